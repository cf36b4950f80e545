use super::writer::GgufWriter;
use super::*;

fn sample() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .meta("llama.block_count", MetaValue::U32(2))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(vec![MetaValue::Str("a".into()), MetaValue::Str("b".into())]),
        )
        .tensor("w", &[4, 2], GgmlType::F32, vec![0u8; 32])
        .tensor("v", &[3], GgmlType::F32, vec![1u8; 12]);
    w.to_bytes()
}

#[test]
fn round_trip() {
    let g = GgufFile::from_bytes(sample()).expect("parses");
    assert_eq!(g.get_str("general.architecture"), Some("llama"));
    assert_eq!(g.get_u64("llama.block_count"), Some(2));
    let toks = g.get("tokenizer.ggml.tokens").and_then(|v| v.as_array());
    assert_eq!(toks.map(|t| t.len()), Some(2));
    let w = g.tensor_info("w").expect("tensor w");
    assert_eq!(w.dims, vec![4, 2]);
    assert_eq!(g.tensor_bytes(w).len(), 32);
    let v = g.tensor_info("v").expect("tensor v");
    assert_eq!(g.tensor_bytes(v), &[1u8; 12][..]);
    assert_eq!(v.offset % 32, 0);
}

/// A file loads the same through `open` (anonymous memory, huge pages) and `open_mapped`; an empty
/// or truncated file is an error from both.
#[test]
fn open_and_open_mapped_agree() {
    let dir = std::env::temp_dir().join(format!("arbor-gguf-open-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bytes = sample();
    let whole = dir.join("whole.gguf");
    std::fs::write(&whole, &bytes).expect("write");
    let a = GgufFile::open(&whole).expect("open");
    let b = GgufFile::open_mapped(&whole).expect("open_mapped");
    for name in ["w", "v"] {
        let (ta, tb) = (
            a.tensor_info(name).expect("a"),
            b.tensor_info(name).expect("b"),
        );
        assert_eq!(ta.dims, tb.dims);
        assert_eq!(a.tensor_bytes(ta), b.tensor_bytes(tb));
    }
    assert_eq!(
        a.tensor_bytes(a.tensor_info("v").expect("v")),
        &[1u8; 12][..]
    );
    assert_eq!(a.path.as_deref(), Some(whole.as_path()));
    for (name, len) in [("empty.gguf", 0), ("cut.gguf", bytes.len() - 5)] {
        let p = dir.join(name);
        std::fs::write(&p, &bytes[..len]).expect("write");
        assert!(GgufFile::open(&p).is_err(), "{name} opened");
        assert!(GgufFile::open_mapped(&p).is_err(), "{name} mapped");
    }
    assert!(GgufFile::open(&dir.join("missing.gguf")).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = sample();
    for n in 0..bytes.len() - 1 {
        let r = GgufFile::from_bytes(bytes[..n].to_vec());
        assert!(r.is_err(), "truncated at {n} parsed");
    }
}

#[test]
fn corrupted_bytes_never_panic() {
    let bytes = sample();
    // Flip every byte of the header region to a few hostile values.
    for i in 0..bytes.len().min(400) {
        for v in [0u8, 0xff, 0x7f, 9] {
            let mut b = bytes.clone();
            b[i] = v;
            let _ = GgufFile::from_bytes(b);
        }
    }
}

#[test]
fn hostile_counts_are_rejected() {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert_eq!(e.error_type(), "malformed_model_file");
    let e = GgufFile::from_bytes(b"GGML\x03\0\0\0".to_vec()).unwrap_err();
    assert!(e.to_string().contains("magic"));
}

#[test]
fn unknown_tensor_type_is_reported() {
    let mut bytes = sample();
    // The first tensor's type id follows its name and dims; find it by re-serializing with a marker.
    let marker = GgufFile::from_bytes(bytes.clone()).expect("parses");
    assert!(marker.tensor_info("w").is_some());
    // Locate "w" tensor info: name len (8) + 'w' + n_dims (4) + 2 dims (16) then the type u32.
    let pos = bytes
        .windows(9)
        .position(|win| win == [1, 0, 0, 0, 0, 0, 0, 0, b'w'])
        .expect("name found");
    let ty_pos = pos + 9 + 4 + 16;
    bytes[ty_pos..ty_pos + 4].copy_from_slice(&999u32.to_le_bytes());
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert_eq!(e.error_type(), "unsupported_tensor_type");
}

/// A file whose tensors share data bytes is refused: packing rewrites each matrix in place and
/// kernels read it with its own shape, so an 8-row matrix aliased onto a 16-row one would be
/// read (and written) as the wider layout.
#[test]
fn overlapping_tensor_data_is_an_error() {
    let bytes = sample();
    // Tensor info of "v": name (len 1, "v"), 1 dim, dims [3], type F32 (0), offset 32.
    let mut info = Vec::new();
    info.extend_from_slice(&1u64.to_le_bytes());
    info.extend_from_slice(b"v");
    info.extend_from_slice(&1u32.to_le_bytes());
    info.extend_from_slice(&3u64.to_le_bytes());
    info.extend_from_slice(&0u32.to_le_bytes());
    let at = bytes
        .windows(info.len())
        .position(|w| w == info.as_slice())
        .expect("tensor info of v")
        + info.len();
    assert_eq!(bytes[at..at + 8], 32u64.to_le_bytes());
    assert!(GgufFile::from_bytes(bytes.clone()).is_ok());
    let mut aliased = bytes;
    aliased[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
    let err = GgufFile::from_bytes(aliased).expect_err("aliased tensors parse");
    assert!(err.to_string().contains("share data"), "{err}");
}

/// A metadata array of more values than any model has is refused before it is parsed into
/// 32-byte values (a 17 MB array of bytes would take ~0.5 GB).
#[test]
fn too_many_metadata_values_is_an_error() {
    let image = |n: u64| {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // metadata entries
        b.extend_from_slice(&3u64.to_le_bytes());
        b.extend_from_slice(b"big");
        b.extend_from_slice(&9u32.to_le_bytes()); // array
        b.extend_from_slice(&0u32.to_le_bytes()); // of u8
        b.extend_from_slice(&n.to_le_bytes());
        b.resize(b.len() + n as usize, 7);
        b
    };
    let ok = GgufFile::from_bytes(image(1000)).expect("a small array parses");
    assert_eq!(
        ok.get("big").and_then(|v| v.as_array()).map(|a| a.len()),
        Some(1000)
    );
    let err = GgufFile::from_bytes(image((1 << 24) + 1)).expect_err("17 M values parsed");
    assert!(err.to_string().contains("metadata values"), "{err}");
}
