//! Logit bias, repetition penalty (Keskar et al. 2019, CTRL) and the OpenAI API's frequency and presence penalties, applied to a row's logits before temperature and truncation as vLLM does; a tree row sees its own path.
//!
//! A logit bias adds a fixed value to chosen tokens' logits (first, as vLLM's order).
//!
//! For a token `t` seen `c` times in the generated tokens (`in_prompt` when the prompt holds it):
//! the repetition penalty `r` divides a positive logit by `r` and multiplies a negative one by
//! `r` when `in_prompt || c > 0`; then `frequency * c + presence * (c > 0)` is subtracted. A row
//! of a token tree predicts the token after its node, so its history is the request's plus the
//! draft tokens on the node's path: verifying a tree then gives each row exactly the logits
//! that decoding token by token would have penalized, and greedy outputs stay identical.

use std::collections::HashMap;

use crate::error::{EngineError, Result};
use crate::sample::json::JsonConstraint;
use crate::tree::TokenTree;

/// How strongly to discourage tokens the request has already seen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalties {
    /// Divides positive (multiplies negative) logits of tokens in the prompt or the output;
    /// 1.0 disables, above 1 discourages repeats.
    pub repetition: f32,
    /// Subtracted once per occurrence in the output (OpenAI `frequency_penalty`, -2 to 2).
    pub frequency: f32,
    /// Subtracted once from every token the output holds (OpenAI `presence_penalty`, -2 to 2).
    pub presence: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties {
            repetition: 1.0,
            frequency: 0.0,
            presence: 0.0,
        }
    }
}

impl Penalties {
    /// Whether these penalties leave every logit as it is.
    pub fn is_off(&self) -> bool {
        self.repetition == 1.0 && self.frequency == 0.0 && self.presence == 0.0
    }

    /// Reject values no request could mean: the ranges of vLLM and the OpenAI API.
    pub fn validate(&self) -> Result<()> {
        // Below 0.01 a positive logit divided by it overflows toward infinity.
        if !(0.01..=100.0).contains(&self.repetition) {
            return Err(EngineError::InvalidArgument(format!(
                "repetition_penalty must be in [0.01, 100], got {}",
                self.repetition
            )));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency),
            ("presence_penalty", self.presence),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(EngineError::InvalidArgument(format!(
                    "{name} must be in [-2, 2], got {v}"
                )));
            }
        }
        Ok(())
    }

    /// One logit after the penalties of a token the prompt holds (`in_prompt`) and the output
    /// holds `count` times.
    pub fn apply(&self, logit: f32, in_prompt: bool, count: u32) -> f32 {
        let mut l = logit;
        if self.repetition != 1.0 && (in_prompt || count > 0) {
            l = if l > 0.0 {
                l / self.repetition
            } else {
                l * self.repetition
            };
        }
        if count > 0 {
            l -= self.frequency * count as f32 + self.presence;
        }
        l
    }
}

/// A token the request has seen.
#[derive(Clone, Copy, Debug)]
struct Seen {
    token: u32,
    in_prompt: bool,
    /// Occurrences in the generated tokens.
    count: u32,
}

/// Most tokens one request may bias (OpenAI's bound).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Reject biases no request could mean: at most [`MAX_LOGIT_BIAS`] tokens, each inside the
/// vocabulary and once, each value finite in [-100, 100] (OpenAI's range).
pub fn validate_logit_bias(bias: &[(u32, f32)], vocab: usize) -> Result<()> {
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(EngineError::InvalidArgument(format!(
            "logit_bias holds {} tokens; at most {MAX_LOGIT_BIAS}",
            bias.len()
        )));
    }
    for (i, &(t, b)) in bias.iter().enumerate() {
        if t as usize >= vocab {
            return Err(EngineError::InvalidArgument(format!(
                "logit_bias token {t} is outside the vocabulary (size {vocab})"
            )));
        }
        if !(-100.0..=100.0).contains(&b) {
            return Err(EngineError::InvalidArgument(format!(
                "logit_bias of token {t} must be in [-100, 100], got {b}"
            )));
        }
        if bias[..i].iter().any(|e| e.0 == t) {
            return Err(EngineError::InvalidArgument(format!(
                "logit_bias names token {t} twice"
            )));
        }
    }
    Ok(())
}

