#!/usr/bin/env bash
# llama.cpp's own speculative decoding on Arbor's speculative-decoding suite, for comparison with
# `arbor bench spec --suite` (docs/benchmarks.md, "llama.cpp speculative decoding").
#
# Usage: scripts/bench_llamacpp_spec.sh [TOKENS] [REPEATS] [THREADS]
#   TOKENS   tokens generated per prompt (default 64)
#   REPEATS  runs of every (config, temperature, prompt); the median is reported (default 2)
#   THREADS  threads for the target and the draft model (-t / -td, default 2)
# Environment:
#   ARBOR_HOME   cache folder (default ~/.cache/arbor); models are read from $ARBOR_HOME/models and
#                llama.cpp is built once under $ARBOR_HOME/llama.cpp-0.3.16
#   LLM, SSM     GGUF paths of the target and the draft model (default qwen2.5-coder-1.5b / -0.5b)
#   DRAFT_MAX    extra --draft-max values swept besides llama.cpp's default (default "4 8")
#   TEMPS        temperatures (default "0 0.7")
#
# What runs, on each of the three SUITE_PROMPTS of tools/src/spec_bench.rs (raw text, no chat
# template), per temperature, interleaved within each repeat:
#   plain        llama-cli, the LLM alone (-no-cnv, same sampler chain as llama-speculative)
#   spec default llama-speculative LLM + SSM with llama.cpp's default draft settings
#                (--draft-max 16, --draft-min 0, --draft-p-min 0.75, one draft sequence)
#   spec dmax=K  the same with --draft-max K, for each K in DRAFT_MAX
# All from one build, so the speedup compares like with like.
#
# Output: one JSON line per (config, temperature, prompt) with the median over repeats (runs that
# ended while another job was running are left out when an undisturbed run exists), then one
# aggregate JSON line per (config, temperature). Logs of every run stay in $WORK/logs.
#
# Needs: python3 with pip (PyPI reachable), a C/C++ compiler, make. No GitHub access needed: the
# llama.cpp source comes from the llama-cpp-python 0.3.16 sdist on PyPI (vendor/llama.cpp).
set -euo pipefail

TOKENS="${1:-64}"
REPEATS="${2:-2}"
THREADS="${3:-2}"
ARBOR_HOME="${ARBOR_HOME:-$HOME/.cache/arbor}"
LLM="${LLM:-$ARBOR_HOME/models/qwen2.5-coder-1.5b.gguf}"
SSM="${SSM:-$ARBOR_HOME/models/qwen2.5-coder-0.5b.gguf}"
DRAFT_MAX="${DRAFT_MAX:-4 8}"
TEMPS="${TEMPS:-0 0.7}"
SEED=42

WORK="$ARBOR_HOME/llama.cpp-0.3.16"
SRC="$WORK/llama_cpp_python-0.3.16/vendor/llama.cpp"
BUILD="$WORK/build"
BIN="$BUILD/bin"
TARGETS=(llama-cli llama-speculative llama-speculative-simple llama-simple)

log() { echo "[bench_llamacpp_spec] $*" >&2; }

# ---------------------------------------------------------------------------------------------
# 1. Build llama.cpp once (skipped when every binary is already there).
# ---------------------------------------------------------------------------------------------
build_llamacpp() {
    local missing=0 t
    for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || missing=1; done
    if [[ $missing == 0 ]]; then
        log "using the cached build in $BUILD"
        return
    fi
    mkdir -p "$WORK"
    # Source: the llama-cpp-python sdist vendors the full llama.cpp tree. Only this package is
    # forced to source (`--no-binary llama-cpp-python`): with `--no-binary :all:` pip also builds
    # the sdist's build requirements (cmake, ninja) from source just to read its metadata.
    if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
        local dl="$WORK/sdist"
        mkdir -p "$dl"
        if ! ls "$dl"/llama_cpp_python-0.3.16.tar.gz >/dev/null 2>&1; then
            log "downloading the llama-cpp-python 0.3.16 sdist from PyPI"
            python3 -m pip download --no-deps --no-binary llama-cpp-python \
                llama-cpp-python==0.3.16 -d "$dl" >&2
        fi
        tar -xzf "$dl/llama_cpp_python-0.3.16.tar.gz" -C "$WORK"
    fi
    # cmake from PyPI when the system has none.
    local cmake_bin
    if command -v cmake >/dev/null 2>&1; then
        cmake_bin="$(command -v cmake)"
    else
        log "installing cmake from PyPI"
        python3 -m pip install --quiet cmake >&2
        cmake_bin="$(python3 -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
    fi
    # CPU build for x86-64 with AVX-512/VNNI/BF16 but AMX off: a native build (GGML_NATIVE) on
    # this VM enables AMX, which the CPU lists but which crashes in `ldtilecfg` (tile state not
    # granted to the process).
    log "configuring llama.cpp ($SRC) with $cmake_bin"
    "$cmake_bin" -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >&2
    log "building ${TARGETS[*]} (-j2, ~10-15 min on 2 cores)"
    "$cmake_bin" --build "$BUILD" --config Release -j2 --target "${TARGETS[@]}" >&2
}

