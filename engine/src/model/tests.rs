use crate::backend::{AmxUse, Backend, BatchMask, CpuBackend};
use crate::kv::KvCache;
use crate::model::Model;
use crate::quant::GgmlType;
use crate::sample::Rng;
use crate::testing::{skip_hardware, tiny_model, TinySpec};

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn specs() -> Vec<TinySpec> {
    let mut v = Vec::new();
    for arch in ["llama", "qwen2"] {
        for ty in [
            GgmlType::F32,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
        ] {
            v.push(TinySpec {
                arch,
                n_embd: 256,
                n_ff: 512,
                n_head: 8,
                n_head_kv: 2,
                weight_type: ty,
                separate_output: ty == GgmlType::Q6_K,
                ..TinySpec::default()
            });
        }
    }
    v
}

/// Batched prefill computes, for every position, the logits and K/V incremental decoding
/// computes: bit for bit (1e-4 / 1e-5) on the VNNI kernels and with the AMX family everywhere
/// (`AmxUse::Always`); with AMX tiles in the prefill only (where granted) within 5% of the
/// largest logit and of the largest K/V entry. That mix sums in two orders, each within 2e-5 of
/// the scalar reference (`quant::tests::amx_matches_scalar`); the f16 K/V cache and these random
/// models' attention amplify that. Measured (llama, Q4_K): layer 0's K differ by one f16
/// rounding (1.5e-4 of the largest entry), layer 1's V by 3.2%, the logits by up to 2.0%.
#[test]
fn batched_prefill_equals_incremental_decoding() {
    for (backend, exact) in [
        (CpuBackend::new(2).unwrap().bit_exact(), true),
        (
            CpuBackend::new(2).unwrap().with_amx_use(AmxUse::Always),
            true,
        ),
        (
            CpuBackend::new(2).unwrap().with_amx_use(AmxUse::Prefill),
            false,
        ),
    ] {
        let amx = backend.scope_prefill(crate::quant::amx_active);
        if backend.amx_use() != AmxUse::Never && !amx {
            // Same kernels as the bit-exact run.
            skip_hardware(
                "model::batched_prefill_equals_incremental_decoding",
                &format!(
                    "AmxUse::{:?}: AMX int8 is not available or not granted by the OS",
                    backend.amx_use()
                ),
            );
            continue;
        }
        for (i, spec) in specs().into_iter().enumerate() {
            let model = tiny_model(&spec, 100 + i as u64).unwrap();
            let mut rng = Rng::new(i as u64);
            let toks: Vec<u32> = (0..23)
                .map(|_| (rng.next_u64() % spec.vocab as u64) as u32)
                .collect();
            let pos: Vec<usize> = (0..toks.len()).collect();
            let rows: Vec<usize> = (0..toks.len()).collect();
            let mut c1 = KvCache::new(&model.config, 64);
            let batch = model
                .forward(&backend, &mut c1, &toks, &pos, BatchMask::Causal, &rows)
                .unwrap();
            let mut c2 = KvCache::new(&model.config, 64);
            let v = spec.vocab;
            let tol = |a: &[f32], abs: f32| {
                if exact {
                    abs
                } else {
                    0.05 * a.iter().fold(0.0f32, |m, x| m.max(x.abs())) + abs
                }
            };
            for (t, &tok) in toks.iter().enumerate() {
                let inc = model
                    .forward(&backend, &mut c2, &[tok], &[t], BatchMask::Causal, &[0])
                    .unwrap();
                let d = max_diff(&batch[t * v..(t + 1) * v], &inc);
                assert!(
                    d < tol(&inc, 1e-4),
                    "{} {:?} (amx {amx}): position {t} differs by {d}",
                    spec.arch,
                    spec.weight_type
                );
            }
            for l in 0..spec.n_layers {
                for s in 0..toks.len() {
                    let (k, kr) = (c1.k_row(l, s), c2.k_row(l, s));
                    let (vv, vr) = (c1.v_row(l, s), c2.v_row(l, s));
                    assert!(max_diff(&k, &kr) <= tol(&kr, 1e-5), "K layer {l} slot {s}");
                    assert!(max_diff(&vv, &vr) <= tol(&vr, 1e-5), "V layer {l} slot {s}");
                }
            }
        }
    }
}

