//! `arbor bench spec`: the cost of one SpecInfer tree verification pass as the token tree grows (oracle or random drafter, greedy).
//!
//! A tree of N draft nodes is `w = N / d` parallel chains of depth `d = min(N, depth)`: with the
//! oracle one chain is the true continuation, the others are random wrong tokens, so each pass
//! accepts up to `d` tokens whatever N is and the table shows what the extra width costs.

use std::time::Instant;

use arbor_engine::draft::{Drafter, OracleDrafter, RandomDrafter};
use arbor_engine::generate::{generate, GenerateParams};
use arbor_engine::sample::verify::{Verifier, VerifyMode};
use arbor_engine::sample::SamplingParams;
use arbor_engine::spec::SpecSession;
use arbor_engine::tree::ExpansionConfig;
use arbor_engine::{BatchMask, CpuBackend, EngineError, KvCache, Model, Result, Tokenizer};

use crate::bench::bench_prompt;

/// One tree size.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SpecBenchRow {
    /// Draft nodes per tree (the pass has one more row: the root).
    pub tree_nodes: usize,
    /// The expansion config used.
    pub shape: String,
    pub passes: usize,
    /// Median milliseconds of one verification pass (forward over the tree, verify, KV commit).
    pub ms_per_pass: f64,
    /// Mean accepted draft tokens per pass.
    pub mean_accepted: f64,
    /// Milliseconds of verification per generated token (accepted + bonus).
    pub ms_per_token: f64,
    /// Incremental ms/token divided by ms_per_token.
    pub speedup: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct SpecBench {
    pub model: String,
    pub threads: usize,
    pub drafter: String,
    pub context: usize,
    pub tokens: usize,
    pub depth: usize,
    /// Incremental greedy decoding, milliseconds per token at the same context.
    pub incremental_ms_per_token: f64,
    pub rows: Vec<SpecBenchRow>,
}

/// The tree shape for `n` draft nodes: `n / d` chains of depth `d = min(n, depth)`.
pub fn shape_for(n: usize, depth: usize) -> Result<ExpansionConfig> {
    let d = n.min(depth).max(1);
    let w = (n / d).max(1);
    let mut b = vec![1usize; d];
    b[0] = w;
    ExpansionConfig::new(b)
}

#[allow(clippy::too_many_arguments)]
pub fn spec_bench(
    model: &Model,
    tok: &Tokenizer,
    backend: &CpuBackend,
    model_name: &str,
    drafter: &str,
    sizes: &[usize],
    depth: usize,
    prompt_tokens: usize,
    tokens: usize,
) -> Result<SpecBench> {
    if !matches!(drafter, "oracle" | "random") {
        return Err(EngineError::InvalidArgument(format!(
            "unknown drafter '{drafter}' (oracle, random)"
        )));
    }
    if sizes.is_empty() || sizes.contains(&0) || tokens == 0 || prompt_tokens == 0 {
        return Err(EngineError::InvalidArgument(
            "tree sizes, --tokens and --prompt-tokens must be positive".into(),
        ));
    }
    let prompt = bench_prompt(tok, prompt_tokens)?;
    // The greedy continuation (the oracle's truth) and the incremental baseline.
    let params = GenerateParams {
        max_tokens: tokens + depth + 1,
        ignore_eos: true,
        ..GenerateParams::default()
    };
    let reference = generate(model, backend, tok, &prompt, &params, |_| {})?;
    let incremental_ms_per_token =
        reference.decode_secs * 1e3 / reference.decode_steps.max(1) as f64;
    let mut truth = prompt.clone();
    truth.extend(&reference.tokens);

    let max_n = sizes.iter().copied().max().unwrap_or(1);
    let mut prefilled = KvCache::new(&model.config, prompt.len() + tokens + max_n + 2);
    let positions: Vec<usize> = (0..prompt.len()).collect();
    model.forward(
        backend,
        &mut prefilled,
        &prompt,
        &positions,
        BatchMask::Causal,
        &[],
    )?;

    let mut rows = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let shape = shape_for(n, depth)?;
        let mut d: Box<dyn Drafter> = match drafter {
            "oracle" => Box::new(OracleDrafter::new(truth.clone(), shape.clone(), n as u64)),
            _ => Box::new(RandomDrafter::new(shape.clone(), n as u64)),
        };
        let verifier = Verifier::new(VerifyMode::Greedy, SamplingParams::greedy())?;
        let mut seq = prompt.clone();
        seq.push(reference.tokens[0]);
        let mut s = SpecSession::new(model, backend, prefilled.clone(), seq, verifier, n)?;
        let mut times = Vec::new();
        let mut total = 0.0f64;
        let start = s.tokens().len();
        while s.tokens().len() - start < tokens {
            let tree = s.draft(&mut [d.as_mut()], depth)?;
            let t = Instant::now();
            s.verify(&tree, &mut [d.as_mut()])?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            times.push(ms);
            total += ms;
        }
        let generated = s.tokens().len() - start;
        times.sort_by(f64::total_cmp);
        let ms_per_token = total / generated as f64;
        rows.push(SpecBenchRow {
            tree_nodes: n,
            shape: shape.to_string(),
            passes: times.len(),
            ms_per_pass: times[times.len() / 2],
            mean_accepted: s.metrics().mean_accepted(),
            ms_per_token,
            speedup: incremental_ms_per_token / ms_per_token,
        });
    }
    Ok(SpecBench {
        model: model_name.to_string(),
        threads: backend.threads(),
        drafter: drafter.to_string(),
        context: prompt.len(),
        tokens,
        depth,
        incremental_ms_per_token,
        rows,
    })
}

/// The text table `arbor bench spec` prints.
pub fn format_table(r: &SpecBench) -> String {
    let mut s = format!(
        "model: {}  threads: {}  drafter: {}  context: {}  tokens per size: {}  max depth: {}\n\
         incremental greedy decode: {:.2} ms/token\n\
         {:>6} {:>20} {:>7} {:>9} {:>14} {:>10} {:>8}\n",
        r.model,
        r.threads,
        r.drafter,
        r.context,
        r.tokens,
        r.depth,
        r.incremental_ms_per_token,
        "nodes",
        "shape",
        "passes",
        "ms/pass",
        "accepted/pass",
        "ms/token",
        "speedup"
    );
    for row in &r.rows {
        s.push_str(&format!(
            "{:>6} {:>20} {:>7} {:>9.2} {:>14.2} {:>10.2} {:>7.2}x\n",
            row.tree_nodes,
            row.shape,
            row.passes,
            row.ms_per_pass,
            row.mean_accepted,
            row.ms_per_token,
            row.speedup
        ));
    }
    s
}
