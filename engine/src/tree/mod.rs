//! Token trees for tree-based speculative inference (SpecInfer, Miao et al., ASPLOS 2024): nodes, trie merge, expansion configs, ancestor masks.
//!
//! Convention (used by verification, the KV commit and every drafter): node 0 is the *root*, the
//! sequence's last sampled token that is not yet in the KV cache. Draft nodes follow in depth-first
//! order, so every node's ancestors precede it and the nodes of any root-to-leaf path have
//! increasing indices. Batch row `i` of a verification pass is node `i`, at RoPE position
//! `prefix_len + depth(i)` (the root has depth 0), attending to the committed prefix and to its own
//! ancestors and itself. The logits of node `i` verify the children of node `i`.
//!
//! There is no size cap: masks are bitsets of any width.

mod expand;
mod mask;
#[cfg(test)]
mod tests;

pub(crate) use expand::{draw, normalized};
pub use expand::{expand, ExpandMode, ExpansionConfig};
pub use mask::TreeMask;

use std::sync::Arc;

use crate::error::{EngineError, Result};

/// Identifies a drafter within one speculative engine (its index in the drafter list).
pub type DrafterId = u16;

/// A sparse next-token distribution: (token, probability) pairs, probabilities summing to ~1.
pub type SparseDist = Arc<[(u32, f32)]>;

/// How a drafter chose a proposed token. Stochastic verification (MSS) needs to know: a sampled
/// token is checked against the drafter's distribution at the parent, a picked one (top-k, oracle,
/// random guess) against a point mass on itself — both keep the LLM's distribution exactly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrawKind {
    /// Drawn at random from the drafter's distribution recorded at the parent node.
    Sampled,
    /// Chosen deterministically (independently of any randomness verification uses).
    Picked,
}

/// One drafter's proposal of a node.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    pub drafter: DrafterId,
    /// The drafter's probability of this token given the parent's path (informational for
    /// picked tokens; equals the recorded distribution's entry for sampled ones).
    pub prob: f32,
    pub kind: DrawKind,
    /// Independent draws that produced this token (sampled); 1 for picked.
    pub draws: u32,
}

/// A node of a token tree.
#[derive(Clone, Debug)]
pub struct TreeNode {
    pub token: u32,
    /// `None` only for the root.
    pub parent: Option<usize>,
    /// 0 for the root.
    pub depth: usize,
    /// Which drafters proposed this node and how (empty for the root).
    pub proposals: Vec<Proposal>,
    /// Per drafter that sampled children of this node: its distribution over the next token
    /// (the draft distribution at the parent, from the children's point of view).
    pub child_dists: Vec<(DrafterId, SparseDist)>,
}

/// A merged draft tree with its attention mask (SpecInfer's topology-aware causal mask), as the
/// tree merger hands it to verification: the verifier attends with this mask, restricted to the
/// rows it keeps when it verifies less than the whole tree.
#[derive(Clone, Debug)]
pub struct MaskedTree {
    tree: TokenTree,
    mask: TreeMask,
}

impl MaskedTree {
    pub fn new(tree: TokenTree) -> MaskedTree {
        let mask = tree.mask();
        MaskedTree { tree, mask }
    }

    /// The tree.
    pub fn tree(&self) -> &TokenTree {
        &self.tree
    }

    /// The tree and its mask.
    pub fn into_parts(self) -> (TokenTree, TreeMask) {
        (self.tree, self.mask)
    }

    /// [`TokenTree::truncate_masked`]; itself when nothing is cut.
    pub fn truncate(self, max_depth: usize, max_draft: usize) -> MaskedTree {
        if self.tree.max_depth() <= max_depth && self.tree.n_draft() <= max_draft {
            return self;
        }
        let (tree, mask) = self.tree.truncate_masked(&self.mask, max_depth, max_draft);
        MaskedTree { tree, mask }
    }
}

/// A token tree in depth-first order (node 0 = root). Sibling tokens are unique.
#[derive(Clone, Debug)]
pub struct TokenTree {
    nodes: Vec<TreeNode>,
    children: Vec<Vec<usize>>,
}

impl TokenTree {
    /// A tree with only the root.
    pub fn root_only(root: u32) -> TokenTree {
        TreeBuilder::new(root).build()
    }

    /// A chain root → tokens[0] → tokens[1] → … proposed (picked) by `drafter`.
    pub fn chain(root: u32, tokens: &[u32], drafter: DrafterId) -> TokenTree {
        let mut b = TreeBuilder::new(root);
        let mut at = 0;
        for &t in tokens {
            at = b.add_child(at, t, Some(Proposal::picked(drafter, 1.0)));
        }
        b.build()
    }

