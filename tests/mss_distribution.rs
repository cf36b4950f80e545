//! Multi-step speculative sampling (SpecInfer MSS) keeps the LLM's distribution: chi-square tests of the next token and of 3-token continuations on a small-vocabulary model.
//!
//! The LLM is a tiny random model with 8 tokens. Its exact distribution over the next token and
//! over 3-token continuations is computed from its logits (what direct sampling with `Sampler`
//! draws from); 20,000 speculative samples per case are compared with it by a chi-square
//! goodness-of-fit test (fixed seeds, p > 0.001). Drafters: a second random tiny model and
//! synthetic distributions, all different from the LLM and from each other; sampled and top-k
//! children; merged trees of two drafters. A verifier that always accepts would fail (checked).

use std::collections::HashMap;

use arbor_engine::draft::{
    early_exit, DistDrafter, DraftSampling, Drafter, ModelDrafter, NgramDrafter, RecycleDrafter,
    SpaceDrafter, SpaceMode,
};
use arbor_engine::sample::penalty::{Penalties, PenaltyHistory};
use arbor_engine::sample::verify::{Verifier, VerifyMode, VerifyOutcome};
use arbor_engine::sample::{Rng, Sampler, SamplingParams};
use arbor_engine::spec::{self, SpecSession};
use arbor_engine::testing::{tiny_model, TinySpec};
use arbor_engine::tree::{DrawKind, ExpandMode, TokenTree};
use arbor_engine::{BatchMask, CpuBackend, GenerateParams, KvCache, Model};
use statrs::distribution::{ChiSquared, ContinuousCDF};

const VOCAB: usize = 8;
const SAMPLES: usize = 20_000;
const PROMPT: [u32; 4] = [1, 5, 2, 7];

fn tiny_spec() -> TinySpec {
    TinySpec {
        arch: "qwen2",
        n_layers: 2,
        n_embd: 32,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 64,
        vocab: VOCAB,
        context: 64,
        ..TinySpec::default()
    }
}

fn llm() -> Model {
    tiny_model(&tiny_spec(), 2024).unwrap()
}

fn backend() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

fn sampling(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p: 0.0,
        seed: 0,
    }
}

/// Logits after `ctx` (full recomputation).
fn logits_after(model: &Model, be: &CpuBackend, ctx: &[u32]) -> Vec<f32> {
    let mut c = KvCache::new(&model.config, ctx.len());
    let pos: Vec<usize> = (0..ctx.len()).collect();
    model
        .forward(be, &mut c, ctx, &pos, BatchMask::Causal, &[ctx.len() - 1])
        .unwrap()
}

/// The exact distribution (after `pen`, temperature / top-k / top-p) of the LLM's next token
/// after `ctx` (PROMPT then generated tokens).
fn llm_dist(
    model: &Model,
    be: &CpuBackend,
    p: &SamplingParams,
    pen: &Penalties,
    ctx: &[u32],
) -> [f64; VOCAB] {
    let s = Sampler::new(p.clone()).unwrap();
    let mut logits = logits_after(model, be, ctx);
    if !pen.is_off() {
        let mut h = PenaltyHistory::new(*pen, &PROMPT);
        for &t in &ctx[PROMPT.len()..] {
            h.push(t);
        }
        h.penalize_row(&mut logits, &[]);
    }
    let mut out = [0.0; VOCAB];
    for (t, pr) in s.distribution(&logits) {
        out[t as usize] += pr as f64;
    }
    out
}

/// Exact probabilities of (next token) and of (3-token continuation, index t1*64 + t2*8 + t3).
fn exact(model: &Model, be: &CpuBackend, p: &SamplingParams) -> (Vec<f64>, Vec<f64>) {
    exact_penalized(model, be, p, &Penalties::default())
}

