//! Token Recycling (Luo et al., "Turning Trash into Treasure", arXiv 2408.08696): an adjacency matrix of every token's K most recent likely successors, refilled from the top-K of each row the LLM computes, and draft trees grown best first over it along a static template.
//!
//! Each verification pass already computes logits for the root and every tree node, accepted or
//! not; decoding keeps one token per row and throws the rest away. Here the top-K tokens of row
//! `i` replace the matrix row of node `i`'s token (the paper's update: the latest candidates win).
//! Beside the matrix (first order: a token's successors whatever came before it), a table of
//! successors in context keeps the same candidates under the token and the 1 to [`MAX_ORDER`]
//! tokens before it on the row's path (our addition, as n-gram models back off: the tokens after
//! `x` differ with what led to `x`); a lookup takes the longest context the table holds, else
//! the matrix row, and a token never seen before gets the candidates of the last new token's
//! row (a fresh identifier tends to be followed as the previous fresh one was). A proposal grows the static template (the paper's Figure 5 tree, 80 nodes,
//! depth 6) best first: a template node with rank `r` under a node holding token `t` becomes the
//! `r`-th successor of `t` in its context, scored by the product of acceptance rates along its
//! path (per context length, depth and rank, learnt from the drafter's own verified proposals);
//! the best nodes join while the budget lasts and each is worth its row, always a subtree.
//! Proposals are picks (never samples), so greedy and MSS verification stay lossless. The tables
//! start from the sequence's own successors (token `i` -> token `i + 1` of the prompt, in each of
//! its contexts), or, with [`RecycleDrafter::with_prompt_logits`], also from the top-K of every
//! prompt row (the paper's warm start, which costs the output head over the whole prompt).

use std::sync::{Arc, Mutex, MutexGuard};

use super::{DraftRequest, Drafter, RowCandidates};
use crate::error::{EngineError, Result};
use crate::tree::{Proposal, TokenTree, TreeBuilder};

/// Successors kept per token by default (the paper's K).
pub const DEFAULT_K: usize = 8;

/// Most successors per token a matrix keeps.
pub const MAX_K: usize = 32;

/// Marks an unused successor slot.
const EMPTY: u32 = u32::MAX;

/// Token -> its K most recent likely successors, best first: `[vocab, K]` u32 (qwen's 151,936
/// tokens at K = 8: 4.9 MB).
#[derive(Clone, Debug)]
pub struct RecycleMatrix {
    k: usize,
    vocab: usize,
    /// `[vocab, k]`, `EMPTY`-padded rows.
    next: Vec<u32>,
    /// Successors in context: keys (hashes of a token and the 1 to `MAX_ORDER` tokens before
    /// it) of a direct-mapped table of `CTX_SLOTS` slots (a newer key takes its slot;
    /// `NO_KEY`: empty).
    ctx_keys: Vec<u64>,
    /// `[CTX_SLOTS, k]`, `EMPTY`-padded rows.
    ctx_next: Vec<u32>,
    /// The candidates of the last row whose token had no successors yet (its first pass through
    /// the LLM): what a token never seen before is likely followed by (a fresh identifier by
    /// `(`, `,`, ` =`...), `EMPTY`-padded.
    novel: Vec<u32>,
}

/// The "order" [`RecycleMatrix::successors_with_order`] reports for a token without successors
/// of its own, given the last new token's (see `RecycleMatrix::novel`).
pub const NOVEL_ORDER: usize = MAX_ORDER + 1;

/// Most tokens of context the table of successors in context keys on.
pub const MAX_ORDER: usize = 4;
// A root's context comes from the sequence tokens a pass keeps before its rows.
const _: () = assert!(MAX_ORDER <= crate::draft::CONTEXT_TOKENS);
/// Slots of the table of successors in context.
const CTX_SLOTS: usize = 1 << 14;
/// Marks an empty slot of the table of successors in context.
const NO_KEY: u64 = u64::MAX;

/// The key of `token` after `ctx` (most recent first; FNV-1a over the tokens, never `NO_KEY`).
fn ctx_key(ctx: &[u32], token: u32) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ ctx.len() as u64;
    for &t in std::iter::once(&token).chain(ctx) {
        h = (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h >> 1
}

/// The slot of a context key.
fn ctx_slot(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - CTX_SLOTS.trailing_zeros())) as usize
}

/// Copies the first `row.len()` of `candidates` inside the vocabulary into `row`, `EMPTY`-padded.
fn fill_row(row: &mut [u32], candidates: &[u32], vocab: usize) {
    let mut n = 0;
    for &c in candidates {
        if n == row.len() {
            break;
        }
        if (c as usize) < vocab {
            row[n] = c;
            n += 1;
        }
    }
    row[n..].fill(EMPTY);
}

/// The non-`EMPTY` prefix of a row.
fn filled(row: &[u32]) -> &[u32] {
    &row[..row.iter().position(|&x| x == EMPTY).unwrap_or(row.len())]
}

