//! Model-based drafters (SpecInfer's small speculative models, SSMs): batched per-depth tree expansion with tree attention over the drafter's own KV cache, kept in step with the LLM's accepted tokens.
//!
//! The drafter keeps the K/V of a prefix of the sequence (`fed`). A proposal first rolls back to
//! the longest common prefix of `fed` and the request's tokens and feeds the missing tokens and
//! the root in one causal pass. It then expands the tree one depth at a time: all frontier nodes
//! of a depth go through the model in one batched pass ([`crate::backend::BatchMask::Scratch`]: each node sees
//! the prefix, its ancestors' scratch rows and itself). When the LLM accepts a path, the rows of
//! the root and of the accepted nodes this drafter computed are compacted in place
//! ([`KvCache::commit_rows`]); rejected branches are dropped and accepted tokens are never
//! recomputed. Tokens the drafter did not propose (another drafter's, the last depth's leaves)
//! are fed at the next proposal.
//!
//! The same drafter runs the LLM's own first layers for early-exit self-speculation
//! ([`super::early_exit`]).

use std::sync::Arc;

use super::dynamic::DraftShape;
use super::{BatchDrafter, BatchKey, DraftPass, DraftRequest, DraftStep, Drafter};
use crate::backend::Backend;
use crate::error::{EngineError, Result};
use crate::kv::{KvCache, KvPool};
use crate::model::{Model, SeqBatch};
use crate::sample::{Rng, Sampler, SamplingParams};
use crate::shared::Shared;
use crate::tree::{draw, normalized, DrafterId, Proposal, TokenTree, TreeBuilder};

/// How a model drafter picks children from its next-token distribution.
#[derive(Clone, Debug, PartialEq)]
pub enum DraftSampling {
    /// The most likely tokens (picked proposals; right for greedy decoding, lossless under MSS).
    TopK,
    /// Independent draws from the drafter's distribution under these parameters (temperature,
    /// top-k, top-p; the seed is unused), recorded so MSS checks them against the LLM.
    Sample(SamplingParams),
}

/// Refuse a drafter whose vocabulary differs from the LLM's: the token tables (GGUF
/// `tokenizer.ggml.tokens`) must be identical, or, for models without tables, the vocabulary
/// sizes equal.
pub fn check_same_vocab(llm: &Model, draft: &Model) -> Result<()> {
    let table = |m: &Model| m.gguf().get("tokenizer.ggml.tokens").cloned();
    let (a, b) = (table(llm), table(draft));
    let same = match (&a, &b) {
        (Some(a), Some(b)) => a == b,
        (None, None) => llm.config.vocab_size == draft.config.vocab_size,
        _ => false,
    };
    if !same {
        let n = |t: &Option<crate::gguf::MetaValue>, m: &Model| {
            t.as_ref()
                .and_then(|t| t.as_array())
                .map_or(m.config.vocab_size, |a| a.len())
        };
        return Err(EngineError::InvalidArgument(format!(
            "the drafter's vocabulary ({} tokens) differs from the LLM's ({} tokens): a drafter \
             must share the LLM's token table",
            n(&b, draft),
            n(&a, llm)
        )));
    }
    Ok(())
}

/// A drafter backed by a model (a small GGUF model, or the LLM's first layers). The model and
/// backend are borrowed (`&Model`) or shared (`Arc<Model>`: a `'static` drafter for threads and
/// actors). Drafters of one model whose caches share a KV pool ([`ModelDrafter::in_pool`]) draft
/// for many sequences in one forward pass per tree depth ([`crate::spec::draft_trees`]).
pub struct ModelDrafter<'m, B: Backend> {
    name: String,
    model: Shared<'m, Model>,
    backend: Shared<'m, B>,
    /// Layers run (all of them for an SSM; early exit runs fewer).
    layers: usize,
    shape: DraftShape,
    sampling: DraftSampling,
    sampler: Option<Sampler>,
    rng: Rng,
    /// Tokens at or above this id are never proposed (the LLM's vocabulary size).
    vocab_limit: usize,
    cache: KvCache,
    /// Tokens whose K/V sit at slots `0..fed.len()`.
    fed: Vec<u32>,
    /// The last proposal's nodes (root first): (parent, token); node `i < scratch_fed` has its
    /// K/V at slot `base + i`.
    scratch: Vec<(Option<usize>, u32)>,
    scratch_fed: usize,
    base: usize,
    /// The proposal under way between two passes ([`BatchDrafter::resume`]).
    expansion: Option<Expansion>,
    /// Forward passes this drafter ran (for itself and the drafters batched with it).
    passes_run: usize,
}

