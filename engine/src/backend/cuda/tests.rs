//! Host-side checks of the GPU path that need no GPU: device selection errors, and the attention
//! launch plan (block tables, masks, row maps) against the CPU backend's attention.

use half::f16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;
use crate::backend::{AttentionShape, AttnSeq, Backend, BatchMask, CpuBackend, KvLayer};
use crate::kv::{KvCache, KvPool, BLOCK_SLOTS};
use crate::model::SeqBatch;
use crate::tree::TreeMask;

#[test]
fn devices_parse_and_report_stable_errors() {
    assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
    assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
    for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
        let e = bad.parse::<Device>().unwrap_err();
        assert_eq!(e.error_type(), "invalid_argument", "{bad}");
    }
    assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    assert!(check_device(Device::Cpu).is_ok());
    match check_device(Device::Cuda(0)) {
        Ok(()) => assert!(is_compiled(), "a CUDA device without the cuda feature"),
        Err(e) if !is_compiled() => assert_eq!(e.error_type(), "not_compiled_with_cuda"),
        Err(e) => {
            assert_eq!(e.error_type(), "no_cuda_device");
            eprintln!("no CUDA device here: {e}");
        }
    }
    // A device number past the driver's count is never usable.
    let e = check_device(Device::Cuda(1 << 20)).unwrap_err();
    let want = if is_compiled() {
        "no_cuda_device"
    } else {
        "not_compiled_with_cuda"
    };
    assert_eq!(e.error_type(), want);
    assert!(kernel_names().contains(&"tree_attention_f16"));
}

#[test]
fn kernel_block_size_is_the_pools() {
    assert_eq!(arbor_kernels_gpu::plan::BLOCK_SLOTS, BLOCK_SLOTS);
}

