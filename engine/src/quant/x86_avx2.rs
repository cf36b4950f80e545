//! AVX2 kernels (ggml's `maddubs`/`madd` scheme): legacy types on natural records; K-quants as exact integer sums per group with one shared float step, register-tiled (2 output × 4 activation rows) on pair-ordered records.
//!
//! **Legacy types** (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) use the sign trick for signed weights and scale
//! each 32-block in f32; loop structure as the AVX-512 kernels (each weight group unpacked once for
//! all activation rows).
//!
//! **K-quants** (Q4_K, Q5_K, Q6_K). Every kernel computes, per (output row, activation row,
//! group), the exact integers `s = Σ q·sc·x` and `m` (mins against the Q8_K block sums, or Q6_K's
//! −32 offset), then [`k_epilogue`] turns them into the f32 accumulator: the bits of a row never
//! depend on how its integers were computed, so batches and single rows agree bit for bit.
//!
//! * Fewer than [`PAIR_MIN_ROWS`] activation rows (decoding): natural records, weights unpacked in
//!   natural order, one `maddubs` + `madd` (sub-block scales) per 32 elements (`rows_k_nat`).
//! * More rows: **pair order**. A 256-element group is four 64-element spans; span `p` holds the
//!   32-element units `u0 = [64p, 64p + 32)` and `u1 = [64p + 32, 64p + 64)`. Weights and
//!   activations of a span are stored as `X = [u0[0..16] | u1[16..32]]`, `Y = [u0[16..32] |
//!   u1[0..16]]` (one `vpblendd` and one `vperm2i128` from natural order), so in both the 16-bit
//!   `maddubs` lanes 0..8 belong to `u0` and 8..16 to `u1`: Q4_K/Q5_K add the two `maddubs`
//!   results before the one `madd` that applies both units' scales (five integer operations per
//!   64 weights and activation row instead of six). Each group is unpacked once per pair of
//!   output rows and dotted with the activation rows four at a time, the weight registers reused
//!   across the four and each activation load across the two (`rows_k_pair`); the 2 × 4 tile's
//!   eight integer pairs are reduced together (a transposed `hadd` tree) and stepped as one
//!   vector.
//!
//! Pair activation record (`PREC` bytes per group, from the natural Q8_K record of [`act`]):
//! `[0, 256)` i8 q, span `p` at `64p`: `X` then `Y`; `[256, 260)` f32 d; `[288, 320)` i16
//! bsums[16].

use std::arch::x86_64::*;

use super::act::{self, ActKind, GROUP, OFF_BS, OFF_D, OFF_S, REC};
use super::x86_avx512::k4_sc_m8;
use super::{GgmlType, QMatrix, YPtr};

/// Bytes of one pair activation record (one 256-element group).
pub(crate) const PREC: usize = 320;
const P_DP: usize = 256;
const P_BS: usize = 288;

/// Accumulators (output row × activation row) kept per row tile.
const ACC_CAP: usize = 256;
/// Activation bytes of one k-block (all rows of the tile), sized to stay in L1.
const KB_BYTES: usize = 24 * 1024;
/// Software prefetch distance for the weight stream, in groups.
const PREFETCH_GROUPS: usize = 6;

/// A legacy weight type for `rows_legacy`.
trait LegacyKind {
    type W;
    const BLOCKS: usize;
    const BB: usize;
    unsafe fn unpack(p: *const u8) -> Self::W;
    /// Zeroes the scales of blocks `nb..` of a partial group that was unpacked in place.
    unsafe fn mask_tail(_w: &mut Self::W, _nb: usize) {}
    unsafe fn step(w: &Self::W, a: *const u8, acc: __m256) -> __m256;
}

#[inline(always)]
unsafe fn rd_u16(p: *const u8) -> u16 {
    std::ptr::read_unaligned(p as *const u16)
}

#[inline(always)]
unsafe fn rd_u32(p: *const u8) -> u32 {
    std::ptr::read_unaligned(p as *const u32)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_1(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(rd_u16(p) as i32)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 32 nibbles of 16 bytes: low nibbles then high nibbles (elements 0..32 of a legacy block).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let t = _mm_loadu_si128(p as *const __m128i);
    let m4 = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(
        _mm_and_si128(_mm_srli_epi16(t, 4), m4),
        _mm_and_si128(t, m4),
    )
}

/// Byte j = 0xFF where bit j of `x` is set (ggml's `bytes_from_bits_32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits(x: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// `act::quantize_group` compiled with AVX2 (same code and results, vectorized 8-wide).
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_group(kind: ActKind, x: &[f32], rec: &mut [u8]) {
    act::quantize_group(kind, x, rec)
}

#[inline(always)]
unsafe fn ld(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// The pair registers `(X, Y)` of two natural-order 32-element units.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair(u0: __m256i, u1: __m256i) -> (__m256i, __m256i) {
    (
        _mm256_blend_epi32::<0xF0>(u0, u1),
        _mm256_permute2x128_si256::<0x21>(u0, u1),
    )
}

/// `(X, Y)` of every span from eight natural-order units.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pairs(n: &[__m256i; 8]) -> ([__m256i; 4], [__m256i; 4]) {
    let mut x = [_mm256_setzero_si256(); 4];
    let mut y = [_mm256_setzero_si256(); 4];
    for p in 0..4 {
        (x[p], y[p]) = pair(n[2 * p], n[2 * p + 1]);
    }
    (x, y)
}

