//! `arbor bench spec`: the cost of one SpecInfer tree verification pass as the token tree grows (oracle or random drafter, greedy).
//!
//! A tree of N draft nodes is `w = N / d` parallel chains of depth `d = min(N, depth)`: with the
//! oracle one chain is the true continuation, the others are random wrong tokens, so each pass
//! accepts up to `d` tokens whatever N is and the table shows what the extra width costs.

use std::time::Instant;

use arbor_engine::draft::{
    early_exit, recycle, DraftSampling, DraftShape, Drafter, FallbackDrafter, ModelDrafter,
    NgramDrafter, OracleDrafter, RandomDrafter, RecycleDrafter, RecycleMatrix, RecycleTemplate,
    SpaceDrafter, SpaceMode,
};
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
        min_tokens: 0,
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
    let bar = crate::progress::steps(sizes.len() as u64, "bench spec: tree sizes");
    for &n in sizes {
        bar.inc(1);
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
    bar.finish_and_clear();
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

/// A real drafter named on the command line: `ngram[:N]` (prompt lookup, longest n-gram N),
/// `early-exit:L` (the LLM's first L layers), `space[:K]` (SPACE, training-free) or a draft model
/// (registry name or GGUF path).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftSpec {
    Ngram(usize),
    EarlyExit(usize),
    Model(String),
    /// SPACE with `k` candidates per pass: training-free (Jacobi) or with a mask token id.
    Space {
        k: usize,
        mask: Option<u32>,
    },
    /// `ngram[:N]-else:SPEC`: prompt lookup on matches of 2 to N tokens, and at steps without
    /// such a match the drafter `SPEC` (`FallbackDrafter`).
    NgramElse(usize, Box<DraftSpec>),
    /// `recycle[:K][:logits]`: Token Recycling with K successors per token (`RecycleDrafter`),
    /// warm-started from the prompt's successors, and with `logits` from every prompt row's
    /// top-K too.
    Recycle {
        k: usize,
        prompt_logits: bool,
    },
}

impl DraftSpec {
    /// Whether this drafter is (or falls back to) Token Recycling.
    pub fn recycles(&self) -> bool {
        match self {
            DraftSpec::Recycle { .. } => true,
            DraftSpec::NgramElse(_, second) => second.recycles(),
            _ => false,
        }
    }

    /// The draft model this drafter loads (a known model name or a GGUF path), if any.
    pub fn model(&self) -> Option<&str> {
        match self {
            DraftSpec::Model(name) => Some(name),
            DraftSpec::NgramElse(_, second) => second.model(),
            _ => None,
        }
    }
}

impl std::str::FromStr for DraftSpec {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<DraftSpec> {
        let num = |x: &str, what: &str| {
            x.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| EngineError::InvalidArgument(format!("drafter '{s}': {what}")))
        };
        if let Some((first, second)) = s.split_once("-else:") {
            let n = match first.parse::<DraftSpec>()? {
                DraftSpec::Ngram(n) if n >= 2 => n,
                _ => {
                    return Err(EngineError::InvalidArgument(format!(
                        "drafter '{s}': expected ngram[:N]-else:DRAFTER with N >= 2"
                    )))
                }
            };
            let second = second.parse::<DraftSpec>()?;
            if matches!(second, DraftSpec::NgramElse(..)) {
                return Err(EngineError::InvalidArgument(format!(
                    "drafter '{s}': one fallback only"
                )));
            }
            return Ok(DraftSpec::NgramElse(n, Box::new(second)));
        }
        if s == "ngram" {
            return Ok(DraftSpec::Ngram(NgramDrafter::default().max_n));
        }
        if let Some(n) = s.strip_prefix("ngram:") {
            return Ok(DraftSpec::Ngram(num(n, "expected ngram:N with N >= 1")?));
        }
        if let Some(l) = s.strip_prefix("early-exit:") {
            return Ok(DraftSpec::EarlyExit(num(l, "expected early-exit:LAYERS")?));
        }
        if s == "recycle" || s.starts_with("recycle:") {
            let what = "expected recycle[:K][:logits] with K >= 1";
            let parts: Vec<&str> = s.split(':').skip(1).collect();
            let (k, prompt_logits) = match parts.as_slice() {
                [] => (recycle::DEFAULT_K, false),
                ["logits"] => (recycle::DEFAULT_K, true),
                [k] => (num(k, what)?, false),
                [k, "logits"] => (num(k, what)?, true),
                _ => {
                    return Err(EngineError::InvalidArgument(format!(
                        "drafter '{s}': {what}"
                    )))
                }
            };
            if k > recycle::MAX_K {
                return Err(EngineError::InvalidArgument(format!(
                    "drafter '{s}': at most {} successors per token",
                    recycle::MAX_K
                )));
            }
            return Ok(DraftSpec::Recycle { k, prompt_logits });
        }
        if s == "space" {
            return Ok(DraftSpec::Space { k: 4, mask: None });
        }
        if let Some(k) = s.strip_prefix("space:") {
            return Ok(DraftSpec::Space {
                k: num(k, "expected space:K with K >= 1")?,
                mask: None,
            });
        }
        if s == "early-exit" {
            return Err(EngineError::InvalidArgument(
                "early-exit needs a layer count: early-exit:L".into(),
            ));
        }
        if s.is_empty() {
            return Err(EngineError::InvalidArgument("empty drafter name".into()));
        }
        Ok(DraftSpec::Model(s.to_string()))
    }
}