build_llamacpp
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then exit 0; fi

for f in "$LLM" "$SSM"; do
    [[ -f "$f" ]] || { log "missing model $f (arbor models fetch NAME)"; exit 1; }
done

# ---------------------------------------------------------------------------------------------
# 2. The prompts: tools/src/spec_bench.rs::SUITE_PROMPTS verbatim (raw text, no chat template).
#    Written to files without a trailing newline and passed with -f.
# ---------------------------------------------------------------------------------------------
PROMPT_CODE=$'```python\nclass Stack:\n    """A simple stack."""\n\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n            raise IndexError("pop from empty stack")\n        return self.items.pop()\n\n\nclass Queue:\n    """A simple queue."""\n\n    def __init__(self):\n'
PROMPT_CHAT=$'User: What are three tips for writing readable Python code?\nAssistant: Here are three tips:\n1.'
PROMPT_SUMMARIZATION=$'Article: The city council met on Tuesday to discuss the new bike lane plan. The plan adds twelve kilometres of protected bike lanes downtown, funded by a state grant. Council members praised the safety benefits, while some shop owners worried about parking. The council approved the plan by a vote of seven to two, and construction starts in spring.\nSummary: The city council'
PROMPTS=(code chat summarization)

RUN_DIR="$WORK/logs/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$RUN_DIR"
printf '%s' "$PROMPT_CODE" >"$RUN_DIR/prompt_code.txt"
printf '%s' "$PROMPT_CHAT" >"$RUN_DIR/prompt_chat.txt"
printf '%s' "$PROMPT_SUMMARIZATION" >"$RUN_DIR/prompt_summarization.txt"

# ---------------------------------------------------------------------------------------------
# 3. Runs. Configs: "plain", "spec" (llama-speculative, default draft settings), "spec-dmaxK"
#    (llama-speculative --draft-max K) and "spec-simple" (llama-speculative-simple, the
#    single-sequence implementation the server uses, default settings). Interleaved: every
#    repeat runs every config back to back on the same prompt and temperature.
# ---------------------------------------------------------------------------------------------
CONFIGS=(plain spec)
for k in $DRAFT_MAX; do CONFIGS+=("spec-dmax$k"); done
CONFIGS+=(spec-simple)

# Flags shared by every run: same context size, seed, threads and token budget.
common_flags() { # $1 = temperature, $2 = prompt file
    echo -c 2048 -b 2048 --seed "$SEED" -t "$THREADS" -n "$TOKENS" --temp "$1" -f "$2"
}

run_one() { # $1 = config, $2 = temperature, $3 = prompt name, $4 = log file
    local cfg=$1 temp=$2 prompt="$RUN_DIR/prompt_$3.txt" out=$4
    # shellcheck disable=SC2046 # common_flags is split into words on purpose
    case "$cfg" in
        plain)
            "$BIN/llama-cli" -m "$LLM" $(common_flags "$temp" "$prompt") -no-cnv \
                </dev/null >"$out" 2>&1 ;;
        spec)
            "$BIN/llama-speculative" -m "$LLM" -md "$SSM" -td "$THREADS" \
                $(common_flags "$temp" "$prompt") >"$out" 2>&1 ;;
        spec-dmax*)
            "$BIN/llama-speculative" -m "$LLM" -md "$SSM" -td "$THREADS" \
                --draft-max "${cfg#spec-dmax}" $(common_flags "$temp" "$prompt") >"$out" 2>&1 ;;
        spec-simple)
            "$BIN/llama-speculative-simple" -m "$LLM" -md "$SSM" -td "$THREADS" \
                $(common_flags "$temp" "$prompt") >"$out" 2>&1 ;;
        *) log "unknown config $cfg"; exit 1 ;;
    esac
}

# The reference VM has 2 cores and is shared: another job's `arbor`/`cargo` run next to a
# benchmark halves or worse its speed (llama.cpp's OpenMP threads spin at barriers). Before each
# run, wait (up to QUIET_WAIT seconds, default 180) until no such process is running, and note in
# the run's log whether one was running when it ended. Only reads the process table.
BUSY_NAMES="${BUSY_NAMES:-arbor cargo rustc cc1 cc1plus ld}"
busy() { local n; for n in $BUSY_NAMES; do pgrep -x "$n" >/dev/null 2>&1 && return 0; done; return 1; }
wait_quiet() {
    local waited=0
    while busy && (( waited < ${QUIET_WAIT:-180} )); do sleep 2; waited=$((waited + 2)); done
    (( waited == 0 )) || log "waited ${waited}s for other jobs to finish"
}

