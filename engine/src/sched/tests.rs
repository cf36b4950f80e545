use super::*;
use crate::backend::CpuBackend;
use crate::quant::GgmlType;
use crate::sample::json::JsonState;
use crate::sample::SamplingParams;
use crate::testing::{tiny_model, TinySpec};

fn spec(arch: &'static str, ty: GgmlType) -> TinySpec {
    TinySpec {
        arch,
        n_embd: 256,
        n_ff: 512,
        n_head: 4,
        n_head_kv: 2,
        weight_type: ty,
        ..TinySpec::default()
    }
}

/// Prompts of mixed lengths (one longer than a prefill chunk) and their token budgets.
fn workload(vocab: u32) -> Vec<(Vec<u32>, usize)> {
    [
        (3usize, 20usize),
        (17, 9),
        (70, 12),
        (40, 25),
        (5, 1),
        (33, 16),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(n, m))| {
        let p = (0..n as u32)
            .map(|j| (j * 31 + i as u32 * 17 + 3) % vocab)
            .collect();
        (p, m)
    })
    .collect()
}

/// JSON fragments the tiny models' tokens stand for in JSON mode.
const JSON_PIECES: [&str; 24] = [
    "{", "}", "[", "]", "\"", ":", ",", " ", "\n", "0", "1", "-", ".", "e", "a", "b", "true",
    "null", "\"a\"", "\":", "{\"", "}\n", "\\", "x",
];

/// A JSON-mode vocabulary for a tiny model of `vocab` tokens: token `i` is
/// `JSON_PIECES[i % 24]`, every 11th token a control token, the last one ends generation.
fn tiny_json_vocab(vocab: usize) -> Arc<JsonVocab> {
    let pieces = (0..vocab)
        .map(|i| (i % 11 != 10 && i + 1 < vocab).then(|| JSON_PIECES[i % 24].as_bytes().to_vec()))
        .collect();
    Arc::new(JsonVocab::new(pieces, vec![vocab as u32 - 1]))
}

/// Incremental decoding of one request with its own sampler (and penalties): the reference.
fn alone(model: &Model, be: &CpuBackend, prompt: &[u32], params: &GenerateParams) -> Vec<u32> {
    alone_with_logprobs(model, be, prompt, params).0
}

/// [`alone`] with each token's log-probability under the row it was drawn from.
fn alone_with_logprobs(
    model: &Model,
    be: &CpuBackend,
    prompt: &[u32],
    params: &GenerateParams,
) -> (Vec<u32>, Vec<f32>) {
    let mut cache = KvCache::new(&model.config, prompt.len() + params.max_tokens);
    let mut sampler = Sampler::new(params.sampling.clone()).unwrap();
    let pos: Vec<usize> = (0..prompt.len()).collect();
    let mut logits = model
        .forward(
            be,
            &mut cache,
            prompt,
            &pos,
            BatchMask::Causal,
            &[prompt.len() - 1],
        )
        .unwrap();
    let json = tiny_json_vocab(model.config.vocab_size);
    let mut history = params.logits_history(prompt, Some(&json)).unwrap();
    let (mut out, mut lps) = (Vec::new(), Vec::new());
    while out.len() < params.max_tokens {
        if let Some(h) = &history {
            h.penalize_row(&mut logits, &[]);
        }
        let t = sampler.sample(&logits);
        lps.push(crate::sample::log_softmax_at(&logits, t));
        if let Some(h) = history.as_mut() {
            h.push(t);
        }
        out.push(t);
        if out.len() == params.max_tokens {
            break;
        }
        let p = cache.len();
        logits = model
            .forward(be, &mut cache, &[t], &[p], BatchMask::Causal, &[0])
            .unwrap();
    }
    (out, lps)
}

fn done_tokens(f: &Finish) -> (&[u32], usize) {
    match f {
        Finish::Done {
            tokens,
            preemptions,
            ..
        } => (tokens, *preemptions),
        Finish::Failed(e) => panic!("request failed: {e}"),
    }
}

/// Every request of a batch gets exactly the tokens it gets alone: greedy and seeded sampling,
/// with a roomy pool, with chunked prefill under a small step budget, and with a pool so small
/// that requests are preempted and recomputed. Every block is back in the pool at the end.
#[test]
fn batched_outputs_equal_each_request_alone() {
    let be = CpuBackend::new(2).unwrap();
    for (arch, ty) in [("llama", GgmlType::Q4_K), ("qwen2", GgmlType::Q8_0)] {
        let model = tiny_model(&spec(arch, ty), 3).unwrap();
        let vocab = model.config.vocab_size as u32;
        for sampling in [
            SamplingParams::greedy(),
            SamplingParams {
                temperature: 0.9,
                seed: 42,
                ..SamplingParams::default()
            },
        ] {
            let reqs: Vec<(Vec<u32>, GenerateParams)> = workload(vocab)
                .into_iter()
                .enumerate()
                .map(|(i, (p, m))| {
                    let mut s = sampling.clone();
                    s.seed += i as u64;
                    let params = GenerateParams {
                        max_tokens: m,
                        sampling: s,
                        ..GenerateParams::default()
                    };
                    (p, params)
                })
                .collect();
            let want: Vec<Vec<u32>> = reqs
                .iter()
                .map(|(p, params)| alone(&model, &be, p, params))
                .collect();
            // (pool blocks, step budget, preemptions expected)
            for (blocks, budget, preempts) in [(64, 256, false), (64, 24, false), (9, 64, true)] {
                let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
                let config = SchedConfig {
                    max_step_tokens: budget,
                    ..SchedConfig::default()
                };
                let mut s = Scheduler::new(&model, None, pool.clone(), config).unwrap();
                for (p, params) in &reqs {
                    s.submit(p.clone(), params.clone()).unwrap();
                }
                let done = s.run_to_completion(&be).unwrap();
                assert_eq!(done.len(), reqs.len());
                let mut total_preempt = 0;
                for (id, f) in &done {
                    let (toks, pre) = done_tokens(f);
                    total_preempt += pre;
                    assert_eq!(
                        toks,
                        &want[*id as usize][..],
                        "{arch} {ty:?} T={} pool {blocks} budget {budget}: request {id}",
                        sampling.temperature
                    );
                }
                assert_eq!(total_preempt > 0, preempts, "pool {blocks}: preemptions");
                assert_eq!(s.stats().preemptions as usize, total_preempt);
                // A pool that preempted was full at some step; a roomy one never was.
                let peak = s.stats().peak_blocks;
                assert_eq!(peak == blocks, preempts, "pool {blocks}: peak {peak}");
                assert_eq!(pool.stats().used, 0, "every block back");
            }
        }
    }
}

/// A tiny llama model (`ty` weights), four prompts sharing a 200-token prefix (12 full blocks),
/// and greedy parameters for 8 tokens.
fn shared_prefix_case(ty: GgmlType) -> (Model, Vec<Vec<u32>>, GenerateParams) {
    let model = tiny_model(&spec("llama", ty), 5).unwrap();
    let vocab = model.config.vocab_size as u32;
    let prefix: Vec<u32> = (0..200u32).map(|j| (j * 7 + 1) % vocab).collect();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| {
            let mut p = prefix.clone();
            p.extend((0..5 + i).map(|j| (j * 3 + i * 11) % vocab));
            p
        })
        .collect();
    let params = GenerateParams {
        max_tokens: 8,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    (model, prompts, params)
}

/// A scheduler for [`shared_prefix_case`]'s model over a 128-block pool, and the pool.
fn shared_prefix_scheduler(model: &Model, config: SchedConfig) -> (Scheduler<'_>, KvPool) {
    let pool = KvPool::new(&model.config, model.config.n_layers, 128);
    let s = Scheduler::new(model, None, pool.clone(), config).unwrap();
    (s, pool)
}

/// Requests sharing a 200-token prefix (admitted after the first one's prefill) take its
/// blocks from the prefix cache: fewer blocks at the peak, the same outputs.
#[test]
fn shared_prefixes_use_fewer_blocks_and_change_nothing() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompts, params) = shared_prefix_case(GgmlType::Q4_K);
    let mut results = Vec::new();
    for caching in [false, true] {
        let (mut s, pool) = shared_prefix_scheduler(
            &model,
            SchedConfig {
                prefix_caching: caching,
                ..SchedConfig::default()
            },
        );
        s.submit(prompts[0].clone(), params.clone()).unwrap();
        // The first request's prompt is in the cache once it produced a token.
        let mut events = Vec::new();
        while events.iter().all(|e: &StepEvent| e.tokens.is_empty()) {
            events = s.step(&be).unwrap();
        }
        for p in &prompts[1..] {
            s.submit(p.clone(), params.clone()).unwrap();
        }
        let done = s.run_to_completion(&be).unwrap();
        let cached: Vec<usize> = done
            .iter()
            .map(|(_, f)| match f {
                Finish::Done {
                    cached_prompt_tokens,
                    ..
                } => *cached_prompt_tokens,
                Finish::Failed(e) => panic!("{e}"),
            })
            .collect();
        let toks: Vec<Vec<u32>> = done
            .iter()
            .map(|(_, f)| done_tokens(f).0.to_vec())
            .collect();
        results.push((s.stats().peak_blocks, cached, toks, pool.stats()));
    }
    let (plain, shared) = (&results[0], &results[1]);
    assert_eq!(plain.2, shared.2, "identical outputs");
    for (p, t) in prompts.iter().zip(&shared.2) {
        assert_eq!(t, &alone(&model, &be, p, &params));
    }
    assert_eq!(plain.1, vec![0, 0, 0, 0]);
    // 200 tokens = 12 full blocks (192 tokens) found by every later request.
    assert_eq!(shared.1, vec![0, 192, 192, 192]);
    assert!(
        shared.0 + 3 * 10 <= plain.0,
        "peak blocks: shared {} vs plain {}",
        shared.0,
        plain.0
    );
    assert!(shared.3.prefix_hits >= 36);
}

