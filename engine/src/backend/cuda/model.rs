//! The decoder forward pass on a device over a ragged batch (prefill chunks, decode tokens,
//! token trees) with weights, activations and the paged f16 KV pool in the device's memory,
//! written once over [`DeviceOps`] (CUDA kernels, or their host reference in tests).

use std::sync::{Arc, Mutex, MutexGuard};

use arbor_kernels_gpu::plan::{AttentionPlan, KvCommitPlan, SeqMask, SeqRows, BLOCK_SLOTS};
use half::f16;

use super::ops::{DeviceOps, HostOps, PlanBufs};

use crate::backend::BatchMask;
use crate::draft::{DraftRequest, Drafter};
use crate::error::{EngineError, Result};
use crate::kv::{BlockAllocator, KvCache};
use crate::model::SeqBatch;
use crate::model::{Model, ModelConfig, RopeStyle, RopeTable};
use crate::quant::{self, QMatrix};
use crate::tree::TokenTree;

/// Rows of one causal pass when a prompt is prefilled (longer prompts run in chunks).
const PREFILL_ROWS: usize = 512;

/// One f16 weight matrix on the device: `[n_out, n_in]`.
struct DeviceMatrix<O: DeviceOps> {
    data: O::Buf<u16>,
    n_out: usize,
    n_in: usize,
}

impl<O: DeviceOps> DeviceMatrix<O> {
    /// Dequantize a GGUF matrix and upload it as f16 (converted once, at load).
    fn upload(ops: &O, m: &QMatrix<'_>) -> Result<DeviceMatrix<O>> {
        // GGUF row order (a CPU-packed matrix unpacked).
        let data = m.natural_bytes();
        let row_bytes = data.len() / m.n_out.max(1);
        let mut row = vec![0.0f32; m.n_in];
        let mut bits = Vec::with_capacity(m.n_out * m.n_in);
        for r in 0..m.n_out {
            quant::dequantize_row(m.ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut row)?;
            bits.extend(row.iter().map(|&x| f16::from_f32(x).to_bits()));
        }
        Ok(DeviceMatrix {
            data: ops.upload(&bits)?,
            n_out: m.n_out,
            n_in: m.n_in,
        })
    }
}

struct DeviceLayer<O: DeviceOps> {
    attn_norm: O::Buf<f32>,
    ffn_norm: O::Buf<f32>,
    wq: DeviceMatrix<O>,
    wk: DeviceMatrix<O>,
    wv: DeviceMatrix<O>,
    wo: DeviceMatrix<O>,
    w_gate: DeviceMatrix<O>,
    w_up: DeviceMatrix<O>,
    w_down: DeviceMatrix<O>,
    bq: Option<O::Buf<f32>>,
    bk: Option<O::Buf<f32>>,
    bv: Option<O::Buf<f32>>,
}

/// The block allocator behind a lock that a panicking holder cannot poison for everyone else
/// (its state is only ever changed by whole operations).
fn lock(pool: &Mutex<BlockAllocator>) -> MutexGuard<'_, BlockAllocator> {
    pool.lock().unwrap_or_else(|e| e.into_inner())
}

/// One sequence's rows in a device forward pass ([`DeviceModel::forward`]).
pub struct DeviceSeq<'a> {
    /// New tokens `[n]` and their RoPE positions `[n]`.
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    /// Committed slots; the new rows go to slots `n_past..n_past + n`.
    pub n_past: usize,
    /// The sequence's block table (blocks of the model's device pool).
    pub blocks: &'a [u32],
    /// Which new rows each new row sees (the committed prefix always).
    pub mask: SeqMask<'a>,
    /// Rows (within this sequence) whose logits (or argmax) are returned.
    pub logit_rows: &'a [usize],
}

/// What the output head returns for the logit rows.
enum Head {
    Logits,
    Argmax,
}

enum HeadOut {
    Logits(Vec<f32>),
    Argmax(Vec<u32>),
}

