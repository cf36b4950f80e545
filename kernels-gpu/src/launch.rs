//! cust launch wrappers for the embedded PTX kernels: modules loaded on first use and cached, one
//! typed function per kernel whose arguments follow the kernel's parameter list exactly.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cust::memory::{DeviceCopy, DevicePointer};
use cust::module::Module;
use cust::stream::Stream;

use crate::plan::{self, AttentionPlan, LaunchDims};
use crate::{module_source, KernelError};

impl From<cust::error::CudaError> for KernelError {
    fn from(e: cust::error::CudaError) -> Self {
        KernelError::Cuda(e.to_string())
    }
}

/// A device pointer to `T` (f16 values travel as their u16 bits).
pub type Ptr<T> = DevicePointer<T>;

/// The address of one kernel argument, as `cuLaunchKernel` takes it.
fn arg<T: DeviceCopy>(v: &T) -> *mut c_void {
    v as *const T as *mut c_void
}

fn u32_of(n: usize, what: &str) -> Result<u32, KernelError> {
    u32::try_from(n).map_err(|_| KernelError::InvalidPlan(format!("{what} = {n} over u32")))
}

/// The kernel modules of one CUDA context, loaded from the embedded PTX on first use.
#[derive(Default)]
pub struct Kernels {
    modules: Mutex<HashMap<&'static str, Arc<Module>>>,
}

impl Kernels {
    pub fn new() -> Kernels {
        Kernels::default()
    }

    fn module(&self, name: &'static str) -> Result<Arc<Module>, KernelError> {
        let mut m = self
            .modules
            .lock()
            .map_err(|_| KernelError::Cuda("kernel cache lock poisoned".into()))?;
        if let Some(module) = m.get(name) {
            return Ok(module.clone());
        }
        let module = Arc::new(Module::from_ptx(module_source(name)?, &[])?);
        m.insert(name, module.clone());
        Ok(module)
    }

    /// Load every embedded module now (so a driver that rejects one fails at start, not mid-request).
    pub fn load_all(&self) -> Result<(), KernelError> {
        for (name, _) in crate::MODULES {
            self.module(name)?;
        }
        Ok(())
    }

    /// Launch `name` (module and entry share the name) with `args`, each the address of a value
    /// whose type matches the entry's parameter at that position.
    fn launch(
        &self,
        stream: &Stream,
        name: &'static str,
        dims: LaunchDims,
        args: &[*mut c_void],
    ) -> Result<(), KernelError> {
        let module = self.module(name)?;
        let f = module.get_function(name)?;
        // SAFETY: every wrapper below passes one argument per PTX parameter, in order, with the
        // parameter's type (u64 pointers, u32, f32), and buffers sized as the kernel's header says.
        unsafe { stream.launch(&f, dims.grid, dims.block, 0, args)? };
        Ok(())
    }

    /// `out[r] = table[tokens[r]]` as f32 (`table`: `[vocab, d]` f16).
    #[allow(clippy::too_many_arguments)]
    pub fn embed_rows_f16(
        &self,
        s: &Stream,
        table: Ptr<u16>,
        tokens: Ptr<u32>,
        out: Ptr<f32>,
        n_rows: usize,
        d: usize,
        vocab: usize,
    ) -> Result<(), KernelError> {
        let (d, vocab) = (u32_of(d, "d")?, u32_of(vocab, "vocab")?);
        let dims = plan::per_row(n_rows, 256)?;
        self.launch(
            s,
            "embed_rows_f16",
            dims,
            &[arg(&table), arg(&tokens), arg(&out), arg(&d), arg(&vocab)],
        )
    }

