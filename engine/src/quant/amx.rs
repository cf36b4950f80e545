//! AMX int8 tile kernels: `tdpbssd` on 16 output rows × 16 activation rows; Q4_K and Q6_K with their scales folded into the weights (exact integer per group), Q8_0 with a float epilogue per block.
//!
//! Used by `matmul_with` at `KernelLevel::Amx` for natural (unpacked: `ARBOR_PACK=0`) Q4_K, Q6_K
//! and Q8_0 weights with `n_in % 256 == 0` and at least `MIN_TOK` activation rows; packed weights
//! run `x86_avx2::kcols512::amx_packed` instead, everything else the AVX-512 VNNI kernels. The
//! level exists only when CPUID reports AMX-TILE and AMX-INT8 and Linux grants the process the
//! tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, requested once).
//!
//! Tiles (one configuration per product size `KS`, loaded by every row task on its own thread and
//! released at its end): weight tiles A are 16 output rows × `KS` int8, activation tiles B `KS/4`
//! rows × 16 activation rows × 4 int8 (the VNNI layout), accumulators 16×16 int32. So
//! `C[o, t] = Σ_k W[o, k] · a[t, k]` over `KS` elements is one `tdpbssd`, an exact integer dot
//! product as in the scalar reference.
//!
//! * Weights stay in their GGUF blocks: each 256-element group of 16 rows is unpacked into a
//!   per-task scratch tile, then dotted with every 16-row activation block.
//!   - Q8_0 (as stored): one plane of int8, one f32 scale per block.
//!   - Q4_K: two planes, `q · (sc >> 3)` and `q · (sc & 7)` (six-bit scales split in two halves;
//!     each product at most 105), so two K = 256 products give the exact group integer
//!     `I = 8·C_hi + C_lo = Σ_j sc_j Σ_{k in j} q_k a_k`.
//!   - Q6_K: two planes, `w >> 6` and `w & 63` of the products `w = q · sc` (q in −32..31, signed
//!     eight-bit scales, |w| <= 4096), so `I = 64·C_hi + C_lo` exactly.
//! * Activations are quantized once per call (Q8_K / Q8_0 as the other kernels) and packed per
//!   (16-row block, group) into records of `AREC` bytes: `[0, 4096)` the 64 B rows of the VNNI
//!   layout (element order permuted to match the weight unpack), `[4096, 4160)` f32 `d` per row
//!   (Q8_K), `[4160, 5184)` one f32 vector of 16 rows per sub-block: Q4_K 32-element sums of the
//!   quantized values (for the mins), Q8_0 the block scales.
//! * Epilogues, per output and group:
//!   - Q4_K, Q6_K: `acc = fma(cvt(I), d·dx, acc)`; Q4_K then `acc = fnmadd(M, dmin·dx, acc)` with
//!     the mins `M = Σ_j m_j · bsum_j` (exact in f32).
//!   - Q8_0, per block `p`: `G += cvt(C_p) · (ws[p] · d_x[p])`.
//!
//!   Only the order of the f32 sums differs from the scalar kernel.
//!
//! Where: its f32 summation order differs from the VNNI kernels', so decoding and verification
//! must not mix the two. `matmul_with(KernelLevel::Amx, ..)` therefore runs the whole AMX family:
//! these tiles for `MIN_TOK`+ rows and `x86_avx512::amx_order_rows` (the same f32 operations per
//! output, in the same order, from VNNI integer dot products) for fewer, so any row is
//! bit-identical whatever the batch size. `matmul` takes the family inside `with_amx` scopes: by
//! default every forward pass (`CpuBackend::with_amx_use`, `AmxUse::Always`), only prompt prefill
//! with `AmxUse::Prefill`, never with `AmxUse::Never` or `ARBOR_KERNEL=avx512` (see
//! `KernelLevel::detect`).

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use rayon::prelude::*;

use super::act::{self, ActKind, GROUP, OFF_D, REC};
use super::{GgmlType, QMatrix, YPtr};

/// Fewest activation rows for which `matmul_with` takes the AMX path (measured crossover with the
/// VNNI kernels on a 2-core Sapphire Rapids: below it the per-sub-block epilogue costs more than
/// the tiles save).
pub(crate) const MIN_TOK: usize = 8;

/// Rows of a tile (output rows per A tile, activation rows per B tile).
const TILE: usize = 16;
/// Packed activation record: VNNI rows, per-row `d`, per-sub-block vectors.
const OFF_DX: usize = 64 * 64;
const OFF_V: usize = OFF_DX + 64;
const AREC: usize = OFF_V + 16 * 64;
/// Weight scratch: 16 rows of at most two planes of 256 int8 (`Kind::AROW`).
const AROW_MAX: usize = 2 * GROUP;
/// Software prefetch distance for the weight stream, in groups.
const PREFETCH_GROUPS: usize = 4;

/// Whether AMX int8 tiles can run in this process (CPUID + AVX-512 VNNI + the kernel's grant);
/// the grant is requested on the first call.
pub(crate) fn granted() -> bool {
    static G: OnceLock<bool> = OnceLock::new();
    *G.get_or_init(request)
}

