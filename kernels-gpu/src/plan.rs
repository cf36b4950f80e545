//! Launch plans for the PTX kernels (grid shapes and the packed arrays they read: row maps,
//! block tables, ancestor-bitset masks), built and checked on the host, no GPU needed.

use crate::KernelError;

/// Slots per KV block; the engine's `kv::BLOCK_SLOTS` (its tests assert they agree). The kernels
/// map slot `s` to pool row `blocks[s / 16] * 16 + s % 16`.
pub const BLOCK_SLOTS: usize = 16;

/// Warps (query heads) per block of `tree_attention_f16`.
pub const ATTENTION_WARPS: u32 = 4;

/// Output rows per block of `matmul_f16` (one warp each).
pub const MATMUL_WARPS: u32 = 4;

/// u32 fields per sequence in the attention plan's `seqs` array.
pub const SEQ_FIELDS: usize = 8;

/// A kernel launch's grid and block shapes (x, y, z).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
}

fn dims(grid: (usize, usize), block: u32) -> Result<LaunchDims, KernelError> {
    let x = u32::try_from(grid.0).map_err(|_| plan_err("grid x over u32"))?;
    // CUDA limits grid y to 65,535 blocks.
    if grid.1 > 65_535 || grid.0 == 0 || grid.1 == 0 {
        return Err(plan_err(format!("grid {grid:?} outside CUDA's limits")));
    }
    Ok(LaunchDims {
        grid: (x, grid.1 as u32, 1),
        block: (block, 1, 1),
    })
}

fn plan_err(msg: impl Into<String>) -> KernelError {
    KernelError::InvalidPlan(msg.into())
}

/// One block per row (embed, add, gather, rope, kv_write, argmax, rms_norm).
pub fn per_row(n_rows: usize, threads: u32) -> Result<LaunchDims, KernelError> {
    dims((n_rows, 1), threads)
}

/// One thread per element, 256 per block (silu_mul).
pub fn elementwise(n: usize) -> Result<LaunchDims, KernelError> {
    dims((n.div_ceil(256), 1), 256)
}

/// `matmul_f16`: one warp per output row, `MATMUL_WARPS` per block; `n_in` must be a multiple of 8
/// (each lane reads 8 weights, 16 bytes, at a time).
pub fn matmul(n_out: usize, n_in: usize) -> Result<LaunchDims, KernelError> {
    if n_in == 0 || !n_in.is_multiple_of(8) {
        return Err(plan_err(format!(
            "matmul_f16 needs n_in a multiple of 8, got {n_in}"
        )));
    }
    dims(
        (n_out.div_ceil(MATMUL_WARPS as usize), 1),
        32 * MATMUL_WARPS,
    )
}

/// `kv_copy_rows_f16`: one block per plane (a layer's K or V).
pub fn kv_copy(n_planes: usize) -> Result<LaunchDims, KernelError> {
    dims((n_planes, 1), 128)
}

/// Which of its sequence's new rows a new row may attend to (its committed prefix is always
/// visible), as the engine's `BatchMask::{Causal, Bits}`.
#[derive(Clone, Copy, Debug)]
pub enum SeqMask<'a> {
    /// Row `t` sees new rows `0..=t`.
    Causal,
    /// Row `t` sees new row `j` iff bit `j` of its `words_per_row` u64 words is set.
    Bits {
        words_per_row: usize,
        bits: &'a [u64],
    },
}

/// One sequence's part of a ragged attention batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqRows<'a> {
    /// Committed slots (always visible).
    pub n_past: usize,
    /// New rows, at slots `n_past..n_past + n_new`.
    pub n_new: usize,
    /// The sequence's block table (pool block ids).
    pub blocks: &'a [u32],
    pub mask: SeqMask<'a>,
}

/// Everything `tree_attention_f16` reads besides Q, K and V, packed for one launch.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionPlan {
    /// `[n_rows, 2]`: each batch row's sequence and its index among that sequence's new rows.
    pub rows: Vec<u32>,
    /// `[n_seq, SEQ_FIELDS]`: n_past, n_new, block offset, mask offset (u64 words), mask words
    /// per row, then zeros.
    pub seqs: Vec<u32>,
    /// Every sequence's block table, concatenated.
    pub blocks: Vec<u32>,
    /// Every sequence's mask words (causal chunks packed as bitsets too).
    pub mask: Vec<u64>,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
}

