//! Drafters for tree-based speculative inference (SpecInfer's small speculative models, generalized): the `Drafter` trait and test drafters.
//!
//! A drafter proposes a token tree rooted at the sequence's last token (not yet in the LLM's KV
//! cache) within a node budget, and is told which tokens the LLM accepted. Drafters here:
//! - [`OracleDrafter`]: knows the true continuation (a test oracle), optionally padded with wrong
//!   random siblings to fill a tree shape;
//! - [`RandomDrafter`]: random guesses;
//! - [`DistDrafter`]: expands a tree from any next-token distribution function (top-k or sampled),
//!   the building block for model-based drafters and for distribution tests;
//! - [`ModelDrafter`]: a small model (SSM) or the LLM's first layers ([`early_exit`]), with its
//!   own KV cache, fixed or dynamic ([`DraftShape`]) trees;
//! - [`NgramDrafter`]: prompt lookup;
//! - [`SpaceDrafter`]: SPACE auto-correct decoding (drafts from placeholder rows of the LLM's own
//!   verification pass);
//! - [`RecycleDrafter`]: Token Recycling (drafts from the top-k candidates of every row the LLM
//!   computed, kept in an adjacency matrix).

pub mod dynamic;
pub mod early_exit;
pub mod fallback;
pub mod ngram;
pub mod recycle;
pub mod space;
pub mod ssm;

pub use dynamic::DraftShape;
pub use early_exit::early_exit;
pub use fallback::FallbackDrafter;
pub use ngram::NgramDrafter;
pub use recycle::{RecycleDrafter, RecycleMatrix, RecycleTemplate};
pub use space::{SpaceDrafter, SpaceMode};
pub use ssm::{check_same_vocab, DraftSampling, ModelDrafter};

use crate::backend::BatchMask;
use crate::error::Result;
use crate::kv::{KvCache, KvPool};
use crate::model::{Model, SeqBatch};
use crate::sample::Rng;
use crate::tree::{expand, DrafterId, ExpandMode, ExpansionConfig, TokenTree};

/// What a drafter is asked for.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    /// The sequence so far (prompt and generated tokens). Its last token is the tree's root: the
    /// LLM sampled it but has not fed it yet.
    pub tokens: &'a [u32],
    /// Most draft nodes (root excluded) this drafter may propose.
    pub budget: usize,
    /// Deepest level worth proposing (deeper nodes are cut).
    pub max_depth: usize,
    /// The id to record in this drafter's proposals.
    pub drafter: DrafterId,
    /// The LLM's vocabulary size.
    pub vocab: usize,
}

impl DraftRequest<'_> {
    /// The root token.
    pub fn root(&self) -> u32 {
        self.tokens.last().copied().unwrap_or(0)
    }
}

/// A source of speculated token trees.
pub trait Drafter: Send {
    fn name(&self) -> &str;

    /// Propose a tree rooted at `req.root()`, with at most `req.budget` draft nodes and depth
    /// `req.max_depth`. Under stochastic verification, nodes recorded as sampled must really be
    /// draws from the distribution recorded at their parent: a sampled node whose token has no
    /// mass there makes MSS ignore all of this drafter's proposals for the step (reported in
    /// `VerifyOutcome::broken_drafters`, counted in `SpecMetrics::drafter_contract_failures`).
    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree>;

    /// The LLM accepted `accepted` (tokens after the root, in order) and then sampled `bonus`,
    /// the next root. Drafters with their own caches follow the sequence here.
    fn accept(&mut self, _accepted: &[u32], _bonus: u32) {}

    /// Placeholder rows to append to the verification pass of `tree` (the merged tree about to
    /// be verified), SPACE-style: each group is a chain hanging off one tree node. They are never
    /// verified or committed; [`Drafter::observe`] gets the logits of the group hanging off the
    /// last accepted node. Default: none.
    fn placeholders(&mut self, _tree: &TokenTree) -> Vec<PlaceholderGroup> {
        Vec::new()
    }

    /// Most placeholder rows [`Drafter::placeholders`] ever returns (callers reserve KV scratch
    /// slots for them).
    fn max_placeholder_rows(&self) -> usize {
        0
    }

