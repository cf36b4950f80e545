//! AVX-512 VNNI kernels: `vpdpbusd` on lane-permuted activations, one int32 accumulator per 256-element group.
//!
//! A 256-element group (one K-quant block, or eight 32-element legacy blocks) is unpacked into four
//! 64-byte registers `R0..R3` of unsigned weights (4/5/6-bit values, or Q8_0 + 128) in which every
//! 128-bit lane holds one 16-element chunk `LAYOUT[r][s]` of the group. A 4x4 dword transpose per
//! 128-bit lane (`transpose4`, 8 unpack instructions) turns them into `Y0..Y3` where dword lane
//! `i = 4s + r` of every `Yk` holds the k-th 4 bytes of chunk `LAYOUT[r][s]`. The activation record is
//! permuted the same way once per call, so
//!
//! `P = dpbusd(dpbusd(dpbusd(dpbusd(init, Y0, A0), Y1, A1), Y2, A2), Y3, A3)`
//!
//! leaves in lane `i` the exact integer dot product of one whole chunk, and every chunk lies in one
//! scale group `sigma(i)`. The group then costs one int→float conversion and one or two FMAs per
//! activation row: `acc += cvt(P) * (LS * DX) [+ LM * AUX]`, with per-lane weight scales `LS`/mins `LM`
//! (built once per weight group) and per-lane activation scales `DX`. Weight offsets (Q4_0 −8, Q5_0 −16,
//! Q8_0 −128, Q6_K −32) enter exactly as the integer start value `init = −offset · Σa` per lane.
//!
//! K-quants, Q4_1 and Q8_0 of this family do not use these lane kernels: they run the AVX2
//! family's exact-integer kernels at 512 bits (`x86_avx2::kcols512` and `x86_avx2::lcols512`:
//! column tiles; one or two K-quant rows: `x86_avx2::knat512`), which measured faster and give the AVX2
//! family's bits. The lane kernels serve Q4_0, Q5_0 and Q5_1; the Q4_K/Q6_K/Q8_0 lane unpacks
//! here serve the AMX-order kernels (`amx_order_rows`).
//!
//! Driver (`rows`): row tiles (≤ `ACC_CAP` accumulators) × k-blocks (activations of all rows in L1)
//! × pairs of output rows (sharing every activation load) × groups (the next group is unpacked
//! before the current one is used, and the weight stream is prefetched `PREFETCH_GROUPS` ahead) ×
//! activation rows. A partial last group (legacy types, `n_in % 256 != 0`) is unpacked in place
//! with the scales of its missing blocks zeroed (a zero-padded copy only at the end of the data).
//!
//! Lane activation record (`REC` = 384 bytes per group):
//! `[0,256)` A0..A3; `[256,320)` AUX: i32 `−offset·Σa` per lane, or f32 mins operand
//! (Q4_K/Q5_K: d·Σa; Q4_1/Q5_1: s/2 of the lane's block); `[320,384)` f32 DX per lane.

use std::arch::x86_64::*;

use super::act::{rec_bsum32, rec_f32, GROUP, OFF_D, REC};
use super::{GgmlType, QMatrix, YPtr};

/// Accumulator registers (one per output row × activation row) kept per row tile: 16 KiB.
const ACC_CAP: usize = 256;
/// Activation bytes of one k-block (all rows of the tile), sized to stay in L1.
const KB_BYTES: usize = 24 * 1024;
/// Software prefetch distance for the weight stream, in groups.
const PREFETCH_GROUPS: usize = 6;

type Layout = [[usize; 4]; 4];
/// K-quants with 32-element sub-blocks (Q4_K, Q5_K): R0 = low nibbles of qs[0..64], etc.
const LAYOUT_K4: Layout = [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]];
/// Natural order (Q6_K, Q8_0): Rr = elements 64r..64r+64.
const LAYOUT_NAT: Layout = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]];
/// Nibble-packed 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1): R0 = low nibbles of blocks 0..4, etc.
const LAYOUT_LEG: Layout = [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]];

/// Scale group of accumulator lane `i`, for chunks of `group_chunks` 16-element chunks per group.
const fn sigma(l: &Layout, group_chunks: usize, add: i32) -> [i32; 16] {
    let mut s = [0i32; 16];
    let mut i = 0;
    while i < 16 {
        s[i] = (l[i % 4][i / 4] / group_chunks) as i32 + add;
        i += 1;
    }
    s
}

/// `vpermt2q` indices that gather register `r`'s four chunks from the 128-byte half holding them.
const fn gather_idx(l: &Layout, r: usize) -> [i64; 8] {
    let mut idx = [0i64; 8];
    let mut s = 0;
    while s < 4 {
        let c = l[r][s] % 8;
        idx[2 * s] = (2 * c) as i64;
        idx[2 * s + 1] = (2 * c + 1) as i64;
        s += 1;
    }
    idx
}

const fn gather_all(l: &Layout) -> [[i64; 8]; 4] {
    [
        gather_idx(l, 0),
        gather_idx(l, 1),
        gather_idx(l, 2),
        gather_idx(l, 3),
    ]
}

static SIG_K4: [i32; 16] = sigma(&LAYOUT_K4, 2, 0);
static SIG_K4_M: [i32; 16] = sigma(&LAYOUT_K4, 2, 8);
static SIG_K6: [i32; 16] = sigma(&LAYOUT_NAT, 1, 0);
static SIG_NAT2: [i32; 16] = sigma(&LAYOUT_NAT, 2, 0);
static SIG_LEG: [i32; 16] = sigma(&LAYOUT_LEG, 2, 0);
static SIG_LEG_M: [i32; 16] = sigma(&LAYOUT_LEG, 2, 8);
static GATHER_K4: [[i64; 8]; 4] = gather_all(&LAYOUT_K4);
static GATHER_NAT: [[i64; 8]; 4] = gather_all(&LAYOUT_NAT);
static GATHER_LEG: [[i64; 8]; 4] = gather_all(&LAYOUT_LEG);

