//! GGML block layouts: scalar unpacking, reference dequantization and simple round-to-nearest quantizers.
//!
//! Layouts follow ggml-common.h exactly (little-endian, no padding):
//! Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d, m; u8 qs[16]}, Q5_0 {f16 d; u8 qh[4]; u8 qs[16]},
//! Q5_1 {f16 d, m; u8 qh[4]; u8 qs[16]}, Q8_0 {f16 d; i8 qs[32]},
//! Q4_K {f16 d, dmin; u8 scales[12]; u8 qs[128]}, Q5_K {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]},
//! Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}.

use half::{bf16, f16};

use super::{unsupported, GgmlType};
use crate::error::{EngineError, Result};

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
pub(crate) fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

#[inline(always)]
fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

#[inline(always)]
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

// ---------------------------------------------------------------------------------------------
// Block unpacking (shared by dequantization and the scalar kernels)
// ---------------------------------------------------------------------------------------------

/// Q4_0 block → (d, q - 8).
#[inline]
pub(crate) fn unpack_q4_0(b: &[u8], q: &mut [i8; 32]) -> f32 {
    let qs = &b[2..18];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) as i8 - 8;
        q[j + 16] = (qs[j] >> 4) as i8 - 8;
    }
    f16_at(b, 0)
}

/// Q4_1 block → (d, m, q in 0..16).
#[inline]
pub(crate) fn unpack_q4_1(b: &[u8], q: &mut [i8; 32]) -> (f32, f32) {
    let qs = &b[4..20];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0F) as i8;
        q[j + 16] = (qs[j] >> 4) as i8;
    }
    (f16_at(b, 0), f16_at(b, 2))
}

#[inline(always)]
fn q5_values(qh: u32, qs: &[u8], q: &mut [i8; 32], off: i8) {
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        q[j] = ((qs[j] & 0x0F) | h0) as i8 - off;
        q[j + 16] = ((qs[j] >> 4) | h1) as i8 - off;
    }
}

/// Q5_0 block → (d, q - 16).
#[inline]
pub(crate) fn unpack_q5_0(b: &[u8], q: &mut [i8; 32]) -> f32 {
    q5_values(u32_at(b, 2), &b[6..22], q, 16);
    f16_at(b, 0)
}

/// Q5_1 block → (d, m, q in 0..32).
#[inline]
pub(crate) fn unpack_q5_1(b: &[u8], q: &mut [i8; 32]) -> (f32, f32) {
    q5_values(u32_at(b, 4), &b[8..24], q, 0);
    (f16_at(b, 0), f16_at(b, 2))
}

/// Q8_0 block → (d, q).
#[inline]
pub(crate) fn unpack_q8_0(b: &[u8], q: &mut [i8; 32]) -> f32 {
    for j in 0..32 {
        q[j] = b[2 + j] as i8;
    }
    f16_at(b, 0)
}