    /// Most draft nodes a proposal at most `max_depth` deep ever holds, whatever the budget
    /// (the default, `usize::MAX`: as many as the budget). The scheduler reserves a step's rows
    /// for a tree verified whole by this bound rather than the budget, so more requests share
    /// the step; a tree over it is cut to it.
    fn max_nodes(&self, _max_depth: usize) -> usize {
        usize::MAX
    }

    /// After each verification pass, before [`Drafter::accept`]: the logits of this drafter's
    /// placeholder group anchored at the last accepted node (the root when nothing was accepted),
    /// or `None` when it had no group there (or its groups did not fit in the pass).
    fn observe(&mut self, _group: Option<GroupLogits<'_>>) {}

    /// How many top candidates per computed row this drafter wants from each pass
    /// ([`Drafter::observe_candidates`]); 0 (the default): none, and nobody computes them.
    fn candidates_wanted(&self) -> usize {
        0
    }

    /// How many top candidates per prompt row this drafter wants from the prefill (a warm start:
    /// the output head then runs over every prompt row); 0 (the default): none.
    fn prompt_candidates(&self) -> usize {
        0
    }

    /// After a pass of the LLM over this sequence (a verification pass, before
    /// [`Drafter::accept`], and the prompt's prefill when [`Drafter::prompt_candidates`] asks):
    /// every row's input token and the top candidates of its logits.
    fn observe_candidates(&mut self, _rows: &RowCandidates<'_>) {}

    /// What each further verified row costs, in plain passes (with the adaptive policy's
    /// hurdle): `costs[i]` for a tree's `i + 1`-th draft node, as the adaptive policy last
    /// measured them ([`crate::sched::adaptive::row_costs`]; a pass over a few rows may cost
    /// little more than one over the root, the next rows far more); empty when nobody measures.
    /// A drafter that knows how likely each node is to be accepted proposes only the nodes worth
    /// their rows.
    fn set_row_costs(&mut self, _costs: &[f64]) {}

    /// Whether proposing again, with a larger budget, is cheap and changes nothing but the
    /// proposal (no LLM or draft-model passes, no state beyond the last proposal): a merge then
    /// gives this drafter the budget its fellow drafters left unused
    /// ([`crate::spec::draft_trees`]). Default: no.
    fn reproposes_cheaply(&self) -> bool {
        false
    }

    /// The drafter's batched form, when its passes can join other drafters' in one forward pass
    /// (model drafters): [`crate::spec::draft_trees`] then drafts many sequences together.
    /// Default: none (the drafter proposes alone).
    fn as_batch(&mut self) -> Option<&mut dyn BatchDrafter> {
        None
    }
}

/// A drafter whose proposal runs as passes that batch with other drafters' (one forward pass
/// per tree depth for many sequences): [`BatchDrafter::start`], then for every
/// [`DraftStep::Pass`] the pass's logits to [`BatchDrafter::resume`], until
/// [`DraftStep::Done`]. The tree equals what [`Drafter::propose`] returns.
pub trait BatchDrafter {
    /// Drafters with equal keys run one model's layers over one KV pool: their passes batch.
    fn batch_key(&self) -> BatchKey;

    /// Begin a proposal.
    fn start(&mut self, req: &DraftRequest<'_>) -> Result<DraftStep>;

    /// The logits of the last pass's logit rows (`[rows, vocab]`).
    fn resume(&mut self, logits: Vec<f32>) -> Result<DraftStep>;

    /// The cache a pass writes into.
    fn cache_mut(&mut self) -> &mut KvCache;

    /// Run one batched forward pass with this drafter's model and backend: `own` (this
    /// drafter's pending pass) first, then `others` (passes of drafters with this key, over
    /// their caches); each sequence's logits in that order.
    fn run_batch_with(
        &mut self,
        own: &DraftPass,
        others: Vec<SeqBatch<'_>>,
    ) -> Result<Vec<Vec<f32>>>;
}

/// What a batched drafter needs next.
#[derive(Debug)]
pub enum DraftStep {
    /// A forward pass over these new rows of its cache.
    Pass(DraftPass),
    /// The proposal.
    Done(TokenTree),
}

/// New rows of one drafter's sequence for a forward pass (owned: the pass runs elsewhere).
#[derive(Clone, Debug)]
pub struct DraftPass {
    /// `[n]` tokens and their positions.
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// Tree attention over scratch slots (`base`, words per row, `[n, words]` bits); `None` is
    /// a causal feed.
    pub scratch: Option<(usize, usize, Vec<u64>)>,
    /// Rows whose logits come back.
    pub logit_rows: Vec<usize>,
}

impl DraftPass {
    /// This pass as one sequence of a batch over `cache`.
    pub fn seq<'a>(&'a self, cache: &'a mut KvCache) -> SeqBatch<'a> {
        SeqBatch {
            cache,
            tokens: &self.tokens,
            positions: &self.positions,
            mask: match &self.scratch {
                Some((base, words, bits)) => BatchMask::Scratch {
                    base: *base,
                    words_per_row: *words,
                    bits,
                },
                None => BatchMask::Causal,
            },
            logit_rows: &self.logit_rows,
        }
    }
}

/// Which drafters batch together: the same model, backend, layer count and KV pool (by
/// identity).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BatchKey {
    model: usize,
    backend: usize,
    layers: usize,
    pool: usize,
}

impl BatchKey {
    pub fn new<B>(model: &Model, backend: &B, layers: usize, pool: &KvPool) -> BatchKey {
        BatchKey {
            model: model as *const Model as usize,
            backend: backend as *const B as *const () as usize,
            layers,
            pool: pool.id(),
        }
    }
}

/// A chain of placeholder tokens hanging off tree node `anchor`: token `j` sits at the position
/// after the anchor plus `j` and attends to the committed prefix, the anchor's path and the
/// group's earlier tokens only (never to other groups or other tree branches).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlaceholderGroup {
    pub anchor: usize,
    pub tokens: Vec<u32>,
}

/// The LLM's logits over one placeholder group, returned to the drafter that asked for it.
#[derive(Clone, Copy, Debug)]
pub struct GroupLogits<'a> {
    /// Index of the group in the list the drafter returned.
    pub group: usize,
    /// `[group length, vocab]`, row `j` = the LLM's next-token logits after placeholder `j`.
    pub logits: &'a [f32],
    pub vocab: usize,
}

