//! AMX int8 tiles on column-packed K-quant weights (Q4_K, Q6_K): a packed group of 16 output rows is already the tiles' B operand (dword `k` of row `c` at byte `64k + 4c`) and the float step is `rows_packed`'s, so the AMX family computes every row bit for bit as the packed AVX-512 kernels do, whatever the batch size.
//!
//! Per group of 16 output rows, the units `KCols16Kind::unit16_packed` gives (eight registers of
//! 16 rows × 4 values each, i.e. eight rows of a B tile in natural element order) are folded with
//! their scale runs into two int8 planes, as `quant::amx` folds natural rows:
//! - Q4_K: `hi = q·(sc >> 3)`, `lo = q·(sc & 7)` (each at most 105), so `8·C_hi + C_lo` is the
//!   exact integer `s = Σ_runs sc · Σ q·a` that `rows_packed` builds from `vpdpbusd` and
//!   `vpmulld`, and `k16_group_value` (the mins against the block sums) gives the group's value;
//! - Q6_K: `w = (q − 32)·sc` (q in 0..63, signed eight-bit scales, |w| <= 4096) split as
//!   `hi = w >> 6`, `lo = w & 63`, so `64·C_hi + C_lo` is `s − m`, the integer whose
//!   `cvt(s − m)·d` `k16_value` takes (the −32 offset's share `m` included);
//!
//! where `C = A·B` over the group's four K = 64 chunks (`tdpbssd`, activations signed; A: the
//! activation records' int8 values copied once per call as 16-row tiles, `tile_activations`).
//! Steps (group, slice, one or two activation tiles) run in blocks of slices, group-major within
//! a block, so a group's activation tiles stay in L1 while the block's slices pass; each step's
//! products are issued before the previous step's float step runs and the next step's group is
//! folded (two scratch buffers of each).

use std::arch::asm;
use std::arch::x86_64::*;

use super::{k16_group_value, KCols16, KCols16Kind, ROWS};
use super::{prefetch_block_l2, Q4K, Q6K};
use crate::quant::act::{GROUP, OFF_D, REC};
use crate::quant::{GgmlType, QMatrix, YPtr};

/// Activation rows of a tile (and output rows of a packed slice).
const TILE: usize = 16;
/// Bytes of one plane of a folded group: four K = 64 chunks of 16 B-tile rows of 64 bytes.
const PLANE: usize = 4 * 1024;
/// Software prefetch distance of the weight stream, in steps of the traversal.
const PREFETCH: usize = 4;

/// Fewest activation rows the AMX family runs these tiles for, by type; fewer run `rows_packed`
/// (same bits). Measured on a 2-core AMX Xeon VM (`quant::tests::amx_vs_packed_timing`, an
/// 8,960 × 1,536 matrix): Q4_K level with the packed VNNI kernel at 8 rows, Q6_K (whose fold
/// costs twice Q4_K's) between 8 and 12.
pub(crate) fn min_rows(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q6_K => 12,
        _ => 8,
    }
}

/// Whether these tiles cover a packed `ty` matrix of `n_in` columns.
pub(crate) fn covers(ty: GgmlType, n_in: usize) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) && n_in > 0 && n_in.is_multiple_of(GROUP)
}

/// Whether these tiles take a packed `ty` matrix of `n_in` columns against `n_tok` rows.
pub(crate) fn takes(ty: GgmlType, n_in: usize, n_tok: usize) -> bool {
    covers(ty, n_in) && n_tok >= min_rows(ty)
}

/// A K-quant type whose packed groups fold into two B-tile planes.
trait AmxFold: KCols16Kind {
    /// The power of two of the `hi` plane.
    const SHIFT: u32;
    /// The group's value (before the activation scale) from the folded sum `sum` against the
    /// record at `at`: `k16_group_value` of the sum `rows_packed` builds.
    unsafe fn value(ks: &KCols16, sum: __m512i, at: *const u8) -> __m512;
    /// Folds the packed group at `gp` (scales already in `ks`) into the planes at `b` (`hi` at
    /// `b`, `lo` at `b + PLANE`; unit `j` register `i` is B row `8j + i` of the plane).
    unsafe fn fold(gp: *const u8, ks: &KCols16, b: *mut u8);
}

/// `s` (an i32 per lane) in both i16 halves of its lane, for `vpmullw` by lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn words(s: __m512i) -> __m512i {
    _mm512_or_si512(
        _mm512_and_si512(s, _mm512_set1_epi32(0xFFFF)),
        _mm512_slli_epi32::<16>(s),
    )
}