/// The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`).
#[inline]
pub(crate) fn k4_scales(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// Unpacked Q4_K / Q5_K block: value = d * sc[j] * q - dmin * m[j] for element in sub-block j (32).
pub(crate) struct KMins {
    pub d: f32,
    pub dmin: f32,
    pub sc: [u8; 8],
    pub m: [u8; 8],
}

/// Q4_K block → scales and q (0..16) in natural element order.
#[inline]
pub(crate) fn unpack_q4_k(b: &[u8], q: &mut [u8; 256]) -> KMins {
    let (sc, m) = k4_scales(&b[4..16]);
    let qs = &b[16..144];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = qs[32 * c + l] & 0x0F;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
    KMins {
        d: f16_at(b, 0),
        dmin: f16_at(b, 2),
        sc,
        m,
    }
}

/// Q5_K block → scales and q (0..32) in natural element order.
#[inline]
pub(crate) fn unpack_q5_k(b: &[u8], q: &mut [u8; 256]) -> KMins {
    let (sc, m) = k4_scales(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        for l in 0..32 {
            let h0 = ((qh[l] >> (2 * c)) & 1) << 4;
            let h1 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
            q[64 * c + l] = (qs[32 * c + l] & 0x0F) | h0;
            q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | h1;
        }
    }
    KMins {
        d: f16_at(b, 0),
        dmin: f16_at(b, 2),
        sc,
        m,
    }
}

/// Q6_K block → (d, scales per 16 elements, q - 32 in natural order).
#[inline]
pub(crate) fn unpack_q6_k(b: &[u8], q: &mut [i8; 256]) -> (f32, [i8; 16]) {
    let mut sc = [0i8; 16];
    for (s, &v) in sc.iter_mut().zip(&b[192..208]) {
        *s = v as i8;
    }
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..128 + 32 * h + 32];
        let y = &mut q[128 * h..128 * h + 128];
        for l in 0..32 {
            y[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    (f16_at(b, 208), sc)
}

// ---------------------------------------------------------------------------------------------
// Dequantization
// ---------------------------------------------------------------------------------------------

/// Scalar reference dequantization of `dst.len()` elements (a multiple of `block_elems`) from
/// `src`, which must hold exactly `row_bytes(dst.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    if !ty.supported() {
        return Err(unsupported(ty));
    }
    let need = ty.row_bytes(dst.len()).ok_or_else(|| {
        EngineError::Shape(format!(
            "cannot dequantize {} {ty} elements: not a multiple of the block size {}",
            dst.len(),
            ty.block_elems()
        ))
    })?;
    if src.len() != need {
        return Err(EngineError::Shape(format!(
            "dequantizing {} {ty} elements needs {need} bytes, got {}",
            dst.len(),
            src.len()
        )));
    }
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
            let mut q = [0i8; 32];
            for (y, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(bb)) {
                let d = match ty {
                    GgmlType::Q4_0 => unpack_q4_0(b, &mut q),
                    GgmlType::Q5_0 => unpack_q5_0(b, &mut q),
                    _ => unpack_q8_0(b, &mut q),
                };
                for (v, &qv) in y.iter_mut().zip(&q) {
                    *v = qv as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            let mut q = [0i8; 32];
            for (y, b) in dst.chunks_exact_mut(32).zip(src.chunks_exact(bb)) {
                let (d, m) = if ty == GgmlType::Q4_1 {
                    unpack_q4_1(b, &mut q)
                } else {
                    unpack_q5_1(b, &mut q)
                };
                for (v, &qv) in y.iter_mut().zip(&q) {
                    *v = qv as f32 * d + m;
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let mut q = [0u8; 256];
            for (y, b) in dst.chunks_exact_mut(256).zip(src.chunks_exact(bb)) {
                let k = if ty == GgmlType::Q4_K {
                    unpack_q4_k(b, &mut q)
                } else {
                    unpack_q5_k(b, &mut q)
                };
                for j in 0..8 {
                    let d1 = k.d * k.sc[j] as f32;
                    let m1 = k.dmin * k.m[j] as f32;
                    for l in 0..32 {
                        y[32 * j + l] = d1 * q[32 * j + l] as f32 - m1;
                    }
                }
            }
        }
        GgmlType::Q6_K => {
            let mut q = [0i8; 256];
            for (y, b) in dst.chunks_exact_mut(256).zip(src.chunks_exact(bb)) {
                let (d, sc) = unpack_q6_k(b, &mut q);
                for j in 0..16 {
                    let dj = d * sc[j] as f32;
                    for l in 0..16 {
                        y[16 * j + l] = dj * q[16 * j + l] as f32;
                    }
                }
            }
        }
        _ => return Err(unsupported(ty)),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Quantization (test / tooling helpers; round-to-nearest, not llama.cpp's optimizing quantizers)
// ---------------------------------------------------------------------------------------------

fn check_quant_lens(ty: GgmlType, src: &[f32], dst: &[u8]) -> Result<()> {
    let need = ty.row_bytes(src.len()).ok_or_else(|| {
        EngineError::Shape(format!(
            "cannot quantize {} values to {ty}: not a multiple of the block size {}",
            src.len(),
            ty.block_elems()
        ))
    })?;
    if dst.len() != need {
        return Err(EngineError::Shape(format!(
            "quantizing {} values to {ty} needs {need} bytes, got {}",
            src.len(),
            dst.len()
        )));
    }
    Ok(())
}

/// Quantizes `src` (a multiple of `block_elems` values) into `dst` (exactly `row_bytes` bytes).
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match ty {
        GgmlType::F32 => {
            check_quant_lens(ty, src, dst)?;
            for (c, v) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        }
        GgmlType::F16 => quantize_row_f16(src, dst),
        GgmlType::BF16 => quantize_row_bf16(src, dst),
        GgmlType::Q4_0 => quantize_row_q4_0(src, dst),
        GgmlType::Q4_1 => quantize_row_q4_1(src, dst),
        GgmlType::Q5_0 => quantize_row_q5_0(src, dst),
        GgmlType::Q5_1 => quantize_row_q5_1(src, dst),
        GgmlType::Q8_0 => quantize_row_q8_0(src, dst),
        GgmlType::Q4_K => quantize_row_q4_k(src, dst),
        GgmlType::Q5_K => quantize_row_q5_k(src, dst),
        GgmlType::Q6_K => quantize_row_q6_k(src, dst),
        _ => Err(unsupported(ty)),
    }
}

/// F16 (round to nearest even).
pub fn quantize_row_f16(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::F16, src, dst)?;
    for (c, &v) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
    }
    Ok(())
}

/// BF16 (round to nearest even).
pub fn quantize_row_bf16(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::BF16, src, dst)?;
    for (c, &v) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
    }
    Ok(())
}

