//! CPU backend: quantized SIMD matmuls (quant module) and attention, multi-threaded on a rayon pool.

use rayon::prelude::*;

use super::simd;
use super::{AttentionShape, Backend, BatchMask};
use crate::error::{EngineError, Result};
use crate::quant::{self, QMatrix};

/// Cache slots per attention block: their K (or V) rows stay in L1 while every head of a group
/// reads them (32 rows of 128 f32 = 16 KiB).
const SLOT_BLOCK: usize = 32;
/// Most query heads per KV head that one attention task takes together.
const MAX_GROUP: usize = 16;

/// Where the CPU backend runs the AMX kernel family (`quant::with_amx`; only where the CPU and
/// OS grant AMX, and only for the weight types it covers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxUse {
    /// Never: every matmul on the VNNI kernels.
    Never,
    /// Prompt prefill only (the default): decoding and tree verification stay on the VNNI
    /// kernels, so they are bit-identical to each other, while prefill sums in the AMX order.
    Prefill,
    /// Every forward pass: prefill, decoding and verification all in the AMX order (tiles for 8+
    /// rows, the AMX-order VNNI kernel below), bit-identical to each other. Verification of wide
    /// trees is cheaper, single-token decoding somewhat slower (see docs/benchmarks.md).
    Always,
}

/// The CPU backend owns its worker pool; `threads` = 0 means one per core.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    /// Where the AMX kernels run (see [`Backend::scope_prefill`]).
    amx: AmxUse,
}

