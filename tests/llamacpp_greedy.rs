//! Greedy continuations and last-position logits on smollm2-135m, compared with llama.cpp's
//! (fixtures made by scripts/gen_fixtures.py with llama-cpp-python on the same GGUF file).

mod common;

use arbor_engine::{generate, sample::argmax, BatchMask, GenerateParams, KvCache};
use serde::Deserialize;

#[derive(Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    /// [id1, logit1, id2, logit2] at each generated step, from llama.cpp.
    step_top2: Vec<[f64; 4]>,
    last_logits_file: String,
}

/// Logit gap under which llama.cpp's top-2 is a near-tie that rounding differences may flip.
/// Both engines quantize activations the same way (Q8_1 / Q8_0 / Q8_K) but accumulate in a
/// different order and llama.cpp keeps K/V in f16; the measured max last-logit difference is
/// well under this (see `last_position_logits_match_llama_cpp`).
const NEAR_TIE: f64 = 0.1;
/// Max absolute difference allowed between our last-position logits and llama.cpp's.
const LOGIT_TOL: f32 = 0.25;

fn cases(file: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(common::fixture(file)).expect("fixture present");
    let v: serde_json::Value = serde_json::from_str(&text).expect("fixture parses");
    serde_json::from_value(v["cases"].clone()).or_else(|_| serde_json::from_value(v)).expect("cases")
}

fn read_f32(file: &str) -> Vec<f32> {
    let b = std::fs::read(common::fixture(file)).expect("logits fixture");
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn prompt_tokenization_matches_llama_cpp() {
    let m = common::smollm2();
    for c in cases("greedy_smollm2.json") {
        assert_eq!(m.tok.encode_prompt(&c.prompt).unwrap(), c.prompt_ids, "prompt {:?}", c.prompt);
    }
}

#[test]
fn greedy_continuations_match_llama_cpp() {
    let m = common::smollm2();
    let cases = cases("greedy_smollm2.json");
    assert!(cases.len() >= 8);
    let mut exact = 0;
    for c in &cases {
        let params = GenerateParams {
            max_tokens: c.greedy_ids.len(),
            ignore_eos: true,
            ..GenerateParams::default()
        };
        let out = generate(&m.model, common::backend(), &m.tok, &c.prompt_ids, &params, |_| {}).unwrap();
        match out.tokens.iter().zip(&c.greedy_ids).position(|(a, b)| a != b) {
            None => {
                assert_eq!(out.tokens, c.greedy_ids);
                exact += 1;
            }
            Some(i) => {
                // Allowed only where llama.cpp itself had a near-tie and we picked its runner-up.
                let [id1, l1, id2, l2] = c.step_top2[i];
                eprintln!(
                    "prompt {:?}: diverges at step {i}: ours {} vs llama.cpp {} (llama.cpp top-2 {id1}:{l1:.4} {id2}:{l2:.4})",
                    c.prompt, out.tokens[i], c.greedy_ids[i]
                );
                assert!(
                    (l1 - l2).abs() < NEAR_TIE && out.tokens[i] as f64 == id2,
                    "prompt {:?}: divergence at step {i} is not a near-tie",
                    c.prompt
                );
            }
        }
    }
    eprintln!("{exact}/{} prompts identical for all tokens", cases.len());
    assert!(exact * 4 >= cases.len() * 3, "too many near-tie divergences: {exact}/{}", cases.len());
}

#[test]
fn last_position_logits_match_llama_cpp() {
    let m = common::smollm2();
    let mut worst = 0.0f32;
    for c in cases("greedy_smollm2.json") {
        let reference = read_f32(&c.last_logits_file);
        let mut cache = KvCache::new(&m.model.config, c.prompt_ids.len());
        let pos: Vec<usize> = (0..c.prompt_ids.len()).collect();
        let ours = m
            .model
            .forward(common::backend(), &mut cache, &c.prompt_ids, &pos, BatchMask::Causal, &[pos.len() - 1])
            .unwrap();
        assert_eq!(ours.len(), reference.len());
        let d = ours.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        worst = worst.max(d);
        assert_eq!(argmax(&ours), argmax(&reference), "prompt {:?}", c.prompt);
        assert!(d < LOGIT_TOL, "prompt {:?}: max |logit diff| {d} >= {LOGIT_TOL}", c.prompt);
    }
    eprintln!("worst max |logit diff| vs llama.cpp: {worst}");
}
