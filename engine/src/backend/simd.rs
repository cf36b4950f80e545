//! f32 vector kernels for attention (dot product, scaled accumulate), softmax and SwiGLU, dispatched at run time to
//! AVX-512F or AVX2+FMA+F16C (`ARBOR_KERNEL=avx2` or `avxvnni` forces the latter, `scalar` the portable code).

use std::sync::OnceLock;

use half::f16;

/// This module's kernel level; [`widened!`] functions run at its width too.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

pub(crate) fn level() -> Level {
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let want = std::env::var("ARBOR_KERNEL").unwrap_or_default();
            let want = want.trim();
            if want.eq_ignore_ascii_case("scalar") {
                return Level::Portable;
            }
            // `avxvnni` stands for an AVX2 + AVX-VNNI CPU (no AVX-512).
            if is_x86_feature_detected!("avx512f")
                && !want.eq_ignore_ascii_case("avx2")
                && !want.eq_ignore_ascii_case("avxvnni")
            {
                return Level::Avx512;
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Level::Avx2;
            }
        }
        Level::Portable
    })
}

/// Cephes `expf` constants: `exp(x) = 2^n · e^r`, `n = round(x·log2 e)`, `r = x − n·ln 2` (ln 2 in
/// two parts), `e^r = 1 + r + r²·P(r)` (about 1 ulp on |r| ≤ ln2/2).
const EXP_LOG2E: f32 = std::f32::consts::LOG2_E;
const EXP_C1: f32 = 0.693_359_4;
const EXP_C2: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `exp(x)` with the Cephes polynomial (the portable twin of `x86::exp_avx512`: the same
/// operations, fused where it fuses).
#[inline]
fn exp_portable(x: f32) -> f32 {
    let x = x.clamp(-104.0, 89.0);
    let n = (x * EXP_LOG2E).round_ties_even();
    let r = (-n).mul_add(EXP_C2, (-n).mul_add(EXP_C1, x));
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let e = p.mul_add(r * r, r) + 1.0;
    // 2^n in two steps so that neither factor overflows or flushes early.
    let n = n as i32;
    let (h, l) = (n / 2, n - n / 2);
    e * f32::from_bits(((h + 127) as u32) << 23) * f32::from_bits(((l + 127) as u32) << 23)
}

/// SwiGLU's gate in place: `g[i] = silu(g[i]) · u[i]` with `silu(x) = x / (1 + exp(−x))`, the
/// exponential vectorized (same function for every batch size, so batches keep the bits of
/// single-token decoding).
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    let n = g.len().min(u.len());
    let (g, u) = (&mut g[..n], &u[..n]);
    match level() {
        // SAFETY: the level was chosen from CPUID; slices have equal length.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::silu_mul_avx512(g, u) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::silu_mul_avx2(g, u) },
        _ => {
            for (a, &b) in g.iter_mut().zip(u) {
                *a = *a / (1.0 + exp_portable(-*a)) * b;
            }
        }
    }
}

/// `x[i] = exp(x[i] − sub)` in place; returns the sum of the results as 16 lane sums (lane `j`
/// adds elements `j, j + 16, …` in order), then the lanes in turn. (A single running sum, one
/// dependent add per element, cost ~4 cycles per score in a 16-token batch's softmax.)
pub fn exp_sub_sum(x: &mut [f32], sub: f32) -> f32 {
    let lanes = match level() {
        // SAFETY: the level was chosen from CPUID.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::exp_sub_avx512(x, sub) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::exp_sub_avx2(x, sub) },
        _ => {
            let mut lanes = [0f32; 16];
            for (i, v) in x.iter_mut().enumerate() {
                *v = exp_portable(*v - sub);
                lanes[i % 16] += *v;
            }
            lanes
        }
    };
    lanes.iter().fold(0.0f32, |s, &v| s + v)
}

/// `x[i] = exp(x[i] − sub)` in place ([`exp_sub_sum`] without using its sum: the lane sums cost
/// one add per 16 values).
pub fn exp_sub(x: &mut [f32], sub: f32) {
    exp_sub_sum(x, sub);
}

/// `widened! { fn name<T: Bound>(a: A, ...) -> R = body; }` defines `name`, which calls the
/// `#[inline(always)]` function `body` compiled for AVX-512F, for AVX2 or for neither, as
/// [`level`] says: its loops vectorize at the machine's width. Only for code whose results do
/// not depend on the width: element-wise IEEE operations and sums whose order the code fixes
/// itself (Rust never fuses a multiply and an add on its own).
macro_rules! widened {
    ($(#[$m:meta])* $vis:vis fn $name:ident $(<$($g:ident : $b:path),*>)? ($($a:ident : $t:ty),*) -> $r:ty = $body:path;) => {
        $(#[$m])*
        $vis fn $name $(<$($g: $b),*>)? ($($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn wide512 $(<$($g: $b),*>)? ($($a: $t),*) -> $r {
                $body($($a),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            unsafe fn wide256 $(<$($g: $b),*>)? ($($a: $t),*) -> $r {
                $body($($a),*)
            }
            match $crate::backend::simd::level() {
                // SAFETY: the level was chosen from CPUID.
                #[cfg(target_arch = "x86_64")]
                $crate::backend::simd::Level::Avx512 => unsafe { wide512($($a),*) },
                #[cfg(target_arch = "x86_64")]
                $crate::backend::simd::Level::Avx2 => unsafe { wide256($($a),*) },
                $crate::backend::simd::Level::Portable => $body($($a),*),
            }
        }
    };
}
pub(crate) use widened;

/// sum_i a[i] * b[i] over the common length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match level() {
        // SAFETY: the level was chosen from CPUID; slices have equal length.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::dot_avx2(a, b) },
        Level::Portable => dot_portable(a, b),
    }
}

/// y[i] += s * x[i] over the common length.
#[inline]
pub fn axpy(y: &mut [f32], s: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    let (y, x) = (&mut y[..n], &x[..n]);
    match level() {
        // SAFETY: the level was chosen from CPUID; slices have equal length.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::axpy_avx512(y, s, x) },
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::axpy_avx2(y, s, x) },
        Level::Portable => axpy_portable(y, s, x),
    }
}

/// Round every value to the nearest f16 (in place): K/V, Q and attention weights are kept at f16
/// precision, as in llama.cpp's default cache.
#[inline]
pub fn round_f16_slice(x: &mut [f32]) {
    match level() {
        // SAFETY: the level was chosen from CPUID (AVX-512F includes the f16 conversions).
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { x86::round_f16_avx512(x) },
        // SAFETY: the level was chosen from CPUID (AVX2 level implies F16C).
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { x86::round_f16_avx2(x) },
        _ => {
            for v in x.iter_mut() {
                *v = half::f16::from_f32(*v).to_f32();
            }
        }
    }
}

/// A cache row of `hd` f16 values as f32 (exact: f16 widens to f32 without rounding).
fn widen_row<'a>(row: &[f16], out: &'a mut [f32; 256]) -> &'a [f32] {
    for (o, h) in out.iter_mut().zip(row) {
        *o = h.to_f32();
    }
    &out[..row.len()]
}

