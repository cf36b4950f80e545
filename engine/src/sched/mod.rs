//! Continuous batching (iteration-level scheduling, Orca / vLLM): every step admits waiting requests while KV blocks allow, runs chunked prefill and decode rows of all running requests in one `forward_batch`, and preempts (recomputes later) the newest request when blocks run out.
//!
//! A request's output depends only on its prompt, its settings and its seed: its rows get the
//! bits they would get alone (the batch kernels are row-invariant), its sampler is its own, and
//! a preempted request keeps its tokens and sampler and recomputes its K/V when resumed.

pub mod adaptive;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

pub use adaptive::{
    catch_up_weight, choose_depths, drafting_pays, nodes_upto, row_costs, useful_budget,
    Acceptance, DepthOptions, DraftBackoff, GainCalibration, StepBase, StepCost,
};

use crate::backend::cuda::DeviceForward;
use crate::backend::{Backend, BatchMask};
use crate::draft::{Drafter, PassCandidates};
use crate::error::{EngineError, Result};
use crate::generate::{FinishReason, GenerateParams, ResponseFormat, TokenSink};
use crate::kv::{KvCache, KvPool, BLOCK_SLOTS};
use crate::model::{Model, SeqBatch};
use crate::sample::json::JsonVocab;
use crate::sample::penalty::PenaltyHistory;
use crate::sample::verify::{Verifier, VerifyMode, VerifyOutcome};
use crate::sample::Sampler;
use crate::shared::Shared;
use crate::spec::{draft_trees, DraftJobRef, SpecMetrics};
use crate::tokenizer::Tokenizer;
use crate::tree::{MaskedTree, TokenTree, TreeMask};

/// Limits of one scheduler step.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    /// Most rows (prefill and decode tokens together) one forward pass runs.
    pub max_step_tokens: usize,
    /// Most requests running at once.
    pub max_running: usize,
    /// Longest prefill chunk one request gets per step (a long prompt does not stall the
    /// running requests' decoding).
    pub prefill_chunk: usize,
    /// Share the K/V blocks of equal prompt prefixes between requests.
    pub prefix_caching: bool,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            max_step_tokens: 256,
            max_running: 64,
            prefill_chunk: 64,
            prefix_caching: true,
        }
    }
}

/// What a step did for one request.
#[derive(Debug)]
pub struct StepEvent {
    pub id: u64,
    /// Tokens generated this step (at most one without speculation).
    pub tokens: Vec<u32>,
    /// Their log-probabilities under the model, one per token, when the request asked
    /// ([`GenerateParams::logprobs`]); empty otherwise.
    pub logprobs: Vec<f32>,
    /// Per token, its `GenerateParams::top_logprobs` most likely alternatives (token,
    /// log-probability) when the request asked; empty otherwise.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Text that became final this step.
    pub text: String,
    /// The prompt's log-probabilities, on the request's first event with tokens when it asked
    /// ([`GenerateParams::prompt_logprobs`]).
    pub prompt: Option<Box<PromptScores>>,
    /// Set on the request's last event.
    pub finish: Option<Finish>,
}

/// A prompt scored by the model: each token's log-probability given the tokens before it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptScores {
    /// The prompt's tokens.
    pub tokens: Vec<u32>,
    /// `logprobs[i]`: token `i + 1`'s (the first token has none).
    pub logprobs: Vec<f32>,
    /// `top_logprobs[i]`: the row's most likely tokens before token `i + 1`, most likely first
    /// (empty lists when no alternatives were asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Alternatives asked for per row ([`GenerateParams::prompt_logprobs`]).
    pub alternatives: usize,
}

/// How a request ended.
#[derive(Debug)]
pub enum Finish {
    Done {
        reason: FinishReason,
        /// Every generated token (EOS included when it ended generation).
        tokens: Vec<u32>,
        text: String,
        prompt_tokens: usize,
        /// Prompt tokens whose K/V came from the prefix cache at the first admission.
        cached_prompt_tokens: usize,
        preemptions: usize,
        /// Speculation counters of a speculating request.
        spec: Option<SpecMetrics>,
    },
    /// The request cannot run (e.g. it needs more KV blocks than the whole pool).
    Failed(EngineError),
}

/// What a cancelled request had done before [`Scheduler::cancel`] dropped it (the counters of
/// [`Finish::Done`]; its tokens are those its events carried).
#[derive(Clone, Debug, Default)]
pub struct CancelledStats {
    /// Prompt tokens whose K/V came from the prefix cache at the first admission (0 if never
    /// admitted).
    pub cached_prompt_tokens: usize,
    pub preemptions: usize,
    /// Speculation counters of a speculating request.
    pub spec: Option<SpecMetrics>,
}

/// Scheduler counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct SchedStats {
    pub steps: u64,
    pub rows: u64,
    pub preemptions: u64,
    /// Admissions put off because the request's prompt shares full blocks with a prompt still
    /// being computed (counted once per step it waited).
    pub prefix_waits: u64,
    /// Most blocks in use after any step.
    pub peak_blocks: usize,
    /// Drafters dropped from their request after an error, a panic or an invalid tree.
    pub drafter_failures: u64,
    /// Seconds inside the steps' forward passes.
    pub forward_secs: f64,
    /// Seconds of whole steps (planning, drafting, the pass, verification, streaming).
    pub step_secs: f64,
}

/// A drafter that failed and was dropped from its request (the request goes on without it).
#[derive(Clone, Debug)]
pub struct DrafterFailure {
    pub id: u64,
    pub drafter: String,
    pub message: String,
}

/// How a speculating request sizes its trees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecPolicy {
    /// Verify the drafters' whole tree (up to the budget) every step.
    Fixed,
    /// Verify the depth that maximises the batch's expected tokens per second
    /// ([`adaptive::choose_depths`]); plain decoding when drafts do not pay.
    Adaptive,
}

/// A request's speculation settings.
pub struct RequestSpec<'a> {
    /// The request's own drafters (their trees are merged).
    pub drafters: Vec<Box<dyn Drafter + 'a>>,
    /// Most draft nodes per step.
    pub budget: usize,
    pub policy: SpecPolicy,
    /// Verification rule; `None` = greedy for greedy sampling, MSS otherwise.
    pub mode: Option<VerifyMode>,
    /// The request's trees are drafted outside the scheduler: [`Scheduler::begin_step`] lists
    /// what to draft, [`Scheduler::finish_step`] takes the trees (`drafters` stays empty), and
    /// [`Scheduler::take_commits`] says what was accepted.
    pub external: bool,
    /// Top candidates per verified row that the outside drafters want with each commit
    /// (Token Recycling; 0: none). In-process drafters say so themselves
    /// ([`Drafter::candidates_wanted`]).
    pub candidates: usize,
    /// Top candidates per prompt row the outside drafters want (a warm start; 0: none).
    pub prompt_candidates: usize,
    /// Outside drafters: the most draft nodes their merged tree holds when at most `d` deep, at
    /// index `d` (the last entry for deeper trees); empty: no bound but the budget. A step
    /// reserves rows for the tree by it (in-process drafters say so themselves,
    /// [`Drafter::max_nodes`]).
    pub max_nodes_by_depth: Vec<usize>,
}

/// A tree to draft outside the scheduler for one request of a planned step.
#[derive(Clone, Debug)]
pub struct DraftJob {
    pub id: u64,
    /// The request's tokens; the tree's root is the last.
    pub tokens: Vec<u32>,
    /// Most draft nodes.
    pub budget: usize,
    /// Most draft depth.
    pub max_depth: usize,
    /// What each further verified row costs, in plain passes (adaptive requests; empty
    /// otherwise): for the drafters' [`Drafter::set_row_costs`].
    pub row_costs: Vec<f64>,
}

/// What verification accepted for a request drafted outside (drafters follow with it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Commit {
    pub id: u64,
    /// Accepted draft tokens after the root, in order.
    pub accepted: Vec<u32>,
    /// The next root.
    pub bonus: u32,
    /// The top candidates of the verification pass's rows, when the request's outside drafters
    /// want them ([`RequestSpec::candidates`]).
    pub candidates: Option<PassCandidates>,
    /// A prefill chunk's candidates only (Token Recycling's warm start): nothing was verified,
    /// so drafters observe the candidates and do not accept (`accepted` and `bonus` mean nothing).
    pub prefill: bool,
}

/// A step between [`Scheduler::begin_step`] and [`Scheduler::finish_step`].
pub struct PlannedStep {
    slots: Vec<Slot>,
    events: Vec<StepEvent>,
    /// Trees to draft outside (requests with `external` speculation).
    pub jobs: Vec<DraftJob>,
    /// When the step began (its planning included in the step's seconds).
    started: Instant,
}

