//! AVX2 kernels: `maddubs`/`madd` integer dots on natural-order activation records (ggml's AVX2 scheme).
//!
//! K-quants apply their integer sub-block scales inside `madd`, mins / the Q6_K offset come from the
//! Q8_K block sums; legacy types use the sign trick for signed weights and scale each 32-block in
//! float. Loop structure (row tiles × k-blocks × rows × groups × activation rows) is the same as the
//! AVX-512 kernels: each weight group is unpacked once for all activation rows.

use std::arch::x86_64::*;

use super::act::{self, ActKind, GROUP, OFF_BS, OFF_D, OFF_S, REC};
use super::{GgmlType, QMatrix, YPtr};

const ACC_CAP: usize = 256;
const KB_BYTES: usize = 24 * 1024;
/// Software prefetch distance for the weight stream, in groups.
const PREFETCH_GROUPS: usize = 6;

trait Kind {
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

impl Kind for Q40 {
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

impl Kind for Q41 {
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

impl Kind for Q50 {
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

impl Kind for Q51 {
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

impl Kind for Q80 {
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

// ---------------------------------------------------------------------------------------------
// K-quants
// ---------------------------------------------------------------------------------------------

struct WK {
    /// Unsigned weights, natural order: register k = elements 32k..32k+32.
    q: [__m256i; 8],
    /// i16 sub-block scales matching the 16 `maddubs` lanes of register k.
    sc: [__m256i; 8],
    /// i16 factors for the 16 Q8_K block sums: mins (Q4_K/Q5_K) or 32·scale (Q6_K offset).
    bs: __m256i,
    d: f32,
    dmin: f32,
}

/// Scales, mins and d/dmin of a Q4_K/Q5_K block into `w`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_scales(p: *const u8, w: &mut WK) {
    let mut s = [0u8; 12];
    std::ptr::copy_nonoverlapping(p.add(4), s.as_mut_ptr(), 12);
    let (sc, m) = super::formats::k4_scales(&s);
    for (v, &s) in w.sc.iter_mut().zip(&sc) {
        *v = _mm256_set1_epi16(s as i16);
    }
    let mut mm = [0i16; 16];
    for j in 0..8 {
        mm[2 * j] = m[j] as i16;
        mm[2 * j + 1] = m[j] as i16;
    }
    w.bs = _mm256_loadu_si256(mm.as_ptr() as *const __m256i);
    w.d = f16_1(p);
    w.dmin = f16_1(p.add(2));
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_step<const K6: bool>(w: &WK, a: *const u8, acc: __m256) -> __m256 {
    let mut sumi = _mm256_setzero_si256();
    for k in 0..8 {
        let av = _mm256_loadu_si256(a.add(32 * k) as *const __m256i);
        let p = _mm256_maddubs_epi16(w.q[k], av);
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, w.sc[k]));
    }
    let mm = _mm256_madd_epi16(w.bs, _mm256_loadu_si256(a.add(OFF_BS) as *const __m256i));
    let dx = std::ptr::read_unaligned(a.add(OFF_D) as *const f32);
    if K6 {
        let s = _mm256_sub_epi32(sumi, mm);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(w.d * dx), acc)
    } else {
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(w.d * dx), acc);
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(mm), _mm256_set1_ps(-w.dmin * dx), acc)
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn wk_zero() -> WK {
    WK {
        q: [_mm256_setzero_si256(); 8],
        sc: [_mm256_setzero_si256(); 8],
        bs: _mm256_setzero_si256(),
        d: 0.0,
        dmin: 0.0,
    }
}

struct Q4K;
struct Q5K;
struct Q6K;

impl Kind for Q4K {
    type W = WK;
    const BLOCKS: usize = 1;
    const BB: usize = 144;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WK {
        let mut w = wk_zero();
        k4_scales(p, &mut w);
        let m4 = _mm256_set1_epi8(0x0F);
        for c in 0..4 {
            let v = _mm256_loadu_si256(p.add(16 + 32 * c) as *const __m256i);
            w.q[2 * c] = _mm256_and_si256(v, m4);
            w.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WK, a: *const u8, acc: __m256) -> __m256 {
        k_step::<false>(w, a, acc)
    }
}

impl Kind for Q5K {
    type W = WK;
    const BLOCKS: usize = 1;
    const BB: usize = 176;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WK {
        let mut w = wk_zero();
        k4_scales(p, &mut w);
        let m4 = _mm256_set1_epi8(0x0F);
        let qh = _mm256_loadu_si256(p.add(16) as *const __m256i);
        let c16 = _mm256_set1_epi8(16);
        for c in 0..4 {
            let v = _mm256_loadu_si256(p.add(48 + 32 * c) as *const __m256i);
            let b0 = _mm256_set1_epi8((1u8 << (2 * c)) as i8);
            let b1 = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
            let h0 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), c16);
            let h1 = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), c16);
            w.q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), h0);
            w.q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h1);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WK, a: *const u8, acc: __m256) -> __m256 {
        k_step::<false>(w, a, acc)
    }
}

impl Kind for Q6K {
    type W = WK;
    const BLOCKS: usize = 1;
    const BB: usize = 210;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> WK {
        let mut w = wk_zero();
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(3);
        for h in 0..2 {
            let l0 = _mm256_loadu_si256(p.add(64 * h) as *const __m256i);
            let l1 = _mm256_loadu_si256(p.add(64 * h + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i);
            let hb0 = _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4);
            let hb2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4);
            let hb4 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4);
            let hb6 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4);
            w.q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, m4), hb0);
            w.q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), hb2);
            w.q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hb4);
            w.q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hb6);
        }
        let mut bs = [0i16; 16];
        for k in 0..8 {
            let s0 = *p.add(192 + 2 * k) as i8 as i16;
            let s1 = *p.add(192 + 2 * k + 1) as i8 as i16;
            w.sc[k] = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
            bs[2 * k] = 32 * s0;
            bs[2 * k + 1] = 32 * s1;
        }
        w.bs = _mm256_loadu_si256(bs.as_ptr() as *const __m256i);
        w.d = f16_1(p.add(208));
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(w: &WK, a: *const u8, acc: __m256) -> __m256 {
        k_step::<true>(w, a, acc)
    }
}

// ---------------------------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------------------------

/// Quantized rows `[r0, r1)` against natural activation records.
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C; `act` holds `n_tok * stride` bytes of natural records for
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
    match w.ty {
        GgmlType::Q4_0 => rows::<Q40>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_1 => rows::<Q41>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_0 => rows::<Q50>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_1 => rows::<Q51>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q8_0 => rows::<Q80>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q4_K => rows::<Q4K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_K => rows::<Q5K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K => rows::<Q6K>(w, a, stride, n_tok, r0, r1, y),
        _ => {}
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<K: Kind>(
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
                        // Weights stream from DRAM once: ask for them a few groups ahead.
                        let pf = wrow.wrapping_add((g + PREFETCH_GROUPS) * gbytes);
                        let mut off = 0;
                        while off < gbytes {
                            _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(off) as *const i8);
                            off += 64;
                        }
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
