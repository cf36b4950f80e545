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
    /// llama.cpp's 8 best (id, logit) at each generated step.
    step_top8: Vec<Vec<(u32, f64)>>,
    last_logits_file: String,
}

/// Logit gap under which llama.cpp's top-2 is a near-tie that rounding differences may flip.
/// Calibration: llama.cpp against itself, f32 instead of f16 KV cache, teacher-forced along these
/// fixtures, agrees on 365/384 steps and its disagreements have gaps up to 0.25; this model is that
/// sensitive to rounding. We allow twice that gap, and require 90% of steps identical.
const NEAR_TIE: f64 = 0.5;
/// Tolerances on the last-position logits, after removing each vector's mean (a uniform shift does
/// not change any probability). Both engines quantize activations alike (Q8_0 / Q8_1 / Q8_K) and keep
/// K/V at f16, but sum in a different order; this small model amplifies such rounding: llama.cpp
/// itself moves these logits by a mean |d| of 0.14-0.25 and a max of 0.95 when its KV cache type
/// changes from f16 to f32 (measured on the first four fixture prompts, llama-cpp-python 0.3.16).
const MEAN_ABS_TOL: f64 = 0.3;
const MAX_ABS_TOL: f64 = 1.5;

fn cases(file: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(common::fixture(file)).expect("fixture present");
    let v: serde_json::Value = serde_json::from_str(&text).expect("fixture parses");
    serde_json::from_value(v["prompts"].clone()).expect("fixture has prompts")
}

