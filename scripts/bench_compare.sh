#!/usr/bin/env bash
# Interleaved decode / prefill / batched-forward benchmark: Arbor (`arbor bench decode`) against llama.cpp's own C++
# tools on the same GGUF file and thread count: `llama-bench` (decode tg at depth 256, prefill pp256) and
# `llama-batched-bench` (one decode step of 1 and of 16 sequences at context 256).
#
# Usage: scripts/bench_compare.sh MODEL_NAME [ROUNDS] [THREADS]
#   LLAMA_BIN=DIR   llama.cpp's tools (default: what ../shared/tools/llama-cpp.sh prints, built for this CPU)
#   ARBOR_KERNEL    passed to Arbor (e.g. avx2 to force the AVX2 family; pair it with an AVX2-only LLAMA_BIN)
# Prints the CPU and each side's kernels, then one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-smollm2-135m}"; rounds="${2:-3}"; threads="${3:-2}"
bin=target/release/arbor
[ -x "$bin" ] || cargo build --release
path="$($bin models path "$model")"
llama="${LLAMA_BIN:-$(bash ../shared/tools/llama-cpp.sh bin)}"
echo "{\"cpu\":\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')\",\"arbor_kernel\":\"${ARBOR_KERNEL:-auto}\",\"llama_bin\":\"$llama\"}"
for r in $(seq 1 "$rounds"); do
  echo "{\"engine\":\"arbor\",\"round\":$r,\"result\":$($bin bench decode --model "$model" --threads "$threads" --reps 3 --decode-tokens 64 --format json)}"
  # llama-bench: tg64 after a 256-token context, and pp256; its build line names the CPU backend's features.
  lb=$("$llama/llama-bench" -m "$path" -t "$threads" -p 256 -n 64 -d 256 -r 3 -o jsonl 2>/dev/null | grep '^{' | paste -sd, -)
  echo "{\"engine\":\"llama-bench\",\"round\":$r,\"result\":[$lb]}"
  # llama-batched-bench: the cost of one decode step for 1 and 16 sequences after 256 prompt tokens each.
  bb=$("$llama/llama-batched-bench" -m "$path" -t "$threads" -c 8192 -b 2048 -ub 512 -npp 256 -ntg 16 -npl 1,16 --output-format jsonl 2>/dev/null | grep '^{' | paste -sd, -)
  echo "{\"engine\":\"llama-batched-bench\",\"round\":$r,\"result\":[$bb]}"
done