    /// Number of nodes, root included (= rows of a verification pass).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never true (the root always exists); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Number of draft nodes (root excluded).
    pub fn n_draft(&self) -> usize {
        self.nodes.len() - 1
    }

    /// Whether some node was proposed by a random draw ([`DrawKind::Sampled`]): then how many
    /// distinct nodes the tree has depends on the drawn values.
    pub fn has_sampled(&self) -> bool {
        self.nodes
            .iter()
            .any(|n| n.proposals.iter().any(|p| p.kind == DrawKind::Sampled))
    }

    pub fn root_token(&self) -> u32 {
        self.nodes[0].token
    }

    pub fn nodes(&self) -> &[TreeNode] {
        &self.nodes
    }

    pub fn node(&self, i: usize) -> &TreeNode {
        &self.nodes[i]
    }

    /// Children of node `i`, in insertion order.
    pub fn children(&self, i: usize) -> &[usize] {
        &self.children[i]
    }

    /// Token of every node, root first: the token column of a verification batch.
    pub fn tokens(&self) -> Vec<u32> {
        self.nodes.iter().map(|n| n.token).collect()
    }

    /// RoPE position of every node when the committed prefix holds `prefix_len` tokens.
    pub fn positions(&self, prefix_len: usize) -> Vec<usize> {
        self.nodes.iter().map(|n| prefix_len + n.depth).collect()
    }

    pub fn max_depth(&self) -> usize {
        self.nodes.iter().map(|n| n.depth).max().unwrap_or(0)
    }

    /// Node indices from the root's first child down to `i` (empty for the root).
    pub fn path(&self, i: usize) -> Vec<usize> {
        let mut p = Vec::with_capacity(self.nodes[i].depth);
        let mut at = i;
        while let Some(parent) = self.nodes[at].parent {
            p.push(at);
            at = parent;
        }
        p.reverse();
        p
    }

    /// Tokens from the root (included) down to node `i` (included).
    pub fn path_tokens(&self, i: usize) -> Vec<u32> {
        let mut t = vec![self.root_token()];
        t.extend(self.path(i).into_iter().map(|j| self.nodes[j].token));
        t
    }

    /// The child of `parent` carrying `token`, if any.
    pub fn child_with_token(&self, parent: usize, token: u32) -> Option<usize> {
        self.children[parent]
            .iter()
            .copied()
            .find(|&c| self.nodes[c].token == token)
    }

    /// The distribution `drafter` recorded over the children of `node`.
    pub fn child_dist(&self, node: usize, drafter: DrafterId) -> Option<&SparseDist> {
        self.nodes[node]
            .child_dists
            .iter()
            .find(|(d, _)| *d == drafter)
            .map(|(_, dist)| dist)
    }

    /// The ancestor-set mask of this tree (row i: ancestors of i and i itself).
    pub fn mask(&self) -> TreeMask {
        TreeMask::from_tree(self)
    }

    /// Number of draft nodes at each depth: index d-1 holds depth d.
    pub fn nodes_by_depth(&self) -> Vec<usize> {
        let mut v = vec![0usize; self.max_depth()];
        for n in &self.nodes[1..] {
            v[n.depth - 1] += 1;
        }
        v
    }

    /// Trie union of trees with the same root token: a token path proposed by several drafters
    /// becomes one node whose `proposals` list all of them.
    pub fn merge(trees: &[TokenTree]) -> Result<TokenTree> {
        let first = trees
            .first()
            .ok_or_else(|| EngineError::InvalidArgument("merge needs at least one tree".into()))?;
        let root = first.root_token();
        if let Some(t) = trees.iter().find(|t| t.root_token() != root) {
            return Err(EngineError::InvalidArgument(format!(
                "cannot merge trees with different roots ({} and {})",
                root,
                t.root_token()
            )));
        }
        let mut b = TreeBuilder::new(root);
        for t in trees {
            // Nodes are topologically ordered, so each parent is mapped before its children.
            let mut map = vec![0usize; t.len()];
            for (i, n) in t.nodes.iter().enumerate() {
                if let Some(p) = n.parent {
                    map[i] = b.add_child(map[p], n.token, None);
                    for pr in &n.proposals {
                        b.add_proposal(map[i], pr.clone());
                    }
                }
                for (d, dist) in &n.child_dists {
                    b.set_child_dist(map[i], *d, dist.clone());
                }
            }
        }
        Ok(b.build())
    }

    /// The subtree of nodes at depth <= `max_depth`.
    pub fn truncate_depth(&self, max_depth: usize) -> TokenTree {
        if self.max_depth() <= max_depth {
            return self.clone();
        }
        self.filter(|n| n.depth <= max_depth).0
    }

