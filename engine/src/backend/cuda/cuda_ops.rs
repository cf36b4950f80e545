//! [`DeviceOps`] on a CUDA device: cust device buffers, one blocking stream, the PTX kernels.

use arbor_kernels_gpu::launch::{Kernels, Ptr};
use arbor_kernels_gpu::plan::{AttentionPlan, KvCommitPlan};
use cust::context::Context;
use cust::memory::{CopyDestination, DeviceBuffer};
use cust::stream::{Stream, StreamFlags};

use super::ops::{DeviceOps, Elem, PlanBufs};
use crate::error::{EngineError, Result};

pub(crate) fn gpu(e: cust::error::CudaError) -> EngineError {
    EngineError::Gpu(e.to_string())
}

/// One CUDA context on one device, its stream and its loaded kernels. Buffers made through it
/// must be dropped before it (the device model keeps it as its last field).
pub struct CudaOps {
    kernels: Kernels,
    stream: Stream,
    _ctx: Context,
}

impl CudaOps {
    /// A context on device `ordinal` (after [`super::check_device`]), every kernel module loaded.
    pub fn new(ordinal: usize) -> Result<CudaOps> {
        super::check_device(super::Device::Cuda(ordinal))?;
        let device = cust::device::Device::get_device(ordinal as u32).map_err(gpu)?;
        let ctx = Context::new(device).map_err(gpu)?;
        // A blocking stream: it waits for the legacy default stream, where cust's uploads and
        // `zeroed` memsets run, so a kernel never reads a buffer before it is filled.
        let stream = Stream::new(StreamFlags::DEFAULT, None).map_err(gpu)?;
        let kernels = Kernels::new();
        kernels.load_all()?;
        Ok(CudaOps {
            kernels,
            stream,
            _ctx: ctx,
        })
    }
}

fn at(b: &DeviceBuffer<u16>, off: usize) -> Result<Ptr<u16>> {
    if off > b.len() {
        return Err(EngineError::Shape(
            "plane offset outside the KV pool".into(),
        ));
    }
    // SAFETY: the offset is inside the buffer (checked above).
    Ok(unsafe { b.as_device_ptr().add(off) })
}

impl DeviceOps for CudaOps {
    type Buf<T: Elem> = DeviceBuffer<T>;

    fn activate(&self) -> Result<()> {
        cust::context::CurrentContext::set_current(&self._ctx).map_err(gpu)
    }

