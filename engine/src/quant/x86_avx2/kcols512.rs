//! AVX-512 column tiles for K-quants (the AVX-512 VNNI family): the AVX2 column layout at 16 output rows per register, `vpdpbusd` into exact i32 per scale run, one `vpmulld` by the run's scales.
//!
//! A group of 16 output rows is unpacked by 16×16 dword transposes into 512-bit registers whose
//! 32-bit lane `c` holds four values of output row `c` (the AVX2 column layout, twice as wide).
//! One `vpdpbusd` against four broadcast activations then adds 64 exact products into the i32
//! lanes of 16 output rows: no i16 partial sums (the AVX2 tiles' `maddubs` + add +
//! `madd`), and no horizontal sums. The exact integers per (output row, activation row, group)
//! and the float step are those of the AVX2 kernels (`k_epilogue`'s operations), so the AVX-512
//! family computes K-quant rows bit for bit as the AVX2 family does, for any batch size; one or
//! two activation rows run the natural-order kernel at 512 bits (`knat512`). Column-packed
//! weights (`quant::packed`) skip the transposes: up to 16 activation rows on `rows_packed`
//! (units unpacked straight into the `vpdpbusd` chains), more on the same tiles.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::knat512::{rows_k_nat16, rows_k_nat16x16, KNat512};
use super::{
    column_rows, f16_cols, prefetch_block, prefetch_block_l2, rd_u32, ColumnTiles, KCols, KKind,
    CB_ROWS, Q4K, Q5K, Q6K, T_CAP,
};
use crate::quant::act::{GROUP, OFF_BS, OFF_BS32, OFF_D, REC};
use crate::quant::x86_avx512::transpose16;
use crate::quant::{GgmlType, QMatrix, YPtr};

pub(crate) mod amx_packed;

/// Output rows of one 512-bit column block (one i32 lane each).
const ROWS: usize = 2 * CB_ROWS;
/// Column blocks of a tile.
const CB: usize = 2;
/// Activation rows of a tile: `CB × CT` running dot products plus as many sums stay in registers
/// (24 of 32), and 12 independent `vpdpbusd` chains cover its latency.
const CT: usize = 6;
/// Software prefetch distance for the weight stream, in groups (in traversal order).
const PREFETCH: usize = 3;

/// A K-quant group of 16 output rows in column order (`KCols` at 16 rows per register).
#[repr(C, align(64))]
struct KCols16 {
    q: [[__m512i; 8]; 8],
    /// i32 scale of output row `c` in lane `c`, one register per scale run (Q4_K/Q5_K: 8 runs of
    /// 32 elements; Q6_K: 16 of 16, signed).
    sc: [__m512i; 16],
    /// As `KCols::bs` (i16 pairs for `madd`).
    bs: [__m512i; 8],
    d: __m512,
    ndmin: __m512,
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn join_ps(lo: __m256, hi: __m256) -> __m512 {
    _mm512_castsi512_ps(join(_mm256_castps_si256(lo), _mm256_castps_si256(hi)))
}

/// The f32 of the f16 at `p[c] + off` of 16 rows (`f16_cols` per eight).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn f16_cols16(p: &[*const u8; ROWS], off: usize) -> __m512 {
    let half = |h: usize| -> [*const u8; CB_ROWS] { std::array::from_fn(|c| p[h * CB_ROWS + c]) };
    join_ps(f16_cols(&half(0), off), f16_cols(&half(1), off))
}

/// The 16 registers `r[k]` whose lane `c` holds dword `k` of the 64 bytes at `p[c] + off`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dwords16(p: &[*const u8; ROWS], off: usize) -> [__m512i; 16] {
    let mut r: [__m512i; 16] =
        std::array::from_fn(|c| _mm512_loadu_si512(p[c].add(off) as *const __m512i));
    transpose16(&mut r);
    r
}

/// Bit `j` of every byte of `v` moved to bit 4 (the others cleared): a 16-bit shift leaves the
/// bit in its own byte.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn bit_to_4(v: __m512i, j: usize) -> __m512i {
    let x = match j {
        0 => _mm512_slli_epi16::<4>(v),
        1 => _mm512_slli_epi16::<3>(v),
        2 => _mm512_slli_epi16::<2>(v),
        3 => _mm512_slli_epi16::<1>(v),
        4 => v,
        5 => _mm512_srli_epi16::<1>(v),
        6 => _mm512_srli_epi16::<2>(v),
        _ => _mm512_srli_epi16::<3>(v),
    };
    _mm512_and_si512(x, _mm512_set1_epi8(0x10))
}

