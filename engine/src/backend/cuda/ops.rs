//! Device-neutral operations of the device forward pass: buffers the device owns and one method
//! per PTX kernel over them; [`HostOps`] computes on the host what each kernel computes, so the
//! device model's orchestration (plans, paged K/V, commits, tree verification) runs in every test
//! without a GPU, and [`CudaOps`](super::cuda_ops::CudaOps) launches the kernels.

use std::sync::{Mutex, MutexGuard};

use half::f16;

use arbor_kernels_gpu::plan::{AttentionPlan, KvCommitPlan};

use crate::error::{EngineError, Result};

/// What a device buffer may hold.
#[cfg(feature = "cuda")]
pub trait Elem:
    Copy + Default + Send + Sync + 'static + cust::memory::DeviceCopy + cust::memory::bytemuck::Pod
{
}
/// What a device buffer may hold.
#[cfg(not(feature = "cuda"))]
pub trait Elem: Copy + Default + Send + Sync + 'static {}

impl Elem for u16 {}
impl Elem for u32 {}
impl Elem for u64 {}
impl Elem for f32 {}

/// A plan's packed arrays on the device (see [`AttentionPlan`]).
pub struct PlanBufs<O: DeviceOps + ?Sized> {
    pub rows: O::Buf<u32>,
    pub seqs: O::Buf<u32>,
    pub blocks: O::Buf<u32>,
    pub mask: O::Buf<u64>,
}

impl<O: DeviceOps + ?Sized> PlanBufs<O> {
    pub fn upload(ops: &O, plan: &AttentionPlan) -> Result<PlanBufs<O>> {
        Ok(PlanBufs {
            rows: ops.upload(&plan.rows)?,
            seqs: ops.upload(&plan.seqs)?,
            blocks: ops.upload(&plan.blocks)?,
            mask: ops.upload(if plan.mask.is_empty() {
                &[0u64][..]
            } else {
                &plan.mask[..]
            })?,
        })
    }
}

/// The operations of the device forward pass. Buffers are written through shared references
/// (device memory is the device's, not Rust's); every call names its shapes, and f16 values travel
/// as their u16 bits. `k_off` / `v_off` are element offsets of a layer's K and V planes in the pool
/// (V's plane directly follows K's, as `DeviceModel` lays them out; the host reference relies on
/// it).
#[allow(clippy::too_many_arguments)]
pub trait DeviceOps: Send + Sync {
    type Buf<T: Elem>: Send + Sync;

    /// Make this device's context the calling thread's (CUDA contexts are per thread); called
    /// before each pass, so a model may be driven from any thread.
    fn activate(&self) -> Result<()> {
        Ok(())
    }

    fn upload<T: Elem>(&self, data: &[T]) -> Result<Self::Buf<T>>;
    fn zeroed<T: Elem>(&self, n: usize) -> Result<Self::Buf<T>>;
    /// Wait for the queued work, then copy `buf` (exactly `out.len()` elements) to the host.
    fn download<T: Elem>(&self, buf: &Self::Buf<T>, out: &mut [T]) -> Result<()>;
    /// Wait for the queued work.
    fn sync(&self) -> Result<()>;

