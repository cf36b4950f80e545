//! Goodput-driven speculation length (SmartSpec, Liu et al. 2024): per step, choose every request's verified tree depth from its measured acceptance by depth and the measured cost of a forward pass over the step's rows, maximising expected accepted tokens per second for the whole batch.
//!
//! Acceptance is measured on the drafters' full proposals ("shadow" drafts): after a step, the
//! proposal is walked along the tokens the step really produced, so a request whose drafts were
//! verified only to depth D (or not at all) still tells how deep they would have been accepted,
//! up to depth D + 1. A request that stops speculating keeps learning, and speculates again when
//! its drafts start matching.

use std::time::Instant;

use crate::backend::{Backend, BatchMask};
use crate::error::Result;
use crate::kv::KvCache;
use crate::model::{Model, SeqBatch};
use crate::tree::TokenTree;

/// Seconds of one forward pass by its row count and its number of sequences: the shape of the
/// curve from calibration points — `rows` rows of one sequence, plus each extra sequence's own
/// cost (its attention over its own K/V, its bookkeeping: `n` sequences of one row each cost
/// more than `n` rows of one sequence) — times one factor that follows the measured passes. The
/// policy's choices depend on the shape only (the factor cancels in its comparisons), so a
/// noisy measurement never bends the curve it decides on; the factor keeps the seconds
/// themselves current.
#[derive(Clone, Debug, PartialEq)]
pub struct StepCost {
    /// `(rows, secs)` of passes over one sequence's new rows.
    points: Vec<(usize, f64)>,
    /// `(seqs, secs)`: what `seqs` sequences cost beyond `seqs` rows of one sequence (`(1, 0)`
    /// first; only that without a calibration of many sequences).
    seq_extra: Vec<(usize, f64)>,
    scale: f64,
    /// What a step costs outside its forward pass, by its rows with logits.
    overhead: StepOverhead,
}

/// Seconds a step spends outside its forward pass (verification, sampling each verified row's
/// distribution, the K/V commit, streaming, building the batch) as `a + b·rows`, `rows` the rows
/// with logits: a least-squares line over decayed sums of measured steps. Sampled verification
/// costs a few passes over the vocabulary per row, which the forward curve does not see: on
/// smollm2-135m at temperature 1.0 about 0.25 ms per row against 0.6 ms of forward per extra
/// row, and pricing rows by the forward alone made speculation lose to plain decoding at
/// concurrency 4.
#[derive(Clone, Debug, Default, PartialEq)]
struct StepOverhead {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
    /// The per-row cost fitted when the row counts last varied (kept while they do not: a
    /// batch that stopped speculating keeps its price of a row instead of charging each row the
    /// whole step's fixed part, which would keep it from ever speculating again).
    slope: Option<f64>,
}

/// Decay of the [`StepOverhead`] sums per step (about the last 50 steps count).
const OVERHEAD_DECAY: f64 = 0.98;

impl StepOverhead {
    fn record(&mut self, rows: usize, secs: f64) {
        if !(secs.is_finite() && secs >= 0.0) || rows == 0 {
            return;
        }
        let (x, d) = (rows as f64, OVERHEAD_DECAY);
        self.n = d * self.n + 1.0;
        self.x = d * self.x + x;
        self.y = d * self.y + secs;
        self.xx = d * self.xx + x * x;
        self.xy = d * self.xy + x * secs;
        if let Some(b) = self.fitted_slope() {
            self.slope = Some(b);
        }
    }

    /// The least-squares slope where the recent steps' row counts vary (their variance at
    /// least a quarter row²).
    fn fitted_slope(&self) -> Option<f64> {
        if self.n <= 0.0 {
            return None;
        }
        let (mx, my) = (self.x / self.n, self.y / self.n);
        let var = self.xx / self.n - mx * mx;
        (var >= 0.25).then(|| ((self.xy / self.n - mx * my) / var).max(0.0))
    }

    /// `(a, b)`: the fitted line; where the row counts have not varied lately, the last fitted
    /// slope with the intercept that meets the recent mean; where they never varied, all of it
    /// per row (a fixed part priced per row: dearer rows, never cheaper).
    fn line(&self) -> (f64, f64) {
        if self.n <= 0.0 || self.x <= 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (self.x / self.n, self.y / self.n);
        match self.fitted_slope().or(self.slope) {
            Some(b) => ((my - b * mx).max(0.0), b),
            None => (0.0, my / mx),
        }
    }

    fn secs(&self, rows: usize) -> f64 {
        let (a, b) = self.line();
        a + b * rows as f64
    }
}

/// Weight of a new measurement in a point's moving average.
const COST_EMA: f64 = 0.2;

/// Most sequences [`StepCost::calibrate`] times together (a larger batch extends the per-sequence
/// cost proportionally).
pub const CALIBRATION_SEQS: usize = 32;

/// `points` (sorted by x) at `x`: linear between points, the first value below the first,
/// proportional to `x` past the last.
fn interpolate(points: &[(usize, f64)], x: usize) -> f64 {
    let Some(&(n0, s0)) = points.first() else {
        return x as f64; // no measurement: one unit per row
    };
    if x <= n0 {
        return s0;
    }
    for w in points.windows(2) {
        let ((a, sa), (b, sb)) = (w[0], w[1]);
        if x <= b {
            return sa + (sb - sa) * (x - a) as f64 / (b - a) as f64;
        }
    }
    let (nl, sl) = points[points.len() - 1];
    sl * x as f64 / nl as f64
}

fn clean(mut points: Vec<(usize, f64)>) -> Vec<(usize, f64)> {
    points.retain(|&(n, s)| n > 0 && s.is_finite() && s >= 0.0);
    points.sort_by_key(|p| p.0);
    points.dedup_by_key(|p| p.0);
    points
}

impl StepCost {
    /// A model from known points of one sequence's passes (at least one), sequences costing
    /// nothing beyond their rows.
    pub fn from_points(points: Vec<(usize, f64)>) -> StepCost {
        let mut points = clean(points);
        points.retain(|&(_, s)| s > 0.0);
        StepCost {
            points,
            seq_extra: vec![(1, 0.0)],
            scale: 1.0,
            overhead: StepOverhead::default(),
        }
    }

