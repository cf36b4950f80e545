//! Tiny random-weight llama/qwen2 models built in memory, for exactness tests that run in milliseconds.

use crate::backend::{Backend, BatchMask};
use crate::draft::Drafter;
use crate::error::Result;
use crate::gguf::writer::GgufWriter;
use crate::gguf::{GgufFile, MetaValue};
use crate::kv::KvCache;
use crate::model::Model;
use crate::quant::{self, GgmlType};
use crate::sample::verify::{Verifier, VerifyMode};
use crate::sample::{Rng, SamplingParams};
use crate::spec::SpecSession;

/// Shape and numeric format of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    /// "llama" or "qwen2" (qwen2 adds QKV biases and NEOX RoPE).
    pub arch: &'static str,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ff: usize,
    pub vocab: usize,
    pub context: usize,
    /// Type of the layer matrices (the embedding is Q8_0, norms F32).
    pub weight_type: GgmlType,
    /// Whether to add a separate output head instead of tying it to the embedding.
    pub separate_output: bool,
}

impl Default for TinySpec {
    fn default() -> Self {
        TinySpec {
            arch: "llama",
            n_layers: 2,
            n_embd: 64,
            n_head: 4,
            n_head_kv: 2,
            n_ff: 128,
            vocab: 96,
            context: 512,
            weight_type: GgmlType::F32,
            separate_output: false,
        }
    }
}

fn random_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale)
        .collect()
}

fn encode(ty: GgmlType, data: &[f32]) -> Result<Vec<u8>> {
    let n_in = data.len();
    let mut out = vec![0u8; ty.row_bytes(n_in).unwrap_or(n_in * 4)];
    quant::quantize_row(ty, data, &mut out)?;
    Ok(out)
}

/// Serialize a random model as a GGUF image.
pub fn tiny_model_gguf(spec: &TinySpec, seed: u64) -> Result<Vec<u8>> {
    let mut rng = Rng::new(seed);
    let mut w = GgufWriter::new();
    let a = spec.arch;
    let hd = spec.n_embd / spec.n_head;
    let kv = spec.n_head_kv * hd;
    w.meta("general.architecture", MetaValue::Str(a.into()))
        .meta(
            &format!("{a}.block_count"),
            MetaValue::U32(spec.n_layers as u32),
        )
        .meta(
            &format!("{a}.context_length"),
            MetaValue::U32(spec.context as u32),
        )
        .meta(
            &format!("{a}.embedding_length"),
            MetaValue::U32(spec.n_embd as u32),
        )
        .meta(
            &format!("{a}.feed_forward_length"),
            MetaValue::U32(spec.n_ff as u32),
        )
        .meta(
            &format!("{a}.attention.head_count"),
            MetaValue::U32(spec.n_head as u32),
        )
        .meta(
            &format!("{a}.attention.head_count_kv"),
            MetaValue::U32(spec.n_head_kv as u32),
        )
        .meta(&format!("{a}.rope.freq_base"), MetaValue::F32(10000.0))
        .meta(
            &format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-5),
        )
        .meta(
            &format!("{a}.vocab_size"),
            MetaValue::U32(spec.vocab as u32),
        );
    let mut mat =
        |w: &mut GgufWriter, name: &str, n_out: usize, n_in: usize, ty: GgmlType| -> Result<()> {
            let scale = 1.0 / (n_in as f32).sqrt();
            let mut bytes = Vec::new();
            for _ in 0..n_out {
                bytes.extend(encode(ty, &random_vec(&mut rng, n_in, scale * 1.7))?);
            }
            w.tensor(name, &[n_in as u64, n_out as u64], ty, bytes);
            Ok(())
        };
    mat(
        &mut w,
        "token_embd.weight",
        spec.vocab,
        spec.n_embd,
        GgmlType::Q8_0,
    )?;
    if spec.separate_output {
        mat(
            &mut w,
            "output.weight",
            spec.vocab,
            spec.n_embd,
            spec.weight_type,
        )?;
    }
    let t = spec.weight_type;
    for l in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{l}.{s}");
        mat(&mut w, &n("attn_q.weight"), spec.n_embd, spec.n_embd, t)?;
        mat(&mut w, &n("attn_k.weight"), kv, spec.n_embd, t)?;
        mat(&mut w, &n("attn_v.weight"), kv, spec.n_embd, t)?;
        mat(
            &mut w,
            &n("attn_output.weight"),
            spec.n_embd,
            spec.n_embd,
            t,
        )?;
        mat(&mut w, &n("ffn_gate.weight"), spec.n_ff, spec.n_embd, t)?;
        mat(&mut w, &n("ffn_up.weight"), spec.n_ff, spec.n_embd, t)?;
        mat(&mut w, &n("ffn_down.weight"), spec.n_embd, spec.n_ff, t)?;
    }
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut vecf = |w: &mut GgufWriter, name: &str, n: usize, base: f32, scale: f32| {
        let v: Vec<f32> = random_vec(&mut rng, n, scale)
            .iter()
            .map(|x| x + base)
            .collect();
        let bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.tensor(name, &[n as u64], GgmlType::F32, bytes);
    };
    vecf(&mut w, "output_norm.weight", spec.n_embd, 1.0, 0.2);
    for l in 0..spec.n_layers {
        let n = |s: &str| format!("blk.{l}.{s}");
        vecf(&mut w, &n("attn_norm.weight"), spec.n_embd, 1.0, 0.2);
        vecf(&mut w, &n("ffn_norm.weight"), spec.n_embd, 1.0, 0.2);
        if a == "qwen2" {
            vecf(&mut w, &n("attn_q.bias"), spec.n_embd, 0.0, 0.3);
            vecf(&mut w, &n("attn_k.bias"), kv, 0.0, 0.3);
            vecf(&mut w, &n("attn_v.bias"), kv, 0.0, 0.3);
        }
    }
    Ok(w.to_bytes())
}

