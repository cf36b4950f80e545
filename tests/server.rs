//! The TCP server end to end on loopback with smollm2-135m: outputs equal `arbor generate`'s, many clients get exactly their own outputs, hostile input is answered code by code while a good request completes, cancellation and disconnects free KV blocks, failing drafters, auth, overload, slow readers, shutdown, and a fuzz test over arbitrary lines.

mod common;
#[path = "server/harness.rs"]
mod harness;

use std::sync::Arc;
use std::time::Duration;

use arbor_actors::server::ServerConfig;
use arbor_actors::{DraftContext, DrafterFactory, Limits};
use arbor_engine::draft::{DraftRequest, Drafter, NgramDrafter};
use arbor_engine::spec::{self, SpecParams};
use arbor_engine::tree::TokenTree;
use arbor_engine::{generate, EngineError, GenerateParams, SamplingParams};
use harness::{code, engine_config, streamed, Client, TestServer};
use serde_json::{json, Value};

const PROMPTS: [&str; 4] = [
    "def fibonacci(n):",
    "The capital of France is",
    "```python\nimport numpy as np\nx = np.arange(10)\n",
    "Once upon a time, in a small village,",
];

fn params(max_tokens: usize, temperature: f32, seed: u64) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    }
}

/// What `arbor generate` prints for this prompt (with `--draft ngram` when `spec` is set).
fn reference(prompt: &str, p: &GenerateParams, spec: Option<bool>) -> (String, Vec<u32>) {
    let m = common::smollm2();
    let be = common::backend();
    let ids = m.tok.encode_prompt(prompt).expect("encode");
    match spec {
        None => {
            let o = generate(&m.model, be, &m.tok, &ids, p, |_| {}).expect("generate");
            (o.text, o.tokens)
        }
        Some(adaptive) => {
            let d = NgramDrafter::default();
            let mut ng = NgramDrafter::new(d.max_n, 1, 8, d.max_matches).expect("ngram");
            let mut ds: Vec<&mut dyn Drafter> = vec![&mut ng];
            let sp = SpecParams {
                budget: 64,
                mode: None,
                adaptive,
                step_cost: None,
            };
            let o = spec::generate(&m.model, be, &m.tok, &ids, p, &sp, &mut ds, |_| {})
                .expect("spec generate");
            (o.output.text, o.output.tokens)
        }
    }
}

/// A request's `speculation`: none, or prompt lookup with adaptive (`Some(true)`) or fixed
/// trees, as `reference(.., spec)` runs.
fn ngram_or_none(spec: Option<bool>) -> Value {
    match spec {
        None => json!({"draft": []}),
        Some(adaptive) => json!({"draft": ["ngram"], "adaptive": adaptive}),
    }
}

fn request(id: Value, prompt: &str, p: &GenerateParams) -> Value {
    json!({
        "id": id,
        "prompt": prompt,
        "max_tokens": p.max_tokens,
        "temperature": p.sampling.temperature,
        "seed": p.sampling.seed,
    })
}

#[test]
fn streamed_text_equals_generate_with_and_without_speculation() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let mut n = 0;
    // (temperature, speculation): greedy plain and speculative (adaptive by default), sampled
    // plain and with a fixed speculation config.
    for (temperature, spec) in [
        (0.0f32, None),
        (0.0, Some(true)),
        (0.8, None),
        (0.8, Some(false)),
    ] {
        for (i, prompt) in PROMPTS.iter().enumerate() {
            let p = params(24, temperature, 11 + i as u64);
            let mut req = request(json!(format!("r{n}")), prompt, &p);
            n += 1;
            req["speculation"] = match spec {
                None => json!({"draft": []}),
                Some(adaptive) => json!({"draft": ["ngram"], "adaptive": adaptive}),
            };
            let (events, fin) = c.run(&req);
            assert_eq!(fin["done"], true, "{fin}");
            let (text, toks) = streamed(&events);
            let (want_text, want_toks) = reference(prompt, &p, spec);
            assert_eq!(
                toks, want_toks,
                "tokens of {prompt:?} t={temperature} spec={spec:?}"
            );
            assert_eq!(
                text, want_text,
                "text of {prompt:?} t={temperature} spec={spec:?}"
            );
            assert_eq!(fin["usage"]["completion_tokens"], want_toks.len());
            assert_eq!(fin["spec"].is_null(), spec.is_none(), "{fin}");
            // Not streamed: the final line carries the whole text.
            let mut req2 = req.clone();
            req2["id"] = json!(format!("r{n}"));
            n += 1;
            req2["stream"] = json!(false);
            let (events, fin) = c.run(&req2);
            assert!(events.is_empty(), "no token lines when not streaming");
            assert_eq!(fin["text"], json!(want_text));
        }
    }
    // Cancelled mid-stream: the final line still reports the request's speculation counters
    // and its prefix-cache hit (the prompt's full blocks cached by the request before it).
    let prompt =
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";
    let spec = json!({"draft": ["ngram"], "adaptive": false});
    let (_, warm) =
        c.run(&json!({"id": "warm", "prompt": prompt, "max_tokens": 2, "speculation": spec}));
    assert_eq!(warm["usage"]["cached_prompt_tokens"], 0, "{warm}");
    c.send(
        &json!({"id": "cut", "prompt": prompt, "max_tokens": 3000, "ignore_eos": true,
        "speculation": spec}),
    );
    let (_, _) = (c.recv(), c.recv());
    c.send(&json!({"cancel": "cut"}));
    let fin = loop {
        let v = c.recv();
        if v.get("done").is_some() {
            break v;
        }
    };
    assert_eq!(fin["finish_reason"], "cancelled", "{fin}");
    assert!(
        fin["spec"]["steps"].as_u64().is_some_and(|n| n > 0),
        "{fin}"
    );
    assert!(
        fin["usage"]["cached_prompt_tokens"]
            .as_u64()
            .is_some_and(|n| n >= 16),
        "{fin}"
    );
}

/// Token lines and the final line of `n` requests whose lines interleave on one connection, by
/// integer id (one final line each, no token line after it).
fn collect_by_id(
    c: &mut Client,
    n: usize,
) -> std::collections::HashMap<u64, (Vec<Value>, Option<Value>)> {
    let mut got: std::collections::HashMap<u64, (Vec<Value>, Option<Value>)> = Default::default();
    while got.values().filter(|(_, f)| f.is_some()).count() < n {
        let v = c.recv();
        let id = v["id"].as_u64().expect("integer id");
        let e = got.entry(id).or_default();
        assert!(e.1.is_none(), "a line after the final one of {id}");
        if v.get("done").is_some() || v.get("error").is_some() {
            e.1 = Some(v);
        } else {
            e.0.push(v);
        }
    }
    got
}

/// A served model drafter (early exit: smollm2's first 10 layers) drafts every request of a
/// step together (one pass per tree depth for all of them, its instances in one pool): twelve
/// concurrent greedy requests over three connections get exactly plain decoding's tokens, trees
/// were verified, no drafter failed, and every LLM block comes back.
#[test]
fn a_served_model_drafter_keeps_every_concurrent_greedy_output() {
    let (model, _) = common::smollm2_shared();
    let shape: arbor_engine::draft::DraftShape = "1,1,2,1".parse().expect("shape");
    let ee = DrafterFactory::early_exit(&model, 10, shape, 0, 16 << 20).expect("early exit");
    assert_eq!(ee.name, "early-exit:10");
    let server = TestServer::start(engine_config(vec![ee]), ServerConfig::default());
    let addr = server.addr;
    let threads: Vec<_> = (0..3)
        .map(|conn| {
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                let mut want = Vec::new();
                for k in 0..4 {
                    let i = conn * 4 + k;
                    let prompt = PROMPTS[i % PROMPTS.len()];
                    let p = params(12 + i % 4, 0.0, 0);
                    let mut req = request(json!(i), prompt, &p);
                    req["speculation"] =
                        json!({"draft": ["early-exit:10"], "adaptive": i % 2 == 0});
                    c.send(&req);
                    want.push((i, prompt, p));
                }
                (want, collect_by_id(&mut c, 4))
            })
        })
        .collect();
    let mut drafted = 0;
    for t in threads {
        let (want, got) = t.join().expect("client thread");
        for (i, prompt, p) in want {
            let (events, fin) = &got[&(i as u64)];
            let fin = fin.as_ref().expect("final");
            assert_eq!(fin["done"], true, "{fin}");
            let (text, toks) = streamed(events);
            let (want_text, want_toks) = reference(prompt, &p, None);
            assert_eq!(toks, want_toks, "request {i}");
            assert_eq!(text, want_text, "request {i}");
            drafted += fin["spec"]["drafted"].as_u64().expect("spec stats");
        }
    }
    assert!(drafted > 0, "model trees were verified");
    let s = server.wait_stats("idle", |s| s["running"] == 0);
    assert_eq!(s["drafter_failures"], 0, "{s}");
    assert_eq!(s["kv_blocks_used"], 0, "{s}");
    assert_eq!(s["completed"], 12, "{s}");
}

