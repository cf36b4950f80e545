//! AVX-512 column tiles and packed rows for Q4_1 and Q8_0 (the AVX-512 VNNI family): the AVX2 legacy column tiles ([`super::lcols`]) at 16 output rows per register, `vpdpbusd` into the exact i32 of each 32-element block, then the same f32 steps, so both families compute these rows bit for bit alike.
//!
//! `vpdpbusd` multiplies unsigned weight bytes by signed activations: Q4_1's nibbles are
//! unsigned already; Q8_0's values are stored as `w + 128` (a flipped top bit) and the block sum
//! becomes `Σ (w + 128)·a − 128·Σ a`, with `Σ a` the exact sum the activation record carries
//! (`OFF_QSUM`). No i16 partial sums and no sign trick: one instruction per 64 products.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::kcols512::{columns_avx512, f16_cols16, join_ps, PACKED_ROWS_MAX};
use super::{dwords8, f16_lanes, ld, rd_u32, ColumnTiles, CB_ROWS};
use crate::quant::act::{GROUP, OFF_D, OFF_QSUM, OFF_S};
use crate::quant::{GgmlType, QMatrix, YPtr};

/// Output rows of one 512-bit column block (one i32 lane each).
const ROWS: usize = 2 * CB_ROWS;
/// 32-element blocks of one activation record.
const BLOCKS: usize = GROUP / 32;
/// Column blocks of a tile.
const CB: usize = 2;
/// Activation rows of a tile: `CB × CT` running sums and as many f32 accumulators stay in
/// registers (24 of 32).
const CT: usize = 6;

/// A legacy group of 16 output rows in column order.
#[repr(C, align(64))]
struct LCols16 {
    /// `q[k][i]`, lane `c`: the four unsigned values of elements `4i .. 4i + 4` of block `k` of
    /// row `c` (Q4_1: the nibbles, `i ≥ 4` the high ones, elements `16 + 4(i − 4) ..`; Q8_0:
    /// `w + 128`).
    q: [[__m512i; 8]; BLOCKS],
    d: [__m512; BLOCKS],
    m: [__m512; BLOCKS],
}

/// A legacy type on 512-bit column tiles.
trait LKind16 {
    const BB: usize;
    /// Q4_1: `w = d·q + m`, with activation block sums.
    const MINS: bool;
    /// Q8_0: values stored offset by 128.
    const OFFSET: bool;
    /// Unpacks block `k` of the groups at `p[c]` into `out`.
    unsafe fn build_block(p: &[*const u8; ROWS], k: usize, out: &mut LCols16);
}

struct Q41;
struct Q80;

impl LKind16 for Q41 {
    const BB: usize = 20;
    const MINS: bool = true;
    const OFFSET: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn build_block(p: &[*const u8; ROWS], k: usize, out: &mut LCols16) {
        let at: [*const u8; ROWS] = std::array::from_fn(|c| p[c].add(Self::BB * k));
        let x = |c: usize| _mm_loadu_si128(at[c].add(4) as *const __m128i);
        // 128-bit lane L of y[c] holds row c + 4L: a 4 × 4 dword transpose per lane.
        let y: [__m512i; 4] = std::array::from_fn(|c| {
            let v = _mm512_castsi128_si512(x(c));
            let v = _mm512_inserti32x4::<1>(v, x(c + 4));
            let v = _mm512_inserti32x4::<2>(v, x(c + 8));
            _mm512_inserti32x4::<3>(v, x(c + 12))
        });
        let t0 = _mm512_unpacklo_epi32(y[0], y[1]);
        let t1 = _mm512_unpackhi_epi32(y[0], y[1]);
        let t2 = _mm512_unpacklo_epi32(y[2], y[3]);
        let t3 = _mm512_unpackhi_epi32(y[2], y[3]);
        let dw = [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ];
        let m4 = _mm512_set1_epi8(0x0F);
        for (j, v) in dw.iter().enumerate() {
            out.q[k][j] = _mm512_and_si512(*v, m4);
            out.q[k][4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(*v), m4);
        }
        let (lo, hi) = (dwords8(&at[..CB_ROWS]), dwords8(&at[CB_ROWS..]));
        out.d[k] = join_ps(f16_lanes(lo), f16_lanes(hi));
        out.m[k] = join_ps(
            f16_lanes(_mm256_srli_epi32::<16>(lo)),
            f16_lanes(_mm256_srli_epi32::<16>(hi)),
        );
    }
}