/// A random model ready to run.
pub fn tiny_model(spec: &TinySpec, seed: u64) -> Result<Model> {
    Model::from_gguf(GgufFile::from_bytes(tiny_model_gguf(spec, seed)?)?)
}

/// Greedy incremental decoding of `n` tokens after `prompt`, every generated token fed: the
/// reference speculative decoding must reproduce. The cache keeps `extra` spare slots.
pub fn greedy_incremental<B: Backend>(
    model: &Model,
    backend: &B,
    prompt: &[u32],
    n: usize,
    extra: usize,
) -> Result<(KvCache, Vec<u32>)> {
    let mut cache = KvCache::new(&model.config, prompt.len() + n + extra);
    let pos: Vec<usize> = (0..prompt.len()).collect();
    let mut logits = model.forward(
        backend,
        &mut cache,
        prompt,
        &pos,
        BatchMask::Causal,
        &[prompt.len() - 1],
    )?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = crate::sample::argmax(&logits);
        out.push(t);
        let p = cache.len();
        logits = model.forward(backend, &mut cache, &[t], &[p], BatchMask::Causal, &[0])?;
    }
    Ok((cache, out))
}

/// Largest absolute difference between the K/V rows of two caches of the same model, over
/// every layer and the slots both hold; `f32::INFINITY` when their lengths differ.
pub fn max_kv_diff(a: &KvCache, b: &KvCache, n_layers: usize) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let diff = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max)
    };
    let mut m = 0.0f32;
    for l in 0..n_layers {
        for s in 0..a.len() {
            m = m
                .max(diff(&a.k_row(l, s), &b.k_row(l, s)))
                .max(diff(&a.v_row(l, s), &b.v_row(l, s)));
        }
    }
    m
}

/// A greedy speculative session positioned after `prompt`: its K/V cached (128 spare slots) and
/// `first` (the first greedy token) as the root.
pub fn greedy_session<'m, B: Backend>(
    model: &'m Model,
    backend: &'m B,
    prompt: &[u32],
    first: u32,
    budget: usize,
) -> Result<SpecSession<'m, B>> {
    let (cache, _) = greedy_incremental(model, backend, prompt, 0, 128)?;
    let mut seq = prompt.to_vec();
    seq.push(first);
    let v = Verifier::new(VerifyMode::Greedy, SamplingParams::greedy())?;
    SpecSession::new(model, backend, cache, seq, v, budget)
}

/// Speculative steps (trees cut at `max_depth`) until the session holds at least `len` tokens.
pub fn step_until<B: Backend>(
    s: &mut SpecSession<'_, B>,
    drafters: &mut [&mut dyn Drafter],
    len: usize,
    max_depth: usize,
) -> Result<()> {
    while s.tokens().len() < len {
        s.step(drafters, max_depth)?;
    }
    Ok(())
}

/// Environment variable naming a file to which [`skip_hardware`] appends its lines (`.ci/run`
/// sets it and prints the file at the end: cargo test hides a passing test's stderr).
#[cfg(test)]
pub(crate) const SKIP_LOG_VAR: &str = "ARBOR_SKIP_LOG";

/// A test that cannot run a hardware path on this machine (no AVX-512 VNNI, AMX not granted, …)
/// calls this before returning (or skipping that part): it prints
/// `SKIP(hardware): <test>: <reason>` to stderr and appends the line to the file named by
/// [`SKIP_LOG_VAR`], if set.
#[cfg(test)]
pub(crate) fn skip_hardware(test: &str, reason: &str) {
    let line = format!("SKIP(hardware): {test}: {reason}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os(SKIP_LOG_VAR) {
        append_line(std::path::Path::new(&path), &line)
            .unwrap_or_else(|e| panic!("{SKIP_LOG_VAR}: cannot append to {path:?}: {e}"));
    }
}

/// Append `line` and a newline to `path` (created if missing) in one write.
#[cfg(test)]
fn append_line(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .write_all(format!("{line}\n").as_bytes())
}

#[cfg(test)]
mod tests {
    /// Skip lines accumulate in the log file, one per line, earlier ones kept.
    #[test]
    fn skip_lines_are_appended_to_the_log() {
        let path = std::env::temp_dir().join(format!("arbor-skip-log-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        super::append_line(&path, "SKIP(hardware): a: no x").unwrap();
        super::append_line(&path, "SKIP(hardware): b: no y").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(text, "SKIP(hardware): a: no x\nSKIP(hardware): b: no y\n");
    }
}