/// The top candidates of the rows of one LLM pass: row `i` fed `tokens[i]`, and `top[i * k..]`
/// are the `k` highest-logit tokens after it, best first.
#[derive(Clone, Copy, Debug)]
pub struct RowCandidates<'a> {
    pub tokens: &'a [u32],
    /// Row `i`'s parent row on its path (`NO_ROW`: its path continues with `before`); empty:
    /// no path known.
    pub parents: &'a [u32],
    /// The sequence's last tokens before the rows' paths (at most [`CONTEXT_TOKENS`], oldest
    /// first).
    pub before: &'a [u32],
    pub k: usize,
    /// `[tokens.len(), k]`.
    pub top: &'a [u32],
}

/// Marks a row without a parent row in [`RowCandidates::parents`].
pub const NO_ROW: u32 = u32::MAX;

/// Most sequence tokens [`PassCandidates`] keep before a pass's rows.
pub const CONTEXT_TOKENS: usize = 4;

impl<'a> RowCandidates<'a> {
    /// Row `i`'s candidates, best first.
    pub fn row(&self, i: usize) -> &'a [u32] {
        self.top.get(i * self.k..(i + 1) * self.k).unwrap_or(&[])
    }

    /// Up to `n` tokens before row `i`'s token on its path, into `out` (most recent first);
    /// fewer where the path is not known that far.
    pub fn context(&self, i: usize, n: usize, out: &mut Vec<u32>) {
        out.clear();
        if self.parents.len() != self.tokens.len() {
            return;
        }
        let mut at = i;
        while out.len() < n {
            match self.parents.get(at).copied() {
                Some(p) if p != NO_ROW && (p as usize) < self.tokens.len() => {
                    at = p as usize;
                    out.push(self.tokens[at]);
                }
                _ => break,
            }
        }
        out.extend(self.before.iter().rev().take(n - out.len()));
    }
}

