//! Tests of the quant module: layouts, round trips, SIMD kernels vs the scalar reference, error paths.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::act::{self, ActKind, GROUP, OFF_BS, OFF_D, OFF_S, REC};
use super::formats::f16_round;
use super::*;
use crate::testing::skip_hardware;

const QUANT_TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];
const FLOAT_TYPES: [GgmlType; 3] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];

fn randn(rng: &mut StdRng) -> f32 {
    // Sum of uniforms: cheap, roughly normal, with occasional larger values.
    let s: f32 = (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum();
    if rng.gen_range(0..64) == 0 {
        s * 8.0
    } else {
        s
    }
}

fn rand_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| randn(rng)).collect()
}

fn quantized(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; ty.row_bytes(x.len()).unwrap()];
    quantize_row(ty, x, &mut out).unwrap();
    out
}

fn dequantized(ty: GgmlType, data: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    dequantize_row(ty, data, &mut out).unwrap();
    out
}

/// Random weight rows: quantized random floats, or (for quant types, `raw`) random bytes with sane
/// f16 scale fields, so that every bit pattern of the quant values is exercised.
fn random_matrix(rng: &mut StdRng, ty: GgmlType, n_out: usize, n_in: usize, raw: bool) -> Vec<u8> {
    let rb = ty.row_bytes(n_in).unwrap();
    if !raw || FLOAT_TYPES.contains(&ty) {
        let mut data = Vec::with_capacity(rb * n_out);
        for _ in 0..n_out {
            data.extend(quantized(ty, &rand_vec(rng, n_in)));
        }
        return data;
    }
    let mut data: Vec<u8> = (0..rb * n_out).map(|_| rng.gen()).collect();
    let bb = ty.block_bytes();
    let f16_fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[],
    };
    for blk in data.chunks_exact_mut(bb) {
        for &off in f16_fields {
            let v = half::f16::from_f32(rng.gen_range(-0.05f32..0.05));
            blk[off..off + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    data
}

fn levels() -> Vec<KernelLevel> {
    KernelLevel::available()
}

#[test]
fn type_table() {
    for ty in QUANT_TYPES.iter().chain(&FLOAT_TYPES) {
        assert_eq!(GgmlType::from_u32(ty.to_u32()), Some(*ty));
        assert!(ty.supported());
    }
    assert_eq!(GgmlType::from_u32(30), Some(GgmlType::BF16));
    assert_eq!(GgmlType::from_u32(4), None);
    assert_eq!(GgmlType::Q4_K.name(), "Q4_K");
    assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
    assert_eq!(GgmlType::Q4_K.row_bytes(300), None);
    assert_eq!(GgmlType::Q8_0.row_bytes(64), Some(68));
    assert_eq!(GgmlType::F16.row_bytes(3), Some(6));
    assert_eq!(GgmlType::Q6_K.block_bytes(), 210);
    assert!(!GgmlType::Q8_K.supported() && !GgmlType::Q2_K.supported());
}

#[test]
fn dequantize_round_trip() {
    let mut rng = StdRng::seed_from_u64(1);
    // Max error relative to the block's max |x| (float types: relative to |x| per element). These
    // are the round-to-nearest bounds: half a step, plus clipping of the extreme value for the
    // symmetric types and 6-bit rounding of the sub-block scales for the K-quants.
    let tol = |ty: GgmlType| match ty {
        GgmlType::F32 => 0.0,
        GgmlType::F16 => 5e-4,
        GgmlType::BF16 => 4e-3,
        GgmlType::Q8_0 => 5e-3,
        GgmlType::Q4_0 => 0.13,
        GgmlType::Q4_1 => 0.07,
        GgmlType::Q5_0 => 0.066,
        GgmlType::Q5_1 => 0.036,
        GgmlType::Q4_K => 0.1,
        GgmlType::Q5_K => 0.06,
        GgmlType::Q6_K => 0.035,
        _ => 0.0,
    };
    for ty in QUANT_TYPES.iter().chain(&FLOAT_TYPES).copied() {
        for n in [256usize, 1024] {
            let x = rand_vec(&mut rng, n);
            let q = quantized(ty, &x);
            let y = dequantized(ty, &q, n);
            if ty.is_float() {
                for (a, b) in x.iter().zip(&y) {
                    assert!((a - b).abs() <= tol(ty) * a.abs(), "{ty}: {a} -> {b}");
                }
                continue;
            }
            let be = ty.block_elems();
            for (xb, yb) in x.chunks(be).zip(y.chunks(be)) {
                let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let max_err = xb
                    .iter()
                    .zip(yb)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(
                    max_err <= tol(ty) * amax + 1e-6,
                    "{ty}: max err {max_err} in a block with max |x| {amax} (tol {})",
                    tol(ty)
                );
            }
        }
    }
}

#[test]
fn dequantize_known_blocks() {
    // Q8_0: d = 0.5, q = -3 → -1.5.
    let mut b = vec![0u8; 34];
    b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    b[2] = (-3i8) as u8;
    b[3] = 4;
    let y = dequantized(GgmlType::Q8_0, &b, 32);
    assert_eq!(&y[..3], &[-1.5, 2.0, 0.0]);
    // Q4_0: byte 0x9F → element 0 = (15-8)d, element 16 = (9-8)d.
    let mut b = vec![0x88u8; 18];
    b[..2].copy_from_slice(&half::f16::from_f32(2.0).to_bits().to_le_bytes());
    b[2] = 0x9F;
    let y = dequantized(GgmlType::Q4_0, &b, 32);
    assert_eq!((y[0], y[16], y[1]), (14.0, 2.0, 0.0));
    // Q5_0: qh bit 16 sets the high bit of element 16.
    let mut b = vec![0u8; 22];
    b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
    b[2..6].copy_from_slice(&(1u32 << 16).to_le_bytes());
    let y = dequantized(GgmlType::Q5_0, &b, 32);
    assert_eq!((y[0], y[16]), (-16.0, 0.0));
}

/// Sequential port of ggml's `quantize_row_q8_K_ref` (the spec the kernels must match).
fn q8k_reference(x: &[f32]) -> (f32, Vec<i8>) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        return (0.0, vec![0; x.len()]);
    }
    let iscale = -127.0 / max;
    let q = x
        .iter()
        .map(|&v| {
            let f = iscale * v + 12582912.0;
            let i = ((f.to_bits() & 0x007f_ffff) as i32) - 0x0040_0000;
            i.min(127) as i8
        })
        .collect();
    (1.0 / iscale, q)
}

