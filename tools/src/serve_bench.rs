//! `arbor bench serve`: the server's own overhead — one streamed greedy request over loopback TCP against `generate` in-process (or both speculating with prompt lookup), same model, prompt and settings, alternated in one run.

use std::io::{BufRead, BufReader, Write};
use std::sync::Arc;
use std::time::Instant;

use arbor_actors::server::{BackgroundServer, ServerConfig};
use arbor_actors::{Engine, EngineConfig};
use arbor_engine::draft::{Drafter, NgramDrafter};
use arbor_engine::spec::{self, SpecParams};
use arbor_engine::{generate, CpuBackend, GenerateParams, Model, Tokenizer};
use serde_json::{json, Value};

/// One repetition's decode rates (tokens after the first per second).
#[derive(Clone, Copy, Debug)]
pub struct ServeRep {
    pub generate_tok_s: f64,
    /// The same request through the in-process API (actors, no TCP).
    pub api_tok_s: f64,
    pub server_tok_s: f64,
}

/// Alternate `reps` runs of `generate` and of the same request through the TCP server.
pub fn serve_bench(
    model_path: &std::path::Path,
    threads: usize,
    prompt: &str,
    tokens: usize,
    reps: usize,
    ngram: bool,
) -> anyhow::Result<Vec<ServeRep>> {
    let model = Arc::new(Model::open(model_path)?);
    let tok = Arc::new(Tokenizer::from_gguf(model.gguf())?);
    let backend = CpuBackend::new(threads)?;
    let mut config = EngineConfig::new(Arc::clone(&model), Arc::clone(&tok));
    config.threads = threads;
    config.kv_memory = Some(256 << 20);
    if ngram {
        config.drafters = vec![arbor_actors::DrafterFactory::ngram(3)?];
    }
    let engine = Arc::new(Engine::start(config)?);
    let mut server =
        BackgroundServer::start(Arc::clone(&engine), "127.0.0.1:0", ServerConfig::default())?;
    let addr = server.addr;
    let ids = tok.encode_prompt(prompt)?;
    let params = GenerateParams {
        max_tokens: tokens,
        ignore_eos: true,
        ..GenerateParams::default()
    };
    let stream = std::net::TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let mut w = stream.try_clone()?;
    let mut r = BufReader::new(stream);
    let mut out = Vec::new();
    let bar = crate::progress::steps(reps as u64 + 1, "bench serve: repetitions");
    for rep in 0..reps + 1 {
        bar.inc(1);
        let g = if ngram {
            // What `arbor generate --draft ngram` runs (adaptive under greedy decoding).
            let d = NgramDrafter::default();
            let mut ng = NgramDrafter::new(d.max_n, 1, 8, d.max_matches)?;
            let mut ds: Vec<&mut dyn Drafter> = vec![&mut ng];
            let sp = SpecParams {
                budget: 64,
                mode: None,
                adaptive: true,
                step_cost: None,
            };
            spec::generate(&model, &backend, &tok, &ids, &params, &sp, &mut ds, |_| {})?.output
        } else {
            generate(&model, &backend, &tok, &ids, &params, |_| {})?
        };
        let mut api_req = arbor_actors::Request::prompt(prompt);
        api_req.max_tokens = tokens;
        api_req.ignore_eos = true;
        let h = engine.submit(api_req)?;
        let mut first: Option<(Instant, usize)> = None;
        let mut last = Instant::now();
        let mut n = 0usize;
        while let Some(ev) = h.recv() {
            match ev {
                arbor_actors::Event::Tokens { tokens, .. } => {
                    let now = Instant::now();
                    n += tokens.len();
                    first.get_or_insert((now, n));
                    last = now;
                }
                arbor_actors::Event::Done(_) => break,
                arbor_actors::Event::Error { error, .. } => anyhow::bail!("engine error: {error}"),
            }
        }
        let (t0, n0) = first.ok_or_else(|| anyhow::anyhow!("no tokens"))?;
        let api_tok_s = (n - n0) as f64 / last.duration_since(t0).as_secs_f64();
        let req = json!({"id": rep, "prompt": prompt, "max_tokens": tokens, "ignore_eos": true});
        writeln!(w, "{req}")?;
        let mut first: Option<(Instant, usize)> = None;
        let mut last = Instant::now();
        let mut n = 0usize;
        loop {
            let mut line = String::new();
            if r.read_line(&mut line)? == 0 {
                anyhow::bail!("the server closed the connection");
            }
            let now = Instant::now();
            let v: Value = serde_json::from_str(&line)?;
            if v.get("error").is_some() {
                anyhow::bail!("server error: {v}");
            }
            if v.get("done").is_some() {
                break;
            }
            let k = v["tokens"].as_array().map_or(0, Vec::len);
            n += k;
            if first.is_none() {
                first = Some((now, n));
            }
            last = now;
        }
        let (t0, n0) = first.ok_or_else(|| anyhow::anyhow!("no tokens streamed"))?;
        let server_tok_s = (n - n0) as f64 / last.duration_since(t0).as_secs_f64();
        if rep > 0 {
            // The first repetition warms both paths.
            out.push(ServeRep {
                generate_tok_s: g.decode_tok_s(),
                api_tok_s,
                server_tok_s,
            });
        }
    }
    bar.finish_and_clear();
    drop(w);
    if let Some(st) = engine.stats() {
        println!(
            "# engine: {} steps, {:.3} ms per step, {:.3} ms idle between consecutive steps ({:.2}% of a step)",
            st.steps,
            st.step_ms,
            st.step_gap_ms,
            100.0 * st.step_gap_ms / st.step_ms.max(1e-9)
        );
        println!(
            "# KV allocator: {:.1} messages per step, {:.3} ms per step waiting for them ({:.2}% of a step)",
            st.kv_messages_per_step,
            st.kv_wait_ms,
            100.0 * st.kv_wait_ms / st.step_ms.max(1e-9)
        );
        if st.drafted_steps > 0 {
            println!(
                "# drafting steps: {}, mean wait for drafters + merger: {:.3} ms per step",
                st.drafted_steps, st.draft_wait_ms
            );
        }
    }
    server.shutdown()?;
    Ok(out)
}