    /// A model from one sequence's passes `rows` and passes over `seqs` sequences of one row
    /// each (`(seqs, secs)`): the latter's excess over as many rows of one sequence (never
    /// below zero) is each batch's per-sequence cost.
    pub fn from_curves(rows: Vec<(usize, f64)>, seqs: Vec<(usize, f64)>) -> StepCost {
        let mut c = StepCost::from_points(rows);
        let mut extra = vec![(1, 0.0)];
        for (n, s) in clean(seqs) {
            if n >= 2 {
                extra.push((n, (s - interpolate(&c.points, n)).max(0.0)));
            }
        }
        c.seq_extra = extra;
        c
    }

    /// Time forward passes over `sizes` rows of one sequence and over `sizes` sequences of one
    /// row each (up to [`CALIBRATION_SEQS`]), every sequence with a context of `ctx` tokens in
    /// its own memory: the fastest of `reps` rounds over every size in turn, smallest first,
    /// each round after a few untimed small passes ([`SETTLE_PASSES`]).
    pub fn calibrate<B: Backend>(
        model: &Model,
        backend: &B,
        sizes: &[usize],
        ctx: usize,
        reps: usize,
    ) -> Result<StepCost> {
        let vocab = model.config.vocab_size as u32;
        let ctx = ctx.max(1);
        let max = sizes.iter().copied().max().unwrap_or(1);
        let seq_sizes: Vec<usize> = sizes
            .iter()
            .copied()
            .filter(|&n| (2..=CALIBRATION_SEQS).contains(&n))
            .collect();
        let n_seqs = seq_sizes.iter().copied().max().unwrap_or(1);
        let prompt: Vec<u32> = (0..ctx as u32).map(|i| (i * 7 + 1) % vocab).collect();
        let cap = ctx + max + 1;
        let blocks = (n_seqs + 1) * cap.div_ceil(crate::kv::BLOCK_SLOTS) + 4;
        let pool = crate::kv::KvPool::elastic(&model.config, model.config.n_layers, blocks);
        let mut cache = KvCache::in_pool(&pool, cap);
        let pos: Vec<usize> = (0..prompt.len()).collect();
        model.forward(backend, &mut cache, &prompt, &pos, BatchMask::Causal, &[])?;
        // The other sequences: deep copies of the first (their K/V in their own blocks).
        let mut others = Vec::with_capacity(n_seqs.saturating_sub(1));
        for _ in 1..n_seqs {
            let mut c = cache.clone();
            c.unshare()?;
            others.push(c);
        }
        let mut sizes: Vec<usize> = sizes.iter().copied().filter(|&n| n > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut best = vec![f64::INFINITY; sizes.len()];
        let mut best_seqs = vec![f64::INFINITY; seq_sizes.len()];
        let tok = [5 % vocab];
        let one_pos = [ctx];
        for _ in 0..reps.max(1) {
            settle(model, backend, &mut cache)?;
            // Smallest first, each batch of `n` sequences right after the pass over `n` rows of
            // one: every pass follows one of about its size.
            for (&n, best) in sizes.iter().zip(best.iter_mut()) {
                time_rows(model, backend, &mut cache, &[n], std::slice::from_mut(best))?;
                let Some(j) = seq_sizes.iter().position(|&m| m == n) else {
                    continue;
                };
                let mut batch: Vec<SeqBatch<'_>> = std::iter::once(&mut cache)
                    .chain(others.iter_mut().take(n - 1))
                    .map(|c| SeqBatch {
                        cache: c,
                        tokens: &tok,
                        positions: &one_pos,
                        mask: BatchMask::Causal,
                        logit_rows: &[0],
                    })
                    .collect();
                let t0 = Instant::now();
                let r = model.forward_batch(backend, &mut batch);
                best_seqs[j] = best_seqs[j].min(t0.elapsed().as_secs_f64());
                for sb in batch.iter_mut() {
                    sb.cache.truncate(ctx);
                }
                r?;
            }
        }
        Ok(StepCost::from_curves(
            sizes.into_iter().zip(best).collect(),
            seq_sizes.into_iter().zip(best_seqs).collect(),
        ))
    }

    /// Time forward passes over `sizes` rows (all logits, as verification needs) appended to
    /// `cache` and dropped again (`cache` must have room for the largest): `reps` rounds over
    /// every size in turn (smallest first, after [`SETTLE_PASSES`] untimed ones), the fastest
    /// pass of each size. Noise on a shared machine only ever adds time, and alternating the
    /// sizes spreads a slow phase over all of them, so the curve's shape (all the policy decides
    /// on) is the machine's, not the phase's.
    pub fn measure_in<B: Backend>(
        model: &Model,
        backend: &B,
        cache: &mut KvCache,
        sizes: &[usize],
        reps: usize,
    ) -> Result<StepCost> {
        let mut sizes: Vec<usize> = sizes.iter().copied().filter(|&n| n > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut best = vec![f64::INFINITY; sizes.len()];
        for _ in 0..reps.max(1) {
            if sizes.is_empty() {
                break; // nothing to time, and maybe no room for the untimed passes
            }
            settle(model, backend, cache)?;
            time_rows(model, backend, cache, &sizes, &mut best)?;
        }
        Ok(StepCost::from_points(sizes.into_iter().zip(best).collect()))
    }

    /// Fold in a measured pass over `rows` rows of one sequence ([`StepCost::record_pass`]).
    pub fn record(&mut self, rows: usize, secs: f64) {
        self.record_pass(rows, 1, secs);
    }

    /// Fold in a measured pass over `rows` rows of `seqs` sequences: the curve's factor moves
    /// toward the ratio of the measurement to the calibrated shape (an exponential moving
    /// average). A pass over more rows than any point of the curve extends it instead (a new
    /// point, in the shape's units): the curve learns the sizes it is asked about, and never
    /// bends where it was measured.
    pub fn record_pass(&mut self, rows: usize, seqs: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 || self.points.is_empty() {
            return;
        }
        let seqs = seqs.clamp(1, rows);
        if self.points.last().is_some_and(|&(n, _)| rows > n) {
            let own = secs / self.scale - interpolate(&self.seq_extra, seqs);
            if own > 0.0 {
                self.points.push((rows, own));
            }
            return;
        }
        let ratio = secs / self.shape(rows, seqs).max(1e-12);
        self.scale = (1.0 - COST_EMA) * self.scale + COST_EMA * ratio;
    }

    /// Points never fall with more rows: one above a later point was a slow measurement.
    fn monotone(&mut self) {
        for j in (0..self.points.len().saturating_sub(1)).rev() {
            self.points[j].1 = self.points[j].1.min(self.points[j + 1].1);
        }
    }

    /// Add a measured pass over `rows` rows of one sequence as a point of the curve's shape
    /// where it has none (a size measured since calibration). At an existing point a faster pass
    /// lowers the point (a size measured twice keeps its faster pass: timing noise on a shared
    /// machine only ever adds time), a slower one moves the factor, as [`StepCost::record`].
    /// Points never fall with more rows: one above a later point was a slow measurement.
    pub fn add_point(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 || self.points.is_empty() {
            return;
        }
        let own = secs / self.scale;
        match self.points.binary_search_by_key(&rows, |p| p.0) {
            Ok(i) if own < self.points[i].1 => self.points[i].1 = own,
            Ok(_) => self.record(rows, secs),
            Err(at) => self.points.insert(at, (rows, own)),
        }
        self.monotone();
    }

    /// Estimated seconds of a pass over `rows` rows of one sequence.
    pub fn secs(&self, rows: usize) -> f64 {
        self.pass_secs(rows, 1)
    }

    /// Estimated seconds of a pass over `rows` rows of `seqs` sequences (`rows >= seqs`).
    pub fn pass_secs(&self, rows: usize, seqs: usize) -> f64 {
        self.scale * self.shape(rows, seqs)
    }

    /// Fold in what a step over `logit_rows` rows with logits spent outside its forward pass.
    pub fn record_overhead(&mut self, logit_rows: usize, secs: f64) {
        self.overhead.record(logit_rows, secs);
    }

    /// Estimated seconds of a whole step: its pass over `rows` rows of `seqs` sequences, and the
    /// work outside the pass for its `logit_rows` rows with logits
    /// ([`StepCost::record_overhead`]; nothing until measured).
    pub fn step_secs(&self, rows: usize, seqs: usize, logit_rows: usize) -> f64 {
        self.pass_secs(rows, seqs) + self.overhead.secs(logit_rows)
    }

    /// Estimated seconds of a whole step over `rows` rows of one sequence, all with logits (a
    /// verified tree).
    pub fn tree_secs(&self, rows: usize) -> f64 {
        self.step_secs(rows, 1, rows)
    }

    /// The calibrated curve.
    fn shape(&self, rows: usize, seqs: usize) -> f64 {
        let seqs = seqs.max(1);
        interpolate(&self.points, rows.max(seqs)) + interpolate(&self.seq_extra, seqs)
    }
}

/// Untimed one-row passes before a round of timed ones. Measured on a 2-core Xeon VM
/// (smollm2-135m): the first two or three passes after a large one (a 256-row pass, a prompt's
/// prefill) take 1.3-1.7x their usual time, sleeping 20 ms between does not help, and passes
/// after a few small ones are back to normal; calibrating small batches right after large ones
/// had priced every extra sequence of a batch at ~2 ms (real passes: ~0), so the policy
/// over-priced plain steps and under-priced the rows a tree adds.
const SETTLE_PASSES: usize = 4;

fn settle<B: Backend>(model: &Model, backend: &B, cache: &mut KvCache) -> Result<()> {
    let mut ignored = [f64::INFINITY];
    for _ in 0..SETTLE_PASSES {
        time_rows(model, backend, cache, &[1], &mut ignored)?;
    }
    Ok(())
}

/// Time one pass over each of `sizes` rows appended to `cache` (then dropped), keeping each
/// size's fastest in `best`.
fn time_rows<B: Backend>(
    model: &Model,
    backend: &B,
    cache: &mut KvCache,
    sizes: &[usize],
    best: &mut [f64],
) -> Result<()> {
    let vocab = model.config.vocab_size as u32;
    let base = cache.len();
    for (&n, best) in sizes.iter().zip(best.iter_mut()) {
        let toks: Vec<u32> = (0..n as u32).map(|i| (i * 13 + 5) % vocab).collect();
        let pos: Vec<usize> = (base..base + n).collect();
        let rows: Vec<usize> = (0..n).collect();
        let t0 = Instant::now();
        let r = model.forward(backend, cache, &toks, &pos, BatchMask::Causal, &rows);
        *best = best.min(t0.elapsed().as_secs_f64());
        cache.truncate(base);
        r?;
    }
    Ok(())
}

/// The median of `v` (the upper one for an even count; `None` when empty).
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied()
}

/// One request's acceptance by depth: `hit[d] / tried[d]` estimates the probability that a
/// proposal's depth-`d + 1` token is accepted when its depth-`d` prefix was.
#[derive(Clone, Debug)]
pub struct Acceptance {
    hit: Vec<f64>,
    tried: Vec<f64>,
}

/// Decay of old observations per step (recent behaviour matters: a request's text changes).
const ACC_DECAY: f64 = 0.9;

impl Default for Acceptance {
    fn default() -> Self {
        Acceptance::new()
    }
}

impl Acceptance {
    pub fn new() -> Acceptance {
        Acceptance {
            hit: Vec::new(),
            tried: Vec::new(),
        }
    }