/// Build drafters for `llm`: draft models come from `ssms` (loaded by the caller, in the order
/// of the `DraftSpec::Model` entries). Children are the drafters' top-k (lossless under greedy and
/// MSS verification alike).
pub fn build_drafters<'m>(
    specs: &[DraftSpec],
    llm: &'m Model,
    ssms: &[&'m Model],
    backend: &'m CpuBackend,
    shape: &DraftShape,
    seed: u64,
) -> Result<Vec<Box<dyn Drafter + 'm>>> {
    let mut out: Vec<Box<dyn Drafter + 'm>> = Vec::new();
    let mut next_ssm = ssms.iter().copied();
    for (i, s) in specs.iter().enumerate() {
        let seed = seed.wrapping_add(1 + i as u64);
        out.push(build_drafter(s, llm, &mut next_ssm, backend, shape, seed)?);
    }
    Ok(out)
}

fn build_drafter<'m>(
    s: &DraftSpec,
    llm: &'m Model,
    next_ssm: &mut impl Iterator<Item = &'m Model>,
    backend: &'m CpuBackend,
    shape: &DraftShape,
    seed: u64,
) -> Result<Box<dyn Drafter + 'm>> {
    let max_matches = NgramDrafter::default().max_matches;
    let max_len = shape.depth().max(1);
    Ok(match s {
        DraftSpec::Ngram(n) => Box::new(NgramDrafter::new(*n, 1, max_len, max_matches)?),
        DraftSpec::NgramElse(n, second) => {
            let first = NgramDrafter::new(*n, 2, max_len, max_matches)?;
            let second = build_drafter(second, llm, next_ssm, backend, shape, seed)?;
            Box::new(FallbackDrafter::new(Box::new(first), second))
        }
        DraftSpec::EarlyExit(l) => Box::new(early_exit(
            llm,
            backend,
            *l,
            shape.clone(),
            DraftSampling::TopK,
            seed,
        )?),
        DraftSpec::Recycle { k, prompt_logits } => Box::new(
            RecycleDrafter::new(llm.config.vocab_size, *k)?.with_prompt_logits(*prompt_logits),
        ),
        DraftSpec::Space { k, mask } => {
            let mode = mask.map_or(SpaceMode::Jacobi, SpaceMode::MaskToken);
            Box::new(SpaceDrafter::new(
                *k,
                mode,
                DraftSampling::TopK,
                llm.config.vocab_size,
                seed,
            )?)
        }
        DraftSpec::Model(name) => {
            let m = next_ssm.next().ok_or_else(|| {
                EngineError::InvalidArgument(format!("draft model '{name}' is not loaded"))
            })?;
            Box::new(ModelDrafter::ssm(
                name.clone(),
                m,
                llm,
                backend,
                shape.clone(),
                DraftSampling::TopK,
                seed,
            )?)
        }
    })
}

