//! AVX2 column tiles for the legacy 32-element types Q4_1 and Q8_0 (smollm2's weights): eight output rows per register, exact i32 per 32-element block, then one f32 step per block in block order, for every activation row count.
//!
//! The layout is the K-quant column tiles' ([`super::KCols`]): a group of eight output rows is
//! transposed so that the 32-bit lane `c` of a register holds four values of row `c`, and one
//! `maddubs` against four broadcast activations gives 32 products of eight rows at once. Q4_1's
//! unsigned nibbles add up in i16 over a whole 32-element block (8·2·15·127 < 2^15) before one
//! `madd`; Q8_0 uses ggml's sign trick (`|w|` against `sign(a, w)`), one `madd` per four values.
//!
//! The f32 result of (output row, activation row) is, for every block `k` of the row in order,
//! `acc = fma(isum_k, d_k·dx_k, acc)` and for Q4_1 then `acc = fma(m_k, s_k, acc)` (`s_k` the
//! record's `dx·Σa`), from `acc = 0`: one chain per output row, which a column lane computes
//! directly. Every row count (one, for decoding, included) runs these tiles, so the bits of a row
//! never depend on the batch; the AVX-512 family's tiles (`lcols512`) compute the same bits, and
//! so do the AVX-VNNI family's ([`tile_vnni`]: one VEX `vpdpbusd` per 32 products, Q8_0 as
//! `lcols512` stores it, `w + 128` against the record's exact `Σ a`).

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::kvnni::columns_avxvnni;
use super::{
    chain, columns_avx2, dwords8, f16_cols, f16_lanes, ld, rd_u32, transpose8_epi32, ColumnTiles,
    CB_ROWS,
};
use crate::quant::act::{GROUP, OFF_D, OFF_QSUM, OFF_S};
use crate::quant::{GgmlType, QMatrix, YPtr};

/// 32-element blocks of one activation record.
const BLOCKS: usize = GROUP / 32;
/// Column blocks of a tile (output rows `CB × CB_ROWS` per pass over the activations).
const CB: usize = 2;
/// Activation rows of a tile.
const CT: usize = 4;

/// A legacy group of eight output rows in column order.
#[repr(C, align(32))]
struct LCols {
    /// `q[k][i]`, lane `c`: the four values of elements `4i .. 4i + 4` of block `k` of row `c`
    /// (Q4_1: the nibbles, with `i ≥ 4` the high ones, elements `16 + 4(i − 4) ..`; Q8_0: `|w|`).
    q: [[__m256i; 8]; BLOCKS],
    /// Q8_0: the signed values, whose signs move onto the activations.
    s: [[__m256i; 8]; BLOCKS],
    /// Per block: `d` (and Q4_1's `m`) of the eight rows.
    d: [__m256; BLOCKS],
    m: [__m256; BLOCKS],
}

/// A legacy type on column tiles.
trait LKind {
    /// Bytes of one 32-element block.
    const BB: usize;
    /// Q4_1: `w = d·q + m`, with activation block sums.
    const MINS: bool;
    /// Q8_0: signed values (the sign trick).
    const SIGNED: bool;
    /// Unpacks block `k` of the groups at `p[c]` into `out`.
    unsafe fn build_block(p: &[*const u8; CB_ROWS], k: usize, out: &mut LCols);
}

struct Q41;
struct Q80;

impl LKind for Q41 {
    const BB: usize = 20;
    const MINS: bool = true;
    const SIGNED: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn build_block(p: &[*const u8; CB_ROWS], k: usize, out: &mut LCols) {
        let at = |c: usize| p[c].add(Self::BB * k);
        // Rows c and c + 4 share a register: a 4 × 4 dword transpose per 128-bit half.
        let y: [__m256i; 4] = std::array::from_fn(|c| {
            _mm256_set_m128i(
                _mm_loadu_si128(at(c + 4).add(4) as *const __m128i),
                _mm_loadu_si128(at(c).add(4) as *const __m128i),
            )
        });
        let t0 = _mm256_unpacklo_epi32(y[0], y[1]);
        let t1 = _mm256_unpackhi_epi32(y[0], y[1]);
        let t2 = _mm256_unpacklo_epi32(y[2], y[3]);
        let t3 = _mm256_unpackhi_epi32(y[2], y[3]);
        let dw = [
            _mm256_unpacklo_epi64(t0, t2),
            _mm256_unpackhi_epi64(t0, t2),
            _mm256_unpacklo_epi64(t1, t3),
            _mm256_unpackhi_epi64(t1, t3),
        ];
        let m4 = _mm256_set1_epi8(0x0F);
        for (j, v) in dw.iter().enumerate() {
            out.q[k][j] = _mm256_and_si256(*v, m4);
            out.q[k][4 + j] = _mm256_and_si256(_mm256_srli_epi16::<4>(*v), m4);
        }
        let dm = dwords8(&std::array::from_fn::<_, CB_ROWS, _>(at));
        out.d[k] = f16_lanes(dm);
        out.m[k] = f16_lanes(_mm256_srli_epi32::<16>(dm));
    }
}

