//! Portable scalar reference kernels: exact integer block sums scaled like ggml's generic `vec_dot`s.
//!
//! Loop order is the same as the SIMD kernels (each weight block is unpacked once and dotted with
//! every activation row), but this file favours clarity; the SIMD kernels are tested against it.

use half::{bf16, f16};

use super::act::{GROUP, OFF_BS, OFF_D, OFF_S, REC};
use super::formats::{
    unpack_q4_0, unpack_q4_1, unpack_q4_k, unpack_q5_0, unpack_q5_1, unpack_q5_k, unpack_q6_k,
    unpack_q8_0,
};
use super::{GgmlType, QMatrix, YPtr};

#[inline(always)]
fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline(always)]
fn i16_at(b: &[u8], off: usize) -> i32 {
    i16::from_le_bytes([b[off], b[off + 1]]) as i32
}

#[inline(always)]
fn dot_i8(a: &[i8], b: &[u8]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x as i32 * y as i8 as i32)
        .sum()
}

#[inline(always)]
fn dot_u8(a: &[u8], b: &[u8]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| x as i32 * y as i8 as i32)
        .sum()
}

/// Quantized rows `[r0, r1)` against natural activation records (`stride` bytes per token row).
pub(crate) fn quant_rows(
    w: &QMatrix,
    act: &[u8],
    stride: usize,
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    let rb = w.row_bytes();
    let bb = w.ty.block_bytes();
    let mut acc = vec![0f32; n_tok];
    for o in r0..r1 {
        let row = &w.data[o * rb..(o + 1) * rb];
        acc.fill(0.0);
        match w.ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4_1 | GgmlType::Q5_1 => {
                let mut q = [0i8; 32];
                for (ib, blk) in row.chunks_exact(bb).enumerate() {
                    let (d, m) = match w.ty {
                        GgmlType::Q4_0 => (unpack_q4_0(blk, &mut q), 0.0),
                        GgmlType::Q5_0 => (unpack_q5_0(blk, &mut q), 0.0),
                        GgmlType::Q8_0 => (unpack_q8_0(blk, &mut q), 0.0),
                        GgmlType::Q4_1 => unpack_q4_1(blk, &mut q),
                        _ => unpack_q5_1(blk, &mut q),
                    };
                    let with_min = matches!(w.ty, GgmlType::Q4_1 | GgmlType::Q5_1);
                    let (g, b) = (ib / 8, ib % 8);
                    for (t, a) in acc.iter_mut().enumerate() {
                        let rec = &act[t * stride + g * REC..t * stride + (g + 1) * REC];
                        let sumi = dot_i8(&q, &rec[32 * b..32 * b + 32]);
                        let dx = f32_at(rec, OFF_D + 4 * b);
                        *a += (d * dx) * sumi as f32;
                        if with_min {
                            *a += m * f32_at(rec, OFF_S + 4 * b);
                        }
                    }
                }
            }
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let mut q = [0u8; 256];
                for (g, blk) in row.chunks_exact(bb).enumerate() {
                    let k = if w.ty == GgmlType::Q4_K {
                        unpack_q4_k(blk, &mut q)
                    } else {
                        unpack_q5_k(blk, &mut q)
                    };
                    for (t, a) in acc.iter_mut().enumerate() {
                        let rec = &act[t * stride + g * REC..t * stride + (g + 1) * REC];
                        let mut sumi = 0i32;
                        let mut summ = 0i32;
                        for j in 0..8 {
                            sumi += k.sc[j] as i32
                                * dot_u8(&q[32 * j..32 * j + 32], &rec[32 * j..32 * j + 32]);
                            let bs = i16_at(rec, OFF_BS + 4 * j) + i16_at(rec, OFF_BS + 4 * j + 2);
                            summ += k.m[j] as i32 * bs;
                        }
                        let dx = f32_at(rec, OFF_D);
                        *a += (k.d * dx) * sumi as f32 - (k.dmin * dx) * summ as f32;
                    }
                }
            }
            GgmlType::Q6_K => {
                let mut q = [0i8; 256];
                for (g, blk) in row.chunks_exact(bb).enumerate() {
                    let (d, sc) = unpack_q6_k(blk, &mut q);
                    for (t, a) in acc.iter_mut().enumerate() {
                        let rec = &act[t * stride + g * REC..t * stride + (g + 1) * REC];
                        let mut sumi = 0i32;
                        for j in 0..16 {
                            sumi += sc[j] as i32
                                * dot_i8(&q[16 * j..16 * j + 16], &rec[16 * j..16 * j + 16]);
                        }
                        *a += (d * f32_at(rec, OFF_D)) * sumi as f32;
                    }
                }
            }
            _ => {}
        }
        for (t, &a) in acc.iter().enumerate() {
            // SAFETY: t < n_tok and o is in this task's rows.
            unsafe { y.write(t, o, a) };
        }
    }
    debug_assert_eq!(GROUP, 256);
}

/// Float-weight rows `[r0, r1)` against f32 activations.
pub(crate) fn float_rows(w: &QMatrix, x: &[f32], n_tok: usize, r0: usize, r1: usize, y: YPtr) {
    let n_in = w.n_in;
    let rb = w.row_bytes();
    let mut wf = vec![0f32; n_in];
    for o in r0..r1 {
        let row = &w.data[o * rb..(o + 1) * rb];
        match w.ty {
            GgmlType::F32 => {
                for (v, c) in wf.iter_mut().zip(row.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            GgmlType::F16 => {
                for (v, c) in wf.iter_mut().zip(row.chunks_exact(2)) {
                    *v = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            _ => {
                for (v, c) in wf.iter_mut().zip(row.chunks_exact(2)) {
                    *v = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
        }
        for t in 0..n_tok {
            let xr = &x[t * n_in..(t + 1) * n_in];
            let s: f32 = wf.iter().zip(xr).map(|(a, b)| a * b).sum();
            // SAFETY: t < n_tok and o is in this task's rows.
            unsafe { y.write(t, o, s) };
        }
    }
}