impl RecycleMatrix {
    /// An empty matrix (every token without successors).
    pub fn new(vocab: usize, k: usize) -> Result<RecycleMatrix> {
        if k == 0 || k > MAX_K || vocab == 0 || vocab >= EMPTY as usize {
            return Err(EngineError::InvalidArgument(format!(
                "token recycling needs 1 <= K <= {MAX_K} successors per token and a vocabulary \
                 (got K = {k}, vocabulary {vocab})"
            )));
        }
        Ok(RecycleMatrix {
            k,
            vocab,
            next: vec![EMPTY; vocab * k],
            ctx_keys: vec![NO_KEY; CTX_SLOTS],
            ctx_next: vec![EMPTY; CTX_SLOTS * k],
            novel: vec![EMPTY; k],
        })
    }

    /// Successors kept per token.
    pub fn k(&self) -> usize {
        self.k
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Bytes of the first-order matrix (`[vocab, K]` u32).
    pub fn matrix_bytes(&self) -> usize {
        self.next.len() * std::mem::size_of::<u32>()
    }

    /// Bytes of the successor tables (the matrix and the table of successors in context).
    pub fn bytes(&self) -> usize {
        (self.next.len() + self.ctx_next.len()) * std::mem::size_of::<u32>()
            + self.ctx_keys.len() * std::mem::size_of::<u64>()
    }

    /// The successors of `token`, best first (empty for tokens never seen or outside the
    /// vocabulary).
    pub fn successors(&self, token: u32) -> &[u32] {
        let t = token as usize;
        if t >= self.vocab {
            return &[];
        }
        filled(&self.next[t * self.k..(t + 1) * self.k])
    }

    /// The successors of `token` after `ctx` (the tokens before it, most recent first), best
    /// first: those of the longest context (up to [`MAX_ORDER`] tokens) the table holds, else
    /// `token`'s.
    pub fn successors_in(&self, ctx: &[u32], token: u32) -> &[u32] {
        self.successors_with_order(ctx, token).0
    }

    /// [`Self::successors_in`] and the length of the context they were kept under (0: the
    /// token's own); for a token without successors, the last new token's ([`NOVEL_ORDER`]).
    pub fn successors_with_order(&self, ctx: &[u32], token: u32) -> (&[u32], usize) {
        for n in (1..=ctx.len().min(MAX_ORDER)).rev() {
            let key = ctx_key(&ctx[..n], token);
            let slot = ctx_slot(key);
            if self.ctx_keys[slot] == key {
                let row = filled(&self.ctx_next[slot * self.k..(slot + 1) * self.k]);
                if !row.is_empty() {
                    return (row, n);
                }
            }
        }
        let own = self.successors(token);
        if own.is_empty() && (token as usize) < self.vocab {
            return (filled(&self.novel), NOVEL_ORDER);
        }
        (own, 0)
    }

    /// Replace the successors of `token` after `ctx` (most recent first, 1 to [`MAX_ORDER`]
    /// tokens) by `candidates` (as [`Self::update`]).
    pub fn update_in(&mut self, ctx: &[u32], token: u32, candidates: &[u32]) {
        if ctx.is_empty() || ctx.len() > MAX_ORDER || token as usize >= self.vocab {
            return;
        }
        let key = ctx_key(ctx, token);
        let slot = ctx_slot(key);
        self.ctx_keys[slot] = key;
        fill_row(
            &mut self.ctx_next[slot * self.k..(slot + 1) * self.k],
            candidates,
            self.vocab,
        );
    }

    /// Whether the table holds successors of `token` after `ctx`.
    fn has_context(&self, ctx: &[u32], token: u32) -> bool {
        let key = ctx_key(ctx, token);
        self.ctx_keys[ctx_slot(key)] == key
    }

    /// Replace the successors of `token` by `candidates` (best first; the first K inside the
    /// vocabulary are kept).
    pub fn update(&mut self, token: u32, candidates: &[u32]) {
        let t = token as usize;
        if t >= self.vocab {
            return;
        }
        fill_row(
            &mut self.next[t * self.k..(t + 1) * self.k],
            candidates,
            self.vocab,
        );
    }

    /// Every row of a pass: `tokens[i]`'s successors become row `i`'s candidates, and so do
    /// those of `tokens[i]` after each of its contexts (1 to [`MAX_ORDER`] tokens) its path has.
    pub fn observe(&mut self, rows: &RowCandidates<'_>) {
        let mut ctx = Vec::with_capacity(MAX_ORDER);
        for (i, &t) in rows.tokens.iter().enumerate() {
            if (t as usize) < self.vocab && self.successors(t).is_empty() {
                let vocab = self.vocab;
                fill_row(&mut self.novel, rows.row(i), vocab);
            }
            self.update(t, rows.row(i));
            rows.context(i, MAX_ORDER, &mut ctx);
            for n in 1..=ctx.len() {
                self.update_in(&ctx[..n], t, rows.row(i));
            }
        }
    }
}

/// The static tree of Token Recycling's Figure 5 (80 draft nodes, depth 6): for each depth, the
/// number of children of every node of the depth above, in breadth-first order; a node's
/// children are its token's candidates of rank 0, 1, ...
const PAPER_TEMPLATE: [&[u8]; 6] = [
    &[8],
    &[8, 4, 3, 2, 1, 1, 1, 1],
    &[
        8, 3, 2, 1, 1, 1, 1, 1, 2, 1, 0, 0, 1, 0, 0, 1, 0, 1, 1, 0, 0,
    ],
    &[
        5, 2, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0,
    ],
    &[3, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0],
    &[2, 0, 0, 1, 0, 0, 0, 0],
];

/// One node of a template: index 0 is the root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TemplateNode {
    /// Template index of the parent (0 for the root's children and the root itself).
    parent: usize,
    /// Which successor of the parent's token this node takes.
    rank: usize,
    depth: usize,
}

