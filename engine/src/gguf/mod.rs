//! GGUF v2/v3 reader (ggml's model file format): loaded onto huge pages (or memory-mapped), bounds-checked metadata and tensor infos.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};
use crate::quant::GgmlType;

const GGUF_MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Arrays nested deeper than this are rejected (the format allows nesting; real files use depth 1).
const MAX_ARRAY_DEPTH: usize = 4;
const MAX_DIMS: usize = 4;
/// Most metadata values (array elements included) a file may hold: a vocabulary of 150 k
/// tokens with its merges and types is under 0.5 M. Each value takes 32 bytes parsed against as
/// little as one in the file, so a count bound by the file's size alone could ask for 32 times
/// the file in memory.
const MAX_META_VALUES: usize = 1 << 24;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v as i64),
            MetaValue::U16(v) => Some(v as i64),
            MetaValue::U32(v) => Some(v as i64),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(v) => Some(v),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    pub fn n_elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Storage {
    /// The file, read into anonymous memory (huge pages where granted), and its length.
    Anon(memmap2::Mmap, usize),
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Anon(m, len) => &m[..*len],
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file; tensor data stays in the loaded image.
pub struct GgufFile {
    storage: Storage,
    pub version: u32,
    metadata: HashMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    pub path: Option<PathBuf>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Load and parse a GGUF file: the file is read once into anonymous memory backed by huge
    /// pages where the OS grants them (Linux transparent huge pages, `MADV_HUGEPAGE`).
    ///
    /// Every forward pass streams all the weights; with 4 KiB pages of a file mapping that is a
    /// TLB miss every 4 KiB (~250k per pass on a 1 GB model) and a hardware prefetcher that stops
    /// at every page boundary. On 2 MiB pages a qwen2.5-coder-1.5b forward pass over 1 and over
    /// 16 tokens runs ~18% faster (docs/benchmarks.md). Resident memory is the same as a fully
    /// touched mapping (the file's size), and a copy cannot change under us if the file does.
    /// Falls back to a read-only file mapping where anonymous memory cannot be mapped.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
        let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
        let len = usize::try_from(len).map_err(|_| {
            EngineError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidData, "file too large"),
            )
        })?;
        let storage = match memmap2::MmapMut::map_anon(len.max(1)) {
            Ok(mut m) => {
                use std::io::Read;
                #[cfg(target_os = "linux")]
                {
                    // A hint: without it (or without THP) the copy still works on 4 KiB pages.
                    let _ = m.advise(memmap2::Advice::HugePage);
                }
                (&file)
                    .read_exact(&mut m[..len])
                    .map_err(|e| EngineError::io(path, e))?;
                let m = m.make_read_only().map_err(|e| EngineError::io(path, e))?;
                Storage::Anon(m, len)
            }
            Err(_) => return Self::open_mapped(path),
        };
        let mut g = Self::parse(storage)?;
        g.path = Some(path.to_path_buf());
        Ok(g)
    }

    /// Memory-map and parse a GGUF file (4 KiB pages of the page cache, shared with other
    /// processes mapping the same file; see [`GgufFile::open`] for the faster default).
    pub fn open_mapped(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
        // SAFETY: the mapping is read-only; model files are not modified while we run
        // (the fetcher writes to a temporary name and renames atomically).
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let mut g = Self::parse(Storage::Mmap(mmap))?;
        g.path = Some(path.to_path_buf());
        Ok(g)
    }

    /// Parse a GGUF image held in memory (tests, fuzzing).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<GgufFile> {
        let (version, metadata, tensors) = {
            let mut r = Reader {
                buf: storage.bytes(),
                pos: 0,
                values: 0,
            };
            let magic = r.take(4)?;
            if magic != GGUF_MAGIC {
                return Err(EngineError::Gguf("bad magic (not a GGUF file)".into()));
            }
            let version = r.u32()?;
            if !(2..=3).contains(&version) {
                return Err(EngineError::Gguf(format!(
                    "unsupported GGUF version {version} (supported: 2, 3)"
                )));
            }
            let n_tensors = r.u64()?;
            let n_kv = r.u64()?;
            // Each KV needs at least 8 (key len) + 4 (type) bytes; each tensor info at least 8+4+4+8.
            if n_kv > (r.remaining() / 12) as u64 || n_tensors > (r.remaining() / 24) as u64 {
                return Err(EngineError::Gguf(format!(
                    "implausible counts: {n_tensors} tensors, {n_kv} metadata entries"
                )));
            }
            let mut metadata = HashMap::with_capacity(n_kv as usize);
            for _ in 0..n_kv {
                let key = r.string()?;
                let ty = r.u32()?;
                let value = r.value(ty, 0)?;
                metadata.insert(key, value);
            }
            let alignment = match metadata.get("general.alignment") {
                None => DEFAULT_ALIGNMENT,
                Some(v) => match v.as_u64() {
                    Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                    _ => return Err(EngineError::Gguf("general.alignment is invalid".into())),
                },
            };
            let mut raw = Vec::with_capacity(n_tensors as usize);
            for _ in 0..n_tensors {
                let name = r.string()?;
                let n_dims = r.u32()? as usize;
                if n_dims == 0 || n_dims > MAX_DIMS {
                    return Err(EngineError::Gguf(format!(
                        "tensor '{name}' has {n_dims} dimensions"
                    )));
                }
                let mut dims = Vec::with_capacity(n_dims);
                for _ in 0..n_dims {
                    dims.push(r.u64()?);
                }
                let ty_id = r.u32()?;
                let offset = r.u64()?;
                raw.push((name, dims, ty_id, offset));
            }
            let data_start = align_up(r.pos as u64, alignment)
                .ok_or_else(|| EngineError::Gguf("data offset overflows".into()))?;
            let file_len = r.buf.len() as u64;
            let mut tensors = Vec::with_capacity(raw.len());
            for (name, dims, ty_id, offset) in raw {
                let ty = GgmlType::from_u32(ty_id).ok_or_else(|| {
                    EngineError::UnsupportedTensorType(format!("id {ty_id} (tensor '{name}')"))
                })?;
                let n_elems = dims
                    .iter()
                    .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                    .ok_or_else(|| EngineError::Gguf(format!("tensor '{name}' size overflows")))?;
                let row = dims[0] as usize;
                if n_elems == 0 || row as u64 != dims[0] {
                    return Err(EngineError::Gguf(format!("tensor '{name}' is empty")));
                }
                let row_bytes = ty.row_bytes(row).ok_or_else(|| {
                    EngineError::Gguf(format!(
                        "tensor '{name}': row of {row} is not a multiple of the {} block",
                        ty.name()
                    ))
                })? as u64;
                let n_bytes = (n_elems / dims[0])
                    .checked_mul(row_bytes)
                    .ok_or_else(|| EngineError::Gguf(format!("tensor '{name}' size overflows")))?;
                if offset % alignment != 0 {
                    return Err(EngineError::Gguf(format!(
                        "tensor '{name}' offset {offset} is not aligned to {alignment}"
                    )));
                }
                let start = data_start
                    .checked_add(offset)
                    .ok_or_else(|| EngineError::Gguf("tensor offset overflows".into()))?;
                let end = start
                    .checked_add(n_bytes)
                    .ok_or_else(|| EngineError::Gguf("tensor offset overflows".into()))?;
                if end > file_len {
                    return Err(EngineError::Gguf(format!(
                        "tensor '{name}' extends past the end of the file ({end} > {file_len}); the file is truncated"
                    )));
                }
                tensors.push(TensorInfo {
                    name,
                    dims,
                    ty,
                    offset: start as usize,
                    n_bytes: n_bytes as usize,
                });
            }
            reject_overlaps(&tensors)?;
            (version, metadata, tensors)
        };
        let mut by_name = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(EngineError::Gguf(format!("duplicate tensor '{}'", t.name)));
            }
        }
        Ok(GgufFile {
            storage,
            version,
            metadata,
            tensors,
            by_name,
            path: None,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(MetaValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(MetaValue::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(MetaValue::as_f64)
    }

    pub fn metadata(&self) -> &HashMap<String, MetaValue> {
        &self.metadata
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (bounds were checked when parsing).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.storage.bytes()[info.offset..info.offset + info.n_bytes]
    }

    /// Rewrites tensors in place: `f` gets each of `infos`' bytes in turn (the weight packing of
    /// `quant::packed`). Returns false, changing nothing, where the image is a read-only file
    /// mapping ([`GgufFile::open_mapped`]).
    pub(crate) fn rewrite_tensors(
        &mut self,
        infos: &[TensorInfo],
        f: impl Fn(&TensorInfo, &mut [u8]),
    ) -> Result<bool> {
        let rewrite = |bytes: &mut [u8]| {
            for t in infos {
                f(t, &mut bytes[t.offset..t.offset + t.n_bytes]);
            }
        };
        match std::mem::replace(&mut self.storage, Storage::Owned(Vec::new())) {
            Storage::Owned(mut v) => {
                rewrite(&mut v);
                self.storage = Storage::Owned(v);
            }
            Storage::Anon(m, len) => {
                let io = |e| EngineError::Io {
                    path: self.path.clone().unwrap_or_default(),
                    source: e,
                };
                let mut m = m.make_mut().map_err(io)?;
                rewrite(&mut m[..len]);
                self.storage = Storage::Anon(m.make_read_only().map_err(io)?, len);
            }
            mapped @ Storage::Mmap(_) => {
                self.storage = mapped;
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Total size of the file image.
    pub fn file_len(&self) -> usize {
        self.storage.bytes().len()
    }
}

/// Two tensors whose data ranges overlap are an error: each weight matrix is rewritten in place
/// (packed) and read with its own shape, so shared bytes would be read as another layout.
fn reject_overlaps(tensors: &[TensorInfo]) -> Result<()> {
    let mut ranges: Vec<(usize, usize, &str)> = tensors
        .iter()
        .map(|t| (t.offset, t.offset + t.n_bytes, t.name.as_str()))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (w[0], w[1]);
        if b_start < a_end {
            return Err(EngineError::Gguf(format!(
                "tensors '{a}' and '{b}' share data bytes"
            )));
        }
    }
    Ok(())
}

fn align_up(v: u64, a: u64) -> Option<u64> {
    v.checked_add(a - 1).map(|x| x / a * a)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata values parsed so far (at most [`MAX_META_VALUES`]).
    values: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(EngineError::Gguf(format!(
                "unexpected end of file at byte {} (wanted {n} more bytes); the file is truncated",
                self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > self.remaining() as u64 {
            return Err(EngineError::Gguf(format!(
                "string of {n} bytes at byte {} runs past the end of the file",
                self.pos
            )));
        }
        let s = self.take(n as usize)?;
        // llama.cpp vocabularies may hold invalid UTF-8 in rare tokens; keep them lossily.
        Ok(String::from_utf8_lossy(s).into_owned())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue> {
        self.values += 1;
        if self.values > MAX_META_VALUES {
            return Err(EngineError::Gguf(format!(
                "more than {MAX_META_VALUES} metadata values"
            )));
        }
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>()?[0]),
            1 => MetaValue::I8(self.arr::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => match self.arr::<1>()?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(EngineError::Gguf(format!("invalid bool byte {b}"))),
            },
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(EngineError::Gguf("arrays nested too deeply".into()));
                }
                let elem_ty = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a count above the bytes left is a lie.
                if n > self.remaining() as u64 {
                    return Err(EngineError::Gguf(format!(
                        "array of {n} elements at byte {} runs past the end of the file",
                        self.pos
                    )));
                }
                let mut v = Vec::with_capacity((n as usize).min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem_ty, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr()?)),
            t => {
                return Err(EngineError::Gguf(format!(
                    "unknown metadata value type {t}"
                )))
            }
        })
    }
}

/// Writes GGUF v3 images: used by tests to build tiny random models and malformed files.
pub mod writer;

#[cfg(test)]
mod tests;