impl LKind for Q80 {
    const BB: usize = 34;
    const MINS: bool = false;
    const SIGNED: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn build_block(p: &[*const u8; CB_ROWS], k: usize, out: &mut LCols) {
        let at = |c: usize| p[c].add(Self::BB * k);
        let r = transpose8_epi32(std::array::from_fn(|c| ld(at(c).add(2))));
        for (i, v) in r.iter().enumerate() {
            out.s[k][i] = *v;
            out.q[k][i] = _mm256_abs_epi8(*v);
        }
        let ps: [*const u8; CB_ROWS] = std::array::from_fn(at);
        out.d[k] = f16_cols(&ps, 0);
    }
}

/// The column tile: blocks `0..nb` of one group of `CB × CB_ROWS` output rows against `RT`
/// activation rows (natural records at `a + t * stride`), each block's exact i32 sums and f32
/// step, into `acc[t * CB * CB_ROWS + row]`.
// The tile's registers are indexed [column block][activation row] throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<K: LKind, const RT: usize>(
    w: &[LCols; CB],
    nb: usize,
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    const W: usize = CB * CB_ROWS;
    let ones = _mm256_set1_epi16(1);
    let mut f: [[__m256; RT]; CB] = std::array::from_fn(|b| {
        std::array::from_fn(|t| _mm256_loadu_ps(acc.add(t * W + b * CB_ROWS)))
    });
    for k in 0..nb {
        // Q4_1: i16 sums of `maddubs`; Q8_0: i32 sums of `madd`.
        let mut h = [[_mm256_setzero_si256(); RT]; CB];
        for i in 0..8 {
            let wv: [__m256i; CB] = std::array::from_fn(|b| w[b].q[k][i]);
            for t in 0..RT {
                let av = _mm256_set1_epi32(rd_u32(a.add(t * stride + 32 * k + 4 * i)) as i32);
                for b in 0..CB {
                    if K::SIGNED {
                        let p = _mm256_maddubs_epi16(wv[b], _mm256_sign_epi8(av, w[b].s[k][i]));
                        h[b][t] = _mm256_add_epi32(h[b][t], _mm256_madd_epi16(p, ones));
                    } else {
                        h[b][t] = _mm256_add_epi16(h[b][t], _mm256_maddubs_epi16(wv[b], av));
                    }
                    chain(&mut h[b][t]);
                }
            }
        }
        if !K::SIGNED {
            for hb in &mut h {
                for ht in hb.iter_mut() {
                    *ht = _mm256_madd_epi16(*ht, ones);
                }
            }
        }
        block_step::<K, RT>(w, k, &h, a, stride, &mut f);
    }
    for b in 0..CB {
        for t in 0..RT {
            _mm256_storeu_ps(acc.add(t * W + b * CB_ROWS), f[b][t]);
        }
    }
}

/// The f32 step of block `k` for every (output row, activation row) of a tile, from the block's
/// exact i32 sums `isum` (`[column block][activation row]`): `f = fma(isum, d·dx, f)`, then for
/// Q4_1 `f = fma(m, s, f)`. Shared by the AVX2 and AVX-VNNI tiles.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_step<K: LKind, const RT: usize>(
    w: &[LCols; CB],
    k: usize,
    isum: &[[__m256i; RT]; CB],
    a: *const u8,
    stride: usize,
    f: &mut [[__m256; RT]; CB],
) {
    for t in 0..RT {
        let at = a.add(t * stride);
        let dx = _mm256_broadcast_ss(&*(at.add(OFF_D + 4 * k) as *const f32));
        for b in 0..CB {
            let sc = _mm256_mul_ps(w[b].d[k], dx);
            f[b][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[b][t]), sc, f[b][t]);
            if K::MINS {
                let sx = _mm256_broadcast_ss(&*(at.add(OFF_S + 4 * k) as *const f32));
                f[b][t] = _mm256_fmadd_ps(w[b].m[k], sx, f[b][t]);
            }
        }
    }
}

/// The AVX2 legacy column tiles: `CB` blocks of eight output rows, `CT` activation rows.
struct LTiles<K>(PhantomData<K>);

