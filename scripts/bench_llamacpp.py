#!/usr/bin/env python3
"""Baseline CPU speed of llama.cpp (through llama-cpp-python) for Arbor's benchmarks.

Prints one JSON object:
  prefill_tok_s    256-token prompt evaluated in one llm.eval (median of --reps runs)
  decode_tok_s     128 greedy tokens, one llm.eval per token, after that prompt
  forward_ms       {"1","4","16","64"}: one llm.eval of N new tokens on top of a
                   256-token context (KV truncated back to 256 before every run, median)
  llama_cpp_python version, model, threads and the settings used.

Only the last position's logits are computed (logits_all=False), as in llama.cpp's
own benchmarks; --all-logits adds forward_all_logits_ms, the same forwards with logits
for every new token (what verifying a speculated tree needs).

Usage: python3 scripts/bench_llamacpp.py --model PATH [--threads 2] [--reps 5]
"""

import argparse
import ctypes
import json
import statistics
import sys
import time

import numpy as np

import llama_cpp
from llama_cpp import Llama

CONTEXT = 256
N_DECODE = 128
FORWARD_SIZES = (1, 4, 16, 64)

FILLER = (
    "Arbor is an inference engine for small language models. It reads GGUF files, "
    "runs the transformer on the CPU with quantized kernels and serves requests. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "The quick brown fox jumps over the lazy dog; 0123456789 times, again and again. "
)


def make_tokens(llm: Llama, n: int) -> list:
    ids = llm.tokenize(FILLER.encode("utf-8"), add_bos=False, special=False)
    out = []
    while len(out) < n:
        out.extend(ids)
    return out[:n]


def last_logits(llm: Llama) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(llm.n_vocab(),))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def forward_ms(llm: Llama, prompt: list, extra: list, reps: int) -> dict:
    llm.reset()
    llm.eval(prompt)
    out = {}
    for n in FORWARD_SIZES:
        times = []
        for _ in range(reps + 1):  # the first run warms up
            llm.n_tokens = CONTEXT  # eval() drops the KV cache beyond n_tokens
            times.append(timed(lambda: llm.eval(extra[:n])))
        out[str(n)] = round(statistics.median(times[1:]) * 1e3, 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median)")
    ap.add_argument("--all-logits", action="store_true", help="also time forwards with logits for every token")
    args = ap.parse_args()

    n_ctx = CONTEXT + N_DECODE + max(FORWARD_SIZES)
    common = dict(
        model_path=args.model,
        n_ctx=n_ctx,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        seed=0,
        verbose=False,
    )
    llm = Llama(logits_all=False, **common)
    prompt = make_tokens(llm, CONTEXT)
    extra = make_tokens(llm, CONTEXT + max(FORWARD_SIZES))[CONTEXT:]

    # warm-up (page in the weights, build the graphs)
    llm.reset()
    llm.eval(prompt[:32])

    # prefill
    prefill = []
    for _ in range(max(1, args.reps // 2)):
        llm.reset()
        prefill.append(timed(lambda: llm.eval(prompt)))
    prefill_s = statistics.median(prefill)

    # decode: greedy, one token per eval, after the 256-token prompt
    llm.reset()
    llm.eval(prompt)
    t0 = time.perf_counter()
    for _ in range(N_DECODE):
        tok = int(np.argmax(last_logits(llm)))
        llm.eval([tok])
    decode_s = time.perf_counter() - t0

    result = {
        "model": args.model,
        "llama_cpp_python": llama_cpp.__version__,
        "threads": args.threads,
        "prefill_tokens": CONTEXT,
        "prefill_tok_s": round(CONTEXT / prefill_s, 2),
        "decode_tokens": N_DECODE,
        "decode_tok_s": round(N_DECODE / decode_s, 2),
        "forward_context": CONTEXT,
        "forward_ms": forward_ms(llm, prompt, extra, args.reps),
        "reps": args.reps,
    }

    if args.all_logits:
        del llm
        llm_all = Llama(logits_all=True, **common)
        result["forward_all_logits_ms"] = forward_ms(llm_all, prompt, extra, args.reps)

    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