/// [`exact`] with penalties.
fn exact_penalized(
    model: &Model,
    be: &CpuBackend,
    p: &SamplingParams,
    pen: &Penalties,
) -> (Vec<f64>, Vec<f64>) {
    let p1 = llm_dist(model, be, p, pen, &PROMPT);
    let mut p3 = vec![0.0; VOCAB * VOCAB * VOCAB];
    for a in 0..VOCAB {
        if p1[a] == 0.0 {
            continue;
        }
        let mut ctx = PROMPT.to_vec();
        ctx.push(a as u32);
        let p2 = llm_dist(model, be, p, pen, &ctx);
        for b in 0..VOCAB {
            if p2[b] == 0.0 {
                continue;
            }
            ctx.push(b as u32);
            let pc = llm_dist(model, be, p, pen, &ctx);
            ctx.pop();
            for c in 0..VOCAB {
                p3[a * 64 + b * 8 + c] = p1[a] * p2[b] * pc[c];
            }
        }
    }
    (p1.to_vec(), p3)
}

/// Chi-square goodness of fit of `counts` against `probs` (cells with expected count < 5 pooled).
/// Returns (chi2, degrees of freedom, p-value). A count in a zero-probability cell gives p = 0.
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize, f64) {
    let n: usize = counts.iter().sum();
    let (mut chi2, mut cells) = (0.0, 0usize);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if p == 0.0 && c > 0 {
            return (f64::INFINITY, 0, 0.0);
        }
        if e < 5.0 {
            pool_o += c as f64;
            pool_e += e;
        } else {
            chi2 += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pool_e > 0.0 {
        chi2 += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    let df = cells.saturating_sub(1).max(1);
    let p = ChiSquared::new(df as f64)
        .expect("positive degrees of freedom")
        .sf(chi2);
    (chi2, df, p)
}

/// A synthetic drafter distribution: a deterministic function of the context, far from the LLM.
fn synthetic(ctx: &[u32], salt: u64, peak: f32) -> Vec<(u32, f32)> {
    let mut h = Rng::new(
        ctx.iter()
            .fold(salt, |a, &t| a.wrapping_mul(31).wrapping_add(t as u64)),
    );
    let top = (h.next_u64() % VOCAB as u64) as u32;
    (0..VOCAB as u32)
        .map(|t| {
            let base = 0.2 + h.next_f64() as f32;
            (t, if t == top { base + peak } else { base })
        })
        .collect()
}

/// A drafter backed by its own random tiny model (distributions memoized per context).
fn model_drafter(config: &str, mode: ExpandMode, seed: u64) -> DistDrafter {
    let draft = tiny_model(&tiny_spec(), 77).unwrap();
    let be = backend();
    let mut memo: HashMap<Vec<u32>, Vec<(u32, f32)>> = HashMap::new();
    DistDrafter::new(
        "tiny-model",
        config.parse().unwrap(),
        mode,
        seed,
        Box::new(move |ctx: &[u32]| {
            Ok(memo
                .entry(ctx.to_vec())
                .or_insert_with(|| {
                    let s = Sampler::new(sampling(1.0, 0, 1.0)).unwrap();
                    s.distribution(&logits_after(&draft, &be, ctx))
                })
                .clone())
        }),
    )
}

fn synthetic_drafter(
    config: &str,
    mode: ExpandMode,
    seed: u64,
    salt: u64,
    peak: f32,
) -> DistDrafter {
    DistDrafter::new(
        "synthetic",
        config.parse().unwrap(),
        mode,
        seed,
        Box::new(move |ctx: &[u32]| Ok(synthetic(ctx, salt, peak))),
    )
}

/// The K/V of PROMPT without its last token (the first root).
fn prefix_cache(model: &Model, be: &CpuBackend) -> KvCache {
    let mut base = KvCache::new(&model.config, 64);
    let n = PROMPT.len() - 1;
    let pos: Vec<usize> = (0..n).collect();
    model
        .forward(be, &mut base, &PROMPT[..n], &pos, BatchMask::Causal, &[])
        .unwrap();
    base
}

/// Draw `SAMPLES` speculative continuations of PROMPT (3 tokens each): the root is the prompt's
/// last token, so even the first token comes from tree verification.
fn speculative_counts(
    mode: VerifyMode,
    params: &SamplingParams,
    drafters: &mut [&mut dyn Drafter],
    budget: usize,
) -> (Vec<usize>, Vec<usize>, f64) {
    speculative_counts_penalized(mode, params, &Penalties::default(), drafters, budget)
}

/// [`speculative_counts`] with penalties (PROMPT is the prompt).
fn speculative_counts_penalized(
    mode: VerifyMode,
    params: &SamplingParams,
    pen: &Penalties,
    drafters: &mut [&mut dyn Drafter],
    budget: usize,
) -> (Vec<usize>, Vec<usize>, f64) {
    let model = llm();
    let be = backend();
    let base = prefix_cache(&model, &be);
    let mut verifier = Verifier::new(
        mode,
        SamplingParams {
            seed: 99,
            ..params.clone()
        },
    )
    .unwrap();
    let (mut c1, mut c3) = (vec![0usize; VOCAB], vec![0usize; VOCAB * VOCAB * VOCAB]);
    let mut accepted = 0usize;
    let mut steps = 0usize;
    for _ in 0..SAMPLES {
        let mut s =
            SpecSession::new(&model, &be, base.clone(), PROMPT.to_vec(), verifier, budget).unwrap();
        let with = GenerateParams {
            penalties: *pen,
            ..GenerateParams::default()
        };
        s.set_penalties(&with, PROMPT.len(), None).unwrap();
        while s.tokens().len() < PROMPT.len() + 3 {
            s.step(drafters, 4).unwrap();
        }
        let t = &s.tokens()[PROMPT.len()..PROMPT.len() + 3];
        c1[t[0] as usize] += 1;
        c3[t[0] as usize * 64 + t[1] as usize * 8 + t[2] as usize] += 1;
        accepted += s.metrics().accepted;
        steps += s.metrics().steps;
        verifier = s.into_verifier();
    }
    (c1, c3, accepted as f64 / steps as f64)
}

fn assert_matches_llm(name: &str, params: &SamplingParams, c1: &[usize], c3: &[usize]) {
    assert_matches_llm_penalized(name, params, &Penalties::default(), c1, c3)
}

fn assert_matches_llm_penalized(
    name: &str,
    params: &SamplingParams,
    pen: &Penalties,
    c1: &[usize],
    c3: &[usize],
) {
    let model = llm();
    let be = backend();
    let (p1, p3) = exact_penalized(&model, &be, params, pen);
    let (x1, df1, pv1) = chi_square(c1, &p1);
    let (x3, df3, pv3) = chi_square(c3, &p3);
    eprintln!(
        "{name}: next token chi2 {x1:.1} (df {df1}, p {pv1:.3}); 3-token chi2 {x3:.1} (df {df3}, p {pv3:.3})"
    );
    assert!(
        pv1 > 0.001,
        "{name}: next token p = {pv1} (chi2 {x1}, df {df1}), counts {c1:?}"
    );
    assert!(
        pv3 > 0.001,
        "{name}: 3-token p = {pv3} (chi2 {x3}, df {df3})"
    );
}

#[test]
fn chi_square_helper_is_calibrated() {
    // A perfect fit.
    let (x, df, p) = chi_square(&[50, 50], &[0.5, 0.5]);
    assert_eq!((x, df), (0.0, 1));
    assert!((p - 1.0).abs() < 1e-12, "{p}");
    // chi2 = 2 * 20^2 / 50 = 16 on 1 df: p = erfc(sqrt(8)) = 6.334e-5.
    let (x, df, p) = chi_square(&[30, 70], &[0.5, 0.5]);
    assert_eq!((x, df), (16.0, 1));
    assert!((p - 6.334e-5).abs() < 1e-8, "{p}");
    // Cells expecting fewer than 5 are pooled (2 + 2 -> one cell expecting 4): chi2 =
    // 6^2 / 36 + 6^2 / 4 = 10 on 2 df, p = e^-5.
    let (x, df, p) = chi_square(&[60, 30, 5, 5], &[0.6, 0.36, 0.02, 0.02]);
    assert_eq!(df, 2);
    assert!((x - 10.0).abs() < 1e-9, "{x}");
    assert!((p - (-5.0f64).exp()).abs() < 1e-9, "{p}");
    // A count where the LLM has no mass: rejected outright.
    assert_eq!(chi_square(&[1, 99], &[0.0, 1.0]).2, 0.0);
}

#[test]
fn mss_one_model_drafter_matches_llm() {
    let params = sampling(1.0, 0, 1.0);
    let mut d = model_drafter("3,2,1", ExpandMode::Sample, 5);
    let (c1, c3, acc) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut d], 16);
    eprintln!("one drafter: mean accepted {acc:.2}");
    assert!(acc > 0.3, "the drafter should be accepted sometimes: {acc}");
    assert_matches_llm("mss, one drafter", &params, &c1, &c3);
}