#[test]
fn activation_quantization_matches_ggml() {
    let mut rng = StdRng::seed_from_u64(2);
    for case in 0..20 {
        let mut x = rand_vec(&mut rng, GROUP);
        if case == 1 {
            x.iter_mut().for_each(|v| *v = 0.0);
        }
        if case == 2 {
            // Ties in magnitude: the first one decides the sign.
            x[10] = -9.0;
            x[20] = 9.0;
        }
        if case == 3 {
            // Exact .5 products round to even.
            for (i, v) in x.iter_mut().enumerate() {
                *v = (i as f32 - 128.0) * 0.5;
            }
        }
        let mut rec = vec![0u8; REC];
        act::quantize_group(ActKind::Q8K, &x, &mut rec);
        let (d, q) = q8k_reference(&x);
        let got_d = f32::from_le_bytes(rec[OFF_D..OFF_D + 4].try_into().unwrap());
        assert_eq!(got_d.to_bits(), d.to_bits(), "case {case}");
        for j in 0..GROUP {
            assert_eq!(rec[j] as i8, q[j], "case {case} element {j}");
        }
        for j in 0..16 {
            let bs = i16::from_le_bytes([rec[OFF_BS + 2 * j], rec[OFF_BS + 2 * j + 1]]);
            let want: i32 = q[16 * j..16 * j + 16].iter().map(|&v| v as i32).sum();
            assert_eq!(bs as i32, want);
        }
        for j in 0..8 {
            let at = act::OFF_BS32 + 2 * j;
            let bs = i16::from_le_bytes([rec[at], rec[at + 1]]);
            let want: i32 = q[32 * j..32 * j + 32].iter().map(|&v| v as i32).sum();
            assert_eq!(bs as i32, want, "case {case} 32-element sum {j}");
        }

        // Q8_0 / Q8_1 as ggml's x86 code: d = amax/127 stored as f16, q = rne(x * 127/amax).
        act::quantize_group(ActKind::Q8_1, &x, &mut rec);
        for b in 0..8 {
            let xb = &x[32 * b..32 * b + 32];
            let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0;
            for j in 0..32 {
                let want = (xb[j] * id).round_ties_even() as i32;
                sum += want;
                assert_eq!(rec[32 * b + j] as i8 as i32, want);
            }
            let dd = f32::from_le_bytes(rec[OFF_D + 4 * b..OFF_D + 4 * b + 4].try_into().unwrap());
            let ss = f32::from_le_bytes(rec[OFF_S + 4 * b..OFF_S + 4 * b + 4].try_into().unwrap());
            assert_eq!(dd, f16_round(amax / 127.0));
            assert_eq!(ss, f16_round(amax / 127.0 * sum as f32));
        }
    }
}

/// The AVX2 quantizer's Q8_0/Q8_1 (and Q8_K) records equal the portable code's, byte for byte,
/// for whole and partial groups, zeros, ties, huge values, infinities and NaNs.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_activation_records_equal_the_portable_ones() {
    if !levels().contains(&KernelLevel::Avx2) {
        skip_hardware("quant::avx2_activation_records", "no AVX2/FMA/F16C");
        return;
    }
    let mut rng = StdRng::seed_from_u64(21);
    for case in 0..60 {
        let len = [GROUP, 64, 32, 96, 224][case % 5];
        let mut x = rand_vec(&mut rng, len);
        match case / 5 {
            1 => x.iter_mut().take(40).for_each(|v| *v = 0.0),
            // amax 127: the scale is 1 and the halves are ties.
            2 => x.iter_mut().enumerate().for_each(|(i, v)| {
                *v = if i % 32 == 0 {
                    127.0
                } else {
                    (i % 32) as f32 * 0.5 - 40.0
                }
            }),
            3 => x[3] = 3.0e38,
            4 => x[5] = f32::INFINITY,
            // The block's largest value and a NaN in one lane, the NaN in a later chunk.
            5 => {
                x[3] = 50.0;
                x[27] = f32::NAN;
            }
            // Subnormal: 127 / amax overflows, products saturate.
            6 => x.iter_mut().for_each(|v| *v *= 1.0e-40),
            7 => x[1] = -x.iter().fold(0.0f32, |a, v| a.max(v.abs())) - 1.0,
            _ => {}
        }
        for kind in [ActKind::Q8_0, ActKind::Q8_1, ActKind::Q8K] {
            if kind == ActKind::Q8K && len != GROUP {
                continue;
            }
            let mut want = vec![0xa5u8; REC];
            let mut got = vec![0x5au8; REC];
            act::quantize_group(kind, &x, &mut want);
            // SAFETY: the AVX2 level (AVX2, FMA, F16C) checked above.
            unsafe { super::x86_avx2::quantize_group(kind, &x, &mut got) };
            assert_eq!(got, want, "case {case} {kind:?} len {len}");
        }
    }
}

/// Σ_k |W[o,k] x[t,k]| in f64.
fn abs_dot(wf: &[f32], x: &[f32], n_in: usize, o: usize, t: usize) -> f64 {
    let w = &wf[o * n_in..(o + 1) * n_in];
    let xr = &x[t * n_in..(t + 1) * n_in];
    w.iter()
        .zip(xr)
        .map(|(a, b)| (*a as f64 * *b as f64).abs())
        .sum()
}