/// Bad requests are errors at submission; a request larger than the whole pool fails alone
/// with `kv_pool_exhausted` while the others finish; cancelling frees the blocks at once.
#[test]
fn bad_requests_fail_alone_and_cancel_frees_blocks() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 7).unwrap();
    let vocab = model.config.vocab_size as u32;
    let pool = KvPool::new(&model.config, model.config.n_layers, 6);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    let params = GenerateParams {
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    assert!(s.submit(vec![], params.clone()).is_err());
    assert!(s.submit(vec![vocab], params.clone()).is_err());
    let bad_sampling = GenerateParams {
        sampling: SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        },
        ..params.clone()
    };
    assert!(s.submit(vec![1, 2], bad_sampling).is_err());
    let big = s.submit(vec![1; 120], params.clone()).unwrap(); // 8 blocks > 6
    let ok = s.submit(vec![1, 2, 3], params.clone()).unwrap();
    let done = s.run_to_completion(&be).unwrap();
    assert_eq!(done.len(), 2);
    for (id, f) in &done {
        match f {
            Finish::Failed(e) if *id == big => assert_eq!(e.error_type(), "kv_pool_exhausted"),
            Finish::Done { tokens, .. } if *id == ok => {
                assert_eq!(tokens, &alone(&model, &be, &[1, 2, 3], &params))
            }
            other => panic!("request {id}: {other:?}"),
        }
    }
    let id = s.submit(vec![5; 40], params.clone()).unwrap();
    s.step(&be).unwrap();
    assert!(pool.stats().used >= 3);
    let stats = s.cancel(id).expect("known request");
    assert_eq!((stats.cached_prompt_tokens, stats.preemptions), (0, 0));
    assert!(stats.spec.is_none());
    assert!(s.cancel(id).is_none());
    assert_eq!(pool.stats().used, 0);
    assert!(s.is_idle());
    // A max_tokens of usize::MAX is bounded by the pool like any other (the length overflowed).
    let endless = GenerateParams {
        max_tokens: usize::MAX,
        ..params.clone()
    };
    let id = s
        .submit_spec(
            vec![1, 2, 3],
            endless,
            Some(ngram_spec(SpecPolicy::Fixed, 4)),
        )
        .unwrap();
    let done = s.run_to_completion(&be).unwrap();
    match &done[..] {
        [(d, Finish::Done { reason, .. })] if *d == id => {
            assert_eq!(*reason, FinishReason::Length)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(pool.stats().used, 0);
}

/// A pool that holds a request's tokens but not its draft tree on top: the tree shrinks instead
/// of the request failing; a request longer than the whole pool ends with `Length` and the
/// tokens it has (as at the model's context), instead of failing part way.
#[test]
fn a_small_pool_shrinks_trees_and_bounds_requests_like_a_context() {
    let be = CpuBackend::new(2).unwrap();
    // 40 prompt tokens + 20 generated = 60 slots of 4 blocks (64); a 32-node tree needs 5.
    let (model, prompt, params, want) = greedy_case(&be, 11, 40, 3, 20);
    let pool = KvPool::new(&model.config, model.config.n_layers, 4);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    s.submit_spec(
        prompt.clone(),
        params.clone(),
        Some(ngram_spec(SpecPolicy::Fixed, 32)),
    )
    .unwrap();
    let done = s.run_to_completion(&be).unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done_tokens(&done[0].1).0, &want[..]);
    assert!(spec_metrics(&done[0].1).drafted > 0, "drafts were verified");
    assert_eq!(pool.stats().used, 0);
    // 40 + 40 tokens do not fit 3 blocks (48 slots): the output stops at the pool's size.
    let long = GenerateParams {
        max_tokens: 40,
        ..params.clone()
    };
    let want_long = alone(&model, &be, &prompt, &long);
    let pool = KvPool::new(&model.config, model.config.n_layers, 3);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    s.submit(prompt.clone(), long).unwrap();
    let done = s.run_to_completion(&be).unwrap();
    match &done[0].1 {
        Finish::Done { reason, tokens, .. } => {
            assert_eq!(*reason, FinishReason::Length);
            // The cache holds all but the last token: 48 slots, 40 of them the prompt's.
            assert_eq!(tokens.len(), 48 - 40 + 1);
            assert_eq!(tokens[..], want_long[..tokens.len()]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(pool.stats().used, 0);
    // A prompt that fills the whole pool (48 slots) still gets the token its last row gives,
    // whether `max_tokens` or the pool ends it.
    let (model, prompt, _, want) = greedy_case(&be, 11, 48, 3, 1);
    for max_tokens in [1, 5] {
        let pool = KvPool::new(&model.config, model.config.n_layers, 3);
        let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
        let p = GenerateParams {
            max_tokens,
            ..params.clone()
        };
        s.submit(prompt.clone(), p).unwrap();
        let done = s.run_to_completion(&be).unwrap();
        match &done[0].1 {
            Finish::Done { reason, tokens, .. } => {
                assert_eq!(*reason, FinishReason::Length, "max_tokens {max_tokens}");
                assert_eq!(tokens[..], want[..1], "max_tokens {max_tokens}");
            }
            other => panic!("max_tokens {max_tokens}: {other:?}"),
        }
        assert_eq!(pool.stats().used, 0);
    }
}

/// Admission reserves what it admits: two 40-token prompts (3 blocks each) in a pool of 5 are
/// admitted one after the other, not both at once and the second preempted by the first plan.
#[test]
fn admission_does_not_admit_what_the_step_must_preempt() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompt, params, want) = greedy_case(&be, 12, 40, 5, 4);
    let pool = KvPool::new(&model.config, model.config.n_layers, 5);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    for _ in 0..2 {
        s.submit(prompt.clone(), params.clone()).unwrap();
    }
    let done = s.run_to_completion(&be).unwrap();
    assert_eq!(done.len(), 2);
    for (_, f) in &done {
        assert_eq!(done_tokens(f), (&want[..], 0));
    }
    assert_eq!(s.stats().preemptions, 0);
    assert_eq!(pool.stats().used, 0);
}

/// `max_step_tokens` caps every step's rows where more requests run than it holds (prompts wait
/// for room beside the decoding roots), and every request still gets its own tokens.
#[test]
fn the_step_budget_is_a_hard_cap_on_rows() {
    let be = CpuBackend::new(2).unwrap();
    let (model, _, params, _) = greedy_case(&be, 12, 5, 1, 6);
    let vocab = model.config.vocab_size as u32;
    let pool = KvPool::new(&model.config, model.config.n_layers, 64);
    let config = SchedConfig {
        max_step_tokens: 4,
        max_running: 8,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(&model, None, pool.clone(), config).unwrap();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| repetitive(vocab, 3, i)).collect();
    for p in &prompts {
        s.submit(p.clone(), params.clone()).unwrap();
    }
    let mut done = Vec::new();
    let mut steps = 0;
    while !s.is_idle() {
        steps += 1;
        assert!(steps < 200, "no progress in 200 steps");
        let rows = s.stats().rows;
        for ev in s.step(&be).unwrap() {
            if let Some(f) = ev.finish {
                done.push((ev.id, done_tokens(&f).0.to_vec()));
            }
        }
        let step_rows = s.stats().rows - rows;
        assert!(step_rows <= 4, "step {steps}: {step_rows} rows");
    }
    done.sort_by_key(|(id, _)| *id);
    assert_eq!(done.len(), 8);
    for ((_, got), p) in done.iter().zip(&prompts) {
        assert_eq!(got, &alone(&model, &be, p, &params));
    }
    assert_eq!(pool.stats().used, 0);
}

/// Sampled fixed trees (verified whole) that would fill every step leave room for a prompt
/// being prefilled: a newly arrived request gets its first token in its first step instead of
/// waiting for the speculating requests to finish; their tokens stay their own alone.
#[test]
fn whole_trees_leave_room_for_prefill() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let vocab = model.config.vocab_size as u32;
    let sampled = |i: u64| GenerateParams {
        max_tokens: 24,
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 100 + i,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    };
    let config = SchedConfig {
        max_step_tokens: 16,
        ..SchedConfig::default()
    };
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| repetitive(vocab, 4, i)).collect();
    let run = |late: Option<&[u32]>| -> Vec<Vec<u32>> {
        let pool = KvPool::new(&model.config, model.config.n_layers, 128);
        let mut s = Scheduler::new(&model, None, pool, config.clone()).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            // Two roots with 7-node trees: 16 rows, the whole step.
            let spec = ngram_spec(SpecPolicy::Fixed, 7);
            s.submit_spec(p.clone(), sampled(i as u64), Some(spec))
                .unwrap();
        }
        let mut done = Vec::new();
        let collect = |evs: Vec<StepEvent>, done: &mut Vec<(u64, Vec<u32>)>| {
            for ev in evs {
                if let Some(f) = ev.finish {
                    done.push((ev.id, done_tokens(&f).0.to_vec()));
                }
            }
        };
        // Both prompts in one step, then one decoding step.
        for _ in 0..2 {
            let evs = s.step(&be).unwrap();
            collect(evs, &mut done);
        }
        if let Some(p) = late {
            let id = s.submit(p.to_vec(), sampled(7)).unwrap();
            let evs = s.step(&be).unwrap();
            assert!(
                evs.iter().any(|ev| ev.id == id && !ev.tokens.is_empty()),
                "the new request got no token in its first step"
            );
            collect(evs, &mut done);
        }
        while !s.is_idle() {
            let evs = s.step(&be).unwrap();
            collect(evs, &mut done);
        }
        done.sort_by_key(|(id, _)| *id);
        done.into_iter().map(|(_, t)| t).collect()
    };
    let alone = run(None);
    let late = repetitive(vocab, 6, 5);
    let with_late = run(Some(&late));
    assert_eq!(with_late.len(), 3);
    assert_eq!(&with_late[..2], &alone[..]);
}

/// Sampled requests `which` in steps of 16 rows, run to idle (request `i`: a 4-token repetitive
/// prompt, seed `seed + i`, `max_tokens`, speculation from `spec`): per request, its tokens and
/// the most steps between two of its events.
fn sampled_in_small_steps<'a>(
    model: &'a Model,
    be: &CpuBackend,
    which: &[u64],
    (max_tokens, seed): (usize, u64),
    spec: impl Fn() -> RequestSpec<'a>,
) -> Vec<(Vec<u32>, usize)> {
    let vocab = model.config.vocab_size as u32;
    let config = SchedConfig {
        max_step_tokens: 16,
        ..SchedConfig::default()
    };
    let pool = KvPool::new(&model.config, model.config.n_layers, 128);
    let mut s = Scheduler::new(model, None, pool, config).unwrap();
    for &i in which {
        let params = GenerateParams {
            max_tokens,
            sampling: SamplingParams {
                temperature: 0.8,
                seed: seed + i,
                ..SamplingParams::default()
            },
            ..GenerateParams::default()
        };
        s.submit_spec(repetitive(vocab, 4, i as u32), params, Some(spec()))
            .unwrap();
    }
    let mut out = vec![(Vec::new(), 0usize, None::<usize>); which.len()];
    let mut step = 0;
    while !s.is_idle() {
        step += 1;
        assert!(step < 500, "no progress in 500 steps");
        for ev in s.step(be).unwrap() {
            let o = &mut out[ev.id as usize];
            if let Some(last) = o.2 {
                o.1 = o.1.max(step - last);
            }
            o.2 = Some(step);
            if let Some(f) = ev.finish {
                o.0 = done_tokens(&f).0.to_vec();
            }
        }
    }
    out.into_iter().map(|(t, gap, _)| (t, gap)).collect()
}