/// An explicit causal bit mask behaves exactly like `BatchMask::Causal`; a chunked prefill too.
#[test]
fn bit_mask_and_chunked_prefill_agree_with_causal() {
    let backend = CpuBackend::new(2).unwrap();
    let spec = TinySpec::default();
    let model = tiny_model(&spec, 7).unwrap();
    let toks: Vec<u32> = (0..70).map(|i| (i * 7 % spec.vocab) as u32).collect();
    let n = toks.len();
    let pos: Vec<usize> = (0..n).collect();
    let words = n.div_ceil(64);
    let mut bits = vec![0u64; n * words];
    for t in 0..n {
        for j in 0..=t {
            bits[t * words + j / 64] |= 1 << (j % 64);
        }
    }
    let mut c1 = KvCache::new(&model.config, 128);
    let a = model
        .forward(
            &backend,
            &mut c1,
            &toks,
            &pos,
            BatchMask::Causal,
            &[n - 1, 3],
        )
        .unwrap();
    let mut c2 = KvCache::new(&model.config, 128);
    let mask = BatchMask::Bits {
        words_per_row: words,
        bits: &bits,
    };
    let b = model
        .forward(&backend, &mut c2, &toks, &pos, mask, &[n - 1, 3])
        .unwrap();
    assert_eq!(a, b);
    let mut c3 = KvCache::new(&model.config, 128);
    model
        .forward(
            &backend,
            &mut c3,
            &toks[..30],
            &pos[..30],
            BatchMask::Causal,
            &[],
        )
        .unwrap();
    let c = model
        .forward(
            &backend,
            &mut c3,
            &toks[30..],
            &pos[30..],
            BatchMask::Causal,
            &[n - 31],
        )
        .unwrap();
    assert!(max_diff(&a[..spec.vocab], &c) < 1e-4);
}

#[test]
fn bad_inputs_are_errors() {
    let backend = CpuBackend::new(1).unwrap();
    let spec = TinySpec::default();
    let model = tiny_model(&spec, 1).unwrap();
    let mut c = KvCache::new(&model.config, 4);
    let oov = spec.vocab as u32;
    let e = model
        .forward(&backend, &mut c, &[oov], &[0], BatchMask::Causal, &[0])
        .unwrap_err();
    assert_eq!(e.error_type(), "invalid_argument");
    let e = model
        .forward(
            &backend,
            &mut c,
            &[1, 2, 3, 4, 5],
            &[0, 1, 2, 3, 4],
            BatchMask::Causal,
            &[0],
        )
        .unwrap_err();
    assert_eq!(e.error_type(), "context_overflow");
    let e = model
        .forward(&backend, &mut c, &[1], &[0], BatchMask::Causal, &[1])
        .unwrap_err();
    assert_eq!(e.error_type(), "invalid_argument");
    assert_eq!(c.len(), 0, "failed calls leave the cache untouched");
}

