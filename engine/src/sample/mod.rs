//! Token sampling: greedy, temperature, top-k, top-p (nucleus), with a seeded deterministic RNG.

pub mod verify;

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
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
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

/// Index of the largest logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// The largest value that is not NaN (`-inf` when none): eight running maxima, so the loop
/// vectorizes (the maximum is exact in any order).
fn max_ignoring_nan(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x); // `max` ignores a NaN operand
        }
    }
    tail.iter()
        .chain(&acc)
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x))
}

/// The untruncated distribution: softmax of `(logits - shift) / temperature` over the tokens
/// whose logit is not NaN, in token order — bit for bit what the general path of
/// [`Sampler::distribution`] computes (the same operations per token, the f64 sum in token
/// order), in passes over plain arrays that vectorize instead of one pass over (token, value)
/// pairs: this runs for every sampled row, and over a 49k-150k vocabulary it cost a decoding
/// step of a small model a quarter of its time. A maximum that is not finite gives greedy's
/// point mass, as there.
fn softmax_in_token_order(logits: &[f32], shift: f32, temperature: f32) -> Vec<(u32, f32)> {
    // [vocab] the scaled logits (NaN where the logit is; those tokens are left out below).
    let mut x: Vec<f32> = logits.iter().map(|&v| (v - shift) / temperature).collect();
    let max = max_ignoring_nan(&x);
    if !max.is_finite() {
        return vec![(argmax(logits), 1.0)];
    }
    exp_shifted(&mut x, max);
    let kept = |i: usize| !logits[i].is_nan();
    // In token order, in a register (a sum whose address a closure takes lives in memory, a
    // store and a load per token).
    let sum = x
        .iter()
        .enumerate()
        .filter(|&(i, _)| kept(i))
        .fold(0.0f64, |s, (_, &v)| s + v as f64);
    for v in x.iter_mut() {
        *v = (*v as f64 / sum) as f32;
    }
    let mut out = Vec::with_capacity(x.len());
    out.extend(
        x.iter()
            .enumerate()
            .filter(|&(i, _)| kept(i))
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
    for v in x.iter_mut() {
        if *v < f32::MIN_POSITIVE {
            *v = 0.0;
        }
    }
}

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
        let p = &self.params;
        if p.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        // A temperature so small that `logit / t` overflows (t = 1e-40 is a valid f32) would
        // make the softmax `inf - inf`: there the logits are shifted by their maximum first
        // (the same distribution; other temperatures keep the unshifted, bit-stable form).
        let top = max_ignoring_nan(logits);
        let shift = if top.is_finite() && !(top / p.temperature).is_finite() {
            top
        } else {
            0.0
        };
        if (p.top_k == 0 || p.top_k >= logits.len()) && p.top_p >= 1.0 {
            return softmax_in_token_order(logits, shift, p.temperature);
        }
        // Sized once (a filtered iterator's `collect` grows the vector by doubling: ~8 copies
        // of a 150k-token vocabulary's pairs per sampled row).
        let mut cand: Vec<(u32, f32)> = Vec::with_capacity(logits.len());
        cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (i as u32, (v - shift) / p.temperature)),
        );
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cand.len() {
            // The same k tokens a full sort would keep (a total order), in O(V + k log k).
            cand.select_nth_unstable_by(p.top_k - 1, by_prob);
            cand.truncate(p.top_k);
            cand.sort_by(by_prob);
        } else if p.top_p < 1.0 {
            cand.sort_by(by_prob);
        }
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            // A +inf logit (the softmax would be `inf - inf` = NaN everywhere) or no finite one:
            // greedy's choice, the first +inf (or 0), as a point mass, so plain sampling and
            // tree verification agree.
            return vec![(argmax(logits), 1.0)];
        }
        let mut e: Vec<f32> = cand.iter().map(|c| c.1).collect();
        exp_shifted(&mut e, max);
        let mut sum = 0.0f64;
        for (c, e) in cand.iter_mut().zip(e) {
            c.1 = e;
            sum += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        if p.top_p < 1.0 {
            // In f64: over a vocabulary of 150 k, an f32 running sum drops tail tokens below
            // half its ulp and the cut lands early or late.
            let mut acc = 0.0f64;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += f64::from(c.1);
                if acc >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
            let s: f64 = cand.iter().map(|c| f64::from(c.1)).sum();
            for c in cand.iter_mut() {
                c.1 = (f64::from(c.1) / s) as f32;
            }
        }
        cand
    }

    /// Draw the next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        self.draw(&dist)
    }

    /// Draw from an explicit sparse distribution (probabilities summing to ~1).
    pub fn draw(&mut self, dist: &[(u32, f32)]) -> u32 {
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
            seed: 1,
        })
        .unwrap();
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![4, 3]);
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
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

    #[test]
    fn same_seed_same_stream() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
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
        for (t, p) in [(-1.0, 1.0), (f32::NAN, 1.0), (1.0, 0.0), (1.0, 1.5)] {
            let r = Sampler::new(SamplingParams {
                temperature: t,
                top_k: 0,
                top_p: p,
                seed: 0,
            });
            assert!(r.is_err());
        }
    }
}
