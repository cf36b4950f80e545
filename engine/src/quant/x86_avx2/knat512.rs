//! AVX-512 one- and two-row K-quant kernel (Q4_K, Q5_K, Q6_K; decoding, two-row trees and batches): the AVX2 natural-order kernel (`rows_k_nat`) at 512 bits, two 32-element sub-blocks per register, the same exact integers and `k_epilogue` step.
//!
//! `maddubs` then `madd` against the sub-blocks' scales, as `k_dot_nat`, on registers that hold
//! sub-blocks `2c` and `2c + 1` (unpacked from one value register broadcast to both halves and
//! shifted per half), so a group takes four of each instead of eight. The integers per (output
//! row, group) are `k_dot_nat`'s, hence the AVX2 family's bits.

use std::arch::x86_64::*;

use super::kcols512::k16_value;
use super::{
    f16_1, hsum_i32, k4_mins, k_epilogue, ld, prefetch_ahead, prefetch_block, shuf_k4, shuf_k6,
    KKind, Q4K, Q5K, Q6K,
};
use crate::quant::act::{GROUP, OFF_BS, OFF_D, REC};
use crate::quant::x86_avx512::{k4_sc_m8, reduce16_halves_epi32};
use crate::quant::{QMatrix, YPtr};

/// A K-quant group in natural order, two sub-blocks per register: `q[c]` = elements
/// `64c .. 64c + 64`.
pub(super) struct KNat16 {
    q: [__m512i; 4],
    /// The scale bytes, broadcast to every 128-bit lane (for the `pshufb` controls below).
    scv: __m512i,
    /// i16 factors of the 16 Q8_K block sums (as `KNat::bs`).
    bs: __m256i,
    d: f32,
    dmin: f32,
}

/// The AVX2 scale controls of sub-blocks `2c` and `2c + 1`, side by side.
const fn pairs(t: [[i8; 32]; 8]) -> [[i8; 64]; 4] {
    let mut out = [[0i8; 64]; 4];
    let mut c = 0;
    while c < 4 {
        let mut i = 0;
        while i < 32 {
            out[c][i] = t[2 * c][i];
            out[c][32 + i] = t[2 * c + 1][i];
            i += 1;
        }
        c += 1;
    }
    out
}

static SHUF_K4_2: [[i8; 64]; 4] = pairs(shuf_k4());
static SHUF_K6_2: [[i8; 64]; 4] = pairs(shuf_k6());

/// `[v | v >> s]`: `v` in the low 256 bits, `v` shifted right by `s` bits per 16-bit lane in the
/// high ones (the caller masks the bytes).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn halves_shifted(v: __m256i, s: i16) -> __m512i {
    let z = _mm512_broadcast_i64x4(v);
    let counts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(s));
    _mm512_srlv_epi16(z, counts)
}

/// A K-quant type with a 512-bit natural-order unpack.
pub(super) trait KNat512: KKind {
    unsafe fn unpack16(p: *const u8) -> KNat16;
}

impl KNat512 for Q4K {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack16(p: *const u8) -> KNat16 {
        let (sc8, m8) = k4_sc_m8(p);
        let m4 = _mm512_set1_epi8(0x0F);
        // qs register c: sub-block 2c in its low nibbles, 2c + 1 in its high ones.
        let q = std::array::from_fn(|c| {
            _mm512_and_si512(halves_shifted(ld(p.add(16 + 32 * c)), 4), m4)
        });
        KNat16 {
            q,
            scv: _mm512_set1_epi64(sc8 as i64),
            bs: k4_mins(m8),
            d: f16_1(p),
            dmin: f16_1(p.add(2)),
        }
    }
}

impl KNat512 for Q5K {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack16(p: *const u8) -> KNat16 {
        let (sc8, m8) = k4_sc_m8(p);
        let m4 = _mm512_set1_epi8(0x0F);
        // Bit j of the 32 qh bytes is the fifth bit of sub-block j.
        let qh = _mm512_broadcast_i64x4(ld(p.add(16)));
        let c16 = _mm512_set1_epi8(16);
        let q = std::array::from_fn(|c| {
            let lo = _mm512_and_si512(halves_shifted(ld(p.add(48 + 32 * c)), 4), m4);
            let bits = _mm512_inserti64x4::<1>(
                _mm512_set1_epi8((1u8 << (2 * c)) as i8),
                _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8),
            );
            _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bits), lo, c16)
        });
        KNat16 {
            q,
            scv: _mm512_set1_epi64(sc8 as i64),
            bs: k4_mins(m8),
            d: f16_1(p),
            dmin: f16_1(p.add(2)),
        }
    }
}