/// A random tree over `n` nodes as parent links (each parent precedes its child).
fn random_parents(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<Option<usize>> {
    (0..n)
        .map(|i| {
            if i == 0 {
                None
            } else {
                Some(rng.gen_range(0..i))
            }
        })
        .collect()
}

/// The attention plan the kernel reads, interpreted on the CPU, agrees with the CPU backend on
/// ragged batches of decode rows, causal chunks and token trees (up to 70 nodes: two mask words),
/// grouped-query heads and shuffled block tables.
#[test]
fn attention_plan_matches_cpu_attention_on_ragged_trees() {
    let backend = CpuBackend::new(2).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (case, &(n_head, n_head_kv, hd)) in [(4, 2, 64), (6, 1, 32), (8, 8, 128), (9, 3, 64)]
        .iter()
        .enumerate()
    {
        let kv_dim = n_head_kv * hd;
        let width = n_head * hd;
        let pool_blocks = 64;
        let pool_rows = pool_blocks * BLOCK_SLOTS;
        let k: Vec<f16> = (0..pool_rows * kv_dim)
            .map(|_| f16::from_f32(rng.gen_range(-1.0..1.0)))
            .collect();
        let v: Vec<f16> = (0..pool_rows * kv_dim)
            .map(|_| f16::from_f32(rng.gen_range(-1.0..1.0)))
            .collect();
        let mut free: Vec<u32> = (0..pool_blocks as u32).collect();
        free.shuffle(&mut rng);
        // (n_past, n_new, tree?) per sequence.
        let shapes: [(usize, usize, bool); 5] = [
            (37, 1, false),
            (0, 20, false),
            (50, 70, true),
            (16, 9, true),
            (5, 3, false),
        ];
        let mut tables = Vec::new();
        let mut masks = Vec::new();
        for &(n_past, n_new, tree) in &shapes {
            let used = (n_past + n_new).div_ceil(BLOCK_SLOTS);
            tables.push(free.split_off(free.len() - used));
            masks.push(tree.then(|| TreeMask::from_parents(&random_parents(&mut rng, n_new))));
        }
        let n_rows: usize = shapes.iter().map(|s| s.1).sum();
        let q: Vec<f32> = (0..n_rows * width)
            .map(|_| rng.gen_range(-2.0..2.0))
            .collect();
        let mut seq_rows = Vec::new();
        let mut attn = Vec::new();
        let mut row0 = 0;
        for (i, &(n_past, n_new, _)) in shapes.iter().enumerate() {
            let (mask, seq_mask) = match &masks[i] {
                Some(m) => {
                    let BatchMask::Bits {
                        words_per_row,
                        bits,
                    } = m.as_batch_mask()
                    else {
                        unreachable!()
                    };
                    (
                        m.as_batch_mask(),
                        SeqMask::Bits {
                            words_per_row,
                            bits,
                        },
                    )
                }
                None => (BatchMask::Causal, SeqMask::Causal),
            };
            seq_rows.push(SeqRows {
                n_past,
                n_new,
                blocks: &tables[i],
                mask: seq_mask,
            });
            attn.push(AttnSeq {
                shape: AttentionShape {
                    n_tok: n_new,
                    n_past,
                    n_head,
                    n_head_kv,
                    head_dim: hd,
                },
                mask,
                kv: KvLayer {
                    k: &k,
                    v: &v,
                    blocks: &tables[i],
                },
                row0,
            });
            row0 += n_new;
        }
        let mut want = vec![0.0f32; q.len()];
        backend.attention_batch(&attn, &q, &mut want).unwrap();
        let plan = AttentionPlan::new(&seq_rows, n_head, n_head_kv, hd, pool_rows).unwrap();
        let kf: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
        let vf: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
        let got = plan.reference(&q, &kf, &vf);
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        // The CPU rounds probabilities to f16 (llama.cpp's f16 attention); the plan keeps f32.
        assert!(worst < 2e-3, "case {case}: worst difference {worst}");
        // The pool rows new K/V go to: each new token's slot through its own block table.
        let rows = plan.new_pool_rows();
        let mut r = 0;
        for (i, &(n_past, n_new, _)) in shapes.iter().enumerate() {
            for t in 0..n_new {
                let s = n_past + t;
                let want_row = tables[i][s / BLOCK_SLOTS] as usize * BLOCK_SLOTS + s % BLOCK_SLOTS;
                assert_eq!(rows[r] as usize, want_row);
                r += 1;
            }
        }
    }
}

/// Breaking the plan's mask packing must break the agreement (the test above can fail).
#[test]
fn attention_plan_mask_is_what_decides() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (n_head, n_head_kv, hd) = (2, 1, 32);
    let kv_dim = n_head_kv * hd;
    let pool_rows = 4 * BLOCK_SLOTS;
    let k: Vec<f32> = (0..pool_rows * kv_dim)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let v: Vec<f32> = (0..pool_rows * kv_dim)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let q: Vec<f32> = (0..3 * n_head * hd)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let chain = [0b001u64, 0b011, 0b111];
    let fork = [0b001u64, 0b011, 0b101];
    let run = |bits: &[u64]| {
        let seq = SeqRows {
            n_past: 10,
            n_new: 3,
            blocks: &[2],
            mask: SeqMask::Bits {
                words_per_row: 1,
                bits,
            },
        };
        AttentionPlan::new(&[seq], n_head, n_head_kv, hd, pool_rows)
            .unwrap()
            .reference(&q, &k, &v)
    };
    let (a, b) = (run(&chain), run(&fork));
    let w = n_head * hd;
    assert_eq!(a[..2 * w], b[..2 * w], "rows 0 and 1 see the same slots");
    assert_ne!(
        a[2 * w..],
        b[2 * w..],
        "row 2 sees node 1 only in the chain"
    );
}

/// A tiny random model the device kernels can run (head_dim 32).
fn device_shaped(arch: &'static str) -> crate::Model {
    let spec = crate::testing::TinySpec {
        arch,
        n_layers: 2,
        n_embd: 128,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 256,
        vocab: 512,
        context: 1024,
        weight_type: crate::quant::GgmlType::Q8_0,
        separate_output: arch == "qwen2",
    };
    crate::testing::tiny_model(&spec, 21).unwrap()
}

