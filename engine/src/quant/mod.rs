//! GGML tensor formats (block layouts, dequantization, test quantizers) and the multi-row quantized matmul.
//!
//! Weights stay in their GGUF block format. For quantized weights each activation row is quantized once
//! per call to the weight type's dot type, as llama.cpp does (Q4_0/Q5_0/Q8_0 × Q8_0, Q4_1/Q5_1 × Q8_1,
//! K-quants × Q8_K), and the products are integer dot products. Float weights (F32/F16/BF16) multiply
//! the f32 activations directly. Kernels:
//!
//! * `scalar` — portable reference (exact integer sums per block, like ggml's generic code);
//! * `x86_avx2` — AVX2 `maddubs`/`madd`; K-quants for 2+ activation rows, Q4_1 and Q8_0 for any
//!   number, on column-interleaved tiles (8 output rows per register, 16 output × 4 activation
//!   rows per tile, one shared driver);
//! * `x86_avx512` — AVX-512 VNNI `dpbusd`; activations are stored permuted so that every 32-bit lane
//!   of the accumulator covers exactly one 16-element chunk of one scale group, which lets all four
//!   64-byte registers of a 256-element group accumulate into one register (Q4_0, Q5_0, Q5_1);
//!   K-quants, Q4_1 and Q8_0 instead run `x86_avx2::kcols512` / `lcols512` (`dpbusd` on 512-bit
//!   column tiles of 16 output rows per register) and `x86_avx2::knat512` (K-quant calls of up to
//!   [`natural_kernel_rows`] activation rows, 16 output rows at a time), the
//!   AVX2 family's exact integers and float steps: the two families agree bit for bit on them;
//! * `x86_avx2::kvnni` (and `lcols`' VNNI tile) — the AVX-VNNI family: the AVX2 column tiles with
//!   VEX `vpdpbusd` (K-quants, Q4_1, Q8_0), for AVX2 CPUs with AVX-VNNI and no AVX-512; the AVX2
//!   family's bits;
//! * the AMX family, where the OS grants AMX, only inside [`with_amx`] / [`with_amx_family`]
//!   scopes (a `CpuBackend` opens the family for every forward pass by default): on packed rows
//!   `x86_avx2::kcols512::amx_packed` (int8 tiles reading packed Q4_K/Q6_K groups as their B
//!   operand, for `amx_packed::min_rows`+ activation rows) and the packed AVX-512 kernels
//!   otherwise, the AVX-512 family's bits; on natural rows `amx` (`tdpbssd` on Q4_K/Q6_K/Q8_0 for
//!   `amx::MIN_TOK`+ rows) and below that `x86_avx512::amx_order_rows`, VNNI kernels that repeat
//!   the tiles' f32 arithmetic bit for bit.
//!
//! Every kernel unpacks each weight group once and dots it against all activation rows of the call
//! (the activation rows, the accumulators and a k-block of the activations stay in L1/L2), so
//! multiplying 16 rows costs far less than 16 single-row calls.

mod act;
#[cfg(target_arch = "x86_64")]
mod amx;
mod formats;
pub mod packed;
mod scalar;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86_avx512;
#[cfg(target_arch = "x86_64")]
use x86_avx2::kcols512::amx_packed;

use std::cell::Cell;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::error::{EngineError, Result};

pub use formats::{
    dequantize_row, quantize_row, quantize_row_bf16, quantize_row_f16, quantize_row_q4_0,
    quantize_row_q4_1, quantize_row_q4_k, quantize_row_q5_0, quantize_row_q5_1, quantize_row_q5_k,
    quantize_row_q6_k, quantize_row_q8_0,
};

/// GGML tensor element types (ids as in `ggml.h`). Only the types GGUF LLM files commonly use.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    BF16,
}

impl GgmlType {
    /// The type for a GGML type id, `None` for ids this engine does not know.
    pub fn from_u32(v: u32) -> Option<GgmlType> {
        Some(match v {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            30 => GgmlType::BF16,
            _ => return None,
        })
    }

    /// The GGML type id.
    pub fn to_u32(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::BF16 => 30,
        }
    }

    /// The name llama.cpp prints ("Q4_K", "F16", ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q8_1 => "Q8_1",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::Q8_K => "Q8_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Elements per block: 1 for float types, 32 for the legacy quants, 256 for K-quants.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => 32,
            GgmlType::Q8_0 | GgmlType::Q8_1 => 32,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K => 256,
            GgmlType::Q6_K | GgmlType::Q8_K => 256,
        }
    }

    /// Bytes per block (sizes of ggml's `block_*` structs).
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q8_1 => 36,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::Q8_K => 292,
        }
    }

    /// Bytes of a row of `n_elems` elements; `None` if `n_elems` is not a multiple of
    /// `block_elems()` (or the size overflows).
    pub fn row_bytes(self, n_elems: usize) -> Option<usize> {
        if !n_elems.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n_elems / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Whether `dequantize_row`, `quantize_row` and `matmul` support this type.
    pub fn supported(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q5_K
                | GgmlType::Q6_K
        )
    }

    fn is_float(self) -> bool {
        matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

pub(crate) fn unsupported(ty: GgmlType) -> EngineError {
    EngineError::UnsupportedTensorType(ty.name().to_string())
}

/// A weight matrix as stored in GGUF: `n_out` rows, each `n_in` elements, row-major, quantized rows
/// back to back.
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub ty: GgmlType,
    pub data: &'a [u8],
    pub n_out: usize,
    pub n_in: usize,
    /// `data` holds the rows column-packed ([`packed`]), not in GGUF order.
    pub(crate) packed: bool,
}

impl std::fmt::Debug for QMatrix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("n_out", &self.n_out)
            .field("n_in", &self.n_in)
            .field("bytes", &self.data.len())
            .field("packed", &self.packed)
            .finish()
    }
}

impl<'a> QMatrix<'a> {
    /// Checks that `n_in` is a whole number of blocks and `data.len() == n_out * row_bytes(n_in)`.
    pub fn new(ty: GgmlType, data: &'a [u8], n_out: usize, n_in: usize) -> Result<Self> {
        let rb = ty.row_bytes(n_in).ok_or_else(|| {
            EngineError::Shape(format!(
                "{ty} row of {n_in} elements is not a multiple of the block size {}",
                ty.block_elems()
            ))
        })?;
        let need = rb.checked_mul(n_out).ok_or_else(|| {
            EngineError::Shape(format!("{ty} matrix {n_out}x{n_in} is too large"))
        })?;
        if data.len() != need {
            return Err(EngineError::Shape(format!(
                "{ty} matrix {n_out}x{n_in} needs {need} bytes, got {}",
                data.len()
            )));
        }
        Ok(QMatrix {
            ty,
            data,
            n_out,
            n_in,
            packed: false,
        })
    }