impl AmxFold for Q4K {
    const SHIFT: u32 = 3;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn value(ks: &KCols16, sum: __m512i, at: *const u8) -> __m512 {
        k16_group_value::<Self>(ks, sum, at)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn fold(gp: *const u8, ks: &KCols16, b: *mut u8) {
        let c7 = _mm512_set1_epi32(7);
        for j in 0..8 {
            let q = Self::unit16_packed(gp, j);
            // Six-bit scales in two three-bit halves: each byte's product stays below 128, so
            // no byte of a word carries into the other.
            let sh = words(_mm512_srli_epi32::<3>(ks.sc[j]));
            let sl = words(_mm512_and_si512(ks.sc[j], c7));
            for (i, qi) in q.iter().enumerate() {
                let at = b.add(64 * (8 * j + i));
                _mm512_storeu_si512(at as *mut __m512i, _mm512_mullo_epi16(*qi, sh));
                _mm512_storeu_si512(at.add(PLANE) as *mut __m512i, _mm512_mullo_epi16(*qi, sl));
            }
        }
    }
}

impl AmxFold for Q6K {
    const SHIFT: u32 = 6;
    /// The fold's sum already has the offset: `Σ (q − 32)·sc·a = s − m`, the integer
    /// `k16_value` converts, so its `cvt(s − m)·d` is `cvt(sum)·d` here.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn value(ks: &KCols16, sum: __m512i, _at: *const u8) -> __m512 {
        _mm512_mul_ps(_mm512_cvtepi32_ps(sum), ks.d)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn fold(gp: *const u8, ks: &KCols16, b: *mut u8) {
        let c32 = _mm512_set1_epi8(32);
        for j in 0..8 {
            let q = Self::unit16_packed(gp, j);
            for (i, qi) in q.iter().enumerate() {
                // Register `i` of unit `j` holds elements `32j + 4i ..`: scale run `2j + i/4`;
                // `(q − 32)·sc` is at most 4096 in magnitude.
                let (hi, lo) = crate::quant::amx::split_products(
                    _mm512_sub_epi8(*qi, c32),
                    words(ks.sc[2 * j + i / 4]),
                );
                let at = b.add(64 * (8 * j + i));
                _mm512_storeu_si512(at as *mut __m512i, hi);
                _mm512_storeu_si512(at.add(PLANE) as *mut __m512i, lo);
            }
        }
    }
}

/// Both planes of a folded group, twice (the group multiplied and the next one).
#[repr(C, align(64))]
struct BPlanes([u8; 2 * PLANE]);

/// The stored products of two (group, activation tile) steps: `C_hi`, `C_lo` of each.
#[repr(C, align(64))]
struct CTiles([i32; 8 * TILE * TILE]);

/// `$name(a, b, c)`: one activation tile against one group's two weight planes, `C_hi = A·B_hi`
/// into `$hi` and `C_lo = A·B_lo` into `$lo` over the four K = 64 chunks, stored at `c` (2 × 1
/// KiB). `A`: chunk `u` at `a + 64u`, 16 rows of 256 bytes (`tile_activations`); `B`: the planes
/// at `b` (chunk `u` at `b + 1024u`, `lo` 4 KiB on). The chunks' `A` alternate between tmm4 and
/// tmm5; two accumulator pairs (tmm0-1, tmm2-3) let one step's products start while the
/// previous step's are stored and scaled.
macro_rules! group_tiles {
    ($name:ident, $hi:literal, $lo:literal) => {
        /// See `group_tiles!`.
        ///
        /// # Safety
        /// Tiles configured by `tile_cfg` on this thread; the pointers must cover the tiles.
        #[inline(always)]
        unsafe fn $name(a: *const u8, b: *const u8, c: *mut i32) {
            asm!(
                concat!("tilezero ", $hi),
                concat!("tilezero ", $lo),
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tileloadd tmm6, [{b} + {s64}*1]",
                "tileloadd tmm7, [{b} + {s64}*1 + 4096]",
                concat!("tdpbssd ", $hi, ", tmm4, tmm6"),
                concat!("tdpbssd ", $lo, ", tmm4, tmm7"),
                "tileloadd tmm5, [{a} + {sa}*1 + 64]",
                "tileloadd tmm6, [{b} + {s64}*1 + 1024]",
                "tileloadd tmm7, [{b} + {s64}*1 + 5120]",
                concat!("tdpbssd ", $hi, ", tmm5, tmm6"),
                concat!("tdpbssd ", $lo, ", tmm5, tmm7"),
                "tileloadd tmm4, [{a} + {sa}*1 + 128]",
                "tileloadd tmm6, [{b} + {s64}*1 + 2048]",
                "tileloadd tmm7, [{b} + {s64}*1 + 6144]",
                concat!("tdpbssd ", $hi, ", tmm4, tmm6"),
                concat!("tdpbssd ", $lo, ", tmm4, tmm7"),
                "tileloadd tmm5, [{a} + {sa}*1 + 192]",
                "tileloadd tmm6, [{b} + {s64}*1 + 3072]",
                "tileloadd tmm7, [{b} + {s64}*1 + 7168]",
                concat!("tdpbssd ", $hi, ", tmm5, tmm6"),
                concat!("tdpbssd ", $lo, ", tmm5, tmm7"),
                concat!("tilestored [{c} + {s64}*1], ", $hi),
                concat!("tilestored [{c} + {s64}*1 + 1024], ", $lo),
                a = in(reg) a,
                b = in(reg) b,
                c = in(reg) c,
                sa = in(reg) GROUP,
                s64 = in(reg) 64usize,
                options(nostack)
            );
        }
    };
}

group_tiles!(tiles_set0, "tmm0", "tmm1");
group_tiles!(tiles_set1, "tmm2", "tmm3");

/// Two activation tiles (`a` and `a + ATILE`, each as in `group_tiles!`) against one group's
/// planes: `C_hi`, `C_lo` of the first into tmm0-1 and of the second into tmm2-3, stored at `c`
/// (4 × 1 KiB). Four independent accumulator chains, each chunk's B tiles loaded once for both.
///
/// # Safety
/// Tiles configured by `tile_cfg` on this thread; the pointers must cover the tiles.
#[inline(always)]
unsafe fn tiles_pair(a: *const u8, b: *const u8, c: *mut i32) {
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        "tileloadd tmm6, [{b} + {s64}*1]",
        "tileloadd tmm7, [{b} + {s64}*1 + 4096]",
        "tileloadd tmm4, [{a} + {sa}*1]",
        "tileloadd tmm5, [{a} + {sa}*1 + 4096]",
        "tdpbssd tmm0, tmm4, tmm6",
        "tdpbssd tmm1, tmm4, tmm7",
        "tdpbssd tmm2, tmm5, tmm6",
        "tdpbssd tmm3, tmm5, tmm7",
        "tileloadd tmm6, [{b} + {s64}*1 + 1024]",
        "tileloadd tmm7, [{b} + {s64}*1 + 5120]",
        "tileloadd tmm4, [{a} + {sa}*1 + 64]",
        "tileloadd tmm5, [{a} + {sa}*1 + 4160]",
        "tdpbssd tmm0, tmm4, tmm6",
        "tdpbssd tmm1, tmm4, tmm7",
        "tdpbssd tmm2, tmm5, tmm6",
        "tdpbssd tmm3, tmm5, tmm7",
        "tileloadd tmm6, [{b} + {s64}*1 + 2048]",
        "tileloadd tmm7, [{b} + {s64}*1 + 6144]",
        "tileloadd tmm4, [{a} + {sa}*1 + 128]",
        "tileloadd tmm5, [{a} + {sa}*1 + 4224]",
        "tdpbssd tmm0, tmm4, tmm6",
        "tdpbssd tmm1, tmm4, tmm7",
        "tdpbssd tmm2, tmm5, tmm6",
        "tdpbssd tmm3, tmm5, tmm7",
        "tileloadd tmm6, [{b} + {s64}*1 + 3072]",
        "tileloadd tmm7, [{b} + {s64}*1 + 7168]",
        "tileloadd tmm4, [{a} + {sa}*1 + 192]",
        "tileloadd tmm5, [{a} + {sa}*1 + 4288]",
        "tdpbssd tmm0, tmm4, tmm6",
        "tdpbssd tmm1, tmm4, tmm7",
        "tdpbssd tmm2, tmm5, tmm6",
        "tdpbssd tmm3, tmm5, tmm7",
        "tilestored [{c} + {s64}*1], tmm0",
        "tilestored [{c} + {s64}*1 + 1024], tmm1",
        "tilestored [{c} + {s64}*1 + 2048], tmm2",
        "tilestored [{c} + {s64}*1 + 3072], tmm3",
        a = in(reg) a,
        b = in(reg) b,
        c = in(reg) c,
        sa = in(reg) GROUP,
        s64 = in(reg) 64usize,
        options(nostack)
    );
}

