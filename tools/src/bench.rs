//! `arbor bench decode`: prefill and decode throughput, and the cost of one forward pass over
//! 1, 4, 16 and 64 new tokens at a fixed context (the curve that makes tree verification pay).

use std::collections::BTreeMap;
use std::time::Instant;

use arbor_engine::tree::TreeMask;
use arbor_engine::{BatchMask, CpuBackend, KvCache, Model, Result, Tokenizer};

/// Built-in text the benchmark prompt is cut from (mixed prose and code).
const BENCH_TEXT: &str = "The quick brown fox jumps over the lazy dog. In computer science, a tree is a \
widely used abstract data type that represents a hierarchical tree structure with a set of connected \
nodes. Each node in the tree can be connected to many children, but must be connected to exactly one \
parent, except for the root node, which has no parent.\n\ndef fibonacci(n):\n    a, b = 0, 1\n    for _ in \
range(n):\n        a, b = b, a + b\n    return a\n\nfor i in range(10):\n    print(i, fibonacci(i))\n";

#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeBench {
    pub model: String,
    /// The CPU and the kernel family (`batch_bench::cpu_name`).
    pub cpu: String,
    pub threads: usize,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub context: usize,
    /// Median milliseconds of one forward pass over N new tokens (logits for all N, as tree
    /// verification needs), keyed by N.
    pub forward_ms: BTreeMap<String, f64>,
    /// The same with logits for the last new token only (what llama.cpp's benchmarks time).
    pub forward_last_ms: BTreeMap<String, f64>,
}

/// `n` deterministic prompt tokens cut from the built-in text, repeated as needed.
pub fn bench_prompt(tok: &Tokenizer, n: usize) -> Result<Vec<u32>> {
    let base = tok.encode(BENCH_TEXT, false)?;
    Ok(base.iter().copied().cycle().take(n).collect())
}

pub fn decode_bench(
    model: &Model,
    tok: &Tokenizer,
    backend: &CpuBackend,
    model_name: &str,
    prompt_tokens: usize,
    decode_tokens: usize,
    reps: usize,
) -> Result<DecodeBench> {
    let context = prompt_tokens;
    let prompt = bench_prompt(tok, prompt_tokens)?;
    let capacity = prompt_tokens + decode_tokens.max(64) + 1;
    let mut cache = KvCache::new(&model.config, capacity);
    let positions: Vec<usize> = (0..prompt.len()).collect();

    // Warm-up pass (page in the weights), then the measured prefill.
    model.forward(
        backend,
        &mut cache,
        &prompt[..8.min(prompt.len())],
        &positions[..8.min(prompt.len())],
        BatchMask::Causal,
        &[0],
    )?;
    cache.clear();
    let t = Instant::now();
    let logits = model.forward(
        backend,
        &mut cache,
        &prompt,
        &positions,
        BatchMask::Causal,
        &[prompt.len() - 1],
    )?;
    let prefill_tok_s = prompt.len() as f64 / t.elapsed().as_secs_f64();

    // Greedy decode.
    let mut next = arbor_engine::sample::argmax(&logits);
    let t = Instant::now();
    for _ in 0..decode_tokens {
        let pos = cache.len();
        let l = model.forward(
            backend,
            &mut cache,
            &[next],
            &[pos],
            BatchMask::Causal,
            &[0],
        )?;
        next = arbor_engine::sample::argmax(&l);
    }
    let decode_tok_s = decode_tokens as f64 / t.elapsed().as_secs_f64();

    // One forward over n new tokens at a context of `context`: logits for every new token, and
    // for the last one only. The tokens form a chain verified with a tree mask, so this measures
    // the tree-verification path (the kernels of single-token decoding; prompt prefill may use
    // faster ones, see `Backend::scope_prefill`). The sizes take turns within each repetition, so
    // a drift in the machine's speed moves all of them alike (the 16-over-1 ratio is the figure
    // tree verification lives on); each time is the median of its `reps`.
    const SIZES: [usize; 6] = [1, 2, 4, 8, 16, 64];
    let reps = reps.max(1);
    // Per size: tokens, positions, the chain's mask, and the rows (0..n) whose logits are asked.
    let runs: Vec<_> = SIZES
        .iter()
        .map(|&n| {
            let toks: Vec<u32> = prompt.iter().copied().cycle().skip(7).take(n).collect();
            let pos: Vec<usize> = (context..context + n).collect();
            let parents: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
            let all: Vec<usize> = (0..n).collect();
            (toks, pos, TreeMask::from_parents(&parents), all)
        })
        .collect();
    // times[size][0: all rows, 1: last row]
    let mut times = vec![[Vec::with_capacity(reps), Vec::with_capacity(reps)]; SIZES.len()];
    let bar = crate::progress::steps((reps * runs.len()) as u64, "bench decode: forward passes");
    for _ in 0..reps {
        for ((toks, pos, chain, all), t_n) in runs.iter().zip(times.iter_mut()) {
            bar.inc(1);
            let last = &all[all.len() - 1..];
            for (rows, t_rows) in [&all[..], last].into_iter().zip(t_n.iter_mut()) {
                cache.truncate(context);
                let t = Instant::now();
                model.forward(backend, &mut cache, toks, pos, chain.as_batch_mask(), rows)?;
                t_rows.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    bar.finish_and_clear();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut forward_ms = BTreeMap::new();
    let mut forward_last_ms = BTreeMap::new();
    for (n, [all, last]) in SIZES.iter().zip(times.iter_mut()) {
        forward_ms.insert(n.to_string(), median(all));
        forward_last_ms.insert(n.to_string(), median(last));
    }
    Ok(DecodeBench {
        model: model_name.to_string(),
        cpu: crate::batch_bench::cpu_name(),
        threads: backend.threads(),
        prompt_tokens: prompt.len(),
        decode_tokens,
        prefill_tok_s,
        decode_tok_s,
        context,
        forward_ms,
        forward_last_ms,
    })
}