/// Σ_k 3·max|W[o, block(k)]|·|x[t,k]| over 32-element blocks: bounds the magnitude of the partial
/// terms d·q·x and m·x that the kernels sum in f32 (they can cancel, so Σ|W·x| alone is too small).
fn term_scale(wf: &[f32], x: &[f32], n_in: usize, o: usize, t: usize) -> f64 {
    let w = &wf[o * n_in..(o + 1) * n_in];
    let xr = &x[t * n_in..(t + 1) * n_in];
    w.chunks(32)
        .zip(xr.chunks(32))
        .map(|(wb, xb)| {
            let wmax = wb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
            3.0 * wmax * xb.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum()
}

fn dequant_matrix(ty: GgmlType, data: &[u8], n_out: usize, n_in: usize) -> Vec<f32> {
    let rb = ty.row_bytes(n_in).unwrap();
    let mut wf = vec![0f32; n_out * n_in];
    for o in 0..n_out {
        dequantize_row(
            ty,
            &data[o * rb..(o + 1) * rb],
            &mut wf[o * n_in..(o + 1) * n_in],
        )
        .unwrap();
    }
    wf
}

fn activations(rng: &mut StdRng, n_tok: usize, n_in: usize) -> Vec<f32> {
    let mut x = rand_vec(rng, n_tok * n_in);
    if n_tok > 2 {
        // One all-zero row and one row with a single huge value.
        x[n_in..2 * n_in].iter_mut().for_each(|v| *v = 0.0);
        x[2 * n_in + 5] = 1000.0;
    }
    x
}

/// SIMD levels agree with the scalar reference. The integer dot products of every block are exact
/// at all levels; only the order of the f32 accumulation differs (per-lane vs per-block sums, lane
/// reductions), so the difference is a few ulps of the summed terms: we allow 2e-5 · `term_scale`
/// (≈ 2e-5 of Σ|terms|; f32 ulp is 6e-8, so this leaves room for ~300 roundings).
#[test]
fn simd_matches_scalar() {
    let mut rng = StdRng::seed_from_u64(3);
    let lv: Vec<KernelLevel> = levels()
        .into_iter()
        .filter(|l| *l != KernelLevel::Scalar)
        .collect();
    if lv.is_empty() {
        skip_hardware(
            "quant::simd_matches_scalar",
            "no SIMD kernel level (AVX2, AVX-VNNI, AVX-512 VNNI)",
        );
        return;
    }
    for ty in QUANT_TYPES.iter().chain(&FLOAT_TYPES).copied() {
        let n_ins: &[usize] = if ty.block_elems() == 256 {
            &[256, 768]
        } else if ty.is_float() {
            &[37, 256, 300]
        } else {
            &[32, 288, 544]
        };
        for &n_in in n_ins {
            for (n_out, toks) in [
                (37usize, &[1usize, 2, 3, 4, 5, 7, 16, 33, 64][..]),
                (300, &[1, 5, 16][..]),
            ] {
                let raw = n_out == 37;
                let data = random_matrix(&mut rng, ty, n_out, n_in, raw);
                let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
                let wf = dequant_matrix(ty, &data, n_out, n_in);
                for &n_tok in toks {
                    let x = activations(&mut rng, n_tok, n_in);
                    let mut want = vec![0f32; n_tok * n_out];
                    matmul_with(KernelLevel::Scalar, &w, &x, n_tok, &mut want).unwrap();
                    for &level in &lv {
                        let mut got = vec![f32::NAN; n_tok * n_out];
                        matmul_with(level, &w, &x, n_tok, &mut got).unwrap();
                        for t in 0..n_tok {
                            for o in 0..n_out {
                                let (a, b) = (got[t * n_out + o], want[t * n_out + o]);
                                let tol = 2e-5 * term_scale(&wf, &x, n_in, o, t) + 1e-6;
                                assert!(
                                    ((a - b) as f64).abs() <= tol,
                                    "{ty} {level:?} n_out {n_out} n_in {n_in} n_tok {n_tok} [t {t}, o {o}]: {a} vs scalar {b} (tol {tol})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The scalar kernels equal an f32 matmul on the dequantized weights up to the activation
/// quantization error: |Δy| ≤ Σ_k |W[o,k]| · d_x/2 (rounding to the 8-bit grid, d_x = amax/127 of the
/// activation block) + Σ_k max|W|_block · |x_k| · 2e-3 (f16 rounding of d_x and of Q8_1's s).
#[test]
fn scalar_matches_dequantized_f32() {
    let mut rng = StdRng::seed_from_u64(4);
    for ty in QUANT_TYPES.iter().chain(&FLOAT_TYPES).copied() {
        let n_in = if ty.block_elems() == 256 { 512 } else { 288 };
        let (n_out, n_tok) = (19, 5);
        let data = random_matrix(&mut rng, ty, n_out, n_in, false);
        let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
        let wf = dequant_matrix(ty, &data, n_out, n_in);
        let x = activations(&mut rng, n_tok, n_in);
        let mut y = vec![0f32; n_tok * n_out];
        matmul_with(KernelLevel::Scalar, &w, &x, n_tok, &mut y).unwrap();
        let ab = if ty.is_float() {
            0
        } else {
            act::GROUP.min(ty.block_elems().max(32))
        };
        for t in 0..n_tok {
            let xr = &x[t * n_in..(t + 1) * n_in];
            for o in 0..n_out {
                let wr = &wf[o * n_in..(o + 1) * n_in];
                let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mut bound = 1e-5 + 1e-6 * abs_dot(&wf, &x, n_in, o, t);
                if ab > 0 {
                    for (wb, xb) in wr.chunks(ab).zip(xr.chunks(ab)) {
                        let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                        let wmax = wb.iter().fold(0.0f32, |a, v| a.max(v.abs())) as f64;
                        for (wv, xv) in wb.iter().zip(xb) {
                            bound += (*wv as f64).abs() * 0.5 * amax / 127.0 * 1.01
                                + wmax * (*xv as f64).abs() * 2e-3;
                        }
                    }
                }
                let got = y[t * n_out + o] as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "{ty} [t {t}, o {o}]: {got} vs f32 {exact} (bound {bound})"
                );
            }
        }
    }
}

#[test]
fn threads_do_not_change_results() {
    let mut rng = StdRng::seed_from_u64(5);
    let (ty, n_out, n_in, n_tok) = (GgmlType::Q4_K, 256, 1024, 8);
    let data = random_matrix(&mut rng, ty, n_out, n_in, false);
    let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
    let x = activations(&mut rng, n_tok, n_in);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut y = vec![0f32; n_tok * n_out];
        pool.install(|| matmul(&w, &x, n_tok, &mut y)).unwrap();
        y
    };
    assert_eq!(run(1), run(3));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_lane_record_permutation() {
    if !levels().contains(&KernelLevel::Avx512Vnni) {
        skip_hardware("quant::avx512_lane_record_permutation", "no AVX-512 VNNI");
        return;
    }
    let mut rng = StdRng::seed_from_u64(6);
    let x = rand_vec(&mut rng, GROUP);
    // Lane i = 4s + r of every accumulator register covers chunk LAYOUT[r][s]; A_k holds its k-th dword.
    let layouts: [(GgmlType, [[usize; 4]; 4]); 3] = [
        (
            GgmlType::Q4_K,
            [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]],
        ),
        (
            GgmlType::Q6_K,
            [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        ),
        (
            GgmlType::Q4_0,
            [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
        ),
    ];
    for (ty, layout) in layouts {
        let mut nat = [0u8; REC];
        act::quantize_group(act::act_kind(ty), &x, &mut nat);
        let mut lane = vec![0u8; REC];
        // SAFETY: AVX-512 VNNI checked above.
        unsafe { x86_avx512::lane_record(ty, &nat, &mut lane) };
        for k in 0..4 {
            for i in 0..16 {
                let c = layout[i % 4][i / 4];
                for j in 0..4 {
                    assert_eq!(
                        lane[64 * k + 4 * i + j],
                        nat[16 * c + 4 * k + j],
                        "{ty} k {k} lane {i} byte {j}"
                    );
                }
            }
        }
    }
}

/// Every activation row of a multi-row VNNI matmul is bit for bit what the kernel computes for that
/// row alone (n_tok = 1): tree verification must reproduce incremental decoding exactly. Covers
/// every quantized type, partial last groups, k-blocking (many groups × many rows), odd output row
/// counts and the row split over threads.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_rows_bit_identical_to_single_row() {
    if !levels().contains(&KernelLevel::Avx512Vnni) {
        skip_hardware(
            "quant::avx512_rows_bit_identical_to_single_row",
            "no AVX-512 VNNI",
        );
        return;
    }
    with_natural_rows(2, || {
        rows_bit_identical_to_single_row(KernelLevel::Avx512Vnni)
    });
    with_natural_rows(MAX_NATURAL_ROWS, || {
        rows_bit_identical_to_single_row(KernelLevel::Avx512Vnni)
    });
}

/// The same for the AVX2 kernels (natural order for one row; column tiles of 16 output × 4
/// activation rows above, with remainders of 1-3 activation rows and partial column blocks).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_rows_bit_identical_to_single_row() {
    if !levels().contains(&KernelLevel::Avx2) {
        skip_hardware(
            "quant::avx2_rows_bit_identical_to_single_row",
            "no AVX2/FMA/F16C",
        );
        return;
    }
    rows_bit_identical_to_single_row(KernelLevel::Avx2);
}

/// The same for the AVX-VNNI family (its column tiles of 16 output × 5 activation rows).
#[cfg(target_arch = "x86_64")]
#[test]
fn avxvnni_rows_bit_identical_to_single_row() {
    if !levels().contains(&KernelLevel::AvxVnni) {
        skip_hardware(
            "quant::avxvnni_rows_bit_identical_to_single_row",
            "no AVX-VNNI",
        );
        return;
    }
    rows_bit_identical_to_single_row(KernelLevel::AvxVnni);
}

/// The AVX-512 family's column tiles (`x86_avx2::kcols512` for K-quants, `x86_avx2::lcols512` for
/// Q4_1 and Q8_0) compute the AVX2 family's exact integers and float steps: every output equals
/// the AVX2 kernels' bit for bit, for raw random blocks (every scale, min and value pattern; Q8_0
/// values of -128 included), activation rows on both sides of the tile sizes, output rows that
/// leave partial 16- and 32-row blocks, and legacy rows that end in a partial 256-element group.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_column_tiles_bit_identical_to_avx2() {
    if !levels().contains(&KernelLevel::Avx512Vnni) {
        skip_hardware(
            "quant::avx512_column_tiles_bit_identical_to_avx2",
            "no AVX-512 VNNI",
        );
        return;
    }
    // The column tiles from 3 rows, then the natural-order kernel up to 16 (every CPU's choice
    // lies between).
    with_natural_rows(2, || bit_identical_to_avx2(KernelLevel::Avx512Vnni, 23));
    with_natural_rows(MAX_NATURAL_ROWS, || {
        bit_identical_to_avx2(KernelLevel::Avx512Vnni, 24)
    });
}

/// The same for the AVX-VNNI family (`x86_avx2::kvnni`: `vpdpbusd` into i32 per scale run in
/// place of the AVX2 tiles' i16 sums and `madd`).
#[cfg(target_arch = "x86_64")]
#[test]
fn avxvnni_column_tiles_bit_identical_to_avx2() {
    if !levels().contains(&KernelLevel::AvxVnni) {
        skip_hardware(
            "quant::avxvnni_column_tiles_bit_identical_to_avx2",
            "no AVX-VNNI",
        );
        return;
    }
    bit_identical_to_avx2(KernelLevel::AvxVnni, 29);
}

/// The types the column tiles and packed kernels run (K-quants, Q4_1, Q8_0).
#[cfg(target_arch = "x86_64")]
const COLUMN_TYPES: [GgmlType; 5] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
];

/// Every output of `level` equals the AVX2 family's bit for bit (see the tests above).
#[cfg(target_arch = "x86_64")]
fn bit_identical_to_avx2(level: KernelLevel, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    for ty in COLUMN_TYPES {
        let shapes: &[(usize, usize)] = if ty.block_elems() == 256 {
            &[(37, 256), (100, 2304), (16, 1024)]
        } else {
            &[(37, 32), (100, 576), (16, 1024), (33, 2080)]
        };
        for &(n_out, n_in) in shapes {
            let data = random_matrix(&mut rng, ty, n_out, n_in, true);
            let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
            for n_tok in [1usize, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 15, 33, 64, 70] {
                let x = activations(&mut rng, n_tok, n_in);
                let mut want = vec![f32::NAN; n_tok * n_out];
                matmul_with(KernelLevel::Avx2, &w, &x, n_tok, &mut want).unwrap();
                let mut got = vec![f32::NAN; n_tok * n_out];
                matmul_with(level, &w, &x, n_tok, &mut got).unwrap();
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} {n_out}x{n_in} n_tok {n_tok} [t {}, o {}]: {} {a} vs avx2 {b}",
                        i / n_out,
                        i % n_out,
                        level.name()
                    );
                }
            }
        }
    }
}

/// The same at the AMX level: batches of `amx::MIN_TOK` or more rows run the AMX tiles, smaller
/// ones (and single rows) the AMX-order VNNI kernel, and every row must still equal its single-row
/// result bit for bit, for the covered types (Q4_K, Q6_K, Q8_0) and the rest alike.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_rows_bit_identical_to_single_row() {
    if !levels().contains(&KernelLevel::Amx) {
        skip_hardware(
            "quant::amx_rows_bit_identical_to_single_row",
            "AMX int8 is not available or not granted by the OS",
        );
        return;
    }
    rows_bit_identical_to_single_row(KernelLevel::Amx);
}

#[cfg(target_arch = "x86_64")]
fn rows_bit_identical_to_single_row(level: KernelLevel) {
    let mut rng = StdRng::seed_from_u64(11);
    let pools: Vec<rayon::ThreadPool> = [1, 3]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    for ty in QUANT_TYPES {
        let n_ins: &[usize] = if ty.block_elems() == 256 {
            &[256, 2304]
        } else {
            &[288, 512, 2080]
        };
        for &n_in in n_ins {
            let n_out = 37;
            let data = random_matrix(&mut rng, ty, n_out, n_in, true);
            let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
            for n_tok in [2usize, 3, 4, 5, 7, 8, 16, 17, 33, 64, 80] {
                let x = activations(&mut rng, n_tok, n_in);
                let mut want = vec![0f32; n_tok * n_out];
                for (xr, yr) in x.chunks(n_in).zip(want.chunks_mut(n_out)) {
                    pools[0]
                        .install(|| matmul_with(level, &w, xr, 1, yr))
                        .unwrap();
                }
                for pool in &pools {
                    let mut got = vec![f32::NAN; n_tok * n_out];
                    pool.install(|| matmul_with(level, &w, &x, n_tok, &mut got))
                        .unwrap();
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{ty} n_in {n_in} n_tok {n_tok} threads {} [t {}, o {}]: {a} vs one row {b}",
                            pool.current_num_threads(),
                            i / n_out,
                            i % n_out
                        );
                    }
                }
            }
        }
    }
}

/// Every level a caller may ask for runs on this CPU as a level it has (AVX-VNNI is not implied
/// by AVX-512: Ice Lake and Zen 4 have AVX-512 VNNI without it), and a matmul asked for at any
/// level gives the bits of the level it runs.
#[test]
fn every_level_falls_back_to_one_this_cpu_runs() {
    let have = KernelLevel::available();
    // AVX-VNNI is offered exactly where the CPU reports it (with AVX2/FMA/F16C), whatever else
    // the CPU has.
    #[cfg(target_arch = "x86_64")]
    assert_eq!(
        have.contains(&KernelLevel::AvxVnni),
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avxvnni"),
        "{have:?}"
    );
    let mut rng = StdRng::seed_from_u64(31);
    let data = random_matrix(&mut rng, GgmlType::Q4_K, 24, 512, true);
    let w = QMatrix::new(GgmlType::Q4_K, &data, 24, 512).unwrap();
    let x = activations(&mut rng, 3, 512);
    for level in [
        KernelLevel::Scalar,
        KernelLevel::Avx2,
        KernelLevel::AvxVnni,
        KernelLevel::Avx512Vnni,
        KernelLevel::Amx,
    ] {
        let runs = level.on_this_cpu();
        assert!(
            have.contains(&runs),
            "{level:?} runs as {runs:?}, not in {have:?}"
        );
        assert!(
            runs == level || !have.contains(&level),
            "{level:?} is here but runs as {runs:?}"
        );
        let mut got = vec![f32::NAN; 3 * 24];
        matmul_with(level, &w, &x, 3, &mut got).unwrap();
        let mut want = vec![f32::NAN; 3 * 24];
        matmul_with(runs, &w, &x, 3, &mut want).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{level:?}"
        );
    }
}