/// A proposal between passes: the tree so far and the frontier whose logits come next.
struct Expansion {
    b: TreeBuilder,
    drafter: DrafterId,
    /// Per builder node: its parent, and its cumulative path probability.
    parents: Vec<Option<usize>>,
    probs: Vec<f32>,
    /// Builder ids whose logits rows the next pass returns, in order.
    frontier: Vec<usize>,
    /// Draft nodes still allowed.
    remaining: usize,
    /// Depth the next logits expand (1 = the root's children).
    depth: usize,
    depth_limit: usize,
    max_nodes: usize,
    /// Dynamic trees: children not expanded (builder ids come after the expansion, so the
    /// expanded nodes' ids stay their scratch slots): (score, parent, token, probability).
    leaves: Vec<(f32, usize, u32, f32)>,
}

impl<'m, B: Backend> ModelDrafter<'m, B> {
    /// A small speculative model drafting for `llm` (vocabularies must match).
    pub fn ssm(
        name: impl Into<String>,
        draft: impl Into<Shared<'m, Model>>,
        llm: &Model,
        backend: impl Into<Shared<'m, B>>,
        shape: DraftShape,
        sampling: DraftSampling,
        seed: u64,
    ) -> Result<Self> {
        let draft = draft.into();
        check_same_vocab(llm, &draft)?;
        let layers = draft.config.n_layers;
        Self::new(
            name,
            draft,
            backend,
            layers,
            llm.config.vocab_size,
            shape,
            sampling,
            seed,
        )
    }