#[inline(always)]
unsafe fn ld_i32x16(a: &[i32; 16]) -> __m512i {
    _mm512_loadu_si512(a.as_ptr() as *const __m512i)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn transpose4(r: [__m512i; 4]) -> [__m512i; 4] {
    let x0 = _mm512_unpacklo_epi32(r[0], r[1]);
    let x1 = _mm512_unpackhi_epi32(r[0], r[1]);
    let x2 = _mm512_unpacklo_epi32(r[2], r[3]);
    let x3 = _mm512_unpackhi_epi32(r[2], r[3]);
    [
        _mm512_unpacklo_epi64(x0, x2),
        _mm512_unpackhi_epi64(x0, x2),
        _mm512_unpacklo_epi64(x1, x3),
        _mm512_unpackhi_epi64(x1, x3),
    ]
}

// ---------------------------------------------------------------------------------------------
// Activation records
// ---------------------------------------------------------------------------------------------

/// Builds the lane record for weight type `ty` from a natural record (see `act`).
///
/// # Safety
/// The CPU must support the enabled features; `out` must hold at least `REC` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn lane_record(ty: GgmlType, nat: &[u8; REC], out: &mut [u8]) {
    let out = &mut out[..REC];
    let (gather, sig, sig_m) = match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => (&GATHER_K4, &SIG_K4, &SIG_K4_M),
        GgmlType::Q6_K => (&GATHER_NAT, &SIG_K6, &SIG_K6),
        GgmlType::Q8_0 => (&GATHER_NAT, &SIG_NAT2, &SIG_NAT2),
        _ => (&GATHER_LEG, &SIG_LEG, &SIG_LEG_M),
    };
    let np = nat.as_ptr();
    let z = [
        _mm512_loadu_si512(np as *const __m512i),
        _mm512_loadu_si512(np.add(64) as *const __m512i),
        _mm512_loadu_si512(np.add(128) as *const __m512i),
        _mm512_loadu_si512(np.add(192) as *const __m512i),
    ];
    let idx = [
        _mm512_loadu_si512(gather[0].as_ptr() as *const __m512i),
        _mm512_loadu_si512(gather[1].as_ptr() as *const __m512i),
        _mm512_loadu_si512(gather[2].as_ptr() as *const __m512i),
        _mm512_loadu_si512(gather[3].as_ptr() as *const __m512i),
    ];
    let r = [
        _mm512_permutex2var_epi64(z[0], idx[0], z[1]),
        _mm512_permutex2var_epi64(z[0], idx[1], z[1]),
        _mm512_permutex2var_epi64(z[2], idx[2], z[3]),
        _mm512_permutex2var_epi64(z[2], idx[3], z[3]),
    ];
    let y = transpose4(r);
    let op = out.as_mut_ptr();
    let ones = _mm512_set1_epi8(1);
    let mut s = _mm512_setzero_si512();
    for (k, yk) in y.iter().enumerate() {
        _mm512_storeu_si512(op.add(64 * k) as *mut __m512i, *yk);
        s = _mm512_dpbusd_epi32(s, ones, *yk);
    }
    let dv = _mm512_loadu_ps(np.add(OFF_D) as *const f32);
    let d0 = _mm512_set1_ps(*(np.add(OFF_D) as *const f32));
    // −offset · Σa (offsets are 8, 16, 32, 128).
    let off = match ty {
        GgmlType::Q4_0 => 8,
        GgmlType::Q5_0 => 16,
        GgmlType::Q6_K => 32,
        GgmlType::Q8_0 => 128,
        _ => 0,
    };
    let neg = _mm512_mullo_epi32(s, _mm512_set1_epi32(-off));
    let (aux, dx) = match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => (
            _mm512_castps_si512(_mm512_mul_ps(_mm512_cvtepi32_ps(s), d0)),
            d0,
        ),
        GgmlType::Q6_K => (neg, d0),
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let sm = _mm512_permutexvar_ps(ld_i32x16(sig_m), dv);
            (
                _mm512_castps_si512(_mm512_mul_ps(sm, _mm512_set1_ps(0.5))),
                _mm512_permutexvar_ps(ld_i32x16(sig), dv),
            )
        }
        GgmlType::Q4_0 => (neg, _mm512_permutexvar_ps(ld_i32x16(sig), dv)),
        GgmlType::Q5_0 => (neg, _mm512_permutexvar_ps(ld_i32x16(sig), dv)),
        _ => (neg, _mm512_permutexvar_ps(ld_i32x16(sig), dv)),
    };
    _mm512_storeu_si512(op.add(256) as *mut __m512i, aux);
    _mm512_storeu_ps(op.add(320) as *mut f32, dx);
}

// ---------------------------------------------------------------------------------------------
// Weight unpacking
// ---------------------------------------------------------------------------------------------

/// One unpacked weight group: transposed unsigned weights, per-lane scales and mins.
#[derive(Clone, Copy)]
struct W {
    y: [__m512i; 4],
    ls: __m512,
    lm: __m512,
}

trait Kind {
    /// Start the integer accumulator at AUX (−offset·Σa).
    const OFFSET: bool;
    /// Add LM · AUX.
    const MINS: bool;
    /// Blocks per 256-element group.
    const BLOCKS: usize;
    /// Bytes per block.
    const BB: usize;
    /// Block (scale group) index of each accumulator lane, for masking a partial last group.
    const SIG: &'static [i32; 16] = &SIG_LEG;
    /// Unpacks the group starting at `p` (`BLOCKS * BB` readable bytes).
    unsafe fn unpack(p: *const u8) -> W;
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
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn f16x2(p: *const u8) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(rd_u32(p) as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// Four 16-byte pieces at `p + off + k * stride` as one register.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load4x16(p: *const u8, stride: usize) -> __m512i {
    let v = _mm512_castsi128_si512(_mm_loadu_si128(p as *const __m128i));
    let v = _mm512_inserti32x4(v, _mm_loadu_si128(p.add(stride) as *const __m128i), 1);
    let v = _mm512_inserti32x4(v, _mm_loadu_si128(p.add(2 * stride) as *const __m128i), 2);
    _mm512_inserti32x4(v, _mm_loadu_si128(p.add(3 * stride) as *const __m128i), 3)
}

/// Low and high nibbles of the 64 bytes in `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles(v: __m512i) -> (__m512i, __m512i) {
    let m4 = _mm512_set1_epi8(0x0F);
    (
        _mm512_and_si512(v, m4),
        _mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
    )
}

/// Per-lane d (and m) of 8 legacy blocks: f16 at `p + b*BB + off_d` (and `+ off_m`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn legacy_scales<const BB: usize>(
    p: *const u8,
    off_m: Option<usize>,
    sig: &[i32; 16],
    sig_m: &[i32; 16],
) -> (__m512, __m512) {
    let mut h = [0u16; 16];
    for (b, v) in h.iter_mut().take(8).enumerate() {
        *v = rd_u16(p.add(b * BB));
    }
    if let Some(om) = off_m {
        for b in 0..8 {
            h[8 + b] = rd_u16(p.add(b * BB + om));
        }
    }
    let v = _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr() as *const __m256i));
    (
        _mm512_permutexvar_ps(ld_i32x16(sig), v),
        _mm512_permutexvar_ps(ld_i32x16(sig_m), v),
    )
}

/// Adds 16 to the bytes of the four legacy-layout registers whose Q5 high bit is set.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_high<const BB: usize>(p: *const u8, off_qh: usize, r: &mut [__m512i; 4]) {
    let c16 = _mm512_set1_epi8(16);
    for half in 0..2 {
        let mut klo = 0u64;
        let mut khi = 0u64;
        for b in 0..4 {
            let qh = rd_u32(p.add((4 * half + b) * BB + off_qh)) as u64;
            klo |= (qh & 0xFFFF) << (16 * b);
            khi |= (qh >> 16) << (16 * b);
        }
        r[2 * half] = _mm512_mask_add_epi8(r[2 * half], klo, r[2 * half], c16);
        r[2 * half + 1] = _mm512_mask_add_epi8(r[2 * half + 1], khi, r[2 * half + 1], c16);
    }
}

struct Q40;
struct Q50;
struct Q51;
struct Q80;
struct Q4K;
struct Q6K;

impl Kind for Q40 {
    const OFFSET: bool = true;
    const MINS: bool = false;
    const BLOCKS: usize = 8;
    const BB: usize = 18;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W {
        let (r0, r1) = nibbles(load4x16(p.add(2), 18));
        let (r2, r3) = nibbles(load4x16(p.add(2 + 4 * 18), 18));
        let (ls, lm) = legacy_scales::<18>(p, None, &SIG_LEG, &SIG_LEG_M);
        W {
            y: transpose4([r0, r1, r2, r3]),
            ls,
            lm,
        }
    }
}