/// The fixed prompt set of the drafter benchmark: (kind, text).
pub const SUITE_PROMPTS: [(&str, &str); 3] = [
    (
        "code",
        "```python\nclass Stack:\n    \"\"\"A simple stack.\"\"\"\n\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n            raise IndexError(\"pop from empty stack\")\n        return self.items.pop()\n\n\nclass Queue:\n    \"\"\"A simple queue.\"\"\"\n\n    def __init__(self):\n",
    ),
    (
        "chat",
        "User: What are three tips for writing readable Python code?\nAssistant: Here are three tips:\n1.",
    ),
    (
        "summarization",
        "Article: The city council met on Tuesday to discuss the new bike lane plan. The plan adds \
         twelve kilometres of protected bike lanes downtown, funded by a state grant. Council \
         members praised the safety benefits, while some shop owners worried about parking. The \
         council approved the plan by a vote of seven to two, and construction starts in spring.\n\
         Summary: The city council",
    ),
];

/// Requests that do not repeat their prompt (chat-style, sent through the model's chat
/// template): (class, user message).
pub const UNSEEN_PROMPTS: [(&str, &str); 4] = [
    (
        "unseen code",
        "Write a Python function that merges two sorted lists into one sorted list.",
    ),
    (
        "unseen code",
        "Write a function in JavaScript that debounces another function.",
    ),
    (
        "unseen chat",
        "Explain the difference between a process and a thread.",
    ),
    (
        "unseen chat",
        "Give me three ideas for a weekend trip with children.",
    ),
];

/// One prompt class of one configuration.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ClassRow {
    pub class: String,
    pub decode_tok_s: f64,
    pub mean_accepted: f64,
    /// Over incremental decoding of the same prompts at the same temperature.
    pub speedup: f64,
}

/// One configuration of the drafter benchmark at one temperature.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SuiteRow {
    pub config: String,
    pub temperature: f32,
    /// Decode tokens per second, over all prompts.
    pub decode_tok_s: f64,
    /// Mean accepted draft tokens per verification pass (0 for incremental).
    pub mean_accepted: f64,
    /// Decode speed over incremental decoding at the same temperature.
    pub speedup: f64,
    /// The same per prompt class.
    pub classes: Vec<ClassRow>,
    /// Greedy: whether every output equals incremental output (None under sampling).
    pub equal: Option<bool>,
    /// Steps × drafters whose proposals were ignored for a broken sampling contract (a sampled
    /// node without draft mass; `SpecMetrics::drafter_contract_failures`), over all prompts.
    pub drafter_contract_failures: usize,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct SuiteBench {
    pub model: String,
    pub draft_model: String,
    pub threads: usize,
    pub tokens: usize,
    pub cpu: String,
    pub rows: Vec<SuiteRow>,
}

/// One drafter configuration of the suite.
struct SuiteConfig {
    name: String,
    specs: Vec<DraftSpec>,
    shape: DraftShape,
    budget: usize,
    adaptive: bool,
    /// `recycle` drafters share one matrix over all prompts (as a server's requests can).
    shared_recycle: bool,
}

impl SuiteConfig {
    fn new(
        name: impl Into<String>,
        specs: Vec<DraftSpec>,
        shape: &str,
        budget: usize,
    ) -> Result<Self> {
        Ok(SuiteConfig {
            name: name.into(),
            specs,
            shape: shape.parse()?,
            budget,
            adaptive: false,
            shared_recycle: false,
        })
    }

    fn adaptive(mut self) -> Self {
        self.adaptive = true;
        self
    }
}

/// Per-prompt sums of one run: (decode secs, tokens, accepted, steps).
#[derive(Clone, Copy, Default)]
struct Sums {
    secs: f64,
    tokens: usize,
    accepted: usize,
    steps: usize,
}

impl Sums {
    fn add(&mut self, o: &Sums) {
        self.secs += o.secs;
        self.tokens += o.tokens;
        self.accepted += o.accepted;
        self.steps += o.steps;
    }