impl Head {
    /// The output of a pass without logit rows.
    fn nothing(&self) -> HeadOut {
        match self {
            Head::Logits => HeadOut::Logits(Vec::new()),
            Head::Argmax => HeadOut::Argmax(Vec::new()),
        }
    }
}

/// A model on one device: f16 weights, the paged f16 KV pool (`[n_layers * 2, pool rows,
/// kv_dim]`: layer l's K is plane 2l, its V plane 2l + 1), the operations that run on it.
pub struct DeviceModel<O: DeviceOps> {
    pub config: ModelConfig,
    embed: DeviceMatrix<O>,
    output: DeviceMatrix<O>,
    output_norm: O::Buf<f32>,
    layers: Vec<DeviceLayer<O>>,
    biases: bool,
    kv: O::Buf<u16>,
    pool_rows: usize,
    blocks: Arc<Mutex<BlockAllocator>>,
    // Dropped last: on a GPU every buffer above belongs to its context.
    ops: O,
}

/// The device model on a CUDA device.
#[cfg(feature = "cuda")]
pub type CudaModel = DeviceModel<super::cuda_ops::CudaOps>;

#[cfg(feature = "cuda")]
impl DeviceModel<super::cuda_ops::CudaOps> {
    /// Upload `model` to CUDA device `ordinal` with a KV pool of `kv_blocks` blocks.
    pub fn new(model: &Model, ordinal: usize, kv_blocks: usize) -> Result<Self> {
        DeviceModel::with_ops(super::cuda_ops::CudaOps::new(ordinal)?, model, kv_blocks)
    }
}

impl DeviceModel<HostOps> {
    /// The device model on the host reference of the kernels (tests: the device path's
    /// orchestration without a GPU).
    pub fn on_host(model: &Model, kv_blocks: usize) -> Result<Self> {
        DeviceModel::with_ops(HostOps, model, kv_blocks)
    }
}

impl<O: DeviceOps> DeviceModel<O> {
    /// Upload `model` through `ops` with a KV pool of `kv_blocks` blocks of `BLOCK_SLOTS` slots.
    pub fn with_ops(ops: O, model: &Model, kv_blocks: usize) -> Result<Self> {
        let c = model.config.clone();
        if c.head_dim > 128 || !c.head_dim.is_multiple_of(32) || !c.kv_dim().is_multiple_of(2) {
            return Err(EngineError::InvalidArgument(format!(
                "the device kernels need head_dim a multiple of 32 up to 128, got {}",
                c.head_dim
            )));
        }
        let mut layers = Vec::with_capacity(model.layers.len());
        let mut biases = false;
        for w in &model.layers {
            let opt = |b: &Option<Vec<f32>>| b.as_deref().map(|v| ops.upload(v)).transpose();
            biases |= w.bq.is_some();
            let mat = |t| DeviceMatrix::upload(&ops, &model.mat(t));
            layers.push(DeviceLayer {
                attn_norm: ops.upload(&w.attn_norm)?,
                ffn_norm: ops.upload(&w.ffn_norm)?,
                wq: mat(&w.wq)?,
                wk: mat(&w.wk)?,
                wv: mat(&w.wv)?,
                wo: mat(&w.wo)?,
                w_gate: mat(&w.w_gate)?,
                w_up: mat(&w.w_up)?,
                w_down: mat(&w.w_down)?,
                bq: opt(&w.bq)?,
                bk: opt(&w.bk)?,
                bv: opt(&w.bv)?,
            });
        }
        let pool_rows = kv_blocks * BLOCK_SLOTS;
        let kv = ops.zeroed::<u16>(c.n_layers * 2 * pool_rows * c.kv_dim())?;
        Ok(DeviceModel {
            embed: DeviceMatrix::upload(&ops, &model.embedding_matrix())?,
            output: DeviceMatrix::upload(&ops, &model.output_matrix())?,
            output_norm: ops.upload(model.output_norm())?,
            layers,
            biases,
            kv,
            pool_rows,
            blocks: Arc::new(Mutex::new(BlockAllocator::new(kv_blocks))),
            config: c,
            ops,
        })
    }

