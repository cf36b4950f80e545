//! CPU backend: quantized SIMD matmuls (quant module) and attention, multi-threaded on a rayon pool.

use rayon::prelude::*;

use super::simd;
use super::{AttentionShape, AttnSeq, Backend, BatchMask, KvLayer};
use crate::error::{EngineError, Result};
use crate::quant::{self, QMatrix};

/// Cache slots per attention block: their K (or V) rows stay in L1 while every query head of a
/// group, for every token of a task, reads them (32 rows of 128 f32 = 16 KiB).
const SLOT_BLOCK: usize = 32;
/// Most f32 scores one batched-attention task holds (2 MiB).
const SCORES_MAX: usize = 1 << 19;
/// Most query heads per KV head that batched attention (`attention_by_kv_head`) takes together.
const MAX_GROUP: usize = 16;

/// Where the CPU backend runs the AMX kernel family (`quant::with_amx`; only where the CPU and
/// OS grant AMX, and only for the weight types it covers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxUse {
    /// Never: every matmul on the VNNI kernels.
    Never,
    /// Prompt prefill only: decoding and tree verification stay on the VNNI kernels. On packed
    /// weights (the default) every family gives the same bits; on natural ones prefill sums in
    /// the AMX order.
    Prefill,
    /// Every forward pass (the default): prefill, decoding and verification all in the AMX
    /// family (on packed weights the tiles for 8+ rows and the packed VNNI kernels below, the
    /// AVX-512 family's bits; on natural ones tiles and AMX-order VNNI kernels), bit-identical to
    /// each other (see docs/benchmarks.md).
    Always,
}

/// The CPU backend owns its worker pool; `threads` = 0 means one per core.
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    /// Where the AMX kernels run (see [`Backend::scope_prefill`]).
    amx: AmxUse,
}