impl Kind for Q50 {
    const OFFSET: bool = true;
    const MINS: bool = false;
    const BLOCKS: usize = 8;
    const BB: usize = 22;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W {
        let (r0, r1) = nibbles(load4x16(p.add(6), 22));
        let (r2, r3) = nibbles(load4x16(p.add(6 + 4 * 22), 22));
        let mut r = [r0, r1, r2, r3];
        q5_high::<22>(p, 2, &mut r);
        let (ls, lm) = legacy_scales::<22>(p, None, &SIG_LEG, &SIG_LEG_M);
        W {
            y: transpose4(r),
            ls,
            lm,
        }
    }
}

impl Kind for Q51 {
    const OFFSET: bool = false;
    const MINS: bool = true;
    const BLOCKS: usize = 8;
    const BB: usize = 24;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W {
        let (r0, r1) = nibbles(load4x16(p.add(8), 24));
        let (r2, r3) = nibbles(load4x16(p.add(8 + 4 * 24), 24));
        let mut r = [r0, r1, r2, r3];
        q5_high::<24>(p, 4, &mut r);
        let (ls, lm) = legacy_scales::<24>(p, Some(2), &SIG_LEG, &SIG_LEG_M);
        W {
            y: transpose4(r),
            ls,
            lm,
        }
    }
}

/// Blocks 2r and 2r+1 of a Q8_0 group as unsigned bytes (q + 128).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_reg(p: *const u8, r: usize) -> __m512i {
    let lo = _mm256_loadu_si256(p.add(34 * (2 * r) + 2) as *const __m256i);
    let hi = _mm256_loadu_si256(p.add(34 * (2 * r + 1) + 2) as *const __m256i);
    _mm512_xor_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1),
        _mm512_set1_epi8(-128),
    )
}

impl Kind for Q80 {
    const OFFSET: bool = true;
    const MINS: bool = false;
    const BLOCKS: usize = 8;
    const BB: usize = 34;
    const SIG: &'static [i32; 16] = &SIG_NAT2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W {
        let r = [q8_reg(p, 0), q8_reg(p, 1), q8_reg(p, 2), q8_reg(p, 3)];
        let (ls, lm) = legacy_scales::<34>(p, None, &SIG_NAT2, &SIG_NAT2);
        W {
            y: transpose4(r),
            ls,
            lm,
        }
    }
}

/// The eight six-bit scales and the eight mins of a Q4_K/Q5_K block (`p` = block start), one
/// byte each in sub-block order (ggml's `get_scale_min_k4`).
///
/// # Safety
/// `p` must cover the block's first 16 bytes.
#[inline(always)]
pub(crate) unsafe fn k4_sc_m8(p: *const u8) -> (u64, u64) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let s = p.add(4);
    let u0 = rd_u32(s);
    let u1 = rd_u32(s.add(4));
    let u2 = rd_u32(s.add(8));
    let m_hi = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let m_lo = u1 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let sc_lo = u0 & KMASK1;
    (
        (sc_lo as u64) | ((sc_hi as u64) << 32),
        (m_lo as u64) | ((m_hi as u64) << 32),
    )
}

/// Per-lane d·sc and −dmin·m of a Q4_K/Q5_K block (`p` = block start).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn k4_lane_scales(p: *const u8) -> (__m512, __m512) {
    let (d, dmin) = f16x2(p);
    let (sc8, m8) = k4_sc_m8(p);
    let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x(m8 as i64, sc8 as i64)));
    (
        _mm512_mul_ps(
            _mm512_permutexvar_ps(ld_i32x16(&SIG_K4), v),
            _mm512_set1_ps(d),
        ),
        _mm512_mul_ps(
            _mm512_permutexvar_ps(ld_i32x16(&SIG_K4_M), v),
            _mm512_set1_ps(-dmin),
        ),
    )
}

impl Kind for Q4K {
    const OFFSET: bool = false;
    const MINS: bool = true;
    const BLOCKS: usize = 1;
    const BB: usize = 144;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W {
        let (r0, r1) = nibbles(_mm512_loadu_si512(p.add(16) as *const __m512i));
        let (r2, r3) = nibbles(_mm512_loadu_si512(p.add(80) as *const __m512i));
        let (ls, lm) = k4_lane_scales(p);
        W {
            y: transpose4([r0, r1, r2, r3]),
            ls,
            lm,
        }
    }
}

impl Kind for Q6K {
    const OFFSET: bool = true;
    const MINS: bool = false;
    const BLOCKS: usize = 1;
    const BB: usize = 210;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> W {
        let m30 = _mm512_set1_epi8(0x30);
        // Word shift counts: bytes 0..32 of a register take one 2-bit field of qh, bytes 32..64 the next.
        let shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        let mut r = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let (lo, hi) = nibbles(_mm512_loadu_si512(p.add(64 * h) as *const __m512i));
            let qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i));
            let h0 = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30);
            let h1 = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30);
            r[2 * h] = _mm512_or_si512(lo, h0);
            r[2 * h + 1] = _mm512_or_si512(hi, h1);
        }
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(rd_u16(p.add(208)) as i32)));
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            p.add(192) as *const __m128i
        )));
        let ls = _mm512_mul_ps(
            _mm512_permutexvar_ps(ld_i32x16(&SIG_K6), sc),
            _mm512_set1_ps(d),
        );
        W {
            y: transpose4(r),
            ls,
            lm: _mm512_setzero_ps(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

/// Unpacks group `g` of a weight row. A partial last group (legacy types, `n_in % 256 != 0`) is
/// unpacked in place when `in_place` says its full 256-element span is readable (it then reads
/// into the next row) with the scales of the missing blocks zeroed; the padded activations of
/// those lanes are zero, so they contribute exactly 0. Otherwise it is read from a zero-padded copy.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_group<K: Kind>(
    wrow: *const u8,
    g: usize,
    n_full: usize,
    tail_bytes: usize,
    in_place: bool,
) -> W {
    let gbytes = K::BLOCKS * K::BB;
    if g < n_full {
        K::unpack(wrow.add(g * gbytes))
    } else if in_place {
        let mut w = K::unpack(wrow.add(g * gbytes));
        let nb = (tail_bytes / K::BB) as i32;
        let valid = _mm512_cmplt_epi32_mask(ld_i32x16(K::SIG), _mm512_set1_epi32(nb));
        w.ls = _mm512_maskz_mov_ps(valid, w.ls);
        w.lm = _mm512_maskz_mov_ps(valid, w.lm);
        w
    } else {
        let mut tail = [0u8; 8 * 34];
        std::ptr::copy_nonoverlapping(wrow.add(g * gbytes), tail.as_mut_ptr(), tail_bytes);
        K::unpack(tail.as_ptr())
    }
}

/// One weight group against one activation record.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn step<K: Kind>(w: &W, a: *const u8, acc: __m512) -> __m512 {
    let p = chunk_dots::<K>(&w.y, a);
    let dx = _mm512_loadu_ps(a.add(320) as *const f32);
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w.ls, dx), acc);
    if K::MINS {
        _mm512_fmadd_ps(w.lm, _mm512_loadu_ps(a.add(256) as *const f32), acc)
    } else {
        acc
    }
}