impl LKind16 for Q80 {
    const BB: usize = 34;
    const MINS: bool = false;
    const OFFSET: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn build_block(p: &[*const u8; ROWS], k: usize, out: &mut LCols16) {
        let at: [*const u8; ROWS] = std::array::from_fn(|c| p[c].add(Self::BB * k));
        // The 256-bit half H of r[c] holds row c + 8H: the AVX2 8 × 8 dword transpose per half.
        let r: [__m512i; 8] = std::array::from_fn(|c| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(ld(at[c].add(2))),
                ld(at[c + 8].add(2)),
            )
        });
        let t: [__m512i; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // u[4h + m]: from t[4h + (m / 2)] and t[4h + 2 + (m / 2)], low (m even) or high qwords.
        let u: [__m512i; 8] = std::array::from_fn(|i| {
            let (h, m) = (i / 4, i % 4);
            let (a, b) = (t[4 * h + m / 2], t[4 * h + 2 + m / 2]);
            if m % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        // Per 256-bit half: the low 128 bits of u[m] and u[4 + m] (dword m), or the high ones
        // (dword 4 + m).
        let lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
        let hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
        let flip = _mm512_set1_epi8(-128);
        for m in 0..4 {
            let lo = _mm512_permutex2var_epi64(u[m], lo_idx, u[4 + m]);
            let hi = _mm512_permutex2var_epi64(u[m], hi_idx, u[4 + m]);
            out.q[k][m] = _mm512_xor_si512(lo, flip);
            out.q[k][4 + m] = _mm512_xor_si512(hi, flip);
        }
        out.d[k] = f16_cols16(&at, 0);
    }
}

/// The column tile: blocks `0..nb` of one group of `CB × ROWS` output rows against `RT`
/// activation rows (natural records at `a + t * stride`), each block's exact i32 sums and the
/// AVX2 tiles' f32 steps, into `acc[t * CB * ROWS + row]`.
// The tile's registers are indexed [column block][activation row] throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile16<K: LKind16, const RT: usize>(
    w: &[LCols16; CB],
    nb: usize,
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    const W: usize = CB * ROWS;
    let mut f: [[__m512; RT]; CB] = std::array::from_fn(|b| {
        std::array::from_fn(|t| _mm512_loadu_ps(acc.add(t * W + b * ROWS)))
    });
    for k in 0..nb {
        let mut h = [[_mm512_setzero_si512(); RT]; CB];
        for i in 0..8 {
            let wv: [__m512i; CB] = std::array::from_fn(|b| w[b].q[k][i]);
            for t in 0..RT {
                let av = _mm512_set1_epi32(rd_u32(a.add(t * stride + 32 * k + 4 * i)) as i32);
                for b in 0..CB {
                    h[b][t] = _mm512_dpbusd_epi32(h[b][t], wv[b], av);
                }
            }
        }
        for t in 0..RT {
            let at = a.add(t * stride);
            for b in 0..CB {
                f[b][t] = block_step::<K>(h[b][t], w[b].d[k], w[b].m[k], at, k, f[b][t]);
            }
        }
    }
    for b in 0..CB {
        for t in 0..RT {
            _mm512_storeu_ps(acc.add(t * W + b * ROWS), f[b][t]);
        }
    }
}