/// One request's logit bias, its penalties and the tokens they weigh: the prompt's (when the
/// repetition penalty reads them) and the generated ones, with counts.
#[derive(Clone, Debug)]
pub struct PenaltyHistory {
    penalties: Penalties,
    /// (token, added to its logit) before the penalties.
    bias: Vec<(u32, f32)>,
    seen: Vec<Seen>,
    /// Token -> its entry of `seen`.
    index: HashMap<u32, usize>,
    /// JSON mode: masks every token that cannot continue the object, after the penalties.
    json: Option<JsonConstraint>,
}

impl PenaltyHistory {
    /// The history of a request about to generate after `prompt`.
    pub fn new(penalties: Penalties, prompt: &[u32]) -> PenaltyHistory {
        let mut h = PenaltyHistory {
            penalties,
            bias: Vec::new(),
            seen: Vec::new(),
            index: HashMap::new(),
            json: None,
        };
        // Only the repetition penalty reads the prompt.
        if penalties.repetition != 1.0 {
            for &t in prompt {
                let i = h.entry(t);
                h.seen[i].in_prompt = true;
            }
        }
        h
    }

    /// Add `bias` ((token, value) pairs, validated by [`validate_logit_bias`]) to the logits
    /// before the penalties.
    pub fn with_bias(mut self, bias: &[(u32, f32)]) -> PenaltyHistory {
        self.bias = bias.to_vec();
        self
    }

    /// Mask the rows by `json` (JSON mode) after the bias and penalties.
    pub fn with_json(mut self, json: Option<JsonConstraint>) -> PenaltyHistory {
        self.json = json;
        self
    }

    fn entry(&mut self, token: u32) -> usize {
        let seen = &mut self.seen;
        *self.index.entry(token).or_insert_with(|| {
            seen.push(Seen {
                token,
                in_prompt: false,
                count: 0,
            });
            seen.len() - 1
        })
    }

    /// Count a generated token.
    pub fn push(&mut self, token: u32) {
        if let Some(j) = self.json.as_mut() {
            j.push(token);
        }
        if self.penalties.is_off() {
            return; // a bias alone reads no history
        }
        let i = self.entry(token);
        self.seen[i].count += 1;
    }

    /// Penalize `row` (`[vocab]` logits) for this history followed by the generated tokens
    /// `path` (a tree row's draft tokens; empty for a plain row). Tokens outside the row are
    /// skipped (a tree is validated against the vocabulary before it is verified).
    pub fn penalize_row(&self, row: &mut [f32], path: &[u32]) {
        for &(t, b) in &self.bias {
            if let Some(l) = row.get_mut(t as usize) {
                *l += b;
            }
        }
        self.apply_penalties(row, path);
        if let Some(j) = &self.json {
            j.mask_row(row, path);
        }
    }

    fn apply_penalties(&self, row: &mut [f32], path: &[u32]) {
        let p = self.penalties;
        if p.is_off() {
            return;
        }
        // The path's distinct tokens with their counts and, for seen ones, their entry.
        let mut extra: Vec<(u32, u32, Option<usize>)> = Vec::with_capacity(path.len());
        for &t in path {
            match extra.iter_mut().find(|e| e.0 == t) {
                Some(e) => e.1 += 1,
                None => extra.push((t, 1, self.index.get(&t).copied())),
            }
        }
        let mut skip: Vec<usize> = extra.iter().filter_map(|e| e.2).collect();
        skip.sort_unstable();
        let mut next_skip = skip.iter().copied().peekable();
        for (i, s) in self.seen.iter().enumerate() {
            if next_skip.peek() == Some(&i) {
                next_skip.next();
                continue;
            }
            if let Some(l) = row.get_mut(s.token as usize) {
                *l = p.apply(*l, s.in_prompt, s.count);
            }
        }
        for &(t, c, at) in &extra {
            let (in_prompt, count) = at.map_or((false, 0), |i| {
                let s = &self.seen[i];
                (s.in_prompt, s.count)
            });
            if let Some(l) = row.get_mut(t as usize) {
                *l = p.apply(*l, in_prompt, count + c);
            }
        }
    }