    fn tok_s(&self) -> f64 {
        self.tokens as f64 / self.secs.max(1e-9)
    }

    fn mean_accepted(&self) -> f64 {
        self.accepted as f64 / self.steps.max(1) as f64
    }
}

/// Classes in first-seen order, and each one's sums over `per_prompt`.
fn by_class(classes: &[&str], per_prompt: &[Sums]) -> Vec<(String, Sums)> {
    let mut out: Vec<(String, Sums)> = Vec::new();
    for (c, s) in classes.iter().zip(per_prompt) {
        match out.iter_mut().find(|(n, _)| n == c) {
            Some((_, t)) => t.add(s),
            None => out.push((c.to_string(), *s)),
        }
    }
    out
}

/// `arbor bench spec --suite`: incremental vs real drafters over [`SUITE_PROMPTS`] and
/// [`UNSEEN_PROMPTS`], greedy and T = 0.7, overall and per prompt class; `only` keeps the
/// configurations whose names contain one of its strings (all when empty).
#[allow(clippy::too_many_arguments)]
pub fn suite_bench(
    llm: &Model,
    tok: &Tokenizer,
    backend: &CpuBackend,
    model_name: &str,
    ssm: Option<(&str, &Model)>,
    early_exit_layers: usize,
    tokens: usize,
    temperatures: &[f32],
    only: &[String],
) -> Result<SuiteBench> {
    use arbor_engine::spec::{self, SpecParams};
    let ssm_name = ssm.map(|s| s.0.to_string());
    let mut configs: Vec<SuiteConfig> = Vec::new();
    let ee = DraftSpec::EarlyExit(early_exit_layers);
    let ng = DraftSpec::Ngram(3);
    let rc = DraftSpec::Recycle {
        k: recycle::DEFAULT_K,
        prompt_logits: false,
    };
    let tree = "1,1,3,1,1,1,1,1";
    if let Some(n) = &ssm_name {
        let m = || DraftSpec::Model(n.clone());
        configs.push(SuiteConfig::new("ssm chain k=4", vec![m()], "1,1,1,1", 4)?);
        configs.push(SuiteConfig::new(
            "ssm tree [1,1,3,1,1,1,1,1]",
            vec![m()],
            tree,
            20,
        )?);
        configs.push(SuiteConfig::new(
            "ssm + ngram + early-exit",
            vec![m(), ng.clone(), ee.clone()],
            tree,
            60,
        )?);
        configs.push(SuiteConfig::new(
            "ssm dynamic:16",
            vec![m()],
            "dynamic:16",
            16,
        )?);
    }
    configs.push(SuiteConfig::new(
        format!("early-exit:{early_exit_layers} chain k=4"),
        vec![ee.clone()],
        "1,1,1,1",
        4,
    )?);
    // Budget 8 (about one chain) suits greedy verification best, 16 (room for a second and
    // third branch) sampling.
    let chain8 = "1,1,1,1,1,1,1,1";
    for budget in [8, 16] {
        configs.push(SuiteConfig::new(
            format!("prompt lookup, budget {budget}"),
            vec![ng.clone()],
            chain8,
            budget,
        )?);
    }
    configs
        .push(SuiteConfig::new("prompt lookup adaptive", vec![ng.clone()], chain8, 64)?.adaptive());
    configs.push(SuiteConfig::new(
        "SPACE training-free k=4",
        vec![DraftSpec::Space { k: 4, mask: None }],
        "1,1,1,1",
        4,
    )?);
    // Token Recycling: the template's best `budget` nodes (the paper's 80-node tree at 80).
    for budget in [4, 8, 16] {
        configs.push(SuiteConfig::new(
            format!("recycle, budget {budget}"),
            vec![rc.clone()],
            chain8,
            budget,
        )?);
    }
    configs.push(SuiteConfig::new("recycle adaptive", vec![rc.clone()], chain8, 64)?.adaptive());
    configs.push(SuiteConfig::new(
        "recycle + ngram, budget 16",
        vec![rc.clone(), ng.clone()],
        chain8,
        16,
    )?);
    configs.push(
        SuiteConfig::new(
            "recycle + ngram adaptive",
            vec![rc.clone(), ng.clone()],
            chain8,
            64,
        )?
        .adaptive(),
    );
    // Prompt lookup where the prompt has a match, Token Recycling with the whole budget where
    // it has none (the merge above splits every step's budget between the two).
    configs.push(
        SuiteConfig::new(
            "ngram else recycle adaptive",
            vec![DraftSpec::NgramElse(3, Box::new(rc.clone()))],
            chain8,
            64,
        )?
        .adaptive(),
    );
    let mut shared = SuiteConfig::new("recycle shared, budget 8", vec![rc.clone()], chain8, 8)?;
    shared.shared_recycle = true;
    configs.push(shared);
    configs.retain(|c| only.is_empty() || only.iter().any(|o| c.name.contains(o.as_str())));

    let mut classes: Vec<&str> = SUITE_PROMPTS.iter().map(|p| p.0).collect();
    let mut prompts: Vec<Vec<u32>> = SUITE_PROMPTS
        .iter()
        .map(|(_, t)| tok.encode_prompt(t))
        .collect::<Result<_>>()?;
    for (class, text) in UNSEEN_PROMPTS {
        let chat = tok.apply_chat_template(&[arbor_engine::ChatMessage::new("user", text)], true);
        prompts.push(tok.encode_prompt(&chat)?);
        classes.push(class);
    }
    let mut rows = Vec::new();
    let bar = crate::progress::steps(
        (temperatures.len() * (configs.len() + 1)) as u64,
        "bench spec --suite: configurations",
    );
    for &temp in temperatures {
        bar.inc(1);
        let params = GenerateParams {
            max_tokens: tokens,
            ignore_eos: true,
            min_tokens: 0,
            sampling: SamplingParams {
                temperature: temp,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 7,
            },
            ..GenerateParams::default()
        };
        // Incremental baseline.
        let mut base_out = Vec::new();
        let mut base = Vec::new();
        for p in &prompts {
            let o = generate(llm, backend, tok, p, &params, |_| {})?;
            base.push(Sums {
                secs: o.decode_secs,
                tokens: o.decode_steps,
                ..Sums::default()
            });
            base_out.push(o.tokens);
        }
        let base_classes = by_class(&classes, &base);
        let mut base_all = Sums::default();
        base.iter().for_each(|s| base_all.add(s));
        rows.push(SuiteRow {
            config: "incremental".into(),
            temperature: temp,
            decode_tok_s: base_all.tok_s(),
            mean_accepted: 0.0,
            speedup: 1.0,
            classes: base_classes
                .iter()
                .map(|(c, s)| ClassRow {
                    class: c.clone(),
                    decode_tok_s: s.tok_s(),
                    mean_accepted: 0.0,
                    speedup: 1.0,
                })
                .collect(),
            equal: (temp == 0.0).then_some(true),
            drafter_contract_failures: 0,
        });
        for cfg in &configs {
            bar.inc(1);
            let name = &cfg.name;
            let ssm_models: Vec<&Model> = ssm.iter().map(|s| s.1).collect();
            let mut per_prompt = Vec::new();
            let (mut equal, mut broken) = (true, 0usize);
            let matrix = std::sync::Arc::new(std::sync::Mutex::new(RecycleMatrix::new(
                llm.config.vocab_size,
                recycle::DEFAULT_K,
            )?));
            let template = std::sync::Arc::new(RecycleTemplate::paper());
            for (i, p) in prompts.iter().enumerate() {
                let mut ds = build_drafters(&cfg.specs, llm, &ssm_models, backend, &cfg.shape, 1)?;
                if cfg.shared_recycle {
                    for (d, spec) in ds.iter_mut().zip(&cfg.specs) {
                        if matches!(spec, DraftSpec::Recycle { .. }) {
                            *d = Box::new(RecycleDrafter::shared(
                                std::sync::Arc::clone(&matrix),
                                std::sync::Arc::clone(&template),
                            )?);
                        }
                    }
                }
                let mut refs: Vec<&mut dyn Drafter> = ds
                    .iter_mut()
                    .map(|d| d.as_mut() as &mut dyn Drafter)
                    .collect();
                let sp = SpecParams {
                    budget: cfg.budget,
                    mode: None,
                    adaptive: cfg.adaptive,
                    step_cost: None,
                };
                let o = spec::generate(llm, backend, tok, p, &params, &sp, &mut refs, |_| {})?;
                per_prompt.push(Sums {
                    secs: o.output.decode_secs,
                    tokens: o.output.decode_steps,
                    accepted: o.metrics.accepted,
                    steps: o.metrics.steps,
                });
                broken += o.metrics.drafter_contract_failures;
                if temp == 0.0 && o.output.tokens != base_out[i] {
                    let at = o
                        .output
                        .tokens
                        .iter()
                        .zip(&base_out[i])
                        .position(|(a, b)| a != b)
                        .unwrap_or(o.output.tokens.len().min(base_out[i].len()));
                    eprintln!(
                        "'{name}', prompt {i}: greedy output differs from incremental output at \
                         token {at}: {:?} vs {:?}",
                        &o.output.tokens[at..(at + 4).min(o.output.tokens.len())],
                        &base_out[i][at..(at + 4).min(base_out[i].len())]
                    );
                    equal = false;
                }
            }
            let equal = (temp == 0.0).then_some(equal);
            if equal == Some(false) {
                return Err(EngineError::InvalidArgument(format!(
                    "greedy output of '{name}' differs from incremental output"
                )));
            }
            let mut all = Sums::default();
            per_prompt.iter().for_each(|s| all.add(s));
            let classes = by_class(&classes, &per_prompt)
                .into_iter()
                .zip(&base_classes)
                .map(|((c, s), (_, b))| ClassRow {
                    class: c,
                    decode_tok_s: s.tok_s(),
                    mean_accepted: s.mean_accepted(),
                    speedup: s.tok_s() / b.tok_s().max(1e-9),
                })
                .collect();
            rows.push(SuiteRow {
                config: name.clone(),
                temperature: temp,
                decode_tok_s: all.tok_s(),
                mean_accepted: all.mean_accepted(),
                speedup: all.tok_s() / base_all.tok_s().max(1e-9),
                classes,
                equal,
                drafter_contract_failures: broken,
            });
        }
    }
    bar.finish_and_clear();
    Ok(SuiteBench {
        model: model_name.to_string(),
        draft_model: ssm_name.unwrap_or_else(|| "-".into()),
        threads: backend.threads(),
        tokens,
        cpu: crate::batch_bench::cpu_name(),
        rows,
    })
}