    fn upload<T: Elem>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::from_slice(data).map_err(gpu)
    }

    fn zeroed<T: Elem>(&self, n: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::zeroed(n.max(1)).map_err(gpu)
    }

    fn download<T: Elem>(&self, buf: &DeviceBuffer<T>, out: &mut [T]) -> Result<()> {
        self.sync()?;
        if buf.len() < out.len() {
            return Err(EngineError::Shape("download larger than its buffer".into()));
        }
        buf.index(..out.len()).copy_to(out).map_err(gpu)
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(gpu)
    }

    fn embed_rows(
        &self,
        table: &DeviceBuffer<u16>,
        tokens: &DeviceBuffer<u32>,
        out: &DeviceBuffer<f32>,
        n_rows: usize,
        d: usize,
        vocab: usize,
    ) -> Result<()> {
        Ok(self.kernels.embed_rows_f16(
            &self.stream,
            table.as_device_ptr(),
            tokens.as_device_ptr(),
            out.as_device_ptr(),
            n_rows,
            d,
            vocab,
        )?)
    }

    fn rms_norm(
        &self,
        x: &DeviceBuffer<f32>,
        w: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        n_rows: usize,
        n_cols: usize,
        eps: f32,
    ) -> Result<()> {
        Ok(self.kernels.rms_norm_f32(
            &self.stream,
            x.as_device_ptr(),
            w.as_device_ptr(),
            out.as_device_ptr(),
            n_rows,
            n_cols,
            eps,
        )?)
    }

    fn matmul(
        &self,
        w: &DeviceBuffer<u16>,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        n_tok: usize,
        n_out: usize,
        n_in: usize,
    ) -> Result<()> {
        if w.len() < n_out * n_in || x.len() < n_tok * n_in || y.len() < n_tok * n_out {
            return Err(EngineError::Shape("matmul buffers too small".into()));
        }
        Ok(self.kernels.matmul_f16(
            &self.stream,
            w.as_device_ptr(),
            x.as_device_ptr(),
            y.as_device_ptr(),
            n_tok,
            n_out,
            n_in,
        )?)
    }

    fn add(
        &self,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        n_rows: usize,
        width: usize,
        y_stride: usize,
    ) -> Result<()> {
        Ok(self.kernels.add_f32(
            &self.stream,
            x.as_device_ptr(),
            y.as_device_ptr(),
            n_rows,
            width,
            y_stride,
        )?)
    }

    fn rope(
        &self,
        x: &DeviceBuffer<f32>,
        cos: &DeviceBuffer<f32>,
        sin: &DeviceBuffer<f32>,
        n_rows: usize,
        n_heads: usize,
        hd: usize,
        half: usize,
        neox: bool,
    ) -> Result<()> {
        Ok(self.kernels.rope_f32(
            &self.stream,
            x.as_device_ptr(),
            cos.as_device_ptr(),
            sin.as_device_ptr(),
            n_rows,
            n_heads,
            hd,
            half,
            neox,
        )?)
    }

    fn kv_write(
        &self,
        pool: &DeviceBuffer<u16>,
        k_off: usize,
        v_off: usize,
        k_new: &DeviceBuffer<f32>,
        v_new: &DeviceBuffer<f32>,
        rows: &DeviceBuffer<u32>,
        n_rows: usize,
        kv_dim: usize,
    ) -> Result<()> {
        Ok(self.kernels.kv_write_f16(
            &self.stream,
            at(pool, k_off)?,
            at(pool, v_off)?,
            k_new.as_device_ptr(),
            v_new.as_device_ptr(),
            rows.as_device_ptr(),
            n_rows,
            kv_dim,
        )?)
    }

    fn attention(
        &self,
        plan: &AttentionPlan,
        bufs: &PlanBufs<Self>,
        q: &DeviceBuffer<f32>,
        pool: &DeviceBuffer<u16>,
        k_off: usize,
        v_off: usize,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        Ok(self.kernels.tree_attention_f16(
            &self.stream,
            plan,
            (
                bufs.rows.as_device_ptr(),
                bufs.seqs.as_device_ptr(),
                bufs.blocks.as_device_ptr(),
                bufs.mask.as_device_ptr(),
            ),
            q.as_device_ptr(),
            at(pool, k_off)?,
            at(pool, v_off)?,
            out.as_device_ptr(),
        )?)
    }

    fn silu_mul(&self, gate: &DeviceBuffer<f32>, up: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        Ok(self
            .kernels
            .silu_mul_f32(&self.stream, gate.as_device_ptr(), up.as_device_ptr(), n)?)
    }

    fn gather_rows(
        &self,
        x: &DeviceBuffer<f32>,
        rows: &DeviceBuffer<u32>,
        out: &DeviceBuffer<f32>,
        n_out_rows: usize,
        width: usize,
    ) -> Result<()> {
        Ok(self.kernels.gather_rows_f32(
            &self.stream,
            x.as_device_ptr(),
            rows.as_device_ptr(),
            out.as_device_ptr(),
            n_out_rows,
            width,
        )?)
    }

    fn argmax(
        &self,
        logits: &DeviceBuffer<f32>,
        out: &DeviceBuffer<u32>,
        n_rows: usize,
        vocab: usize,
    ) -> Result<()> {
        Ok(self.kernels.argmax_f32(
            &self.stream,
            logits.as_device_ptr(),
            out.as_device_ptr(),
            n_rows,
            vocab,
        )?)
    }

    fn kv_copy_rows(
        &self,
        pool: &DeviceBuffer<u16>,
        commit: &KvCommitPlan,
        n_planes: usize,
        pool_rows: usize,
        kv_dim: usize,
    ) -> Result<()> {
        if commit.is_empty() {
            return Ok(());
        }
        let (src, dst) = (self.upload(&commit.src)?, self.upload(&commit.dst)?);
        self.kernels.kv_copy_rows_f16(
            &self.stream,
            pool.as_device_ptr(),
            src.as_device_ptr(),
            dst.as_device_ptr(),
            commit.src.len(),
            n_planes,
            pool_rows,
            kv_dim,
        )?;
        // The index buffers are freed on return: wait for the kernel that reads them.
        self.sync()
    }
}