/// Two weight groups (output rows o and o+1) against one activation record: the activation loads
/// are shared, which halves the L1 traffic per product.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn step2<K: Kind>(
    wa: &W,
    wb: &W,
    a: *const u8,
    acc_a: __m512,
    acc_b: __m512,
) -> (__m512, __m512) {
    let x0 = _mm512_loadu_si512(a as *const __m512i);
    let x1 = _mm512_loadu_si512(a.add(64) as *const __m512i);
    let x2 = _mm512_loadu_si512(a.add(128) as *const __m512i);
    let x3 = _mm512_loadu_si512(a.add(192) as *const __m512i);
    let init = if K::OFFSET {
        _mm512_loadu_si512(a.add(256) as *const __m512i)
    } else {
        _mm512_setzero_si512()
    };
    let mut pa = _mm512_dpbusd_epi32(init, wa.y[0], x0);
    let mut pb = _mm512_dpbusd_epi32(init, wb.y[0], x0);
    pa = _mm512_dpbusd_epi32(pa, wa.y[1], x1);
    pb = _mm512_dpbusd_epi32(pb, wb.y[1], x1);
    pa = _mm512_dpbusd_epi32(pa, wa.y[2], x2);
    pb = _mm512_dpbusd_epi32(pb, wb.y[2], x2);
    pa = _mm512_dpbusd_epi32(pa, wa.y[3], x3);
    pb = _mm512_dpbusd_epi32(pb, wb.y[3], x3);
    let dx = _mm512_loadu_ps(a.add(320) as *const f32);
    let mut acc_a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pa), _mm512_mul_ps(wa.ls, dx), acc_a);
    let mut acc_b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pb), _mm512_mul_ps(wb.ls, dx), acc_b);
    if K::MINS {
        let aux = _mm512_loadu_ps(a.add(256) as *const f32);
        acc_a = _mm512_fmadd_ps(wa.lm, aux, acc_a);
        acc_b = _mm512_fmadd_ps(wb.lm, aux, acc_b);
    }
    (acc_a, acc_b)
}

/// Software prefetch of one weight group (`BLOCKS * BB` bytes from `p`; a hint, never faults).
#[inline(always)]
unsafe fn prefetch_group<K: Kind>(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
    if K::BLOCKS * K::BB > 64 {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64) as *const i8);
    }
    if K::BLOCKS * K::BB > 128 {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(128) as *const i8);
    }
    if K::BLOCKS * K::BB > 192 {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(192) as *const i8);
    }
}

/// The (first output row, group) that the driver reaches `PREFETCH_GROUPS` group steps after
/// (row pair at `o`, group `g`) of k-block `[g0, g1)` in row tile `[o0, o1)`: later groups of this
/// pair, then the next pairs of the tile, then the next k-block (or the next tile's first rows).
#[inline(always)]
fn ahead(
    o: usize,
    g: usize,
    g0: usize,
    g1: usize,
    o0: usize,
    o1: usize,
    n_groups: usize,
) -> (usize, usize) {
    let len = g1 - g0;
    let j = g - g0 + PREFETCH_GROUPS;
    if j < len {
        return (o, g0 + j);
    }
    let (po, pg) = (o + 2 * (j / len), j % len);
    if po < o1 {
        (po, g0 + pg)
    } else if g1 < n_groups {
        (o0 + (po - o1), g1 + pg)
    } else {
        (po, pg)
    }
}

/// Quantized rows `[r0, r1)` against lane activation records.
///
/// # Safety
/// The CPU must support the enabled features; `act` must hold `n_tok * stride` bytes of lane
/// records built by `lane_record` for `w.ty`, `stride >= ceil(n_in/256) * REC`, `r1 <= w.n_out`,
/// and `w` must have been validated (`data.len() == n_out * row_bytes`). K-quant calls of up to
/// `nat_rows` rows run the natural-order kernel, more the column tiles (the same bits).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn quant_rows(
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
    match w.ty {
        GgmlType::Q4_0 => rows::<Q40>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_0 => rows::<Q50>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q5_1 => rows::<Q51>(w, a, stride, n_tok, r0, r1, y),
        // Q4_1 and Q8_0: natural records, the AVX2 family's exact integers and float steps on
        // 512-bit column tiles (`x86_avx2::lcols512`).
        GgmlType::Q4_1 | GgmlType::Q8_0 => {
            super::x86_avx2::lcols512::legacy_rows16(w, act, stride, n_tok, r0, r1, y)
        }
        // K-quants: natural records, the AVX2 family's exact integers and float step on 512-bit
        // column tiles (`x86_avx2::kcols512`).
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            super::x86_avx2::kcols512::k_rows(w, act, stride, n_tok, r0, r1, nat_rows, y)
        }
        _ => {}
    }
}

/// Row tiles × k-blocks × rows × groups × activation rows. The accumulators of a row tile (at most
/// `ACC_CAP` registers) and the k-block of activation records they read stay in L1; each weight
/// group is loaded and unpacked exactly once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
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
    // Whether row `o`'s partial last group can be read as a whole group (it is not the end of the data).
    let data_len = w.data.len();
    let in_place = |o: usize| o * rb + (n_full + 1) * gbytes <= data_len;
    let mut acc = [_mm512_setzero_ps(); ACC_CAP];
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
                *v = _mm512_setzero_ps();
            }
            let mut g0 = 0;
            while g0 < n_groups {
                let g1 = (g0 + kb).min(n_groups);
                let mut o = o0;
                // Pairs of output rows share every activation load.
                while o + 2 <= o1 {
                    let wra = w.data.as_ptr().add(o * rb);
                    let wrb = wra.add(rb);
                    let acc_a = acc.as_mut_ptr().add((o - o0) * nt);
                    let acc_b = acc_a.add(nt);
                    // Unpack group g+1 before the row loop of group g, so its load/shuffle latency overlaps.
                    let mut nxt = (
                        unpack_group::<K>(wra, g0, n_full, tail_bytes, in_place(o)),
                        unpack_group::<K>(wrb, g0, n_full, tail_bytes, in_place(o + 1)),
                    );
                    for g in g0..g1 {
                        let (wa, wb) = nxt;
                        // Weights stream from DRAM once: ask for the group `PREFETCH_GROUPS` steps
                        // ahead in traversal order (this pair's row, then the next pair's, then the
                        // next k-block's or tile's first rows), so each pair and k-block starts warm.
                        let (po, pg) = ahead(o, g, g0, g1, o0, o1, n_groups);
                        let pa = w.data.as_ptr().wrapping_add(po * rb + pg * gbytes);
                        prefetch_group::<K>(pa);
                        prefetch_group::<K>(pa.wrapping_add(rb));
                        if g + 1 < g1 {
                            nxt = (
                                unpack_group::<K>(wra, g + 1, n_full, tail_bytes, in_place(o)),
                                unpack_group::<K>(wrb, g + 1, n_full, tail_bytes, in_place(o + 1)),
                            );
                        }
                        let ag = ab.add(g * REC);
                        for t in 0..nt {
                            let (pa, pb) = (acc_a.add(t), acc_b.add(t));
                            let (va, vb) = step2::<K>(&wa, &wb, ag.add(t * stride), *pa, *pb);
                            *pa = va;
                            *pb = vb;
                        }
                    }
                    o += 2;
                }
                if o < o1 {
                    let wrow = w.data.as_ptr().add(o * rb);
                    let accs = acc.as_mut_ptr().add((o - o0) * nt);
                    for g in g0..g1 {
                        let (po, pg) = ahead(o, g, g0, g1, o0, o1, n_groups);
                        prefetch_group::<K>(w.data.as_ptr().wrapping_add(po * rb + pg * gbytes));
                        let wv = unpack_group::<K>(wrow, g, n_full, tail_bytes, in_place(o));
                        let ag = ab.add(g * REC);
                        for t in 0..nt {
                            let ap = accs.add(t);
                            *ap = step::<K>(&wv, ag.add(t * stride), *ap);
                        }
                    }
                }
                g0 = g1;
            }
            // Sums of 16 output rows at a time for one activation row: one contiguous store.
            let mut o = o0;
            while o + 16 <= o1 {
                for t in 0..nt {
                    let mut v = [_mm512_setzero_ps(); 16];
                    for (i, vi) in v.iter_mut().enumerate() {
                        *vi = acc[(o + i - o0) * nt + t];
                    }
                    y.write16(t0 + t, o, reduce16(&v));
                }
                o += 16;
            }
            for o in o..o1 {
                for t in 0..nt {
                    y.write(t0 + t, o, _mm512_reduce_add_ps(acc[(o - o0) * nt + t]));
                }
            }
            o0 = o1;
        }
        t0 += nt;
    }
}

