//! AVX2 kernels (ggml's `maddubs`/`madd` scheme): legacy types on natural records; K-quants as exact integer sums per group with one shared float step, on column-interleaved register tiles (8 output rows per register, in the manner of llama.cpp's repacked `q4_K_8x8` GEMM, built per group on the fly).
//!
//! **Legacy types.** Q4_1 and Q8_0 (smollm2's weights) run on column tiles for every row count
//! ([`lcols`]: eight output rows per register, exact i32 per 32-element block, one f32 step per
//! block in block order). Q4_0, Q5_0 and Q5_1 use the sign trick for signed weights and scale each
//! 32-block in f32; loop structure as the AVX-512 kernels (each weight group unpacked once for all
//! activation rows).
//!
//! **K-quants** (Q4_K, Q5_K, Q6_K). Every kernel computes, per (output row, activation row,
//! group), the exact integers `s = Σ q·sc·x` and `m` (mins against the Q8_K block sums, or Q6_K's
//! −32 offset), then [`k_epilogue`]'s operations turn them into the f32 accumulator: the bits of a
//! row never depend on how its integers were computed, so batches and single rows agree bit for
//! bit. Activations are natural Q8_K records (see [`act`]) for every row count.
//!
//! * Fewer than [`COLS_MIN_ROWS`] activation rows (decoding): weights unpacked in natural order,
//!   one `maddubs` + `madd` (sub-block scales) per 32 elements and a horizontal sum per group
//!   (`rows_k_nat`).
//! * 2 to [`NATURAL_ROWS`] rows (small batches, token trees): [`knat8`], natural order as well,
//!   each group of eight output rows unpacked row by row, the exact sums of every (row,
//!   activation row) kept as eight lanes and reduced for the eight rows together, then the
//!   column tiles' float step on those lanes.
//! * More rows: **column tiles** (`KTiles`, run by the shared driver `column_rows`). Each
//!   256-element group of 8 output rows is
//!   transposed once into 64 registers whose 32-bit lane `c` holds four consecutive values of row
//!   `c` (the value registers are transposed before unpacking: every unpack step works byte by
//!   byte, so it commutes with the transpose), with its scales spread by `pshufb` into matching
//!   i16 lanes. A tile of 2 such blocks × 4 activation rows then broadcasts four activations,
//!   `maddubs` them against a register (32 products for 8 rows) and adds the results in i16 for as
//!   long as they cannot overflow (Q4_K: a whole 32-element sub-block, 8·2·15·128 < 2^15; Q5_K
//!   half; Q6_K a quarter) before one `madd` applies the sub-block scales: about 2 integer
//!   operations per 32 products, against 2.5 plus a horizontal reduction per (row, group) for
//!   natural-order tiles, and every lane of the sums already belongs to one output row, so the
//!   float step runs on 8 rows at once without a horizontal sum.
//!
//! Column-packed weights (`quant::packed`, the default at load): [`kpacked8`] reads each packed
//! 16-row group as two of these 8-row column blocks, loaded instead of transposed.
//!
//! The AVX-512 family computes the same integers and float steps at 512 bits ([`kcols512`] and
//! [`lcols512`]: column tiles of 16 output rows per register with `vpdpbusd`; `knat512`: K-quant
//! calls of a few rows), so the two families agree bit for bit on K-quants, Q4_1 and Q8_0; so does
//! the AVX-VNNI family ([`kvnni`] and `lcols`' VNNI tile: these tiles with VEX `vpdpbusd`).

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::act::{self, ActKind, GROUP, OFF_BS, OFF_BS32, OFF_D, OFF_S, REC};
use super::x86_avx512::k4_sc_m8;
use super::{GgmlType, QMatrix, YPtr};

pub(crate) mod kcols512;
mod knat512;
mod knat8;
mod kpacked8;
pub(crate) mod kvnni;
mod lcols;
pub(crate) mod lcols512;

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

/// `act::quantize_group` with AVX2: the same records bit for bit. Q8_K runs the portable code;
/// Q8_0/Q8_1 blocks run [`q8_block`] (the compiled scalar code had left their
/// max and rounding loops mostly scalar: ~6% of a smollm2-135m step, on one thread).
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_group(kind: ActKind, x: &[f32], rec: &mut [u8]) {
    if kind == ActKind::Q8K {
        return act::quantize_group(kind, x, rec);
    }
    let rec = &mut rec[..REC];
    rec.fill(0);
    for (b, xb) in x.chunks_exact(32).take(GROUP / 32).enumerate() {
        // SAFETY: `xb` holds 32 values and `rec` 32 bytes at `32 b` (b < 8).
        let (d, sum) = q8_block(xb.as_ptr(), rec.as_mut_ptr().add(32 * b));
        let put = |rec: &mut [u8], off: usize, v: [u8; 4]| rec[off..off + 4].copy_from_slice(&v);
        put(
            rec,
            OFF_D + 4 * b,
            super::formats::f16_round(d).to_le_bytes(),
        );
        put(rec, act::OFF_QSUM + 4 * b, sum.to_le_bytes());
        if kind == ActKind::Q8_1 {
            put(
                rec,
                OFF_S + 4 * b,
                super::formats::f16_round(d * sum as f32).to_le_bytes(),
            );
        }
    }
}

