//! Model weights (quantized, memory-mapped from GGUF) for the llama and qwen2 decoder architectures.

mod config;
mod forward;
#[cfg(test)]
mod tests;

pub use config::{Arch, ModelConfig, RopeStyle};
pub(crate) use forward::RopeTable;
pub use forward::{BatchMask, SeqBatch};

use std::collections::HashSet;

use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, TensorInfo};
use crate::quant::{self, QMatrix};

/// One transformer block's weights. Matrices stay quantized in the file mapping.
pub(crate) struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: TensorInfo,
    pub wk: TensorInfo,
    pub wv: TensorInfo,
    pub wo: TensorInfo,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: TensorInfo,
    pub w_up: TensorInfo,
    pub w_down: TensorInfo,
}

/// A loaded decoder-only model.
pub struct Model {
    gguf: GgufFile,
    /// Offsets of the tensors whose rows were column-packed at load (`quant::packed`).
    packed: HashSet<usize>,
    pub config: ModelConfig,
    tok_embd: TensorInfo,
    output_norm: Vec<f32>,
    output: TensorInfo,
    pub(crate) layers: Vec<LayerWeights>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .finish()
    }
}

impl Model {
    /// Open a GGUF file and check every tensor the forward pass needs.
    pub fn open(path: &std::path::Path) -> Result<Model> {
        Self::from_gguf(GgufFile::open(path)?)
    }

    /// The model of a parsed GGUF image. Unless `ARBOR_PACK=0`, the weight matrices this
    /// process's kernels read packed ([`quant::packed::packs_here_matrix`]) are column-packed in
    /// place first ([`quant::packed`]; not in a read-only file mapping): the same results,
    /// cheaper passes.
    pub fn from_gguf(gguf: GgufFile) -> Result<Model> {
        Self::from_gguf_packing(gguf, quant::packed::pack_requested())
    }

    /// [`Model::from_gguf`] choosing whether to pack (`pack` is ignored where no kernel reads
    /// packed rows, i.e. unless [`quant::packed::packs_here`]).
    pub fn from_gguf_packing(gguf: GgufFile, pack: bool) -> Result<Model> {
        let mut model = Self::from_gguf_natural(gguf)?;
        if pack && quant::packed::packs_here() {
            model.pack()?;
        }
        Ok(model)
    }

    /// Packs every packable weight matrix the forward pass multiplies by, an output head tied to
    /// the embedding table included ([`Model::embed`] reads its rows back from the packed
    /// groups); an untied embedding table stays as it is.
    fn pack(&mut self) -> Result<()> {
        let mut infos: Vec<TensorInfo> = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(std::iter::once(&self.output))
            .filter(|t| {
                quant::packed::packs_here_matrix(t.ty, t.dims[1] as usize, t.dims[0] as usize)
            })
            .cloned()
            .collect();
        infos.sort_by_key(|t| t.offset);
        infos.dedup_by_key(|t| t.offset);
        let packed = self.gguf.rewrite_tensors(&infos, |t, bytes| {
            quant::packed::pack(t.ty, bytes, t.dims[1] as usize, t.dims[0] as usize)
        })?;
        if packed {
            self.packed = infos.iter().map(|t| t.offset).collect();
        }
        Ok(())
    }