/// Sampled fixed trees (verified whole) that do not all fit a step take turns: no request waits
/// more than a step for the others (the newest used to wait until the older ones finished), and
/// each one's tokens are its own alone.
#[test]
fn whole_trees_take_turns() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    // Three roots with 7-node trees (8 rows each) in steps of 16 rows: two fit a step.
    let run = |which: &[u64]| {
        sampled_in_small_steps(&model, &be, which, (20, 200), || {
            ngram_spec(SpecPolicy::Fixed, 7)
        })
    };
    let together = run(&[0, 1, 2]);
    for (i, (tokens, gap)) in together.iter().enumerate() {
        assert_eq!(tokens.len(), 20);
        assert!(*gap <= 2, "request {i} waited {gap} steps between events");
        assert_eq!(&run(&[i as u64])[0].0, tokens, "request {i}");
    }
}

/// Rows are reserved for a whole tree by what its drafters can propose (`Drafter::max_nodes`),
/// not by the budget: four sampled requests whose prompt lookup proposes at most two nodes share
/// every 16-row step (reserving their budget of 15 nodes, one request ran per step), and each
/// one's tokens are its own alone.
#[test]
fn whole_trees_reserve_what_their_drafters_can_propose() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let run = |which: &[u64]| {
        sampled_in_small_steps(&model, &be, which, (16, 300), || {
            // One match, two tokens: at most two draft nodes.
            let ngram = crate::draft::NgramDrafter::new(3, 1, 2, 1).unwrap();
            in_process_spec(vec![Box::new(ngram)], SpecPolicy::Fixed, 15)
        })
    };
    let together = run(&[0, 1, 2, 3]);
    for (i, (tokens, gap)) in together.iter().enumerate() {
        assert_eq!(tokens.len(), 16);
        assert_eq!(*gap, 1, "request {i} waited {gap} steps between events");
        assert_eq!(&run(&[i as u64])[0].0, tokens, "request {i}");
    }
}

/// A prompt that repeats itself, so prompt lookup finds matches.
fn repetitive(vocab: u32, n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|j| ((j % 9) * 5 + salt) % vocab)
        .collect()
}

/// A tiny Q8_0 qwen2 model (`seed`), a repetitive prompt of `n` tokens (`salt`), greedy
/// parameters for `max_tokens` tokens, and the model's own output for them.
fn greedy_case(
    be: &CpuBackend,
    seed: u64,
    n: usize,
    salt: u32,
    max_tokens: usize,
) -> (Model, Vec<u32>, GenerateParams, Vec<u32>) {
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), seed).unwrap();
    let prompt = repetitive(model.config.vocab_size as u32, n, salt);
    let params = GenerateParams {
        max_tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    let want = alone(&model, be, &prompt, &params);
    (model, prompt, params, want)
}

fn ngram_spec<'a>(policy: SpecPolicy, budget: usize) -> RequestSpec<'a> {
    in_process_spec(
        vec![Box::new(crate::draft::NgramDrafter::default())],
        policy,
        budget,
    )
}

/// In-process speculation with `drafters`.
fn in_process_spec<'a>(
    drafters: Vec<Box<dyn Drafter + 'a>>,
    policy: SpecPolicy,
    budget: usize,
) -> RequestSpec<'a> {
    RequestSpec {
        drafters,
        budget,
        policy,
        mode: None,
        external: false,
        candidates: 0,
        prompt_candidates: 0,
        max_nodes_by_depth: Vec::new(),
    }
}

fn spec_metrics(f: &Finish) -> SpecMetrics {
    match f {
        Finish::Done { spec: Some(m), .. } => m.clone(),
        other => panic!("no speculation metrics: {other:?}"),
    }
}

/// Five repetitive prompts (request `i`: greedy, `base_tokens + 3 i` tokens) in one scheduler over
/// `blocks` KV blocks with the step cost of a machine where rows are cheap; request `i % 3 == 0`
/// plain, 1 with fixed and 2 with adaptive speculation from `spec(i, policy)`. Every output must
/// equal the request's alone, 12 blocks must preempt, the pool must be full again. Returns the
/// speculating requests' metrics.
fn mixed_batch_keeps_outputs<'a>(
    model: &'a Model,
    be: &CpuBackend,
    blocks: usize,
    base_tokens: usize,
    mut spec: impl FnMut(usize, SpecPolicy) -> RequestSpec<'a>,
) -> Vec<SpecMetrics> {
    let vocab = model.config.vocab_size as u32;
    let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
    let mut s = Scheduler::new(model, None, pool.clone(), SchedConfig::default()).unwrap();
    s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (64, 0.012)]));
    let mut want = Vec::new();
    for i in 0..5usize {
        let p = repetitive(vocab, 20 + 9 * i, i as u32);
        let params = GenerateParams {
            max_tokens: base_tokens + 3 * i,
            sampling: SamplingParams::greedy(),
            ..GenerateParams::default()
        };
        want.push(alone(model, be, &p, &params));
        let sp = match i % 3 {
            0 => None,
            1 => Some(spec(i, SpecPolicy::Fixed)),
            _ => Some(spec(i, SpecPolicy::Adaptive)),
        };
        s.submit_spec(p, params, sp).unwrap();
    }
    let done = s.run_to_completion(be).unwrap();
    let mut metrics = Vec::new();
    for (id, f) in &done {
        assert_eq!(
            done_tokens(f).0,
            &want[*id as usize][..],
            "pool {blocks} request {id}"
        );
        if id % 3 != 0 {
            metrics.push(spec_metrics(f));
        }
    }
    if blocks == 12 {
        assert!(s.stats().preemptions > 0);
    }
    assert_eq!(pool.stats().used, 0);
    metrics
}

/// Speculating requests (prompt lookup; fixed trees and the adaptive policy) batched with
/// plain ones give every request its incremental greedy tokens, also under preemption; with
/// seeded sampling and fixed trees each request's tokens are the same alone or batched.
#[test]
fn speculating_requests_in_a_batch_keep_their_outputs() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| repetitive(vocab, 20 + 9 * i as usize, i))
        .collect();
    for blocks in [128usize, 12] {
        let metrics =
            mixed_batch_keeps_outputs(&model, &be, blocks, 10, |_, policy| ngram_spec(policy, 8));
        let drafted: usize = metrics.iter().map(|m| m.drafted).sum();
        assert!(drafted > 0, "trees were verified");
    }
    // Sampling, fixed trees: alone (a scheduler of one) or batched, the same tokens.
    let sampled = |i: usize| GenerateParams {
        max_tokens: 16,
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 100 + i as u64,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    };
    let run_in = |which: &[usize], seed_shift: u64, config: SchedConfig| -> Vec<Vec<u32>> {
        let pool = KvPool::new(&model.config, model.config.n_layers, 128);
        let mut s = Scheduler::new(&model, None, pool, config).unwrap();
        for &i in which {
            let mut params = sampled(i);
            params.sampling.seed += seed_shift;
            s.submit_spec(
                prompts[i].clone(),
                params,
                Some(ngram_spec(SpecPolicy::Fixed, 6)),
            )
            .unwrap();
        }
        s.run_to_completion(&be)
            .unwrap()
            .iter()
            .map(|(_, f)| done_tokens(f).0.to_vec())
            .collect()
    };
    let run = |which: &[usize], seed_shift: u64| run_in(which, seed_shift, SchedConfig::default());
    let batched = run(&[0, 1, 2, 3, 4], 0);
    for (i, b) in batched.iter().enumerate() {
        assert_eq!(&run(&[i], 0)[0], b, "request {i}");
    }
    // A step budget that does not hold every request's tree (5 roots + 6-node trees > 16):
    // trees wait whole rather than shrink, so the outputs stay the same.
    let tight = SchedConfig {
        max_step_tokens: 16,
        ..SchedConfig::default()
    };
    assert_eq!(run_in(&[0, 1, 2, 3, 4], 0, tight.clone()), batched);
    // Another seed, another output.
    assert_ne!(run(&[0], 1)[0], batched[0]);

    // Trees that fill a step with their roots: a step of 16 rows, two requests with 15-node
    // trees (and 24-node ones, capped to a step at submission). The oldest decoding request
    // always runs (two waiting whole trees stalled the scheduler forever), and each request's
    // tokens are its own alone, whatever the others of its steps.
    for budget in [15usize, 24] {
        let run_tight = |which: &[usize]| -> Vec<Vec<u32>> {
            let pool = KvPool::new(&model.config, model.config.n_layers, 128);
            let mut s = Scheduler::new(&model, None, pool, tight.clone()).unwrap();
            for &i in which {
                // Short prompts: both requests are prefilled in one step and decode together.
                s.submit_spec(
                    prompts[i][..4].to_vec(),
                    sampled(i),
                    Some(ngram_spec(SpecPolicy::Fixed, budget)),
                )
                .unwrap();
            }
            let mut done = Vec::new();
            let mut steps = 0;
            while !s.is_idle() {
                steps += 1;
                assert!(steps < 500, "budget {budget}: no progress in 500 steps");
                for ev in s.step(&be).unwrap() {
                    if let Some(f) = ev.finish {
                        done.push((ev.id, done_tokens(&f).0.to_vec()));
                    }
                }
            }
            done.sort_by_key(|(id, _)| *id);
            done.into_iter().map(|(_, t)| t).collect()
        };
        let together = run_tight(&[0, 1]);
        assert_eq!(together.len(), 2);
        assert_eq!(run_tight(&[0])[0], together[0], "budget {budget}");
        assert_eq!(run_tight(&[1])[0], together[1], "budget {budget}");
        // ... next to plain decoders, too (their roots do not change a whole tree's size).
        let pool = KvPool::new(&model.config, model.config.n_layers, 128);
        let mut s = Scheduler::new(&model, None, pool, tight.clone()).unwrap();
        s.submit_spec(
            prompts[0][..4].to_vec(),
            sampled(0),
            Some(ngram_spec(SpecPolicy::Fixed, budget)),
        )
        .unwrap();
        for (i, p) in prompts.iter().enumerate().take(4).skip(1) {
            s.submit_spec(p[..4].to_vec(), sampled(i), None).unwrap();
        }
        let done = s.run_to_completion(&be).unwrap();
        assert_eq!(
            done_tokens(&done[0].1).0,
            &together[0][..],
            "budget {budget}"
        );
    }
}

