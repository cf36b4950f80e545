//! Engine configuration: the model, KV memory, scheduler limits, the drafters requests may use, and the edge limits every request is checked against.

use std::sync::Arc;
use std::time::Duration;

use arbor_engine::backend::cuda::Device;
use arbor_engine::draft::ngram::NgramDrafter;
use arbor_engine::draft::{
    check_same_vocab, DraftSampling, DraftShape, Drafter, ModelDrafter, RecycleDrafter,
    RecycleMatrix, RecycleTemplate,
};
use arbor_engine::sched::SchedConfig;
use arbor_engine::{CpuBackend, KvPool, Model, Tokenizer};

use crate::error::{Result, ServeError};

/// What a drafter factory knows about the request it builds a drafter for.
#[derive(Clone, Copy, Debug)]
pub struct DraftContext {
    /// The request's sampling seed (drafters that sample derive theirs from it).
    pub seed: u64,
    /// Most draft depth the request allows.
    pub depth: usize,
    pub vocab: usize,
}

type BuildFn = dyn Fn(&DraftContext) -> arbor_engine::Result<Box<dyn Drafter>> + Send + Sync;

/// [`Drafter::max_nodes`] of the drafter a factory builds for a request, at a draft depth.
type MaxNodesFn = dyn Fn(&DraftContext, usize) -> usize + Send + Sync;

/// Builds one request's instance of a drafter (drafters keep per-sequence state).
#[derive(Clone)]
pub struct DrafterFactory {
    pub name: String,
    /// Top candidates per verified row its drafters want with each commit (Token Recycling;
    /// 0: none).
    pub candidates: usize,
    /// Top candidates per prompt row its drafters want from the prefill (0: none).
    pub prompt_candidates: usize,
    build: Arc<BuildFn>,
    max_nodes: Arc<MaxNodesFn>,
}

impl std::fmt::Debug for DrafterFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrafterFactory")
            .field("name", &self.name)
            .finish()
    }
}

impl DrafterFactory {
    pub fn new(
        name: impl Into<String>,
        build: impl Fn(&DraftContext) -> arbor_engine::Result<Box<dyn Drafter>> + Send + Sync + 'static,
    ) -> DrafterFactory {
        DrafterFactory {
            name: name.into(),
            candidates: 0,
            prompt_candidates: 0,
            build: Arc::new(build),
            max_nodes: Arc::new(|_: &DraftContext, _| usize::MAX),
        }
    }

    /// Say how many draft nodes the built drafters' trees hold at most, by request and draft
    /// depth ([`Drafter::max_nodes`]; without it, as many as the budget).
    pub fn with_max_nodes(
        mut self,
        f: impl Fn(&DraftContext, usize) -> usize + Send + Sync + 'static,
    ) -> DrafterFactory {
        self.max_nodes = Arc::new(f);
        self
    }

    /// Most draft nodes the drafter built for `cx` proposes at most `max_depth` deep.
    pub fn max_nodes(&self, cx: &DraftContext, max_depth: usize) -> usize {
        (self.max_nodes)(cx, max_depth)
    }

    /// Token Recycling (`recycle[:K]`): every request drafts from an adjacency matrix of `k`
    /// successors per token, refilled from the top-`k` candidates of its verified rows. With
    /// `shared`, one matrix serves every request of the server (one request's candidates become
    /// other requests' draft guesses, checked by verification like any guess; never output).
    /// Each request's drafter starts from its prompt's own successors, and with `prompt_logits`
    /// also from every prompt row's top-`k` (the output head over the whole prompt).
    pub fn recycle(
        vocab: usize,
        k: usize,
        shared: bool,
        prompt_logits: bool,
    ) -> Result<DrafterFactory> {
        let template = Arc::new(RecycleTemplate::paper());
        let matrix = Arc::new(std::sync::Mutex::new(
            RecycleMatrix::new(vocab, k).map_err(ServeError::from)?,
        ));
        let bound = Arc::clone(&template);
        let mut f = DrafterFactory::new("recycle", move |_: &DraftContext| {
            let matrix = if shared {
                Arc::clone(&matrix)
            } else {
                Arc::new(std::sync::Mutex::new(RecycleMatrix::new(vocab, k)?))
            };
            Ok(Box::new(
                RecycleDrafter::shared(matrix, Arc::clone(&template))?
                    .with_prompt_logits(prompt_logits),
            ) as Box<dyn Drafter>)
        })
        .with_max_nodes(move |_, depth| bound.nodes_within(depth));
        f.candidates = k;
        f.prompt_candidates = if prompt_logits { k } else { 0 };
        Ok(f)
    }

