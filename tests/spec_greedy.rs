//! Greedy speculative generation (SpecInfer token trees) on smollm2-135m equals incremental greedy decoding token for token.

mod common;

use arbor_engine::draft::{DistDrafter, Drafter, OracleDrafter, RandomDrafter};
use arbor_engine::generate::{generate, GenerateParams};
use arbor_engine::sample::verify::VerifyMode;
use arbor_engine::sample::SamplingParams;
use arbor_engine::sched::StepCost;
use arbor_engine::spec::{self, SpecParams};
use arbor_engine::tree::{ExpandMode, ExpansionConfig};

const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\nx = np.",
    "Water boils at a temperature of",
    "A list of fruits: apples, bananas,",
    "In 1969, the first humans",
];

/// (name, expansion config, budget): chain, wide, deep, SpecInfer's shape and a 256-node tree
/// (257 rows with the root: bitset rows wider than 256 bits).
fn configs() -> Vec<(&'static str, ExpansionConfig, usize)> {
    let c = |s: &str| s.parse::<ExpansionConfig>().unwrap();
    vec![
        ("chain", ExpansionConfig::chain(6), 6),
        ("wide", c("12,2"), 36),
        ("deep", ExpansionConfig::chain(24), 24),
        ("specinfer", ExpansionConfig::specinfer(), 32),
        ("256", c("2,2,2,2,2,2,2,2"), 256),
    ]
}

fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        ignore_eos: true,
        min_tokens: 0,
        logprobs: false,
        ..GenerateParams::default()
    }
}

/// [`params`] sampling at `temperature` with `seed`.
fn sampled(max_tokens: usize, temperature: f32, seed: u64) -> GenerateParams {
    GenerateParams {
        sampling: SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        },
        ..params(max_tokens)
    }
}

/// Every prompt runs the oracle on every config; the random drafter and the merged
/// random + oracle pair rotate through the configs (a random tree costs a pass per token).
#[test]
fn greedy_speculation_equals_incremental() {
    let m = common::smollm2();
    let be = common::backend();
    let n_tokens = 16;
    let cfgs = configs();
    for (pi, text) in PROMPTS.iter().enumerate() {
        let prompt = m.tok.encode_prompt(text).unwrap();
        let reference = generate(&m.model, be, &m.tok, &prompt, &params(n_tokens), |_| {}).unwrap();
        assert_eq!(reference.tokens.len(), n_tokens);
        let mut truth = prompt.clone();
        truth.extend(&reference.tokens);
        let mut runs: Vec<(&str, usize)> = (0..cfgs.len()).map(|c| ("oracle", c)).collect();
        runs.push(("random", pi % cfgs.len()));
        runs.push(("both", (pi + 2) % cfgs.len()));
        for (kind, ci) in runs {
            let (name, cfg, budget) = &cfgs[ci];
            let mut oracle = OracleDrafter::new(truth.clone(), cfg.clone(), pi as u64);
            let mut random = RandomDrafter::new(cfg.clone(), 100 + pi as u64);
            let mut ds: Vec<&mut dyn Drafter> = match kind {
                "oracle" => vec![&mut oracle],
                "random" => vec![&mut random],
                _ => vec![&mut random, &mut oracle],
            };
            let budget = if kind == "both" { 2 * budget } else { *budget };
            let sp = SpecParams {
                budget,
                mode: None,
                adaptive: false,
                step_cost: None,
            };
            let out = spec::generate(
                &m.model,
                be,
                &m.tok,
                &prompt,
                &params(n_tokens),
                &sp,
                &mut ds,
                |_| {},
            )
            .unwrap();
            let what = format!("prompt {pi} config {name} drafter {kind}");
            assert_eq!(out.mode, VerifyMode::Greedy);
            assert_eq!(out.output.tokens, reference.tokens, "{what}");
            assert_eq!(out.output.text, reference.text, "{what}");
            let mt = &out.metrics;
            assert!(mt.accepted + mt.steps + 1 >= n_tokens, "{what}: {mt:?}");
            if kind != "random" {
                // The oracle's path is always accepted: far fewer passes than tokens.
                assert!(mt.mean_accepted() >= 1.0, "{what}: {mt:?}");
            }
            if *name == "256" && kind == "oracle" {
                // The first pass verifies all 256 nodes (depth 8, 257 rows).
                assert!(
                    mt.drafted >= 256 && mt.drafted_by_depth.len() == 8,
                    "{mt:?}"
                );
            }
        }
    }
}