/// Token Recycling drafters in the scheduler (fixed and adaptive, batched with plain requests,
/// under preemption): outputs are each request's alone, the drafter sees the prompt's rows first
/// (the warm start, a prefill chunk of candidates) and then every verified row, and its
/// guesses are accepted.
#[test]
fn token_recycling_in_a_batch_keeps_outputs_and_warm_starts() {
    use crate::draft::{RecycleDrafter, RowCandidates};
    use crate::tree::TokenTree;
    use std::sync::{Arc, Mutex};

    /// A recycle drafter that logs the row count of every pass it observes.
    struct Logged(RecycleDrafter, Arc<Mutex<Vec<usize>>>);
    impl Drafter for Logged {
        fn name(&self) -> &str {
            "recycle"
        }
        fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
            self.0.propose(req)
        }
        fn accept(&mut self, accepted: &[u32], bonus: u32) {
            self.0.accept(accepted, bonus)
        }
        fn candidates_wanted(&self) -> usize {
            self.0.candidates_wanted()
        }
        fn prompt_candidates(&self) -> usize {
            self.0.prompt_candidates()
        }
        fn observe_candidates(&mut self, rows: &RowCandidates<'_>) {
            self.1.lock().unwrap().push(rows.tokens.len());
            self.0.observe_candidates(rows)
        }
        fn set_row_costs(&mut self, c: &[f64]) {
            self.0.set_row_costs(c)
        }
    }

    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let vocab = model.config.vocab_size;
    for blocks in [128usize, 12] {
        let mut logs = Vec::new();
        let metrics = mixed_batch_keeps_outputs(&model, &be, blocks, 16, |i, policy| {
            let log = Arc::new(Mutex::new(Vec::new()));
            logs.push((i, Arc::clone(&log)));
            let d = RecycleDrafter::new(vocab, 8)
                .unwrap()
                .with_prompt_logits(true);
            in_process_spec(vec![Box::new(Logged(d, log))], policy, 8)
        });
        let accepted: usize = metrics.iter().map(|m| m.accepted).sum();
        assert!(accepted > 0, "pool {blocks}: recycled guesses accepted");
        for (i, log) in &logs {
            let log = log.lock().unwrap();
            assert_eq!(
                log.first().copied(),
                Some(20 + 9 * i),
                "request {i}: the prompt's first chunk (all its rows) comes first: {log:?}"
            );
            assert!(log.len() > 2, "request {i}: every pass observed: {log:?}");
        }
    }
}

/// The adaptive policy verifies trees where drafts are accepted and rows are cheap, backs off
/// to plain decoding where every row costs a whole pass, and keeps the tokens either way.
#[test]
fn adaptive_speculation_follows_acceptance_and_cost() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), 13).unwrap();
    let vocab = model.config.vocab_size as u32;
    // The model's own greedy output, repeated: prompt lookup then drafts what it will say.
    let seed_prompt = repetitive(vocab, 12, 3);
    let params = GenerateParams {
        max_tokens: 40,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    let cont = alone(&model, &be, &seed_prompt, &params);
    let mut prompt = seed_prompt.clone();
    prompt.extend(&cont);
    prompt.extend(&seed_prompt);
    let want = alone(&model, &be, &prompt, &params);
    let mut drafted = Vec::new();
    for cost in [
        StepCost::from_points(vec![(1, 0.010), (64, 0.011)]),
        StepCost::from_points(vec![(1, 0.010), (64, 0.640)]),
    ] {
        let pool = KvPool::new(&model.config, model.config.n_layers, 64);
        let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
        s.set_step_cost(cost);
        // Stop the measured step times from moving the cost model: a test's timings are noise.
        s.freeze_step_cost = true;
        s.submit_spec(
            prompt.clone(),
            params.clone(),
            Some(ngram_spec(SpecPolicy::Adaptive, 8)),
        )
        .unwrap();
        let done = s.run_to_completion(&be).unwrap();
        assert_eq!(done_tokens(&done[0].1).0, &want[..]);
        let m = spec_metrics(&done[0].1);
        drafted.push((m.drafted, m.accepted, m.steps));
    }
    let (cheap, steep) = (drafted[0], drafted[1]);
    assert!(
        cheap.1 >= 10,
        "cheap rows: many tokens come from accepted drafts ({cheap:?})"
    );
    assert!(
        cheap.2 < 30,
        "cheap rows: far fewer passes than tokens ({cheap:?})"
    );
    assert_eq!(
        steep.0, 0,
        "every row a whole pass: plain decoding ({steep:?})"
    );
    // Adaptive needs a cost model.
    let pool = KvPool::new(&model.config, model.config.n_layers, 8);
    let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
    assert!(s
        .submit_spec(
            vec![1, 2],
            params,
            Some(ngram_spec(SpecPolicy::Adaptive, 4))
        )
        .is_err());
}

#[test]
fn panic_messages_are_read_from_the_payload() {
    let p = std::panic::catch_unwind(|| panic!("boom {}", 7)).expect_err("panics");
    assert_eq!(crate::spec::panic_message(&*p), "boom 7");
    let p = std::panic::catch_unwind(|| std::panic::panic_any("static")).expect_err("panics");
    assert_eq!(crate::spec::panic_message(&*p), "static");
}

/// Trees drafted outside the scheduler (`begin_step` jobs, `finish_step` trees, `take_commits`)
/// give exactly what the same drafters give inside it: tokens and speculation counters, greedy
/// and sampled with fixed trees; a job left without a tree verifies its root only.
#[test]
fn external_drafting_equals_in_process_drafting() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| repetitive(vocab, 24 + 7 * i as usize, i))
        .collect();
    let params = |i: usize, t: f32| GenerateParams {
        max_tokens: 14 + i,
        sampling: SamplingParams {
            temperature: t,
            seed: 5 + i as u64,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    };
    for temperature in [0.0f32, 0.8] {
        let run = |external: bool, skip_every: usize| -> Vec<(Vec<u32>, usize, usize)> {
            let pool = KvPool::new(&model.config, model.config.n_layers, 96);
            let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
            let mut outside: std::collections::HashMap<u64, crate::draft::NgramDrafter> =
                Default::default();
            for (i, p) in prompts.iter().enumerate() {
                let mut sp = ngram_spec(SpecPolicy::Fixed, 8);
                if external {
                    sp.drafters.clear();
                    sp.external = true;
                }
                let id = s
                    .submit_spec(p.clone(), params(i, temperature), Some(sp))
                    .unwrap();
                outside.insert(id, crate::draft::NgramDrafter::default());
            }
            let mut done = Vec::new();
            let mut step = 0;
            while !s.is_idle() {
                step += 1;
                let planned = s.begin_step();
                let mut trees = Vec::new();
                for j in &planned.jobs {
                    assert!(external, "jobs only for external requests");
                    if skip_every > 0 && step % skip_every == 0 {
                        continue;
                    }
                    let d = outside.get_mut(&j.id).unwrap();
                    let mut ds: Vec<&mut dyn Drafter> = vec![d];
                    let t = crate::spec::draft_tree(
                        &mut ds,
                        &j.tokens,
                        j.budget,
                        j.max_depth,
                        vocab as usize,
                    )
                    .unwrap();
                    trees.push((j.id, MaskedTree::new(t)));
                }
                for ev in s.finish_step(&be, planned, trees).unwrap() {
                    if let Some(f) = ev.finish {
                        done.push((ev.id, f));
                    }
                }
                for c in s.take_commits() {
                    outside.get_mut(&c.id).unwrap().accept(&c.accepted, c.bonus);
                }
            }
            done.sort_by_key(|(id, _)| *id);
            done.iter()
                .map(|(_, f)| {
                    let m = spec_metrics(f);
                    (done_tokens(f).0.to_vec(), m.drafted, m.accepted)
                })
                .collect()
        };
        let inside = run(false, 0);
        let outside = run(true, 0);
        assert_eq!(inside, outside, "temperature {temperature}");
        assert!(
            inside.iter().map(|x| x.1).sum::<usize>() > 0,
            "trees verified"
        );
        // Steps without trees still give the same tokens (greedy: any tree is lossless).
        if temperature == 0.0 {
            let sparse = run(true, 2);
            for (a, b) in inside.iter().zip(&sparse) {
                assert_eq!(a.0, b.0);
            }
        }
    }
}

/// A drafter that proposes a chain of its root twice, then errors or panics every time it is
/// asked; `calls` counts its proposals.
struct Breaking {
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    panic: bool,
}

impl Drafter for Breaking {
    fn name(&self) -> &str {
        "breaking"
    }

    fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n >= 2 {
            if self.panic {
                panic!("drafter bug (test)");
            }
            return Err(EngineError::InvalidArgument(
                "drafter failure (test)".into(),
            ));
        }
        let k = req.budget.min(req.max_depth).min(2);
        Ok(TokenTree::chain(
            req.root(),
            &vec![req.root(); k],
            req.drafter,
        ))
    }
}

/// In-process drafters that error or panic are dropped from their request after their first
/// failure, counted and reported; the request keeps its incremental greedy tokens.
#[test]
fn failing_in_process_drafters_are_dropped_and_change_nothing() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let vocab = model.config.vocab_size as u32;
    let prompt = repetitive(vocab, 30, 1);
    let params = GenerateParams {
        max_tokens: 16,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    let want = alone(&model, &be, &prompt, &params);
    let calls: Vec<_> = (0..2)
        .map(|_| std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0)))
        .collect();
    let pool = KvPool::new(&model.config, model.config.n_layers, 64);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    let mut sp = ngram_spec(SpecPolicy::Fixed, 8);
    for (c, panic) in calls.iter().zip([true, false]) {
        sp.drafters.push(Box::new(Breaking {
            calls: std::sync::Arc::clone(c),
            panic,
        }));
    }
    s.submit_spec(prompt, params, Some(sp)).unwrap();
    let done = s.run_to_completion(&be).unwrap();
    assert_eq!(done_tokens(&done[0].1).0, &want[..]);
    assert_eq!(s.stats().drafter_failures, 2);
    let failures = s.take_drafter_failures();
    assert_eq!(failures.len(), 2);
    assert!(failures.iter().all(|f| f.drafter == "breaking"));
    // Each was asked once more after its two good trees, then never again.
    for c in &calls {
        assert_eq!(c.load(std::sync::atomic::Ordering::SeqCst), 3);
    }
    assert_eq!(pool.stats().used, 0);
}

/// Requests whose drafters are early-exit model drafters sharing one drafter pool (their trees
/// drafted together, one pass per depth for all) keep their incremental greedy tokens, batched
/// with plain and prompt-lookup requests, fixed trees and adaptive, also under preemption; the
/// drafters' blocks all come back.
#[test]
fn batched_model_drafters_keep_every_output() {
    use crate::draft::{early_exit, DraftSampling, DraftShape};
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), 21).unwrap();
    let vocab = model.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..6u32)
        .map(|i| repetitive(vocab, 12 + 7 * i as usize, i))
        .collect();
    let cost = StepCost::from_points(vec![(1, 0.010), (64, 0.012)]);
    let shape: DraftShape = "2,1,1".parse().unwrap();
    for blocks in [128usize, 14] {
        let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
        let drafts = KvPool::elastic(&model.config, 1, 512);
        let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
        s.set_step_cost(cost.clone());
        let mut want = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let params = GenerateParams {
                max_tokens: 9 + 2 * i,
                sampling: SamplingParams::greedy(),
                ..GenerateParams::default()
            };
            want.push(alone(&model, &be, p, &params));
            let model_spec = |policy| RequestSpec {
                drafters: vec![Box::new(
                    early_exit(&model, &be, 1, shape.clone(), DraftSampling::TopK, i as u64)
                        .unwrap()
                        .in_pool(&drafts)
                        .unwrap(),
                ) as Box<dyn Drafter>],
                budget: 6,
                policy,
                mode: None,
                external: false,
                candidates: 0,
                prompt_candidates: 0,
                max_nodes_by_depth: Vec::new(),
            };
            let sp = match i % 4 {
                0 => None,
                1 => Some(model_spec(SpecPolicy::Fixed)),
                2 => Some(model_spec(SpecPolicy::Adaptive)),
                _ => Some(ngram_spec(SpecPolicy::Fixed, 6)),
            };
            s.submit_spec(p.clone(), params, sp).unwrap();
        }
        let done = s.run_to_completion(&be).unwrap();
        assert_eq!(done.len(), prompts.len());
        let mut drafted = 0;
        for (id, f) in &done {
            assert_eq!(
                done_tokens(f).0,
                &want[*id as usize][..],
                "pool {blocks} request {id}"
            );
            if matches!(id % 4, 1 | 2) {
                drafted += spec_metrics(f).drafted;
            }
        }
        assert!(drafted > 0, "model trees were verified");
        if blocks == 14 {
            assert!(s.stats().preemptions > 0);
        }
        assert_eq!(s.stats().drafter_failures, 0);
        assert_eq!(pool.stats().used, 0);
        drop(s);
        assert_eq!(drafts.stats().used, 0, "drafter blocks came back");
    }
}

