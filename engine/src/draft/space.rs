//! SPACE auto-correct decoding (Yi et al., "Generation Meets Verification", 2024): one LLM pass verifies the previous pass's k candidates and drafts the next k from placeholder groups.
//!
//! Layout of one pass (k = 2): the root `r`, the candidate chain `c1 c2`, and after each of
//! `r, c1, c2` its own group of k placeholders:
//!
//! ```text
//! r ─ c1 ─ c2 ─ [p21 p22]
//! │    └─ [p11 p12]
//! └─ [p01 p02]
//! ```
//!
//! A group sees the committed prefix, the chain up to its anchor and its own earlier placeholders,
//! never another group: each group is one more branch of the token tree, so the LLM's candidate
//! rows are exactly what they would be without placeholders, and verification stays lossless.
//! Placeholder rows are never verified or committed ([`super::Drafter::placeholders`]).
//!
//! When the LLM accepts the chain up to `c_a` and samples the bonus `b` (at position
//! `pos(c_a) + 1`), placeholder `j` of `c_a`'s group sits at `pos(c_a) + j` and predicts position
//! `pos(c_a) + j + 1`: the j-th token after `b`, the next pass's candidate `j`.
//!
//! Two modes ([`SpaceMode`]):
//! - mask token: every placeholder is a given `[M]` id (for models fine-tuned
//!   semi-autoregressively, as in the paper);
//! - training-free (Jacobi): placeholders hold the previous pass's own predictions for their
//!   positions. The chain already holds the top prediction of each position, so the group after
//!   `c_i` starts with the runner-up for position `i + 1`, then the top predictions of the
//!   positions after it. When the LLM rejects `c_(i+1)` in favour of that runner-up, the group's
//!   outputs are the LLM's own predictions after it, so the next pass's first candidate is right
//!   under greedy decoding.
//!
//! Candidates are either the placeholders' top tokens (picked) or draws from their distributions
//! (sampled and recorded, so MSS accepts each with min(1, p/q) and, after a rejection, draws from
//! the residual norm(max(0, p − q)); the paper's reference code draws from p there, which is not
//! distribution-preserving).

use std::sync::Arc;

use super::{DraftRequest, DraftSampling, Drafter, GroupLogits, PlaceholderGroup};
use crate::error::{EngineError, Result};
use crate::sample::{Rng, Sampler};
use crate::tree::{draw, normalized, Proposal, TokenTree, TreeBuilder};

/// What fills the placeholder rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpaceMode {
    /// A dedicated mask token id (semi-autoregressively fine-tuned models).
    MaskToken(u32),
    /// The previous pass's own predictions (stock models).
    Jacobi,
}

/// One candidate of the next pass: its token and, when sampled, the distribution it was drawn
/// from (recorded at its parent for MSS).
#[derive(Clone, Debug)]
struct Candidate {
    token: u32,
    prob: f32,
    dist: Option<Arc<[(u32, f32)]>>,
}

/// The SPACE drafter: its candidates come from placeholder rows of the previous verification pass.
pub struct SpaceDrafter {
    name: String,
    k: usize,
    mode: SpaceMode,
    sampler: Option<Sampler>,
    rng: Rng,
    vocab: usize,
    /// Candidates for the positions after the next root (offset 1, 2, …).
    next: Vec<Candidate>,
    /// Jacobi: the runner-up prediction for each of those positions.
    alts: Vec<u32>,
    /// The chain proposed by the last `propose` (tokens after the root).
    chain: Vec<u32>,
}

