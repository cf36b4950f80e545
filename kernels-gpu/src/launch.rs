//! cust launch wrappers for the embedded PTX kernels; modules are loaded on first use and cached.

use std::collections::HashMap;
use std::sync::Mutex;

use cust::prelude::*;

use crate::{module_source, KernelError};

fn cuda_err(e: cust::error::CudaError) -> KernelError {
    KernelError::Cuda(e.to_string())
}

/// Loaded modules, keyed by name.
#[derive(Default)]
pub struct KernelCache {
    modules: Mutex<HashMap<&'static str, std::sync::Arc<Module>>>,
}

impl KernelCache {
    fn module(&self, name: &'static str) -> Result<std::sync::Arc<Module>, KernelError> {
        let mut m = self
            .modules
            .lock()
            .map_err(|_| KernelError::Cuda("poisoned".into()))?;
        if let Some(module) = m.get(name) {
            return Ok(module.clone());
        }
        let module =
            std::sync::Arc::new(Module::from_ptx(module_source(name)?, &[]).map_err(cuda_err)?);
        m.insert(name, module.clone());
        Ok(module)
    }

    /// gate = silu(gate) * up, elementwise.
    pub fn silu_mul_f32(
        &self,
        stream: &Stream,
        gate: &mut DeviceBuffer<f32>,
        up: &DeviceBuffer<f32>,
    ) -> Result<(), KernelError> {
        let module = self.module("silu_mul_f32")?;
        let f = module.get_function("silu_mul_f32").map_err(cuda_err)?;
        let n = gate.len() as u32;
        let blocks = n.div_ceil(256);
        // SAFETY: argument types and order match the PTX entry's parameter list.
        unsafe {
            launch!(f<<<blocks, 256, 0, stream>>>(gate.as_device_ptr(), up.as_device_ptr(), n))
                .map_err(cuda_err)?;
        }
        Ok(())
    }

    /// out[r] = rms_norm(x[r]) * w for `rows` rows of `w.len()` columns.
    pub fn rms_norm_f32(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<f32>,
        w: &DeviceBuffer<f32>,
        out: &mut DeviceBuffer<f32>,
        eps: f32,
    ) -> Result<(), KernelError> {
        let module = self.module("rms_norm_f32")?;
        let f = module.get_function("rms_norm_f32").map_err(cuda_err)?;
        let cols = w.len() as u32;
        let rows = (x.len() / w.len().max(1)) as u32;
        // SAFETY: argument types and order match the PTX entry's parameter list.
        unsafe {
            launch!(f<<<rows, 256, 0, stream>>>(
                x.as_device_ptr(),
                w.as_device_ptr(),
                out.as_device_ptr(),
                cols,
                eps
            ))
            .map_err(cuda_err)?;
        }
        Ok(())
    }
}
