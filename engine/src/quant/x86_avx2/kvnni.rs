//! AVX-VNNI column tiles for K-quants (the `avxvnni` family: AVX2 CPUs with VEX `vpdpbusd`, such as Intel's Alder Lake and later clients and Xeon 6 E-cores): the AVX2 tiles with one `vpdpbusd` per 32 products into exact i32 per scale run, one `vpmulld` by the run's scales.
//!
//! The AVX2 tiles (`KTiles`) add `maddubs` results in i16 and apply a scale run's scales with
//! `madd`: two or three integer operations per 32 products. `vpdpbusd` adds the same four
//! products per i32 lane in one operation, so a run's sums need no i16 stage. The exact integers
//! per (output row, activation row, group) and the float step are the AVX2 kernels', so this
//! family computes every row bit for bit as the AVX2 family does, for any batch size. One
//! K-quant activation row (decoding, memory-bound) runs the AVX2 kernel; Q4_1 and Q8_0 run
//! `lcols`' VNNI tiles for every row count; the other legacy types the AVX2 kernels.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::{
    build_cols, chain, column_rows, rd_u32, tile_epilogue, ColumnTiles, KCols, KKind, CB, CB_ROWS,
    COLS_MIN_ROWS, Q4K, Q5K, Q6K, T_CAP,
};
use crate::quant::{GgmlType, QMatrix, YPtr};

/// Activation rows of a tile: `CB × CT` run sums, two weight registers and a broadcast stay in
/// AVX2's 16 registers; the `CB × CT` running sums, touched once per scale run, spill (5 measured
/// against 3, 4 and 6 in cache: within a few percent of the best for every type).
const CT: usize = 5;

/// The tile: exact i32 sums of `CB × CB_ROWS` output rows × `RT` activation rows (natural
/// records at `a + t * stride`), then the AVX2 tiles' float step into `acc[t * CB * CB_ROWS +
/// row]` (`tile_epilogue`). `w[b].sc` holds i32 scales (see [`KTilesVnni::build`]).
// The tile's registers are indexed [column block][activation row] throughout.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn tile_vnni<K: KKind, const RT: usize>(
    w: &[KCols; CB],
    a: *const u8,
    stride: usize,
    acc: *mut f32,
) {
    let mut s = [[_mm256_setzero_si256(); RT]; CB];
    // Rolled over the units (as the AVX2 tile), unrolled within one.
    for j in 0..std::hint::black_box(8) {
        let mut r = 0;
        while r < 8 {
            let mut p = [[_mm256_setzero_si256(); RT]; CB];
            for i in r..r + K::SCN {
                let wv: [__m256i; CB] = std::array::from_fn(|b| w[b].q[j][i]);
                for t in 0..RT {
                    let av = _mm256_set1_epi32(rd_u32(a.add(t * stride + 32 * j + 4 * i)) as i32);
                    for b in 0..CB {
                        p[b][t] = _mm256_dpbusd_avx_epi32(p[b][t], wv[b], av);
                        chain(&mut p[b][t]);
                    }
                }
            }
            let run = (8 * j + r) / K::SCN;
            for b in 0..CB {
                let sc = w[b].sc[run];
                for t in 0..RT {
                    s[b][t] = _mm256_add_epi32(s[b][t], _mm256_mullo_epi32(p[b][t], sc));
                }
            }
            r += K::SCN;
        }
    }
    tile_epilogue::<K, RT>(w, &s, a, stride, acc);
}

/// The AVX-VNNI K-quant column tiles: `CB` blocks of eight output rows, `CT` activation rows.
struct KTilesVnni<K>(PhantomData<K>);

impl<K: KKind> ColumnTiles for KTilesVnni<K> {
    const W: usize = CB * CB_ROWS;
    const BLOCK_ROWS: usize = CB_ROWS;
    const CT: usize = CT;
    const GROUP_BYTES: usize = K::BB;
    type Cols = [KCols; CB];
    /// The AVX2 unpack, then each scale run's i16 pair `(sc, sc)` of a lane turned into the i32
    /// `sc` (an arithmetic shift: both halves hold the same sign-extended scale).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn build(p: &[*const u8], b: usize, _nb: usize, cols: &mut [KCols; CB]) {
        let out = &mut cols[b];
        build_cols::<K>(&std::array::from_fn(|c| p[c]), out);
        let runs = if K::K6 { 16 } else { 8 };
        for sc in &mut out.sc[..runs] {
            *sc = _mm256_srai_epi32::<16>(*sc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn tile(cols: &[KCols; CB], _nb: usize, a: *const u8, stride: usize, acc: *mut f32) {
        tile_vnni::<K, CT>(cols, a, stride, acc)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    unsafe fn tile_tail(
        cols: &[KCols; CB],
        _nb: usize,
        rt: usize,
        a: *const u8,
        stride: usize,
        acc: *mut f32,
    ) {
        match rt {
            4 => tile_vnni::<K, 4>(cols, a, stride, acc),
            3 => tile_vnni::<K, 3>(cols, a, stride, acc),
            2 => tile_vnni::<K, 2>(cols, a, stride, acc),
            _ => tile_vnni::<K, 1>(cols, a, stride, acc),
        }
    }
}

/// The column-tile driver (`x86_avx2::column_rows`) compiled for the AVX-VNNI family.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(super) unsafe fn columns_avxvnni<T: ColumnTiles>(
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

/// Quantized rows `[r0, r1)` against natural activation records for the AVX-VNNI family:
/// K-quants of [`COLS_MIN_ROWS`] or more activation rows on the VNNI column tiles, Q4_1 and Q8_0
/// on `lcols`' VNNI tiles for every row count, everything else on the AVX2 kernels (the same
/// bits either way).
///
/// # Safety
/// The CPU must support AVX2/FMA/F16C and AVX-VNNI; `act` holds `n_tok * stride` bytes of
/// records for `w.ty`; `w` validated; `r1 <= w.n_out`.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
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
        GgmlType::Q4_K if n_tok >= COLS_MIN_ROWS => {
            columns_avxvnni::<KTilesVnni<Q4K>>(w, a, stride, n_tok, r0, r1, y)
        }
        GgmlType::Q5_K if n_tok >= COLS_MIN_ROWS => {
            columns_avxvnni::<KTilesVnni<Q5K>>(w, a, stride, n_tok, r0, r1, y)
        }
        GgmlType::Q6_K if n_tok >= COLS_MIN_ROWS => {
            columns_avxvnni::<KTilesVnni<Q6K>>(w, a, stride, n_tok, r0, r1, y)
        }
        GgmlType::Q4_1 | GgmlType::Q8_0 => {
            super::lcols::legacy_cols_vnni(w, a, stride, n_tok, r0, r1, y)
        }
        _ => super::quant_rows(w, act, stride, n_tok, r0, r1, y),
    }
}