/// The device forward pass (on the kernels' host reference) against the CPU forward pass,
/// teacher-forced over a prompt in one causal pass: logits close (the device multiplies f16
/// weights with f32 activations, the CPU quantizes activations), picks equal except at near ties.
#[test]
fn device_model_on_host_matches_cpu_forward() {
    for arch in ["llama", "qwen2"] {
        let model = device_shaped(arch);
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let toks: Vec<u32> = (0..40)
            .map(|_| rng.gen_range(0..model.config.vocab_size as u32))
            .collect();
        let dev = DeviceModel::on_host(&model, 8).unwrap();
        let a = check::logits_against_cpu(&model, &dev, &toks).unwrap();
        eprintln!("{arch}: {a:?}");
        // Measured: llama 0.087 of logits up to 3.7 (2 flips at gaps under 0.03), qwen2 0.076;
        // a wrong RoPE pairing gives 3.9 and 35 flips, skipping qwen2's biases 3.6 and 26 flips.
        assert!(a.worst_diff < 0.25, "{arch}: {a:?}");
        assert!(
            a.worst_flip_gap < 0.1 && a.flips * 10 <= a.rows,
            "{arch}: {a:?}"
        );
    }
}

/// Speculative greedy decoding on the device model equals its incremental decoding, token for
/// token, with prompt lookup and with trees whose accepted paths must be moved; every block goes
/// back to the pool.
#[test]
fn device_model_speculative_equals_incremental() {
    for arch in ["llama", "qwen2"] {
        let model = device_shaped(arch);
        let vocab = model.config.vocab_size as u32;
        let dev = DeviceModel::on_host(&model, 32).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let mut prompt: Vec<u32> = (0..30).map(|_| rng.gen_range(0..vocab)).collect();
        prompt.extend(prompt.clone());
        let n = 50;
        let runs = check::greedy_runs(&dev, &prompt, n, 5).unwrap();
        let base = &runs.incremental;
        assert_eq!((base.tokens.len(), base.passes), (n, n));
        assert_eq!(runs.ngram.tokens, base.tokens, "{arch}: ngram");
        assert_eq!(
            runs.trees.tokens, base.tokens,
            "{arch}: sibling-first trees"
        );
        assert!(
            runs.trees.passes * 2 < n,
            "{arch}: {} passes",
            runs.trees.passes
        );
        assert_eq!(
            dev.free_blocks(),
            32,
            "{arch}: every block back in the pool"
        );
    }
}

/// A forked sequence (a clone sharing its blocks) that writes into a shared, partly filled block
/// gets a copy of it on the host (copy-on-write) and, through `DeviceForward`, on the device too:
/// the fork's next row equals that row computed from scratch, bit for bit, and the original
/// sequence still sees its own rows.
#[test]
fn device_forward_copies_shared_blocks_before_writing() {
    let model = device_shaped("llama");
    let dev = DeviceModel::on_host(&model, 16).unwrap();
    let pool = KvPool::new(&model.config, model.config.n_layers, 16);
    let vocab = model.config.vocab_size as u32;
    let toks: Vec<u32> = (0..22).map(|i| (i * 37 + 5) % vocab).collect();
    // The original: 20 tokens (block 1 holds 4 of them), then the fork shares both blocks.
    let last_row = |cache: &mut KvCache, tokens: &[u32]| last_row(&dev, cache, tokens, None);
    let mut a = KvCache::in_pool(&pool, 64);
    last_row(&mut a, &toks[..20]);
    let mut b = a.clone();
    let got_b = last_row(&mut b, &toks[20..21]);
    assert_ne!(
        a.blocks()[1],
        b.blocks()[1],
        "the fork's write copied the shared block"
    );
    let got_a = last_row(&mut a, &toks[20..22]);
    let mut fresh = KvCache::in_pool(&pool, 64);
    let want_b = last_row(&mut fresh, &toks[..21]);
    let mut fresh = KvCache::in_pool(&pool, 64);
    let want_a = last_row(&mut fresh, &toks[..22]);
    assert_eq!(got_b, want_b);
    assert_eq!(got_a, want_a);
}