impl CpuBackend {
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("arbor-cpu-{i}"))
            .build()
            .map_err(|e| {
                EngineError::InvalidArgument(format!("cannot start {threads} threads: {e}"))
            })?;
        Ok(CpuBackend {
            pool,
            amx: AmxUse::Prefill,
        })
    }

    /// Never use AMX tiles, not even in prompt prefill: every batch is then computed bit for bit
    /// as single-token decoding computes it (the VNNI kernels give the same result for any
    /// number of rows).
    pub fn bit_exact(self) -> CpuBackend {
        self.with_amx_use(AmxUse::Never)
    }

    /// Chooses where the AMX kernels run (`AmxUse`). `ARBOR_KERNEL=amx` in the environment
    /// means `Always` for every backend, `ARBOR_KERNEL=avx512` (or lower) `Never`.
    pub fn with_amx_use(mut self, amx: AmxUse) -> CpuBackend {
        self.amx = amx;
        self
    }

    pub fn amx_use(&self) -> AmxUse {
        self.amx
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.amx {
            AmxUse::Always => self.pool.install(|| quant::with_amx_family(f)),
            _ => self.pool.install(f),
        }
    }

    fn scope_prefill<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.amx {
            AmxUse::Never => self.pool.install(f),
            AmxUse::Prefill => self.pool.install(|| quant::with_amx(f)),
            AmxUse::Always => self.pool.install(|| quant::with_amx_family(f)),
        }
    }

    fn matmul(&self, w: &QMatrix, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()> {
        quant::matmul(w, x, n_tok, y)
    }

    fn matmul_many(
        &self,
        ws: &[QMatrix],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        // Decode-sized batches: one parallel region for all of them, so the worker threads wake
        // once per group instead of once per matrix (the wake-ups dominated small matmuls).
        // Larger batches are compute-bound and keep each matmul's own row split.
        if n_tok > 4 {
            for (w, y) in ws.iter().zip(outs.iter_mut()) {
                quant::matmul(w, x, n_tok, y)?;
            }
            return Ok(());
        }
        // The jobs may run on other threads of the pool: carry this thread's AMX scope to them.
        let amx = quant::amx_scope();
        ws.par_iter()
            .zip(outs.par_iter_mut())
            .try_for_each(|(w, y)| quant::matmul_in(amx, w, x, n_tok, y))
    }

    fn attention(
        &self,
        s: AttentionShape,
        mask: BatchMask<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let hd = s.head_dim;
        let kv_dim = s.n_head_kv * hd;
        let group = s.n_head / s.n_head_kv;
        let n_slots = s.n_past + s.n_tok;
        if q.len() != s.n_tok * s.n_head * hd
            || out.len() != q.len()
            || k.len() < n_slots * kv_dim
            || v.len() < n_slots * kv_dim
        {
            return Err(EngineError::Shape(
                "attention buffers do not match shape".into(),
            ));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        // One task per (token, KV head, `gs` query heads of its group): the heads of a group read
        // the same K and V rows, so slots go in blocks of `SLOT_BLOCK` and each block's rows are
        // read from L2 once for all `gs` heads. Small batches (decoding) keep one head per task so
        // every thread has work. Every head's sums run in the same order either way.
        let gs = if s.n_tok * s.n_head_kv >= 8 && group <= MAX_GROUP {
            group
        } else {
            1
        };
        out.par_chunks_mut(gs * hd).enumerate().for_each_init(
            || {
                (
                    Vec::<f32>::new(),
                    Vec::<usize>::new(),
                    vec![0.0f32; gs * hd],
                    Vec::<f32>::new(),
                )
            },
            |(scores, slots, qg, tmp), (idx, o)| {
                let (t, h0) = (idx * gs / s.n_head, idx * gs % s.n_head);
                let kvh = h0 / group;
                // Q at f16 precision, like the K it meets (llama.cpp's K·Q runs in f16).
                let q0 = (t * s.n_head + h0) * hd;
                qg.copy_from_slice(&q[q0..q0 + gs * hd]);
                simd::round_f16_slice(qg);
                slots.clear();
                if let BatchMask::Causal = mask {
                    slots.extend(0..s.n_past + t + 1);
                } else if let BatchMask::Scratch { base, .. } = mask {
                    let base = base.min(s.n_past);
                    slots.extend(0..base);
                    slots.extend((base..n_slots).filter(|&j| mask.visible_slot(t, j, s.n_past)));
                } else {
                    slots.extend(0..s.n_past);
                    slots.extend(
                        (0..s.n_tok)
                            .filter(|&j| mask.visible(t, j))
                            .map(|j| s.n_past + j),
                    );
                }
                let n = slots.len();
                // [gs, n] scores, then weights.
                scores.clear();
                scores.resize(gs * n, 0.0);
                let mut maxes = [f32::NEG_INFINITY; MAX_GROUP];
                let maxes = &mut maxes[..gs];
                for b0 in (0..n).step_by(SLOT_BLOCK) {
                    let b1 = (b0 + SLOT_BLOCK).min(n);
                    for (g, m) in maxes.iter_mut().enumerate() {
                        let qh = &qg[g * hd..(g + 1) * hd];
                        let bm =
                            simd::attn_scores(qh, k, &slots[b0..b1], kv_dim, kvh * hd, scale, tmp);
                        scores[g * n + b0..g * n + b1].copy_from_slice(tmp);
                        *m = m.max(bm);
                    }
                }
                for (g, &max) in maxes.iter().enumerate() {
                    let sg = &mut scores[g * n..(g + 1) * n];
                    let mut sum = 0.0f32;
                    for sc in sg.iter_mut() {
                        *sc = (*sc - max).exp();
                        sum += *sc;
                    }
                    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                    for sc in sg.iter_mut() {
                        *sc *= inv;
                    }
                    // Attention weights at f16 precision (llama.cpp multiplies them with V in f16).
                    simd::round_f16_slice(sg);
                }
                o.fill(0.0);
                for b0 in (0..n).step_by(SLOT_BLOCK) {
                    let b1 = (b0 + SLOT_BLOCK).min(n);
                    for g in 0..maxes.len() {
                        let p = &scores[g * n + b0..g * n + b1];
                        let og = &mut o[g * hd..(g + 1) * hd];
                        simd::attn_weighted_sum(p, v, &slots[b0..b1], kv_dim, kvh * hd, og);
                    }
                }
            },
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) (SplitMix64).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Grouped-query attention (query heads of a group in one task, slots in blocks) gives every
    /// head exactly the bits of one head per task: the same call with each KV head copied out to
    /// its query heads (no groups), for causal and tree masks, AVX-512 and portable head sizes;
    /// and within f16 rounding of an f64 reference (a lost slot block or KV head shows there).
    #[test]
    fn grouped_attention_bit_identical_per_head_and_equal_to_reference() {
        let backend = CpuBackend::new(2).expect("backend");
        let (n_head, n_kv, n_past, n_tok) = (6usize, 2usize, 45usize, 8usize);
        let group = n_head / n_kv;
        let n_slots = n_past + n_tok;
        // Tree: token t sees itself and the earlier tokens j with j % 3 != 1.
        let bits: Vec<u64> = (0..n_tok)
            .map(|t| {
                (0..=t)
                    .filter(|&j| j == t || j % 3 != 1)
                    .map(|j| 1u64 << j)
                    .sum()
            })
            .collect();
        let masks = [
            BatchMask::Causal,
            BatchMask::Bits {
                words_per_row: 1,
                bits: &bits,
            },
        ];
        for hd in [64usize, 48] {
            let q = values(n_tok * n_head * hd, 1);
            let k = values(n_slots * n_kv * hd, 2);
            let v = values(n_slots * n_kv * hd, 3);
            // K and V with KV head `h / group` copied to every query head `h`.
            let expand = |x: &[f32]| -> Vec<f32> {
                let mut e = Vec::with_capacity(n_slots * n_head * hd);
                for s in 0..n_slots {
                    for h in 0..n_head {
                        let src = (s * n_kv + h / group) * hd;
                        e.extend_from_slice(&x[src..src + hd]);
                    }
                }
                e
            };
            let (kx, vx) = (expand(&k), expand(&v));
            for mask in masks {
                let shape = |n_head_kv| AttentionShape {
                    n_tok,
                    n_past,
                    n_head,
                    n_head_kv,
                    head_dim: hd,
                };
                let mut grouped = vec![0f32; q.len()];
                let mut single = vec![0f32; q.len()];
                backend
                    .attention(shape(n_kv), mask, &q, &k, &v, &mut grouped)
                    .expect("grouped");
                backend
                    .attention(shape(n_head), mask, &q, &kx, &vx, &mut single)
                    .expect("single");
                let gb: Vec<u32> = grouped.iter().map(|x| x.to_bits()).collect();
                let sb: Vec<u32> = single.iter().map(|x| x.to_bits()).collect();
                assert_eq!(gb, sb, "hd {hd} mask {mask:?}");
                // And both are attention: an f64 reference (Q and the weights at f16, as above).
                let f16 = |x: f64| half::f16::from_f64(x).to_f64();
                for t in 0..n_tok {
                    let seen: Vec<usize> = (0..n_slots)
                        .filter(|&j| j < n_past || mask.visible(t, j - n_past))
                        .collect();
                    for h in 0..n_head {
                        let qh = &q[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
                        let row =
                            |x: &[f32], s: usize, d: usize| x[(s * n_kv + h / group) * hd + d];
                        let sc: Vec<f64> = seen
                            .iter()
                            .map(|&s| {
                                (0..hd)
                                    .map(|d| f16(qh[d] as f64) * row(&k, s, d) as f64)
                                    .sum::<f64>()
                                    / (hd as f64).sqrt()
                            })
                            .collect();
                        let max = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
                        let sum: f64 = e.iter().sum();
                        for d in 0..hd {
                            let r: f64 = seen
                                .iter()
                                .zip(&e)
                                .map(|(&s, w)| f16(w / sum) * row(&v, s, d) as f64)
                                .sum();
                            let got = grouped[(t * n_head + h) * hd + d] as f64;
                            assert!(
                                (got - r).abs() < 3e-3,
                                "hd {hd} t {t} h {h} d {d}: {got} vs {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}