fn request() -> bool {
    // SAFETY: CPUID is available on every x86_64 CPU; leaf 7 is read only if the max leaf allows it.
    #[allow(unused_unsafe)]
    let (max_leaf, edx7) = unsafe {
        let max = __cpuid(0).eax;
        (max, if max >= 7 { __cpuid_count(7, 0).edx } else { 0 })
    };
    let amx = max_leaf >= 7 && (edx7 >> 24) & 1 == 1 && (edx7 >> 25) & 1 == 1;
    let vnni = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    amx && vnni && os_grant()
}

#[cfg(target_os = "linux")]
fn os_grant() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_GET_XCOMP_PERM: usize = 0x1022;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    /// Raw two-argument Linux syscall (the engine has no libc dependency).
    unsafe fn syscall2(n: usize, a1: usize, a2: usize) -> isize {
        let ret: isize;
        asm!(
            "syscall",
            inlateout("rax") n as isize => ret,
            in("rdi") a1,
            in("rsi") a2,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack)
        );
        ret
    }
    let mut perm: u64 = 0;
    // SAFETY: arch_prctl with these codes only changes this process's permitted xfeatures or writes
    // the permitted mask to `perm`, a live u64.
    unsafe {
        if syscall2(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0 {
            return false;
        }
        if syscall2(
            SYS_ARCH_PRCTL,
            ARCH_GET_XCOMP_PERM,
            &mut perm as *mut u64 as usize,
        ) != 0
        {
            return false;
        }
    }
    (perm >> XFEATURE_XTILEDATA) & 1 == 1
}

#[cfg(not(target_os = "linux"))]
fn os_grant() -> bool {
    false
}

/// Whether the AMX kernels cover this weight type and row length.
pub(crate) fn supports(ty: GgmlType, n_in: usize) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q8_0)
        && n_in.is_multiple_of(GROUP)
        && n_in > 0
}

/// y = W x with the AMX kernels (any `n_tok >= 1`). Returns false, touching nothing, when AMX is
/// not granted or the weights are not covered (`supports`). Shapes must have been validated as in
/// `matmul_with`.
pub(crate) fn matmul(w: &QMatrix, x: &[f32], n_tok: usize, y: &mut [f32]) -> bool {
    matmul_many(std::slice::from_ref(w), x, n_tok, &mut [y])
}

/// `ys[i] = ws[i] x` with the AMX kernels, all the matrices' row tiles in one parallel region and
/// the activations packed once per weight type. Returns false, touching nothing, when AMX is not
/// granted or any matrix is packed or not covered (`supports`, all with the same `n_in`). Shapes must have
/// been validated as in `matmul_with`.
pub(crate) fn matmul_many(ws: &[QMatrix], x: &[f32], n_tok: usize, ys: &mut [&mut [f32]]) -> bool {
    if ws.len() != ys.len() {
        return false;
    }
    let yps: Vec<YPtr> = ys
        .iter_mut()
        .zip(ws)
        .map(|(y, w)| {
            debug_assert_eq!(y.len(), n_tok * w.n_out);
            YPtr {
                ptr: y.as_mut_ptr(),
                n_out: w.n_out,
            }
        })
        .collect();
    // SAFETY: each `YPtr` comes from the unique borrow of an output of `n_tok * n_out` floats.
    unsafe { matmul_many_raw(ws, x, n_tok, &yps, false) }
}

/// `gate = silu(W_gate x) · (W_up x)`, `up = W_up x` with the AMX kernels: each row task runs its
/// rows of both matrices, then gates them (`matmul_swiglu_in`). Returns false, touching nothing,
/// as `matmul_many` does, and where the matrices' `n_out` differ.
pub(crate) fn matmul_swiglu(
    w_gate: &QMatrix,
    w_up: &QMatrix,
    x: &[f32],
    n_tok: usize,
    gate: &mut [f32],
    up: &mut [f32],
) -> bool {
    let yp = |y: &mut [f32], w: &QMatrix| YPtr {
        ptr: y.as_mut_ptr(),
        n_out: w.n_out,
    };
    let yps = [yp(gate, w_gate), yp(up, w_up)];
    // SAFETY: each `YPtr` comes from the unique borrow of an output of `n_tok * n_out` floats.
    unsafe { matmul_many_raw(&[*w_gate, *w_up], x, n_tok, &yps, true) }
}