/// Attention scores over f16 cache rows: `scores[i] = dot(q, rows[slots[i]]) * scale`, where row
/// `s` is `k[s * stride + off..][..q.len()]` widened to f32. Returns the maximum score. The bits
/// are those of [`dot`] over the widened rows.
pub fn attn_scores(
    q: &[f32],
    k: &[f16],
    slots: &[usize],
    stride: usize,
    off: usize,
    scale: f32,
    scores: &mut Vec<f32>,
) -> f32 {
    let hd = q.len();
    scores.clear();
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512
        && hd.is_multiple_of(16)
        && slots.iter().all(|&s| s * stride + off + hd <= k.len())
    {
        // SAFETY: AVX-512F detected; every row read was bounds-checked just above.
        return unsafe { x86::attn_scores_avx512(q, k, slots, stride, off, scale, scores) };
    }
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx2
        && hd.is_multiple_of(16)
        && hd <= 256
        && slots.iter().all(|&s| s * stride + off + hd <= k.len())
    {
        // SAFETY: AVX2/FMA/F16C detected; every row read was bounds-checked just above.
        return unsafe { x86::attn_scores_avx2(q, k, slots, stride, off, scale, scores) };
    }
    let mut max = f32::NEG_INFINITY;
    let mut buf = [0f32; 256];
    for &s in slots {
        let row = &k[s * stride + off..s * stride + off + hd];
        let sc = if hd <= 256 {
            dot(q, widen_row(row, &mut buf)) * scale
        } else {
            let wide: Vec<f32> = row.iter().map(|h| h.to_f32()).collect();
            dot(q, &wide) * scale
        };
        max = max.max(sc);
        scores.push(sc);
    }
    max
}

/// Attention output, accumulated: `o += sum_i p[i] * rows[slots[i]]` (in slot order, so a call
/// per block of slots sums exactly as one call over all of them) with f16 rows laid out as in
/// [`attn_scores`]; per output the bits of [`axpy`] over the widened rows.
pub fn attn_weighted_sum(
    p: &[f32],
    v: &[f16],
    slots: &[usize],
    stride: usize,
    off: usize,
    o: &mut [f32],
) {
    let hd = o.len();
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512
        && hd.is_multiple_of(16)
        && hd <= 256
        && slots.iter().all(|&s| s * stride + off + hd <= v.len())
    {
        // SAFETY: AVX-512F detected; every row read was bounds-checked just above.
        return unsafe { x86::attn_weighted_sum_avx512(p, v, slots, stride, off, o) };
    }
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx2
        && hd.is_multiple_of(8)
        && slots.iter().all(|&s| s * stride + off + hd <= v.len())
    {
        // SAFETY: AVX2/FMA/F16C detected; every row read was bounds-checked just above.
        return unsafe { x86::attn_weighted_sum_avx2(p, v, slots, stride, off, o) };
    }
    let mut wide = Vec::with_capacity(hd);
    for (&s, &w) in slots.iter().zip(p) {
        wide.clear();
        wide.extend(
            v[s * stride + off..s * stride + off + hd]
                .iter()
                .map(|h| h.to_f32()),
        );
        axpy(o, w, &wide);
    }
}

/// Most query heads the AVX-512 grouped kernels keep in one register tile
/// ([`attn_weighted_sum_group`]).
const GROUP_TILE: usize = 6;