struct SpecState<'a> {
    drafters: Vec<Box<dyn Drafter + 'a>>,
    budget: usize,
    policy: SpecPolicy,
    verifier: Verifier,
    acceptance: Acceptance,
    /// Depth verified at the request's last step (adaptive).
    last_depth: usize,
    /// Steps without drafting while drafts do not pay (adaptive).
    backoff: DraftBackoff,
    /// Seconds of in-process drafting per drafted step (moving average; 0 when drafted outside).
    draft_secs: f64,
    /// Whether that drafting costs next to nothing ([`adaptive::CHEAP_DRAFT`]): drafts are then
    /// asked for at full depth.
    cheap_drafting: bool,
    metrics: SpecMetrics,
    external: bool,
    /// Candidates per row the outside drafters want, of verified rows and of prompt rows.
    candidates: usize,
    prompt_candidates: usize,
    /// [`RequestSpec::max_nodes_by_depth`].
    max_nodes_by_depth: Vec<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// `left` tokens to feed before decoding; the last chunk's logits give the first token
    /// when nothing was generated yet.
    Prefill { left: usize, logits_at_end: bool },
    /// The cache holds every token but the root (the last one).
    Decode,
}

/// One request's part of a step.
struct Slot {
    idx: usize,
    /// The request's id (indices are re-resolved by id when a step is finished later).
    id: u64,
    /// Prefill rows (0: a decode slot).
    prefill: usize,
    logits: bool,
    /// Most draft nodes this step: the drafters' budget.
    tree_cap: usize,
    /// Most draft nodes the drafters' tree holds at this step's depth, whatever the budget
    /// (`usize::MAX`: unbounded): rows are reserved for [`Slot::tree_rows`].
    tree_bound: usize,
    /// The tree to verify (root first), for speculating requests.
    tree: Option<TokenTree>,
    /// `tree`'s attention mask when the tree merger built it (else built from `tree`).
    tree_mask: Option<TreeMask>,
    /// The drafters' whole proposal (acceptance is measured on it).
    proposal: Option<TokenTree>,
    /// `proposal`'s mask from the tree merger (trees drafted outside the scheduler).
    proposal_mask: Option<TreeMask>,
    /// A prefill chunk's top candidates per row for the request's drafters (Token Recycling's
    /// warm start; 0: none, and only the last row's logits when `logits`).
    candidates: usize,
    /// A prefill chunk of a prompt being scored: every row's logits (scored after the pass,
    /// then cut to the rows the step reads).
    score: bool,
    /// Draft tokens the adaptive policy expects `tree` to have accepted (0: no chosen depth).
    promised: f64,
}

impl Slot {
    fn decode(idx: usize, id: u64) -> Slot {
        Slot {
            idx,
            id,
            prefill: 0,
            logits: true,
            tree_cap: 0,
            tree_bound: usize::MAX,
            tree: None,
            tree_mask: None,
            proposal: None,
            proposal_mask: None,
            candidates: 0,
            score: false,
            promised: 0.0,
        }
    }

    /// Rows of a prefill chunk with logits, its last ones: every row where the drafters want
    /// each row's candidates, else the last where the chunk ends the prompt.
    fn prefill_logit_rows(&self) -> usize {
        if self.candidates > 0 || self.score {
            self.prefill
        } else {
            usize::from(self.logits && self.prefill > 0)
        }
    }

    /// Most draft nodes this step's tree has.
    fn tree_rows(&self) -> usize {
        self.tree_cap.min(self.tree_bound)
    }

    /// Most rows this slot can feed.
    fn rows_upper(&self) -> usize {
        if self.prefill > 0 {
            self.prefill
        } else {
            1 + self.tree_rows()
        }
    }
}

/// The rows of one slot.
struct StepInput {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    mask: Option<TreeMask>,
    logit_rows: Vec<usize>,
}

impl SpecState<'_> {
    /// Top candidates per row the request's drafters want, in-process and outside, of a
    /// verification pass's rows or (`prompt`) of the prompt's.
    fn candidates_wanted(&self, prompt: bool) -> usize {
        let own = self.drafters.iter().map(|d| {
            if prompt {
                d.prompt_candidates()
            } else {
                d.candidates_wanted()
            }
        });
        let outside = match (self.external, prompt) {
            (false, _) => 0,
            (true, false) => self.candidates,
            (true, true) => self.prompt_candidates,
        };
        own.max().unwrap_or(0).max(outside)
    }
}

/// Run `f` on each of a request's drafters; one that panics is dropped and reported (`what`
/// names the call), never the request.
fn each_drafter(
    id: u64,
    sp: &mut SpecState<'_>,
    what: &str,
    stats: &mut SchedStats,
    out: &mut Vec<DrafterFailure>,
    mut f: impl FnMut(&mut dyn Drafter),
) {
    let mut broken = Vec::new();
    for (i, d) in sp.drafters.iter_mut().enumerate() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mut **d)));
        if let Err(p) = r {
            broken.push((i, format!("{what} {}", crate::spec::panic_message(&*p))));
        }
    }
    drop_drafters(id, sp, broken, stats, out);
}

/// Drop the drafters that failed (`(index, message)`, indices ascending): a failed drafter may
/// be left in any state, so the request goes on without it.
fn drop_drafters(
    id: u64,
    sp: &mut SpecState<'_>,
    failures: Vec<(usize, String)>,
    stats: &mut SchedStats,
    out: &mut Vec<DrafterFailure>,
) {
    for (i, message) in failures.into_iter().rev() {
        let d = sp.drafters.remove(i);
        stats.drafter_failures += 1;
        out.push(DrafterFailure {
            id,
            drafter: d.name().to_string(),
            message,
        });
    }
}

fn failed(id: u64, e: EngineError) -> StepEvent {
    StepEvent {
        id,
        tokens: Vec::new(),
        logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        text: String::new(),
        prompt: None,
        finish: Some(Finish::Failed(e)),
    }
}

/// One request's state: waiting (no cache) or running (its cache holds a prefix of `tokens`).
struct Request<'a> {
    id: u64,
    /// Prompt then generated tokens: what the cache must hold before the next sample.
    seq: Vec<u32>,
    prompt_len: usize,
    params: GenerateParams,
    sampler: Sampler,
    /// The logit bias and the tokens the penalties weigh (None when the request has neither).
    penalties: Option<PenaltyHistory>,
    /// Text, end-of-generation tokens and stop strings (None without a tokenizer: tokens only).
    sink: Option<TokenSink<'a, fn(&str)>>,
    cache: Option<KvCache>,
    /// Admission order (preemption takes the newest).
    admitted: u64,
    /// The last plan (`Scheduler::plans`) that gave the request rows: decoding requests are
    /// planned least recently served first, so trees verified whole take turns.
    served: u64,
    cached_prompt_tokens: Option<usize>,
    preemptions: usize,
    /// Slots of the request's cache (its tokens plus tree scratch).
    capacity: usize,
    /// Positions generation may fill (prompt + max_tokens, at most the model context and the
    /// pool's slots).
    cap: usize,
    spec: Option<SpecState<'a>>,
    /// The prompt's scores so far, until the first event takes them (requests that asked).
    prompt_scores: Option<Box<PromptScores>>,
}