/// Owned candidates of one pass's rows (what a drafter outside the verifier is sent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassCandidates {
    pub tokens: Vec<u32>,
    /// As [`RowCandidates::parents`].
    pub parents: Vec<u32>,
    /// As [`RowCandidates::before`].
    pub before: Vec<u32>,
    pub k: usize,
    /// `[tokens.len(), k]`.
    pub top: Vec<u32>,
}

/// The last [`CONTEXT_TOKENS`] of `seq`.
fn tail(seq: &[u32]) -> Vec<u32> {
    seq[seq.len().saturating_sub(CONTEXT_TOKENS)..].to_vec()
}

impl PassCandidates {
    /// The top `k` of every row of `logits` (`[tokens.len(), vocab]`), rows fed in sequence
    /// after `before` (a prefill chunk and the sequence before it).
    pub fn of(
        tokens: Vec<u32>,
        before: &[u32],
        logits: &[f32],
        vocab: usize,
        k: usize,
    ) -> PassCandidates {
        PassCandidates::with_top(
            tokens,
            before,
            recycle::top_k_rows(logits, vocab, k),
            vocab,
            k,
        )
    }

    /// [`PassCandidates::of`] with the rows' top `k` already computed (`[tokens.len(), k]`).
    pub fn with_top(
        tokens: Vec<u32>,
        before: &[u32],
        top: Vec<u32>,
        vocab: usize,
        k: usize,
    ) -> PassCandidates {
        PassCandidates {
            top,
            k: k.min(vocab),
            parents: (0..tokens.len() as u32)
                .map(|i| i.checked_sub(1).unwrap_or(NO_ROW))
                .collect(),
            before: tail(before),
            tokens,
        }
    }

    /// The top `k` of every row of a verified tree's pass (`logits`: `[tree.len(), vocab]`),
    /// the tree rooted after `before` (the sequence before its root).
    pub fn of_tree(
        tree: &TokenTree,
        before: &[u32],
        logits: &[f32],
        vocab: usize,
        k: usize,
    ) -> PassCandidates {
        PassCandidates {
            top: recycle::top_k_rows(logits, vocab, k),
            k: k.min(vocab),
            parents: tree
                .nodes()
                .iter()
                .map(|n| n.parent.map_or(NO_ROW, |p| p as u32))
                .collect(),
            before: tail(before),
            tokens: tree.tokens(),
        }
    }

    pub fn rows(&self) -> RowCandidates<'_> {
        RowCandidates {
            tokens: &self.tokens,
            parents: &self.parents,
            before: &self.before,
            k: self.k,
            top: &self.top,
        }
    }
}

/// A test oracle: knows the sequence the LLM will produce (prompt + continuation). At each
/// on-path node its first child is the true next token; the other children the expansion config
/// asks for (and the children of off-path nodes) are random wrong tokens.
#[derive(Clone, Debug)]
pub struct OracleDrafter {
    truth: Vec<u32>,
    config: ExpansionConfig,
    rng: Rng,
}

impl OracleDrafter {
    /// `truth` = prompt followed by the expected continuation; `seed` drives the wrong siblings.
    pub fn new(truth: Vec<u32>, config: ExpansionConfig, seed: u64) -> OracleDrafter {
        OracleDrafter {
            truth,
            config,
            rng: Rng::new(seed),
        }
    }
}

impl Drafter for OracleDrafter {
    fn name(&self) -> &str {
        "oracle"
    }