    /// [`TokenTree::truncate_depth`] then [`TokenTree::truncate_nodes`], with the indices (here)
    /// of the nodes kept, ascending: a mask of this tree restricted to them
    /// ([`TreeMask::restrict`]) is the mask of the result.
    pub fn truncate_rows(&self, max_depth: usize, max_draft: usize) -> (TokenTree, Vec<usize>) {
        let (t, rows) = if self.max_depth() <= max_depth {
            (self.clone(), (0..self.len()).collect())
        } else {
            self.filter(|n| n.depth <= max_depth)
        };
        if t.n_draft() <= max_draft {
            return (t, rows);
        }
        let keep = t.keep_shallowest(max_draft);
        let (t2, sub) = t.filter_by_index(&keep);
        let rows = sub.iter().map(|&k| rows[k]).collect();
        (t2, rows)
    }

    /// [`TokenTree::truncate_rows`] with `mask` (this tree's) restricted to the rows kept: the
    /// cut tree and its mask, without building the mask again.
    pub fn truncate_masked(
        &self,
        mask: &TreeMask,
        max_depth: usize,
        max_draft: usize,
    ) -> (TokenTree, TreeMask) {
        let (tree, rows) = self.truncate_rows(max_depth, max_draft);
        let mask = if rows.len() == self.len() {
            mask.clone()
        } else {
            mask.restrict(&rows).unwrap_or_else(|| tree.mask())
        };
        (tree, mask)
    }

    /// Keep at most `max_draft` draft nodes, shallowest first (breadth-first order; the kept set
    /// is closed under ancestors). Note: for sampled proposals, dropping nodes by token can bias
    /// stochastic verification; drafters should respect their budget themselves.
    pub fn truncate_nodes(&self, max_draft: usize) -> TokenTree {
        if self.n_draft() <= max_draft {
            return self.clone();
        }
        let keep = self.keep_shallowest(max_draft);
        self.filter_by_index(&keep).0
    }

    /// Which nodes `truncate_nodes(max_draft)` keeps (the root and the `max_draft` shallowest
    /// draft nodes; needs `max_draft < n_draft()`).
    fn keep_shallowest(&self, max_draft: usize) -> Vec<bool> {
        let mut order: Vec<usize> = (1..self.len()).collect();
        order.sort_by_key(|&i| (self.nodes[i].depth, i));
        let mut keep = vec![false; self.len()];
        keep[0] = true;
        for &i in &order[..max_draft.min(order.len())] {
            keep[i] = true;
        }
        keep
    }

    fn filter_by_index(&self, keep: &[bool]) -> (TokenTree, Vec<usize>) {
        let mut i = 0;
        self.filter(|_| {
            i += 1;
            keep[i - 1]
        })
    }

    /// Nodes for which `keep` holds (called once per node in order; must be ancestor-closed),
    /// with their indices here.
    fn filter(&self, mut keep: impl FnMut(&TreeNode) -> bool) -> (TokenTree, Vec<usize>) {
        let mut map = vec![usize::MAX; self.len()];
        let mut nodes = Vec::new();
        let mut rows = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let parent_kept = match n.parent {
                Some(p) => map[p] != usize::MAX,
                None => true,
            };
            if keep(n) && parent_kept {
                map[i] = nodes.len();
                let mut n = n.clone();
                n.parent = n.parent.map(|p| map[p]);
                nodes.push(n);
                rows.push(i);
            }
        }
        (TokenTree::from_dfs_nodes(nodes), rows)
    }

    /// Wrap nodes already in depth-first order.
    fn from_dfs_nodes(nodes: Vec<TreeNode>) -> TokenTree {
        let mut children = vec![Vec::new(); nodes.len()];
        for (i, n) in nodes.iter().enumerate() {
            if let Some(p) = n.parent {
                children[p].push(i);
            }
        }
        TokenTree { nodes, children }
    }

    /// Check the structural invariants (used on trees that come from drafters).
    pub fn validate(&self, vocab: usize) -> Result<()> {
        let bad = |m: String| Err(EngineError::InvalidArgument(format!("malformed tree: {m}")));
        if self.nodes.is_empty() || self.nodes[0].parent.is_some() || self.nodes[0].depth != 0 {
            return bad("node 0 must be a root at depth 0".into());
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if n.token as usize >= vocab {
                return bad(format!(
                    "token {} outside the vocabulary ({vocab})",
                    n.token
                ));
            }
            if i > 0 {
                match n.parent {
                    Some(p) if p < i && self.nodes[p].depth + 1 == n.depth => {}
                    _ => return bad(format!("node {i} has an invalid parent or depth")),
                }
            }
        }
        for (i, ch) in self.children.iter().enumerate() {
            for (a, &x) in ch.iter().enumerate() {
                if ch[..a]
                    .iter()
                    .any(|&y| self.nodes[y].token == self.nodes[x].token)
                {
                    return bad(format!("node {i} has two children with the same token"));
                }
            }
        }
        Ok(())
    }
}

