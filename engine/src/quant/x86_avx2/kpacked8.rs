//! The AVX2 family on column-packed K-quant weights (`quant::packed`): each 16-row packed group read as two 8-row column blocks, the column tiles' registers loaded instead of transposed.
//!
//! A packed group stores dword `k` of row `c` at byte `64 k + 4 c`, so the 32 bytes at
//! `64 k + 32 h` are what `build_cols` gets from an 8×8 transpose of rows `8 h .. 8 h + 8`. The
//! small-row kernel ([`rows_packed8`]) unpacks each (unit, column) straight from those bytes into
//! its `maddubs` chains, nothing stored; more rows run the column tiles on groups built from the
//! packed bytes ([`KPackedTiles`]). The exact integers per (output row, activation row, group) and
//! the float step are the tiles' (`tile_cols`, `k8_value`), so the bits are those of the natural
//! rows, for any batch size.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::{
    k4_col_scales_t, k8_value, ld, prefetch_block_l2, rd_u32, ColumnTiles, KCols, KKind, KTiles,
    CB, CB_ROWS, CT, Q4K, Q5K, Q6K,
};
use crate::quant::act::{GROUP, OFF_D, REC};
use crate::quant::packed::PACK_ROWS;
use crate::quant::{QMatrix, YPtr};

/// The 32 bytes of dword column `i` (lane `c`: dword `i` of row `8 h + c`) of the value
/// register at byte `off` of the natural block, in the packed group at `p` (already offset by
/// `32 h`).
#[inline(always)]
unsafe fn col(p: *const u8, off: usize, i: usize) -> __m256i {
    ld(p.add(16 * off + 64 * i))
}

/// A K-quant type the AVX2 family reads packed.
pub(super) trait KPacked8: KKind {
    /// Unit `j`'s column `i` (`build_cols`' `q[j][i]`) of the packed half-group at `p`.
    unsafe fn unit_col(p: *const u8, j: usize, i: usize) -> __m256i;
    /// `sc`, `bs`, `d` and `ndmin` of half `h` of the packed group at `base` (as `col_scales`).
    unsafe fn col_scales_packed(base: *const u8, h: usize, out: &mut KCols);
}

impl KPacked8 for Q4K {
    #[inline(always)]
    unsafe fn unit_col(p: *const u8, j: usize, i: usize) -> __m256i {
        let v = col(p, 16 + 32 * (j / 2), i);
        let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (j % 2) as i32));
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn col_scales_packed(base: *const u8, h: usize, out: &mut KCols) {
        k4_col_scales_t(std::array::from_fn(|k| col(base.add(32 * h), 0, k)), out)
    }
}

impl KPacked8 for Q5K {
    #[inline(always)]
    unsafe fn unit_col(p: *const u8, j: usize, i: usize) -> __m256i {
        let v = col(p, 48 + 32 * (j / 2), i);
        let lo = _mm256_and_si256(
            _mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (j % 2) as i32)),
            _mm256_set1_epi8(0x0F),
        );
        // Bit j of the qh byte: the fifth bit (`q5k_units_of`'s compare).
        let b = _mm256_set1_epi8((1u8 << j) as i8);
        let qh = col(p, 16, i);
        let hb = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(qh, b), b),
            _mm256_set1_epi8(16),
        );
        _mm256_or_si256(lo, hb)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn col_scales_packed(base: *const u8, h: usize, out: &mut KCols) {
        k4_col_scales_t(std::array::from_fn(|k| col(base.add(32 * h), 0, k)), out)
    }
}

impl KPacked8 for Q6K {
    /// Unit `4 hh + g`: nibble `g / 2` of `ql` register `2 hh + g % 2` (bytes `64 hh + 32 (g % 2)`),
    /// bits `2g, 2g + 1` of `qh` register `hh` (byte `128 + 32 hh`) above it (`q6k_units_of`).
    #[inline(always)]
    unsafe fn unit_col(p: *const u8, j: usize, i: usize) -> __m256i {
        let (hh, g) = (j / 4, j % 4);
        let l = col(p, 64 * hh + 32 * (g % 2), i);
        let qh = col(p, 128 + 32 * hh, i);
        let lo = _mm256_and_si256(
            _mm256_srl_epi16(l, _mm_cvtsi32_si128(4 * (g / 2) as i32)),
            _mm256_set1_epi8(0x0F),
        );
        let hi = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32)),
            _mm256_set1_epi8(3),
        );
        _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
    }
    /// The sixteen signed scales (dwords 48..52 of every row) spread in their lanes as
    /// `Q6K::col_scales` spreads them, `d` from the group's trailing f16.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn col_scales_packed(base: *const u8, h: usize, out: &mut KCols) {
        let r: [__m256i; 4] = std::array::from_fn(|k| col(base.add(32 * h), 192, k));
        for s in 0..16 {
            out.sc[s] = _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(r[s / 4], K6_BYTE[s % 4].v()));
        }
        for q in 0..8 {
            let pair = _mm256_shuffle_epi8(r[q / 2], K6_PAIR[q % 2].v());
            out.bs[q] = _mm256_slli_epi16::<5>(_mm256_srai_epi16::<8>(pair));
        }
        let d = base.add(64 * (Q6K::BB / 4) + 2 * CB_ROWS * h) as *const __m128i;
        out.d = _mm256_cvtph_ps(_mm_loadu_si128(d));
        out.ndmin = _mm256_setzero_ps();
    }
}

