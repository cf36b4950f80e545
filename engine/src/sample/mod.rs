//! Token sampling: greedy, temperature, top-k, top-p (nucleus), with a seeded deterministic RNG.

pub(crate) mod draw;
pub mod json;
pub mod penalty;
pub mod schema;
pub mod verify;

use crate::backend::simd::widened;
use crate::error::{EngineError, Result};

/// How to pick the next token from logits.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 (or less) means greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches p; 1.0 disables.
    pub top_p: f32,
    /// Keep only tokens at least this share of the most likely one's probability (min-p, as
    /// llama.cpp and vLLM: after the temperature, before top-k and top-p); 0.0 disables.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Reject values no sampler could honour.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(EngineError::InvalidArgument(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::InvalidArgument(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(EngineError::InvalidArgument(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        Ok(())
    }
}

/// SplitMix64: tiny, fast and stable across versions (outputs are part of our reproducibility contract).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Index of the largest logit (the first one on ties; NaN ignored; 0 when none is above
/// `-inf`): the largest value in 64 running maxima, then its first position, two passes
/// that vectorize (a compare-and-branch per token did not: 15-60 us per row, and greedy
/// verification takes one per tree row).
pub fn argmax(logits: &[f32]) -> u32 {
    let top = max_ignoring_nan(logits);
    if top == f32::NEG_INFINITY {
        return 0;
    }
    first_equal(logits, top) as u32
}

widened! {
    /// The first index holding `x` (`v.len()` when none).
    fn first_equal(v: &[f32], x: f32) -> usize = first_equal_of;
}

#[inline(always)]
fn first_equal_of(v: &[f32], x: f32) -> usize {
    let mut base = 0;
    for c in v.chunks(64) {
        // A block without it is one vector compare per 16 lanes.
        if c.iter().fold(false, |any, &e| any | (e == x)) {
            return base + c.iter().position(|&e| e == x).unwrap_or(0);
        }
        base += c.len();
    }
    v.len()
}

widened! {
    /// The largest value that is not NaN (`-inf` when none): 64 running maxima, so the loop
    /// vectorizes (the maximum is exact in any order).
    fn max_ignoring_nan(v: &[f32]) -> f32 = max_ignoring_nan_of;
}

#[inline(always)]
fn max_ignoring_nan_of(v: &[f32]) -> f32 {
    // 64 running maxima: four vectors of 16 (eight of 8) whose chains run side by side (one
    // chain of `max` and NaN blend waits on its latency).
    let mut acc = [f32::NEG_INFINITY; 64];
    let chunks = v.chunks_exact(64);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = larger(*a, x);
        }
    }
    for &x in tail {
        acc[0] = larger(acc[0], x);
    }
    lanes_max(acc)
}

/// `x` where it is above `a`, else `a`: the larger, a NaN `x` ignored (`vmaxps` alone, where
/// `f32::max` adds a NaN test and blend per vector). Never NaN when `a` is not; of two zeros
/// it keeps `a`'s sign, which no caller tells apart (they compare with `==` and `>=`).
#[inline(always)]
fn larger(a: f32, x: f32) -> f32 {
    if x > a {
        x
    } else {
        a
    }
}

/// The largest of `N` (a power of two) running maxima that are not NaN, halving.
#[inline(always)]
fn lanes_max<const N: usize>(mut acc: [f32; N]) -> f32 {
    let mut w = N / 2;
    while w > 0 {
        for i in 0..w {
            acc[i] = larger(acc[i], acc[i + w]);
        }
        w /= 2;
    }
    acc[0]
}

/// `ln softmax(logits)[tok]`: the model's log-probability of `tok` (temperature 1, nothing
/// truncated), `logit − max − ln Σ exp(logit − max)` with the engine's exponential and
/// token-keyed sum, so a row gives the same value wherever it was computed (NaN logits carry no
/// mass; `-inf` for a token without mass; NaN when the row has no finite maximum).
pub fn log_softmax_at(logits: &[f32], tok: u32) -> f32 {
    log_softmax_top(logits, tok, 0).0
}

/// Most alternatives a request may ask for per token (`top_logprobs`, as OpenAI's API).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// [`log_softmax_at`] of `tok` and the `n` most likely tokens of the row with their
/// log-probabilities (the same values `log_softmax_at` gives them), most likely first, ties by
/// ascending token id; tokens without mass (NaN logits) are never among them. One exponential
/// pass for all of them; the head is read from 64-token block maxima where it can be.
pub fn log_softmax_top(logits: &[f32], tok: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = max_ignoring_nan(logits);
    if !max.is_finite() {
        return (f32::NAN, Vec::new());
    }
    let sum = exp_total(&mut logits.to_vec(), logits, max);
    let ln_sum = sum.ln();
    let lp = |v: f32| (f64::from(v - max) - ln_sum) as f32;
    let at = logits.get(tok as usize).map_or(f32::NAN, |&v| lp(v));
    if n == 0 {
        return (at, Vec::new());
    }
    let head = top_k_head(logits, n, |v| v).unwrap_or_else(|| {
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        all.sort_unstable_by(by_prob);
        all.truncate(n);
        all
    });
    // Tokens a mask ruled out (-inf: JSON mode) are no alternatives.
    let head = head.into_iter().filter(|&(_, v)| v > f32::NEG_INFINITY);
    (at, head.map(|(t, v)| (t, lp(v))).collect())
}

/// What the logits are shifted by before scaling: a temperature so small that `logit / t`
/// overflows (t = 1e-40 is a valid f32) would make the softmax `inf - inf`, so there the logits
/// are shifted by their maximum first (the same distribution; other temperatures keep the
/// unshifted, bit-stable form).
fn softmax_shift(logits: &[f32], temperature: f32) -> f32 {
    shift_for(max_ignoring_nan(logits), temperature)
}

/// [`softmax_shift`] of logits whose largest value that is not NaN is `top`.
fn shift_for(top: f32, temperature: f32) -> f32 {
    if top.is_finite() && !(top / temperature).is_finite() {
        top
    } else {
        0.0
    }
}