impl Request<'_> {
    /// Whether prompt rows are still to be scored: the request reads no prefix from the cache
    /// and its prefill chunks return every row's logits.
    fn scoring(&self) -> bool {
        self.prompt_scores
            .as_ref()
            .is_some_and(|s| s.logprobs.len() + 1 < self.prompt_len)
    }

    fn generated(&self) -> usize {
        self.seq.len() - self.prompt_len
    }

    /// Slots admission must find: every token of `seq` (the last one is fed to sample the
    /// next), and one more if generation goes on after that token.
    fn slots_to_admit(&self) -> usize {
        let goes_on = self.generated() + 1 < self.params.max_tokens && self.seq.len() < self.cap;
        self.seq.len() + usize::from(goes_on)
    }

    /// Top candidates per prompt row this request's drafters want (Token Recycling's warm
    /// start).
    fn prompt_candidates(&self) -> usize {
        if self.generated() > 0 {
            return 0; // a preempted request's recompute: its drafters saw the prompt already
        }
        self.spec
            .as_ref()
            .map_or(0, |sp| sp.candidates_wanted(true))
    }

    fn root(&self) -> u32 {
        self.seq[self.seq.len() - 1]
    }

    fn phase(&self) -> Phase {
        let have = self.cache.as_ref().map_or(0, KvCache::len);
        let first = self.generated() == 0;
        let target = if first {
            self.seq.len()
        } else {
            self.seq.len() - 1
        };
        if have < target {
            Phase::Prefill {
                left: target - have,
                logits_at_end: first,
            }
        } else {
            Phase::Decode
        }
    }

    /// Whether the request's tree is verified whole or not at all (fixed trees of a sampling
    /// request: their size is part of its random stream).
    fn whole_tree(&self) -> bool {
        self.spec
            .as_ref()
            .is_some_and(|sp| whole_tree(sp.policy, &self.params.sampling))
    }

    /// Most draft nodes the drafters' tree holds at this step's draft depth, whatever the
    /// budget (`usize::MAX`: no bound known).
    fn tree_bound(&self) -> usize {
        let Some(sp) = &self.spec else {
            return 0;
        };
        let depth = self.draft_depth();
        if sp.external {
            match sp.max_nodes_by_depth.as_slice() {
                [] => usize::MAX,
                t => t[depth.min(t.len() - 1)],
            }
        } else {
            sp.drafters
                .iter()
                .map(|d| d.max_nodes(depth))
                .fold(0, usize::saturating_add)
        }
    }

    /// Deepest draft this step may verify: no token past `max_tokens` or the position cap.
    fn max_depth(&self) -> usize {
        let remaining = self.params.max_tokens.saturating_sub(self.generated());
        let committed = self.seq.len() - 1;
        remaining
            .saturating_sub(1)
            .min(self.cap.saturating_sub(1 + committed))
    }

    /// Deepest draft the drafters are asked for this step.
    fn draft_depth(&self) -> usize {
        let max_depth = self.max_depth();
        match &self.spec {
            // Two depths past the last verified one: room to grow, one depth to learn from
            // (drafting that costs next to nothing: the whole depth).
            Some(sp) if sp.policy == SpecPolicy::Adaptive && !sp.cheap_drafting => {
                max_depth.min(sp.last_depth.saturating_add(2))
            }
            _ => max_depth,
        }
    }

    /// Most draft nodes this step (0 without speculation).
    fn tree_cap(&self) -> usize {
        let Some(sp) = &self.spec else {
            return 0;
        };
        if self.max_depth() == 0 || (sp.policy == SpecPolicy::Adaptive && sp.backoff.skips_next()) {
            return 0;
        }
        let room = self
            .capacity
            .saturating_sub(self.cache.as_ref().map_or(0, KvCache::len) + 1);
        sp.budget.min(room)
    }
}

/// One slot's draw of a step, made ahead of the step's bookkeeping ([`Scheduler::draw_rows`]).
enum Drawn {
    Sampled(u32),
    Verified(Result<VerifyOutcome>),
}

/// What a slot's draw needs: its request's sampler or verifier, and its logits.
enum DrawWork<'s> {
    Sample {
        sampler: &'s mut Sampler,
        logits: &'s [f32],
    },
    Verify {
        verifier: &'s mut Verifier,
        tree: &'s TokenTree,
        logits: &'s [f32],
    },
}

impl DrawWork<'_> {
    fn draw(self, vocab: usize) -> Drawn {
        match self {
            DrawWork::Sample { sampler, logits } => Drawn::Sampled(sampler.sample(logits)),
            DrawWork::Verify {
                verifier,
                tree,
                logits,
            } => Drawn::Verified(verifier.verify(tree, logits, vocab)),
        }
    }
}

/// Prefill rows per chunk of a request whose drafters want every row's candidates (bounds the
/// chunk's `[rows, vocab]` logits).
const CANDIDATE_PREFILL_ROWS: usize = 64;

/// The iteration-level scheduler over one model and one KV pool.
pub struct Scheduler<'a> {
    model: Shared<'a, Model>,
    tokenizer: Option<Shared<'a, Tokenizer>>,
    pool: KvPool,
    config: SchedConfig,
    waiting: VecDeque<Request<'a>>,
    running: Vec<Request<'a>>,
    next_id: u64,
    admissions: u64,
    /// Plans made (`begin_step`).
    plans: u64,
    stats: SchedStats,
    /// Forward-pass cost by row count (adaptive speculation; kept current by every step).
    cost: Option<StepCost>,
    /// Keep the cost model as set (tests; benchmarks of a given cost curve).
    pub freeze_step_cost: bool,
    /// How far adaptive requests' acceptance estimates over-promise: the hurdle their draft
    /// tokens clear ([`GainCalibration`]).
    gains: GainCalibration,
    /// Failures not yet taken by [`Scheduler::take_drafter_failures`].
    drafter_failures: Vec<DrafterFailure>,
    /// Outcomes of externally drafted requests not yet taken by [`Scheduler::take_commits`].
    commits: Vec<Commit>,
    /// Where the forward passes run when not on the backend: a device keeping the K/V of the
    /// pool's blocks ([`Scheduler::set_device`]).
    device: Option<Arc<dyn DeviceForward>>,
    /// The vocabulary JSON mode reads where the tokenizer's is not used
    /// ([`Scheduler::set_json_vocab`]).
    json_vocab: Option<Arc<JsonVocab>>,
}