/// `v >> s` within every byte (a 16-bit shift, then the caller's mask).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn srl_bytes(v: __m512i, s: usize) -> __m512i {
    match s {
        0 => v,
        2 => _mm512_srli_epi16::<2>(v),
        4 => _mm512_srli_epi16::<4>(v),
        _ => _mm512_srli_epi16::<6>(v),
    }
}

/// A K-quant type's values of 16 output rows in column order: `q[j][i]` lane `c` = elements
/// `32j + 4i .. 32j + 4i + 4` of row `c` (what `KKind::units_of` gives per row), unpacked from
/// 16×16 dword transposes of the rows' value bytes.
trait KCols16Kind: KKind {
    unsafe fn q16<S: Src16>(src: S, q: &mut [[__m512i; 8]; 8]);

    /// `sc`, `bs`, `d` and `ndmin` of a packed group at `base` (`quant::packed`): by default
    /// the Q4_K/Q5_K block head's.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scales16_packed(base: *const u8, out: &mut KCols16) {
        k4_scales16_packed(base, out)
    }

    /// `q16`'s `q[j]` of a packed group (unit `j` alone, straight from its bytes).
    unsafe fn unit16_packed(base: *const u8, j: usize) -> [__m512i; 8];

    /// `sc`, `bs`, `d` and `ndmin` of 16 rows: by default the AVX2 code's two halves of eight
    /// rows, joined.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scales16(p: &[*const u8; ROWS], half: &mut [KCols; 2], out: &mut KCols16) {
        for (h, kc) in half.iter_mut().enumerate() {
            let ph: [*const u8; CB_ROWS] = std::array::from_fn(|c| p[h * CB_ROWS + c]);
            Self::col_scales(&ph, kc);
        }
        let [lo, hi] = &*half;
        // `KCols::sc` holds each scale in both i16 halves of its lane (zero- or sign-extended):
        // the arithmetic shift leaves it as an i32.
        let runs = if Self::K6 { 16 } else { 8 };
        for r in 0..runs {
            out.sc[r] = _mm512_srai_epi32::<16>(join(lo.sc[r], hi.sc[r]));
        }
        for q in 0..8 {
            out.bs[q] = join(lo.bs[q], hi.bs[q]);
        }
        out.d = join_ps(lo.d, hi.d);
        out.ndmin = join_ps(lo.ndmin, hi.ndmin);
    }
}

impl KCols16Kind for Q4K {
    /// `qs` at byte 16: unit `2cc + h` is nibble `h` of bytes `32cc .. 32cc + 32`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q16<S: Src16>(src: S, q: &mut [[__m512i; 8]; 8]) {
        let m4 = _mm512_set1_epi8(0x0F);
        for half in 0..2 {
            let t = src.dwords16(16 + 64 * half);
            for (k, &v) in t.iter().enumerate() {
                let (cc, i) = ((16 * half + k) / 8, k % 8);
                q[2 * cc][i] = _mm512_and_si512(v, m4);
                q[2 * cc + 1][i] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
        }
    }
    /// Unit `2cc + h`: nibble `h` of the dwords `8 (cc % 2) ..` of `qs` half `cc / 2`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unit16_packed(base: *const u8, j: usize) -> [__m512i; 8] {
        let (cc, h) = (j / 2, j % 2);
        let at = base.add(16 * (16 + 64 * (cc / 2)) + 64 * 8 * (cc % 2));
        let m4 = _mm512_set1_epi8(0x0F);
        // Shifts by immediates (none for the low nibbles): ~7% off a 16-row Q4_K matmul in L2
        // on Zen 4 against shifts by a register count.
        std::array::from_fn(|i| _mm512_and_si512(srl_bytes(ld512(at.add(64 * i)), 4 * h), m4))
    }
}

