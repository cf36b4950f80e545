//! Speculative generation with token trees (SpecInfer, Miao et al., ASPLOS 2024): draft a tree, verify it in one LLM pass, commit the accepted path's K/V.
//!
//! Sequence convention: the KV cache holds every token but the last one sampled (the *root*).
//! A step asks the drafters for trees rooted at the root, merges them, runs one forward pass over
//! `[root, nodes…]` (node at depth d at position `cache.len() + d`, tree attention mask), verifies
//! (greedy / MSS / naive), then keeps the K/V rows of the root and the accepted nodes, compacted
//! so slots equal positions, and drops the rest. The bonus token becomes the next root. Accepted
//! tokens are never recomputed.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::draft::{
    BatchDrafter, BatchKey, DraftPass, DraftRequest, DraftStep, Drafter, GroupLogits,
    PassCandidates, PlaceholderGroup,
};
use crate::error::{EngineError, Result};
use crate::generate::{
    check_prompt, prefill, FinishReason, GenerateOutput, GenerateParams, ResponseFormat, TokenSink,
};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sample::json::JsonVocab;
use crate::sample::penalty::PenaltyHistory;
use crate::sample::verify::{Verifier, VerifyMode, VerifyOutcome};
use crate::sample::Sampler;
use crate::sched::adaptive::{
    choose_depths, drafting_pays, median, nodes_upto, row_costs, useful_budget, Acceptance,
    DepthOptions, DraftBackoff, GainCalibration, StepBase, StepCost, CHEAP_DRAFT, COSTLY_DRAFT,
};
use crate::tokenizer::Tokenizer;
use crate::tree::{DrafterId, TokenTree, TreeMask};

/// Speculation settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecParams {
    /// Most draft nodes per step (root excluded), shared by the drafters.
    pub budget: usize,
    /// Verification rule; `None` = greedy for greedy sampling, MSS otherwise.
    pub mode: Option<VerifyMode>,
    /// Verify only the tree depth that pays (the scheduler's goodput policy,
    /// [`crate::sched::adaptive`]): where drafts are rarely accepted, steps fall back to plain
    /// decoding. `false`: verify the whole drafted tree every step.
    pub adaptive: bool,
    /// The pass cost by row count the adaptive policy starts from (e.g. a calibration); `None`:
    /// learnt from the request's first passes. Its shape is kept; its scale follows the passes.
    pub step_cost: Option<StepCost>,
}

impl Default for SpecParams {
    fn default() -> Self {
        SpecParams {
            budget: 64,
            mode: None,
            adaptive: false,
            step_cost: None,
        }
    }
}

/// Per-request speculation counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecMetrics {
    /// Verification passes.
    pub steps: usize,
    /// Draft nodes verified (after merging).
    pub drafted: usize,
    /// Draft tokens accepted (bonus tokens not counted).
    pub accepted: usize,
    /// `accepted_by_depth[d]`: steps whose accepted path reached depth d + 1.
    pub accepted_by_depth: Vec<usize>,
    /// `drafted_by_depth[d]`: draft nodes proposed at depth d + 1.
    pub drafted_by_depth: Vec<usize>,
    /// SPACE placeholder rows run alongside the trees (never verified).
    pub placeholder_rows: usize,
    /// Broken drafter contracts: per step, the drafters whose proposals verification ignored
    /// because they recorded a node as sampled that their distribution gave no mass
    /// ([`VerifyOutcome::broken_drafters`]). Nonzero means a drafter is buggy; output stays
    /// lossless, only that drafter's speculation is lost.
    pub drafter_contract_failures: usize,
}

impl SpecMetrics {
    /// Mean accepted draft tokens per verification pass (each pass also emits one bonus token).
    pub fn mean_accepted(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.accepted as f64 / self.steps as f64
        }
    }

    /// Per depth d (index d - 1): the fraction of steps whose accepted path reached depth d.
    pub fn acceptance_by_depth(&self) -> Vec<f64> {
        self.accepted_by_depth
            .iter()
            .map(|&a| a as f64 / self.steps.max(1) as f64)
            .collect()
    }

    /// Count one verified step.
    pub fn record(&mut self, tree: &TokenTree, outcome: &VerifyOutcome) {
        self.steps += 1;
        self.drafted += tree.n_draft();
        self.accepted += outcome.accepted.len();
        self.drafter_contract_failures += outcome.broken_drafters.len();
        let by_depth = tree.nodes_by_depth();
        grow(&mut self.drafted_by_depth, by_depth.len());
        for (d, n) in by_depth.iter().enumerate() {
            self.drafted_by_depth[d] += n;
        }
        grow(&mut self.accepted_by_depth, outcome.accepted.len());
        for d in 0..outcome.accepted.len() {
            self.accepted_by_depth[d] += 1;
        }
    }
}

fn grow(v: &mut Vec<usize>, n: usize) {
    if v.len() < n {
        v.resize(n, 0);
    }
}

/// One forward pass over `[root, nodes…]` with tree attention: the tree's rows are appended to
/// `cache` at slots `cache.len()..` (scratch until committed). Returns `[tree.len(), vocab]` logits.
pub fn tree_logits<B: Backend>(
    model: &Model,
    backend: &B,
    cache: &mut KvCache,
    tree: &TokenTree,
) -> Result<Vec<f32>> {
    let mask = tree.mask();
    let rows: Vec<usize> = (0..tree.len()).collect();
    model.forward(
        backend,
        cache,
        &tree.tokens(),
        &tree.positions(cache.len()),
        mask.as_batch_mask(),
        &rows,
    )
}

/// What [`verify_step`] returns.
#[derive(Debug)]
pub struct VerifiedStep {
    pub outcome: VerifyOutcome,
    /// Per placeholder group, its logits `[len, vocab]` when it hangs off the last accepted node.
    pub group_logits: Vec<Option<Vec<f32>>>,
    /// The top candidates of every tree row, when asked for.
    pub candidates: Option<PassCandidates>,
}

/// Verify `tree` in one pass and commit: afterwards `cache` holds the root's and the accepted
/// nodes' K/V at their positions (`len` grows by 1 + accepted) and nothing else.
///
/// SPACE placeholder `groups` (possibly none) ride along as rows after the tree's, each a chain
/// hanging off its anchor node (see [`crate::draft::space`]). The tree's rows never see a
/// placeholder, so verification is exactly that of the tree alone; placeholder K/V rows are
/// dropped. Returns the outcome, per group its logits `[len, vocab]` when the group hangs
/// off the last accepted node (the only ones a drafter can use; the others' output head is
/// skipped), and with `candidates = (k, before)`, `k > 0`, the top `k` tokens of every tree row
/// (Token Recycling; `before`, the sequence before the root, is the rows' context). With
/// `penalties` (the history up to the root), the tree's rows are penalized before anything
/// reads them.
#[allow(clippy::too_many_arguments)]
pub fn verify_step<B: Backend>(
    model: &Model,
    backend: &B,
    cache: &mut KvCache,
    tree: &TokenTree,
    groups: &[&PlaceholderGroup],
    verifier: &mut Verifier,
    penalties: Option<&PenaltyHistory>,
    candidates: (usize, &[u32]),
) -> Result<VerifiedStep> {
    let base = cache.len();
    let vocab = model.config.vocab_size;
    let t = tree.len();
    let mut tokens = tree.tokens();
    let mut positions = tree.positions(base);
    let mut parents: Vec<Option<usize>> = tree.nodes().iter().map(|n| n.parent).collect();
    let mut starts = Vec::with_capacity(groups.len());
    for g in groups {
        if g.anchor >= t || g.tokens.is_empty() {
            return Err(EngineError::InvalidArgument(format!(
                "placeholder group at node {} of a {t}-node tree with {} tokens",
                g.anchor,
                g.tokens.len()
            )));
        }
        if let Some(&bad) = g.tokens.iter().find(|&&x| x as usize >= vocab) {
            return Err(EngineError::InvalidArgument(format!(
                "placeholder token {bad} outside the vocabulary ({vocab})"
            )));
        }
        starts.push(tokens.len());
        let pos0 = base + tree.node(g.anchor).depth + 1;
        for (j, &x) in g.tokens.iter().enumerate() {
            parents.push(Some(if j == 0 { g.anchor } else { tokens.len() - 1 }));
            tokens.push(x);
            positions.push(pos0 + j);
        }
    }
    let mask = TreeMask::from_parents(&parents);
    let run = |cache: &mut KvCache, verifier: &mut Verifier| {
        let hidden =
            model.forward_hidden(backend, cache, &tokens, &positions, mask.as_batch_mask())?;
        let rows: Vec<usize> = (0..t).collect();
        let mut logits = model.logits_of(backend, &hidden, &rows)?; // [t, vocab]
        if let Some(h) = penalties {
            h.penalize_tree(tree, &mut logits, vocab);
        }
        let o = verifier.verify(tree, &logits, vocab)?;
        let (k, before) = candidates;
        let cands = (k > 0).then(|| PassCandidates::of_tree(tree, before, &logits, vocab, k));
        let last = o.accepted.last().copied().unwrap_or(0);
        let mut out = Vec::with_capacity(groups.len());
        for (g, &start) in groups.iter().zip(&starts) {
            out.push(if g.anchor == last {
                let rows: Vec<usize> = (start..start + g.tokens.len()).collect();
                Some(model.logits_of(backend, &hidden, &rows)?)
            } else {
                None
            });
        }
        Ok(VerifiedStep {
            outcome: o,
            group_logits: out,
            candidates: cands,
        })
    };
    match run(cache, verifier) {
        Ok(v) => {
            cache.commit_rows(base, &v.outcome.kv_rows())?;
            Ok(v)
        }
        Err(e) => {
            cache.truncate(base);
            Err(e)
        }
    }
}

