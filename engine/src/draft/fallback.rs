//! Fallback drafting: a cheap drafter (prompt lookup) first, a costlier one (an SSM) only at steps where the first proposes nothing.

use super::{DraftRequest, Drafter, GroupLogits, PlaceholderGroup, RowCandidates};
use crate::error::Result;
use crate::tree::TokenTree;

/// Asks `first` for a tree; where it proposes no draft node (only the root), asks `second`. Both
/// see every `accept`, so a drafter with its own cache (an SSM) stays in step with the sequence
/// even across steps it did not draft (it feeds what it missed at its next proposal). Placeholder
/// groups and their logits go to whichever drafter proposed the step's tree.
pub struct FallbackDrafter<'a> {
    first: Box<dyn Drafter + 'a>,
    second: Box<dyn Drafter + 'a>,
    name: String,
    /// Whether `second` drafted the current step.
    second_drafted: bool,
    /// Steps drafted by `first` and by `second`.
    counts: [u64; 2],
}

impl<'a> FallbackDrafter<'a> {
    pub fn new(first: Box<dyn Drafter + 'a>, second: Box<dyn Drafter + 'a>) -> Self {
        let name = format!("{} else {}", first.name(), second.name());
        FallbackDrafter {
            first,
            second,
            name,
            second_drafted: false,
            counts: [0; 2],
        }
    }

    /// Steps drafted so far by the first and by the second drafter.
    pub fn counts(&self) -> [u64; 2] {
        self.counts
    }

    fn active(&mut self) -> &mut (dyn Drafter + 'a) {
        if self.second_drafted {
            self.second.as_mut()
        } else {
            self.first.as_mut()
        }
    }
}

impl Drafter for FallbackDrafter<'_> {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_nodes(&self, max_depth: usize) -> usize {
        self.first
            .max_nodes(max_depth)
            .max(self.second.max_nodes(max_depth))
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let tree = self.first.propose(req)?;
        self.second_drafted = tree.len() <= 1;
        if !self.second_drafted {
            self.counts[0] += 1;
            return Ok(tree);
        }
        self.counts[1] += 1;
        self.second.propose(req)
    }

    fn accept(&mut self, accepted: &[u32], bonus: u32) {
        self.first.accept(accepted, bonus);
        self.second.accept(accepted, bonus);
    }

    fn placeholders(&mut self, tree: &TokenTree) -> Vec<PlaceholderGroup> {
        self.active().placeholders(tree)
    }

    fn max_placeholder_rows(&self) -> usize {
        self.first
            .max_placeholder_rows()
            .max(self.second.max_placeholder_rows())
    }

    fn observe(&mut self, group: Option<GroupLogits<'_>>) {
        self.active().observe(group)
    }

    fn candidates_wanted(&self) -> usize {
        self.first
            .candidates_wanted()
            .max(self.second.candidates_wanted())
    }

    fn prompt_candidates(&self) -> usize {
        self.first
            .prompt_candidates()
            .max(self.second.prompt_candidates())
    }

    fn set_row_costs(&mut self, costs: &[f64]) {
        self.first.set_row_costs(costs);
        self.second.set_row_costs(costs);
    }

    fn observe_candidates(&mut self, rows: &RowCandidates<'_>) {
        // Both follow every pass, as both follow every accepted step.
        for d in [&mut self.first, &mut self.second] {
            if d.candidates_wanted() > 0 {
                d.observe_candidates(rows);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::draft::{early_exit, DraftSampling, NgramDrafter};
    use crate::testing::{greedy_incremental, greedy_session, tiny_model, TinySpec};

    /// Prompt lookup (bigram matches or longer) first, else the LLM itself as its own drafter
    /// (early exit with every layer, so whatever it drafts is right): greedy output equals
    /// incremental decoding, both drafters draft some steps, and the fallback, which skips the
    /// steps prompt lookup drafts, catches up on them (its drafts stay fully accepted).
    #[test]
    fn fallback_greedy_equals_incremental_and_catches_up() {
        let spec = TinySpec {
            vocab: 12,
            ..TinySpec::default()
        };
        let llm = tiny_model(&spec, 21).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5];
        let n = 40;
        let (_, truth) = greedy_incremental(&llm, &be, &prompt, n, 0).unwrap();
        let exact = early_exit(
            &llm,
            &be,
            spec.n_layers,
            "1,1,1,1".parse().unwrap(),
            DraftSampling::TopK,
            1,
        )
        .unwrap();
        let mut d = FallbackDrafter::new(
            Box::new(NgramDrafter::new(3, 2, 4, 2).unwrap()),
            Box::new(exact),
        );
        let mut s = greedy_session(&llm, &be, &prompt, truth[0], 16).unwrap();
        let mut full_steps = 0;
        let mut fallback_steps = 0;
        while s.tokens().len() < prompt.len() + n {
            let before = d.counts()[1];
            let o = s.step(&mut [&mut d], 4).unwrap();
            if d.counts()[1] > before {
                fallback_steps += 1;
                full_steps += usize::from(o.tokens.len() == 4);
            }
        }
        assert_eq!(&s.tokens()[prompt.len()..prompt.len() + n], &truth[..]);
        let [first, second] = d.counts();
        assert!(
            first > 0 && second > 0,
            "both drafters draft: {first} / {second}"
        );
        assert_eq!(
            full_steps, fallback_steps,
            "every chain the exact fallback drafts is accepted whole"
        );
    }
}
