//! Activation quantization to the weights' dot type (Q8_0 / Q8_1 / Q8_K), numerically as llama.cpp on x86.
//!
//! A row of `n_in` activations becomes `ceil(n_in / 256)` records of `REC` bytes, one per 256-element
//! group (legacy 32-element types are zero-padded to whole groups). The natural record used by the
//! scalar and AVX2 kernels is
//!
//! ```text
//! [0, 256)   i8  q[256]     quantized values, natural order
//! [256, 288) f32 d[8]       Q8_0/Q8_1: per 32-block scale (f16-rounded, as ggml stores it); Q8_K: d[0]
//! [288, 320) f32 s[8]       Q8_1: d * sum(q) per block (f16-rounded)
//! [320, 352) i16 bsums[16]  Q8_K: sums of 16 consecutive q
//! [352, 368) i16 bsums32[8] Q8_K: sums of 32 consecutive q (pairs of bsums)
//! [352, 384) i32 qsum[8]    Q8_0/Q8_1: sum(q) per block, exact
//! [368, 384) zero           Q8_K
//! ```
//!
//! The AVX-512 kernels for Q4_0, Q5_0 and Q5_1 use a permuted record built from the natural one
//! (see `x86_avx512`); every other type uses the natural record at every level.

use super::formats::f16_round;
use super::{GgmlType, KernelLevel};

pub(crate) const GROUP: usize = 256;
pub(crate) const REC: usize = 384;
pub(crate) const OFF_D: usize = 256;
pub(crate) const OFF_S: usize = 288;
pub(crate) const OFF_BS: usize = 320;
pub(crate) const OFF_BS32: usize = 352;
/// Q8_0/Q8_1 records: the exact i32 sums of each block's quantized values (where Q8_K records
/// keep `bsums32`).
pub(crate) const OFF_QSUM: usize = 352;

/// The activation format a weight type is dotted with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActKind {
    Q8_0,
    Q8_1,
    Q8K,
}

pub(crate) fn act_kind(ty: GgmlType) -> ActKind {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 => ActKind::Q8_1,
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => ActKind::Q8K,
        _ => ActKind::Q8_0,
    }
}

/// What [`quantize_row`] writes for `level` and `ty`: matrices of one format read the same
/// activation records, so a batch of them over one input quantizes it once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RecordFormat {
    /// Natural records of this kind.
    Natural(ActKind),
    /// The AVX-512 family's lane records for this type.
    Lane(GgmlType),
}

pub(crate) fn record_format(level: KernelLevel, ty: GgmlType) -> RecordFormat {
    #[cfg(target_arch = "x86_64")]
    if matches!(level, KernelLevel::Avx512Vnni | KernelLevel::Amx)
        && matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1)
    {
        return RecordFormat::Lane(ty);
    }
    let _ = level;
    RecordFormat::Natural(act_kind(ty))
}

/// The f32 at byte `off` of a natural record (`d` values).
pub(crate) fn rec_f32(nat: &[u8; REC], off: usize) -> f32 {
    f32::from_le_bytes([nat[off], nat[off + 1], nat[off + 2], nat[off + 3]])
}

/// Q8_K: the sum of the quantized values of 32-element sub-block `j` of a natural record (its two
/// 16-element `bsums`), as the f32 the AMX epilogues multiply with Q4_K's mins.
pub(crate) fn rec_bsum32(nat: &[u8; REC], j: usize) -> f32 {
    let i16_at = |off: usize| i16::from_le_bytes([nat[off], nat[off + 1]]) as i32;
    (i16_at(OFF_BS + 4 * j) + i16_at(OFF_BS + 4 * j + 2)) as f32
}

/// Quantizes one activation row `x` into `out` (`ceil(len/256) * REC` bytes) for kernels of
/// `level`.
pub(crate) fn quantize_row(level: KernelLevel, ty: GgmlType, x: &[f32], out: &mut [u8]) {
    let kind = act_kind(ty);
    #[cfg(target_arch = "x86_64")]
    match level {
        // The AVX-512 family's lane kernels (Q4_0, Q5_0, Q5_1) read lane records; its column
        // tiles (`x86_avx2::kcols512`, `x86_avx2::lcols512`) natural ones.
        KernelLevel::Avx512Vnni | KernelLevel::Amx
            if matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q5_1) =>
        {
            let mut nat = [0u8; REC];
            for (g, rec) in out.chunks_exact_mut(REC).enumerate() {
                let xs = &x[g * GROUP..x.len().min((g + 1) * GROUP)];
                // SAFETY: SIMD levels are only passed here after `hw_level()` confirmed the features.
                unsafe {
                    super::x86_avx2::quantize_group(kind, xs, &mut nat);
                    super::x86_avx512::lane_record(ty, &nat, rec);
                }
            }
            return;
        }
        KernelLevel::Avx2 | KernelLevel::AvxVnni | KernelLevel::Avx512Vnni | KernelLevel::Amx => {
            for (g, rec) in out.chunks_exact_mut(REC).enumerate() {
                let xs = &x[g * GROUP..x.len().min((g + 1) * GROUP)];
                // SAFETY: as above.
                unsafe { super::x86_avx2::quantize_group(kind, xs, rec) };
            }
            return;
        }
        KernelLevel::Scalar => {}
    }
    let _ = level;
    for (g, rec) in out.chunks_exact_mut(REC).enumerate() {
        let xs = &x[g * GROUP..x.len().min((g + 1) * GROUP)];
        quantize_group(kind, xs, rec);
    }
}

