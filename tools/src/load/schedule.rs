//! Seeded request arrivals for open-loop load: gamma-distributed gaps (shape = burstiness, mean = 1/rate), as vLLM's `bench serve` draws them; burstiness 1 is a Poisson process.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};

use super::LoadError;

/// Arrival offsets in seconds from the start of a run, reproducible from a seed.
pub struct ArrivalSchedule {
    rng: StdRng,
    gamma: Gamma<f64>,
    t: f64,
}

impl ArrivalSchedule {
    /// `rate` requests per second on average; `burstiness` B > 0 gives gaps of mean 1/rate and
    /// variance 1/(rate² B): below 1 burstier than Poisson, above 1 more even.
    pub fn new(rate: f64, burstiness: f64, seed: u64) -> Result<Self, LoadError> {
        if !(rate.is_finite() && rate > 0.0) {
            return Err(LoadError::Invalid(format!(
                "--rate must be a positive number, got {rate}"
            )));
        }
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(LoadError::Invalid(format!(
                "--burstiness must be a positive number, got {burstiness}"
            )));
        }
        let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness))
            .map_err(|e| LoadError::Invalid(format!("gamma distribution: {e}")))?;
        Ok(ArrivalSchedule {
            rng: StdRng::seed_from_u64(seed ^ 0xa11_0ad),
            gamma,
            t: 0.0,
        })
    }

    /// The next gap in seconds (does not advance the clock).
    pub fn next_gap(&mut self) -> f64 {
        self.gamma.sample(&mut self.rng)
    }

    /// The next arrival offset in seconds.
    pub fn next_arrival(&mut self) -> f64 {
        let gap = self.next_gap();
        self.t += gap;
        self.t
    }
}

/// The seeded stream that picks prompts and output lengths, independent of the arrivals.
pub fn choice_rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15)
}

/// Uniform integer in `[lo, hi]`.
pub fn uniform(rng: &mut StdRng, lo: usize, hi: usize) -> usize {
    if hi <= lo {
        lo
    } else {
        rng.gen_range(lo..=hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(rate: f64, b: f64, seed: u64, n: usize) -> (f64, f64) {
        let mut s = ArrivalSchedule::new(rate, b, seed).unwrap();
        let gaps: Vec<f64> = (0..n).map(|_| s.next_gap()).collect();
        let mean = gaps.iter().sum::<f64>() / n as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        (mean, var)
    }

    #[test]
    fn mean_gap_is_one_over_rate_and_variance_follows_burstiness() {
        let n = 2000;
        for (rate, b) in [(4.0, 0.5), (4.0, 1.0), (4.0, 2.0), (0.5, 1.0)] {
            let (mean, var) = moments(rate, b, 7, n);
            assert!(
                (mean * rate - 1.0).abs() < 0.10,
                "rate {rate} B {b}: mean gap {mean} vs {}",
                1.0 / rate
            );
            // Gamma(k = B): variance 1/(rate² B). The sample variance over n gaps has relative
            // standard deviation sqrt((kurtosis - 1) / n) with kurtosis 3 + 6/B; allow 3.5 of them.
            let want = 1.0 / (rate * rate * b);
            let rel_sd = ((2.0 + 6.0 / b) / n as f64).sqrt();
            assert!(
                (var / want - 1.0).abs() < 3.5 * rel_sd,
                "rate {rate} B {b}: variance {var} vs {want} (tolerance {:.3})",
                3.5 * rel_sd
            );
        }
        // Burstiness orders the spread.
        let v: Vec<f64> = [0.5, 1.0, 2.0]
            .iter()
            .map(|&b| moments(2.0, b, 3, n).1)
            .collect();
        assert!(v[0] > v[1] && v[1] > v[2], "{v:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_arrivals() {
        let a: Vec<f64> = {
            let mut s = ArrivalSchedule::new(2.0, 1.0, 11).unwrap();
            (0..50).map(|_| s.next_arrival()).collect()
        };
        let mut s = ArrivalSchedule::new(2.0, 1.0, 11).unwrap();
        let b: Vec<f64> = (0..50).map(|_| s.next_arrival()).collect();
        assert_eq!(a, b);
        let mut s = ArrivalSchedule::new(2.0, 1.0, 12).unwrap();
        let c: Vec<f64> = (0..50).map(|_| s.next_arrival()).collect();
        assert_ne!(a, c);
        assert!(a.windows(2).all(|w| w[1] > w[0]));
    }

    #[test]
    fn bad_rates_are_refused() {
        assert!(ArrivalSchedule::new(0.0, 1.0, 1).is_err());
        assert!(ArrivalSchedule::new(1.0, -1.0, 1).is_err());
        assert!(ArrivalSchedule::new(f64::NAN, 1.0, 1).is_err());
    }
}
