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
    /// EAGLE-2's dynamic tree: each expanded node contributes its `beam` most probable
    /// children, and of a depth's `beam × beam` children the `beam` best (by the drafter's
    /// cumulative path probability) are expanded next, down to `depth`. Every child stays a
    /// candidate: the tree is the `budget` most probable of all of them (at most
    /// [`DraftShape::capacity`], which `budget` may not exceed).
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

    /// Most draft nodes the shape can produce before any budget: an expansion config's full
    /// tree; for a dynamic tree the candidates it ranks, `beam` at depth 1 and `beam × beam`
    /// at each depth below.
    pub fn capacity(&self) -> usize {
        self.capacity_within(self.depth())
    }

    /// [`DraftShape::capacity`] of the shape's first `depth` depths.
    fn capacity_within(&self, depth: usize) -> usize {
        match self {
            DraftShape::Expand(c) => c.max_nodes_within(depth),
            DraftShape::Dynamic { beam, .. } => match depth {
                0 => 0,
                d => (d - 1)
                    .saturating_mul(beam.saturating_mul(*beam))
                    .saturating_add(*beam),
            },
        }
    }

    /// A dynamic tree's budget must be positive and within what its beam and depth can fill
    /// (otherwise `dynamic:N` would silently yield fewer nodes); beam and depth positive.
    pub fn validate(&self) -> Result<()> {
        if let DraftShape::Dynamic {
            budget,
            beam,
            depth,
        } = *self
        {
            if budget == 0 || beam == 0 || depth == 0 {
                return Err(EngineError::InvalidArgument(format!(
                    "tree '{self}': budget, beam and depth must be positive"
                )));
            }
            let cap = self.capacity();
            if budget > cap {
                return Err(EngineError::InvalidArgument(format!(
                    "tree '{self}': a beam of {beam} over {depth} depths ranks at most {cap} \
                     nodes ({beam} + {} x {beam}^2), fewer than the budget of {budget}; lower \
                     the budget or raise the beam or the depth",
                    depth - 1
                )));
            }
        }
        Ok(())
    }

    /// Most draft nodes a tree of this shape has.
    pub fn max_nodes(&self) -> usize {
        self.max_nodes_within(self.depth())
    }

    /// Most draft nodes a tree of this shape has in its first `depth` depths.
    pub fn max_nodes_within(&self, depth: usize) -> usize {
        match self {
            DraftShape::Expand(_) => self.capacity_within(depth),
            DraftShape::Dynamic { budget, .. } => self.capacity_within(depth).min(*budget),
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
        let shape = DraftShape::Dynamic {
            budget: nums[0],
            beam: nums.get(1).copied().unwrap_or(Self::BEAM),
            depth: nums.get(2).copied().unwrap_or(Self::DEPTH),
        };
        shape.validate()?;
        Ok(shape)
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
        let within = |s: &DraftShape| (0..5).map(|d| s.max_nodes_within(d)).collect::<Vec<_>>();
        assert_eq!(within(&s), [0, 1, 2, 5, 5]);
        // A dynamic tree: its `beam` candidates at depth 1, `beam²` more per depth, at most its
        // budget.
        assert_eq!(
            within(&"dynamic:12:3:6".parse().unwrap()),
            [0, 3, 12, 12, 12]
        );
        assert_eq!(
            within(&"dynamic:30:3:6".parse().unwrap()),
            [0, 3, 12, 21, 30]
        );
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
        // 4 + 7 x 16 = 116 candidates; 2 + 4 x 4 = 18.
        assert_eq!(d.capacity(), 116);
        assert!("dynamic:116".parse::<DraftShape>().is_ok());
        let e = "dynamic:117".parse::<DraftShape>().unwrap_err().to_string();
        assert!(e.contains("at most 116"), "{e}");
        assert_eq!(
            "dynamic:18:2:5".parse::<DraftShape>().unwrap().capacity(),
            18
        );
        assert!("dynamic:19:2:5".parse::<DraftShape>().is_err());
        assert!("dynamic:2:1:2".parse::<DraftShape>().is_ok());
        assert!("dynamic:3:1:2".parse::<DraftShape>().is_err());
        let big = DraftShape::Dynamic {
            budget: usize::MAX,
            beam: usize::MAX,
            depth: usize::MAX,
        };
        assert_eq!(big.capacity(), usize::MAX);
        assert!(big.validate().is_ok());
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