impl KCols16Kind for Q5K {
    /// `qh` at byte 16 (bit `j` of byte `l`: the fifth bit of element `l` of unit `j`), `qs` at 48
    /// as Q4_K's.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q16<S: Src16>(src: S, q: &mut [[__m512i; 8]; 8]) {
        let m4 = _mm512_set1_epi8(0x0F);
        // Only `th[..8]` (the 32 `qh` bytes) is read: a packed group has no more there.
        let th = src.dwords8(16);
        for half in 0..2 {
            let t = src.dwords16(48 + 64 * half);
            for (k, &v) in t.iter().enumerate() {
                let (cc, i) = ((16 * half + k) / 8, k % 8);
                let (j0, j1) = (2 * cc, 2 * cc + 1);
                q[j0][i] = _mm512_or_si512(_mm512_and_si512(v, m4), bit_to_4(th[i], j0));
                q[j1][i] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
                    bit_to_4(th[i], j1),
                );
            }
        }
    }
    /// Q4_K's unit from `qs` at byte 48, bit `j` of the `qh` dwords as its fifth bit.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unit16_packed(base: *const u8, j: usize) -> [__m512i; 8] {
        let (cc, h) = (j / 2, j % 2);
        let at = base.add(16 * (48 + 64 * (cc / 2)) + 64 * 8 * (cc % 2));
        let bit = _mm_cvtsi32_si128(j as i32);
        let (m4, b4) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
        std::array::from_fn(|i| {
            let lo = _mm512_and_si512(srl_bytes(ld512(at.add(64 * i)), 4 * h), m4);
            // Bit j of every byte to bit 4 (16-bit shifts keep each byte's bit in its byte).
            let qh = _mm512_srl_epi16(ld512(base.add(16 * 16 + 64 * i)), bit);
            _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16::<4>(qh), b4))
        })
    }
}

/// Byte `b` of every dword of `v`, sign-extended to i32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn byte_i32(v: __m512i, b: usize) -> __m512i {
    let x = match b {
        0 => _mm512_slli_epi32::<24>(v),
        1 => _mm512_slli_epi32::<16>(v),
        2 => _mm512_slli_epi32::<8>(v),
        _ => v,
    };
    _mm512_srai_epi32::<24>(x)
}

impl KCols16Kind for Q6K {
    /// The sixteen signed scales (bytes 192..208) of 16 rows by one transpose: `sc[h]` is scale
    /// `h` of row `c` in lane `c`, `bs[q]` the i16 pair `(32·sc_2q, 32·sc_2q+1)` (the −32
    /// offset against the 16-element block sums), as `Q6K::col_scales` builds them per 8 rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scales16(p: &[*const u8; ROWS], _half: &mut [KCols; 2], out: &mut KCols16) {
        let mut r: [__m512i; 16] = std::array::from_fn(|c| {
            _mm512_zextsi128_si512(_mm_loadu_si128(p[c].add(192) as *const __m128i))
        });
        transpose16(&mut r);
        q6k_scales16(&r, out);
        out.d = f16_cols16(p, 208);
    }

    /// The scales' four dwords at byte 192 of every row, `d` the trailing f16 of the group.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scales16_packed(base: *const u8, out: &mut KCols16) {
        let r: [__m512i; 4] = std::array::from_fn(|k| ld512(base.add(16 * 192 + 64 * k)));
        q6k_scales16(&r, out);
        out.d = _mm512_cvtph_ps(_mm256_loadu_si256(
            base.add(64 * (Q6K::BB / 4)) as *const __m256i
        ));
    }

    /// Unit `4h + g` as `q16` builds it: `ql` dword `16h + 8(g % 2) + i` (register `kl` of the
    /// packed group at `64 kl`), `qh` dword `8h + i` at byte 128.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unit16_packed(base: *const u8, j: usize) -> [__m512i; 8] {
        let (h, g) = (j / 4, j % 4);
        let (m4, m3) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
        std::array::from_fn(|i| {
            let kl = 16 * h + 8 * (g % 2) + i;
            let lo = _mm512_and_si512(srl_bytes(ld512(base.add(64 * kl)), 4 * (g / 2)), m4);
            let th = ld512(base.add(16 * 128 + 64 * (8 * h + i)));
            let hi = _mm512_and_si512(srl_bytes(th, 2 * g), m3);
            _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi))
        })
    }

    /// `ql` at byte 0, `qh` at 128: element `128h + 32g + l` is nibble `g / 2` of
    /// `ql[64h + 32(g % 2) + l]` with bits `2g, 2g + 1` of `qh[32h + l]` above it (ggml's
    /// `dequantize_row_q6_K`; the −32 offset enters through `bs`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q16<S: Src16>(src: S, q: &mut [[__m512i; 8]; 8]) {
        let (m4, m3) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(3));
        let tl = [src.dwords16(0), src.dwords16(64)];
        let th = src.dwords16(128);
        for (j, qj) in q.iter_mut().enumerate() {
            let (h, g) = (j / 4, j % 4);
            for (i, qji) in qj.iter_mut().enumerate() {
                let kl = 16 * h + 8 * (g % 2) + i;
                let lo = _mm512_and_si512(srl_bytes(tl[kl / 16][kl % 16], 4 * (g / 2)), m4);
                let hi = _mm512_and_si512(srl_bytes(th[8 * h + i], 2 * g), m3);
                *qji = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(hi));
            }
        }
    }
}