#[test]
fn thirty_two_clients_over_eight_connections_get_their_own_outputs() {
    let server = TestServer::plain();
    let addr = server.addr;
    let threads: Vec<_> = (0..8)
        .map(|conn| {
            std::thread::spawn(move || {
                let mut c = Client::connect(addr);
                let mut want = Vec::new();
                for k in 0..4 {
                    let i = conn * 4 + k;
                    let prompt = PROMPTS[i % PROMPTS.len()];
                    let temperature = if i % 2 == 0 { 0.0 } else { 0.9 };
                    let p = params(10 + i % 5, temperature, 100 + i as u64);
                    c.send(&request(json!(i), prompt, &p));
                    want.push((i, prompt, p));
                }
                // Lines of the four requests interleave: collect per id.
                (want, collect_by_id(&mut c, 4))
            })
        })
        .collect();
    for t in threads {
        let (want, got) = t.join().expect("client thread");
        for (i, prompt, p) in want {
            let (events, fin) = &got[&(i as u64)];
            assert_eq!(fin.as_ref().expect("final")["done"], true);
            let (text, toks) = streamed(events);
            let (want_text, want_toks) = reference(prompt, &p, None);
            assert_eq!(toks, want_toks, "request {i}");
            assert_eq!(text, want_text, "request {i}");
        }
    }
    let s = server.wait_stats("idle", |s| s["running"] == 0);
    assert_eq!(s["kv_blocks_used"], 0, "{s}");
    assert_eq!(s["completed"], 32, "{s}");
}