#[test]
fn malformed_lengths_are_errors() {
    let data = vec![0u8; 144 * 2];
    assert!(QMatrix::new(GgmlType::Q4_K, &data, 2, 256).is_ok());
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_K, &data, 3, 256),
        Err(EngineError::Shape(_))
    ));
    assert!(matches!(
        QMatrix::new(GgmlType::Q4_K, &data, 2, 255),
        Err(EngineError::Shape(_))
    ));
    assert!(QMatrix::new(GgmlType::Q4_K, &data, usize::MAX, 256).is_err());
    let w = QMatrix::new(GgmlType::Q4_K, &data, 2, 256).unwrap();
    for level in [
        KernelLevel::Scalar,
        KernelLevel::Avx2,
        KernelLevel::AvxVnni,
        KernelLevel::Avx512Vnni,
    ] {
        let mut y = vec![0f32; 2];
        assert!(matmul_with(level, &w, &[0.0; 255], 1, &mut y).is_err());
        assert!(matmul_with(level, &w, &[0.0; 256], 2, &mut y).is_err());
        assert!(matmul_with(level, &w, &[0.0; 256], 1, &mut [0.0; 3]).is_err());
        assert!(matmul_with(level, &w, &[0.0; 256], usize::MAX, &mut y).is_err());
        assert!(matmul_with(level, &w, &[0.0; 256], 1, &mut y).is_ok());
        // A hand-built matrix whose fields disagree with its data.
        let bad = QMatrix {
            ty: GgmlType::Q4_K,
            data: &data,
            n_out: 5,
            n_in: 256,
            packed: false,
        };
        assert!(matches!(
            matmul_with(level, &bad, &[0.0; 256], 1, &mut [0.0; 5]),
            Err(EngineError::Shape(_))
        ));
        let bad = QMatrix {
            ty: GgmlType::Q4_K,
            data: &data,
            n_out: 1,
            n_in: 100,
            packed: false,
        };
        assert!(matmul_with(level, &bad, &[0.0; 100], 1, &mut [0.0; 1]).is_err());
    }
    let q2 = QMatrix {
        ty: GgmlType::Q2_K,
        data: &data[..84],
        n_out: 1,
        n_in: 256,
        packed: false,
    };
    assert!(matches!(
        matmul(&q2, &[0.0; 256], 1, &mut [0.0; 1]),
        Err(EngineError::UnsupportedTensorType(_))
    ));
    let mut out = vec![0f32; 256];
    assert!(dequantize_row(GgmlType::Q4_K, &data[..143], &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_K, &data, &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_K, &data[..144], &mut out[..100]).is_err());
    assert!(dequantize_row(GgmlType::Q8_K, &data[..144], &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_K, &data[..144], &mut out).is_ok());
    let mut buf = vec![0u8; 100];
    assert!(quantize_row(GgmlType::Q4_0, &[0.0; 33], &mut buf).is_err());
    assert!(quantize_row(GgmlType::Q4_0, &[0.0; 32], &mut buf).is_err());
    assert!(quantize_row(GgmlType::Q4_0, &[0.0; 32], &mut buf[..18]).is_ok());
    assert!(quantize_row(GgmlType::Q3_K, &[0.0; 256], &mut buf).is_err());
}

