//! Embedding Arbor in a program: start an engine from a config, stream one request through the blocking API and two through the async API, read the stats, shut down.
//!
//! `cargo run --release --example embed [MODEL]` (default: smollm2-135m, fetched if missing).

use std::sync::Arc;
use std::time::Duration;

use arbor_actors::{Engine, EngineConfig, Event, Input, Request};
use arbor_engine::ChatMessage;
use futures_util::StreamExt;

/// What the example did (a test checks it).
#[derive(Debug)]
pub struct Summary {
    pub blocking_text: String,
    pub blocking_tokens: usize,
    pub async_texts: Vec<String>,
    pub kv_blocks_used_after: usize,
}

pub fn run(model: &str) -> Result<Summary, Box<dyn std::error::Error>> {
    let path = arbor_tools::resolve_model(model)?;
    let mut config = EngineConfig::open(&path)?;
    config.kv_memory = Some(64 << 20);
    config.drafters = vec![arbor_actors::DrafterFactory::ngram(3)?];
    let engine = Arc::new(Engine::start(config)?);

    // Blocking: events arrive on a crossbeam channel.
    let mut req = Request::prompt("def fibonacci(n):");
    req.max_tokens = 24;
    let handle = engine.submit(req)?;
    let mut blocking_text = String::new();
    let mut blocking_tokens = 0;
    while let Some(ev) = handle.recv() {
        match ev {
            Event::Tokens { text, tokens, .. } => {
                print!("{text}");
                blocking_text.push_str(&text);
                blocking_tokens += tokens.len();
            }
            Event::Done(c) => {
                println!(
                    "\n[done: {}, {} tokens, ttft {:.1} ms]",
                    c.finish_reason.as_str(),
                    c.usage.completion_tokens,
                    c.timing.ttft_ms.unwrap_or(0.0)
                );
                break;
            }
            Event::Error { error, .. } => return Err(error.into()),
        }
    }

    // Async: two requests at once, each an event Stream.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let async_texts = rt.block_on(async {
        let mut chat = Request::new(Input::Messages(vec![ChatMessage::new(
            "user",
            "Name three primary colors.",
        )]));
        chat.max_tokens = 16;
        let mut sampled = Request::prompt("Once upon a time");
        sampled.max_tokens = 16;
        sampled.sampling.temperature = 0.8;
        sampled.sampling.seed = 42;
        let streams = [engine.submit_stream(chat)?, engine.submit_stream(sampled)?];
        let mut texts = Vec::new();
        for mut s in streams {
            let mut text = String::new();
            while let Some(ev) = s.next().await {
                match ev {
                    Event::Tokens { text: t, .. } => text.push_str(&t),
                    Event::Done(c) => {
                        assert_eq!(c.text, text);
                        break;
                    }
                    Event::Error { error, .. } => return Err(error),
                }
            }
            println!("[async] {text:?}");
            texts.push(text);
        }
        Ok::<_, arbor_actors::ServeError>(texts)
    })?;

    let stats = engine.stats().ok_or("engine stopped")?;
    println!(
        "[stats] completed {}, kv blocks used {} of {}, cached {}",
        stats.completed, stats.kv_blocks_used, stats.kv_blocks_total, stats.kv_blocks_cached
    );
    engine.shutdown(Duration::from_secs(5));
    Ok(Summary {
        blocking_text,
        blocking_tokens,
        async_texts,
        kv_blocks_used_after: stats.kv_blocks_used,
    })
}

#[allow(dead_code)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "smollm2-135m".into());
    run(&model).map(|_| ())
}
