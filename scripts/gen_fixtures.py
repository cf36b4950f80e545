#!/usr/bin/env python3
"""Generate llama.cpp reference fixtures for Arbor's tokenizer and forward-pass tests.

Uses llama-cpp-python (the llama.cpp it bundles is the reference implementation):

* tests/fixtures/tokenize_smollm2.json, tokenize_qwen2.json
    token ids for a list of test strings, with and without special-token parsing,
    plus the detokenized bytes, the end-of-generation / control id sets and a
    sample of token pieces.
* tests/fixtures/greedy_smollm2.json (+ greedy_smollm2_logits_<i>.f32)
* tests/fixtures/greedy_qwen15.json (+ greedy_qwen15_logits_<i>.f32)
    greedy decoding (argmax, no EOS stop; the prompt in one batch, then one token per
    step) with the top-2 and top-8 logits of every step and the full logits row of the
    last prompt position (little-endian f32); and llama.cpp's own noise: the same model
    with an f32 instead of the default f16 KV cache, teacher-forced along that greedy
    path, per step (kv_f32_argmax, kv_f32_top8_logits: its logits of the f16 run's
    top-8 ids, kv_f32_centered_diff: [mean, max] centered |d logit| over the vocabulary)
    and aggregated in kv_f32_noise (printed too).

Usage: python3 scripts/gen_fixtures.py [--models-dir DIR] [--out tests/fixtures]
       [--only tokenize|greedy|greedy-smollm2|greedy-qwen15]
Models default to $ARBOR_HOME/models (ARBOR_HOME defaults to ~/.cache/arbor).
"""

import argparse
import ctypes
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

import llama_cpp
from llama_cpp import Llama

SMOLLM2 = "smollm2-135m.gguf"
QWEN_TOKENIZER = "qwen2.5-coder-0.5b.gguf"  # same tokenizer as the 1.5b; the tests fetch only the 0.5b
QWEN15 = "qwen2.5-coder-1.5b.gguf"

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Strings for the tokenizer fixtures. Each one is tokenized by both vocabularies.
TEXTS = [
    # ASCII prose
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "In 1492, Columbus sailed the ocean blue. It took him 70 days!",
    "Once upon a time, there was a little robot who loved to read books about the stars.",
    # leading / trailing / repeated spaces, whitespace only
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple   spaces   between   words",
    "word  \n  next",
    " ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \n",
    "\r\n",
    "\r",
    "",
    # code with tabs, runs of spaces, newlines, CRLF
    "def foo(x):\n    return x * 2\n",
    "if (a) {\n\tb();\n}\r\n",
    "tabs\tand\t\ttabs\t\t\t!",
    "line1\r\nline2\r\n\r\nline4",
    "fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    "class Foo:\n        def __init__(self):\n                self.x = 1\n\n\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}",
    "a \t b\n \n c",
    "x = [1, 2, 3]  # comment\n        y = {'k': None}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "# Title\n\n- item 1\n- item 2\n\n```rust\nfn main() {}\n```\n",
    "camelCaseIdentifier and snake_case_identifier and SCREAMING_CASE",
    "____init____",
    "https://example.com/path/to/page?query=1&x=y#frag",
    "user.name+tag@example.co.uk",
    # numbers
    "12345678901234567890",
    "3.14159 and 2.71828",
    "1,234,567",
    "Version 1.2.3-beta+build.456",
    "abc123def456",
    "9" * 100,
    "$100 \u20ac200 \u00a3300 \u00a5400",
    # contractions
    "I'm sure it's fine, you're right, we'll see, they've gone, I'd go, don't.",
    "I'LL SHOUT IT'S LOUD, YOU'RE WE'VE I'D I'M",
    "'s 're 'LL 'Ve 'd 'M 't",
    "rock'n'roll 'quoted' words''",
    # CJK, Japanese, Korean, other scripts
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002",
    "\u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\u3002\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3001\u6f22\u5b57\u3002",
    "\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "Hello\u4e16\u754c123\u3053\u3093\u306b\u3061\u306f",
    # emoji: plain, ZWJ sequences, flags, skin tones, variation selectors, keycaps
    "\U0001f600\U0001f603\U0001f604",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 family",
    "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5\U0001f1eb\U0001f1f7",
    "\U0001f44d\U0001f3fd ok",
    "I \u2764\ufe0f Rust",
    "1\ufe0f\u20e3 keycap",
    "\U0001f3f3\ufe0f\u200d\U0001f308",
    # combining marks, NFC vs NFD
    "e\u0301",
    "caf\u00e9",
    "cafe\u0301",
    "\u00c5ngstr\u00f6m",
    "A\u030angstro\u0308m",
    "\u00dcn\u00efc\u00f6d\u00e9",
    # unicode whitespace / format / odd code points
    "a\u00a0b",
    "a\u3000b\u3000",
    "a\u0085b",
    "a\u200bb",
    "\ufeffhello",
    "\x01\x02\x7f",
    "a\x1c\x1db",
    "\ue000 private",
    "\u0378 unassigned",
    # symbols and numbers of other categories
    "\u2211\u222b\u221a\u221e\u2260\u2264 \u00b1 \u00d7 \u00f7",
    "x\u00b2 + y\u00b3 = \u00bd",
    "\u216b and \u2163",
    "\uff11\uff12\uff13 fullwidth",
    "\u0663\u0664\u0665 arabic-indic",
    "!!!???...,,,;;;",
    "Hello!!! How are you???",
    "\u201csmart quotes\u201d and \u2018single\u2019",
    # special-token text
    "<|endoftext|>",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>",
    "text<|im_end|>more",
    " <|im_start|> spaced <|im_end|> ",
    "<|",
    "<|im_start",
    "|>",
    "<|im_end|",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
    "<repo_name>arbor<file_sep>main.rs",
    "[PAD151665]",
    # long word
    "supercalifragilisticexpialidocious" * 8,
    "a" * 300,
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
]