impl CpuBackend {
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("arbor-cpu-{i}"))
            .build()
            .map_err(|e| {
                EngineError::InvalidArgument(format!("cannot start {threads} threads: {e}"))
            })?;
        Ok(CpuBackend {
            pool,
            amx: AmxUse::Always,
        })
    }

    /// Never use AMX tiles, not even in prompt prefill: every batch is then computed bit for bit
    /// as single-token decoding computes it (the VNNI kernels give the same result for any
    /// number of rows).
    pub fn bit_exact(self) -> CpuBackend {
        self.with_amx_use(AmxUse::Never)
    }

    /// Chooses where the AMX kernels run (`AmxUse`). `ARBOR_KERNEL=amx` in the environment
    /// means `Always` for every backend, `ARBOR_KERNEL=avx512` (or lower) `Never`.
    pub fn with_amx_use(mut self, amx: AmxUse) -> CpuBackend {
        self.amx = amx;
        self
    }

    pub fn amx_use(&self) -> AmxUse {
        self.amx
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.amx {
            AmxUse::Always => self.pool.install(|| quant::with_amx_family(f)),
            _ => self.pool.install(f),
        }
    }

    fn scope_prefill<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.amx {
            AmxUse::Never => self.pool.install(f),
            AmxUse::Prefill => self.pool.install(|| quant::with_amx(f)),
            AmxUse::Always => self.pool.install(|| quant::with_amx_family(f)),
        }
    }

    fn matmul(&self, w: &QMatrix, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()> {
        quant::matmul(w, x, n_tok, y)
    }

    fn matmul_new(&self, w: &QMatrix, x: &[f32], n_tok: usize) -> Result<Vec<f32>> {
        quant::matmul_new(w, x, n_tok)
    }

    fn matmul_many(
        &self,
        ws: &[QMatrix],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        // Decode-sized batches: one parallel region for all of them, so the worker threads wake
        // once per group instead of once per matrix (the wake-ups dominated small matmuls).
        // Larger batches are compute-bound: each matmul splits its own rows, except that the AMX
        // tiles pack the activations once and run all the matrices' row tiles in one region.
        let amx = quant::amx_scope();
        if n_tok > 4 {
            return quant::matmul_many_in(amx, ws, x, n_tok, outs);
        }
        // The jobs may run on other threads of the pool: carry this thread's AMX scope to them.
        ws.par_iter()
            .zip(outs.par_iter_mut())
            .try_for_each(|(w, y)| quant::matmul_in(amx, w, x, n_tok, y))
    }

    fn matmul_swiglu(
        &self,
        w_gate: &QMatrix,
        w_up: &QMatrix,
        x: &[f32],
        n_tok: usize,
        gate: &mut [f32],
        up: &mut [f32],
    ) -> Result<()> {
        // Batches as `matmul_many`'s (the AMX tiles gate each task's rows in its cache).
        if n_tok > 4 {
            return quant::matmul_swiglu_in(quant::amx_scope(), w_gate, w_up, x, n_tok, gate, up);
        }
        self.matmul_many(&[*w_gate, *w_up], x, n_tok, &mut [&mut *gate, &mut *up])?;
        simd::silu_mul(gate, up);
        Ok(())
    }

    fn attention(
        &self,
        s: AttentionShape,
        mask: BatchMask<'_>,
        q: &[f32],
        kv: KvLayer<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        let one = [AttnSeq {
            shape: s,
            mask,
            kv,
            row0: 0,
        }];
        self.attention_batch(&one, q, out)
    }

    fn attention_batch(&self, seqs: &[AttnSeq<'_>], q: &[f32], out: &mut [f32]) -> Result<()> {
        let Some(first) = seqs.first() else {
            return Ok(());
        };
        let (n_head, hd) = (first.shape.n_head, first.shape.head_dim);
        let width = n_head * hd;
        let n_rows = q.len() / width.max(1);
        if q.len() != n_rows * width || out.len() != q.len() {
            return Err(EngineError::Shape(
                "attention buffers do not match shape".into(),
            ));
        }
        // Which sequence owns each row of the one-task-per-(token, head) pass (None: another
        // path, or no sequence).
        let mut owner: Vec<Option<usize>> = vec![None; n_rows];
        for (i, sq) in seqs.iter().enumerate() {
            let s = sq.shape;
            let rows = sq.row0..sq.row0 + s.n_tok;
            if s.n_head != n_head
                || s.head_dim != hd
                || s.n_head_kv == 0
                || !n_head.is_multiple_of(s.n_head_kv)
                || rows.end > n_rows
                || owner[rows.clone()].iter().any(Option::is_some)
                || !sq.kv.covers(s.n_past + s.n_tok, s.n_head_kv * hd)
            {
                return Err(EngineError::Shape(
                    "attention buffers do not match shape".into(),
                ));
            }
            if s.n_tok * s.n_head_kv >= 8 && n_head / s.n_head_kv <= MAX_GROUP {
                // Prefill chunks and trees: a KV head's query heads and tokens per task.
                let r = rows.start * width..rows.end * width;
                attention_by_kv_head(s, sq.mask, &q[r.clone()], sq.kv, &mut out[r], SCORES_MAX);
            } else {
                owner[rows].fill(Some(i));
            }
        }
        if owner.iter().all(Option::is_none) {
            return Ok(());
        }
        // Decoding-sized parts of every sequence in one parallel region: one task per (token,
        // KV head, tile of that head's query heads), so the query heads sharing a KV head widen
        // its K and V rows once, every thread has work, and the threads wake once per layer, not
        // per sequence.
        let n_kv = seqs[owner.iter().flatten().next().copied().unwrap_or(0)]
            .shape
            .n_head_kv;
        let tile = decode_head_tile(
            n_head,
            n_kv,
            owner.iter().filter(|o| o.is_some()).count(),
            rayon::current_num_threads(),
        );
        out.par_chunks_mut(tile * hd).enumerate().for_each_init(
            || (Vec::<f32>::new(), Vec::<usize>::new(), Vec::<f32>::new()),
            |(scores, slots, qh), (idx, o)| {
                let tiles_per_row = n_head / tile;
                let (row, h0) = (idx / tiles_per_row, (idx % tiles_per_row) * tile);
                let Some(sq) = owner[row].map(|i| &seqs[i]) else {
                    return;
                };
                let s = sq.shape;
                let kv_dim = s.n_head_kv * hd;
                let group = n_head / s.n_head_kv;
                let scale = 1.0 / (hd as f32).sqrt();
                // Q at f16 precision, like the K it meets (llama.cpp's K·Q runs in f16).
                let src = row * width + h0 * hd;
                qh.clear();
                qh.extend_from_slice(&q[src..src + o.len()]);
                simd::round_f16_slice(qh);
                visible_slots(s, sq.mask, row - sq.row0, slots);
                sq.kv.to_rows(slots);
                let n = slots.len();
                let mut maxes = [0f32; MAX_GROUP];
                // Heads of one KV head share the slots; a tile never spans two KV heads unless
                // the sequence's grouping differs from the batch's first (then head by head).
                let mut h = 0;
                while h < o.len() / hd {
                    let kvh = (h0 + h) / group;
                    let g = (group - (h0 + h) % group).min(o.len() / hd - h);
                    scores.resize(g * n, 0.0);
                    let qg = &qh[h * hd..(h + g) * hd];
                    simd::attn_scores_group(
                        qg,
                        hd,
                        sq.kv.k,
                        slots,
                        kv_dim,
                        kvh * hd,
                        scale,
                        scores,
                        n,
                        &mut maxes[..g],
                    );
                    for (j, &max) in maxes[..g].iter().enumerate() {
                        softmax_f16(&mut scores[j * n..(j + 1) * n], max);
                    }
                    let og = &mut o[h * hd..(h + g) * hd];
                    og.fill(0.0);
                    simd::attn_weighted_sum_group(
                        scores,
                        n,
                        hd,
                        sq.kv.v,
                        slots,
                        kv_dim,
                        kvh * hd,
                        og,
                    );
                    h += g;
                }
            },
        );
        Ok(())
    }
}

/// Query heads per task of the decoding-sized attention pass: a KV head's whole group (its K
/// and V rows widened once for all of them), split into equal tiles only as far as needed to give
/// every thread two tasks over `rows` rows.
fn decode_head_tile(n_head: usize, n_kv: usize, rows: usize, threads: usize) -> usize {
    if n_kv == 0 || !n_head.is_multiple_of(n_kv) || n_head / n_kv > MAX_GROUP {
        return 1;
    }
    let group = n_head / n_kv;
    let want = (2 * threads).div_ceil((rows * n_kv).max(1));
    // The largest divisor of `group` giving at least `want` tiles per KV head.
    (1..=group)
        .rev()
        .find(|&t| group.is_multiple_of(t) && group / t >= want)
        .unwrap_or(1)
}

/// The cache slots new token `t` attends to, ascending.
fn visible_slots(s: AttentionShape, mask: BatchMask<'_>, t: usize, slots: &mut Vec<usize>) {
    let n_slots = s.n_past + s.n_tok;
    slots.clear();
    if let BatchMask::Causal = mask {
        slots.extend(0..s.n_past + t + 1);
    } else if let BatchMask::Scratch { base, .. } = mask {
        let base = base.min(s.n_past);
        slots.extend(0..base);
        slots.extend((base..n_slots).filter(|&j| mask.visible_slot(t, j, s.n_past)));
    } else {
        slots.extend(0..s.n_past);
        slots.extend(
            (0..s.n_tok)
                .filter(|&j| mask.visible(t, j))
                .map(|j| s.n_past + j),
        );
    }
}

/// Scores → attention weights in place: `exp(score − max)` normalized, then rounded to f16
/// precision (llama.cpp multiplies them with V in f16).
fn softmax_f16(scores: &mut [f32], max: f32) {
    let sum = simd::exp_sub_sum(scores, max);
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    for sc in scores.iter_mut() {
        *sc *= inv;
    }
    simd::round_f16_slice(scores);
}

/// Batched attention, one task per (KV head, chunk of tokens; a task holds at most about
/// `scores_max` scores): the cache is walked in blocks of
/// `SLOT_BLOCK` slots, and each block's K (then V) rows, read from memory once, serve every query
/// head of the group for every token of the chunk from L1. (One task per token would read the
/// whole cache once per token: at 16 tokens that is most of the attention time.) Each (token,
/// head) gets exactly the operations of the one-head-per-task path, in the same order: its scores
/// block by block in slot order, the same softmax, its output accumulated block by block.
fn attention_by_kv_head(
    s: AttentionShape,
    mask: BatchMask<'_>,
    q: &[f32],
    kv: KvLayer<'_>,
    out: &mut [f32],
    scores_max: usize,
) {
    let hd = s.head_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let kv_dim = s.n_head_kv * hd;
    let group = s.n_head / s.n_head_kv;
    let n_slots = s.n_past + s.n_tok;
    // Enough tasks for every thread (two per thread), fewest cache passes.
    let per_head = (2 * rayon::current_num_threads())
        .div_ceil(s.n_head_kv)
        .clamp(1, s.n_tok);
    // A task's scores are [tokens × group, n_slots]: keep them within ~2 MiB (L2), so a long
    // prompt's prefill takes more, smaller chunks instead of memory quadratic in its length.
    let max_tok = (scores_max / (group * n_slots)).max(1);
    let chunk = s.n_tok.div_ceil(per_head).min(max_tok);
    let tasks: Vec<(usize, usize, usize)> = (0..s.n_head_kv)
        .flat_map(|kvh| {
            (0..s.n_tok)
                .step_by(chunk)
                .map(move |t0| (kvh, t0, (t0 + chunk).min(s.n_tok)))
        })
        .collect();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(kvh, t0, t1)| {
            let nt = t1 - t0;
            let rows = nt * group;
            let h0 = kvh * group;
            // [rows, hd] queries (row = token × group head) at f16 precision, like the K they meet.
            let mut qr = vec![0f32; rows * hd];
            for (ti, qt) in qr.chunks_exact_mut(group * hd).enumerate() {
                let src = ((t0 + ti) * s.n_head + h0) * hd;
                qt.copy_from_slice(&q[src..src + group * hd]);
            }
            simd::round_f16_slice(&mut qr);
            let mut slots: Vec<Vec<usize>> = (t0..t1)
                .map(|t| {
                    let mut sl = Vec::new();
                    visible_slots(s, mask, t, &mut sl);
                    sl
                })
                .collect();
            // Both passes walk the same (block, token) pieces, block-major: token `ti`'s slots
            // `sl[c0..c1]` inside block [b0, b0 + SLOT_BLOCK) (its list is ascending).
            let mut pieces: Vec<(usize, usize, usize)> = Vec::new();
            for b0 in (0..n_slots).step_by(SLOT_BLOCK) {
                let b1 = b0 + SLOT_BLOCK;
                for (ti, sl) in slots.iter().enumerate() {
                    let (c0, c1) = (
                        sl.partition_point(|&x| x < b0),
                        sl.partition_point(|&x| x < b1),
                    );
                    if c1 > c0 {
                        pieces.push((ti, c0, c1));
                    }
                }
            }
            // The pieces are cut; from here on each token's list holds its slots' pool rows.
            for sl in slots.iter_mut() {
                kv.to_rows(sl);
            }
            // [rows, n_slots] scores, then weights (row r uses the first len(slots of its token)).
            let mut sc = vec![0f32; rows * n_slots];
            let mut maxes = vec![f32::NEG_INFINITY; rows];
            // A token's query heads share its slots: each piece's K rows widened once for the
            // group ([`simd::attn_scores_group`]; per head the one-head kernel's bits).
            let mut m = [0f32; MAX_GROUP];
            for &(ti, c0, c1) in &pieces {
                let (r0, sl) = (ti * group, &slots[ti][c0..c1]);
                simd::attn_scores_group(
                    &qr[r0 * hd..(r0 + group) * hd],
                    hd,
                    kv.k,
                    sl,
                    kv_dim,
                    kvh * hd,
                    scale,
                    &mut sc[r0 * n_slots + c0..(r0 + group) * n_slots],
                    n_slots,
                    &mut m[..group],
                );
                for (r, &mr) in (r0..r0 + group).zip(&m[..group]) {
                    maxes[r] = maxes[r].max(mr);
                }
            }
            for (r, &max) in maxes.iter().enumerate() {
                let n = slots[r / group].len();
                softmax_f16(&mut sc[r * n_slots..r * n_slots + n], max);
            }
            // [rows, hd] outputs.
            let mut o = vec![0f32; rows * hd];
            for &(ti, c0, c1) in &pieces {
                let r0 = ti * group;
                simd::attn_weighted_sum_group(
                    &sc[r0 * n_slots + c0..(r0 + group) * n_slots],
                    n_slots,
                    hd,
                    kv.v,
                    &slots[ti][c0..c1],
                    kv_dim,
                    kvh * hd,
                    &mut o[r0 * hd..(r0 + group) * hd],
                );
            }
            o
        })
        .collect();
    for (&(kvh, t0, t1), o) in tasks.iter().zip(&results) {
        for ti in 0..t1 - t0 {
            let dst = ((t0 + ti) * s.n_head + kvh * group) * hd;
            out[dst..dst + group * hd].copy_from_slice(&o[ti * group * hd..(ti + 1) * group * hd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    /// Rows `[n_slots, dim]` as a paged f16 cache whose blocks lie in reverse order.
    struct Paged {
        k: Vec<half::f16>,
        v: Vec<half::f16>,
        blocks: Vec<crate::kv::BlockId>,
    }

    impl Paged {
        fn new(k: &[f32], v: &[f32], dim: usize) -> Paged {
            use crate::kv::BLOCK_SLOTS;
            let n_slots = k.len() / dim;
            let nb = n_slots.div_ceil(BLOCK_SLOTS);
            let blocks: Vec<u32> = (0..nb as u32).rev().collect();
            let mut p = Paged {
                k: vec![half::f16::ZERO; nb * BLOCK_SLOTS * dim],
                v: vec![half::f16::ZERO; nb * BLOCK_SLOTS * dim],
                blocks,
            };
            for s in 0..n_slots {
                let r = p.layer().row(s);
                for d in 0..dim {
                    p.k[r * dim + d] = half::f16::from_f32(k[s * dim + d]);
                    p.v[r * dim + d] = half::f16::from_f32(v[s * dim + d]);
                }
            }
            p
        }

        fn layer(&self) -> KvLayer<'_> {
            KvLayer {
                k: &self.k,
                v: &self.v,
                blocks: &self.blocks,
            }
        }
    }

    /// Values rounded to f16 (what the cache holds).
    fn f16_values(n: usize, seed: u64) -> Vec<f32> {
        values(n, seed)
            .into_iter()
            .map(|x| half::f16::from_f32(x).to_f32())
            .collect()
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::sample::Rng::new(seed);
        (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
    }

    /// Batched attention (a KV head's query heads and tokens in one task, slots in blocks) gives
    /// every head exactly the bits of the same call with each KV head copied out to its query
    /// heads (no groups), for causal and tree masks, AVX-512 and portable head sizes; causal
    /// tokens exactly the bits of decoding them one at a time (one head per task); and all
    /// within f16 rounding of an f64 reference (a lost slot block or KV head shows there).
    #[test]
    fn grouped_attention_bit_identical_per_head_and_equal_to_reference() {
        let backend = CpuBackend::new(2).expect("backend");
        let (n_head, n_kv, n_past, n_tok) = (6usize, 2usize, 45usize, 8usize);
        let group = n_head / n_kv;
        let n_slots = n_past + n_tok;
        // Tree: token t sees itself and the earlier tokens j with j % 3 != 1.
        let bits: Vec<u64> = (0..n_tok)
            .map(|t| {
                (0..=t)
                    .filter(|&j| j == t || j % 3 != 1)
                    .map(|j| 1u64 << j)
                    .sum()
            })
            .collect();
        let masks = [
            BatchMask::Causal,
            BatchMask::Bits {
                words_per_row: 1,
                bits: &bits,
            },
        ];
        for hd in [64usize, 48] {
            let q = values(n_tok * n_head * hd, 1);
            let k = f16_values(n_slots * n_kv * hd, 2);
            let v = f16_values(n_slots * n_kv * hd, 3);
            let paged = Paged::new(&k, &v, n_kv * hd);
            // K and V with KV head `h / group` copied to every query head `h`.
            let expand = |x: &[f32]| -> Vec<f32> {
                let mut e = Vec::with_capacity(n_slots * n_head * hd);
                for s in 0..n_slots {
                    for h in 0..n_head {
                        let src = (s * n_kv + h / group) * hd;
                        e.extend_from_slice(&x[src..src + hd]);
                    }
                }
                e
            };
            let (kx, vx) = (expand(&k), expand(&v));
            let paged_x = Paged::new(&kx, &vx, n_head * hd);
            for mask in masks {
                let shape = |n_head_kv| AttentionShape {
                    n_tok,
                    n_past,
                    n_head,
                    n_head_kv,
                    head_dim: hd,
                };
                let mut grouped = vec![0f32; q.len()];
                let mut single = vec![0f32; q.len()];
                backend
                    .attention(shape(n_kv), mask, &q, paged.layer(), &mut grouped)
                    .expect("grouped");
                backend
                    .attention(shape(n_head), mask, &q, paged_x.layer(), &mut single)
                    .expect("single");
                // One token per task (the chunking of long prompts) changes nothing either.
                let mut chunked = vec![0f32; q.len()];
                backend.pool.install(|| {
                    attention_by_kv_head(shape(n_kv), mask, &q, paged.layer(), &mut chunked, 1)
                });
                let cb: Vec<u32> = chunked.iter().map(|x| x.to_bits()).collect();
                let gb: Vec<u32> = grouped.iter().map(|x| x.to_bits()).collect();
                assert!(cb == gb, "hd {hd} mask {mask:?}: one token per task");
                let sb: Vec<u32> = single.iter().map(|x| x.to_bits()).collect();
                assert!(gb == sb, "hd {hd} mask {mask:?}");
                // Causal: each token exactly as decoding it alone computes it (one head per task).
                if let BatchMask::Causal = mask {
                    for t in 0..n_tok {
                        let one = AttentionShape {
                            n_tok: 1,
                            n_past: n_past + t,
                            ..shape(n_kv)
                        };
                        let row = t * n_head * hd..(t + 1) * n_head * hd;
                        let mut o1 = vec![0f32; n_head * hd];
                        backend
                            .attention(one, mask, &q[row.clone()], paged.layer(), &mut o1)
                            .expect("one token");
                        let ob: Vec<u32> = o1.iter().map(|x| x.to_bits()).collect();
                        assert!(ob == gb[row], "hd {hd} token {t}");
                    }
                }
                // And both are attention: an f64 reference (Q and the weights at f16, as above).
                let f16 = |x: f64| half::f16::from_f64(x).to_f64();
                for t in 0..n_tok {
                    let seen: Vec<usize> = (0..n_slots)
                        .filter(|&j| j < n_past || mask.visible(t, j - n_past))
                        .collect();
                    for h in 0..n_head {
                        let qh = &q[(t * n_head + h) * hd..(t * n_head + h + 1) * hd];
                        let row =
                            |x: &[f32], s: usize, d: usize| x[(s * n_kv + h / group) * hd + d];
                        let sc: Vec<f64> = seen
                            .iter()
                            .map(|&s| {
                                (0..hd)
                                    .map(|d| f16(qh[d] as f64) * row(&k, s, d) as f64)
                                    .sum::<f64>()
                                    / (hd as f64).sqrt()
                            })
                            .collect();
                        let max = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
                        let sum: f64 = e.iter().sum();
                        for d in 0..hd {
                            let r: f64 = seen
                                .iter()
                                .zip(&e)
                                .map(|(&s, w)| f16(w / sum) * row(&v, s, d) as f64)
                                .sum();
                            let got = grouped[(t * n_head + h) * hd + d] as f64;
                            assert!(
                                (got - r).abs() < 3e-3,
                                "hd {hd} t {t} h {h} d {d}: {got} vs {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}