    /// Bytes of device memory the weights take.
    pub fn weight_bytes(&self) -> usize {
        let m = |d: &DeviceMatrix<O>| d.n_out * d.n_in * 2;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                    .into_iter()
                    .map(m)
                    .sum::<usize>()
            })
            .sum();
        layers + m(&self.embed) + m(&self.output)
    }

    /// Blocks of the KV pool no sequence holds.
    pub fn free_blocks(&self) -> usize {
        lock(&self.blocks).available()
    }

    /// A new, empty sequence whose blocks come from this model's pool.
    pub fn sequence(&self) -> DeviceSequence {
        DeviceSequence {
            blocks: Vec::new(),
            len: 0,
            pool: self.blocks.clone(),
        }
    }

    /// Element offset of layer `layer`'s K (or V) plane in the pool.
    fn plane(&self, layer: usize, v: bool) -> usize {
        (2 * layer + v as usize) * self.pool_rows * self.config.kv_dim()
    }

    /// One forward pass over the batch: each sequence's logits `[logit_rows.len(), vocab]`.
    pub fn forward(&self, seqs: &[DeviceSeq<'_>]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.config.vocab_size;
        let HeadOut::Logits(all) = self.run(seqs, Head::Logits)? else {
            unreachable!("logits asked")
        };
        Ok(split(seqs, &all, vocab))
    }

    /// One forward pass over the batch: each sequence's greedy token per logit row.
    pub fn forward_argmax(&self, seqs: &[DeviceSeq<'_>]) -> Result<Vec<Vec<u32>>> {
        let HeadOut::Argmax(all) = self.run(seqs, Head::Argmax)? else {
            unreachable!("argmax asked")
        };
        Ok(split(seqs, &all, 1))
    }

    fn run(&self, seqs: &[DeviceSeq<'_>], head: Head) -> Result<HeadOut> {
        self.ops.activate()?;
        let c = &self.config;
        let (d, hd, kv_dim, n_ff) = (c.n_embd, c.head_dim, c.kv_dim(), c.n_ff);
        let q_dim = c.n_head * hd;
        // Validate at the edge: nothing below reads outside a buffer.
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut logit_rows = Vec::new();
        let mut rows = Vec::with_capacity(seqs.len());
        for sq in seqs {
            if sq.tokens.is_empty() || sq.positions.len() != sq.tokens.len() {
                return Err(EngineError::InvalidArgument(
                    "forward needs one position per token and at least one token".into(),
                ));
            }
            if let Some(&t) = sq.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::InvalidArgument(format!(
                    "token id {t} is outside the vocabulary (size {})",
                    c.vocab_size
                )));
            }
            if let Some(&r) = sq.logit_rows.iter().find(|&&r| r >= sq.tokens.len()) {
                return Err(EngineError::InvalidArgument(format!(
                    "logit row {r} is outside the batch of {}",
                    sq.tokens.len()
                )));
            }
            logit_rows.extend(sq.logit_rows.iter().map(|&r| (tokens.len() + r) as u32));
            tokens.extend_from_slice(sq.tokens);
            positions.extend_from_slice(sq.positions);
            rows.push(SeqRows {
                n_past: sq.n_past,
                n_new: sq.tokens.len(),
                blocks: sq.blocks,
                mask: sq.mask,
            });
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(head.nothing());
        }
        let plan = AttentionPlan::new(&rows, c.n_head, c.n_head_kv, hd, self.pool_rows)?;
        let rope = RopeTable::new(c.rope_base, c.rope_dim, &positions);
        let o = &self.ops;

        // Per-pass inputs.
        let tokens_d = o.upload(&tokens)?;
        let cos_d = o.upload(&rope.cos)?;
        let sin_d = o.upload(&rope.sin)?;
        let new_rows_d = o.upload(&plan.new_pool_rows())?;
        let plan_d = PlanBufs::upload(o, &plan)?;
        // Activations.
        let x = o.zeroed::<f32>(n * d)?; // [n, n_embd] residual stream
        let xn = o.zeroed::<f32>(n * d)?; // [n, n_embd]
        let q = o.zeroed::<f32>(n * q_dim)?; // [n, n_head * hd]
        let kn = o.zeroed::<f32>(n * kv_dim)?; // [n, kv_dim]
        let vn = o.zeroed::<f32>(n * kv_dim)?; // [n, kv_dim]
        let att = o.zeroed::<f32>(n * q_dim)?; // [n, n_head * hd]
        let proj = o.zeroed::<f32>(n * d)?; // [n, n_embd]
        let gate = o.zeroed::<f32>(n * n_ff)?; // [n, n_ff]
        let up = o.zeroed::<f32>(n * n_ff)?; // [n, n_ff]
        let half = c.rope_dim / 2;
        let neox = c.rope_style == RopeStyle::Neox;

        o.embed_rows(&self.embed.data, &tokens_d, &x, n, d, c.vocab_size)?;
        for (l, w) in self.layers.iter().enumerate() {
            // Attention block.
            o.rms_norm(&x, &w.attn_norm, &xn, n, d, c.rms_eps)?;
            o.matmul(&w.wq.data, &xn, &q, n, w.wq.n_out, d)?;
            o.matmul(&w.wk.data, &xn, &kn, n, w.wk.n_out, d)?;
            o.matmul(&w.wv.data, &xn, &vn, n, w.wv.n_out, d)?;
            if self.biases {
                for (b, y, width) in [
                    (&w.bq, &q, q_dim),
                    (&w.bk, &kn, kv_dim),
                    (&w.bv, &vn, kv_dim),
                ] {
                    if let Some(b) = b {
                        o.add(y, b, n, width, 0)?;
                    }
                }
            }
            o.rope(&q, &cos_d, &sin_d, n, c.n_head, hd, half, neox)?;
            o.rope(&kn, &cos_d, &sin_d, n, c.n_head_kv, hd, half, neox)?;
            let (k_off, v_off) = (self.plane(l, false), self.plane(l, true));
            o.kv_write(&self.kv, k_off, v_off, &kn, &vn, &new_rows_d, n, kv_dim)?;
            o.attention(&plan, &plan_d, &q, &self.kv, k_off, v_off, &att)?;
            o.matmul(&w.wo.data, &att, &proj, n, d, q_dim)?;
            o.add(&x, &proj, n, d, d)?;
            // Feed-forward block (SwiGLU).
            o.rms_norm(&x, &w.ffn_norm, &xn, n, d, c.rms_eps)?;
            o.matmul(&w.w_gate.data, &xn, &gate, n, n_ff, d)?;
            o.matmul(&w.w_up.data, &xn, &up, n, n_ff, d)?;
            o.silu_mul(&gate, &up, n * n_ff)?;
            o.matmul(&w.w_down.data, &gate, &proj, n, d, n_ff)?;
            o.add(&x, &proj, n, d, d)?;
        }
        // Output head over the logit rows only.
        let n_out = logit_rows.len();
        if n_out == 0 {
            o.sync()?;
            return Ok(head.nothing());
        }
        let rows_d = o.upload(&logit_rows)?;
        let sel = o.zeroed::<f32>(n_out * d)?; // [n_out, n_embd]
        let seln = o.zeroed::<f32>(n_out * d)?;
        let logits = o.zeroed::<f32>(n_out * c.vocab_size)?; // [n_out, vocab]
        o.gather_rows(&x, &rows_d, &sel, n_out, d)?;
        o.rms_norm(&sel, &self.output_norm, &seln, n_out, d, c.rms_eps)?;
        o.matmul(&self.output.data, &seln, &logits, n_out, c.vocab_size, d)?;
        let out = match head {
            Head::Logits => {
                let mut host = vec![0.0f32; n_out * c.vocab_size];
                o.download(&logits, &mut host)?;
                HeadOut::Logits(host)
            }
            Head::Argmax => {
                let best = o.zeroed::<u32>(n_out)?;
                o.argmax(&logits, &best, n_out, c.vocab_size)?;
                let mut host = vec![0u32; n_out];
                o.download(&best, &mut host)?;
                HeadOut::Argmax(host)
            }
        };
        Ok(out)
    }

    /// Move K/V pool rows `src -> dst` in order in every layer (an accepted path's commit).
    pub fn commit(&self, plan: &KvCommitPlan) -> Result<()> {
        if plan.is_empty() {
            return Ok(());
        }
        self.ops.activate()?;
        let limit = self.pool_rows as u32;
        if plan.src.iter().chain(&plan.dst).any(|&r| r >= limit) {
            return Err(EngineError::InvalidArgument(
                "commit row outside the KV pool".into(),
            ));
        }
        // Returns once the copy is done (its index buffers are freed on return).
        self.ops.kv_copy_rows(
            &self.kv,
            plan,
            self.config.n_layers * 2,
            self.pool_rows,
            self.config.kv_dim(),
        )
    }

    /// Feed `tokens` (causal, in chunks) to `seq` without computing logits; returns nothing.
    pub fn prefill(&self, seq: &mut DeviceSequence, tokens: &[u32]) -> Result<()> {
        for chunk in tokens.chunks(PREFILL_ROWS) {
            seq.reserve(chunk.len())?;
            let positions: Vec<usize> = (seq.len..seq.len + chunk.len()).collect();
            self.run(
                &[DeviceSeq {
                    tokens: chunk,
                    positions: &positions,
                    n_past: seq.len,
                    blocks: &seq.blocks,
                    mask: SeqMask::Causal,
                    logit_rows: &[],
                }],
                Head::Argmax,
            )?;
            seq.len += chunk.len();
        }
        Ok(())
    }

    /// Greedy decoding of `n` tokens after `prompt` (at least one token) on the device:
    /// incremental with `drafter = None`, else speculative (the drafter's tree, up to `budget`
    /// nodes, verified in one pass; the longest path the model agrees with is kept).
    pub fn greedy(
        &self,
        prompt: &[u32],
        n: usize,
        mut drafter: Option<&mut dyn Drafter>,
        budget: usize,
    ) -> Result<GreedyRun> {
        let Some((_, head)) = prompt.split_last() else {
            return Err(EngineError::InvalidArgument("empty prompt".into()));
        };
        let mut seq = self.sequence();
        let t0 = std::time::Instant::now();
        self.prefill(&mut seq, head)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let mut ctx = prompt.to_vec();
        let mut out = Vec::with_capacity(n);
        let mut passes = 0;
        let t1 = std::time::Instant::now();
        while out.len() < n {
            let tree = match drafter.as_deref_mut() {
                Some(d) => d.propose(&DraftRequest {
                    tokens: &ctx,
                    budget,
                    max_depth: budget.max(1),
                    drafter: 0,
                    vocab: self.config.vocab_size,
                })?,
                None => TokenTree::root_only(*ctx.last().unwrap_or(&0)),
            };
            let (accepted, bonus) = self.verify_tree(&mut seq, &tree)?;
            passes += 1;
            for &t in accepted.iter().chain(std::iter::once(&bonus)) {
                if out.len() < n {
                    out.push(t);
                }
                ctx.push(t);
            }
            if let Some(d) = drafter.as_deref_mut() {
                d.accept(&accepted, bonus);
            }
        }
        Ok(GreedyRun {
            tokens: out,
            passes,
            prefill_s,
            decode_s: t1.elapsed().as_secs_f64(),
        })
    }

    /// Verify `tree` (root = the last sampled token, not yet fed) after `seq`'s committed
    /// slots: one pass, greedy walk, commit of the accepted path. Returns the accepted tokens
    /// (after the root) and the model's next token.
    pub fn verify_tree(
        &self,
        seq: &mut DeviceSequence,
        tree: &TokenTree,
    ) -> Result<(Vec<u32>, u32)> {
        let tokens = tree.tokens();
        let positions = tree.positions(seq.len);
        let mask = tree.mask();
        let crate::backend::BatchMask::Bits {
            words_per_row,
            bits,
        } = mask.as_batch_mask()
        else {
            unreachable!("tree masks are bitsets")
        };
        seq.reserve(tokens.len())?;
        let all: Vec<usize> = (0..tokens.len()).collect();
        let best = self
            .forward_argmax(&[DeviceSeq {
                tokens: &tokens,
                positions: &positions,
                n_past: seq.len,
                blocks: &seq.blocks,
                mask: SeqMask::Bits {
                    words_per_row,
                    bits,
                },
                logit_rows: &all,
            }])?
            .pop()
            .unwrap_or_default();
        let (mut node, mut accepted) = (0usize, Vec::new());
        let bonus = loop {
            let t = best[node];
            match tree.child_with_token(node, t) {
                Some(child) => {
                    accepted.push(t);
                    node = child;
                }
                None => break t,
            }
        };
        // Keep the root's row and the accepted path's rows, moved to consecutive slots.
        let path = tree.path(node);
        let pairs = path.iter().enumerate().map(|(i, &row)| {
            (
                seq.pool_row(seq.len + row) as u32,
                seq.pool_row(seq.len + 1 + i) as u32,
            )
        });
        self.commit(&KvCommitPlan::new(pairs))?;
        seq.len += 1 + path.len();
        seq.shrink();
        Ok((accepted, bonus))
    }
}

