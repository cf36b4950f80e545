#!/usr/bin/env bash
# Interleaved decode benchmark: arbor vs llama.cpp (llama-cpp-python) on the same GGUF file, same threads.
# Usage: scripts/bench_compare.sh MODEL_NAME [ROUNDS] [THREADS]   (prints one JSON line per run)
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-smollm2-135m}"; rounds="${2:-3}"; threads="${3:-2}"
bin=target/release/arbor
[ -x "$bin" ] || cargo build --release
path="$($bin models path "$model")"
for r in $(seq 1 "$rounds"); do
  echo "{\"engine\":\"arbor\",\"round\":$r,\"result\":$($bin bench decode --model "$model" --threads "$threads" --format json)}"
  echo "{\"engine\":\"llama.cpp\",\"round\":$r,\"result\":$(python3 scripts/bench_llamacpp.py --model "$path" --threads "$threads" --all-logits 2>/dev/null | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))')}"
done