/// A static draft-tree template: draft nodes in breadth-first order, each the `rank`-th
/// successor of its parent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecycleTemplate {
    nodes: Vec<TemplateNode>,
    /// Per node, its children's template indices by rank.
    children: Vec<Vec<usize>>,
}

impl RecycleTemplate {
    /// The paper's tree (80 draft nodes, depth 6, widest rank 8).
    pub fn paper() -> RecycleTemplate {
        RecycleTemplate::from_layers(&PAPER_TEMPLATE).expect("the paper's template is valid")
    }

    /// A template from its layers: `layers[d][j]` = children of the `j`-th node (breadth-first)
    /// at depth `d` (depth 0 has the root only).
    pub fn from_layers(layers: &[&[u8]]) -> Result<RecycleTemplate> {
        let mut nodes = vec![TemplateNode {
            parent: 0,
            rank: 0,
            depth: 0,
        }];
        let mut layer: Vec<usize> = vec![0];
        for (d, counts) in layers.iter().enumerate() {
            if counts.len() != layer.len() {
                return Err(EngineError::InvalidArgument(format!(
                    "template depth {d} lists {} child counts for {} nodes",
                    counts.len(),
                    layer.len()
                )));
            }
            let mut next = Vec::new();
            for (&parent, &c) in layer.iter().zip(counts.iter()) {
                for rank in 0..c as usize {
                    next.push(nodes.len());
                    nodes.push(TemplateNode {
                        parent,
                        rank,
                        depth: d + 1,
                    });
                }
            }
            layer = next;
        }
        let mut children = vec![Vec::new(); nodes.len()];
        for (i, n) in nodes.iter().enumerate().skip(1) {
            children[n.parent].push(i);
        }
        Ok(RecycleTemplate { nodes, children })
    }

    /// Draft nodes (the root excluded).
    pub fn len(&self) -> usize {
        self.nodes.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn max_depth(&self) -> usize {
        self.nodes.last().map_or(0, |n| n.depth)
    }

    /// Draft nodes at most `depth` deep.
    pub fn nodes_within(&self, depth: usize) -> usize {
        self.nodes
            .iter()
            .skip(1)
            .filter(|n| n.depth <= depth)
            .count()
    }

    /// Widest rank used (the most successors a proposal reads per token).
    pub fn max_rank(&self) -> usize {
        self.nodes
            .iter()
            .skip(1)
            .map(|n| n.rank + 1)
            .max()
            .unwrap_or(0)
    }
}

/// How often a candidate of each rank was right, per context length of its list and depth:
/// `hits / tries` with a prior, the rates proposals score paths with.
#[derive(Clone, Debug)]
struct RankRates {
    /// `[order][depth][rank]` (hits, tries); depths past the last share the last row.
    counts: Vec<Vec<Vec<(f64, f64)>>>,
}

/// Prior acceptance of a rank-`r` candidate (worth `PRIOR_WEIGHT` tries): the top candidate
/// is right far more often than the others.
const PRIOR: [f64; 8] = [0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01];
const PRIOR_WEIGHT: f64 = 8.0;
/// Recent tries dominate: older counts decay by this factor per update.
const DECAY: f64 = 0.995;

impl RankRates {
    fn new(depths: usize, ranks: usize) -> RankRates {
        let row: Vec<(f64, f64)> = (0..ranks.max(1))
            .map(|r| {
                let p = PRIOR.get(r).copied().unwrap_or(PRIOR[PRIOR.len() - 1]);
                (p * PRIOR_WEIGHT, PRIOR_WEIGHT)
            })
            .collect();
        RankRates {
            counts: vec![vec![row; depths.max(1)]; NOVEL_ORDER + 1],
        }
    }

    /// The rate of a rank-`rank` candidate at `depth` from a list kept under `order` tokens of
    /// context.
    fn rate(&self, order: usize, depth: usize, rank: usize) -> f64 {
        let by_depth = &self.counts[order.min(NOVEL_ORDER)];
        let row = &by_depth[depth.saturating_sub(1).min(by_depth.len() - 1)];
        let (h, t) = row[rank.min(row.len() - 1)];
        h / t.max(1e-9)
    }

