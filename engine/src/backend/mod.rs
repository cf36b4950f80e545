//! Compute backends: one `Backend` trait; the CPU implementation is always built, CUDA behind a feature.

pub mod cpu;
pub mod cuda;
pub mod simd;

pub use cpu::{AmxUse, CpuBackend};

use crate::error::Result;
use crate::quant::QMatrix;

/// Which earlier tokens of the batch each new token may attend to (the committed prefix is always visible).
#[derive(Clone, Copy, Debug)]
pub enum BatchMask<'a> {
    /// Token `t` sees new tokens `0..=t` (prefill, incremental decoding).
    Causal,
    /// Token `t` sees the new tokens `j` for which bit `j` of row `t` is set
    /// (row-major bitsets of `words_per_row` u64 words; tree attention).
    Bits {
        words_per_row: usize,
        bits: &'a [u64],
    },
    /// Tree attention over scratch slots already in the cache (a drafter expanding a token tree
    /// one depth per pass): slots before `base` are always visible; token `t` sees slot
    /// `base + j` (a scratch slot of an earlier pass or a new token) iff bit `j` of row `t` is set.
    Scratch {
        base: usize,
        words_per_row: usize,
        bits: &'a [u64],
    },
}

impl BatchMask<'_> {
    /// Whether new token `t` may attend to new token `j`.
    #[inline]
    pub fn visible(&self, t: usize, j: usize) -> bool {
        match *self {
            BatchMask::Causal => j <= t,
            BatchMask::Bits {
                words_per_row,
                bits,
            } => {
                let w = t * words_per_row + j / 64;
                bits.get(w).is_some_and(|word| (word >> (j % 64)) & 1 == 1)
            }
            BatchMask::Scratch { .. } => false,
        }
    }

    /// Whether new token `t` (at slot `n_past + t`) may attend to cache slot `slot`.
    #[inline]
    pub fn visible_slot(&self, t: usize, slot: usize, n_past: usize) -> bool {
        match *self {
            BatchMask::Scratch {
                base,
                words_per_row,
                bits,
            } => {
                if slot < base {
                    return true;
                }
                let j = slot - base;
                let w = t * words_per_row + j / 64;
                bits.get(w).is_some_and(|word| (word >> (j % 64)) & 1 == 1)
            }
            _ => slot < n_past || self.visible(t, slot - n_past),
        }
    }
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_tok: usize,
    pub n_past: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// The operations the forward pass needs from a device.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// Run `f` with this backend's worker threads available (one entry per forward pass).
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R;

    /// Like [`Backend::scope`], for batches whose results need not be bit-identical to
    /// single-token decoding (prompt prefill): the backend may use faster kernels that sum in
    /// another order (CPU: AMX tiles). Tree verification must use `scope`.
    fn scope_prefill<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.scope(f)
    }

    /// y[t, o] = sum_k W[o, k] x[t, k].  x: [n_tok, n_in], y: [n_tok, n_out].
    fn matmul(&self, w: &QMatrix, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()>;

    /// `matmul` into a new vector `[n_tok, n_out]` (backends may skip clearing it first).
    fn matmul_new(&self, w: &QMatrix, x: &[f32], n_tok: usize) -> Result<Vec<f32>> {
        let n = n_tok.checked_mul(w.n_out).ok_or_else(|| {
            crate::EngineError::Shape(format!("{n_tok} rows of {} outputs overflow", w.n_out))
        })?;
        let mut y = vec![0.0f32; n];
        self.matmul(w, x, n_tok, &mut y)?;
        Ok(y)
    }

    /// Several matmuls of the same input (e.g. Q, K and V): `outs[i] = ws[i] x`.
    /// Backends may run them concurrently; the default runs them in turn.
    fn matmul_many(
        &self,
        ws: &[QMatrix],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        for (w, y) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, n_tok, y)?;
        }
        Ok(())
    }

    /// SwiGLU's projections and gate: `gate = silu(W_gate x) · (W_up x)`, `up = W_up x`
    /// (x: [n_tok, n_in]; gate, up: [n_tok, n_out]). The default runs `matmul_many`, then
    /// [`simd::silu_mul`]; a backend may fuse them, with the same bits.
    fn matmul_swiglu(
        &self,
        w_gate: &QMatrix,
        w_up: &QMatrix,
        x: &[f32],
        n_tok: usize,
        gate: &mut [f32],
        up: &mut [f32],
    ) -> Result<()> {
        self.matmul_many(&[*w_gate, *w_up], x, n_tok, &mut [&mut *gate, &mut *up])?;
        simd::silu_mul(gate, up);
        Ok(())
    }

    /// Scaled dot-product attention of new tokens over slots `0..n_past + n_tok` of one layer.
    /// q: [n_tok, n_head * head_dim]; k, v: [slots, n_head_kv * head_dim]; out like q.
    fn attention(
        &self,
        shape: AttentionShape,
        mask: BatchMask<'_>,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
    ) -> Result<()>;
}