impl<K: LKind> ColumnTiles for LTiles<K> {
    const W: usize = CB * CB_ROWS;
    const BLOCK_ROWS: usize = CB_ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = BLOCKS * K::BB;
    type Cols = [LCols; CB];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn build(p: &[*const u8], b: usize, nb: usize, cols: &mut [LCols; CB]) {
        let pb: [*const u8; CB_ROWS] = std::array::from_fn(|c| p[c]);
        for k in 0..nb {
            K::build_block(&pb, k, &mut cols[b]);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile(cols: &[LCols; CB], nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        tile::<K, CT>(cols, nb, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_tail(
        cols: &[LCols; CB],
        nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        match rt {
            3 => tile::<K, 3>(cols, nb, a, stride, acc),
            2 => tile::<K, 2>(cols, nb, a, stride, acc),
            _ => tile::<K, 1>(cols, nb, a, stride, acc),
        }
    }
}

/// Q4_1 / Q8_0 rows `[r0, r1)` against natural records, any number of them.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `act` holds `n_tok` records of `stride` bytes at `act`;
/// `w` is a validated Q4_1 or Q8_0 matrix; `r1 <= w.n_out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn legacy_cols(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    match w.ty {
        GgmlType::Q4_1 => columns_avx2::<LTiles<Q41>>(w, act, stride, n_tok, r0, r1, y),
        GgmlType::Q8_0 => columns_avx2::<LTiles<Q80>>(w, act, stride, n_tok, r0, r1, y),
        _ => debug_assert!(false, "legacy_cols: {}", w.ty),
    }
}

/// The AVX-VNNI tile: as [`tile`], with each block's exact i32 sums from one `vpdpbusd` per
/// four values of eight rows (`w` built by [`LTilesVnni::build`]: Q8_0's `q` holds `w + 128`,
/// whose sums less `128·Σ a` are the signed ones).
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn tile_vnni<K: LKind, const RT: usize>(
    w: &[LCols; CB],
    nb: usize,
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    const W: usize = CB * CB_ROWS;
    let mut f: [[__m256; RT]; CB] = std::array::from_fn(|b| {
        std::array::from_fn(|t| _mm256_loadu_ps(acc.add(t * W + b * CB_ROWS)))
    });
    for k in 0..nb {
        let mut h = [[_mm256_setzero_si256(); RT]; CB];
        for i in 0..8 {
            let wv: [__m256i; CB] = std::array::from_fn(|b| w[b].q[k][i]);
            for t in 0..RT {
                let av = _mm256_set1_epi32(rd_u32(a.add(t * stride + 32 * k + 4 * i)) as i32);
                for b in 0..CB {
                    h[b][t] = _mm256_dpbusd_avx_epi32(h[b][t], wv[b], av);
                    chain(&mut h[b][t]);
                }
            }
        }
        if K::SIGNED {
            for t in 0..RT {
                let qsum = *(a.add(t * stride + OFF_QSUM + 4 * k) as *const i32);
                let off = _mm256_set1_epi32(128 * qsum);
                for hb in &mut h {
                    hb[t] = _mm256_sub_epi32(hb[t], off);
                }
            }
        }
        block_step::<K, RT>(w, k, &h, a, stride, &mut f);
    }
    for b in 0..CB {
        for t in 0..RT {
            _mm256_storeu_ps(acc.add(t * W + b * CB_ROWS), f[b][t]);
        }
    }
}

/// The AVX-VNNI legacy column tiles: `CB` blocks of eight output rows, `CT_VNNI` activation rows.
struct LTilesVnni<K>(PhantomData<K>);

/// Activation rows of an AVX-VNNI tile (its i32 sums need no i16 stage, so more rows fit).
const CT_VNNI: usize = 5;

impl<K: LKind> ColumnTiles for LTilesVnni<K> {
    const W: usize = CB * CB_ROWS;
    const BLOCK_ROWS: usize = CB_ROWS;
    const CT: usize = CT_VNNI;
    const GROUP_BYTES: usize = BLOCKS * K::BB;
    type Cols = [LCols; CB];
    /// The AVX2 unpack; Q8_0's `q` then becomes `w + 128` (the signed bytes with the top bit
    /// flipped: unsigned for `vpdpbusd`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn build(p: &[*const u8], b: usize, nb: usize, cols: &mut [LCols; CB]) {
        let pb: [*const u8; CB_ROWS] = std::array::from_fn(|c| p[c]);
        let out = &mut cols[b];
        let flip = _mm256_set1_epi8(-128);
        for k in 0..nb {
            K::build_block(&pb, k, out);
            if K::SIGNED {
                for i in 0..8 {
                    out.q[k][i] = _mm256_xor_si256(out.s[k][i], flip);
                }
            }
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn tile(cols: &[LCols; CB], nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        tile_vnni::<K, CT_VNNI>(cols, nb, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn tile_tail(
        cols: &[LCols; CB],
        nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        match rt {
            4 => tile_vnni::<K, 4>(cols, nb, a, stride, acc),
            3 => tile_vnni::<K, 3>(cols, nb, a, stride, acc),
            2 => tile_vnni::<K, 2>(cols, nb, a, stride, acc),
            _ => tile_vnni::<K, 1>(cols, nb, a, stride, acc),
        }
    }
}

/// [`legacy_cols`] for the AVX-VNNI family.
///
/// # Safety
/// As [`legacy_cols`], and the CPU must support AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn legacy_cols_vnni(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    match w.ty {
        GgmlType::Q4_1 => columns_avxvnni::<LTilesVnni<Q41>>(w, act, stride, n_tok, r0, r1, y),
        GgmlType::Q8_0 => columns_avxvnni::<LTilesVnni<Q80>>(w, act, stride, n_tok, r0, r1, y),
        _ => debug_assert!(false, "legacy_cols_vnni: {}", w.ty),
    }
}