    /// A drafter running the first `layers` layers of `model` (then its final norm and head).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: impl Into<String>,
        model: impl Into<Shared<'m, Model>>,
        backend: impl Into<Shared<'m, B>>,
        layers: usize,
        vocab_limit: usize,
        shape: DraftShape,
        sampling: DraftSampling,
        seed: u64,
    ) -> Result<Self> {
        let model = model.into();
        if layers == 0 || layers > model.config.n_layers {
            return Err(EngineError::InvalidArgument(format!(
                "a drafter needs 1..={} layers, got {layers}",
                model.config.n_layers
            )));
        }
        shape.validate()?;
        let sampler = match &sampling {
            DraftSampling::TopK => None,
            DraftSampling::Sample(p) if p.is_greedy() => {
                return Err(EngineError::InvalidArgument(
                    "a sampling drafter needs a positive temperature".into(),
                ))
            }
            DraftSampling::Sample(p) => Some(Sampler::new(p.clone())?),
        };
        // An early-exit drafter's cache holds its own layers only.
        let cache = KvCache::with_layers(&model.config, layers, model.config.context_length);
        Ok(ModelDrafter {
            name: name.into(),
            vocab_limit: vocab_limit.min(model.config.vocab_size),
            model,
            backend: backend.into(),
            layers,
            shape,
            sampling,
            sampler,
            rng: Rng::new(seed),
            cache,
            fed: Vec::new(),
            scratch: Vec::new(),
            scratch_fed: 0,
            base: 0,
            expansion: None,
            passes_run: 0,
        })
    }

    /// Keep this drafter's K/V in `pool` (blocks for this model's `layers` layers, e.g.
    /// [`KvPool::elastic`]) instead of a private one: drafters of one model sharing a pool batch
    /// their passes. Only before the first proposal.
    pub fn in_pool(mut self, pool: &KvPool) -> Result<Self> {
        if pool.n_layers() != self.layers || pool.kv_dim() != self.model.config.kv_dim() {
            return Err(EngineError::Shape(format!(
                "a pool of {} layers x {} K/V values cannot hold a drafter of {} layers x {}",
                pool.n_layers(),
                pool.kv_dim(),
                self.layers,
                self.model.config.kv_dim()
            )));
        }
        if !self.fed.is_empty() {
            return Err(EngineError::InvalidArgument(
                "a drafter moves to another pool before its first proposal only".into(),
            ));
        }
        self.cache = KvCache::in_pool(pool, self.model.config.context_length);
        Ok(self)
    }

    /// The drafter's cache (committed slots `0..fed().len()`, then scratch of the last proposal).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Tokens whose K/V the cache holds.
    pub fn fed(&self) -> &[u32] {
        &self.fed
    }

    pub fn sampling(&self) -> &DraftSampling {
        &self.sampling
    }

    /// Forward passes this drafter has run, its own and those of the drafters batched with it
    /// (each batched pass is counted once, by the drafter that ran it).
    pub fn passes_run(&self) -> usize {
        self.passes_run
    }

    /// Children of one node: (token, probability) in the order to add them, and the recorded
    /// distribution when sampled.
    fn children(&mut self, logits: &[f32], k: usize) -> Result<ChildPick> {
        let limit = self.vocab_limit.min(logits.len());
        let row = &logits[..limit];
        match &self.sampler {
            None => Ok(ChildPick {
                picks: top_k_probs(row, k),
                dist: None,
            }),
            Some(s) => {
                let dist = normalized(s.distribution(row))?;
                let picks = (0..k).map(|_| draw(&dist, &mut self.rng)).collect();
                Ok(ChildPick {
                    picks,
                    dist: Some(dist),
                })
            }
        }
    }

    /// Expand one depth of `ex` from the logits of its frontier (`[frontier, vocab]`): the new
    /// nodes' builder ids.
    fn expand_depth(&mut self, ex: &mut Expansion, logits: &[f32]) -> Result<Vec<usize>> {
        let vocab = self.model.config.vocab_size;
        let d = ex.depth;
        let mut created: Vec<usize> = Vec::new();
        match self.shape.clone() {
            DraftShape::Expand(cfg) => {
                let k = cfg.branches()[d - 1];
                let frontier = std::mem::take(&mut ex.frontier);
                for (r, &node) in frontier.iter().enumerate() {
                    if ex.remaining == 0 {
                        break;
                    }
                    let take = k.min(ex.remaining);
                    let pick = self.children(&logits[r * vocab..(r + 1) * vocab], take)?;
                    let sampled = pick.dist.is_some();
                    if !sampled {
                        ex.remaining -= pick.picks.len().min(ex.remaining);
                    } else {
                        ex.remaining -= take;
                    }
                    for (tok, p) in pick.picks {
                        let prop = if sampled {
                            Proposal::sampled(ex.drafter, p, 1)
                        } else {
                            Proposal::picked(ex.drafter, p)
                        };
                        let before = ex.b.len();
                        let id = ex.b.add_child(node, tok, Some(prop));
                        if ex.b.len() > before {
                            ex.parents.push(Some(node));
                            ex.probs.push(ex.probs[node] * p);
                            created.push(id);
                        }
                    }
                    if let Some(dist) = pick.dist {
                        ex.b.set_child_dist(node, ex.drafter, Arc::from(dist));
                    }
                }
            }
            DraftShape::Dynamic { beam, .. } => {
                // EAGLE-2: the `beam` best children of every frontier node, scored by cumulative
                // path probability; the `beam` best of the depth are expanded next, the others
                // stay candidates for the final rerank.
                let mut cands: Vec<(f32, usize, u32, f32)> = Vec::new();
                for (r, &node) in ex.frontier.iter().enumerate() {
                    let row = &logits[r * vocab..(r + 1) * vocab];
                    let limit = self.vocab_limit.min(row.len());
                    for (tok, p) in top_k_probs(&row[..limit], beam) {
                        cands.push((ex.probs[node] * p, node, tok, p));
                    }
                }
                cands.sort_by(|a, b| b.0.total_cmp(&a.0));
                let mut cands = cands.into_iter();
                for (score, node, tok, p) in cands.by_ref().take(beam) {
                    let id =
                        ex.b.add_child(node, tok, Some(Proposal::picked(ex.drafter, p)));
                    ex.parents.push(Some(node));
                    ex.probs.push(score);
                    created.push(id);
                }
                ex.leaves.extend(cands);
            }
        }
        Ok(created)
    }

    /// The finished proposal: leaves added, dynamic trees reranked; the scratch kept for
    /// [`Drafter::accept`].
    fn finish_tree(&mut self, mut ex: Expansion) -> TokenTree {
        for (score, node, tok, p) in std::mem::take(&mut ex.leaves) {
            // Never a duplicate: a node's children are distinct tokens, each scored once.
            ex.b.add_child(node, tok, Some(Proposal::picked(ex.drafter, p)));
            ex.parents.push(Some(node));
            ex.probs.push(score);
        }
        let Expansion {
            b,
            drafter,
            parents,
            probs,
            max_nodes,
            ..
        } = ex;
        debug_assert_eq!(parents.len(), b.len());
        self.scratch = (0..b.len()).map(|i| (parents[i], b.token(i))).collect();
        match self.shape {
            DraftShape::Expand(_) => b.build(),
            DraftShape::Dynamic { .. } => {
                // Rerank: the `max_nodes` best nodes by path probability (ancestor-closed: a
                // child never beats its parent, and ties go to the lower id, which a parent
                // has).
                let mut order: Vec<usize> = (1..b.len()).collect();
                order.sort_by(|&x, &y| probs[y].total_cmp(&probs[x]).then(x.cmp(&y)));
                order.truncate(max_nodes);
                order.sort_unstable();
                let mut keep = vec![false; b.len()];
                keep[0] = true;
                let mut out = TreeBuilder::new(b.token(0));
                let mut map = vec![0usize; b.len()];
                for i in order {
                    let Some(p) = parents[i] else { continue };
                    if keep[p] {
                        keep[i] = true;
                        let pr = probs[i] / probs[p].max(f32::MIN_POSITIVE);
                        map[i] = out.add_child(
                            map[p],
                            b.token(i),
                            Some(Proposal::picked(drafter, pr.min(1.0))),
                        );
                    }
                }
                out.build()
            }
        }
    }
}

struct ChildPick {
    picks: Vec<(u32, f32)>,
    dist: Option<Vec<(u32, f32)>>,
}