/// `act::quantize_q8_block` on 32 values at `x` into 32 bytes at `q`, 8 lanes at a time (ggml's
/// AVX2 `quantize_row_q8_0`): the same max (NaN ignored as in the scalar code), the same
/// products and magic-number rounding (a multiply then an add, never fused), the same
/// saturation.
///
/// # Safety
/// AVX2/FMA/F16C; `x` readable for 32 f32, `q` writable for 32 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_block(x: *const f32, q: *mut u8) -> (f32, i32) {
    let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(x.add(i)));
    let sign = _mm256_set1_ps(-0.0);
    // max(a, m) keeps m where a is NaN, as the scalar `if a > m { a } else { m }`.
    let mut m = _mm256_setzero_ps();
    for vi in v {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    let amax = lanes.iter().fold(0.0f32, |a, &b| if b > a { b } else { a });
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
    let magic = _mm256_set1_ps(12582912.0);
    let (mask, bias) = (
        _mm256_set1_epi32(0x007f_ffff),
        _mm256_set1_epi32(0x0040_0000),
    );
    let (lo, hi) = (_mm256_set1_epi32(-128), _mm256_set1_epi32(127));
    let r = v.map(|vi| {
        let t = _mm256_add_ps(_mm256_mul_ps(vi, id), magic);
        let r = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(t), mask), bias);
        _mm256_min_epi32(_mm256_max_epi32(r, lo), hi)
    });
    let s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
    let mut sums = [0i32; 8];
    _mm256_storeu_si256(sums.as_mut_ptr() as *mut __m256i, s);
    // i32 -> i8 (already in range), then the lane order packing interleaved put back.
    let p = _mm256_packs_epi16(
        _mm256_packs_epi32(r[0], r[1]),
        _mm256_packs_epi32(r[2], r[3]),
    );
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q as *mut __m256i, p);
    (d, sums.iter().sum())
}

#[inline(always)]
unsafe fn ld(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
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
struct Q50;
struct Q51;

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

/// Fewest activation rows for which K-quant matmuls run on the column tiles (`KTiles`, and
/// the AVX-512 family's `kcols512`); a single row (decoding: weights streamed from DRAM once)
/// uses `rows_k_nat`, which measured faster in the model there. Two and three rows measured
/// faster on the tiles (Q4_K 1536 × 8960, AVX2: 0.36-0.45 against 0.75-0.78 ms at 2 rows,
/// 0.43-0.53 against 0.86-0.88 ms at 3; docs/benchmarks.md).
pub(crate) const COLS_MIN_ROWS: usize = 2;

/// Most activation rows for which K-quant matmuls (from `COLS_MIN_ROWS` on) run `knat8` (natural
/// order, the sums of eight weight rows reduced together) instead of the column tiles: on Zen 4
/// with the AVX2 family forced, a qwen2.5-coder-1.5b forward over 2 rows took 58-63 against 95-104
/// ms on the tiles, 4 rows 88 against 120-145, 8 rows 155-157 against 173-195 (docs/benchmarks.md,
/// 2026-12-03 evening).
const NATURAL_ROWS: usize = 8;

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

/// A K-quant group in natural order for `rows_k_nat`: `q[k]` = elements `32k..32k+32`.
struct KNat {
    q: [__m256i; 8],
    /// The scale bytes, broadcast (Q4_K/Q5_K: 8 scales in every 64 bits; Q6_K: 16 in every
    /// 128), for `k_dot_nat`'s shuffles.
    scv: __m256i,
    /// i16 factors of the 16 Q8_K block sums: mins (Q4_K/Q5_K) or 32·scale (Q6_K's offset).
    bs: __m256i,
    d: f32,
    dmin: f32,
}

/// A K-quant type: its block, the natural-order unpack (`rows_k_nat`) and what the column
/// tiles need (`KTiles`).
trait KKind {
    const BB: usize;
    const K6: bool;
    unsafe fn unpack_nat(p: *const u8) -> KNat;
    /// Elements of one scale run, in 4-element chunks (Q4_K/Q5_K: 8, Q6_K: 4).
    const SCN: usize;
    /// Chunks whose `maddubs` results add up exactly in i16 before one `madd` (Q4_K: 8 since
    /// 8·2·15·128 < 2^15; Q5_K: 4; Q6_K: 2).
    const ACC: usize;
    /// Offsets of the block's 32-byte value registers. Every unpack step works byte by byte
    /// (the same byte position of each register in, one byte out), so it commutes with the
    /// 32-bit transpose: [`build_cols`] transposes these registers of eight rows, then unpacks.
    const RAW: &'static [usize];
    /// Natural-order units (`units[j]` = elements `32j .. 32j + 32`) from the `RAW` registers.
    unsafe fn units_of(r: &Raw) -> [__m256i; 8];
    /// `sc`, `bs`, `d` and `ndmin` of the groups at `p[c]`.
    unsafe fn col_scales(p: &[*const u8; CB_ROWS], out: &mut KCols);
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

/// Up to six 32-byte registers of a K-quant block's values (see [`KKind::RAW`]).
type Raw = [__m256i; 6];

/// The registers of the block at `p` at the offsets `off` (unused entries zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_raw(p: *const u8, off: &[usize]) -> Raw {
    let mut r = [_mm256_setzero_si256(); 6];
    for (v, &o) in r.iter_mut().zip(off) {
        *v = ld(p.add(o));
    }
    r
}

/// Q4_K units from the qs registers: register c holds sub-blocks 2c (low nibbles) and 2c + 1
/// (high nibbles).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_units_of(r: &Raw) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut n = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        n[2 * c] = _mm256_and_si256(r[c], m4);
        n[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(r[c], 4), m4);
    }
    n
}

