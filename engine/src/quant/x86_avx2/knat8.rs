//! AVX2 natural-order K-quant kernel for a few activation rows (Q4_K, Q5_K, Q6_K; small batches and token trees): each group unpacked once per weight row as `rows_k_nat` does, the exact sums of eight weight rows reduced together, the float step eight rows wide (`k8_value`, the tiles' own), so the AVX2 family's bits.
//!
//! The column tiles transpose every group of eight weight rows before their products; for a few
//! activation rows that fixed cost outweighs the products. Here each weight row's group stays in
//! natural order: per activation row its exact integers (`maddubs`, `madd` against the
//! sub-blocks' scales) are kept as eight i32 lanes, one transposing reduction gives the eight
//! weight rows' sums in the lanes of one register, and the mins and the float step run on those
//! lanes with the tiles' function (`k8_value`). Same integers, same float operations: the same
//! bits.

use std::arch::x86_64::*;

use super::{columns_avx2, k8_value, ld, prefetch_block, rd_u16, KKind, KTiles, SHUF_K4, SHUF_K6};
use crate::quant::act::{GROUP, OFF_BS, OFF_D, REC};
use crate::quant::x86_avx512::k4_sc_m8;
use crate::quant::{QMatrix, YPtr};

/// Weight rows of one block (one i32 lane each).
const ROWS: usize = 8;
/// Most groups per row for which the next block is prefetched in memory order (see
/// `knat512::rows_k_nat16x16`).
const LINEAR_GROUPS: usize = 8;
/// Prefetch distance on longer rows, in groups of each row.
const PREFETCH: usize = 2;

/// Lane `j` = the sum of the eight lanes of `v[j]` (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce8_epi32(v: &[__m256i; ROWS]) -> __m256i {
    // Per 128-bit half: [v2k.0 + v2k.2, v2k+1.0 + v2k+1.2, v2k.1 + v2k.3, v2k+1.1 + v2k+1.3].
    let a: [__m256i; 4] = std::array::from_fn(|k| {
        let (x, y) = (v[2 * k], v[2 * k + 1]);
        _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y))
    });
    // Per half: the half's sums of v[4k .. 4k + 4].
    let b: [__m256i; 2] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm256_add_epi32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y))
    });
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(b[0], b[1]),
        _mm256_permute2x128_si256::<0x31>(b[0], b[1]),
    )
}

/// Lane `c` of result `q`: dword `q` of `m[c]` (an 8×4 dword transpose).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mins_cols8(m: &[__m128i; ROWS]) -> [__m256i; 4] {
    // Rows 4h .. 4h + 4: dwords 0..4 as four registers of four lanes.
    let quarter = |h: usize| -> [__m128i; 4] {
        let lo01 = _mm_unpacklo_epi32(m[4 * h], m[4 * h + 1]);
        let hi01 = _mm_unpackhi_epi32(m[4 * h], m[4 * h + 1]);
        let lo23 = _mm_unpacklo_epi32(m[4 * h + 2], m[4 * h + 3]);
        let hi23 = _mm_unpackhi_epi32(m[4 * h + 2], m[4 * h + 3]);
        [
            _mm_unpacklo_epi64(lo01, lo23),
            _mm_unpackhi_epi64(lo01, lo23),
            _mm_unpacklo_epi64(hi01, hi23),
            _mm_unpackhi_epi64(hi01, hi23),
        ]
    };
    let (lo, hi) = (quarter(0), quarter(1));
    std::array::from_fn(|q| _mm256_set_m128i(hi[q], lo[q]))
}