/// One pass of `tokens` after `cache` through `DeviceForward` (causal, or `tree` with its
/// positions): the last row's logits.
fn last_row(
    dev: &dyn DeviceForward,
    cache: &mut KvCache,
    tokens: &[u32],
    tree: Option<(&TreeMask, &[usize])>,
) -> Vec<f32> {
    let n = cache.len();
    let causal: Vec<usize> = (n..n + tokens.len()).collect();
    let rows = [tokens.len() - 1];
    let mut batch = [SeqBatch {
        cache,
        tokens,
        positions: tree.map_or(&causal[..], |t| t.1),
        mask: tree.map_or(BatchMask::Causal, |t| t.0.as_batch_mask()),
        logit_rows: &rows,
    }];
    dev.forward_batch(&mut batch).unwrap().pop().unwrap()
}

/// A tree pass whose accepted node is not the first row: `DeviceForward::commit_rows` moves its
/// K/V on the device as the host moves its bookkeeping, so the next token's logits are the bits
/// of the same tokens decoded from scratch.
#[test]
fn device_forward_commit_moves_rows_on_the_device() {
    let model = device_shaped("qwen2");
    let dev = DeviceModel::on_host(&model, 16).unwrap();
    let pool = KvPool::new(&model.config, model.config.n_layers, 16);
    let vocab = model.config.vocab_size as u32;
    let toks: Vec<u32> = (0..23).map(|i| (i * 41 + 7) % vocab).collect();
    let mut a = KvCache::in_pool(&pool, 64);
    last_row(&dev, &mut a, &toks[..20], None);
    // Root toks[20], two wrong children, then the true child toks[21] (rows 0..4).
    let (w1, w2) = ((toks[21] + 1) % vocab, (toks[21] + 2) % vocab);
    let tree = TreeMask::from_parents(&[None, Some(0), Some(0), Some(0)]);
    last_row(
        &dev,
        &mut a,
        &[toks[20], w1, w2, toks[21]],
        Some((&tree, &[20, 21, 21, 21])),
    );
    dev.commit_rows(&mut a, 20, &[0, 3]).unwrap();
    assert_eq!(a.len(), 22);
    let got = last_row(&dev, &mut a, &toks[22..23], None);
    let mut fresh = KvCache::in_pool(&pool, 64);
    let want = last_row(&dev, &mut fresh, &toks[..23], None);
    assert_eq!(got, want);
    assert!(dev.commit_rows(&mut a, 20, &[1, 1]).is_err());
}

/// The per-kernel harness the GPU check compares `CudaOps` with: on the host reference it runs
/// every kernel, its edge cases come out as the kernels' contracts say, and two runs agree.
#[test]
fn kernel_outputs_cover_every_kernel() {
    let a = check::kernel_outputs(&HostOps).unwrap();
    let mut names: Vec<&str> = a.iter().map(|k| k.0).collect();
    names.dedup();
    let mut modules = kernel_names();
    modules.retain(|m| !names.contains(m));
    assert!(modules.is_empty(), "kernels not covered: {modules:?}");
    let get = |n: &str| &a.iter().find(|k| k.0 == n).unwrap().1;
    assert_eq!(get("argmax_f32"), &vec![17.0, 500.0, 0.0]);
    assert!(get("embed_rows_f16")[80..120].iter().all(|&x| x == 0.0));
    let b = check::kernel_outputs(&HostOps).unwrap();
    for (name, worst, _) in check::kernel_differences(&a, &b) {
        assert_eq!(worst, 0.0, "{name}");
    }
}