/// (line, expected code, whether the error line carries an id).
fn hostile_lines() -> Vec<(Vec<u8>, &'static str)> {
    let l = |s: &str| s.as_bytes().to_vec();
    vec![
        (b"\xff\xfe\xfd".to_vec(), "invalid_utf8"),
        (b"{\"id\": \"\xc3\x28\"}".to_vec(), "invalid_utf8"),
        (l("{not json"), "invalid_json"),
        (l("{\"id\": 1,}"), "invalid_json"),
        (l("\"just a string\""), "not_an_object"),
        (l("[1, 2, 3]"), "not_an_object"),
        (l("42"), "not_an_object"),
        (l("null"), "not_an_object"),
        (l(r#"{"prompt": "hi"}"#), "missing_field"),
        (l(r#"{"id": "a1"}"#), "missing_field"),
        (
            l(r#"{"id": "a2", "prompt": "hi", "bogus": 1}"#),
            "unknown_field",
        ),
        (
            l(r#"{"id": "a3", "prompt": "hi", "speculation": {"depth": 2}}"#),
            "unknown_field",
        ),
        (l(r#"{"cancel": "x", "extra": true}"#), "unknown_field"),
        (
            l(r#"{"id": "a4", "messages": [{"role": "user", "content": "hi", "name": "x"}]}"#),
            "unknown_field",
        ),
        (l(r#"{"id": [1], "prompt": "hi"}"#), "invalid_type"),
        (l(r#"{"id": 1.5, "prompt": "hi"}"#), "invalid_type"),
        (l(r#"{"id": "a5", "prompt": 7}"#), "invalid_type"),
        (
            l(r#"{"id": "a6", "prompt": "hi", "max_tokens": "ten"}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "a7", "prompt": "hi", "stream": "yes"}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "a8", "prompt": "hi", "stop": [1]}"#),
            "invalid_type",
        ),
        (l(r#"{"id": "a9", "messages": "hello"}"#), "invalid_type"),
        (
            l(r#"{"id": "b1", "prompt": "hi", "speculation": 3}"#),
            "invalid_type",
        ),
        (l(r#"{"health": 1}"#), "invalid_type"),
        (
            l(r#"{"id": "b2", "prompt": "hi", "max_tokens": -1}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b3", "prompt": "hi", "max_tokens": 0}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b4", "prompt": "hi", "max_tokens": 100000000}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b5", "prompt": "hi", "temperature": -0.5}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b6", "prompt": "hi", "top_p": 0}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7", "prompt": "hi", "top_p": 1.5}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7m", "prompt": "hi", "min_p": 1.5}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7n", "prompt": "hi", "min_p": -0.1}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7r", "prompt": "hi", "repetition_penalty": 0}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7t", "prompt": "hi", "top_logprobs": 2}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7b", "prompt": "hi", "logit_bias": {"12": 101}}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7c", "prompt": "hi", "logit_bias": {"x": 1}}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7d", "prompt": "hi", "logit_bias": [[12, 1]]}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "b7e", "prompt": "hi", "logit_bias": {"99999999": 1}}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7n", "prompt": "hi", "n": 0}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7o", "prompt": "hi", "n": 65}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7p", "prompt": "hi", "n": "2"}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "b7s", "prompt": "hi", "stop_token_ids": [99999999]}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7v", "prompt": "hi", "stop_token_ids": [-1]}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7w", "prompt": "hi", "stop_token_ids": 5}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "b7j", "prompt": "hi", "response_format": "json"}"#),
            "invalid_type",
        ),
        (
            l(
                r#"{"id": "b7k", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#,
            ),
            "missing_field",
        ),
        (
            l(
                r#"{"id": "b7x", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"e": {"type": "integer", "minimum": 0}}}}}}"#,
            ),
            "invalid_argument",
        ),
        (
            l(
                r#"{"id": "b7y", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strictly": true}}}"#,
            ),
            "unknown_field",
        ),
        (
            l(
                r#"{"id": "b7z", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": "yes"}}}"#,
            ),
            "invalid_type",
        ),
        (
            l(
                r#"{"id": "b7l", "prompt": "hi", "response_format": {"type": "json_object", "schema": {}}}"#,
            ),
            "unknown_field",
        ),
        (
            l(r#"{"id": "b7m", "prompt": "hi", "response_format": {}}"#),
            "missing_field",
        ),
        (
            l(r#"{"id": "b7u", "prompt": "hi", "logprobs": true, "top_logprobs": 21}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7f", "prompt": "hi", "frequency_penalty": 2.5}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b7p", "prompt": "hi", "presence_penalty": "high"}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "b8", "prompt": "hi", "deadline_ms": 0}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "b9", "prompt": "hi", "min_tokens": 9, "max_tokens": 3}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "c1", "prompt": "hi", "speculation": {"draft": ["ssm"]}}"#),
            "invalid_argument",
        ),
        (
            l(
                r#"{"id": "c2", "prompt": "hi", "speculation": {"verify": "greedy"}, "temperature": 0.7}"#,
            ),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "c3", "prompt": "hi", "speculation": {"verify": "magic"}}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "c4", "prompt": "hi", "messages": []}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": "c5", "prompt": "hi", "stop": ["", "x"]}"#),
            "invalid_argument",
        ),
        (
            l(&format!(
                r#"{{"id": "{}", "prompt": "hi"}}"#,
                "x".repeat(300)
            )),
            "invalid_argument",
        ),
        (l(r#"{"health": false}"#), "invalid_argument"),
        (l(r#"{"id": "c6", "prompt": ""}"#), "empty_prompt"),
        (l(r#"{"id": "c7", "messages": []}"#), "empty_prompt"),
        (
            l(r#"{"id": "c8", "messages": [{"role": "wizard", "content": "hi"}]}"#),
            "invalid_role",
        ),
        (
            l(r#"{"id": "c9", "messages": [{"role": "user"}]}"#),
            "missing_field",
        ),
        (l(r#"{"cancel": "never-sent"}"#), "unknown_id"),
        (l(r#"{"cancel": {"x": 1}}"#), "invalid_type"),
        (l(r#"{"auth": 5}"#), "invalid_type"),
        (
            l(r#"{"id": "e1", "prompt": "hi", "max_tokens": 1.5}"#),
            "invalid_type",
        ),
        (
            l(r#"{"id": "e2", "prompt": "hi", "seed": -3}"#),
            "invalid_argument",
        ),
        (
            l(r#"{"id": 18446744073709551616, "prompt": "hi"}"#),
            "invalid_argument",
        ),
        (l(r#"{"id": 1.5, "prompt": "hi"}"#), "invalid_type"),
        (vec![b'a'; 5000], "line_too_long"),
        (
            l(&format!(
                r#"{{"id": "d1", "prompt": "{}"}}"#,
                "word ".repeat(900)
            )),
            "line_too_long",
        ),
        (
            l(r#"{"id": "d2", "prompt": "hi", "max_tokens": 5000}"#),
            "invalid_argument",
        ),
        (
            l(&format!(
                r#"{{"id": "d3", "prompt": "{}"}}"#,
                "word ".repeat(150)
            )),
            "prompt_too_long",
        ),
    ]
}

#[test]
fn hostile_inputs_get_their_codes_while_a_good_request_completes() {
    let mut cfg = engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]);
    cfg.limits.max_tokens = 4096;
    cfg.limits.max_prompt_tokens = 100;
    let server = TestServer::start(
        cfg,
        ServerConfig {
            max_line_bytes: 4096,
            ..ServerConfig::default()
        },
    );
    let p = params(40, 0.0, 1);
    let (want_text, want_toks) = reference(PROMPTS[0], &p, None);
    // The good request runs on its own connection; the hostile lines share another connection
    // with a second good request.
    let mut good = server.client();
    let mut good_req = request(json!("good"), PROMPTS[0], &p);
    good_req["speculation"] = json!({"draft": []});
    good.send(&good_req);
    let mut bad = server.client();
    let mut bad_req = request(json!("good2"), PROMPTS[0], &p);
    bad_req["speculation"] = json!({"draft": []});
    bad.send(&bad_req);
    let lines = hostile_lines();
    assert!(lines.len() >= 30);
    let mut good2 = Vec::new();
    for (line, want) in &lines {
        let mut bytes = line.clone();
        bytes.push(b'\n');
        bad.send_raw(&bytes);
        // Answers to this connection's good request may come in between.
        let answer = loop {
            let v = bad.recv();
            if v["id"] == "good2" {
                good2.push(v);
                continue;
            }
            break v;
        };
        assert_eq!(
            code(&answer),
            *want,
            "line {:?} got {answer}",
            String::from_utf8_lossy(&line[..line.len().min(80)])
        );
    }
    // A duplicate id while "good2" runs (unless it already finished), then the connection
    // still serves.
    let fin2 = if good2.iter().any(|v| v.get("done").is_some()) {
        good2.pop().expect("final")
    } else {
        bad.send(&bad_req);
        let v = loop {
            let v = bad.recv();
            if v.get("error").is_some() || v.get("done").is_some() {
                break v;
            }
            good2.push(v);
        };
        if v.get("error").is_some() {
            assert_eq!(code(&v), "duplicate_id", "{v}");
            // Not the final line of "good2", which goes on.
            assert_eq!(v["id"], Value::Null, "{v}");
            assert_eq!(v["rejected_id"], "good2", "{v}");
            loop {
                let v = bad.recv();
                if v.get("done").is_some() {
                    break v;
                }
                good2.push(v);
            }
        } else {
            v // finished just before the duplicate arrived: the duplicate runs as a new request
        }
    };
    assert_eq!(fin2["done"], true, "{fin2}");
    let (text, toks) = streamed(&good2);
    assert_eq!(toks, want_toks);
    assert_eq!(text, want_text);
    // The other connection's request is untouched by all of it.
    let mut events = Vec::new();
    let fin = loop {
        let v = good.recv();
        if v.get("done").is_some() || v.get("error").is_some() {
            break v;
        }
        events.push(v);
    };
    assert_eq!(fin["done"], true, "{fin}");
    let (text1, toks1) = streamed(&events);
    assert_eq!(toks1, want_toks);
    assert_eq!(text1, want_text);
    // Both connections still work.
    bad.send(&json!({"health": true}));
    let mut h = bad.recv();
    while h.get("health").is_none() {
        h = bad.recv();
    }
    assert_eq!(h["health"], "ok");
}

#[test]
fn disconnect_and_cancel_free_the_kv_blocks() {
    let server = TestServer::plain();
    // Cancel: the final line says cancelled, and blocks are free once it is read.
    let mut c = server.client();
    c.send(&json!({"id": "long", "prompt": PROMPTS[3], "max_tokens": 3000, "ignore_eos": true}));
    let first = c.recv();
    assert_eq!(first["id"], "long", "{first}");
    let mut long_events = vec![first];
    // Its id is taken while it runs.
    c.send(&json!({"id": "long", "prompt": "hi"}));
    let dup = loop {
        let v = c.recv();
        if v.get("error").is_some() {
            break v;
        }
        long_events.push(v);
    };
    assert_eq!(code(&dup), "duplicate_id", "{dup}");
    assert_eq!(dup["id"], Value::Null, "{dup}");
    assert_eq!(dup["rejected_id"], "long", "{dup}");
    // A bad line with the running request's id does not end it either.
    c.send(&json!({"id": "long", "prompt": "hi", "top_p": 7}));
    let bad = loop {
        let v = c.recv();
        if v.get("error").is_some() {
            break v;
        }
        long_events.push(v);
    };
    assert_eq!(code(&bad), "invalid_argument", "{bad}");
    assert_eq!(bad["rejected_id"], "long", "{bad}");
    c.send(&json!({"cancel": "long"}));
    let fin = loop {
        let v = c.recv();
        if v.get("done").is_some() {
            break v;
        }
        long_events.push(v);
    };
    assert_eq!(fin["finish_reason"], "cancelled", "{fin}");
    // The final line counts what was streamed, not steps that ran after the cancel.
    let (_, streamed_toks) = streamed(&long_events);
    assert_eq!(
        fin["usage"]["completion_tokens"],
        streamed_toks.len(),
        "{fin}"
    );
    let s = c.stats();
    assert_eq!(s["kv_blocks_used"], 0, "after cancel: {s}");
    assert_eq!(s["running"], 0, "{s}");
    assert_eq!(s["cancelled"], 1);
    // Cancelling a finished request is an unknown id.
    c.send(&json!({"cancel": "long"}));
    let unknown = c.recv();
    assert_eq!(code(&unknown), "unknown_id");
    assert_eq!(unknown["id"], Value::Null, "{unknown}");
    assert_eq!(unknown["cancel"], "long", "{unknown}");
    // Disconnect mid-stream.
    let mut d = server.client();
    d.send(&json!({"id": 1, "prompt": PROMPTS[1], "max_tokens": 3000, "ignore_eos": true}));
    let _ = d.recv();
    let _ = d.recv();
    drop(d);
    let s = server.wait_stats("cancellation after disconnect", |s| s["cancelled"] == 2);
    assert_eq!(s["kv_blocks_used"], 0, "after disconnect: {s}");
    assert_eq!(s["running"], 0, "{s}");
}

/// A drafter that proposes a chain of the root repeated, then fails: by error or by panic.
struct FailingDrafter {
    proposals: usize,
    fail_after: usize,
    panic: bool,
}

impl Drafter for FailingDrafter {
    fn name(&self) -> &str {
        if self.panic {
            "panicking"
        } else {
            "erroring"
        }
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> arbor_engine::Result<TokenTree> {
        self.proposals += 1;
        if self.proposals > self.fail_after {
            if self.panic {
                panic!("drafter bug (test)");
            }
            return Err(EngineError::InvalidArgument(
                "drafter failure (test)".into(),
            ));
        }
        let n = req.budget.min(req.max_depth).min(2);
        Ok(TokenTree::chain(
            req.root(),
            &vec![req.root(); n],
            req.drafter,
        ))
    }
}

/// A drafter that answers every proposal after `delay` with a chain of the root repeated.
struct SlowDrafter {
    delay: Duration,
}

impl Drafter for SlowDrafter {
    fn name(&self) -> &str {
        "slow"
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> arbor_engine::Result<TokenTree> {
        std::thread::sleep(self.delay);
        Ok(TokenTree::chain(req.root(), &[req.root()], req.drafter))
    }
}

/// A drafter that does not answer a step in time is dropped for that step's requests (which go
/// on with their other drafters, output unchanged) and is not asked again while its late reply
/// is pending: one failure, not one two-second wait per step.
#[test]
fn a_drafter_too_slow_for_a_step_is_dropped_for_its_requests() {
    let slow = DrafterFactory::new("slow", |_: &DraftContext| {
        Ok(Box::new(SlowDrafter {
            delay: Duration::from_millis(2500),
        }) as Box<dyn Drafter>)
    });
    let server = TestServer::start(
        engine_config(vec![slow, DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let p = params(12, 0.0, 0);
    let mut req = request(json!("a"), PROMPTS[2], &p);
    req["speculation"] = json!({"adaptive": false, "draft": ["slow", "ngram"]});
    let t0 = std::time::Instant::now();
    let (events, fin) = c.run(&req);
    let took = t0.elapsed();
    assert_eq!(fin["done"], true, "{fin}");
    let (text, toks) = streamed(&events);
    let (want_text, want_toks) = reference(PROMPTS[2], &p, None);
    assert_eq!(toks, want_toks);
    assert_eq!(text, want_text);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    let s = c.stats();
    assert_eq!(s["drafter_failures"], 1, "{s}");
}

/// Durations too long for `Instant` (a shutdown grace of `Duration::MAX`, a deadline limit of
/// `Duration::MAX`) mean no limit: the request completes and the shutdown returns (the
/// additions panicked on the engine thread and the shutdown waited forever).
#[test]
fn unbounded_grace_and_deadline_mean_no_limit() {
    let mut config = engine_config(vec![]);
    config.limits.max_deadline = Duration::MAX;
    let engine = std::sync::Arc::new(arbor_actors::Engine::start(config).expect("engine starts"));
    let mut req = arbor_actors::Request::prompt(PROMPTS[1]);
    req.max_tokens = 4;
    let done = engine
        .submit(req)
        .expect("submit")
        .wait()
        .expect("completes");
    assert_eq!(done.usage.completion_tokens, 4);
    let (tx, rx) = std::sync::mpsc::channel();
    let e = std::sync::Arc::clone(&engine);
    std::thread::spawn(move || {
        e.shutdown(Duration::MAX);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("shutdown(Duration::MAX) returns");
}

/// Sets its flag when dropped, a while after being asked to.
struct SlowDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for SlowDrop {
    fn drop(&mut self) {
        std::thread::sleep(Duration::from_millis(300));
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `Engine::shutdown` returns once the compute threads have dropped their actors (here a
/// drafter's factory, whose drop takes 300 ms), not while they are still being torn down.
#[test]
fn shutdown_returns_after_the_compute_threads_dropped_their_state() {
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let held = SlowDrop(std::sync::Arc::clone(&dropped));
    let factory = DrafterFactory::new("slow-drop", move |_: &DraftContext| {
        let _held = &held;
        Ok(Box::new(NgramDrafter::new(3, 1, 8, 4).expect("ngram")) as Box<dyn Drafter>)
    });
    let engine = arbor_actors::Engine::start(engine_config(vec![factory])).expect("starts");
    let mut req = arbor_actors::Request::prompt(PROMPTS[0]);
    req.max_tokens = 4;
    engine
        .submit(req)
        .expect("submit")
        .wait()
        .expect("completes");
    assert!(!dropped.load(std::sync::atomic::Ordering::SeqCst));
    engine.shutdown(Duration::from_secs(1));
    assert!(
        dropped.load(std::sync::atomic::Ordering::SeqCst),
        "shutdown returned before the drafter thread dropped its factory"
    );
}

/// Dropping a request's handle before its final event cancels the request: a waiting one no
/// longer holds a place in the `max_waiting` queue.
#[test]
fn dropping_a_request_handle_cancels_the_request() {
    let mut config = engine_config(vec![]);
    config.sched.max_running = 1;
    config.limits.max_waiting = 1;
    let engine = arbor_actors::Engine::start(config).expect("engine starts");
    let mut long = arbor_actors::Request::prompt(PROMPTS[3]);
    long.max_tokens = 4000;
    long.ignore_eos = true;
    let long = engine.submit(long).expect("submit");
    assert!(matches!(
        long.recv(),
        Some(arbor_actors::Event::Tokens { .. })
    ));
    // Waits behind `long` (one running request at most), then is dropped.
    drop(
        engine
            .submit(arbor_actors::Request::prompt("a"))
            .expect("submit"),
    );
    let mut b = arbor_actors::Request::prompt("b");
    b.max_tokens = 2;
    let b = engine.submit(b).expect("submit");
    engine.cancel(long.id);
    let done = b.wait().expect("b is not refused as overloaded");
    assert_eq!(done.usage.completion_tokens, 2);
    // `a` and `long` end cancelled (`a` without a place in the queue, as `b` showed).
    let t0 = std::time::Instant::now();
    while engine.stats().expect("stats").cancelled < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "a and long not cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_failing_drafter_does_not_change_greedy_output() {
    let factory = |panic: bool| {
        DrafterFactory::new(
            if panic { "panicking" } else { "erroring" },
            move |_: &DraftContext| {
                Ok(Box::new(FailingDrafter {
                    proposals: 0,
                    fail_after: 3,
                    panic,
                }) as Box<dyn Drafter>)
            },
        )
    };
    let server = TestServer::start(
        engine_config(vec![
            factory(true),
            factory(false),
            DrafterFactory::ngram(3).expect("ngram"),
        ]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let p = params(20, 0.0, 0);
        let mut req = request(json!(i), prompt, &p);
        req["speculation"] = json!({"adaptive": false});
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let (text, toks) = streamed(&events);
        let (want_text, want_toks) = reference(prompt, &p, None);
        assert_eq!(toks, want_toks, "{prompt:?}");
        assert_eq!(text, want_text);
    }
    let s = c.stats();
    assert_eq!(s["drafter_failures"], 2 * PROMPTS.len() as u64, "{s}");
}

/// Token Recycling served: every request's drafter learns from the candidates the Verifier
/// sends with each commit, per request or from one matrix all requests share; greedy outputs
/// stay the LLM's own and recycled guesses are accepted.
#[test]
fn served_token_recycling_keeps_greedy_output() {
    let vocab = common::smollm2().model.config.vocab_size;
    // Per request with the prompt rows' candidates; shared, from the prompts' successors.
    for shared in [false, true] {
        let server = TestServer::start(
            engine_config(vec![
                DrafterFactory::recycle(vocab, 8, shared, !shared).expect("recycle"),
                DrafterFactory::ngram(3).expect("ngram"),
            ]),
            ServerConfig::default(),
        );
        let mut c = server.client();
        let mut accepted = 0;
        for (i, prompt) in PROMPTS.iter().enumerate() {
            let p = params(24, 0.0, 0);
            let mut req = request(json!(i), prompt, &p);
            req["speculation"] = json!({"draft": ["recycle"], "adaptive": false, "budget": 8});
            let (events, fin) = c.run(&req);
            assert_eq!(fin["done"], true, "{fin}");
            accepted += fin["spec"]["accepted"].as_u64().unwrap_or(0);
            let (text, toks) = streamed(&events);
            let (want_text, want_toks) = reference(prompt, &p, None);
            assert_eq!(toks, want_toks, "shared {shared}: {prompt:?}");
            assert_eq!(text, want_text);
        }
        assert!(accepted > 0, "shared {shared}: recycled guesses accepted");
    }
}

/// A request's `speculation.tree` caps the depth every drafter is asked for (only prompt lookup
/// was built to the request's depth; Token Recycling's template and model drafters' shapes
/// have their own).
#[test]
fn served_tree_depth_caps_every_drafter() {
    use std::sync::{Arc, Mutex};
    /// Records the depth it is asked for; proposes the root alone.
    struct Probe(Arc<Mutex<Vec<usize>>>);
    impl Drafter for Probe {
        fn name(&self) -> &str {
            "probe"
        }
        fn propose(&mut self, req: &DraftRequest<'_>) -> arbor_engine::Result<TokenTree> {
            self.0.lock().unwrap().push(req.max_depth);
            Ok(TokenTree::root_only(req.root()))
        }
    }
    let asked = Arc::new(Mutex::new(Vec::new()));
    let factory = {
        let asked = Arc::clone(&asked);
        DrafterFactory::new("probe", move |_: &DraftContext| {
            Ok(Box::new(Probe(Arc::clone(&asked))) as Box<dyn Drafter>)
        })
    };
    let server = TestServer::start(engine_config(vec![factory]), ServerConfig::default());
    let mut c = server.client();
    for (tree, adaptive) in [(2, false), (3, true)] {
        asked.lock().unwrap().clear();
        let p = params(16, 0.0, 0);
        let mut req = request(json!(tree), PROMPTS[0], &p);
        req["speculation"] = json!({"draft": ["probe"], "adaptive": adaptive, "tree": tree});
        let (_, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let asked = asked.lock().unwrap().clone();
        assert!(!asked.is_empty());
        assert!(
            asked.iter().all(|&d| d <= tree),
            "tree {tree}: asked {asked:?}"
        );
    }
}

/// A drafter factory's `max_nodes` reaches the scheduler, which reserves a step's rows by it
/// and cuts a tree that exceeds it: a drafter that says one node but proposes four gets one
/// verified a step, and greedy output is unchanged.
#[test]
fn served_trees_stay_within_their_drafters_bound() {
    use arbor_engine::tree::{Proposal, TreeBuilder};
    /// A chain of four guesses (the root's token again and again).
    struct Chain;
    impl Drafter for Chain {
        fn name(&self) -> &str {
            "chain"
        }
        fn propose(&mut self, req: &DraftRequest<'_>) -> arbor_engine::Result<TokenTree> {
            let mut b = TreeBuilder::new(req.root());
            let mut at = TreeBuilder::ROOT;
            for _ in 0..4.min(req.max_depth).min(req.budget) {
                at = b.add_child(at, req.root(), Some(Proposal::picked(req.drafter, 1.0)));
            }
            Ok(b.build())
        }
    }
    let factory = DrafterFactory::new("chain", |_: &DraftContext| {
        Ok(Box::new(Chain) as Box<dyn Drafter>)
    })
    .with_max_nodes(|_, _| 1);
    let server = TestServer::start(engine_config(vec![factory]), ServerConfig::default());
    let mut c = server.client();
    let p = params(16, 0.0, 0);
    let mut req = request(json!(1), PROMPTS[0], &p);
    req["speculation"] = json!({"draft": ["chain"], "adaptive": false});
    let (events, fin) = c.run(&req);
    assert_eq!(fin["done"], true, "{fin}");
    let n = |k: &str| fin["spec"][k].as_u64().expect("spec counter");
    assert!(n("steps") > 0 && n("drafted") <= n("steps"), "{fin}");
    assert_eq!(streamed(&events).1, reference(PROMPTS[0], &p, None).1);
}

#[test]
fn auth_is_required_when_configured() {
    let server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            auth_token: Some("s3cret".into()),
            ..ServerConfig::default()
        },
    );
    let mut c = server.client();
    c.send(&json!({"health": true}));
    assert_eq!(code(&c.recv()), "unauthorized");
    c.send(&json!({"id": 1, "prompt": "hi", "max_tokens": 2}));
    let v = c.recv();
    assert_eq!(code(&v), "unauthorized");
    assert_eq!(v["id"], 1);
    c.send(&json!({"auth": "wrong"}));
    assert_eq!(code(&c.recv()), "unauthorized");
    c.send(&json!({"auth": "s3cret"}));
    assert_eq!(c.recv()["auth"], "ok");
    let (_, fin) = c.run(&json!({"id": 2, "prompt": "hi", "max_tokens": 2}));
    assert_eq!(fin["done"], true, "{fin}");
    // Once authenticated, a token is still checked, and the connection stays authenticated.
    c.send(&json!({"auth": "wrong"}));
    assert_eq!(code(&c.recv()), "unauthorized");
    c.send(&json!({"auth": "s3cret"}));
    assert_eq!(c.recv()["auth"], "ok");
    c.send(&json!({"health": true}));
    assert_eq!(c.recv()["health"], "ok");
    // Each connection authenticates for itself.
    let mut c2 = server.client();
    c2.send(&json!({"stats": true}));
    assert_eq!(code(&c2.recv()), "unauthorized");
    // Without a token configured nothing is asked.
    let open = TestServer::plain();
    let mut c3 = open.client();
    let (_, fin) = c3.run(&json!({"id": 3, "prompt": "hi", "max_tokens": 2}));
    assert_eq!(fin["done"], true);
    c3.send(&json!({"auth": "anything"}));
    assert_eq!(c3.recv()["auth"], "not_required");
}

/// An integer field written as a float without a fractional part (`2.0`, as some JSON encoders
/// write numbers) is that integer.
#[test]
fn integral_floats_are_integers() {
    let server = TestServer::plain();
    let mut c = server.client();
    let (events, fin) = c.run(&json!({"id": 1, "prompt": "hi", "max_tokens": 2.0, "seed": 7.0}));
    assert_eq!(fin["done"], true, "{fin}");
    assert_eq!(fin["usage"]["completion_tokens"], 2, "{fin}");
    assert_eq!(streamed(&events).1.len(), 2);
}

/// A client that pipelines thousands of lines in one go and reads the replies as they come is
/// answered line by line (its replies wait for room in its outgoing queue), not cut off as a
/// client that stopped reading.
#[test]
fn a_pipelined_burst_of_lines_is_answered_in_full() {
    let server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            out_queue_lines: 64,
            ..ServerConfig::default()
        },
    );
    let mut c = server.client();
    let burst: String = (0..3000).map(|_| "{\"health\": true}\n").collect();
    let mut w = c.w.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        w.write_all(burst.as_bytes()).expect("write the burst");
    });
    for i in 0..3000 {
        let v = c.recv();
        assert_eq!(v["health"], "ok", "reply {i}: {v}");
    }
    writer.join().expect("writer");
    let (_, fin) = c.run(&json!({"id": 1, "prompt": "hi", "max_tokens": 2}));
    assert_eq!(fin["done"], true, "{fin}");
    let s = c.stats();
    assert_eq!(s["slow_reader_connections"], 0, "{s}");
}

/// A peer that never reads the lines written to it (a zero receive window) is closed a few
/// seconds after its session ends, its unsent lines dropped: the connection's writer does not
/// outlive it holding the socket.
#[test]
fn a_peer_that_never_reads_its_last_lines_is_closed() {
    use std::io::{BufRead, Write};
    let server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            auth_token: Some("t".into()),
            auth_timeout: Duration::from_millis(300),
            send_buffer_bytes: Some(4096),
            ..ServerConfig::default()
        },
    );
    let sock =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    sock.set_recv_buffer_size(4096).expect("rcvbuf");
    sock.connect(&server.addr.into()).expect("connect");
    let mut tcp: std::net::TcpStream = sock.into();
    // 2000 lines, each answered `unauthorized` in ~360 bytes: ~700 kB the peer never reads.
    let line = format!("{{\"cancel\": \"{}\"}}\n", "x".repeat(250));
    for _ in 0..2000 {
        tcp.write_all(line.as_bytes()).expect("write");
    }
    // The auth timeout ends the session; its writer gets 5 s to finish, then is aborted.
    std::thread::sleep(Duration::from_secs(7));
    tcp.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut r = std::io::BufReader::new(tcp);
    let (mut n, mut buf) = (0usize, String::new());
    loop {
        buf.clear();
        match r.read_line(&mut buf) {
            Ok(0) => break,
            Ok(_) => n += 1,
            Err(e) => panic!("no end of stream after {n} lines: {e}"),
        }
    }
    assert!(
        n < 1000,
        "{n} lines arrived: the writer outlived its session"
    );
}

#[test]
fn overload_limits_answer_with_their_codes() {
    let mut cfg = engine_config(vec![]);
    cfg.limits = Limits {
        max_waiting: 1,
        ..Limits::default()
    };
    cfg.sched.max_running = 1;
    let server = TestServer::start(
        cfg,
        ServerConfig {
            max_requests_per_connection: 2,
            ..ServerConfig::default()
        },
    );
    let long =
        |id: &str| json!({"id": id, "prompt": PROMPTS[3], "max_tokens": 3000, "ignore_eos": true});
    let mut c = server.client();
    c.send(&long("a"));
    let v = c.recv();
    assert_eq!(v["id"], "a");
    // "a" runs; "b" waits (the one waiting slot); a third on this connection is refused here.
    c.send(&long("b"));
    c.send(&long("c"));
    let v = loop {
        let v = c.recv();
        if v["id"] == "c" {
            break v;
        }
    };
    assert_eq!(code(&v), "too_many_requests", "{v}");
    // Another connection: the waiting queue is full.
    let mut c2 = server.client();
    c2.send(&long("d"));
    let v = c2.recv();
    assert_eq!(code(&v), "overloaded", "{v}");
    assert_eq!(v["id"], "d");
    // More choices than a connection may have in flight: never servable.
    c2.send(&json!({"id": "f", "prompt": "hi", "n": 3}));
    let v = c2.recv();
    assert_eq!(code(&v), "invalid_argument", "{v}");
    assert_eq!(v["id"], "f");
    c.send(&json!({"cancel": "a"}));
    c.send(&json!({"cancel": "b"}));
    let mut finals = 0;
    while finals < 2 {
        let v = c.recv();
        if v.get("done").is_some() {
            assert_eq!(v["finish_reason"], "cancelled");
            finals += 1;
        }
    }
    // With room again, requests are served.
    let (_, fin) = c2.run(&json!({"id": "e", "prompt": "hi", "max_tokens": 3}));
    assert_eq!(fin["done"], true, "{fin}");
    // Every choice of a request counts against the connection's limit: one running request
    // and two more choices would be three.
    c2.send(&long("g"));
    c2.send(&json!({"id": "h", "prompt": "hi", "n": 2}));
    let v = loop {
        let v = c2.recv();
        if v["id"] == "h" {
            break v;
        }
    };
    assert_eq!(code(&v), "too_many_requests", "{v}");
    c2.send(&json!({"cancel": "g"}));
    loop {
        let v = c2.recv();
        if v.get("done").is_some() {
            assert_eq!(v["finish_reason"], "cancelled", "{v}");
            break;
        }
    }
    let (_, fin) = c2.run(&json!({"id": "h", "prompt": "hi", "max_tokens": 2, "n": 2}));
    assert_eq!(fin["choices"].as_array().map(Vec::len), Some(2), "{fin}");
}

#[test]
fn idle_and_unauthenticated_connections_are_closed_with_a_line() {
    let server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            idle_timeout: Some(Duration::from_millis(400)),
            ..ServerConfig::default()
        },
    );
    // Silent: closed after the idle line.
    let mut silent = server.client();
    let v = silent.try_recv().expect("an idle_timeout line");
    assert_eq!(code(&v), "idle_timeout", "{v}");
    assert_eq!(v["id"], Value::Null, "{v}");
    assert!(silent.try_recv().is_none(), "closed after the line");
    // A request running longer than the timeout keeps its connection, and blank keep-alive
    // lines keep an idle one open.
    let mut busy = server.client();
    let (events, fin) =
        busy.run(&json!({"id": 1, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": true}));
    assert_eq!(fin["done"], true, "{fin}");
    assert_eq!(streamed(&events).1.len(), 200);
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(200));
        busy.send_raw(b"\n");
    }
    busy.send(&json!({"health": true}));
    assert_eq!(busy.recv()["health"], "ok");
    // With a token: no auth in time, closed.
    let guarded = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            auth_token: Some("t".into()),
            auth_timeout: Duration::from_millis(300),
            ..ServerConfig::default()
        },
    );
    let mut c = guarded.client();
    let v = c.try_recv().expect("an unauthorized line");
    assert_eq!(code(&v), "unauthorized", "{v}");
    assert!(c.try_recv().is_none(), "closed after the line");
    let mut ok = guarded.client();
    ok.send(&json!({"auth": "t"}));
    assert_eq!(ok.recv()["auth"], "ok");
    std::thread::sleep(Duration::from_millis(500));
    ok.send(&json!({"health": true}));
    assert_eq!(ok.recv()["health"], "ok");
}

#[test]
fn a_connection_over_the_limit_is_told_why_it_is_closed() {
    let server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            max_connections: 1,
            ..ServerConfig::default()
        },
    );
    let mut first = server.client();
    first.send(&json!({"health": true}));
    assert_eq!(first.recv()["health"], "ok");
    let mut second = server.client();
    let v = second.try_recv().expect("an error line before the close");
    assert_eq!(code(&v), "too_many_connections", "{v}");
    assert_eq!(v["id"], Value::Null, "{v}");
    assert!(second.try_recv().is_none(), "closed after the error line");
    // The first connection is untouched, and once it is gone a new one is served.
    let (_, fin) = first.run(&json!({"id": 1, "prompt": "hi", "max_tokens": 2}));
    assert_eq!(fin["done"], true, "{fin}");
    drop(first);
    let t0 = std::time::Instant::now();
    loop {
        // A refused connection is answered at once; a served one stays silent until asked.
        let mut c = server.client();
        c.w.set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        match c.try_recv() {
            Some(v) => {
                assert_eq!(code(&v), "too_many_connections", "{v}");
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "the slot never freed"
                );
            }
            None => {
                c.w.set_read_timeout(Some(Duration::from_secs(120)))
                    .expect("timeout");
                c.send(&json!({"health": true}));
                assert_eq!(c.recv()["health"], "ok");
                break;
            }
        }
    }
}

#[test]
fn a_slow_reader_is_cancelled_and_its_blocks_freed() {
    let server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            out_queue_lines: 8,
            event_queue: 8,
            send_buffer_bytes: Some(4096),
            ..ServerConfig::default()
        },
    );
    let slow = std::net::TcpStream::connect(server.addr).expect("connect");
    let _ = socket2::SockRef::from(&slow).set_recv_buffer_size(4096);
    let mut w = slow.try_clone().expect("clone");
    use std::io::Write;
    for i in 0..4 {
        let line =
            json!({"id": i, "prompt": PROMPTS[i % 4], "max_tokens": 4000, "ignore_eos": true});
        writeln!(w, "{line}").expect("write");
    }
    // Never read: the server must give up on this client instead of buffering forever.
    let s = server.wait_stats("slow reader", |s| {
        s["slow_readers"].as_u64().unwrap_or(0) + s["slow_reader_connections"].as_u64().unwrap_or(0)
            >= 1
            && s["running"] == 0
    });
    assert_eq!(s["kv_blocks_used"], 0, "{s}");
    // The server is fine.
    let mut c = server.client();
    let (_, fin) = c.run(&json!({"id": "ok", "prompt": "hi", "max_tokens": 3}));
    assert_eq!(fin["done"], true);
    drop(slow);
}

#[test]
fn shutdown_ends_in_flight_requests_with_a_final_line() {
    let mut server = TestServer::start(
        engine_config(vec![]),
        ServerConfig {
            shutdown_grace: Duration::from_millis(300),
            ..ServerConfig::default()
        },
    );
    let mut c = server.client();
    // One short request finishes within the grace; a long one is ended by the shutdown.
    c.send(&json!({"id": "long", "prompt": PROMPTS[3], "max_tokens": 4000, "ignore_eos": true}));
    let _ = c.recv();
    c.send(&json!({"id": "short", "prompt": PROMPTS[1], "max_tokens": 4}));
    std::thread::sleep(Duration::from_millis(50));
    server.signal_shutdown();
    let mut finals = std::collections::HashMap::new();
    while let Some(v) = c.try_recv() {
        if v.get("done").is_some() || v.get("error").is_some() {
            finals.insert(v["id"].as_str().expect("id").to_string(), v);
        }
    }
    assert_eq!(finals.len(), 2, "{finals:?}");
    assert_eq!(finals["long"]["finish_reason"], "shutdown");
    assert_eq!(finals["short"]["done"], true);
    assert_eq!(finals["short"]["finish_reason"], "length");
    server.shutdown();
    assert!(
        std::net::TcpStream::connect(server.addr).is_err(),
        "no longer listening"
    );
}

#[test]
fn every_error_code_is_in_the_protocol_doc() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/protocol.md"))
        .expect("docs/protocol.md");
    for (code, _) in arbor_actors::codes::ALL {
        assert!(
            doc.contains(&format!("| `{code}` |")),
            "docs/protocol.md has no table row for `{code}`"
        );
    }
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    fn server() -> &'static TestServer {
        static S: OnceLock<TestServer> = OnceLock::new();
        S.get_or_init(|| {
            TestServer::start(
                engine_config(vec![]),
                ServerConfig {
                    max_line_bytes: 512,
                    ..ServerConfig::default()
                },
            )
        })
    }

    fn line() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..600),
            "[ -~]{0,80}".prop_map(String::into_bytes),
            (
                "[a-z_]{1,12}",
                prop_oneof![
                    Just("1".to_string()),
                    Just("\"x\"".to_string()),
                    Just("[]".to_string()),
                    Just("{}".to_string()),
                    Just("null".to_string()),
                    Just("-3.5".to_string()),
                ]
            )
                .prop_map(
                    |(k, v)| format!(r#"{{"id": "f", "prompt": "a", "{k}": {v}}}"#).into_bytes()
                ),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn arbitrary_lines_never_kill_the_connection(lines in proptest::collection::vec(line(), 1..6)) {
            let mut c = server().client();
            for l in &lines {
                // Lines are framed by newlines: embedded ones split a line into several.
                let clean: Vec<u8> = l.iter().copied().filter(|&b| b != b'\n').collect();
                let mut bytes = clean;
                bytes.push(b'\n');
                c.send_raw(&bytes);
            }
            c.send(&json!({"health": true}));
            // Every line before the health check is answered or ignored (blank) without
            // closing the connection; a request that was valid may stream and finish.
            loop {
                let v = c.try_recv();
                prop_assert!(v.is_some(), "connection closed after {:?}", lines);
                let v = v.unwrap_or_default();
                if v.get("health").is_some() {
                    break;
                }
            }
        }
    }
}

/// `"logprobs": true`: every streamed line carries one log-probability per token (and with
/// `top_logprobs` that many alternatives, the token itself first under greedy decoding), the
/// final line of a request that does not stream has them all, and greedy speculation (prompt
/// lookup) gives the same values bit for bit as plain decoding; a request that does not ask gets
/// none.
#[test]
fn logprobs_come_one_per_token_and_do_not_depend_on_speculation() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let prompt = PROMPTS[2];
    let p = params(32, 0.0, 0);
    let mut runs = Vec::new();
    for (n, (spec, logprobs)) in [
        (json!({"draft": []}), true),
        (json!({"draft": ["ngram"], "adaptive": false}), true),
        (json!({"draft": []}), false),
    ]
    .into_iter()
    .enumerate()
    {
        let mut req = request(json!(format!("lp{n}")), prompt, &p);
        req["speculation"] = spec;
        req["logprobs"] = json!(logprobs);
        if logprobs {
            req["top_logprobs"] = json!(3);
        }
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let mut lps = Vec::new();
        for ev in &events {
            let n_tok = ev["tokens"].as_array().map_or(0, |t| t.len());
            match ev.get("logprobs") {
                Some(l) => {
                    assert!(logprobs, "{ev}");
                    let l = l.as_array().expect("an array");
                    assert_eq!(l.len(), n_tok, "{ev}");
                    let top = ev["top_logprobs"].as_array().expect("top_logprobs");
                    assert_eq!(top.len(), n_tok, "{ev}");
                    for ((alts, tok), lp) in top.iter().zip(ev["tokens"].as_array().unwrap()).zip(l)
                    {
                        let alts = alts.as_array().expect("alternatives");
                        assert_eq!(alts.len(), 3, "{ev}");
                        // Greedy: the best alternative is the token, with its log-probability.
                        assert_eq!(alts[0]["token"], *tok, "{ev}");
                        assert_eq!(alts[0]["logprob"], *lp, "{ev}");
                        assert!(alts[1]["logprob"].as_f64() <= alts[0]["logprob"].as_f64());
                    }
                    lps.extend(l.iter().map(|x| x.as_f64().expect("a number")));
                }
                None => {
                    assert!(!logprobs || n_tok == 0, "{ev}");
                    assert!(ev.get("top_logprobs").is_none(), "{ev}");
                }
            }
        }
        if logprobs {
            assert_eq!(lps.len(), p.max_tokens);
            assert!(lps.iter().all(|&l| l <= 0.0), "{lps:?}");
        }
        runs.push((streamed(&events).1, lps, fin["spec"].clone()));
    }
    assert_eq!(runs[0].0, runs[1].0, "greedy tokens");
    assert_eq!(
        runs[0].1, runs[1].1,
        "log-probabilities with and without speculation"
    );
    assert!(
        runs[1].2["accepted"].as_u64().unwrap_or(0) > 0,
        "{}",
        runs[1].2
    );
    // Not streamed: the final line has them all.
    let mut req = request(json!("lp-final"), prompt, &p);
    req["logprobs"] = json!(true);
    req["top_logprobs"] = json!(2);
    req["stream"] = json!(false);
    req["speculation"] = json!({"draft": []});
    let (_, fin) = c.run(&req);
    let all: Vec<f64> = fin["logprobs"]
        .as_array()
        .expect("logprobs on the final line")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect();
    assert_eq!(all, runs[0].1);
    let top = fin["top_logprobs"]
        .as_array()
        .expect("top_logprobs on the final line");
    assert_eq!(top.len(), all.len());
    assert!(top
        .iter()
        .all(|a| a.as_array().is_some_and(|a| a.len() == 2)));
}

/// Repetition, frequency and presence penalties through the server: the tokens of
/// `arbor generate` (plain, and `--draft ngram` through `spec::generate`) whether the server
/// decodes plainly or verifies prompt-lookup trees, greedy and sampled; and they change the
/// output of a prompt that repeats itself. A logit bias of -100 bans its token.
#[test]
fn penalties_through_the_server_equal_generate_with_and_without_speculation() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let prompt = PROMPTS[2];
    let penalties = arbor_engine::Penalties {
        repetition: 1.3,
        frequency: 0.4,
        presence: 0.3,
    };
    for (n, (temperature, spec)) in [
        (0.0f32, None),
        (0.0, Some(true)),
        (0.0, Some(false)),
        (0.8, None),
    ]
    .into_iter()
    .enumerate()
    {
        let p = GenerateParams {
            penalties,
            ..params(32, temperature, 5)
        };
        let mut req = request(json!(format!("pen{n}")), prompt, &p);
        req["repetition_penalty"] = json!(penalties.repetition);
        req["frequency_penalty"] = json!(penalties.frequency);
        req["presence_penalty"] = json!(penalties.presence);
        req["speculation"] = ngram_or_none(spec);
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let (_, toks) = streamed(&events);
        let (_, want) = reference(prompt, &p, spec);
        assert_eq!(toks, want, "t={temperature} spec={spec:?}");
        if spec.is_some() {
            // Greedy: the plain reference too.
            assert_eq!(toks, reference(prompt, &p, None).1, "spec={spec:?}");
        }
        if temperature == 0.0 {
            let plain = params(32, 0.0, 5);
            assert_ne!(
                toks,
                reference(prompt, &plain, None).1,
                "penalties change the output"
            );
        }
    }
    // A logit bias: the plain output's third token banned, with prompt lookup.
    let plain = params(32, 0.0, 5);
    let banned = reference(prompt, &plain, None).1[2];
    let p = GenerateParams {
        logit_bias: vec![(banned, -100.0)],
        ..plain.clone()
    };
    let mut req = request(json!("bias"), prompt, &p);
    req["logit_bias"] = json!({ banned.to_string(): -100 });
    req["speculation"] = json!({"draft": ["ngram"]});
    let (events, fin) = c.run(&req);
    assert_eq!(fin["done"], true, "{fin}");
    let toks = streamed(&events).1;
    assert_eq!(toks, reference(prompt, &p, None).1);
    assert!(!toks.contains(&banned), "{toks:?}");
}

/// `stop_token_ids` end a served request at the first of them, as `generate` ends: the stop
/// token is the last token streamed, its text is not, the finish reason is `stop`; with prompt
/// lookup the same.
#[test]
fn stop_token_ids_end_served_requests_as_generate_does() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let prompt = PROMPTS[1];
    let plain = GenerateParams {
        ignore_eos: true,
        ..params(40, 0.0, 5)
    };
    let full = reference(prompt, &plain, None).1;
    // The first token past the fifth that the output did not hold before.
    let at = (5..full.len())
        .find(|&i| !full[..i].contains(&full[i]))
        .expect("a new token");
    let p = GenerateParams {
        stop_token_ids: vec![full[at]],
        ..plain.clone()
    };
    let (want_text, want) = reference(prompt, &p, None);
    assert_eq!(want, full[..=at], "generate ends at the stop token");
    for (n, spec) in [None, Some(true), Some(false)].into_iter().enumerate() {
        let mut req = request(json!(format!("stop{n}")), prompt, &p);
        req["ignore_eos"] = json!(true);
        req["stop_token_ids"] = json!([full[at]]);
        req["speculation"] = ngram_or_none(spec);
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        assert_eq!(fin["finish_reason"], "stop", "{fin}");
        let (text, toks) = streamed(&events);
        assert_eq!(toks, want, "spec={spec:?}");
        assert_eq!(text, want_text, "spec={spec:?}");
        assert_eq!(fin["usage"]["completion_tokens"], at + 1, "{fin}");
    }
}

/// JSON mode (`response_format: {"type": "json_object"}`): the served output is the one
/// `generate` gives in JSON mode, greedy with and without prompt lookup (adaptive and fixed
/// trees) and sampled; the text is one JSON object and the request ends with `stop`, where the
/// same request without JSON mode answers in a Markdown block.
#[test]
fn json_mode_serves_one_object_as_generate_does() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let prompt = "<|im_start|>user\nGive me a JSON object describing a cat with its name and \
                  age.<|im_end|>\n<|im_start|>assistant\n";
    let plain = reference(prompt, &params(64, 0.0, 5), None).0;
    assert!(
        serde_json::from_str::<Value>(&plain).is_err(),
        "without JSON mode: {plain:?}"
    );
    // With a schema the object holds the listed properties, in order.
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "indoor": {"type": "boolean"}
        },
        "required": ["name", "age"]
    });
    let object = (
        arbor_engine::ResponseFormat::JsonObject,
        json!({"type": "json_object"}),
    );
    let typed = (
        arbor_engine::ResponseFormat::JsonSchema(Arc::new(arbor_engine::JsonSchema::new(
            schema.clone(),
        ))),
        json!({"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": true}}),
    );
    for (n, ((format, wire), temperature, spec)) in [
        (&object, 0.0f32, None),
        (&object, 0.0, Some(true)),
        (&object, 0.0, Some(false)),
        (&object, 0.7, None),
        (&typed, 0.0, None),
        (&typed, 0.0, Some(true)),
        (&typed, 0.7, Some(false)),
    ]
    .into_iter()
    .enumerate()
    {
        let p = GenerateParams {
            response_format: format.clone(),
            ..params(64, temperature, 5)
        };
        let mut req = request(json!(format!("json{n}")), prompt, &p);
        req["response_format"] = wire.clone();
        req["speculation"] = ngram_or_none(spec);
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let (text, toks) = streamed(&events);
        let (want_text, want) = reference(prompt, &p, spec);
        assert_eq!(toks, want, "{wire} t={temperature} spec={spec:?}");
        assert_eq!(text, want_text);
        if spec.is_some() && temperature == 0.0 {
            assert_eq!(toks, reference(prompt, &p, None).1, "spec={spec:?}");
        }
        assert_eq!(fin["finish_reason"], "stop", "{fin} {text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        let o = v.as_object().expect("an object");
        if let arbor_engine::ResponseFormat::JsonSchema(_) = format {
            let keys: Vec<&str> = o.keys().map(String::as_str).collect();
            assert!(
                keys == ["name", "age"] || keys == ["name", "age", "indoor"],
                "{text:?}"
            );
            assert!(
                o["name"].as_str().is_some_and(|s| s.chars().count() <= 24),
                "{text:?}"
            );
            assert!(o["age"].is_i64(), "{text:?}");
            assert!(o.get("indoor").is_none_or(Value::is_boolean), "{text:?}");
        }
    }
}

/// A prompt of more than one KV block (16 tokens), so that later choices can share its blocks.
const LONG_PROMPT: &str = "The capital of France is Paris. The capital of Germany is Berlin. \
                           The capital of Spain is Madrid. The capital of Italy is";

/// The streamed tokens of each choice, by `index`.
fn tokens_by_choice(events: &[Value], n: usize) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); n];
    for e in events {
        let i = e["index"].as_u64().expect("index") as usize;
        out[i].extend(streamed(std::slice::from_ref(e)).1);
    }
    out
}

/// `n` choices: choice `i` is the request with seed `seed + i` (plain and with fixed trees,
/// whose sampled outputs depend on the seed only; greedy with adaptive trees), streamed with
/// its `index` or listed whole in the final line; choices after the first read the prompt's
/// full blocks from the prefix cache; usage adds the choices up.
#[test]
fn n_choices_are_requests_with_consecutive_seeds_sharing_the_prompt() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let n = 3;
    for (k, (temperature, spec, stream)) in [
        (0.8f32, None, true),
        (0.8, Some(false), false),
        (0.0, Some(true), true),
    ]
    .into_iter()
    .enumerate()
    {
        let p = |seed| GenerateParams {
            ignore_eos: true,
            ..params(16, temperature, seed)
        };
        let mut req = request(json!(format!("n{k}")), LONG_PROMPT, &p(5));
        req["n"] = json!(n);
        req["ignore_eos"] = json!(true);
        req["stream"] = json!(stream);
        req["speculation"] = ngram_or_none(spec);
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let choices = fin["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), n, "{fin}");
        let got: Vec<Vec<u32>> = if stream {
            tokens_by_choice(&events, n)
        } else {
            assert!(events.is_empty(), "not streamed: {events:?}");
            choices
                .iter()
                .map(|ch| serde_json::from_value(ch["tokens"].clone()).expect("tokens"))
                .collect()
        };
        let mut completion = 0;
        for (i, ch) in choices.iter().enumerate() {
            assert_eq!(ch["index"], i, "{fin}");
            assert_eq!(ch["finish_reason"], "length", "{fin}");
            let want = reference(LONG_PROMPT, &p(5 + i as u64), spec).1;
            assert_eq!(got[i], want, "case {k} choice {i}");
            assert_eq!(ch["usage"]["completion_tokens"], want.len(), "{fin}");
            completion += want.len();
            if i > 0 {
                let cached = ch["usage"]["cached_prompt_tokens"].as_u64().unwrap_or(0);
                assert!(cached >= 16, "choice {i} shares the prompt's blocks: {fin}");
            }
        }
        assert_eq!(fin["usage"]["completion_tokens"], completion, "{fin}");
        if temperature > 0.0 {
            assert_ne!(got[0], got[1], "seeds differ: {got:?}");
        }
    }
    let s = c.stats();
    assert_eq!(s["running"], 0, "{s}");
}

/// Cancelling a request with several choices ends them all: one final line, every choice
/// `cancelled`, every KV block free.
#[test]
fn cancelling_n_choices_ends_them_all_and_frees_their_blocks() {
    let server = TestServer::plain();
    let mut c = server.client();
    c.send(
        &json!({"id": "many", "prompt": LONG_PROMPT, "max_tokens": 3000,
                   "ignore_eos": true, "n": 4}),
    );
    // Wait until every choice streams.
    let mut events = Vec::new();
    while tokens_by_choice(&events, 4).iter().any(Vec::is_empty) {
        events.push(c.recv());
    }
    c.send(&json!({"cancel": "many"}));
    let fin = loop {
        let v = c.recv();
        assert!(v.get("error").is_none(), "{v}");
        if v.get("done").is_some() {
            break v;
        }
        events.push(v);
    };
    let choices = fin["choices"].as_array().expect("choices");
    let streamed = tokens_by_choice(&events, 4);
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["finish_reason"], "cancelled", "{fin}");
        assert_eq!(ch["usage"]["completion_tokens"], streamed[i].len(), "{fin}");
    }
    let s = c.stats();
    assert_eq!(s["kv_blocks_used"], 0, "after cancel: {s}");
    assert_eq!(s["running"], 0, "{s}");
    assert_eq!(s["cancelled"], 4, "{s}");
    // The id is free again.
    let (_, fin) = c.run(&json!({"id": "many", "prompt": "hi", "max_tokens": 2, "n": 2}));
    assert_eq!(fin["choices"].as_array().map(Vec::len), Some(2), "{fin}");
}

/// A cancel that arrives before the first choice has a token ends the later choices unstarted:
/// zero usage, no timing; nothing runs or holds KV blocks afterwards.
#[test]
fn cancelling_n_choices_before_the_first_token_ends_the_rest_unstarted() {
    let server = TestServer::plain();
    let mut c = server.client();
    // A busy neighbour keeps the engine stepping, so the cancel lands while "many" waits for
    // its first token.
    c.send(&json!({"id": "busy", "prompt": PROMPTS[3], "max_tokens": 3000, "ignore_eos": true}));
    let _ = c.recv();
    let mut prompt = LONG_PROMPT.repeat(40);
    prompt.push_str(" Go on:");
    c.send(
        &json!({"id": "many", "prompt": prompt, "max_tokens": 3000, "ignore_eos": true,
                   "n": 4, "stream": false}),
    );
    c.send(&json!({"cancel": "many"}));
    let fin = loop {
        let v = c.recv();
        if v["id"] == "many" {
            break v;
        }
    };
    assert_eq!(fin["done"], true, "{fin}");
    let choices = fin["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 4, "{fin}");
    for ch in choices {
        assert_eq!(ch["finish_reason"], "cancelled", "{fin}");
    }
    // Choice 0 had no token: the others never started.
    assert_eq!(choices[0]["usage"]["completion_tokens"], 0, "{fin}");
    for ch in &choices[1..] {
        assert_eq!(ch["usage"]["completion_tokens"], 0, "{fin}");
        assert_eq!(ch["usage"]["prompt_tokens"], 0, "{fin}");
        assert_eq!(ch["timing"], Value::Null, "{fin}");
        assert_eq!(ch["text"], "", "{fin}");
    }
    c.send(&json!({"cancel": "busy"}));
    loop {
        let v = c.recv();
        if v["id"] == "busy" && v.get("done").is_some() {
            break;
        }
    }
    let s = c.stats();
    assert_eq!(s["kv_blocks_used"], 0, "{s}");
    assert_eq!(s["running"], 0, "{s}");
    assert_eq!(s["cancelled"], 2, "{s}");
}

/// `prompt_logprobs`: the first token line (or the final line when not streaming) carries the
/// prompt's token ids and each one's log-probability under the model (`null` for the first),
/// bit for bit the rows of one pass over the prompt, with alternatives when asked; the output
/// is the request's without scoring, with prompt lookup too.
#[test]
fn prompt_logprobs_are_the_models_rows_over_the_prompt() {
    let server = TestServer::start(
        engine_config(vec![DrafterFactory::ngram(3).expect("ngram")]),
        ServerConfig::default(),
    );
    let mut c = server.client();
    let m = common::smollm2();
    let ids = m.tok.encode_prompt(LONG_PROMPT).expect("encode");
    let n = ids.len();
    let vocab = m.model.config.vocab_size;
    let mut cache = arbor_engine::KvCache::new(&m.model.config, n);
    let pos: Vec<usize> = (0..n).collect();
    let rows = m
        .model
        .forward(
            common::backend(),
            &mut cache,
            &ids,
            &pos,
            arbor_engine::BatchMask::Causal,
            &pos,
        )
        .expect("forward");
    let want: Vec<(f32, Vec<(u32, f32)>)> = (0..n - 1)
        .map(|i| {
            arbor_engine::sample::log_softmax_top(&rows[i * vocab..(i + 1) * vocab], ids[i + 1], 2)
        })
        .collect();
    let f32s = |v: &Value| -> Vec<u32> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| (x.as_f64().expect("number") as f32).to_bits())
            .collect()
    };
    let want_lp: Vec<u32> = want.iter().map(|w| w.0.to_bits()).collect();
    // Ask for the prompt's blocks to be cached first: a scoring request must not read them.
    let plain = params(8, 0.0, 0);
    let (_, fin) = c.run(&request(json!("warm"), LONG_PROMPT, &plain));
    assert_eq!(fin["done"], true, "{fin}");
    let (_, want_tokens) = reference(LONG_PROMPT, &plain, None);
    for (k, (stream, spec)) in [(true, false), (false, true)].into_iter().enumerate() {
        let mut req = request(json!(format!("score{k}")), LONG_PROMPT, &plain);
        req["prompt_logprobs"] = json!(2);
        req["stream"] = json!(stream);
        if !spec {
            req["speculation"] = json!({"draft": []});
        }
        let (events, fin) = c.run(&req);
        assert_eq!(fin["done"], true, "{fin}");
        let (carrier, toks) = if stream {
            for e in &events[1..] {
                assert!(
                    e.get("prompt_logprobs").is_none(),
                    "only the first line: {e}"
                );
            }
            (events[0].clone(), streamed(&events).1)
        } else {
            let toks = serde_json::from_value(fin["tokens"].clone()).expect("tokens");
            (fin.clone(), toks)
        };
        assert_eq!(toks, want_tokens, "stream {stream}");
        assert_eq!(fin["usage"]["cached_prompt_tokens"], 0, "{fin}");
        assert_eq!(carrier["prompt_token_ids"], json!(ids), "{carrier}");
        let lps = carrier["prompt_logprobs"]
            .as_array()
            .expect("prompt_logprobs");
        assert_eq!(lps.len(), n);
        assert_eq!(lps[0], Value::Null);
        assert_eq!(f32s(&Value::Array(lps[1..].to_vec())), want_lp);
        let tops = carrier["prompt_top_logprobs"]
            .as_array()
            .expect("alternatives");
        assert_eq!(tops[0], Value::Null);
        for (t, w) in tops[1..].iter().zip(&want) {
            let got: Vec<(u64, u32)> = t
                .as_array()
                .expect("list")
                .iter()
                .map(|a| {
                    let l = a["logprob"].as_f64().expect("logprob") as f32;
                    (a["token"].as_u64().expect("token"), l.to_bits())
                })
                .collect();
            let w: Vec<(u64, u32)> = w.1.iter().map(|&(t, l)| (t as u64, l.to_bits())).collect();
            assert_eq!(got, w);
        }
    }
    // With `n`, choice 0 scores the prompt; the others read it from the cache.
    let mut req = request(json!("scores-n"), LONG_PROMPT, &plain);
    req["prompt_logprobs"] = json!(0);
    req["n"] = json!(2);
    req["stream"] = json!(false);
    let (_, fin) = c.run(&req);
    let choices = fin["choices"].as_array().expect("choices");
    assert_eq!(
        f32s(&Value::Array(
            choices[0]["prompt_logprobs"].as_array().expect("scores")[1..].to_vec()
        )),
        want_lp
    );
    assert!(choices[0].get("prompt_top_logprobs").is_none(), "{fin}");
    assert!(choices[1].get("prompt_logprobs").is_none(), "{fin}");
    assert!(
        choices[1]["usage"]["cached_prompt_tokens"].as_u64() >= Some(16),
        "{fin}"
    );
    // Out of range.
    let mut req = request(json!("bad"), LONG_PROMPT, &plain);
    req["prompt_logprobs"] = json!(21);
    let (_, fin) = c.run(&req);
    assert_eq!(code(&fin), "invalid_argument", "{fin}");
}

/// Requests sent together with one long prompt: the later ones wait for the first one's prompt
/// blocks and read them from the cache (`prefix_waits` in the stats).
#[test]
fn requests_sharing_a_prompt_compute_it_once() {
    let server = TestServer::plain();
    let mut c = server.client();
    let prompt = LONG_PROMPT.repeat(8);
    for i in 0..3 {
        c.send(&json!({"id": i, "prompt": prompt, "max_tokens": 4, "stream": false}));
    }
    let mut cached = Vec::new();
    while cached.len() < 3 {
        let v = c.recv();
        assert_eq!(v["done"], true, "{v}");
        cached.push(v["usage"]["cached_prompt_tokens"].as_u64().unwrap_or(0));
    }
    cached.sort_unstable();
    assert_eq!(cached[0], 0, "{cached:?}");
    assert!(cached[1] >= 160 && cached[2] >= 160, "{cached:?}");
    let s = c.stats();
    assert!(s["prefix_waits"].as_u64() > Some(0), "{s}");
}