/// [`attn_scores`] for the `g = qs.len() / hd` query heads of one KV head (grouped-query
/// attention), over the same slots: head `h`'s query is `qs[h * hd..][..hd]`, its scores go to
/// `scores[h * ld..][..slots.len()]` and its maximum to `maxes[h]`, each exactly what
/// [`attn_scores`] gives that head alone (the same FMAs in the same order). Each K row is widened
/// once for all `g` heads instead of once per head.
#[allow(clippy::too_many_arguments)]
pub fn attn_scores_group(
    qs: &[f32],
    hd: usize,
    k: &[f16],
    slots: &[usize],
    stride: usize,
    off: usize,
    scale: f32,
    scores: &mut [f32],
    ld: usize,
    maxes: &mut [f32],
) {
    let g = qs.len() / hd.max(1);
    let n = slots.len();
    assert!(
        qs.len() == g * hd
            && maxes.len() >= g
            && ld >= n
            && (g == 0 || scores.len() >= (g - 1) * ld + n),
        "attn_scores_group: buffers do not match shape"
    );
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512
        && (hd == 128 || hd == 64)
        && slots.iter().all(|&s| s * stride + off + hd <= k.len())
    {
        // SAFETY: AVX-512F detected; every row read was bounds-checked just above, the output
        // lengths asserted.
        unsafe {
            match hd {
                128 => x86::scores_group_avx512::<8>(
                    qs, k, slots, stride, off, scale, scores, ld, maxes,
                ),
                _ => x86::scores_group_avx512::<4>(
                    qs, k, slots, stride, off, scale, scores, ld, maxes,
                ),
            }
        }
        return;
    }
    // The one-head kernels push into a Vec: one per thread, kept (this runs per layer and task).
    thread_local! {
        static ONE_HEAD: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    ONE_HEAD.with(|tmp| {
        let tmp = &mut *tmp.borrow_mut();
        for h in 0..g {
            maxes[h] = attn_scores(&qs[h * hd..(h + 1) * hd], k, slots, stride, off, scale, tmp);
            scores[h * ld..h * ld + n].copy_from_slice(tmp);
        }
    });
}

/// [`attn_weighted_sum`] for the `g = o.len() / hd` query heads of one KV head over the same
/// slots: head `h` accumulates `o[h * hd..][..hd] += sum_i p[h * ld + i] * rows[slots[i]]`,
/// exactly as [`attn_weighted_sum`] would for that head alone (per output, the same FMAs in slot
/// order). Each V row is widened once for all `g` heads.
#[allow(clippy::too_many_arguments)]
pub fn attn_weighted_sum_group(
    p: &[f32],
    ld: usize,
    hd: usize,
    v: &[f16],
    slots: &[usize],
    stride: usize,
    off: usize,
    o: &mut [f32],
) {
    let g = o.len() / hd.max(1);
    let n = slots.len();
    assert!(
        o.len() == g * hd && ld >= n && (g == 0 || p.len() >= (g - 1) * ld + n),
        "attn_weighted_sum_group: buffers do not match shape"
    );
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512
        && hd.is_multiple_of(64)
        && hd <= 256
        && slots.iter().all(|&s| s * stride + off + hd <= v.len())
    {
        let mut h0 = 0;
        while h0 < g {
            let t = (g - h0).min(GROUP_TILE);
            let (pt, ot) = (&p[h0 * ld..], &mut o[h0 * hd..(h0 + t) * hd]);
            // SAFETY: AVX-512F detected; every row read was bounds-checked just above; `pt`
            // holds `t` rows of `ld >= n` weights (asserted), `ot` `t` rows of `hd`.
            unsafe {
                match t {
                    1 => x86::weighted_sum_group_avx512::<1>(pt, ld, v, slots, stride, off, ot),
                    2 => x86::weighted_sum_group_avx512::<2>(pt, ld, v, slots, stride, off, ot),
                    3 => x86::weighted_sum_group_avx512::<3>(pt, ld, v, slots, stride, off, ot),
                    4 => x86::weighted_sum_group_avx512::<4>(pt, ld, v, slots, stride, off, ot),
                    5 => x86::weighted_sum_group_avx512::<5>(pt, ld, v, slots, stride, off, ot),
                    _ => x86::weighted_sum_group_avx512::<6>(pt, ld, v, slots, stride, off, ot),
                }
            }
            h0 += t;
        }
        return;
    }
    for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
        attn_weighted_sum(&p[h * ld..h * ld + n], v, slots, stride, off, oh);
    }
}

pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