    /// `out[r] = f32(table[tokens[r]])` (`embed_rows_f16`).
    fn embed_rows(
        &self,
        table: &Self::Buf<u16>,
        tokens: &Self::Buf<u32>,
        out: &Self::Buf<f32>,
        n_rows: usize,
        d: usize,
        vocab: usize,
    ) -> Result<()>;
    /// `out[r] = rms_norm(x[r]) * w` (`rms_norm_f32`).
    fn rms_norm(
        &self,
        x: &Self::Buf<f32>,
        w: &Self::Buf<f32>,
        out: &Self::Buf<f32>,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<()>;
    /// `y[t, o] = sum_k w[o, k] x[t, k]` (`matmul_f16`).
    fn matmul(
        &self,
        w: &Self::Buf<u16>,
        x: &Self::Buf<f32>,
        y: &Self::Buf<f32>,
        n_tok: usize,
        n_out: usize,
        n_in: usize,
    ) -> Result<()>;
    /// `x[r, i] += y[r * y_stride + i]` (`add_f32`).
    fn add(
        &self,
        x: &Self::Buf<f32>,
        y: &Self::Buf<f32>,
        n_rows: usize,
        width: usize,
        y_stride: usize,
    ) -> Result<()>;
    /// RoPE in place with cos/sin tables `[n_rows, half]` (`rope_f32`).
    fn rope(
        &self,
        x: &Self::Buf<f32>,
        cos: &Self::Buf<f32>,
        sin: &Self::Buf<f32>,
        n_rows: usize,
        n_heads: usize,
        hd: usize,
        half: usize,
        neox: bool,
    ) -> Result<()>;
    /// New K/V rows, rounded to f16, into pool rows `rows[r]` of one layer (`kv_write_f16`).
    fn kv_write(
        &self,
        pool: &Self::Buf<u16>,
        k_off: usize,
        v_off: usize,
        k_new: &Self::Buf<f32>,
        v_new: &Self::Buf<f32>,
        rows: &Self::Buf<u32>,
        n_rows: usize,
        kv_dim: usize,
    ) -> Result<()>;
    /// Attention of every row of `plan` over one layer of the pool (`tree_attention_f16`).
    fn attention(
        &self,
        plan: &AttentionPlan,
        bufs: &PlanBufs<Self>,
        q: &Self::Buf<f32>,
        pool: &Self::Buf<u16>,
        k_off: usize,
        v_off: usize,
        out: &Self::Buf<f32>,
    ) -> Result<()>;
    /// `gate = silu(gate) * up` (`silu_mul_f32`).
    fn silu_mul(&self, gate: &Self::Buf<f32>, up: &Self::Buf<f32>, n: usize) -> Result<()>;
    /// `out[i] = x[rows[i]]` (`gather_rows_f32`).
    fn gather_rows(
        &self,
        x: &Self::Buf<f32>,
        rows: &Self::Buf<u32>,
        out: &Self::Buf<f32>,
        n_out_rows: usize,
        width: usize,
    ) -> Result<()>;
    /// `out[r] = argmax(logits[r])`, the first index of the largest value (`argmax_f32`).
    fn argmax(
        &self,
        logits: &Self::Buf<f32>,
        out: &Self::Buf<u32>,
        n_rows: usize,
        vocab: usize,
    ) -> Result<()>;
    /// Pool rows `src[i] -> dst[i]`, in order, in every plane (`kv_copy_rows_f16`); returns once
    /// the rows are moved.
    fn kv_copy_rows(
        &self,
        pool: &Self::Buf<u16>,
        commit: &KvCommitPlan,
        n_planes: usize,
        pool_rows: usize,
        kv_dim: usize,
    ) -> Result<()>;
}

/// The kernels' computations on the host, buffer for buffer (the CPU reference of each kernel:
/// the same inputs, the same rounding points; sums in a plain order).
#[derive(Debug, Default)]
pub struct HostOps;

fn shape_err(what: &str) -> EngineError {
    EngineError::Shape(format!("device buffer too small for {what}"))
}

fn f16f(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// A host buffer's contents (a poisoned lock still holds whole values: every op writes whole
/// elements).
fn get<T>(b: &Mutex<Vec<T>>) -> MutexGuard<'_, Vec<T>> {
    b.lock().unwrap_or_else(|e| e.into_inner())
}

impl DeviceOps for HostOps {
    type Buf<T: Elem> = Mutex<Vec<T>>;

    fn upload<T: Elem>(&self, data: &[T]) -> Result<Mutex<Vec<T>>> {
        Ok(Mutex::new(data.to_vec()))
    }

    fn zeroed<T: Elem>(&self, n: usize) -> Result<Mutex<Vec<T>>> {
        Ok(Mutex::new(vec![T::default(); n.max(1)]))
    }