impl AttentionPlan {
    /// Pack a batch. Each sequence's blocks must cover its slots and lie inside a pool of
    /// `pool_rows` rows; masks must have their words; heads must group evenly; head_dim must be a
    /// multiple of 32 up to 128 (the kernel gives each lane head_dim / 32 output dims).
    pub fn new(
        seqs: &[SeqRows<'_>],
        n_head: usize,
        n_head_kv: usize,
        head_dim: usize,
        pool_rows: usize,
    ) -> Result<AttentionPlan, KernelError> {
        if head_dim == 0 || head_dim > 128 || !head_dim.is_multiple_of(32) {
            return Err(plan_err(format!(
                "tree_attention_f16 needs head_dim in 32, 64, 96, 128; got {head_dim}"
            )));
        }
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(plan_err(format!(
                "{n_head} query heads do not group over {n_head_kv} KV heads"
            )));
        }
        let mut plan = AttentionPlan {
            rows: Vec::new(),
            seqs: Vec::with_capacity(seqs.len() * SEQ_FIELDS),
            blocks: Vec::new(),
            mask: Vec::new(),
            n_head,
            n_head_kv,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        for (i, sq) in seqs.iter().enumerate() {
            let n_slots = sq.n_past + sq.n_new;
            if sq.n_new == 0 {
                return Err(plan_err(format!("sequence {i} has no new rows")));
            }
            let used = n_slots.div_ceil(BLOCK_SLOTS);
            if sq.blocks.len() < used {
                return Err(plan_err(format!(
                    "sequence {i}: {} blocks cannot hold {n_slots} slots",
                    sq.blocks.len()
                )));
            }
            if let Some(b) = sq.blocks[..used]
                .iter()
                .find(|&&b| (b as usize + 1) * BLOCK_SLOTS > pool_rows)
            {
                return Err(plan_err(format!(
                    "sequence {i}: block {b} is outside the pool of {pool_rows} rows"
                )));
            }
            let words = sq.n_new.div_ceil(64);
            let mask_off = plan.mask.len();
            match sq.mask {
                SeqMask::Causal => {
                    for t in 0..sq.n_new {
                        let row0 = plan.mask.len();
                        plan.mask.resize(row0 + words, 0);
                        for j in 0..=t {
                            plan.mask[row0 + j / 64] |= 1 << (j % 64);
                        }
                    }
                }
                SeqMask::Bits {
                    words_per_row,
                    bits,
                } => {
                    if words_per_row < words || bits.len() < sq.n_new * words_per_row {
                        return Err(plan_err(format!(
                            "sequence {i}: {} mask words for {} rows of {words_per_row}",
                            bits.len(),
                            sq.n_new
                        )));
                    }
                    // Keep only the words that can name a new row (bits past n_new are ignored).
                    for t in 0..sq.n_new {
                        let row = &bits[t * words_per_row..t * words_per_row + words];
                        plan.mask.extend_from_slice(row);
                        if let Some(last) = plan.mask.last_mut() {
                            let tail = sq.n_new % 64;
                            if tail != 0 {
                                *last &= (1u64 << tail) - 1;
                            }
                        }
                    }
                }
            }
            let fields = [
                sq.n_past,
                sq.n_new,
                plan.blocks.len(),
                mask_off,
                words,
                0,
                0,
                0,
            ];
            for f in fields {
                plan.seqs
                    .push(u32::try_from(f).map_err(|_| plan_err("plan field over u32"))?);
            }
            plan.blocks.extend_from_slice(&sq.blocks[..used]);
            for t in 0..sq.n_new {
                plan.rows.extend([i as u32, t as u32]);
            }
        }
        Ok(plan)
    }

    /// Rows of the batch (all sequences' new rows).
    pub fn n_rows(&self) -> usize {
        self.rows.len() / 2
    }

    /// The launch shape: a block per (row, 4 heads), a warp per head.
    pub fn launch(&self) -> Result<LaunchDims, KernelError> {
        let d = dims(
            (
                self.n_rows(),
                self.n_head.div_ceil(ATTENTION_WARPS as usize),
            ),
            32 * ATTENTION_WARPS,
        )?;
        Ok(d)
    }

    fn seq(&self, s: usize) -> [usize; 5] {
        let f = &self.seqs[s * SEQ_FIELDS..s * SEQ_FIELDS + 5];
        [
            f[0] as usize,
            f[1] as usize,
            f[2] as usize,
            f[3] as usize,
            f[4] as usize,
        ]
    }

    /// The pool row of slot `slot` of sequence `s`.
    pub fn pool_row(&self, s: usize, slot: usize) -> usize {
        let [_, _, block_off, _, _] = self.seq(s);
        self.blocks[block_off + slot / BLOCK_SLOTS] as usize * BLOCK_SLOTS + slot % BLOCK_SLOTS
    }

    /// The pool rows the batch's new K/V rows are written to (`kv_write_f16`'s `pool_rows`), in
    /// batch-row order.
    pub fn new_pool_rows(&self) -> Vec<u32> {
        self.rows
            .chunks_exact(2)
            .map(|r| {
                let (s, t) = (r[0] as usize, r[1] as usize);
                self.pool_row(s, self.seq(s)[0] + t) as u32
            })
            .collect()
    }

    /// Whether batch row `row` sees slot `slot` of its sequence.
    pub fn visible(&self, row: usize, slot: usize) -> bool {
        let (s, t) = (self.rows[2 * row] as usize, self.rows[2 * row + 1] as usize);
        let [n_past, n_new, _, mask_off, words] = self.seq(s);
        if slot < n_past {
            return true;
        }
        let j = slot - n_past;
        j < n_new && (self.mask[mask_off + t * words + j / 64] >> (j % 64)) & 1 == 1
    }

    /// What the kernel computes, step for step, on the CPU: q `[n_rows, n_head * hd]` f32;
    /// k, v one layer's `[pool rows, n_head_kv * hd]` (f16 values as f32). Returns
    /// `[n_rows, n_head * hd]`. Tiles of 32 slots, online softmax with exp2, Q rounded to f16.
    pub fn reference(&self, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
        let (hd, n_head) = (self.head_dim, self.n_head);
        let kv_dim = self.n_head_kv * hd;
        let group = n_head / self.n_head_kv;
        let mut out = vec![0.0f32; q.len()];
        for row in 0..self.n_rows() {
            let s = self.rows[2 * row] as usize;
            let [n_past, n_new, ..] = self.seq(s);
            let n_slots = n_past + n_new;
            for h in 0..n_head {
                let kvh = h / group;
                let qh: Vec<f32> = q[(row * n_head + h) * hd..][..hd]
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_f32())
                    .collect();
                let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                let mut acc = vec![0.0f32; hd];
                for s0 in (0..n_slots).step_by(32) {
                    let tile: Vec<(f32, usize)> = (s0..(s0 + 32).min(n_slots))
                        .map(|slot| {
                            if !self.visible(row, slot) {
                                return (f32::NEG_INFINITY, 0);
                            }
                            let pr = self.pool_row(s, slot);
                            let kr = &k[pr * kv_dim + kvh * hd..][..hd];
                            let dot = qh.iter().zip(kr).fold(0.0f32, |a, (x, y)| x.mul_add(*y, a));
                            (dot * self.scale, pr)
                        })
                        .collect();
                    let tmax = tile.iter().fold(f32::NEG_INFINITY, |a, t| a.max(t.0));
                    if tmax == f32::NEG_INFINITY {
                        continue;
                    }
                    let m_new = m.max(tmax);
                    let c = ((m - m_new) * std::f32::consts::LOG2_E).exp2();
                    let p: Vec<f32> = tile
                        .iter()
                        .map(|t| ((t.0 - m_new) * std::f32::consts::LOG2_E).exp2())
                        .collect();
                    l = l.mul_add(c, p.iter().sum::<f32>());
                    for a in acc.iter_mut() {
                        *a *= c;
                    }
                    for (pj, &(_, pr)) in p.iter().zip(&tile) {
                        if *pj == 0.0 {
                            continue;
                        }
                        let vr = &v[pr * kv_dim + kvh * hd..][..hd];
                        for (a, &x) in acc.iter_mut().zip(vr) {
                            *a = pj.mul_add(x, *a);
                        }
                    }
                    m = m_new;
                }
                let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                for (o, a) in out[(row * n_head + h) * hd..][..hd].iter_mut().zip(&acc) {
                    *o = a * inv;
                }
            }
        }
        out
    }
}