/// Rows of the first tree an adaptive request verifies before it knows what passes cost.
const FIRST_TREE_ROWS: usize = 8;

/// Row counts an adaptive request's next trees verify after the first, each pass a point of its
/// cost curve: the first tree's pass and the plain ones alone draw a straight line from one row
/// to `FIRST_TREE_ROWS`, while a pass that streams the weights (a CPU) costs about the same over
/// the first few rows. Each size twice, the faster pass kept (`StepCost::add_point`): rows 2 to
/// 5 cost a few percent more than one, less than a shared VM's noise on one pass, and a slow
/// pass priced them out of the trees for the rest of the request.
const EXPLORE_ROWS: [usize; 6] = [2, 4, 6, 2, 4, 6];

/// Drafted steps after which an adaptive request stops exploring sizes its drafts did not fill.
const EXPLORE_TRIES: usize = 12;

/// Depth of the first proposal an adaptive request drafts (a model drafter's passes are paid
/// per depth).
const FIRST_DRAFT_DEPTH: usize = 4;

/// The deepest depth-prefix of `tree` with at most `max_rows` nodes (the root at least).
fn prefix_within(tree: &TokenTree, max_rows: usize) -> TokenTree {
    let mut best = tree.truncate_depth(0);
    for d in 1..=tree.max_depth() {
        let t = tree.truncate_depth(d);
        if t.len() > max_rows {
            break;
        }
        best = t;
    }
    best
}

/// Ask every drafter for a tree rooted at the last of `tokens` (drafter i gets an equal share of
/// `budget` and id i), check each, cut it to `max_depth` and merge them.
pub fn draft_tree(
    drafters: &mut [&mut dyn Drafter],
    tokens: &[u32],
    budget: usize,
    max_depth: usize,
    vocab: usize,
) -> Result<TokenTree> {
    draft_one(drafters, tokens, budget, max_depth, vocab, None)
}

/// [`draft_tree`] that survives its drafters: a drafter that errors, panics or proposes an
/// invalid tree is left out of this step's tree and reported as `(index, message)`; the tree of
/// the others (at least the root) is still returned.
pub fn draft_tree_tolerant(
    drafters: &mut [&mut dyn Drafter],
    tokens: &[u32],
    budget: usize,
    max_depth: usize,
    vocab: usize,
    failures: &mut Vec<(usize, String)>,
) -> Result<TokenTree> {
    draft_one(drafters, tokens, budget, max_depth, vocab, Some(failures))
}

/// [`draft_trees`] for one sequence.
fn draft_one(
    drafters: &mut [&mut dyn Drafter],
    tokens: &[u32],
    budget: usize,
    max_depth: usize,
    vocab: usize,
    failures: Option<&mut Vec<(usize, String)>>,
) -> Result<TokenTree> {
    let mut jobs = [DraftJobRef {
        drafters,
        tokens,
        budget,
        max_depth,
    }];
    let mut lists = vec![Vec::new()];
    let tolerant = failures.is_some();
    let mut trees = draft_trees(&mut jobs, vocab, tolerant.then_some(&mut lists))?;
    if let (Some(f), Some(list)) = (failures, lists.pop()) {
        f.extend(list);
    }
    Ok(trees.pop().expect("one tree per job"))
}

/// One sequence's drafting for a step: its drafters (drafter i gets id i and an equal share of
/// `budget`), its tokens (the last is the root) and its deepest useful depth.
pub struct DraftJobRef<'j, 'd> {
    pub drafters: &'j mut [&'d mut dyn Drafter],
    pub tokens: &'j [u32],
    pub budget: usize,
    pub max_depth: usize,
}

/// The drafting loop of a step: every job's drafters propose, and each job's checked trees are
/// merged into its tree. Model drafters of one model and KV pool ([`Drafter::as_batch`]) run
/// one forward pass per tree depth for all jobs together ([`propose_many`]). With `failures`
/// (one list per job) a drafter that errors, panics or proposes an invalid tree is left out of
/// its job's tree and reported as `(index, message)`; without, the first failure is the result.
pub fn draft_trees(
    jobs: &mut [DraftJobRef<'_, '_>],
    vocab: usize,
    mut failures: Option<&mut Vec<Vec<(usize, String)>>>,
) -> Result<Vec<TokenTree>> {
    let roots: Vec<u32> = jobs
        .iter()
        .map(|j| draft_root(j.tokens))
        .collect::<Result<_>>()?;
    let budgets: Vec<usize> = jobs.iter().map(|j| j.budget).collect();
    let mut items = Vec::new();
    let mut owner = Vec::new();
    for (j, job) in jobs.iter_mut().enumerate() {
        let n = job.drafters.len();
        let (tokens, budget, max_depth) = (job.tokens, job.budget, job.max_depth);
        for (i, d) in job.drafters.iter_mut().enumerate() {
            items.push(ProposeItem {
                drafter: &mut **d,
                tokens,
                index: i,
                of: n,
                budget,
                max_depth,
                vocab,
            });
            owner.push((j, i));
        }
    }
    let mut proposed = propose_many(&mut items);
    share_leftover(&budgets, &mut items, &owner, &mut proposed);
    let mut trees: Vec<Vec<TokenTree>> = roots
        .iter()
        .map(|&r| vec![TokenTree::root_only(r)])
        .collect();
    for ((j, i), r) in owner.into_iter().zip(proposed) {
        match (r, failures.as_deref_mut()) {
            (Ok(t), _) => trees[j].push(t),
            (Err(e), Some(f)) => {
                if let Some(list) = f.get_mut(j) {
                    list.push((i, e.to_string()));
                }
            }
            (Err(e), None) => return Err(e),
        }
    }
    trees.iter().map(|t| TokenTree::merge(t)).collect()
}