    fn from_gguf_natural(gguf: GgufFile) -> Result<Model> {
        let config = ModelConfig::from_gguf(&gguf)?;
        let c = &config;
        let q_dim = c.n_head * c.head_dim;
        let tok_embd = matrix(&gguf, "token_embd.weight", c.vocab_size, c.n_embd)?;
        let output = match gguf.tensor_info("output.weight") {
            Some(_) => matrix(&gguf, "output.weight", c.vocab_size, c.n_embd)?,
            None => tok_embd.clone(), // tied embeddings
        };
        let output_norm = vector(&gguf, "output_norm.weight", c.n_embd)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let opt_vec = |s: &str, len: usize| -> Result<Option<Vec<f32>>> {
                match gguf.tensor_info(&n(s)) {
                    Some(_) => vector(&gguf, &n(s), len).map(Some),
                    None => Ok(None),
                }
            };
            layers.push(LayerWeights {
                attn_norm: vector(&gguf, &n("attn_norm.weight"), c.n_embd)?,
                wq: matrix(&gguf, &n("attn_q.weight"), q_dim, c.n_embd)?,
                wk: matrix(&gguf, &n("attn_k.weight"), c.kv_dim(), c.n_embd)?,
                wv: matrix(&gguf, &n("attn_v.weight"), c.kv_dim(), c.n_embd)?,
                wo: matrix(&gguf, &n("attn_output.weight"), c.n_embd, q_dim)?,
                bq: opt_vec("attn_q.bias", q_dim)?,
                bk: opt_vec("attn_k.bias", c.kv_dim())?,
                bv: opt_vec("attn_v.bias", c.kv_dim())?,
                ffn_norm: vector(&gguf, &n("ffn_norm.weight"), c.n_embd)?,
                w_gate: matrix(&gguf, &n("ffn_gate.weight"), c.n_ff, c.n_embd)?,
                w_up: matrix(&gguf, &n("ffn_up.weight"), c.n_ff, c.n_embd)?,
                w_down: matrix(&gguf, &n("ffn_down.weight"), c.n_embd, c.n_ff)?,
            });
        }
        Ok(Model {
            gguf,
            packed: HashSet::new(),
            config,
            tok_embd,
            output_norm,
            output,
            layers,
        })
    }

    pub fn gguf(&self) -> &GgufFile {
        &self.gguf
    }

    pub(crate) fn mat(&self, t: &TensorInfo) -> QMatrix<'_> {
        QMatrix {
            ty: t.ty,
            data: self.gguf.tensor_bytes(t),
            n_out: t.dims[1] as usize,
            n_in: t.dims[0] as usize,
            packed: self.packed.contains(&t.offset),
        }
    }

    /// Dequantize the embedding rows of `tokens` into `out` ([n_tok, n_embd]).
    pub(crate) fn embed(&self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        let d = self.config.n_embd;
        let t = &self.tok_embd;
        let row_bytes = t.n_bytes / self.config.vocab_size;
        let data = self.gguf.tensor_bytes(t);
        // A tied output head packed at load: each row gathered back from its slice.
        let packed = self.packed.contains(&t.offset);
        let mut row = vec![0u8; if packed { row_bytes } else { 0 }];
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            if tok >= self.config.vocab_size {
                return Err(EngineError::InvalidArgument(format!(
                    "token id {tok} is outside the vocabulary (size {})",
                    self.config.vocab_size
                )));
            }
            let bytes = if packed {
                quant::packed::natural_row(t.ty, data, d, tok, &mut row);
                &row[..]
            } else {
                &data[tok * row_bytes..(tok + 1) * row_bytes]
            };
            quant::dequantize_row(t.ty, bytes, &mut out[i * d..(i + 1) * d])?;
        }
        Ok(())
    }

    pub(crate) fn output_norm(&self) -> &[f32] {
        &self.output_norm
    }

    pub(crate) fn embedding_matrix(&self) -> QMatrix<'_> {
        self.mat(&self.tok_embd)
    }

    pub(crate) fn output_matrix(&self) -> QMatrix<'_> {
        self.mat(&self.output)
    }

    /// Bytes of weights read by one forward pass (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .iter()
                    .map(|t| t.n_bytes)
                    .sum::<usize>()
            })
            .sum();
        l + self.output.n_bytes
    }
}

/// Look up a 2-D weight matrix with `n_out` rows of `n_in` elements.
fn matrix(g: &GgufFile, name: &str, n_out: usize, n_in: usize) -> Result<TensorInfo> {
    let t = g
        .tensor_info(name)
        .ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
    if t.dims.len() != 2 || t.dims[0] as usize != n_in || t.dims[1] as usize != n_out {
        return Err(EngineError::Shape(format!(
            "{name}: expected [{n_in}, {n_out}], file has {:?}",
            t.dims
        )));
    }
    if !t.ty.supported() {
        return Err(EngineError::UnsupportedTensorType(format!(
            "{} (tensor '{name}')",
            t.ty.name()
        )));
    }
    Ok(t.clone())
}

/// Load a 1-D tensor of `len` elements as f32.
fn vector(g: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = g
        .tensor_info(name)
        .ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
    if t.n_elems() != len as u64 {
        return Err(EngineError::Shape(format!(
            "{name}: expected {len} elements, file has {:?}",
            t.dims
        )));
    }
    let mut out = vec![0.0; len];
    quant::dequantize_row(t.ty, g.tensor_bytes(t), &mut out)?;
    Ok(out)
}