    fn record(&mut self, order: usize, depth: usize, rank: usize, hit: bool) {
        let by_depth = &mut self.counts[order.min(NOVEL_ORDER)];
        let d = depth.saturating_sub(1).min(by_depth.len() - 1);
        let row = &mut by_depth[d];
        let r = rank.min(row.len() - 1);
        let (h, t) = &mut row[r];
        *h = *h * DECAY + if hit { 1.0 } else { 0.0 };
        *t = *t * DECAY + 1.0;
    }
}

/// A node of the last proposal: its builder parent, token, template rank and depth, and the
/// context length of the list it came from.
#[derive(Clone, Copy, Debug)]
struct Proposed {
    parent: usize,
    token: u32,
    rank: usize,
    depth: usize,
    order: usize,
}

/// A node a proposal may add next: template node `tnode` under builder node `parent`.
#[derive(Clone, Copy, Debug)]
struct Frontier {
    score: f64,
    tnode: usize,
    parent: usize,
    token: u32,
    order: usize,
}

/// The Token Recycling drafter (`--draft recycle[:K]`). Its matrix is its own, or shared by
/// every drafter built from one [`RecycleDrafter::shared`] handle (a server's requests): a
/// shared matrix carries one request's candidates into another's draft guesses only, which
/// verification checks like any other guess, never into outputs.
#[derive(Clone, Debug)]
pub struct RecycleDrafter {
    matrix: Arc<Mutex<RecycleMatrix>>,
    template: Arc<RecycleTemplate>,
    rates: RankRates,
    /// The last proposal's nodes (builder order: parents first); index 0 stands for the root.
    last: Vec<Proposed>,
    /// Least path score worth the tree's `i + 1`-th node, `row_costs[i]`
    /// ([`Drafter::set_row_costs`]; empty: the budget alone decides).
    row_costs: Vec<f64>,
    /// The sequence's own successors are in the matrix (done at the first proposal).
    warm: bool,
    /// Also warm up from the top candidates of every prompt row (costs the output head over the
    /// whole prompt).
    prompt_logits: bool,
}

impl RecycleDrafter {
    /// A drafter with its own empty matrix of `k` successors per token, drafting along the
    /// paper's template.
    pub fn new(vocab: usize, k: usize) -> Result<RecycleDrafter> {
        let matrix = Arc::new(Mutex::new(RecycleMatrix::new(vocab, k)?));
        RecycleDrafter::shared(matrix, Arc::new(RecycleTemplate::paper()))
    }

    /// A drafter over a matrix shared with others, drafting along `template`.
    pub fn shared(
        matrix: Arc<Mutex<RecycleMatrix>>,
        template: Arc<RecycleTemplate>,
    ) -> Result<RecycleDrafter> {
        if template.is_empty() {
            return Err(EngineError::InvalidArgument(
                "token recycling needs a template with draft nodes".into(),
            ));
        }
        let rates = RankRates::new(template.max_depth(), template.max_rank());
        Ok(RecycleDrafter {
            matrix,
            template,
            rates,
            last: Vec::new(),
            row_costs: Vec::new(),
            warm: false,
            prompt_logits: false,
        })
    }

    /// Also warm the matrix up from every prompt row's top candidates
    /// ([`Drafter::prompt_candidates`]): the paper's warm start, at the cost of the output head
    /// over the whole prompt (about doubles qwen2.5-coder-1.5b's prefill on 2 cores).
    pub fn with_prompt_logits(mut self, on: bool) -> RecycleDrafter {
        self.prompt_logits = on;
        self
    }

    /// The matrix, locked.
    pub fn matrix(&self) -> MutexGuard<'_, RecycleMatrix> {
        lock(&self.matrix)
    }
}