impl SpaceDrafter {
    /// `k` candidates per pass (and k placeholders per group); `vocab` = the LLM's vocabulary
    /// size. `sampling` chooses picked top tokens or sampled candidates.
    pub fn new(
        k: usize,
        mode: SpaceMode,
        sampling: DraftSampling,
        vocab: usize,
        seed: u64,
    ) -> Result<SpaceDrafter> {
        if k == 0 || k > 32 {
            return Err(EngineError::InvalidArgument(format!(
                "SPACE needs 1 to 32 candidates per pass, got {k}"
            )));
        }
        if let SpaceMode::MaskToken(m) = mode {
            if m as usize >= vocab {
                return Err(EngineError::InvalidArgument(format!(
                    "SPACE mask token {m} is outside the vocabulary ({vocab})"
                )));
            }
        }
        let sampler = match sampling {
            DraftSampling::TopK => None,
            DraftSampling::Sample(p) => Some(Sampler::new(p)?),
        };
        let name = match mode {
            SpaceMode::MaskToken(m) => format!("space:{k}:mask={m}"),
            SpaceMode::Jacobi => format!("space:{k}"),
        };
        Ok(SpaceDrafter {
            name,
            k,
            mode,
            sampler,
            rng: Rng::new(seed),
            vocab,
            next: Vec::new(),
            alts: Vec::new(),
            chain: Vec::new(),
        })
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Placeholder tokens of the group after chain node `i` (0 = root), which covers the
    /// positions `i + 1 ..= i + k` after the root.
    fn group_tokens(&self, i: usize, root: u32) -> Vec<u32> {
        match self.mode {
            SpaceMode::MaskToken(m) => vec![m; self.k],
            SpaceMode::Jacobi => {
                // Top prediction of offset o (1-based), else the last known token.
                let top = |o: usize| {
                    self.next
                        .get(o - 1)
                        .or(self.next.last())
                        .map_or(root, |c| c.token)
                };
                let mut t = Vec::with_capacity(self.k);
                t.push(self.alts.get(i).copied().unwrap_or_else(|| top(i + 1)));
                for o in i + 2..=i + self.k {
                    t.push(top(o));
                }
                t
            }
        }
    }

    /// Next pass's candidates from the placeholder group after the last accepted node.
    fn read_group(&mut self, logits: &[f32], vocab: usize) -> Result<()> {
        self.next.clear();
        self.alts.clear();
        let usable = vocab.min(self.vocab);
        for row in logits.chunks_exact(vocab).take(self.k) {
            let row = &row[..usable];
            let (top, second) = top2(row);
            let cand = match &self.sampler {
                None => Candidate {
                    token: top,
                    prob: 1.0,
                    dist: None,
                },
                Some(s) => {
                    let dist = normalized(s.distribution(row))?;
                    let (token, prob) = draw(&dist, &mut self.rng);
                    Candidate {
                        token,
                        prob,
                        dist: Some(Arc::from(dist)),
                    }
                }
            };
            self.alts.push(if cand.token == top { second } else { top });
            self.next.push(cand);
        }
        Ok(())
    }
}

/// The two highest-scoring tokens of a logit row (the same token twice for a 1-token row).
fn top2(row: &[f32]) -> (u32, u32) {
    let (mut a, mut b) = (0usize, usize::MAX);
    for (i, &v) in row.iter().enumerate().skip(1) {
        if v > row[a] {
            b = a;
            a = i;
        } else if b == usize::MAX || v > row[b] {
            b = i;
        }
    }
    let b = if b == usize::MAX { a } else { b };
    (a as u32, b as u32)
}

impl Drafter for SpaceDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let n = self
            .k
            .min(req.budget)
            .min(req.max_depth)
            .min(self.next.len());
        let mut b = TreeBuilder::new(req.root());
        let mut at = TreeBuilder::ROOT;
        self.chain.clear();
        for c in &self.next[..n] {
            if c.token as usize >= req.vocab {
                break;
            }
            let proposal = match &c.dist {
                None => Proposal::picked(req.drafter, c.prob),
                Some(d) => {
                    b.set_child_dist(at, req.drafter, d.clone());
                    Proposal::sampled(req.drafter, c.prob, 1)
                }
            };
            at = b.add_child(at, c.token, Some(proposal));
            self.chain.push(c.token);
        }
        Ok(b.build())
    }

    fn placeholders(&mut self, tree: &TokenTree) -> Vec<PlaceholderGroup> {
        // Anchor a group at the root and at each chain node still in the (merged, cut) tree.
        let mut anchors = vec![0usize];
        let mut at = 0;
        for &t in &self.chain {
            match tree.child_with_token(at, t) {
                Some(c) => {
                    anchors.push(c);
                    at = c;
                }
                None => break,
            }
        }
        let root = tree.root_token();
        anchors
            .into_iter()
            .enumerate()
            .map(|(i, anchor)| PlaceholderGroup {
                anchor,
                tokens: self.group_tokens(i, root),
            })
            .collect()
    }

    fn max_placeholder_rows(&self) -> usize {
        self.k * (self.k + 1)
    }

    fn observe(&mut self, group: Option<GroupLogits<'_>>) {
        let ok = match group {
            Some(g) if g.vocab > 0 => self.read_group(g.logits, g.vocab).is_ok(),
            _ => false,
        };
        if !ok {
            self.next.clear();
            self.alts.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::testing::{
        greedy_incremental, greedy_session, max_kv_diff, step_until, tiny_model, TinySpec,
    };

    #[test]
    fn top2_orders_the_best_two() {
        assert_eq!(top2(&[0.1, 3.0, 2.0, -1.0]), (1, 2));
        assert_eq!(top2(&[5.0, 3.0, 4.0]), (0, 2));
        assert_eq!(top2(&[1.0]), (0, 0));
    }

    #[test]
    fn bad_settings_are_errors() {
        let s = DraftSampling::TopK;
        assert!(SpaceDrafter::new(0, SpaceMode::Jacobi, s.clone(), 10, 1).is_err());
        assert!(SpaceDrafter::new(4, SpaceMode::MaskToken(10), s.clone(), 10, 1).is_err());
        assert!(SpaceDrafter::new(4, SpaceMode::MaskToken(9), s, 10, 1).is_ok());
    }

    #[test]
    fn groups_follow_the_paper_layout() {
        let mut d = SpaceDrafter::new(3, SpaceMode::Jacobi, DraftSampling::TopK, 50, 1).unwrap();
        // Logits of a group of 3 rows over a vocab of 50: tops 7, 8, 9; runner-ups 17, 18, 19.
        let mut logits = vec![0.0f32; 3 * 50];
        for j in 0..3 {
            logits[j * 50 + 7 + j] = 5.0;
            logits[j * 50 + 17 + j] = 4.0;
        }
        d.observe(Some(GroupLogits {
            group: 0,
            logits: &logits,
            vocab: 50,
        }));
        let req = DraftRequest {
            tokens: &[1, 2, 3],
            budget: 8,
            max_depth: 8,
            drafter: 0,
            vocab: 50,
        };
        let tree = d.propose(&req).unwrap();
        assert_eq!(tree.path_tokens(tree.len() - 1), vec![3, 7, 8, 9]);
        let groups = d.placeholders(&tree);
        let anchors: Vec<usize> = groups.iter().map(|g| g.anchor).collect();
        assert_eq!(anchors, vec![0, 1, 2, 3]);
        // After the root: runner-up of offset 1, then the tops of offsets 2 and 3.
        assert_eq!(groups[0].tokens, vec![17, 8, 9]);
        assert_eq!(groups[1].tokens, vec![18, 9, 9]);
        assert_eq!(groups[3].tokens, vec![9, 9, 9]);
        let mut m =
            SpaceDrafter::new(2, SpaceMode::MaskToken(42), DraftSampling::TopK, 50, 1).unwrap();
        let t = m.propose(&req).unwrap();
        assert_eq!(t.len(), 1, "no candidates before the first pass");
        assert_eq!(
            m.placeholders(&t),
            vec![PlaceholderGroup {
                anchor: 0,
                tokens: vec![42, 42]
            }]
        );
    }

    /// Greedy SPACE decoding (both modes, several k) equals incremental decoding token for token,
    /// and leaves the KV cache exactly as long as the sequence needs.
    #[test]
    fn greedy_space_equals_incremental() {
        let model = tiny_model(
            &TinySpec {
                vocab: 24,
                ..TinySpec::default()
            },
            8,
        )
        .unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5];
        let n = 40;
        let (_, truth) = greedy_incremental(&model, &be, &prompt, n, 128).unwrap();
        let mut full = prompt.to_vec();
        full.extend(&truth);
        for (k, mode) in [
            (1, SpaceMode::Jacobi),
            (3, SpaceMode::Jacobi),
            (5, SpaceMode::Jacobi),
            (3, SpaceMode::MaskToken(0)),
        ] {
            let mut d = SpaceDrafter::new(k, mode, DraftSampling::TopK, 24, 1).unwrap();
            let mut s = greedy_session(&model, &be, &prompt, truth[0], 16).unwrap();
            step_until(&mut s, &mut [&mut d], full.len(), 8).unwrap();
            assert_eq!(&s.tokens()[..full.len()], &full[..], "k {k} {mode:?}");
            assert_eq!(s.cache().len() + 1, s.tokens().len());
            if mode == SpaceMode::Jacobi && k >= 3 {
                let m = s.metrics();
                assert!(
                    m.accepted > 0,
                    "Jacobi candidates accepted sometimes: {m:?}"
                );
            }
        }
    }

    /// The KV cache after SPACE steps equals incremental decoding's (placeholders never leak in).
    #[test]
    fn space_kv_equals_incremental_kv() {
        let model = tiny_model(
            &TinySpec {
                arch: "qwen2",
                vocab: 24,
                ..TinySpec::default()
            },
            5,
        )
        .unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [1u32, 2, 3, 4];
        let (_, truth) = greedy_incremental(&model, &be, &prompt, 30, 128).unwrap();
        let mut s = greedy_session(&model, &be, &prompt, truth[0], 16).unwrap();
        let mut d = SpaceDrafter::new(4, SpaceMode::Jacobi, DraftSampling::TopK, 24, 1).unwrap();
        for _ in 0..6 {
            s.step(&mut [&mut d], 8).unwrap();
        }
        let fed = s.tokens().len() - 1 - prompt.len();
        let (want, _) = greedy_incremental(&model, &be, &prompt, fed, 128).unwrap();
        let d = max_kv_diff(s.cache(), &want, model.config.n_layers);
        assert!(d <= 1e-5, "K/V differ from incremental decoding by {d}");
    }
}
