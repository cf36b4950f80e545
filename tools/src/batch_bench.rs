//! `arbor bench batch`: aggregate decode throughput of N concurrent requests under continuous batching (the engine's `Scheduler` over one paged KV pool), side by side with llama.cpp's `llama-batched-bench`.

use std::collections::HashMap;
use std::time::Instant;

use arbor_engine::draft::{early_exit, DraftSampling, DraftShape, Drafter, NgramDrafter};
use arbor_engine::sched::{Finish, RequestSpec, SchedConfig, Scheduler, SpecPolicy, StepCost};
use arbor_engine::{
    CpuBackend, EngineError, GenerateParams, KvPool, Model, Result, SamplingParams, Tokenizer,
};

use crate::spec_bench::SUITE_PROMPTS;

/// Figures of one mode at one concurrency.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModeFigures {
    /// Output tokens per second of all requests together, over the decode phase (from every
    /// request past its prompt to the last finish; see `steady_tok_s` for llama-batched-bench's
    /// S_TG).
    pub tok_s: f64,
    /// Mean over requests of its tokens per second from its first token to its last.
    pub per_request_tok_s: f64,
    /// Tokens per request per step (1 without speculation).
    pub mean_accepted: f64,
    /// Most KV blocks in use at once.
    pub kv_blocks: usize,
    /// Output tokens per second from the first submission to the last finish (prefill included).
    pub end_to_end_tok_s: f64,
    pub preemptions: u64,
    /// Rows per forward pass (prefill included).
    pub rows_per_step: f64,
    /// Share of the steps' seconds spent in forward passes.
    pub forward_share: f64,
    /// Decode-phase tok/s of each round (`--rounds`; `tok_s` is over all rounds together).
    pub rounds_tok_s: Vec<f64>,
    /// Output tokens per second over the steady part of the decode phase: from every request
    /// past its prompt until the first one finishes (all `concurrency` requests decoding in every
    /// step, as llama-batched-bench's lockstep sequences do). `tok_s` also counts the ragged end,
    /// where requests admitted first have finished and the last ones decode in smaller steps.
    pub steady_tok_s: f64,
}

/// Raw sums of one mode's runs (one per round), turned into [`ModeFigures`] at the end.
#[derive(Clone, Debug, Default)]
struct ModeSums {
    decode_tokens: usize,
    decode_secs: f64,
    tokens: usize,
    secs: f64,
    per_request_tok_s: Vec<f64>,
    spec_steps: usize,
    accepted: usize,
    kv_blocks: usize,
    preemptions: u64,
    rows: u64,
    steps: u64,
    forward_secs: f64,
    step_secs: f64,
    rounds_tok_s: Vec<f64>,
    steady_tokens: usize,
    steady_secs: f64,
}

impl ModeSums {
    fn add(&mut self, r: ModeSums) {
        self.decode_tokens += r.decode_tokens;
        self.decode_secs += r.decode_secs;
        self.tokens += r.tokens;
        self.secs += r.secs;
        self.per_request_tok_s.extend(r.per_request_tok_s);
        self.spec_steps += r.spec_steps;
        self.accepted += r.accepted;
        self.kv_blocks = self.kv_blocks.max(r.kv_blocks);
        self.preemptions += r.preemptions;
        self.rows += r.rows;
        self.steps += r.steps;
        self.forward_secs += r.forward_secs;
        self.step_secs += r.step_secs;
        self.rounds_tok_s.extend(r.rounds_tok_s);
        self.steady_tokens += r.steady_tokens;
        self.steady_secs += r.steady_secs;
    }