/// Quantizes up to 256 values (a multiple of 32; missing blocks are zero) into one natural record.
#[inline(always)]
pub(crate) fn quantize_group(kind: ActKind, x: &[f32], rec: &mut [u8]) {
    let rec = &mut rec[..REC];
    rec.fill(0);
    let (qs, rest) = rec.split_at_mut(GROUP);
    match kind {
        ActKind::Q8_0 | ActKind::Q8_1 => {
            for (b, xb) in x.chunks_exact(32).enumerate() {
                let q: &mut [u8] = &mut qs[32 * b..32 * b + 32];
                let (d, sum) = quantize_q8_block(xb, q);
                put_f32(rest, OFF_D - GROUP + 4 * b, f16_round(d));
                rest[OFF_QSUM - GROUP + 4 * b..OFF_QSUM - GROUP + 4 * b + 4]
                    .copy_from_slice(&sum.to_le_bytes());
                if kind == ActKind::Q8_1 {
                    put_f32(rest, OFF_S - GROUP + 4 * b, f16_round(d * sum as f32));
                }
            }
        }
        ActKind::Q8K => {
            if x.len() != GROUP {
                return;
            }
            let d = quantize_q8k_block(x, qs);
            put_f32(rest, OFF_D - GROUP, d);
            let mut s32 = 0i32;
            for j in 0..16 {
                let s: i32 = qs[16 * j..16 * j + 16]
                    .iter()
                    .map(|&v| v as i8 as i32)
                    .sum();
                rest[OFF_BS - GROUP + 2 * j..OFF_BS - GROUP + 2 * j + 2]
                    .copy_from_slice(&(s as i16).to_le_bytes());
                s32 += s;
                if j % 2 == 1 {
                    let at = OFF_BS32 - GROUP + j - 1;
                    rest[at..at + 2].copy_from_slice(&(s32 as i16).to_le_bytes());
                    s32 = 0;
                }
            }
        }
    }
}

#[inline(always)]
fn put_f32(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// Max |x| over a slice, vectorizable (same result as a sequential max for non-NaN input).
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    let mut m = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for i in 0..8 {
            let a = c[i].abs();
            m[i] = if a > m[i] { a } else { m[i] };
        }
    }
    for &v in chunks.remainder() {
        let a = v.abs();
        m[0] = if a > m[0] { a } else { m[0] };
    }
    m.iter().fold(0.0f32, |a, &b| if b > a { b } else { a })
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the float mantissa (|v| < 2^22).
/// Pure integer ops after one add, so loops using it vectorize.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    ((v + 12582912.0).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Q8_0/Q8_1 block as ggml's x86 `quantize_row_q8_0/q8_1`: d = amax/127, q = round-half-even(x *
/// 127/amax), saturated. Returns (d before f16 rounding, sum of q).
#[inline(always)]
pub(crate) fn quantize_q8_block(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    let amax = abs_max(x);
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (o, &v) in q.iter_mut().zip(x) {
        let r = nearest_int(v * id).clamp(-128, 127);
        sum += r;
        *o = r as u8;
    }
    (d, sum)
}

/// Q8_K block as ggml's `quantize_row_q8_K_ref`: iscale = -127/max with `max` the (first) value of
/// largest magnitude, q = min(127, nearest_int(iscale * x)), d = 1/iscale. Returns d.
#[inline(always)]
pub(crate) fn quantize_q8k_block(x: &[f32], q: &mut [u8]) -> f32 {
    // Vectorizable max/min; the value of largest magnitude is then max or min, unless both have
    // the same magnitude, where ggml's sequential scan keeps the first one.
    let mut hi = [0f32; 8];
    let mut lo = [0f32; 8];
    for c in x.chunks_exact(8) {
        for i in 0..8 {
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
        }
    }
    let hi = hi.iter().fold(0.0f32, |a, &b| if b > a { b } else { a });
    let lo = lo.iter().fold(0.0f32, |a, &b| if b < a { b } else { a });
    let amax = if hi >= -lo { hi } else { -lo };
    if amax == 0.0 || !amax.is_finite() {
        q[..GROUP].fill(0);
        return 0.0;
    }
    let max = if hi != -lo {
        if hi == amax {
            hi
        } else {
            lo
        }
    } else {
        x.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax)
    };
    let iscale = -127.0 / max;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = nearest_int(iscale * v).clamp(-128, 127) as u8;
    }
    1.0 / iscale
}
