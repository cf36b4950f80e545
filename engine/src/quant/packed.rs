//! Column-packed weights for the AVX-512 and AVX2 families: each 16-row group of blocks stored dword-transposed, the layout the 512-bit column registers hold (llama.cpp's `repack` idea, our own layout).
//!
//! The AVX-512 column tiles (`x86_avx2::kcols512`, `lcols512`) hold 16 output rows per register,
//! lane `c` = row `c`, so every pass over natural GGUF rows begins with 16×16 dword transposes of
//! the rows' blocks (a fifth of a 4- to 8-row qwen2.5-coder-1.5b forward pass on a Zen 5 EPYC).
//! Packed at load, the transposes are gone: for rows `16 i .. 16 i + 16` and block `g`, the packed
//! group is the `[16 rows, BB bytes]` matrix of their blocks transposed at dword granularity
//! (dword `k` of row `c` at byte `64 k + 4 c`), followed, for Q6_K's 210-byte blocks, by the 16
//! trailing f16 (`d`) at `64 · 52 + 2 c` (Q8_0's 34-byte blocks: the 32 value bytes transposed,
//! then the 16 leading `d` at `512 + 2 c`). So the kernels load what `dwords16` used to build,
//! one register per 64 bytes. The groups of a 16-row slice follow each other, slices follow each
//! other: a packed matrix has exactly the natural matrix's bytes, in place, and the same integers
//! and float steps per output, hence the same bits. The AVX2 family reads each packed K-quant
//! group as two 8-row column blocks (the 32 bytes at `64 k + 32 h` are its 8×8 transposes of rows
//! `8 h ..`; `x86_avx2::kpacked8`); Q4_1 and Q8_0 (smollm2's types) are packed for the AVX-512
//! family only (`x86_avx2::lcols512::rows_packed`). The AMX family packs what the AVX-512 family
//! packs: its tiles read packed Q4_K and Q6_K groups as their B operand
//! (`x86_avx2::kcols512::amx_packed`).

use rayon::prelude::*;

use super::{GgmlType, KernelLevel};

/// Output rows of a packed slice.
pub(crate) const PACK_ROWS: usize = 16;

/// Whether an `n_out × n_in` matrix of `ty` can be packed: a K-quant (Q4_K, Q5_K, Q6_K), Q4_1
/// or Q8_0 with whole 16-row slices.
pub fn packable(ty: GgmlType, n_out: usize, n_in: usize) -> bool {
    matches!(
        ty,
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q4_1 | GgmlType::Q8_0
    ) && n_out > 0
        && n_out.is_multiple_of(PACK_ROWS)
        && n_in > 0
        && n_in.is_multiple_of(ty.block_elems())
}

/// Whether this process's matmuls read packed rows of some type as they are: where they run the
/// AVX-512 VNNI, the AVX2 or the AMX family (the others get an unpacked copy).
pub fn packs_here() -> bool {
    read_packed(super::kernel_level())
}

/// Whether this process packs an `n_out × n_in` matrix of `ty` at load: [`packable`] and read
/// packed by the kernels it runs ([`reads_packed`]).
pub fn packs_here_matrix(ty: GgmlType, n_out: usize, n_in: usize) -> bool {
    packable(ty, n_out, n_in) && reads_packed(super::kernel_level(), ty)
}

/// Whether the kernels of `level` read packed rows of `ty` as they are: K-quants in the AVX-512
/// VNNI (`x86_avx2::kcols512`) and AVX2 (`x86_avx2::kpacked8`) families,
/// Q4_1 and Q8_0 in the AVX-512 VNNI family (`x86_avx2::lcols512`). The AMX family reads what the
/// AVX-512 VNNI family reads: its tiles take packed Q4_K and Q6_K batches of
/// `amx_packed::min_rows`+ rows (`x86_avx2::kcols512::amx_packed`), the packed AVX-512 kernels
/// the rest, with the same bits.
pub(crate) fn reads_packed(level: KernelLevel, ty: GgmlType) -> bool {
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => read_packed(level),
        GgmlType::Q4_1 | GgmlType::Q8_0 => {
            matches!(level, KernelLevel::Avx512Vnni | KernelLevel::Amx)
        }
        _ => false,
    }
}

/// Whether the kernels of `level` read packed rows of some type as they are.
pub(crate) fn read_packed(level: KernelLevel) -> bool {
    matches!(
        level,
        KernelLevel::Avx512Vnni | KernelLevel::Avx2 | KernelLevel::Amx
    )
}

/// Whether models are packed at load: yes unless `ARBOR_PACK=0` (`off`, `false`). Measured on
/// Zen 4 (docs/benchmarks.md, 2026-12-03 "night"): with the packed kernels' weight stream
/// prefetched into L2 a slice of each group at a time, decoding runs 0-25% faster than on GGUF
/// order in both families and AVX-512 passes over 4-16 rows 25-35% cheaper (before, with whole
/// groups prefetched into L1 at once, a Zen 5 EPYC decoded 0.87x packed and a Zen 4 0.55x, so
/// packing was opt-in).
pub fn pack_requested() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("ARBOR_PACK").is_ok_and(|v| matches!(v.as_str(), "0" | "off" | "false"))
    })
}