    /// Penalize every row of `logits` (`[tree.len(), vocab]`, row `i` node `i`'s): this
    /// history (whose last generated token is the root) followed by the node's path below the
    /// root.
    pub fn penalize_tree(&self, tree: &TokenTree, logits: &mut [f32], vocab: usize) {
        let rows = logits.chunks_exact_mut(vocab).take(tree.len());
        if self.penalties.is_off() && self.json.is_none() {
            // A bias alone reads no path.
            rows.for_each(|row| self.penalize_row(row, &[]));
            return;
        }
        for (i, row) in rows.enumerate() {
            // The root (already in the history) first, then the path below it.
            self.penalize_row(row, &tree.path_tokens(i)[1..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::TreeBuilder;

    /// The rule written out over dense counts: the reference.
    fn reference(p: &Penalties, row: &[f32], prompt: &[u32], output: &[u32]) -> Vec<f32> {
        let mut out = row.to_vec();
        for (t, l) in out.iter_mut().enumerate() {
            let t = t as u32;
            let in_prompt = prompt.contains(&t);
            let c = output.iter().filter(|&&x| x == t).count() as f32;
            if p.repetition != 1.0 && (in_prompt || c > 0.0) {
                *l = if *l > 0.0 {
                    *l / p.repetition
                } else {
                    *l * p.repetition
                };
            }
            if c > 0.0 {
                *l -= p.frequency * c + p.presence;
            }
        }
        out
    }

    fn row(vocab: usize, salt: u32) -> Vec<f32> {
        (0..vocab as u32)
            .map(|i| ((i * 37 + salt * 11) % 23) as f32 * 0.5 - 5.0)
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn rows_follow_the_rule_for_prompt_output_and_path_tokens() {
        let vocab = 32;
        let prompt = [3u32, 4, 4, 9, 20];
        let output = [4u32, 7, 7, 7, 21];
        for p in [
            Penalties {
                repetition: 1.3,
                ..Penalties::default()
            },
            Penalties {
                frequency: 0.4,
                ..Penalties::default()
            },
            Penalties {
                presence: -0.7,
                ..Penalties::default()
            },
            Penalties {
                repetition: 0.8,
                frequency: -0.3,
                presence: 1.5,
            },
        ] {
            let mut h = PenaltyHistory::new(p, &prompt);
            for &t in &output {
                h.push(t);
            }
            for path in [&[][..], &[7, 9, 30, 30, 4][..], &[0, 31][..]] {
                let mut r = row(vocab, path.len() as u32);
                let mut all = output.to_vec();
                all.extend_from_slice(path);
                let want = reference(&p, &r, &prompt, &all);
                h.penalize_row(&mut r, path);
                assert_eq!(bits(&r), bits(&want), "{p:?} path {path:?}");
            }
        }
        // A bias comes first, then the penalties (a biased token may change sign).
        let p = Penalties {
            repetition: 2.0,
            frequency: 0.5,
            ..Penalties::default()
        };
        let mut h = PenaltyHistory::new(p, &[1, 2]).with_bias(&[(1, 3.0), (3, -1.5), (2, 0.0)]);
        h.push(1);
        let mut r = vec![0.5, -1.0, -4.0, 1.0];
        h.penalize_row(&mut r, &[3]);
        let want = [
            0.5,
            (-1.0f32 + 3.0) / 2.0 - 0.5,
            -8.0,
            (1.0f32 - 1.5) * 2.0 - 0.5,
        ];
        assert_eq!(bits(&r), bits(&want));
        // A bias alone keeps no history and leaves the other tokens alone.
        let mut h = PenaltyHistory::new(Penalties::default(), &[1, 2]).with_bias(&[(0, -100.0)]);
        h.push(3);
        let mut r = vec![1.0, 1.0, 1.0, 1.0];
        h.penalize_row(&mut r, &[3, 3]);
        assert_eq!(r, vec![-99.0, 1.0, 1.0, 1.0]);
        // A positive logit of a repeated token goes down, a negative one further down.
        let p = Penalties {
            repetition: 2.0,
            ..Penalties::default()
        };
        let h = PenaltyHistory::new(p, &[1, 2]);
        let mut r = vec![4.0, 4.0, -4.0, -4.0];
        h.penalize_row(&mut r, &[]);
        assert_eq!(r, vec![4.0, 2.0, -8.0, -4.0]);
    }

    /// Each tree row is the row of its node's path appended to the history, whatever the
    /// tree's shape (siblings, repeated tokens on one path, the root's own row).
    #[test]
    fn tree_rows_see_their_own_paths() {
        let vocab = 16;
        let p = Penalties {
            repetition: 1.5,
            frequency: 0.25,
            presence: 0.5,
        };
        let prompt = [1u32, 2, 3];
        let mut h = PenaltyHistory::new(p, &prompt);
        for t in [5u32, 6, 5] {
            h.push(t);
        }
        // root 5 -> {6 -> {6, 7}, 2 -> 5 -> 5}
        let mut b = TreeBuilder::new(5);
        let a = b.add_child(0, 6, None);
        b.add_child(a, 6, None);
        b.add_child(a, 7, None);
        let c = b.add_child(0, 2, None);
        let d = b.add_child(c, 5, None);
        b.add_child(d, 5, None);
        let tree = b.build();
        let mut logits: Vec<f32> = (0..tree.len() as u32).flat_map(|i| row(vocab, i)).collect();
        let raw = logits.clone();
        h.penalize_tree(&tree, &mut logits, vocab);
        for i in 0..tree.len() {
            let mut alone = h.clone();
            for j in tree.path(i) {
                alone.push(tree.node(j).token);
            }
            let mut want = raw[i * vocab..(i + 1) * vocab].to_vec();
            alone.penalize_row(&mut want, &[]);
            assert_eq!(
                bits(&logits[i * vocab..(i + 1) * vocab]),
                bits(&want),
                "row {i}"
            );
        }
        // The path counts: row 2 (path 6, 6) is not the history's row.
        let mut plain = raw[2 * vocab..3 * vocab].to_vec();
        h.penalize_row(&mut plain, &[]);
        assert_ne!(bits(&logits[2 * vocab..3 * vocab]), bits(&plain));
    }

    #[test]
    fn logit_biases_out_of_range_are_rejected() {
        assert!(validate_logit_bias(&[(0, -100.0), (9, 100.0)], 10).is_ok());
        assert!(validate_logit_bias(&[(10, 1.0)], 10).is_err());
        assert!(validate_logit_bias(&[(1, 100.5)], 10).is_err());
        assert!(validate_logit_bias(&[(1, f32::NAN)], 10).is_err());
        assert!(validate_logit_bias(&[(1, 1.0), (1, 2.0)], 10).is_err());
        let many: Vec<(u32, f32)> = (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect();
        assert!(validate_logit_bias(&many, 1000).is_err());
        assert!(validate_logit_bias(&many[1..], 1000).is_ok());
    }

    #[test]
    fn penalties_out_of_range_are_rejected() {
        assert!(Penalties::default().validate().is_ok());
        assert!(Penalties::default().is_off());
        for bad in [
            Penalties {
                repetition: 0.0,
                ..Penalties::default()
            },
            Penalties {
                repetition: f32::NAN,
                ..Penalties::default()
            },
            Penalties {
                repetition: 1e-39,
                ..Penalties::default()
            },
            Penalties {
                frequency: 2.5,
                ..Penalties::default()
            },
            Penalties {
                presence: f32::NAN,
                ..Penalties::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
            assert!(!bad.is_off());
        }
    }
}