/// Early exit after `L` of `N` layers computes what an `L`-layer model with the same weights
/// computes (the hidden state after `L` layers, the final norm, the output head), in a causal
/// prefill and in a tree batch after it, logits and K/V alike. The reference takes the normal
/// all-layers path: `tiny_model` with `n_layers = L` and the same seed draws the full model's
/// embedding, first `L` layers, final norm and head (checked tensor by tensor).
#[test]
fn early_exit_equals_a_model_truncated_to_its_layers() {
    let backend = CpuBackend::new(1).unwrap();
    for (arch, ty) in [("llama", GgmlType::F32), ("qwen2", GgmlType::Q8_0)] {
        let spec = TinySpec {
            arch,
            n_layers: 4,
            weight_type: ty,
            separate_output: arch == "qwen2",
            ..TinySpec::default()
        };
        let full = tiny_model(&spec, 41).unwrap();
        let toks = [5u32, 17, 3, 88, 41, 2, 60];
        let pos: Vec<usize> = (0..toks.len()).collect();
        let rows: Vec<usize> = (0..toks.len()).collect();
        // A tree after the prefix: root 9 -> {30 -> 31 -> 32, 33}.
        let tree_toks = [9u32, 30, 31, 32, 33];
        let parents = [None, Some(0), Some(1), Some(2), Some(0)];
        let tree_pos: Vec<usize> = [0, 1, 2, 3, 1].iter().map(|d| toks.len() + d).collect();
        let mask = crate::tree::TreeMask::from_parents(&parents);
        let tree_rows: Vec<usize> = (0..tree_toks.len()).collect();
        let mut all_layers = Vec::new();
        for l in 1..=4 {
            let short = tiny_model(
                &TinySpec {
                    n_layers: l,
                    ..spec.clone()
                },
                41,
            )
            .unwrap();
            for t in short.gguf().tensors() {
                let f = full.gguf().tensor_info(&t.name).unwrap();
                assert_eq!(
                    short.gguf().tensor_bytes(t),
                    full.gguf().tensor_bytes(f),
                    "{}",
                    t.name
                );
            }
            let mut c_ee = KvCache::new(&full.config, 32);
            let mut c_ref = KvCache::new(&short.config, 32);
            let got = full
                .forward_early_exit(
                    &backend,
                    &mut c_ee,
                    &toks,
                    &pos,
                    BatchMask::Causal,
                    &rows,
                    l,
                )
                .unwrap();
            let want = short
                .forward(&backend, &mut c_ref, &toks, &pos, BatchMask::Causal, &rows)
                .unwrap();
            assert_eq!(got, want, "{arch} early exit after {l}: causal prefill");
            let got = full
                .forward_early_exit(
                    &backend,
                    &mut c_ee,
                    &tree_toks,
                    &tree_pos,
                    mask.as_batch_mask(),
                    &tree_rows,
                    l,
                )
                .unwrap();
            let want = short
                .forward(
                    &backend,
                    &mut c_ref,
                    &tree_toks,
                    &tree_pos,
                    mask.as_batch_mask(),
                    &tree_rows,
                )
                .unwrap();
            assert_eq!(got, want, "{arch} early exit after {l}: tree batch");
            let d = crate::testing::max_kv_diff(&c_ee, &c_ref, l);
            assert_eq!(d, 0.0, "{arch} early exit after {l}: K/V");
            all_layers.push(got);
        }
        // The exit point matters: each depth gives other logits.
        for i in 1..all_layers.len() {
            assert!(
                max_diff(&all_layers[i - 1], &all_layers[i]) > 1e-3,
                "{arch} {i}"
            );
        }
    }
}

/// One sequence of a mixed batch: committed tokens, then the new rows of this pass.
struct MixedSeq {
    prefix: Vec<u32>,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    /// Tree bits (one u64 per row) or causal.
    bits: Option<Vec<u64>>,
    logit_rows: Vec<usize>,
}

fn mixed_batch(vocab: u32) -> Vec<MixedSeq> {
    let toks = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 7 + salt * 13 + 1) % vocab)
            .collect()
    };
    // A tree of 5 nodes: root 0; 1, 2 children of 0; 3 child of 1; 4 child of 2.
    let parents = [usize::MAX, 0, 0, 1, 2];
    let mut bits = vec![0u64; 5];
    for i in 0..5 {
        bits[i] = 1 << i;
        if parents[i] != usize::MAX {
            bits[i] |= bits[parents[i]];
        }
    }
    let depth = [0usize, 1, 1, 2, 2];
    vec![
        // A fresh prompt's prefill chunk.
        MixedSeq {
            prefix: vec![],
            tokens: toks(7, 1),
            positions: (0..7).collect(),
            bits: None,
            logit_rows: vec![6],
        },
        // One decode token after 20.
        MixedSeq {
            prefix: toks(20, 2),
            tokens: vec![5],
            positions: vec![20],
            bits: None,
            logit_rows: vec![0],
        },
        // A token tree after 10 (all rows' logits).
        MixedSeq {
            prefix: toks(10, 3),
            tokens: toks(5, 4),
            positions: depth.iter().map(|d| 10 + d).collect(),
            bits: Some(bits),
            logit_rows: (0..5).collect(),
        },
        // A later prefill chunk after 33 (crosses a block boundary), every row's logits.
        MixedSeq {
            prefix: toks(33, 5),
            tokens: toks(3, 6),
            positions: (33..36).collect(),
            bits: None,
            logit_rows: vec![0, 1, 2],
        },
    ]
}