/// `matmul_many` into raw outputs. When it returns true it has written every element
/// `[n_tok, n_out]` of every output (so they may start uninitialized). `swiglu`: `ws` is
/// `[gate, up]` (same `n_out`), each task runs the same rows of both and then gates them,
/// `y_gate = silu(y_gate) · y_up` (`simd::silu_mul`).
///
/// # Safety
/// `yps[i]` must point to `n_tok * ws[i].n_out` writable floats that nothing else accesses
/// during the call.
pub(crate) unsafe fn matmul_many_raw(
    ws: &[QMatrix],
    x: &[f32],
    n_tok: usize,
    yps: &[YPtr],
    swiglu: bool,
) -> bool {
    let Some(n_in) = ws.first().map(|w| w.n_in) else {
        return false;
    };
    if !granted()
        || n_tok == 0
        || ws.len() != yps.len()
        || (swiglu && (ws.len() != 2 || ws[0].n_out != ws[1].n_out))
        || ws
            .iter()
            .any(|w| w.packed || !supports(w.ty, w.n_in) || w.n_in != n_in)
    {
        return false;
    }
    debug_assert_eq!(x.len(), n_tok * n_in);
    let n_groups = n_in / GROUP;
    let n_tb = n_tok.div_ceil(TILE);
    let per_ty = n_tb * n_groups * AREC;
    // The distinct weight types, in order of first use; matrix i reads the records of type `slot[i]`.
    let mut tys: Vec<GgmlType> = Vec::new();
    let slot: Vec<usize> = ws
        .iter()
        .map(|w| {
            tys.iter().position(|&t| t == w.ty).unwrap_or_else(|| {
                tys.push(w.ty);
                tys.len() - 1
            })
        })
        .collect();
    let bytes = tys.len() * per_ty;
    let mut buf = super::take_scratch(bytes);
    {
        let act_bytes = super::bytes_of_lines(&mut buf, bytes);
        let n_rec = n_tb * n_groups;
        let fill = |(i, rec): (usize, &mut [u8])| {
            let (ty, r) = (tys[i / n_rec], i % n_rec);
            pack_record(ty, x, n_in, n_tok, r / n_groups, r % n_groups, rec)
        };
        if n_tok * n_in * tys.len() >= 16384 && rayon::current_num_threads() > 1 {
            act_bytes.par_chunks_mut(AREC).enumerate().for_each(fill);
        } else {
            act_bytes.chunks_mut(AREC).enumerate().for_each(fill);
        }
        let act_ro: &[u8] = act_bytes;
        let rows = |m: usize, r0: usize, r1: usize| {
            let act = act_ro[slot[m] * per_ty..].as_ptr();
            // SAFETY: `granted()` confirmed AMX-INT8, the tile grant and AVX-512 VNNI; `act`
            // holds `n_tb * n_groups` records built by `pack_record` for `ws[m].ty`;
            // `r1 <= n_out`; the caller validated the matrices; tasks own disjoint row ranges of
            // their matrix's output.
            unsafe { quant_rows(&ws[m], act, n_tok, r0, r1, yps[m]) }
        };
        // SAFETY: the caller's contract on `yps`; `quant_rows` writes every element of its rows.
        unsafe { super::run_matrix_tasks(ws, n_tok, yps, swiglu, TILE, &rows) };
    }
    super::put_scratch(buf);
    true
}

/// Q4_K's 32-element sub-blocks in A-tile column order (its unpack leaves the low and high nibbles
/// of each 64-byte half side by side); the f32 epilogue runs over them in this order.
pub(super) const Q4K_ORDER: [usize; 8] = [0, 2, 1, 3, 4, 6, 5, 7];

/// Natural element index of A-tile column `e` (0..256) of a group: Q4_K's unpack leaves the
/// 32-element sub-blocks in the order 0, 2, 1, 3, 4, 6, 5, 7; the other types are natural.
#[inline(always)]
fn perm(ty: GgmlType, e: usize) -> usize {
    if ty == GgmlType::Q4_K {
        Q4K_ORDER[e / 32] * 32 + e % 32
    } else {
        e
    }
}

