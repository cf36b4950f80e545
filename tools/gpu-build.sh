#!/usr/bin/env bash
# Builds the GPU checks here (x86-64, no GPU, no CUDA toolkit) for tools/gpu-check.sh: stripped
# release test binaries with feature `cuda`, linked against the stub driver from
# tools/cuda-stub.sh (on the GPU machine the real libcuda.so.1 loads instead), into gpu-out/
# (git-ignored; carry it to the GPU machine with the working tree).
# Usage: tools/gpu-build.sh            then, on the GPU machine: tools/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
stub="$(tools/cuda-stub.sh)"
export CUDA_LIBRARY_PATH="$PWD/$stub"
out=gpu-out
rm -rf "$out"
mkdir -p "$out"

# The executables a `cargo test --no-run` builds, one per line.
executables() {
  cargo test --release --no-run --message-format=json "$@" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])
'
}

cp "$(executables --features cuda --test cuda_device | tail -1)" "$out/cuda_device"
cp "$(executables -p arbor-engine --features cuda --lib | tail -1)" "$out/engine_lib"
strip "$out"/*
ls -l "$out"
du -sh "$out"
