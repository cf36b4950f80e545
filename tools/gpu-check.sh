#!/usr/bin/env bash
# Runs on the GPU machine (which has the NVIDIA driver, PyTorch and no Rust) over the binaries
# tools/gpu-build.sh made, in a few minutes: the GPU's identity, the engine's CUDA unit tests, the
# device checks of tests/cuda_device.rs (CUDA vs CPU logits, speculative = incremental on the
# device, tree attention vs its reference), then the figures: kernel times, matmul GB/s, decode
# tok/s, and PyTorch's scaled_dot_product_attention on the same tree-attention shapes.
# Every figure line starts with FIGURE; the exit status is the checks' (figures never fail).
set -uo pipefail
cd "$(dirname "$0")/.."
dir="${1:-gpu-out}"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv,noheader || true
echo "== engine unit tests (backend::cuda)"
"$dir/engine_lib" backend::cuda --test-threads=1 || status=1
echo "== device checks"
"$dir/cuda_device" --test-threads=1 --nocapture || status=1
echo "== figures"
"$dir/cuda_device" --ignored gpu_figures --test-threads=1 --nocapture || true
python3 tools/sdpa_bench.py || true
exit $status