    /// Probability that depth `d` (1-based) is accepted given depth `d - 1` was: the decayed
    /// counts plus a prior worth one observation, one half at depth 1 and the estimate of depth
    /// `d - 1` deeper (acceptance is alike from depth to depth; a depth never tried yet is
    /// expected to do as well as the one above it, so good drafts grow their trees).
    pub fn p(&self, d: usize) -> f64 {
        let mut prior = 0.5;
        for i in 0..d {
            let (h, t) = match (self.hit.get(i), self.tried.get(i)) {
                (Some(&h), Some(&t)) => (h, t),
                _ => (0.0, 0.0),
            };
            prior = (h + prior) / (t + 1.0);
        }
        prior
    }

    /// Expected tokens a step yields with `proposal` verified to depth `depth`: the bonus token
    /// plus, per depth, the probability that the path gets that far (for a tree, any node at
    /// that depth; a chain's estimate, a lower bound for trees).
    pub fn expected_tokens(&self, depth: usize) -> f64 {
        let mut e = 1.0;
        let mut reach = 1.0;
        for d in 1..=depth {
            reach *= self.p(d);
            e += reach;
        }
        e
    }

    /// After a step that produced `emitted` (accepted tokens then the bonus token): walk the
    /// full `proposal` along them and count, per depth, whether it would have been accepted.
    pub fn record(&mut self, proposal: &TokenTree, emitted: &[u32]) {
        for (h, t) in self.hit.iter_mut().zip(self.tried.iter_mut()) {
            *h *= ACC_DECAY;
            *t *= ACC_DECAY;
        }
        let mut node = 0;
        for (d, &tok) in emitted.iter().enumerate() {
            if proposal.children(node).is_empty() {
                break;
            }
            if self.tried.len() <= d {
                self.tried.resize(d + 1, 0.0);
                self.hit.resize(d + 1, 0.0);
            }
            self.tried[d] += 1.0;
            match proposal.child_with_token(node, tok) {
                Some(c) => {
                    self.hit[d] += 1.0;
                    node = c;
                }
                None => break,
            }
        }
    }
}

/// Most steps in a row an adaptive request skips drafting while its drafts do not pay.
pub const MAX_DRAFT_BACKOFF: usize = 16;

/// Failed probes in a row (drafted steps whose chosen depth was 0) after which a request stops
/// drafting with a drafter whose drafting costs at least [`COSTLY_DRAFT`] of a pass (a model
/// drafter: each probe is itself passes, plus feeding the drafter every token since its last
/// probe, which grows with the backoff).
pub const COSTLY_GIVE_UP: usize = 4;

/// Drafting seconds, as a share of a pass, from which a drafter counts as costly.
pub const COSTLY_DRAFT: f64 = 0.1;

/// Drafting seconds, as a share of a one-row pass, below which drafting counts as free (prompt
/// lookup): an adaptive request then asks its drafters for their whole depth every step instead
/// of two depths past its last verified one (a limit that saves a model drafter's passes).
pub const CHEAP_DRAFT: f64 = 0.02;

/// When an adaptive request drafts at all: after a step whose chosen depth was 0 (its drafts
/// were not worth verifying), it skips drafting for 0, 1, 3, 7, then 15 steps (doubling while the
/// choice stays 0), and drafts every step again once a depth above 0 is chosen. A skipped step
/// is plain decoding without drafting cost (no drafter passes, no draft round trip); the steps
/// it does draft keep measuring acceptance, so speculation returns when drafts start to match.
/// A costly drafter's probes are not cheap enough to keep measuring with: after
/// [`COSTLY_GIVE_UP`] failed probes in a row the request stops drafting for good.
#[derive(Clone, Debug, Default)]
pub struct DraftBackoff {
    backoff: usize,
    skip_left: usize,
    costly_fails: usize,
}

impl DraftBackoff {
    /// Whether this step skips drafting (counts the step when it does).
    pub fn skip(&mut self) -> bool {
        if self.gave_up() {
            true
        } else if self.skip_left > 0 {
            self.skip_left -= 1;
            true
        } else {
            false
        }
    }