def tokenize_fixture(model_path: Path, out_path: Path) -> None:
    llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llm.n_vocab()

    buf = ctypes.create_string_buffer(4096)

    def piece(tok: int, special: bool) -> bytes:
        n = llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, special)
        assert 0 <= n <= len(buf), (tok, n)
        return bytes(buf.raw[:n])

    def detok(ids, special: bool) -> bytes:
        return b"".join(piece(t, special) for t in ids)

    cases = []
    seen = set()
    for text in TEXTS:
        if text in seen:
            raise SystemExit(f"duplicate test string: {text!r}")
        seen.add(text)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        ids_plain = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_plain": ids_plain,
                # llama_token_to_piece(special=true) of every id of `ids`, concatenated
                "detok_hex": detok(ids, True).hex(),
                # llama_token_to_piece(special=false) of every id of `ids`, concatenated
                "detok_plain_hex": detok(ids, False).hex(),
            }
        )

    eog_ids = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    control_ids = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_control(vocab, i)]
    # a sample of token pieces (special=true): every 97th id plus the first/last 300 ids
    sample = sorted(set(range(0, n_vocab, 97)) | set(range(300)) | set(range(n_vocab - 300, n_vocab)))
    pieces = [[i, piece(i, True).hex()] for i in sample]

    doc = {
        "model": model_path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "n_vocab": n_vocab,
        "bos": llm.token_bos(),
        "eos": llm.token_eos(),
        "eog_ids": eog_ids,
        "control_ids": control_ids,
        "pieces_hex": pieces,
        "cases": cases,
    }
    out_path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out_path} ({len(cases)} cases)")


def chatml(system: str, user: str) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n"
        f"<|im_start|>assistant\n"
    )


SMOLLM2_PROMPTS = [
    chatml(SMOLLM2_SYSTEM, "What is the capital of France?"),
    chatml(SMOLLM2_SYSTEM, "Write a haiku about the sea."),
    chatml(SMOLLM2_SYSTEM, "Explain recursion in one sentence."),
    chatml("You are a concise assistant.", "List three primary colors."),
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):\n    ",
    "fn main() {\n    println!(",
    "1, 2, 3, 4, 5,",
    "The meaning of life is",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius and freezes at",
]

QWEN15_PROMPTS = [
    chatml(QWEN_SYSTEM, "Write a Python function that reverses a string."),
    "def quicksort(arr):\n",
    "The three laws of robotics are",
]


def centered_abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| after removing each row's mean (a uniform shift changes no probability)."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return np.abs((a - a.mean()) - (b - b.mean()))