/// Bytes of one activation tile of one group: 16 rows × 256 int8.
const ATILE: usize = TILE * GROUP;

/// Bytes `tile_activations` writes for `n_tok` rows of `n_in` columns.
pub(crate) fn tile_bytes(n_in: usize, n_tok: usize) -> usize {
    n_in / GROUP * n_tok.div_ceil(TILE) * ATILE
}

/// Copies the int8 values of `n_tok` natural records (`stride` bytes each) into `out` as the A
/// tiles read them: group after group, each group's 16-row tiles one after another (rows past
/// `n_tok` zero), so a slice's pass over its groups reads one contiguous stream.
pub(crate) fn tile_activations(act: &[u8], stride: usize, n_tok: usize, out: &mut [u8]) {
    let n_groups = stride / REC;
    let n_tb = n_tok.div_ceil(TILE);
    for (i, tile) in out
        .chunks_exact_mut(ATILE)
        .take(n_groups * n_tb)
        .enumerate()
    {
        let (g, tb) = (i / n_tb, i % n_tb);
        for (r, row) in tile.chunks_exact_mut(GROUP).enumerate() {
            let t = tb * TILE + r;
            if t < n_tok {
                let at = t * stride + g * REC;
                row.copy_from_slice(&act[at..at + GROUP]);
            } else {
                row.fill(0);
            }
        }
    }
}