/// Where a block's bytes go in a packed group: the dword-aligned body `start .. start + len`
/// transposed (dword `k` of row `c` at byte `64 k + 4 c`), then a 2-byte f16 left over
/// (Q6_K's trailing `d`, Q8_0's leading one) at `64 · len / 4 + 2 c`.
fn layout(ty: GgmlType) -> (usize, usize, Option<usize>) {
    match ty {
        GgmlType::Q6_K => (0, 208, Some(208)),
        GgmlType::Q8_0 => (2, 32, Some(0)),
        _ => (0, ty.block_bytes(), None),
    }
}

/// Copies row `c`'s block `nat` into its place in the packed group `out`.
fn put_block(ty: GgmlType, nat: &[u8], c: usize, out: &mut [u8]) {
    let (start, len, tail) = layout(ty);
    for (k, dw) in nat[start..start + len].chunks_exact(4).enumerate() {
        out[64 * k + 4 * c..64 * k + 4 * c + 4].copy_from_slice(dw);
    }
    if let Some(t) = tail {
        let at = 64 * (len / 4) + 2 * c;
        out[at..at + 2].copy_from_slice(&nat[t..t + 2]);
    }
}

/// Copies row `c`'s block out of the packed group `packed` into `nat` (the inverse of
/// [`put_block`]).
fn get_block(ty: GgmlType, packed: &[u8], c: usize, nat: &mut [u8]) {
    let (start, len, tail) = layout(ty);
    for (k, dw) in nat[start..start + len].chunks_exact_mut(4).enumerate() {
        dw.copy_from_slice(&packed[64 * k + 4 * c..64 * k + 4 * c + 4]);
    }
    if let Some(t) = tail {
        let at = 64 * (len / 4) + 2 * c;
        nat[t..t + 2].copy_from_slice(&packed[at..at + 2]);
    }
}

/// Block bytes and row bytes of `ty` at `n_in` elements.
fn sizes(ty: GgmlType, n_in: usize) -> (usize, usize) {
    (
        ty.block_bytes(),
        ty.block_bytes() * (n_in / ty.block_elems()),
    )
}

/// Pack `data` (`n_out` natural rows of `n_in` elements of `ty`, [`packable`]) in place.
pub(crate) fn pack(ty: GgmlType, data: &mut [u8], n_out: usize, n_in: usize) {
    let (bb, rb) = sizes(ty, n_in);
    debug_assert!(packable(ty, n_out, n_in) && data.len() == n_out * rb);
    let slices = data.par_chunks_exact_mut(PACK_ROWS * rb);
    slices.for_each_init(
        || vec![0u8; PACK_ROWS * rb],
        |nat, slice| {
            nat.copy_from_slice(slice);
            for (g, out) in slice.chunks_exact_mut(PACK_ROWS * bb).enumerate() {
                for c in 0..PACK_ROWS {
                    put_block(ty, &nat[c * rb + g * bb..c * rb + (g + 1) * bb], c, out);
                }
            }
        },
    );
}

/// The natural rows of a packed matrix (the inverse of [`pack`]).
pub(crate) fn unpack(ty: GgmlType, data: &[u8], n_out: usize, n_in: usize) -> Vec<u8> {
    let (bb, rb) = sizes(ty, n_in);
    debug_assert!(packable(ty, n_out, n_in) && data.len() == n_out * rb);
    let mut nat = vec![0u8; data.len()];
    for (slice, out) in data
        .chunks_exact(PACK_ROWS * rb)
        .zip(nat.chunks_exact_mut(PACK_ROWS * rb))
    {
        for (g, packed) in slice.chunks_exact(PACK_ROWS * bb).enumerate() {
            for c in 0..PACK_ROWS {
                get_block(
                    ty,
                    packed,
                    c,
                    &mut out[c * rb + g * bb..c * rb + (g + 1) * bb],
                );
            }
        }
    }
    nat
}

/// Natural row `row` of a packed matrix of `n_in`-element rows, into `out` (its row bytes): what
/// an embedding lookup in a packed table reads.
pub(crate) fn natural_row(ty: GgmlType, data: &[u8], n_in: usize, row: usize, out: &mut [u8]) {
    let (bb, rb) = sizes(ty, n_in);
    let (slice, c) = (row / PACK_ROWS, row % PACK_ROWS);
    let slice = &data[slice * PACK_ROWS * rb..(slice + 1) * PACK_ROWS * rb];
    for (g, packed) in slice.chunks_exact(PACK_ROWS * bb).enumerate() {
        get_block(ty, packed, c, &mut out[g * bb..(g + 1) * bb]);
    }
}