/// Split `[Σ rows, width]` results per sequence.
fn split<T: Copy>(seqs: &[DeviceSeq<'_>], all: &[T], width: usize) -> Vec<Vec<T>> {
    let mut at = 0;
    seqs.iter()
        .map(|sq| {
            let n = sq.logit_rows.len() * width;
            at += n;
            all[at - n..at].to_vec()
        })
        .collect()
}

/// A greedy run's tokens and timings.
#[derive(Clone, Debug)]
pub struct GreedyRun {
    pub tokens: Vec<u32>,
    /// Verification passes (one per generated token when incremental).
    pub passes: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
}

/// One sequence's committed length and block table in a [`DeviceModel`]'s pool; its blocks go back
/// to the pool on drop.
pub struct DeviceSequence {
    pub blocks: Vec<u32>,
    pub len: usize,
    pool: Arc<Mutex<BlockAllocator>>,
}

impl DeviceSequence {
    /// Make room for `n` more slots after `len`.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        let need = (self.len + n).div_ceil(BLOCK_SLOTS);
        let mut pool = lock(&self.pool);
        while self.blocks.len() < need {
            let Some(b) = pool.allocate() else {
                return Err(EngineError::KvPoolExhausted {
                    needed: need - self.blocks.len(),
                });
            };
            self.blocks.push(b);
        }
        Ok(())
    }

    /// Give back blocks past the committed slots.
    pub fn shrink(&mut self) {
        let keep = self.len.div_ceil(BLOCK_SLOTS);
        let mut pool = lock(&self.pool);
        for b in self.blocks.drain(keep..) {
            let _ = pool.release(b);
        }
    }

    /// The pool row of slot `slot`.
    pub fn pool_row(&self, slot: usize) -> usize {
        self.blocks[slot / BLOCK_SLOTS] as usize * BLOCK_SLOTS + slot % BLOCK_SLOTS
    }
}