/// Packed rows `[r0, r1)` (whole 16-row slices) of a Q4_K or Q6_K matrix against `n_tok`
/// natural records of `stride` bytes in `act`, whose values `tiles` holds as
/// [`tile_activations`] lays them out, on AMX tiles.
///
/// # Safety
/// AMX-INT8 granted on this process (`quant::amx::granted`) and AVX-512 VNNI present; `w` a
/// validated packed matrix that [`covers`], with `n_in = stride / REC * 256`; `act` holds
/// `n_tok` records and `tiles` their tiles; `r0`, `r1` multiples of 16 with `r1 <= w.n_out`;
/// rows `[r0, r1)` of `y` owned by the caller.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rows(
    w: &QMatrix,
    act: &[u8],
    tiles: &[u8],
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    debug_assert!(act.len() >= n_tok * stride);
    debug_assert!(tiles.len() >= w.n_in / GROUP * n_tok.div_ceil(TILE) * ATILE);
    let (act, tiles) = (act.as_ptr(), tiles.as_ptr());
    match w.ty {
        GgmlType::Q4_K => rows_k::<Q4K>(w, act, tiles, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K => rows_k::<Q6K>(w, act, tiles, stride, n_tok, r0, r1, y),
        _ => debug_assert!(false, "AMX packed tiles take Q4_K and Q6_K"),
    }
}

/// Scales and planes of the packed group at `gp` into `ks` and `b`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fold_group<K: AmxFold>(gp: *const u8, ks: &mut KCols16, b: *mut u8) {
    K::scales16_packed(gp, ks);
    K::fold(gp, ks, b);
}