/// The untruncated distribution's masses in token order: softmax of `(logits - shift) /
/// temperature`, NaN where the logit is NaN (those tokens have no mass); `None` when the maximum
/// is not finite (greedy's point mass, as the general path of [`Sampler::distribution`]).
/// Bit for bit what the general path computes where it keeps token order (top-k at least the
/// number of tokens that are not NaN: the same operations per token, the same token-keyed
/// blocked sum, [`draw::total`]), in passes over plain arrays that vectorize: this runs for
/// every sampled row, over a 49k-150k vocabulary.
fn softmax_in_token_order(logits: &[f32], temperature: f32) -> Option<Vec<f32>> {
    let top = max_ignoring_nan(logits);
    let shift = shift_for(top, temperature);
    // The scaled values' maximum: subtracting, dividing by a positive number and rounding never
    // change the order.
    let max = (top - shift) / temperature;
    if !max.is_finite() {
        return None;
    }
    // [vocab] the scaled logits, then their masses.
    let mut x = Vec::with_capacity(logits.len());
    scale(logits, shift, temperature, &mut x);
    let sum = exp_total(&mut x, logits, max);
    normalize(&mut x, sum);
    Some(x)
}

/// `x[i] = exp(x[i] − max)` (subnormal results 0, NaN where `logits[i]` is NaN) and their
/// token-keyed total: the unnormalized masses of a row whose scaled values are `x`.
fn exp_total(x: &mut [f32], logits: &[f32], max: f32) -> f64 {
    crate::backend::simd::exp_sub(x, max);
    // The exponential's lanes and its scalar tail agree on normal results only (see
    // `exp_shifted`), and it need not keep a NaN.
    flush_masked(x, logits);
    draw::total(x)
}

widened! {
    /// [`flush_subnormal`], then NaN wherever the logit is NaN (no mass).
    fn flush_masked(x: &mut [f32], logits: &[f32]) -> () = flush_masked_of;
}

#[inline(always)]
fn flush_masked_of(x: &mut [f32], logits: &[f32]) {
    for (v, l) in x.iter_mut().zip(logits) {
        *v = if l.is_nan() {
            f32::NAN
        } else if *v < f32::MIN_POSITIVE {
            0.0
        } else {
            *v
        };
    }
}

widened! {
    /// `x = (logits - shift) / temperature`, element by element.
    fn scale(logits: &[f32], shift: f32, temperature: f32, x: &mut Vec<f32>) -> () = scale_of;
}

#[inline(always)]
fn scale_of(logits: &[f32], shift: f32, temperature: f32, x: &mut Vec<f32>) {
    x.clear();
    x.extend(logits.iter().map(|&v| (v - shift) / temperature));
}

widened! {
    /// `x[i] = x[i] / sum` as [`normalized`] computes it.
    fn normalize(x: &mut [f32], sum: f64) -> () = normalize_of;
}

#[inline(always)]
fn normalize_of(x: &mut [f32], sum: f64) {
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v = normalized(*v, inv);
    }
}

/// A mass divided by the total whose reciprocal is `inv`: in f64, rounded to f32 (a multiply:
/// an f64 division per token cost a third of a sampled row).
#[inline(always)]
fn normalized(v: f32, inv: f64) -> f32 {
    (f64::from(v) * inv) as f32
}

/// The (token, mass) pairs of masses in token order, NaN ones left out.
fn pairs_in_token_order(m: &[f32]) -> Vec<(u32, f32)> {
    let mut out = Vec::with_capacity(m.len());
    out.extend(
        m.iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v)),
    );
    out
}

/// `x[i] = exp(x[i] − max)` with the engine's vectorized exponential
/// ([`crate::backend::simd::exp_sub`]; libm's `expf`, one call per token, cost more than the
/// rest of a row's softmax together), results below the smallest normal float flushed to 0: the
/// vector lanes and the scalar tail agree on normal results only, and this way a token's mass
/// is the same wherever it sits in the array (the untruncated and the truncated paths place it
/// differently). `-inf` gives exactly 0.
fn exp_shifted(x: &mut [f32], max: f32) {
    crate::backend::simd::exp_sub(x, max);
    flush_subnormal(x);
}

widened! {
    /// Values below the smallest normal float (not NaN) become 0.
    fn flush_subnormal(x: &mut [f32]) -> () = flush_subnormal_of;
}

#[inline(always)]
fn flush_subnormal_of(x: &mut [f32]) {
    for v in x.iter_mut() {
        if *v < f32::MIN_POSITIVE {
            *v = 0.0;
        }
    }
}

/// One row's distribution in token order ([`Sampler::dense_masses`]).
pub(crate) enum RowMasses {
    /// All the mass on one token.
    Point(u32),
    /// `[vocab]` masses in token order, NaN where a token has none.
    Dense(Vec<f32>),
}

impl RowMasses {
    /// The inverse-CDF draw of uniform `r` ([`draw::draw_dense`]; a point mass gives its token):
    /// bit for bit the draw from the distribution's (token, probability) pairs.
    pub(crate) fn draw(&self, r: f64) -> u32 {
        match self {
            RowMasses::Point(t) => *t,
            RowMasses::Dense(m) => draw::draw_dense(m, r),
        }
    }
}