    fn figures(&self) -> ModeFigures {
        let n = self.per_request_tok_s.len().max(1) as f64;
        ModeFigures {
            tok_s: self.decode_tokens as f64 / self.decode_secs.max(1e-12),
            per_request_tok_s: self.per_request_tok_s.iter().sum::<f64>() / n,
            mean_accepted: if self.spec_steps > 0 {
                (self.spec_steps + self.accepted) as f64 / self.spec_steps as f64
            } else {
                1.0
            },
            kv_blocks: self.kv_blocks,
            end_to_end_tok_s: self.tokens as f64 / self.secs.max(1e-9),
            preemptions: self.preemptions,
            rows_per_step: self.rows as f64 / self.steps.max(1) as f64,
            forward_share: self.forward_secs / self.step_secs.max(1e-12),
            rounds_tok_s: self.rounds_tok_s.clone(),
            steady_tok_s: self.steady_tokens as f64 / self.steady_secs.max(1e-12),
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchRow {
    pub concurrency: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub none: Option<ModeFigures>,
    /// Every request verifies the drafter's whole tree (up to the budget) every step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed: Option<ModeFigures>,
    /// Tree depths chosen per step for the whole batch (goodput-driven).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<ModeFigures>,
}

/// Speculation of one benchmark mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    None,
    Fixed,
    Adaptive,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::None => "none",
            Mode::Fixed => "fixed",
            Mode::Adaptive => "adaptive",
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchBench {
    pub model: String,
    pub cpu: String,
    pub threads: usize,
    pub prompts: String,
    pub prompt_tokens: usize,
    pub tokens: usize,
    pub temperature: f32,
    /// Top-k of every request (0: off).
    pub top_k: usize,
    /// Top-p of every request (1: off).
    pub top_p: f32,
    /// Min-p of every request (0: off).
    pub min_p: f32,
    pub kv_block_bytes: usize,
    /// Runs of every mode per concurrency, alternated (the figures sum them).
    pub rounds: usize,
    /// The drafter of the fixed and adaptive modes (prompt lookup, longest n-gram).
    pub draft: String,
    pub budget: usize,
    /// The calibrated forward-pass cost the adaptive mode starts from: (rows, ms) of one
    /// sequence's rows.
    pub step_cost_ms: Vec<(usize, f64)>,
    /// The same for (sequences, ms) of that many sequences of one row each.
    pub step_cost_seqs_ms: Vec<(usize, f64)>,
    pub results: Vec<BatchRow>,
}

/// The CPU's model name (from /proc/cpuinfo on Linux) and the kernel family the process runs
/// (`ARBOR_KERNEL` or the CPU's best): `AMD EPYC (avx512 kernels)`.
pub fn cpu_name() -> String {
    format!(
        "{} ({} kernels)",
        cpu_model(),
        arbor_engine::quant::kernel_level().name()
    )
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// The prompts of a built-in set, each cut or cycled to `n` tokens.
fn prompt_set(tok: &Tokenizer, set: &str, n: usize) -> Result<Vec<Vec<u32>>> {
    let kinds: Vec<&str> = match set {
        "code" => vec!["code"],
        "chat" => vec!["chat"],
        "mixed" => vec!["code", "chat", "summarization"],
        other => {
            return Err(EngineError::InvalidArgument(format!(
                "unknown prompt set '{other}' (code, chat, mixed)"
            )))
        }
    };
    SUITE_PROMPTS
        .iter()
        .filter(|(k, _)| kinds.contains(k))
        .map(|(_, text)| {
            let ids = tok.encode(text, true)?;
            Ok(ids.iter().copied().cycle().take(n).collect())
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
pub fn batch_bench(
    model: &Model,
    tok: &Tokenizer,
    backend: &CpuBackend,
    model_name: &str,
    concurrency: &[usize],
    prompts: &str,
    prompt_tokens: usize,
    tokens: usize,
    sampling: &SamplingParams,
    kv_memory: usize,
    draft: &BenchDraft,
    budget: usize,
    modes: &[String],
    rounds: usize,
) -> Result<BatchBench> {
    let rounds = rounds.max(1);
    for m in modes {
        if !["none", "fixed", "adaptive"].contains(&m.as_str()) {
            return Err(EngineError::InvalidArgument(format!(
                "unknown mode '{m}' (none, fixed, adaptive)"
            )));
        }
    }
    let want = |m: &str| modes.iter().any(|x| x == m);
    if tokens < 2 || prompt_tokens == 0 {
        return Err(EngineError::InvalidArgument(
            "--tokens must be at least 2 and --prompt-tokens positive".into(),
        ));
    }
    let set = prompt_set(tok, prompts, prompt_tokens)?;
    let kind = parse_draft(&draft.spec)?;
    let sizes = [1usize, 2, 4, 8, 16, 32, 64, 128, 256];
    let cost = if want("adaptive") {
        StepCost::calibrate(model, backend, &sizes, prompt_tokens, 3)?
    } else {
        StepCost::from_points(vec![])
    };
    let (step_cost_ms, step_cost_seqs_ms) = if want("adaptive") {
        (
            sizes.iter().map(|&r| (r, cost.secs(r) * 1e3)).collect(),
            sizes
                .iter()
                .filter(|&&n| n <= arbor_engine::sched::adaptive::CALIBRATION_SEQS)
                .map(|&n| (n, cost.pass_secs(n, n) * 1e3))
                .collect(),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let mut results = Vec::new();
    let bar = crate::progress::steps(concurrency.len() as u64, "bench batch: concurrency levels");
    for &c in concurrency {
        bar.inc(1);
        let run = |mode| {
            run_mode(
                model,
                tok,
                backend,
                &set,
                c,
                tokens,
                sampling,
                kv_memory,
                mode,
                (kind, draft),
                budget,
                &cost,
            )
        };
        // Modes in the order asked, rotated by one each round: a slow phase of a shared machine
        // falls on every mode alike.
        let order: Vec<Mode> = [Mode::None, Mode::Fixed, Mode::Adaptive]
            .into_iter()
            .filter(|m| want(m.name()))
            .collect();
        let mut sums = [
            ModeSums::default(),
            ModeSums::default(),
            ModeSums::default(),
        ];
        for round in 0..rounds {
            for k in 0..order.len() {
                let mode = order[(k + round) % order.len()];
                sums[mode as usize].add(run(mode)?);
            }
        }
        let fig = |m: Mode| want(m.name()).then(|| sums[m as usize].figures());
        results.push(BatchRow {
            concurrency: c,
            none: fig(Mode::None),
            fixed: fig(Mode::Fixed),
            adaptive: fig(Mode::Adaptive),
        });
    }
    bar.finish_and_clear();
    Ok(BatchBench {
        model: model_name.to_string(),
        cpu: cpu_name(),
        threads: backend.threads(),
        prompts: prompts.to_string(),
        prompt_tokens,
        tokens,
        temperature: sampling.temperature,
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        min_p: sampling.min_p,
        kv_block_bytes: KvPool::block_bytes(model.config.kv_dim(), model.config.n_layers),
        rounds,
        draft: format!(
            "{}{}",
            draft.spec,
            match kind {
                DraftKind::Ngram(_) => String::new(),
                DraftKind::EarlyExit(_) => format!(
                    " tree {:?}, {}",
                    draft.shape,
                    if draft.batched {
                        "batched across requests"
                    } else {
                        "each request alone"
                    }
                ),
            }
        ),
        budget,
        step_cost_ms,
        step_cost_seqs_ms,
        results,
    })
}

/// `ngram` or `ngram:N` (prompt lookup on n-grams of up to N tokens).
/// The drafter of the speculative modes.
#[derive(Clone, Debug)]
pub struct BenchDraft {
    /// `ngram[:N]` or `early-exit:L`.
    pub spec: String,
    /// Tree shape of model drafters.
    pub shape: DraftShape,
    /// Model drafters of all requests in one pool, drafted in one pass per depth.
    pub batched: bool,
}

#[derive(Clone, Copy, Debug)]
enum DraftKind {
    Ngram(usize),
    EarlyExit(usize),
}

fn parse_draft(draft: &str) -> Result<DraftKind> {
    let bad = || {
        EngineError::InvalidArgument(format!(
            "bench batch drafts with ngram[:N] or early-exit:L, not '{draft}'"
        ))
    };
    let num = |n: &str| n.parse().ok().filter(|&n: &usize| n >= 1).ok_or_else(bad);
    match draft.split_once(':') {
        None if draft == "ngram" => Ok(DraftKind::Ngram(3)),
        Some(("ngram", n)) => Ok(DraftKind::Ngram(num(n)?)),
        Some(("early-exit", l)) => Ok(DraftKind::EarlyExit(num(l)?)),
        _ => Err(bad()),
    }
}

/// One mode at one concurrency: `c` requests submitted at once, run to completion.
#[allow(clippy::too_many_arguments)]
fn run_mode(
    model: &Model,
    tok: &Tokenizer,
    backend: &CpuBackend,
    set: &[Vec<u32>],
    c: usize,
    tokens: usize,
    sampling: &SamplingParams,
    kv_memory: usize,
    mode: Mode,
    (kind, draft): (DraftKind, &BenchDraft),
    budget: usize,
    cost: &StepCost,
) -> Result<ModeSums> {
    let pool = KvPool::with_memory(&model.config, kv_memory);
    // Model drafters' K/V: one pool for all requests (batched drafting), or one each.
    let draft_pool = match kind {
        DraftKind::EarlyExit(l) => Some(KvPool::elastic(
            &model.config,
            l,
            (kv_memory / KvPool::block_bytes(model.config.kv_dim(), l).max(1)).max(4),
        )),
        DraftKind::Ngram(_) => None,
    };
    // Prefix caching off: every request computes its own prompt, as llama-batched-bench does.
    let config = SchedConfig {
        max_running: c.max(1),
        prefix_caching: false,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(model, Some(tok), pool, config)?;
    s.set_step_cost(cost.clone());
    for i in 0..c {
        let params = GenerateParams {
            max_tokens: tokens,
            sampling: SamplingParams {
                seed: i as u64,
                ..sampling.clone()
            },
            stop: Vec::new(),
            ignore_eos: true,
            min_tokens: 0,
            ..GenerateParams::default()
        };
        let spec = match mode {
            Mode::None => None,
            Mode::Fixed | Mode::Adaptive => Some(RequestSpec {
                drafters: vec![match kind {
                    DraftKind::Ngram(n) => Box::new(NgramDrafter::new(
                        n,
                        1,
                        budget.max(1),
                        NgramDrafter::default().max_matches,
                    )?) as Box<dyn Drafter>,
                    DraftKind::EarlyExit(l) => {
                        let d = early_exit(
                            model,
                            backend,
                            l,
                            draft.shape.clone(),
                            DraftSampling::TopK,
                            i as u64,
                        )?;
                        match (&draft_pool, draft.batched) {
                            (Some(p), true) => Box::new(d.in_pool(p)?),
                            _ => Box::new(d),
                        }
                    }
                }],
                budget,
                policy: if mode == Mode::Fixed {
                    SpecPolicy::Fixed
                } else {
                    SpecPolicy::Adaptive
                },
                mode: None,
                external: false,
                candidates: 0,
                prompt_candidates: 0,
                max_nodes_by_depth: Vec::new(),
            }),
        };
        s.submit_spec(set[i % set.len()].clone(), params, spec)?;
    }
    let t0 = Instant::now();
    let mut first: HashMap<u64, Instant> = HashMap::new();
    let mut per_req = Vec::new();
    let (mut produced, mut steps, mut accepted) = (0usize, 0usize, 0usize);
    // Decode phase: from the step after every request has its first token.
    let mut decode_start: Option<(Instant, usize)> = None;
    let mut decode_end = t0;
    // The steady part: from `decode_start` to the end of the step in which a request first
    // finished after it.
    let mut steady_end: Option<(Instant, usize)> = None;
    while !s.is_idle() {
        let events = s.step(backend)?;
        let now = Instant::now();
        let mut any_done = false;
        for ev in events {
            produced += ev.tokens.len();
            first.entry(ev.id).or_insert(now);
            match ev.finish {
                Some(Finish::Done {
                    tokens: t, spec, ..
                }) => {
                    any_done = true;
                    let secs = now.duration_since(first[&ev.id]).as_secs_f64();
                    if secs > 0.0 && t.len() > 1 {
                        per_req.push((t.len() - 1) as f64 / secs);
                    }
                    if let Some(m) = spec {
                        steps += m.steps;
                        accepted += m.accepted;
                    }
                }
                Some(Finish::Failed(e)) => return Err(e),
                None => {}
            }
        }
        if decode_start.is_some() && steady_end.is_none() && any_done {
            steady_end = Some((now, produced));
        }
        if decode_start.is_none() && first.len() == c {
            decode_start = Some((now, produced));
        }
        decode_end = now;
    }
    let total = t0.elapsed().as_secs_f64();
    let (ds, dp) = decode_start.unwrap_or((t0, 0));
    let dsecs = decode_end.duration_since(ds).as_secs_f64();
    let st = s.stats();
    let decode_tokens = produced - dp;
    let (se, sp) = steady_end.unwrap_or((decode_end, produced));
    let (steady_secs, steady_tokens) = (se.duration_since(ds).as_secs_f64(), sp - dp);
    Ok(ModeSums {
        decode_tokens,
        decode_secs: dsecs,
        tokens: produced,
        secs: total,
        per_request_tok_s: per_req,
        spec_steps: steps,
        accepted,
        kv_blocks: st.peak_blocks,
        preemptions: st.preemptions,
        rows: st.rows,
        steps: st.steps,
        forward_secs: st.forward_secs,
        step_secs: st.step_secs,
        rounds_tok_s: vec![if dsecs > 0.0 {
            decode_tokens as f64 / dsecs
        } else {
            0.0
        }],
        steady_tokens,
        steady_secs,
    })
}

pub fn format_table(r: &BatchBench) -> String {
    let mut s = format!(
        "model: {}  cpu: {}  threads: {}  prompts: {} ({} tokens)  tokens: {}  T: {}  top-k: {}  top-p: {}  min-p: {}\n\
         fixed/adaptive: --draft {} budget {}; tok/s over the decode phase, steady while all decode, e2e from submission; \
         {} round(s), modes alternated\n\
         {:>5} {:>9} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>7} {:>8} {:>5}\n",
        r.model,
        r.cpu,
        r.threads,
        r.prompts,
        r.prompt_tokens,
        r.tokens,
        r.temperature,
        r.top_k,
        r.top_p,
        r.min_p,
        r.draft,
        r.budget,
        r.rounds,
        "conc",
        "mode",
        "tok/s",
        "steady",
        "per-req",
        "e2e tok/s",
        "accepted",
        "blocks",
        "preempt",
        "rows/pass",
        "fwd%"
    );
    for row in &r.results {
        for (name, f) in [
            ("none", &row.none),
            ("fixed", &row.fixed),
            ("adaptive", &row.adaptive),
        ] {
            let Some(f) = f else {
                continue;
            };
            s.push_str(&format!(
                "{:>5} {:>9} {:>10.1} {:>10.1} {:>10.2} {:>10.1} {:>8.2} {:>8} {:>7} {:>8.1} {:>5.1}{}\n",
                row.concurrency,
                name,
                f.tok_s,
                f.steady_tok_s,
                f.per_request_tok_s,
                f.end_to_end_tok_s,
                f.mean_accepted,
                f.kv_blocks,
                f.preemptions,
                f.rows_per_step,
                100.0 * f.forward_share,
                if f.rounds_tok_s.len() > 1 {
                    let each: Vec<String> =
                        f.rounds_tok_s.iter().map(|t| format!("{t:.1}")).collect();
                    format!("  rounds: {}", each.join(" "))
                } else {
                    String::new()
                }
            ));
        }
    }
    s
}

/// Drafting cost per step of model drafters for many sequences: batched across sequences (one
/// KV pool, one forward pass per tree depth for all) against each sequence drafting alone.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DraftBatchRow {
    pub sequences: usize,
    /// Mean milliseconds per drafting step, per round (alternated: batched, alone, ...).
    pub batched_ms: Vec<f64>,
    pub alone_ms: Vec<f64>,
}

/// `arbor bench draft-batch`: `layers`-layer early-exit drafters of `model` along `shape` for
/// `n` sequences of `context` tokens, `steps` drafting steps (each accepts the first child and a
/// bonus token, so drafters feed two tokens per step as in decoding), `rounds` alternations.
#[allow(clippy::too_many_arguments)]
pub fn draft_batch_bench(
    model: &Model,
    backend: &CpuBackend,
    layers: usize,
    shape: &DraftShape,
    sequences: &[usize],
    context: usize,
    steps: usize,
    rounds: usize,
) -> Result<Vec<DraftBatchRow>> {
    use arbor_engine::spec::{propose_many, ProposeItem};
    let vocab = model.config.vocab_size;
    let budget = shape.max_nodes();
    let depth = shape.depth();
    let mut rows = Vec::new();
    let bar = crate::progress::steps(
        (sequences.len() * rounds * 2) as u64,
        "bench draft-batch: runs",
    );
    for &n in sequences {
        let mut row = DraftBatchRow {
            sequences: n,
            batched_ms: Vec::new(),
            alone_ms: Vec::new(),
        };
        for _ in 0..rounds {
            for batched in [true, false] {
                bar.inc(1);
                let pool = KvPool::elastic(&model.config, layers, n * (context + 2 * steps + 64));
                let mut ds = Vec::with_capacity(n);
                for i in 0..n {
                    let d = early_exit(
                        model,
                        backend,
                        layers,
                        shape.clone(),
                        DraftSampling::TopK,
                        i as u64,
                    )?;
                    ds.push(if batched { d.in_pool(&pool)? } else { d });
                }
                let mut seqs: Vec<Vec<u32>> = (0..n)
                    .map(|i| {
                        (0..context as u32)
                            .map(|j| (j * 31 + i as u32 * 7 + 1) % vocab as u32)
                            .collect()
                    })
                    .collect();
                let mut secs = 0.0;
                // Step 0 feeds the whole context: not timed.
                for step in 0..=steps {
                    let t0 = Instant::now();
                    let trees: Vec<Result<arbor_engine::tree::TokenTree>> = if batched {
                        let mut items: Vec<ProposeItem<'_>> = ds
                            .iter_mut()
                            .zip(&seqs)
                            .map(|(d, s)| {
                                ProposeItem::sole(d as &mut dyn Drafter, s, budget, depth, vocab)
                            })
                            .collect();
                        propose_many(&mut items)
                    } else {
                        ds.iter_mut()
                            .zip(&seqs)
                            .map(|(d, s)| {
                                arbor_engine::spec::propose_checked(
                                    d, 0, 1, s, budget, depth, vocab,
                                )
                            })
                            .collect()
                    };
                    if step > 0 {
                        secs += t0.elapsed().as_secs_f64();
                    }
                    for (i, t) in trees.into_iter().enumerate() {
                        let t = t?;
                        let first = t.children(0).first().map(|&c| t.node(c).token);
                        let accepted: Vec<u32> = first.into_iter().collect();
                        let bonus = (step as u32 * 13 + i as u32) % vocab as u32;
                        ds[i].accept(&accepted, bonus);
                        seqs[i].extend(&accepted);
                        seqs[i].push(bonus);
                    }
                }
                let ms = secs / steps.max(1) as f64 * 1e3;
                if batched {
                    row.batched_ms.push(ms);
                } else {
                    row.alone_ms.push(ms);
                }
            }
        }
        rows.push(row);
    }
    bar.finish_and_clear();
    Ok(rows)
}

/// The draft-batch table: per sequence count, each round's batched and alone milliseconds.
pub fn format_draft_batch(rows: &[DraftBatchRow]) -> String {
    let mut s = format!(
        "{:>5} {:>28} {:>28} {:>8}\n",
        "seqs", "batched ms/step", "alone ms/step", "speedup"
    );
    let join = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    for r in rows {
        s.push_str(&format!(
            "{:>5} {:>28} {:>28} {:>7.2}x\n",
            r.sequences,
            join(&r.batched_ms),
            join(&r.alone_ms),
            median(&r.alone_ms) / median(&r.batched_ms)
        ));
    }
    s
}