/// Q6_K's `sc` and `bs` from `r[k]` (lane `c`: dword `k` of row `c`'s sixteen signed scales):
/// `sc[h]` is scale `h` of row `c` in lane `c`, `bs[q]` the i16 pair `(32·sc_2q, 32·sc_2q+1)`
/// (the −32 offset against the 16-element block sums), as `Q6K::col_scales` builds them per 8
/// rows; no mins.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6k_scales16(r: &[__m512i], out: &mut KCols16) {
    for h in 0..16 {
        out.sc[h] = byte_i32(r[h / 4], h % 4);
    }
    let lo16 = _mm512_set1_epi32(0xFFFF);
    for q in 0..8 {
        let lo = _mm512_and_si512(_mm512_slli_epi32::<5>(out.sc[2 * q]), lo16);
        let hi = _mm512_slli_epi32::<21>(out.sc[2 * q + 1]);
        out.bs[q] = _mm512_or_si512(lo, hi);
    }
    out.ndmin = _mm512_setzero_ps();
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn ld512(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p as *const __m512i)
}

/// Byte `b` of every dword of `v`, zero-extended to i32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn byte_u32(v: __m512i, b: usize) -> __m512i {
    let x = match b {
        0 => v,
        1 => _mm512_srli_epi32::<8>(v),
        2 => _mm512_srli_epi32::<16>(v),
        _ => return _mm512_srli_epi32::<24>(v),
    };
    _mm512_and_si512(x, _mm512_set1_epi32(0xFF))
}

/// Q4_K/Q5_K `sc`, `bs`, `d` and `ndmin` of a packed group: the 16-byte block heads are its
/// first four dword registers (`d | dmin`, then the twelve bytes of six-bit scales and mins),
/// decoded in the lanes as `k4_col_scales` decodes them per eight rows (ggml's
/// `get_scale_min_k4`): `sc[j]` scale `j` as i32, `bs[q]` the i16 pair `(m_2q, m_2q+1)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k4_scales16_packed(base: *const u8, out: &mut KCols16) {
    let t: [__m512i; 4] = std::array::from_fn(|k| ld512(base.add(64 * k)));
    let (u0, u1, u2) = (t[1], t[2], t[3]);
    let k1 = _mm512_set1_epi32(0x3f3f_3f3f);
    let k2 = _mm512_set1_epi32(0x0f0f_0f0f);
    let k3 = _mm512_set1_epi32(0x0303_0303);
    let hi2 = |u: __m512i| _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u), k3));
    // Bytes 0..4 and 4..8 of every row's eight scales and eight mins.
    let sc = [
        _mm512_and_si512(u0, k1),
        _mm512_or_si512(_mm512_and_si512(u2, k2), hi2(u0)),
    ];
    let mn = [
        _mm512_and_si512(u1, k1),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(u2), k2), hi2(u1)),
    ];
    for j in 0..8 {
        out.sc[j] = byte_u32(sc[j / 4], j % 4);
    }
    for q in 0..4 {
        let b = 2 * (q % 2);
        let (lo, hi) = (byte_u32(mn[q / 2], b), byte_u32(mn[q / 2], b + 1));
        out.bs[q] = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
    }
    // d and dmin: the f16 halves of dword 0.
    out.d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(t[0]));
    // Sign flip by an integer xor (`_mm512_xor_ps` needs AVX-512DQ, not enabled here: it would
    // be a call).
    out.ndmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<
            16,
        >(t[0])))),
        _mm512_set1_epi32(i32::MIN),
    ));
}

/// Where the dwords of a 16-row group come from: natural rows, transposed here, or a packed
/// group (`quant::packed`), loaded as they are.
trait Src16: Copy {
    /// `r[k]` with lane `c` = dword `k` of the 64 bytes at byte `off` of row `c`'s block.
    unsafe fn dwords16(self, off: usize) -> [__m512i; 16];
    /// The first eight of [`Src16::dwords16`] (32 bytes per row).
    unsafe fn dwords8(self, off: usize) -> [__m512i; 8];
}

/// Natural rows: one block pointer per output row.
#[derive(Clone, Copy)]
struct Rows<'a>(&'a [*const u8; ROWS]);

impl Src16 for Rows<'_> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dwords16(self, off: usize) -> [__m512i; 16] {
        dwords16(self.0, off)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dwords8(self, off: usize) -> [__m512i; 8] {
        let r = dwords16(self.0, off);
        std::array::from_fn(|k| r[k])
    }
}

/// A packed group: dword `k` of row `c` at byte `64 k + 4 c`.
#[derive(Clone, Copy)]
struct Packed(*const u8);