/// The pair record (`PREC` bytes, see the module doc) of a natural Q8_K record.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `out.len() >= PREC`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn pair_record(nat: &[u8; REC], out: &mut [u8]) {
    let out = &mut out[..PREC];
    out.fill(0);
    let (np, op) = (nat.as_ptr(), out.as_mut_ptr());
    for p in 0..4 {
        let (x, y) = pair(ld(np.add(64 * p)), ld(np.add(64 * p + 32)));
        _mm256_storeu_si256(op.add(64 * p) as *mut __m256i, x);
        _mm256_storeu_si256(op.add(64 * p + 32) as *mut __m256i, y);
    }
    std::ptr::copy_nonoverlapping(np.add(OFF_D), op.add(P_DP), 4);
    std::ptr::copy_nonoverlapping(np.add(OFF_BS), op.add(P_BS), 32);
}

// ---------------------------------------------------------------------------------------------
// Legacy 32-element types
// ---------------------------------------------------------------------------------------------

struct WL {
    /// |w| (offset types) or w (unsigned types), per block.
    wa: [__m256i; 8],
    /// Signed w for the sign trick (offset types only).
    ws: [__m256i; 8],
    d: __m256,
    m: __m256,
}

/// Per-block d (and m) of 8 legacy blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_dm(p: *const u8, bb: usize, off_m: Option<usize>) -> (__m256, __m256) {
    let mut h = [0u16; 16];
    for b in 0..8 {
        h[b] = rd_u16(p.add(b * bb));
        if let Some(om) = off_m {
            h[8 + b] = rd_u16(p.add(b * bb + om));
        }
    }
    (
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i)),
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(8) as *const __m128i)),
    )
}

/// Zeroes d and m of blocks `nb..8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_mask_tail(w: &mut WL, nb: usize) {
    let keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(nb as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    ));
    w.d = _mm256_and_ps(w.d, keep);
    w.m = _mm256_and_ps(w.m, keep);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_step<const OFFSET: bool, const MINS: bool>(
    w: &WL,
    a: *const u8,
    acc: __m256,
) -> __m256 {
    let scale = _mm256_mul_ps(w.d, _mm256_loadu_ps(a.add(OFF_D) as *const f32));
    let ones = _mm256_set1_epi16(1);
    let mut acc = acc;
    for b in 0..8 {
        let av = _mm256_loadu_si256(a.add(32 * b) as *const __m256i);
        let av = if OFFSET {
            _mm256_sign_epi8(av, w.ws[b])
        } else {
            av
        };
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w.wa[b], av), ones);
        let sb = _mm256_permutevar8x32_ps(scale, _mm256_set1_epi32(b as i32));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sb, acc);
    }
    if MINS {
        acc = _mm256_fmadd_ps(w.m, _mm256_loadu_ps(a.add(OFF_S) as *const f32), acc);
    }
    acc
}

struct Q40;
struct Q41;
struct Q50;
struct Q51;
struct Q80;