/// The pairs `kv_copy_rows_f16` moves when an accepted path is committed: pool row `src[i]` to
/// pool row `dst[i]`, in order (pairs with `src == dst` dropped: nothing to move).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvCommitPlan {
    pub src: Vec<u32>,
    pub dst: Vec<u32>,
}

impl KvCommitPlan {
    /// From (source, destination) pool-row pairs in commit order.
    pub fn new(pairs: impl IntoIterator<Item = (u32, u32)>) -> KvCommitPlan {
        let (src, dst) = pairs.into_iter().filter(|(s, d)| s != d).unzip();
        KvCommitPlan { src, dst }
    }

    pub fn is_empty(&self) -> bool {
        self.src.is_empty()
    }

    /// What the kernel does to one plane (`[pool rows, row_len]`), on the CPU.
    pub fn apply<T: Copy>(&self, plane: &mut [T], row_len: usize) {
        for (&s, &d) in self.src.iter().zip(&self.dst) {
            let (s, d) = (s as usize * row_len, d as usize * row_len);
            plane.copy_within(s..s + row_len, d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_masks_pack_lower_triangles_across_words() {
        let blocks = [3u32, 0, 7, 1, 2, 4, 5, 6, 8];
        let seq = SeqRows {
            n_past: 5,
            n_new: 70,
            blocks: &blocks,
            mask: SeqMask::Causal,
        };
        let plan = AttentionPlan::new(&[seq], 4, 2, 64, 16 * 9).unwrap();
        assert_eq!(plan.n_rows(), 70);
        assert_eq!(plan.mask.len(), 70 * 2);
        for t in 0..70 {
            for slot in 0..75 {
                assert_eq!(
                    plan.visible(t, slot),
                    slot < 5 + t + 1,
                    "row {t} slot {slot}"
                );
            }
        }
        // Slot 16 lives in the second block (pool block 0), row 0 of it.
        assert_eq!(plan.pool_row(0, 16), 0);
        assert_eq!(plan.pool_row(0, 33), 7 * 16 + 1);
        assert_eq!(plan.new_pool_rows()[0], 3 * 16 + 5);
        let l = plan.launch().unwrap();
        assert_eq!(l.grid, (70, 1, 1));
        assert_eq!(l.block, (128, 1, 1));
    }

    #[test]
    fn ragged_batches_index_each_sequence() {
        // A decode row, a 3-node tree (root, two children) and a 2-row chunk.
        let tree = [0b001u64, 0b011, 0b101];
        let seqs = [
            SeqRows {
                n_past: 20,
                n_new: 1,
                blocks: &[4, 5],
                mask: SeqMask::Causal,
            },
            SeqRows {
                n_past: 16,
                n_new: 3,
                blocks: &[0, 1],
                mask: SeqMask::Bits {
                    words_per_row: 1,
                    bits: &tree,
                },
            },
            SeqRows {
                n_past: 0,
                n_new: 2,
                blocks: &[2],
                mask: SeqMask::Causal,
            },
        ];
        let plan = AttentionPlan::new(&seqs, 14, 2, 64, 6 * 16).unwrap();
        assert_eq!(plan.rows, vec![0, 0, 1, 0, 1, 1, 1, 2, 2, 0, 2, 1]);
        assert_eq!(plan.blocks, vec![4, 5, 0, 1, 2]);
        assert_eq!(&plan.seqs[8..13], &[16, 3, 2, 1, 1]);
        // Row 3 (tree node 2) sees the prefix, the root and itself, not its sibling.
        assert!(plan.visible(3, 15) && plan.visible(3, 16) && plan.visible(3, 18));
        assert!(!plan.visible(3, 17) && !plan.visible(3, 19));
        assert_eq!(plan.new_pool_rows(), vec![5 * 16 + 4, 16, 17, 18, 32, 33]);
        assert_eq!(plan.launch().unwrap().grid, (6, 4, 1));
    }

    #[test]
    fn bad_plans_are_refused() {
        let seq = |blocks: &'static [u32]| SeqRows {
            n_past: 30,
            n_new: 3,
            blocks,
            mask: SeqMask::Causal,
        };
        assert!(AttentionPlan::new(&[seq(&[0])], 4, 2, 64, 64).is_err()); // too few blocks
        assert!(AttentionPlan::new(&[seq(&[0, 9, 1])], 4, 2, 64, 64).is_err()); // outside the pool
        assert!(AttentionPlan::new(&[seq(&[0, 1, 2])], 4, 3, 64, 64).is_err()); // heads
        assert!(AttentionPlan::new(&[seq(&[0, 1, 2])], 4, 2, 80, 64).is_err()); // head_dim
        let short = SeqRows {
            n_past: 0,
            n_new: 3,
            blocks: &[0],
            mask: SeqMask::Bits {
                words_per_row: 1,
                bits: &[1, 3],
            },
        };
        let e = AttentionPlan::new(&[short], 4, 2, 64, 64).unwrap_err();
        assert_eq!(e.error_type(), "invalid_launch_plan");
        assert!(matmul(10, 12).is_err());
        assert_eq!(matmul(10, 16).unwrap().grid, (3, 1, 1));
    }

    #[test]
    fn commit_moves_rows_in_order_even_when_they_chain() {
        // Accepted path of tree rows 10, 12, 15 into slots 10, 11, 12: 12 -> 11 must read row 12
        // before 15 -> 12 overwrites it.
        let plan = KvCommitPlan::new([(10, 10), (12, 11), (15, 12)]);
        assert_eq!(plan.src, vec![12, 15]);
        let mut plane: Vec<u32> = (0..20).flat_map(|r| [r * 10, r * 10 + 1]).collect();
        plan.apply(&mut plane, 2);
        assert_eq!(&plane[20..26], &[100, 101, 120, 121, 150, 151]);
    }
}