/// Stop strings, EOS and the length limit end speculative generation exactly where incremental
/// generation ends, even when a step accepts tokens past that point.
#[test]
fn stop_rules_match_incremental() {
    let m = common::smollm2();
    let be = common::backend();
    let prompt = m.tok.encode_prompt("The capital of France is").unwrap();
    let reference = generate(&m.model, be, &m.tok, &prompt, &params(16), |_| {}).unwrap();
    let mut truth = prompt.clone();
    truth.extend(&reference.tokens);
    // A stop string cut from the middle of the reference text.
    let mid = reference.text.len() / 2;
    let stop: String = reference.text[mid..].chars().take(3).collect();
    for p in [
        params(5),
        params(16),
        GenerateParams {
            stop: vec![stop.clone()],
            ..params(16)
        },
        GenerateParams {
            ignore_eos: false,
            min_tokens: 0,
            ..params(16)
        },
        // A stop token from the middle of the reference, past a `min_tokens` that skips
        // nothing or that skips its first place.
        GenerateParams {
            stop_token_ids: vec![reference.tokens[8]],
            ..params(16)
        },
        GenerateParams {
            stop_token_ids: vec![reference.tokens[8]],
            min_tokens: 9,
            ..params(16)
        },
    ] {
        let want = generate(&m.model, be, &m.tok, &prompt, &p, |_| {}).unwrap();
        let mut oracle = OracleDrafter::new(truth.clone(), ExpansionConfig::chain(10), 1);
        let mut streamed = String::new();
        let got = spec::generate(
            &m.model,
            be,
            &m.tok,
            &prompt,
            &p,
            &SpecParams::default(),
            &mut [&mut oracle],
            |s| streamed.push_str(s),
        )
        .unwrap();
        assert_eq!(got.output.tokens, want.tokens, "stop {:?}", p.stop);
        assert_eq!(got.output.text, want.text);
        assert_eq!(streamed, want.text);
        assert_eq!(got.output.finish_reason, want.finish_reason);
        if let Some(&stop) = p.stop_token_ids.first() {
            let end = (p.min_tokens..16).find(|&i| reference.tokens[i] == stop);
            let n = end.map_or(16, |i| i + 1);
            assert_eq!(
                want.tokens,
                reference.tokens[..n],
                "min_tokens {}",
                p.min_tokens
            );
        }
    }
}

/// After a speculative step the KV cache holds what incremental decoding writes.
#[test]
fn kv_after_speculative_steps_matches_incremental() {
    use arbor_engine::sample::verify::Verifier;
    use arbor_engine::spec::SpecSession;
    use arbor_engine::{BatchMask, KvCache};

    let m = common::smollm2();
    let be = common::backend();
    let prompt = m
        .tok
        .encode_prompt("Once upon a time, in a small village,")
        .unwrap();
    let reference = generate(&m.model, be, &m.tok, &prompt, &params(24), |_| {}).unwrap();
    let mut truth = prompt.clone();
    truth.extend(&reference.tokens);

    let prefill = |cap: usize, toks: &[u32]| {
        let mut c = KvCache::new(&m.model.config, cap);
        let pos: Vec<usize> = (0..toks.len()).collect();
        m.model
            .forward(be, &mut c, toks, &pos, BatchMask::Causal, &[])
            .unwrap();
        c
    };
    let mut oracle = OracleDrafter::new(truth.clone(), "3,2,1,1,1".parse().unwrap(), 4);
    let v = Verifier::new(VerifyMode::Greedy, SamplingParams::greedy()).unwrap();
    let mut seq = prompt.clone();
    seq.push(reference.tokens[0]);
    let mut s = SpecSession::new(&m.model, be, prefill(256, &prompt), seq, v, 40).unwrap();
    for _ in 0..2 {
        s.step(&mut [&mut oracle], 5).unwrap();
    }
    let n = s.cache().len();
    assert!(n > prompt.len() + 2);
    assert_eq!(&s.tokens()[..n + 1], &truth[..n + 1]);
    // Incremental: prompt prefill, then one token per pass.
    let mut want = prefill(256, &prompt);
    for &t in &truth[prompt.len()..n] {
        let p = want.len();
        m.model
            .forward(be, &mut want, &[t], &[p], BatchMask::Causal, &[])
            .unwrap();
    }
    assert_eq!(want.len(), n);
    let mut worst = 0.0f32;
    for l in 0..m.model.config.n_layers {
        for slot in 0..n {
            for (a, b) in s.cache().k_row(l, slot).iter().zip(want.k_row(l, slot)) {
                worst = worst.max((a - b).abs());
            }
            for (a, b) in s.cache().v_row(l, slot).iter().zip(want.v_row(l, slot)) {
                worst = worst.max((a - b).abs());
            }
        }
    }
    assert!(worst <= 1e-3, "max K/V difference {worst}");
}