/// Q5_K units from `[qh, qs0, qs1, qs2, qs3]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5k_units_of(r: &Raw) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let qh = r[0];
    let c16 = _mm256_set1_epi8(16);
    let mut n = [_mm256_setzero_si256(); 8];
    for c in 0..4 {
        let v = r[1 + c];
        let b0 = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
        let b1 = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
        let h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), c16);
        let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), c16);
        n[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), h0);
        n[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1);
    }
    n
}

/// Q6_K units (values 0..64; the −32 offset enters through `bs`) from `[ql0, ql1, qh0, ql2,
/// ql3, qh1]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_units_of(r: &Raw) -> [__m256i; 8] {
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let mut n = [_mm256_setzero_si256(); 8];
    for h in 0..2 {
        let (l0, l1, qh) = (r[3 * h], r[3 * h + 1], r[3 * h + 2]);
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

const Q4K_RAW: [usize; 4] = [16, 48, 80, 112];
const Q5K_RAW: [usize; 5] = [16, 48, 80, 112, 144];
const Q6K_RAW: [usize; 6] = [0, 32, 128, 64, 96, 160];

struct Q4K;
struct Q5K;
struct Q6K;

impl KKind for Q4K {
    const BB: usize = 144;
    const K6: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_nat(p: *const u8) -> KNat {
        k4_nat(p, Self::units_of(&load_raw(p, Self::RAW)))
    }
    const RAW: &'static [usize] = &Q4K_RAW;
    const SCN: usize = 8;
    const ACC: usize = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn units_of(r: &Raw) -> [__m256i; 8] {
        q4k_units_of(r)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn col_scales(p: &[*const u8; CB_ROWS], out: &mut KCols) {
        k4_col_scales(p, out)
    }
}

impl KKind for Q5K {
    const BB: usize = 176;
    const K6: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack_nat(p: *const u8) -> KNat {
        k4_nat(p, Self::units_of(&load_raw(p, Self::RAW)))
    }
    const RAW: &'static [usize] = &Q5K_RAW;
    const SCN: usize = 8;
    const ACC: usize = 4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn units_of(r: &Raw) -> [__m256i; 8] {
        q5k_units_of(r)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn col_scales(p: &[*const u8; CB_ROWS], out: &mut KCols) {
        k4_col_scales(p, out)
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
            q: Self::units_of(&load_raw(p, Self::RAW)),
            scv: _mm256_broadcastsi128_si256(scales),
            bs: _mm256_slli_epi16(_mm256_cvtepi8_epi16(scales), 5),
            d: f16_1(p.add(208)),
            dmin: 0.0,
        }
    }
    const RAW: &'static [usize] = &Q6K_RAW;
    const SCN: usize = 4;
    const ACC: usize = 2;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn units_of(r: &Raw) -> [__m256i; 8] {
        q6k_units_of(r)
    }
    /// Sixteen signed scales per block: byte `h` of row `c` to the high bytes of dword `c`, then
    /// an arithmetic shift (and for the offsets a multiply by 32).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn col_scales(p: &[*const u8; CB_ROWS], out: &mut KCols) {
        let x: [__m128i; CB_ROWS] =
            std::array::from_fn(|c| _mm_loadu_si128(p[c].add(192) as *const __m128i));
        // Lane pairs [row k | row k + 4].
        let y: [__m256i; 4] = std::array::from_fn(|k| _mm256_set_m128i(x[k + 4], x[k]));
        let gather = |e: usize| {
            let mut v = _mm256_setzero_si256();
            for (k, yk) in y.iter().enumerate() {
                let ctl = ld(SHUF_K6_COLS[k][e].as_ptr() as *const u8);
                v = _mm256_or_si256(v, _mm256_shuffle_epi8(*yk, ctl));
            }
            _mm256_srai_epi16::<8>(v)
        };
        for h in 0..16 {
            out.sc[h] = gather(h);
        }
        for q in 0..8 {
            out.bs[q] = _mm256_slli_epi16::<5>(gather(16 + q));
        }
        out.d = f16_cols(p, 208);
        out.ndmin = _mm256_setzero_ps();
    }
}

/// Asks for the weight group `g + PREFETCH_GROUPS` of the row starting at `row` (the weights
/// stream from DRAM once).
#[inline(always)]
unsafe fn prefetch_ahead(row: *const u8, g: usize, gbytes: usize) {
    prefetch_block(row.wrapping_add((g + PREFETCH_GROUPS) * gbytes), gbytes);
}

/// Asks for the `bytes` at `p`: every 64-byte line they touch (a block that does not start on a
/// line, such as Q6_K's 210 bytes, can touch one line more than `bytes / 64` rounded up).
#[inline(always)]
unsafe fn prefetch_block(p: *const u8, bytes: usize) {
    prefetch_lines::<_MM_HINT_T0>(p, bytes)
}

/// As [`prefetch_block`], into L2 only (`prefetcht1`): a weight stream read once, whose lines
/// need not wait in L1.
#[inline(always)]
unsafe fn prefetch_block_l2(p: *const u8, bytes: usize) {
    prefetch_lines::<_MM_HINT_T1>(p, bytes)
}

/// Every 64-byte line of the `bytes` at `p`, prefetched with `HINT`.
#[inline(always)]
unsafe fn prefetch_lines<const HINT: i32>(p: *const u8, bytes: usize) {
    let misalign = (p as usize) & 63;
    let line0 = p.wrapping_sub(misalign);
    let mut off = 0;
    while off < misalign + bytes {
        _mm_prefetch::<HINT>(line0.wrapping_add(off) as *const i8);
        off += 64;
    }
}

/// K-quant rows `[r0, r1)` against `n_tok < COLS_MIN_ROWS` natural records: each group unpacked
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
    debug_assert!(n_tok < COLS_MIN_ROWS);
    let rb = w.row_bytes();
    let n_groups = w.n_in / GROUP;
    for o in r0..r1 {
        let row = w.data.as_ptr().add(o * rb);
        let mut acc = [0f32; COLS_MIN_ROWS];
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
// K-quants on column tiles: 8 output rows interleaved per register, no horizontal sums
// ---------------------------------------------------------------------------------------------

/// Output rows of one column block (one i32 lane each).
const CB_ROWS: usize = 8;
/// Column blocks of a tile (output rows `CB * CB_ROWS` per pass over the activations).
const CB: usize = 2;
/// Activation rows of a column tile.
const CT: usize = 4;

/// A K-quant group of eight output rows, column-interleaved: register `q[j][i]` holds in its
/// 32-bit lane `c` the four values of elements `32j + 4i .. 32j + 4i + 4` of output row `c`, so
/// one `maddubs` against those four activations broadcast dots eight rows at once and every i32
/// lane of the sums belongs to one output row (no horizontal reduction).
#[repr(C, align(32))]
struct KCols {
    q: [[__m256i; 8]; 8],
    /// i16 scales of the `maddubs` lanes `(2c, 2c + 1)` of output row `c`, one register per
    /// scale run: Q4_K/Q5_K per 32 elements (8 used), Q6_K per 16 (16).
    sc: [__m256i; 16],
    /// i16 pairs against dword `q` of the activations' block sums: Q4_K/Q5_K the mins `(m_2q(c),
    /// m_2q+1(c))` against the 32-element sums (4 used), Q6_K its offset `(32·sc_2q(c),
    /// 32·sc_2q+1(c))` against the 16-element sums (8).
    bs: [__m256i; 8],
    d: __m256,
    /// −dmin (Q4_K/Q5_K).
    ndmin: __m256,
}

/// `pshufb` controls spreading bytes of every 32-bit lane into its two 16-bit halves,
/// zero-extended: `[e]` for `e < 4` puts byte `e` in both (a scale), `[4 + h]` bytes `2h` and
/// `2h + 1` (a pair of mins).
const fn shuf_k4_cols() -> [[i8; 32]; 6] {
    let mut t = [[-128i8; 32]; 6];
    let mut e = 0;
    while e < 6 {
        let (b0, b1) = if e < 4 {
            (e, e)
        } else {
            (2 * (e - 4), 2 * (e - 4) + 1)
        };
        let mut d = 0;
        while d < 8 {
            // Dword d of the register is dword d % 4 of its 128-bit lane.
            t[e][4 * d] = (4 * (d % 4) + b0) as i8;
            t[e][4 * d + 2] = (4 * (d % 4) + b1) as i8;
            d += 1;
        }
        e += 1;
    }
    t
}

/// `pshufb` controls putting bytes `b0`, `b1` of a lane into the high bytes of the 16-bit
/// halves of dword `k` (zero elsewhere), for Q6_K's signed scales: `[k][h]` with `b0 = b1 = h`
/// (scale registers) and `[k][16 + q]` with `b0 = 2q, b1 = 2q + 1` (offset registers).
const fn shuf_k6_cols() -> [[[i8; 32]; 24]; 4] {
    let mut t = [[[-128i8; 32]; 24]; 4];
    let mut k = 0;
    while k < 4 {
        let mut e = 0;
        while e < 24 {
            let (b0, b1) = if e < 16 {
                (e, e)
            } else {
                (2 * (e - 16), 2 * (e - 16) + 1)
            };
            let mut lane = 0;
            while lane < 2 {
                let at = 16 * lane + 4 * k;
                t[k][e][at + 1] = b0 as i8;
                t[k][e][at + 3] = b1 as i8;
                lane += 1;
            }
            e += 1;
        }
        k += 1;
    }
    t
}

static SHUF_K4_COLS: [[i8; 32]; 6] = shuf_k4_cols();
static SHUF_K6_COLS: [[[i8; 32]; 24]; 4] = shuf_k6_cols();

/// The f32 of eight f16 at `p[c] + off`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_cols(p: &[*const u8; CB_ROWS], off: usize) -> __m256 {
    // Inserted into a register one by one (eight 16-bit stores read back as one 128-bit load
    // would miss store forwarding).
    let h = |c: usize| rd_u16(p[c].add(off)) as i16;
    _mm256_cvtph_ps(_mm_setr_epi16(
        h(0),
        h(1),
        h(2),
        h(3),
        h(4),
        h(5),
        h(6),
        h(7),
    ))
}

/// The f32 of the low 16 bits (an f16) of each 32-bit lane, in lane order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_lanes(v: __m256i) -> __m256 {
    let lo = _mm256_and_si256(v, _mm256_set1_epi32(0xffff));
    let w = _mm256_packus_epi32(lo, lo); // [r0..r3 r0..r3 | r4..r7 r4..r7]
    _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(
        w,
    )))
}