impl LegacyKind for Q40 {
    type W = WL;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mask_tail(w: &mut WL, nb: usize) {
        legacy_mask_tail(w, nb)
    }
    const BLOCKS: usize = 8;
    const BB: usize = 18;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WL {
        let (d, m) = legacy_dm(p, 18, None);
        let mut w = WL {
            wa: [_mm256_setzero_si256(); 8],
            ws: [_mm256_setzero_si256(); 8],
            d,
            m,
        };
        for b in 0..8 {
            let s = _mm256_sub_epi8(nibbles32(p.add(18 * b + 2)), _mm256_set1_epi8(8));
            w.ws[b] = s;
            w.wa[b] = _mm256_abs_epi8(s);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WL, a: *const u8, acc: __m256) -> __m256 {
        legacy_step::<true, false>(w, a, acc)
    }
}

impl LegacyKind for Q41 {
    type W = WL;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mask_tail(w: &mut WL, nb: usize) {
        legacy_mask_tail(w, nb)
    }
    const BLOCKS: usize = 8;
    const BB: usize = 20;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WL {
        let (d, m) = legacy_dm(p, 20, Some(2));
        let mut w = WL {
            wa: [_mm256_setzero_si256(); 8],
            ws: [_mm256_setzero_si256(); 8],
            d,
            m,
        };
        for b in 0..8 {
            w.wa[b] = nibbles32(p.add(20 * b + 4));
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WL, a: *const u8, acc: __m256) -> __m256 {
        legacy_step::<false, true>(w, a, acc)
    }
}

impl LegacyKind for Q50 {
    type W = WL;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mask_tail(w: &mut WL, nb: usize) {
        legacy_mask_tail(w, nb)
    }
    const BLOCKS: usize = 8;
    const BB: usize = 22;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WL {
        let (d, m) = legacy_dm(p, 22, None);
        let mut w = WL {
            wa: [_mm256_setzero_si256(); 8],
            ws: [_mm256_setzero_si256(); 8],
            d,
            m,
        };
        for b in 0..8 {
            let q = nibbles32(p.add(22 * b + 6));
            let hb = _mm256_and_si256(
                bytes_from_bits(rd_u32(p.add(22 * b + 2))),
                _mm256_set1_epi8(16),
            );
            let s = _mm256_sub_epi8(_mm256_or_si256(q, hb), _mm256_set1_epi8(16));
            w.ws[b] = s;
            w.wa[b] = _mm256_abs_epi8(s);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WL, a: *const u8, acc: __m256) -> __m256 {
        legacy_step::<true, false>(w, a, acc)
    }
}

impl LegacyKind for Q51 {
    type W = WL;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mask_tail(w: &mut WL, nb: usize) {
        legacy_mask_tail(w, nb)
    }
    const BLOCKS: usize = 8;
    const BB: usize = 24;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WL {
        let (d, m) = legacy_dm(p, 24, Some(2));
        let mut w = WL {
            wa: [_mm256_setzero_si256(); 8],
            ws: [_mm256_setzero_si256(); 8],
            d,
            m,
        };
        for b in 0..8 {
            let q = nibbles32(p.add(24 * b + 8));
            let hb = _mm256_and_si256(
                bytes_from_bits(rd_u32(p.add(24 * b + 4))),
                _mm256_set1_epi8(16),
            );
            w.wa[b] = _mm256_or_si256(q, hb);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WL, a: *const u8, acc: __m256) -> __m256 {
        legacy_step::<false, true>(w, a, acc)
    }
}

impl LegacyKind for Q80 {
    type W = WL;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mask_tail(w: &mut WL, nb: usize) {
        legacy_mask_tail(w, nb)
    }
    const BLOCKS: usize = 8;
    const BB: usize = 34;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WL {
        let (d, m) = legacy_dm(p, 34, None);
        let mut w = WL {
            wa: [_mm256_setzero_si256(); 8],
            ws: [_mm256_setzero_si256(); 8],
            d,
            m,
        };
        for b in 0..8 {
            let s = _mm256_loadu_si256(p.add(34 * b + 2) as *const __m256i);
            w.ws[b] = s;
            w.wa[b] = _mm256_abs_epi8(s);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WL, a: *const u8, acc: __m256) -> __m256 {
        legacy_step::<true, false>(w, a, acc)
    }
}

/// Legacy-type rows `[r0, r1)` against natural activation records.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_legacy<K: LegacyKind>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let gbytes = K::BLOCKS * K::BB;
    let n_full = w.n_in / GROUP;
    let tail_bytes = (w.n_in % GROUP) / 32 * K::BB;
    let n_groups = n_full + usize::from(tail_bytes > 0);
    let mut tail = [0u8; 8 * 34];
    let mut acc = [_mm256_setzero_ps(); ACC_CAP];
    let mut t0 = 0;
    while t0 < n_tok {
        let nt = (n_tok - t0).min(ACC_CAP);
        let rs = (ACC_CAP / nt).max(1);
        let kb = (KB_BYTES / (nt * REC)).max(1);
        let ab = act.add(t0 * stride);
        let mut o0 = r0;
        while o0 < r1 {
            let o1 = (o0 + rs).min(r1);
            for v in acc[..(o1 - o0) * nt].iter_mut() {
                *v = _mm256_setzero_ps();
            }
            let mut g0 = 0;
            while g0 < n_groups {
                let g1 = (g0 + kb).min(n_groups);
                for o in o0..o1 {
                    let wrow = w.data.as_ptr().add(o * rb);
                    let accs = acc.as_mut_ptr().add((o - o0) * nt);
                    for g in g0..g1 {
                        prefetch_ahead(wrow, g, gbytes);
                        let wv = if g < n_full {
                            K::unpack(wrow.add(g * gbytes))
                        } else if o * rb + (n_full + 1) * gbytes <= w.data.len() {
                            // Partial last group read in place (into the next row), missing
                            // blocks masked: their padded activations are zero.
                            let mut wv = K::unpack(wrow.add(g * gbytes));
                            K::mask_tail(&mut wv, tail_bytes / K::BB);
                            wv
                        } else {
                            std::ptr::copy_nonoverlapping(
                                wrow.add(g * gbytes),
                                tail.as_mut_ptr(),
                                tail_bytes,
                            );
                            K::unpack(tail.as_ptr())
                        };
                        let ag = ab.add(g * REC);
                        for t in 0..nt {
                            let ap = accs.add(t);
                            *ap = K::step(&wv, ag.add(t * stride), *ap);
                        }
                    }
                }
                g0 = g1;
            }
            for o in o0..o1 {
                for t in 0..nt {
                    y.write(t0 + t, o, hsum(acc[(o - o0) * nt + t]));
                }
            }
            o0 = o1;
        }
        t0 += nt;
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants: exact integer sums per (output row, activation row, group), one float step
// ---------------------------------------------------------------------------------------------

/// Fewest activation rows for which K-quant matmuls use pair records and the register tiles;
/// fewer rows (single-token decoding, small batches) use natural records and `rows_k_nat`.
pub(crate) const PAIR_MIN_ROWS: usize = 4;

/// Whether a matmul of `n_tok` activation rows against weights of type `ty` runs on pair
/// records (otherwise natural ones).
pub(crate) fn pair_layout(ty: GgmlType, n_tok: usize) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K) && n_tok >= PAIR_MIN_ROWS
}

/// The float step of one K-quant group, shared by every kernel so that each (output row,
/// activation row) gets the same bits whatever kernel computed its exact integer sums:
/// `s = Σ q·sc·x` and `m` (Q4_K/Q5_K: `Σ min·bsum`; Q6_K: `Σ 32·sc·bsum`, its offset).
#[inline(always)]
fn k_epilogue(k6: bool, s: i32, m: i32, d: f32, dmin: f32, dx: f32, acc: f32) -> f32 {
    let v = if k6 {
        (s - m) as f32 * d
    } else {
        (m as f32).mul_add(-dmin, s as f32 * d)
    };
    v.mul_add(dx, acc)
}

/// Sum of the 8 i32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// `[Σ v[0], …, Σ v[7]]`: the lane sums of eight vectors (a transposed hadd tree, exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum8_i32(v: &[__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    let a = _mm256_hadd_epi32(h01, h23);
    let b = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(a, b),
        _mm256_permute2x128_si256::<0x31>(a, b),
    )
}

/// A K-quant group in natural order for `rows_k_nat`: `q[k]` = elements `32k..32k+32`.
struct KNat {
    q: [__m256i; 8],
    /// The scale bytes, broadcast (Q4_K/Q5_K: 8 scales in every 64 bits; Q6_K: 16 in every
    /// 128), for `k_dot_nat`'s shuffles.
    scv: __m256i,
    /// i16 factors of the 16 Q8_K block sums, as `WK::bs`.
    bs: __m256i,
    d: f32,
    dmin: f32,
}

/// A K-quant group in pair order for the tiles.
#[derive(Clone, Copy)]
struct WK {
    x: [__m256i; 4],
    y: [__m256i; 4],
    /// i16 scales of the 16 `maddubs` lanes of `x[p]` (and of `y[p]`, except for Q6_K: `sy`).
    sx: [__m256i; 4],
    sy: [__m256i; 4],
    /// i16 factors of the 16 Q8_K block sums: mins (Q4_K/Q5_K) or 32·scale (Q6_K's offset).
    bs: __m256i,
    d: f32,
    dmin: f32,
}

trait KKind {
    const BB: usize;
    const K6: bool;
    unsafe fn unpack_nat(p: *const u8) -> KNat;
    unsafe fn unpack_pair(p: *const u8) -> WK;
}

/// `pshufb` controls putting scale byte `k` (Q4_K/Q5_K) into every 16-bit lane, high byte zero.
const fn shuf_k4() -> [[i8; 32]; 8] {
    let mut t = [[-128i8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        let mut i = 0;
        while i < 16 {
            t[k][2 * i] = k as i8;
            i += 1;
        }
        k += 1;
    }
    t
}

/// `pshufb` controls putting Q6_K scale byte `2k` (low 128 bits) / `2k + 1` (high) into the
/// high byte of every 16-bit lane (an arithmetic shift then sign-extends it).
const fn shuf_k6() -> [[i8; 32]; 8] {
    let mut t = [[-128i8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        let mut i = 0;
        while i < 8 {
            t[k][2 * i + 1] = (2 * k) as i8;
            t[k][16 + 2 * i + 1] = (2 * k + 1) as i8;
            i += 1;
        }
        k += 1;
    }
    t
}

static SHUF_K4: [[i8; 32]; 8] = shuf_k4();
static SHUF_K6: [[i8; 32]; 8] = shuf_k6();

/// Mins `[m_0, m_0, m_1, m_1, …]` (i16) against the sixteen 16-element bsums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_mins(m8: u64) -> __m256i {
    let z = -128i8;
    let mshuf = _mm256_setr_epi8(
        0, z, 0, z, 1, z, 1, z, 2, z, 2, z, 3, z, 3, z, 4, z, 4, z, 5, z, 5, z, 6, z, 6, z, 7, z,
        7, z,
    );
    _mm256_shuffle_epi8(_mm256_set1_epi64x(m8 as i64), mshuf)
}

/// Exact `(Σ q·sc·x, Σ bs·bsum)` of a natural group against the natural record at `a`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_dot_nat<K: KKind>(w: &KNat, a: *const u8) -> (i32, i32) {
    let mut s = _mm256_setzero_si256();
    for k in 0..8 {
        let sc = if K::K6 {
            _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(
                w.scv,
                ld(SHUF_K6[k].as_ptr() as *const u8),
            ))
        } else {
            _mm256_shuffle_epi8(w.scv, ld(SHUF_K4[k].as_ptr() as *const u8))
        };
        let p = _mm256_maddubs_epi16(w.q[k], ld(a.add(32 * k)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, sc));
    }
    let mm = _mm256_madd_epi16(w.bs, ld(a.add(OFF_BS)));
    (hsum_i32(s), hsum_i32(mm))
}

/// Scales of a Q4_K/Q5_K block for the pair tiles (span p: `[sc_2p ×8 | sc_2p+1 ×8]`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_pair(p: *const u8, x: [__m256i; 4], y: [__m256i; 4]) -> WK {
    let (sc8, m8) = k4_sc_m8(p);
    let scv = _mm256_set1_epi64x(sc8 as i64);
    let mut sx = [_mm256_setzero_si256(); 4];
    for (s, v) in sx.iter_mut().enumerate() {
        // Bytes 2s (low 128 bits) and 2s + 1 (high) into every 16-bit lane, high byte zero.
        let (lo, hi, z) = ((2 * s) as i8, (2 * s + 1) as i8, -128i8);
        let shuf = _mm256_setr_epi8(
            lo, z, lo, z, lo, z, lo, z, lo, z, lo, z, lo, z, lo, z, hi, z, hi, z, hi, z, hi, z, hi,
            z, hi, z, hi, z, hi, z,
        );
        *v = _mm256_shuffle_epi8(scv, shuf);
    }
    WK {
        x,
        y,
        sx,
        sy: sx,
        bs: k4_mins(m8),
        d: f16_1(p),
        dmin: f16_1(p.add(2)),
    }
}