    /// Whether the next step skips drafting (nothing counted).
    pub fn skips_next(&self) -> bool {
        self.gave_up() || self.skip_left > 0
    }

    /// Whether the request stopped drafting for good (a costly drafter kept failing).
    pub fn gave_up(&self) -> bool {
        self.costly_fails >= COSTLY_GIVE_UP
    }

    /// The depth the policy chose for a drafted step, and whether the drafting was costly.
    pub fn chose(&mut self, depth: usize, costly: bool) {
        if depth > 0 {
            self.backoff = 0;
            self.skip_left = 0;
            self.costly_fails = 0;
        } else {
            self.costly_fails = if costly { self.costly_fails + 1 } else { 0 };
            self.backoff = (self.backoff * 2).clamp(1, MAX_DRAFT_BACKOFF);
            self.skip_left = self.backoff - 1;
        }
    }
}

/// Whether a request's drafting paid for itself in a step: its expected extra tokens `gain`, as a
/// share of the batch's expected tokens, beat `hurdle` ([`GainCalibration::hurdle`]) times its
/// drafting seconds as a share of the pass (`pass_secs`). Drafting that does not pay counts as
/// depth 0 for the backoff, so a costly drafter (a model's passes) with middling acceptance
/// drafts rarely.
pub fn drafting_pays(
    gain: f64,
    batch_tokens: f64,
    draft_secs: f64,
    pass_secs: f64,
    hurdle: f64,
) -> bool {
    draft_secs <= 0.0
        || gain / batch_tokens.max(f64::MIN_POSITIVE)
            > hurdle * draft_secs / pass_secs.max(f64::MIN_POSITIVE)
}

/// The most a verified tree may cost, in plain passes, whatever its drafts are expected to gain:
/// a request's trees may cost more only as far as its measured acceptance expects more tokens.
pub const MAX_TREE_COST: f64 = 2.5;

/// Draft nodes worth proposing for an adaptive step (at most `budget`, at least 1): those whose
/// pass costs at most [`MAX_TREE_COST`] plain passes on the learnt curve, or at most the tokens a
/// chain of that many nodes is expected to yield by the request's `acceptance` where that is
/// more (drafts accepted deep, as prompt lookup on repeated text, earn long chains). Wide
/// drafters (Token Recycling's first level has 8 candidates) then propose their best few nodes
/// instead of a level no depth choice can afford.
pub fn useful_budget(cost: &StepCost, budget: usize, acceptance: &Acceptance) -> usize {
    let one = cost.tree_secs(1);
    let mut n = 1;
    while n < budget {
        let worth = MAX_TREE_COST.max(acceptance.expected_tokens(n + 1));
        if cost.tree_secs(n + 2) > worth * one {
            break;
        }
        n += 1;
    }
    n.min(budget)
}

/// What each further verified row costs, in plain passes, times `hurdle`: `costs[i]` is
/// the marginal row of a tree growing from `i` to `i + 1` draft nodes on the learnt curve, for
/// `nodes` nodes ([`crate::draft::Drafter::set_row_costs`]). Where a pass streams the weights
/// (a CPU decoding one sequence), the first few rows cost almost nothing and the next ones
/// nearly a row's compute each: one mean over a larger tree would price the cheap rows out.
pub fn row_costs(cost: &StepCost, nodes: usize, hurdle: f64) -> Vec<f64> {
    let one = cost.tree_secs(1).max(1e-12);
    (0..nodes)
        .map(|i| hurdle * ((cost.tree_secs(i + 2) - cost.tree_secs(i + 1)) / one).max(0.0))
        .collect()
}

/// `nodes_upto[d]`: draft nodes of `tree` at depth at most `d`, for `d = 0..=max_depth`.
pub fn nodes_upto(tree: &TokenTree) -> Vec<usize> {
    let mut upto = vec![0usize; tree.max_depth() + 1];
    for n in &tree.nodes()[1..] {
        upto[n.depth] += 1;
    }
    for d in 1..upto.len() {
        upto[d] += upto[d - 1];
    }
    upto
}

/// One request's options for this step: the draft nodes its proposal has at each depth.
pub struct DepthOptions<'a> {
    pub acceptance: &'a Acceptance,
    /// `nodes_upto[d]`: draft nodes of depth at most `d` (`nodes_upto[0] = 0`).
    pub nodes_upto: Vec<usize>,
    /// What the request's extra tokens are worth against the batch's ([`catch_up_weight`]).
    pub weight: f64,
}