impl Src16 for Packed {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dwords16(self, off: usize) -> [__m512i; 16] {
        std::array::from_fn(|k| ld512(self.0.add(16 * off + 64 * k)))
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn dwords8(self, off: usize) -> [__m512i; 8] {
        std::array::from_fn(|k| ld512(self.0.add(16 * off + 64 * k)))
    }
}

/// Unpacks the groups at `p[c]` (one per output row) into `out` (`half`: scratch for the scales
/// built per eight rows by the AVX2 code).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn build_cols16<K: KCols16Kind>(
    p: &[*const u8; ROWS],
    half: &mut [KCols; 2],
    out: &mut KCols16,
) {
    K::q16(Rows(p), &mut out.q);
    K::scales16(p, half, out);
}

/// The tile: exact i32 sums of `CB × ROWS` output rows × `RT` activation rows (natural records
/// at `a + t * stride`), then the AVX2 tiles' float step into `acc[t * CB * ROWS + row]`.
// The tile's registers are indexed [column block][activation row] throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile16<K: KCols16Kind, const RT: usize>(
    w: &[KCols16; CB],
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    let mut s = [[_mm512_setzero_si512(); RT]; CB];
    // Rolled over the sub-blocks (as the AVX2 tile), unrolled within one.
    for j in 0..std::hint::black_box(8) {
        let mut r = 0;
        while r < 8 {
            let mut p = [[_mm512_setzero_si512(); RT]; CB];
            for i in r..r + K::SCN {
                let wv: [__m512i; CB] = std::array::from_fn(|b| w[b].q[j][i]);
                for t in 0..RT {
                    let av = _mm512_set1_epi32(rd_u32(a.add(t * stride + 32 * j + 4 * i)) as i32);
                    for b in 0..CB {
                        p[b][t] = _mm512_dpbusd_epi32(p[b][t], wv[b], av);
                        chain512(&mut p[b][t]);
                    }
                }
            }
            let run = (8 * j + r) / K::SCN;
            for b in 0..CB {
                let sc = w[b].sc[run];
                for t in 0..RT {
                    s[b][t] = _mm512_add_epi32(s[b][t], _mm512_mullo_epi32(p[b][t], sc));
                }
            }
            r += K::SCN;
        }
    }
    for t in 0..RT {
        let at = a.add(t * stride);
        let dx = _mm512_set1_ps(*(at.add(OFF_D) as *const f32));
        for b in 0..CB {
            let v = k16_group_value::<K>(&w[b], s[b][t], at);
            let ap = acc.add(t * CB * ROWS + b * ROWS);
            _mm512_storeu_ps(ap, _mm512_fmadd_ps(v, dx, _mm512_loadu_ps(ap)));
        }
    }
}

/// Keeps `v` in a register at this point of the instruction stream (the 512-bit `chain`): LLVM
/// otherwise schedules each scale run's `vpdpbusd` chains one after another, two at a time,
/// which leaves most of their latency uncovered.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn chain512(v: &mut __m512i) {
    std::arch::asm!(
        "/* {0} */",
        inout(zmm_reg) * v,
        options(pure, nomem, nostack, preserves_flags)
    );
}

/// A K-quant group of `CB × ROWS` output rows, unpacked (`half`: scratch for the scales built per
/// eight rows by the AVX2 code).
struct KPass16 {
    half: [KCols; 2],
    cols: [KCols16; CB],
}

/// The 512-bit K-quant column tiles: `CB` blocks of 16 output rows, `CT` activation rows.
struct KTiles16<K>(PhantomData<K>);