/// Lane `j` = the sum of the 16 lanes of `v[j]`, added exactly as `_mm512_reduce_add_ps` adds
/// them (halves: lane i + lane i+8, then i + i+4, i + i+2, 0 + 1), so every sum has the bits of a
/// one-at-a-time reduction, in ~46 shuffles and adds instead of ~130. (AVX-512F only: the
/// attention kernels use it too.)
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
    reduce16_gen::<false>(v)
}

/// `reduce16` of 32-bit integers (exact, so the add order does not matter): lane `j` = the sum of
/// the 16 lanes of `v[j]`.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn reduce16_epi32(v: &[__m512i; 16]) -> __m512i {
    let f: [__m512; 16] = std::array::from_fn(|j| _mm512_castsi512_ps(v[j]));
    _mm512_castps_si512(reduce16_gen::<true>(&f))
}

/// `a + b` as floats, or (`INT`) as 32-bit integers on the same bits.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn add16<const INT: bool>(a: __m512, b: __m512) -> __m512 {
    if INT {
        _mm512_castsi512_ps(_mm512_add_epi32(
            _mm512_castps_si512(a),
            _mm512_castps_si512(b),
        ))
    } else {
        _mm512_add_ps(a, b)
    }
}

/// `reduce16`'s shuffles with float adds, or (`INT`) 32-bit integer adds on the same bits.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16_gen<const INT: bool>(v: &[__m512; 16]) -> __m512 {
    // Step 1: [v_j.lo + v_j.hi | v_{j+8}.lo + v_{j+8}.hi] (8 partial sums each).
    let mut b = [_mm512_setzero_ps(); 8];
    for j in 0..8 {
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(v[j], v[j + 8]);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(v[j], v[j + 8]);
        b[j] = add16::<INT>(lo, hi);
    }
    reduce16_steps::<INT>(&b)
}

/// `reduce16_epi32` of 16 vectors already folded to eight lanes each (lane `j` = the sum of the
/// eight lanes of `v[j]`): `reduce16`'s steps from the second on.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn reduce16_halves_epi32(v: &[__m256i; 16]) -> __m512i {
    let b: [__m512; 8] = std::array::from_fn(|j| {
        _mm512_castsi512_ps(_mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(v[j]),
            v[j + 8],
        ))
    });
    _mm512_castps_si512(reduce16_steps::<true>(&b))
}

/// Steps 2-4 of `reduce16_gen` on its step 1's `b`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn reduce16_steps<const INT: bool>(b: &[__m512; 8]) -> __m512 {
    // Step 2: 128-bit quarters [b_j.q0 + b_j.q1, b_j.q2 + b_j.q3, b_{j+4}.q0 + .q1, ...].
    let mut c = [_mm512_setzero_ps(); 4];
    for j in 0..4 {
        let x = _mm512_shuffle_f32x4::<0b10_00_10_00>(b[j], b[j + 4]);
        let y = _mm512_shuffle_f32x4::<0b11_01_11_01>(b[j], b[j + 4]);
        c[j] = add16::<INT>(x, y);
    }
    // Step 3: within each quarter [c_j.0 + c_j.2, c_j.1 + c_j.3, c_{j+2}.0 + .2, c_{j+2}.1 + .3].
    let mut d = [_mm512_setzero_ps(); 2];
    for j in 0..2 {
        let x = _mm512_shuffle_ps::<0b01_00_01_00>(c[j], c[j + 2]);
        let y = _mm512_shuffle_ps::<0b11_10_11_10>(c[j], c[j + 2]);
        d[j] = add16::<INT>(x, y);
    }
    // Step 4: the last pair, then lanes back into `v` order.
    let x = _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]);
    let y = _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]);
    let order = _mm512_loadu_si512(REDUCE16_ORDER.as_ptr() as *const __m512i);
    _mm512_permutexvar_ps(order, add16::<INT>(x, y))
}

/// The lane where `reduce16`'s step 4 leaves the sum of `v[j]`.
static REDUCE16_ORDER: [i32; 16] = reduce16_order();

const fn reduce16_order() -> [i32; 16] {
    // Follow each accumulator through the four steps:
    // 1: v[j] lands in b[j % 8], half j / 8;
    // 2: b[j] half h -> c[j % 4], quarter h + 2 * (j / 4);
    // 3: c[j] quarter q -> d[j % 2] quarter q, element pair j / 2 (elements 0-1 or 2-3);
    // 4: d[k] quarter q pair p -> lane 4q + 2k + p.
    let mut pos = [0i32; 16];
    let mut j = 0;
    while j < 16 {
        let (bj, h) = (j % 8, j / 8);
        let (cj, q) = (bj % 4, h + 2 * (bj / 4));
        let (dk, pair) = (cj % 2, cj / 2);
        pos[j] = (4 * q + 2 * dk + pair) as i32;
        j += 1;
    }
    pos
}

// ---------------------------------------------------------------------------------------------
// AMX-order kernel
// ---------------------------------------------------------------------------------------------

/// Bytes of one AMX-order activation record: the lane record, then 16 f32 (Q8_K: `d`, then the
/// eight 32-element sums of the quantized values; Q8_0: the eight block scales).
pub(crate) const AREC: usize = REC + 64;

/// Builds the AMX-order record of one group from a natural record (see `AREC`).
///
/// # Safety
/// As `lane_record`; `out` must hold at least `AREC` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn amx_order_record(ty: GgmlType, nat: &[u8; REC], out: &mut [u8]) {
    lane_record(ty, nat, out);
    // The same values, converted the same way, as the AMX record's (`amx::pack_record`).
    let mut v = [0f32; 16];
    if ty == GgmlType::Q8_0 {
        for (j, vj) in v.iter_mut().take(8).enumerate() {
            *vj = rec_f32(nat, OFF_D + 4 * j);
        }
    } else {
        v[0] = rec_f32(nat, OFF_D);
        for j in 0..8 {
            v[1 + j] = rec_bsum32(nat, j);
        }
    }
    _mm512_storeu_ps(
        out.as_mut_ptr().add(REC) as *mut f32,
        _mm512_loadu_ps(v.as_ptr()),
    );
}

