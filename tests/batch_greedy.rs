//! Continuous batching on smollm2-135m: every request of a batch (mixed prompt lengths, chunked
//! prefill, a pool small enough to preempt) gets exactly the tokens and text `generate` gives
//! it alone, greedy and with seeded sampling; every KV block is back in the pool at the end.

mod common;

use arbor_engine::sched::{Finish, SchedConfig, Scheduler};
use arbor_engine::{generate, GenerateParams, KvPool, SamplingParams};

const PROMPTS: [&str; 5] = [
    "def fibonacci(n):",
    "The capital of France is",
    "User: Name three primary colors.\nAssistant:",
    "```rust\nfn main() {\n    let v: Vec<u32> = (0..10).collect();\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old \
     clockmaker who repaired every clock in the valley. One winter morning",
];

#[test]
fn batched_requests_equal_generate_alone_on_smollm2() {
    let m = common::smollm2();
    let be = common::backend();
    for (temperature, blocks, budget) in [(0.0f32, 256usize, 256usize), (0.0, 7, 48), (0.8, 40, 96)]
    {
        let reqs: Vec<(Vec<u32>, GenerateParams)> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let params = GenerateParams {
                    max_tokens: 12 + 4 * i,
                    sampling: SamplingParams {
                        temperature,
                        seed: 7 + i as u64,
                        ..SamplingParams::default()
                    },
                    stop: if i == 2 { vec!["\n".into()] } else { vec![] },
                    ignore_eos: false,
                    min_tokens: 0,
                    ..GenerateParams::default()
                };
                (m.tok.encode(p, true).expect("encode"), params)
            })
            .collect();
        let want: Vec<_> = reqs
            .iter()
            .map(|(p, params)| generate(&m.model, be, &m.tok, p, params, |_| {}).expect("alone"))
            .collect();
        let pool = KvPool::new(&m.model.config, m.model.config.n_layers, blocks);
        let config = SchedConfig {
            max_step_tokens: budget,
            ..SchedConfig::default()
        };
        let mut s = Scheduler::new(&m.model, Some(&m.tok), pool.clone(), config).expect("sched");
        for (p, params) in &reqs {
            s.submit(p.clone(), params.clone()).expect("submit");
        }
        let mut streamed = vec![String::new(); reqs.len()];
        let mut done = Vec::new();
        while !s.is_idle() {
            for ev in s.step(be).expect("step") {
                streamed[ev.id as usize].push_str(&ev.text);
                if let Some(f) = ev.finish {
                    done.push((ev.id, f));
                }
            }
        }
        assert_eq!(done.len(), reqs.len());
        for (id, f) in done {
            let w = &want[id as usize];
            match f {
                Finish::Done {
                    reason,
                    tokens,
                    text,
                    ..
                } => {
                    let ctx = format!("T={temperature} pool {blocks}: request {id}");
                    assert_eq!(tokens, w.tokens, "{ctx}");
                    assert_eq!(text, w.text, "{ctx}");
                    assert_eq!(streamed[id as usize], w.text, "{ctx}: streamed text");
                    assert_eq!(reason, w.finish_reason, "{ctx}");
                }
                Finish::Failed(e) => panic!("request {id} failed: {e}"),
            }
        }
        if blocks == 7 {
            assert!(s.stats().preemptions > 0, "the small pool preempts");
        }
        assert_eq!(pool.stats().used, 0);
    }
}