/// Descending probability, then ascending token id: a total order.
fn by_prob(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Min-p on normalized masses in token order (NaN for no mass): tokens below `min_p` times the
/// largest mass lose theirs (NaN), and the rest are normalized again.
fn min_p_cut(m: &mut [f32], min_p: f32) {
    let floor = min_p * max_ignoring_nan(m);
    below_to_nan(m, floor);
    let sum = draw::total(m);
    normalize(m, sum);
}

widened! {
    /// NaN (no mass) wherever a value is below `floor`.
    fn below_to_nan(m: &mut [f32], floor: f32) -> () = below_to_nan_of;
}

#[inline(always)]
fn below_to_nan_of(m: &mut [f32], floor: f32) {
    for v in m.iter_mut() {
        if *v < floor {
            *v = f32::NAN;
        }
    }
}

/// Top-p (nucleus) of the untruncated masses `m` (token order, NaN for no mass): the most likely
/// tokens, in [`by_prob`] order, up to the first whose running f64 sum reaches `top_p`,
/// renormalized over themselves. Only that head is sorted: the [`NUCLEUS_HEAD`] most likely
/// tokens are selected in O(V) and sorted, four times as many while their mass falls short (a
/// full sort of a 150k-token vocabulary per sampled row cost ~4 ms). The result is what a full
/// sort gives.
fn nucleus(m: &[f32], top_p: f32) -> Vec<(u32, f32)> {
    // Most nuclei lie within the head: found from the blocks' maxima without a pair per token
    // ([`top_k_head`]; zero masses rank after every positive one and add nothing, so the cut
    // comes before them).
    if let Some(mut head) = top_k_head(m, NUCLEUS_HEAD, |v| v) {
        if let Some(keep) = nucleus_len(&head, top_p) {
            head.truncate(keep);
            renormalize(&mut head);
            return head;
        }
    }
    let mut cand: Vec<(u32, f32)> = Vec::with_capacity(m.len());
    cand.extend(
        m.iter()
            .enumerate()
            .filter(|(_, v)| **v > 0.0)
            .map(|(i, &v)| (i as u32, v)),
    );
    let mut head = NUCLEUS_HEAD.min(cand.len());
    let keep = loop {
        if head < cand.len() {
            cand.select_nth_unstable_by(head - 1, by_prob);
        }
        cand[..head].sort_by(by_prob);
        match nucleus_len(&cand[..head], top_p) {
            Some(n) => break n,
            None if head == cand.len() => break head,
            None => head = (head * 4).min(cand.len()),
        }
    };
    cand.truncate(keep);
    renormalize(&mut cand);
    cand
}

/// How many of `sorted` (by [`by_prob`]) top-p keeps: up to the first whose running sum reaches
/// `top_p` (`None` when none does). In f64: over a vocabulary of 150 k, an f32 running sum drops
/// tail tokens below half its ulp and the cut lands early or late.
fn nucleus_len(sorted: &[(u32, f32)], top_p: f32) -> Option<usize> {
    let mut acc = 0.0f64;
    sorted
        .iter()
        .position(|c| {
            acc += f64::from(c.1);
            acc >= f64::from(top_p)
        })
        .map(|i| i + 1)
}

/// Kept probabilities divided by their sum (in f64, in order).
fn renormalize(cand: &mut [(u32, f32)]) {
    let s: f64 = cand.iter().map(|c| f64::from(c.1)).sum();
    for c in cand.iter_mut() {
        c.1 = (f64::from(c.1) / s) as f32;
    }
}

/// Values per block of [`block_maxima`].
const MAX_BLOCK: usize = 64;

widened! {
    /// The largest value that is not NaN of each [`MAX_BLOCK`]-value block of `v` (`-inf` for a
    /// block without one), into `out`.
    fn block_maxima(v: &[f32], out: &mut Vec<f32>) -> () = block_maxima_of;
}

#[inline(always)]
fn block_maxima_of(v: &[f32], out: &mut Vec<f32>) {
    out.clear();
    let blocks = v.chunks_exact(MAX_BLOCK);
    let tail = blocks.remainder();
    for b in blocks {
        let mut acc = [f32::NEG_INFINITY; 16];
        for c in b.chunks_exact(16) {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a = larger(*a, x);
            }
        }
        out.push(lanes_max(acc));
    }
    if !tail.is_empty() {
        out.push(max_ignoring_nan_of(tail));
    }
}

/// The `k` most likely tokens of `logits` under the scaling `scaled` (monotone: `(v − shift) /
/// temperature`), as (token, scaled logit) in [`by_prob`] order, without a pair per token: the
/// `k`-th largest of the blocks' maxima bounds the `k`-th token from below (`k` blocks reach it),
/// so only the blocks whose maximum reaches that bound are scanned and only their tokens that
/// reach it are ranked. The same `k` pairs, in the same order, as selecting over every token that
/// is not NaN; `None` (the caller ranks every token) where it cannot tell that more than `k`
/// tokens are not NaN, i.e. that top-k truncates at all. Costs three vectorized passes where the
/// pairs cost ~130 us per row over a 49k vocabulary.
fn top_k_head(logits: &[f32], k: usize, scaled: impl Fn(f32) -> f32) -> Option<Vec<(u32, f32)>> {
    if k == 0 || k >= logits.len() {
        return None;
    }
    // [n_blocks] each block's largest logit; scaling is monotone, so scaled it is the block's
    // largest scaled value.
    let mut maxima = Vec::with_capacity(logits.len().div_ceil(MAX_BLOCK));
    block_maxima(logits, &mut maxima);
    if maxima.len() < k {
        return None;
    }
    let mut order = maxima.clone();
    order.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    // At least k tokens (a block maximum each) scale to `bound` or more, so the k-th token by
    // `by_prob` does too, and every token ranked above it.
    let bound = scaled(order[k - 1]);
    if bound.is_nan() {
        return None;
    }
    let mut cand: Vec<(u32, f32)> = Vec::with_capacity(4 * k);
    for (b, &m) in maxima.iter().enumerate() {
        if scaled(m) >= bound {
            let start = b * MAX_BLOCK;
            let block = &logits[start..(start + MAX_BLOCK).min(logits.len())];
            for (i, &v) in block.iter().enumerate() {
                let x = scaled(v);
                if x >= bound {
                    cand.push(((start + i) as u32, x));
                }
            }
        }
    }
    // Only tokens that are not NaN pass `>=`, and the k best over every token are among them.
    // Top-k truncates where more than k tokens are not NaN: more than k here, or exactly k (the
    // common case where each of the k best tops its own block) and another one elsewhere.
    if cand.len() < k || (cand.len() == k && count_not_nan(logits) == k) {
        return None;
    }
    cand.select_nth_unstable_by(k - 1, by_prob);
    cand.truncate(k);
    cand.sort_by(by_prob);
    Some(cand)
}

widened! {
    /// How many values of `v` are not NaN.
    fn count_not_nan(v: &[f32]) -> usize = count_not_nan_of;
}

#[inline(always)]
fn count_not_nan_of(v: &[f32]) -> usize {
    v.iter().map(|x| usize::from(!x.is_nan())).sum()
}

/// Tokens sorted first when looking for a nucleus ([`nucleus`]).
const NUCLEUS_HEAD: usize = 256;