/// Blocks of slices, within a block group after group and slice after slice: fold the step's
/// group (the next one while this one's tiles run), then per one or two activation tiles the
/// products and `rows_packed`'s float step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_k<K: AmxFold>(
    w: &QMatrix,
    act: *const u8,
    tiles: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    if n_tok == 0 || r0 >= r1 {
        return;
    }
    // K = 64 products: all eight tiles 16 rows × 64 bytes (C: tmm0-3, A: tmm4-5, B: tmm6-7).
    let cfg = crate::quant::amx::tile_cfg(64);
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    let (n_groups, rb, gb) = (w.n_in / GROUP, w.row_bytes(), ROWS * K::BB);
    let n_tb = n_tok.div_ceil(TILE);
    let base = w.data.as_ptr();
    // Scratch: every plane is folded and every product tile stored before it is read; the
    // scales are written whole by `scales16_packed` (only `sc`, `bs`, `d`, `ndmin` are read).
    let mut ks: [KCols16; 2] = std::mem::zeroed();
    let mut planes = std::mem::MaybeUninit::<[BPlanes; 2]>::uninit();
    let mut ctiles = std::mem::MaybeUninit::<CTiles>::uninit();
    let pbase = planes.as_mut_ptr() as *mut u8;
    let bptr = |s: usize| pbase.add(s * 2 * PLANE);
    let cbase = ctiles.as_mut_ptr() as *mut i32;
    let cptr = |p: usize| cbase.add(p * 4 * TILE * TILE);
    let n_sl = (r1 - r0) / ROWS;
    let per = n_tb * TILE;
    // Slices per block: a block's accumulators (`[sb, n_tb * 16]` registers) stay within 16 KiB.
    let sb = (16 / n_tb).clamp(1, n_sl);
    // Two blocks' accumulators (the block at hand and the one whose last float step is still
    // pending): slice `sl` at `((sl / sb) % 2) * sb + sl % sb`, activation row `t`, 16 outputs
    // in the lanes.
    let mut acc = vec![_mm512_setzero_ps(); 2 * sb * per];
    let at_acc = |sl: usize| ((sl / sb) % 2 * sb + sl % sb) * per;
    let shift = _mm_cvtsi32_si128(K::SHIFT as i32);
    // One step's float step: the stored products `c` of activation tile `tb` of group `g`
    // (scales `w`), into the accumulators `acc` of its slice.
    let epilogue = |acc: &mut [__m512], g: usize, tb: usize, w: &KCols16, c: *const i32| {
        for r in 0..TILE.min(n_tok - tb * TILE) {
            let t = tb * TILE + r;
            let hi = _mm512_load_si512(c.add(TILE * r) as *const __m512i);
            let lo = _mm512_load_si512(c.add(TILE * (TILE + r)) as *const __m512i);
            let sum = _mm512_add_epi32(_mm512_sll_epi32(hi, shift), lo);
            let at = act.add(t * stride + g * REC);
            let dx = _mm512_set1_ps(*(at.add(OFF_D) as *const f32));
            acc[t] = _mm512_fmadd_ps(K::value(w, sum, at), dx, acc[t]);
        }
    };
    // Step `i` of the traversal: block after block of `sb` slices, within a block group after
    // group, slice after slice (so a group's activation tiles stay in L1 while the block's
    // slices pass, and each output's groups add up in order).
    let total = n_sl * n_groups;
    let order = |i: usize| {
        let b0 = i / (sb * n_groups) * sb;
        let bs = sb.min(n_sl - b0);
        let j = i - b0 * n_groups;
        (b0 + j % bs, j / bs)
    };
    let group_at = |(sl, g): (usize, usize)| base.add((r0 + sl * ROWS) * rb + g * gb);
    let block_done = |i: usize| i + 1 == total || (i + 1).is_multiple_of(sb * n_groups);
    // Retires a pending step: its float step (scales `w`, products at `cptr(pp)`), and once the
    // last step of a block is done, the block's outputs to `y`.
    let retire =
        |acc: &mut [__m512], w: &KCols16, (pi, ptb, pk, pp): (usize, usize, usize, usize)| {
            let (psl, pg) = order(pi);
            for k in 0..pk {
                let c = cptr(pp).add(2 * k * TILE * TILE);
                epilogue(&mut acc[at_acc(psl)..], pg, ptb + k, w, c);
            }
            if ptb + pk == n_tb && block_done(pi) {
                let b0 = psl / sb * sb;
                for sl in b0..(b0 + sb).min(n_sl) {
                    for (t, v) in acc[at_acc(sl)..].iter().take(n_tok).enumerate() {
                        y.write16(t, r0 + sl * ROWS, *v);
                    }
                }
            }
        };
    let mut cur = 0;
    fold_group::<K>(group_at(order(0)), &mut ks[cur], bptr(cur));
    // Software-pipelined: a step's products are issued, then the previous step's float step
    // runs while they compute. Pending: (step, first tile, tiles, product set) and the scale
    // buffer it reads.
    let mut pending: Option<((usize, usize, usize, usize), usize)> = None;
    let mut set = 0;
    for i in 0..total {
        let s = cur;
        let (sl, g) = order(i);
        if g == 0 && sl % sb == 0 {
            let a = at_acc(sl);
            acc[a..a + sb * per].fill(_mm512_setzero_ps());
        }
        // This step's fold was done; the next one's goes into the other buffers once this
        // step's products are issued (asked into L2 `PREFETCH` steps ahead).
        if i + PREFETCH < total {
            prefetch_block_l2(group_at(order(i + PREFETCH)), gb);
        }
        let mut tb = 0;
        while tb < n_tb {
            let nk = (n_tb - tb).min(2);
            let p = set;
            set = 1 - set;
            let a = tiles.add((g * n_tb + tb) * ATILE);
            match (nk, p) {
                (2, _) => tiles_pair(a, bptr(s), cptr(p)),
                (_, 0) => tiles_set0(a, bptr(s), cptr(0)),
                _ => tiles_set1(a, bptr(s), cptr(1)),
            }
            if let Some((step, ps)) = pending {
                retire(&mut acc, &ks[ps], step);
            }
            pending = Some(((i, tb, nk, p), s));
            tb += nk;
        }
        if i + 1 < total {
            fold_group::<K>(group_at(order(i + 1)), &mut ks[1 - s], bptr(1 - s));
        }
        cur = 1 - s;
    }
    if let Some((step, ps)) = pending {
        retire(&mut acc, &ks[ps], step);
    }
    asm!("tilerelease", options(nostack, nomem));
}