#[test]
fn mss_two_different_drafters_merged_matches_llm() {
    let params = sampling(1.0, 0, 1.0);
    let mut a = model_drafter("2,1,1", ExpandMode::Sample, 6);
    let mut b = synthetic_drafter("1,2,1", ExpandMode::Sample, 7, 3, 3.0);
    let (c1, c3, acc) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut a, &mut b], 16);
    eprintln!("two drafters: mean accepted {acc:.2}");
    assert_matches_llm("mss, two drafters", &params, &c1, &c3);
}

#[test]
fn mss_with_top_k_top_p_temperature_and_picked_children_matches_llm() {
    // Temperature, top-k and top-p reshape p_LLM; one drafter samples, the other picks its top-2.
    let params = sampling(0.8, 6, 0.9);
    let mut a = synthetic_drafter("2,2,1", ExpandMode::Sample, 8, 11, 2.0);
    let mut b = synthetic_drafter("2,1,1", ExpandMode::TopK, 9, 12, 1.0);
    let (c1, c3, _) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut a, &mut b], 20);
    assert_matches_llm("mss, top-k/top-p, sampled + picked", &params, &c1, &c3);
}

#[test]
fn mss_with_min_p_matches_llm() {
    // Min-p cuts p_LLM's tail (then top-p on what is left); the sampled drafter's own
    // distribution keeps its tail, so its draws there are always rejected.
    let params = SamplingParams {
        min_p: 0.15,
        ..sampling(0.9, 0, 0.95)
    };
    let mut a = synthetic_drafter("2,2,1", ExpandMode::Sample, 14, 15, 2.0);
    let (c1, c3, _) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut a], 20);
    assert_matches_llm("mss, min-p + top-p", &params, &c1, &c3);
}