impl KNat512 for Q6K {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack16(p: *const u8) -> KNat16 {
        let m4 = _mm512_set1_epi8(0x0F);
        let m3 = _mm512_set1_epi8(3);
        let mut q = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            // ql: sub-blocks 4h, 4h + 1 in the low nibbles of 64 bytes, 4h + 2, 4h + 3 in the
            // high ones; qh: their two high bits at bit pairs 0, 2 (and 4, 6) of 32 bytes.
            let l = _mm512_loadu_si512(p.add(64 * h) as *const __m512i);
            let qh = halves_shifted(ld(p.add(128 + 32 * h)), 2);
            let hi = |v: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(v, m3));
            q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), hi(qh));
            q[2 * h + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(l), m4),
                hi(_mm512_srli_epi16::<4>(qh)),
            );
        }
        let scales = _mm_loadu_si128(p.add(192) as *const __m128i);
        KNat16 {
            q,
            scv: _mm512_broadcast_i32x4(scales),
            bs: _mm256_slli_epi16(_mm256_cvtepi8_epi16(scales), 5),
            d: f16_1(p.add(208)),
            dmin: 0.0,
        }
    }
}

/// The i16 scales of sub-blocks `2c` and `2c + 1` against the `maddubs` pairs of `w.q[c]`
/// (the same for every activation row: built once per group).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_scales<K: KNat512>(w: &KNat16) -> [__m512i; 4] {
    let mut sc = [_mm512_setzero_si512(); 4];
    for (c, sc) in sc.iter_mut().enumerate() {
        *sc = if K::K6 {
            let ctl = _mm512_loadu_si512(SHUF_K6_2[c].as_ptr() as *const __m512i);
            _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(w.scv, ctl))
        } else {
            let ctl = _mm512_loadu_si512(SHUF_K4_2[c].as_ptr() as *const __m512i);
            _mm512_shuffle_epi8(w.scv, ctl)
        };
    }
    sc
}

/// Exact `(Σ q·sc·x, Σ bs·bsum)` of a group against the natural record at `a` (`k_dot_nat`'s).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k_dot_nat16(w: &KNat16, sc: &[__m512i; 4], a: *const u8) -> (i32, i32) {
    let mut s = _mm512_setzero_si512();
    for (c, sc) in sc.iter().enumerate() {
        let x = _mm512_loadu_si512(a.add(64 * c) as *const __m512i);
        let p = _mm512_maddubs_epi16(w.q[c], x);
        s = _mm512_add_epi32(s, _mm512_madd_epi16(p, *sc));
    }
    let mm = _mm256_madd_epi16(w.bs, ld(a.add(OFF_BS)));
    (_mm512_reduce_add_epi32(s), hsum_i32(mm))
}

/// K-quant rows `[r0, r1)` against `R` natural records at `act + t * stride` (`rows_k_nat` at
/// 512 bits): each group unpacked once for the `R` rows, every row with the integers and float
/// steps it has alone.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows_k_nat16<K: KNat512, const R: usize>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let n_groups = w.n_in / GROUP;
    for o in r0..r1 {
        let row = w.data.as_ptr().add(o * rb);
        let mut acc = [0f32; R];
        for g in 0..n_groups {
            prefetch_ahead(row, g, K::BB);
            let wg = K::unpack16(row.add(g * K::BB));
            let sc = pair_scales::<K>(&wg);
            for (t, acc) in acc.iter_mut().enumerate() {
                let at = act.add(t * stride + g * REC);
                let (s, m) = k_dot_nat16(&wg, &sc, at);
                let dx = *(at.add(OFF_D) as *const f32);
                *acc = k_epilogue(K::K6, s, m, wg.d, wg.dmin, dx, *acc);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            y.write(t, o, *acc);
        }
    }
}

/// The 16 output rows' `d | dmin` (Q4_K/Q5_K: the block head's first dword; Q6_K: `d` in the
/// low half) and Q4_K/Q5_K mins as i16 pairs (`(m_2q, m_2q+1)` in dword `q`), stored per row
/// while it is unpacked and turned into column registers once per group.
#[repr(C, align(64))]
struct Heads16 {
    dd: [u32; 16],
    mins: [[u32; 4]; 16],
}

/// Lane `c` of the four results: dword `q` of `mins[c]` (a 16×4 dword transpose).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn mins_cols16(h: &Heads16) -> [__m512i; 4] {
    let x: [__m512i; 4] =
        std::array::from_fn(|k| _mm512_load_si512(h.mins[4 * k].as_ptr() as *const __m512i));
    // Outputs 0..8 (from x0, x1) and 8..16 (x2, x3): dwords q in {0, 1}, then {2, 3}.
    let idx = |q0: i32| {
        let v: [i32; 16] = std::array::from_fn(|l| {
            let (o, q) = (l as i32 % 8, q0 + l as i32 / 8);
            16 * (o / 4) + 4 * (o % 4) + q
        });
        _mm512_loadu_si512(v.as_ptr() as *const __m512i)
    };
    let (i01, i23) = (idx(0), idx(2));
    let pa = _mm512_permutex2var_epi32(x[0], i01, x[1]);
    let pb = _mm512_permutex2var_epi32(x[0], i23, x[1]);
    let pc = _mm512_permutex2var_epi32(x[2], i01, x[3]);
    let pd = _mm512_permutex2var_epi32(x[2], i23, x[3]);
    [
        _mm512_shuffle_i64x2::<0b01_00_01_00>(pa, pc),
        _mm512_shuffle_i64x2::<0b11_10_11_10>(pa, pc),
        _mm512_shuffle_i64x2::<0b01_00_01_00>(pb, pd),
        _mm512_shuffle_i64x2::<0b11_10_11_10>(pb, pd),
    ]
}