/// The dwords at `p[c]` of eight rows, in lane order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dwords8(p: &[*const u8]) -> __m256i {
    let v = |c: usize| rd_u32(p[c]) as i32;
    _mm256_setr_epi32(v(0), v(1), v(2), v(3), v(4), v(5), v(6), v(7))
}

/// `[x0[j], …, x7[j]]` from eight registers of eight 32-bit lanes (an 8 × 8 transpose).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose8_epi32(r: [__m256i; 8]) -> [__m256i; 8] {
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
    let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
    let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    let u0 = _mm256_unpacklo_epi64(t0, t2);
    let u1 = _mm256_unpackhi_epi64(t0, t2);
    let u2 = _mm256_unpacklo_epi64(t1, t3);
    let u3 = _mm256_unpackhi_epi64(t1, t3);
    let u4 = _mm256_unpacklo_epi64(t4, t6);
    let u5 = _mm256_unpackhi_epi64(t4, t6);
    let u6 = _mm256_unpacklo_epi64(t5, t7);
    let u7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256::<0x20>(u0, u4),
        _mm256_permute2x128_si256::<0x20>(u1, u5),
        _mm256_permute2x128_si256::<0x20>(u2, u6),
        _mm256_permute2x128_si256::<0x20>(u3, u7),
        _mm256_permute2x128_si256::<0x31>(u0, u4),
        _mm256_permute2x128_si256::<0x31>(u1, u5),
        _mm256_permute2x128_si256::<0x31>(u2, u6),
        _mm256_permute2x128_si256::<0x31>(u3, u7),
    ]
}