/// Lane of the chunk-dot register that holds natural 16-element chunk `c`: lane `4s + r` holds
/// chunk `LAYOUT[r][s]`.
const fn lane_of(l: &Layout) -> [usize; 16] {
    let mut inv = [0usize; 16];
    let mut i = 0;
    while i < 16 {
        inv[l[i % 4][i / 4]] = i;
        i += 1;
    }
    inv
}

const LANE_NAT: [usize; 16] = lane_of(&LAYOUT_NAT);

/// 16×16 dword transpose: lane `i` of output `j` is lane `j` of input `i`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn transpose16(r: &mut [__m512i; 16]) {
    let mut t = [_mm512_setzero_si512(); 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    // u[4k + m], 128-bit lane L: column 4L + m of rows 4k..4k+4.
    let mut u = [_mm512_setzero_si512(); 16];
    for k in 0..4 {
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for m in 0..4 {
        let ab_lo = _mm512_shuffle_i32x4::<0x44>(u[m], u[4 + m]);
        let ab_hi = _mm512_shuffle_i32x4::<0xEE>(u[m], u[4 + m]);
        let cd_lo = _mm512_shuffle_i32x4::<0x44>(u[8 + m], u[12 + m]);
        let cd_hi = _mm512_shuffle_i32x4::<0xEE>(u[8 + m], u[12 + m]);
        r[m] = _mm512_shuffle_i32x4::<0x88>(ab_lo, cd_lo);
        r[4 + m] = _mm512_shuffle_i32x4::<0xDD>(ab_lo, cd_lo);
        r[8 + m] = _mm512_shuffle_i32x4::<0x88>(ab_hi, cd_hi);
        r[12 + m] = _mm512_shuffle_i32x4::<0xDD>(ab_hi, cd_hi);
    }
}

/// The Q4_K block-head fields of 16 rows, one row per lane: f16 `d` and `dmin` as f32, and the
/// six-bit mins `m[j]` of sub-block `j` as i32 (the kernels read the scales per row).
pub(crate) struct K4Fields {
    pub(crate) d: __m512,
    pub(crate) dmin: __m512,
    pub(crate) m: [__m512i; 8],
}

/// The Q4_K block-head fields of 16 rows from their 16-byte heads at `heads + 64 i` (f16 d and
/// dmin, then the 12 bytes of packed six-bit scales and mins): ggml's `get_scale_min_k4` for the
/// mins, vectorized over rows.
///
/// # Safety
/// AVX-512 present; `heads` must cover 16 heads of 64 bytes each (the first 16 of each read).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k4_fields_by_row(heads: *const u8) -> K4Fields {
    let z: [__m512i; 4] = std::array::from_fn(|k| {
        let r = |i: usize| _mm_loadu_si128(heads.add(64 * (4 * k + i)) as *const __m128i);
        let v = _mm512_castsi128_si512(r(0));
        let v = _mm512_inserti32x4::<1>(v, r(1));
        let v = _mm512_inserti32x4::<2>(v, r(2));
        _mm512_inserti32x4::<3>(v, r(3))
    });
    // Field f (dword f of each head) of the 16 rows.
    let field = |f: i32| {
        let idx = _mm512_setr_epi32(
            f,
            4 + f,
            8 + f,
            12 + f,
            16 + f,
            20 + f,
            24 + f,
            28 + f,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        );
        let lo = _mm512_permutex2var_epi32(z[0], idx, z[1]);
        let hi = _mm512_permutex2var_epi32(z[2], idx, z[3]);
        _mm512_shuffle_i64x2::<0x44>(lo, hi)
    };
    let (dd, u1, u2) = (field(0), field(2), field(3));
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
    let byte = |v: __m512i, sh: u32, mask: i32| {
        _mm512_and_si512(
            _mm512_srlv_epi32(v, _mm512_set1_epi32(sh as i32)),
            _mm512_set1_epi32(mask),
        )
    };
    let mut m = [_mm512_setzero_si512(); 8];
    for k in 0..4 {
        let sh = 8 * k as u32;
        m[k] = byte(u1, sh, 63);
        m[4 + k] = _mm512_or_si512(
            byte(u2, sh + 4, 0xF),
            _mm512_slli_epi32::<4>(byte(u1, sh + 6, 3)),
        );
    }
    K4Fields { d, dmin, m }
}

/// Where a kernel that walks 16-row tiles group by group (all 16 rows of a group, then the next
/// group) prefetches while at group `g` of the tile at row `o0`: the same rows `dist` groups
/// ahead, or past the last group the next tile's rows (its first groups). Returns (first row,
/// group); rows past the matrix only make harmless prefetches.
#[inline(always)]
pub(crate) fn group_ahead(o0: usize, g: usize, n_groups: usize, dist: usize) -> (usize, usize) {
    if g + dist < n_groups {
        (o0, g + dist)
    } else {
        (o0 + 16, (g + dist - n_groups).min(n_groups - 1))
    }
}

/// The exact integer dot products of one unpacked group's 16 chunks (`y`, lane layout) with one
/// activation record at `a`, the weight offset's `init` included.
///
/// # Safety
/// AVX-512 VNNI present; `a` must cover one lane record (`REC` bytes) built for `K`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn chunk_dots<K: Kind>(y: &[__m512i; 4], a: *const u8) -> __m512i {
    let mut d = if K::OFFSET {
        _mm512_loadu_si512(a.add(256) as *const __m512i)
    } else {
        _mm512_setzero_si512()
    };
    for (k, yk) in y.iter().enumerate() {
        d = _mm512_dpbusd_epi32(d, *yk, _mm512_loadu_si512(a.add(64 * k) as *const __m512i));
    }
    d
}

/// Writes the AMX-order kernels' accumulators (`acc[t]`: output rows `o0 .. o0 + nr` in the
/// lanes, activation row `t0 + t`) to `y`: one store per activation row for a whole tile.
///
/// # Safety
/// AVX-512 present; rows `o0 .. o0 + nr` (`nr <= 16`) belong to the calling task's range of `y`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn write_rows16(acc: &[__m512], t0: usize, o0: usize, nr: usize, y: YPtr) {
    let mut lanes = [0f32; 16];
    for (t, a) in acc.iter().enumerate() {
        if nr == 16 {
            y.write16(t0 + t, o0, *a);
            continue;
        }
        _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
        for (i, &v) in lanes.iter().take(nr).enumerate() {
            y.write(t0 + t, o0 + i, v);
        }
    }
}

/// Activation rows per pass of `amx_order_rows` (the AMX kernels take larger batches).
const AO_TOK: usize = 8;

