//! Prompt-lookup decoding (Saxena 2023; n-gram drafting): match the latest n tokens earlier in the prompt and output and propose what followed; several matches become branches of one trie.

use super::{DraftRequest, Drafter};
use crate::error::{EngineError, Result};
use crate::tree::{Proposal, TokenTree, TreeBuilder};

/// Prompt-lookup drafter settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NgramDrafter {
    /// Longest suffix matched (tried first).
    pub max_n: usize,
    /// Shortest suffix matched.
    pub min_n: usize,
    /// Most continuation tokens proposed per match.
    pub max_len: usize,
    /// Most matches (branches) per proposal.
    pub max_matches: usize,
    /// Most continuation tokens proposed after a match of a single token (weak evidence: each
    /// extra row costs part of a verification pass and is rarely accepted).
    pub single_token_len: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        NgramDrafter {
            max_n: 3,
            min_n: 1,
            max_len: 8,
            max_matches: 3,
            single_token_len: 2,
        }
    }
}

impl NgramDrafter {
    pub fn new(max_n: usize, min_n: usize, max_len: usize, max_matches: usize) -> Result<Self> {
        if min_n == 0 || max_n < min_n || max_len == 0 || max_matches == 0 {
            return Err(EngineError::InvalidArgument(format!(
                "n-gram drafter needs 1 <= min_n <= max_n and positive lengths \
                 (got n {min_n}..={max_n}, length {max_len}, matches {max_matches})"
            )));
        }
        Ok(NgramDrafter {
            max_n,
            min_n,
            max_len,
            max_matches,
            single_token_len: NgramDrafter::default().single_token_len,
        })
    }

    /// Continuations of the latest n-grams, longest n first, most recent match first; distinct.
    pub fn continuations(&self, seq: &[u32], max_len: usize) -> Vec<Vec<u32>> {
        self.matches(seq, max_len)
            .into_iter()
            .map(|(c, _)| c)
            .collect()
    }

    /// `continuations` with the length n of the n-gram each one follows.
    fn matches(&self, seq: &[u32], max_len: usize) -> Vec<(Vec<u32>, usize)> {
        let mut out: Vec<(Vec<u32>, usize)> = Vec::new();
        let len = seq.len();
        for n in (self.min_n..=self.max_n).rev() {
            if len <= n {
                continue;
            }
            let suffix = &seq[len - n..];
            // Occurrences ending before the suffix itself, latest first.
            for i in (0..len - n).rev() {
                if &seq[i..i + n] != suffix {
                    continue;
                }
                let start = i + n;
                let cont = seq[start..(start + max_len).min(len)].to_vec();
                if !cont.is_empty() && !out.iter().any(|(c, _)| c.starts_with(&cont)) {
                    out.push((cont, n));
                    if out.len() >= self.max_matches {
                        return out;
                    }
                }
            }
        }
        out
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }

    fn reproposes_cheaply(&self) -> bool {
        true
    }

    /// One branch per match, each at most `max_len` deep.
    fn max_nodes(&self, max_depth: usize) -> usize {
        self.max_matches.saturating_mul(self.max_len.min(max_depth))
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let root = req.root();
        let mut b = TreeBuilder::new(root);
        let mut remaining = req.budget;
        let max_len = self.max_len.min(req.max_depth);
        if max_len == 0 || req.tokens.is_empty() {
            return Ok(b.build());
        }
        for (rank, (cont, n)) in self.matches(req.tokens, max_len).into_iter().enumerate() {
            let mut at = TreeBuilder::ROOT;
            let len = if n == 1 {
                self.single_token_len
            } else {
                max_len
            };
            for &t in cont.iter().take(len) {
                if t as usize >= req.vocab {
                    break;
                }
                if remaining == 0 {
                    return Ok(b.build());
                }
                let before = b.len();
                at = b.add_child(
                    at,
                    t,
                    Some(Proposal::picked(req.drafter, 1.0 / (rank + 1) as f32)),
                );
                if b.len() > before {
                    remaining -= 1;
                }
            }
        }
        Ok(b.build())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(tokens: &[u32], budget: usize) -> DraftRequest<'_> {
        DraftRequest {
            tokens,
            budget,
            max_depth: 16,
            drafter: 0,
            vocab: 100,
        }
    }

    #[test]
    fn proposes_what_followed_earlier_matches_as_branches() {
        // "1 2 3 4 5 ... 1 2 3 9 ... 1 2 3": the suffix [1 2 3] matched twice.
        let seq = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 9, 8, 1, 2, 3];
        let mut d = NgramDrafter::new(3, 1, 4, 4).unwrap();
        let conts = d.continuations(&seq, 4);
        assert_eq!(conts[0], vec![9, 8, 1, 2]);
        assert_eq!(conts[1], vec![4, 5, 6, 7]);
        let t = d.propose(&req(&seq, 64)).unwrap();
        t.validate(100).unwrap();
        assert_eq!(t.root_token(), 3);
        let first: Vec<u32> = t.children(0).iter().map(|&c| t.node(c).token).collect();
        assert!(first.contains(&9) && first.contains(&4), "{first:?}");
        // Budget respected; the first (latest, longest) match comes first.
        let t = d.propose(&req(&seq, 3)).unwrap();
        assert_eq!(t.n_draft(), 3);
        assert_eq!(t.path_tokens(3), vec![3, 9, 8, 1]);
        // No match: root only. Short sequences are fine.
        assert_eq!(d.propose(&req(&[5, 6, 7], 8)).unwrap().n_draft(), 0);
        assert_eq!(d.propose(&req(&[5], 8)).unwrap().n_draft(), 0);
        // A match of a single token proposes `single_token_len` tokens only.
        let seq = [4, 1, 2, 3, 5, 6, 7, 9, 4];
        let t = d.propose(&req(&seq, 64)).unwrap();
        assert_eq!(t.n_draft(), 2);
        assert_eq!(t.path_tokens(2), vec![4, 1, 2]);
        d.single_token_len = 4;
        assert_eq!(
            d.propose(&req(&seq, 64)).unwrap().path_tokens(4),
            vec![4, 1, 2, 3, 5]
        );
        assert!(NgramDrafter::new(0, 1, 1, 1).is_err());
        assert!(NgramDrafter::new(2, 3, 1, 1).is_err());
    }
}