/// Counts the proposals it is asked for, each taking at least `delay`.
struct Counting<D> {
    inner: D,
    proposals: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    delay: std::time::Duration,
}

impl<D: Drafter> Drafter for Counting<D> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
        self.proposals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(self.delay);
        self.inner.propose(req)
    }

    fn accept(&mut self, accepted: &[u32], bonus: u32) {
        self.inner.accept(accepted, bonus);
    }
}

/// One greedy request alone in a scheduler with the frozen `cost` curve and `drafter` (wrapped
/// to count its proposals, each taking at least `delay`): its tokens checked against `want`;
/// (proposals, verification steps, accepted tokens).
#[allow(clippy::too_many_arguments)]
fn counted_run(
    model: &Model,
    be: &CpuBackend,
    prompt: &[u32],
    params: &GenerateParams,
    want: &[u32],
    cost: StepCost,
    drafter: impl Drafter + 'static,
    delay: std::time::Duration,
    budget: usize,
    policy: SpecPolicy,
) -> (usize, usize, usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pool = KvPool::new(&model.config, model.config.n_layers, 64);
    let mut s = Scheduler::new(model, None, pool, SchedConfig::default()).unwrap();
    s.set_step_cost(cost);
    s.freeze_step_cost = true;
    let proposals = std::sync::Arc::new(AtomicUsize::new(0));
    let counting = Counting {
        inner: drafter,
        proposals: std::sync::Arc::clone(&proposals),
        delay,
    };
    let sp = RequestSpec {
        drafters: vec![Box::new(counting)],
        budget,
        policy,
        mode: None,
        external: false,
        candidates: 0,
        prompt_candidates: 0,
        max_nodes_by_depth: Vec::new(),
    };
    s.submit_spec(prompt.to_vec(), params.clone(), Some(sp))
        .unwrap();
    let done = s.run_to_completion(be).unwrap();
    assert_eq!(
        done_tokens(&done[0].1).0,
        want,
        "{policy:?}, delay {delay:?}"
    );
    let m = spec_metrics(&done[0].1);
    (proposals.load(Ordering::Relaxed), m.steps, m.accepted)
}

/// Where drafts fail (random tokens), an adaptive request soon stops drafting on most steps
/// (the backoff: no drafter call, no draft round trip, plain decoding), keeps its exact greedy
/// tokens, and a fixed request drafts every step.
#[test]
fn adaptive_requests_back_off_drafting_where_drafts_fail() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompt, params, want) = greedy_case(&be, 31, 20, 5, 80);
    let run = |policy| {
        counted_run(
            &model,
            &be,
            &prompt,
            &params,
            &want,
            // Rows at 10% of a pass each: worth a few when drafts look good, not when they fail.
            StepCost::from_points(vec![(1, 0.010), (64, 0.073)]),
            crate::draft::RandomDrafter::new(crate::tree::ExpansionConfig::chain(4), 7),
            std::time::Duration::ZERO,
            4,
            policy,
        )
    };
    let (adaptive, fixed) = (run(SpecPolicy::Adaptive), run(SpecPolicy::Fixed));
    assert!(fixed.0 >= 70, "fixed trees draft every step ({fixed:?})");
    assert!(
        adaptive.0 <= 20 && adaptive.1 >= 70,
        "adaptive: few drafting steps among ~80 ({adaptive:?})"
    );
}

/// A drafter whose one-token guesses are always right but whose drafting takes three passes'
/// time (at least 30 ms against a frozen 10 ms pass) does not pay: the adaptive request backs off
/// drafting (the drafter's own cost counts, not only the verified rows); the same drafter at no
/// cost drafts every step. Tokens are exact either way.
#[test]
fn drafting_that_costs_more_than_it_gains_backs_off() {
    use std::time::Duration;
    let be = CpuBackend::new(2).unwrap();
    let (model, prompt, params, want) = greedy_case(&be, 37, 16, 2, 40);
    let mut truth = prompt.clone();
    truth.extend(&want);
    let run = |delay| {
        counted_run(
            &model,
            &be,
            &prompt,
            &params,
            &want,
            StepCost::from_points(vec![(1, 0.010), (64, 0.012)]),
            crate::draft::OracleDrafter::new(
                truth.clone(),
                crate::tree::ExpansionConfig::chain(1),
                3,
            ),
            delay,
            1,
            SpecPolicy::Adaptive,
        )
    };
    let (free, slow) = (run(Duration::ZERO), run(Duration::from_millis(30)));
    assert!(
        free.2 >= 10 && free.0 + 2 >= free.1,
        "free drafts pay every step ({free:?})"
    );
    assert!(slow.0 <= 10, "slow drafts back off ({slow:?})");
}

/// Forward passes on a device (the device model on the kernels' host reference): the shared
/// check `scheduler_against_incremental` (plain and speculating requests whose accepted paths
/// move K/V rows, preemption at 12 blocks, prefix hits at 64) gives every request the device's
/// own incremental greedy tokens, and the pool is full again at the end.
#[test]
fn scheduler_on_a_device_keeps_the_devices_outputs() {
    use crate::backend::cuda::{check, DeviceModel};
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), 31).unwrap();
    let reference = DeviceModel::on_host(&model, 64).unwrap();
    let incremental = |p: &[u32], n: usize| Ok(reference.greedy(p, n, None, 0)?.tokens);
    for blocks in [12usize, 64] {
        let device = Arc::new(DeviceModel::on_host(&model, blocks).unwrap());
        let c = check::scheduler_against_incremental(&model, device, blocks, &incremental).unwrap();
        c.verdict(blocks).unwrap();
    }
}

/// Proposes `inner`'s tree every third call and nothing (the root alone) otherwise, as prompt
/// lookup does where the text has no earlier match.
struct EveryThird<D> {
    inner: D,
    calls: usize,
}

impl<D: Drafter> Drafter for EveryThird<D> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
        self.calls += 1;
        if self.calls.is_multiple_of(3) {
            self.inner.propose(req)
        } else {
            Ok(TokenTree::root_only(*req.tokens.last().expect("a root")))
        }
    }

    fn accept(&mut self, accepted: &[u32], bonus: u32) {
        self.inner.accept(accepted, bonus);
    }
}

/// A step whose drafters propose nothing says nothing about whether drafts pay: an adaptive
/// request whose free, always-right drafter proposes only every third step keeps drafting every
/// step (no backoff), and verifies those proposals at their full depth.
#[test]
fn empty_proposals_do_not_back_off_drafting() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompt, params, want) = greedy_case(&be, 41, 16, 2, 60);
    let mut truth = prompt.clone();
    truth.extend(&want);
    let (proposals, steps, accepted) = counted_run(
        &model,
        &be,
        &prompt,
        &params,
        &want,
        StepCost::from_points(vec![(1, 0.010), (64, 0.012)]),
        EveryThird {
            inner: crate::draft::OracleDrafter::new(
                truth.clone(),
                crate::tree::ExpansionConfig::chain(4),
                3,
            ),
            calls: 0,
        },
        std::time::Duration::ZERO,
        4,
        SpecPolicy::Adaptive,
    );
    assert!(
        proposals + 1 >= steps,
        "a proposal every step ({proposals} proposals, {steps} steps, {accepted} accepted)"
    );
    assert!(
        accepted >= 3 * (steps / 3 - 1),
        "every third step accepts ~4 tokens ({proposals} proposals, {steps} steps, {accepted} accepted)"
    );
}

/// Drafting outside the scheduler (the server's drafter actors) costs every step a round trip:
/// there, steps whose proposals are empty still back off, so a request whose outside drafter
/// never finds anything is asked for drafts on few steps.
#[test]
fn empty_outside_proposals_back_off() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompt, params, want) = greedy_case(&be, 43, 16, 3, 48);
    let pool = KvPool::new(&model.config, model.config.n_layers, 64);
    let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
    s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (64, 0.012)]));
    s.freeze_step_cost = true;
    let mut sp = ngram_spec(SpecPolicy::Adaptive, 4);
    sp.drafters.clear();
    sp.external = true;
    s.submit_spec(prompt, params, Some(sp)).unwrap();
    let (mut steps, mut asked) = (0, 0);
    let mut done = Vec::new();
    while !s.is_idle() {
        steps += 1;
        let planned = s.begin_step();
        asked += usize::from(!planned.jobs.is_empty());
        let trees = planned
            .jobs
            .iter()
            .map(|j| {
                (
                    j.id,
                    MaskedTree::new(TokenTree::root_only(*j.tokens.last().unwrap())),
                )
            })
            .collect();
        for ev in s.finish_step(&be, planned, trees).unwrap() {
            if let Some(f) = ev.finish {
                done.push(f);
            }
        }
        s.take_commits();
    }
    assert_eq!(done_tokens(&done[0]).0, &want[..]);
    assert!(
        asked * 3 <= steps,
        "{asked} of {steps} steps asked for drafts"
    );
}

/// A device whose `fail_at`-th `commit_rows` call fails (0-based).
struct FailingCommit<D> {
    inner: D,
    calls: std::sync::atomic::AtomicUsize,
    fail_at: usize,
}

impl<D: crate::backend::cuda::DeviceForward> crate::backend::cuda::DeviceForward
    for FailingCommit<D>
{
    fn forward_batch(&self, seqs: &mut [SeqBatch<'_>]) -> Result<Vec<Vec<f32>>> {
        self.inner.forward_batch(seqs)
    }

    fn commit_rows(&self, cache: &mut KvCache, base: usize, keep: &[usize]) -> Result<()> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.calls.fetch_add(1, SeqCst) == self.fail_at {
            return Err(EngineError::InvalidArgument(
                "device commit failed (test)".into(),
            ));
        }
        self.inner.commit_rows(cache, base, keep)
    }
}