    /// Whether the rows are column-packed ([`packed`]; the AVX-512 VNNI and AVX2 families'
    /// kernels read them as they are, the others see an unpacked copy).
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// The rows in GGUF order: `data` itself, or an unpacked copy of packed rows.
    pub fn natural_bytes(&self) -> std::borrow::Cow<'a, [u8]> {
        if self.packed {
            std::borrow::Cow::Owned(packed::unpack(self.ty, self.data, self.n_out, self.n_in))
        } else {
            std::borrow::Cow::Borrowed(self.data)
        }
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.n_in).unwrap_or(0)
    }
}

/// Which SIMD kernels `matmul_with` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelLevel {
    Scalar,
    Avx2,
    /// The AVX2 kernels with AVX-VNNI's VEX `vpdpbusd` in the column tiles of K-quants, Q4_1 and
    /// Q8_0 (CPUs with AVX-VNNI but no AVX-512: Intel Alder Lake and later clients, Xeon 6
    /// E-cores). Bit for bit the AVX2 family's results.
    AvxVnni,
    Avx512Vnni,
    /// AVX-512 VNNI plus AMX int8 tiles for quantized matmuls with many activation rows (x86_64
    /// Linux, only when CPUID reports AMX-INT8 and the kernel grants the tile state).
    Amx,
}

impl KernelLevel {
    /// Every level, lowest first.
    const ALL: [KernelLevel; 5] = [
        KernelLevel::Scalar,
        KernelLevel::Avx2,
        KernelLevel::AvxVnni,
        KernelLevel::Avx512Vnni,
        KernelLevel::Amx,
    ];

    /// The best level this CPU supports (runtime CPUID, and for AMX the OS grant), chosen by the
    /// environment variable `ARBOR_KERNEL=scalar|avx2|avxvnni|avx512|amx` (it can never exceed the hardware):
    ///
    /// * unset: the best level, but the AMX family only inside [`with_amx`] /
    ///   [`with_amx_family`] scopes (see `CpuBackend::with_amx_use`). The AMX family (tiles for
    ///   `amx::MIN_TOK`+ rows, the AMX-order VNNI kernel below) orders its f32 sums differently
    ///   from the VNNI kernels, and each family is bit-identical across batch sizes on its own; so
    ///   tree verification and decoding must use the same family for greedy speculative output to
    ///   equal incremental output token for token;
    /// * `amx`: the AMX family for every quantized matmul it covers (prefill, decoding and
    ///   verification alike, still bit-identical to each other);
    /// * `avx512`: VNNI only, never AMX; `avxvnni`, `avx2`, `scalar`: those kernels only.
    pub fn detect() -> KernelLevel {
        let hw = hw_level();
        match std::env::var("ARBOR_KERNEL").ok().as_deref().map(str::trim) {
            Some(s) if s.eq_ignore_ascii_case("scalar") => KernelLevel::Scalar,
            Some(s) if s.eq_ignore_ascii_case("avx2") => KernelLevel::Avx2.on_this_cpu(),
            // Also beside AVX-512 (Zen 5, Sapphire Rapids): the family an AVX2 + AVX-VNNI CPU
            // would run.
            Some(s) if s.eq_ignore_ascii_case("avxvnni") => KernelLevel::AvxVnni.on_this_cpu(),
            Some(s) if s.eq_ignore_ascii_case("avx512") => KernelLevel::Avx512Vnni.on_this_cpu(),
            _ => hw,
        }
    }

    /// Whether `ARBOR_KERNEL=amx` asks for AMX outside [`with_amx`] scopes too.
    fn amx_everywhere() -> bool {
        static E: OnceLock<bool> = OnceLock::new();
        *E.get_or_init(|| {
            std::env::var("ARBOR_KERNEL").is_ok_and(|s| s.trim().eq_ignore_ascii_case("amx"))
        })
    }

    /// Short name ("scalar", "avx2", "avxvnni", "avx512", "amx").
    pub fn name(self) -> &'static str {
        match self {
            KernelLevel::Scalar => "scalar",
            KernelLevel::Avx2 => "avx2",
            KernelLevel::AvxVnni => "avxvnni",
            KernelLevel::Avx512Vnni => "avx512",
            KernelLevel::Amx => "amx",
        }
    }

    fn rank(self) -> u8 {
        match self {
            KernelLevel::Scalar => 0,
            KernelLevel::Avx2 => 1,
            KernelLevel::AvxVnni => 2,
            KernelLevel::Avx512Vnni => 3,
            KernelLevel::Amx => 4,
        }
    }

    /// Whether this CPU runs the level's kernels: every level up to the best one it has, except
    /// AVX-VNNI, which AVX-512 does not imply (Ice Lake and Zen 4 have AVX-512 VNNI without it).
    fn runs_here(self) -> bool {
        match self {
            KernelLevel::AvxVnni => avx_vnni(),
            l => l.rank() <= hw_level().rank(),
        }
    }

    /// `self`, or the best level below it this CPU runs.
    fn on_this_cpu(self) -> KernelLevel {
        KernelLevel::ALL
            .into_iter()
            .rev()
            .find(|l| l.rank() <= self.rank() && l.runs_here())
            .unwrap_or(KernelLevel::Scalar)
    }

    fn min_with(self, other: KernelLevel) -> KernelLevel {
        if self.rank() <= other.rank() {
            self
        } else {
            other
        }
    }

    /// Levels this machine can run, lowest first (`AvxVnni` wherever the CPU has AVX-VNNI, also
    /// beside AVX-512).
    pub fn available() -> Vec<KernelLevel> {
        KernelLevel::ALL
            .into_iter()
            .filter(|l| l.runs_here())
            .collect()
    }
}