    /// Prompt lookup over suffixes of up to `max_n` tokens (`ngram[:N]`), proposing up to the
    /// request's depth.
    pub fn ngram(max_n: usize) -> Result<DrafterFactory> {
        let d = NgramDrafter::default();
        NgramDrafter::new(max_n, 1, 1, d.max_matches).map_err(ServeError::from)?;
        let drafter =
            move |cx: &DraftContext| NgramDrafter::new(max_n, 1, cx.depth.max(1), d.max_matches);
        Ok(DrafterFactory::new("ngram", move |cx: &DraftContext| {
            Ok(Box::new(drafter(cx)?) as Box<dyn Drafter>)
        })
        .with_max_nodes(move |cx, depth| drafter(cx).map_or(usize::MAX, |d| d.max_nodes(depth))))
    }

    /// A model drafter for every request: the first `layers` layers of `model` (all of them for
    /// a small speculative model), children picked by the drafter's top-k along `shape`
    /// (lossless under greedy and MSS verification). Every instance keeps its K/V in one pool
    /// of at most `kv_bytes`, so the Drafter actor drafts all of a step's requests in one forward
    /// pass per tree depth; the passes run on a backend of `threads` threads (0: all cores).
    pub fn model(
        name: impl Into<String>,
        model: Arc<Model>,
        layers: usize,
        vocab_limit: usize,
        shape: DraftShape,
        threads: usize,
        kv_bytes: usize,
    ) -> Result<DrafterFactory> {
        let name = name.into();
        let backend = Arc::new(CpuBackend::new(threads).map_err(ServeError::from)?);
        let block = KvPool::block_bytes(model.config.kv_dim(), layers).max(1);
        let pool = KvPool::elastic(&model.config, layers, (kv_bytes / block).max(4));
        let label = name.clone();
        let bound = shape.clone();
        let build = move |seed: u64| -> arbor_engine::Result<Box<dyn Drafter>> {
            let d = ModelDrafter::new(
                name.clone(),
                Arc::clone(&model),
                Arc::clone(&backend),
                layers,
                vocab_limit,
                shape.clone(),
                DraftSampling::TopK,
                seed,
            )?;
            Ok(Box::new(d.in_pool(&pool)?))
        };
        // Built once here (layers, shape, pool checked), so a bad configuration fails at start-up.
        build(0).map_err(ServeError::from)?;
        Ok(
            DrafterFactory::new(label, move |cx: &DraftContext| build(cx.seed))
                .with_max_nodes(move |_, depth| bound.max_nodes_within(depth)),
        )
    }

    /// Early-exit self-speculation (`early-exit:L`): the LLM's own first `layers` layers.
    pub fn early_exit(
        llm: &Arc<Model>,
        layers: usize,
        shape: DraftShape,
        threads: usize,
        kv_bytes: usize,
    ) -> Result<DrafterFactory> {
        let vocab = llm.config.vocab_size;
        DrafterFactory::model(
            format!("early-exit:{layers}"),
            Arc::clone(llm),
            layers,
            vocab,
            shape,
            threads,
            kv_bytes,
        )
    }

    /// A small speculative model `draft` (named `name`) drafting for `llm`; their token tables
    /// must be identical.
    pub fn ssm(
        name: impl Into<String>,
        draft: Arc<Model>,
        llm: &Model,
        shape: DraftShape,
        threads: usize,
        kv_bytes: usize,
    ) -> Result<DrafterFactory> {
        check_same_vocab(llm, &draft).map_err(ServeError::from)?;
        let layers = draft.config.n_layers;
        DrafterFactory::model(
            name,
            draft,
            layers,
            llm.config.vocab_size,
            shape,
            threads,
            kv_bytes,
        )
    }

