//! Self-speculative early-exit drafting (LayerSkip / Draft & Verify style): the LLM's first L layers, its final norm and output head draft for the full LLM, sharing its weights.

use super::dynamic::DraftShape;
use super::ssm::{DraftSampling, ModelDrafter};
use crate::backend::Backend;
use crate::error::Result;
use crate::model::Model;

/// A drafter that runs the first `layers` layers of `llm` itself (no extra weights; its own small
/// KV cache for those layers), then the LLM's final norm and head.
pub fn early_exit<'m, B: Backend>(
    llm: &'m Model,
    backend: &'m B,
    layers: usize,
    shape: DraftShape,
    sampling: DraftSampling,
    seed: u64,
) -> Result<ModelDrafter<'m, B>> {
    ModelDrafter::new(
        format!("early-exit:{layers}"),
        llm,
        backend,
        layers,
        llm.config.vocab_size,
        shape,
        sampling,
        seed,
    )
}
