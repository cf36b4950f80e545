"""PyTorch scaled_dot_product_attention on the tree-attention shapes of tests/cuda_device.rs's
gpu_figures (qwen2.5-coder-1.5b heads: 12 query over 2 KV heads, head_dim 128; a 64-node random
tree after 1,024 committed slots; 1 and 32 sequences), with the same kind of boolean mask, f16.
Prints FIGURE lines; run by tools/gpu-check.sh."""
import torch
import torch.nn.functional as F

torch.manual_seed(1)
dev = "cuda"
n_head, n_kv, hd, past, new = 12, 2, 128, 1024, 64
for n_seq in (1, 32):
    parents = [None] + [int(torch.randint(0, i, (1,))) for i in range(1, new)]
    allowed = torch.zeros(new, past + new, dtype=torch.bool)
    allowed[:, :past] = True
    for i in range(new):
        j = i
        while j is not None:
            allowed[i, past + j] = True
            j = parents[j]
    q = torch.randn(n_seq, n_head, new, hd, device=dev, dtype=torch.float16)
    k = torch.randn(n_seq, n_kv, past + new, hd, device=dev, dtype=torch.float16)
    v = torch.randn(n_seq, n_kv, past + new, hd, device=dev, dtype=torch.float16)
    # SDPA has no grouped-query heads in every version: repeat K/V per query group.
    kr = k.repeat_interleave(n_head // n_kv, dim=1)
    vr = v.repeat_interleave(n_head // n_kv, dim=1)
    mask = allowed.to(dev)
    for _ in range(5):
        F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 50
    for _ in range(reps):
        F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1000 / reps
    print(f"FIGURE sdpa seqs={n_seq} heads=12/2 hd=128 past={past} tree={new}: {us:.1f} us "
          f"(torch {torch.__version__}, K/V repeated per group, bool mask)")