impl<K: KCols16Kind> ColumnTiles for KTiles16<K> {
    const W: usize = CB * ROWS;
    const BLOCK_ROWS: usize = ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = K::BB;
    type Cols = KPass16;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn build(p: &[*const u8], b: usize, _nb: usize, pass: &mut KPass16) {
        let pb: [*const u8; ROWS] = std::array::from_fn(|c| p[c]);
        build_cols16::<K>(&pb, &mut pass.half, &mut pass.cols[b]);
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile(pass: &KPass16, _nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        tile16::<K, CT>(&pass.cols, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_tail(
        pass: &KPass16,
        _nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        let w = &pass.cols;
        match rt {
            5 => tile16::<K, 5>(w, a, stride, acc),
            4 => tile16::<K, 4>(w, a, stride, acc),
            3 => tile16::<K, 3>(w, a, stride, acc),
            2 => tile16::<K, 2>(w, a, stride, acc),
            _ => tile16::<K, 1>(w, a, stride, acc),
        }
    }
    /// `PREFETCH` groups ahead in traversal order: this pass's later groups, then the next pass's
    /// first ones.
    #[inline(always)]
    unsafe fn prefetch(at: *const u8, g: usize, n_groups: usize, rb: usize, _nb: usize) {
        let ahead = if g + PREFETCH < n_groups {
            at.wrapping_add(PREFETCH * K::BB)
        } else {
            at.wrapping_add(Self::W * rb + PREFETCH * K::BB)
                .wrapping_sub(n_groups * K::BB)
        };
        prefetch_block(ahead, K::BB);
    }
}

/// Packed K-quant rows `[r0, r1)` (whole 16-row slices) against `n_tok` natural records: per
/// slice, up to `PACKED_ROWS_MAX` activation rows at a time ([`slice_packed`]; the slice, at most
/// 16 rows × 35 groups of Q6_K = 118 KB, stays in L2 for the next ones). One sequential weight
/// stream per thread: slice after slice, group after group.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows_packed<K: KCols16Kind>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    // The scales of the group at hand (the unit registers stay unused): 5.7 KB, zeroed once per
    // call, not per slice.
    let mut ks: KCols16 = std::mem::zeroed();
    for o in (r0..r1).step_by(ROWS) {
        let slice = w.data.as_ptr().add(o * rb);
        let mut t0 = 0;
        while t0 < n_tok {
            let nt = (n_tok - t0).min(PACKED_ROWS_MAX);
            let (a, sl) = (act.add(t0 * stride), SliceAt { slice, o, t0 });
            match nt {
                1 => slice_packed::<K, 1>(w, sl, &mut ks, a, stride, y),
                2 => slice_packed::<K, 2>(w, sl, &mut ks, a, stride, y),
                3 => slice_packed::<K, 3>(w, sl, &mut ks, a, stride, y),
                4 => slice_packed::<K, 4>(w, sl, &mut ks, a, stride, y),
                5 => slice_packed::<K, 5>(w, sl, &mut ks, a, stride, y),
                6 => slice_packed::<K, 6>(w, sl, &mut ks, a, stride, y),
                7 => slice_packed::<K, 7>(w, sl, &mut ks, a, stride, y),
                _ => slice_packed::<K, PACKED_ROWS_MAX>(w, sl, &mut ks, a, stride, y),
            }
            t0 += nt;
        }
    }
}

/// A packed slice and where its outputs go: output rows `o..o + 16`, activation rows from `t0`.
#[derive(Clone, Copy)]
struct SliceAt {
    slice: *const u8,
    o: usize,
    t0: usize,
}

/// One packed 16-row slice against `R` natural records at `act + t * stride`: each unit
/// unpacked from its bytes straight into `vpdpbusd` chains, one per (scale run, activation row),
/// nothing stored; the tiles' exact integers and float step per group, so the bits of every
/// batch size.
// The chains are indexed by activation row and unit register throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn slice_packed<K: KCols16Kind, const R: usize>(
    w: &QMatrix,
    at: SliceAt,
    ks: &mut KCols16,
    act: *const u8,
    stride: usize,
    y: YPtr,
) {
    let n_groups = w.n_in / GROUP;
    let gb = ROWS * K::BB;
    let mut acc = [_mm512_setzero_ps(); R];
    for g in 0..n_groups {
        let gp = at.slice.add(g * gb);
        K::scales16_packed(gp, ks);
        let ag = act.add(g * REC);
        let mut s = [_mm512_setzero_si512(); R];
        for j in 0..8 {
            // The next slices follow this one: a plain stream, asked into L2 an eighth of a
            // group per unit (measured on Zen 4, one-row Q6_K matmuls: all of it at once into
            // L1 took twice the natural kernel's time; an eighth per unit into L1 about the
            // same time; into L2 0.7x).
            let part = gb.div_ceil(8);
            prefetch_block_l2(gp.wrapping_add(PACKED_PREFETCH * gb + j * part), part);
            let q = K::unit16_packed(gp, j);
            let mut r = 0;
            while r < 8 {
                let mut p = [_mm512_setzero_si512(); R];
                for i in r..r + K::SCN {
                    for t in 0..R {
                        let x = rd_u32(ag.add(t * stride + 32 * j + 4 * i)) as i32;
                        p[t] = _mm512_dpbusd_epi32(p[t], q[i], _mm512_set1_epi32(x));
                    }
                }
                let sc = ks.sc[(8 * j + r) / K::SCN];
                for t in 0..R {
                    s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(p[t], sc));
                }
                r += K::SCN;
            }
        }
        for t in 0..R {
            let a = ag.add(t * stride);
            let dx = _mm512_set1_ps(*(a.add(OFF_D) as *const f32));
            acc[t] = _mm512_fmadd_ps(k16_group_value::<K>(ks, s[t], a), dx, acc[t]);
        }
    }
    for (t, v) in acc.iter().enumerate() {
        y.write16(at.t0 + t, at.o, *v);
    }
}