#[test]
fn mss_with_penalties_matches_the_penalized_llm() {
    // Repetition, frequency and presence penalties reshape every row by its own history: the
    // tree's rows by their paths. The drafter knows nothing of them.
    let params = sampling(0.9, 0, 1.0);
    let pen = Penalties {
        repetition: 1.6,
        frequency: 0.6,
        presence: 0.4,
    };
    let mut a = synthetic_drafter("2,2,1", ExpandMode::Sample, 16, 17, 2.0);
    let mut b = synthetic_drafter("2,1,1", ExpandMode::TopK, 18, 19, 1.0);
    let (c1, c3, acc) =
        speculative_counts_penalized(VerifyMode::Mss, &params, &pen, &mut [&mut a, &mut b], 20);
    assert!(acc > 0.3, "drafts were accepted ({acc} per step)");
    assert_matches_llm_penalized("mss, penalties", &params, &pen, &c1, &c3);
    // The penalties change the distribution these counts must match.
    let model = llm();
    let (_, plain) = exact(&model, &backend(), &params);
    let (_, penalized) = exact_penalized(&model, &backend(), &params, &pen);
    let tv: f64 = plain
        .iter()
        .zip(&penalized)
        .map(|(a, b)| (a - b).abs())
        .sum::<f64>()
        / 2.0;
    assert!(tv > 0.1, "penalties move the 3-token distribution ({tv})");
}