/// One block's f32 step for 16 output rows, `tile16`'s and `slice_packed`'s alike (so their bits
/// agree): `acc + isum·(d·dx)` (then `+ m·sx` for Q4_1) with the block's exact sums `h` against
/// block `k` of the record at `at` (Q8_0's less `128·Σa`, undoing the stored `w + 128`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn block_step<K: LKind16>(
    h: __m512i,
    d: __m512,
    m: __m512,
    at: *const u8,
    k: usize,
    acc: __m512,
) -> __m512 {
    let dx = _mm512_set1_ps(*(at.add(OFF_D + 4 * k) as *const f32));
    let isum = if K::OFFSET {
        let off = _mm512_set1_epi32(128 * *(at.add(OFF_QSUM + 4 * k) as *const i32));
        _mm512_sub_epi32(h, off)
    } else {
        h
    };
    let f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), acc);
    if K::MINS {
        let sx = _mm512_set1_ps(*(at.add(OFF_S + 4 * k) as *const f32));
        _mm512_fmadd_ps(m, sx, f)
    } else {
        f
    }
}

/// The 512-bit legacy column tiles: `CB` blocks of 16 output rows, `CT` activation rows.
struct LTiles16<K>(PhantomData<K>);

impl<K: LKind16> ColumnTiles for LTiles16<K> {
    const W: usize = CB * ROWS;
    const BLOCK_ROWS: usize = ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = BLOCKS * K::BB;
    type Cols = [LCols16; CB];
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn build(p: &[*const u8], b: usize, nb: usize, cols: &mut [LCols16; CB]) {
        let pb: [*const u8; ROWS] = std::array::from_fn(|c| p[c]);
        for k in 0..nb {
            K::build_block(&pb, k, &mut cols[b]);
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile(cols: &[LCols16; CB], nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        tile16::<K, CT>(cols, nb, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_tail(
        cols: &[LCols16; CB],
        nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        match rt {
            5 => tile16::<K, 5>(cols, nb, a, stride, acc),
            4 => tile16::<K, 4>(cols, nb, a, stride, acc),
            3 => tile16::<K, 3>(cols, nb, a, stride, acc),
            2 => tile16::<K, 2>(cols, nb, a, stride, acc),
            _ => tile16::<K, 1>(cols, nb, a, stride, acc),
        }
    }
}

/// The AVX-512 family's Q4_1 / Q8_0 rows `[r0, r1)` against natural records, any number of them
/// (the AVX2 family's bits): packed matrices on `rows_packed`; natural ones on 512-bit tiles from
/// two rows, the AVX2 tiles for one.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C; `act` holds `n_tok` natural
/// records of `stride` bytes; `w` is a validated Q4_1 or Q8_0 matrix; `r1 <= w.n_out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn legacy_rows16(
    w: &QMatrix,
    act: &[u8],
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    debug_assert!(act.len() >= n_tok * stride);
    let a = act.as_ptr();
    if w.packed {
        // Packed Q4_1 and Q8_0 (`quant::packed`): every row count on `rows_packed` (no
        // transposes left for the tiles to share among rows).
        match w.ty {
            GgmlType::Q4_1 => rows_packed::<Q41>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q8_0 => rows_packed::<Q80>(w, a, stride, n_tok, r0, r1, y),
            _ => debug_assert!(false, "legacy_rows16: packed {}", w.ty),
        }
        return;
    }
    if n_tok == 1 {
        // One row (decoding) streams the weights once: the AVX2 tiles' lighter unpack of eight
        // rows measured as fast or faster there (same bits).
        return super::lcols::legacy_cols(w, a, stride, n_tok, r0, r1, y);
    }
    match w.ty {
        GgmlType::Q4_1 => columns_avx512::<LTiles16<Q41>>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q8_0 => columns_avx512::<LTiles16<Q80>>(w, a, stride, n_tok, r0, r1, y),
        _ => debug_assert!(false, "legacy_rows16: {}", w.ty),
    }
}

/// A legacy type the AVX-512 family reads packed (`quant::packed`: each 16-row block group is the
/// 16 rows' blocks transposed at dword granularity).
trait LPacked16: LKind16 {
    /// `q`, `d` and `m` of the packed block group at `p`, as [`LKind16::build_block`] unpacks
    /// them from natural rows.
    unsafe fn block_packed(p: *const u8) -> ([__m512i; 8], __m512, __m512);
}

impl LPacked16 for Q41 {
    /// Dword 0 of every row is `d | m` (f16), dwords 1-4 its nibbles.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn block_packed(p: *const u8) -> ([__m512i; 8], __m512, __m512) {
        let ld = |k: usize| _mm512_loadu_si512(p.add(64 * k) as *const __m512i);
        let m4 = _mm512_set1_epi8(0x0F);
        let q = std::array::from_fn(|i| {
            let v = ld(1 + i % 4);
            if i < 4 {
                _mm512_and_si512(v, m4)
            } else {
                _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4)
            }
        });
        let dm = ld(0);
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)));
        (q, d, m)
    }
}