/// The `k` largest logits (ties to the lower id) with their softmax probabilities.
pub(crate) fn top_k_probs(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    let mut max = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        max = max.max(v);
        if best.len() < k || best.last().is_some_and(|b| v > b.1) {
            let at = best.partition_point(|b| b.1 >= v);
            best.insert(at, (i as u32, v));
            best.truncate(k);
        }
    }
    let sum: f64 = row
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    best.iter()
        .map(|&(t, v)| {
            (
                t,
                (((v - max) as f64).exp() / sum.max(f64::MIN_POSITIVE)) as f32,
            )
        })
        .collect()
}

/// Mask rows of new scratch nodes: bit j of a row is set for scratch node j among the node's
/// ancestors and itself.
fn scratch_mask(parents: &[Option<usize>], new: &[usize], total: usize) -> (usize, Vec<u64>) {
    let words = total.div_ceil(64).max(1);
    let mut bits = vec![0u64; new.len() * words];
    for (r, &id) in new.iter().enumerate() {
        let mut at = Some(id);
        while let Some(i) = at {
            bits[r * words + i / 64] |= 1u64 << (i % 64);
            at = parents[i];
        }
    }
    (words, bits)
}

impl<B: Backend> BatchDrafter for ModelDrafter<'_, B> {
    fn batch_key(&self) -> BatchKey {
        BatchKey::new(&self.model, &*self.backend, self.layers, self.cache.pool())
    }

    /// Roll back to the longest common prefix of the fed tokens and the request's (the last
    /// proposal's scratch goes too), then feed what the LLM accepted since and the root in one
    /// causal pass; the root's logits start the tree.
    fn start(&mut self, req: &DraftRequest<'_>) -> Result<DraftStep> {
        let seq = req.tokens;
        let n = seq.len();
        if n == 0 {
            return Err(EngineError::InvalidArgument(
                "a draft request needs at least the root token".into(),
            ));
        }
        let root = seq[n - 1];
        let keep = self
            .fed
            .iter()
            .zip(&seq[..n - 1])
            .take_while(|(a, b)| a == b)
            .count()
            .min(self.cache.len());
        self.fed.truncate(keep);
        self.cache.truncate(keep);
        self.scratch.clear();
        self.scratch_fed = 0;
        self.expansion = None;
        let depth_limit = self.shape.depth().min(req.max_depth);
        let max_nodes = self.shape.max_nodes().min(req.budget);
        if n + max_nodes + 1 > self.cache.capacity() || depth_limit == 0 || max_nodes == 0 {
            return Ok(DraftStep::Done(TokenTree::root_only(root)));
        }
        let tokens = seq[keep..].to_vec();
        let last = tokens.len() - 1;
        // The pass feeds every token the cache lacks; from here the cache is counted as
        // holding them (a failed pass is rolled back by the next proposal's common prefix).
        self.fed = seq.to_vec();
        self.base = n - 1;
        self.scratch_fed = 1;
        self.expansion = Some(Expansion {
            b: TreeBuilder::new(root),
            drafter: req.drafter,
            parents: vec![None],
            probs: vec![1.0],
            frontier: vec![0],
            remaining: max_nodes,
            depth: 1,
            depth_limit,
            max_nodes,
            leaves: Vec::new(),
        });
        Ok(DraftStep::Pass(DraftPass {
            tokens,
            positions: (keep..n).collect(),
            scratch: None,
            logit_rows: vec![last],
        }))
    }

    /// Expand one depth from the last pass's logits; then either one batched pass over the new
    /// nodes (they follow every fed node in id order; each sees the prefix, its ancestors'
    /// scratch rows and itself) or the finished tree.
    fn resume(&mut self, logits: Vec<f32>) -> Result<DraftStep> {
        let Some(mut ex) = self.expansion.take() else {
            return Err(EngineError::InvalidArgument(
                "a drafter resumed without a proposal under way".into(),
            ));
        };
        let created = self.expand_depth(&mut ex, &logits)?;
        if created.is_empty() || ex.depth == ex.depth_limit || ex.remaining == 0 {
            return Ok(DraftStep::Done(self.finish_tree(ex)));
        }
        debug_assert_eq!(created[0], self.scratch_fed);
        debug_assert_eq!(self.cache.len(), self.base + self.scratch_fed);
        let (words, bits) = scratch_mask(&ex.parents, &created, ex.b.len());
        let tokens: Vec<u32> = created.iter().map(|&i| ex.b.token(i)).collect();
        let pass = DraftPass {
            positions: vec![self.base + ex.depth; created.len()],
            logit_rows: (0..created.len()).collect(),
            tokens,
            scratch: Some((self.base, words, bits)),
        };
        self.scratch_fed += created.len();
        ex.depth += 1;
        ex.frontier = created;
        self.expansion = Some(ex);
        Ok(DraftStep::Pass(pass))
    }

    fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    fn run_batch_with(
        &mut self,
        own: &DraftPass,
        others: Vec<SeqBatch<'_>>,
    ) -> Result<Vec<Vec<f32>>> {
        self.passes_run += 1;
        let mut seqs = Vec::with_capacity(others.len() + 1);
        seqs.push(own.seq(&mut self.cache));
        seqs.extend(others);
        self.model
            .forward_batch_layers(&*self.backend, &mut seqs, self.layers)
    }
}

