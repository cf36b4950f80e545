//! Expansion-based token tree construction (SpecInfer §3): a branch factor per depth, top-k or sampled children.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use super::{DrafterId, Proposal, TokenTree, TreeBuilder};
use crate::error::{EngineError, Result};
use crate::sample::Rng;

/// Branch factors per depth: `[1,1,3,1,1,1,1,1]` takes the drafter's best child at depths 1 and 2,
/// three children of the depth-2 node, then one child of every node down to depth 8.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpansionConfig {
    branches: Vec<usize>,
}

impl ExpansionConfig {
    /// Every factor must be at least 1 (an empty config is a root-only tree).
    pub fn new(branches: Vec<usize>) -> Result<ExpansionConfig> {
        if branches.contains(&0) {
            return Err(EngineError::InvalidArgument(
                "expansion branch factors must be >= 1".into(),
            ));
        }
        Ok(ExpansionConfig { branches })
    }

    /// The configuration of the SpecInfer paper, `[1,1,3,1,1,1,1,1]`.
    pub fn specinfer() -> ExpansionConfig {
        ExpansionConfig {
            branches: vec![1, 1, 3, 1, 1, 1, 1, 1],
        }
    }

    /// A chain (sequence speculation) of `depth` tokens.
    pub fn chain(depth: usize) -> ExpansionConfig {
        ExpansionConfig {
            branches: vec![1; depth],
        }
    }

    pub fn branches(&self) -> &[usize] {
        &self.branches
    }

    pub fn depth(&self) -> usize {
        self.branches.len()
    }

    /// Draft nodes of the full expansion (saturating).
    pub fn max_nodes(&self) -> usize {
        self.max_nodes_within(self.depth())
    }

    /// Draft nodes of the expansion's first `depth` levels (saturating).
    pub fn max_nodes_within(&self, depth: usize) -> usize {
        let mut level = 1usize;
        let mut total = 0usize;
        for &b in self.branches.iter().take(depth) {
            level = level.saturating_mul(b);
            total = total.saturating_add(level);
        }
        total
    }
}

impl FromStr for ExpansionConfig {
    type Err = EngineError;

    /// Parses `"1,1,3,1"` (also accepts brackets and spaces: `"[1, 1, 3]"`).
    fn from_str(s: &str) -> Result<ExpansionConfig> {
        let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
        if inner.trim().is_empty() {
            return ExpansionConfig::new(Vec::new());
        }
        let branches = inner
            .split(',')
            .map(|x| {
                x.trim().parse::<usize>().map_err(|_| {
                    EngineError::InvalidArgument(format!(
                        "expansion config '{s}': '{x}' is not a branch factor"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        ExpansionConfig::new(branches)
    }
}

impl fmt::Display for ExpansionConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.branches.iter().map(|b| b.to_string()).collect();
        write!(f, "[{}]", parts.join(","))
    }
}

/// How children are chosen from the drafter's distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpandMode {
    /// The k most likely tokens (recorded as picked; right for greedy, still lossless under MSS).
    TopK,
    /// k independent draws (duplicates merge into one node with a draw count); the distribution is
    /// recorded at the parent so MSS can use it.
    Sample,
}

/// Expand a tree from `root` level by level. `dist_at(path)` gives the drafter's next-token
/// distribution after `path` (tokens from the root, included, to the node). `budget` caps the
/// draft nodes (top-k) or draws (sampling; fixed before the draws, so sampled candidates stay
/// unbiased); `max_depth` caps the depth below the config's.
#[allow(clippy::too_many_arguments)]
pub fn expand(
    config: &ExpansionConfig,
    root: u32,
    drafter: DrafterId,
    mode: ExpandMode,
    budget: usize,
    max_depth: usize,
    rng: &mut Rng,
    mut dist_at: impl FnMut(&[u32]) -> Result<Vec<(u32, f32)>>,
) -> Result<TokenTree> {
    let mut b = TreeBuilder::new(root);
    let mut remaining = budget;
    let mut frontier = vec![TreeBuilder::ROOT];
    for &k in config.branches.iter().take(max_depth) {
        let mut next = Vec::new();
        for &node in &frontier {
            if remaining == 0 {
                break;
            }
            let dist = normalized(dist_at(&b.path_tokens(node))?)?;
            let n = k.min(remaining);
            match mode {
                ExpandMode::TopK => {
                    let mut sorted = dist;
                    sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    for &(tok, p) in sorted.iter().filter(|x| x.1 > 0.0).take(n) {
                        let before = b.len();
                        let id = b.add_child(node, tok, Some(Proposal::picked(drafter, p)));
                        if b.len() > before {
                            next.push(id);
                            remaining -= 1;
                        }
                    }
                }
                ExpandMode::Sample => {
                    for _ in 0..n {
                        let (tok, p) = draw(&dist, rng);
                        let before = b.len();
                        let id = b.add_child(node, tok, Some(Proposal::sampled(drafter, p, 1)));
                        if b.len() > before {
                            next.push(id);
                        }
                    }
                    remaining -= n;
                    b.set_child_dist(node, drafter, Arc::from(dist));
                }
            }
        }
        frontier = next;
    }
    Ok(b.build())
}

/// Check and normalize a drafter's distribution (non-empty, finite, non-negative, positive mass);
/// repeated tokens are summed, the result is sorted by token.
pub(crate) fn normalized(mut dist: Vec<(u32, f32)>) -> Result<Vec<(u32, f32)>> {
    let sum: f64 = dist.iter().map(|d| d.1 as f64).sum();
    let bad = |p: f32| !p.is_finite() || p < 0.0;
    if dist.is_empty() || dist.iter().any(|d| bad(d.1)) || sum.is_nan() || sum <= 0.0 {
        return Err(EngineError::InvalidArgument(
            "drafter distribution must be non-empty with finite, non-negative mass".into(),
        ));
    }
    dist.sort_by_key(|d| d.0);
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(dist.len());
    for (tok, p) in dist {
        let p = (p as f64 / sum) as f32;
        match out.last_mut() {
            Some(last) if last.0 == tok => last.1 += p,
            _ => out.push((tok, p)),
        }
    }
    Ok(out)
}

/// One draw from a normalized sparse distribution.
pub(crate) fn draw(dist: &[(u32, f32)], rng: &mut Rng) -> (u32, f32) {
    let total: f64 = dist.iter().map(|d| d.1 as f64).sum();
    let mut u = rng.next_f64() * total;
    for &(tok, p) in dist {
        u -= p as f64;
        if u < 0.0 && p > 0.0 {
            return (tok, p);
        }
    }
    dist.iter()
        .rev()
        .find(|d| d.1 > 0.0)
        .copied()
        .unwrap_or(dist[0])
}