impl LPacked16 for Q80 {
    /// The value bytes' eight dwords of every row (stored `w + 128` as the tiles hold them: the
    /// top bit flipped), then the 16 `d`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn block_packed(p: *const u8) -> ([__m512i; 8], __m512, __m512) {
        let flip = _mm512_set1_epi8(-128);
        let q = std::array::from_fn(|i| {
            _mm512_xor_si512(_mm512_loadu_si512(p.add(64 * i) as *const __m512i), flip)
        });
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(512) as *const __m256i));
        (q, d, _mm512_setzero_ps())
    }
}

/// Bytes ahead of the packed stream asked into L2 (as the packed K-quant kernel's 8 groups).
const PACKED_AHEAD: usize = 16 << 10;

/// Packed legacy rows `[r0, r1)` (whole 16-row slices) against `n_tok` natural records, up to
/// [`PACKED_ROWS_MAX`] at a time per slice: one sequential weight stream per thread.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_packed<K: LPacked16>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    for o in (r0..r1).step_by(ROWS) {
        let slice = w.data.as_ptr().add(o * rb);
        let mut t0 = 0;
        while t0 < n_tok {
            let nt = (n_tok - t0).min(PACKED_ROWS_MAX);
            let (a, at) = (act.add(t0 * stride), (slice, w.n_in / 32, o, t0));
            match nt {
                1 => slice_packed::<K, 1>(at, a, stride, y),
                2 => slice_packed::<K, 2>(at, a, stride, y),
                3 => slice_packed::<K, 3>(at, a, stride, y),
                4 => slice_packed::<K, 4>(at, a, stride, y),
                5 => slice_packed::<K, 5>(at, a, stride, y),
                6 => slice_packed::<K, 6>(at, a, stride, y),
                7 => slice_packed::<K, 7>(at, a, stride, y),
                _ => slice_packed::<K, PACKED_ROWS_MAX>(at, a, stride, y),
            }
            t0 += nt;
        }
    }
}

/// One packed 16-row slice (`n_blocks` block groups at `slice`, output rows `o ..`) against `R`
/// records at `act + t * stride` (activation rows `t0 ..`): per block the exact i32 sums by one
/// `vpdpbusd` chain per activation row and `tile16`'s f32 steps, so the bits of the tiles.
// The sums and accumulators are indexed by activation row throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn slice_packed<K: LPacked16, const R: usize>(
    (slice, n_blocks, o, t0): (*const u8, usize, usize, usize),
    act: *const u8,
    stride: usize,
    y: YPtr,
) {
    let bg = ROWS * K::BB;
    let mut f = [_mm512_setzero_ps(); R];
    for kb in 0..n_blocks {
        let p = slice.add(kb * bg);
        super::prefetch_block_l2(p.wrapping_add(PACKED_AHEAD), bg);
        let (q, d, m) = K::block_packed(p);
        let (ag, k) = (act.add(kb / BLOCKS * super::REC), kb % BLOCKS);
        let mut h = [_mm512_setzero_si512(); R];
        for i in 0..8 {
            for t in 0..R {
                let x = rd_u32(ag.add(t * stride + 32 * k + 4 * i)) as i32;
                h[t] = _mm512_dpbusd_epi32(h[t], q[i], _mm512_set1_epi32(x));
            }
        }
        for t in 0..R {
            f[t] = block_step::<K>(h[t], d, m, ag.add(t * stride), k, f[t]);
        }
    }
    for (t, v) in f.iter().enumerate() {
        y.write16(t0 + t, o, *v);
    }
}