/// Q4_K/Q5_K natural-order group from its units.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_nat(p: *const u8, q: [__m256i; 8]) -> KNat {
    let (sc8, m8) = k4_sc_m8(p);
    KNat {
        q,
        scv: _mm256_set1_epi64x(sc8 as i64),
        bs: k4_mins(m8),
        d: f16_1(p),
        dmin: f16_1(p.add(2)),
    }
}

/// Q4_K units: qs register c holds sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_units(p: *const u8) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut n = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let v = ld(p.add(16 + 32 * c));
        n[2 * c] = _mm256_and_si256(v, m4);
        n[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    n
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5k_units(p: *const u8) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let qh = ld(p.add(16));
    let c16 = _mm256_set1_epi8(16);
    let mut n = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let v = ld(p.add(48 + 32 * c));
        let b0 = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
        let b1 = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
        let h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), c16);
        let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), c16);
        n[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), h0);
        n[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1);
    }
    n
}

/// Q6_K units (values 0..64; the −32 offset enters through `bs`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_units(p: *const u8) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let mut n = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        let l0 = ld(p.add(64 * h));
        let l1 = ld(p.add(64 * h + 32));
        let qh = ld(p.add(128 + 32 * h));
        let hb0 = _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4);
        let hb2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4);
        let hb4 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4);
        let hb6 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4);
        n[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), hb0);
        n[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), hb2);
        n[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hb4);
        n[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hb6);
    }
    n
}

