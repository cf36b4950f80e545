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
use crate::model::Model;
use crate::tree::TokenTree;

/// Seconds of one forward pass by its row count: the shape of the curve from calibration points
/// `(rows, secs)` (linear between them, proportional past the last), times one factor that
/// follows the measured passes. The policy's choices depend on the shape only (the factor
/// cancels in its comparisons), so a noisy measurement never bends the curve it decides on; the
/// factor keeps the seconds themselves current.
#[derive(Clone, Debug)]
pub struct StepCost {
    points: Vec<(usize, f64)>,
    scale: f64,
}

/// Weight of a new measurement in a point's moving average.
const COST_EMA: f64 = 0.2;

impl StepCost {
    /// A model from known points (sorted by rows, at least one).
    pub fn from_points(mut points: Vec<(usize, f64)>) -> StepCost {
        points.retain(|&(n, s)| n > 0 && s.is_finite() && s > 0.0);
        points.sort_by_key(|p| p.0);
        points.dedup_by_key(|p| p.0);
        StepCost { points, scale: 1.0 }
    }

    /// Time forward passes over `sizes` rows (context `ctx` tokens, the median of `reps` runs)
    /// in a private cache.
    pub fn calibrate<B: Backend>(
        model: &Model,
        backend: &B,
        sizes: &[usize],
        ctx: usize,
        reps: usize,
    ) -> Result<StepCost> {
        let vocab = model.config.vocab_size as u32;
        let max = sizes.iter().copied().max().unwrap_or(1);
        let prompt: Vec<u32> = (0..ctx.max(1) as u32)
            .map(|i| (i * 7 + 1) % vocab)
            .collect();
        let mut cache = KvCache::new(&model.config, ctx.max(1) + max + 1);
        let pos: Vec<usize> = (0..prompt.len()).collect();
        model.forward(backend, &mut cache, &prompt, &pos, BatchMask::Causal, &[])?;
        Self::measure_in(model, backend, &mut cache, sizes, reps)
    }

    /// Time forward passes over `sizes` rows (all logits, as verification needs) appended to
    /// `cache` and dropped again (`cache` must have room for the largest); the median of `reps`.
    pub fn measure_in<B: Backend>(
        model: &Model,
        backend: &B,
        cache: &mut KvCache,
        sizes: &[usize],
        reps: usize,
    ) -> Result<StepCost> {
        let vocab = model.config.vocab_size as u32;
        let base = cache.len();
        let mut points = Vec::new();
        for &n in sizes.iter().filter(|&&n| n > 0) {
            let toks: Vec<u32> = (0..n as u32).map(|i| (i * 13 + 5) % vocab).collect();
            let pos: Vec<usize> = (base..base + n).collect();
            let rows: Vec<usize> = (0..n).collect();
            let mut t = Vec::new();
            for _ in 0..reps.max(1) {
                let t0 = Instant::now();
                let r = model.forward(backend, cache, &toks, &pos, BatchMask::Causal, &rows);
                t.push(t0.elapsed().as_secs_f64());
                cache.truncate(base);
                r?;
            }
            points.extend(median(&t).map(|m| (n, m)));
        }
        Ok(StepCost::from_points(points))
    }

    /// Fold in a measured pass over `rows` rows: the curve's factor moves toward the ratio of
    /// the measurement to the calibrated shape (an exponential moving average). A pass over
    /// more rows than any point of the curve extends it instead (a new point, in the shape's
    /// units): the curve learns the sizes it is asked about, and never bends where it was
    /// measured.
    pub fn record(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 || self.points.is_empty() {
            return;
        }
        if self.points.last().is_some_and(|&(n, _)| rows > n) {
            self.points.push((rows, secs / self.scale));
            return;
        }
        let ratio = secs / self.shape(rows).max(1e-12);
        self.scale = (1.0 - COST_EMA) * self.scale + COST_EMA * ratio;
    }

    /// Estimated seconds of a pass over `rows` rows.
    pub fn secs(&self, rows: usize) -> f64 {
        self.scale * self.shape(rows)
    }