impl<B: Backend> Drafter for ModelDrafter<'_, B> {
    fn name(&self) -> &str {
        &self.name
    }

    fn max_nodes(&self, max_depth: usize) -> usize {
        self.shape.max_nodes_within(max_depth)
    }

    /// The batched proposal with a batch of one: start, then pass and resume until done.
    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let mut step = self.start(req)?;
        loop {
            match step {
                DraftStep::Done(tree) => return Ok(tree),
                DraftStep::Pass(pass) => {
                    let mut logits = self.run_batch_with(&pass, Vec::new())?;
                    step = self.resume(logits.pop().unwrap_or_default())?;
                }
            }
        }
    }

    fn as_batch(&mut self) -> Option<&mut dyn BatchDrafter> {
        Some(self)
    }

    fn accept(&mut self, accepted: &[u32], _bonus: u32) {
        self.expansion = None;
        if self.scratch.is_empty() {
            return;
        }
        let mut rows = vec![0usize];
        let mut at = 0usize;
        for &t in accepted {
            match (1..self.scratch_fed).find(|&c| self.scratch[c] == (Some(at), t)) {
                Some(c) => {
                    rows.push(c);
                    at = c;
                }
                None => break,
            }
        }
        if self.cache.commit_rows(self.base, &rows).is_ok() {
            self.fed.truncate(self.base + 1);
            self.fed
                .extend(rows[1..].iter().map(|&r| self.scratch[r].1));
        } else {
            // Out of step: resynchronize at the next proposal.
            self.fed.truncate(self.base);
            self.cache.truncate(self.base);
        }
        self.scratch.clear();
        self.scratch_fed = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BatchMask, CpuBackend};
    use crate::draft::{early_exit, NgramDrafter};
    use crate::sample::verify::{Verifier, VerifyMode};
    use crate::spec::SpecSession;
    use crate::testing::{tiny_model, TinySpec};

    fn spec(vocab: usize) -> TinySpec {
        TinySpec {
            arch: "qwen2",
            n_layers: 3,
            vocab,
            ..TinySpec::default()
        }
    }

    /// Greedy incremental decoding: `n` tokens after `prompt`.
    fn incremental(model: &Model, be: &CpuBackend, prompt: &[u32], n: usize) -> Vec<u32> {
        crate::testing::greedy_incremental(model, be, prompt, n, 1)
            .unwrap()
            .1
    }

    fn session<'m>(
        model: &'m Model,
        be: &'m CpuBackend,
        prompt: &[u32],
        first: u32,
        budget: usize,
    ) -> SpecSession<'m, CpuBackend> {
        let mut c = KvCache::new(&model.config, 256);
        let pos: Vec<usize> = (0..prompt.len()).collect();
        model
            .forward(be, &mut c, prompt, &pos, BatchMask::Causal, &[])
            .unwrap();
        let mut seq = prompt.to_vec();
        seq.push(first);
        let v = Verifier::new(VerifyMode::Greedy, SamplingParams::greedy()).unwrap();
        SpecSession::new(model, be, c, seq, v, budget).unwrap()
    }

    /// The drafter's committed K/V equal a fresh causal prefill of the same tokens.
    fn assert_cache_fresh(d: &ModelDrafter<'_, CpuBackend>, model: &Model, be: &CpuBackend) {
        // An early-exit drafter keeps K/V for its own layers only.
        assert_eq!(d.cache().n_layers(), d.layers);
        let fed = d.fed();
        let mut fresh = KvCache::new(&model.config, fed.len());
        let pos: Vec<usize> = (0..fed.len()).collect();
        model
            .forward_early_exit(be, &mut fresh, fed, &pos, BatchMask::Causal, &[], d.layers)
            .unwrap();
        let mut worst = 0.0f32;
        for l in 0..d.layers {
            for s in 0..fed.len() {
                for (a, b) in d.cache().k_row(l, s).iter().zip(fresh.k_row(l, s)) {
                    worst = worst.max((a - b).abs());
                }
                for (a, b) in d.cache().v_row(l, s).iter().zip(fresh.v_row(l, s)) {
                    worst = worst.max((a - b).abs());
                }
            }
        }
        assert!(
            worst <= 1e-4,
            "drafter K/V differ from a fresh prefill by {worst}"
        );
    }

    #[test]
    fn greedy_equals_incremental_with_ssm_early_exit_ngram_and_merged() {
        let llm = tiny_model(&spec(24), 8).unwrap();
        // A draft model: the LLM's own weights with a different seed for part of its layers
        // would be closer; a different random model exercises rejection.
        let ssm = tiny_model(
            &TinySpec {
                n_layers: 1,
                ..spec(24)
            },
            9,
        )
        .unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
        let n = 40;
        let truth = incremental(&llm, &be, &prompt, n);
        let shapes = ["1,1,3,1,1,1,1,1", "4", "2,2,2", "dynamic:12:3:6"];
        for (si, shape) in shapes.iter().enumerate() {
            let shape: DraftShape = shape.parse().unwrap();
            let mk_ssm = || {
                ModelDrafter::ssm(
                    "ssm",
                    &ssm,
                    &llm,
                    &be,
                    shape.clone(),
                    DraftSampling::TopK,
                    1,
                )
                .unwrap()
            };
            let mk_ee = || early_exit(&llm, &be, 2, shape.clone(), DraftSampling::TopK, 2).unwrap();
            let mut combos: Vec<Vec<Box<dyn Drafter + '_>>> =
                vec![vec![Box::new(mk_ssm())], vec![Box::new(mk_ee())]];
            if si == 0 {
                combos.push(vec![Box::new(NgramDrafter::default())]);
                combos.push(vec![
                    Box::new(mk_ssm()),
                    Box::new(NgramDrafter::default()),
                    Box::new(mk_ee()),
                ]);
            }
            for mut ds in combos {
                let names: Vec<String> = ds.iter().map(|d| d.name().to_string()).collect();
                let mut s = session(&llm, &be, &prompt, truth[0], 24 * ds.len());
                let mut refs: Vec<&mut dyn Drafter> = ds
                    .iter_mut()
                    .map(|d| d.as_mut() as &mut dyn Drafter)
                    .collect();
                while s.tokens().len() < prompt.len() + n {
                    s.step(&mut refs, 8).unwrap();
                }
                let got = &s.tokens()[prompt.len()..prompt.len() + n];
                assert_eq!(got, &truth[..], "shape {shape} drafters {names:?}");
                let m = s.metrics();
                assert!(m.steps < n, "{names:?} {shape}: {m:?}");
            }
        }
    }

    #[test]
    fn early_exit_with_all_layers_drafts_the_llm_exactly() {
        // All layers: the drafter is the LLM, so every greedy draft is accepted.
        let llm = tiny_model(&spec(40), 3).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [7u32, 2, 9, 30];
        let truth = incremental(&llm, &be, &prompt, 30);
        for shape in ["1,1,1,1,1", "2,2,1,1", "dynamic:8:2:5"] {
            let mut d =
                early_exit(&llm, &be, 3, shape.parse().unwrap(), DraftSampling::TopK, 1).unwrap();
            let mut s = session(&llm, &be, &prompt, truth[0], 16);
            while s.tokens().len() < prompt.len() + 30 {
                s.step(&mut [&mut d], 5).unwrap();
                assert_cache_fresh(&d, &llm, &be);
            }
            assert_eq!(&s.tokens()[prompt.len()..prompt.len() + 30], &truth[..]);
            let m = s.metrics();
            let full = m.accepted_by_depth.first().copied().unwrap_or(0);
            assert_eq!(full, m.steps, "{shape}: every step accepts: {m:?}");
            assert!(m.mean_accepted() >= 3.0, "{shape}: {m:?}");
        }
    }

    #[test]
    fn ssm_kv_after_rollbacks_equals_fresh_recompute() {
        let llm = tiny_model(&spec(24), 8).unwrap();
        let ssm = tiny_model(
            &TinySpec {
                n_layers: 2,
                ..spec(24)
            },
            11,
        )
        .unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5];
        let truth = incremental(&llm, &be, &prompt, 25);
        let mut d = ModelDrafter::ssm(
            "ssm",
            &ssm,
            &llm,
            &be,
            "2,2,2,1".parse().unwrap(),
            DraftSampling::TopK,
            1,
        )
        .unwrap();
        let mut ng = NgramDrafter::default();
        let mut s = session(&llm, &be, &prompt, truth[0], 40);
        let mut committed_rows = 0;
        while s.tokens().len() < prompt.len() + 25 {
            s.step(&mut [&mut d, &mut ng], 6).unwrap();
            // Right after `accept`: the committed prefix is the root plus the accepted nodes
            // the drafter had computed, all in step with the sequence.
            assert!(s.tokens().starts_with(d.fed()));
            assert_eq!(d.cache().len(), d.fed().len());
            committed_rows += d.fed().len();
            assert_cache_fresh(&d, &ssm, &be);
        }
        assert!(committed_rows > 0);
        assert_eq!(&s.tokens()[prompt.len()..prompt.len() + 25], &truth[..]);
    }

    /// (token, parent, proposals) of every node: what a verifier sees of a tree.
    fn tree_shape(t: &TokenTree) -> Vec<(u32, Option<usize>, Vec<crate::tree::Proposal>)> {
        t.nodes()
            .iter()
            .map(|n| (n.token, n.parent, n.proposals.clone()))
            .collect()
    }

    /// Model drafters of one model whose caches share a pool draft four sequences of different
    /// lengths together (`propose_many`: one forward pass per depth for all of them) and
    /// propose exactly the trees (tokens, shape, probabilities) each proposes alone in its own
    /// cache, round after round (rollbacks, accepted paths committed, bonus tokens fed), for an
    /// SSM and an early-exit drafter, chains, wide and dynamic trees; an n-gram drafter in the
    /// same call proposes alone. The batched caches equal a fresh prefill of what they fed.
    #[test]
    fn batched_drafting_across_sequences_equals_drafting_alone() {
        use crate::spec::{propose_checked, propose_many, ProposeItem};
        let llm = tiny_model(&spec(24), 8).unwrap();
        let ssm = tiny_model(
            &TinySpec {
                n_layers: 1,
                ..spec(24)
            },
            9,
        )
        .unwrap();
        let be = CpuBackend::new(2).unwrap();
        let (budget, max_depth) = (8, 5);
        for shape in ["1,1,3,1,1", "2,2,2", "dynamic:12:3:6"] {
            let shape: DraftShape = shape.parse().unwrap();
            for early in [false, true] {
                let mk = |seed: u64| {
                    if early {
                        early_exit(&llm, &be, 2, shape.clone(), DraftSampling::TopK, seed)
                    } else {
                        ModelDrafter::ssm(
                            "ssm",
                            &ssm,
                            &llm,
                            &be,
                            shape.clone(),
                            DraftSampling::TopK,
                            seed,
                        )
                    }
                    .unwrap()
                };
                let (m, layers) = if early { (&llm, 2) } else { (&ssm, 1) };
                let pool = KvPool::elastic(&m.config, layers, 256);
                let mut batched: Vec<_> = (0..4).map(|i| mk(i).in_pool(&pool).unwrap()).collect();
                let mut alone: Vec<_> = (0..4).map(mk).collect();
                let mut seqs: Vec<Vec<u32>> = (0..4u32)
                    .map(|i| (0..5 + 7 * i).map(|j| (j * 7 + i * 3 + 1) % 24).collect())
                    .collect();
                let (mut ng_batched, mut ng_alone) =
                    (NgramDrafter::default(), NgramDrafter::default());
                let mut rng = crate::sample::Rng::new(5);
                for round in 0..6 {
                    let runs_before: usize = batched.iter().map(|d| d.passes_run()).sum();
                    let mut items: Vec<ProposeItem<'_>> = batched
                        .iter_mut()
                        .zip(&seqs)
                        .map(|(d, s)| {
                            ProposeItem::sole(d as &mut dyn Drafter, s, budget, max_depth, 24)
                        })
                        .collect();
                    items.insert(
                        2,
                        ProposeItem {
                            drafter: &mut ng_batched,
                            tokens: &seqs[1],
                            index: 1,
                            of: 2,
                            budget,
                            max_depth,
                            vocab: 24,
                        },
                    );
                    let mut got = propose_many(&mut items);
                    drop(items);
                    let ng = got.remove(2).unwrap();
                    let ng_want =
                        propose_checked(&mut ng_alone, 1, 2, &seqs[1], budget, max_depth, 24)
                            .unwrap();
                    assert_eq!(tree_shape(&ng), tree_shape(&ng_want));
                    let mut alone_runs = Vec::new();
                    for (i, d) in alone.iter_mut().enumerate() {
                        let before = d.passes_run();
                        let want =
                            propose_checked(d, 0, 1, &seqs[i], budget, max_depth, 24).unwrap();
                        alone_runs.push(d.passes_run() - before);
                        let g = got[i].as_ref().unwrap();
                        assert!(want.n_draft() > 0);
                        assert_eq!(
                            tree_shape(g),
                            tree_shape(&want),
                            "{shape:?} early exit {early} round {round} sequence {i}"
                        );
                    }
                    // Accept a random path of each tree, then a random bonus token.
                    for (i, t) in got.iter().enumerate() {
                        let t = t.as_ref().unwrap();
                        let mut node = 0;
                        let mut path = Vec::new();
                        let depth = (rng.next_u64() % (t.max_depth() as u64 + 1)) as usize;
                        for _ in 0..depth {
                            let ch = t.children(node);
                            if ch.is_empty() {
                                break;
                            }
                            node = ch[(rng.next_u64() % ch.len() as u64) as usize];
                            path.push(t.node(node).token);
                        }
                        let bonus = (rng.next_u64() % 24) as u32;
                        batched[i].accept(&path, bonus);
                        alone[i].accept(&path, bonus);
                        seqs[i].extend(&path);
                        seqs[i].push(bonus);
                    }
                    // One pass per depth for all four: as many passes as the deepest alone.
                    let runs: usize = batched.iter().map(|d| d.passes_run()).sum();
                    assert_eq!(
                        runs - runs_before,
                        *alone_runs.iter().max().unwrap(),
                        "passes of round {round}"
                    );
                }
                for d in &batched {
                    assert_cache_fresh(d, m, &be);
                }
            }
        }
    }

    #[test]
    fn a_different_vocabulary_is_refused() {
        let llm = tiny_model(&spec(24), 8).unwrap();
        let other = tiny_model(&spec(32), 9).unwrap();
        let be = CpuBackend::new(1).unwrap();
        let e = ModelDrafter::ssm(
            "ssm",
            &other,
            &llm,
            &be,
            "1".parse().unwrap(),
            DraftSampling::TopK,
            1,
        );
        let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("vocabulary"), "{msg}");
        assert!(early_exit(&llm, &be, 0, "1".parse().unwrap(), DraftSampling::TopK, 1).is_err());
        assert!(early_exit(&llm, &be, 4, "1".parse().unwrap(), DraftSampling::TopK, 1).is_err());
    }

    /// Path probabilities of a tree's nodes (products of the proposals' probabilities), keyed
    /// by token path.
    fn path_probs(t: &TokenTree) -> Vec<(Vec<u32>, f64)> {
        let mut pr = vec![1.0f64; t.len()];
        let mut out = Vec::new();
        for (i, n) in t.nodes().iter().enumerate().skip(1) {
            pr[i] = pr[n.parent.unwrap()] * n.proposals[0].prob as f64;
            out.push((t.path_tokens(i), pr[i]));
        }
        out
    }

    /// EAGLE-2 dynamic trees rank every child of the expanded nodes (`beam` at depth 1, `beam ×
    /// beam` below), not only the `beam` expanded per depth: `dynamic:64` (beam 4, depth 8)
    /// yields 64 nodes (it yielded 32), `dynamic:116` the whole pool of 4 + 7 × 16, and the
    /// 64-node tree is the 64 most probable nodes of that pool.
    #[test]
    fn dynamic_trees_fill_their_budget_from_all_children() {
        let llm = tiny_model(&spec(96), 8).unwrap();
        let ssm = tiny_model(
            &TinySpec {
                n_layers: 1,
                ..spec(96)
            },
            9,
        )
        .unwrap();
        let be = CpuBackend::new(1).unwrap();
        let prompt = [3u32, 1, 4, 1, 5, 9, 2, 6];
        let propose = |shape: &str, budget: usize| {
            let mut d = ModelDrafter::ssm(
                "ssm",
                &ssm,
                &llm,
                &be,
                shape.parse().unwrap(),
                DraftSampling::TopK,
                1,
            )
            .unwrap();
            d.propose(&DraftRequest {
                tokens: &prompt,
                budget,
                max_depth: 8,
                drafter: 0,
                vocab: 96,
            })
            .unwrap()
        };
        for (shape, budget, want) in [
            ("dynamic:64", 64, 64),
            ("dynamic:64", 40, 40),
            ("dynamic:116", 200, 116),
            ("dynamic:18:2:5", 18, 18),
        ] {
            let t = propose(shape, budget);
            t.validate(96).unwrap();
            assert_eq!(t.n_draft(), want, "{shape} with budget {budget}");
        }
        let pool = propose("dynamic:116", 116);
        assert_eq!(pool.nodes_by_depth(), vec![4, 16, 16, 16, 16, 16, 16, 16]);
        let mut ranked = path_probs(&pool);
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut want: Vec<Vec<u32>> = ranked[..64].iter().map(|r| r.0.clone()).collect();
        let mut got: Vec<Vec<u32>> = path_probs(&propose("dynamic:64", 64))
            .into_iter()
            .map(|r| r.0)
            .collect();
        want.sort();
        got.sort();
        assert_eq!(got, want);
        // Budgets the shape cannot fill are refused up front.
        let too_big = DraftShape::Dynamic {
            budget: 117,
            beam: 4,
            depth: 8,
        };
        let e = ModelDrafter::ssm("ssm", &ssm, &llm, &be, too_big, DraftSampling::TopK, 1);
        let msg = e.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("at most 116"), "{msg}");
    }

    #[test]
    fn top_k_probs_orders_and_normalizes() {
        let row = [0.0f32, 3.0, 1.0, 3.0, f32::NAN, 2.0];
        let t = top_k_probs(&row, 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 5]);
        let total: f32 = (0..6)
            .filter(|&i| i != 4)
            .map(|i| (row[i] - 3.0).exp())
            .sum();
        assert!((t[0].1 - 1.0 / total).abs() < 1e-6);
    }
}