/// Bounds of [`catch_up_weight`].
pub const CATCH_UP: (f64, f64) = (0.5, 2.0);

/// What a request's extra tokens are worth in a step, from the tokens it may still produce
/// (`left`) against the mean of the step's decoding requests: their ratio, within
/// [`CATCH_UP`]. Requests that lag get deeper trees, those about to finish shallower ones, so a
/// batch's requests finish closer together and the batch stays wide (a batch whose fast
/// requests finished first runs its slow ones in small, costly steps).
pub fn catch_up_weight(left: f64, mean_left: f64) -> f64 {
    if mean_left > 0.0 && left.is_finite() {
        (left / mean_left).clamp(CATCH_UP.0, CATCH_UP.1)
    } else {
        1.0
    }
}

/// How much a depth's expected gain must exceed its cost before anything is measured (the
/// [`GainCalibration`]'s prior): draft tokens count as `1 / hurdle` of their expected number
/// when choosing depths, so a speculative choice wins only where its relative gain in tokens
/// beats the relative growth of the pass by about this factor. The noise of acceptance
/// estimates makes break-even depths lose in practice (measured: prompt lookup on chat text
/// through the server, 0.85x of plain decoding at concurrency 4 without a hurdle).
pub const DEPTH_HURDLE: f64 = 1.25;

/// Weight, in promised tokens, of the [`GainCalibration`]'s prior (its hurdle starts at
/// [`DEPTH_HURDLE`]).
const CALIBRATION_PRIOR: f64 = 4.0;

/// Decay of a [`GainCalibration`]'s sums per recorded request-step (about the last 50 verified
/// speculations count).
const CALIBRATION_DECAY: f64 = 0.98;

/// Bounds of the measured hurdle: never a premium on draft tokens, and never so dear that a
/// request whose drafts really match could not win speculation back.
pub const HURDLE_RANGE: (f64, f64) = (1.0, 3.0);

/// The hurdle measured (online calibration of the acceptance estimates): over the recent steps
/// that verified a speculative depth, the draft tokens the policy expected
/// ([`Acceptance::expected_tokens`] at the chosen depth, less the bonus token) against those
/// accepted. Depths are chosen where estimates are high, and estimates from a few decayed
/// observations are high partly by chance, so the expectations behind chosen depths run above
/// what the drafts deliver wherever acceptance is noisy (sampled text, drafts that rarely
/// match: measured there at about half) and close to it where acceptance is steady (repeated
/// text). Their ratio is the discount draft tokens need ([`choose_depths`]' `hurdle`), learnt
/// from the traffic instead of one constant for every regime. It starts at [`DEPTH_HURDLE`].
#[derive(Clone, Debug)]
pub struct GainCalibration {
    promised: f64,
    realized: f64,
}

impl Default for GainCalibration {
    fn default() -> Self {
        GainCalibration::new()
    }
}

impl GainCalibration {
    pub fn new() -> GainCalibration {
        GainCalibration {
            promised: CALIBRATION_PRIOR * DEPTH_HURDLE,
            realized: CALIBRATION_PRIOR,
        }
    }

    /// A verified speculative depth: the draft tokens its estimate `promised` and those
    /// `accepted`. Steps without draft rows (depth 0) tell nothing and are not recorded.
    pub fn record(&mut self, promised: f64, accepted: usize) {
        if !(promised.is_finite() && promised > 0.0) {
            return;
        }
        self.promised = CALIBRATION_DECAY * self.promised + promised;
        self.realized = CALIBRATION_DECAY * self.realized + accepted as f64;
    }

    /// How far the estimates over-promise, within [`HURDLE_RANGE`].
    pub fn hurdle(&self) -> f64 {
        (self.promised / self.realized.max(f64::MIN_POSITIVE)).clamp(HURDLE_RANGE.0, HURDLE_RANGE.1)
    }
}

/// A step's rows before any adaptive depth is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepBase {
    /// Prefill chunks, every decoding request's root, the trees verified whole (fixed and
    /// sampled ones).
    pub rows: usize,
    /// Those of them with logits.
    pub logit_rows: usize,
    /// Tokens they yield without speculation: one per decoding request and per prompt that
    /// ends this step.
    pub tokens: usize,
    /// Sequences in the step.
    pub seqs: usize,
}

impl StepBase {
    /// `n` decoding requests, their roots alone.
    pub fn decoding(n: usize) -> StepBase {
        StepBase {
            rows: n,
            logit_rows: n,
            tokens: n,
            seqs: n,
        }
    }
}