    /// The calibrated curve.
    fn shape(&self, rows: usize) -> f64 {
        let pts = &self.points;
        let Some(&(n0, s0)) = pts.first() else {
            return rows as f64; // no measurement: one unit per row
        };
        let x = rows as f64;
        if rows <= n0 {
            return s0;
        }
        for w in pts.windows(2) {
            let ((a, sa), (b, sb)) = (w[0], w[1]);
            if rows <= b {
                return sa + (sb - sa) * (x - a as f64) / (b - a) as f64;
            }
        }
        let (nl, sl) = pts[pts.len() - 1];
        sl * x / nl as f64
    }
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
/// share of the batch's expected tokens, beat [`DEPTH_HURDLE`] times its drafting seconds as a
/// share of the pass (`pass_secs`). Drafting that does not pay counts as depth 0 for the
/// backoff, so a costly drafter (a model's passes) with middling acceptance drafts rarely.
pub fn drafting_pays(gain: f64, batch_tokens: f64, draft_secs: f64, pass_secs: f64) -> bool {
    draft_secs <= 0.0
        || gain / batch_tokens.max(f64::MIN_POSITIVE)
            > DEPTH_HURDLE * draft_secs / pass_secs.max(f64::MIN_POSITIVE)
}

/// The most a verified tree may cost, in plain passes: the greatest mean acceptance measured on
/// these CPUs stays under ~2 tokens per step, so a wider pass never pays.
pub const MAX_TREE_COST: f64 = 2.5;

/// Draft nodes worth proposing for an adaptive step (at most `budget`, at least 1): those whose
/// pass costs at most [`MAX_TREE_COST`] plain passes on the learnt curve. Wide drafters (Token
/// Recycling's first level has 8 candidates) then propose their best few nodes instead of a level
/// no depth choice can afford.
pub fn useful_budget(cost: &StepCost, budget: usize) -> usize {
    let limit = MAX_TREE_COST * cost.secs(1);
    let mut n = 1;
    while n < budget && cost.secs(n + 2) <= limit {
        n += 1;
    }
    n.min(budget)
}

/// What one more verified row costs, in plain passes, times [`DEPTH_HURDLE`]: the mean
/// marginal row of an 8-node tree on the learnt curve ([`crate::draft::Drafter::set_row_cost`]).
pub fn row_cost(cost: &StepCost) -> f64 {
    const ROWS: usize = 8;
    let one = cost.secs(1).max(1e-12);
    DEPTH_HURDLE * ((cost.secs(ROWS + 1) - one) / ROWS as f64 / one).max(0.0)
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
}

/// How much a depth's expected gain must exceed its cost: a depth is added only while the
/// relative gain in expected tokens beats the relative growth of the pass by this factor. Costs
/// the curve does not see (drafting, tree bookkeeping, the K/V commit) and the noise of
/// acceptance estimates make break-even depths lose in practice (measured: prompt lookup on chat
/// text through the server, 0.85x of plain decoding at concurrency 4 without it).
pub const DEPTH_HURDLE: f64 = 1.25;

/// Choose each request's verified depth for a step whose other rows (prefill chunks, the roots
/// of every decoding request) number `base_rows`: greedily add the depth with the best expected
/// tokens per extra row while the batch's expected tokens grow [`DEPTH_HURDLE`] times faster
/// than the pass's cost. Depth 0 everywhere is plain decoding, so the choice never expects a
/// slower step mix than no speculation.
pub fn choose_depths(
    options: &[DepthOptions<'_>],
    base_rows: usize,
    cost: &StepCost,
) -> Vec<usize> {
    let mut depth = vec![0usize; options.len()];
    let mut rows = base_rows;
    let mut tokens: f64 = options.len() as f64;
    loop {
        let secs = cost.secs(rows.max(1));
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
                let gain = o.acceptance.expected_tokens(d + 1) - o.acceptance.expected_tokens(d);
                Some((i, extra, gain))
            })
            .filter(|&(_, extra, _)| extra > 0)
            .max_by(|a, b| (a.2 / a.1 as f64).total_cmp(&(b.2 / b.1 as f64)));
        let Some((i, extra, gain)) = best else {
            break;
        };
        // Relative token gain against the hurdle times the relative cost growth.
        let grows = cost.secs(rows + extra) / secs - 1.0;
        if gain / tokens <= DEPTH_HURDLE * grows.max(0.0) {
            break;
        }
        depth[i] += 1;
        rows += extra;
        tokens += gain;
    }
    depth
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
        };
        // Nearly free rows: even a 5% chance pays for a few; the accepting request goes deep.
        let ds = choose_depths(&[mk(&good), mk(&bad)], 2, &flat);
        assert_eq!(ds[0], 8);
        assert!(ds[1] < ds[0]);
        // Rows at 3% of a pass each: the accepting request drafts deep, the rejecting one not.
        let moderate = StepCost::from_points(vec![(1, 0.01), (64, 0.03)]);
        assert_eq!(
            choose_depths(&[mk(&good), mk(&bad)], 2, &moderate),
            vec![8, 0]
        );
        // Each row costs a whole pass: plain decoding.
        assert_eq!(choose_depths(&[mk(&good), mk(&bad)], 2, &steep), vec![0, 0]);
    }
}