/// Quantized rows `[r0, r1)` with the AMX kernels' arithmetic (`amx`): for Q4_K, Q6_K and Q8_0
/// groups of 256, every output `y[t, o]` is the same sequence of f32 operations as in the AMX
/// epilogue, so one row computed here is bit-identical to the same row of an AMX batch. Per 16
/// output rows and group, from the chunk dot products of each row (`vpdpbusd`, exact integers as
/// the tile products): Q4_K and Q6_K sum them, times their scales, into the group's exact
/// integer (`ao_fold`); Q8_0 transposes them to one register per chunk with the 16 rows in its
/// lanes, adds the chunks of a block (exact) and runs the f32 chain over the blocks with the AMX
/// scale values (`amx::q80_scales`) (`ao_q80`).
///
/// # Safety
/// The CPU must support the enabled features; `ty` must be Q4_K, Q6_K or Q8_0 with
/// `n_in % 256 == 0`; `act` must hold `n_tok * stride` bytes of `amx_order_record`s,
/// `stride >= n_in/256 * AREC`; `r1 <= w.n_out`; `w` validated.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn amx_order_rows(
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
        GgmlType::Q4_K => ao_fold::<Q4K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q6_K => ao_fold::<Q6K>(w, a, stride, n_tok, r0, r1, y),
        GgmlType::Q8_0 => ao_q80(w, a, stride, n_tok, r0, r1, y),
        _ => {}
    }
}

/// A type whose sub-block scales the AMX tiles fold into the weights (`amx`, `Kind::FOLD`): its
/// AMX-order kernel `ao_fold` forms the same exact group integer from the chunk dot products.
trait Fold: Kind {
    /// Q4_K's mins.
    const FOLD_MINS: bool;
    /// The chunk registers of `Kind::unpack`, and per lane the integer scale of its sub-block.
    unsafe fn int_unpack(p: *const u8) -> ([__m512i; 4], __m512i);
    /// The chunk dot products `c` times their scales `s`.
    unsafe fn scaled(c: __m512i, s: __m512i) -> __m512i;
}

impl Fold for Q4K {
    const FOLD_MINS: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn int_unpack(p: *const u8) -> ([__m512i; 4], __m512i) {
        let (r0, r1) = nibbles(_mm512_loadu_si512(p.add(16) as *const __m512i));
        let (r2, r3) = nibbles(_mm512_loadu_si512(p.add(80) as *const __m512i));
        let (sc8, _) = k4_sc_m8(p);
        // The six-bit scales as i32 with the high 16 bits zero, for `vpmaddwd`.
        let sc = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(sc8 as i64));
        (
            transpose4([r0, r1, r2, r3]),
            _mm512_permutexvar_epi32(ld_i32x16(&SIG_K4), sc),
        )
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scaled(c: __m512i, s: __m512i) -> __m512i {
        // A 16-element chunk sum of 4-bit weights fits 16 bits.
        _mm512_madd_epi16(c, s)
    }
}

impl Fold for Q6K {
    const FOLD_MINS: bool = false;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn int_unpack(p: *const u8) -> ([__m512i; 4], __m512i) {
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(192) as *const __m128i));
        (
            Q6K::unpack(p).y,
            _mm512_permutexvar_epi32(ld_i32x16(&SIG_K6), sc),
        )
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn scaled(c: __m512i, s: __m512i) -> __m512i {
        _mm512_mullo_epi32(c, s)
    }
}

/// Q4_K and Q6_K rows of the AMX family below the tiles' batch size, with the tiles' arithmetic
/// (`amx`, `Kind::FOLD`): per output row, activation row and group the exact integer
/// `I = Σ_j sc_j · Σ_{k in j} q_k a_k`, then `acc = fma(cvt(I), d·dx, acc)`; for Q4_K also the
/// mins `M = Σ_j m_j · bsum_j` and `acc = fnmadd(M, dmin·dx, acc)`. Per 16 output rows and
/// group: each row's chunk dot products (`vpdpbusd`) times its lanes' scales (`Fold::scaled`)
/// leave 16 registers per activation row, summed lane-wise into one register with the 16 rows in
/// its lanes (`reduce16_epi32`), so the f32 chain runs for 16 rows at once.
///
/// # Safety
/// As `amx_order_rows`, for Q4_K or Q6_K.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn ao_fold<K: Fold>(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let gb = K::BB;
    let n_groups = w.n_in / GROUP;
    let base = w.data.as_ptr();
    let mut part = [[_mm512_setzero_si512(); 16]; AO_TOK];
    let mut heads = [[0u8; 64]; 16];
    let mut dh = [0u16; 16];
    let mut t0 = 0;
    while t0 < n_tok {
        let nt = (n_tok - t0).min(AO_TOK);
        let mut o0 = r0;
        while o0 < r1 {
            let nr = (r1 - o0).min(16);
            let mut acc = [_mm512_setzero_ps(); AO_TOK];
            for g in 0..n_groups {
                let (po, pg) = group_ahead(o0, g, n_groups, PREFETCH_GROUPS);
                for (i, head) in heads.iter_mut().enumerate() {
                    // Rows past the end repeat the last one (their results are dropped).
                    let p = base.add((o0 + i.min(nr - 1)) * rb + g * gb);
                    prefetch_group::<K>(base.wrapping_add((po + i) * rb + pg * gb));
                    if K::FOLD_MINS {
                        _mm_storeu_si128(
                            head.as_mut_ptr() as *mut __m128i,
                            _mm_loadu_si128(p as *const __m128i),
                        );
                    } else {
                        dh[i] = rd_u16(p.add(gb - 2));
                    }
                    let (wy, scl) = K::int_unpack(p);
                    for (t, pt) in part.iter_mut().take(nt).enumerate() {
                        let ag = act.add((t0 + t) * stride + g * AREC);
                        pt[i] = K::scaled(chunk_dots::<K>(&wy, ag), scl);
                    }
                }
                let f = if K::FOLD_MINS {
                    k4_fields_by_row(heads.as_ptr() as *const u8)
                } else {
                    K4Fields {
                        d: _mm512_cvtph_ps(_mm256_loadu_si256(dh.as_ptr() as *const __m256i)),
                        dmin: _mm512_setzero_ps(),
                        m: [_mm512_setzero_si512(); 8],
                    }
                };
                let mf: [__m512; 8] = std::array::from_fn(|j| _mm512_cvtepi32_ps(f.m[j]));
                for (t, pt) in part.iter().take(nt).enumerate() {
                    let v = act.add((t0 + t) * stride + g * AREC + REC) as *const f32;
                    let dx = _mm512_set1_ps(*v);
                    let isum = _mm512_cvtepi32_ps(reduce16_epi32(pt));
                    acc[t] = _mm512_fmadd_ps(isum, _mm512_mul_ps(f.d, dx), acc[t]);
                    if !K::FOLD_MINS {
                        continue;
                    }
                    let mut mins = _mm512_mul_ps(mf[0], _mm512_set1_ps(*v.add(1)));
                    for (j, mj) in mf.iter().enumerate().skip(1) {
                        mins = _mm512_fmadd_ps(*mj, _mm512_set1_ps(*v.add(1 + j)), mins);
                    }
                    acc[t] = _mm512_fnmadd_ps(mins, _mm512_mul_ps(f.dmin, dx), acc[t]);
                }
            }
            write_rows16(&acc[..nt], t0, o0, nr, y);
            o0 += 16;
        }
        t0 += nt;
    }
}

