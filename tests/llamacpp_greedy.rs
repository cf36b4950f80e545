//! Greedy continuations and logits on smollm2-135m (and, ignored, qwen2.5-coder-1.5b), compared
//! with llama.cpp's (fixtures made by scripts/gen_fixtures.py with llama-cpp-python on the same
//! GGUF files).
//!
//! Both engines quantize activations alike (Q8_0 / Q8_1 / Q8_K) and keep K/V at f16, but sum in a
//! different order, and these models amplify such rounding. How much is measured, not guessed: the
//! fixture also holds llama.cpp against itself, the same model with an f32 instead of its default
//! f16 KV cache, teacher-forced along the same greedy paths (`kv_f32_*`), and every allowance
//! below is derived from that noise ([`Allowance`], mostly [`NOISE_FACTOR`] times it). Measured
//! with llama-cpp-python 0.3.36, Arbor on AVX-512 without AMX:
//!
//! | smollm2, 12 prompts, 384 steps, vs llama.cpp | llama.cpp f32 KV | Arbor | allowed |
//! |----------------------------------------------|------------------|-------|---------|
//! | teacher-forced steps whose argmax differs    | 18               | 17    | 30      |
//! | largest gap between the two picks (flip_gap) | 0.330            | 0.338 | 0.412   |
//! | top-8 gap shift per step (gap_shift): mean   | 0.278            | 0.256 | 0.348   |
//! | top-8 gap shift per step: 95th percentile    | 0.526            | 0.519 | 0.658   |
//! | top-8 gap shift per step: largest            | 1.237            | 1.129 | -       |
//! | last prompt position, centered abs diff mean | 0.148            | 0.154 | 0.185   |
//! | last prompt position, centered abs diff max  | 1.014            | 1.050 | 1.268   |
//!
//! llama.cpp's f16-to-f32 change moves its top-2 gaps by median 0.10, p95 0.31, p99 0.56, max
//! 1.13; 71 of the 384 steps have a top-2 gap within the 0.412 allowance (76 were within the 0.5
//! this test allowed before). The batched teacher-forced pass differs at 17 steps too; 4 of the 12
//! prompts are identical throughout. qwen15 (3 prompts, 48 steps): llama.cpp f32 KV flips 1 step
//! (gap 0.028), gap shift mean 0.208, p95 0.363, largest 0.438; Arbor flips none, mean 0.242
//! (allowed 0.260), p95 0.488 (unchecked under [`P95_MIN_STEPS`]), largest 0.641; for scale,
//! llama.cpp 0.3.16 against 0.3.36 on the same steps: mean 0.215, p95 0.421, largest 0.485.
//!
//! Power, and its floor (smollm2): scaling every layer's FFN output by 1.01 or 0.99 fails (a
//! differing argmax at a gap of 0.67-0.70), and so do 1.05 on layer 0 (gap 1.59) and 1.1 on layer
//! 10 (three tests). 1.005 on every layer, 1.01-1.05 on one middle layer or K rounded to bf16
//! instead of f16 pass, and no comparison with llama.cpp can catch them: Arbor with 1.01 on layer
//! 10 differs from Arbor without it by as much as either differs from llama.cpp (mean top-2..8 gap
//! change 0.12 vs 0.13), this model's rounding noise floor (not the KV cache's, which bf16 K does
//! not raise; presumably the activation quantization). Those mild changes, independent draws of
//! that noise, also show the allowances' margin: flips 16-21, flip_gap up to 0.348, gap shift mean
//! up to 0.284 and p95 up to 0.575.

mod common;

use arbor_engine::{generate, sample::argmax, BatchMask, GenerateParams, KvCache};
use serde::Deserialize;

/// Each allowance is llama.cpp's own f16-vs-f32 KV noise (measured in the fixture) times this.
const NOISE_FACTOR: f64 = 1.25;