struct Q4K;
struct Q5K;
struct Q6K;

impl KKind for Q4K {
    const BB: usize = 144;
    const K6: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_nat(p: *const u8) -> KNat {
        k4_nat(p, q4k_units(p))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_pair(p: *const u8) -> WK {
        // Straight from the packed nibbles: the pair of (v, v >> 4), then the mask.
        let m4 = _mm256_set1_epi8(0x0F);
        let mut x = [_mm256_setzero_si256(); 4];
        let mut y = [_mm256_setzero_si256(); 4];
        for c in 0..4 {
            let v = ld(p.add(16 + 32 * c));
            let (xc, yc) = pair(v, _mm256_srli_epi16(v, 4));
            x[c] = _mm256_and_si256(xc, m4);
            y[c] = _mm256_and_si256(yc, m4);
        }
        k4_pair(p, x, y)
    }
}

impl KKind for Q5K {
    const BB: usize = 176;
    const K6: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_nat(p: *const u8) -> KNat {
        k4_nat(p, q5k_units(p))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_pair(p: *const u8) -> WK {
        let (x, y) = pairs(&q5k_units(p));
        k4_pair(p, x, y)
    }
}

impl KKind for Q6K {
    const BB: usize = 210;
    const K6: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_nat(p: *const u8) -> KNat {
        let scales = _mm_loadu_si128(p.add(192) as *const __m128i);
        KNat {
            q: q6k_units(p),
            scv: _mm256_broadcastsi128_si256(scales),
            bs: _mm256_slli_epi16(_mm256_cvtepi8_epi16(scales), 5),
            d: f16_1(p.add(208)),
            dmin: 0.0,
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_pair(p: *const u8) -> WK {
        let (x, y) = pairs(&q6k_units(p));
        // Sixteen i8 scales, one per 16 elements. Span s: X's lanes hold elements 64s..64s+16
        // (scale 4s) and 64s+48..64s+64 (4s+3), Y's 64s+16..64s+32 (4s+1) and 64s+32..64s+48
        // (4s+2). Each scale byte goes to the high byte of its lanes, then an arithmetic shift
        // sign-extends it.
        let scales = _mm_loadu_si128(p.add(192) as *const __m128i);
        let sc2 = _mm256_broadcastsi128_si256(scales);
        let spread = |lo: usize, hi: usize| {
            let (lo, hi, z) = (lo as i8, hi as i8, -128i8);
            let shuf = _mm256_setr_epi8(
                z, lo, z, lo, z, lo, z, lo, z, lo, z, lo, z, lo, z, lo, z, hi, z, hi, z, hi, z, hi,
                z, hi, z, hi, z, hi, z, hi,
            );
            _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(sc2, shuf))
        };
        let mut w = WK {
            x,
            y,
            sx: [_mm256_setzero_si256(); 4],
            sy: [_mm256_setzero_si256(); 4],
            bs: _mm256_slli_epi16(_mm256_cvtepi8_epi16(scales), 5),
            d: f16_1(p.add(208)),
            dmin: 0.0,
        };
        for s in 0..4 {
            w.sx[s] = spread(4 * s, 4 * s + 3);
            w.sy[s] = spread(4 * s + 1, 4 * s + 2);
        }
        w
    }
}

/// The span count of a tile's loop: for full tiles a value the compiler does not unroll the loop
/// over (unrolled, it interleaves the spans' registers and spills them), for small ones a
/// constant.
#[inline(always)]
fn spans<const RO: usize, const RT: usize>() -> usize {
    if RO * RT >= 4 {
        std::hint::black_box(4)
    } else {
        4
    }
}

/// The K-quant tile: exact i32 sums of `RO` output rows × `RT` activation rows (pair records at
/// `a + t * stride`), then [`k_epilogue`] into `acc[o * nt + t]` (for the full 2 × 4 tile, its
/// eight lanes at once).
// The tile's registers are indexed [output row][activation row] throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_k<K: KKind, const RO: usize, const RT: usize>(
    w: [&WK; RO],
    a: *const u8,
    stride: usize,
    acc: *mut f32,
    nt: usize,
) {
    let mut s = [[_mm256_setzero_si256(); RT]; RO];
    for p in 0..spans::<RO, RT>() {
        for o in 0..RO {
            let (wx, wy, sx) = (w[o].x[p], w[o].y[p], w[o].sx[p]);
            for t in 0..RT {
                let ap = a.add(t * stride + 64 * p);
                let px = _mm256_maddubs_epi16(wx, ld(ap));
                let py = _mm256_maddubs_epi16(wy, ld(ap.add(32)));
                let v = if K::K6 {
                    _mm256_add_epi32(_mm256_madd_epi16(px, sx), _mm256_madd_epi16(py, w[o].sy[p]))
                } else {
                    _mm256_madd_epi16(_mm256_add_epi16(px, py), sx)
                };
                s[o][t] = _mm256_add_epi32(s[o][t], v);
            }
        }
    }
    let mut m = [[_mm256_setzero_si256(); RT]; RO];
    for t in 0..RT {
        let bsums = ld(a.add(t * stride + P_BS));
        for o in 0..RO {
            m[o][t] = _mm256_madd_epi16(w[o].bs, bsums);
        }
    }
    let dx_at = |t: usize| *(a.add(t * stride + P_DP) as *const f32);
    if RO == 2 && RT == 4 {
        let flat =
            |v: &[[__m256i; RT]; RO]| -> [__m256i; 8] { std::array::from_fn(|i| v[i / 4][i % 4]) };
        // Lane 4o + t: output row o, activation row t (the scalar step's exact operations).
        let si = hsum8_i32(&flat(&s));
        let mi = hsum8_i32(&flat(&m));
        let dx4 = _mm_setr_ps(dx_at(0), dx_at(1), dx_at(2), dx_at(3));
        let dx = _mm256_set_m128(dx4, dx4);
        let d = _mm256_set_m128(_mm_set1_ps(w[RO - 1].d), _mm_set1_ps(w[0].d));
        let v = if K::K6 {
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(si, mi)), d)
        } else {
            let ndmin = _mm256_set_m128(_mm_set1_ps(-w[RO - 1].dmin), _mm_set1_ps(-w[0].dmin));
            _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(mi),
                ndmin,
                _mm256_mul_ps(_mm256_cvtepi32_ps(si), d),
            )
        };
        let accv = _mm256_loadu2_m128(acc.add(nt), acc);
        _mm256_storeu2_m128(acc.add(nt), acc, _mm256_fmadd_ps(v, dx, accv));
        return;
    }
    for t in 0..RT {
        let dx = dx_at(t);
        for o in 0..RO {
            let ap = acc.add(o * nt + t);
            *ap = k_epilogue(
                K::K6,
                hsum_i32(s[o][t]),
                hsum_i32(m[o][t]),
                w[o].d,
                w[o].dmin,
                dx,
                *ap,
            );
        }
    }
}