#[test]
fn degenerate_shapes() {
    let w = QMatrix::new(GgmlType::Q8_0, &[], 0, 64).unwrap();
    matmul(&w, &[1.0; 64], 1, &mut []).unwrap();
    let w = QMatrix::new(GgmlType::Q8_0, &[], 3, 0).unwrap();
    let mut y = vec![5.0; 6];
    matmul(&w, &[], 2, &mut y).unwrap();
    assert_eq!(y, vec![0.0; 6]);
    let data = quantized(GgmlType::Q8_0, &[1.0; 64]);
    let w = QMatrix::new(GgmlType::Q8_0, &data, 1, 64).unwrap();
    matmul(&w, &[], 0, &mut []).unwrap();
}

/// Standalone timing (run with `cargo test --release -p arbor-engine quant::tests::timing -- --ignored --nocapture`).
#[test]
#[ignore]
fn timing() {
    use std::time::Instant;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let cases = [
        (GgmlType::Q4_K, 1536usize, 8960usize),
        (GgmlType::Q4_K, 8960, 1536),
        (GgmlType::Q6_K, 1536, 8960),
        (GgmlType::Q5_K, 1536, 8960),
        (GgmlType::Q8_0, 576, 1536),
        (GgmlType::Q4_1, 576, 1536),
        (GgmlType::Q4_1, 1536, 576),
    ];
    // Several copies so the weights do not sit in cache between calls (like a real model).
    for (ty, n_out, n_in) in cases {
        let copies = (256 << 20) / ty.row_bytes(n_in).unwrap() / n_out;
        let copies = copies.clamp(1, 32);
        let mats: Vec<Vec<u8>> = (0..copies)
            .map(|_| random_matrix(&mut rng, ty, n_out, n_in, true))
            .collect();
        let bytes = mats[0].len();
        for level in levels() {
            let mut line = format!("{ty} {n_out}x{n_in} {:>6}:", level.name());
            for n_tok in [1usize, 2, 3, 4, 8, 16, 32, 64] {
                if level == KernelLevel::Scalar && n_tok > 4 {
                    continue;
                }
                let x = rand_vec(&mut rng, n_tok * n_in);
                let mut y = vec![0f32; n_tok * n_out];
                let iters = if level == KernelLevel::Scalar {
                    4
                } else {
                    3 * copies.max(8)
                };
                let t = Instant::now();
                pool.install(|| {
                    for i in 0..iters {
                        let w = QMatrix::new(ty, &mats[i % copies], n_out, n_in).unwrap();
                        matmul_with(level, &w, &x, n_tok, &mut y).unwrap();
                    }
                });
                let s = t.elapsed().as_secs_f64() / iters as f64;
                if n_tok == 1 {
                    line += &format!(" n1 {:.3} ms ({:.1} GB/s)", s * 1e3, bytes as f64 / s / 1e9);
                } else {
                    line += &format!(" | n{n_tok} {:.3} ms", s * 1e3);
                }
            }
            eprintln!("{line}");
        }
    }
}