/// `amx_order_rows` for Q8_0: per 32-element block `G += cvt(C_b) · (dx_b · d_b)`.
// `j` indexes the chunk registers, the scales and the record values alike.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn ao_q80(
    w: &QMatrix,
    act: *const u8,
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let gbytes = Q80::BLOCKS * Q80::BB;
    let n_groups = w.n_in / GROUP;
    let base = w.data.as_ptr();
    // Per row tile and group: the chunk dot products of its 16 rows per activation row, and the
    // rows' 16 scales (`amx::q80_scales`), combined as soon as the group is done.
    let mut part = [[_mm512_setzero_si512(); 16]; AO_TOK];
    let mut scales = [_mm512_setzero_si512(); 16];
    let mut t0 = 0;
    while t0 < n_tok {
        let nt = (n_tok - t0).min(AO_TOK);
        let mut o0 = r0;
        while o0 < r1 {
            let nr = (r1 - o0).min(16);
            let mut acc = [_mm512_setzero_ps(); AO_TOK];
            for g in 0..n_groups {
                let (po, pg) = group_ahead(o0, g, n_groups, PREFETCH_GROUPS);
                for (i, sc) in scales.iter_mut().enumerate() {
                    // Rows past the end repeat the last one (their results are dropped).
                    let p = base.add((o0 + i.min(nr - 1)) * rb + g * gbytes);
                    prefetch_group::<Q80>(base.wrapping_add((po + i) * rb + pg * gbytes));
                    let wv = Q80::unpack(p);
                    let mut ws = [0f32; 16];
                    super::amx::q80_scales(p, ws.as_mut_ptr());
                    *sc = _mm512_loadu_si512(ws.as_ptr() as *const __m512i);
                    for (t, pt) in part.iter_mut().take(nt).enumerate() {
                        pt[i] = chunk_dots::<Q80>(&wv.y, act.add((t0 + t) * stride + g * AREC));
                    }
                }
                // Scales and chunk sums with the 16 rows in the lanes of one register each.
                let mut wsi = scales;
                transpose16(&mut wsi);
                let ws: [__m512; 16] = std::array::from_fn(|j| _mm512_castsi512_ps(wsi[j]));
                for (t, pt) in part.iter_mut().take(nt).enumerate() {
                    transpose16(pt);
                    let c = &*pt;
                    let v = act.add((t0 + t) * stride + g * AREC + REC) as *const f32;
                    let mut gs = _mm512_setzero_ps();
                    for j in 0..8 {
                        let s = _mm512_add_epi32(c[LANE_NAT[2 * j]], c[LANE_NAT[2 * j + 1]]);
                        let sc = _mm512_mul_ps(_mm512_set1_ps(*v.add(j)), ws[j]);
                        gs = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, gs);
                    }
                    acc[t] = _mm512_add_ps(acc[t], gs);
                }
            }
            write_rows16(&acc[..nt], t0, o0, nr, y);
            o0 += 16;
        }
        t0 += nt;
    }
}

// ---------------------------------------------------------------------------------------------
// Float weights
// ---------------------------------------------------------------------------------------------

trait FKind {
    const BYTES: usize;
    /// 16 weights starting at element `i`, the first `n` of them (`n <= 16`) if `n < 16`.
    unsafe fn load(p: *const u8, i: usize, n: usize) -> __m512;
}

struct F32W;
struct F16W;
struct Bf16W;

impl FKind for F32W {
    const BYTES: usize = 4;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn load(p: *const u8, i: usize, n: usize) -> __m512 {
        let q = p.add(4 * i) as *const f32;
        if n >= 16 {
            _mm512_loadu_ps(q)
        } else {
            _mm512_maskz_loadu_ps(((1u32 << n) - 1) as u16, q)
        }
    }
}

impl FKind for F16W {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn load(p: *const u8, i: usize, n: usize) -> __m512 {
        let q = p.add(2 * i);
        let h = if n >= 16 {
            _mm256_loadu_si256(q as *const __m256i)
        } else {
            _mm256_maskz_loadu_epi16(((1u32 << n) - 1) as u16, q as *const i16)
        };
        _mm512_cvtph_ps(h)
    }
}

impl FKind for Bf16W {
    const BYTES: usize = 2;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn load(p: *const u8, i: usize, n: usize) -> __m512 {
        let q = p.add(2 * i);
        let h = if n >= 16 {
            _mm256_loadu_si256(q as *const __m256i)
        } else {
            _mm256_maskz_loadu_epi16(((1u32 << n) - 1) as u16, q as *const i16)
        };
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }
}

/// Float-weight rows `[r0, r1)` against f32 activations.
///
/// # Safety
/// The CPU must support the enabled features; `w` validated, `x.len() == n_tok * n_in`, `r1 <= n_out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn float_rows(
    w: &QMatrix,
    x: &[f32],
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    match w.ty {
        GgmlType::F32 => frows::<F32W>(w, x, n_tok, r0, r1, y),
        GgmlType::F16 => frows::<F16W>(w, x, n_tok, r0, r1, y),
        GgmlType::BF16 => frows::<Bf16W>(w, x, n_tok, r0, r1, y),
        _ => {}
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn frows<K: FKind>(w: &QMatrix, x: &[f32], n_tok: usize, r0: usize, r1: usize, y: YPtr) {
    let n_in = w.n_in;
    for o in r0..r1 {
        let wrow = w.data.as_ptr().add(o * n_in * K::BYTES);
        let mut t0 = 0;
        while t0 < n_tok {
            let xp = x.as_ptr().add(t0 * n_in);
            let nt = n_tok - t0;
            if nt >= 4 {
                fdot::<K, 4>(wrow, xp, n_in, y, t0, o);
                t0 += 4;
            } else if nt >= 2 {
                fdot::<K, 2>(wrow, xp, n_in, y, t0, o);
                t0 += 2;
            } else {
                fdot::<K, 1>(wrow, xp, n_in, y, t0, o);
                t0 += 1;
            }
        }
    }
}

/// y[t0 + j, o] = dot(w row, x row t0 + j) for j < N; two accumulators per row hide FMA latency.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fdot<K: FKind, const N: usize>(
    wrow: *const u8,
    xp: *const f32,
    n_in: usize,
    y: YPtr,
    t0: usize,
    o: usize,
) {
    let mut a0 = [_mm512_setzero_ps(); N];
    let mut a1 = [_mm512_setzero_ps(); N];
    let mut i = 0;
    while i + 32 <= n_in {
        let w0 = K::load(wrow, i, 16);
        let w1 = K::load(wrow, i + 16, 16);
        for (j, (c0, c1)) in a0.iter_mut().zip(a1.iter_mut()).enumerate() {
            let xr = xp.add(j * n_in + i);
            *c0 = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), *c0);
            *c1 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr.add(16)), *c1);
        }
        i += 32;
    }
    while i < n_in {
        let n = (n_in - i).min(16);
        let wv = K::load(wrow, i, n);
        let m = ((1u32 << n) - 1) as u16;
        for (j, c0) in a0.iter_mut().enumerate() {
            let xv = _mm512_maskz_loadu_ps(m, xp.add(j * n_in + i));
            *c0 = _mm512_fmadd_ps(wv, xv, *c0);
        }
        i += n;
    }
    for (j, (c0, c1)) in a0.iter().zip(&a1).enumerate() {
        y.write(t0 + j, o, _mm512_reduce_add_ps(_mm512_add_ps(*c0, *c1)));
    }
}