/// Q4_K/Q5_K column scales: the first 16 bytes of the eight blocks (d, dmin, 12 scale bytes)
/// transposed, so lane `c` of every register is row `c`; the six-bit scales and mins unpacked as
/// `k4_sc_m8` does, eight rows at once, then spread by `pshufb` within each lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_col_scales(p: &[*const u8; CB_ROWS], out: &mut KCols) {
    // t[k] lane c: dword k of row c's block (k < 4; the upper registers are unused).
    let t = transpose8_epi32(std::array::from_fn(|c| {
        _mm256_castsi128_si256(_mm_loadu_si128(p[c] as *const __m128i))
    }));
    k4_col_scales_t([t[0], t[1], t[2], t[3]], out)
}

/// [`k4_col_scales`] from the block heads' dwords in lanes: `t[k]` lane `c` = dword `k` of row
/// `c`'s block (transposed natural rows, or a packed group as it is).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_col_scales_t(t: [__m256i; 4], out: &mut KCols) {
    let (u0, u1, u2) = (t[1], t[2], t[3]);
    let k1 = _mm256_set1_epi32(0x3f3f_3f3f);
    let k2 = _mm256_set1_epi32(0x0f0f_0f0f);
    let k3 = _mm256_set1_epi32(0x0303_0303);
    let hi2 = |u: __m256i| _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u), k3));
    // Bytes 0..4 and 4..8 of every row's eight scales and eight mins.
    let sc = [
        _mm256_and_si256(u0, k1),
        _mm256_or_si256(_mm256_and_si256(u2, k2), hi2(u0)),
    ];
    let mn = [
        _mm256_and_si256(u1, k1),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32::<4>(u2), k2), hi2(u1)),
    ];
    let ctl = |e: usize| ld(SHUF_K4_COLS[e].as_ptr() as *const u8);
    for j in 0..8 {
        out.sc[j] = _mm256_shuffle_epi8(sc[j / 4], ctl(j % 4));
    }
    for q in 0..4 {
        out.bs[q] = _mm256_shuffle_epi8(mn[q / 2], ctl(4 + q % 2));
    }
    // d and dmin: the f16 halves of dword 0.
    out.d = f16_lanes(t[0]);
    out.ndmin = _mm256_xor_ps(
        f16_lanes(_mm256_srli_epi32::<16>(t[0])),
        _mm256_set1_ps(-0.0),
    );
}