/// Builds the packed record of activation rows `16 tb .. 16 tb + 16` (zeros past `n_tok`), group `g`.
fn pack_record(
    ty: GgmlType,
    x: &[f32],
    n_in: usize,
    n_tok: usize,
    tb: usize,
    g: usize,
    rec: &mut [u8],
) {
    let rec = &mut rec[..AREC];
    rec.fill(0);
    let kind = act::act_kind(ty);
    let mut nat = [0u8; REC];
    for t in 0..TILE {
        let tok = tb * TILE + t;
        if tok >= n_tok {
            break;
        }
        let xs = &x[tok * n_in + g * GROUP..tok * n_in + (g + 1) * GROUP];
        // SAFETY: this module runs only after `granted()` confirmed AVX2/FMA/F16C.
        unsafe { super::x86_avx2::quantize_group(kind, xs, &mut nat) };
        for r in 0..64 {
            let src = perm(ty, 4 * r);
            rec[r * 64 + 4 * t..r * 64 + 4 * t + 4].copy_from_slice(&nat[src..src + 4]);
        }
        let put = |rec: &mut [u8], off: usize, v: f32| {
            rec[off + 4 * t..off + 4 * t + 4].copy_from_slice(&v.to_le_bytes())
        };
        match kind {
            ActKind::Q8K => {
                put(rec, OFF_DX, act::rec_f32(&nat, OFF_D));
                for j in 0..8 {
                    put(rec, OFF_V + 64 * j, act::rec_bsum32(&nat, j));
                }
            }
            _ => {
                for j in 0..8 {
                    put(rec, OFF_V + 64 * j, act::rec_f32(&nat, OFF_D + 4 * j));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Weight unpacking
// ---------------------------------------------------------------------------------------------

/// One weight type: its sub-block size and its unpack of one 256-element group.
trait Kind {
    /// Elements per `tdpbssd` (the K of one product): a scale sub-block, or (`FOLD`) 64.
    const KS: usize;
    /// Bytes of one 256-element group.
    const GB: usize;
    /// Bytes of one unpacked row of the A scratch: 256 int8, or (`FOLD`) two planes of 256.
    const AROW: usize = if Self::FOLD { 2 * GROUP } else { GROUP };
    /// The sub-block scales are folded into the weights as two int8 planes `hi`, `lo` with
    /// `w = 2^SHIFT · hi + lo` for every weight times its sub-block scale, so one K = 256 product
    /// per plane gives the exact integer `I = 2^SHIFT · C_hi + C_lo = Σ_j sc_j Σ_{k in j} q_k a_k`
    /// of the group.
    /// - Q4_K (`SHIFT` 3): `hi = q·(sc >> 3)`, `lo = q·(sc & 7)` (six-bit scales, products at most
    ///   105). The f32 scales are decoded for a whole row tile at once
    ///   (`x86_avx512::k4_fields_by_row`) and stored transposed, `ws[p][row]`: `d`, `dmin`, then
    ///   the eight mins `m_j`.
    /// - Q6_K (`SHIFT` 6): `w = q·sc` (q in −32..31, signed eight-bit scales: |w| <= 4096) split
    ///   as `hi = w >> 6` (−64..64), `lo = w & 63`. `ws[0][row]` is the row's `d`.
    ///
    /// `unpack` then leaves `ws` alone; `unpack_group` fills it.
    const FOLD: bool = false;
    /// `FOLD`: the power of two of the `hi` plane.
    const SHIFT: u32 = 0;
    /// `FOLD`: Q4_K's mins (`M = Σ_j m_j · bsum_j`, subtracted times `dmin`).
    const MINS: bool = false;
    /// Unpacks the group at `p` into `AROW` bytes at `a` (A-tile column order) and, unless
    /// `FOLD` (Q8_0, the one type that is not), its block scales into `ws` (`q80_scales`).
    unsafe fn unpack(p: *const u8, a: *mut u8, ws: *mut f32);
}

struct Q4K;
struct Q6K;
struct Q80;

#[inline(always)]
unsafe fn rd_u16(p: *const u8) -> u16 {
    std::ptr::read_unaligned(p as *const u16)
}

/// Low and high nibbles of the 64 bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> (__m512i, __m512i) {
    let v = _mm512_loadu_si512(p as *const __m512i);
    let m4 = _mm512_set1_epi8(0x0F);
    (
        _mm512_and_si512(v, m4),
        _mm512_and_si512(_mm512_srli_epi16(v, 4), m4),
    )
}

impl Kind for Q4K {
    const KS: usize = 64;
    const GB: usize = 144;
    const FOLD: bool = true;
    const SHIFT: u32 = 3;
    const MINS: bool = true;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8, a: *mut u8, ws: *mut f32) {
        // Registers in A-tile column order: sub-blocks (0, 2), (1, 3), (4, 6), (5, 7).
        let (l0, h0) = nibbles(p.add(16));
        let (l1, h1) = nibbles(p.add(80));
        let (sc8, _) = super::x86_avx512::k4_sc_m8(p);
        let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc8 as i64)));
        let (c7, q) = (_mm512_set1_epi16(7), [l0, h0, l1, h1]);
        for (r, qr) in q.iter().enumerate() {
            // Each 16-bit word holds two 4-bit weights of one sub-block: times a three-bit scale
            // half, neither byte carries into the other (15 · 7 = 105 < 128).
            let s = _mm512_permutexvar_epi16(
                _mm512_loadu_si512(K4_WORD_SC[r].as_ptr() as *const _),
                sc,
            );
            let hi = _mm512_mullo_epi16(*qr, _mm512_srli_epi16::<3>(s));
            let lo = _mm512_mullo_epi16(*qr, _mm512_and_si512(s, c7));
            _mm512_storeu_si512(a.add(64 * r) as *mut __m512i, hi);
            _mm512_storeu_si512(a.add(GROUP + 64 * r) as *mut __m512i, lo);
        }
        let _ = ws;
    }
}

/// `vpermw` indices: word `i` of unpacked register `r` belongs to sub-block `Q4K_ORDER[2r + i/16]`.
static K4_WORD_SC: [[u16; 32]; 4] = word_sc(16, &Q4K_ORDER);

/// `vpermw` indices of the four unpacked registers (32 words each, `wps` words per sub-block, the
/// register's sub-blocks in the order `order`): word `i` of register `r` is scaled by sub-block
/// `order[(32r + i) / wps]`.
const fn word_sc(wps: usize, order: &[usize]) -> [[u16; 32]; 4] {
    let mut t = [[0u16; 32]; 4];
    let mut r = 0;
    while r < 4 {
        let mut i = 0;
        while i < 32 {
            t[r][i] = order[(32 * r + i) / wps] as u16;
            i += 1;
        }
        r += 1;
    }
    t
}

