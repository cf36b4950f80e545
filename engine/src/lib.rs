//! Arbor engine: GGUF models on a quantized CPU backend, tokenizer, forward pass and sampling (no I/O beyond model files).
pub mod backend;
pub mod draft;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod quant;
pub mod sample;
pub mod sched;
pub mod shared;
pub mod spec;
pub mod testing;
pub mod tokenizer;
pub mod tree;

pub use backend::{AmxUse, Backend, BatchMask, CpuBackend};
pub use error::{EngineError, Result};
pub use generate::{generate, FinishReason, GenerateOutput, GenerateParams, ResponseFormat};
pub use gguf::GgufFile;
pub use kv::{KvCache, KvPool, PoolStats};
pub use model::{Model, ModelConfig, SeqBatch};
pub use sample::penalty::Penalties;
pub use sample::schema::{JsonGrammar, JsonSchema};
pub use sample::{Sampler, SamplingParams};
pub use shared::Shared;
pub use tokenizer::{ChatMessage, StreamDecoder, Tokenizer};