/// The text table of `arbor bench spec --suite`: overall, then speedup and mean accepted tokens
/// per step for each prompt class.
pub fn format_suite(r: &SuiteBench) -> String {
    let classes: Vec<&str> = r
        .rows
        .first()
        .map(|row| row.classes.iter().map(|c| c.class.as_str()).collect())
        .unwrap_or_default();
    let mut s = format!(
        "model: {}  draft model: {}  threads: {}  tokens per prompt: {}  cpu: {}\n\
         per class: speedup / mean accepted tokens per step\n\
         {:<28} {:>4} {:>9} {:>8} {:>8}",
        r.model,
        r.draft_model,
        r.threads,
        r.tokens,
        r.cpu,
        "config",
        "T",
        "tok/s",
        "accepted",
        "speedup",
    );
    for c in &classes {
        s.push_str(&format!(" {c:>16}"));
    }
    s.push_str(&format!(" {:>6} {:>6}\n", "equal", "broken"));
    for row in &r.rows {
        s.push_str(&format!(
            "{:<28} {:>4.1} {:>9.2} {:>8.2} {:>7.2}x",
            row.config, row.temperature, row.decode_tok_s, row.mean_accepted, row.speedup,
        ));
        for c in &row.classes {
            s.push_str(&format!(
                " {:>16}",
                format!("{:.2}x / {:.2}", c.speedup, c.mean_accepted)
            ));
        }
        s.push_str(&format!(
            " {:>6} {:>6}\n",
            match row.equal {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "-",
            },
            row.drafter_contract_failures
        ));
    }
    s
}