    fn max_nodes(&self, max_depth: usize) -> usize {
        self.config.max_nodes_within(max_depth)
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let n = req.tokens.len();
        let on_track = self.truth.len() >= n && self.truth[..n] == *req.tokens;
        let future: &[u32] = if on_track { &self.truth[n..] } else { &[] };
        let width = self.config.branches().iter().copied().max().unwrap_or(1);
        let rng = &mut self.rng;
        let vocab = req.vocab.max(1) as u64;
        expand(
            &self.config,
            req.root(),
            req.drafter,
            ExpandMode::TopK,
            req.budget,
            req.max_depth,
            &mut Rng::new(0),
            |path| {
                // path = [root, t1, .., td]: on the true path when t1..td match the future.
                let d = path.len() - 1;
                let truth_next = (d < future.len() && path[1..] == future[..d]).then(|| future[d]);
                let mut dist = Vec::with_capacity(width + 1);
                if let Some(t) = truth_next {
                    dist.push((t, 1.0));
                }
                // Random wrong tokens with distinct weights below the true token's.
                for i in 0..width {
                    let t = (rng.next_u64() % vocab) as u32;
                    if Some(t) != truth_next {
                        dist.push((t, 0.5 / (i + 2) as f32));
                    }
                }
                if dist.is_empty() {
                    dist.push(((rng.next_u64() % vocab) as u32, 1.0));
                }
                Ok(dist)
            },
        )
    }
}

/// Random guesses (picked uniformly), shaped by an expansion config.
#[derive(Clone, Debug)]
pub struct RandomDrafter {
    config: ExpansionConfig,
    rng: Rng,
}

impl RandomDrafter {
    pub fn new(config: ExpansionConfig, seed: u64) -> RandomDrafter {
        RandomDrafter {
            config,
            rng: Rng::new(seed),
        }
    }
}

impl Drafter for RandomDrafter {
    fn name(&self) -> &str {
        "random"
    }

    fn max_nodes(&self, max_depth: usize) -> usize {
        self.config.max_nodes_within(max_depth)
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let width = self.config.branches().iter().copied().max().unwrap_or(1);
        let vocab = req.vocab.max(1) as u64;
        let rng = &mut self.rng;
        expand(
            &self.config,
            req.root(),
            req.drafter,
            ExpandMode::TopK,
            req.budget,
            req.max_depth,
            &mut Rng::new(0),
            |_| {
                Ok((0..width)
                    .map(|i| ((rng.next_u64() % vocab) as u32, 1.0 / (i + 1) as f32))
                    .collect())
            },
        )
    }
}

/// The next-token distribution a [`DistDrafter`] expands: given the whole sequence (the request's
/// tokens followed by the node's path below the root), (token, probability) pairs.
pub type DistFn = dyn FnMut(&[u32]) -> Result<Vec<(u32, f32)>> + Send;

/// Expands trees from a next-token distribution function: top-k children or sampled ones.
pub struct DistDrafter {
    name: String,
    config: ExpansionConfig,
    mode: ExpandMode,
    rng: Rng,
    dist: Box<DistFn>,
}

impl DistDrafter {
    pub fn new(
        name: impl Into<String>,
        config: ExpansionConfig,
        mode: ExpandMode,
        seed: u64,
        dist: Box<DistFn>,
    ) -> DistDrafter {
        DistDrafter {
            name: name.into(),
            config,
            mode,
            rng: Rng::new(seed),
            dist,
        }
    }
}