    fn download<T: Elem>(&self, buf: &Mutex<Vec<T>>, out: &mut [T]) -> Result<()> {
        let b = get(buf);
        let src = b.get(..out.len()).ok_or_else(|| shape_err("download"))?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn embed_rows(
        &self,
        table: &Mutex<Vec<u16>>,
        tokens: &Mutex<Vec<u32>>,
        out: &Mutex<Vec<f32>>,
        n_rows: usize,
        d: usize,
        vocab: usize,
    ) -> Result<()> {
        let (table, tokens, mut out) = (get(table), get(tokens), get(out));
        for r in 0..n_rows {
            let t = tokens[r] as usize;
            for i in 0..d {
                out[r * d + i] = if t < vocab {
                    f16f(table[t * d + i])
                } else {
                    0.0
                };
            }
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &Mutex<Vec<f32>>,
        w: &Mutex<Vec<f32>>,
        out: &Mutex<Vec<f32>>,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<()> {
        let (x, w, mut out) = (get(x), get(w), get(out));
        for r in 0..n_rows {
            let row = &x[r * n_cols..(r + 1) * n_cols];
            let ss = row.iter().fold(0.0f32, |a, &v| v.mul_add(v, a));
            let scale = 1.0 / (ss / n_cols as f32 + eps).sqrt();
            for i in 0..n_cols {
                out[r * n_cols + i] = row[i] * scale * w[i];
            }
        }
        Ok(())
    }

    fn matmul(
        &self,
        w: &Mutex<Vec<u16>>,
        x: &Mutex<Vec<f32>>,
        y: &Mutex<Vec<f32>>,
        n_tok: usize,
        n_out: usize,
        n_in: usize,
    ) -> Result<()> {
        let (w, x, mut y) = (get(w), get(x), get(y));
        if w.len() < n_out * n_in || x.len() < n_tok * n_in || y.len() < n_tok * n_out {
            return Err(shape_err("matmul"));
        }
        for o in 0..n_out {
            let wr: Vec<f32> = w[o * n_in..(o + 1) * n_in]
                .iter()
                .map(|&b| f16f(b))
                .collect();
            for t in 0..n_tok {
                let xr = &x[t * n_in..(t + 1) * n_in];
                y[t * n_out + o] = wr.iter().zip(xr).fold(0.0f32, |a, (p, q)| p.mul_add(*q, a));
            }
        }
        Ok(())
    }

    fn add(
        &self,
        x: &Mutex<Vec<f32>>,
        y: &Mutex<Vec<f32>>,
        n_rows: usize,
        width: usize,
        y_stride: usize,
    ) -> Result<()> {
        let (mut x, y) = (get(x), get(y));
        for r in 0..n_rows {
            for i in 0..width {
                x[r * width + i] += y[r * y_stride + i];
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &Mutex<Vec<f32>>,
        cos: &Mutex<Vec<f32>>,
        sin: &Mutex<Vec<f32>>,
        n_rows: usize,
        n_heads: usize,
        hd: usize,
        half: usize,
        neox: bool,
    ) -> Result<()> {
        let (mut x, cos, sin) = (get(x), get(cos), get(sin));
        for r in 0..n_rows {
            for h in 0..n_heads {
                for i in 0..half {
                    let base = r * n_heads * hd + h * hd;
                    let (a, b) = if neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (c, s) = (cos[r * half + i], sin[r * half + i]);
                    let (x0, x1) = (x[base + a], x[base + b]);
                    x[base + a] = x0 * c - x1 * s;
                    x[base + b] = x0 * s + x1 * c;
                }
            }
        }
        Ok(())
    }

    fn kv_write(
        &self,
        pool: &Mutex<Vec<u16>>,
        k_off: usize,
        v_off: usize,
        k_new: &Mutex<Vec<f32>>,
        v_new: &Mutex<Vec<f32>>,
        rows: &Mutex<Vec<u32>>,
        n_rows: usize,
        kv_dim: usize,
    ) -> Result<()> {
        let (mut pool, k_new, v_new, rows) = (get(pool), get(k_new), get(v_new), get(rows));
        for r in 0..n_rows {
            let at = rows[r] as usize * kv_dim;
            for i in 0..kv_dim {
                pool[k_off + at + i] = f16::from_f32(k_new[r * kv_dim + i]).to_bits();
                pool[v_off + at + i] = f16::from_f32(v_new[r * kv_dim + i]).to_bits();
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        plan: &AttentionPlan,
        _bufs: &PlanBufs<Self>,
        q: &Mutex<Vec<f32>>,
        pool: &Mutex<Vec<u16>>,
        k_off: usize,
        v_off: usize,
        out: &Mutex<Vec<f32>>,
    ) -> Result<()> {
        let pool = get(pool);
        let plane = v_off.abs_diff(k_off);
        let as_f32 =
            |off: usize| -> Vec<f32> { pool[off..off + plane].iter().map(|&b| f16f(b)).collect() };
        let (k, v) = (as_f32(k_off), as_f32(v_off));
        let width = plan.n_head * plan.head_dim;
        let q = get(q);
        let res = plan.reference(&q[..plan.n_rows() * width], &k, &v);
        get(out)[..res.len()].copy_from_slice(&res);
        Ok(())
    }

    fn silu_mul(&self, gate: &Mutex<Vec<f32>>, up: &Mutex<Vec<f32>>, n: usize) -> Result<()> {
        let (mut g, u) = (get(gate), get(up));
        for i in 0..n {
            g[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
        }
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &Mutex<Vec<f32>>,
        rows: &Mutex<Vec<u32>>,
        out: &Mutex<Vec<f32>>,
        n_out_rows: usize,
        width: usize,
    ) -> Result<()> {
        let (x, rows, mut out) = (get(x), get(rows), get(out));
        for i in 0..n_out_rows {
            let r = rows[i] as usize;
            out[i * width..(i + 1) * width].copy_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(())
    }

    fn argmax(
        &self,
        logits: &Mutex<Vec<f32>>,
        out: &Mutex<Vec<u32>>,
        n_rows: usize,
        vocab: usize,
    ) -> Result<()> {
        let (l, mut out) = (get(logits), get(out));
        for r in 0..n_rows {
            out[r] = crate::sample::argmax(&l[r * vocab..(r + 1) * vocab]);
        }
        Ok(())
    }

    fn kv_copy_rows(
        &self,
        pool: &Mutex<Vec<u16>>,
        commit: &KvCommitPlan,
        n_planes: usize,
        pool_rows: usize,
        kv_dim: usize,
    ) -> Result<()> {
        let mut pool = get(pool);
        for plane in pool.chunks_exact_mut(pool_rows * kv_dim).take(n_planes) {
            commit.apply(plane, kv_dim);
        }
        Ok(())
    }
}