/// An error verifying one request's tree (here its device commit) fails that request alone:
/// the other speculating request in the same steps finishes with its exact tokens, and every
/// block comes back.
#[test]
fn one_requests_verification_error_fails_it_alone() {
    use crate::backend::cuda::DeviceModel;
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), 31).unwrap();
    let reference = DeviceModel::on_host(&model, 64).unwrap();
    let vocab = model.config.vocab_size as u32;
    let prompts = [repetitive(vocab, 24, 1), repetitive(vocab, 30, 2)];
    let n = 24;
    for fail_at in [0, 1, 3] {
        let pool = KvPool::new(&model.config, model.config.n_layers, 64);
        let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
        s.set_device(Arc::new(FailingCommit {
            inner: DeviceModel::on_host(&model, 64).unwrap(),
            calls: Default::default(),
            fail_at,
        }));
        let params = GenerateParams {
            max_tokens: n,
            sampling: SamplingParams::greedy(),
            ..GenerateParams::default()
        };
        for p in &prompts {
            s.submit_spec(
                p.clone(),
                params.clone(),
                Some(ngram_spec(SpecPolicy::Fixed, 8)),
            )
            .unwrap();
        }
        let done = s.run_to_completion(&CpuBackend::new(1).unwrap()).unwrap();
        assert_eq!(done.len(), 2, "fail_at {fail_at}");
        let mut failed = 0;
        for (id, f) in &done {
            match f {
                Finish::Failed(e) => {
                    assert!(e.to_string().contains("(test)"), "{e}");
                    failed += 1;
                }
                Finish::Done { tokens, .. } => {
                    let want = reference
                        .greedy(&prompts[*id as usize], n, None, 0)
                        .unwrap();
                    assert_eq!(
                        tokens[..],
                        want.tokens[..],
                        "fail_at {fail_at}, request {id}"
                    );
                }
            }
        }
        assert_eq!(failed, 1, "fail_at {fail_at}");
        assert_eq!(pool.stats().used, 0, "fail_at {fail_at}");
    }
}

/// An adaptive request whose drafter samples its tree is verified on what it drafted, even
/// where the step cost says deeper drafts do not pay: a depth chosen from the proposal's node
/// counts (which depend on which tokens the draws hit) would bias MSS.
#[test]
fn adaptive_sampled_proposals_are_verified_whole() {
    use crate::tree::{expand, ExpandMode, ExpansionConfig, TokenTree};

    /// Two draws at the root, one below each, from a flat distribution over four tokens.
    struct Sampling(crate::sample::Rng);
    impl Drafter for Sampling {
        fn name(&self) -> &str {
            "sampling"
        }
        fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
            let cfg: ExpansionConfig = "2,1".parse()?;
            expand(
                &cfg,
                req.root(),
                req.drafter,
                ExpandMode::Sample,
                req.budget,
                req.max_depth,
                &mut self.0,
                |_| Ok(vec![(1, 0.25), (2, 0.25), (3, 0.25), (4, 0.25)]),
            )
        }
    }

    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let pool = KvPool::new(&model.config, model.config.n_layers, 64);
    let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
    // Every extra row costs as much as a whole pass: no depth pays.
    s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (8, 0.080)]));
    let params = GenerateParams {
        max_tokens: 12,
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    };
    let sp = in_process_spec(
        vec![Box::new(Sampling(crate::sample::Rng::new(5)))],
        SpecPolicy::Adaptive,
        8,
    );
    s.submit_spec(vec![1, 2, 3, 4], params, Some(sp)).unwrap();
    let done = s.run_to_completion(&be).unwrap();
    let m = spec_metrics(&done[0].1);
    assert!(m.steps > 0);
    // The tree's size still follows the cost (drafting budgets are chosen before any draw),
    // but what was drafted is verified: a depth chosen from the proposal cut every tree to its
    // root here (0 nodes verified).
    assert!(m.drafted > 0, "{m:?}");
}

/// A drafter whose proposals exceed its own `max_nodes` (the rows a step reserved for its tree)
/// is cut to it: the step stays within its rows and blocks, and greedy output is unchanged.
#[test]
fn trees_over_their_drafters_bound_are_cut_to_it() {
    struct Understated(crate::draft::NgramDrafter);
    impl Drafter for Understated {
        fn name(&self) -> &str {
            "understated"
        }
        fn max_nodes(&self, _max_depth: usize) -> usize {
            1
        }
        fn propose(&mut self, req: &crate::draft::DraftRequest<'_>) -> Result<TokenTree> {
            self.0.propose(req)
        }
    }
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 9).unwrap();
    let vocab = model.config.vocab_size as u32;
    let pool = KvPool::new(&model.config, model.config.n_layers, 64);
    let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
    let prompt = repetitive(vocab, 40, 3);
    let params = GenerateParams {
        max_tokens: 24,
        ..GenerateParams::default()
    };
    let d = Understated(crate::draft::NgramDrafter::default());
    let sp = in_process_spec(vec![Box::new(d)], SpecPolicy::Fixed, 16);
    s.submit_spec(prompt.clone(), params.clone(), Some(sp))
        .unwrap();
    let done = s.run_to_completion(&be).unwrap();
    let m = spec_metrics(&done[0].1);
    assert!(m.drafted <= m.steps, "{m:?}");
    assert!(m.accepted > 0, "{m:?}");
    assert_eq!(
        done_tokens(&done[0].1).0,
        alone(&model, &be, &prompt, &params)
    );
}

/// Log-probabilities reported with the tokens: one per token, the log-softmax of the row the
/// token was drawn from, bit for bit the same whether the tokens came from plain decoding or
/// from verified trees (tree rows equal rows computed alone), and equal to those of incremental
/// decoding's rows; a request that does not ask gets none.
#[test]
fn logprobs_are_the_rows_log_softmax_with_and_without_speculation() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompt, params, want) = greedy_case(&be, 21, 40, 3, 24);
    // Incremental decoding's log-probabilities.
    let mut cache = KvCache::new(&model.config, prompt.len() + want.len());
    let pos: Vec<usize> = (0..prompt.len()).collect();
    let mut logits = model
        .forward(
            &be,
            &mut cache,
            &prompt,
            &pos,
            BatchMask::Causal,
            &[prompt.len() - 1],
        )
        .unwrap();
    let (mut want_lp, mut want_top) = (Vec::new(), Vec::new());
    for &t in &want {
        want_lp.push(crate::sample::log_softmax_at(&logits, t));
        want_top.push(crate::sample::log_softmax_top(&logits, t, 3).1);
        let p = cache.len();
        logits = model
            .forward(&be, &mut cache, &[t], &[p], BatchMask::Causal, &[0])
            .unwrap();
    }
    assert!(want_lp.iter().all(|&l| l <= 0.0 && l.is_finite()));
    let vocab = model.config.vocab_size as u32;
    for (speculate, logprobs) in [(false, true), (true, true), (true, false)] {
        let pool = KvPool::new(&model.config, model.config.n_layers, 64);
        let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
        let p = GenerateParams {
            logprobs,
            top_logprobs: 3,
            ..params.clone()
        };
        let sp = speculate.then(|| ngram_spec(SpecPolicy::Fixed, 8));
        s.submit_spec(prompt.clone(), p, sp).unwrap();
        // A second request without logprobs shares the steps.
        s.submit(repetitive(vocab, 30, 5), params.clone()).unwrap();
        let (mut tokens, mut lps, mut tops, mut multi) =
            (Vec::new(), Vec::new(), Vec::new(), false);
        while !s.is_idle() {
            for ev in s.step(&be).unwrap() {
                if ev.id == 0 {
                    let n = if logprobs { ev.tokens.len() } else { 0 };
                    assert_eq!(ev.logprobs.len(), n, "one per token when asked");
                    assert_eq!(ev.top_logprobs.len(), n, "alternatives with logprobs only");
                    multi |= ev.tokens.len() > 1;
                    tokens.extend(ev.tokens);
                    lps.extend(ev.logprobs);
                    tops.extend(ev.top_logprobs);
                } else {
                    assert!(ev.logprobs.is_empty() && ev.top_logprobs.is_empty());
                }
            }
        }
        assert_eq!(tokens, want, "speculate {speculate}");
        if speculate {
            assert!(multi, "a step accepted drafts");
        }
        if logprobs {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&lps), bits(&want_lp), "speculate {speculate}");
            // Greedy: the best alternative is the token itself.
            for ((top, want), (&t, &lp)) in tops.iter().zip(&want_top).zip(tokens.iter().zip(&lps))
            {
                assert_eq!(top.len(), 3);
                assert_eq!(top[0], (t, lp));
                let ids =
                    |v: &[(u32, f32)]| v.iter().map(|&(t, l)| (t, l.to_bits())).collect::<Vec<_>>();
                assert_eq!(ids(top), ids(want), "speculate {speculate}");
            }
        }
    }
}

/// Penalties (repetition; frequency with presence) and a logit bias: a request's greedy tokens
/// are those of incremental decoding over its penalized rows, whether it decodes plainly or
/// verifies trees (each tree row penalized with its own path), fixed or adaptive, batched with
/// others and preempted; and the penalties change the outputs. The log-probabilities reported
/// are those of the penalized rows.
#[test]
fn penalized_outputs_equal_incremental_decoding_with_speculation() {
    use crate::sample::penalty::Penalties;
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), 21).unwrap();
    let vocab = model.config.vocab_size as u32;
    let plain = GenerateParams {
        max_tokens: 24,
        ..GenerateParams::default()
    };
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| repetitive(vocab, 24 + 7 * i as usize, i))
        .collect();
    let unbiased: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| alone(&model, &be, p, &plain))
        .collect();
    for (penalties, bias) in [
        (
            Penalties {
                repetition: 1.2,
                ..Penalties::default()
            },
            false,
        ),
        (
            Penalties {
                frequency: 0.3,
                presence: 0.2,
                ..Penalties::default()
            },
            false,
        ),
        // A logit bias alone: the plain output's fifth token banned, another favoured.
        (Penalties::default(), true),
    ] {
        // (prompt, params, tokens, their log-probabilities) of incremental decoding.
        type Case = (Vec<u32>, GenerateParams, Vec<u32>, Vec<f32>);
        let cases: Vec<Case> = prompts
            .iter()
            .zip(&unbiased)
            .map(|(prompt, out)| {
                let logit_bias = match bias {
                    true => vec![(out[4], -100.0), ((out[9] + 1) % vocab, 2.5)],
                    false => Vec::new(),
                };
                let params = GenerateParams {
                    penalties,
                    logit_bias,
                    ..plain.clone()
                };
                let params = GenerateParams {
                    logprobs: true,
                    ..params
                };
                let (want, lps) = alone_with_logprobs(&model, &be, prompt, &params);
                (prompt.clone(), params, want, lps)
            })
            .collect();
        let changed = cases.iter().zip(&unbiased).any(|(c, out)| c.2 != *out);
        assert!(changed, "{penalties:?} changes some output");
        for blocks in [128usize, 12] {
            let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
            let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
            s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (64, 0.012)]));
            for (i, (p, params, _, _)) in cases.iter().enumerate() {
                let sp = match i % 3 {
                    0 => None,
                    1 => Some(ngram_spec(SpecPolicy::Fixed, 8)),
                    _ => Some(ngram_spec(SpecPolicy::Adaptive, 8)),
                };
                s.submit_spec(p.clone(), params.clone(), sp).unwrap();
            }
            let (mut done, mut lps) = (Vec::new(), vec![Vec::new(); cases.len()]);
            while !s.is_idle() {
                for ev in s.step(&be).unwrap() {
                    lps[ev.id as usize].extend(ev.logprobs);
                    done.extend(ev.finish.map(|f| (ev.id, f)));
                }
            }
            let mut accepted = 0;
            for (id, f) in &done {
                let case = &cases[*id as usize];
                assert_eq!(
                    done_tokens(f).0,
                    &case.2[..],
                    "{penalties:?} pool {blocks} request {id}"
                );
                // Log-probabilities of the rows after the bias and the penalties, tree rows
                // (with their paths) included.
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&lps[*id as usize]), bits(&case.3), "request {id}");
                if id % 3 != 0 {
                    let m = spec_metrics(f);
                    accepted += m.accepted;
                }
            }
            assert!(accepted > 0, "drafts were accepted");
            if blocks == 12 {
                assert!(s.stats().preemptions > 0);
            }
            assert_eq!(pool.stats().used, 0);
        }
    }
}