impl Kind for Q6K {
    const KS: usize = 64;
    const GB: usize = 210;
    const FOLD: bool = true;
    const SHIFT: u32 = 6;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8, a: *mut u8, ws: *mut f32) {
        let m30 = _mm512_set1_epi8(0x30);
        let c32 = _mm512_set1_epi8(32);
        // Word shift counts: bytes 0..32 of a register take one 2-bit field of qh, bytes 32..64 the next.
        let shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        // The 16 signed scales as words.
        let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(
            p.add(192) as *const __m128i
        )));
        for h in 0..2 {
            let (lo, hi) = nibbles(p.add(64 * h));
            let qh =
                _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * h) as *const __m256i));
            let h0 = _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30);
            let h1 = _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30);
            // Registers of elements 64r .. 64r + 64 (natural order), q in −32..31.
            for (k, q) in [(lo, h0), (hi, h1)].into_iter().enumerate() {
                let r = 2 * h + k;
                let q = _mm512_sub_epi8(_mm512_or_si512(q.0, q.1), c32);
                let s = _mm512_permutexvar_epi16(
                    _mm512_loadu_si512(K6_WORD_SC[r].as_ptr() as *const _),
                    sc,
                );
                let (whi, wlo) = split_products(q, s);
                _mm512_storeu_si512(a.add(64 * r) as *mut __m512i, whi);
                _mm512_storeu_si512(a.add(GROUP + 64 * r) as *mut __m512i, wlo);
            }
        }
        let _ = ws;
    }
}

/// The products `w = q · s` of 64 signed bytes `q` with the word scales `s` (word `i` scales
/// bytes `2i` and `2i + 1`; |w| < 2^13), as two planes of bytes in `q`'s order: `w >> 6` (signed)
/// and `w & 63`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn split_products(q: __m512i, s: __m512i) -> (__m512i, __m512i) {
    const ODD: __mmask64 = 0xAAAA_AAAA_AAAA_AAAA;
    // Even and odd bytes sign-extended to words, times their scale (exact in 16 bits).
    let we = _mm512_mullo_epi16(_mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(q)), s);
    let wo = _mm512_mullo_epi16(_mm512_srai_epi16::<8>(q), s);
    // Bits 6..14 of each product into its byte (`wo << 2`: the odd product's into the high byte).
    let hi = _mm512_mask_blend_epi8(ODD, _mm512_srli_epi16::<6>(we), _mm512_slli_epi16::<2>(wo));
    let lo = _mm512_and_si512(
        _mm512_mask_blend_epi8(ODD, we, _mm512_slli_epi16::<8>(wo)),
        _mm512_set1_epi8(63),
    );
    (hi, lo)
}

/// `vpermw` indices: word `i` of the register of elements 64r .. 64r + 64 scales elements
/// `64r + 2i` and `64r + 2i + 1`, of sub-block `4r + i/8`.
static K6_WORD_SC: [[u16; 32]; 4] =
    word_sc(8, &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);

impl Kind for Q80 {
    const KS: usize = 32;
    const GB: usize = 8 * 34;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8, a: *mut u8, ws: *mut f32) {
        for b in 0..8 {
            let q = _mm256_loadu_si256(p.add(34 * b + 2) as *const __m256i);
            _mm256_storeu_si256(a.add(32 * b) as *mut __m256i, q);
        }
        q80_scales(p, ws);
    }
}

/// Q8_0: the 8 block scales of the group at `p` into `ws`, exactly as the AMX epilogue multiplies
/// them. The AMX-order VNNI kernel (`x86_avx512::amx_order_rows`) reads them from here so both
/// paths use the same values.
///
/// # Safety
/// AVX-512 must be present; `p` must cover one Q8_0 group (8 blocks); `ws` must hold 8 floats.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q80_scales(p: *const u8, ws: *mut f32) {
    let mut h = [0u16; 8];
    for (b, v) in h.iter_mut().enumerate() {
        *v = rd_u16(p.add(34 * b));
    }
    _mm256_storeu_ps(
        ws,
        _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i)),
    );
}

// ---------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------

/// The 64-byte tile configuration (palette 1) for sub-blocks of `ks` elements.
#[repr(C, align(64))]
pub(crate) struct TileCfg(pub(crate) [u8; 64]);

pub(crate) fn tile_cfg(ks: usize) -> TileCfg {
    let mut c = [0u8; 64];
    c[0] = 1;
    let mut set = |i: usize, rows: usize, colsb: usize| {
        c[16 + 2 * i..18 + 2 * i].copy_from_slice(&(colsb as u16).to_le_bytes());
        c[48 + i] = rows as u8;
    };
    for i in 0..4 {
        set(i, TILE, 64);
    }
    set(4, TILE, ks);
    set(5, TILE, ks);
    set(6, ks / 4, 64);
    set(7, ks / 4, 64);
    TileCfg(c)
}

#[repr(C, align(64))]
struct ABuf([u8; TILE * AROW_MAX]);

#[repr(C, align(64))]
struct CBuf([i32; 16 * TILE * TILE]);