/// Lock a matrix; a poisoned lock is taken over (the table is valid after any update).
fn lock(m: &Mutex<RecycleMatrix>) -> MutexGuard<'_, RecycleMatrix> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Drafter for RecycleDrafter {
    fn name(&self) -> &str {
        "recycle"
    }

    /// Proposals are subtrees of the template.
    fn max_nodes(&self, max_depth: usize) -> usize {
        self.template.nodes_within(max_depth)
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        if !self.warm {
            // Warm start from the sequence itself: each token's successor in it, where the
            // matrix knows nothing better (free; as good as the prompt rows' candidates on the
            // benchmark prompts, see docs/benchmarks.md).
            self.warm = true;
            let mut m = lock(&self.matrix);
            for w in req.tokens.windows(2) {
                if m.successors(w[0]).is_empty() {
                    m.update(w[0], &w[1..]);
                }
            }
            for n in 1..=MAX_ORDER {
                for w in req.tokens.windows(n + 2) {
                    let ctx: Vec<u32> = w[..n].iter().rev().copied().collect();
                    if !m.has_context(&ctx, w[n]) {
                        m.update_in(&ctx, w[n], &w[n + 1..]);
                    }
                }
            }
        }
        let root = req.root();
        let mut b = TreeBuilder::new(root);
        self.last.clear();
        self.last.push(Proposed {
            parent: 0,
            token: root,
            rank: 0,
            depth: 0,
            order: 0,
        });
        if req.budget == 0 || req.max_depth == 0 || req.tokens.is_empty() {
            return Ok(b.build());
        }
        // Best first along the template: a node's score, the product of its path's rates,
        // estimates the chance its path is accepted, the tokens it is worth. The best node of
        // the frontier joins while the budget lasts and it is worth its row (the `i + 1`-th
        // costs `row_costs[i]`); its template children join the frontier. Rates in (0, 1] make
        // a child never outscore its parent: the tree is the best nodes, a subtree.
        let matrix = lock(&self.matrix);
        // Per builder node (the root first), the tokens before it (most recent first): the
        // root's from the sequence, a node's its parent's token, then the parent's.
        let mut context: Vec<Vec<u32>> = vec![req.tokens[..req.tokens.len() - 1]
            .iter()
            .rev()
            .take(MAX_ORDER)
            .copied()
            .collect()];
        let mut frontier: Vec<Frontier> = Vec::new();
        let expand = |id: usize,
                      tnode: usize,
                      score: f64,
                      ctx: &[u32],
                      token: u32,
                      frontier: &mut Vec<Frontier>| {
            let (next, order) = matrix.successors_with_order(ctx, token);
            for &c in &self.template.children[tnode] {
                let n = self.template.nodes[c];
                let Some(&t) = next.get(n.rank) else { break };
                if n.depth > req.max_depth || t as usize >= req.vocab {
                    continue;
                }
                let rate = self.rates.rate(order, n.depth, n.rank).clamp(1e-9, 1.0);
                frontier.push(Frontier {
                    score: score * rate,
                    tnode: c,
                    parent: id,
                    token: t,
                    order,
                });
            }
        };
        expand(TreeBuilder::ROOT, 0, 1.0, &context[0], root, &mut frontier);
        let last_cost = self.row_costs.last().copied();
        while b.len() - 1 < req.budget {
            // The best score, ties to the earlier template node.
            let Some(best) = (0..frontier.len()).max_by(|&x, &y| {
                let (fx, fy) = (&frontier[x], &frontier[y]);
                fx.score.total_cmp(&fy.score).then(fy.tnode.cmp(&fx.tnode))
            }) else {
                break;
            };
            let f = frontier.swap_remove(best);
            if let Some(last) = last_cost {
                if f.score < self.row_costs.get(b.len() - 1).copied().unwrap_or(last) {
                    break;
                }
            }
            let before = b.len();
            let id = b.add_child(
                f.parent,
                f.token,
                Some(Proposal::picked(req.drafter, f.score as f32)),
            );
            if b.len() == before {
                continue;
            }
            let n = self.template.nodes[f.tnode];
            self.last.push(Proposed {
                parent: f.parent,
                token: f.token,
                rank: n.rank,
                depth: n.depth,
                order: f.order,
            });
            let ctx: Vec<u32> = std::iter::once(b.token(f.parent))
                .chain(context[f.parent].iter().copied())
                .take(MAX_ORDER)
                .collect();
            expand(id, f.tnode, f.score, &ctx, f.token, &mut frontier);
            context.push(ctx);
        }
        Ok(b.build())
    }

    fn accept(&mut self, accepted: &[u32], bonus: u32) {
        // Along the LLM's path (accepted tokens, then the bonus), every proposed child of a node
        // on the path was a try of its rank; the one with the path's next token was a hit.
        let mut node = 0usize;
        for &next in accepted.iter().chain(std::iter::once(&bonus)) {
            let mut found = None;
            for (id, p) in self.last.iter().enumerate().skip(1) {
                if p.parent == node {
                    let hit = p.token == next;
                    self.rates.record(p.order, p.depth, p.rank, hit);
                    if hit {
                        found = Some(id);
                    }
                }
            }
            match found {
                Some(id) => node = id,
                None => break,
            }
        }
        self.last.clear();
    }

    fn candidates_wanted(&self) -> usize {
        self.matrix().k()
    }

    fn reproposes_cheaply(&self) -> bool {
        true
    }

    fn prompt_candidates(&self) -> usize {
        if self.prompt_logits {
            self.candidates_wanted()
        } else {
            0
        }
    }

    fn set_row_costs(&mut self, costs: &[f64]) {
        self.row_costs.clear();
        self.row_costs.extend(
            costs
                .iter()
                .map(|&c| if c.is_finite() { c.max(0.0) } else { 0.0 }),
        );
    }

    fn observe_candidates(&mut self, rows: &RowCandidates<'_>) {
        self.matrix().observe(rows);
    }
}