    /// `out[r] = rms_norm(x[r]) * w` over `n_rows` rows of `n_cols`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_f32(
        &self,
        s: &Stream,
        x: Ptr<f32>,
        w: Ptr<f32>,
        out: Ptr<f32>,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        let n_cols = u32_of(n_cols, "n_cols")?;
        self.launch(
            s,
            "rms_norm_f32",
            plan::per_row(n_rows, 256)?,
            &[arg(&x), arg(&w), arg(&out), arg(&n_cols), arg(&eps)],
        )
    }

    /// `y[t, o] = sum_k w[o, k] x[t, k]` (`w`: `[n_out, n_in]` f16).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_f16(
        &self,
        s: &Stream,
        w: Ptr<u16>,
        x: Ptr<f32>,
        y: Ptr<f32>,
        n_tok: usize,
        n_out: usize,
        n_in: usize,
    ) -> Result<(), KernelError> {
        let dims = plan::matmul(n_out, n_in)?;
        let (n_in, n_out, n_tok) = (
            u32_of(n_in, "n_in")?,
            u32_of(n_out, "n_out")?,
            u32_of(n_tok, "n_tok")?,
        );
        self.launch(
            s,
            "matmul_f16",
            dims,
            &[
                arg(&w),
                arg(&x),
                arg(&y),
                arg(&n_in),
                arg(&n_out),
                arg(&n_tok),
            ],
        )
    }

    /// `x[r, i] += y[r * y_stride + i]` (`y_stride` = `width`: residual; 0: bias row).
    pub fn add_f32(
        &self,
        s: &Stream,
        x: Ptr<f32>,
        y: Ptr<f32>,
        n_rows: usize,
        width: usize,
        y_stride: usize,
    ) -> Result<(), KernelError> {
        let (width, y_stride) = (u32_of(width, "width")?, u32_of(y_stride, "y_stride")?);
        self.launch(
            s,
            "add_f32",
            plan::per_row(n_rows, 256)?,
            &[arg(&x), arg(&y), arg(&width), arg(&y_stride)],
        )
    }

    /// RoPE in place with host-computed `cos`/`sin` tables `[n_rows, half]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_f32(
        &self,
        s: &Stream,
        x: Ptr<f32>,
        cos: Ptr<f32>,
        sin: Ptr<f32>,
        n_rows: usize,
        n_heads: usize,
        hd: usize,
        half: usize,
        neox: bool,
    ) -> Result<(), KernelError> {
        let (n_heads, hd, half, neox) = (
            u32_of(n_heads, "n_heads")?,
            u32_of(hd, "hd")?,
            u32_of(half, "half")?,
            neox as u32,
        );
        self.launch(
            s,
            "rope_f32",
            plan::per_row(n_rows, 128)?,
            &[
                arg(&x),
                arg(&cos),
                arg(&sin),
                arg(&n_heads),
                arg(&hd),
                arg(&half),
                arg(&neox),
            ],
        )
    }

    /// The batch's new K/V rows into one layer of the pool, row `r` at pool row `pool_rows[r]`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write_f16(
        &self,
        s: &Stream,
        k_pool: Ptr<u16>,
        v_pool: Ptr<u16>,
        k_new: Ptr<f32>,
        v_new: Ptr<f32>,
        pool_rows: Ptr<u32>,
        n_rows: usize,
        kv_dim: usize,
    ) -> Result<(), KernelError> {
        let kv_dim = u32_of(kv_dim, "kv_dim")?;
        self.launch(
            s,
            "kv_write_f16",
            plan::per_row(n_rows, 128)?,
            &[
                arg(&k_pool),
                arg(&v_pool),
                arg(&k_new),
                arg(&v_new),
                arg(&pool_rows),
                arg(&kv_dim),
            ],
        )
    }

    /// Attention of every row of `plan`'s batch over one layer of the pool; `plan_bufs` hold
    /// the plan's `rows`, `seqs`, `blocks` and `mask` on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn tree_attention_f16(
        &self,
        s: &Stream,
        plan: &AttentionPlan,
        plan_bufs: (Ptr<u32>, Ptr<u32>, Ptr<u32>, Ptr<u64>),
        q: Ptr<f32>,
        k: Ptr<u16>,
        v: Ptr<u16>,
        out: Ptr<f32>,
    ) -> Result<(), KernelError> {
        let (rows, seqs, blocks, mask) = plan_bufs;
        let (n_head, n_head_kv, hd) = (
            u32_of(plan.n_head, "n_head")?,
            u32_of(plan.n_head_kv, "n_head_kv")?,
            u32_of(plan.head_dim, "head_dim")?,
        );
        let scale = plan.scale;
        self.launch(
            s,
            "tree_attention_f16",
            plan.launch()?,
            &[
                arg(&q),
                arg(&k),
                arg(&v),
                arg(&out),
                arg(&rows),
                arg(&seqs),
                arg(&blocks),
                arg(&mask),
                arg(&n_head),
                arg(&n_head_kv),
                arg(&hd),
                arg(&scale),
            ],
        )
    }

    /// `gate = silu(gate) * up` over `n` elements.
    pub fn silu_mul_f32(
        &self,
        s: &Stream,
        gate: Ptr<f32>,
        up: Ptr<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        let n32 = u32_of(n, "n")?;
        self.launch(
            s,
            "silu_mul_f32",
            plan::elementwise(n)?,
            &[arg(&gate), arg(&up), arg(&n32)],
        )
    }

    /// `out[i] = x[rows[i]]` over rows of `width`.
    pub fn gather_rows_f32(
        &self,
        s: &Stream,
        x: Ptr<f32>,
        rows: Ptr<u32>,
        out: Ptr<f32>,
        n_out_rows: usize,
        width: usize,
    ) -> Result<(), KernelError> {
        let width = u32_of(width, "width")?;
        self.launch(
            s,
            "gather_rows_f32",
            plan::per_row(n_out_rows, 128)?,
            &[arg(&x), arg(&rows), arg(&out), arg(&width)],
        )
    }

    /// `out[r] = argmax(logits[r])` (first index of the largest value).
    pub fn argmax_f32(
        &self,
        s: &Stream,
        logits: Ptr<f32>,
        out: Ptr<u32>,
        n_rows: usize,
        vocab: usize,
    ) -> Result<(), KernelError> {
        let vocab = u32_of(vocab, "vocab")?;
        self.launch(
            s,
            "argmax_f32",
            plan::per_row(n_rows, 256)?,
            &[arg(&logits), arg(&out), arg(&vocab)],
        )
    }

    /// Move pool rows `src[i]` to `dst[i]`, in order, in every plane of the pool
    /// (`[n_planes, pool_rows, kv_dim]` f16).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_copy_rows_f16(
        &self,
        s: &Stream,
        pool: Ptr<u16>,
        src: Ptr<u32>,
        dst: Ptr<u32>,
        n_pairs: usize,
        n_planes: usize,
        pool_rows: usize,
        kv_dim: usize,
    ) -> Result<(), KernelError> {
        if !kv_dim.is_multiple_of(2) {
            return Err(KernelError::InvalidPlan(format!(
                "kv_copy_rows_f16 copies 32-bit words: kv_dim {kv_dim} is odd"
            )));
        }
        let n_pairs = u32_of(n_pairs, "n_pairs")?;
        let row_words = u32_of(kv_dim / 2, "row_words")?;
        let plane_words = (pool_rows * kv_dim / 2) as u64;
        self.launch(
            s,
            "kv_copy_rows_f16",
            plan::kv_copy(n_planes)?,
            &[
                arg(&pool),
                arg(&src),
                arg(&dst),
                arg(&n_pairs),
                arg(&row_words),
                arg(&plane_words),
            ],
        )
    }
}