/// One group of `RO` output rows against activation rows `0..nt`: four at a time, then the rest.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_rows_k<K: KKind, const RO: usize>(
    ws: [&WK; RO],
    a: *const u8,
    stride: usize,
    acc: *mut f32,
    nt: usize,
) {
    let mut t = 0;
    while t + 4 <= nt {
        tile_k::<K, RO, 4>(ws, a.add(t * stride), stride, acc.add(t), nt);
        t += 4;
    }
    let (a, acc) = (a.add(t * stride), acc.add(t));
    match nt - t {
        3 => tile_k::<K, RO, 3>(ws, a, stride, acc, nt),
        2 => tile_k::<K, RO, 2>(ws, a, stride, acc, nt),
        1 => tile_k::<K, RO, 1>(ws, a, stride, acc, nt),
        _ => {}
    }
}

/// Asks for the weight group `g + PREFETCH_GROUPS` of the row starting at `row` (the weights
/// stream from DRAM once).
#[inline(always)]
unsafe fn prefetch_ahead(row: *const u8, g: usize, gbytes: usize) {
    let pf = row.wrapping_add((g + PREFETCH_GROUPS) * gbytes);
    let mut off = 0;
    while off < gbytes {
        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(off) as *const i8);
        off += 64;
    }
}

/// K-quant rows `[r0, r1)` against `n_tok >= PAIR_MIN_ROWS` pair records: row tiles (≤ `ACC_CAP`
/// accumulators) × k-blocks (activations of all rows in L1) × pairs of output rows × groups (each
/// unpacked once) × tiles of four activation rows.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_k_pair<K: KKind>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let n_groups = w.n_in / GROUP;
    let mut acc = [0f32; 2 * ACC_CAP];
    let mut t0 = 0;
    while t0 < n_tok {
        let nt = (n_tok - t0).min(ACC_CAP);
        let rs = (2 * ACC_CAP / nt) & !1;
        let kb = (KB_BYTES / (nt * PREC)).max(1);
        let ab = act.add(t0 * stride);
        let mut o0 = r0;
        while o0 < r1 {
            let o1 = (o0 + rs).min(r1);
            acc[..(o1 - o0) * nt].fill(0.0);
            let mut g0 = 0;
            while g0 < n_groups {
                let g1 = (g0 + kb).min(n_groups);
                let mut o = o0;
                while o < o1 {
                    let ro = (o1 - o).min(2);
                    let accs = acc.as_mut_ptr().add((o - o0) * nt);
                    let row = w.data.as_ptr().add(o * rb);
                    for g in g0..g1 {
                        prefetch_ahead(row, g, K::BB);
                        let ag = ab.add(g * PREC);
                        let w0 = K::unpack_pair(row.add(g * K::BB));
                        if ro == 2 {
                            prefetch_ahead(row.add(rb), g, K::BB);
                            let w1 = K::unpack_pair(row.add(rb + g * K::BB));
                            group_rows_k::<K, 2>([&w0, &w1], ag, stride, accs, nt);
                        } else {
                            group_rows_k::<K, 1>([&w0], ag, stride, accs, nt);
                        }
                    }
                    o += ro;
                }
                g0 = g1;
            }
            for o in o0..o1 {
                for t in 0..nt {
                    y.write(t0 + t, o, acc[(o - o0) * nt + t]);
                }
            }
            o0 = o1;
        }
        t0 += nt;
    }
}

