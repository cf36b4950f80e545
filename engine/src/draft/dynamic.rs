//! Draft tree shapes: fixed expansion configs (SpecInfer) or dynamic trees grown by cumulative path probability within a node budget (EAGLE-2, Li et al. 2024).

use std::fmt;
use std::str::FromStr;

use crate::error::{EngineError, Result};
use crate::tree::ExpansionConfig;

/// How a model drafter shapes its tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DraftShape {
    /// A branch factor per depth (top-k or sampled children).
    Expand(ExpansionConfig),
    /// EAGLE-2's dynamic tree: at each depth the `beam` best children (by the drafter's
    /// cumulative path probability) of the previous depth's kept nodes are kept and expanded,
    /// down to `depth`; the tree is then cut to the `budget` most probable nodes.
    Dynamic {
        budget: usize,
        beam: usize,
        depth: usize,
    },
}

impl DraftShape {
    /// Default beam width and depth of `dynamic:N`.
    pub const BEAM: usize = 4;
    pub const DEPTH: usize = 8;

    pub fn depth(&self) -> usize {
        match self {
            DraftShape::Expand(c) => c.depth(),
            DraftShape::Dynamic { depth, .. } => *depth,
        }
    }

    /// Most draft nodes a tree of this shape has.
    pub fn max_nodes(&self) -> usize {
        match self {
            DraftShape::Expand(c) => c.max_nodes(),
            DraftShape::Dynamic { budget, .. } => *budget,
        }
    }

    pub fn is_dynamic(&self) -> bool {
        matches!(self, DraftShape::Dynamic { .. })
    }
}

impl FromStr for DraftShape {
    type Err = EngineError;

    /// `1,1,3,1` (an expansion config) or `dynamic:N[:BEAM[:DEPTH]]`.
    fn from_str(s: &str) -> Result<DraftShape> {
        let Some(rest) = s.trim().strip_prefix("dynamic:") else {
            return Ok(DraftShape::Expand(s.parse()?));
        };
        let bad = || {
            EngineError::InvalidArgument(format!(
                "tree '{s}': expected dynamic:N[:BEAM[:DEPTH]] with positive integers"
            ))
        };
        let nums = rest
            .split(':')
            .map(|x| x.trim().parse::<usize>().map_err(|_| bad()))
            .collect::<Result<Vec<_>>>()?;
        if nums.is_empty() || nums.len() > 3 || nums.contains(&0) {
            return Err(bad());
        }
        Ok(DraftShape::Dynamic {
            budget: nums[0],
            beam: nums.get(1).copied().unwrap_or(Self::BEAM),
            depth: nums.get(2).copied().unwrap_or(Self::DEPTH),
        })
    }
}

impl fmt::Display for DraftShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DraftShape::Expand(c) => write!(f, "{c}"),
            DraftShape::Dynamic {
                budget,
                beam,
                depth,
            } => write!(f, "dynamic:{budget}:{beam}:{depth}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_configs_and_dynamic_budgets() {
        let s: DraftShape = "1,1,3".parse().unwrap();
        assert_eq!(s.depth(), 3);
        assert_eq!(s.max_nodes(), 5);
        let d: DraftShape = "dynamic:64".parse().unwrap();
        assert_eq!(
            d,
            DraftShape::Dynamic {
                budget: 64,
                beam: 4,
                depth: 8
            }
        );
        assert_eq!(d.to_string().parse::<DraftShape>().unwrap(), d);
        assert_eq!("dynamic:10:2:5".parse::<DraftShape>().unwrap().depth(), 5);
        for bad in [
            "dynamic:",
            "dynamic:0",
            "dynamic:x",
            "dynamic:1:2:3:4",
            "1,0",
        ] {
            assert!(bad.parse::<DraftShape>().is_err(), "{bad}");
        }
    }
}