/// A 32-byte `pshufb` control.
#[repr(C, align(32))]
struct Ctl([i8; 32]);

impl Ctl {
    #[inline(always)]
    unsafe fn v(&self) -> __m256i {
        _mm256_load_si256(self.0.as_ptr() as *const __m256i)
    }
}

/// Byte `b` of every dword into bytes 1 and 3 of that dword (the high bytes of its i16 halves).
const fn k6_byte(b: usize) -> Ctl {
    let mut t = [-128i8; 32];
    let mut d = 0;
    while d < 8 {
        t[4 * d + 1] = (4 * (d % 4) + b) as i8;
        t[4 * d + 3] = (4 * (d % 4) + b) as i8;
        d += 1;
    }
    Ctl(t)
}

/// Bytes `2p` and `2p + 1` of every dword into its bytes 1 and 3.
const fn k6_pair(p: usize) -> Ctl {
    let mut t = [-128i8; 32];
    let mut d = 0;
    while d < 8 {
        t[4 * d + 1] = (4 * (d % 4) + 2 * p) as i8;
        t[4 * d + 3] = (4 * (d % 4) + 2 * p + 1) as i8;
        d += 1;
    }
    Ctl(t)
}

static K6_BYTE: [Ctl; 4] = [k6_byte(0), k6_byte(1), k6_byte(2), k6_byte(3)];
static K6_PAIR: [Ctl; 2] = [k6_pair(0), k6_pair(1)];

/// Activation rows [`rows_packed8`] takes at once: its `2 R` chains and sums stay in the sixteen
/// registers.
const PACKED8_ROWS_MAX: usize = 4;
/// Most activation rows `rows_packed8` takes; the packed column tiles take more.
pub(super) const PACKED_ROWS: usize = 8;
/// Software prefetch distance of the packed kernels, in groups of 16 rows.
const PACKED_PREFETCH: usize = 8;

/// Packed K-quant rows `[r0, r1)` (whole 16-row slices) against `n_tok` natural records: per
/// slice, [`PACKED8_ROWS_MAX`] activation rows at a time (the slice, at most 118 KB of Q6_K,
/// stays in L2 for the next ones).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_packed8<K: KPacked8>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let mut ks: KCols = std::mem::zeroed();
    for o in (r0..r1).step_by(PACK_ROWS) {
        let slice = w.data.as_ptr().add(o * rb);
        let mut t0 = 0;
        while t0 < n_tok {
            let nt = (n_tok - t0).min(PACKED8_ROWS_MAX);
            let a = act.add(t0 * stride);
            match nt {
                1 => slice_packed8::<K, 1>(w, slice, &mut ks, a, stride, o, t0, y),
                2 => slice_packed8::<K, 2>(w, slice, &mut ks, a, stride, o, t0, y),
                3 => slice_packed8::<K, 3>(w, slice, &mut ks, a, stride, o, t0, y),
                _ => slice_packed8::<K, PACKED8_ROWS_MAX>(w, slice, &mut ks, a, stride, o, t0, y),
            }
            t0 += nt;
        }
    }
}