fn read_f32(file: &str) -> Vec<f32> {
    let b = std::fs::read(common::fixture(file)).expect("logits fixture");
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn prompt_tokenization_matches_llama_cpp() {
    let m = common::smollm2();
    for c in cases("greedy_smollm2.json") {
        assert_eq!(
            m.tok.encode_prompt(&c.prompt).unwrap(),
            c.prompt_ids,
            "prompt {:?}",
            c.prompt
        );
    }
}

#[test]
fn greedy_continuations_match_llama_cpp() {
    let cases = cases("greedy_smollm2.json");
    assert!(cases.len() >= 8);
    check_greedy(common::smollm2(), &cases);
}

/// The realistic LLM (1.1 GB download, so not part of the default test run):
/// `cargo test --test llamacpp_greedy -- --ignored`.
#[test]
#[ignore]
fn qwen15_greedy_continuations_match_llama_cpp() {
    check_greedy(
        &common::load("qwen2.5-coder-1.5b"),
        &cases("greedy_qwen15.json"),
    );
}

fn check_greedy(m: &common::Loaded, cases: &[Case]) {
    let mut exact = 0;
    for c in cases {
        let params = GenerateParams {
            max_tokens: c.greedy_ids.len(),
            ignore_eos: true,
            ..GenerateParams::default()
        };
        let out = generate(
            &m.model,
            common::backend(),
            &m.tok,
            &c.prompt_ids,
            &params,
            |_| {},
        )
        .unwrap();
        match out
            .tokens
            .iter()
            .zip(&c.greedy_ids)
            .position(|(a, b)| a != b)
        {
            None => {
                assert_eq!(out.tokens, c.greedy_ids);
                exact += 1;
            }
            Some(i) => {
                // Allowed only where llama.cpp itself had a near-tie that included our pick.
                let top = &c.step_top8[i];
                let best = top[0].1;
                let ours = top
                    .iter()
                    .find(|(id, _)| *id == out.tokens[i])
                    .map(|&(_, l)| l);
                eprintln!(
                    "prompt {:?}: diverges at step {i}: ours {} (llama.cpp logit {ours:?}) vs llama.cpp {} ({best:.4})",
                    c.prompt, out.tokens[i], c.greedy_ids[i]
                );
                assert!(
                    ours.is_some_and(|l| best - l < NEAR_TIE),
                    "prompt {:?}: divergence at step {i} is not a near-tie",
                    c.prompt
                );
            }
        }
    }
    eprintln!("{exact}/{} prompts identical for all tokens", cases.len());
}

/// Teacher-forced along llama.cpp's greedy path (one batched forward over prompt + its 32 tokens):
/// at every step our argmax must be llama.cpp's token, or a near-tie with it in llama.cpp's logits.
/// Unlike free-running generation this checks all steps of every prompt, even after a near-tie.
#[test]
fn teacher_forced_argmax_matches_llama_cpp_at_every_step() {
    let m = common::smollm2();
    let (mut steps, mut exact) = (0usize, 0usize);
    for c in cases("greedy_smollm2.json") {
        let mut ids = c.prompt_ids.clone();
        ids.extend(&c.greedy_ids[..c.greedy_ids.len() - 1]);
        let pos: Vec<usize> = (0..ids.len()).collect();
        let rows: Vec<usize> = (c.prompt_ids.len() - 1..ids.len()).collect();
        let mut cache = KvCache::new(&m.model.config, ids.len());
        let logits = m
            .model
            .forward(
                common::backend(),
                &mut cache,
                &ids,
                &pos,
                BatchMask::Causal,
                &rows,
            )
            .unwrap();
        let v = m.model.config.vocab_size;
        for (i, row) in logits.chunks_exact(v).enumerate() {
            steps += 1;
            let ours = argmax(row);
            if ours == c.greedy_ids[i] {
                exact += 1;
                continue;
            }
            let top = &c.step_top8[i];
            let gap = top
                .iter()
                .find(|(id, _)| *id == ours)
                .map(|&(_, l)| top[0].1 - l);
            eprintln!(
                "prompt {:?} step {i}: ours {ours} vs llama.cpp {} (gap {gap:?})",
                c.prompt, c.greedy_ids[i]
            );
            assert!(
                gap.is_some_and(|g| g < NEAR_TIE),
                "prompt {:?} step {i}: not a near-tie",
                c.prompt
            );
        }
    }
    eprintln!("{exact}/{steps} teacher-forced steps identical to llama.cpp");
    assert!(
        exact * 10 >= steps * 9,
        "only {exact}/{steps} steps identical"
    );
}

#[test]
fn last_position_logits_match_llama_cpp() {
    let m = common::smollm2();
    let (mut worst_mean, mut worst_max) = (0.0f64, 0.0f64);
    for c in cases("greedy_smollm2.json") {
        let reference = read_f32(&c.last_logits_file);
        let mut cache = KvCache::new(&m.model.config, c.prompt_ids.len());
        let pos: Vec<usize> = (0..c.prompt_ids.len()).collect();
        let ours = m
            .model
            .forward(
                common::backend(),
                &mut cache,
                &c.prompt_ids,
                &pos,
                BatchMask::Causal,
                &[pos.len() - 1],
            )
            .unwrap();
        assert_eq!(ours.len(), reference.len());
        let n = ours.len() as f64;
        let mo = ours.iter().map(|&x| x as f64).sum::<f64>() / n;
        let mr = reference.iter().map(|&x| x as f64).sum::<f64>() / n;
        let d: Vec<f64> = ours
            .iter()
            .zip(&reference)
            .map(|(&a, &b)| ((a as f64 - mo) - (b as f64 - mr)).abs())
            .collect();
        let mean = d.iter().sum::<f64>() / n;
        let max = d.iter().copied().fold(0.0, f64::max);
        worst_mean = worst_mean.max(mean);
        worst_max = worst_max.max(max);
        let [_, l1, _, l2] = c.step_top2[0];
        if (l1 - l2).abs() >= NEAR_TIE {
            assert_eq!(
                argmax(&ours),
                argmax(&reference),
                "prompt {:?}: top-1 differs",
                c.prompt
            );
        }
        assert!(
            mean < MEAN_ABS_TOL && max < MAX_ABS_TOL,
            "prompt {:?}: centered logit diff mean {mean:.3} max {max:.3}",
            c.prompt
        );
    }
    eprintln!("worst centered logit diff vs llama.cpp: mean {worst_mean:.3}, max {worst_max:.3}");
}