/// Unpacks the groups at `p[c]` (one per output row) into column order.
// t[r][i] is indexed by value register and chunk.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn build_cols<K: KKind>(p: &[*const u8; CB_ROWS], out: &mut KCols) {
    // t[r][i]: lane c holds bytes 4i .. 4i + 4 of value register r of row c.
    let mut t = [[_mm256_setzero_si256(); 8]; 6];
    for (tr, &off) in t.iter_mut().zip(K::RAW) {
        *tr = transpose8_epi32(std::array::from_fn(|c| ld(p[c].add(off))));
    }
    for i in 0..8 {
        let u = K::units_of(&std::array::from_fn(|r| t[r][i]));
        for (j, uj) in u.iter().enumerate() {
            out.q[j][i] = *uj;
        }
    }
    K::col_scales(p, out);
}

/// The column tile: exact i32 sums of `CB × CB_ROWS` output rows × `RT` activation rows
/// (natural records at `a + t * stride`), then [`k_epilogue`]'s operations, eight rows at a
/// time, into `acc[t * CB * CB_ROWS + row]`.
// The tile's registers are indexed [column block][activation row] throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_cols<K: KKind, const RT: usize>(
    w: &[KCols; CB],
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    let mut s = [[_mm256_setzero_si256(); RT]; CB];
    // Rolled over the units: unrolled, LLVM interleaves their registers and spills them.
    for j in 0..std::hint::black_box(8) {
        let mut r = 0;
        while r < 8 {
            let mut h = [[_mm256_setzero_si256(); RT]; CB];
            for i in r..r + K::ACC {
                let wv: [__m256i; CB] = std::array::from_fn(|b| w[b].q[j][i]);
                for t in 0..RT {
                    let av = _mm256_set1_epi32(rd_u32(a.add(t * stride + 32 * j + 4 * i)) as i32);
                    for b in 0..CB {
                        h[b][t] = _mm256_add_epi16(h[b][t], _mm256_maddubs_epi16(wv[b], av));
                        chain(&mut h[b][t]);
                    }
                }
            }
            let run = (8 * j + r) / K::SCN;
            for b in 0..CB {
                let sc = w[b].sc[run];
                for t in 0..RT {
                    s[b][t] = _mm256_add_epi32(s[b][t], _mm256_madd_epi16(h[b][t], sc));
                }
            }
            r += K::ACC;
        }
    }
    tile_epilogue::<K, RT>(w, &s, a, stride, acc);
}

/// The float step of a K-quant column tile (`k_epilogue`'s operations, eight output rows at a
/// time): the group's exact sums `s` (`[column block][activation row]`) and the activations' block
/// sums against the mins (or Q6_K's offset), into `acc[t * CB * CB_ROWS + row]`. Shared by the
/// AVX2 and AVX-VNNI tiles, which differ only in how they reach `s`.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_epilogue<K: KKind, const RT: usize>(
    w: &[KCols; CB],
    s: &[[__m256i; RT]; CB],
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    for t in 0..RT {
        let at = a.add(t * stride);
        let dx = _mm256_set1_ps(*(at.add(OFF_D) as *const f32));
        let n_bs = if K::K6 { 8 } else { 4 };
        for b in 0..CB {
            let v = k8_value::<K>(&w[b].bs[..n_bs], w[b].d, w[b].ndmin, s[b][t], at);
            let ap = acc.add(t * CB * CB_ROWS + b * CB_ROWS);
            _mm256_storeu_ps(ap, _mm256_fmadd_ps(v, dx, _mm256_loadu_ps(ap)));
        }
    }
}

/// `k_epilogue`'s value of one group (before the activation scale) for eight output rows, one per
/// lane: exact sums `s`, the i16 pairs `bs` against the record's block sums at `at` (Q4_K/Q5_K:
/// the mins against the 32-element sums; Q6_K: its offset against the 16-element sums, or none
/// when `s` already has it subtracted), `d` and `−dmin`. Every 8-row K-quant kernel's float
/// step (`tile_epilogue`, `knat8`), so theirs are the same operations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k8_value<K: KKind>(
    bs: &[__m256i],
    d: __m256,
    ndmin: __m256,
    s: __m256i,
    at: *const u8,
) -> __m256 {
    let off = if K::K6 { OFF_BS } else { OFF_BS32 };
    let mut m = _mm256_setzero_si256();
    for (q, bs) in bs.iter().enumerate() {
        let b = _mm256_set1_epi32(rd_u32(at.add(off + 4 * q)) as i32);
        m = _mm256_add_epi32(m, _mm256_madd_epi16(*bs, b));
    }
    if K::K6 {
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s, m)), d)
    } else {
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(m),
            ndmin,
            _mm256_mul_ps(_mm256_cvtepi32_ps(s), d),
        )
    }
}