/// Four sub-blocks: `C_u = A_u · B_u` for u = 0..4 into `c` (4 × 1 KiB), where `A_u` is the
/// 16 × `ks` tile at `a + u·ks` (row stride `AROW`) and `B_u` the `ks/4` × 64 B tile at
/// `b + u·16·ks` (row stride 64).
///
/// # Safety
/// Tiles must be configured by `tile_cfg(ks)` on this thread; the pointers must cover the tiles.
#[inline(always)]
unsafe fn tiles4(a: *const u8, b: *const u8, ks: usize, c: *mut i32) {
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        "tileloadd tmm4, [{a} + {sa}*1]",
        "tileloadd tmm6, [{b} + {s64}*1]",
        "tdpbssd tmm0, tmm4, tmm6",
        "add {a}, {ka}",
        "add {b}, {kb}",
        "tileloadd tmm5, [{a} + {sa}*1]",
        "tileloadd tmm7, [{b} + {s64}*1]",
        "tdpbssd tmm1, tmm5, tmm7",
        "add {a}, {ka}",
        "add {b}, {kb}",
        "tileloadd tmm4, [{a} + {sa}*1]",
        "tileloadd tmm6, [{b} + {s64}*1]",
        "tdpbssd tmm2, tmm4, tmm6",
        "add {a}, {ka}",
        "add {b}, {kb}",
        "tileloadd tmm5, [{a} + {sa}*1]",
        "tileloadd tmm7, [{b} + {s64}*1]",
        "tdpbssd tmm3, tmm5, tmm7",
        "tilestored [{c} + {s64}*1], tmm0",
        "tilestored [{c} + {s64}*1 + 1024], tmm1",
        "tilestored [{c} + {s64}*1 + 2048], tmm2",
        "tilestored [{c} + {s64}*1 + 3072], tmm3",
        a = inout(reg) a => _,
        b = inout(reg) b => _,
        c = in(reg) c,
        sa = in(reg) GROUP,
        s64 = in(reg) 64usize,
        ka = in(reg) ks,
        kb = in(reg) 16 * ks,
        options(nostack)
    );
}

/// `Kind::FOLD` (Q4_K, Q6_K): `C_hi = A_hi · B` and `C_lo = A_lo · B` over the whole group (four
/// K = 64 products each) into `c` (2 × 1 KiB), where `A_hi` and `A_lo` are the 16 × 256 planes at
/// `a` and `a + 256` (row stride 512) and `B` the 64 × 64 B activation rows at `b`.
///
/// # Safety
/// Tiles must be configured by `tile_cfg(64)` on this thread; the pointers must cover the tiles.
#[inline(always)]
unsafe fn tiles_fold(a: *const u8, b: *const u8, c: *mut i32) {
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tileloadd tmm6, [{b} + {s64}*1 + 0]",
        "tileloadd tmm3, [{a} + {sa}*1 + 0]",
        "tdpbssd tmm0, tmm3, tmm6",
        "tileloadd tmm4, [{a} + {sa}*1 + 256]",
        "tdpbssd tmm1, tmm4, tmm6",
        "tileloadd tmm7, [{b} + {s64}*1 + 1024]",
        "tileloadd tmm3, [{a} + {sa}*1 + 64]",
        "tdpbssd tmm0, tmm3, tmm7",
        "tileloadd tmm4, [{a} + {sa}*1 + 320]",
        "tdpbssd tmm1, tmm4, tmm7",
        "tileloadd tmm6, [{b} + {s64}*1 + 2048]",
        "tileloadd tmm3, [{a} + {sa}*1 + 128]",
        "tdpbssd tmm0, tmm3, tmm6",
        "tileloadd tmm4, [{a} + {sa}*1 + 384]",
        "tdpbssd tmm1, tmm4, tmm6",
        "tileloadd tmm7, [{b} + {s64}*1 + 3072]",
        "tileloadd tmm3, [{a} + {sa}*1 + 192]",
        "tdpbssd tmm0, tmm3, tmm7",
        "tileloadd tmm4, [{a} + {sa}*1 + 448]",
        "tdpbssd tmm1, tmm4, tmm7",
        "tilestored [{c} + {s64}*1], tmm0",
        "tilestored [{c} + {s64}*1 + 1024], tmm1",
        a = in(reg) a,
        b = in(reg) b,
        c = in(reg) c,
        sa = in(reg) 2 * GROUP,
        s64 = in(reg) 64usize,
        options(nostack)
    );
}

/// Quantized rows `[r0, r1)` (16-row tiles) against packed activation records.
///
/// # Safety
/// AMX-INT8 must be granted and AVX-512 VNNI present; `act` must hold `ceil(n_tok/16) * n_in/256`
/// records built by `pack_record` for `w.ty`; `r1 <= w.n_out`; `w` validated.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn quant_rows(w: &QMatrix, act: *const u8, n_tok: usize, r0: usize, r1: usize, y: YPtr) {
    match w.ty {
        GgmlType::Q4_K => rows::<Q4K>(w, act, n_tok, r0, r1, y),
        GgmlType::Q6_K => rows::<Q6K>(w, act, n_tok, r0, r1, y),
        GgmlType::Q8_0 => rows::<Q80>(w, act, n_tok, r0, r1, y),
        _ => {}
    }
}