def kv_noise(rows16, rows32, top8):
    """llama.cpp against itself, f16 vs f32 KV cache, at each step of one prompt.

    rows16/rows32: the full logit rows of each step; top8: the f16 run's 8 best ids per step.
    Returns the per-step record fields (the f32 run's argmax, its logits of the f16 top-8 ids,
    the centered |d logit| mean and max over the vocabulary)."""
    argmax32, top8_32, diff = [], [], []
    for r16, r32, ids in zip(rows16, rows32, top8):
        d = centered_abs_diff(r16, r32)
        argmax32.append(int(np.argmax(r32)))
        top8_32.append([float(r32[t]) for t in ids])
        diff.append([float(d.mean()), float(d.max())])
    return {"kv_f32_argmax": argmax32, "kv_f32_top8_logits": top8_32, "kv_f32_centered_diff": diff}


def quantile(values, q: float) -> float:
    """The q quantile of values, nearest rank (as tests/llamacpp_greedy.rs computes it)."""
    v = sorted(values)
    return v[min(max(math.ceil(q * len(v)), 1), len(v)) - 1]


def noise_summary(records):
    """Aggregate llama.cpp's f16-vs-f32 KV noise over every step of every prompt.

    gap shift of a step: max over the f16 run's top-8 ids t of
    |(l[top1] - l[t]) under f16 - (l[top1] - l[t]) under f32|, the amount the KV precision moved
    a near-top token's distance from the winner."""
    steps = flips = 0
    flip_gaps, shifts, top2_shifts = [], [], []
    step_mean = step_max = 0.0
    for r in records:
        for s, (top, l32, a32, (mean, mx)) in enumerate(
            zip(r["step_top8"], r["kv_f32_top8_logits"], r["kv_f32_argmax"], r["kv_f32_centered_diff"])
        ):
            steps += 1
            g16 = [top[0][1] - l for _, l in top]
            g32 = [l32[0] - l for l in l32]
            sh = [abs(a - b) for a, b in zip(g16, g32)]
            shifts.append(max(sh))
            top2_shifts.append(sh[1])
            step_mean, step_max = max(step_mean, mean), max(step_max, mx)
            if a32 != top[0][0]:
                flips += 1
                # the larger of the two runs' gaps between their picks
                j = next((j for j, (t, _) in enumerate(top) if t == a32), None)
                gap = None if j is None else max(top[0][1] - top[j][1], l32[j] - l32[0])
                flip_gaps.append(gap)
                print(f"    f16/f32 flip: prompt {r['prompt'][-30:]!r} step {s}: gap between the picks {gap}")
    last = [r["kv_f32_centered_diff"][0] for r in records]
    known = [g for g in flip_gaps if g is not None]
    return {
        "steps": steps,
        "argmax_flips": flips,
        # at those steps, the largest gap between the two picks, in either run's logits
        "max_gap_at_flip": max(known) if known else 0.0,
        "flips_outside_top8": len(flip_gaps) - len(known),
        # gap shift (see above) over the steps: largest, 95th percentile, mean; then the same of the
        # top-2 gap alone
        "max_gap_shift": max(shifts),
        "p95_gap_shift": quantile(shifts, 0.95),
        "mean_gap_shift": float(np.mean(shifts)),
        "max_top2_gap_shift": max(top2_shifts),
        "p95_top2_gap_shift": quantile(top2_shifts, 0.95),
        # the last prompt position's logits (step 0): worst prompt's centered |d| mean and max
        "last_logits_max_mean_abs": max(m for m, _ in last),
        "last_logits_max_abs": max(x for _, x in last),
        # every step's logits, worst step
        "steps_max_mean_abs": step_mean,
        "steps_max_abs": step_max,
    }


