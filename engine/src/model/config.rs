//! Model hyper-parameters read from GGUF metadata (llama and qwen2 architectures).

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

/// Supported decoder architectures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
}

/// How RoPE pairs dimensions: `Norm` rotates (2i, 2i+1) (llama GGUFs, whose Q/K rows were permuted
/// by the converter), `Neox` rotates (i, i + d/2) (qwen2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Norm,
    Neox,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    pub vocab_size: usize,
    pub context_length: usize,
}

impl ModelConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let arch_name = g
            .get_str("general.architecture")
            .ok_or_else(|| EngineError::MissingTensor("metadata general.architecture".into()))?;
        let (arch, rope_style) = match arch_name {
            "llama" => (Arch::Llama, RopeStyle::Norm),
            "qwen2" => (Arch::Qwen2, RopeStyle::Neox),
            other => return Err(EngineError::UnsupportedArchitecture(other.to_string())),
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize> {
            g.get_u64(&key(k))
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| EngineError::MissingTensor(format!("metadata {}", key(k))))
        };
        let n_embd = req("embedding_length")?;
        let n_head = req("attention.head_count")?;
        let n_head_kv = g
            .get_u64(&key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(EngineError::Gguf(format!(
                "inconsistent attention shape: embd {n_embd}, heads {n_head}, kv heads {n_head_kv}"
            )));
        }
        let head_dim = n_embd / n_head;
        let rope_dim = g
            .get_u64(&key("rope.dimension_count"))
            .map(|v| v as usize)
            .unwrap_or(head_dim);
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(EngineError::Gguf(format!(
                "invalid rope dimension {rope_dim}"
            )));
        }
        let vocab_size = match g.get_u64(&key("vocab_size")) {
            Some(v) => v as usize,
            None => g
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.as_array())
                .map(|a| a.len())
                .ok_or_else(|| EngineError::MissingTensor("vocabulary size".into()))?,
        };
        // Each layer has at least nine tensors (two norms, four attention and three FFN
        // matrices): a larger count is corrupt metadata, not a model to allocate for.
        let n_layers = req("block_count")?;
        if n_layers == 0 || n_layers > g.tensors().len() / 9 {
            return Err(EngineError::Gguf(format!(
                "block_count {n_layers} does not match the file's {} tensors",
                g.tensors().len()
            )));
        }
        Ok(ModelConfig {
            arch,
            n_layers,
            n_embd,
            n_ff: req("feed_forward_length")?,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            rope_base: g.get_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32,
            rope_style,
            rms_eps: g
                .get_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            vocab_size,
            context_length: req("context_length").unwrap_or(4096),
        })
    }

    /// Width of one K (or V) row for one token: all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
}