/// Most activation rows for which the AVX-512 family multiplies natural K-quant weights on the
/// natural-order kernel (`x86_avx2::knat512`: each weight group unpacked once, every row's exact
/// integers summed for 16 output rows at once, then the float step as each row has it alone)
/// instead of its 512-bit column tiles; both give the AVX2 family's bits
/// (`avx512_column_tiles_bit_identical_to_avx2`). The tiles transpose every weight group into
/// registers first, a fixed cost per group that pays from a few rows on where 512-bit shuffles
/// are cheap (2 on Zen 5), while a core that splits 512-bit shuffles into two 256-bit halves
/// (AMD Zen 4) runs the natural kernel cheaper up to 16 rows (docs/benchmarks.md, 2026-12-03
/// afternoon and evening). `ARBOR_NAT_ROWS=N` (1 to 16) overrides.
pub fn natural_kernel_rows() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        let env = std::env::var("ARBOR_NAT_ROWS")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok());
        match env {
            Some(n) => n.clamp(1, MAX_NATURAL_ROWS),
            None if splits_512_bit_shuffles() => MAX_NATURAL_ROWS,
            None => 2,
        }
    })
}

/// Most rows the natural-order kernel is built for.
pub(crate) const MAX_NATURAL_ROWS: usize = 16;