#[derive(Deserialize)]
struct Fixture {
    prompts: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    /// llama.cpp's greedy continuation: the prompt in one batch, then one token per step.
    greedy_ids: Vec<u32>,
    /// llama.cpp's 8 best (id, logit) at each generated step.
    step_top8: Vec<Vec<(u32, f64)>>,
    last_logits_file: String,
    /// llama.cpp with an f32 KV cache, teacher-forced along `greedy_ids`: its argmax at each step
    /// and its logits of the ids of `step_top8` (absent from fixtures made before the noise was
    /// measured, which `kv_noise` refuses).
    #[serde(default)]
    kv_f32_argmax: Vec<u32>,
    #[serde(default)]
    kv_f32_top8_logits: Vec<Vec<f64>>,
    /// [mean, max] centered |d logit| over the vocabulary, f16 against f32 KV cache, per step.
    #[serde(default)]
    kv_f32_centered_diff: Vec<[f64; 2]>,
}

fn load(file: &str) -> Fixture {
    let text = std::fs::read_to_string(common::fixture(file)).expect("fixture present");
    serde_json::from_str(&text).expect("fixture parses")
}

fn read_f32(file: &str) -> Vec<f32> {
    let b = std::fs::read(common::fixture(file)).expect("logits fixture");
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Largest |(l[top1] - l[t]) - (r[top1] - r[t])| over llama.cpp's top-8 ids t of a step, where
/// `l` are llama.cpp's logits of them and `r` the other run's.
fn gap_shift(top: &[(u32, f64)], other: impl Fn(u32) -> f64) -> f64 {
    let r0 = other(top[0].0);
    top.iter()
        .map(|&(t, l)| ((top[0].1 - l) - (r0 - other(t))).abs())
        .fold(0.0, f64::max)
}

/// At a step where the other run's argmax `pick` is not llama.cpp's top-1: the larger of the two
/// runs' gaps between the two tokens (llama.cpp's top-1 minus its logit of `pick`, and the other
/// run's logit of `pick` minus its logit of llama.cpp's top-1). None if `pick` is not in
/// llama.cpp's top-8, which is no near-tie.
fn flip_gap(top: &[(u32, f64)], pick: u32, other: impl Fn(u32) -> f64) -> Option<f64> {
    let &(_, l) = top.iter().find(|(id, _)| *id == pick)?;
    Some((top[0].1 - l).max(other(pick) - other(top[0].0)))
}

/// llama.cpp against itself, f16 vs f32 KV cache, over every step of a fixture.
#[derive(Debug, Default)]
struct Noise {
    steps: usize,
    /// steps whose argmax differs
    flips: usize,
    /// largest `flip_gap` at those steps
    max_flip_gap: f64,
    /// 95th percentile over the steps of |change of l[top1] - l[top2]|
    p95_top2_shift: f64,
    /// `gap_shift` per step: mean, 95th percentile, largest
    mean_gap_shift: f64,
    p95_gap_shift: f64,
    max_gap_shift: f64,
    /// step 0 (the last prompt position), worst prompt: centered |d logit| mean and largest
    last_mean: f64,
    last_max: f64,
}

/// The `q` quantile of `v` (nearest rank).
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

/// The fixture's measurement of llama.cpp's noise.
fn kv_noise(file: &str, f: &Fixture) -> Noise {
    assert!(
        f.prompts.iter().all(|c| !c.kv_f32_argmax.is_empty()),
        "{file} predates the noise measurement: regenerate it with scripts/gen_fixtures.py"
    );
    let mut n = Noise::default();
    let (mut top2_shifts, mut shifts) = (Vec::new(), Vec::new());
    for c in &f.prompts {
        let steps = c.step_top8.iter().zip(&c.kv_f32_top8_logits);
        for ((top, l32), &pick) in steps.zip(&c.kv_f32_argmax) {
            let other = |t: u32| l32[top.iter().position(|&(id, _)| id == t).unwrap()];
            n.steps += 1;
            top2_shifts.push(((top[0].1 - top[1].1) - (l32[0] - l32[1])).abs());
            shifts.push(gap_shift(top, other));
            if pick != top[0].0 {
                n.flips += 1;
                let gap = flip_gap(top, pick, other).expect("f32 pick in the f16 top-8");
                n.max_flip_gap = n.max_flip_gap.max(gap);
            }
        }
        let [mean, max] = c.kv_f32_centered_diff[0];
        n.last_mean = n.last_mean.max(mean);
        n.last_max = n.last_max.max(max);
    }
    n.mean_gap_shift = shifts.iter().sum::<f64>() / n.steps as f64;
    n.max_gap_shift = shifts.iter().copied().fold(0.0, f64::max);
    n.p95_gap_shift = quantile(shifts, 0.95);
    n.p95_top2_shift = quantile(top2_shifts, 0.95);
    eprintln!("{file}: llama.cpp f16 vs f32 KV cache: {n:?}");
    n
}

fn smollm2_noise() -> (Fixture, Noise) {
    let f = load("greedy_smollm2.json");
    let n = kv_noise("greedy_smollm2.json", &f);
    (f, n)
}

/// Arbor along llama.cpp's greedy path: the prompt in one batch, then one token per step, as
/// llama.cpp made the fixture and as `generate` decodes. `f(step, logits)` sees every step.
/// One prefill over `prompt` (a cache with room for `extra` more tokens) and its last-position
/// logits.
fn prompt_logits(m: &common::Loaded, prompt: &[u32], extra: usize) -> (KvCache, Vec<f32>) {
    let mut cache = KvCache::new(&m.model.config, prompt.len() + extra);
    let pos: Vec<usize> = (0..prompt.len()).collect();
    let logits = m
        .model
        .forward(
            common::backend(),
            &mut cache,
            prompt,
            &pos,
            BatchMask::Causal,
            &[pos.len() - 1],
        )
        .unwrap();
    (cache, logits)
}

fn teacher_forced(m: &common::Loaded, c: &Case, mut f: impl FnMut(usize, &[f32])) {
    let n = c.greedy_ids.len();
    let (mut cache, mut logits) = prompt_logits(m, &c.prompt_ids, n);
    for s in 0..n {
        f(s, &logits);
        if s + 1 < n {
            let p = cache.len();
            logits = m
                .model
                .forward(
                    common::backend(),
                    &mut cache,
                    &[c.greedy_ids[s]],
                    &[p],
                    BatchMask::Causal,
                    &[0],
                )
                .unwrap();
        }
    }
}

#[test]
fn prompt_tokenization_matches_llama_cpp() {
    let m = common::smollm2();
    for c in load("greedy_smollm2.json").prompts {
        assert_eq!(
            m.tok.encode_prompt(&c.prompt).unwrap(),
            c.prompt_ids,
            "prompt {:?}",
            c.prompt
        );
    }
}

/// What a greedy comparison allows, from llama.cpp's measured noise.
struct Allowance {
    /// a differing argmax must have `flip_gap` at most this: `NOISE_FACTOR` times the largest
    /// gap llama.cpp's own f16-to-f32 change flipped, or the 95th percentile of how far it moved
    /// top-2 gaps if larger (a fixture with few flips measures little with them)
    flip_gap: f64,
    /// at most this many steps may differ: llama.cpp's own count plus 3 standard deviations
    /// of a count (Poisson, sqrt)
    flips: usize,
    /// `gap_shift` against llama.cpp over the steps: mean, and 95th percentile where the fixture
    /// has at least [`P95_MIN_STEPS`] steps
    mean_gap_shift: f64,
    p95_gap_shift: Option<f64>,
}

/// A 95th percentile is estimated from the values above it: with 200 steps, 10 of them.
const P95_MIN_STEPS: usize = 200;

impl Allowance {
    fn from(n: &Noise) -> Allowance {
        let flips = n.flips as f64;
        Allowance {
            flip_gap: NOISE_FACTOR * n.max_flip_gap.max(n.p95_top2_shift),
            flips: (flips + 3.0 * flips.sqrt()) as usize,
            mean_gap_shift: NOISE_FACTOR * n.mean_gap_shift,
            p95_gap_shift: (n.steps >= P95_MIN_STEPS).then_some(NOISE_FACTOR * n.p95_gap_shift),
        }
    }
}

#[test]
fn greedy_continuations_match_llama_cpp() {
    let (f, noise) = smollm2_noise();
    assert!(f.prompts.len() >= 8);
    check_greedy(common::smollm2(), &f, &Allowance::from(&noise));
}

/// The realistic LLM (1.1 GB download, so not part of the default test run):
/// `cargo test --test llamacpp_greedy -- --ignored`.
#[test]
#[ignore]
fn qwen15_greedy_continuations_match_llama_cpp() {
    let f = load("greedy_qwen15.json");
    let allow = Allowance::from(&kv_noise("greedy_qwen15.json", &f));
    check_greedy(&common::load("qwen2.5-coder-1.5b"), &f, &allow);
}

/// Every step of every prompt, teacher-forced along llama.cpp's greedy path (so a divergence does
/// not end the comparison): Arbor's argmax must be llama.cpp's token, or a near-tie within the
/// measured noise in both engines' logits; the distances of llama.cpp's top-8 tokens from its
/// top-1 must agree within the noise (the mean and 95th percentile over the steps of how far they
/// moved: one step's largest shift is too noisy a figure to bound). Then free-running `generate` must reproduce llama.cpp's
/// whole continuation, or, where teacher forcing found a divergence, agree up to it and take
/// Arbor's token there; a prompt without a near-tie step must therefore be identical throughout.
fn check_greedy(m: &common::Loaded, f: &Fixture, allow: &Allowance) {
    let (mut steps, mut flips, mut exact) = (0usize, 0usize, 0usize);
    let mut shifts = Vec::new();
    for c in &f.prompts {
        let mut picks = Vec::new();
        let mut near_ties = 0;
        teacher_forced(m, c, |s, row| {
            let top = &c.step_top8[s];
            let ours = argmax(row);
            let arbor = |t: u32| row[t as usize] as f64;
            picks.push(ours);
            steps += 1;
            if top[0].1 - top[1].1 <= allow.flip_gap {
                near_ties += 1;
            }
            shifts.push(gap_shift(top, arbor));
            if ours != top[0].0 {
                flips += 1;
                let gap = flip_gap(top, ours, arbor);
                eprintln!(
                    "prompt {:?} step {s}: ours {ours} vs llama.cpp {} (gap {gap:?})",
                    c.prompt, top[0].0
                );
                assert!(
                    gap.is_some_and(|g| g <= allow.flip_gap),
                    "prompt {:?} step {s}: ours {ours} vs llama.cpp {}: gap {gap:?} is not a \
                     near-tie (allowed {:.3})",
                    c.prompt,
                    top[0].0,
                    allow.flip_gap
                );
            }
        });
        let first = picks.iter().zip(&c.greedy_ids).position(|(a, b)| a != b);
        // Free-running, up to the first divergence (past it there is no reference to compare).
        let params = GenerateParams {
            max_tokens: first.map_or(c.greedy_ids.len(), |i| i + 1),
            ignore_eos: true,
            min_tokens: 0,
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
        match first {
            None => {
                assert_eq!(out.tokens, c.greedy_ids, "prompt {:?}", c.prompt);
                exact += 1;
            }
            Some(i) => {
                assert!(
                    near_ties > 0,
                    "prompt {:?}: diverges without a near-tie",
                    c.prompt
                );
                assert_eq!(out.tokens[..i], c.greedy_ids[..i], "prompt {:?}", c.prompt);
                assert_eq!(out.tokens[i], picks[i], "prompt {:?}", c.prompt);
            }
        }
    }
    let mean = shifts.iter().sum::<f64>() / steps as f64;
    let worst = shifts.iter().copied().fold(0.0, f64::max);
    let p95 = quantile(shifts, 0.95);
    eprintln!(
        "{exact}/{} prompts identical throughout; {flips}/{steps} teacher-forced steps differ \
         (allowed {}); top-8 gap shift mean {mean:.3} (allowed {:.3}), p95 {p95:.3} (allowed \
         {:?}), largest {worst:.3}",
        f.prompts.len(),
        allow.flips,
        allow.mean_gap_shift,
        allow.p95_gap_shift,
    );
    assert!(flips <= allow.flips, "{flips}/{steps} steps differ");
    assert!(
        mean <= allow.mean_gap_shift && allow.p95_gap_shift.is_none_or(|a| p95 <= a),
        "llama.cpp's top-8 gaps moved by mean {mean:.3}, p95 {p95:.3}"
    );
}

/// Teacher-forced again, but the whole path as one causal batch (the prefill kernels, in chunks),
/// where llama.cpp decoded one token per step: every step's argmax must be llama.cpp's token or a
/// near-tie within the measured noise.
#[test]
fn batched_teacher_forced_argmax_matches_llama_cpp_at_every_step() {
    let (f, noise) = smollm2_noise();
    let allow = Allowance::from(&noise);
    let m = common::smollm2();
    let (mut steps, mut flips) = (0usize, 0usize);
    for c in &f.prompts {
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
        for (s, row) in logits.chunks_exact(v).enumerate() {
            steps += 1;
            let top = &c.step_top8[s];
            let ours = argmax(row);
            if ours == top[0].0 {
                continue;
            }
            flips += 1;
            let gap = flip_gap(top, ours, |t| row[t as usize] as f64);
            eprintln!(
                "prompt {:?} step {s}: ours {ours} vs llama.cpp {} (gap {gap:?})",
                c.prompt, top[0].0
            );
            assert!(
                gap.is_some_and(|g| g <= allow.flip_gap),
                "prompt {:?} step {s}: gap {gap:?} is not a near-tie",
                c.prompt
            );
        }
    }
    eprintln!("{flips}/{steps} batched teacher-forced steps differ from llama.cpp");
    assert!(flips <= allow.flips, "{flips}/{steps} steps differ");
}

/// The full logits row of the last prompt position, after removing each row's mean (a uniform
/// shift changes no probability), within the measured noise; and the argmax on every prompt,
/// llama.cpp's or a near-tie within the noise.
#[test]
fn last_position_logits_match_llama_cpp() {
    let (f, noise) = smollm2_noise();
    let allow = Allowance::from(&noise);
    let (mean_tol, max_tol) = (
        NOISE_FACTOR * noise.last_mean,
        NOISE_FACTOR * noise.last_max,
    );
    let m = common::smollm2();
    let (mut worst_mean, mut worst_max) = (0.0f64, 0.0f64);
    for c in &f.prompts {
        let reference = read_f32(&c.last_logits_file);
        let (_, ours) = prompt_logits(m, &c.prompt_ids, 0);
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
        let (theirs, pick) = (argmax(&reference), argmax(&ours));
        assert_eq!(theirs, c.step_top8[0][0].0, "fixture's row 0 is step 0");
        if pick != theirs {
            let gap = flip_gap(&c.step_top8[0], pick, |t| ours[t as usize] as f64);
            assert!(
                gap.is_some_and(|g| g <= allow.flip_gap),
                "prompt {:?}: top-1 {pick} vs llama.cpp {theirs}, gap {gap:?}",
                c.prompt
            );
        }
        assert!(
            mean <= mean_tol && max <= max_tol,
            "prompt {:?}: centered logit diff mean {mean:.3} max {max:.3} (allowed {mean_tol:.3}, \
             {max_tol:.3})",
            c.prompt
        );
    }
    eprintln!(
        "worst centered logit diff vs llama.cpp: mean {worst_mean:.3} (allowed {mean_tol:.3}), \
         max {worst_max:.3} (allowed {max_tol:.3})"
    );
}