/// The AMX kernels agree with the scalar reference (same tolerance as `simd_matches_scalar`) for
/// every covered type, activation row counts around the 16-row tile and output row counts that
/// are not a multiple of 16, on one and on several threads.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_matches_scalar() {
    if !amx::granted() {
        skip_hardware(
            "quant::amx_matches_scalar",
            "AMX int8 is not available or not granted by the OS",
        );
        return;
    }
    let mut rng = StdRng::seed_from_u64(8);
    let pools: Vec<rayon::ThreadPool> = [1, 3]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
        for n_in in [256usize, 512, 768] {
            for (n_out, raw) in [(37usize, true), (75, false), (16, true), (256, false)] {
                let data = random_matrix(&mut rng, ty, n_out, n_in, raw);
                let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
                let wf = dequant_matrix(ty, &data, n_out, n_in);
                for n_tok in [1usize, 5, 16, 17, 33, 64] {
                    let x = activations(&mut rng, n_tok, n_in);
                    let mut want = vec![0f32; n_tok * n_out];
                    matmul_with(KernelLevel::Scalar, &w, &x, n_tok, &mut want).unwrap();
                    for pool in &pools {
                        let mut got = vec![f32::NAN; n_tok * n_out];
                        assert!(pool.install(|| amx::matmul(&w, &x, n_tok, &mut got)));
                        for t in 0..n_tok {
                            for o in 0..n_out {
                                let (a, b) = (got[t * n_out + o], want[t * n_out + o]);
                                let tol = 2e-5 * term_scale(&wf, &x, n_in, o, t) + 1e-6;
                                assert!(
                                    ((a - b) as f64).abs() <= tol,
                                    "{ty} amx n_out {n_out} n_in {n_in} n_tok {n_tok} threads {} [t {t}, o {o}]: {a} vs scalar {b} (tol {tol})",
                                    pool.current_num_threads()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The AMX path declines what it does not cover (the caller then runs the VNNI kernels), and
/// `matmul_with(Amx)` still agrees with the scalar kernel on those.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_declines_uncovered_weights() {
    let mut rng = StdRng::seed_from_u64(9);
    for (ty, n_in) in [
        (GgmlType::Q4_0, 256usize),
        (GgmlType::Q8_0, 288),
        (GgmlType::F16, 256),
    ] {
        let (n_out, n_tok) = (20, 16);
        let data = random_matrix(&mut rng, ty, n_out, n_in, false);
        let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
        let x = activations(&mut rng, n_tok, n_in);
        let mut y = vec![7f32; n_tok * n_out];
        assert!(!amx::matmul(&w, &x, n_tok, &mut y));
        assert!(
            y.iter().all(|&v| v == 7.0),
            "{ty}: declined call wrote output"
        );
        let mut want = vec![0f32; n_tok * n_out];
        matmul_with(KernelLevel::Scalar, &w, &x, n_tok, &mut want).unwrap();
        matmul_with(KernelLevel::Amx, &w, &x, n_tok, &mut y).unwrap();
        let wf = dequant_matrix(ty, &data, n_out, n_in);
        for t in 0..n_tok {
            for o in 0..n_out {
                let tol = 2e-5 * term_scale(&wf, &x, n_in, o, t) + 1e-6;
                assert!(((y[t * n_out + o] - want[t * n_out + o]) as f64).abs() <= tol);
            }
        }
    }
}

/// `reduce16` gives every lane exactly the bits of `_mm512_reduce_add_ps` of its vector (the
/// VNNI kernels' outputs do not change with how many rows are reduced at once), on values of
/// mixed signs and magnitudes where any other order of the adds would round differently.
#[cfg(target_arch = "x86_64")]
#[test]
fn reduce16_bit_identical_to_one_vector_reduction() {
    use std::arch::x86_64::*;
    if !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("avx512vnni") {
        skip_hardware(
            "quant::reduce16_bit_identical_to_one_vector_reduction",
            "no AVX-512F / VNNI",
        );
        return;
    }
    let mut rng = StdRng::seed_from_u64(16);
    for round in 0..2000 {
        let vals: Vec<f32> = (0..256)
            .map(|_| randn(&mut rng) * 10f32.powi(rng.gen_range(-3..4)))
            .collect();
        // SAFETY: AVX-512F and VNNI were detected above; `vals` holds 16 × 16 floats.
        let (got, want) = unsafe {
            let mut v = [_mm512_setzero_ps(); 16];
            for (j, vj) in v.iter_mut().enumerate() {
                *vj = _mm512_loadu_ps(vals[16 * j..].as_ptr());
            }
            let mut got = [0f32; 16];
            _mm512_storeu_ps(got.as_mut_ptr(), x86_avx512::reduce16(&v));
            let want: Vec<f32> = v.iter().map(|&x| _mm512_reduce_add_ps(x)).collect();
            (got, want)
        };
        for j in 0..16 {
            assert_eq!(
                got[j].to_bits(),
                want[j].to_bits(),
                "round {round} lane {j}"
            );
        }
    }
}

/// `matmul_many_in` gives every matrix's output bit for bit as its own `matmul_in` does, in every
/// AMX scope, for batch sizes around the tiles' threshold: mixed weight types (each matrix on
/// its own), and sets of one activation format, natural and column-packed (the activations
/// quantized once for all of them, every matrix's rows in one region: QKV's and SwiGLU's case).
#[test]
fn matmul_many_bit_identical_to_one_at_a_time() {
    let mut rng = StdRng::seed_from_u64(21);
    let n_in = 512;
    let sets: [&[(GgmlType, usize)]; 6] = [
        &[
            (GgmlType::Q4_K, 48),
            (GgmlType::Q6_K, 37),
            (GgmlType::Q4_K, 16),
            (GgmlType::Q8_0, 21),
        ],
        &[
            (GgmlType::Q4_K, 48),
            (GgmlType::Q6_K, 32),
            (GgmlType::Q4_K, 16),
        ],
        // One record format, but the AMX family's natural tiles take Q6_K and not Q5_K: each
        // matrix keeps its own path.
        &[(GgmlType::Q5_K, 48), (GgmlType::Q6_K, 32)],
        &[(GgmlType::Q6_K, 32), (GgmlType::Q5_K, 48)],
        &[
            (GgmlType::Q4_1, 64),
            (GgmlType::Q4_1, 32),
            (GgmlType::Q4_1, 16),
        ],
        &[(GgmlType::Q8_0, 48), (GgmlType::Q8_0, 16)],
    ];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for (set, specs) in sets.iter().enumerate() {
        for pack in [false, true] {
            if pack && !specs.iter().all(|&(ty, n)| packed::packable(ty, n, n_in)) {
                continue;
            }
            let mats: Vec<Vec<u8>> = specs
                .iter()
                .map(|&(ty, n_out)| {
                    let mut d = random_matrix(&mut rng, ty, n_out, n_in, true);
                    if pack {
                        packed::pack(ty, &mut d, n_out, n_in);
                    }
                    d
                })
                .collect();
            let ws: Vec<QMatrix> = specs
                .iter()
                .zip(&mats)
                .map(|(&(ty, n_out), d)| QMatrix {
                    packed: pack,
                    ..QMatrix::new(ty, d, n_out, n_in).unwrap()
                })
                .collect();
            for scope in [AmxScope::Off, AmxScope::Prefill, AmxScope::Family] {
                for n_tok in [1usize, 7, 8, 16, 17, 40] {
                    let x = activations(&mut rng, n_tok, n_in);
                    let mut many: Vec<Vec<f32>> =
                        ws.iter().map(|w| vec![f32::NAN; n_tok * w.n_out]).collect();
                    let mut outs: Vec<&mut [f32]> =
                        many.iter_mut().map(|v| v.as_mut_slice()).collect();
                    pool.install(|| matmul_many_in(scope, &ws, &x, n_tok, &mut outs))
                        .unwrap();
                    for (i, w) in ws.iter().enumerate() {
                        let mut one = vec![f32::NAN; n_tok * w.n_out];
                        pool.install(|| matmul_in(scope, w, &x, n_tok, &mut one))
                            .unwrap();
                        let same = one
                            .iter()
                            .zip(&many[i])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "set {set} packed {pack} {scope:?} n_tok {n_tok} matrix {i} ({})",
                            w.ty
                        );
                    }
                }
            }
            // Mismatched outputs are an error, not a panic.
            let x = vec![0f32; n_in];
            let mut y = vec![0f32; ws[0].n_out];
            assert!(matmul_many_in(AmxScope::Family, &ws, &x, 1, &mut [&mut y]).is_err());
        }
    }
}

/// `matmul_new` (the output head's entry: no clearing where the AMX tiles write every output)
/// gives exactly `matmul`'s bits, inside and outside the AMX family, for tile-sized and smaller
/// batches, covered and uncovered types; a bad input length is an error.
#[test]
fn matmul_new_equals_matmul() {
    let mut rng = StdRng::seed_from_u64(21);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
    ] {
        let (n_out, n_in) = (45, 512);
        let data = random_matrix(&mut rng, ty, n_out, n_in, true);
        let w = QMatrix::new(ty, &data, n_out, n_in).unwrap();
        for n_tok in [1usize, 8, 16, 21] {
            let x = activations(&mut rng, n_tok, n_in);
            for family in [false, true] {
                let run = |f: &dyn Fn() -> Result<Vec<f32>>| {
                    if family {
                        with_amx_family(f)
                    } else {
                        f()
                    }
                };
                let got = run(&|| matmul_new(&w, &x, n_tok)).unwrap();
                let want = run(&|| {
                    let mut y = vec![f32::NAN; n_tok * n_out];
                    matmul(&w, &x, n_tok, &mut y).map(|_| y)
                })
                .unwrap();
                assert_eq!(got.len(), want.len());
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} n_tok {n_tok} family {family} [{i}]: {a} vs {b}"
                    );
                }
            }
            assert!(with_amx_family(|| matmul_new(&w, &x[1..], n_tok)).is_err());
        }
    }
}

/// SwiGLU fused into the row tasks (AMX tiles, or the VNNI kernels over activations quantized
/// once; each task gates its own rows) equals the two matmuls followed by `silu_mul`, bit for
/// bit, in every scope, with a partial last row tile, natural and packed.
#[test]
fn matmul_swiglu_equals_matmuls_then_gate() {
    let mut rng = StdRng::seed_from_u64(33);
    let cases = [
        (GgmlType::Q4_K, 45, false),
        (GgmlType::Q6_K, 45, false),
        (GgmlType::Q8_0, 45, false),
        (GgmlType::Q4_1, 45, false),
        (GgmlType::Q4_K, 48, true),
        (GgmlType::Q4_1, 64, true),
    ];
    for (ty, n_out, pack) in cases {
        let n_in = 512;
        let (mut dg, mut du) = (
            random_matrix(&mut rng, ty, n_out, n_in, true),
            random_matrix(&mut rng, ty, n_out, n_in, true),
        );
        if pack {
            packed::pack(ty, &mut dg, n_out, n_in);
            packed::pack(ty, &mut du, n_out, n_in);
        }
        let wg = QMatrix {
            packed: pack,
            ..QMatrix::new(ty, &dg, n_out, n_in).unwrap()
        };
        let wu = QMatrix {
            packed: pack,
            ..QMatrix::new(ty, &du, n_out, n_in).unwrap()
        };
        for n_tok in [1usize, 8, 16, 21] {
            let x = activations(&mut rng, n_tok, n_in);
            for scope in [AmxScope::Off, AmxScope::Prefill, AmxScope::Family] {
                let (mut g, mut u) = (vec![f32::NAN; n_tok * n_out], vec![f32::NAN; n_tok * n_out]);
                matmul_swiglu_in(scope, &wg, &wu, &x, n_tok, &mut g, &mut u).unwrap();
                let (mut g2, mut u2) = (vec![0f32; n_tok * n_out], vec![0f32; n_tok * n_out]);
                matmul_many_in(scope, &[wg, wu], &x, n_tok, &mut [&mut g2, &mut u2]).unwrap();
                crate::backend::simd::silu_mul(&mut g2, &u2);
                for (i, ((a, b), (c, d))) in g.iter().zip(&g2).zip(u.iter().zip(&u2)).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{ty} n_tok {n_tok} {scope:?} gate [{i}]"
                    );
                    assert_eq!(
                        c.to_bits(),
                        d.to_bits(),
                        "{ty} n_tok {n_tok} {scope:?} up [{i}]"
                    );
                }
            }
        }
    }
}

