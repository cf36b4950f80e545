//! GPU verifier entry point: `--device cpu|cuda[:N]`, and a [`DeviceModel`] running the decoder
//! over ragged token-tree batches (SpecInfer's tree verification on the device) on our PTX
//! kernels with feature `cuda` (`CudaModel`), or on their host reference ([`HostOps`]) in tests;
//! without the feature `--device cuda` returns `NotCompiledWithCuda` (candle's dummy backend).

pub mod check;
#[cfg(feature = "cuda")]
mod cuda_ops;
mod model;
mod ops;
#[cfg(test)]
mod tests;

#[cfg(feature = "cuda")]
pub use cuda_ops::CudaOps;
#[cfg(feature = "cuda")]
pub use model::CudaModel;
pub use model::{DeviceForward, DeviceModel, DeviceSeq, DeviceSequence, GreedyRun};
pub use ops::{DeviceOps, Elem, HostOps, PlanBufs};

use crate::error::{EngineError, Result};

pub use arbor_kernels_gpu::plan::{AttentionPlan, KvCommitPlan, SeqMask, SeqRows};

/// Where a model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = EngineError;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device> {
        let bad = || {
            EngineError::InvalidArgument(format!(
                "unknown device '{s}' (expected cpu, cuda or cuda:N)"
            ))
        };
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(bad),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Whether this build can drive a GPU (feature `cuda`).
pub fn is_compiled() -> bool {
    cfg!(feature = "cuda")
}

/// Names of the embedded PTX kernel modules.
pub fn kernel_names() -> Vec<&'static str> {
    arbor_kernels_gpu::MODULES.iter().map(|(n, _)| *n).collect()
}

/// How many CUDA devices the driver reports: `NotCompiledWithCuda` without the feature,
/// `NoCudaDevice` when the driver cannot be initialised (no driver, no GPU).
pub fn device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    {
        cust::init(cust::CudaFlags::empty())
            .map_err(|e| EngineError::NoCudaDevice(format!("CUDA driver: {e}")))?;
        cust::device::Device::num_devices()
            .map(|n| n as usize)
            .map_err(|e| EngineError::NoCudaDevice(format!("CUDA driver: {e}")))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(EngineError::NotCompiledWithCuda)
    }
}

/// Check that `device` can be used: always for the CPU; for `cuda:N`, that this build has CUDA
/// and the driver reports device N.
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(n) => {
            let count = device_count()?;
            if n >= count {
                return Err(EngineError::NoCudaDevice(format!(
                    "device {n} requested, the driver reports {count}"
                )));
            }
            Ok(())
        }
    }
}

/// The device a scheduler runs its forward passes on ([`crate::sched::Scheduler::set_device`]):
/// `None` for the CPU; for `cuda:N` the model uploaded to device N with room for `kv_blocks`
/// blocks (the host pool's most), or `NotCompiledWithCuda` / `NoCudaDevice`.
pub fn open_device(
    model: &crate::model::Model,
    device: Device,
    kv_blocks: usize,
) -> Result<Option<std::sync::Arc<dyn DeviceForward>>> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda(n) => {
            check_device(device)?;
            #[cfg(feature = "cuda")]
            {
                Ok(Some(std::sync::Arc::new(CudaModel::new(
                    model, n, kv_blocks,
                )?)))
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (model, n, kv_blocks);
                Err(EngineError::NotCompiledWithCuda)
            }
        }
    }
}