#[test]
fn naive_sampling_matches_llm() {
    let params = sampling(1.0, 0, 1.0);
    let mut a = model_drafter("3,2,1", ExpandMode::TopK, 10);
    let (c1, c3, _) = speculative_counts(VerifyMode::Naive, &params, &mut [&mut a], 24);
    assert_matches_llm("naive", &params, &c1, &c3);
}

/// SPACE, training-free (Jacobi placeholders) with sampled candidates: each candidate is a draw
/// from its placeholder row's distribution, so a rejection draws from norm(max(0, p - q)).
#[test]
fn space_jacobi_sampled_matches_llm() {
    let params = sampling(1.0, 0, 1.0);
    let mut d = SpaceDrafter::new(
        3,
        SpaceMode::Jacobi,
        DraftSampling::Sample(params.clone()),
        VOCAB,
        3,
    )
    .unwrap();
    let (c1, c3, acc) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut d], 8);
    eprintln!("space jacobi: mean accepted {acc:.2}");
    assert!(
        acc > 0.1,
        "SPACE candidates should be accepted sometimes: {acc}"
    );
    assert_matches_llm("mss, SPACE training-free", &params, &c1, &c3);
}

/// SPACE with a mask token and picked (top-1) candidates, under temperature and top-k, merged
/// with a sampling drafter.
#[test]
fn space_mask_token_matches_llm() {
    let params = sampling(0.8, 6, 1.0);
    let mut d =
        SpaceDrafter::new(2, SpaceMode::MaskToken(7), DraftSampling::TopK, VOCAB, 4).unwrap();
    let mut other = synthetic_drafter("2,1", ExpandMode::Sample, 13, 9, 2.0);
    let (c1, c3, _) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut d, &mut other], 8);
    assert_matches_llm("mss, SPACE mask token + synthetic", &params, &c1, &c3);
}

/// The test has power: a verifier that accepts a proposed child regardless of the ratio (here:
/// always the first candidate of a node) produces the drafter's distribution, which the same
/// chi-square test rejects; the real MSS on the very same trees passes.
#[test]
fn always_accept_bug_is_detected() {
    let mut d = synthetic_drafter("1,1,1", ExpandMode::Sample, 21, 5, 3.0);
    bug_vs_mss(
        "always-accept",
        &mut d,
        3,
        8,
        [1, 2],
        |tree, logits, sampler, rng| always_accept(tree, logits, sampler, rng).emitted()[0],
    );
}

/// The SPACE paper's reference code draws from p after a rejection instead of from the residual
/// norm(max(0, p - q)). That rule is biased, and the same chi-square test catches it on a
/// one-candidate chain; MSS on the very same drafts passes.
#[test]
fn resampling_from_p_after_rejection_is_detected() {
    let mut d = synthetic_drafter("1", ExpandMode::Sample, 31, 5, 3.0);
    bug_vs_mss(
        "resample-from-p",
        &mut d,
        1,
        1,
        [3, 4],
        |tree, logits, sampler, rng| {
            let child = tree.children(0)[0];
            let x = tree.node(child).token;
            let q = tree
                .child_dist(0, tree.node(child).proposals[0].drafter)
                .unwrap();
            let qx = q.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1 as f64);
            let p = sampler.distribution(&logits[..VOCAB]);
            let px = p.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1 as f64);
            if rng.next_f64() < (px / qx).min(1.0) {
                return x;
            }
            // The bug: a fresh draw from p.
            let mut u = rng.next_f64();
            for &(t, pt) in &p {
                u -= pt as f64;
                if u < 0.0 {
                    return t;
                }
            }
            p[0].0
        },
    );
}