/// Column-packed K-quant, Q4_1 and Q8_0 matrices (`packed`): unpacking gives the GGUF rows back
/// byte for byte (and `natural_row` each row),
/// and the AVX-512 family computes every output of a packed matrix bit for bit as of the natural
/// one, for batch sizes around the tile heights, 16- and 32-row slices, several row splits
/// (one and two threads), and every other level through the unpacked copy.
#[cfg(target_arch = "x86_64")]
#[test]
fn packed_matrices_bit_identical_to_natural() {
    let mut rng = StdRng::seed_from_u64(41);
    let two = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for ty in COLUMN_TYPES {
        assert!(!packed::packable(ty, 40, 256) && !packed::packable(ty, 16, 100));
        // Legacy rows of whole groups, of a short last group (smollm2's 576) and of one block.
        let shapes: &[(usize, usize)] = if ty.block_elems() == 32 {
            &[(16, 32), (48, 576), (96, 2304), (32, 320)]
        } else {
            &[(16, 256), (48, 512), (96, 2304)]
        };
        for &(n_out, n_in) in shapes {
            assert!(packed::packable(ty, n_out, n_in));
            let data = random_matrix(&mut rng, ty, n_out, n_in, true);
            let mut pk = data.clone();
            packed::pack(ty, &mut pk, n_out, n_in);
            assert_ne!(pk, data, "{ty}: packing changed nothing");
            assert_eq!(
                packed::unpack(ty, &pk, n_out, n_in),
                data,
                "{ty} round trip"
            );
            let nat = QMatrix::new(ty, &data, n_out, n_in).unwrap();
            let pw = QMatrix {
                packed: true,
                ..QMatrix::new(ty, &pk, n_out, n_in).unwrap()
            };
            assert_eq!(pw.natural_bytes().as_ref(), &data[..]);
            let rb = ty.row_bytes(n_in).unwrap();
            let mut row = vec![0u8; rb];
            for r in [0, 1, 15, n_out - 1] {
                packed::natural_row(ty, &pk, n_in, r, &mut row);
                assert_eq!(row, data[r * rb..(r + 1) * rb], "{ty} row {r}");
            }
            for n_tok in [1usize, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 70] {
                let x = activations(&mut rng, n_tok, n_in);
                for level in levels() {
                    // The AMX family runs packed rows with the AVX-512 VNNI family's arithmetic
                    // (its natural rows with its own f32 order).
                    let nat_level = match level {
                        KernelLevel::Amx => KernelLevel::Avx512Vnni,
                        l => l,
                    };
                    let mut want = vec![f32::NAN; n_tok * n_out];
                    matmul_with(nat_level, &nat, &x, n_tok, &mut want).unwrap();
                    for pool in [None, Some(&two)] {
                        let mut got = vec![f32::NAN; n_tok * n_out];
                        match pool {
                            Some(p) => {
                                p.install(|| matmul_with(level, &pw, &x, n_tok, &mut got).unwrap())
                            }
                            None => matmul_with(level, &pw, &x, n_tok, &mut got).unwrap(),
                        }
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{ty} {n_out}x{n_in} n_tok {n_tok} {} [t {}, o {}]: packed {a} vs {b}",
                                level.name(),
                                i / n_out,
                                i % n_out,
                            );
                        }
                    }
                }
            }
        }
    }
}

/// In-cache cost of packed against natural K-quant matrices at the AVX-512 level, one thread
/// (`cargo test --release -p arbor-engine quant::tests::packed_timing -- --ignored --nocapture`).
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn packed_timing() {
    use std::time::Instant;
    if !levels().contains(&KernelLevel::Avx512Vnni) {
        return;
    }
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let (n_out, n_in) = (256usize, 2048usize);
        let data = random_matrix(&mut rng, ty, n_out, n_in, true);
        let mut pk = data.clone();
        packed::pack(ty, &mut pk, n_out, n_in);
        let nat = QMatrix::new(ty, &data, n_out, n_in).unwrap();
        let pw = QMatrix {
            packed: true,
            ..QMatrix::new(ty, &pk, n_out, n_in).unwrap()
        };
        for n_tok in [1usize, 2, 3, 4, 6, 8, 16, 64] {
            let x = activations(&mut rng, n_tok, n_in);
            let mut y = vec![0f32; n_tok * n_out];
            let mut best = [f64::INFINITY; 2];
            for _round in 0..5 {
                for (k, w) in [&nat, &pw].into_iter().enumerate() {
                    let t = Instant::now();
                    one.install(|| {
                        for _ in 0..200 {
                            matmul_with(KernelLevel::Avx512Vnni, w, &x, n_tok, &mut y).unwrap();
                        }
                    });
                    best[k] = best[k].min(t.elapsed().as_secs_f64() / 200.0);
                }
            }
            let gp = |s: f64| (n_out * n_in * n_tok) as f64 / s / 1e9;
            eprintln!(
                "{ty} n{n_tok}: natural {:.1} us ({:.0} Gprod/s), packed {:.1} us ({:.0} Gprod/s)",
                best[0] * 1e6,
                gp(best[0]),
                best[1] * 1e6,
                gp(best[1])
            );
        }
    }
}