    /// Parse a `--draft` value the server can run without models: `ngram[:N]` (model drafters:
    /// [`DrafterFactory::early_exit`], [`DrafterFactory::ssm`]).
    pub fn parse(spec: &str) -> Result<DrafterFactory> {
        let (name, arg) = spec.split_once(':').unwrap_or((spec, ""));
        match name {
            "ngram" => {
                let n = if arg.is_empty() {
                    NgramDrafter::default().max_n
                } else {
                    arg.parse().map_err(|_| {
                        ServeError::invalid(format!("ngram:N needs a number, got '{arg}'"))
                    })?
                };
                DrafterFactory::ngram(n)
            }
            _ => Err(ServeError::invalid(format!(
                "not a training-free drafter: '{spec}' (ngram[:N]; model drafters are built \
                 with DrafterFactory::early_exit or ::ssm)"
            ))),
        }
    }

    pub fn build(&self, cx: &DraftContext) -> arbor_engine::Result<Box<dyn Drafter>> {
        (self.build)(cx)
    }
}

/// Edge limits (each request is checked against them before it is queued).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most requests waiting for admission at once (more: `overloaded`).
    pub max_waiting: usize,
    /// Most prompt tokens (0: the model's context).
    pub max_prompt_tokens: usize,
    /// Most tokens one request may generate.
    pub max_tokens: usize,
    /// Most stop strings per request.
    pub max_stop: usize,
    /// Every request ends (finish reason `deadline`) at most this long after submission.
    pub max_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_waiting: 256,
            max_prompt_tokens: 0,
            max_tokens: 4096,
            max_stop: 8,
            max_deadline: Duration::from_secs(600),
        }
    }
}

/// Everything an engine starts from.
#[derive(Clone)]
pub struct EngineConfig {
    pub model: Arc<Model>,
    pub tokenizer: Arc<Tokenizer>,
    /// Compute threads (0: all cores).
    pub threads: usize,
    /// Where the verification passes run (`cuda:N`: the LLM and the K/V values on a GPU; the
    /// host keeps the block bookkeeping and runs the drafters).
    pub device: Device,
    /// Bytes of KV cache (f16 blocks); `None`: a quarter of the available memory, 256 MiB to 4 GiB.
    pub kv_memory: Option<usize>,
    pub sched: SchedConfig,
    /// Drafters requests speculate with (each request gets its own instances).
    pub drafters: Vec<DrafterFactory>,
    /// Most draft nodes per request and step.
    pub spec_budget: usize,
    /// Most draft depth per request and step.
    pub spec_depth: usize,
    pub limits: Limits,
}

impl EngineConfig {
    pub fn new(model: Arc<Model>, tokenizer: Arc<Tokenizer>) -> EngineConfig {
        EngineConfig {
            model,
            tokenizer,
            threads: 0,
            device: Device::Cpu,
            kv_memory: None,
            sched: SchedConfig::default(),
            drafters: Vec::new(),
            spec_budget: 64,
            spec_depth: 8,
            limits: Limits::default(),
        }
    }

    /// Load a GGUF model and its tokenizer.
    pub fn open(path: &std::path::Path) -> Result<EngineConfig> {
        let model = Model::open(path).map_err(ServeError::from)?;
        let tok = Tokenizer::from_gguf(model.gguf()).map_err(ServeError::from)?;
        Ok(EngineConfig::new(Arc::new(model), Arc::new(tok)))
    }

    pub(crate) fn kv_bytes(&self) -> usize {
        self.kv_memory.unwrap_or_else(default_kv_memory)
    }

    /// Blocks of the LLM's KV pool: as many as `kv_bytes` holds (at least one).
    pub(crate) fn kv_blocks(&self) -> usize {
        let c = &self.model.config;
        (self.kv_bytes() / KvPool::block_bytes(c.kv_dim(), c.n_layers).max(1)).max(1)
    }
}

/// A quarter of `MemAvailable`, clamped to 256 MiB..4 GiB (1 GiB when unknown).
pub fn default_kv_memory() -> usize {
    const GIB: usize = 1 << 30;
    let avail = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<usize>().ok())
            .map(|kb| kb * 1024)
    });
    avail.map_or(GIB, |b| (b / 4).clamp(GIB / 4, 4 * GIB))
}