/// Power check shared by the bug tests: on `SAMPLES` trees from `d` (depth `depth`, `budget`
/// nodes), the first token the buggy rule `bug` emits must fail the chi-square test against the
/// LLM (p < 1e-6) while MSS verification of the very same trees passes (p > 0.001).
/// `seeds` = [verifier, bug].
fn bug_vs_mss(
    name: &str,
    d: &mut DistDrafter,
    depth: usize,
    budget: usize,
    seeds: [u64; 2],
    mut bug: impl FnMut(&TokenTree, &[f32], &Sampler, &mut Rng) -> u32,
) {
    let params = sampling(1.0, 0, 1.0);
    let model = llm();
    let be = backend();
    let base = prefix_cache(&model, &be);
    let mut verifier = Verifier::new(
        VerifyMode::Mss,
        SamplingParams {
            seed: seeds[0],
            ..params.clone()
        },
    )
    .unwrap();
    let sampler = Sampler::new(params.clone()).unwrap();
    let mut rng = Rng::new(seeds[1]);
    let (mut good, mut bad) = (vec![0usize; VOCAB], vec![0usize; VOCAB]);
    for _ in 0..SAMPLES {
        let mut s =
            SpecSession::new(&model, &be, base.clone(), PROMPT.to_vec(), verifier, budget).unwrap();
        let tree = s.draft(&mut [&mut *d], depth).unwrap();
        let mut c = base.clone();
        let logits = spec::tree_logits(&model, &be, &mut c, &tree).unwrap();
        bad[bug(&tree, &logits, &sampler, &mut rng) as usize] += 1;
        let o = s.verify(&tree, &mut [&mut *d]).unwrap();
        good[o.emitted()[0] as usize] += 1;
        verifier = s.into_verifier();
    }
    let (p1, _) = exact(&model, &be, &params);
    let (_, _, p_good) = chi_square(&good, &p1);
    let (x_bad, _, p_bad) = chi_square(&bad, &p1);
    eprintln!("{name}: chi2 {x_bad:.1}, p {p_bad:e}; mss p {p_good:.3}");
    assert!(p_good > 0.001, "mss: p {p_good}, counts {good:?}");
    assert!(
        p_bad < 1e-6,
        "{name} must be detected: p {p_bad}, counts {bad:?}"
    );
}

/// The bug: accept the first proposed child of every node; bonus sampled from the LLM at the end.
fn always_accept(
    tree: &TokenTree,
    logits: &[f32],
    sampler: &Sampler,
    rng: &mut Rng,
) -> VerifyOutcome {
    let (mut accepted, mut tokens) = (Vec::new(), Vec::new());
    let mut node = 0;
    while let Some(&c) = tree.children(node).first() {
        assert_eq!(tree.node(c).proposals[0].kind, DrawKind::Sampled);
        accepted.push(c);
        tokens.push(tree.node(c).token);
        node = c;
    }
    let dist = sampler.distribution(&logits[node * VOCAB..(node + 1) * VOCAB]);
    let mut u = rng.next_f64();
    let mut bonus = dist[0].0;
    for &(t, p) in &dist {
        u -= p as f64;
        if u < 0.0 {
            bonus = t;
            break;
        }
    }
    VerifyOutcome {
        accepted,
        tokens,
        bonus,
        broken_drafters: Vec::new(),
    }
}

/// Token Recycling (picked candidates from a matrix every verified row refills; one matrix over
/// all the samples, as a server shares it) merged with prompt lookup: its guesses are accepted,
/// the LLM's distribution is kept.
#[test]
fn mss_token_recycling_matches_llm() {
    let params = sampling(0.9, 0, 1.0);
    let mut recycle = RecycleDrafter::new(VOCAB, 4).unwrap();
    let (c1, c3, acc) = speculative_counts(VerifyMode::Mss, &params, &mut [&mut recycle], 16);
    eprintln!("recycle: mean accepted {acc:.2}");
    assert!(
        acc > 0.2,
        "recycled candidates should be accepted sometimes: {acc}"
    );
    assert_matches_llm("mss, recycle", &params, &c1, &c3);
    let mut ng = NgramDrafter::default();
    let (c1, c3, _) =
        speculative_counts(VerifyMode::Mss, &params, &mut [&mut recycle, &mut ng], 16);
    assert_matches_llm("mss, recycle + ngram", &params, &c1, &c3);
}