/// Choose each request's verified depth for a step over `base` ([`StepBase`]). Depths are added
/// greedily, the best expected tokens per extra row first (a request's next depth never gains
/// more than its previous one); of the choices along that order, the one with the most expected
/// tokens per second of the whole step wins (the forward curve and the work outside the pass,
/// [`StepCost::step_secs`]), its draft tokens discounted by `hurdle`
/// ([`GainCalibration::hurdle`]). The whole order is weighed, not only its first steps: on a
/// curve whose marginal row cost falls with the row count (a wider pass amortises its weight
/// reads better), a depth that does not pay alone can pay with the next ones. Depth 0
/// everywhere is plain decoding, so the choice never expects a slower step mix than no
/// speculation.
pub fn choose_depths(
    options: &[DepthOptions<'_>],
    base: &StepBase,
    cost: &StepCost,
    hurdle: f64,
) -> Vec<usize> {
    let mut depth = vec![0usize; options.len()];
    let mut rows = base.rows;
    let mut tokens = base.tokens.max(options.len()).max(1) as f64;
    // Every draft row has logits.
    let rate = |tokens: f64, rows: usize| {
        let logit_rows = base.logit_rows + (rows - base.rows);
        tokens / cost.step_secs(rows.max(1), base.seqs, logit_rows)
    };
    let mut best_rate = rate(tokens, rows);
    // The greedy order's additions, and how many of them the best choice takes.
    let mut order = Vec::new();
    let mut take = 0;
    loop {
        // The best next depth of any request: (request, extra rows, extra tokens).
        let best = options
            .iter()
            .enumerate()
            .filter_map(|(i, o)| {
                let d = depth[i];
                if d + 1 >= o.nodes_upto.len() {
                    return None;
                }
                let extra = o.nodes_upto[d + 1] - o.nodes_upto[d];
                let gain = o.weight
                    * (o.acceptance.expected_tokens(d + 1) - o.acceptance.expected_tokens(d));
                Some((i, extra, gain))
            })
            .filter(|&(_, extra, _)| extra > 0)
            .max_by(|a, b| (a.2 / a.1 as f64).total_cmp(&(b.2 / b.1 as f64)));
        let Some((i, extra, gain)) = best else {
            break;
        };
        depth[i] += 1;
        rows += extra;
        tokens += gain / hurdle;
        order.push(i);
        let r = rate(tokens, rows);
        if r > best_rate {
            best_rate = r;
            take = order.len();
        }
    }
    let mut chosen = vec![0usize; options.len()];
    for &i in &order[..take] {
        chosen[i] += 1;
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::DrafterId;

    #[test]
    fn step_cost_interpolates_and_learns() {
        let mut c = StepCost::from_points(vec![(1, 0.010), (16, 0.020), (64, 0.080)]);
        assert!((c.secs(1) - 0.010).abs() < 1e-12);
        assert!((c.secs(8) - (0.010 + 0.010 * 7.0 / 15.0)).abs() < 1e-12);
        assert!((c.secs(128) - 0.160).abs() < 1e-12);
        // Passes twice as slow as calibrated: the whole curve doubles, marginal costs too.
        for _ in 0..60 {
            c.record(16, 0.040);
        }
        assert!((c.secs(16) - 0.040).abs() < 1e-4);
        assert!((c.secs(1) - 0.020).abs() < 1e-4);
        assert!((c.secs(128) - 0.320).abs() < 1e-3);
        // A pass past the last point extends the curve (in the shape's units) and leaves the
        // factor alone; sizes in between now interpolate toward it.
        let scale = c.secs(1) / 0.010;
        c.record(96, 0.100);
        assert!((c.secs(96) - 0.100).abs() < 1e-9);
        assert!((c.secs(1) / 0.010 - scale).abs() < 1e-12);
        assert!((c.secs(80) - (c.secs(64) + c.secs(96)) / 2.0).abs() < 1e-9);
    }

    /// A measured size between points becomes a point (in the shape's units); the per-row costs
    /// follow the curve's bends.
    #[test]
    fn step_cost_adds_points_and_prices_rows_by_the_curve() {
        // The first tree's pass: a straight line from one row to eight, twice as dear.
        let mut c = StepCost::from_points(vec![(1, 0.010), (8, 0.020)]);
        let line = row_costs(&c, 7, DEPTH_HURDLE);
        for r in &line {
            assert!((r - DEPTH_HURDLE / 7.0).abs() < 1e-9, "{line:?}");
        }
        // Four rows cost what one does: the first three nodes are nearly free, the next dear.
        c.add_point(4, 0.0101);
        assert!((c.secs(4) - 0.0101).abs() < 1e-12);
        assert!((c.secs(8) - 0.020).abs() < 1e-12);
        let bent = row_costs(&c, 7, DEPTH_HURDLE);
        assert!(bent[..3].iter().all(|&r| r < 0.01), "{bent:?}");
        assert!(bent[3..].iter().all(|&r| r > 0.3), "{bent:?}");
        // A slower pass at a size that is already a point moves the factor only.
        c.add_point(4, 0.0202);
        assert!(c.secs(1) > 0.010 && (c.secs(4) / c.secs(1) - 1.01).abs() < 1e-9);
        // A faster one lowers the point; a point above a later one comes down to it.
        let mut c = StepCost::from_points(vec![(1, 0.010), (8, 0.020)]);
        c.add_point(2, 0.013); // a slow first measurement of two rows
        c.add_point(4, 0.0105);
        assert!((c.secs(2) - 0.0105).abs() < 1e-12, "{}", c.secs(2));
        c.add_point(4, 0.0102);
        assert!((c.secs(4) - 0.0102).abs() < 1e-12 && (c.secs(2) - 0.0102).abs() < 1e-12);
        assert!((c.secs(1) - 0.010).abs() < 1e-12 && (c.secs(8) - 0.020).abs() < 1e-12);
    }

    #[test]
    fn acceptance_follows_the_realized_tokens_of_the_full_proposal() {
        let d = DrafterId::try_from(0usize).unwrap();
        let chain = TokenTree::chain(1, &[2, 3, 4, 5], d);
        let mut a = Acceptance::new();
        assert_eq!(a.p(1), 0.5);
        // Realized 2, 3, 9: depths 1 and 2 accepted, 3 rejected, 4 unknown.
        a.record(&chain, &[2, 3, 9]);
        let p1 = 1.5 / 2.0;
        let p2 = (1.0 + p1) / 2.0;
        let p3 = p2 / 2.0;
        assert!((a.p(1) - p1).abs() < 1e-12);
        assert!((a.p(2) - p2).abs() < 1e-12);
        assert!((a.p(3) - p3).abs() < 1e-12);
        // Never tried: as good as the depth above.
        assert!((a.p(4) - p3).abs() < 1e-12);
        // Nothing proposed: nothing learnt (only decay).
        a.record(&TokenTree::root_only(1), &[7]);
        assert!((a.p(1) - (0.9 + 0.5) / (0.9 + 1.0)).abs() < 1e-12);
        // Many misses at depth 1: speculation looks worthless.
        for _ in 0..40 {
            a.record(&chain, &[8]);
        }
        assert!(a.p(1) < 0.1);
        assert!(a.expected_tokens(4) < 1.12);
    }

    #[test]
    fn drafting_backs_off_while_depth_zero_is_chosen() {
        let mut b = DraftBackoff::default();
        // Drafted steps (d) and skipped ones (s) while every choice is depth 0.
        let mut pattern = String::new();
        for _ in 0..40 {
            if b.skip() {
                pattern.push('s');
            } else {
                pattern.push('d');
                b.chose(0, false);
            }
        }
        let want = [
            "dd",
            "s",
            "d",
            "sss",
            "d",
            &"s".repeat(7),
            "d",
            &"s".repeat(15),
            "d",
        ]
        .concat()
            + &"s".repeat(8);
        assert_eq!(pattern, want);
        // A depth above 0: every step drafts again.
        assert!(b.skips_next());
        while b.skip() {}
        b.chose(2, false);
        assert!(!b.skip() && !b.skip());
        // A costly drafter backs off alike, then gives up after COSTLY_GIVE_UP failed probes in
        // a row; a cheap failure in between starts the count again.
        for i in 0..COSTLY_GIVE_UP - 1 {
            b.chose(0, true);
            let mut skipped = 0;
            while b.skip() {
                skipped += 1;
            }
            assert_eq!(skipped, (1 << i) - 1, "probe {i}");
        }
        b.chose(0, false);
        for _ in 0..COSTLY_GIVE_UP - 1 {
            b.chose(0, true);
            while b.skip() {}
        }
        assert!(!b.gave_up());
        b.chose(0, true);
        assert!(b.gave_up() && b.skips_next());
        assert!((0..10_000).all(|_| b.skip()), "no more drafting");
    }

    #[test]
    fn depths_grow_with_acceptance_and_shrink_with_cost() {
        let d = DrafterId::try_from(0usize).unwrap();
        let chain = TokenTree::chain(1, &[2, 3, 4, 5, 6, 7, 8, 9], d);
        let (mut good, mut bad) = (Acceptance::new(), Acceptance::new());
        for _ in 0..30 {
            good.record(&chain, &[2, 3, 4, 5, 6, 7, 8, 9, 10]);
            bad.record(&chain, &[11]);
        }
        let flat = StepCost::from_points(vec![(1, 0.01), (64, 0.0105)]);
        let steep = StepCost::from_points(vec![(1, 0.01), (64, 0.64)]);
        let mk = |a| DepthOptions {
            acceptance: a,
            nodes_upto: (0..=8).collect(),
            weight: 1.0,
        };
        // Nearly free rows: even a 5% chance pays for a few; the accepting request goes deep.
        let ds = choose_depths(
            &[mk(&good), mk(&bad)],
            &StepBase::decoding(2),
            &flat,
            DEPTH_HURDLE,
        );
        assert_eq!(ds[0], 8);
        assert!(ds[1] < ds[0]);
        // Rows at 3% of a pass each: the accepting request drafts deep, the rejecting one not.
        let moderate = StepCost::from_points(vec![(1, 0.01), (64, 0.03)]);
        assert_eq!(
            choose_depths(
                &[mk(&good), mk(&bad)],
                &StepBase::decoding(2),
                &moderate,
                DEPTH_HURDLE
            ),
            vec![8, 0]
        );
        // Each row costs a whole pass: plain decoding.
        assert_eq!(
            choose_depths(
                &[mk(&good), mk(&bad)],
                &StepBase::decoding(2),
                &steep,
                DEPTH_HURDLE
            ),
            vec![0, 0]
        );
    }

    /// An acceptance that accepted every depth of `chain`'s 8 tokens `n` times.
    fn accepting(n: usize) -> Acceptance {
        let d = DrafterId::try_from(0usize).unwrap();
        let chain = TokenTree::chain(1, &[2, 3, 4, 5, 6, 7, 8, 9], d);
        let mut a = Acceptance::new();
        for _ in 0..n {
            a.record(&chain, &[2, 3, 4, 5, 6, 7, 8, 9, 10]);
        }
        a
    }

    #[test]
    fn the_whole_greedy_order_is_weighed_not_its_first_step() {
        let good = accepting(30);
        let o = DepthOptions {
            acceptance: &good,
            nodes_upto: (0..=8).collect(),
            weight: 1.0,
        };
        // The first extra row doubles the pass, the next seven are almost free: depth 1 alone
        // loses, depth 8 wins (about 5.6 expected tokens for 2.2 passes).
        let kinked = StepCost::from_points(vec![(1, 0.010), (2, 0.020), (9, 0.022)]);
        assert_eq!(
            choose_depths(&[o], &StepBase::decoding(1), &kinked, DEPTH_HURDLE),
            vec![8]
        );
    }

    #[test]
    fn the_batch_tokens_and_sequences_set_the_relative_gain() {
        let good = accepting(30);
        let mk = || DepthOptions {
            acceptance: &good,
            nodes_upto: (0..=8).collect(),
            weight: 1.0,
        };
        // Rows cost 2% of a 16-row pass each. One drafting request among 16 decoding ones:
        // its few extra tokens are small against the batch's 16.
        let cost = StepCost::from_points(vec![(1, 0.010), (16, 0.016), (64, 0.064)]);
        let alone = choose_depths(&[mk()], &StepBase::decoding(1), &cost, DEPTH_HURDLE)[0];
        let among = choose_depths(&[mk()], &StepBase::decoding(16), &cost, DEPTH_HURDLE)[0];
        assert_eq!(alone, 8);
        assert!(among < alone, "{among}");
        // 16 sequences cost much more than 16 rows of one: extra rows are then relatively
        // cheaper, and the same request drafts deeper.
        let per_seq = StepCost::from_curves(
            vec![(1, 0.010), (16, 0.016), (64, 0.064)],
            vec![(16, 0.040)],
        );
        assert!((per_seq.pass_secs(16, 16) - 0.040).abs() < 1e-12);
        assert!((per_seq.pass_secs(32, 16) - (0.040 + 0.016)).abs() < 1e-12);
        assert!((per_seq.secs(16) - 0.016).abs() < 1e-12);
        let with_seqs = choose_depths(&[mk()], &StepBase::decoding(16), &per_seq, DEPTH_HURDLE)[0];
        assert!(with_seqs > among, "{with_seqs} vs {among}");
    }

    #[test]
    fn lagging_requests_are_worth_more() {
        assert_eq!(catch_up_weight(10.0, 40.0), CATCH_UP.0);
        assert_eq!(catch_up_weight(80.0, 20.0), CATCH_UP.1);
        assert!((catch_up_weight(30.0, 20.0) - 1.5).abs() < 1e-12);
        assert_eq!(catch_up_weight(5.0, 0.0), 1.0);
        let good = accepting(30);
        let mk = |weight| DepthOptions {
            acceptance: &good,
            nodes_upto: (0..=8).collect(),
            weight,
        };
        // A marginal cost: the same acceptance, the lagging request verifies deeper.
        let cost = StepCost::from_points(vec![(1, 0.010), (8, 0.012), (64, 0.060)]);
        let ds = choose_depths(
            &[mk(0.5), mk(2.0)],
            &StepBase::decoding(8),
            &cost,
            DEPTH_HURDLE,
        );
        assert!(ds[1] > ds[0], "{ds:?}");
    }

    #[test]
    fn the_hurdle_follows_how_far_estimates_over_promise() {
        let mut g = GainCalibration::new();
        assert!((g.hurdle() - DEPTH_HURDLE).abs() < 1e-12);
        // Depths chosen on estimates of 2 tokens that deliver 1: the hurdle goes to 2.
        for _ in 0..400 {
            g.record(2.0, 1);
        }
        assert!((g.hurdle() - 2.0).abs() < 1e-3, "{}", g.hurdle());
        // Nothing learnt from steps without a promise, or from nonsense.
        let before = g.hurdle();
        g.record(0.0, 3);
        g.record(f64::NAN, 3);
        assert_eq!(g.hurdle(), before);
        // Estimates that under-promise (trees accepted beyond their chain's estimate): no
        // premium on draft tokens below 1.
        for _ in 0..400 {
            g.record(1.0, 3);
        }
        assert_eq!(g.hurdle(), HURDLE_RANGE.0);
        // Drafts that never deliver: bounded, so matching drafts can win speculation back.
        for _ in 0..400 {
            g.record(1.0, 0);
        }
        assert_eq!(g.hurdle(), HURDLE_RANGE.1);
    }

    /// The depth `choose_depths` gives one decoding request with acceptance `a` and an 8-node
    /// chain.
    fn lone_depth(a: &Acceptance, cost: &StepCost, hurdle: f64) -> usize {
        let o = DepthOptions {
            acceptance: a,
            nodes_upto: (0..=8).collect(),
            weight: 1.0,
        };
        choose_depths(&[o], &StepBase::decoding(1), cost, hurdle)[0]
    }

    /// A request whose first draft token is accepted a third of the time, the second never.
    fn middling() -> Acceptance {
        let d = DrafterId::try_from(0usize).unwrap();
        let chain = TokenTree::chain(1, &[2, 3, 4, 5, 6, 7, 8, 9], d);
        let mut a = Acceptance::new();
        for i in 0..30 {
            if i % 3 == 0 {
                a.record(&chain, &[2, 11]);
            } else {
                a.record(&chain, &[11]);
            }
        }
        a
    }

    #[test]
    fn a_higher_hurdle_verifies_less() {
        let a = middling();
        // Each extra row costs a fifth of a pass.
        let cost = StepCost::from_points(vec![(1, 0.010), (8, 0.024), (64, 0.200)]);
        let low = lone_depth(&a, &cost, HURDLE_RANGE.0);
        let high = lone_depth(&a, &cost, HURDLE_RANGE.1);
        assert!(low > 0 && high < low, "{low} {high}");
    }

    #[test]
    fn the_work_outside_the_pass_is_priced_per_row() {
        let mut c = StepCost::from_points(vec![(1, 0.010), (8, 0.012), (64, 0.060)]);
        assert_eq!(c.step_secs(4, 4, 4), c.pass_secs(4, 4));
        // 1 ms a step plus 0.25 ms per row with logits, whatever the pass.
        for i in 0..200 {
            let rows = 4 + i % 9;
            c.record_overhead(rows, 0.001 + 0.00025 * rows as f64);
        }
        for rows in [1, 8, 30] {
            let outside = c.step_secs(rows, 1, rows) - c.pass_secs(rows, 1);
            assert!(
                (outside - (0.001 + 0.00025 * rows as f64)).abs() < 1e-9,
                "{rows}"
            );
        }
        assert!((c.tree_secs(8) - (0.012 + 0.003)).abs() < 1e-9);
        // Then 200 steps of 8 rows (speculation stopped): the learnt price of a row stays.
        for _ in 0..200 {
            c.record_overhead(8, 0.001 + 0.00025 * 8.0);
        }
        let outside = c.step_secs(12, 1, 12) - c.pass_secs(12, 1);
        assert!(
            (outside - (0.001 + 0.00025 * 12.0)).abs() < 1e-9,
            "{outside}"
        );
        // Steps of one size only: all of it per row (never cheaper rows than measured).
        let mut one = StepCost::from_points(vec![(1, 0.010), (8, 0.012)]);
        for _ in 0..50 {
            one.record_overhead(8, 0.002);
        }
        assert!((one.step_secs(16, 8, 16) - one.pass_secs(16, 8) - 0.004).abs() < 1e-9);
        // The policy sees it: depths that pay on the pass alone do not when each verified row
        // costs as much again outside it.
        let a = middling();
        let mut dear = StepCost::from_points(vec![(1, 0.010), (8, 0.024), (64, 0.200)]);
        let before = lone_depth(&a, &dear, DEPTH_HURDLE);
        for i in 0..200 {
            let rows = 1 + i % 5;
            dear.record_overhead(rows, 0.010 * rows as f64);
        }
        let after = lone_depth(&a, &dear, DEPTH_HURDLE);
        assert!(before > 0 && after == 0, "{before} {after}");
        assert!(
            row_costs(&dear, 4, 1.0).iter().all(|&r| r > 0.45),
            "{:?}",
            row_costs(&dear, 4, 1.0)
        );
    }

    #[test]
    fn a_request_accepting_deep_drafts_may_propose_costly_trees() {
        // Nine rows cost 4 one-row passes: more than MAX_TREE_COST, less than what a request
        // accepting everything expects from 8 nodes.
        let cost = StepCost::from_points(vec![(1, 0.010), (9, 0.040), (64, 0.640)]);
        let fresh = Acceptance::new();
        let n = useful_budget(&cost, 8, &fresh);
        assert!(
            n < 8 && cost.secs(n + 1) <= MAX_TREE_COST * 0.010 + 1e-12,
            "{n}"
        );
        assert_eq!(useful_budget(&cost, 8, &accepting(30)), 8);
    }
}