/// The AVX-512 family's two K-quant kernels side by side for a few rows (what
/// `natural_kernel_rows` chooses between): the column tiles against the natural-order kernel,
/// alternated over 15 rounds, medians and minima in ms per matmul (qwen2.5-coder-1.5b's shapes,
/// weights streamed from memory as in a model). `AB_ROWS=2,4,8` picks the row counts.
/// `cargo test --release -p arbor-engine quant::tests::natural_rows_timing -- --ignored --nocapture`
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn natural_rows_timing() {
    use std::time::Instant;
    // `AB_LEVEL=avx2`: the AVX2 family (its natural kernels, whatever `nat` says, and packed).
    let level = match std::env::var("AB_LEVEL").as_deref() {
        Ok("avx2") => KernelLevel::Avx2,
        _ => KernelLevel::Avx512Vnni,
    };
    if !levels().contains(&level) {
        skip_hardware("quant::natural_rows_timing", "the CPU lacks the level");
        return;
    }
    // `AB_THREADS=1`: one thread; `AB_HOT=1`: one small matrix over and over (in L2: the
    // kernels' arithmetic without the memory stream).
    let threads = std::env::var("AB_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let hot = std::env::var("AB_HOT").is_ok_and(|s| s == "1");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    // (name, natural rows, packed weights).
    // `AB_VARIANTS=packed,natural`: only those.
    let only = std::env::var("AB_VARIANTS").unwrap_or_default();
    let variants: Vec<(&str, usize, bool)> = [
        ("tiles", 1, false),
        ("natural", MAX_NATURAL_ROWS, false),
        ("packed", MAX_NATURAL_ROWS, true),
    ]
    .into_iter()
    .filter(|(name, _, _)| only.is_empty() || only.split(',').any(|o| o == *name))
    .collect();
    let rows: Vec<usize> = std::env::var("AB_ROWS")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![2, 4, 8, 12, 16]);
    let shapes: &[(GgmlType, usize, usize)] = if hot {
        &[(GgmlType::Q4_K, 512, 1536), (GgmlType::Q6_K, 512, 1536)]
    } else {
        &[
            (GgmlType::Q4_K, 1536, 8960),
            (GgmlType::Q4_K, 8960, 1536),
            (GgmlType::Q6_K, 1536, 8960),
            (GgmlType::Q4_K, 256, 1536),
        ]
    };
    for &(ty, n_out, n_in) in shapes {
        let copies = if hot {
            1
        } else {
            ((256 << 20) / ty.row_bytes(n_in).unwrap() / n_out).clamp(1, 64)
        };
        let mats: Vec<Vec<u8>> = (0..copies)
            .map(|_| random_matrix(&mut rng, ty, n_out, n_in, true))
            .collect();
        let packs: Vec<Vec<u8>> = mats
            .iter()
            .map(|m| {
                let mut pk = m.clone();
                packed::pack(ty, &mut pk, n_out, n_in);
                pk
            })
            .collect();
        for &n_tok in &rows {
            let x = rand_vec(&mut rng, n_tok * n_in);
            let mut y = vec![0f32; n_tok * n_out];
            let mut times = vec![Vec::new(); variants.len()];
            let mut k = 0;
            for _round in 0..15 {
                for (&(_, nat, pk), times) in variants.iter().zip(times.iter_mut()) {
                    let iters = if hot { 1000 } else { copies.max(8) };
                    let t = Instant::now();
                    pool.install(|| {
                        with_natural_rows(nat, || {
                            for _ in 0..iters {
                                let data = if pk { &packs } else { &mats };
                                let w = QMatrix {
                                    packed: pk,
                                    ..QMatrix::new(ty, &data[k % copies], n_out, n_in).unwrap()
                                };
                                k += 1;
                                matmul_with(level, &w, &x, n_tok, &mut y).unwrap();
                            }
                        })
                    });
                    times.push(t.elapsed().as_secs_f64() / iters as f64 * 1e3);
                }
            }
            let mut line = format!("{ty} {n_out}x{n_in} n{n_tok}:");
            for ((name, _, _), t) in variants.iter().zip(times.iter_mut()) {
                t.sort_by(f64::total_cmp);
                line += &format!(" {name} {:.4} (min {:.4})", t[t.len() / 2], t[0]);
            }
            eprintln!("{line}");
        }
    }
}

/// A matrix marked packed that has no whole 16-row slices is refused before any kernel runs
/// (the packed kernels read and write 16 rows per slice).
#[test]
fn a_matrix_marked_packed_without_whole_slices_is_an_error() {
    let mut rng = StdRng::seed_from_u64(41);
    let (n_out, n_in) = (8usize, 256usize);
    let data = random_matrix(&mut rng, GgmlType::Q4_K, n_out, n_in, true);
    let w = QMatrix {
        packed: true,
        ..QMatrix::new(GgmlType::Q4_K, &data, n_out, n_in).unwrap()
    };
    let x = activations(&mut rng, 2, n_in);
    let mut y = vec![0f32; 2 * n_out];
    for level in levels() {
        let err = matmul_with(level, &w, &x, 2, &mut y).expect_err("8-row packed matrix ran");
        assert!(
            err.to_string().contains("marked packed"),
            "{level:?}: {err}"
        );
    }
}

/// The AMX family on natural rows (tiles from `amx::MIN_TOK` rows, the AMX-order VNNI twin
/// below) and on packed rows (tiles from `amx_packed::min_rows`, the packed VNNI kernels below)
/// against the packed AVX-512 VNNI kernels alone, per matmul of qwen2.5-coder-1.5b's FFN shapes
/// (8 copies streamed from memory), two threads, best of 5 rounds.
/// `cargo test --release -p arbor-engine --lib quant::tests::amx_vs_packed_timing -- --ignored --nocapture`
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn amx_vs_packed_timing() {
    use std::time::Instant;
    if !levels().contains(&KernelLevel::Amx) {
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    // qwen2.5-coder-1.5b's FFN up/gate and down shapes.
    for (ty, n_out, n_in) in [
        (GgmlType::Q4_K, 8960usize, 1536usize),
        (GgmlType::Q6_K, 8960, 1536),
        (GgmlType::Q4_K, 1536, 8960),
        (GgmlType::Q6_K, 1536, 8960),
    ] {
        let copies = 8;
        let mats: Vec<(Vec<u8>, Vec<u8>)> = (0..copies)
            .map(|_| {
                let data = random_matrix(&mut rng, ty, n_out, n_in, true);
                let mut pk = data.clone();
                packed::pack(ty, &mut pk, n_out, n_in);
                (data, pk)
            })
            .collect();
        for n_tok in [1usize, 2, 4, 8, 12, 16, 32, 64] {
            let x = activations(&mut rng, n_tok, n_in);
            let mut y = vec![0f32; n_tok * n_out];
            let mut best = [f64::INFINITY; 3];
            for _round in 0..5 {
                for (k, b) in best.iter_mut().enumerate() {
                    let t = Instant::now();
                    pool.install(|| {
                        for (nat, pk) in &mats {
                            if k == 0 {
                                let w = QMatrix::new(ty, nat, n_out, n_in).unwrap();
                                matmul_with(KernelLevel::Amx, &w, &x, n_tok, &mut y).unwrap();
                            } else {
                                let w = QMatrix {
                                    packed: true,
                                    ..QMatrix::new(ty, pk, n_out, n_in).unwrap()
                                };
                                let level = [KernelLevel::Avx512Vnni, KernelLevel::Amx][k - 1];
                                matmul_with(level, &w, &x, n_tok, &mut y).unwrap();
                            }
                        }
                    });
                    *b = b.min(t.elapsed().as_secs_f64() / copies as f64);
                }
            }
            eprintln!(
                "{ty} {n_out}x{n_in} n{n_tok}: amx natural {:.0} us, packed vnni {:.0} us, amx packed {:.0} us",
                best[0] * 1e6,
                best[1] * 1e6,
                best[2] * 1e6
            );
        }
    }
}