pub fn axpy_portable(y: &mut [f32], s: f32, x: &[f32]) {
    for (yi, &xi) in y.iter_mut().zip(x) {
        *yi += s * xi;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        while i + 32 <= n {
            acc0 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i + 16)),
                _mm512_loadu_ps(b.as_ptr().add(i + 16)),
                acc1,
            );
            i += 32;
        }
        if i + 16 <= n {
            acc0 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// SAFETY (caller): AVX-512F present, `q.len() % 16 == 0`, every row in bounds.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attn_scores_avx512(
        q: &[f32],
        k: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        scale: f32,
        scores: &mut Vec<f32>,
    ) -> f32 {
        // As in `attn_weighted_sum_avx512`: a fixed chunk count for the usual head sizes keeps the
        // query in registers and unrolls each dot; the same FMAs in the same order either way.
        match q.len() / 16 {
            8 => scores_chunks::<8>(q, k, slots, stride, off, scale, scores),
            4 => scores_chunks::<4>(q, k, slots, stride, off, scale, scores),
            _ => scores_chunks::<0>(q, k, slots, stride, off, scale, scores),
        }
    }

    /// `attn_scores_avx512` for `C` 16-float chunks per head (`C` = 0: any multiple of 16).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_chunks<const C: usize>(
        q: &[f32],
        k: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        scale: f32,
        scores: &mut Vec<f32>,
    ) -> f32 {
        let hd = q.len();
        let qr: [__m512; C] = std::array::from_fn(|c| _mm512_loadu_ps(q.as_ptr().add(16 * c)));
        let dot = |s: usize| {
            let row = k.as_ptr().add(s * stride + off) as *const __m256i;
            let mut acc = _mm512_setzero_ps();
            if C > 0 {
                for (c, qc) in qr.iter().enumerate() {
                    acc =
                        _mm512_fmadd_ps(*qc, _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c))), acc);
                }
                return acc;
            }
            let mut i = 0;
            while i < hd {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(q.as_ptr().add(i)),
                    _mm512_cvtph_ps(_mm256_loadu_si256(row.add(i / 16))),
                    acc,
                );
                i += 16;
            }
            acc
        };
        // 16 slots at a time: one transposed reduction (the bits of one `reduce_add` per slot).
        let mut blocks = slots.chunks_exact(16);
        let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut out = [0f32; 16];
        for b in blocks.by_ref() {
            let mut v = [_mm512_setzero_ps(); 16];
            for (vi, &s) in v.iter_mut().zip(b) {
                *vi = dot(s);
            }
            let sc = _mm512_mul_ps(
                crate::quant::x86_avx512::reduce16(&v),
                _mm512_set1_ps(scale),
            );
            // NaN scores never win, as with `f32::max` below.
            vmax = _mm512_max_ps(sc, vmax);
            _mm512_storeu_ps(out.as_mut_ptr(), sc);
            scores.extend_from_slice(&out);
        }

        // -inf when no block ran.
        let mut max = _mm512_reduce_max_ps(vmax);
        for &s in blocks.remainder() {
            let sc = _mm512_reduce_add_ps(dot(s)) * scale;
            max = max.max(sc);
            scores.push(sc);
        }
        max
    }

    /// The first `min(rem, 16)` lanes.
    #[inline(always)]
    fn lanes_mask(rem: usize) -> __mmask16 {
        if rem >= 16 {
            0xFFFF
        } else {
            (1u16 << rem) - 1
        }
    }

    /// `exp` of 16 lanes (`exp_portable`'s operations; `vscalefps` applies `2^n`, saturating to
    /// 0 and +inf).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp_avx512(x: __m512) -> __m512 {
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-104.0)),
            _mm512_set1_ps(89.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(super::EXP_LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(super::EXP_C1), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(super::EXP_C2), r);
        let mut p = _mm512_set1_ps(super::EXP_P[0]);
        for &c in &super::EXP_P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let e = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        _mm512_scalef_ps(e, n)
    }

    /// SAFETY (caller): AVX-512F present, `g.len() == u.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul_avx512(g: &mut [f32], u: &[f32]) {
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < g.len() {
            let m = lanes_mask(g.len() - i);
            let x = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
            let y = _mm512_maskz_loadu_ps(m, u.as_ptr().add(i));
            let e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x));
            let s = _mm512_div_ps(x, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(g.as_mut_ptr().add(i), m, _mm512_mul_ps(s, y));
            i += 16;
        }
    }

    /// SAFETY (caller): AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sub_avx512(x: &mut [f32], sub: f32) -> [f32; 16] {
        let sv = _mm512_set1_ps(sub);
        let mut acc = _mm512_setzero_ps();
        let mut i = 0;
        while i < x.len() {
            let m = lanes_mask(x.len() - i);
            let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
            let e = exp_avx512(_mm512_sub_ps(v, sv));
            _mm512_mask_storeu_ps(x.as_mut_ptr().add(i), m, e);
            acc = _mm512_mask_add_ps(acc, m, acc, e);
            i += 16;
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes
    }

    /// `attn_scores_group` for heads of `C` 16-float chunks: per 16 slots, each K row widened
    /// once into `C` registers serves every head's dot (`scores_chunks`' FMAs, in its order),
    /// then one transposed reduction per head.
    ///
    /// SAFETY (caller): AVX-512F present, `qs.len() == g * 16 * C`, every row in bounds,
    /// `scores` holds `g` rows of stride `ld >= slots.len()`, `maxes` `g` values.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_group_avx512<const C: usize>(
        qs: &[f32],
        k: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        scale: f32,
        scores: &mut [f32],
        ld: usize,
        maxes: &mut [f32],
    ) {
        let hd = 16 * C;
        let g = qs.len() / hd;
        let widen = |s: usize| -> [__m512; C] {
            let row = k.as_ptr().add(s * stride + off) as *const __m256i;
            std::array::from_fn(|c| _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c))))
        };
        // Head `h`'s dot with a widened row: `scores_chunks`' chain.
        let dot = |h: usize, kr: &[__m512; C]| {
            let q = qs.as_ptr().add(h * hd);
            let mut acc = _mm512_setzero_ps();
            for (c, kc) in kr.iter().enumerate() {
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(16 * c)), *kc, acc);
            }
            acc
        };
        let vscale = _mm512_set1_ps(scale);
        let mut h0 = 0;
        while h0 < g {
            let t = (g - h0).min(super::GROUP_TILE);
            let mut vmax = [_mm512_set1_ps(f32::NEG_INFINITY); super::GROUP_TILE];
            let mut acc = [[_mm512_setzero_ps(); 16]; super::GROUP_TILE];
            let mut blocks = slots.chunks_exact(16);
            let mut i0 = 0;
            for b in blocks.by_ref() {
                // Two slots at a time: each query chunk loaded once serves both.
                for (jp, pair) in b.chunks_exact(2).enumerate() {
                    let r0 = k.as_ptr().add(pair[0] * stride + off) as *const __m256i;
                    let r1 = k.as_ptr().add(pair[1] * stride + off) as *const __m256i;
                    let mut a2 = [[_mm512_setzero_ps(); 2]; super::GROUP_TILE];
                    for c in 0..C {
                        let k0 = _mm512_cvtph_ps(_mm256_loadu_si256(r0.add(c)));
                        let k1 = _mm512_cvtph_ps(_mm256_loadu_si256(r1.add(c)));
                        for (h, a) in a2.iter_mut().enumerate().take(t) {
                            let qc = _mm512_loadu_ps(qs.as_ptr().add((h0 + h) * hd + 16 * c));
                            a[0] = _mm512_fmadd_ps(qc, k0, a[0]);
                            a[1] = _mm512_fmadd_ps(qc, k1, a[1]);
                        }
                    }
                    for (h, a) in a2.iter().enumerate().take(t) {
                        acc[h][2 * jp] = a[0];
                        acc[h][2 * jp + 1] = a[1];
                    }
                }
                for (h, a) in acc.iter().enumerate().take(t) {
                    let sc = _mm512_mul_ps(crate::quant::x86_avx512::reduce16(a), vscale);
                    vmax[h] = _mm512_max_ps(sc, vmax[h]);
                    _mm512_storeu_ps(scores.as_mut_ptr().add((h0 + h) * ld + i0), sc);
                }
                i0 += 16;
            }
            for (h, vm) in vmax.iter().enumerate().take(t) {
                maxes[h0 + h] = _mm512_reduce_max_ps(*vm);
            }
            for &s in blocks.remainder() {
                let kr = widen(s);
                for h in 0..t {
                    let sc = _mm512_reduce_add_ps(dot(h0 + h, &kr)) * scale;
                    maxes[h0 + h] = maxes[h0 + h].max(sc);
                    scores[(h0 + h) * ld + i0] = sc;
                }
                i0 += 1;
            }
            h0 += t;
        }
    }

    /// `attn_weighted_sum_group` for a tile of `T` heads: four 16-float chunks of every head's
    /// output at a time held in registers, each V chunk widened once for the `T` heads; per
    /// output the FMAs of `weighted_sum_chunks` in slot order.
    ///
    /// SAFETY (caller): AVX-512F present, `o.len() == T * hd` with `hd % 64 == 0`, every row in
    /// bounds, `p` holds `T` rows of stride `ld >= slots.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_sum_group_avx512<const T: usize>(
        p: &[f32],
        ld: usize,
        v: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        o: &mut [f32],
    ) {
        let hd = o.len() / T;
        let op = o.as_mut_ptr();
        let mut c0 = 0;
        while c0 < hd {
            let mut acc = [[_mm512_setzero_ps(); 4]; T];
            for (h, a) in acc.iter_mut().enumerate() {
                for (c, ac) in a.iter_mut().enumerate() {
                    *ac = _mm512_loadu_ps(op.add(h * hd + c0 + 16 * c));
                }
            }
            for (i, &s) in slots.iter().enumerate() {
                let row = v.as_ptr().add(s * stride + off + c0) as *const __m256i;
                let vr: [__m512; 4] =
                    std::array::from_fn(|c| _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c))));
                for (h, a) in acc.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(*p.get_unchecked(h * ld + i));
                    for (ac, vc) in a.iter_mut().zip(&vr) {
                        *ac = _mm512_fmadd_ps(wv, *vc, *ac);
                    }
                }
            }
            for (h, a) in acc.iter().enumerate() {
                for (c, ac) in a.iter().enumerate() {
                    _mm512_storeu_ps(op.add(h * hd + c0 + 16 * c), *ac);
                }
            }
            c0 += 64;
        }
    }

    /// SAFETY (caller): AVX-512F present, `o.len() % 16 == 0 && o.len() <= 256`, rows in bounds.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn attn_weighted_sum_avx512(
        p: &[f32],
        v: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        o: &mut [f32],
    ) {
        // A fixed chunk count for the usual head sizes keeps the output in registers (a runtime
        // count leaves it on the stack: a load and a store around every FMA). The same FMAs, in
        // the same order, either way.
        match o.len() / 16 {
            8 => weighted_sum_chunks::<8>(p, v, slots, stride, off, o),
            4 => weighted_sum_chunks::<4>(p, v, slots, stride, off, o),
            _ => weighted_sum_chunks::<16>(p, v, slots, stride, off, o),
        }
    }

    /// `attn_weighted_sum_avx512` with at most `C` 16-float chunks (`o.len() / 16` of them).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn weighted_sum_chunks<const C: usize>(
        p: &[f32],
        v: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        o: &mut [f32],
    ) {
        let chunks = (o.len() / 16).min(C);
        let mut acc = [_mm512_setzero_ps(); C];
        for (c, a) in acc.iter_mut().enumerate().take(chunks) {
            *a = _mm512_loadu_ps(o.as_ptr().add(c * 16));
        }
        for (&s, &w) in slots.iter().zip(p) {
            let row = v.as_ptr().add(s * stride + off) as *const __m256i;
            let wv = _mm512_set1_ps(w);
            for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                *a = _mm512_fmadd_ps(wv, _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c))), *a);
            }
        }
        for (c, a) in acc.iter().enumerate().take(chunks) {
            _mm512_storeu_ps(o.as_mut_ptr().add(c * 16), *a);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn round_f16_avx512(x: &mut [f32]) {
        let n = x.len();
        let mut i = 0;
        while i + 16 <= n {
            let p = x.as_mut_ptr().add(i);
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_loadu_ps(p),
            );
            _mm512_storeu_ps(p, _mm512_cvtph_ps(h));
            i += 16;
        }
        for v in &mut x[i..] {
            *v = half::f16::from_f32(*v).to_f32();
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn axpy_avx512(y: &mut [f32], s: f32, x: &[f32]) {
        let n = y.len();
        let sv = _mm512_set1_ps(s);
        let mut i = 0;
        while i + 16 <= n {
            let p = y.as_mut_ptr().add(i);
            _mm512_storeu_ps(
                p,
                _mm512_fmadd_ps(sv, _mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(p)),
            );
            i += 16;
        }
        while i < n {
            y[i] += s * x[i];
            i += 1;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
            i += 16;
        }
        let mut s = hsum_avx2(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_avx2(y: &mut [f32], s: f32, x: &[f32]) {
        let n = y.len();
        let sv = _mm256_set1_ps(s);
        let mut i = 0;
        while i + 8 <= n {
            let p = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                p,
                _mm256_fmadd_ps(sv, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(p)),
            );
            i += 8;
        }
        while i < n {
            y[i] += s * x[i];
            i += 1;
        }
    }

    /// The sum of 8 lanes: halves, then pairs, then the last two (`dot_avx2`'s reduction).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum_avx2(acc: __m256) -> f32 {
        let hi = _mm256_extractf128_ps(acc, 1);
        let lo = _mm256_castps256_ps128(acc);
        let s4 = _mm_add_ps(hi, lo);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }

    /// `exp` of 8 lanes: `exp_portable`'s operations, `2^n` applied in the same two exact steps,
    /// so every lane has the portable function's bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_avx2(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-104.0)),
            _mm256_set1_ps(89.0),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(super::EXP_LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::EXP_C1), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(super::EXP_C2), r);
        let mut p = _mm256_set1_ps(super::EXP_P[0]);
        for &c in &super::EXP_P[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_add_ps(
            _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        // n = h + l with h = n / 2 rounded toward zero, as the portable code splits it.
        let ni = _mm256_cvtps_epi32(n);
        let h = _mm256_srai_epi32::<1>(_mm256_add_epi32(ni, _mm256_srli_epi32::<31>(ni)));
        let l = _mm256_sub_epi32(ni, h);
        let bias = _mm256_set1_epi32(127);
        let ph = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(h, bias)));
        let pl = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(l, bias)));
        _mm256_mul_ps(_mm256_mul_ps(e, ph), pl)
    }

    /// SAFETY (caller): AVX2/FMA present, `g.len() == u.len()`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn silu_mul_avx2(g: &mut [f32], u: &[f32]) {
        let one = _mm256_set1_ps(1.0);
        let n = g.len();
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let y = _mm256_loadu_ps(u.as_ptr().add(i));
            let e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g.as_mut_ptr().add(i), _mm256_mul_ps(s, y));
            i += 8;
        }
        for (a, &b) in g[i..].iter_mut().zip(&u[i..]) {
            *a = *a / (1.0 + super::exp_portable(-*a)) * b;
        }
    }

    /// SAFETY (caller): AVX2/FMA present.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_avx2(x: &mut [f32], sub: f32) -> [f32; 16] {
        let sv = _mm256_set1_ps(sub);
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let n = x.len();
        let mut i = 0;
        while i + 16 <= n {
            let p = x.as_mut_ptr().add(i);
            let e0 = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p), sv));
            let e1 = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(p.add(8)), sv));
            _mm256_storeu_ps(p, e0);
            _mm256_storeu_ps(p.add(8), e1);
            acc0 = _mm256_add_ps(acc0, e0);
            acc1 = _mm256_add_ps(acc1, e1);
            i += 16;
        }
        let mut lanes = [0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc0);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc1);
        for (j, v) in x[i..].iter_mut().enumerate() {
            *v = super::exp_portable(*v - sub);
            lanes[j] += *v;
        }
        lanes
    }

    /// SAFETY (caller): AVX2/F16C present.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn round_f16_avx2(x: &mut [f32]) {
        let n = x.len();
        let mut i = 0;
        while i + 8 <= n {
            let p = x.as_mut_ptr().add(i);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(p));
            _mm256_storeu_ps(p, _mm256_cvtph_ps(h));
            i += 8;
        }
        for v in &mut x[i..] {
            *v = half::f16::from_f32(*v).to_f32();
        }
    }

    /// Attention scores two rows at a time (each query load serves both); every score has the
    /// bits of `dot_avx2(q, row) * scale`.
    ///
    /// SAFETY (caller): AVX2/FMA present, `q.len() % 16 == 0`, every row in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attn_scores_avx2(
        q: &[f32],
        k: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        scale: f32,
        scores: &mut Vec<f32>,
    ) -> f32 {
        let hd = q.len();
        let qp = q.as_ptr();
        let row = |s: usize| k.as_ptr().add(s * stride + off);
        let ld =
            |r: *const f16, i: usize| _mm256_cvtph_ps(_mm_loadu_si128(r.add(i) as *const __m128i));
        let mut max = f32::NEG_INFINITY;
        let mut pairs = slots.chunks_exact(2);
        for pr in pairs.by_ref() {
            let (r0, r1) = (row(pr[0]), row(pr[1]));
            let mut a = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i < hd {
                let (q0, q1) = (_mm256_loadu_ps(qp.add(i)), _mm256_loadu_ps(qp.add(i + 8)));
                a[0] = _mm256_fmadd_ps(q0, ld(r0, i), a[0]);
                a[1] = _mm256_fmadd_ps(q1, ld(r0, i + 8), a[1]);
                a[2] = _mm256_fmadd_ps(q0, ld(r1, i), a[2]);
                a[3] = _mm256_fmadd_ps(q1, ld(r1, i + 8), a[3]);
                i += 16;
            }
            for acc in [_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])] {
                let sc = hsum_avx2(acc) * scale;
                max = max.max(sc);
                scores.push(sc);
            }
        }
        for &s in pairs.remainder() {
            let mut buf = [0f32; 256];
            let wide = super::widen_row(std::slice::from_raw_parts(row(s), hd), &mut buf);
            let sc = dot_avx2(q, wide) * scale;
            max = max.max(sc);
            scores.push(sc);
        }
        max
    }

    /// `o += sum_i p[i] * rows[slots[i]]`, 64 outputs at a time kept in registers; per output the
    /// FMAs of `axpy_avx2` in slot order.
    ///
    /// SAFETY (caller): AVX2/FMA present, `o.len() % 8 == 0`, every row in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attn_weighted_sum_avx2(
        p: &[f32],
        v: &[f16],
        slots: &[usize],
        stride: usize,
        off: usize,
        o: &mut [f32],
    ) {
        let mut c0 = 0;
        while c0 < o.len() {
            let chunks = ((o.len() - c0) / 8).min(8);
            let mut acc = [_mm256_setzero_ps(); 8];
            for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                *a = _mm256_loadu_ps(o.as_ptr().add(c0 + 8 * c));
            }
            for (&s, &w) in slots.iter().zip(p) {
                let row = v.as_ptr().add(s * stride + off + c0);
                let wv = _mm256_set1_ps(w);
                for (c, a) in acc.iter_mut().enumerate().take(chunks) {
                    let r = _mm_loadu_si128(row.add(8 * c) as *const __m128i);
                    *a = _mm256_fmadd_ps(wv, _mm256_cvtph_ps(r), *a);
                }
            }
            for (c, a) in acc.iter().enumerate().take(chunks) {
                _mm256_storeu_ps(o.as_mut_ptr().add(c0 + 8 * c), *a);
            }
            c0 += 8 * chunks;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized `exp` (softmax) and SiLU: within 2 ulp of f64 over the range that matters,
    /// exactly 0 / +inf / x at the extremes, and the AVX-512 lanes bit for bit the portable
    /// function wherever the result is a normal float (so the tail lanes need no scalar path).
    #[test]
    fn vector_exp_and_silu_accurate() {
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.0437).collect();
        xs.extend([0.0, -0.0, 1e-8, -1e-8, 88.0, -87.0, 0.5, -0.5]);
        let want: Vec<f64> = xs.iter().map(|&x| (x as f64).exp()).collect();
        for len in [xs.len(), 1, 15, 17] {
            let mut v = xs[..len].to_vec();
            let sum = exp_sub_sum(&mut v, 0.0);
            let mut lanes = [0f32; 16];
            for (i, (&got, &w)) in v.iter().zip(&want).enumerate() {
                let ulp = (w as f32).to_bits().abs_diff(got.to_bits());
                assert!(ulp <= 2, "exp({}) = {got} vs {w} ({ulp} ulp)", xs[i]);
                assert_eq!(
                    got.to_bits(),
                    exp_portable(xs[i]).to_bits(),
                    "exp({})",
                    xs[i]
                );
                lanes[i % 16] += got;
            }
            // The documented order: lane sums, then the lanes in turn.
            let seq = lanes.iter().fold(0.0f32, |s, &v| s + v);
            assert_eq!(sum.to_bits(), seq.to_bits(), "len {len}");
        }
        let mut ext = vec![-200.0f32, -104.5, 100.0, f32::MAX];
        exp_sub_sum(&mut ext, 0.0);
        assert_eq!(ext, [0.0, 0.0, f32::INFINITY, f32::INFINITY]);
        // SiLU · u against f64, and its limits.
        let u: Vec<f32> = xs.iter().map(|&x| 0.5 + (x * 0.37).sin()).collect();
        let mut g = xs.clone();
        silu_mul(&mut g, &u);
        for i in 0..xs.len() {
            let (x, ui) = (xs[i] as f64, u[i] as f64);
            let w = x / (1.0 + (-x).exp()) * ui;
            assert!(
                (g[i] as f64 - w).abs() <= 4e-7 * w.abs() + 1e-30,
                "silu({x}) * {ui}: {} vs {w}",
                g[i]
            );
        }
        let mut lim = vec![200.0f32, -200.0, 0.0];
        silu_mul(&mut lim, &[1.0, 1.0, 1.0]);
        assert_eq!(lim[0], 200.0);
        assert!(lim[1] == 0.0 && lim[2] == 0.0);
    }

    #[test]
    fn simd_matches_portable() {
        if matches!(level(), Level::Portable) {
            crate::testing::skip_hardware(
                "backend::simd::simd_matches_portable",
                "no AVX2 / AVX-512 (or ARBOR_KERNEL=scalar): nothing to compare",
            );
            return;
        }
        let mut rng = crate::sample::Rng::new(3);
        for n in [0usize, 1, 7, 16, 31, 64, 100, 128, 333] {
            let a: Vec<f32> = (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let (d, r) = (dot(&a, &b), dot_portable(&a, &b));
            assert!((d - r).abs() <= 1e-5 * (1.0 + r.abs()), "n={n}: {d} vs {r}");
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(&mut y1, 0.37, &a);
            axpy_portable(&mut y2, 0.37, &a);
            for (p, q) in y1.iter().zip(&y2) {
                assert!((p - q).abs() <= 1e-6);
            }
            let mut r1: Vec<f32> = a.iter().map(|v| v * 1000.0).collect();
            let r2: Vec<f32> = r1
                .iter()
                .map(|&v| half::f16::from_f32(v).to_f32())
                .collect();
            round_f16_slice(&mut r1);
            assert_eq!(r1, r2, "n={n}");
        }
        // Attention helpers against the portable formulas, hd 64 and 128, scattered slots.
        for hd in [64usize, 128, 48] {
            let stride = hd * 3;
            let rows = 40;
            let k: Vec<f32> = (0..rows * stride)
                .map(|_| rng.next_f64() as f32 - 0.5)
                .collect();
            // The cache holds f16: the kernels read `kh`, the references its exact f32 values.
            let kh: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let k: Vec<f32> = kh.iter().map(|h| h.to_f32()).collect();
            let q: Vec<f32> = (0..hd).map(|_| rng.next_f64() as f32 - 0.5).collect();
            let slots = [0usize, 3, 4, 17, 39, 22];
            let off = hd;
            let mut sc = Vec::new();
            let max = attn_scores(&q, &kh, &slots, stride, off, 0.125, &mut sc);
            for (i, &s) in slots.iter().enumerate() {
                let r = dot_portable(&q, &k[s * stride + off..s * stride + off + hd]) * 0.125;
                assert!((sc[i] - r).abs() < 1e-5, "hd {hd} slot {s}");
            }
            assert_eq!(max, sc.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            // Blocks of 16 slots give each score the bits of a one-slot call.
            let many: Vec<usize> = (0..rows).rev().collect();
            let mut all = Vec::new();
            let max_all = attn_scores(&q, &kh, &many, stride, off, 0.125, &mut all);
            let mut one = Vec::new();
            for (i, &s) in many.iter().enumerate() {
                attn_scores(&q, &kh, &[s], stride, off, 0.125, &mut one);
                assert_eq!(all[i].to_bits(), one[0].to_bits(), "hd {hd} slot {s}");
            }
            assert_eq!(
                max_all,
                all.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            );
            let mut o = vec![1.0f32; hd];
            attn_weighted_sum(&sc, &kh, &slots, stride, off, &mut o);
            for d in 0..hd {
                let r: f32 = slots
                    .iter()
                    .zip(&sc)
                    .map(|(&s, &w)| w * k[s * stride + off + d])
                    .sum::<f32>()
                    + 1.0;
                assert!((o[d] - r).abs() < 1e-5, "hd {hd} dim {d}");
            }
        }
    }

    /// The grouped-query kernels give every head exactly the bits of the one-head kernels, for
    /// every group size (tiles of 6 and their remainders), slot count (blocks of 16 and the
    /// remainder) and head size, with padded score rows; on any machine (the fallbacks loop over
    /// the one-head kernels).
    #[test]
    fn grouped_attention_bit_identical_to_one_head() {
        let mut rng = crate::sample::Rng::new(11);
        for hd in [64usize, 128, 48] {
            let n_kv = 2;
            let stride = hd * n_kv;
            let rows = 70;
            let kh: Vec<f16> = (0..rows * stride)
                .map(|_| f16::from_f32((rng.next_f64() as f32 - 0.5) * 4.0))
                .collect();
            let vh: Vec<f16> = (0..rows * stride)
                .map(|_| f16::from_f32(rng.next_f64() as f32 - 0.5))
                .collect();
            for g in [1usize, 2, 3, 5, 6, 7, 12] {
                let qs: Vec<f32> = (0..g * hd).map(|_| rng.next_f64() as f32 - 0.5).collect();
                for n in [0usize, 1, 15, 16, 17, 33, 70] {
                    // Scattered slots, in no order.
                    let slots: Vec<usize> = (0..n).map(|i| (i * 37 + 5) % rows).collect();
                    let (off, scale, ld) = (hd, 0.09, n + 3);
                    let mut sc = vec![f32::NAN; g * ld];
                    let mut maxes = vec![0f32; g];
                    attn_scores_group(
                        &qs, hd, &kh, &slots, stride, off, scale, &mut sc, ld, &mut maxes,
                    );
                    let mut o = vec![0.25f32; g * hd];
                    attn_weighted_sum_group(&sc, ld, hd, &vh, &slots, stride, off, &mut o);
                    let mut one = Vec::new();
                    for h in 0..g {
                        let q = &qs[h * hd..(h + 1) * hd];
                        let max = attn_scores(q, &kh, &slots, stride, off, scale, &mut one);
                        assert_eq!(
                            max.to_bits(),
                            maxes[h].to_bits(),
                            "hd {hd} g {g} n {n} h {h}"
                        );
                        for i in 0..n {
                            assert_eq!(
                                one[i].to_bits(),
                                sc[h * ld + i].to_bits(),
                                "hd {hd} g {g} n {n} head {h} slot {i}"
                            );
                        }
                        let mut oh = vec![0.25f32; hd];
                        attn_weighted_sum(&one, &vh, &slots, stride, off, &mut oh);
                        for d in 0..hd {
                            assert_eq!(
                                oh[d].to_bits(),
                                o[h * hd + d].to_bits(),
                                "hd {hd} g {g} n {n} head {h} dim {d}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Timing of one decode row's attention over a KV head (qwen2.5-1.5b's shape: 6 query heads
    /// of 128 per KV head, 256 slots): the grouped kernels against a call per head.
    /// `cargo test --release -p arbor-engine grouped_attention_timing -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn grouped_attention_timing() {
        let (hd, g, n, n_kv) = (128usize, 6usize, 256usize, 2usize);
        let stride = hd * n_kv;
        let mut rng = crate::sample::Rng::new(5);
        let kh: Vec<f16> = (0..n * stride)
            .map(|_| f16::from_f32(rng.next_f64() as f32 - 0.5))
            .collect();
        let qs: Vec<f32> = (0..g * hd).map(|_| rng.next_f64() as f32 - 0.5).collect();
        let slots: Vec<usize> = (0..n).collect();
        let mut sc = vec![0f32; g * n];
        let mut maxes = vec![0f32; g];
        let mut o = vec![0f32; g * hd];
        let mut one = Vec::new();
        let reps = 20000;
        for round in 0..3 {
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                attn_scores_group(
                    &qs, hd, &kh, &slots, stride, hd, 0.1, &mut sc, n, &mut maxes,
                );
            }
            let grouped_scores = t0.elapsed().as_secs_f64() / reps as f64;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                for h in 0..g {
                    maxes[h] = attn_scores(
                        &qs[h * hd..(h + 1) * hd],
                        &kh,
                        &slots,
                        stride,
                        hd,
                        0.1,
                        &mut one,
                    );
                    sc[h * n..(h + 1) * n].copy_from_slice(&one);
                }
            }
            let per_head_scores = t0.elapsed().as_secs_f64() / reps as f64;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                attn_weighted_sum_group(&sc, n, hd, &kh, &slots, stride, hd, &mut o);
            }
            let grouped_sum = t0.elapsed().as_secs_f64() / reps as f64;
            let t0 = std::time::Instant::now();
            for _ in 0..reps {
                for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
                    attn_weighted_sum(&sc[h * n..(h + 1) * n], &kh, &slots, stride, hd, oh);
                }
            }
            let per_head_sum = t0.elapsed().as_secs_f64() / reps as f64;
            println!(
                "round {round}: scores grouped {:.2} us, per head {:.2} us; weighted sum grouped {:.2} us, per head {:.2} us",
                grouped_scores * 1e6,
                per_head_scores * 1e6,
                grouped_sum * 1e6,
                per_head_sum * 1e6
            );
        }
    }

    /// The AVX2 kernels (what AVX2-only CPUs run; `ARBOR_KERNEL=avx2` elsewhere) give the bits
    /// of the portable `exp` / SiLU / f16 rounding, and attention scores and sums the bits of
    /// `dot_avx2` / `axpy_avx2` per slot, whatever the slot count.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernels_bit_identical_to_their_references() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            crate::testing::skip_hardware(
                "simd::avx2_kernels_bit_identical_to_their_references",
                "no AVX2/FMA/F16C",
            );
            return;
        }
        let mut rng = crate::sample::Rng::new(5);
        let xs: Vec<f32> = (-1500..=1500).map(|i| i as f32 * 0.0613).collect();
        for len in [xs.len(), 1, 8, 15, 16, 17, 31] {
            let mut v = xs[..len].to_vec();
            // SAFETY: features checked above.
            let lanes = unsafe { x86::exp_sub_avx2(&mut v, 0.75) };
            let mut want = [0f32; 16];
            for (i, &got) in v.iter().enumerate() {
                let e = exp_portable(xs[i] - 0.75);
                assert_eq!(got.to_bits(), e.to_bits(), "exp({})", xs[i] - 0.75);
                want[i % 16] += e;
            }
            for (a, b) in lanes.iter().zip(&want) {
                assert_eq!(a.to_bits(), b.to_bits(), "len {len}");
            }
            let u: Vec<f32> = (0..len).map(|i| 0.5 + (i as f32 * 0.37).sin()).collect();
            let mut g = xs[..len].to_vec();
            // SAFETY: as above; equal lengths.
            unsafe { x86::silu_mul_avx2(&mut g, &u) };
            for i in 0..len {
                let x = xs[i];
                let w = x / (1.0 + exp_portable(-x)) * u[i];
                assert_eq!(g[i].to_bits(), w.to_bits(), "silu({x})");
            }
            let mut r: Vec<f32> = xs[..len].iter().map(|v| v * 977.3).collect();
            let want: Vec<f32> = r.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            // SAFETY: as above.
            unsafe { x86::round_f16_avx2(&mut r) };
            assert_eq!(r, want, "len {len}");
        }
        for hd in [64usize, 128, 32] {
            let stride = hd * 2;
            let rows = 19;
            let k: Vec<f32> = (0..rows * stride)
                .map(|_| rng.next_f64() as f32 - 0.5)
                .collect();
            // The cache holds f16: the kernels read `kh`, the references its exact f32 values.
            let kh: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let k: Vec<f32> = kh.iter().map(|h| h.to_f32()).collect();
            let q: Vec<f32> = (0..hd).map(|_| rng.next_f64() as f32 - 0.5).collect();
            for n in [1usize, 2, 5, 19] {
                let slots: Vec<usize> = (0..n).map(|i| (i * 7) % rows).collect();
                let mut sc = Vec::new();
                // SAFETY: as above; rows in bounds.
                let max =
                    unsafe { x86::attn_scores_avx2(&q, &kh, &slots, stride, hd, 0.3, &mut sc) };
                let mut want_max = f32::NEG_INFINITY;
                for (i, &s) in slots.iter().enumerate() {
                    // SAFETY: as above.
                    let w = unsafe { x86::dot_avx2(&q, &k[s * stride + hd..s * stride + 2 * hd]) }
                        * 0.3;
                    assert_eq!(sc[i].to_bits(), w.to_bits(), "hd {hd} n {n} slot {s}");
                    want_max = want_max.max(w);
                }
                assert_eq!(max, want_max);
                let mut o: Vec<f32> = (0..hd).map(|i| i as f32 * 0.01).collect();
                let mut want = o.clone();
                // SAFETY: as above.
                unsafe {
                    x86::attn_weighted_sum_avx2(&sc, &kh, &slots, stride, hd, &mut o);
                    for (&s, &w) in slots.iter().zip(&sc) {
                        x86::axpy_avx2(&mut want, w, &k[s * stride + hd..s * stride + 2 * hd]);
                    }
                }
                for (a, b) in o.iter().zip(&want) {
                    assert_eq!(a.to_bits(), b.to_bits(), "hd {hd} n {n}");
                }
            }
        }
    }
}
