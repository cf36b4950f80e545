//! Self-speculative early-exit drafting (LayerSkip / Draft & Verify style): the LLM's first L layers, its final norm and output head draft for the full LLM, sharing its weights.

use super::dynamic::DraftShape;
use super::ssm::{DraftSampling, ModelDrafter};
use crate::backend::Backend;
use crate::error::Result;
use crate::model::Model;
use crate::shared::Shared;

/// A drafter that runs the first `layers` layers of `llm` itself (no extra weights; its own small
/// KV cache for those layers), then the LLM's final norm and head. `llm` borrowed, or shared
/// (`Arc<Model>`) for a `'static` drafter.
pub fn early_exit<'m, B: Backend>(
    llm: impl Into<Shared<'m, Model>>,
    backend: impl Into<Shared<'m, B>>,
    layers: usize,
    shape: DraftShape,
    sampling: DraftSampling,
    seed: u64,
) -> Result<ModelDrafter<'m, B>> {
    let llm = llm.into();
    let vocab = llm.config.vocab_size;
    ModelDrafter::new(
        format!("early-exit:{layers}"),
        llm,
        backend,
        layers,
        vocab,
        shape,
        sampling,
        seed,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::draft::{DraftRequest, Drafter};
    use crate::testing::{greedy_session, tiny_model, TinySpec};
    use crate::tree::TokenTree;

    /// (token, parent, proposals) of every node: what a verifier sees of a tree.
    fn shape(t: &TokenTree) -> Vec<(u32, Option<usize>, Vec<crate::tree::Proposal>)> {
        t.nodes()
            .iter()
            .map(|n| (n.token, n.parent, n.proposals.clone()))
            .collect()
    }

    /// An early-exit drafter over `L` of the LLM's 4 layers proposes exactly the trees (tokens,
    /// shape, probabilities) of a draft model that *is* those `L` layers (the same seed's
    /// `L`-layer tiny model: the LLM's embedding, first layers, final norm and head, run by the
    /// normal all-layers path), step after step of a greedy session, caches rolled back and
    /// committed alike.
    #[test]
    fn early_exit_drafts_what_the_truncated_model_drafts() {
        let spec = TinySpec {
            arch: "qwen2",
            n_layers: 4,
            vocab: 48,
            ..TinySpec::default()
        };
        let llm = tiny_model(&spec, 17).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
        let (_, first) = crate::testing::greedy_incremental(&llm, &be, &prompt, 1, 1).unwrap();
        for l in [1, 2, 3] {
            let short = tiny_model(
                &TinySpec {
                    n_layers: l,
                    ..spec.clone()
                },
                17,
            )
            .unwrap();
            for shape_s in ["2,2,1", "dynamic:10:3:4"] {
                let sh: DraftShape = shape_s.parse().unwrap();
                let mut ee = early_exit(&llm, &be, l, sh.clone(), DraftSampling::TopK, 1).unwrap();
                let mut reference =
                    ModelDrafter::ssm("truncated", &short, &llm, &be, sh, DraftSampling::TopK, 1)
                        .unwrap();
                let mut s = greedy_session(&llm, &be, &prompt, first[0], 16).unwrap();
                for step in 0..6 {
                    let req = DraftRequest {
                        tokens: s.tokens(),
                        budget: 16,
                        max_depth: 4,
                        drafter: 0,
                        vocab: spec.vocab,
                    };
                    let tree = ee.propose(&req).unwrap();
                    let want = reference.propose(&req).unwrap();
                    assert!(tree.n_draft() > 0);
                    assert_eq!(
                        shape(&tree),
                        shape(&want),
                        "{l} layers, {shape_s}, step {step}"
                    );
                    let o = s.verify(&tree, &mut [&mut ee]).unwrap();
                    reference.accept(&o.tokens, o.bonus);
                }
            }
        }
    }
}