/// The `k` highest logits of every row of `logits` (`[rows, vocab]`), best first, ties to the
/// lower token id: `[rows, k]` token ids (rows shorter than `k` are padded with their last).
pub fn top_k_rows(logits: &[f32], vocab: usize, k: usize) -> Vec<u32> {
    if vocab == 0 || k == 0 {
        return Vec::new();
    }
    let k = k.min(vocab);
    let mut out = Vec::with_capacity(logits.len() / vocab * k);
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for row in logits.chunks_exact(vocab) {
        best.clear();
        let mut floor = f32::NEG_INFINITY;
        let insert = |best: &mut Vec<(f32, u32)>, x: f32, t: u32| {
            // Keep `best` sorted by value descending, earlier ids first among equals.
            let at = best.partition_point(|&(y, _)| y >= x);
            if at < k {
                best.insert(at, (x, t));
                best.truncate(k);
            }
        };
        const CHUNK: usize = 16;
        for (c, chunk) in row.chunks(CHUNK).enumerate() {
            // Most chunks hold nothing above the current k-th value: one vector compare each.
            if best.len() == k && !chunk.iter().fold(false, |a, &x| a | (x > floor)) {
                continue;
            }
            for (j, &x) in chunk.iter().enumerate() {
                if best.len() < k || x > floor {
                    if x.is_nan() {
                        continue;
                    }
                    insert(&mut best, x, (c * CHUNK + j) as u32);
                    if best.len() == k {
                        floor = best[k - 1].0;
                    }
                }
            }
        }
        let last = best.last().map_or(0, |b| b.1);
        out.extend(best.iter().map(|b| b.1));
        out.extend(std::iter::repeat_n(last, k - best.len()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::{PassCandidates, NO_ROW};

    fn req(tokens: &[u32], budget: usize, max_depth: usize) -> DraftRequest<'_> {
        DraftRequest {
            tokens,
            budget,
            max_depth,
            drafter: 0,
            vocab: 100,
        }
    }

    #[test]
    fn the_update_replaces_a_row_with_the_latest_candidates() {
        let mut m = RecycleMatrix::new(100, 3).unwrap();
        assert!(m.successors(7).is_empty());
        m.update(7, &[1, 2, 3, 4]);
        assert_eq!(m.successors(7), &[1, 2, 3]);
        // Newer candidates replace older ones entirely; out-of-vocabulary ids are skipped.
        m.update(7, &[9, 200, 8]);
        assert_eq!(m.successors(7), &[9, 8]);
        m.update(300, &[1]);
        assert!(m.successors(300).is_empty());
        // A pass: row i's candidates go to tokens[i]; a token seen twice keeps its last row.
        let top = [10, 11, 12, 20, 21, 22, 30, 31, 32];
        m.observe(&RowCandidates {
            tokens: &[5, 6, 5],
            parents: &[],
            before: &[],
            k: 3,
            top: &top,
        });
        assert_eq!(m.successors(5), &[30, 31, 32]);
        assert_eq!(m.successors(6), &[20, 21, 22]);
        // 5 and 6 came through the LLM for the first time: a token never seen is guessed to be
        // followed as the last new one (6) was; 7 has successors of its own.
        assert_eq!(
            m.successors_with_order(&[], 99),
            (&[20, 21, 22][..], NOVEL_ORDER)
        );
        assert_eq!(m.successors_with_order(&[], 7), (&[9, 8][..], 0));
        assert!(m.successors(99).is_empty());
        assert!(RecycleMatrix::new(100, 0).is_err());
        assert!(RecycleMatrix::new(100, MAX_K + 1).is_err());
    }

    #[test]
    fn the_matrix_for_qwens_vocabulary_fits_in_five_megabytes() {
        let m = RecycleMatrix::new(151_936, DEFAULT_K).unwrap();
        assert_eq!(m.matrix_bytes(), 151_936 * 8 * 4);
        assert!(m.matrix_bytes() < 5_000_000, "{} bytes", m.matrix_bytes());
        // The table of successors in context: 16,384 slots of a key and K successors.
        assert_eq!(m.bytes() - m.matrix_bytes(), CTX_SLOTS * (8 + 8 * 4));
        assert!(m.bytes() < 5_600_000, "{} bytes", m.bytes());
    }

    #[test]
    fn successors_in_context_back_off_to_the_longest_context_held() {
        let mut m = RecycleMatrix::new(100, 2).unwrap();
        m.update(5, &[1, 2]);
        // "4 5" -> 3, "9 4 5" -> 7 (contexts most recent first).
        m.update_in(&[4], 5, &[3]);
        m.update_in(&[4, 9], 5, &[7, 200, 8]);
        assert_eq!(m.successors_with_order(&[], 5), (&[1, 2][..], 0));
        assert_eq!(m.successors_with_order(&[4], 5), (&[3][..], 1));
        assert_eq!(m.successors_with_order(&[4, 9], 5), (&[7, 8][..], 2));
        assert_eq!(m.successors_with_order(&[4, 9, 1], 5), (&[7, 8][..], 2));
        assert_eq!(m.successors_with_order(&[4, 8], 5), (&[3][..], 1));
        assert_eq!(m.successors_with_order(&[6], 5), (&[1, 2][..], 0));
        assert!(m.successors_in(&[4], 6).is_empty());
        // Contexts longer than MAX_ORDER or out-of-vocabulary tokens are not kept.
        m.update_in(&[1; MAX_ORDER + 1], 5, &[9]);
        m.update_in(&[4], 500, &[9]);
        assert!(m.successors_in(&[4], 500).is_empty());
        assert_eq!(m.successors_in(&[1; MAX_ORDER + 1], 5), &[1, 2]);

        // A tree pass after the sequence "20 21": root 10, 10 -> 11 -> 12, 10 -> 13. Every row's
        // candidates go under its token alone and under each context its path gives.
        let mut m = RecycleMatrix::new(100, 1).unwrap();
        m.observe(&RowCandidates {
            tokens: &[10, 11, 12, 13],
            parents: &[NO_ROW, 0, 1, 0],
            before: &[20, 21],
            k: 1,
            top: &[50, 51, 52, 53],
        });
        assert_eq!(m.successors_with_order(&[21, 20], 10), (&[50][..], 2));
        assert_eq!(m.successors_with_order(&[10, 21, 20], 11), (&[51][..], 3));
        assert_eq!(
            m.successors_with_order(&[11, 10, 21, 20], 12),
            (&[52][..], 4)
        );
        assert_eq!(m.successors_with_order(&[10, 21, 7], 13), (&[53][..], 2));
        // 13's path never passes 11: no such context.
        assert_eq!(m.successors_with_order(&[11], 13), (&[53][..], 0));
        // Prefill rows: each row's path is the rows before it.
        let c = PassCandidates::with_top(
            vec![30, 31, 32],
            &[1, 2, 3, 4, 5, 6],
            vec![60, 61, 62],
            100,
            1,
        );
        assert_eq!(c.before, vec![3, 4, 5, 6]);
        m.observe(&c.rows());
        assert_eq!(m.successors_with_order(&[31, 30, 6, 5], 32), (&[62][..], 4));
        assert_eq!(m.successors_with_order(&[6, 5, 4], 30), (&[60][..], 3));
    }

    #[test]
    fn proposals_read_each_node_in_its_context() {
        // A chain template three deep; 1 -> 2 alone, but "1 2" -> 6 and "1 2 6" -> 8.
        let template = RecycleTemplate::from_layers(&[&[1], &[1], &[1]]).unwrap();
        let mut m = RecycleMatrix::new(100, 2).unwrap();
        m.update(1, &[2]);
        m.update(2, &[4]);
        m.update(6, &[7]);
        m.update_in(&[1], 2, &[6]);
        m.update_in(&[2, 1], 6, &[8]);
        let shared = Arc::new(Mutex::new(m));
        let mut d = RecycleDrafter::shared(Arc::clone(&shared), Arc::new(template)).unwrap();
        assert_eq!(
            d.propose(&req(&[9, 1], 10, 10)).unwrap().tokens(),
            vec![1, 2, 6, 8]
        );
        // The root's context comes from the sequence: after "3 1", 1's successor in that
        // context wins over its own.
        shared.lock().unwrap().update_in(&[3], 1, &[5]);
        assert_eq!(
            d.propose(&req(&[3, 1], 10, 10)).unwrap().tokens(),
            vec![1, 5]
        );
        // The warm start keeps the sequence's successors in each of their contexts: 8 came
        // first before 9 ("5 8 9"), but after 7 it came before 11 ("7 8 11").
        let mut fresh = RecycleDrafter::new(100, 2).unwrap();
        let t = fresh
            .propose(&req(&[5, 8, 9, 7, 8, 11, 7, 8], 1, 1))
            .unwrap();
        assert_eq!(t.tokens(), vec![8, 11]);
        assert_eq!(fresh.matrix().successors(8), &[9]);
    }

    #[test]
    fn the_paper_template_has_80_nodes_6_deep() {
        let t = RecycleTemplate::paper();
        assert_eq!(t.len(), 80);
        assert_eq!(t.max_depth(), 6);
        assert_eq!(t.max_rank(), 8);
        let per_depth: Vec<usize> = (1..=6)
            .map(|d| t.nodes.iter().filter(|n| n.depth == d).count())
            .collect();
        assert_eq!(per_depth, vec![8, 21, 25, 15, 8, 3]);
        assert!(RecycleTemplate::from_layers(&[&[2], &[1]]).is_err());
    }

    #[test]
    fn best_first_over_a_hand_built_matrix_gives_the_exact_tree() {
        // Template: root -> ranks 0,1; rank 0 -> ranks 0,1; (0,0) -> rank 0.
        let template = RecycleTemplate::from_layers(&[&[2], &[2, 0], &[1, 0]]).unwrap();
        let mut m = RecycleMatrix::new(100, 2).unwrap();
        m.update(1, &[2, 3]);
        m.update(2, &[4, 5]);
        m.update(4, &[6, 7]);
        m.update(3, &[8, 9]); // never reached: rank 1 of the root has no children here
        let shared = Arc::new(Mutex::new(m));
        let mut d = RecycleDrafter::shared(Arc::clone(&shared), Arc::new(template)).unwrap();
        let t = d.propose(&req(&[9, 1], 10, 10)).unwrap();
        t.validate(100).unwrap();
        // Depth-first: 1 -> 2 -> 4 -> 6, 2 -> 5, 1 -> 3.
        assert_eq!(t.tokens(), vec![1, 2, 4, 6, 5, 3]);
        let parents: Vec<Option<usize>> = t.nodes().iter().map(|n| n.parent).collect();
        assert_eq!(
            parents,
            vec![None, Some(0), Some(1), Some(2), Some(1), Some(0)]
        );
        // A budget of 3 keeps the best path scores under the prior rates: 2 (0.45), 2 -> 4
        // (0.45 x 0.45), 3 (0.12); then a depth limit.
        let t = d.propose(&req(&[9, 1], 3, 10)).unwrap();
        assert_eq!(t.tokens(), vec![1, 2, 4, 3]);
        let t = d.propose(&req(&[9, 1], 10, 1)).unwrap();
        assert_eq!(t.tokens(), vec![1, 2, 3]);
        // Row costs leave out the nodes whose path scores fall below their row's: the best
        // first, while each is worth its row.
        d.set_row_costs(&[0.1]);
        let t = d.propose(&req(&[9, 1], 10, 10)).unwrap();
        assert_eq!(t.tokens(), vec![1, 2, 4, 3]);
        // Cheap first rows, a dear third: the two best nodes only (2: 0.45, 2 -> 4: 0.2025).
        d.set_row_costs(&[0.01, 0.01, 0.15]);
        let t = d.propose(&req(&[9, 1], 10, 10)).unwrap();
        assert_eq!(t.tokens(), vec![1, 2, 4]);
        // A dear second row stops the tree at the best node, whatever the rows after it cost.
        d.set_row_costs(&[0.01, 0.25, 0.01]);
        let t = d.propose(&req(&[9, 1], 10, 10)).unwrap();
        assert_eq!(t.tokens(), vec![1, 2]);
        d.set_row_costs(&[]);
        // A missing successor prunes its subtree; an unknown root proposes nothing.
        shared.lock().unwrap().update(2, &[4]);
        let t = d.propose(&req(&[9, 1], 10, 10)).unwrap();
        assert_eq!(t.tokens(), vec![1, 2, 4, 6, 3]);
        assert_eq!(d.propose(&req(&[9, 50], 10, 10)).unwrap().len(), 1);
        // Successors outside the request's vocabulary are skipped.
        let t = d
            .propose(&DraftRequest {
                vocab: 4,
                ..req(&[9, 1], 10, 10)
            })
            .unwrap();
        assert_eq!(t.tokens(), vec![1, 2, 3]);
    }

    #[test]
    fn rank_rates_follow_what_verification_accepts() {
        let template = RecycleTemplate::from_layers(&[&[2], &[1, 1]]).unwrap();
        let mut m = RecycleMatrix::new(100, 2).unwrap();
        m.update(1, &[2, 3]);
        m.update(2, &[4]);
        m.update(3, &[5]);
        let mut d =
            RecycleDrafter::shared(Arc::new(Mutex::new(m)), Arc::new(template.clone())).unwrap();
        // Budget 2 under the prior: the rank-0 chain 1 -> 2 -> 4.
        assert_eq!(d.propose(&req(&[1], 2, 4)).unwrap().tokens(), vec![1, 2, 4]);
        // The LLM keeps choosing the rank-1 candidate: the budget moves to that branch.
        for _ in 0..60 {
            d.propose(&req(&[1], 4, 4)).unwrap();
            d.accept(&[3, 5], 0);
        }
        assert_eq!(d.propose(&req(&[1], 2, 4)).unwrap().tokens(), vec![1, 3, 5]);
    }

    /// What the candidates of a verification pass cost over qwen's vocabulary (a figure, not an
    /// assertion): `cargo test --release -p arbor-engine recycle::tests::top_k_timing --
    /// --ignored --nocapture`.
    #[test]
    #[ignore]
    fn top_k_timing() {
        let vocab = 151_936;
        for rows in [1usize, 8, 16, 64] {
            let mut s = 0x9E37_79B9_7F4A_7C15u64;
            let logits: Vec<f32> = (0..rows * vocab)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s >> 40) as f32 / (1u64 << 20) as f32
                })
                .collect();
            let reps = 20;
            let t0 = std::time::Instant::now();
            let mut n = 0;
            for _ in 0..reps {
                n += top_k_rows(std::hint::black_box(&logits), vocab, DEFAULT_K).len();
            }
            let ms = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
            eprintln!(
                "top-{DEFAULT_K} of {rows} rows x {vocab}: {ms:.3} ms ({:.2} ns per logit, {n})",
                ms * 1e6 / (rows * vocab) as f64
            );
        }
    }

    #[test]
    fn top_k_rows_are_the_largest_logits_best_first() {
        let vocab = 40;
        let mut logits = vec![0.0f32; 2 * vocab];
        for (i, x) in logits.iter_mut().enumerate() {
            *x = ((i * 7919) % 97) as f32 * 0.1 - 3.0;
        }
        logits[vocab + 33] = f32::NAN;
        let top = top_k_rows(&logits, vocab, 5);
        assert_eq!(top.len(), 10);
        for (r, row) in logits.chunks(vocab).enumerate() {
            let mut ids: Vec<u32> = (0..vocab as u32)
                .filter(|&i| !row[i as usize].is_nan())
                .collect();
            ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            assert_eq!(&top[r * 5..r * 5 + 5], &ids[..5], "row {r}");
        }
        // Ties go to the lower id; k above the vocabulary is capped.
        assert_eq!(top_k_rows(&[1.0, 2.0, 2.0, 0.5], 4, 2), vec![1, 2]);
        assert_eq!(top_k_rows(&[1.0, 2.0], 2, 5), vec![1, 0]);
    }
}
