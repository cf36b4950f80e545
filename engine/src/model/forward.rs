//! The decoder forward pass (llama / qwen2), read top to bottom like llama2.c, over a batch of new tokens.

use crate::backend::{AttentionShape, AttnSeq, Backend};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::{Model, RopeStyle};

pub use crate::backend::BatchMask;

/// Longest causal batch run as one pass; longer ones are split (see `Model::forward`).
const PREFILL_CHUNK: usize = 64;

/// One sequence's rows in a ragged batch ([`Model::forward_batch`]).
pub struct SeqBatch<'a> {
    /// The sequence's K/V: its new rows are written at slots `cache.len()..`.
    pub cache: &'a mut KvCache,
    /// New tokens `[n]` and their RoPE positions `[n]`.
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    /// Which new rows each new row sees (its committed prefix is always visible).
    pub mask: BatchMask<'a>,
    /// Rows (0-based within this sequence) whose logits are returned.
    pub logit_rows: &'a [usize],
}

impl Model {
    /// Run the model over `tokens` (new tokens appended to `cache` at slots `cache.len()..`),
    /// token `t` at RoPE position `positions[t]`, attending per `mask`.
    /// Returns logits for the batch rows listed in `logit_rows`: [logit_rows.len(), vocab].
    /// A batch of one sequence for [`Model::forward_batch`].
    pub fn forward<B: Backend>(
        &self,
        backend: &B,
        cache: &mut KvCache,
        tokens: &[u32],
        positions: &[usize],
        mask: BatchMask<'_>,
        logit_rows: &[usize],
    ) -> Result<Vec<f32>> {
        let n_layers = self.layers.len();
        let one = SeqBatch {
            cache,
            tokens,
            positions,
            mask,
            logit_rows,
        };
        self.forward_one(backend, one, n_layers)
    }