/// Whether this is an AMD family 19h core with AVX-512 (Zen 4: 512-bit operations run as two
/// 256-bit halves; Zen 3, the other family 19h cores, has no AVX-512).
#[cfg(target_arch = "x86_64")]
fn splits_512_bit_shuffles() -> bool {
    use std::arch::x86_64::__cpuid;
    let (vendor, sig) = (__cpuid(0), __cpuid(1));
    // "AuthenticAMD" in EBX, EDX, ECX.
    let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
    let base = (sig.eax >> 8) & 0xf;
    let family = if base == 0xf {
        base + ((sig.eax >> 20) & 0xff)
    } else {
        base
    };
    amd && family == 0x19 && is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn splits_512_bit_shuffles() -> bool {
    false
}

thread_local! {
    /// A test's choice of [`natural_kernel_rows`] for the calls it makes on this thread.
    static NATURAL_ROWS_HERE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Run `f` with the AVX-512 family's natural-order kernel taking up to `n` rows in the calls
/// made on this thread (the column tiles above), whatever this CPU's default: the kernel
/// identity tests reach both kernels at every row count on every CPU.
#[cfg(test)]
pub(crate) fn with_natural_rows<R>(n: usize, f: impl FnOnce() -> R) -> R {
    let before = NATURAL_ROWS_HERE.with(|c| c.replace(Some(n.clamp(1, MAX_NATURAL_ROWS))));
    let r = f();
    NATURAL_ROWS_HERE.with(|c| c.set(before));
    r
}

/// The highest level the CPU supports, ignoring the environment.
fn hw_level() -> KernelLevel {
    static HW: OnceLock<KernelLevel> = OnceLock::new();
    *HW.get_or_init(detect_hw)
}

/// Whether the CPU has AVX2/FMA/F16C and AVX-VNNI (the `AvxVnni` family's features).
#[cfg(target_arch = "x86_64")]
fn avx_vnni() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("avxvnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx_vnni() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn detect_hw() -> KernelLevel {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni");
    if avx512 && amx::granted() {
        KernelLevel::Amx
    } else if avx512 {
        KernelLevel::Avx512Vnni
    } else if avx2 && avx_vnni() {
        KernelLevel::AvxVnni
    } else if avx2 {
        KernelLevel::Avx2
    } else {
        KernelLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_hw() -> KernelLevel {
    KernelLevel::Scalar
}

/// Where the AMX kernel family may run for the matmuls a thread issues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxScope {
    /// VNNI kernels only.
    Off,
    /// Prompt prefill: AMX tiles for batches of `amx::MIN_TOK`+ rows, the VNNI kernels below
    /// (so a single causal token, as in incremental decoding, stays on VNNI).
    Prefill,
    /// The whole AMX family for every batch size (tiles, and the AMX-order VNNI kernel below
    /// `amx::MIN_TOK` rows): every row bit-identical whatever the batch.
    Family,
}

thread_local! {
    /// The scope the current thread runs in ([`with_amx`], [`with_amx_family`]).
    static AMX_SCOPE: Cell<AmxScope> = const { Cell::new(AmxScope::Off) };
}

/// Runs `f` with the AMX scope `scope` for the quantized matmuls this thread issues.
fn with_amx_scope<R>(scope: AmxScope, f: impl FnOnce() -> R) -> R {
    /// Restores the previous scope, also when `f` unwinds.
    struct Restore(AmxScope);
    impl Drop for Restore {
        fn drop(&mut self) {
            AMX_SCOPE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(AMX_SCOPE.with(|c| c.replace(scope)));
    f()
}

/// Run `f` with AMX tiles allowed for the large quantized matmuls this thread issues (where the
/// CPU and OS grant them; `AmxScope::Prefill`). For batches whose results need not be
/// bit-identical to single-token decoding: prompt prefill (see [`KernelLevel::detect`]).
pub fn with_amx<R>(f: impl FnOnce() -> R) -> R {
    with_amx_scope(AmxScope::Prefill, f)
}

/// Run `f` with the whole AMX family for every quantized matmul this thread issues
/// (`AmxScope::Family`): prefill, decoding and verification all bit-identical to each other.
pub fn with_amx_family<R>(f: impl FnOnce() -> R) -> R {
    with_amx_scope(AmxScope::Family, f)
}

/// The AMX scope a matmul issued here now runs in (`Off` where AMX is not granted or
/// `ARBOR_KERNEL` rules it out, `Family` everywhere with `ARBOR_KERNEL=amx`).
pub fn amx_scope() -> AmxScope {
    if kernel_level() != KernelLevel::Amx {
        AmxScope::Off
    } else if KernelLevel::amx_everywhere() {
        AmxScope::Family
    } else {
        AMX_SCOPE.with(|c| c.get())
    }
}

/// Whether `ARBOR_KERNEL=amx` puts every matmul in the AMX family's scope, whatever the
/// thread's [`with_amx`] scopes and the backend's `AmxUse` say.
pub fn amx_scope_forced() -> bool {
    kernel_level() == KernelLevel::Amx && KernelLevel::amx_everywhere()
}

/// Whether a matmul issued here now could use AMX tiles (for covered types and batch sizes).
pub fn amx_active() -> bool {
    amx_scope() != AmxScope::Off
}

/// The process-wide kernel level, detected once.
static LEVEL: OnceLock<KernelLevel> = OnceLock::new();

/// The kernel level this process's quantized matmuls run (`KernelLevel::detect`, once; the
/// benchmarks name it beside the CPU).
pub fn kernel_level() -> KernelLevel {
    *LEVEL.get_or_init(KernelLevel::detect)
}

/// y[t, o] = sum_k W[o, k] * x[t, k]. `x`: [n_tok, n_in] f32 row-major; `y`: [n_tok, n_out] f32
/// row-major. Runs on the current rayon pool (wrap in `pool.install` to choose one), with the
/// kernel level of `KernelLevel::detect()` (detected once per process; AMX as [`amx_scope`]
/// allows).
pub fn matmul(w: &QMatrix, x: &[f32], n_tok: usize, y: &mut [f32]) -> Result<()> {
    matmul_in(amx_scope(), w, x, n_tok, y)
}

/// `matmul` into a new vector `[n_tok, w.n_out]`. Where the AMX tiles take the batch (they write
/// every output) the vector is not zeroed first: for the output head of a 16-token tree that
/// saves clearing ~10 MB before the kernels overwrite it.
pub fn matmul_new(w: &QMatrix, x: &[f32], n_tok: usize) -> Result<Vec<f32>> {
    let n = n_tok.checked_mul(w.n_out).ok_or_else(|| {
        EngineError::Shape(format!("{n_tok} rows of {} outputs overflow", w.n_out))
    })?;
    let scope = amx_scope();
    #[cfg(target_arch = "x86_64")]
    if amx_in(scope, n_tok) {
        let mut y: Vec<f32> = Vec::with_capacity(n);
        let yp = YPtr {
            ptr: y.as_mut_ptr(),
            n_out: w.n_out,
        };
        check_shapes_len(w, x, n_tok, n)?;
        let ws = std::slice::from_ref(w);
        // SAFETY: `yp` points to the vector's `n` floats of capacity, which nothing else accesses;
        // both paths below write every one of them when they run, so they are initialized.
        if unsafe {
            if packed_tiles_take(ws, n_tok) {
                packed_tiles_many(ws, x, n_tok, &[yp], false);
                true
            } else {
                tiles_take(scope, n_tok) && amx::matmul_many_raw(ws, x, n_tok, &[yp], false)
            }
        } {
            // SAFETY: as above.
            unsafe { y.set_len(n) };
            return Ok(y);
        }
    }
    let mut y = vec![0.0f32; n];
    matmul_in(scope, w, x, n_tok, &mut y)?;
    Ok(y)
}

/// Whether the AMX tiles take a batch of `n_tok` rows in `scope` (for matrices they cover): the
/// choice `matmul_in` makes, for the callers that hand the tiles several matrices at once
/// (`matmul_many_in`) or an uninitialized output (`matmul_new`).
#[cfg(target_arch = "x86_64")]
fn tiles_take(scope: AmxScope, n_tok: usize) -> bool {
    scope != AmxScope::Off && n_tok >= amx_min_rows() && kernel_level() == KernelLevel::Amx
}

/// `matmul` in the AMX scope the caller read (`amx_scope()` on the thread that owns the scope):
/// for matmuls issued from rayon jobs, which may run on threads outside the scope.
pub fn matmul_in(
    scope: AmxScope,
    w: &QMatrix,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<()> {
    matmul_with(scope_level(scope, n_tok), w, x, n_tok, y)
}

/// The kernel level a batch of `n_tok` rows runs at in `scope`.
fn scope_level(scope: AmxScope, n_tok: usize) -> KernelLevel {
    if amx_in(scope, n_tok) {
        KernelLevel::Amx
    } else {
        kernel_level().min_with(KernelLevel::Avx512Vnni)
    }
}

/// Whether a batch of `n_tok` rows runs the AMX family in `scope` (the VNNI kernels otherwise).
fn amx_in(scope: AmxScope, n_tok: usize) -> bool {
    let amx = match scope {
        AmxScope::Off => false,
        AmxScope::Prefill => n_tok >= amx_min_rows(),
        AmxScope::Family => true,
    };
    amx && kernel_level() == KernelLevel::Amx
}

/// `ys[i]` as raw outputs for the row tasks (`ys[i]` must hold `n_tok * ws[i].n_out` floats).
fn out_ptrs(ws: &[QMatrix], ys: &mut [&mut [f32]]) -> Vec<YPtr> {
    ys.iter_mut()
        .zip(ws)
        .map(|(y, w)| YPtr {
            ptr: y.as_mut_ptr(),
            n_out: w.n_out,
        })
        .collect()
}

/// Fewest rows for which the AMX tiles run (the AMX-order VNNI kernel below).
fn amx_min_rows() -> usize {
    #[cfg(target_arch = "x86_64")]
    return amx::MIN_TOK;
    #[cfg(not(target_arch = "x86_64"))]
    usize::MAX
}

/// `matmul` with an explicit kernel level. A level above what the CPU supports is lowered to the
/// best supported one (never executes unsupported instructions).
pub fn matmul_with(
    level: KernelLevel,
    w: &QMatrix,
    x: &[f32],
    n_tok: usize,
    y: &mut [f32],
) -> Result<()> {
    check_shapes(w, x, n_tok, y)?;
    if n_tok == 0 || w.n_out == 0 {
        return Ok(());
    }
    if w.n_in == 0 {
        y.fill(0.0);
        return Ok(());
    }
    match route(level, w, n_tok) {
        Route::Natural(level) => {
            // Only the AVX-512, AMX and AVX2 families read packed rows (the AVX2 family K-quants
            // only): the others run on natural ones (a copy; tests and explicit levels, never a
            // forward pass of a process that packed).
            let nat = w.natural_bytes();
            let natural = QMatrix {
                data: &nat,
                packed: false,
                ..*w
            };
            matmul_with(level, &natural, x, n_tok, y)
        }
        // The AMX family on natural rows: tiles for large batches, the AMX-order VNNI kernel for
        // small ones, so every row is computed bit for bit alike whatever the batch size.
        #[cfg(target_arch = "x86_64")]
        Route::AmxNatural => {
            if n_tok >= amx::MIN_TOK && amx::matmul(w, x, n_tok, y) {
                return Ok(());
            }
            amx_order_matmul(w, x, n_tok, y);
            Ok(())
        }
        // The AMX family on packed Q4_K/Q6_K rows: tiles reading the packed groups for large
        // batches (small ones take the packed AVX-512 VNNI kernels below: the same integers and
        // float steps).
        #[cfg(target_arch = "x86_64")]
        Route::AmxPacked => {
            let yp = YPtr {
                ptr: y.as_mut_ptr(),
                n_out: w.n_out,
            };
            // SAFETY: the tiles take `w`; `yp` comes from the unique borrow of `y`, `n_tok *
            // n_out` floats (checked).
            unsafe { packed_tiles_many(std::slice::from_ref(w), x, n_tok, &[yp], false) };
            Ok(())
        }
        Route::Float(level) => {
            run_rows(w, n_tok, y, &|r0, r1, yp| {
                float_rows(level, w, x, n_tok, r0, r1, yp)
            });
            Ok(())
        }
        Route::Records(level) => {
            with_records(level, w, x, n_tok, |act, stride, nat_rows| {
                run_rows(w, n_tok, y, &|r0, r1, yp| {
                    quant_rows(level, w, act, stride, n_tok, r0..r1, nat_rows, yp)
                });
            });
            Ok(())
        }
    }
}

/// Where `matmul_with(level, w, ..)` runs a batch of `n_tok` rows (at least one; `w` non-empty).
enum Route {
    /// A natural copy of packed rows the level does not read, at that level.
    Natural(KernelLevel),
    /// The AMX family's natural-order kernels.
    #[cfg(target_arch = "x86_64")]
    AmxNatural,
    /// The AMX tiles on packed Q4_K/Q6_K groups.
    #[cfg(target_arch = "x86_64")]
    AmxPacked,
    /// Float weights, at this level.
    Float(KernelLevel),
    /// Activation records quantized from the input, then the VNNI-style kernels of this level.
    Records(KernelLevel),
}

fn route(level: KernelLevel, w: &QMatrix, n_tok: usize) -> Route {
    let level = level.on_this_cpu();
    if w.packed && !packed::reads_packed(level, w.ty) {
        return Route::Natural(level);
    }
    #[cfg(target_arch = "x86_64")]
    if level == KernelLevel::Amx && !w.packed && amx::granted() && amx::supports(w.ty, w.n_in) {
        return Route::AmxNatural;
    }
    #[cfg(target_arch = "x86_64")]
    if level == KernelLevel::Amx && packed_tiles_take(std::slice::from_ref(w), n_tok) {
        return Route::AmxPacked;
    }
    // Everything else runs the VNNI kernels.
    let level = level.min_with(KernelLevel::Avx512Vnni);
    if w.ty.is_float() {
        Route::Float(level)
    } else {
        Route::Records(level)
    }
}

/// Bytes of one row's activation records for an input of `n_in` values.
fn record_stride(n_in: usize) -> usize {
    n_in.div_ceil(act::GROUP) * act::REC
}

/// Several matrices over the same input on the quantized VNNI path (`Route::Records`), their
/// activation records quantized once for all of them and every matrix's rows run in one
/// parallel region ([`run_matrix_tasks`]; `swiglu`: `ys` are `[gate, up]`, gated in the tasks).
/// The records are the ones each matrix alone would quantize (the same level and record format),
/// and each row is computed by the same kernel, so the bits are those of separate calls. Returns
/// `false`, having done nothing, where the matrices do not all take that path alike.
fn matmul_many_records(
    level: KernelLevel,
    ws: &[QMatrix],
    x: &[f32],
    n_tok: usize,
    ys: &mut [&mut [f32]],
    swiglu: bool,
) -> bool {
    let Some(first) = ws.first() else {
        return false;
    };
    if ws.len() < 2 || n_tok == 0 || first.n_in == 0 {
        return false;
    }
    // Each matrix routed at the caller's level, as its own `matmul_with` would be (the AMX
    // family's tiles may take one of them and not another).
    let Route::Records(records) = route(level, first, n_tok) else {
        return false;
    };
    let format = act::record_format(records, first.ty);
    let alike = ws.iter().all(|w| {
        w.n_in == first.n_in
            && w.n_out > 0
            && w.packed == first.packed
            && matches!(route(level, w, n_tok), Route::Records(l) if l == records)
            && act::record_format(records, w.ty) == format
    });
    if !alike || (swiglu && (ws.len() != 2 || ws[1].n_out != first.n_out)) {
        return false;
    }
    with_records(records, first, x, n_tok, |act_ro, stride, nat_rows| {
        let yps = out_ptrs(ws, ys);
        // Multiples of 4 rows keep the kernels' row tiles whole (of 16, packed slices).
        let tile = if first.packed { packed::PACK_ROWS } else { 4 };
        // SAFETY: each `YPtr` comes from the unique borrow of its output (`n_tok * n_out` floats,
        // checked by the caller); the tasks write disjoint row ranges, every row of each.
        unsafe {
            run_matrix_tasks(ws, n_tok, &yps, swiglu, tile, &|m, r0, r1| {
                quant_rows(
                    records,
                    &ws[m],
                    act_ro,
                    stride,
                    n_tok,
                    r0..r1,
                    nat_rows,
                    yps[m],
                )
            })
        };
    });
    true
}

/// Quantizes `x` (`n_tok` rows of `w.n_in` values) into `level`'s activation records for `w`'s
/// type, in scratch memory, and runs `f(records, stride, nat_rows)` over them (`nat_rows`: the
/// AVX-512 family's [`natural_kernel_rows`], decided on the calling thread, where a test's
/// choice is visible, not in the workers).
fn with_records(
    level: KernelLevel,
    w: &QMatrix,
    x: &[f32],
    n_tok: usize,
    f: impl FnOnce(&[u8], usize, usize),
) {
    let stride = record_stride(w.n_in);
    let mut buf = take_scratch(n_tok * stride);
    {
        let act_bytes: &mut [u8] = bytes_of_lines(&mut buf, n_tok * stride);
        quantize_rows(level, w.ty, x, w.n_in, stride, act_bytes);
        let nat_rows = NATURAL_ROWS_HERE
            .with(Cell::get)
            .unwrap_or_else(natural_kernel_rows);
        f(act_bytes, stride, nat_rows);
    }
    put_scratch(buf);
}

/// Quantizes the rows of `x` (`n_in` each) into the activation records `out` (`stride` bytes per
/// row) as `level`'s kernels read them, in parallel where there is enough work.
fn quantize_rows(
    level: KernelLevel,
    ty: GgmlType,
    x: &[f32],
    n_in: usize,
    stride: usize,
    out: &mut [u8],
) {
    let n_tok = out.len() / stride;
    if n_tok > 1 && n_tok * n_in >= 8192 && rayon::current_num_threads() > 1 {
        out.par_chunks_mut(stride)
            .zip(x.par_chunks(n_in))
            .for_each(|(o, xr)| act::quantize_row(level, ty, xr, o));
    } else {
        for (o, xr) in out.chunks_mut(stride).zip(x.chunks(n_in)) {
            act::quantize_row(level, ty, xr, o);
        }
    }
}

/// Whether the AMX family's tiles on packed rows take `ws` against `n_tok` activation rows: this
/// process runs the AMX family and every matrix is packed, covered
/// (`amx_packed::takes`: Q4_K/Q6_K, `n_tok` at least its `min_rows`) and of one `n_in`.
#[cfg(target_arch = "x86_64")]
fn packed_tiles_take(ws: &[QMatrix], n_tok: usize) -> bool {
    let Some(n_in) = ws.first().map(|w| w.n_in) else {
        return false;
    };
    kernel_level() == KernelLevel::Amx
        && amx::granted()
        && ws
            .iter()
            .all(|w| w.packed && w.n_in == n_in && amx_packed::takes(w.ty, n_in, n_tok))
}

/// The AMX family's tiles on packed Q4_K/Q6_K matrices that share their activations (`ys[i] =
/// ws[i] x`; SwiGLU: `ws` is `[gate, up]`, gated as in [`run_matrix_tasks`]): the activations
/// quantized once as the AVX-512 VNNI family quantizes them and laid out as A tiles once, then
/// every matrix's slices in one parallel region (`x86_avx2::kcols512::amx_packed`).
///
/// # Safety
/// [`packed_tiles_take`] must hold (and SwiGLU's two matrices have one `n_out`); the shapes must
/// have been checked as in `matmul_with`; `yps[i]` must point to `n_tok * ws[i].n_out` writable
/// floats that nothing else accesses during the call. Writes every element of every output.
#[cfg(target_arch = "x86_64")]
unsafe fn packed_tiles_many(ws: &[QMatrix], x: &[f32], n_tok: usize, yps: &[YPtr], swiglu: bool) {
    debug_assert!(packed_tiles_take(ws, n_tok) && ws.len() == yps.len());
    debug_assert!(!swiglu || (ws.len() == 2 && ws[0].n_out == ws[1].n_out));
    let n_in = ws[0].n_in;
    // Every covered type reads the same records (Q8_K, `act::act_kind`).
    debug_assert!(ws
        .iter()
        .all(|w| act::act_kind(w.ty) == act::act_kind(ws[0].ty)));
    let stride = n_in / act::GROUP * act::REC;
    let rec_bytes = (n_tok * stride).next_multiple_of(64);
    let tile_bytes = amx_packed::tile_bytes(n_in, n_tok);
    let mut buf = take_scratch(rec_bytes + tile_bytes);
    {
        let (recs, tiles) =
            bytes_of_lines(&mut buf, rec_bytes + tile_bytes).split_at_mut(rec_bytes);
        let recs = &mut recs[..n_tok * stride];
        quantize_rows(KernelLevel::Avx512Vnni, ws[0].ty, x, n_in, stride, recs);
        let recs: &[u8] = recs;
        amx_packed::tile_activations(recs, stride, n_tok, tiles);
        let tiles: &[u8] = tiles;
        run_matrix_tasks(ws, n_tok, yps, swiglu, packed::PACK_ROWS, &|m, r0, r1| {
            // SAFETY: `amx::granted()` (AMX-INT8, the tile grant, AVX-512 VNNI); the matrices are
            // validated, packed and covered; `recs` holds `n_tok` records and `tiles` their
            // tiles; tasks own disjoint ranges of whole 16-row slices of their matrix.
            unsafe { amx_packed::rows(&ws[m], recs, tiles, stride, n_tok, r0, r1, yps[m]) }
        });
    }
    put_scratch(buf);
}

/// Runs `rows(m, r0, r1)` over the output rows of every matrix in `ws` in one parallel region:
/// ranges of whole `tile`-row tiles, a few per thread over all the matrices together. SwiGLU
/// (`ws` is `[gate, up]`, the same `n_out`): each task runs the same rows of both matrices,
/// then gates them while they are in its cache, `y_gate = silu(y_gate) · y_up`
/// (`simd::silu_mul`).
///
/// # Safety
/// `yps[i]` must point to `n_tok * ws[i].n_out` floats that `rows(i, ..)` writes and nothing
/// else accesses during the call; `rows` must write every element of its range.
pub(crate) unsafe fn run_matrix_tasks(
    ws: &[QMatrix],
    n_tok: usize,
    yps: &[YPtr],
    swiglu: bool,
    tile: usize,
    rows: &(dyn Fn(usize, usize, usize) + Sync),
) {
    let threads = rayon::current_num_threads().max(1);
    let split = if swiglu { &ws[..1] } else { ws };
    let total: usize = split.iter().map(|w| w.n_out).sum();
    let per = total.div_ceil(threads * 4).next_multiple_of(tile).max(tile);
    let tasks: Vec<(usize, usize, usize)> = split
        .iter()
        .enumerate()
        .flat_map(|(m, w)| {
            (0..w.n_out)
                .step_by(per)
                .map(move |r0| (m, r0, (r0 + per).min(w.n_out)))
        })
        .collect();
    let run = |&(m, r0, r1): &(usize, usize, usize)| {
        rows(m, r0, r1);
        if swiglu {
            rows(1, r0, r1);
            for t in 0..n_tok {
                // SAFETY: rows `[r0, r1)` of both outputs belong to this task alone.
                let (g, u) = unsafe { (yps[0].row_mut(t, r0, r1), yps[1].row_mut(t, r0, r1)) };
                crate::backend::simd::silu_mul(g, u);
            }
        }
    };
    if threads == 1 || tasks.len() == 1 {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
}

/// The shape and type checks of `matmul_with`: a supported type, whole blocks, and data, input
/// and output lengths that match `n_out`, `n_in` and `n_tok`.
fn check_shapes(w: &QMatrix, x: &[f32], n_tok: usize, y: &[f32]) -> Result<()> {
    check_shapes_len(w, x, n_tok, y.len())
}

/// `check_shapes` for an output of `y_len` floats.
fn check_shapes_len(w: &QMatrix, x: &[f32], n_tok: usize, y_len: usize) -> Result<()> {
    if !w.ty.supported() {
        return Err(unsupported(w.ty));
    }
    let rb = w.ty.row_bytes(w.n_in).ok_or_else(|| {
        EngineError::Shape(format!(
            "{} row of {} elements is not a whole number of blocks",
            w.ty, w.n_in
        ))
    })?;
    if w.packed && !packed::packable(w.ty, w.n_out, w.n_in) {
        return Err(EngineError::Shape(format!(
            "{} matrix {}x{} is marked packed but cannot be packed",
            w.ty, w.n_out, w.n_in
        )));
    }
    if rb.checked_mul(w.n_out) != Some(w.data.len()) {
        return Err(EngineError::Shape(format!(
            "{} matrix {}x{}: data is {} bytes",
            w.ty,
            w.n_out,
            w.n_in,
            w.data.len()
        )));
    }
    if n_tok.checked_mul(w.n_in) != Some(x.len()) {
        return Err(EngineError::Shape(format!(
            "matmul input has {} values, expected n_tok {} x n_in {}",
            x.len(),
            n_tok,
            w.n_in
        )));
    }
    if n_tok.checked_mul(w.n_out) != Some(y_len) {
        return Err(EngineError::Shape(format!(
            "matmul output has {} values, expected n_tok {} x n_out {}",
            y_len, n_tok, w.n_out
        )));
    }
    Ok(())
}

/// Several matmuls of the same activations (`ys[i] = ws[i] x`, e.g. Q, K and V), in the AMX
/// scope the caller read (see [`matmul_in`]). Where the AMX tiles take all of them (every matrix
/// covered, `amx::MIN_TOK`+ rows), the activations are packed once per weight type and every
/// row tile runs in one parallel region, each row computed exactly as [`matmul_in`] computes it;
/// otherwise they run in turn.
pub fn matmul_many_in(
    scope: AmxScope,
    ws: &[QMatrix],
    x: &[f32],
    n_tok: usize,
    ys: &mut [&mut [f32]],
) -> Result<()> {
    if ws.len() != ys.len() {
        return Err(EngineError::Shape(format!(
            "{} matrices for {} outputs",
            ws.len(),
            ys.len()
        )));
    }
    for (w, y) in ws.iter().zip(ys.iter()) {
        check_shapes(w, x, n_tok, y)?;
    }
    #[cfg(target_arch = "x86_64")]
    if amx_in(scope, n_tok) && !ws.is_empty() {
        if packed_tiles_take(ws, n_tok) {
            let yps = out_ptrs(ws, ys);
            // SAFETY: the tiles take `ws`; shapes checked; each `YPtr` comes from the unique
            // borrow of its output.
            unsafe { packed_tiles_many(ws, x, n_tok, &yps, false) };
            return Ok(());
        }
        if tiles_take(scope, n_tok) && amx::matmul_many(ws, x, n_tok, ys) {
            return Ok(());
        }
    }
    if matmul_many_records(scope_level(scope, n_tok), ws, x, n_tok, ys, false) {
        return Ok(());
    }
    for (w, y) in ws.iter().zip(ys.iter_mut()) {
        matmul_in(scope, w, x, n_tok, y)?;
    }
    Ok(())
}

/// SwiGLU's two projections and gate: `gate = silu(W_gate x) · (W_up x)` ([`simd::silu_mul`]),
/// `up = W_up x`, in `scope`. Where the AMX tiles take the batch, each row task computes its rows
/// of both matrices and gates them while they are in its cache (one parallel region, no serial
/// pass over `[n_tok, n_ff]`); otherwise `matmul_many_in`, then the gate. The same bits either
/// way (the gate is elementwise).
///
/// [`simd::silu_mul`]: crate::backend::simd::silu_mul
pub fn matmul_swiglu_in(
    scope: AmxScope,
    w_gate: &QMatrix,
    w_up: &QMatrix,
    x: &[f32],
    n_tok: usize,
    gate: &mut [f32],
    up: &mut [f32],
) -> Result<()> {
    let ws = [*w_gate, *w_up];
    check_shapes(w_gate, x, n_tok, gate)?;
    check_shapes(w_up, x, n_tok, up)?;
    #[cfg(target_arch = "x86_64")]
    if amx_in(scope, n_tok) {
        if w_gate.n_out == w_up.n_out && packed_tiles_take(&ws, n_tok) {
            let yps = out_ptrs(&ws, &mut [&mut *gate, &mut *up]);
            // SAFETY: the tiles take both matrices, of one `n_out`; shapes checked; each `YPtr`
            // comes from the unique borrow of its output.
            unsafe { packed_tiles_many(&ws, x, n_tok, &yps, true) };
            return Ok(());
        }
        if tiles_take(scope, n_tok) && amx::matmul_swiglu(w_gate, w_up, x, n_tok, gate, up) {
            return Ok(());
        }
    }
    let level = scope_level(scope, n_tok);
    if matmul_many_records(level, &ws, x, n_tok, &mut [&mut *gate, &mut *up], true) {
        return Ok(());
    }
    matmul_many_in(scope, &ws, x, n_tok, &mut [&mut *gate, &mut *up])?;
    crate::backend::simd::silu_mul(gate, up);
    Ok(())
}

/// Fewer than `amx::MIN_TOK` rows of a type the AMX kernels cover, with their arithmetic
/// (`x86_avx512::amx_order_rows`): bit-identical to the same rows inside an AMX batch.
#[cfg(target_arch = "x86_64")]
fn amx_order_matmul(w: &QMatrix, x: &[f32], n_tok: usize, y: &mut [f32]) {
    let n_groups = w.n_in / act::GROUP;
    let stride = n_groups * x86_avx512::AREC;
    let mut buf = take_scratch(n_tok * stride);
    {
        let act_bytes: &mut [u8] = bytes_of_lines(&mut buf, n_tok * stride);
        let (n_in, ty) = (w.n_in, w.ty);
        let kind = act::act_kind(ty);
        let mut nat = [0u8; act::REC];
        for (out, xr) in act_bytes.chunks_mut(stride).zip(x.chunks(n_in)) {
            for (g, rec) in out.chunks_exact_mut(x86_avx512::AREC).enumerate() {
                // SAFETY: the caller saw `amx::granted()`, which implies AVX-512 VNNI, AVX2, FMA, F16C.
                unsafe {
                    x86_avx2::quantize_group(
                        kind,
                        &xr[g * act::GROUP..(g + 1) * act::GROUP],
                        &mut nat,
                    );
                    x86_avx512::amx_order_record(ty, &nat, rec);
                }
            }
        }
        let act_ro: &[u8] = act_bytes;
        let n_out = w.n_out;
        let yp = YPtr {
            ptr: y.as_mut_ptr(),
            n_out,
        };
        run_tiles(n_out, 16, &|r0, r1| {
            // SAFETY: as above; the records were built for `w.ty`, `r1 <= n_out`, `w` validated,
            // tasks own disjoint row ranges of `y`.
            unsafe { x86_avx512::amx_order_rows(w, act_ro, stride, n_tok, r0, r1, yp) }
        });
    }
    put_scratch(buf);
}

/// Runs `task(r0, r1)` over `[0, n_out)` in ranges of whole `tile`-row tiles (the last may be
/// partial), a few per thread of the current rayon pool, or inline on one thread.
pub(crate) fn run_tiles(n_out: usize, tile: usize, task: &(dyn Fn(usize, usize) + Sync)) {
    let threads = rayon::current_num_threads().max(1);
    let per = n_out.div_ceil(threads * 4).next_multiple_of(tile).max(tile);
    let n_tasks = n_out.div_ceil(per);
    if threads == 1 || n_tasks == 1 {
        task(0, n_out);
    } else {
        (0..n_tasks).into_par_iter().for_each(|i| {
            let r0 = i * per;
            task(r0, (r0 + per).min(n_out));
        });
    }
}

/// Raw output pointer shared by the row tasks of one matmul.
#[derive(Clone, Copy)]
pub(crate) struct YPtr {
    ptr: *mut f32,
    n_out: usize,
}

// SAFETY: a `YPtr` is only handed to the row tasks of one `matmul_with` call while it holds the
// unique `&mut` borrow of `y`; each task writes only the columns `o` of its own disjoint row range
// `[r0, r1)` (element `t * n_out + o`), so no two threads ever touch the same element.
unsafe impl Send for YPtr {}
unsafe impl Sync for YPtr {}

impl YPtr {
    /// Writes y[t, o].
    ///
    /// # Safety
    /// `t < n_tok`, `o < n_out`, and `o` must lie in the calling task's own row range.
    #[inline(always)]
    pub(crate) unsafe fn write(self, t: usize, o: usize, v: f32) {
        *self.ptr.add(t * self.n_out + o) = v;
    }

    /// y[t, r0..r1] as a slice.
    ///
    /// # Safety
    /// `t < n_tok`, `r0 <= r1 <= n_out`, and the columns must lie in the calling task's own row
    /// range (no other reference to them may live while the slice does).
    #[inline]
    pub(crate) unsafe fn row_mut<'a>(self, t: usize, r0: usize, r1: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.ptr.add(t * self.n_out + r0), r1 - r0)
    }

    /// Writes y[t, o..o + 16] from the 16 lanes of `v`.
    ///
    /// # Safety
    /// As `write` for each of the 16 columns; AVX-512F must be present.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn write16(self, t: usize, o: usize, v: std::arch::x86_64::__m512) {
        std::arch::x86_64::_mm512_storeu_ps(self.ptr.add(t * self.n_out + o), v);
    }
}

/// Splits the output rows into tasks on the current rayon pool (or runs inline for small work).
fn run_rows(w: &QMatrix, n_tok: usize, y: &mut [f32], f: &(dyn Fn(usize, usize, YPtr) + Sync)) {
    let n_out = w.n_out;
    let yp = YPtr {
        ptr: y.as_mut_ptr(),
        n_out,
    };
    let threads = rayon::current_num_threads().max(1);
    let work = n_out
        .saturating_mul(w.n_in)
        .saturating_mul(n_tok.div_ceil(4));
    if threads == 1 || work < (1 << 17) || n_out < 8 {
        f(0, n_out, yp);
        return;
    }
    // Multiples of 4 rows keep the kernels' row tiles whole (of 16, packed slices).
    let tile = if w.packed { packed::PACK_ROWS } else { 4 };
    run_tiles(n_out, tile, &|r0, r1| f(r0, r1, yp));
}

/// Rows `rows` of `w` against `n_tok` activation records; `nat_rows`: the AVX-512 family's
/// [`natural_kernel_rows`].
#[allow(clippy::too_many_arguments)]
fn quant_rows(
    level: KernelLevel,
    w: &QMatrix,
    act: &[u8],
    stride: usize,
    n_tok: usize,
    rows: std::ops::Range<usize>,
    nat_rows: usize,
    y: YPtr,
) {
    let (r0, r1) = (rows.start, rows.end);
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            // SAFETY: `matmul_with` clamped the level to what this CPU runs (`on_this_cpu`).
            KernelLevel::Avx512Vnni | KernelLevel::Amx => {
                return unsafe {
                    x86_avx512::quant_rows(w, act, stride, n_tok, r0, r1, nat_rows, y)
                }
            }
            KernelLevel::Avx2 => {
                return unsafe { x86_avx2::quant_rows(w, act, stride, n_tok, r0, r1, y) }
            }
            KernelLevel::AvxVnni => {
                return unsafe { x86_avx2::kvnni::quant_rows(w, act, stride, n_tok, r0, r1, y) }
            }
            KernelLevel::Scalar => {}
        }
    }
    let _ = (level, nat_rows);
    scalar::quant_rows(w, act, stride, n_tok, r0, r1, y)
}

fn float_rows(
    level: KernelLevel,
    w: &QMatrix,
    x: &[f32],
    n_tok: usize,
    r0: usize,
    r1: usize,
    y: YPtr,
) {
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            // SAFETY: `matmul_with` clamped the level to what this CPU runs (`on_this_cpu`).
            KernelLevel::Avx512Vnni | KernelLevel::Amx => {
                return unsafe { x86_avx512::float_rows(w, x, n_tok, r0, r1, y) }
            }
            KernelLevel::Avx2 | KernelLevel::AvxVnni => {
                return unsafe { x86_avx2::float_rows(w, x, n_tok, r0, r1, y) }
            }
            KernelLevel::Scalar => {}
        }
    }
    let _ = level;
    scalar::float_rows(w, x, n_tok, r0, r1, y)
}

/// 64-byte aligned storage unit of the activation scratch.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

thread_local! {
    /// Reused activation scratch of the calling thread. Taken out while in use, so a nested call on
    /// the same thread (rayon work stealing) simply allocates its own.
    static SCRATCH: Cell<Vec<Line>> = const { Cell::new(Vec::new()) };
}

fn take_scratch(bytes: usize) -> Vec<Line> {
    let mut v = SCRATCH.with(|c| c.take());
    let lines = bytes.div_ceil(64);
    if v.len() < lines {
        v.resize(lines, Line([0; 64]));
    }
    v
}

fn put_scratch(v: Vec<Line>) {
    SCRATCH.with(|c| c.set(v));
}

fn bytes_of_lines(v: &mut [Line], bytes: usize) -> &mut [u8] {
    let avail = v.len() * 64;
    let n = bytes.min(avail);
    // SAFETY: `Line` is a plain 64-byte array with no padding; the slice covers `n <= len * 64`
    // initialized bytes of the vector's buffer and borrows it mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, n) }
}