/// Row tiles × groups × 16-row activation blocks, software-pipelined: a step's tile products are
/// issued first (Q4_K, Q6_K: `tiles_fold`, both planes of the group; Q8_0: 4 blocks per
/// `tiles4`), then the next group's weights (this tile's next group, or the next tile's first) are
/// unpacked into the other scratch buffer while the tiles compute, then the epilogue reads the
/// stored products into 16 per-row registers. Each row's unpack prefetches into L2 the same row's
/// group `PREFETCH_GROUPS` ahead (the next row tile's rows past the last group), as the
/// single-row kernels stream their 16 rows (measured on qwen2.5-coder-1.5b, forward over 16
/// tokens: ~7% faster than spreading the prefetches of the next group step over the epilogue,
/// which stalled on full fill buffers). Results leave through `write_tile`.
// `p` indexes the record vectors, the product buffer and the scales alike.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn rows<K: Kind>(w: &QMatrix, act: *const u8, n_tok: usize, r0: usize, r1: usize, y: YPtr) {
    let cfg = tile_cfg(K::KS);
    asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
    let n_groups = w.n_in / GROUP;
    let n_tb = n_tok.div_ceil(TILE);
    let nsub = GROUP / K::KS;
    // Scratch, left uninitialized (48 KiB per call): every A row is unpacked and every product
    // tile stored before it is read.
    let mut abuf = std::mem::MaybeUninit::<[ABuf; 2]>::uninit();
    let mut cbuf = std::mem::MaybeUninit::<CBuf>::uninit();
    let abase = abuf.as_mut_ptr() as *mut u8;
    let aptr = |s: usize| abase.add(s * std::mem::size_of::<ABuf>());
    let cptr = cbuf.as_mut_ptr() as *mut i32;
    // Scales of the two buffers: Q8_0's by row (`ws[s][row][block]`); `FOLD`'s transposed, read by
    // `fold_epilogue`.
    let mut ws = [[[0f32; 16]; TILE]; 2];
    let mut acc = vec![_mm512_setzero_ps(); TILE * n_tb];
    let unpack = |ws: &mut [[[f32; 16]; TILE]; 2], s: usize, o0: usize, g: usize| {
        unpack_group::<K>(w, r1, aptr(s), &mut ws[s], o0, g)
    };
    // Scratch buffer `cur` holds the group being multiplied; the next one (this tile's next group,
    // or the next tile's first) is unpacked into the other while the tiles compute.
    let mut cur = 0;
    unpack(&mut ws, cur, r0, 0);
    let mut o0 = r0;
    while o0 < r1 {
        let nr = (r1 - o0).min(TILE);
        acc.fill(_mm512_setzero_ps());
        for g in 0..n_groups {
            let s = cur;
            let next = if g + 1 < n_groups {
                Some((o0, g + 1))
            } else if o0 + TILE < r1 {
                Some((o0 + TILE, 0))
            } else {
                None
            };
            cur = 1 - cur;
            for tb in 0..n_tb {
                let rec = act.add((tb * n_groups + g) * AREC);
                if K::FOLD {
                    tiles_fold(aptr(s), rec, cptr);
                    // Unpack the next group while the tiles compute.
                    if let (true, Some((no, ng))) = (tb + 1 == n_tb, next) {
                        unpack(&mut ws, 1 - s, no, ng);
                    }
                    fold_epilogue::<K>(cptr, &ws[s], rec, &mut acc[tb * TILE..(tb + 1) * TILE]);
                    continue;
                }
                let issue = |b: usize| {
                    tiles4(
                        aptr(s).add(4 * b * K::KS),
                        rec.add(4 * b * 16 * K::KS),
                        K::KS,
                        cptr.add(4 * b * TILE * TILE),
                    )
                };
                let nb = nsub / 4;
                issue(0);
                let mut gacc = [_mm512_setzero_ps(); TILE];
                for b in 0..nb {
                    // Keep the tile unit busy while this batch's products are scaled.
                    if b + 1 < nb {
                        issue(b + 1);
                    } else if let (true, Some((no, ng))) = (tb + 1 == n_tb, next) {
                        unpack(&mut ws, 1 - s, no, ng);
                    }
                    // Q8_0: the activation scale is per block (record vectors).
                    let ws = &ws[s];
                    for p in 4 * b..4 * b + 4 {
                        let cb = cptr.add(p * TILE * TILE) as *const i32;
                        let dx = _mm512_loadu_ps(rec.add(OFF_V + 64 * p) as *const f32);
                        for (i, ga) in gacc.iter_mut().enumerate() {
                            let c = _mm512_cvtepi32_ps(_mm512_load_si512(
                                cb.add(i * TILE) as *const __m512i
                            ));
                            let sc = _mm512_mul_ps(dx, _mm512_set1_ps(ws[i][p]));
                            *ga = _mm512_fmadd_ps(c, sc, *ga);
                        }
                    }
                }
                let a = &mut acc[tb * TILE..(tb + 1) * TILE];
                for (av, ga) in a.iter_mut().zip(&gacc) {
                    *av = _mm512_add_ps(*av, *ga);
                }
            }
        }
        write_tile(&acc, n_tok, nr, o0, y);
        o0 += TILE;
    }
    asm!("tilerelease", options(nostack, nomem));
}