def greedy_fixture(model_path: Path, prompts, n_gen: int, out_dir: Path, stem: str) -> None:
    def load(**kv):
        return Llama(
            model_path=str(model_path),
            n_ctx=512,
            n_threads=2,
            n_batch=512,
            logits_all=True,
            seed=0,
            verbose=False,
            **kv,
        )

    llm = load()  # default KV cache: f16, the reference
    # The same model with an f32 KV cache: llama.cpp's own noise from one rounding choice.
    f32 = getattr(llama_cpp, "GGML_TYPE_F32", 0)
    llm32 = load(type_k=f32, type_v=f32)
    n_vocab = llm.n_vocab()
    records = []
    for i, prompt in enumerate(prompts):
        llm.reset()
        prompt_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.eval(prompt_ids)
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        assert last.shape == (n_vocab,)
        logits_file = f"{stem}_logits_{i}.f32"
        last.astype("<f4").tofile(out_dir / logits_file)

        greedy_ids = []
        step_top2 = []
        step_top8 = []
        rows16 = []
        logits = last
        for s in range(n_gen):
            rows16.append(logits)
            order = np.argsort(-logits, kind="stable")
            t1, t2 = int(order[0]), int(order[1])
            assert t1 == int(np.argmax(logits))
            step_top2.append([t1, float(logits[t1]), t2, float(logits[t2])])
            step_top8.append([[int(t), float(logits[t])] for t in order[:8]])
            greedy_ids.append(t1)
            if s + 1 < n_gen:
                llm.eval([t1])
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)

        # f32 KV cache, teacher-forced along the f16 run's greedy path (prompt in one batch, then
        # one token per step, as above), so each step sees the same tokens.
        llm32.reset()
        llm32.eval(prompt_ids)
        rows32 = [np.array(llm32.scores[llm32.n_tokens - 1], dtype=np.float32)]
        for t in greedy_ids[:-1]:
            llm32.eval([t])
            rows32.append(np.array(llm32.scores[llm32.n_tokens - 1], dtype=np.float32))

        rec = {
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "greedy_ids": greedy_ids,
            "greedy_text": llm.detokenize(greedy_ids, special=True).decode("utf-8", "replace"),
            "step_top2": step_top2,
            "step_top8": step_top8,
            "last_logits_file": logits_file,
        }
        rec.update(kv_noise(rows16, rows32, [[t for t, _ in top] for top in step_top8]))
        records.append(rec)
        print(f"  {stem}[{i}] {len(prompt_ids)} prompt tokens -> {greedy_ids[:8]}...")

    noise = noise_summary(records)
    print(f"  llama.cpp f16 vs f32 KV noise: {json.dumps(noise)}")
    doc = {
        "model": model_path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "n_vocab": n_vocab,
        "settings": {
            "n_ctx": 512,
            "n_threads": 2,
            "n_batch": 512,
            "logits_all": True,
            "seed": 0,
            "n_gen": n_gen,
            "add_bos": False,
            "special": True,
        },
        # llama.cpp with an f32 instead of f16 KV cache, teacher-forced along the same greedy
        # paths: the per-step fields kv_f32_* of each prompt, aggregated (see noise_summary).
        "kv_f32_noise": noise,
        "prompts": records,
    }
    out = out_dir / f"{stem}.json"
    out.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")


def main() -> int:
    home = Path(os.environ.get("ARBOR_HOME", Path.home() / ".cache" / "arbor"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", type=Path, default=home / "models")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests" / "fixtures")
    ap.add_argument(
        "--only", choices=["tokenize", "greedy", "greedy-smollm2", "greedy-qwen15"], default=None
    )
    args = ap.parse_args()

    jobs = {
        "tokenize": [SMOLLM2, QWEN_TOKENIZER],
        "greedy-smollm2": [SMOLLM2],
        "greedy-qwen15": [QWEN15],
    }
    want = [j for j in jobs if args.only in (None, j) or (args.only == "greedy" and j.startswith("greedy"))]
    args.out.mkdir(parents=True, exist_ok=True)
    for name in sorted({m for j in want for m in jobs[j]}):
        if not (args.models_dir / name).exists():
            print(f"missing model {args.models_dir / name} (run `arbor models fetch`)", file=sys.stderr)
            return 1

    if "tokenize" in want:
        tokenize_fixture(args.models_dir / SMOLLM2, args.out / "tokenize_smollm2.json")
        tokenize_fixture(args.models_dir / QWEN_TOKENIZER, args.out / "tokenize_qwen2.json")
    if "greedy-smollm2" in want:
        greedy_fixture(args.models_dir / SMOLLM2, SMOLLM2_PROMPTS, 32, args.out, "greedy_smollm2")
    if "greedy-qwen15" in want:
        greedy_fixture(args.models_dir / QWEN15, QWEN15_PROMPTS, 16, args.out, "greedy_qwen15")
    return 0


if __name__ == "__main__":
    sys.exit(main())