/// `stop_token_ids` end a request at the first of them past `min_tokens` (kept as its last
/// token, finish reason `Eos`), with and without speculation, with `ignore_eos` set: where
/// incremental decoding's output first holds one. A stop token inside a run of tokens the
/// drafts get right ends the request in the middle of an accepted path.
#[test]
fn stop_token_ids_end_requests_where_incremental_decoding_reaches_them() {
    let be = CpuBackend::new(2).unwrap();
    // An output of runs (a tiny model's greedy text): 88 x 30, then 44 x 10.
    let (model, prompt, params, want) = greedy_case(&be, 5, 40, 2, 40);
    let (run, new) = (want[0], want[30]);
    assert!(want[..30].iter().all(|&t| t == run) && !want[..30].contains(&new));
    let never = (0..model.config.vocab_size as u32)
        .find(|t| !want.contains(t))
        .unwrap();
    let pool = KvPool::new(&model.config, model.config.n_layers, 128);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (64, 0.012)]));
    // (request id, the output up to and including the stop token it ends at).
    let mut expected = Vec::new();
    let cases = [
        (vec![never, new], 0usize),
        (vec![new], 31),
        (vec![run], 10),
        (vec![run, new], 29),
    ];
    for (c, (stops, min_tokens)) in cases.iter().enumerate() {
        let end = (*min_tokens..want.len())
            .find(|&j| stops.contains(&want[j]))
            .unwrap();
        for policy in [None, Some(SpecPolicy::Fixed), Some(SpecPolicy::Adaptive)] {
            let p = GenerateParams {
                ignore_eos: true,
                min_tokens: *min_tokens,
                stop_token_ids: stops.clone(),
                ..params.clone()
            };
            let sp = policy.map(|pol| ngram_spec(pol, 8));
            let id = s.submit_spec(prompt.clone(), p, sp).unwrap();
            expected.push((id, c, want[..=end].to_vec()));
        }
    }
    let done = s.run_to_completion(&be).unwrap();
    let mut accepted = 0;
    for (id, c, tokens) in expected {
        let f = &done.iter().find(|d| d.0 == id).expect("finished").1;
        let Finish::Done { reason, .. } = f else {
            panic!("request {id} failed: {f:?}");
        };
        assert_eq!(done_tokens(f).0, &tokens[..], "case {c} request {id}");
        assert_eq!(*reason, FinishReason::Eos, "case {c} request {id}");
        if id % 3 != 0 {
            accepted += spec_metrics(f).accepted;
        }
    }
    assert!(accepted > 0, "drafts were accepted");
    assert_eq!(pool.stats().used, 0);
    // Token ids outside the vocabulary are refused.
    let bad = GenerateParams {
        stop_token_ids: vec![model.config.vocab_size as u32],
        ..params
    };
    assert!(s.submit(prompt, bad).is_err());
}

/// Prompt log-probabilities are each prompt row's log-softmax at the next prompt token, bit for
/// bit the rows of one pass over the whole prompt, with and without chunked prefill, when the
/// prompt's blocks are in the prefix cache (a scoring request reads none), and when scoring
/// requests are preempted and recomputed; they come once, on the first event with tokens, and
/// the generated tokens are those of the request alone.
#[test]
fn prompt_logprobs_are_the_rows_of_one_pass_over_the_prompt() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("qwen2", GgmlType::Q8_0), 33).unwrap();
    let vocab = model.config.vocab_size;
    let prompt: Vec<u32> = (0..70u32).map(|j| (j * 13 + 5) % vocab as u32).collect();
    let n = prompt.len();
    let mut cache = KvCache::new(&model.config, n);
    let pos: Vec<usize> = (0..n).collect();
    let all: Vec<usize> = (0..n).collect();
    let rows = model
        .forward(&be, &mut cache, &prompt, &pos, BatchMask::Causal, &all)
        .unwrap();
    let k = 3;
    let (want_lp, want_top): (Vec<f32>, Vec<Vec<(u32, f32)>>) = (0..n - 1)
        .map(|i| {
            crate::sample::log_softmax_top(&rows[i * vocab..(i + 1) * vocab], prompt[i + 1], k)
        })
        .unzip();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let plain = GenerateParams {
        max_tokens: 30,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    let scoring = GenerateParams {
        prompt_logprobs: Some(k),
        ..plain.clone()
    };
    let want_tokens = alone(&model, &be, &prompt, &plain);
    for (config, blocks) in [
        (SchedConfig::default(), 128usize),
        (
            SchedConfig {
                max_step_tokens: 40,
                prefill_chunk: 24,
                ..SchedConfig::default()
            },
            128,
        ),
        // Requests of 7 blocks each (5 at admission) in 11: preemptions.
        (SchedConfig::default(), 11),
    ] {
        let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
        let mut s = Scheduler::new(&model, None, pool.clone(), config.clone()).unwrap();
        // The prompt's blocks in the prefix cache first.
        let first = s.submit(prompt.clone(), plain.clone()).unwrap();
        let _ = s.step(&be).unwrap();
        let ids: Vec<u64> = (0..3)
            .map(|_| s.submit(prompt.clone(), scoring.clone()).unwrap())
            .collect();
        let mut scores: Vec<Vec<PromptScores>> = vec![Vec::new(); 3];
        let mut done = Vec::new();
        while !s.is_idle() {
            for ev in s.step(&be).unwrap() {
                if let Some(i) = ids.iter().position(|&id| id == ev.id) {
                    if let Some(p) = ev.prompt {
                        assert!(!ev.tokens.is_empty(), "scores come with the first tokens");
                        scores[i].push(*p);
                    }
                }
                done.extend(ev.finish.map(|f| (ev.id, f)));
            }
        }
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(scores[i].len(), 1, "request {id}: scores once");
            let got = &scores[i][0];
            assert_eq!(got.tokens, prompt);
            assert_eq!(
                bits(&got.logprobs),
                bits(&want_lp),
                "blocks {blocks} request {id}"
            );
            assert_eq!(got.top_logprobs.len(), n - 1);
            for (g, w) in got.top_logprobs.iter().zip(&want_top) {
                assert_eq!(g.len(), k);
                let gb: Vec<_> = g.iter().map(|&(t, v)| (t, v.to_bits())).collect();
                let wb: Vec<_> = w.iter().map(|&(t, v)| (t, v.to_bits())).collect();
                assert_eq!(gb, wb);
            }
            let f = &done.iter().find(|d| d.0 == *id).expect("finished").1;
            assert_eq!(done_tokens(f).0, &want_tokens[..], "request {id}");
            let Finish::Done {
                cached_prompt_tokens,
                ..
            } = f
            else {
                unreachable!()
            };
            assert_eq!(
                *cached_prompt_tokens, 0,
                "a scoring request reads no prefix"
            );
        }
        let f = &done.iter().find(|d| d.0 == first).expect("finished").1;
        assert_eq!(done_tokens(f).0, &want_tokens[..]);
        if blocks == 11 {
            assert!(s.stats().preemptions > 0, "preempted");
        }
        assert_eq!(pool.stats().used, 0);
    }
    // With Token Recycling reading every prompt row's candidates too (all rows kept).
    let pool = KvPool::new(&model.config, model.config.n_layers, 128);
    let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
    let d = crate::draft::RecycleDrafter::new(vocab, 8)
        .unwrap()
        .with_prompt_logits(true);
    let sp = in_process_spec(vec![Box::new(d)], SpecPolicy::Fixed, 8);
    let id = s
        .submit_spec(prompt.clone(), scoring.clone(), Some(sp))
        .unwrap();
    let mut got = Vec::new();
    let mut tokens = Vec::new();
    while !s.is_idle() {
        for ev in s.step(&be).unwrap() {
            assert_eq!(ev.id, id);
            got.extend(ev.prompt.map(|p| *p));
            tokens.extend(ev.tokens);
        }
    }
    assert_eq!(got.len(), 1);
    assert_eq!(bits(&got[0].logprobs), bits(&want_lp), "with recycling");
    assert_eq!(tokens, want_tokens, "with recycling");
    // Preempted in the middle of its prompt (4 rows a step; a short request decoding beside
    // it needs its blocks): the recompute scores only the rows not scored yet.
    let pool = KvPool::new(&model.config, model.config.n_layers, 7);
    let config = SchedConfig {
        max_step_tokens: 8,
        prefill_chunk: 4,
        ..SchedConfig::default()
    };
    let mut s = Scheduler::new(&model, None, pool.clone(), config).unwrap();
    let short = GenerateParams {
        max_tokens: 60,
        ..plain.clone()
    };
    s.submit(prompt[..20].to_vec(), short).unwrap();
    let _ = s.step(&be).unwrap();
    let id = s.submit(prompt.clone(), scoring.clone()).unwrap();
    let mut got = Vec::new();
    let mut tokens = Vec::new();
    let mut tokens_at_preemption = None;
    while !s.is_idle() {
        for ev in s.step(&be).unwrap() {
            if ev.id == id {
                got.extend(ev.prompt.map(|p| *p));
                tokens.extend(ev.tokens);
            }
        }
        if s.stats().preemptions > 0 && tokens_at_preemption.is_none() {
            tokens_at_preemption = Some(tokens.len());
        }
    }
    assert_eq!(
        tokens_at_preemption,
        Some(0),
        "preempted before its first token"
    );
    assert_eq!(got.len(), 1);
    assert_eq!(bits(&got[0].logprobs), bits(&want_lp));
    assert_eq!(tokens, want_tokens);
    assert_eq!(pool.stats().used, 0);
}