/// A ragged batch (prefill chunks, a decode token and a token tree of four sequences in one
/// pass over one shared pool) gives every row the logits and K/V bits of its sequence run alone
/// in its own cache; for every kernel family the machine has (`ARBOR_KERNEL` picks one in CI).
#[test]
fn mixed_batch_rows_bit_identical_to_each_sequence_alone() {
    for spec in [specs()[2].clone(), specs()[5].clone(), specs()[7].clone()] {
        let model = tiny_model(&spec, 11).unwrap();
        let backend = CpuBackend::new(2).unwrap();
        let vocab = model.config.vocab_size;
        let seqs = mixed_batch(vocab as u32);
        let prefill = |cache: &mut KvCache, prefix: &[u32]| {
            if !prefix.is_empty() {
                let pos: Vec<usize> = (0..prefix.len()).collect();
                model
                    .forward(&backend, cache, prefix, &pos, BatchMask::Causal, &[])
                    .unwrap();
            }
        };
        // Alone: each sequence in its own private cache.
        let mut alone = Vec::new();
        let mut alone_caches = Vec::new();
        for s in &seqs {
            let mut c = KvCache::new(&model.config, 64);
            prefill(&mut c, &s.prefix);
            let mask = match &s.bits {
                Some(b) => BatchMask::Bits {
                    words_per_row: 1,
                    bits: b,
                },
                None => BatchMask::Causal,
            };
            alone.push(
                model
                    .forward(
                        &backend,
                        &mut c,
                        &s.tokens,
                        &s.positions,
                        mask,
                        &s.logit_rows,
                    )
                    .unwrap(),
            );
            alone_caches.push(c);
        }
        // Batched: one pool, one pass.
        let pool = crate::kv::KvPool::new(&model.config, model.config.n_layers, 16);
        let mut caches: Vec<KvCache> = seqs
            .iter()
            .map(|s| {
                let mut c = KvCache::in_pool(&pool, 64);
                prefill(&mut c, &s.prefix);
                c
            })
            .collect();
        let mut batch: Vec<crate::model::SeqBatch<'_>> = caches
            .iter_mut()
            .zip(&seqs)
            .map(|(c, s)| crate::model::SeqBatch {
                cache: c,
                tokens: &s.tokens,
                positions: &s.positions,
                mask: match &s.bits {
                    Some(b) => BatchMask::Bits {
                        words_per_row: 1,
                        bits: b,
                    },
                    None => BatchMask::Causal,
                },
                logit_rows: &s.logit_rows,
            })
            .collect();
        let got = model.forward_batch(&backend, &mut batch).unwrap();
        drop(batch);
        for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
            let gb: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
            let ab: Vec<u32> = a.iter().map(|x| x.to_bits()).collect();
            assert!(gb == ab, "{spec:?}: sequence {i}'s logits");
            let (c1, c2) = (&caches[i], &alone_caches[i]);
            assert_eq!(c1.len(), c2.len());
            for l in 0..model.config.n_layers {
                for s in 0..c1.len() {
                    assert!(c1.k_row(l, s) == c2.k_row(l, s), "seq {i} K {l} {s}");
                    assert!(c1.v_row(l, s) == c2.v_row(l, s), "seq {i} V {l} {s}");
                }
            }
        }
        drop(caches);
        assert_eq!(pool.stats().used, 0, "every block back in the pool");
        // Caches of two pools cannot share a pass.
        let mut c1 = KvCache::new(&model.config, 8);
        let mut c2 = KvCache::new(&model.config, 8);
        let mut two = [
            crate::model::SeqBatch {
                cache: &mut c1,
                tokens: &[1],
                positions: &[0],
                mask: BatchMask::Causal,
                logit_rows: &[0],
            },
            crate::model::SeqBatch {
                cache: &mut c2,
                tokens: &[1],
                positions: &[0],
                mask: BatchMask::Causal,
                logit_rows: &[0],
            },
        ];
        assert!(model.forward_batch(&backend, &mut two).is_err());
    }
}