/// Keeps `v` in a register as it is: LLVM cannot reassociate a chain of adds through it (it would
/// turn the tile's eight running sums into trees that need more registers than AVX2 has, and
/// spill them).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain(v: &mut __m256i) {
    std::arch::asm!(
        "/* {0} */",
        inout(ymm_reg) * v,
        options(pure, nomem, nostack, preserves_flags)
    );
}

/// The AVX2 K-quant column tiles: `CB` blocks of eight output rows, `CT` activation rows.
struct KTiles<K>(PhantomData<K>);

impl<K: KKind> ColumnTiles for KTiles<K> {
    const W: usize = CB * CB_ROWS;
    const BLOCK_ROWS: usize = CB_ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = K::BB;
    type Cols = [KCols; CB];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn build(p: &[*const u8], b: usize, _nb: usize, cols: &mut [KCols; CB]) {
        build_cols::<K>(&std::array::from_fn(|c| p[c]), &mut cols[b]);
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile(cols: &[KCols; CB], _nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        tile_cols::<K, CT>(cols, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_tail(
        cols: &[KCols; CB],
        _nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        match rt {
            3 => tile_cols::<K, 3>(cols, a, stride, acc),
            2 => tile_cols::<K, 2>(cols, a, stride, acc),
            _ => tile_cols::<K, 1>(cols, a, stride, acc),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The column-tile driver (K-quants, Q4_1 and Q8_0, in both families)
// ---------------------------------------------------------------------------------------------

/// Output rows of the widest column block (`kcols512`, `lcols512`: 16).
const MAX_BLOCK_ROWS: usize = 16;
/// Activation rows whose f32 accumulators a column pass keeps (`T_CAP × W` floats).
const T_CAP: usize = 64;
/// Zero bytes standing in for output rows past the end of a pass (a whole group of every type,
/// Q8_0's 272 bytes included, and `kcols512`'s 64-byte loads).
static ZERO_GROUP: [u8; 512] = [0; 512];
/// Zero bytes standing in for a packed group past the end of a pass (16 rows of Q6_K, 3,360).
static ZERO_SLICE: [u8; 4096] = [0; 4096];

/// A column-tile kernel: each pass over `W` output rows unpacks every weight group of those rows
/// once (`build`) and dots it with the activation rows, up to `CT` at a time (`tile`).
trait ColumnTiles {
    /// Output rows of one pass.
    const W: usize;
    /// Output rows of one column block (at most [`MAX_BLOCK_ROWS`]; `W / BLOCK_ROWS` blocks per
    /// pass, unpacked one by one).
    const BLOCK_ROWS: usize;
    /// Activation rows of a full tile.
    const CT: usize;
    /// Weight bytes of one whole 256-element group of a row.
    const GROUP_BYTES: usize;
    /// The weights are column-packed (`quant::packed`): `build` gets the packed group of the
    /// block's rows in `p[0]` instead of one pointer per row.
    const PACKED: bool = false;
    /// A group of the pass's rows, unpacked.
    type Cols;
    /// Unpacks the first `nb` 32-element blocks of the groups at `p[c]` into column block `b`
    /// (`BLOCK_ROWS` output rows; rows past the end point at zeros).
    unsafe fn build(p: &[*const u8], b: usize, nb: usize, cols: &mut Self::Cols);
    /// Dots the first `nb` blocks of `cols` with `CT` natural records at `a + t * stride`, adding
    /// into `acc[t * W + row]`.
    unsafe fn tile(cols: &Self::Cols, nb: usize, a: *const u8, stride: usize, acc: *mut f32);
    /// As `tile` for the last `rt < CT` records.
    unsafe fn tile_tail(
        cols: &Self::Cols,
        nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    );
    /// Software prefetch while the group at `at` (group `g` of `n_groups`, `nb` blocks, rows of
    /// `rb` bytes) is unpacked: by default the same group of the next pass, whose rows are the
    /// next `W * rb` bytes (a whole pass ahead, whatever the row length).
    #[inline(always)]
    unsafe fn prefetch(at: *const u8, _g: usize, _n_groups: usize, rb: usize, nb: usize) {
        prefetch_block(at.wrapping_add(Self::W * rb), nb * Self::GROUP_BYTES / 8);
    }
}

/// Rows `[r0, r1)` of `w` against `n_tok` natural records on the column tiles `T`: per pass of
/// `T::W` output rows and up to `T_CAP` activation rows, each weight group unpacked once and
/// dotted with the activation rows `T::CT` at a time. Rows of `n_in % 256` elements (legacy types)
/// end in a group of fewer blocks; no block past a row's end is read. Inlined into each family's
/// `#[target_feature]` entry point ([`columns_avx2`], `kcols512::columns_avx512`).
#[inline(always)]
unsafe fn column_rows<T: ColumnTiles, const ACC: usize>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let n_blocks = w.n_in / 32;
    let n_groups = n_blocks.div_ceil(GROUP / 32);
    let mut cols: T::Cols = std::mem::zeroed();
    debug_assert!(ACC == T_CAP * T::W);
    let mut acc = [0f32; ACC]; // [activation row, output row of the pass]
    let mut p = [ZERO_GROUP.as_ptr(); MAX_BLOCK_ROWS];
    let mut t0 = 0;
    while t0 < n_tok {
        let nt = (n_tok - t0).min(T_CAP);
        let ab = act.add(t0 * stride);
        let mut o0 = r0;
        while o0 < r1 {
            let n_c = (r1 - o0).min(T::W);
            acc[..nt * T::W].fill(0.0);
            for g in 0..n_groups {
                let nb = (n_blocks - g * (GROUP / 32)).min(GROUP / 32);
                for b in 0..T::W / T::BLOCK_ROWS {
                    if T::PACKED {
                        // Slices of `BLOCK_ROWS` rows (whole: the caller's row range is), each
                        // its groups in order.
                        let o = b * T::BLOCK_ROWS;
                        p[0] = if o < n_c {
                            let at = w
                                .data
                                .as_ptr()
                                .add((o0 + o) * rb + g * T::BLOCK_ROWS * T::GROUP_BYTES);
                            T::prefetch(at, g, n_groups, rb, nb);
                            at
                        } else {
                            ZERO_SLICE.as_ptr()
                        };
                        T::build(&p[..1], b, nb, &mut cols);
                        continue;
                    }
                    for (i, pc) in p[..T::BLOCK_ROWS].iter_mut().enumerate() {
                        let c = b * T::BLOCK_ROWS + i;
                        *pc = if c < n_c {
                            let at = w.data.as_ptr().add((o0 + c) * rb + g * T::GROUP_BYTES);
                            T::prefetch(at, g, n_groups, rb, nb);
                            at
                        } else {
                            ZERO_GROUP.as_ptr()
                        };
                    }
                    T::build(&p[..T::BLOCK_ROWS], b, nb, &mut cols);
                }
                let ag = ab.add(g * REC);
                let accp = acc.as_mut_ptr();
                let mut t = 0;
                while t + T::CT <= nt {
                    T::tile(&cols, nb, ag.add(t * stride), stride, accp.add(t * T::W));
                    t += T::CT;
                }
                if t < nt {
                    T::tile_tail(
                        &cols,
                        nb,
                        nt - t,
                        ag.add(t * stride),
                        stride,
                        accp.add(t * T::W),
                    );
                }
            }
            for t in 0..nt {
                for c in 0..n_c {
                    y.write(t0 + t, o0 + c, acc[t * T::W + c]);
                }
            }
            o0 += n_c;
        }
        t0 += nt;
    }
}

/// [`column_rows`] compiled for the AVX2 family.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn columns_avx2<T: ColumnTiles>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    column_rows::<T, { T_CAP * CB * CB_ROWS }>(w, act, stride, n_tok, r0, r1, y)
}

// ---------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------

/// Quantized rows `[r0, r1)` against natural activation records.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `act` holds `n_tok * stride` bytes of records for
/// `w.ty`; `w` validated; `r1 <= w.n_out`.
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
    let cols = n_tok >= COLS_MIN_ROWS;
    let nat8 = (COLS_MIN_ROWS..=NATURAL_ROWS).contains(&n_tok);
    if w.packed {
        // Packed K-quants (`quant::packed`): `rows_packed8` for a few rows, the tiles above.
        let few = n_tok <= kpacked8::PACKED_ROWS;
        use kpacked8::{rows_packed8, KPackedTiles};
        match w.ty {
            GgmlType::Q4_K if few => rows_packed8::<Q4K>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q5_K if few => rows_packed8::<Q5K>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q6_K if few => rows_packed8::<Q6K>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q4_K => columns_avx2::<KPackedTiles<Q4K>>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q5_K => columns_avx2::<KPackedTiles<Q5K>>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q6_K => columns_avx2::<KPackedTiles<Q6K>>(w, a, stride, n_tok, r0, r1, y),
            _ => {}
        }
        return;
    }
    match w.ty {
        GgmlType::Q4_0 => rows_legacy::<Q40>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_1 | GgmlType::Q8_0 => lcols::legacy_cols(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_0 => rows_legacy::<Q50>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_1 => rows_legacy::<Q51>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_K if nat8 => knat8::natural_rows::<Q4K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_K if nat8 => knat8::natural_rows::<Q5K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K if nat8 => knat8::natural_rows::<Q6K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_K if cols => columns_avx2::<KTiles<Q4K>>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_K if cols => columns_avx2::<KTiles<Q5K>>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K if cols => columns_avx2::<KTiles<Q6K>>(w, a, stride, n_tok, r0, r1, y),
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