/// The budget a job's drafters left unused (each gets an equal share; prompt lookup often finds
/// nothing) goes to those of them that filled their share and propose again cheaply
/// ([`Drafter::reproposes_cheaply`]): they propose once more with their share and an equal part
/// of the leftover, that proposal replacing their first.
fn share_leftover(
    budgets: &[usize],
    items: &mut [ProposeItem<'_>],
    owner: &[(usize, usize)],
    proposed: &mut [Result<TokenTree>],
) {
    let shares: Vec<usize> = items
        .iter()
        .map(|it| it.request().map_or(0, |r| r.budget))
        .collect();
    for (j, &budget) in budgets.iter().enumerate() {
        let mine: Vec<usize> = (0..items.len()).filter(|&k| owner[k].0 == j).collect();
        if mine.len() < 2 {
            continue;
        }
        let share = |k: usize| shares[k];
        // A tree with sampled draws counts as its whole share: its distinct nodes depend on
        // which tokens the draws hit, and extra room for the others must not (MSS).
        let used: usize = mine
            .iter()
            .map(|&k| match &proposed[k] {
                Ok(t) if t.has_sampled() => t.n_draft().max(share(k)),
                Ok(t) => t.n_draft(),
                Err(_) => 0,
            })
            .sum();
        let left = budget.saturating_sub(used);
        let full: Vec<usize> = mine
            .iter()
            .copied()
            .filter(|&k| {
                items[k].drafter.reproposes_cheaply()
                    && proposed[k]
                        .as_ref()
                        .is_ok_and(|t| t.n_draft() > 0 && t.n_draft() >= share(k))
            })
            .collect();
        if left == 0 || full.is_empty() {
            continue;
        }
        for (n, &k) in full.iter().enumerate() {
            let extra = left / full.len() + usize::from(n < left % full.len());
            let it = &mut items[k];
            let mut again = [ProposeItem {
                drafter: &mut *it.drafter,
                tokens: it.tokens,
                index: it.index,
                of: 1,
                budget: share(k) + extra,
                max_depth: it.max_depth,
                vocab: it.vocab,
            }];
            if let Some(Ok(t)) = propose_many(&mut again).pop() {
                proposed[k] = Ok(t);
            }
        }
    }
}

/// The text of a caught panic.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

fn draft_root(tokens: &[u32]) -> Result<u32> {
    tokens
        .last()
        .copied()
        .ok_or_else(|| EngineError::InvalidArgument("drafting needs at least one token".into()))
}

/// Drafter `i` of `n`: its share of `budget`, its proposal checked and cut to `max_depth`.
pub fn propose_checked(
    d: &mut dyn Drafter,
    i: usize,
    n: usize,
    tokens: &[u32],
    budget: usize,
    max_depth: usize,
    vocab: usize,
) -> Result<TokenTree> {
    let mut one = [ProposeItem {
        drafter: d,
        tokens,
        index: i,
        of: n,
        budget,
        max_depth,
        vocab,
    }];
    propose_many(&mut one).pop().expect("one result per item")
}

/// Batched drafters of one key: (item index, drafter).
type BatchGroup<'a> = Vec<(usize, &'a mut dyn BatchDrafter)>;

/// One drafter's proposal for one sequence: drafter `index` of the sequence's `of`.
pub struct ProposeItem<'a> {
    pub drafter: &'a mut dyn Drafter,
    pub tokens: &'a [u32],
    pub index: usize,
    pub of: usize,
    /// The sequence's budget (the drafter gets its share) and deepest useful depth.
    pub budget: usize,
    pub max_depth: usize,
    pub vocab: usize,
}

impl<'a> ProposeItem<'a> {
    /// A sequence's only drafter.
    pub fn sole(
        drafter: &'a mut dyn Drafter,
        tokens: &'a [u32],
        budget: usize,
        max_depth: usize,
        vocab: usize,
    ) -> ProposeItem<'a> {
        ProposeItem {
            drafter,
            tokens,
            index: 0,
            of: 1,
            budget,
            max_depth,
            vocab,
        }
    }

    /// The drafter's request: its share of the budget, its id.
    fn request(&self) -> Result<DraftRequest<'a>> {
        draft_root(self.tokens)?;
        let id = DrafterId::try_from(self.index)
            .map_err(|_| EngineError::InvalidArgument("too many drafters".into()))?;
        let n = self.of.max(1);
        Ok(DraftRequest {
            tokens: self.tokens,
            budget: self.budget / n + usize::from(self.index < self.budget % n),
            max_depth: self.max_depth,
            drafter: id,
            vocab: self.vocab,
        })
    }
}

/// Run `f`, a panic becoming an error naming `what`.
fn caught<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(EngineError::InvalidArgument(format!(
            "{what} panicked: {}",
            panic_message(&*p)
        )))
    })
}

