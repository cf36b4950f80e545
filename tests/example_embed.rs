//! Runs `examples/embed.rs` (the documented in-process API) and checks what it produced against `generate`.

mod common;
#[path = "../examples/embed.rs"]
mod embed;

use arbor_engine::{generate, GenerateParams};

#[test]
fn the_embedding_example_runs_and_matches_generate() {
    let s = embed::run("smollm2-135m").expect("example runs");
    let m = common::smollm2();
    let ids = m.tok.encode_prompt("def fibonacci(n):").expect("encode");
    let p = GenerateParams {
        max_tokens: 24,
        ..GenerateParams::default()
    };
    let want = generate(&m.model, common::backend(), &m.tok, &ids, &p, |_| {}).expect("gen");
    assert_eq!(s.blocking_text, want.text);
    assert_eq!(s.blocking_tokens, want.tokens.len());
    assert_eq!(s.async_texts.len(), 2);
    assert!(s.async_texts.iter().all(|t| !t.is_empty()));
    assert_eq!(s.kv_blocks_used_after, 0);
}