impl Drafter for DistDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_nodes(&self, max_depth: usize) -> usize {
        self.config.max_nodes_within(max_depth)
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let dist = &mut self.dist;
        let mut ctx = req.tokens.to_vec();
        let base = ctx.len();
        expand(
            &self.config,
            req.root(),
            req.drafter,
            self.mode,
            req.budget,
            req.max_depth,
            &mut self.rng,
            |path| {
                ctx.truncate(base);
                ctx.extend_from_slice(&path[1..]);
                dist(&ctx)
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oracle_puts_the_truth_first_and_respects_budget() {
        let truth = vec![5, 6, 7, 8, 9, 10];
        let cfg: ExpansionConfig = "2,2,2".parse().unwrap();
        let mut o = OracleDrafter::new(truth, cfg, 1);
        let req = DraftRequest {
            tokens: &[5, 6],
            budget: 5,
            max_depth: 8,
            drafter: 0,
            vocab: 50,
        };
        let t = o.propose(&req).unwrap();
        assert_eq!(t.root_token(), 6);
        assert!(t.n_draft() <= 5);
        // DFS order: node 1 is the first child of the root, the true token.
        assert_eq!(t.node(1).token, 7);
        assert_eq!(t.node(2).token, 8);
        t.validate(50).unwrap();
        // Off track: no true tokens known, still a valid tree.
        let t = o
            .propose(&DraftRequest {
                tokens: &[1, 2],
                ..req
            })
            .unwrap();
        t.validate(50).unwrap();
    }

    #[test]
    fn random_drafter_fills_the_shape() {
        let mut r = RandomDrafter::new("4,4,4,4".parse().unwrap(), 3);
        let t = r
            .propose(&DraftRequest {
                tokens: &[1],
                budget: 400,
                max_depth: 8,
                drafter: 0,
                vocab: 50_000,
            })
            .unwrap();
        assert_eq!(t.n_draft(), 4 + 16 + 64 + 256);
        assert_eq!(t.max_depth(), 4);
    }

    /// `Drafter::max_nodes` bounds every proposal at its depth whatever the budget (the
    /// scheduler reserves a step's rows by it), and the bounds are reached: sequences over a
    /// small vocabulary give prompt lookup its every match, Token Recycling a full matrix.
    #[test]
    fn max_nodes_bounds_every_proposal() {
        let mut rng = crate::sample::Rng::new(7);
        let mut reached = std::collections::HashMap::<String, usize>::new();
        for round in 0..40 {
            let vocab = 3 + round % 6;
            let seq: Vec<u32> = (0..60 + round)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect();
            let uniform: Vec<(u32, f32)> =
                (0..vocab as u32).map(|t| (t, 1.0 / vocab as f32)).collect();
            let mut drafters: Vec<Box<dyn Drafter>> = vec![
                Box::new(ngram::NgramDrafter::default()),
                Box::new(ngram::NgramDrafter::new(4, 1, 5, 4).unwrap()),
                Box::new(RecycleDrafter::new(vocab, 8).unwrap()),
                Box::new(RandomDrafter::new("3,2,2".parse().unwrap(), round as u64)),
                Box::new(DistDrafter::new(
                    "sampled",
                    "4,2".parse().unwrap(),
                    ExpandMode::Sample,
                    round as u64,
                    Box::new(move |_: &[u32]| Ok(uniform.clone())),
                )),
                Box::new(FallbackDrafter::new(
                    Box::new(ngram::NgramDrafter::default()),
                    Box::new(RandomDrafter::new("2,2".parse().unwrap(), 1)),
                )),
            ];
            for d in drafters.iter_mut() {
                for max_depth in 0..10 {
                    let t = d
                        .propose(&DraftRequest {
                            tokens: &seq,
                            budget: 10_000,
                            max_depth,
                            drafter: 0,
                            vocab,
                        })
                        .unwrap();
                    let bound = d.max_nodes(max_depth);
                    assert!(
                        t.n_draft() <= bound,
                        "{}: {} nodes at depth {max_depth}, bound {bound}",
                        d.name(),
                        t.n_draft()
                    );
                    if t.n_draft() == bound && max_depth > 0 {
                        *reached.entry(d.name().to_string()).or_default() += 1;
                    }
                }
            }
        }
        // Every drafter's bound is its largest proposal somewhere (not a loose guess).
        for name in ["ngram", "random", "sampled", "ngram else random"] {
            assert!(
                reached.get(name).is_some_and(|&n| n > 0),
                "{name}: {reached:?}"
            );
        }
        // Token Recycling over a matrix where every token has eight successors fills the
        // template at every depth.
        let matrix = std::sync::Arc::new(std::sync::Mutex::new(RecycleMatrix::new(16, 8).unwrap()));
        for t in 0..16u32 {
            let next: Vec<u32> = (1..=8).map(|k| (t + k) % 16).collect();
            matrix.lock().unwrap().update(t, &next);
        }
        let template = std::sync::Arc::new(RecycleTemplate::paper());
        let mut d = RecycleDrafter::shared(matrix, template).unwrap();
        for max_depth in 0..10 {
            let t = d
                .propose(&DraftRequest {
                    tokens: &[3, 4, 5],
                    budget: 10_000,
                    max_depth,
                    drafter: 0,
                    vocab: 16,
                })
                .unwrap();
            assert_eq!(t.n_draft(), d.max_nodes(max_depth), "depth {max_depth}");
        }
        assert_eq!(d.max_nodes(6), 80);
    }
}
