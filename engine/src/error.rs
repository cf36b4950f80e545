//! The engine's one error enum; every variant has a stable machine-readable code (`error_type`).

use std::path::PathBuf;

/// Errors of the engine crate. `error_type()` returns a stable snake_case code for clients.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("i/o error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed GGUF file: {0}")]
    Gguf(String),
    #[error("unsupported tensor type {0}")]
    UnsupportedTensorType(String),
    #[error("unsupported model architecture '{0}' (supported: llama, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("model is missing required data: {0}")]
    MissingTensor(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error("context overflow: {needed} positions needed, model context is {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("KV cache pool exhausted: {needed} more blocks needed")]
    KvPoolExhausted { needed: usize },
    #[error("not compiled with CUDA: rebuild with `--features cuda` to use --device cuda")]
    NotCompiledWithCuda,
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    #[error("GPU error: {0}")]
    Gpu(String),
}

impl EngineError {
    /// Stable error code, never changes once published.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::Io { .. } => "io_error",
            EngineError::Gguf(_) => "malformed_model_file",
            EngineError::UnsupportedTensorType(_) => "unsupported_tensor_type",
            EngineError::UnsupportedArchitecture(_) => "unsupported_architecture",
            EngineError::MissingTensor(_) => "missing_tensor",
            EngineError::Shape(_) => "shape_mismatch",
            EngineError::Tokenizer(_) => "tokenizer_error",
            EngineError::ContextOverflow { .. } => "context_overflow",
            EngineError::InvalidArgument(_) => "invalid_argument",
            EngineError::KvPoolExhausted { .. } => "kv_pool_exhausted",
            EngineError::NotCompiledWithCuda => "not_compiled_with_cuda",
            EngineError::NoCudaDevice(_) => "no_cuda_device",
            EngineError::Gpu(_) => "gpu_error",
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<arbor_kernels_gpu::KernelError> for EngineError {
    fn from(e: arbor_kernels_gpu::KernelError) -> Self {
        use arbor_kernels_gpu::KernelError as K;
        match e {
            K::NotCompiledWithCuda => EngineError::NotCompiledWithCuda,
            K::InvalidPlan(m) => EngineError::InvalidArgument(m),
            K::UnknownModule(m) => EngineError::Gpu(format!("unknown kernel module '{m}'")),
            K::Cuda(m) => EngineError::Gpu(m),
        }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