/// Prompts sharing a 200-token prefix submitted together: the first computes the prefix, the
/// others wait for its blocks instead of computing them again (they read 192 tokens from the
/// cache), with the same outputs; without prefix caching nobody waits.
#[test]
fn prompts_sharing_a_prefix_submitted_together_compute_it_once() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompts, params) = shared_prefix_case(GgmlType::Q8_0);
    let mut rows = Vec::new();
    for caching in [false, true] {
        let (mut s, pool) = shared_prefix_scheduler(
            &model,
            SchedConfig {
                prefix_caching: caching,
                ..SchedConfig::default()
            },
        );
        for p in &prompts {
            s.submit(p.clone(), params.clone()).unwrap();
        }
        let done = s.run_to_completion(&be).unwrap();
        for ((_, f), p) in done.iter().zip(&prompts) {
            assert_eq!(done_tokens(f).0, &alone(&model, &be, p, &params)[..]);
            let Finish::Done {
                cached_prompt_tokens,
                ..
            } = f
            else {
                unreachable!()
            };
            let first = std::ptr::eq(p, &prompts[0]);
            let want = if caching && !first { 192 } else { 0 };
            assert_eq!(*cached_prompt_tokens, want, "caching {caching}");
        }
        assert_eq!(s.stats().prefix_waits > 0, caching);
        rows.push(s.stats().rows);
        assert_eq!(pool.stats().used, 0);
    }
    assert!(rows[1] + 3 * 192 <= rows[0], "rows computed: {rows:?}");
}

/// A request waiting for a prefix another one is still computing does not hold up the
/// requests behind it: an unrelated prompt submitted after it starts decoding first.
#[test]
fn a_request_waiting_for_a_shared_prefix_does_not_block_the_queue() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompts, params) = shared_prefix_case(GgmlType::Q8_0);
    let (mut s, pool) = shared_prefix_scheduler(
        &model,
        SchedConfig {
            prefill_chunk: 16,
            ..SchedConfig::default()
        },
    );
    let first = s.submit(prompts[0].clone(), params.clone()).unwrap();
    let _ = s.step(&be).unwrap();
    let sharer = s.submit(prompts[1].clone(), params.clone()).unwrap();
    let vocab = model.config.vocab_size as u32;
    let other: Vec<u32> = (0..12u32).map(|j| (j * 5 + 3) % vocab).collect();
    let other_id = s.submit(other.clone(), params.clone()).unwrap();
    let mut first_token_step = std::collections::HashMap::new();
    let mut outputs: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    let mut cached = std::collections::HashMap::new();
    let mut step = 0;
    while !s.is_idle() {
        step += 1;
        for ev in s.step(&be).unwrap() {
            if !ev.tokens.is_empty() {
                first_token_step.entry(ev.id).or_insert(step);
            }
            outputs.entry(ev.id).or_default().extend(&ev.tokens);
            if let Some(Finish::Done {
                cached_prompt_tokens,
                ..
            }) = ev.finish
            {
                cached.insert(ev.id, cached_prompt_tokens);
            }
        }
    }
    assert!(
        first_token_step[&other_id] < first_token_step[&first],
        "the unrelated prompt waited behind the sharer: {first_token_step:?}"
    );
    assert!(first_token_step[&first] <= first_token_step[&sharer]);
    assert_eq!(
        cached[&sharer], 192,
        "the sharer read the prefix from the cache"
    );
    assert!(s.stats().prefix_waits > 0);
    assert_eq!(outputs[&first], alone(&model, &be, &prompts[0], &params));
    assert_eq!(outputs[&sharer], alone(&model, &be, &prompts[1], &params));
    assert_eq!(outputs[&other_id], alone(&model, &be, &other, &params));
    assert_eq!(pool.stats().used, 0);
}

/// A request admitted past one waiting for a shared prefix and then preempted queues behind
/// that older request, not ahead of it.
#[test]
fn a_preempted_request_queues_behind_an_older_passed_over_one() {
    let be = CpuBackend::new(2).unwrap();
    let (model, prompts, params) = shared_prefix_case(GgmlType::Q8_0);
    let (mut s, pool) = shared_prefix_scheduler(
        &model,
        SchedConfig {
            prefill_chunk: 16,
            ..SchedConfig::default()
        },
    );
    s.submit(prompts[0].clone(), params.clone()).unwrap();
    let _ = s.step(&be).unwrap();
    let sharer = s.submit(prompts[1].clone(), params.clone()).unwrap();
    let other = s.submit(vec![3, 1, 4, 1, 5], params.clone()).unwrap();
    let _ = s.step(&be).unwrap();
    let waiting = |s: &Scheduler| s.waiting.iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(
        waiting(&s),
        vec![sharer],
        "the sharer waits, the other runs"
    );
    assert!(s.preempt_newest());
    assert_eq!(waiting(&s), vec![sharer, other]);
    let done = s.run_to_completion(&be).unwrap();
    assert_eq!(done.len(), 3);
    assert_eq!(pool.stats().used, 0);
}
/// JSON mode: every output is a live JSON text (an object once complete, then only the end
/// token or whitespace), batched or alone, greedy and seeded sampling, with drafted trees
/// whose wrong siblings leave the grammar, in a roomy pool and in one that preempts: each
/// request's tokens equal its masked reference (`alone`), but sampled requests verifying trees
/// (MSS draws differently), which are only checked to be JSON. A scheduler without a
/// tokenizer or a vocabulary refuses such a request. The same with a schema (an object of an
/// array of at most three integers and an optional literal), whose complete outputs match it.
#[test]
fn json_mode_outputs_are_json_and_equal_the_masked_reference() {
    let be = CpuBackend::new(2).unwrap();
    let model = tiny_model(&spec("llama", GgmlType::Q8_0), 7).unwrap();
    let vocab = model.config.vocab_size;
    let json = tiny_json_vocab(vocab);
    let pieces = |toks: &[u32]| -> Vec<u8> {
        toks.iter()
            .filter(|&&t| (t as usize) + 1 < vocab)
            .flat_map(|&t| JSON_PIECES[t as usize % 24].bytes())
            .collect()
    };
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "b": {"enum": [true, null]}
        },
        "required": ["a"]
    });
    let schema = Arc::new(crate::JsonSchema::new(schema));
    let mut completed = [0, 0];
    let mut preempted = 0;
    for (format, sampling, blocks) in [
        ResponseFormat::JsonObject,
        ResponseFormat::JsonSchema(Arc::clone(&schema)),
    ]
    .into_iter()
    .flat_map(|f| {
        [
            (SamplingParams::greedy(), 64),
            (SamplingParams::greedy(), 9),
            (
                SamplingParams {
                    temperature: 1.0,
                    seed: 11,
                    ..SamplingParams::default()
                },
                64,
            ),
        ]
        .map(|(s, b)| (f.clone(), s, b))
    }) {
        let g = format.grammar().unwrap().unwrap();
        let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
        let mut s = Scheduler::new(&model, None, pool.clone(), SchedConfig::default()).unwrap();
        s.set_json_vocab(Arc::clone(&json));
        let mut want = Vec::new();
        for (i, (p, _)) in workload(vocab as u32).into_iter().take(4).enumerate() {
            let params = GenerateParams {
                max_tokens: 40,
                sampling: SamplingParams {
                    seed: sampling.seed + i as u64,
                    ..sampling.clone()
                },
                response_format: format.clone(),
                ..GenerateParams::default()
            };
            let w = alone(&model, &be, &p, &params);
            // Greedy requests, and every other sampled one, verify oracle trees: the true path
            // plus wrong siblings.
            let sp = (sampling.is_greedy() || i % 2 == 1).then(|| {
                let mut truth = p.clone();
                truth.extend(&w);
                in_process_spec(
                    vec![Box::new(crate::draft::OracleDrafter::new(
                        truth,
                        "2,2,1,1".parse().unwrap(),
                        i as u64,
                    ))],
                    SpecPolicy::Fixed,
                    8,
                )
            });
            want.push(w);
            s.submit_spec(p, params, sp).unwrap();
        }
        for (id, f) in s.run_to_completion(&be).unwrap() {
            let got = done_tokens(&f).0;
            if sampling.is_greedy() || id % 2 == 0 {
                assert_eq!(got, &want[id as usize][..], "request {id} ({sampling:?})");
            }
            // A live JSON text; the end token (which does not stop a request without a
            // tokenizer) only once the object is complete, then whitespace or end tokens.
            let text = pieces(got);
            let state = JsonState::start(&g).after(&g, &text);
            assert!(state.is_some(), "{}", String::from_utf8_lossy(&text));
            if got.contains(&(vocab as u32 - 1)) {
                assert!(state.is_some_and(|s| s.is_done()));
                let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
                assert!(v.is_object());
                if let ResponseFormat::JsonSchema(_) = format {
                    let o = v.as_object().unwrap();
                    let a = o["a"].as_array().unwrap();
                    assert!(a.len() <= 3 && a.iter().all(|x| x.is_i64()), "{v}");
                    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
                    assert!(keys == ["a"] || keys == ["a", "b"], "{v}");
                    assert!(o.get("b").is_none_or(|b| b.is_null() || b == true), "{v}");
                }
                completed[matches!(format, ResponseFormat::JsonSchema(_)) as usize] += 1;
            }
        }
        assert_eq!(pool.stats().used, 0);
        preempted += s.stats().preemptions;
    }
    assert!(
        completed.iter().all(|&c| c > 0),
        "{completed:?}: none completed its object"
    );
    assert!(preempted > 0, "the small pool preempted nobody");
    // Without a vocabulary for JSON mode: refused at submission.
    let pool = KvPool::new(&model.config, model.config.n_layers, 8);
    let mut s = Scheduler::new(&model, None, pool, SchedConfig::default()).unwrap();
    let params = GenerateParams {
        response_format: ResponseFormat::JsonObject,
        ..GenerateParams::default()
    };
    let e = s.submit(vec![1, 2, 3], params).unwrap_err();
    assert!(e.to_string().contains("json_object"), "{e}");
    // A schema Arbor cannot compile: refused at submission, naming the keyword.
    s.set_json_vocab(Arc::clone(&json));
    let params = GenerateParams {
        response_format: ResponseFormat::JsonSchema(Arc::new(crate::JsonSchema::new(
            serde_json::json!({"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}),
        ))),
        ..GenerateParams::default()
    };
    let e = s.submit(vec![1, 2, 3], params).unwrap_err();
    assert_eq!(e.error_type(), "invalid_argument");
    assert!(e.to_string().contains("'maximum'"), "{e}");
}