/// Value of largest magnitude (first one on ties), like ggml's symmetric quantizers.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Q4_0 (ggml's `quantize_row_q4_0_ref`).
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q4_0, src, dst)?;
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(18)) {
        let d = signed_absmax(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..16 {
            let x0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let x1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
            b[2 + j] = x0 | (x1 << 4);
        }
    }
    Ok(())
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        min = min.min(v);
        max = max.max(v);
    }
    (min, max)
}

/// Q4_1 (ggml's `quantize_row_q4_1_ref`).
pub fn quantize_row_q4_1(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q4_1, src, dst)?;
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(20)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        for j in 0..16 {
            let x0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let x1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
            b[4 + j] = x0 | (x1 << 4);
        }
    }
    Ok(())
}

/// Q5_0 (ggml's `quantize_row_q5_0_ref`).
pub fn quantize_row_q5_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q5_0, src, dst)?;
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(22)) {
        let d = signed_absmax(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        let mut qh = 0u32;
        for j in 0..16 {
            let x0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
            let x1 = ((x[j + 16] * id + 16.5) as i8).min(31) as u8;
            b[6 + j] = (x0 & 0x0F) | ((x1 & 0x0F) << 4);
            qh |= ((x0 as u32 & 0x10) >> 4) << j;
            qh |= ((x1 as u32 & 0x10) >> 4) << (j + 16);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }
    Ok(())
}

/// Q5_1 (ggml's `quantize_row_q5_1_ref`).
pub fn quantize_row_q5_1(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q5_1, src, dst)?;
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(24)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        let mut qh = 0u32;
        for j in 0..16 {
            let x0 = (((x[j] - min) * id + 0.5) as u8).min(31);
            let x1 = (((x[j + 16] - min) * id + 0.5) as u8).min(31);
            b[8 + j] = (x0 & 0x0F) | ((x1 & 0x0F) << 4);
            qh |= ((x0 as u32 & 0x10) >> 4) << j;
            qh |= ((x1 as u32 & 0x10) >> 4) << (j + 16);
        }
        b[4..8].copy_from_slice(&qh.to_le_bytes());
    }
    Ok(())
}

/// Q8_0 (ggml's `quantize_row_q8_0_ref`).
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q8_0, src, dst)?;
    for (x, b) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(b, 0, d);
        for j in 0..32 {
            b[2 + j] = (x[j] * id).round().clamp(-127.0, 127.0) as i8 as u8;
        }
    }
    Ok(())
}