/// A model whose K-quant (and, in the AVX-512 family, Q4_1 and Q8_0) matrices were column-packed
/// at load (`quant::packed`, the AVX-512 and AVX2 families) computes the natural model's logits
/// and K/V bit for bit: prefill, decoding and tree-sized batches.
#[test]
fn packed_model_bit_identical_to_natural() {
    if !crate::quant::packed::packs_here() {
        skip_hardware(
            "model::packed_model_bit_identical_to_natural",
            "packed rows are read by the AVX-512 VNNI, AVX2 and AMX families, which this process does not run",
        );
        return;
    }
    let backend = CpuBackend::new(2).unwrap();
    // The AMX family runs packed rows with the AVX-512 VNNI family's arithmetic (its tiles on
    // packed Q4_K/Q6_K groups included) and natural rows in its own f32 order: the natural
    // reference runs without AMX (`ARBOR_KERNEL=amx` would force it everywhere).
    if crate::quant::amx_scope_forced() {
        skip_hardware(
            "model::packed_model_bit_identical_to_natural",
            "ARBOR_KERNEL=amx runs natural rows in the AMX order, which packed rows do not use",
        );
        return;
    }
    let nat_backend = CpuBackend::new(2).unwrap().with_amx_use(AmxUse::Never);
    // K-quants (every family that packs reads them packed) and Q4_1, smollm2's layer type (the
    // AVX-512 and AMX families).
    let mut packed_gates = 0;
    let q4_1 = TinySpec {
        weight_type: GgmlType::Q4_1,
        ..specs()[2].clone()
    };
    // specs()[1]: Q8_0 with the output head tied to the embedding table (smollm2's), so the
    // packed head's rows are also looked up as embeddings.
    // Q8_0 rows of 384 elements, not whole 256-element groups, like smollm2's 576 (the packed
    // kernels' short last group; the tied head too).
    let q8_0_narrow = TinySpec {
        n_embd: 384,
        n_head: 6,
        ..specs()[1].clone()
    };
    for spec in [
        specs()[1].clone(),
        specs()[2].clone(),
        specs()[3].clone(),
        specs()[7].clone(),
        q4_1,
        q8_0_narrow,
    ] {
        let bytes = crate::testing::tiny_model_gguf(&spec, 5).unwrap();
        let load = |pack| {
            Model::from_gguf_packing(
                crate::gguf::GgufFile::from_bytes(bytes.clone()).unwrap(),
                pack,
            )
            .unwrap()
        };
        let (packed, natural) = (load(true), load(false));
        let gate = &packed.layers[0].w_gate;
        assert!(matches!(
            gate.ty,
            GgmlType::Q4_K | GgmlType::Q6_K | GgmlType::Q4_1 | GgmlType::Q8_0
        ));
        let (n_out, n_in) = (gate.dims[1] as usize, gate.dims[0] as usize);
        assert_eq!(
            packed.mat(gate).is_packed(),
            crate::quant::packed::packs_here_matrix(gate.ty, n_out, n_in)
        );
        packed_gates += usize::from(packed.mat(gate).is_packed());
        assert!(!natural.mat(&natural.layers[0].w_gate).is_packed());
        let vocab = packed.config.vocab_size as u32;
        let run = |m: &Model, backend: &CpuBackend| {
            let mut cache = KvCache::new(&m.config, 128);
            let mut out = Vec::new();
            let mut pos = 0;
            for n in [20usize, 1, 3, 1, 9, 2] {
                let toks: Vec<u32> = (0..n as u32)
                    .map(|i| (i * 37 + pos as u32) % vocab)
                    .collect();
                let p: Vec<usize> = (pos..pos + n).collect();
                let rows: Vec<usize> = (0..n).collect();
                out.extend(
                    m.forward(backend, &mut cache, &toks, &p, BatchMask::Causal, &rows)
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits()),
                );
                pos += n;
            }
            out.extend(cache.k_row(1, pos - 1).iter().map(|x| x.to_bits()));
            out
        };
        assert_eq!(
            run(&packed, &backend),
            run(&natural, &nat_backend),
            "{spec:?}"
        );
    }
    // Every family that packs packs some of these models' layers (the AVX2 family the K-quants).
    assert!(packed_gates > 0, "no layer of the test models was packed");
}

/// A `block_count` no file of this size could hold is an error, not an allocation of billions
/// of layers (which aborted the process).
#[test]
fn an_implausible_block_count_is_an_error() {
    let spec = specs()[0].clone();
    let bytes = crate::testing::tiny_model_gguf(&spec, 1).unwrap();
    let mut key = Vec::new();
    key.extend_from_slice(&("llama.block_count".len() as u64).to_le_bytes());
    key.extend_from_slice(b"llama.block_count");
    key.extend_from_slice(&4u32.to_le_bytes()); // U32
    let at = bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .expect("block_count entry")
        + key.len();
    assert_eq!(bytes[at..at + 4], (spec.n_layers as u32).to_le_bytes());
    assert!(Model::from_gguf(crate::gguf::GgufFile::from_bytes(bytes.clone()).unwrap()).is_ok());
    for n in [0u32, u32::MAX] {
        let mut bad = bytes.clone();
        bad[at..at + 4].copy_from_slice(&n.to_le_bytes());
        let Err(err) = Model::from_gguf(crate::gguf::GgufFile::from_bytes(bad).unwrap()) else {
            panic!("block_count {n} loaded");
        };
        assert!(err.to_string().contains("block_count"), "{n}: {err}");
    }
}