/// K-quant rows `[r0, r1)` against `n_tok < PAIR_MIN_ROWS` natural records: each group unpacked
/// once, in natural order, and dotted with every activation row (single-token decoding).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_k_nat<K: KKind>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    debug_assert!(n_tok < PAIR_MIN_ROWS);
    let rb = w.row_bytes();
    let n_groups = w.n_in / GROUP;
    for o in r0..r1 {
        let row = w.data.as_ptr().add(o * rb);
        let mut acc = [0f32; PAIR_MIN_ROWS];
        for g in 0..n_groups {
            prefetch_ahead(row, g, K::BB);
            let wg = K::unpack_nat(row.add(g * K::BB));
            for (t, a) in acc.iter_mut().enumerate().take(n_tok) {
                let at = act.add(t * stride + g * REC);
                let (s, m) = k_dot_nat::<K>(&wg, at);
                let dx = *(at.add(OFF_D) as *const f32);
                *a = k_epilogue(K::K6, s, m, wg.d, wg.dmin, dx, *a);
            }
        }
        for (t, &a) in acc.iter().enumerate().take(n_tok) {
            y.write(t, o, a);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------

/// Quantized rows `[r0, r1)` against activation records: pair records where
/// `pair_layout(w.ty, n_tok)`, natural ones otherwise.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `act` holds `n_tok * stride` bytes of records for
/// `w.ty` in that layout; `w` validated; `r1 <= w.n_out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quant_rows(
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
    let pair = pair_layout(w.ty, n_tok);
    match w.ty {
        GgmlType::Q4_0 => rows_legacy::<Q40>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_1 => rows_legacy::<Q41>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_0 => rows_legacy::<Q50>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_1 => rows_legacy::<Q51>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q8_0 => rows_legacy::<Q80>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_K if pair => rows_k_pair::<Q4K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_K if pair => rows_k_pair::<Q5K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K if pair => rows_k_pair::<Q6K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_K => rows_k_nat::<Q4K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_K => rows_k_nat::<Q5K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K => rows_k_nat::<Q6K>(w, a, stride, n_tok, r0, r1, y),
        _ => {}
    }
}

// ---------------------------------------------------------------------------------------------
// Float weights
// ---------------------------------------------------------------------------------------------

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8(ty: GgmlType, p: *const u8, i: usize) -> __m256 {
    match ty {
        GgmlType::F32 => _mm256_loadu_ps(p.add(4 * i) as *const f32),
        GgmlType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * i) as *const __m128i)),
        _ => _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * i) as *const __m128i)),
            16,
        )),
    }
}