log "logs in $RUN_DIR; configs: ${CONFIGS[*]}; temperatures: $TEMPS; $TOKENS tokens, $REPEATS repeats, $THREADS threads"
for rep in $(seq 1 "$REPEATS"); do
    for temp in $TEMPS; do
        for p in "${PROMPTS[@]}"; do
            for cfg in "${CONFIGS[@]}"; do
                log "repeat $rep/$REPEATS T=$temp $p $cfg"
                out="$RUN_DIR/${cfg}_T${temp}_${p}_r${rep}.log"
                wait_quiet
                run_one "$cfg" "$temp" "$p" "$out" || { log "run failed, see $out"; exit 1; }
                if busy; then echo "BENCH_CONTENDED=1" >>"$out"; log "  (another job was running)"; fi
            done
        done
    done
done

# ---------------------------------------------------------------------------------------------
# 4. Parse the logs and print JSON.
#   plain (llama-cli): generated tokens = eval runs + 1; decode time = eval time + sampling time
#     (llama_perf_context_print / llama_perf_sampler_print), i.e. the decode loop without the
#     prompt, as llama-speculative's "decoded" timer.
#   spec (llama-speculative[-simple]): "decoded N tokens in X seconds", n_drafted, n_accept.
#     Every verification pass of the target yields its accepted draft tokens plus one, so
#     passes = n_predict - n_accept and accepted/pass = n_accept / passes.
# ---------------------------------------------------------------------------------------------
python3 - "$RUN_DIR" "$REPEATS" "$TEMPS" "${CONFIGS[*]}" <<'PY'
import json, re, statistics, sys
run_dir, repeats, temps, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
prompts = ["code", "chat", "summarization"]

def parse(cfg, temp, prompt, rep):
    text = open(f"{run_dir}/{cfg}_T{temp}_{prompt}_r{rep}.log", errors="replace").read()
    if cfg == "plain":
        ev = re.search(r"eval time =\s*([\d.]+) ms /\s*(\d+) runs", text.split("prompt eval time")[-1])
        sm = re.search(r"sampling time =\s*([\d.]+) ms", text)
        secs = (float(ev.group(1)) + float(sm.group(1))) / 1e3
        # generated tokens = evaluated tokens + the last one (sampled, never evaluated)
        tokens = int(ev.group(2)) + 1
        return dict(tokens=tokens, secs=secs, drafted=0, accepted=0, contended="BENCH_CONTENDED" in text)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", text).group(1))
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", text).group(1))
    return dict(tokens=int(dec.group(1)), secs=float(dec.group(2)), drafted=drafted, accepted=accepted,
                contended="BENCH_CONTENDED" in text)

runs = {(c, t, p, r): parse(c, t, p, r) for c in configs for t in temps for p in prompts
        for r in range(1, repeats + 1)}
med = statistics.median

def kept(c, t, p):
    # Runs that ended with another job running are dropped when an undisturbed one exists.
    rs = [runs[c, t, p, r] for r in range(1, repeats + 1)]
    return [x for x in rs if not x["contended"]] or rs

def prompt_tok_s(c, t, p):
    return med([x["tokens"] / x["secs"] for x in kept(c, t, p)])

def total_tok_s(c, t):
    # All prompts: total tokens / total decode time, from each prompt's median tokens and speed.
    n = {p: med([x["tokens"] for x in kept(c, t, p)]) for p in prompts}
    return sum(n.values()) / sum(n[p] / prompt_tok_s(c, t, p) for p in prompts)

def acceptance(c, rs):  # from every run: contention changes speed, not acceptance
    acc, dr, tok = (sum(x[k] for x in rs) for k in ("accepted", "drafted", "tokens"))
    if c == "plain":
        return None, None
    return (round(acc / dr, 3) if dr else None), round(acc / (tok - acc), 2)

for t in temps:
    for c in configs:
        for p in prompts:
            rs = [runs[c, t, p, r] for r in range(1, repeats + 1)]
            rate, mean_acc = acceptance(c, rs)
            print(json.dumps(dict(
                config=c, temperature=float(t), prompt=p,
                decode_tok_s=round(prompt_tok_s(c, t, p), 2),
                runs_tok_s=[round(x["tokens"] / x["secs"], 2) for x in rs],
                contended=[x["contended"] for x in rs],
                tokens=[x["tokens"] for x in rs],
                accept_rate=rate, mean_accepted=mean_acc,
                speedup=round(prompt_tok_s(c, t, p) / prompt_tok_s("plain", t, p), 2))))
for t in temps:
    base = total_tok_s("plain", t)
    code_base = prompt_tok_s("plain", t, "code")
    for c in configs:
        tok_s = total_tok_s(c, t)
        rate, mean_acc = acceptance(c, [runs[c, t, p, r] for p in prompts for r in range(1, repeats + 1)])
        print(json.dumps(dict(
            aggregate=True, config=c, temperature=float(t),
            decode_tok_s=round(tok_s, 2), code_tok_s=round(prompt_tok_s(c, t, "code"), 2),
            accept_rate=rate, mean_accepted=mean_acc,
            speedup=round(tok_s / base, 2),
            code_speedup=round(prompt_tok_s(c, t, "code") / code_base, 2))))
PY