/// K-quant rows `[r0, r1)` against `R` natural records, 16 output rows at a time: each group
/// unpacked once per row as `rows_k_nat16` does, its exact i32 partial sums per activation row
/// (`maddubs`, then `vpdpwssd` against the sub-blocks' scales) kept for the 16 rows and summed by
/// one transposing reduction, the mins and the float step then done for the 16 rows at once in
/// the column tiles' lanes (`kcols512::k16_value`, their float step). Same integers and float steps as
/// the one-row kernel, so the same bits; no horizontal sum per (row, group). Rows past the last
/// whole 16 run `rows_k_nat16`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows_k_nat16x16<K: KNat512, const R: usize>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let n_groups = w.n_in / GROUP;
    let whole = r0 + (r1 - r0) / 16 * 16;
    // Short rows (a 16-row block of at most `LINEAR_GROUPS` groups per row, 27 KB of Q6_K)
    // prefetch the next block in memory order, one group's bytes per step; longer ones each
    // row's own group `PREFETCH16` ahead (measured on Zen 4: each loses on the other's rows).
    let linear = n_groups <= LINEAR_GROUPS;
    let mut heads: Heads16 = std::mem::zeroed();
    // [R][16 output rows] partial sums of the group at hand, folded to eight lanes (half the
    // bytes in L1).
    let mut part = [[_mm256_setzero_si256(); 16]; R];
    for ob in (r0..whole).step_by(16) {
        let base = w.data.as_ptr().add(ob * rb);
        let mut acc = [_mm512_setzero_ps(); R];
        for g in 0..n_groups {
            for c in 0..16 {
                let p = base.add(c * rb + g * K::BB);
                let ahead = if linear {
                    base.wrapping_add(16 * rb + (16 * g + c) * K::BB)
                } else if g + PREFETCH16 < n_groups {
                    p.wrapping_add(PREFETCH16 * K::BB)
                } else {
                    // Past the row's end: the same row of the next block.
                    p.wrapping_add(16 * rb + PREFETCH16 * K::BB)
                        .wrapping_sub(n_groups * K::BB)
                };
                prefetch_block(ahead, K::BB);
                let wg = K::unpack16(p);
                let sc = pair_scales::<K>(&wg);
                if K::K6 {
                    heads.dd[c] = super::rd_u16(p.add(208)) as u32;
                } else {
                    heads.dd[c] = super::rd_u32(p);
                    let (_, m8) = k4_sc_m8(p);
                    _mm_store_si128(
                        heads.mins[c].as_mut_ptr() as *mut __m128i,
                        _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m8 as i64)),
                    );
                }
                for (t, part) in part.iter_mut().enumerate() {
                    let a = act.add(t * stride + g * REC);
                    let mut s = _mm512_setzero_si512();
                    for (cc, sc) in sc.iter().enumerate() {
                        let x = _mm512_loadu_si512(a.add(64 * cc) as *const __m512i);
                        s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(wg.q[cc], x), *sc);
                    }
                    if K::K6 {
                        let mm = _mm256_madd_epi16(wg.bs, ld(a.add(OFF_BS)));
                        s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(mm));
                    }
                    part[c] = _mm256_add_epi32(
                        _mm512_castsi512_si256(s),
                        _mm512_extracti64x4_epi64::<1>(s),
                    );
                }
            }
            let dd = _mm512_load_si512(heads.dd.as_ptr() as *const __m512i);
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
            // Q6_K's offset is already in the sums.
            let bs: &[__m512i] = if K::K6 { &[] } else { &mins_cols16(&heads) };
            let ndmin = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<
                    16,
                >(dd)))),
                _mm512_set1_epi32(i32::MIN),
            ));
            for (t, acc) in acc.iter_mut().enumerate() {
                let a = act.add(t * stride + g * REC);
                let s = reduce16_halves_epi32(&part[t]);
                let v = k16_value::<K>(bs, d, ndmin, s, a);
                let dx = _mm512_set1_ps(*(a.add(OFF_D) as *const f32));
                *acc = _mm512_fmadd_ps(v, dx, *acc);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            y.write16(t, ob, *acc);
        }
    }
    if whole < r1 {
        rows_k_nat16::<K, R>(w, act, stride, whole, r1, y);
    }
}

/// Software prefetch distance of `rows_k_nat16x16` on long rows, in groups of each of its 16 rows.
const PREFETCH16: usize = 2;
/// Most groups per row for which `rows_k_nat16x16` prefetches the next 16-row block in order.
const LINEAR_GROUPS: usize = 8;
