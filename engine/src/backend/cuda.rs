//! CUDA backend entry point: with feature `cuda` it reports the PTX kernels it embeds; without, `NotCompiledWithCuda`.

#[cfg(not(feature = "cuda"))]
use crate::error::EngineError;
use crate::error::Result;

/// Whether this build can drive a GPU.
pub fn is_available() -> bool {
    cfg!(feature = "cuda")
}

/// Names of the embedded PTX modules (empty without the `cuda` feature).
pub fn kernel_names() -> Result<Vec<&'static str>> {
    #[cfg(feature = "cuda")]
    {
        Ok(arbor_kernels_gpu::MODULES.iter().map(|(n, _)| *n).collect())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(EngineError::InvalidArgument(
            "not compiled with CUDA (rebuild with --features cuda)".into(),
        ))
    }
}