impl<'a> Scheduler<'a> {
    /// Without a tokenizer requests produce tokens only: no text, no stop strings, no EOS.
    /// Borrow the model (`&Model`) for a scoped scheduler, or share it (`Arc<Model>`) for one
    /// that lives on its own thread ([`Scheduler::shared`]).
    pub fn new(
        model: &'a Model,
        tokenizer: Option<&'a Tokenizer>,
        pool: KvPool,
        config: SchedConfig,
    ) -> Result<Scheduler<'a>> {
        Scheduler::with(model.into(), tokenizer.map(Shared::from), pool, config)
    }

    /// A scheduler that owns its (shared) model and tokenizer: `'static`, so it can live in
    /// an actor or on another thread.
    pub fn shared(
        model: Arc<Model>,
        tokenizer: Option<Arc<Tokenizer>>,
        pool: KvPool,
        config: SchedConfig,
    ) -> Result<Scheduler<'static>> {
        Scheduler::with(model.into(), tokenizer.map(Shared::from), pool, config)
    }

    fn with(
        model: Shared<'a, Model>,
        tokenizer: Option<Shared<'a, Tokenizer>>,
        pool: KvPool,
        config: SchedConfig,
    ) -> Result<Scheduler<'a>> {
        if pool.kv_dim() != model.config.kv_dim() || pool.n_layers() != model.config.n_layers {
            return Err(EngineError::InvalidArgument(
                "the KV pool was made for another model".into(),
            ));
        }
        if config.max_step_tokens == 0 || config.max_running == 0 || config.prefill_chunk == 0 {
            return Err(EngineError::InvalidArgument(
                "scheduler limits must be positive".into(),
            ));
        }
        Ok(Scheduler {
            model,
            tokenizer,
            pool,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            admissions: 0,
            plans: 0,
            stats: SchedStats::default(),
            cost: None,
            freeze_step_cost: false,
            gains: GainCalibration::new(),
            drafter_failures: Vec::new(),
            commits: Vec::new(),
            device: None,
            json_vocab: None,
        })
    }

    /// The vocabulary JSON-mode requests read (by default the tokenizer's; a scheduler
    /// without a tokenizer refuses them without one).
    pub fn set_json_vocab(&mut self, vocab: Arc<JsonVocab>) {
        self.json_vocab = Some(vocab);
    }

    /// Run every forward pass (and K/V commit) on `device` instead of the backend passed to
    /// [`Scheduler::step`] (which in-process model drafters still use). The pool's blocks keep
    /// their ids on the device; the device must hold at least as many.
    pub fn set_device(&mut self, device: Arc<dyn DeviceForward>) {
        self.device = Some(device);
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The forward-pass cost model adaptive speculation plans with (e.g. from
    /// [`StepCost::calibrate`]); every step's measured time updates it.
    pub fn set_step_cost(&mut self, cost: StepCost) {
        self.cost = Some(cost);
    }

    pub fn step_cost(&self) -> Option<&StepCost> {
        self.cost.as_ref()
    }

    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    /// Drafter failures since the last call (for logging; counted in [`SchedStats`]).
    pub fn take_drafter_failures(&mut self) -> Vec<DrafterFailure> {
        std::mem::take(&mut self.drafter_failures)
    }

    /// What verification accepted for externally drafted requests since the last call.
    pub fn take_commits(&mut self) -> Vec<Commit> {
        std::mem::take(&mut self.commits)
    }

    /// The model this scheduler runs.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// No request waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn n_running(&self) -> usize {
        self.running.len()
    }

    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Ids of the requests holding KV blocks now (admitted and not finished).
    pub fn running_ids(&self) -> Vec<u64> {
        self.running.iter().map(|r| r.id).collect()
    }

    /// Ids of every queued or running request.
    pub fn request_ids(&self) -> Vec<u64> {
        self.waiting
            .iter()
            .chain(&self.running)
            .map(|r| r.id)
            .collect()
    }

    /// Queue a request without speculation; returns its id.
    pub fn submit(&mut self, prompt: Vec<u32>, params: GenerateParams) -> Result<u64> {
        self.submit_spec(prompt, params, None)
    }

    /// Queue a request, speculating with `spec` when given; returns its id. Bad prompts and
    /// settings are errors here, never later.
    pub fn submit_spec(
        &mut self,
        prompt: Vec<u32>,
        params: GenerateParams,
        spec: Option<RequestSpec<'a>>,
    ) -> Result<u64> {
        crate::generate::check_prompt(&self.model, &prompt)?;
        params.validate(self.model.config.vocab_size)?;
        let vocab = self.model.config.vocab_size;
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidArgument(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
        // The whole pool bounds a request as the model's context does: one that outgrows it
        // ends with `Length` (keeping its tokens) instead of failing part way.
        let cap = prompt
            .len()
            .saturating_add(params.max_tokens)
            .min(self.model.config.context_length)
            .min(self.pool.max_blocks().saturating_mul(BLOCK_SLOTS));
        let spec = match spec {
            Some(rs) => {
                let mode = rs.mode.unwrap_or(VerifyMode::auto(&params.sampling));
                if mode == VerifyMode::Greedy && !params.sampling.is_greedy() {
                    return Err(EngineError::InvalidArgument(
                        "greedy verification needs greedy sampling (temperature 0); use mss or naive"
                            .into(),
                    ));
                }
                if rs.policy == SpecPolicy::Adaptive && self.cost.is_none() {
                    return Err(EngineError::InvalidArgument(
                        "adaptive speculation needs the scheduler's step cost (set_step_cost)"
                            .into(),
                    ));
                }
                // A sampled fixed tree runs whole or waits (its size must not depend on the
                // batch): it must fit a step with its root, alone.
                let budget = if whole_tree(rs.policy, &params.sampling) {
                    rs.budget.min(self.config.max_step_tokens.saturating_sub(1))
                } else {
                    rs.budget
                };
                Some(SpecState {
                    drafters: rs.drafters,
                    budget,
                    policy: rs.policy,
                    verifier: Verifier::new(mode, params.sampling.clone())?,
                    acceptance: Acceptance::new(),
                    last_depth: usize::MAX,
                    backoff: DraftBackoff::default(),
                    draft_secs: 0.0,
                    cheap_drafting: false,
                    metrics: SpecMetrics::default(),
                    external: rs.external,
                    candidates: rs.candidates,
                    prompt_candidates: rs.prompt_candidates,
                    max_nodes_by_depth: rs.max_nodes_by_depth,
                })
            }
            None => None,
        };
        // Tree passes need `budget + 1` scratch slots past the tokens.
        let capacity = cap.saturating_add(spec.as_ref().map_or(0, |sp| sp.budget + 1));
        let json = match params.response_format {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject | ResponseFormat::JsonSchema(_) => self
                .json_vocab
                .clone()
                .or_else(|| self.tokenizer.as_ref().map(|t| t.json_vocab())),
        };
        let id = self.next_id;
        self.next_id += 1;
        let noop: fn(&str) = |_| {};
        let prompt_scores = params.prompt_logprobs.map(|k| {
            Box::new(PromptScores {
                tokens: prompt.clone(),
                alternatives: k,
                ..PromptScores::default()
            })
        });
        self.waiting.push_back(Request {
            id,
            prompt_scores,
            prompt_len: prompt.len(),
            sampler: Sampler::new(params.sampling.clone())?,
            penalties: params.logits_history(&prompt, json.as_ref())?,
            sink: self
                .tokenizer
                .clone()
                .map(|t| TokenSink::new(t, &params, noop)),
            params,
            cache: None,
            admitted: 0,
            served: 0,
            cached_prompt_tokens: None,
            preemptions: 0,
            capacity,
            cap,
            seq: prompt,
            spec,
        });
        Ok(id)
    }

    /// Drop a request wherever it is; its blocks go back to the pool. Returns what it had
    /// done (for its final report), or None if unknown.
    pub fn cancel(&mut self, id: u64) -> Option<CancelledStats> {
        let r = if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i)?
        } else {
            let i = self.running.iter().position(|r| r.id == id)?;
            self.running.remove(i)
        };
        Some(CancelledStats {
            cached_prompt_tokens: r.cached_prompt_tokens.unwrap_or(0),
            preemptions: r.preemptions,
            spec: r.spec.map(|sp| sp.metrics),
        })
    }

    /// Admit waiting requests (oldest first) while the pool has blocks for their whole
    /// uncached prompt, and fail those that could never fit. A request waiting for prefix
    /// blocks another request is still computing keeps its place (and the blocks it will
    /// need) while the requests behind it are admitted.
    fn admit(&mut self, events: &mut Vec<StepEvent>) {
        // Blocks the requests admitted in this call will take (`available` counts none of
        // them until their prefill runs): each later one must fit beside them, or the step's
        // plan would preempt it again at once. Requests passed over reserve theirs too.
        let mut reserved = 0;
        let mut i = 0;
        while self.running.len() < self.config.max_running {
            let Some(req) = self.waiting.get(i) else {
                break;
            };
            if req.params.max_tokens == 0 {
                let req = self.waiting.remove(i).expect("index exists");
                events.push(StepEvent {
                    id: req.id,
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    top_logprobs: Vec::new(),
                    text: String::new(),
                    prompt: None,
                    finish: Some(Finish::Done {
                        reason: FinishReason::Length,
                        tokens: Vec::new(),
                        text: String::new(),
                        prompt_tokens: req.prompt_len,
                        cached_prompt_tokens: 0,
                        preemptions: 0,
                        spec: None,
                    }),
                });
                continue;
            }
            let need_all = req.slots_to_admit().div_ceil(BLOCK_SLOTS);
            if need_all > self.pool.max_blocks() {
                let req = self.waiting.remove(i).expect("index exists");
                events.push(failed(
                    req.id,
                    EngineError::KvPoolExhausted { needed: need_all },
                ));
                continue;
            }
            // A prompt that shares full blocks with one still being computed waits for them
            // (at most that prefill's steps) and keeps the blocks it will compute itself.
            let reads_cache = self.config.prefix_caching && !req.scoring();
            if reads_cache {
                if let Some(shared) = self.shared_prefix_in_flight(req) {
                    let need = need_all.saturating_sub(shared);
                    if reserved + need > self.pool.available() {
                        break;
                    }
                    reserved += need;
                    self.stats.prefix_waits += 1;
                    i += 1;
                    continue;
                }
            }
            // A prompt being scored computes every row.
            let cache = if reads_cache {
                KvCache::with_prefix(&self.pool, req.capacity, &req.seq)
            } else {
                KvCache::in_pool(&self.pool, req.capacity)
            };
            let need = need_all.saturating_sub(cache.blocks().len());
            if reserved + need > self.pool.available() {
                break; // its prefix blocks go back with `cache`
            }
            reserved += need;
            let mut req = self.waiting.remove(i).expect("index exists");
            if req.cached_prompt_tokens.is_none() {
                req.cached_prompt_tokens = Some(cache.len().min(req.prompt_len));
            }
            req.cache = Some(cache);
            self.admissions += 1;
            req.admitted = self.admissions;
            self.running.push(req);
        }
    }

    /// The full blocks `req` shares with a running request that has not computed them yet
    /// (None when it shares none): admitted now it would compute them a second time (the
    /// prefix cache holds a block once it is computed), so it waits for them (cache-aware
    /// admission, as SGLang's scheduler).
    fn shared_prefix_in_flight(&self, req: &Request<'_>) -> Option<usize> {
        self.running
            .iter()
            .filter(|r| r.phase() != Phase::Decode) // decoding ones hold every block they share
            .filter_map(|r| {
                let have = r.cache.as_ref().map_or(0, KvCache::len);
                let common = req
                    .seq
                    .iter()
                    .zip(&r.seq)
                    .take_while(|(a, b)| a == b)
                    .count();
                // The prompt's last token is computed again (`KvCache::with_prefix`), so its
                // block is never read from the cache.
                let shared = common.min(req.seq.len().saturating_sub(1)) / BLOCK_SLOTS;
                (shared * BLOCK_SLOTS > have).then_some(shared)
            })
            .max()
    }

    /// New blocks a slot's rows need.
    fn blocks_needed(&self, sl: &Slot) -> usize {
        let r = &self.running[sl.idx];
        let cache = r.cache.as_ref().expect("running requests have a cache");
        cache.blocks_needed(sl.rows_upper())
    }

    /// Cut draft trees, newest requests first (not those verified whole when `keep_whole`),
    /// until the plan's `blocks` fit in `available`; the plan's blocks after the cuts.
    fn fit_trees(
        &self,
        plan: &mut [Slot],
        available: usize,
        mut blocks: usize,
        keep_whole: bool,
    ) -> usize {
        let mut order: Vec<usize> = (0..plan.len()).collect();
        order.sort_by_key(|&k| std::cmp::Reverse(self.running[plan[k].idx].admitted));
        for k in order {
            if blocks <= available {
                break;
            }
            let sl = &plan[k];
            if sl.tree_cap == 0 || (keep_whole && self.running[sl.idx].whole_tree()) {
                continue;
            }
            let others = blocks - self.blocks_needed(sl);
            let sl = &mut plan[k];
            while sl.tree_cap > 0 && others + self.blocks_needed(sl) > available {
                sl.tree_cap -= 1;
            }
            blocks = others + self.blocks_needed(sl);
        }
        blocks
    }

    /// Free the newest running request's blocks and queue it (it recomputes later) before every
    /// waiting request that arrived after it: first, unless an older request was passed over
    /// while waiting for a shared prefix, which then stays ahead of it.
    fn preempt_newest(&mut self) -> bool {
        if self.running.len() <= 1 {
            return false;
        }
        let i = (0..self.running.len())
            .max_by_key(|&i| self.running[i].admitted)
            .expect("non-empty");
        let mut req = self.running.remove(i);
        req.cache = None;
        req.preemptions += 1;
        self.stats.preemptions += 1;
        // Ids follow submission order.
        let at = self
            .waiting
            .iter()
            .position(|w| w.id > req.id)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, req);
        true
    }

    /// One iteration: admission, then one forward pass over every running request's rows —
    /// decode roots, then prefill chunks within the step's token budget, then draft trees (their
    /// depth chosen by the request's policy) — verification or sampling, and stop checks.
    /// Returns one event per request that produced tokens or finished.
    pub fn step<B: Backend>(&mut self, backend: &B) -> Result<Vec<StepEvent>> {
        let planned = self.begin_step();
        self.finish_step(backend, planned, Vec::new())
    }

    /// The first half of [`Scheduler::step`]: admission and this step's plan (preempting when
    /// blocks run short). Its `jobs` are the trees to draft outside; requests may be submitted
    /// or cancelled before [`Scheduler::finish_step`] runs it.
    pub fn begin_step(&mut self) -> PlannedStep {
        let started = Instant::now();
        let mut events = Vec::new();
        self.admit(&mut events);
        let plan = loop {
            let mut plan = self.plan();
            let available = self.pool.available();
            let mut blocks: usize = plan.iter().map(|sl| self.blocks_needed(sl)).sum();
            if blocks > available {
                // Draft trees are optional rows: they shrink before anyone is preempted, but
                // for the trees a sampling request verifies whole (their size is part of its
                // random stream), unless nobody is left to preempt.
                blocks = self.fit_trees(&mut plan, available, blocks, true);
            }
            if blocks <= available {
                break plan;
            }
            if !self.preempt_newest() {
                blocks = self.fit_trees(&mut plan, available, blocks, false);
                if blocks <= available {
                    break plan;
                }
                // One request alone does not fit: it can never run.
                if let Some(req) = self.running.pop() {
                    events.push(failed(
                        req.id,
                        EngineError::KvPoolExhausted { needed: blocks },
                    ));
                }
                break Vec::new();
            }
        };
        self.plans += 1;
        for sl in &plan {
            self.running[sl.idx].served = self.plans;
        }
        let jobs = plan
            .iter()
            .filter(|sl| sl.tree_cap > 0)
            .filter_map(|sl| {
                let r = &self.running[sl.idx];
                r.spec.as_ref().filter(|sp| sp.external).map(|sp| DraftJob {
                    id: r.id,
                    tokens: r.seq.clone(),
                    budget: sl.tree_cap,
                    max_depth: r.draft_depth(),
                    row_costs: match (&self.cost, sp.policy) {
                        (Some(c), SpecPolicy::Adaptive) => {
                            row_costs(c, sl.tree_cap, self.gains.hurdle())
                        }
                        _ => Vec::new(),
                    },
                })
            })
            .collect();
        PlannedStep {
            slots: plan,
            events,
            jobs,
            started,
        }
    }

    /// The second half of [`Scheduler::step`]: draft (in-process drafters; `trees` for the
    /// planned jobs, by request id: a job without a tree verifies its root only), run the one
    /// forward pass, verify, stream and stop.
    pub fn finish_step<B: Backend>(
        &mut self,
        backend: &B,
        planned: PlannedStep,
        trees: Vec<(u64, MaskedTree)>,
    ) -> Result<Vec<StepEvent>> {
        let PlannedStep {
            slots: mut plan,
            mut events,
            jobs: _,
            started,
        } = planned;
        // Requests cancelled since the plan was made drop out; the others may have moved (a
        // step finished at once, as `step` does, finds every slot where it was).
        let running = &self.running;
        plan.retain_mut(|sl| {
            if running.get(sl.idx).is_some_and(|r| r.id == sl.id) {
                return true;
            }
            match running.iter().position(|r| r.id == sl.id) {
                Some(i) => {
                    sl.idx = i;
                    true
                }
                None => false,
            }
        });
        if plan.is_empty() {
            return Ok(events);
        }
        let vocab = self.model.config.vocab_size;
        for (id, masked) in trees {
            let Some(sl) = plan.iter_mut().find(|sl| sl.id == id && sl.tree_cap > 0) else {
                continue;
            };
            let r = &self.running[sl.idx];
            let tree = masked.tree();
            if tree.root_token() != r.root() || tree.validate(vocab).is_err() {
                continue;
            }
            let (tree, mask) = masked
                .truncate(r.draft_depth(), sl.tree_rows())
                .into_parts();
            sl.proposal = Some(tree);
            sl.proposal_mask = Some(mask);
        }
        self.draft(&mut plan)?;
        let drafted = Instant::now();
        // The batch, in running order.
        plan.sort_by_key(|sl| sl.idx);
        let inputs: Vec<StepInput> = plan.iter().map(|sl| self.input(sl)).collect();
        let n_rows: usize = inputs.iter().map(|x| x.tokens.len()).sum();
        let logit_rows: usize = inputs.iter().map(|x| x.logit_rows.len()).sum();
        let device = self.device.clone();
        let t0 = Instant::now();
        let logits = {
            // `plan` is sorted by index: the chosen requests in running order.
            let mut in_plan = vec![false; self.running.len()];
            for sl in &plan {
                in_plan[sl.idx] = true;
            }
            let chosen = self
                .running
                .iter_mut()
                .zip(in_plan)
                .filter_map(|(r, chosen)| chosen.then_some(r));
            let mut batch: Vec<SeqBatch<'_>> = chosen
                .zip(&inputs)
                .map(|(r, x)| SeqBatch {
                    cache: r.cache.as_mut().expect("running requests have a cache"),
                    tokens: &x.tokens,
                    positions: &x.positions,
                    mask: match &x.mask {
                        Some(m) => m.as_batch_mask(),
                        None => BatchMask::Causal,
                    },
                    logit_rows: &x.logit_rows,
                })
                .collect();
            match &device {
                Some(d) => d.forward_batch(&mut batch)?,
                None => self.model.forward_batch(backend, &mut batch)?,
            }
        };
        let fwd = t0.elapsed().as_secs_f64();
        self.stats.forward_secs += fwd;
        if let (Some(c), false) = (self.cost.as_mut(), self.freeze_step_cost) {
            c.record_pass(n_rows, plan.len(), fwd);
        }
        self.stats.steps += 1;
        self.stats.rows += n_rows as u64;
        // Penalties: each row that is drawn from sees its request's history (a tree row, its
        // path's tokens too) before anything reads it.
        let vocab = self.model.config.vocab_size;
        let mut logits = logits;
        self.score_prompts(backend, &plan, &inputs, &mut logits);
        for (sl, lg) in plan.iter().zip(logits.iter_mut()) {
            let Some(h) = self.running[sl.idx].penalties.as_ref() else {
                continue;
            };
            match &sl.tree {
                Some(tree) => h.penalize_tree(tree, lg, vocab),
                // Prompt rows whose candidates drafters read: after those are taken, as
                // `spec::generate` does (below).
                None if sl.prefill > 0 && sl.candidates > 0 => {}
                // The prompt's last row (a chunk that ends it) or the decoding row.
                None if lg.len() >= vocab && (sl.prefill == 0 || sl.logits) => {
                    let last = lg.len() - vocab;
                    h.penalize_row(&mut lg[last..], &[]);
                }
                None => {}
            }
        }
        // Verify or sample, stream, stop.
        let mut drawn = self.draw_rows(backend, &plan, &logits);
        let mut finished = Vec::new();
        for (((sl, x), lg), drawn) in plan
            .iter()
            .zip(&inputs)
            .zip(logits.iter_mut())
            .zip(&mut drawn)
        {
            let r = &mut self.running[sl.idx];
            // The tokens this step emits for the request and the row of `lg` each was drawn
            // from (for log-probabilities).
            let (emitted, rows): (Vec<u32>, Vec<usize>) = match (&sl.tree, r.spec.as_mut()) {
                (Some(tree), Some(sp)) => {
                    let cache = r.cache.as_mut().expect("running requests have a cache");
                    // An error here is this request's alone: it fails, the others go on.
                    let verified = match drawn.take() {
                        Some(Drawn::Verified(v)) => v,
                        other => {
                            debug_assert!(other.is_none(), "draw_rows drew another kind here");
                            sp.verifier.verify(tree, lg, vocab)
                        }
                    };
                    let verified = verified.and_then(|o| {
                        match &device {
                            Some(d) => d.commit_rows(cache, x.positions[0], &o.kv_rows())?,
                            None => cache.commit_rows(x.positions[0], &o.kv_rows())?,
                        }
                        Ok(o)
                    });
                    let o = match verified {
                        Ok(o) => o,
                        Err(e) => {
                            events.push(failed(r.id, e));
                            finished.push((sl.idx, None, events.len() - 1));
                            continue;
                        }
                    };
                    // Token Recycling: the top candidates of every row of this pass.
                    let wanted = sp.candidates_wanted(false);
                    // The root is the sequence's last token (emitted ones join it below).
                    let before = &r.seq[..r.seq.len().saturating_sub(1)];
                    let candidates = (wanted > 0)
                        .then(|| PassCandidates::of_tree(tree, before, lg, vocab, wanted));
                    let emitted = o.emitted();
                    if let Some(p) = &sl.proposal {
                        sp.acceptance.record(p, &emitted);
                    }
                    self.gains.record(sl.promised, o.tokens.len());
                    sp.metrics.record(tree, &o);
                    let (stats, failures) = (&mut self.stats, &mut self.drafter_failures);
                    each_drafter(r.id, sp, "accept", stats, failures, |d| {
                        d.observe(None);
                        if let Some(c) = candidates.as_ref() {
                            if d.candidates_wanted() > 0 {
                                d.observe_candidates(&c.rows());
                            }
                        }
                        d.accept(&o.tokens, o.bonus);
                    });
                    let rows = o.kv_rows();
                    if sp.external {
                        self.commits.push(Commit {
                            id: r.id,
                            accepted: o.tokens,
                            bonus: o.bonus,
                            candidates: candidates.filter(|_| sp.candidates > 0),
                            prefill: false,
                        });
                    }
                    (emitted, rows)
                }
                _ if sl.prefill > 0 && sl.candidates > 0 => {
                    // Every prompt row's candidates (warm start), then the first token from the
                    // last row when this chunk ends the prompt.
                    let before = &r.seq[..x.positions[0]];
                    let c = PassCandidates::of(x.tokens.clone(), before, lg, vocab, sl.candidates);
                    if let Some(sp) = r.spec.as_mut() {
                        let (stats, failures) = (&mut self.stats, &mut self.drafter_failures);
                        each_drafter(r.id, sp, "observe", stats, failures, |d| {
                            if d.prompt_candidates() > 0 {
                                d.observe_candidates(&c.rows());
                            }
                        });
                        if sp.external && sp.prompt_candidates > 0 {
                            self.commits.push(Commit {
                                id: r.id,
                                accepted: Vec::new(),
                                bonus: 0,
                                candidates: Some(c),
                                prefill: true,
                            });
                        }
                    }
                    match sl.prefill.checked_sub(1) {
                        Some(last) if sl.logits => {
                            let row = &mut lg[last * vocab..(last + 1) * vocab];
                            if let Some(h) = &r.penalties {
                                h.penalize_row(row, &[]);
                            }
                            (vec![r.sampler.sample(row)], vec![last])
                        }
                        _ => (Vec::new(), Vec::new()),
                    }
                }
                _ if lg.is_empty() => (Vec::new(), Vec::new()),
                // One decoding row: the slot's logits are that row.
                _ => match drawn.take() {
                    Some(Drawn::Sampled(t)) => (vec![t], vec![0]),
                    other => {
                        debug_assert!(other.is_none(), "draw_rows drew another kind here");
                        (vec![r.sampler.sample(lg)], vec![0])
                    }
                },
            };
            if let (Some(c), true) = (r.cache.as_mut(), self.config.prefix_caching) {
                c.register_prefix(&r.seq);
            }
            if emitted.is_empty() {
                continue;
            }
            let mut ev = StepEvent {
                id: r.id,
                tokens: Vec::new(),
                logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                text: String::new(),
                prompt: r.prompt_scores.take(),
                finish: None,
            };
            let mut reason = None;
            for (tok, row) in emitted.into_iter().zip(rows) {
                ev.tokens.push(tok);
                if r.params.logprobs {
                    let at = row * vocab;
                    let (lp, top) = crate::sample::log_softmax_top(
                        &lg[at..at + vocab],
                        tok,
                        r.params.top_logprobs,
                    );
                    ev.logprobs.push(lp);
                    if r.params.top_logprobs > 0 {
                        ev.top_logprobs.push(top);
                    }
                }
                if let Some(sink) = r.sink.as_mut() {
                    let before = sink.text().len();
                    reason = sink.push(tok);
                    ev.text.push_str(&sink.text()[before..]);
                }
                // The cache holds `seq` but its last token: it is fed next step (if any).
                r.seq.push(tok);
                // Without a tokenizer the sink does not run: stop tokens end here.
                if r.sink.is_none() && r.params.stops_at(tok, r.generated()) {
                    reason = Some(FinishReason::Eos);
                }
                if let Some(h) = r.penalties.as_mut() {
                    h.push(tok);
                }
                if reason.is_none() && (r.generated() >= r.params.max_tokens || r.seq.len() > r.cap)
                {
                    reason = Some(FinishReason::Length);
                }
                if reason.is_some() {
                    break;
                }
            }
            events.push(ev);
            if let Some(reason) = reason {
                finished.push((sl.idx, Some(reason), events.len() - 1));
            }
        }
        // Remove finished requests (highest index first); their blocks go back on drop. A
        // request without a reason failed (its event says so).
        finished.sort_by_key(|&(i, _, _)| std::cmp::Reverse(i));
        for (i, reason, ev) in finished {
            let r = self.running.remove(i);
            let Some(reason) = reason else {
                continue;
            };
            let spec = r.spec.map(|sp| sp.metrics);
            let (text, tokens, reason) = match r.sink {
                Some(sink) => {
                    let before = sink.text().len();
                    let (text, tokens, reason) = sink.finish(reason);
                    events[ev].text.push_str(&text[before..]);
                    (text, tokens, reason)
                }
                None => (String::new(), r.seq[r.prompt_len..].to_vec(), reason),
            };
            events[ev].finish = Some(Finish::Done {
                reason,
                tokens,
                text,
                prompt_tokens: r.prompt_len,
                cached_prompt_tokens: r.cached_prompt_tokens.unwrap_or(0),
                preemptions: r.preemptions,
                spec,
            });
        }
        self.stats.peak_blocks = self.stats.peak_blocks.max(self.pool.stats().used);
        let all = started.elapsed().as_secs_f64();
        if let (Some(c), false) = (self.cost.as_mut(), self.freeze_step_cost) {
            c.record_overhead(logit_rows, drafted.elapsed().as_secs_f64() - fwd);
        }
        self.stats.step_secs += all;
        Ok(events)
    }

    /// Prompt log-probabilities: every scored chunk row gives the next prompt token's (rows
    /// of a recompute after preemption that were scored before are skipped), the rows in
    /// parallel; then the chunk's logits are cut to what the rest of the step reads (the
    /// last row where the chunk ends the prompt, every row for drafters' candidates).
    fn score_prompts<B: Backend>(
        &mut self,
        backend: &B,
        plan: &[Slot],
        inputs: &[StepInput],
        logits: &mut [Vec<f32>],
    ) {
        let vocab = self.model.config.vocab_size;
        for ((sl, x), lg) in plan.iter().zip(inputs).zip(logits.iter_mut()) {
            if !sl.score {
                continue;
            }
            let r = &mut self.running[sl.idx];
            let Some(scores) = r.prompt_scores.as_mut() else {
                continue;
            };
            let k = scores.alternatives;
            // Row `j` (position `x.positions[j]`) scores the prompt token after it.
            let rows: Vec<(usize, u32)> = x
                .positions
                .iter()
                .enumerate()
                .filter(|&(_, &p)| p + 1 > scores.logprobs.len() && p + 1 < r.prompt_len)
                .map(|(j, &p)| (j, r.seq[p + 1]))
                .collect();
            let all: &[f32] = lg;
            let scored: Vec<(f32, Vec<(u32, f32)>)> = backend.scope(|| {
                rows.par_iter()
                    .map(|&(j, t)| {
                        crate::sample::log_softmax_top(&all[j * vocab..(j + 1) * vocab], t, k)
                    })
                    .collect()
            });
            for (lp, top) in scored {
                scores.logprobs.push(lp);
                scores.top_logprobs.push(top);
            }
            let keep = if sl.candidates > 0 {
                sl.prefill
            } else {
                usize::from(sl.logits)
            };
            let cut = lg.len().saturating_sub(keep * vocab);
            lg.drain(..cut);
        }
    }

    /// Most prompt rows of `r` one step prefills. Drafters that learn from every row's
    /// candidates see the prompt's rows too, in chunks that bound the logits buffer.
    fn prefill_chunk(&self, r: &Request<'_>) -> usize {
        if r.prompt_candidates() > 0 || r.scoring() {
            self.config.prefill_chunk.min(CANDIDATE_PREFILL_ROWS)
        } else {
            self.config.prefill_chunk
        }
    }

    /// This step's rows per running request: every decoding request's root, then prefill
    /// chunks in admission order within the token budget, then room for draft trees. The budget
    /// (`max_step_tokens`) is a hard cap.
    fn plan(&self) -> Vec<Slot> {
        let mut order: Vec<usize> = (0..self.running.len()).collect();
        order.sort_by_key(|&i| self.running[i].admitted);
        let mut budget = self.config.max_step_tokens;
        let mut plan = Vec::new();
        // Rows the prompts waiting for prefill take this step (each its chunk), up to half the
        // step: whole trees but the first one's leave them that room.
        let prefill_rows: usize = order
            .iter()
            .filter_map(|&i| match self.running[i].phase() {
                Phase::Prefill { left, .. } => Some(left.min(self.prefill_chunk(&self.running[i]))),
                Phase::Decode => None,
            })
            .fold(0, usize::saturating_add);
        let reserve = prefill_rows.min(self.config.max_step_tokens / 2);
        // Decoding requests, least recently served first (then in admission order): each one's
        // root, and a sampled fixed tree whole or not at all (its size, and so the request's
        // random stream, must not depend on the other requests of the step; greedy trees are
        // sized last and may shrink, which changes no token). A whole tree that does not fit
        // waits a step (not even its root runs); the next step serves it before those that ran,
        // so such trees take turns, and the first request always fits (its tree was capped to a
        // step at submission), so every step makes progress.
        let mut by_turn = order.clone();
        by_turn.sort_by_key(|&i| (self.running[i].served, self.running[i].admitted));
        let mut first_turn = true;
        for &i in &by_turn {
            let r = &self.running[i];
            if r.phase() != Phase::Decode {
                continue;
            }
            let first = std::mem::replace(&mut first_turn, false);
            if budget == 0 {
                break;
            }
            let mut sl = Slot::decode(i, r.id);
            if r.whole_tree() {
                sl.tree_cap = r.tree_cap();
                sl.tree_bound = r.tree_bound();
                let keep = if first { 0 } else { reserve };
                if sl.tree_rows() + 1 + keep > budget {
                    continue;
                }
                budget -= sl.tree_rows();
            }
            budget -= 1;
            plan.push(sl);
        }
        for &i in &order {
            let r = &self.running[i];
            if let Phase::Prefill {
                left,
                logits_at_end,
            } = r.phase()
            {
                let n = left.min(self.prefill_chunk(r)).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                plan.push(Slot {
                    idx: i,
                    id: r.id,
                    prefill: n,
                    logits: logits_at_end && n == left,
                    tree_cap: 0,
                    tree_bound: usize::MAX,
                    tree: None,
                    tree_mask: None,
                    proposal: None,
                    proposal_mask: None,
                    candidates: r.prompt_candidates(),
                    score: r.scoring(),
                    promised: 0.0,
                });
            }
        }
        for sl in plan.iter_mut().filter(|sl| sl.prefill == 0) {
            let r = &self.running[sl.idx];
            if r.whole_tree() {
                continue; // sized above
            }
            let mut cap = r.tree_cap().min(budget);
            // Adaptive requests draft only what a pass worth verifying holds.
            if let (Some(c), Some(sp)) = (self.cost.as_ref(), r.spec.as_ref()) {
                if sp.policy == SpecPolicy::Adaptive && cap > 0 {
                    cap = useful_budget(c, cap, &sp.acceptance);
                }
            }
            sl.tree_cap = cap;
            sl.tree_bound = r.tree_bound();
            budget -= sl.tree_rows();
        }
        plan
    }

    /// Draft the trees of the plan's decoding requests and cut each to the depth its policy
    /// chooses (adaptive requests together, for the step's whole row count).
    fn draft(&mut self, plan: &mut [Slot]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        // Adaptive requests backing off drafting count this step (their plan gave no tree room).
        for sl in plan.iter().filter(|sl| sl.prefill == 0 && sl.tree_cap == 0) {
            if let Some(sp) = self.running[sl.idx].spec.as_mut() {
                if sp.policy == SpecPolicy::Adaptive {
                    sp.backoff.skip();
                }
            }
        }
        // Running index -> plan index of the requests that may get a tree this step.
        let mut slot_of: Vec<Option<usize>> = vec![None; self.running.len()];
        for (k, sl) in plan.iter().enumerate() {
            if sl.tree_cap > 0 {
                slot_of[sl.idx] = Some(k);
            }
        }
        // Every in-process drafting request's drafters, drafted together (model drafters of
        // one model and pool in one pass per depth for all of them).
        let mut drafted: Vec<(usize, usize)> = Vec::new();
        let mut refs = Vec::new();
        // The curve's row prices, once per step for the largest tree (each request takes its
        // tree's prefix).
        let max_cap = plan.iter().map(|sl| sl.tree_cap).max().unwrap_or(0);
        let rc = self
            .cost
            .as_ref()
            .map_or_else(Vec::new, |c| row_costs(c, max_cap, self.gains.hurdle()));
        for (i, r) in self.running.iter_mut().enumerate() {
            let Some(k) = slot_of[i] else { continue };
            let max_depth = r.draft_depth();
            let root = r.root();
            let Some(sp) = r.spec.as_mut() else { continue };
            if sp.external {
                // Drafted outside: the tree came with `finish_step` (or the root alone).
                if plan[k].proposal.is_none() {
                    plan[k].proposal = Some(TokenTree::root_only(root));
                }
                continue;
            }
            if sp.policy == SpecPolicy::Adaptive {
                let rc = &rc[..plan[k].tree_cap.min(rc.len())];
                sp.drafters.iter_mut().for_each(|d| d.set_row_costs(rc));
            }
            let ds: Vec<&mut dyn Drafter> = sp
                .drafters
                .iter_mut()
                .map(|d| &mut **d as &mut dyn Drafter)
                .collect();
            drafted.push((k, i));
            refs.push((ds, &r.seq[..], plan[k].tree_cap, max_depth));
        }
        let mut jobs: Vec<DraftJobRef<'_, '_>> = refs
            .iter_mut()
            .map(|(ds, tokens, budget, max_depth)| DraftJobRef {
                drafters: &mut ds[..],
                tokens,
                budget: *budget,
                max_depth: *max_depth,
            })
            .collect();
        let mut failures = vec![Vec::new(); jobs.len()];
        let t_draft = Instant::now();
        let trees = draft_trees(&mut jobs, vocab, Some(&mut failures))?;
        // Batched passes serve every drafted request alike: an equal share each.
        let share = t_draft.elapsed().as_secs_f64() / drafted.len().max(1) as f64;
        drop(jobs);
        drop(refs);
        for (((k, i), tree), failed) in drafted.into_iter().zip(trees).zip(failures) {
            let r = &mut self.running[i];
            if let Some(sp) = r.spec.as_mut() {
                sp.draft_secs = if sp.draft_secs > 0.0 {
                    0.7 * sp.draft_secs + 0.3 * share
                } else {
                    share
                };
                if let Some(c) = self.cost.as_ref() {
                    sp.cheap_drafting = sp.draft_secs < adaptive::CHEAP_DRAFT * c.secs(1);
                }
                drop_drafters(
                    r.id,
                    sp,
                    failed,
                    &mut self.stats,
                    &mut self.drafter_failures,
                );
            }
            // Within the rows reserved for it (a drafter's `max_nodes` that does not hold).
            let rows = plan[k].tree_rows();
            plan[k].proposal = Some(if tree.n_draft() > rows {
                tree.truncate_nodes(rows)
            } else {
                tree
            });
        }
        // Fixed requests verify the whole proposal; adaptive ones what the policy picks.
        let (mut base_rows, mut base_logit_rows) = (0, 0);
        // Tokens the step yields without speculation: one per decoding request and per prompt
        // that ends in this step.
        let base_tokens = plan
            .iter()
            .filter(|sl| sl.prefill == 0 || sl.logits)
            .count();
        let mut adaptive = Vec::new();
        for (k, sl) in plan.iter().enumerate() {
            let r = &self.running[sl.idx];
            base_rows += if sl.prefill > 0 { sl.prefill } else { 1 };
            // A decoding request's root; a prefill chunk's as `input` asks for them.
            base_logit_rows += if sl.prefill > 0 {
                sl.prefill_logit_rows()
            } else {
                1
            };
            match (&r.spec, &sl.proposal) {
                // A proposal with sampled draws is verified whole, as a fixed one: its node
                // counts depend on the drawn values, and a depth chosen from them would bias MSS.
                (Some(sp), Some(p)) if sp.policy == SpecPolicy::Adaptive && !p.has_sampled() => {
                    adaptive.push(k)
                }
                (Some(_), Some(p)) => {
                    base_rows += p.n_draft();
                    base_logit_rows += p.n_draft();
                }
                _ => {}
            }
        }
        // Each adaptive request's depth, whether its drafting paid this step (its tree is
        // verified anyway), whether its drafting is costly, and the draft tokens its depth is
        // expected to have accepted.
        let (depths, pays, gains): (Vec<usize>, Vec<(bool, bool)>, Vec<f64>) =
            match (&self.cost, adaptive.is_empty()) {
                (Some(cost), false) => {
                    // Tokens each decoding request still may produce, and their mean.
                    let left = |i: usize| {
                        let r = &self.running[i];
                        r.params.max_tokens.saturating_sub(r.generated()).max(1) as f64
                    };
                    let decoding: Vec<f64> = plan
                        .iter()
                        .filter(|sl| sl.prefill == 0)
                        .map(|sl| left(sl.idx))
                        .collect();
                    let mean_left = decoding.iter().sum::<f64>() / decoding.len().max(1) as f64;
                    let options: Vec<DepthOptions<'_>> = adaptive
                        .iter()
                        .map(|&k| {
                            let sl = &plan[k];
                            let p = sl
                                .proposal
                                .as_ref()
                                .expect("adaptive slots have a proposal");
                            let sp = self.running[sl.idx].spec.as_ref().expect("spec request");
                            DepthOptions {
                                acceptance: &sp.acceptance,
                                nodes_upto: nodes_upto(p),
                                weight: catch_up_weight(left(sl.idx), mean_left),
                            }
                        })
                        .collect();
                    let hurdle = self.gains.hurdle();
                    let base = StepBase {
                        rows: base_rows,
                        logit_rows: base_logit_rows,
                        tokens: base_tokens,
                        seqs: plan.len(),
                    };
                    let depths = choose_depths(&options, &base, cost, hurdle);
                    let gains: Vec<f64> = options
                        .iter()
                        .zip(&depths)
                        .map(|(o, &d)| o.acceptance.expected_tokens(d) - 1.0)
                        .collect();
                    let rows: usize = base_rows
                        + options
                            .iter()
                            .zip(&depths)
                            .map(|(o, &d)| o.nodes_upto[d])
                            .sum::<usize>();
                    let batch_tokens =
                        base_tokens.max(adaptive.len()) as f64 + gains.iter().sum::<f64>();
                    let logit_rows = base_logit_rows + (rows - base_rows);
                    let pass = cost.step_secs(rows.max(1), plan.len(), logit_rows);
                    let pays = adaptive
                        .iter()
                        .zip(&gains)
                        .map(|(&k, &g)| {
                            let d = self.running[plan[k].idx]
                                .spec
                                .as_ref()
                                .map_or(0.0, |sp| sp.draft_secs);
                            (
                                drafting_pays(g, batch_tokens, d, pass, hurdle),
                                d >= adaptive::COSTLY_DRAFT * pass,
                            )
                        })
                        .collect();
                    (depths, pays, gains)
                }
                _ => (
                    vec![0; adaptive.len()],
                    vec![(true, false); adaptive.len()],
                    vec![0.0; adaptive.len()],
                ),
            };
        for (k, sl) in plan.iter_mut().enumerate() {
            let Some(p) = &sl.proposal else {
                // Speculating requests without room for a tree still verify their root.
                if self.running[sl.idx].spec.is_some() && sl.prefill == 0 {
                    sl.tree = Some(TokenTree::root_only(self.running[sl.idx].root()));
                }
                continue;
            };
            match adaptive.iter().position(|&a| a == k) {
                Some(j) => {
                    if let Some(sp) = self.running[sl.idx].spec.as_mut() {
                        sp.last_depth = depths[j];
                        sl.promised = gains[j];
                        let (pays, costly) = pays[j];
                        // A proposal without nodes tells nothing about whether drafts pay
                        // where drafting costs next to nothing (in process); drafting outside
                        // costs each step a round trip, which only the backoff saves.
                        if p.n_draft() > 0 || sp.external {
                            sp.backoff.chose(if pays { depths[j] } else { 0 }, costly);
                        }
                    }
                    match sl.proposal_mask.take() {
                        Some(mask) => {
                            let (tree, mask) = p.truncate_masked(&mask, depths[j], usize::MAX);
                            sl.tree = Some(tree);
                            sl.tree_mask = Some(mask);
                        }
                        None => sl.tree = Some(p.truncate_depth(depths[j])),
                    }
                }
                // Fixed trees: the whole proposal (acceptance is only measured for adaptive).
                None => {
                    sl.tree = sl.proposal.take();
                    sl.tree_mask = sl.proposal_mask.take();
                }
            }
        }
        Ok(())
    }

    /// Every plain row's sample and every tree's verification of this step, per plan slot,
    /// drawn on the backend's threads, a request per task (each request's sampler and verifier
    /// own their random streams, so the draws are those the slots would make in turn). `None`
    /// for the slots the step handles otherwise (prefill chunks collecting candidates, rows
    /// without logits), and for all of them in a step with fewer than two draws to make.
    fn draw_rows<B: Backend>(
        &mut self,
        backend: &B,
        plan: &[Slot],
        logits: &[Vec<f32>],
    ) -> Vec<Option<Drawn>> {
        let vocab = self.model.config.vocab_size;
        // (plan position, the work): the plan is in running order, one slot per request.
        let mut work: Vec<(usize, DrawWork<'_>)> = Vec::with_capacity(plan.len());
        let mut slots = plan.iter().zip(logits).enumerate().peekable();
        for (i, r) in self.running.iter_mut().enumerate() {
            let Some((k, (sl, lg))) = slots.next_if(|(_, (sl, _))| sl.idx == i) else {
                continue;
            };
            match (&sl.tree, r.spec.as_mut()) {
                (Some(tree), Some(sp)) => work.push((
                    k,
                    DrawWork::Verify {
                        verifier: &mut sp.verifier,
                        tree,
                        logits: lg,
                    },
                )),
                _ if sl.prefill > 0 && sl.candidates > 0 => {}
                _ if lg.is_empty() => {}
                _ => work.push((
                    k,
                    DrawWork::Sample {
                        sampler: &mut r.sampler,
                        logits: lg,
                    },
                )),
            }
        }
        let mut drawn: Vec<Option<Drawn>> = (0..plan.len()).map(|_| None).collect();
        if work.len() < 2 {
            return drawn;
        }
        let done: Vec<(usize, Drawn)> = backend.scope(|| {
            work.into_par_iter()
                .map(|(k, w)| (k, w.draw(vocab)))
                .collect()
        });
        for (k, d) in done {
            drawn[k] = Some(d);
        }
        drawn
    }

    /// The rows one slot feeds.
    fn input(&self, sl: &Slot) -> StepInput {
        let r = &self.running[sl.idx];
        let start = r.cache.as_ref().map_or(0, KvCache::len);
        if sl.prefill > 0 {
            let n = sl.prefill;
            return StepInput {
                tokens: r.seq[start..start + n].to_vec(),
                positions: (start..start + n).collect(),
                mask: None,
                logit_rows: (n - sl.prefill_logit_rows()..n).collect(),
            };
        }
        match &sl.tree {
            Some(tree) if tree.len() > 1 => StepInput {
                tokens: tree.tokens(),
                positions: tree.positions(start),
                mask: Some(sl.tree_mask.clone().unwrap_or_else(|| tree.mask())),
                logit_rows: (0..tree.len()).collect(),
            },
            _ => StepInput {
                tokens: vec![r.root()],
                positions: vec![start],
                mask: None,
                logit_rows: vec![0],
            },
        }
    }

    /// Step until every request has finished; returns each request's finish, by id.
    pub fn run_to_completion<B: Backend>(&mut self, backend: &B) -> Result<Vec<(u64, Finish)>> {
        let mut done = Vec::new();
        while !self.is_idle() {
            for ev in self.step(backend)? {
                if let Some(f) = ev.finish {
                    done.push((ev.id, f));
                }
            }
        }
        done.sort_by_key(|(id, _)| *id);
        Ok(done)
    }
}

/// Whether a request speculating with `policy` under `sampling` has its tree verified whole or
/// not at all: fixed trees of a sampling request, whose size is part of its random stream.
fn whole_tree(policy: SpecPolicy, sampling: &crate::sample::SamplingParams) -> bool {
    policy == SpecPolicy::Fixed && !sampling.is_greedy()
}

#[cfg(test)]
mod tests;
