#!/usr/bin/env bash
# Continuous batching side by side with llama.cpp: `arbor bench batch` (none / fixed / adaptive
# speculation) and llama.cpp's own C++ `llama-batched-bench -npp 128 -ntg 64 -npl ... -t THREADS`
# (its S_TG column against our aggregate decode tok/s) on the same GGUF, alternated per round.
#
# Usage: scripts/bench_batch.sh MODEL_NAME [ROUNDS] [THREADS] [CONCURRENCY] [PROMPTS]
#   LLAMA_BIN=DIR   llama.cpp's tools (default: what ../shared/tools/llama-cpp.sh prints, built for this CPU)
#   ARBOR_KERNEL    passed to Arbor (e.g. avx2; pair it with an AVX2-only LLAMA_BIN)
# Prints the CPU, then one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-smollm2-135m}"; rounds="${2:-1}"; threads="${3:-2}"
conc="${4:-1,2,4,8,16,32}"; prompts="${5:-mixed}"
bin=target/release/arbor
[ -x "$bin" ] || cargo build --release
path="$($bin models path "$model")"
llama="${LLAMA_BIN:-$(bash ../shared/tools/llama-cpp.sh bin)}"
echo "{\"cpu\":\"$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')\",\"arbor_kernel\":\"${ARBOR_KERNEL:-auto}\",\"llama_bin\":\"$llama\",\"commit\":\"$(git rev-parse --short HEAD)\"}"
for r in $(seq 1 "$rounds"); do
  echo "{\"engine\":\"arbor\",\"round\":$r,\"result\":$($bin bench batch --model "$model" --threads "$threads" --concurrency "$conc" --prompts "$prompts" --prompt-tokens 128 --tokens 64 --format json)}"
  bb=$("$llama/llama-batched-bench" -m "$path" -t "$threads" -c 16384 -b 2048 -ub 512 -npp 128 -ntg 64 -npl "$conc" --output-format jsonl 2>/dev/null | grep '^{' | paste -sd, -)
  echo "{\"engine\":\"llama-batched-bench\",\"round\":$r,\"result\":[$bb]}"
done