/// Real drafters merged: a small model sampling its children (with its own KV cache), the LLM's
/// first layer picking top-k children (early exit) and prompt lookup.
#[test]
fn mss_real_drafters_merged_matches_llm() {
    let params = sampling(0.9, 0, 1.0);
    let target = llm();
    let draft = tiny_model(&tiny_spec(), 77).unwrap();
    let be = backend();
    let mut ssm = ModelDrafter::ssm(
        "ssm",
        &draft,
        &target,
        &be,
        "2,2,1".parse().unwrap(),
        DraftSampling::Sample(sampling(1.0, 0, 1.0)),
        5,
    )
    .unwrap();
    let mut ee = early_exit(
        &target,
        &be,
        1,
        "1,1,1".parse().unwrap(),
        DraftSampling::TopK,
        6,
    )
    .unwrap();
    let mut ng = NgramDrafter::default();
    let (c1, c3, acc) = speculative_counts(
        VerifyMode::Mss,
        &params,
        &mut [&mut ssm, &mut ee, &mut ng],
        24,
    );
    eprintln!("real drafters: mean accepted {acc:.2}");
    assert!(
        acc > 0.3,
        "the drafters should be accepted sometimes: {acc}"
    );
    assert_matches_llm("mss, ssm + early exit + ngram", &params, &c1, &c3);
}

/// Continuous batching with adaptive speculation (prompt lookup, MSS, 64 requests per step,
/// tree depths chosen per step): the 3-token continuations of 20,000 requests with distinct seeds
/// follow the LLM's exact joint distribution (chi-square), while trees were really verified.
#[test]
fn batched_adaptive_speculation_keeps_the_llm_distribution() {
    use arbor_engine::sched::{Finish, RequestSpec, SchedConfig, Scheduler, SpecPolicy, StepCost};
    use arbor_engine::{GenerateParams, KvPool};
    let model = llm();
    let be = backend();
    let p = sampling(1.0, 0, 1.0);
    let (_, p3) = exact(&model, &be, &p);
    let pool = KvPool::new(&model.config, model.config.n_layers, 256);
    let config = SchedConfig {
        max_running: 64,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(&model, None, pool.clone(), config).unwrap();
    // Rows nearly free: the policy verifies trees wherever a draft has a chance.
    s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (512, 0.011)]));
    s.freeze_step_cost = true;
    for i in 0..SAMPLES {
        let params = GenerateParams {
            max_tokens: 3,
            sampling: SamplingParams {
                seed: 1000 + i as u64,
                ..p.clone()
            },
            ..GenerateParams::default()
        };
        let spec = RequestSpec {
            drafters: vec![Box::new(NgramDrafter::default())],
            budget: 4,
            policy: SpecPolicy::Adaptive,
            mode: Some(VerifyMode::Mss),
            external: false,
            candidates: 0,
            prompt_candidates: 0,
            max_nodes_by_depth: Vec::new(),
        };
        s.submit_spec(PROMPT.to_vec(), params, Some(spec)).unwrap();
    }
    let mut counts = vec![0usize; VOCAB * VOCAB * VOCAB];
    let (mut drafted, mut accepted) = (0, 0);
    for (_, f) in s.run_to_completion(&be).unwrap() {
        match f {
            Finish::Done { tokens, spec, .. } => {
                assert_eq!(tokens.len(), 3);
                counts[tokens[0] as usize * 64 + tokens[1] as usize * 8 + tokens[2] as usize] += 1;
                let m = spec.expect("speculating request");
                drafted += m.drafted;
                accepted += m.accepted;
            }
            Finish::Failed(e) => panic!("{e}"),
        }
    }
    assert!(
        drafted > SAMPLES / 2 && accepted > SAMPLES / 20,
        "drafted {drafted}, accepted {accepted}"
    );
    let (chi2, df, pv) = chi_square(&counts, &p3);
    assert!(pv > 1e-3, "chi2 {chi2} on {df} df: p = {pv}");
    assert_eq!(pool.stats().used, 0);
}