/// A stateful sampler (owns its RNG stream).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        let rng = Rng::new(params.seed);
        Ok(Sampler { params, rng })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The distribution this sampler draws from, as sparse (token, probability) pairs;
    /// temperature, top-k and top-p applied. Sorted by descending probability when top-k or top-p
    /// truncates it; without truncation in token order (no O(V log V) sort per token over a
    /// 150k-token vocabulary). Greedy gives one pair.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        match self.dense_masses(logits) {
            Some(RowMasses::Point(t)) => return vec![(t, 1.0)],
            Some(RowMasses::Dense(m)) => return pairs_in_token_order(&m),
            None => {}
        }
        let p = &self.params;
        if p.top_k == 0 || p.top_k >= logits.len() {
            // Top-p (after min-p), no top-k.
            return match self.masses_in_token_order(logits) {
                Some(m) => nucleus(&m, p.top_p),
                None => vec![(argmax(logits), 1.0)],
            };
        }
        let shift = softmax_shift(logits, p.temperature);
        let scaled = |v: f32| (v - shift) / p.temperature;
        let (mut cand, sorted) = match top_k_head(logits, p.top_k, scaled) {
            Some(head) => (head, true),
            None => {
                // Sized once (a filtered iterator's `collect` grows the vector by doubling: ~8
                // copies of a 150k-token vocabulary's pairs per sampled row).
                let mut cand: Vec<(u32, f32)> = Vec::with_capacity(logits.len());
                cand.extend(
                    logits
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| !v.is_nan())
                        .map(|(i, &v)| (i as u32, scaled(v))),
                );
                let sorted = if p.top_k > 0 && p.top_k < cand.len() {
                    // The same k tokens a full sort would keep (a total order), in O(V + k log k).
                    cand.select_nth_unstable_by(p.top_k - 1, by_prob);
                    cand.truncate(p.top_k);
                    cand.sort_by(by_prob);
                    true
                } else if p.top_p < 1.0 {
                    cand.sort_by(by_prob);
                    true
                } else {
                    false
                };
                (cand, sorted)
            }
        };
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            // A +inf logit (the softmax would be `inf - inf` = NaN everywhere) or no finite one:
            // greedy's choice, the first +inf (or 0), as a point mass, so plain sampling and
            // tree verification agree.
            return vec![(argmax(logits), 1.0)];
        }
        let mut e: Vec<f32> = cand.iter().map(|c| c.1).collect();
        exp_shifted(&mut e, max);
        for (c, e) in cand.iter_mut().zip(e) {
            c.1 = e;
        }
        if p.min_p > 0.0 {
            // Against the largest mass before normalizing (the ratio is the same).
            let floor = p.min_p * cand.iter().fold(0.0f32, |a, c| a.max(c.1));
            cand.retain(|c| c.1 >= floor);
        }
        // In token order (nothing truncated: the untruncated path's bits) the token-keyed sum,
        // sorted by probability eight running sums in that order.
        let sum = if sorted {
            draw::total_in_sequence(cand.iter().map(|c| f64::from(c.1)))
        } else {
            draw::total_in_order(cand.iter().map(|c| (c.0, f64::from(c.1))))
        };
        let inv = 1.0 / sum;
        for c in cand.iter_mut() {
            c.1 = normalized(c.1, inv);
        }
        if p.top_p < 1.0 {
            let keep = nucleus_len(&cand, p.top_p).unwrap_or(cand.len());
            cand.truncate(keep);
            renormalize(&mut cand);
        }
        cand
    }

    /// The distribution of one row as masses in token order where it comes in token order
    /// (greedy, no cut, or min-p's alone): [`Sampler::distribution`] without its pairs; `None`
    /// where top-k or top-p truncate.
    pub(crate) fn dense_masses(&self, logits: &[f32]) -> Option<RowMasses> {
        let p = &self.params;
        if p.is_greedy() {
            return Some(RowMasses::Point(argmax(logits)));
        }
        if !self.in_token_order(logits.len()) {
            return None;
        }
        Some(match self.masses_in_token_order(logits) {
            Some(m) => RowMasses::Dense(m),
            None => RowMasses::Point(argmax(logits)),
        })
    }

    /// The softmax at the temperature in token order, min-p's cut applied
    /// ([`softmax_in_token_order`]'s `None` where the maximum is not finite).
    fn masses_in_token_order(&self, logits: &[f32]) -> Option<Vec<f32>> {
        let p = &self.params;
        let mut m = softmax_in_token_order(logits, p.temperature)?;
        if p.min_p > 0.0 {
            min_p_cut(&mut m, p.min_p);
        }
        Some(m)
    }

    /// Whether [`Sampler::distribution`] keeps a `vocab`-token row in token order: no top-k or
    /// top-p cut (a min-p cut leaves the order).
    fn in_token_order(&self, vocab: usize) -> bool {
        let p = &self.params;
        (p.top_k == 0 || p.top_k >= vocab) && p.top_p >= 1.0
    }

    /// Draw the next token: `draw(&distribution(logits))`, bit for bit and with the same
    /// random stream, without building the (token, probability) pairs where nothing truncates;
    /// greedy takes the argmax without a uniform.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        match self.dense_masses(logits) {
            Some(m) => m.draw(self.rng.next_f64()),
            None => {
                let dist = self.distribution(logits);
                self.draw(&dist)
            }
        }
    }

    /// Draw from an explicit sparse distribution (probabilities summing to ~1). In strictly
    /// increasing token order (as untruncated distributions come) the draw runs on blocked sums
    /// ([`draw::draw_in_order`]; a list without mass gives token 0); otherwise (sorted by
    /// probability) it scans in the given order.
    pub fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
        if dist.windows(2).all(|w| w[0].0 < w[1].0) {
            return draw::draw_in_order(dist, self.rng.next_f64());
        }
        let total: f64 = dist.iter().map(|d| d.1 as f64).sum();
        let mut u = self.rng.next_f64() * total;
        for &(tok, p) in dist {
            u -= p as f64;
            if u < 0.0 {
                return tok;
            }
        }
        dist.last().map_or(0, |d| d.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized argmax is the first-maximum scan: ties, NaNs, infinities, `-inf` only,
    /// lengths around the block size.
    #[test]
    fn argmax_is_the_first_maximum() {
        let scan = |v: &[f32]| {
            let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
            for (i, &x) in v.iter().enumerate() {
                if x > best_v {
                    best_v = x;
                    best = i;
                }
            }
            best as u32
        };
        let mut rng = Rng::new(4);
        for case in 0..400 {
            let n = (rng.next_u64() % 300) as usize;
            let mut v: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 12 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => 7.0, // ties
                    _ => (rng.next_u64() % 14) as f32 - 7.0,
                })
                .collect();
            match case % 5 {
                0 if n > 0 => v[(rng.next_u64() % n as u64) as usize] = f32::INFINITY,
                1 => v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
                2 => v.iter_mut().for_each(|x| *x = f32::NAN),
                _ => {}
            }
            assert_eq!(argmax(&v), scan(&v), "case {case}: {v:?}");
        }
    }

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[1.0, 2.0, 0.5]), 1);
    }

    /// A +inf logit is a point mass on it (the first, as greedy picks); no finite logit is
    /// greedy's token 0. Both came out NaN distributions (the last token, or token 0, by path).
    #[test]
    fn non_finite_logits_give_greedys_token() {
        for top_p in [1.0, 0.9] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p,
                min_p: 0.0,
                seed: 1,
            })
            .unwrap();
            let inf = [1.0, f32::INFINITY, 0.0, f32::INFINITY];
            assert_eq!(s.distribution(&inf), vec![(1, 1.0)]);
            assert_eq!(s.sample(&inf), 1);
            let none = [f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NAN];
            assert_eq!(s.distribution(&none), vec![(0, 1.0)]);
            assert_eq!(s.sample(&none), 0);
        }
    }

    /// A `-inf` logit has no mass and a NaN one is no candidate, truncated or not, and masses
    /// that would be subnormal are 0 (the same for a token wherever it sits).
    #[test]
    fn masked_and_vanishing_tokens_have_no_mass() {
        let mut logits = vec![0.0f32; 40];
        logits[3] = f32::NEG_INFINITY;
        logits[7] = f32::NAN;
        logits[9] = -95.0; // e^-95 is about 5e-42: subnormal
        logits[11] = 2.0;
        for (top_k, top_p) in [(0, 1.0), (39, 1.0), (0, 0.9999)] {
            let s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k,
                top_p,
                min_p: 0.0,
                seed: 0,
            })
            .unwrap();
            let d = s.distribution(&logits);
            let mass = |t: u32| d.iter().find(|e| e.0 == t).map(|e| e.1);
            assert!(mass(7).is_none(), "top_k {top_k} top_p {top_p}");
            assert!(
                mass(3).is_none_or(|m| m == 0.0),
                "top_k {top_k} top_p {top_p}"
            );
            assert!(
                mass(9).is_none_or(|m| m == 0.0),
                "top_k {top_k} top_p {top_p}"
            );
            assert!(
                mass(11).is_some_and(|m| m > 0.1),
                "top_k {top_k} top_p {top_p}"
            );
        }
    }

    /// top_p over a long flat tail: the running sum keeps every tail token's mass (an f32 sum
    /// stalls once the tokens fall below half its ulp).
    #[test]
    fn top_p_counts_a_long_tail() {
        // One token of mass 1/2, then 150 000 tokens sharing the other half.
        let n = 150_000usize;
        let mut logits = vec![0.0f32; n + 1];
        logits[0] = (n as f32).ln();
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.75,
            min_p: 0.0,
            seed: 1,
        })
        .unwrap();
        let kept = s.distribution(&logits).len();
        // 1/2 + k / 300 000 >= 3/4: k = 75 000 tail tokens (an f32 sum kept ~74 900).
        let want = 1 + n / 2;
        assert!(kept.abs_diff(want) <= 2, "kept {kept}, want {want}");
    }

    #[test]
    fn top_k_and_top_p_restrict_support() {
        let logits = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1,
        })
        .unwrap();
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 3]);
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            min_p: 0.0,
            seed: 1,
        })
        .unwrap();
        // p(4) = e^4 / sum ~ 0.636 >= 0.5: only token 4 survives.
        assert_eq!(s.distribution(&logits), vec![(4, 1.0)]);
    }

    /// The partial-selection top-k keeps exactly the tokens and order a full sort keeps (ties
    /// broken by token id), and the untruncated distribution is the softmax of every token.
    #[test]
    fn top_k_selection_equals_full_sort_and_untruncated_is_softmax() {
        let mut rng = Rng::new(3);
        // Few distinct values, so ties are common.
        let logits: Vec<f32> = (0..500)
            .map(|_| (rng.next_u64() % 40) as f32 * 0.25)
            .collect();
        for k in [1usize, 2, 7, 40, 499] {
            let s = Sampler::new(SamplingParams {
                temperature: 0.7,
                top_k: k,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
            })
            .unwrap();
            let got: Vec<u32> = s.distribution(&logits).iter().map(|d| d.0).collect();
            let mut want: Vec<u32> = (0..logits.len() as u32).collect();
            want.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            want.truncate(k);
            assert_eq!(got, want, "top-k {k}");
        }
        let s = Sampler::new(SamplingParams {
            temperature: 0.7,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        })
        .unwrap();
        let d = s.distribution(&logits);
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x / 0.7));
        let z: f64 = logits.iter().map(|&x| ((x / 0.7 - max) as f64).exp()).sum();
        assert_eq!(d.len(), logits.len());
        for (i, &(t, p)) in d.iter().enumerate() {
            assert_eq!(t as usize, i);
            let want = ((logits[i] / 0.7 - max) as f64).exp() / z;
            assert!((p as f64 - want).abs() < 1e-6, "token {i}: {p} vs {want}");
        }
    }

    /// The untruncated distribution's array passes give the general path's bits: with a NaN
    /// among the logits, top-k = vocab - 1 truncates nothing and runs the general path.
    #[test]
    fn untruncated_softmax_is_the_general_paths_bits() {
        let mut rng = Rng::new(5);
        for case in 0..60 {
            let n = 1 + (rng.next_u64() % 3000) as usize;
            let mut logits: Vec<f32> = (0..n)
                .map(|_| (rng.next_f64() as f32 - 0.5) * 40.0)
                .collect();
            for _ in 0..1 + case % 4 {
                let i = (rng.next_u64() % n as u64) as usize;
                logits[i] = f32::NAN;
            }
            if case % 3 == 0 {
                logits[(rng.next_u64() % n as u64) as usize] = f32::NEG_INFINITY;
            }
            for temperature in [1.0f32, 0.7, 1.3e-3, 1e-40] {
                let params = |top_k| SamplingParams {
                    temperature,
                    top_k,
                    top_p: 1.0,
                    min_p: 0.0,
                    seed: 0,
                };
                let fast = Sampler::new(params(0)).unwrap().distribution(&logits);
                let general = Sampler::new(params(n - 1)).unwrap().distribution(&logits);
                let bits = |d: &[(u32, f32)]| -> Vec<(u32, u32)> {
                    d.iter().map(|&(t, p)| (t, p.to_bits())).collect()
                };
                assert_eq!(bits(&fast), bits(&general), "case {case}, T {temperature}");
            }
        }
    }

    #[test]
    fn sampling_matches_softmax_frequencies() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()]; // probs 1/6, 2/6, 3/6
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 42,
        })
        .unwrap();
        let mut counts = [0usize; 3];
        let n = 60_000;
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        let expect = [n as f64 / 6.0, n as f64 * 2.0 / 6.0, n as f64 * 3.0 / 6.0];
        let chi2: f64 = counts
            .iter()
            .zip(expect)
            .map(|(&c, e)| (c as f64 - e).powi(2) / e)
            .sum();
        // 2 degrees of freedom: p = 0.001 at chi2 = 13.8.
        assert!(chi2 < 13.8, "chi2 {chi2}, counts {counts:?}");
    }

    #[test]
    fn tiny_temperature_puts_the_mass_on_the_maximum() {
        // 5.0 / 1e-40 overflows f32: without the shift the softmax was `inf - inf` = NaN and
        // every draw fell through to the last token.
        let logits = [1.0f32, 5.0, -3.0, 4.999];
        for t in [1e-40f32, 1e-30, f32::MIN_POSITIVE] {
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                seed: 3,
                ..Default::default()
            })
            .unwrap();
            let d = s.distribution(&logits);
            let p1 = d.iter().find(|c| c.0 == 1).map_or(0.0, |c| c.1);
            assert_eq!(p1, 1.0, "t = {t}: {d:?}");
            assert!(d.iter().all(|c| c.1.is_finite()), "t = {t}: {d:?}");
            for _ in 0..20 {
                assert_eq!(s.sample(&logits), 1, "t = {t}");
            }
        }
    }

    /// `top_k_head` gives every token selection over all tokens gives (the same pairs, bit for
    /// bit, in `by_prob` order) and declines only where top-k does not truncate: ties within and
    /// across blocks, NaN, ±inf, signed zeros, scalings that round distinct logits to one value,
    /// exactly k tokens that are not NaN, k around the block count.
    #[test]
    fn top_k_head_is_the_selection_over_every_token() {
        let mut rng = Rng::new(11);
        for case in 0..9 {
            for n in [1000usize, 4097, 64 * 40] {
                let mut logits: Vec<f32> = match case {
                    0 => rough_logits(&mut rng, n),
                    // Few distinct values: ties everywhere.
                    1 => (0..n).map(|_| (rng.next_u64() % 6) as f32).collect(),
                    // One large value per block (each of the best tops its own block), zeros of
                    // both signs elsewhere.
                    2 => (0..n)
                        .map(|i| match (i % MAX_BLOCK == 7, rng.next_u64() % 2) {
                            (true, _) => 10.0 + (i / MAX_BLOCK % 9) as f32,
                            (false, 0) => 0.0,
                            _ => -0.0,
                        })
                        .collect(),
                    // Distinct logits 8 apart that one scaling rounds together.
                    3 => (0..n)
                        .map(|_| 1.0e8 + 8.0 * (rng.next_u64() % 64) as f32)
                        .collect(),
                    // Mostly NaN: 39 or 40 tokens left.
                    4 | 5 => {
                        let mut v = vec![f32::NAN; n];
                        for i in 0..(35 + case) {
                            v[(i * 97) % n] = rng.next_f64() as f32;
                        }
                        v
                    }
                    6 => {
                        let mut v = rough_logits(&mut rng, n);
                        v[n / 2] = f32::INFINITY;
                        v
                    }
                    // Only zeros of both signs and -1: the bound is a zero, and some blocks
                    // report -0.0 while holding +0.0.
                    7 => (0..n)
                        .map(|_| [0.0, -0.0, -1.0][(rng.next_u64() % 3) as usize])
                        .collect(),
                    _ => (0..n).map(|_| rng.next_f64() as f32 * 20.0).collect(),
                };
                if case == 3 {
                    logits[3] = 1.0e8 + 4.0; // between two neighbours
                }
                for temperature in [1.0f32, 3.0, 0.7, 1e-38] {
                    let shift = softmax_shift(&logits, temperature);
                    let scaled = |v: f32| (v - shift) / temperature;
                    let mut all: Vec<(u32, f32)> = logits
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| !v.is_nan())
                        .map(|(i, &v)| (i as u32, scaled(v)))
                        .collect();
                    all.sort_by(by_prob);
                    let blocks = n.div_ceil(MAX_BLOCK);
                    for k in [1usize, 2, 5, 39, 40, 41, blocks - 1, blocks, blocks + 1] {
                        let head = top_k_head(&logits, k, scaled);
                        let at = format!("case {case} n {n} t {temperature} k {k}");
                        // It declines exactly where top-k keeps every token or there are fewer
                        // blocks than k.
                        assert_eq!(head.is_some(), k < all.len() && k <= blocks, "{at}");
                        let Some(head) = head else { continue };
                        let bits = |v: &[(u32, f32)]| -> Vec<(u32, u32)> {
                            v.iter().map(|&(t, x)| (t, x.to_bits())).collect()
                        };
                        assert_eq!(bits(&head), bits(&all[..k]), "{at}");
                    }
                }
            }
        }
    }

    /// Top-k then top-p: the k most likely, normalized, cut at the first token whose running sum
    /// reaches p and normalized again (a hand-written cut against `nucleus_len`'s).
    #[test]
    fn top_k_then_top_p_cuts_at_the_first_token_reaching_p() {
        let mut rng = Rng::new(5);
        let mut cut = 0;
        for case in 0..12 {
            let n = 3000 + 1000 * case;
            let logits: Vec<f32> = (0..n)
                .map(|_| (rng.next_f64() as f32 - 0.5) * 12.0)
                .collect();
            for (k, top_p) in [(40, 0.5f32), (40, 0.9), (200, 0.95), (5, 0.999)] {
                let params = |top_p| SamplingParams {
                    temperature: 0.8,
                    top_k: k,
                    top_p,
                    min_p: 0.0,
                    seed: 0,
                };
                let whole = Sampler::new(params(1.0)).unwrap().distribution(&logits);
                assert_eq!(whole.len(), k);
                let mut acc = 0.0f64;
                let keep = whole
                    .iter()
                    .position(|c| {
                        acc += f64::from(c.1);
                        acc >= f64::from(top_p)
                    })
                    .map_or(whole.len(), |i| i + 1);
                cut += usize::from(keep < k);
                let total: f64 = whole[..keep].iter().map(|c| f64::from(c.1)).sum();
                let want: Vec<(u32, u32)> = whole[..keep]
                    .iter()
                    .map(|c| (c.0, ((f64::from(c.1) / total) as f32).to_bits()))
                    .collect();
                let got: Vec<(u32, u32)> = Sampler::new(params(top_p))
                    .unwrap()
                    .distribution(&logits)
                    .iter()
                    .map(|c| (c.0, c.1.to_bits()))
                    .collect();
                assert_eq!(got, want, "case {case} k {k} top_p {top_p}");
            }
        }
        assert!(cut >= 24, "top-p cut inside the top-k in {cut} of 48");
    }

    /// Random logits with NaNs, `-inf`s and values whose masses underflow.
    fn rough_logits(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| match rng.next_u64() % 50 {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 => -120.0,
                _ => (rng.next_f64() as f32 - 0.5) * 30.0,
            })
            .collect()
    }

    /// `log_softmax_top`: the chosen token's value is `log_softmax_at`'s; the head is the `n`
    /// best tokens of a full sort (descending logit, then token id; NaN never), each with its
    /// `log_softmax_at` value bit for bit; the masses of a whole row sum to 1.
    #[test]
    fn top_log_probabilities_are_the_rows_best_tokens() {
        let mut rng = Rng::new(5);
        for case in 0..4 {
            for n_tok in [7usize, 300, 4099] {
                let logits: Vec<f32> = match case {
                    0 => rough_logits(&mut rng, n_tok),
                    // Ties: few distinct values.
                    1 => (0..n_tok).map(|_| (rng.next_u64() % 4) as f32).collect(),
                    // Mostly NaN: fewer tokens with mass than asked for.
                    2 => (0..n_tok)
                        .map(|i| if i % 400 == 3 { i as f32 } else { f32::NAN })
                        .collect(),
                    _ => (0..n_tok).map(|i| (i % 97) as f32 * 0.1).collect(),
                };
                let mut order: Vec<(u32, f32)> = logits
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| !v.is_nan())
                    .map(|(i, &v)| (i as u32, v))
                    .collect();
                order.sort_by(by_prob);
                for n in [0usize, 1, 5, MAX_TOP_LOGPROBS] {
                    let tok = (rng.next_u64() % n_tok as u64) as u32;
                    let (lp, top) = log_softmax_top(&logits, tok, n);
                    let want = log_softmax_at(&logits, tok);
                    assert_eq!(lp.to_bits(), want.to_bits(), "case {case} n {n}");
                    assert_eq!(top.len(), n.min(order.len()), "case {case} n {n}");
                    for (&(t, l), &(ot, _)) in top.iter().zip(&order) {
                        assert_eq!(t, ot, "case {case} n {n}");
                        assert_eq!(l.to_bits(), log_softmax_at(&logits, t).to_bits());
                    }
                }
                if case == 3 {
                    let (_, all) = log_softmax_top(&logits, 0, n_tok);
                    let mass: f64 = all.iter().map(|&(_, l)| (l as f64).exp()).sum();
                    assert!((mass - 1.0).abs() < 1e-4, "{mass}");
                }
            }
        }
        assert!(log_softmax_top(&[f32::NAN; 4], 0, 2).1.is_empty());
    }

    /// `sample` (masses drawn without building pairs) is `draw(&distribution(..))` bit for bit,
    /// on the same random stream, truncated or not, at any temperature.
    #[test]
    fn sample_is_the_draw_from_the_distribution() {
        let mut rng = Rng::new(9);
        for case in 0..40u64 {
            let n = 1 + (rng.next_u64() % 5000) as usize;
            let mut logits = rough_logits(&mut rng, n);
            if case % 5 == 0 {
                logits[(rng.next_u64() % n as u64) as usize] = f32::INFINITY; // a point mass
            }
            for (temperature, top_k, top_p, min_p) in [
                (1.0f32, 0, 1.0f32, 0.0f32),
                (0.7, 0, 1.0, 0.0),
                (1e-40, 0, 1.0, 0.0),
                (1.0, 50, 1.0, 0.0),
                (0.8, 0, 0.9, 0.0),
                (1.0, 0, 1.0, 0.01),
                (0.7, 50, 0.9, 0.05),
            ] {
                let params = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed: case,
                };
                let mut a = Sampler::new(params.clone()).unwrap();
                let mut b = Sampler::new(params).unwrap();
                for _ in 0..10 {
                    let d = b.distribution(&logits);
                    assert_eq!(
                        a.sample(&logits),
                        b.draw(&d),
                        "case {case}, T {temperature}"
                    );
                }
                assert_eq!(a.rng.next_u64(), b.rng.next_u64(), "case {case}");
            }
        }
    }

    /// The nucleus found by sorting only its head is the one a full sort gives, bit for bit:
    /// peaked rows (a nucleus of a few tokens), flat ones (most of the vocabulary: the head
    /// grows several times), ties, and `top_p` reached exactly or never (rounding).
    #[test]
    fn nucleus_is_the_full_sorts_nucleus() {
        let mut rng = Rng::new(21);
        for case in 0..60 {
            // Past 64 × NUCLEUS_HEAD tokens the head comes from the blocks' maxima.
            let n = 1 + (rng.next_u64() % [6000, 40000][case / 3 % 2]) as usize;
            let spread = [0.5f32, 4.0, 30.0][case % 3];
            let mut logits: Vec<f32> = (0..n)
                .map(|_| ((rng.next_f64() as f32 - 0.5) * spread * 8.0).round() / 8.0)
                .collect();
            if case % 4 == 0 {
                logits[(rng.next_u64() % n as u64) as usize] = f32::NAN;
            }
            if case % 10 == 9 {
                // Fewer than 256 tokens with mass: zero masses inside the head.
                let len = 16_321 + case;
                logits = vec![-1000.0; len];
                for i in 0..(50 + 4 * case) {
                    logits[(i * 331) % len] = (i % 7) as f32;
                }
            }
            let n = logits.len();
            for top_p in [0.3f32, 0.9, 0.999, 1.0 - f32::EPSILON] {
                let s = Sampler::new(SamplingParams {
                    temperature: 0.9,
                    top_k: 0,
                    top_p,
                    min_p: 0.0,
                    seed: 0,
                })
                .unwrap();
                let m = softmax_in_token_order(&logits, 0.9).unwrap();
                let mut full: Vec<(u32, f32)> = pairs_in_token_order(&m);
                full.retain(|c| c.1 > 0.0);
                full.sort_by(by_prob);
                let mut acc = 0.0f64;
                let keep = full
                    .iter()
                    .position(|c| {
                        acc += f64::from(c.1);
                        acc >= f64::from(top_p)
                    })
                    .map_or(full.len(), |i| i + 1);
                full.truncate(keep);
                let total: f64 = full.iter().map(|c| f64::from(c.1)).sum();
                let want: Vec<(u32, u32)> = full
                    .iter()
                    .map(|c| (c.0, ((f64::from(c.1) / total) as f32).to_bits()))
                    .collect();
                let got: Vec<(u32, u32)> = s
                    .distribution(&logits)
                    .iter()
                    .map(|c| (c.0, c.1.to_bits()))
                    .collect();
                assert_eq!(got, want, "case {case}, n {n}, top_p {top_p}");
            }
        }
    }

    #[test]
    fn same_seed_same_stream() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.0,
            seed: 7,
        };
        let mut a = Sampler::new(p.clone()).unwrap();
        let mut b = Sampler::new(p).unwrap();
        let xa: Vec<u32> = (0..50).map(|_| a.sample(&logits)).collect();
        let xb: Vec<u32> = (0..50).map(|_| b.sample(&logits)).collect();
        assert_eq!(xa, xb);
    }

    #[test]
    fn invalid_params_are_errors() {
        for (t, p, m) in [
            (-1.0, 1.0, 0.0),
            (f32::NAN, 1.0, 0.0),
            (1.0, 0.0, 0.0),
            (1.0, 1.5, 0.0),
            (1.0, 1.0, -0.1),
            (1.0, 1.0, 1.5),
            (1.0, 1.0, f32::NAN),
        ] {
            let r = Sampler::new(SamplingParams {
                temperature: t,
                top_k: 0,
                top_p: p,
                min_p: m,
                seed: 0,
            });
            assert!(r.is_err(), "{t} {p} {m}");
        }
    }

    /// Min-p keeps the tokens whose probability is at least `min_p` of the largest, in
    /// proportion, on the paths without top-k (token order) and with it (by probability); it
    /// cuts before top-p, which then sees the remaining mass renormalized.
    #[test]
    fn min_p_keeps_the_tokens_near_the_top_and_cuts_before_top_p() {
        let mut rng = Rng::new(9);
        for n in [300usize, 20_000] {
            // Softmax probabilities at T = 1 whose ratios to the largest stay clear of 0.1.
            let logits: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 4 {
                    0 => 5.0 + (rng.next_f64() as f32),
                    1 => 4.0 + (rng.next_f64() as f32) * 0.5,
                    _ => (rng.next_f64() as f32) * 2.0,
                })
                .collect();
            let top = logits.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
            let ratio = |v: f32| f64::from(v - top).exp();
            let mut want: Vec<u32> = (0..n as u32)
                .filter(|&i| ratio(logits[i as usize]) >= 0.1)
                .collect();
            assert!(
                logits.iter().all(|&v| (ratio(v) - 0.1).abs() > 1e-3),
                "a token sits on the cut"
            );
            let kept: f64 = want.iter().map(|&i| ratio(logits[i as usize])).sum();
            for top_k in [0usize, n - 1] {
                let s = Sampler::new(SamplingParams {
                    temperature: 1.0,
                    top_k,
                    top_p: 1.0,
                    min_p: 0.1,
                    seed: 0,
                })
                .unwrap();
                let d = s.distribution(&logits);
                let mut got: Vec<u32> = d.iter().map(|c| c.0).collect();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "n {n} top-k {top_k}");
                for &(t, p) in &d {
                    let exact = ratio(logits[t as usize]) / kept;
                    assert!(
                        (f64::from(p) - exact).abs() < 1e-5,
                        "token {t}: {p} vs {exact}"
                    );
                }
            }
        }
        // Masses 0.4, 0.3, 0.2 and a tail of 0.1 below min-p 0.1 (each under 0.04): after the
        // cut 0.44, 0.33, 0.22, so top-p 0.75 keeps two; top-p first would keep three.
        let mut p = vec![0.4f64, 0.3, 0.2];
        p.extend(std::iter::repeat_n(0.1 / 50.0, 50));
        let logits: Vec<f32> = p.iter().map(|&x| x.ln() as f32).collect();
        for top_k in [0usize, 52] {
            let s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k,
                top_p: 0.75,
                min_p: 0.1,
                seed: 0,
            })
            .unwrap();
            let got: Vec<u32> = s.distribution(&logits).iter().map(|c| c.0).collect();
            assert_eq!(got, vec![0, 1], "top-k {top_k}");
        }
    }
}