/// The f32 value of one group for 16 output rows from its exact i32 sums `s` against the record
/// at `at` (block sums against `w.bs`), before the activation scale: the float step of `tile16`
/// and `slice_packed` alike.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k16_group_value<K: KCols16Kind>(w: &KCols16, s: __m512i, at: *const u8) -> __m512 {
    let n_bs = if K::K6 { 8 } else { 4 };
    k16_value::<K>(&w.bs[..n_bs], w.d, w.ndmin, s, at)
}

/// `k_epilogue`'s value of one group (before the activation scale) for 16 output rows, one per
/// lane: exact sums `s`, the i16 pairs `bs` against the record's block sums at `at` (Q4_K/Q5_K:
/// the mins against the 32-element sums; Q6_K: its offset against the 16-element sums, or none
/// when `s` already has it subtracted), `d` and `−dmin`. Every 16-row K-quant kernel's float
/// step, so theirs are the same operations.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn k16_value<K: KKind>(
    bs: &[__m512i],
    d: __m512,
    ndmin: __m512,
    s: __m512i,
    at: *const u8,
) -> __m512 {
    let off = if K::K6 { OFF_BS } else { OFF_BS32 };
    let mut m = _mm512_setzero_si512();
    for (q, bs) in bs.iter().enumerate() {
        let b = _mm512_set1_epi32(rd_u32(at.add(off + 4 * q)) as i32);
        m = _mm512_add_epi32(m, _mm512_madd_epi16(*bs, b));
    }
    if K::K6 {
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, m)), d)
    } else {
        _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(m),
            ndmin,
            _mm512_mul_ps(_mm512_cvtepi32_ps(s), d),
        )
    }
}

/// Activation rows a packed kernel's slice takes at once (here and in `lcols512`: more would push
/// its chains and sums out of the registers).
pub(super) const PACKED_ROWS_MAX: usize = 8;

/// Most activation rows `rows_packed` takes; the packed column tiles take more (measured on a
/// Zen 5 EPYC: `rows_packed` 7-13% below the natural tiles at 16 rows, 15-20% above them at
/// 64, where the tiles reuse each unpacked group for six rows per register load).
const PACKED_TILE_ROWS: usize = 16;

/// Software prefetch distance of the packed small-row kernel, in groups of 16 rows (4 and 8
/// measured alike on Zen 4).
const PACKED_PREFETCH: usize = 8;

/// The 512-bit K-quant column tiles on column-packed weights (`quant::packed`): `build` loads
/// the registers the natural tiles get from 16×16 dword transposes.
struct KPackedTiles16<K>(PhantomData<K>);

