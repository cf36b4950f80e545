//! Tree attention masks (SpecInfer's topology-aware causal mask) as row-major ancestor bitsets of any width.

use super::TokenTree;
use crate::backend::BatchMask;

/// Row `i` has bit `j` set when tree node `j` is node `i` or one of its ancestors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeMask {
    n: usize,
    words_per_row: usize,
    bits: Vec<u64>, // [n, words_per_row]
}

impl TreeMask {
    /// Build from a tree whose parents precede their children (every `TokenTree`).
    pub fn from_tree(tree: &TokenTree) -> TreeMask {
        let parents: Vec<Option<usize>> = tree.nodes().iter().map(|n| n.parent).collect();
        Self::from_parents(&parents)
    }

    /// Build from parent links (`parents[i] < i` or `None`); a row is its parent's row plus itself.
    pub fn from_parents(parents: &[Option<usize>]) -> TreeMask {
        let n = parents.len();
        let words_per_row = n.div_ceil(64).max(1);
        let mut bits = vec![0u64; n * words_per_row];
        for (i, p) in parents.iter().enumerate() {
            if let Some(p) = *p {
                debug_assert!(p < i, "parents must precede children");
                let (src, dst) = bits.split_at_mut(i * words_per_row);
                dst[..words_per_row]
                    .copy_from_slice(&src[p * words_per_row..(p + 1) * words_per_row]);
            }
            bits[i * words_per_row + i / 64] |= 1u64 << (i % 64);
        }
        TreeMask {
            n,
            words_per_row,
            bits,
        }
    }

    /// The mask of the subtree made of `rows` (ascending node indices, closed under ancestors,
    /// as [`TokenTree::truncate_depth`] and [`TokenTree::truncate_nodes`] keep): row and column
    /// `k` of the result are row and column `rows[k]` here, so it equals `from_tree` of that
    /// subtree without walking it again. None when `rows` is not ascending or out of range.
    pub fn restrict(&self, rows: &[usize]) -> Option<TreeMask> {
        if rows.windows(2).any(|w| w[0] >= w[1]) || rows.last().is_some_and(|&r| r >= self.n) {
            return None;
        }
        let n = rows.len();
        let words_per_row = n.div_ceil(64).max(1);
        let mut bits = vec![0u64; n * words_per_row];
        let src = self.as_batch_mask();
        for (a, &i) in rows.iter().enumerate() {
            for (b, &j) in rows[..=a].iter().enumerate() {
                if src.visible(i, j) {
                    bits[a * words_per_row + b / 64] |= 1u64 << (b % 64);
                }
            }
        }
        Some(TreeMask {
            n,
            words_per_row,
            bits,
        })
    }

    /// Number of rows (tree nodes).
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn words_per_row(&self) -> usize {
        self.words_per_row
    }

    /// Whether node `i` attends to node `j`.
    pub fn visible(&self, i: usize, j: usize) -> bool {
        self.as_batch_mask().visible(i, j)
    }

    /// Number of nodes node `i` attends to (its depth + 1).
    pub fn row_count(&self, i: usize) -> usize {
        self.bits[i * self.words_per_row..(i + 1) * self.words_per_row]
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum()
    }

    /// The mask in the form `Model::forward` takes.
    pub fn as_batch_mask(&self) -> BatchMask<'_> {
        BatchMask::Bits {
            words_per_row: self.words_per_row,
            bits: &self.bits,
        }
    }
}