/// Greedy verification under temperature sampling would not be lossless: refused.
#[test]
fn greedy_verification_needs_greedy_sampling() {
    let m = common::smollm2();
    let be = common::backend();
    let prompt = m.tok.encode_prompt("Hello").unwrap();
    let p = sampled(4, 0.7, 0);
    let sp = SpecParams {
        budget: 8,
        mode: Some(VerifyMode::Greedy),
        adaptive: false,
        step_cost: None,
    };
    let mut r = RandomDrafter::new(ExpansionConfig::chain(2), 1);
    let e = spec::generate(
        &m.model,
        be,
        &m.tok,
        &prompt,
        &p,
        &sp,
        &mut [&mut r],
        |_| {},
    );
    assert!(e.is_err());
    // MSS and naive are fine: reproducible per seed, another seed gives other tokens, and the
    // temperature is applied (at 0.01 they are the greedy tokens, at 0.7 not). 16 tokens, pinned
    // seeds: the outcomes are fixed.
    let greedy = generate(&m.model, be, &m.tok, &prompt, &params(16), |_| {})
        .unwrap()
        .tokens;
    for mode in [VerifyMode::Mss, VerifyMode::Naive] {
        let sp = SpecParams {
            mode: Some(mode),
            ..sp.clone()
        };
        let run = |seed: u64, temperature: f32| {
            let p = sampled(16, temperature, seed);
            let mut r = RandomDrafter::new(ExpansionConfig::chain(2), 1);
            spec::generate(
                &m.model,
                be,
                &m.tok,
                &prompt,
                &p,
                &sp,
                &mut [&mut r],
                |_| {},
            )
            .unwrap()
            .output
            .tokens
        };
        let a = run(1, 0.7);
        assert_eq!(a.len(), 16);
        assert_eq!(a, run(1, 0.7), "{mode}: same seed, same tokens");
        assert_ne!(a, run(2, 0.7), "{mode}: the seed is used");
        assert_ne!(a, greedy, "{mode}: temperature 0.7 is not greedy");
        assert_eq!(
            run(1, 0.01),
            greedy,
            "{mode}: temperature 0.01 samples the argmax"
        );
    }
}

/// An adaptive request whose drafter samples its tree is verified on what it drafted, even where
/// the pass cost says that no depth pays: a depth chosen from the proposal's node counts (which
/// depend on which tokens the draws hit) would bias MSS. The drafter samples two children of the
/// root and one below each from a flat distribution over four tokens.
#[test]
fn adaptive_sampled_proposals_are_verified_whole() {
    let m = common::smollm2();
    let be = common::backend();
    let prompt = m.tok.encode_prompt("Hello").unwrap();
    let p = sampled(12, 1.0, 3);
    let sp = SpecParams {
        budget: 8,
        mode: None,
        adaptive: true,
        // Every extra row costs as much as a whole pass.
        step_cost: Some(StepCost::from_points(vec![(1, 0.010), (8, 0.080)])),
    };
    let mut d = DistDrafter::new(
        "sampling",
        "2,1".parse().unwrap(),
        ExpandMode::Sample,
        5,
        Box::new(|_: &[u32]| Ok(vec![(1, 0.25), (2, 0.25), (3, 0.25), (4, 0.25)])),
    );
    let o = spec::generate(
        &m.model,
        be,
        &m.tok,
        &prompt,
        &p,
        &sp,
        &mut [&mut d],
        |_| {},
    )
    .unwrap();
    assert_eq!(o.output.tokens.len(), 12);
    // The tree's size still follows the cost (drafting budgets are chosen before any draw: one
    // node here), but every step but the last (its depth capped by the tokens left) verifies
    // what was drafted; a depth chosen from the proposal cut every tree to its root.
    let m = &o.metrics;
    assert!(m.steps >= 3, "{m:?}");
    assert!(m.drafted + 1 >= m.steps, "{m:?}");
}