/// One packed 16-row slice (output rows `o ..`) against `R` natural records at
/// `act + t * stride` (activation rows `t0 ..`): per group and half, each unit's columns
/// unpacked from their bytes into one `maddubs` chain per activation row (`tile_cols`' i16
/// runs and `madd` by the scales), then `tile_epilogue`'s float step.
// The chains are indexed by activation row throughout.
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn slice_packed8<K: KPacked8, const R: usize>(
    w: &QMatrix,
    slice: *const u8,
    ks: &mut KCols,
    act: *const u8,
    stride: usize,
    o: usize,
    t0: usize,
    y: YPtr,
) {
    let n_groups = w.n_in / GROUP;
    let gb = PACK_ROWS * K::BB;
    let n_bs = if K::K6 { 8 } else { 4 };
    // [half][activation row]: eight output rows per register.
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    for g in 0..n_groups {
        let gp = slice.add(g * gb);
        let ag = act.add(g * REC);
        for h in 0..2 {
            let p = gp.add(32 * h);
            K::col_scales_packed(gp, h, ks);
            let mut s = [_mm256_setzero_si256(); R];
            // Rolled over the units (as `tile_cols`).
            for j in 0..std::hint::black_box(8) {
                // The stream: a sixteenth of the group `PACKED_PREFETCH` ahead per unit and half,
                // into L2 (as `kcols512`'s packed kernel).
                let part = gb.div_ceil(16);
                let ahead = gp.wrapping_add(PACKED_PREFETCH * gb + (8 * h + j) * part);
                prefetch_block_l2(ahead, part);
                let mut r = 0;
                while r < 8 {
                    let mut c = [_mm256_setzero_si256(); R];
                    for i in r..r + K::ACC {
                        let q = K::unit_col(p, j, i);
                        for t in 0..R {
                            let x = rd_u32(ag.add(t * stride + 32 * j + 4 * i)) as i32;
                            let v = _mm256_maddubs_epi16(q, _mm256_set1_epi32(x));
                            c[t] = _mm256_add_epi16(c[t], v);
                        }
                    }
                    let sc = ks.sc[(8 * j + r) / K::SCN];
                    for t in 0..R {
                        s[t] = _mm256_add_epi32(s[t], _mm256_madd_epi16(c[t], sc));
                    }
                    r += K::ACC;
                }
            }
            for t in 0..R {
                let at = ag.add(t * stride);
                let dx = _mm256_set1_ps(*(at.add(OFF_D) as *const f32));
                let v = k8_value::<K>(&ks.bs[..n_bs], ks.d, ks.ndmin, s[t], at);
                acc[h][t] = _mm256_fmadd_ps(v, dx, acc[h][t]);
            }
        }
    }
    for h in 0..2 {
        for t in 0..R {
            let mut v = [0f32; CB_ROWS];
            _mm256_storeu_ps(v.as_mut_ptr(), acc[h][t]);
            for (c, v) in v.iter().enumerate() {
                y.write(t0 + t, o + CB_ROWS * h + c, *v);
            }
        }
    }
}

/// Unpacks half `h` of the packed group at `base` into column order (`build_cols` on loaded
/// instead of transposed registers).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn build_cols_packed<K: KPacked8>(base: *const u8, h: usize, out: &mut KCols) {
    let p = base.add(32 * h);
    for i in 0..8 {
        let mut raw = [_mm256_setzero_si256(); 6];
        for (v, &off) in raw.iter_mut().zip(K::RAW) {
            *v = col(p, off, i);
        }
        let u = K::units_of(&raw);
        for (j, uj) in u.iter().enumerate() {
            out.q[j][i] = *uj;
        }
    }
    K::col_scales_packed(base, h, out);
}

/// The AVX2 K-quant column tiles on packed weights: one block of 16 rows (a packed slice) built
/// as the tiles' two 8-row blocks.
pub(super) struct KPackedTiles<K>(PhantomData<K>);

impl<K: KPacked8> ColumnTiles for KPackedTiles<K> {
    const W: usize = CB * CB_ROWS;
    const BLOCK_ROWS: usize = PACK_ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = K::BB;
    const PACKED: bool = true;
    type Cols = [KCols; CB];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn build(p: &[*const u8], _b: usize, _nb: usize, cols: &mut [KCols; CB]) {
        for (h, c) in cols.iter_mut().enumerate() {
            build_cols_packed::<K>(p[0], h, c);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile(cols: &[KCols; CB], nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        KTiles::<K>::tile(cols, nb, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_tail(
        cols: &[KCols; CB],
        nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        KTiles::<K>::tile_tail(cols, nb, rt, a, stride, acc)
    }
    /// `PACKED_PREFETCH` groups ahead in the slice, then the next pass's.
    #[inline(always)]
    unsafe fn prefetch(at: *const u8, g: usize, n_groups: usize, rb: usize, _nb: usize) {
        let gb = PACK_ROWS * K::BB;
        let ahead = if g + PACKED_PREFETCH < n_groups {
            at.wrapping_add(PACKED_PREFETCH * gb)
        } else {
            at.wrapping_add(Self::W * rb + PACKED_PREFETCH * gb)
                .wrapping_sub(n_groups * gb)
        };
        prefetch_block_l2(ahead, gb);
    }
}