    /// One forward pass over a ragged batch: every linear layer runs once over the rows of all
    /// sequences (`[Σ n_i, ·]`, one weight read per step), attention per sequence over its own
    /// cache. Returns each sequence's logits `[logit_rows.len(), vocab]`, in order. Every row's
    /// logits have the bits it would have in a batch of its own sequence alone (the kernels give
    /// every row the same result whatever the row count). All caches must share one pool.
    pub fn forward_batch<B: Backend>(
        &self,
        backend: &B,
        seqs: &mut [SeqBatch<'_>],
    ) -> Result<Vec<Vec<f32>>> {
        let n_layers = self.layers.len();
        self.forward_layers(backend, seqs, n_layers)
    }

    /// [`Model::forward_batch`] through the first `n_layers` layers only, then the final norm
    /// and output head (early-exit drafting for many sequences at once).
    pub fn forward_batch_layers<B: Backend>(
        &self,
        backend: &B,
        seqs: &mut [SeqBatch<'_>],
        n_layers: usize,
    ) -> Result<Vec<Vec<f32>>> {
        if n_layers == 0 || n_layers > self.layers.len() {
            return Err(EngineError::InvalidArgument(format!(
                "early exit after {n_layers} layers: the model has {}",
                self.layers.len()
            )));
        }
        self.forward_layers(backend, seqs, n_layers)
    }

    /// Like [`Model::forward`] but through the first `n_layers` layers only, then the final norm
    /// and output head (early exit, for self-speculative drafting). `cache` must be this model's.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_early_exit<B: Backend>(
        &self,
        backend: &B,
        cache: &mut KvCache,
        tokens: &[u32],
        positions: &[usize],
        mask: BatchMask<'_>,
        logit_rows: &[usize],
        n_layers: usize,
    ) -> Result<Vec<f32>> {
        if n_layers == 0 || n_layers > self.layers.len() {
            return Err(EngineError::InvalidArgument(format!(
                "early exit after {n_layers} layers: the model has {}",
                self.layers.len()
            )));
        }
        let one = SeqBatch {
            cache,
            tokens,
            positions,
            mask,
            logit_rows,
        };
        self.forward_one(backend, one, n_layers)
    }

    /// A batch of one sequence through `n_layers` layers: its logits.
    fn forward_one<B: Backend>(
        &self,
        backend: &B,
        seq: SeqBatch<'_>,
        n_layers: usize,
    ) -> Result<Vec<f32>> {
        Ok(self
            .forward_layers(backend, &mut [seq], n_layers)?
            .pop()
            .unwrap_or_default())
    }

    /// Run the whole model over a batch like [`Model::forward`] (one pass, no chunking) but return
    /// the final hidden states `[n_tok, n_embd]` (before the output norm) instead of logits, so the
    /// caller computes logits later for the rows it turns out to need ([`Model::logits_of`]; SPACE
    /// verifies the tree first, then reads only the placeholder group after the accepted path).
    pub fn forward_hidden<B: Backend>(
        &self,
        backend: &B,
        cache: &mut KvCache,
        tokens: &[u32],
        positions: &[usize],
        mask: BatchMask<'_>,
    ) -> Result<Vec<f32>> {
        let mut one = [SeqBatch {
            cache,
            tokens,
            positions,
            mask,
            logit_rows: &[],
        }];
        self.check_batch(&one)?;
        let n_layers = self.layers.len();
        backend.scope(|| self.layers_inner(backend, &mut one, n_layers))
    }

    /// Logits `[rows.len(), vocab]` of the listed rows of `hidden` (`[n, n_embd]`, from
    /// [`Model::forward_hidden`]): final norm and output head.
    pub fn logits_of<B: Backend>(
        &self,
        backend: &B,
        hidden: &[f32],
        rows: &[usize],
    ) -> Result<Vec<f32>> {
        let d = self.config.n_embd;
        let n = hidden.len() / d.max(1);
        if hidden.len() != n * d {
            return Err(EngineError::Shape(format!(
                "hidden states of {} values are not rows of {d}",
                hidden.len()
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= n) {
            return Err(EngineError::InvalidArgument(format!(
                "logit row {r} is outside the batch of {n}"
            )));
        }
        backend.scope(|| self.head(backend, hidden, rows))
    }

    /// Check every sequence's shapes against its cache and this model.
    fn check_batch(&self, seqs: &[SeqBatch<'_>]) -> Result<()> {
        for sq in seqs {
            let n_tok = sq.tokens.len();
            if n_tok == 0 || sq.positions.len() != n_tok {
                return Err(EngineError::InvalidArgument(
                    "forward needs one position per token and at least one token".into(),
                ));
            }
            if let Some(&r) = sq.logit_rows.iter().find(|&&r| r >= n_tok) {
                return Err(EngineError::InvalidArgument(format!(
                    "logit row {r} is outside the batch of {n_tok}"
                )));
            }
            if sq.cache.kv_dim() != self.config.kv_dim() {
                return Err(EngineError::Shape(
                    "KV cache belongs to another model".into(),
                ));
            }
            if !sq.cache.pool().same_pool(seqs[0].cache.pool()) {
                return Err(EngineError::InvalidArgument(
                    "the sequences of one batch must share a KV pool".into(),
                ));
            }
        }
        Ok(())
    }

    /// Validate the batch, then run it through `n_layers` layers and the output head (one long
    /// causal sequence in chunks).
    fn forward_layers<B: Backend>(
        &self,
        backend: &B,
        seqs: &mut [SeqBatch<'_>],
        n_layers: usize,
    ) -> Result<Vec<Vec<f32>>> {
        self.check_batch(seqs)?;
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        // Layers, then the output head for every sequence's logit rows.
        let pass = |seqs: &mut [SeqBatch<'_>]| -> Result<Vec<Vec<f32>>> {
            let x = self.layers_inner(backend, seqs, n_layers)?;
            let (mut rows, mut counts) = (Vec::new(), Vec::with_capacity(seqs.len()));
            let mut row0 = 0;
            for sq in seqs.iter() {
                rows.extend(sq.logit_rows.iter().map(|&r| row0 + r));
                counts.push(sq.logit_rows.len());
                row0 += sq.tokens.len();
            }
            let all = self.head(backend, &x, &rows)?; // [rows.len(), vocab]
            let vocab = self.config.vocab_size;
            let mut at = 0;
            Ok(counts
                .iter()
                .map(|&n| {
                    at += n;
                    all[(at - n) * vocab..at * vocab].to_vec()
                })
                .collect())
        };
        if !seqs.iter().all(|sq| matches!(sq.mask, BatchMask::Causal)) {
            // Tree verification: the kernels of single-token decoding, so a verified token is
            // computed bit for bit as incremental decoding would.
            return backend.scope(|| pass(seqs));
        }
        let n_tok = seqs[0].tokens.len();
        if seqs.len() > 1 || n_tok <= PREFILL_CHUNK {
            return backend.scope_prefill(|| pass(seqs));
        }
        // One long causal sequence (prompt prefill) runs in chunks: the matmul kernels are tuned
        // for up to 64 activation rows, and a chunk attends to earlier chunks through the cache
        // exactly as a single pass would.
        let sq = &mut seqs[0];
        let (tokens, positions, logit_rows) = (sq.tokens, sq.positions, sq.logit_rows);
        let vocab = self.config.vocab_size;
        let mut logits = vec![0.0f32; logit_rows.len() * vocab]; // [logit_rows.len(), vocab]
        for start in (0..n_tok).step_by(PREFILL_CHUNK) {
            let end = (start + PREFILL_CHUNK).min(n_tok);
            let (out_idx, local): (Vec<usize>, Vec<usize>) = logit_rows
                .iter()
                .enumerate()
                .filter(|(_, &r)| (start..end).contains(&r))
                .map(|(i, &r)| (i, r - start))
                .unzip();
            let mut part = [SeqBatch {
                cache: &mut *sq.cache,
                tokens: &tokens[start..end],
                positions: &positions[start..end],
                mask: BatchMask::Causal,
                logit_rows: &local,
            }];
            let chunk = backend
                .scope_prefill(|| pass(&mut part))?
                .pop()
                .unwrap_or_default();
            for (j, &i) in out_idx.iter().enumerate() {
                logits[i * vocab..(i + 1) * vocab]
                    .copy_from_slice(&chunk[j * vocab..(j + 1) * vocab]);
            }
        }
        Ok(vec![logits])
    }

    /// The decoder layers over a ragged batch: returns the residual stream `[Σ n_i, n_embd]`
    /// after `n_layers` layers (sequence after sequence).
    fn layers_inner<B: Backend>(
        &self,
        backend: &B,
        seqs: &mut [SeqBatch<'_>],
        n_layers: usize,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let (d, hd, kv_dim) = (c.n_embd, c.head_dim, c.kv_dim());
        let q_dim = c.n_head * hd;
        let Some(pool) = seqs.first().map(|sq| sq.cache.pool().clone()) else {
            return Ok(Vec::new());
        };
        if let Some(sq) = seqs.iter().find(|sq| sq.cache.n_layers() < n_layers) {
            return Err(EngineError::Shape(format!(
                "the KV cache holds {} layers, the pass runs {n_layers}",
                sq.cache.n_layers()
            )));
        }
        let tokens: Vec<u32> = seqs
            .iter()
            .flat_map(|sq| sq.tokens.iter().copied())
            .collect();
        let positions: Vec<usize> = seqs
            .iter()
            .flat_map(|sq| sq.positions.iter().copied())
            .collect();
        let n_tok = tokens.len();
        // Each sequence's first row in the batch and its committed length.
        let mut row0 = Vec::with_capacity(seqs.len());
        let mut n_past = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for sq in seqs.iter() {
            row0.push(at);
            n_past.push(sq.cache.len());
            at += sq.tokens.len();
        }
        let mut g = pool.lock();
        for i in 0..seqs.len() {
            if let Err(e) = seqs[i].cache.reserve_in(&mut g, seqs[i].tokens.len()) {
                // Nothing taken for this pass stays taken.
                for sq in seqs[..i].iter_mut() {
                    sq.cache.shrink(&mut g);
                }
                return Err(e);
            }
        }

        let mut x = vec![0.0f32; n_tok * d]; // [n_tok, n_embd] residual stream
        self.embed(&tokens, &mut x)?;
        let mut xn = vec![0.0f32; n_tok * d]; // [n_tok, n_embd] normalized
        let mut q = vec![0.0f32; n_tok * q_dim]; // [n_tok, n_head * head_dim]
        let mut k = vec![0.0f32; n_tok * kv_dim]; // [n_tok, n_head_kv * head_dim]
        let mut v = vec![0.0f32; n_tok * kv_dim]; // [n_tok, n_head_kv * head_dim]
        let mut att = vec![0.0f32; n_tok * q_dim]; // [n_tok, n_head * head_dim]
        let mut proj = vec![0.0f32; n_tok * d]; // [n_tok, n_embd]
        let mut gate = vec![0.0f32; n_tok * c.n_ff]; // [n_tok, n_ff]
        let mut up = vec![0.0f32; n_tok * c.n_ff]; // [n_tok, n_ff]
        let rope = RopeTable::new(c.rope_base, c.rope_dim, &positions); // [n_tok, rope_dim / 2]

        for (l, w) in self.layers.iter().enumerate().take(n_layers) {
            // Attention block.
            rms_norm(&x, &w.attn_norm, c.rms_eps, &mut xn);
            backend.matmul_many(
                &[self.mat(&w.wq), self.mat(&w.wk), self.mat(&w.wv)],
                &xn,
                n_tok,
                &mut [&mut q, &mut k, &mut v],
            )?;
            add_bias(&mut q, w.bq.as_deref());
            add_bias(&mut k, w.bk.as_deref());
            add_bias(&mut v, w.bv.as_deref());
            rope.apply(&mut q, c.n_head, hd, c.rope_style);
            rope.apply(&mut k, c.n_head_kv, hd, c.rope_style);
            // The cache keeps K/V as f16 (llama.cpp's default cache type).
            for (i, sq) in seqs.iter().enumerate() {
                let rows = row0[i] * kv_dim..(row0[i] + sq.tokens.len()) * kv_dim;
                sq.cache
                    .write_rows(&mut g, l, n_past[i], &k[rows.clone()], &v[rows]);
            }
            let parts: Vec<AttnSeq<'_>> = seqs
                .iter()
                .enumerate()
                .map(|(i, sq)| AttnSeq {
                    shape: AttentionShape {
                        n_tok: sq.tokens.len(),
                        n_past: n_past[i],
                        n_head: c.n_head,
                        n_head_kv: c.n_head_kv,
                        head_dim: hd,
                    },
                    mask: sq.mask,
                    kv: sq.cache.layer(&g, l),
                    row0: row0[i],
                })
                .collect();
            backend.attention_batch(&parts, &q, &mut att)?;
            drop(parts);
            backend.matmul(&self.mat(&w.wo), &att, n_tok, &mut proj)?;
            add_in_place(&mut x, &proj);

            // Feed-forward block (SwiGLU).
            rms_norm(&x, &w.ffn_norm, c.rms_eps, &mut xn);
            backend.matmul_swiglu(
                &self.mat(&w.w_gate),
                &self.mat(&w.w_up),
                &xn,
                n_tok,
                &mut gate,
                &mut up,
            )?;
            backend.matmul(&self.mat(&w.w_down), &gate, n_tok, &mut proj)?;
            add_in_place(&mut x, &proj);
        }
        drop(g);
        for sq in seqs.iter_mut() {
            sq.cache.advance(sq.tokens.len());
        }
        Ok(x)
    }

    /// Final norm and output head for the rows `logit_rows` of the residual stream `x`.
    fn head<B: Backend>(&self, backend: &B, x: &[f32], logit_rows: &[usize]) -> Result<Vec<f32>> {
        let c = &self.config;
        let d = c.n_embd;
        let n_out = logit_rows.len();
        if n_out == 0 {
            return Ok(Vec::new());
        }
        let mut sel = vec![0.0f32; n_out * d]; // [n_out, n_embd]
        for (i, &r) in logit_rows.iter().enumerate() {
            sel[i * d..(i + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        let mut seln = vec![0.0f32; n_out * d];
        rms_norm(&sel, self.output_norm(), c.rms_eps, &mut seln);
        // [n_out, vocab]
        backend.matmul_new(&self.output_matrix(), &seln, n_out)
    }
}

/// RMSNorm per row: out = x / sqrt(mean(x^2) + eps) * weight.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        // The sum of squares in f64 as eight interleaved partial sums: a single running sum is
        // one dependent add per element (~2 µs per 1536-float row), these vectorize.
        let mut part = [0f64; 8];
        let mut blocks = xr.chunks_exact(8);
        for b in blocks.by_ref() {
            for (p, &v) in part.iter_mut().zip(b) {
                *p += (v as f64) * (v as f64);
            }
        }
        let ss = blocks
            .remainder()
            .iter()
            .fold(part.iter().sum::<f64>(), |a, &v| {
                a + (v as f64) * (v as f64)
            });
        let scale = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(weight) {
            *o = xv * scale * wv;
        }
    }
}

fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in x.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// cos/sin of every (token, frequency) pair, computed like ggml: theta_i = pos * base^(-2i/d).
pub(crate) struct RopeTable {
    half: usize,
    pub(crate) cos: Vec<f32>, // [n_tok, half]
    pub(crate) sin: Vec<f32>, // [n_tok, half]
}

impl RopeTable {
    pub(crate) fn new(base: f32, rope_dim: usize, positions: &[usize]) -> RopeTable {
        let half = rope_dim / 2;
        let theta_scale = base.powf(-2.0 / rope_dim as f32);
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            let mut theta = p as f32;
            for _ in 0..half {
                cos.push(theta.cos());
                sin.push(theta.sin());
                theta *= theta_scale;
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotate the first rope_dim dims of every head of every token in `x`: [n_tok, n_heads * hd].
    fn apply(&self, x: &mut [f32], n_heads: usize, hd: usize, style: RopeStyle) {
        let half = self.half;
        for (t, row) in x.chunks_exact_mut(n_heads * hd).enumerate() {
            let cos = &self.cos[t * half..(t + 1) * half];
            let sin = &self.sin[t * half..(t + 1) * half];
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half {
                    let (a, b) = match style {
                        RopeStyle::Norm => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + half),
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
        }
    }
}