/// Unpacks group `g` of the row tile at `o0` (rows past `r1` repeat the last one; their results
/// are dropped) into the A scratch at `a` and the scales `ws`, and prefetches into L2 each row's
/// group `PREFETCH_GROUPS` ahead (past the last group: the next row tile's first groups).
///
/// # Safety
/// AVX-512 VNNI present; `w` validated with `n_in % 256 == 0`; `o0 < r1 <= w.n_out`; `a` must
/// hold `TILE * K::AROW` bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_group<K: Kind>(
    w: &QMatrix,
    r1: usize,
    a: *mut u8,
    ws: &mut [[f32; 16]; TILE],
    o0: usize,
    g: usize,
) {
    let (base, rb, n_groups) = (w.data.as_ptr(), w.row_bytes(), w.n_in / GROUP);
    let nr = (r1 - o0).min(TILE);
    let mut heads = [[0u8; 64]; TILE];
    let mut dh = [0u16; TILE];
    let (po, pg) = super::x86_avx512::group_ahead(o0, g, n_groups, PREFETCH_GROUPS);
    for (i, wsi) in ws.iter_mut().enumerate() {
        let p = base.add((o0 + i.min(nr - 1)) * rb + g * K::GB);
        // Every line the group touches (its start is not line-aligned).
        let q = (po + i) * rb + pg * K::GB;
        for off in (q & !63..q + K::GB).step_by(64) {
            _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(off) as *const i8);
        }
        K::unpack(p, a.add(i * K::AROW), wsi.as_mut_ptr());
        if K::MINS {
            heads[i][..16].copy_from_slice(std::slice::from_raw_parts(p, 16));
        } else if K::FOLD {
            dh[i] = rd_u16(p.add(K::GB - 2));
        }
    }
    if K::FOLD && !K::MINS {
        _mm512_storeu_ps(
            ws[0].as_mut_ptr(),
            _mm512_cvtph_ps(_mm256_loadu_si256(dh.as_ptr() as *const __m256i)),
        );
    }
    if K::MINS {
        let f = super::x86_avx512::k4_fields_by_row(heads.as_ptr() as *const u8);
        _mm512_storeu_ps(ws[0].as_mut_ptr(), f.d);
        _mm512_storeu_ps(ws[1].as_mut_ptr(), f.dmin);
        for (row, m) in ws[2..10].iter_mut().zip(&f.m) {
            _mm512_storeu_ps(row.as_mut_ptr(), _mm512_cvtepi32_ps(*m));
        }
    }
}

/// The `FOLD` epilogue of one group and 16-row activation block: products `C_hi`, `C_lo` at `cb`
/// (2 × 256 i32), scales `ws` (`d`, and for Q4_K `dmin` and the mins), record `rec`,
/// accumulators `acc` (one per output row, the activation rows in the lanes).
///
/// # Safety
/// AVX-512 present; `cb` must hold the two stored product tiles and `rec` one packed record.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fold_epilogue<K: Kind>(
    cb: *const i32,
    ws: &[[f32; 16]; TILE],
    rec: *const u8,
    acc: &mut [__m512],
) {
    let dx = _mm512_loadu_ps(rec.add(OFF_DX) as *const f32);
    let bs: [__m512; 8] =
        std::array::from_fn(|j| _mm512_loadu_ps(rec.add(OFF_V + 64 * j) as *const f32));
    let shift = _mm_cvtsi32_si128(K::SHIFT as i32);
    for (i, av) in acc.iter_mut().enumerate() {
        // I = 2^SHIFT·C_hi + C_lo (exact), then the group's f32 chain: `fma(I, d·dx)`, and for
        // Q4_K the mins `M = Σ_j m_j·bsum_j` (exact in f32: |M| < 2^24).
        let c = |k: usize| _mm512_load_si512(cb.add(k * TILE * TILE + i * TILE) as *const __m512i);
        let isum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_sll_epi32(c(0), shift), c(1)));
        let d = _mm512_mul_ps(_mm512_set1_ps(ws[0][i]), dx);
        *av = _mm512_fmadd_ps(isum, d, *av);
        if !K::MINS {
            continue;
        }
        let mut mins = _mm512_mul_ps(_mm512_set1_ps(ws[2][i]), bs[0]);
        for (j, bj) in bs.iter().enumerate().skip(1) {
            mins = _mm512_fmadd_ps(_mm512_set1_ps(ws[2 + j][i]), *bj, mins);
        }
        let dmin = _mm512_mul_ps(_mm512_set1_ps(ws[1][i]), dx);
        *av = _mm512_fnmadd_ps(mins, dmin, *av);
    }
}

/// Writes a row tile's accumulators (`acc[tb * 16 + i]`: output row `o0 + i`, activation rows
/// `16 tb ..` in the lanes) to `y`, 16 rows at a time per activation row (transposed) when the
/// tile is whole: with `n_out` a multiple of 1024, 16 scalar stores per output row would all hit
/// one L1 set.
///
/// # Safety
/// AVX-512 present; `acc` holds `16 * ceil(n_tok / 16)` registers; rows `o0 .. o0 + nr` belong
/// to the calling task's range of `y`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn write_tile(acc: &[__m512], n_tok: usize, nr: usize, o0: usize, y: YPtr) {
    let mut lanes = [0f32; TILE];
    for tb in 0..n_tok.div_ceil(TILE) {
        let nt = (n_tok - tb * TILE).min(TILE);
        if nr == TILE {
            let mut r = [_mm512_setzero_si512(); TILE];
            for (ri, a) in r.iter_mut().zip(&acc[tb * TILE..(tb + 1) * TILE]) {
                *ri = _mm512_castps_si512(*a);
            }
            super::x86_avx512::transpose16(&mut r);
            for (t, v) in r.iter().take(nt).enumerate() {
                y.write16(tb * TILE + t, o0, _mm512_castsi512_ps(*v));
            }
            continue;
        }
        for i in 0..nr {
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc[tb * TILE + i]);
            for (t, &v) in lanes.iter().take(nt).enumerate() {
                y.write(tb * TILE + t, o0 + i, v);
            }
        }
    }
}