/// K-quant rows `[r0, r1)` against `R` natural records, eight weight rows at a time (see the
/// module doc). Rows after the last whole eight run the column tiles (the same bits).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_k_nat8<K: KKind, const R: usize>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let n_groups = w.n_in / GROUP;
    let whole = r0 + (r1 - r0) / ROWS * ROWS;
    let linear = n_groups <= LINEAR_GROUPS;
    // The block's f16 `d` and `dmin` and (Q4_K/Q5_K) mins as i16 pairs, per weight row.
    let (mut d16, mut dmin16) = ([0u16; ROWS], [0u16; ROWS]);
    let mut mins = [_mm_setzero_si128(); ROWS];
    // [R][ROWS] exact partial sums of the group at hand.
    let mut part = [[_mm256_setzero_si256(); ROWS]; R];
    for ob in (r0..whole).step_by(ROWS) {
        let base = w.data.as_ptr().add(ob * rb);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..n_groups {
            for c in 0..ROWS {
                let p = base.add(c * rb + g * K::BB);
                let ahead = if linear {
                    base.wrapping_add(ROWS * rb + (ROWS * g + c) * K::BB)
                } else if g + PREFETCH < n_groups {
                    p.wrapping_add(PREFETCH * K::BB)
                } else {
                    p.wrapping_add(ROWS * rb + PREFETCH * K::BB)
                        .wrapping_sub(n_groups * K::BB)
                };
                prefetch_block(ahead, K::BB);
                let wg = K::unpack_nat(p);
                let sc: [__m256i; 8] = std::array::from_fn(|k| {
                    if K::K6 {
                        _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(
                            wg.scv,
                            ld(SHUF_K6[k].as_ptr() as *const u8),
                        ))
                    } else {
                        _mm256_shuffle_epi8(wg.scv, ld(SHUF_K4[k].as_ptr() as *const u8))
                    }
                });
                if K::K6 {
                    d16[c] = rd_u16(p.add(208));
                } else {
                    d16[c] = rd_u16(p);
                    dmin16[c] = rd_u16(p.add(2));
                    let (_, m8) = k4_sc_m8(p);
                    mins[c] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m8 as i64));
                }
                for (t, part) in part.iter_mut().enumerate() {
                    let a = act.add(t * stride + g * REC);
                    let mut s = _mm256_setzero_si256();
                    for (k, sc) in sc.iter().enumerate() {
                        let pr = _mm256_maddubs_epi16(wg.q[k], ld(a.add(32 * k)));
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(pr, *sc));
                    }
                    if K::K6 {
                        s = _mm256_sub_epi32(s, _mm256_madd_epi16(wg.bs, ld(a.add(OFF_BS))));
                    }
                    part[c] = s;
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(d16.as_ptr() as *const __m128i));
            let ndmin = _mm256_xor_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(dmin16.as_ptr() as *const __m128i)),
                _mm256_set1_ps(-0.0),
            );
            // Q6_K's offset is already in the sums.
            let bs: &[__m256i] = if K::K6 { &[] } else { &mins_cols8(&mins) };
            for (t, acc) in acc.iter_mut().enumerate() {
                let a = act.add(t * stride + g * REC);
                let v = k8_value::<K>(bs, d, ndmin, reduce8_epi32(&part[t]), a);
                let dx = _mm256_set1_ps(*(a.add(OFF_D) as *const f32));
                *acc = _mm256_fmadd_ps(v, dx, *acc);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(y.row_mut(t, ob, ob + ROWS).as_mut_ptr(), *acc);
        }
    }
    if whole < r1 {
        columns_avx2::<KTiles<K>>(w, act, stride, R, whole, r1, y);
    }
}

/// `rows_k_nat8` for `n_tok` (2 to 8) activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn natural_rows<K: KKind>(
    w: &QMatrix,
    a: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    match n_tok {
        2 => rows_k_nat8::<K, 2>(w, a, stride, r0, r1, y),
        3 => rows_k_nat8::<K, 3>(w, a, stride, r0, r1, y),
        4 => rows_k_nat8::<K, 4>(w, a, stride, r0, r1, y),
        5 => rows_k_nat8::<K, 5>(w, a, stride, r0, r1, y),
        6 => rows_k_nat8::<K, 6>(w, a, stride, r0, r1, y),
        7 => rows_k_nat8::<K, 7>(w, a, stride, r0, r1, y),
        8 => rows_k_nat8::<K, 8>(w, a, stride, r0, r1, y),
        _ => debug_assert!(false, "rows_k_nat8 takes 2 to 8 activation rows"),
    }
}