/// Every item's checked proposal (its share of the budget, validated, rooted at the sequence's
/// last token, cut to `max_depth`; a panic is an error). Drafters with the same
/// [`crate::draft::BatchKey`] run their passes together: one forward pass per tree depth for all
/// of them, each tree equal to what the drafter proposes alone.
pub fn propose_many(items: &mut [ProposeItem<'_>]) -> Vec<Result<TokenTree>> {
    let mut out: Vec<Option<Result<TokenTree>>> = (0..items.len()).map(|_| None).collect();
    // Each item's request; a bad one is that item's result.
    let mut reqs: Vec<Option<DraftRequest<'_>>> = Vec::with_capacity(items.len());
    for (k, it) in items.iter().enumerate() {
        match it.request() {
            Ok(r) => reqs.push(Some(r)),
            Err(e) => {
                out[k] = Some(Err(e));
                reqs.push(None);
            }
        }
    }
    // Batched drafters by key, in first-seen order; the others propose alone.
    let mut groups: Vec<(BatchKey, BatchGroup<'_>)> = Vec::new();
    for (k, it) in items.iter_mut().enumerate() {
        let Some(req) = &reqs[k] else { continue };
        if it.drafter.as_batch().is_none() {
            out[k] = Some(caught("drafter", || it.drafter.propose(req)));
            continue;
        }
        let Some(b) = it.drafter.as_batch() else {
            continue;
        };
        let key = b.batch_key();
        match groups.iter_mut().find(|(g, _)| *g == key) {
            Some((_, members)) => members.push((k, b)),
            None => groups.push((key, vec![(k, b)])),
        }
    }
    for (_, mut members) in groups {
        // Pending passes: (member, pass), in member order.
        let mut pending: Vec<(usize, DraftPass)> = Vec::new();
        for (m, (k, b)) in members.iter_mut().enumerate() {
            let Some(req) = &reqs[*k] else { continue };
            match caught("drafter", || b.start(req)) {
                Ok(DraftStep::Pass(p)) => pending.push((m, p)),
                Ok(DraftStep::Done(t)) => out[*k] = Some(Ok(t)),
                Err(e) => out[*k] = Some(Err(e)),
            }
        }
        while !pending.is_empty() {
            // One pass for all: the first pending member runs it over every pending cache.
            let ran = {
                let mut runner: Option<(&mut dyn BatchDrafter, &DraftPass)> = None;
                let mut others = Vec::new();
                let mut next = pending.iter().peekable();
                for (m, (_, b)) in members.iter_mut().enumerate() {
                    let Some((_, pass)) = next.next_if(|(pm, _)| *pm == m) else {
                        continue;
                    };
                    match runner {
                        None => runner = Some((&mut **b, pass)),
                        Some(_) => others.push(pass.seq(b.cache_mut())),
                    }
                }
                let (b, pass) = runner.expect("a pending member runs the pass");
                caught("a batched draft pass", || b.run_batch_with(pass, others))
            };
            let mut still = Vec::new();
            match ran {
                Ok(logits) => {
                    for ((m, _), lg) in pending.into_iter().zip(logits) {
                        let (k, b) = &mut members[m];
                        match caught("drafter", || b.resume(lg)) {
                            Ok(DraftStep::Pass(p)) => still.push((m, p)),
                            Ok(DraftStep::Done(t)) => out[*k] = Some(Ok(t)),
                            Err(e) => out[*k] = Some(Err(e)),
                        }
                    }
                }
                Err(e) => {
                    // The first pending member gets the error, the others its message.
                    let msg = e.to_string();
                    let mut e = Some(e);
                    for (m, _) in pending {
                        let k = members[m].0;
                        out[k] = Some(Err(e.take().unwrap_or_else(|| {
                            EngineError::InvalidArgument(format!("a batched draft pass: {msg}"))
                        })));
                    }
                }
            }
            pending = still;
        }
    }
    out.into_iter()
        .zip(items.iter())
        .zip(&reqs)
        .map(|((r, it), req)| match (r, req) {
            (Some(Ok(t)), Some(req)) => check_proposal(&*it.drafter, t, req),
            (Some(Err(e)), _) => Err(e),
            _ => Err(EngineError::InvalidArgument(
                "a drafter ended without a proposal".into(),
            )),
        })
        .collect()
}

/// A drafter's tree checked against its request: valid, rooted at the root, within its share,
/// cut to the request's depth.
fn check_proposal(d: &dyn Drafter, t: TokenTree, req: &DraftRequest<'_>) -> Result<TokenTree> {
    t.validate(req.vocab)?;
    let root = req.root();
    if t.root_token() != root {
        return Err(EngineError::InvalidArgument(format!(
            "drafter '{}' proposed a tree rooted at {} instead of {root}",
            d.name(),
            t.root_token()
        )));
    }
    if t.n_draft() > req.budget {
        return Err(EngineError::InvalidArgument(format!(
            "drafter '{}' proposed {} nodes over its budget of {}",
            d.name(),
            t.n_draft(),
            req.budget
        )));
    }
    // Its proposals carry its own id (verification checks sampled draws against the
    // distribution recorded under that id) and at most its budget in draws each (verification
    // makes one candidate per draw).
    for n in &t.nodes()[1..] {
        for p in &n.proposals {
            if p.drafter != req.drafter || p.draws == 0 || p.draws as usize > req.budget.max(1) {
                return Err(EngineError::InvalidArgument(format!(
                    "drafter '{}' proposed token {} as drafter {} with {} draws (it is drafter {} \
                     with a budget of {})",
                    d.name(),
                    n.token,
                    p.drafter,
                    p.draws,
                    req.drafter,
                    req.budget
                )));
            }
        }
    }
    Ok(t.truncate_depth(req.max_depth))
}

/// A sequence being decoded speculatively: its KV cache, its tokens and its verifier.
pub struct SpecSession<'m, B: Backend> {
    model: &'m Model,
    backend: &'m B,
    cache: KvCache,
    /// The whole sequence; the last token is the root (not in `cache`).
    tokens: Vec<u32>,
    verifier: Verifier,
    budget: usize,
    metrics: SpecMetrics,
    /// The tokens the penalties weigh (None without penalties).
    penalties: Option<PenaltyHistory>,
}

impl<'m, B: Backend> SpecSession<'m, B> {
    /// `cache` must hold the K/V of `tokens[..tokens.len() - 1]`; the last token is the first root.
    pub fn new(
        model: &'m Model,
        backend: &'m B,
        cache: KvCache,
        tokens: Vec<u32>,
        verifier: Verifier,
        budget: usize,
    ) -> Result<Self> {
        if tokens.is_empty() || cache.len() + 1 != tokens.len() {
            return Err(EngineError::InvalidArgument(format!(
                "a speculative session needs the K/V of all tokens but the last ({} tokens, {} cached)",
                tokens.len(),
                cache.len()
            )));
        }
        Ok(SpecSession {
            model,
            backend,
            cache,
            tokens,
            verifier,
            budget,
            metrics: SpecMetrics::default(),
            penalties: None,
        })
    }

    /// Bias, penalize and (JSON mode, reading the vocabulary `json`) mask every row this
    /// session verifies from now on, by `params`: `tokens[..prompt_len]` are the prompt, the
    /// rest generated (params with none of them turn them off).
    pub fn set_penalties(
        &mut self,
        params: &GenerateParams,
        prompt_len: usize,
        json: Option<&Arc<JsonVocab>>,
    ) -> Result<()> {
        params.validate(self.model.config.vocab_size)?;
        let prompt_len = prompt_len.min(self.tokens.len());
        self.penalties = params
            .logits_history(&self.tokens[..prompt_len], json)?
            .map(|mut h| {
                for &t in &self.tokens[prompt_len..] {
                    h.push(t);
                }
                h
            });
        Ok(())
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn metrics(&self) -> &SpecMetrics {
        &self.metrics
    }

    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    /// End the session, keeping the verifier (and its random stream) for the next one.
    pub fn into_verifier(self) -> Verifier {
        self.verifier
    }

    /// The cost of a forward pass over each of `sizes` rows (those that fit), timed on scratch
    /// rows appended to this session's cache and dropped again.
    pub fn measure_cost(&mut self, sizes: &[usize]) -> Result<StepCost> {
        let room = self.cache.capacity().saturating_sub(self.cache.len());
        let sizes: Vec<usize> = sizes.iter().copied().filter(|&n| n <= room).collect();
        StepCost::measure_in(self.model, self.backend, &mut self.cache, &sizes, 1)
    }

    /// Ask every drafter for a tree (drafter i gets an equal share of the budget and id i),
    /// merge them, check the result and cut it to `max_depth`.
    pub fn draft(
        &mut self,
        drafters: &mut [&mut dyn Drafter],
        max_depth: usize,
    ) -> Result<TokenTree> {
        self.draft_within(drafters, max_depth, self.budget)
    }

    /// [`SpecSession::draft`] with at most `budget` draft nodes (capped by the session's).
    pub fn draft_within(
        &mut self,
        drafters: &mut [&mut dyn Drafter],
        max_depth: usize,
        budget: usize,
    ) -> Result<TokenTree> {
        let room = self.cache.capacity().saturating_sub(self.cache.len());
        if room == 0 {
            return Err(EngineError::ContextOverflow {
                needed: self.cache.len() + 1,
                limit: self.cache.capacity(),
            });
        }
        let budget = self.budget.min(budget).min(room - 1);
        let vocab = self.model.config.vocab_size;
        draft_tree(drafters, &self.tokens, budget, max_depth, vocab)
    }

    /// Verify `tree` (rooted at the current root), commit, and tell the drafters.
    pub fn verify(
        &mut self,
        tree: &TokenTree,
        drafters: &mut [&mut dyn Drafter],
    ) -> Result<VerifyOutcome> {
        let root = self.tokens[self.tokens.len() - 1];
        if tree.root_token() != root {
            return Err(EngineError::InvalidArgument(format!(
                "tree root {} is not the sequence's last token {root}",
                tree.root_token()
            )));
        }
        // SPACE placeholder groups: (drafter, index in its list, group).
        let mut groups: Vec<(usize, usize, PlaceholderGroup)> = Vec::new();
        for (i, d) in drafters.iter_mut().enumerate() {
            for (j, g) in d.placeholders(tree).into_iter().enumerate() {
                groups.push((i, j, g));
            }
        }
        let extra: usize = groups.iter().map(|g| g.2.tokens.len()).sum();
        let room = self.cache.capacity().saturating_sub(self.cache.len());
        if tree.len() + extra > room {
            groups.clear(); // no scratch room for them: verify the tree alone
        }
        let refs: Vec<&PlaceholderGroup> = groups.iter().map(|g| &g.2).collect();
        let wanted = drafters
            .iter()
            .map(|d| d.candidates_wanted())
            .max()
            .unwrap_or(0);
        let VerifiedStep {
            outcome: o,
            group_logits,
            candidates,
        } = verify_step(
            self.model,
            self.backend,
            &mut self.cache,
            tree,
            &refs,
            &mut self.verifier,
            self.penalties.as_ref(),
            // The root is the sequence's last token.
            (wanted, &self.tokens[..self.tokens.len().saturating_sub(1)]),
        )?;
        self.metrics.record(tree, &o);
        if !groups.is_empty() {
            self.metrics.placeholder_rows += extra;
        }
        let emitted = o.emitted();
        if let Some(h) = self.penalties.as_mut() {
            for &t in &emitted {
                h.push(t);
            }
        }
        self.tokens.extend(emitted);
        let vocab = self.model.config.vocab_size;
        for (i, d) in drafters.iter_mut().enumerate() {
            let seen = groups
                .iter()
                .zip(&group_logits)
                .find_map(|((di, j, _), l)| match l {
                    Some(l) if *di == i => Some(GroupLogits {
                        group: *j,
                        logits: l,
                        vocab,
                    }),
                    _ => None,
                });
            d.observe(seen);
            if let Some(c) = candidates.as_ref().filter(|_| d.candidates_wanted() > 0) {
                d.observe_candidates(&c.rows());
            }
            d.accept(&o.tokens, o.bonus);
        }
        Ok(o)
    }

    /// One speculative step: draft, merge, verify, commit. Returns the outcome; the tokens it
    /// adds to the sequence are `outcome.emitted()`.
    pub fn step(
        &mut self,
        drafters: &mut [&mut dyn Drafter],
        max_depth: usize,
    ) -> Result<VerifyOutcome> {
        let tree = self.draft(drafters, max_depth)?;
        self.verify(&tree, drafters)
    }
}

/// Prompt rows per output-head call of [`prefill_candidates`] (bounds its logits buffer).
const CANDIDATE_ROWS: usize = 64;

/// [`prefill`] that also returns the top `k` candidates of every prompt row: one pass over the
/// prompt for the hidden states, then the output head over chunks of rows. The last row's
/// logits are the same bits as [`prefill`]'s.
pub fn prefill_candidates<B: Backend>(
    model: &Model,
    backend: &B,
    cache: &mut KvCache,
    prompt: &[u32],
    k: usize,
) -> Result<(Vec<f32>, f64, PassCandidates)> {
    let t0 = Instant::now();
    let positions: Vec<usize> = (0..prompt.len()).collect();
    let hidden = model.forward_hidden(
        backend,
        cache,
        prompt,
        &positions,
        crate::backend::BatchMask::Causal,
    )?; // [prompt.len(), n_embd]
    let vocab = model.config.vocab_size;
    let mut top = Vec::new();
    let mut last = Vec::new();
    for start in (0..prompt.len()).step_by(CANDIDATE_ROWS) {
        let rows: Vec<usize> = (start..(start + CANDIDATE_ROWS).min(prompt.len())).collect();
        let logits = model.logits_of(backend, &hidden, &rows)?; // [rows, vocab]
        top.extend(crate::draft::recycle::top_k_rows(&logits, vocab, k));
        last = logits; // the chunk holding the prompt's last row comes last
    }
    let last = last.split_off(last.len().saturating_sub(vocab)); // [vocab]
    let rows = PassCandidates::with_top(prompt.to_vec(), &[], top, vocab, k);
    Ok((last, t0.elapsed().as_secs_f64(), rows))
}

/// Result of a speculative generation.
#[derive(Clone, Debug)]
pub struct SpecOutput {
    /// Same fields as incremental generation; `decode_steps` counts the tokens decoded after the
    /// prefill (so `decode_tok_s` is tokens per second), `metrics.steps` the verification passes.
    pub output: GenerateOutput,
    pub metrics: SpecMetrics,
    pub mode: VerifyMode,
}

/// Generate like [`crate::generate::generate`] (same stop rules, same streaming), speculating
/// with `drafters`. Under greedy sampling the tokens are exactly those of incremental decoding;
/// under sampling their distribution is the LLM's.
#[allow(clippy::too_many_arguments)]
pub fn generate<B: Backend>(
    model: &Model,
    backend: &B,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    spec: &SpecParams,
    drafters: &mut [&mut dyn Drafter],
    on_text: impl FnMut(&str),
) -> Result<SpecOutput> {
    check_prompt(model, prompt)?;
    params.validate(model.config.vocab_size)?;
    if params.prompt_logprobs.is_some() {
        return Err(EngineError::InvalidArgument(
            "prompt_logprobs: the scheduler's events carry the scores (`Scheduler`, the \
             server); `spec::generate` returns none"
                .into(),
        ));
    }
    // JSON mode reads the tokenizer's vocabulary (built on first use).
    let json = (params.response_format != ResponseFormat::Text).then(|| tokenizer.json_vocab());
    let limit = model.config.context_length;
    let mode = spec.mode.unwrap_or(VerifyMode::auto(&params.sampling));
    if mode == VerifyMode::Greedy && !params.sampling.is_greedy() {
        return Err(EngineError::InvalidArgument(
            "greedy verification needs greedy sampling (temperature 0); use mss or naive".into(),
        ));
    }
    let verifier = Verifier::new(mode, params.sampling.clone())?;
    let mut sampler = Sampler::new(params.sampling.clone())?;
    // The slots incremental decoding would use; tree passes need `budget + 1` scratch slots more.
    let cap = (prompt.len() + params.max_tokens).min(limit);
    let placeholders: usize = drafters.iter().map(|d| d.max_placeholder_rows()).sum();
    let mut cache = KvCache::new(
        &model.config,
        cap.saturating_add(spec.budget)
            .saturating_add(1)
            .saturating_add(placeholders),
    );
    let mut sink = TokenSink::new(tokenizer, params, on_text);
    // Prefill exactly as incremental generation does; the first token comes from its logits.
    // Drafters that ask for the prompt rows' candidates (Token Recycling's warm start) get them.
    let wanted = drafters
        .iter()
        .map(|d| d.prompt_candidates())
        .max()
        .unwrap_or(0);
    let (logits, prefill_secs) = if wanted > 0 {
        let (logits, secs, rows) = prefill_candidates(model, backend, &mut cache, prompt, wanted)?;
        for d in drafters.iter_mut().filter(|d| d.prompt_candidates() > 0) {
            d.observe_candidates(&rows.rows());
        }
        (logits, secs)
    } else {
        prefill(model, backend, &mut cache, prompt)?
    };
    let t1 = Instant::now();
    let first = if params.max_tokens == 0 {
        None
    } else {
        let mut logits = logits;
        if let Some(h) = params.logits_history(prompt, json.as_ref())? {
            h.penalize_row(&mut logits, &[]);
        }
        Some(sampler.sample(&logits))
    };
    let mut seq = prompt.to_vec();
    seq.extend(first);
    // Adaptive depth: the cost of a pass by row count, given or learnt from the passes
    // themselves (the first proposal's pass below), then following every measured pass.
    let mut policy = (spec.adaptive && first.is_some()).then(|| {
        (
            spec.step_cost.clone(),
            Acceptance::new(),
            usize::MAX,
            DraftBackoff::default(),
            GainCalibration::new(),
        )
    });
    // Seconds of the plain steps before the first proposal (the curve's one-row point).
    let mut plain_secs: Vec<f64> = Vec::new();
    // Sizes the first tree does not cover and the budget allows (none for a given curve).
    let mut explore: Vec<usize> = match spec.step_cost {
        Some(_) => Vec::new(),
        None => EXPLORE_ROWS
            .iter()
            .copied()
            .filter(|&r| r < FIRST_TREE_ROWS && r - 1 <= spec.budget)
            .collect(),
    };
    let mut explore_tries = 0usize;
    // Whether the last drafting cost next to nothing against a pass (prompt lookup): then the
    // drafters are asked for their whole depth, since a deeper draft costs no drafter passes.
    let mut cheap_drafting = false;
    let mut session = SpecSession::new(model, backend, cache, seq, verifier, spec.budget)?;
    session.set_penalties(params, prompt.len(), json.as_ref())?;
    let mut pending: Vec<u32> = first.into_iter().collect();
    let mut finish_reason = FinishReason::Length;
    'gen: loop {
        for &tok in &pending {
            if let Some(reason) = sink.push(tok) {
                finish_reason = reason;
                break 'gen;
            }
            // Incremental decoding would have fed every token but this one: stop when that
            // fills its `cap` slots.
            let n = sink.tokens.len();
            if n >= params.max_tokens || prompt.len() + n > cap {
                break 'gen;
            }
        }
        if pending.is_empty() {
            break;
        }
        let n = sink.tokens.len();
        let remaining = params.max_tokens - n;
        let committed = prompt.len() + n - 1;
        let max_depth = (remaining - 1).min(cap - 1 - committed);
        let Some((cost, acceptance, last_depth, backoff, gains)) = policy.as_mut() else {
            pending = session.step(drafters, max_depth)?.emitted();
            continue;
        };
        if backoff.skip() {
            // Drafts have not paid lately: a plain step (the root alone), no drafting cost.
            let root = TokenTree::root_only(*session.tokens().last().expect("a root"));
            let t0 = Instant::now();
            pending = session.verify(&root, drafters)?.emitted();
            if let Some(cost) = cost.as_mut() {
                cost.record(1, t0.elapsed().as_secs_f64());
            }
            continue;
        }
        // Draft two depths past the last verified one: room to grow, one depth to learn from,
        // and no deep drafting (a model drafter's passes) while speculation does not pay; cheap
        // drafters as deep as they like. Before the cost curve exists, only as deep as the first
        // tree can use.
        let depth_cap = match cost {
            Some(_) if cheap_drafting => max_depth,
            Some(_) => last_depth.saturating_add(2),
            None => FIRST_DRAFT_DEPTH,
        };
        // Only as many nodes as a pass can verify for what drafts ever gain (the first tree:
        // as many as it verifies; wide drafters such as Token Recycling then draft their best
        // few nodes instead of a first level that no depth choice can afford).
        let node_cap = match cost.as_ref() {
            Some(c) => {
                // While a size is explored the drafters fill it (priced by the curve as it
                // stands, a size that looks dear would never be drafted, hence never measured).
                let rc = match explore.first() {
                    Some(_) => Vec::new(),
                    None => row_costs(c, session.budget, gains.hurdle()),
                };
                drafters.iter_mut().for_each(|d| d.set_row_costs(&rc));
                match explore.first() {
                    Some(&rows) => rows - 1,
                    None => useful_budget(c, session.budget, acceptance),
                }
            }
            None => FIRST_TREE_ROWS - 1,
        };
        let t_draft = Instant::now();
        let proposal = session.draft_within(drafters, max_depth.min(depth_cap), node_cap)?;
        let draft_secs = t_draft.elapsed().as_secs_f64();
        if let Some(c) = cost.as_ref() {
            cheap_drafting = draft_secs < CHEAP_DRAFT * c.secs(1);
        }
        // A proposal with sampled draws is verified whole: its node counts depend on which
        // tokens the draws hit (equal draws merge), so cutting it by them (the first tree's rows,
        // an explored size, the depth choice) would make a candidate's presence depend on its
        // siblings' values, which MSS cannot allow.
        if proposal.has_sampled() {
            let one = match (cost.as_ref(), median(&plain_secs)) {
                (Some(_), _) => 0.0,
                (None, Some(s)) => s,
                (None, None) => session.measure_cost(&[1])?.secs(1),
            };
            let t0 = Instant::now();
            let o = session.verify(&proposal, drafters)?;
            let secs = t0.elapsed().as_secs_f64();
            match cost.as_mut() {
                Some(c) => c.add_point(proposal.len(), secs),
                None => {
                    *cost = Some(StepCost::from_points(vec![
                        (1, one),
                        (proposal.len(), secs),
                    ]))
                }
            }
            *last_depth = proposal.max_depth();
            pending = o.emitted();
            acceptance.record(&proposal, &pending);
            continue;
        }
        let Some(cost) = cost.as_mut() else {
            // No cost curve yet. Nothing proposed: a plain step, timed. The first proposal: verify
            // its largest prefix of at most `FIRST_TREE_ROWS` rows and take that pass's time as
            // the curve's second point (a request whose drafters never propose pays nothing; a
            // separate calibration over 8 and 32 rows cost ~10 single passes on a small model).
            let t0 = Instant::now();
            if proposal.len() == 1 {
                pending = session.verify(&proposal, drafters)?.emitted();
                plain_secs.push(t0.elapsed().as_secs_f64());
                continue;
            }
            let one = match median(&plain_secs) {
                Some(s) => s,
                None => session.measure_cost(&[1])?.secs(1),
            };
            let tree = prefix_within(&proposal, FIRST_TREE_ROWS);
            let t0 = Instant::now();
            let o = session.verify(&tree, drafters)?;
            let secs = t0.elapsed().as_secs_f64();
            *cost = Some(StepCost::from_points(vec![(1, one), (tree.len(), secs)]));
            if let Some(i) = explore.iter().position(|&r| r == tree.len()) {
                explore.remove(i);
            }
            *last_depth = tree.max_depth();
            pending = o.emitted();
            acceptance.record(&proposal, &pending);
            continue;
        };
        // Learn the curve's small sizes from real steps: a proposal drafted within the next size
        // to explore is verified whole, its pass a new point.
        if let Some(&rows) = explore.first() {
            explore_tries += 1;
            if explore_tries > EXPLORE_TRIES {
                explore.clear();
            } else if proposal.len() == rows {
                explore.remove(0);
                let t0 = Instant::now();
                let o = session.verify(&proposal, drafters)?;
                cost.add_point(rows, t0.elapsed().as_secs_f64());
                *last_depth = proposal.max_depth();
                pending = o.emitted();
                acceptance.record(&proposal, &pending);
                continue;
            }
        }
        let opts = [DepthOptions {
            acceptance,
            nodes_upto: nodes_upto(&proposal),
            weight: 1.0,
        }];
        let hurdle = gains.hurdle();
        let depth = choose_depths(&opts, &StepBase::decoding(1), cost, hurdle)[0];
        *last_depth = depth;
        let tree = proposal.truncate_depth(depth);
        let gain = acceptance.expected_tokens(depth) - 1.0;
        let pass = cost.secs(tree.len());
        let pays = drafting_pays(gain, 1.0 + gain, draft_secs, pass, hurdle);
        // A proposal without nodes tells nothing about whether drafts pay.
        if proposal.n_draft() > 0 {
            backoff.chose(
                if pays { depth } else { 0 },
                draft_secs >= COSTLY_DRAFT * pass,
            );
        }
        let t0 = Instant::now();
        let o = session.verify(&tree, drafters)?;
        cost.record(tree.len(), t0.elapsed().as_secs_f64());
        gains.record(gain, o.tokens.len());
        pending = o.emitted();
        acceptance.record(&proposal, &pending);
    }
    let (text, tokens, finish_reason) = sink.finish(finish_reason);
    let metrics = session.metrics().clone();
    let decode_steps = tokens.len().saturating_sub(1);
    Ok(SpecOutput {
        output: GenerateOutput {
            text,
            tokens,
            prompt_tokens: prompt.len(),
            finish_reason,
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
            // Tokens decoded after the prefill (as in incremental generation, where each took
            // one pass), so `decode_tok_s` compares; `metrics.steps` counts the passes.
            decode_steps,
        },
        metrics,
        mode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::draft::{OracleDrafter, RandomDrafter};
    use crate::quant::GgmlType;
    use crate::sample::SamplingParams;
    use crate::testing::{greedy_session, step_until, tiny_model, TinySpec};
    use crate::tree::ExpansionConfig;

    #[test]
    fn a_merge_gives_the_budget_one_drafter_leaves_to_the_others() {
        use crate::draft::{NgramDrafter, RecycleDrafter};
        // "5 6 7 5": prompt lookup (matches of 2+ tokens) finds no earlier "7 5"; recycle knows
        // the chain 5 -> 6 -> 7 -> 5 from the sequence itself.
        let seq = [5, 6, 7, 5];
        let mut ngram = NgramDrafter::new(3, 2, 8, 4).unwrap();
        let mut recycle = RecycleDrafter::new(100, 8).unwrap();
        let mut ds: [&mut dyn Drafter; 2] = [&mut recycle, &mut ngram];
        // Each gets 2 of 4 nodes; recycle fills its share, prompt lookup proposes nothing, so
        // recycle proposes again with all 4.
        let t = draft_tree(&mut ds, &seq, 4, 8, 100).unwrap();
        t.validate(100).unwrap();
        assert_eq!(t.tokens(), vec![5, 6, 7, 5, 6]);
        // Where prompt lookup matches ("6 7" came before) both fill their shares with the same
        // chain 9 -> 6: nothing is left over, nobody proposes again (recycle would have added
        // 7 -> 9 below it).
        let seq = [6, 7, 9, 6, 7];
        let mut ngram = NgramDrafter::new(3, 2, 8, 4).unwrap();
        let mut recycle = RecycleDrafter::new(100, 8).unwrap();
        let mut ds: [&mut dyn Drafter; 2] = [&mut recycle, &mut ngram];
        let t = draft_tree(&mut ds, &seq, 4, 8, 100).unwrap();
        assert_eq!(t.tokens(), vec![7, 9, 6]);
    }

    /// A sampling drafter whose draws all hit one token: its two draws merge into one node.
    struct Colliding;

    impl Drafter for Colliding {
        fn name(&self) -> &str {
            "colliding"
        }

        fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
            let cfg: ExpansionConfig = "2".parse()?;
            let mut rng = crate::sample::Rng::new(1);
            crate::tree::expand(
                &cfg,
                req.root(),
                req.drafter,
                crate::tree::ExpandMode::Sample,
                req.budget,
                req.max_depth,
                &mut rng,
                |_| Ok(vec![(9, 1.0)]),
            )
        }
    }

    /// A sampling drafter's share counts as used whole, whatever its draws hit: how much room a
    /// cheap reproposer gets must not depend on sampled values (MSS would be biased). Here the
    /// two draws collide into one node, and recycle still gets no more than its share.
    #[test]
    fn sampled_draws_that_collide_leave_no_budget_to_the_others() {
        use crate::draft::RecycleDrafter;
        let seq = [5, 6, 7, 5];
        let mut recycle = RecycleDrafter::new(100, 8).unwrap();
        let mut sampled = Colliding;
        let mut ds: [&mut dyn Drafter; 2] = [&mut sampled, &mut recycle];
        let t = draft_tree(&mut ds, &seq, 4, 8, 100).unwrap();
        t.validate(100).unwrap();
        assert!(t.has_sampled());
        // One sampled node (9) and recycle's share of 2 (6 -> 7), not its share plus the slot
        // the collision freed (6 -> 7 -> 5).
        assert_eq!(t.n_draft(), 3, "{:?}", t.tokens());
    }

    /// A drafter that labels its proposals with another drafter's id, or claims more draws
    /// than its budget, is left out of the tree (a mislabelled draw would be checked against
    /// another drafter's distribution; four billion draws made as many candidates).
    #[test]
    fn proposals_under_another_id_or_with_absurd_draws_are_refused() {
        struct Liar {
            id_shift: u16,
            draws: u32,
        }
        impl Drafter for Liar {
            fn name(&self) -> &str {
                "liar"
            }
            fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
                let mut b = crate::tree::TreeBuilder::new(req.root());
                let id = req.drafter.wrapping_add(self.id_shift);
                b.add_child(
                    crate::tree::TreeBuilder::ROOT,
                    3,
                    Some(crate::tree::Proposal {
                        drafter: id,
                        prob: 1.0,
                        kind: crate::tree::DrawKind::Picked,
                        draws: self.draws,
                    }),
                );
                Ok(b.build())
            }
        }
        for (id_shift, draws, ok) in [
            (0, 1, true),
            (1, 1, false),
            (0, u32::MAX, false),
            (0, 0, false),
        ] {
            let mut liar = Liar { id_shift, draws };
            let mut ds: [&mut dyn Drafter; 1] = [&mut liar];
            let mut failures = Vec::new();
            let t = draft_tree_tolerant(&mut ds, &[5, 6], 4, 4, 100, &mut failures).unwrap();
            assert_eq!(
                failures.is_empty(),
                ok,
                "shift {id_shift} draws {draws}: {failures:?}"
            );
            assert_eq!(t.n_draft(), usize::from(ok));
        }
    }

    /// Greedy incremental decoding: the cache after `prompt` and `n` generated tokens (all fed),
    /// and the tokens.
    fn incremental(
        model: &Model,
        be: &CpuBackend,
        prompt: &[u32],
        n: usize,
    ) -> (KvCache, Vec<u32>) {
        crate::testing::greedy_incremental(model, be, prompt, n, 128).unwrap()
    }

    #[test]
    fn kv_after_a_step_equals_incremental_kv() {
        let spec = TinySpec {
            arch: "qwen2",
            ..TinySpec::default()
        };
        let model = tiny_model(&spec, 5).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [1u32, 2, 3, 4, 5, 6];
        let (_, truth) = incremental(&model, &be, &prompt, 12);
        // Session state: prompt fed, first generated token is the root.
        let (cache, _) = incremental(&model, &be, &prompt, 0);
        let mut seq = prompt.to_vec();
        seq.push(truth[0]);
        let mut full = prompt.to_vec();
        full.extend(&truth);
        assert!(
            truth.windows(2).any(|w| w[0] != w[1]),
            "a varied continuation: {truth:?}"
        );
        let mut oracle = OracleDrafter::new(full, "2,2,1,1,1,1,1".parse().unwrap(), 9);
        let verifier = Verifier::new(VerifyMode::Greedy, SamplingParams::greedy()).unwrap();
        let mut s = SpecSession::new(&model, &be, cache, seq, verifier, 64).unwrap();
        let mut drafters: [&mut dyn Drafter; 1] = [&mut oracle];
        let o = s.step(&mut drafters, 8).unwrap();
        assert_eq!(o.tokens, truth[1..8].to_vec());
        assert_eq!(o.bonus, truth[8]);
        // Incremental decoding that fed prompt + truth[..8].
        let (want, _) = incremental(&model, &be, &prompt, 8);
        let d = crate::testing::max_kv_diff(s.cache(), &want, model.config.n_layers);
        assert!(d <= 1e-5, "K/V differ from incremental decoding by {d}");
    }

    /// A 24-token tiny model, its prompt, and greedy incremental decoding's `n` tokens after it
    /// (`truth`) and the whole sequence (`full`).
    struct Tiny24 {
        model: Model,
        be: CpuBackend,
        prompt: [u32; 5],
        truth: Vec<u32>,
        full: Vec<u32>,
    }

    fn tiny24(n: usize) -> Tiny24 {
        let model = tiny_model(
            &TinySpec {
                vocab: 24,
                ..TinySpec::default()
            },
            8,
        )
        .unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5];
        let (_, truth) = incremental(&model, &be, &prompt, n);
        let mut full = prompt.to_vec();
        full.extend(&truth);
        Tiny24 {
            model,
            be,
            prompt,
            truth,
            full,
        }
    }

    #[test]
    fn greedy_session_equals_incremental_for_any_drafter() {
        let Tiny24 {
            model,
            be,
            prompt,
            truth,
            full,
        } = tiny24(30);
        for cfg in ["1,1,1,1", "6", "2,2,2,2,2", "1,1,3,1,1,1,1,1"] {
            let cfg: ExpansionConfig = cfg.parse().unwrap();
            let mut oracle = OracleDrafter::new(full.clone(), cfg.clone(), 1);
            let mut random = RandomDrafter::new(cfg.clone(), 2);
            let combos: Vec<Vec<&mut dyn Drafter>> = vec![vec![&mut oracle], vec![&mut random]];
            for mut ds in combos {
                let mut s = greedy_session(&model, &be, &prompt, truth[0], 40).unwrap();
                step_until(&mut s, &mut ds, full.len(), 8).unwrap();
                assert_eq!(&s.tokens()[..full.len()], &full[..], "config {cfg}");
                assert_eq!(s.cache().len() + 1, s.tokens().len());
            }
        }
        // Both drafters merged.
        let cfg: ExpansionConfig = "2,2,2".parse().unwrap();
        let mut oracle = OracleDrafter::new(full.clone(), cfg.clone(), 1);
        let mut random = RandomDrafter::new(cfg, 2);
        let mut ds: [&mut dyn Drafter; 2] = [&mut random, &mut oracle];
        let mut s = greedy_session(&model, &be, &prompt, truth[0], 28).unwrap();
        step_until(&mut s, &mut ds, full.len(), 8).unwrap();
        assert_eq!(&s.tokens()[..full.len()], &full[..]);
        let m = s.metrics();
        assert!(m.accepted > m.steps, "oracle should be accepted: {m:?}");
        assert_eq!(
            m.accepted_by_depth[0] as f64 / m.steps as f64,
            m.acceptance_by_depth()[0]
        );
    }

    /// Token Recycling alone and merged with prompt lookup, over sessions of a tiny model: its
    /// matrix fills from every verified row (nothing before the first pass), the output is
    /// incremental decoding's and its guesses are accepted.
    #[test]
    fn greedy_session_with_token_recycling_equals_incremental() {
        use crate::draft::{NgramDrafter, RecycleDrafter};
        let Tiny24 {
            model,
            be,
            prompt,
            truth,
            full,
        } = tiny24(40);
        for budget in [4, 16, 80] {
            let mut recycle = RecycleDrafter::new(24, 8).unwrap();
            let mut s = greedy_session(&model, &be, &prompt, truth[0], budget).unwrap();
            step_until(&mut s, &mut [&mut recycle], full.len(), 8).unwrap();
            assert_eq!(&s.tokens()[..full.len()], &full[..], "budget {budget}");
            assert!(
                s.metrics().accepted > 0,
                "budget {budget}: {:?}",
                s.metrics()
            );
            assert!(!recycle.matrix().successors(truth[0]).is_empty());

            let mut recycle = RecycleDrafter::new(24, 4).unwrap();
            let mut ngram = NgramDrafter::default();
            let mut ds: [&mut dyn Drafter; 2] = [&mut recycle, &mut ngram];
            let mut s = greedy_session(&model, &be, &prompt, truth[0], budget).unwrap();
            step_until(&mut s, &mut ds, full.len(), 8).unwrap();
            assert_eq!(
                &s.tokens()[..full.len()],
                &full[..],
                "merged, budget {budget}"
            );
        }
    }

    /// Whatever the AMX setting (never; prompt prefill only; everywhere, the default: tiles for
    /// the wide verification batches and the AMX-order VNNI kernels for single-token decoding),
    /// decoding and verification use the same arithmetic: greedy speculation equals incremental
    /// decoding, and the accepted K/V equal incremental decoding's bit for bit. The weights cover
    /// every type the AMX kernels take, at widths they take (multiples of 256).
    #[test]
    fn greedy_session_kv_bit_identical_to_incremental_for_any_amx_use() {
        use crate::backend::AmxUse;
        let amx = CpuBackend::new(2)
            .unwrap()
            .with_amx_use(AmxUse::Always)
            .scope_prefill(crate::quant::amx_active);
        if !amx {
            crate::testing::skip_hardware(
                "spec::greedy_session_kv_bit_identical_to_incremental_for_any_amx_use",
                "AMX int8 is not available or not granted by the OS: every AmxUse runs the \
                 same VNNI / AVX2 kernels",
            );
        }
        let cases = [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0]
            .into_iter()
            .flat_map(|ty| [AmxUse::Never, AmxUse::Prefill, AmxUse::Always].map(|u| (ty, u)));
        for (i, (ty, amx_use)) in cases.enumerate() {
            let spec = TinySpec {
                arch: "qwen2",
                n_embd: 256,
                n_ff: 512,
                n_head: 8,
                n_head_kv: 2,
                vocab: 64,
                weight_type: ty,
                separate_output: ty == GgmlType::Q6_K,
                ..TinySpec::default()
            };
            let model = tiny_model(&spec, 30 + i as u64 / 3).unwrap();
            let be = CpuBackend::new(2).unwrap().with_amx_use(amx_use);
            let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
            let n = 24;
            let (_, truth) = incremental(&model, &be, &prompt, n);
            let mut full = prompt.to_vec();
            full.extend(&truth);
            // 30-node trees: verification batches run the AMX tiles where granted.
            let cfg: ExpansionConfig = "2,2,2,2".parse().unwrap();
            let mut oracle = OracleDrafter::new(full.clone(), cfg.clone(), 1);
            let mut random = RandomDrafter::new(cfg, 2);
            let mut ds: [&mut dyn Drafter; 2] = [&mut random, &mut oracle];
            let mut s = greedy_session(&model, &be, &prompt, truth[0], 64).unwrap();
            step_until(&mut s, &mut ds, full.len(), 8).unwrap();
            assert_eq!(&s.tokens()[..full.len()], &full[..], "{ty} {amx_use:?}");
            let fed = s.cache().len() - prompt.len();
            let (want, _) = incremental(&model, &be, &prompt, fed);
            let d = crate::testing::max_kv_diff(s.cache(), &want, model.config.n_layers);
            assert_eq!(
                d, 0.0,
                "{ty} {amx_use:?}: K/V differ from incremental decoding by {d}"
            );
        }
    }

    #[test]
    fn sampling_session_is_deterministic_per_seed() {
        let model = tiny_model(&TinySpec::default(), 3).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let run = |seed: u64, mode: VerifyMode| {
            let (cache, _) = incremental(&model, &be, &[1, 2, 3], 0);
            let p = SamplingParams {
                temperature: 0.9,
                top_k: 20,
                top_p: 0.95,
                min_p: 0.0,
                seed,
            };
            let v = Verifier::new(mode, p).unwrap();
            let mut s = SpecSession::new(&model, &be, cache, vec![1, 2, 3, 4], v, 16).unwrap();
            let mut r = RandomDrafter::new("2,2,2".parse().unwrap(), seed);
            let mut ds: [&mut dyn Drafter; 1] = [&mut r];
            for _ in 0..10 {
                s.step(&mut ds, 8).unwrap();
            }
            s.tokens().to_vec()
        };
        for mode in [VerifyMode::Mss, VerifyMode::Naive] {
            assert_eq!(run(4, mode), run(4, mode));
            assert_ne!(run(4, mode), run(5, mode));
        }
    }

    /// A drafter that breaks its contract (a node recorded as sampled from a distribution that
    /// gives it no mass) does not stop the request: its proposals are ignored every step, each
    /// step counts the failure, and the sequence goes on one bonus token per step.
    #[test]
    fn a_drafter_sampling_tokens_it_gave_no_mass_is_counted_and_ignored() {
        use crate::tree::{Proposal, TreeBuilder};
        use std::sync::Arc;
        struct Liar;
        impl Drafter for Liar {
            fn name(&self) -> &str {
                "liar"
            }
            fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
                let mut b = TreeBuilder::new(req.root());
                b.add_child(0, 1, Some(Proposal::sampled(req.drafter, 0.5, 1)));
                b.set_child_dist(0, req.drafter, Arc::from(vec![(2u32, 1.0f32)]));
                Ok(b.build())
            }
        }
        let model = tiny_model(&TinySpec::default(), 3).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let (cache, _) = incremental(&model, &be, &[1, 2, 3], 0);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
        };
        let v = Verifier::new(VerifyMode::Mss, p).unwrap();
        let mut s = SpecSession::new(&model, &be, cache, vec![1, 2, 3, 4], v, 8).unwrap();
        let mut liar = Liar;
        for _ in 0..12 {
            let o = s.step(&mut [&mut liar], 4).unwrap();
            assert_eq!(o.broken_drafters, vec![0]);
            assert!(o.accepted.is_empty(), "{o:?}");
        }
        assert_eq!(s.tokens().len(), 4 + 12);
        let m = s.metrics();
        assert_eq!(
            (m.steps, m.drafter_contract_failures, m.accepted),
            (12, 12, 0)
        );
    }

    #[test]
    fn bad_sessions_and_trees_are_errors() {
        let model = tiny_model(&TinySpec::default(), 3).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let v = Verifier::new(VerifyMode::Greedy, SamplingParams::greedy()).unwrap();
        let cache = KvCache::new(&model.config, 16);
        assert!(SpecSession::new(&model, &be, cache.clone(), vec![], v.clone(), 4).is_err());
        assert!(SpecSession::new(&model, &be, cache.clone(), vec![1, 2], v.clone(), 4).is_err());
        let mut s = SpecSession::new(&model, &be, cache, vec![1], v, 4).unwrap();
        // Wrong root.
        assert!(s.verify(&TokenTree::chain(2, &[3], 0), &mut []).is_err());
        // Token outside the vocabulary: error, cache untouched.
        assert!(s.verify(&TokenTree::chain(1, &[5000], 0), &mut []).is_err());
        assert_eq!(s.cache().len(), 0);
        // Over budget drafter.
        let mut r = RandomDrafter::new("8".parse().unwrap(), 1);
        struct Greedy<'a>(&'a mut RandomDrafter);
        impl Drafter for Greedy<'_> {
            fn name(&self) -> &str {
                "over-budget"
            }
            fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
                self.0.propose(&DraftRequest {
                    budget: 100,
                    ..*req
                })
            }
        }
        let mut g = Greedy(&mut r);
        assert!(s.step(&mut [&mut g], 8).is_err());
        let o = s.step(&mut [], 8).unwrap();
        assert!(o.accepted.is_empty());
        assert_eq!(s.cache().len(), 1);
    }
}
