//! CPU backend: quantized SIMD matmuls (quant module) and attention, multi-threaded on a rayon pool.

use rayon::prelude::*;

use super::simd;
use super::{AttentionShape, Backend, BatchMask};
use crate::error::{EngineError, Result};
use crate::quant::{self, QMatrix};

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
        // One task per (token, head): out[t, h, :] = softmax(q·K^T * scale) V over visible slots.
        out.par_chunks_mut(hd).enumerate().for_each_init(
            || (Vec::<f32>::new(), Vec::<usize>::new(), vec![0.0f32; hd]),
            |(scores, slots, qh), (idx, o)| {
                let (t, h) = (idx / s.n_head, idx % s.n_head);
                let kvh = h / group;
                // Q at f16 precision, like the K it meets (llama.cpp's K·Q runs in f16).
                qh.copy_from_slice(&q[idx * hd..(idx + 1) * hd]);
                simd::round_f16_slice(qh);
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
                let max = simd::attn_scores(qh, k, slots, kv_dim, kvh * hd, scale, scores);
                let mut sum = 0.0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
                for sc in scores.iter_mut() {
                    *sc *= inv;
                }
                // Attention weights at f16 precision (llama.cpp multiplies them with V in f16).
                simd::round_f16_slice(scores);
                simd::attn_weighted_sum(scores, v, slots, kv_dim, kvh * hd, o);
            },
        );
        Ok(())
    }
}