#[inline(always)]
unsafe fn load1(ty: GgmlType, p: *const u8, i: usize) -> f32 {
    match ty {
        GgmlType::F32 => std::ptr::read_unaligned(p.add(4 * i) as *const f32),
        GgmlType::F16 => half::f16::from_bits(rd_u16(p.add(2 * i))).to_f32(),
        _ => half::bf16::from_bits(rd_u16(p.add(2 * i))).to_f32(),
    }
}

/// Float-weight rows `[r0, r1)` against f32 activations.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `w` validated, `x.len() == n_tok * n_in`, `r1 <= n_out`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn float_rows(
    w: &QMatrix,
    x: &[f32],
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let n_in = w.n_in;
    let bpe = w.ty.block_bytes();
    for o in r0..r1 {
        let wrow = w.data.as_ptr().add(o * n_in * bpe);
        let mut t0 = 0;
        while t0 < n_tok {
            let nt = (n_tok - t0).min(4);
            let xp = x.as_ptr().add(t0 * n_in);
            let mut a = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 8 <= n_in {
                let wv = load8(w.ty, wrow, i);
                for (j, aj) in a.iter_mut().enumerate().take(nt) {
                    *aj = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(j * n_in + i)), *aj);
                }
                i += 8;
            }
            for (j, aj) in a.iter().enumerate().take(nt) {
                let mut s = hsum(*aj);
                for k in i..n_in {
                    s += load1(w.ty, wrow, k) * *xp.add(j * n_in + k);
                }
                y.write(t0 + j, o, s);
            }
            t0 += nt;
        }
    }
}