impl Drop for DeviceSequence {
    fn drop(&mut self) {
        let mut pool = lock(&self.pool);
        for b in self.blocks.drain(..) {
            let _ = pool.release(b);
        }
    }
}

/// The scheduler's forward pass on a device. The host `KvPool` keeps the bookkeeping (block
/// tables, reference counts, the prefix cache); the device keeps the K/V values of the same block
/// ids, so its pool must have at least as many blocks as the host's (`DeviceModel::with_ops`).
pub trait DeviceForward: Send + Sync {
    /// [`Model::forward_batch`] on the device: each cache's new rows go to its slots
    /// `len()..`, every cache advances, and each sequence's logit rows come back.
    fn forward_batch(&self, seqs: &mut [SeqBatch<'_>]) -> Result<Vec<Vec<f32>>>;

    /// [`KvCache::commit_rows`] with the device's rows moved too.
    fn commit_rows(&self, cache: &mut KvCache, base: usize, keep: &[usize]) -> Result<()>;
}

impl<O: DeviceOps> DeviceForward for DeviceModel<O> {
    fn forward_batch(&self, seqs: &mut [SeqBatch<'_>]) -> Result<Vec<Vec<f32>>> {
        // Reserve every sequence's slots in the host pool (its blocks are the device's too). A
        // shared block about to change is copied on the host (copy-on-write): copy it here too.
        let mut copies = Vec::new();
        for i in 0..seqs.len() {
            let before = seqs[i].cache.blocks().to_vec();
            if let Err(e) = seqs[i].cache.reserve(seqs[i].tokens.len()) {
                for sq in seqs[..i].iter_mut() {
                    let len = sq.cache.len();
                    sq.cache.truncate(len);
                }
                return Err(e);
            }
            for (&old, &new) in before.iter().zip(seqs[i].cache.blocks()) {
                if old != new {
                    copies.extend(
                        (0..BLOCK_SLOTS as u32)
                            .map(|r| (old * BLOCK_SLOTS as u32 + r, new * BLOCK_SLOTS as u32 + r)),
                    );
                }
            }
        }
        self.commit(&KvCommitPlan::new(copies))?;
        let batch: Vec<DeviceSeq<'_>> = seqs
            .iter()
            .map(|sq| {
                let mask = match sq.mask {
                    BatchMask::Causal => SeqMask::Causal,
                    BatchMask::Bits {
                        words_per_row,
                        bits,
                    } => SeqMask::Bits {
                        words_per_row,
                        bits,
                    },
                    BatchMask::Scratch { .. } => {
                        return Err(EngineError::InvalidArgument(
                            "scratch-slot masks (drafter trees) do not run on a device".into(),
                        ))
                    }
                };
                Ok(DeviceSeq {
                    tokens: sq.tokens,
                    positions: sq.positions,
                    n_past: sq.cache.len(),
                    blocks: sq.cache.blocks(),
                    mask,
                    logit_rows: sq.logit_rows,
                })
            })
            .collect::<Result<_>>()?;
        let logits = self.forward(&batch);
        drop(batch);
        match logits {
            Ok(l) => {
                for sq in seqs.iter_mut() {
                    sq.cache.advance(sq.tokens.len());
                }
                Ok(l)
            }
            Err(e) => {
                for sq in seqs.iter_mut() {
                    let len = sq.cache.len();
                    sq.cache.truncate(len);
                }
                Err(e)
            }
        }
    }

    fn commit_rows(&self, cache: &mut KvCache, base: usize, keep: &[usize]) -> Result<()> {
        // Checked as the host checks them, before anything moves on the device.
        let scratch = cache.len().saturating_sub(base);
        if keep.windows(2).any(|w| w[0] >= w[1]) || keep.last().is_some_and(|&r| r >= scratch) {
            return Err(EngineError::InvalidArgument(format!(
                "rows to keep must be strictly increasing and below {scratch}"
            )));
        }
        let row = |s: usize| cache.pool_row(s) as u32;
        let pairs = keep
            .iter()
            .enumerate()
            .map(|(j, &r)| (row(base + r), row(base + j)));
        self.commit(&KvCommitPlan::new(pairs))?;
        cache.commit_rows(base, keep)
    }
}