impl<K: KCols16Kind> ColumnTiles for KPackedTiles16<K> {
    const W: usize = CB * ROWS;
    const BLOCK_ROWS: usize = ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = K::BB;
    const PACKED: bool = true;
    type Cols = KPass16;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn build(p: &[*const u8], b: usize, _nb: usize, pass: &mut KPass16) {
        K::q16(Packed(p[0]), &mut pass.cols[b].q);
        K::scales16_packed(p[0], &mut pass.cols[b]);
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile(pass: &KPass16, nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        KTiles16::<K>::tile(pass, nb, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_tail(
        pass: &KPass16,
        nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        KTiles16::<K>::tile_tail(pass, nb, rt, a, stride, acc)
    }
    /// `PREFETCH` groups ahead in the slice (one stream per 16 rows), then the next pass's.
    #[inline(always)]
    unsafe fn prefetch(at: *const u8, g: usize, n_groups: usize, rb: usize, _nb: usize) {
        let gb = ROWS * K::BB;
        let ahead = if g + PREFETCH < n_groups {
            at.wrapping_add(PREFETCH * gb)
        } else {
            at.wrapping_add(Self::W * rb + PREFETCH * gb)
                .wrapping_sub(n_groups * gb)
        };
        prefetch_block_l2(ahead, gb);
    }
}

/// The column-tile driver (`x86_avx2::column_rows`) compiled for the AVX-512 family.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn columns_avx512<T: ColumnTiles>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    column_rows::<T, { T_CAP * CB * ROWS }>(w, act, stride, n_tok, r0, r1, y)
}

/// The AVX-512 family's K-quant rows `[r0, r1)` against natural records: the natural-order
/// kernel at 512 bits for up to `nat_rows` activation rows (`knat512`: each group unpacked once
/// for all of them, 16 output rows reduced together; `quant::natural_kernel_rows`: 2 on Zen 5,
/// where a two-row qwen2.5-coder-1.5b forward took 27-28 ms against 33-34 ms on the tiles, 16 on
/// Zen 4; see docs/benchmarks.md),
/// 512-bit column tiles above (both give the AVX2 family's bits). Packed weights: their own
/// kernels.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and AVX2/FMA/F16C; `act` holds `n_tok * stride`
/// bytes of natural records; `w` is a validated Q4_K/Q5_K/Q6_K matrix; `r1 <= w.n_out`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_rows(
    w: &QMatrix,
    act: &[u8],
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    nat_rows: usize,
    y: YPtr,
) {
    debug_assert!(act.len() >= n_tok * stride);
    let a = act.as_ptr();
    if w.packed {
        // Packed weights: `rows_packed` up to `PACKED_TILE_ROWS` rows, the column tiles above.
        match (w.ty, n_tok <= PACKED_TILE_ROWS) {
            (GgmlType::Q4_K, true) => rows_packed::<Q4K>(w, a, stride, n_tok, r0, r1, y),
            (GgmlType::Q5_K, true) => rows_packed::<Q5K>(w, a, stride, n_tok, r0, r1, y),
            (GgmlType::Q6_K, true) => rows_packed::<Q6K>(w, a, stride, n_tok, r0, r1, y),
            (GgmlType::Q4_K, _) => {
                columns_avx512::<KPackedTiles16<Q4K>>(w, a, stride, n_tok, r0, r1, y)
            }
            (GgmlType::Q5_K, _) => {
                columns_avx512::<KPackedTiles16<Q5K>>(w, a, stride, n_tok, r0, r1, y)
            }
            (GgmlType::Q6_K, _) => {
                columns_avx512::<KPackedTiles16<Q6K>>(w, a, stride, n_tok, r0, r1, y)
            }
            _ => {}
        }
        return;
    }
    if n_tok <= nat_rows {
        match w.ty {
            GgmlType::Q4_K => natural_rows::<Q4K>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q5_K => natural_rows::<Q5K>(w, a, stride, n_tok, r0, r1, y),
            GgmlType::Q6_K => natural_rows::<Q6K>(w, a, stride, n_tok, r0, r1, y),
            _ => {}
        }
        return;
    }
    match w.ty {
        GgmlType::Q4_K => columns_avx512::<KTiles16<Q4K>>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_K => columns_avx512::<KTiles16<Q5K>>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K => columns_avx512::<KTiles16<Q6K>>(w, a, stride, n_tok, r0, r1, y),
        _ => {}
    }
}

/// `knat512::rows_k_nat16` for one activation row, `rows_k_nat16x16` for 2 to
/// `quant::MAX_NATURAL_ROWS`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn natural_rows<K: KNat512>(
    w: &QMatrix,
    a: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    match n_tok {
        // One row (decoding): the one-row kernel, each output row on its own (measured on Zen 4,
        // the 16-row blocks decoded qwen2.5-coder-1.5b 5-20% slower).
        1 => rows_k_nat16::<K, 1>(w, a, stride, r0, r1, y),
        2 => rows_k_nat16x16::<K, 2>(w, a, stride, r0, r1, y),
        3 => rows_k_nat16x16::<K, 3>(w, a, stride, r0, r1, y),
        4 => rows_k_nat16x16::<K, 4>(w, a, stride, r0, r1, y),
        5 => rows_k_nat16x16::<K, 5>(w, a, stride, r0, r1, y),
        6 => rows_k_nat16x16::<K, 6>(w, a, stride, r0, r1, y),
        7 => rows_k_nat16x16::<K, 7>(w, a, stride, r0, r1, y),
        8 => rows_k_nat16x16::<K, 8>(w, a, stride, r0, r1, y),
        9 => rows_k_nat16x16::<K, 9>(w, a, stride, r0, r1, y),
        10 => rows_k_nat16x16::<K, 10>(w, a, stride, r0, r1, y),
        11 => rows_k_nat16x16::<K, 11>(w, a, stride, r0, r1, y),
        12 => rows_k_nat16x16::<K, 12>(w, a, stride, r0, r1, y),
        13 => rows_k_nat16x16::<K, 13>(w, a, stride, r0, r1, y),
        14 => rows_k_nat16x16::<K, 14>(w, a, stride, r0, r1, y),
        15 => rows_k_nat16x16::<K, 15>(w, a, stride, r0, r1, y),
        16 => rows_k_nat16x16::<K, 16>(w, a, stride, r0, r1, y),
        _ => debug_assert!(false, "natural rows take at most 16 activation rows"),
    }
}
