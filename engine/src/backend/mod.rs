//! Compute backends: one `Backend` trait; the CPU implementation is always built, CUDA behind a feature.

pub mod cpu;
pub mod cuda;
pub mod simd;

pub use cpu::{AmxUse, CpuBackend};

use half::f16;

use crate::error::Result;
use crate::kv::{BlockId, BLOCK_SLOTS};
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

/// One layer of a sequence's paged f16 K/V as attention reads it: the sequence's slot `s` is row
/// `blocks[s / BLOCK_SLOTS] * BLOCK_SLOTS + s % BLOCK_SLOTS` of `k` and of `v` (both
/// `[pool rows, kv_dim]`, the whole pool's layer; see `kv::KvPool`).
#[derive(Clone, Copy, Debug)]
pub struct KvLayer<'a> {
    pub k: &'a [f16],
    pub v: &'a [f16],
    pub blocks: &'a [BlockId],
}

impl KvLayer<'_> {
    /// The pool row holding the sequence's slot `slot`.
    #[inline]
    pub fn row(&self, slot: usize) -> usize {
        self.blocks[slot / BLOCK_SLOTS] as usize * BLOCK_SLOTS + slot % BLOCK_SLOTS
    }

    /// Slots (ascending, from `visible_slots`) to pool rows, in place.
    pub fn to_rows(&self, slots: &mut [usize]) {
        for s in slots {
            *s = self.row(*s);
        }
    }

    /// Whether slots `0..n_slots` of rows of `kv_dim` values are all inside `k` and `v`.
    pub fn covers(&self, n_slots: usize, kv_dim: usize) -> bool {
        let rows = self.k.len().min(self.v.len()) / kv_dim.max(1);
        n_slots <= self.blocks.len() * BLOCK_SLOTS
            && self.blocks[..n_slots.div_ceil(BLOCK_SLOTS)]
                .iter()
                .all(|&b| (b as usize + 1) * BLOCK_SLOTS <= rows)
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

/// One sequence's part of a batched attention call: rows `row0..row0 + shape.n_tok` of `q` and
/// `out` are its new tokens; they attend to its cache `kv` per `mask`.
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    pub shape: AttentionShape,
    pub mask: BatchMask<'a>,
    pub kv: KvLayer<'a>,
    pub row0: usize,
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

    /// Scaled dot-product attention of new tokens over slots `0..n_past + n_tok` of one layer of
    /// a sequence's paged cache. q: [n_tok, n_head * head_dim]; kv: rows of n_head_kv * head_dim
    /// f16 values; out like q.
    fn attention(
        &self,
        shape: AttentionShape,
        mask: BatchMask<'_>,
        q: &[f32],
        kv: KvLayer<'_>,
        out: &mut [f32],
    ) -> Result<()>;

    /// Attention of every sequence of a ragged batch (disjoint row ranges of q and out:
    /// `[n_rows, n_head * head_dim]`), each exactly as [`Backend::attention`] computes it alone.
    /// The default runs them in turn; a backend may run them together.
    fn attention_batch(&self, seqs: &[AttnSeq<'_>], q: &[f32], out: &mut [f32]) -> Result<()> {
        for sq in seqs {
            let w = sq.shape.n_head * sq.shape.head_dim;
            let rows = sq.row0 * w..(sq.row0 + sq.shape.n_tok) * w;
            if rows.end > q.len() || rows.end > out.len() {
                return Err(crate::EngineError::Shape(
                    "attention rows outside the batch".into(),
                ));
            }
            self.attention(sq.shape, sq.mask, &q[rows.clone()], sq.kv, &mut out[rows])?;
        }
        Ok(())
    }
}