/// Packs 6-bit scales and mins in ggml's Q4_K/Q5_K 12-byte layout.
fn pack_k4_scales(sc: &[u8; 8], m: &[u8; 8], s: &mut [u8]) {
    s[..12].fill(0);
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
        } else {
            s[j + 4] = (sc[j] & 0x0F) | ((m[j] & 0x0F) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
}

/// Q4_K/Q5_K scales: per 32-element sub-block an affine range [min(0, lo), hi] with `nmax` steps.
fn k_affine(x: &[f32], nmax: f32) -> (f32, f32, [u8; 8], [u8; 8]) {
    let mut scale = [0f32; 8];
    let mut mins = [0f32; 8];
    for j in 0..8 {
        let (lo, hi) = min_max(&x[32 * j..32 * j + 32]);
        let lo = lo.min(0.0);
        scale[j] = (hi - lo) / nmax;
        mins[j] = -lo;
    }
    let max_scale = scale.iter().fold(0.0f32, |a, &b| a.max(b));
    let max_min = mins.iter().fold(0.0f32, |a, &b| a.max(b));
    let d = f16_round(max_scale / 63.0);
    let dmin = f16_round(max_min / 63.0);
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        sc[j] = if d > 0.0 {
            (scale[j] / d).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
        m[j] = if dmin > 0.0 {
            (mins[j] / dmin).round().clamp(0.0, 63.0) as u8
        } else {
            0
        };
    }
    (d, dmin, sc, m)
}

fn k_quant_values(
    x: &[f32],
    d: f32,
    dmin: f32,
    sc: &[u8; 8],
    m: &[u8; 8],
    nmax: f32,
    q: &mut [u8; 256],
) {
    for j in 0..8 {
        let s = d * sc[j] as f32;
        let mn = dmin * m[j] as f32;
        for l in 0..32 {
            let v = x[32 * j + l];
            q[32 * j + l] = if s > 0.0 {
                ((v + mn) / s).round().clamp(0.0, nmax) as u8
            } else {
                0
            };
        }
    }
}

/// Q4_K (simple round-to-nearest per sub-block; same layout as ggml).
pub fn quantize_row_q4_k(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q4_K, src, dst)?;
    let mut q = [0u8; 256];
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(144)) {
        let (d, dmin, sc, m) = k_affine(x, 15.0);
        k_quant_values(x, d, dmin, &sc, &m, 15.0, &mut q);
        put_f16(b, 0, d);
        put_f16(b, 2, dmin);
        pack_k4_scales(&sc, &m, &mut b[4..16]);
        for c in 0..4 {
            for l in 0..32 {
                b[16 + 32 * c + l] = q[64 * c + l] | (q[64 * c + 32 + l] << 4);
            }
        }
    }
    Ok(())
}

/// Q5_K (simple round-to-nearest per sub-block; same layout as ggml).
pub fn quantize_row_q5_k(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q5_K, src, dst)?;
    let mut q = [0u8; 256];
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(176)) {
        let (d, dmin, sc, m) = k_affine(x, 31.0);
        k_quant_values(x, d, dmin, &sc, &m, 31.0, &mut q);
        put_f16(b, 0, d);
        put_f16(b, 2, dmin);
        pack_k4_scales(&sc, &m, &mut b[4..16]);
        b[16..48].fill(0);
        for c in 0..4 {
            for l in 0..32 {
                let q0 = q[64 * c + l];
                let q1 = q[64 * c + 32 + l];
                b[48 + 32 * c + l] = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
                b[16 + l] |= ((q0 >> 4) << (2 * c)) | ((q1 >> 4) << (2 * c + 1));
            }
        }
    }
    Ok(())
}

/// Q6_K (symmetric round-to-nearest per 16-element sub-block; same layout as ggml).
pub fn quantize_row_q6_k(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_quant_lens(GgmlType::Q6_K, src, dst)?;
    let mut q = [0u8; 256];
    for (x, b) in src.chunks_exact(256).zip(dst.chunks_exact_mut(210)) {
        let mut scale = [0f32; 16];
        for j in 0..16 {
            scale[j] = signed_absmax(&x[16 * j..16 * j + 16]) / -32.0;
        }
        let amax = scale.iter().fold(0.0f32, |a, s| a.max(s.abs()));
        let d = f16_round(amax / 127.0);
        let mut sc = [0i8; 16];
        for j in 0..16 {
            sc[j] = if d > 0.0 {
                (scale[j] / d).round().clamp(-128.0, 127.0) as i8
            } else {
                0
            };
            let s = d * sc[j] as f32;
            for l in 0..16 {
                let v = x[16 * j + l];
                let qi = if s != 0.0 {
                    (v / s).round().clamp(-32.0, 31.0) as i32
                } else {
                    0
                };
                q[16 * j + l] = (qi + 32) as u8;
            }
        }
        for h in 0..2 {
            let y = &q[128 * h..128 * h + 128];
            for l in 0..32 {
                b[64 * h + l] = (y[l] & 0x0F) | ((y[l + 64] & 0x0F) << 4);
                b[64 * h + l + 32] = (y[l + 32] & 0x0F) | ((y[l + 96] & 0x0F) << 4);
                b[128 + 32 * h + l] = (y[l] >> 4)
                    | ((y[l + 32] >> 4) << 2)
                    | ((y[l + 64] >> 4) << 4)
                    | ((y[l + 96] >> 4) << 6);
            }
        }
        for (o, &s) in b[192..208].iter_mut().zip(&sc) {
            *o = s as u8;
        }
        put_f16(b, 208, d);
    }
    Ok(())
}