impl Proposal {
    /// A deterministic pick by `drafter` (its model probability `prob`, informational).
    pub fn picked(drafter: DrafterId, prob: f32) -> Proposal {
        Proposal {
            drafter,
            prob,
            kind: DrawKind::Picked,
            draws: 1,
        }
    }

    /// `draws` independent samples from `drafter`'s distribution at the parent, which gives the
    /// token probability `prob`.
    pub fn sampled(drafter: DrafterId, prob: f32, draws: u32) -> Proposal {
        Proposal {
            drafter,
            prob,
            kind: DrawKind::Sampled,
            draws,
        }
    }
}

/// Builds a token tree as a trie: adding an existing (parent, token) pair returns the existing
/// node and merges the proposal. `build` flattens to depth-first order.
#[derive(Clone, Debug)]
pub struct TreeBuilder {
    nodes: Vec<TreeNode>,
    children: Vec<Vec<usize>>,
}

impl TreeBuilder {
    pub fn new(root: u32) -> TreeBuilder {
        TreeBuilder {
            nodes: vec![TreeNode {
                token: root,
                parent: None,
                depth: 0,
                proposals: Vec::new(),
                child_dists: Vec::new(),
            }],
            children: vec![Vec::new()],
        }
    }

    /// Nodes so far, root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Builder id of the root.
    pub const ROOT: usize = 0;

    pub fn depth(&self, id: usize) -> usize {
        self.nodes[id].depth
    }

    pub fn token(&self, id: usize) -> u32 {
        self.nodes[id].token
    }

    /// Tokens from the root (included) down to builder node `id` (included).
    pub fn path_tokens(&self, id: usize) -> Vec<u32> {
        let mut t = Vec::with_capacity(self.nodes[id].depth + 1);
        let mut at = Some(id);
        while let Some(i) = at {
            t.push(self.nodes[i].token);
            at = self.nodes[i].parent;
        }
        t.reverse();
        t
    }

    /// The child of `parent` with `token` (created if missing), with `proposal` merged in.
    /// Panics if `parent` is not a node of this builder.
    pub fn add_child(&mut self, parent: usize, token: u32, proposal: Option<Proposal>) -> usize {
        let id = match self.children[parent]
            .iter()
            .copied()
            .find(|&c| self.nodes[c].token == token)
        {
            Some(c) => c,
            None => {
                let id = self.nodes.len();
                self.nodes.push(TreeNode {
                    token,
                    parent: Some(parent),
                    depth: self.nodes[parent].depth + 1,
                    proposals: Vec::new(),
                    child_dists: Vec::new(),
                });
                self.children.push(Vec::new());
                self.children[parent].push(id);
                id
            }
        };
        if let Some(p) = proposal {
            self.add_proposal(id, p);
        }
        id
    }

    /// Record a proposal of node `id`; draws of the same drafter and kind add up.
    pub fn add_proposal(&mut self, id: usize, p: Proposal) {
        let props = &mut self.nodes[id].proposals;
        match props
            .iter_mut()
            .find(|q| q.drafter == p.drafter && q.kind == p.kind)
        {
            Some(q) if p.kind == DrawKind::Sampled => q.draws += p.draws,
            Some(_) => {}
            None => props.push(p),
        }
    }

    /// Record `drafter`'s distribution over the children of node `id` (first one wins).
    pub fn set_child_dist(&mut self, id: usize, drafter: DrafterId, dist: SparseDist) {
        let d = &mut self.nodes[id].child_dists;
        if !d.iter().any(|(x, _)| *x == drafter) {
            d.push((drafter, dist));
        }
    }

    /// Flatten into depth-first order (children in insertion order).
    pub fn build(self) -> TokenTree {
        let TreeBuilder {
            mut nodes,
            children,
        } = self;
        let mut order = Vec::with_capacity(nodes.len());
        let mut stack = vec![0usize];
        while let Some(i) = stack.pop() {
            order.push(i);
            stack.extend(children[i].iter().rev());
        }
        let mut map = vec![0usize; nodes.len()];
        for (new, &old) in order.iter().enumerate() {
            map[old] = new;
        }
        for n in nodes.iter_mut() {
            n.parent = n.parent.map(|p| map[p]);
        }
        let mut indexed: Vec<(usize, TreeNode)> = nodes
            .drain(..)
            .enumerate()
            .map(|(old, n)| (map[old], n))
            .collect();
        indexed.sort_by_key(|(new, _)| *new);
        TokenTree::from_dfs_nodes(indexed.into_iter().map(|(_, n)| n).collect())
    }
}
