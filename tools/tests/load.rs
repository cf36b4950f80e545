//! `arbor load` against a real server on loopback (smollm2-135m through the actors and TCP server) and against the instant servers: every request accounted for, TTFT <= E2E, streamed tokens equal the server's usage, exact lengths with ignore_eos, cancelled requests free their KV blocks, failures counted by code, results files that `compare` reads back.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_actors::server::{BackgroundServer, ServerConfig};
use arbor_actors::{DrafterFactory, Engine, EngineConfig};
use arbor_tools::load::instant::InstantServer;
use arbor_tools::load::metrics::Outcome;
use arbor_tools::load::prompts::PromptSource;
use arbor_tools::load::{report, run, Arrivals, LoadOptions, ResultsFile, RunResult, Slo};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

struct Served {
    engine: Arc<Engine>,
    server: BackgroundServer,
}

fn serve() -> Served {
    let path = arbor_tools::resolve_model("smollm2-135m").expect("smollm2-135m");
    let mut config = EngineConfig::open(&path).expect("engine config");
    config.kv_memory = Some(128 << 20);
    config.drafters = vec![DrafterFactory::ngram(3).expect("ngram")];
    let engine = Arc::new(Engine::start(config).expect("engine"));
    let server =
        BackgroundServer::start(Arc::clone(&engine), "127.0.0.1:0", ServerConfig::default())
            .expect("server");
    Served { engine, server }
}

fn check_accounting(r: &RunResult) {
    let c = &r.counts;
    assert_eq!(
        c.sent,
        c.completed + c.cancelled + c.failed,
        "every request ends exactly once: {c:?}"
    );
    assert_eq!(c.sent as usize, r.requests.len());
    assert_eq!(c.failed, c.failed_by_code.values().sum::<u64>());
    for q in &r.requests {
        let ttft = q.ttft_ms();
        if let Some(t) = ttft {
            assert!(
                t <= q.e2e_ms,
                "request {}: TTFT {t} > E2E {}",
                q.index,
                q.e2e_ms
            );
        }
        assert!(q.events.windows(2).all(|w| w[0].0 <= w[1].0));
    }
}

#[test]
fn a_short_run_on_a_real_server_accounts_for_everything() {
    let s = serve();
    let target = format!("arbor://{}", s.server.addr);
    let mut o = LoadOptions::new(&target);
    o.arrivals = Arrivals::Open {
        rate: 20.0,
        burstiness: 1.0,
    };
    o.requests = Some(10);
    o.max_tokens = 12;
    o.output_range = 0.5;
    o.seed = 3;
    let rt = rt();
    let r = rt
        .block_on(run(&o, Some(Slo::parse("ttft=30s").unwrap())))
        .expect("run");
    check_accounting(&r);
    assert_eq!(r.counts.sent, 10);
    assert_eq!(r.counts.completed, 10, "{:?}", r.counts);
    for q in &r.requests {
        assert_eq!(
            Some(q.output_tokens),
            q.usage_completion_tokens,
            "request {}: streamed tokens vs the server's usage",
            q.index
        );
        assert!(q.output_tokens as usize <= q.max_tokens);
        assert!(q.usage_prompt_tokens.is_some_and(|p| p > 0));
    }
    // Lengths drawn from 12 x [0.5, 1.5], seeded: the same plan again.
    let lens: Vec<usize> = r.requests.iter().map(|q| q.max_tokens).collect();
    assert!(lens.iter().all(|&n| (6..=18).contains(&n)), "{lens:?}");
    assert!(lens.iter().any(|&n| n != lens[0]), "{lens:?}");
    assert!(r.summary.output_token_throughput > 0.0);
    assert!(r.summary.goodput > 0.0);
    // The results file reads back, and compare prints both.
    let dir = std::env::temp_dir().join(format!("arbor-load-{}", std::process::id()));
    let path = dir.join("run.json");
    ResultsFile::Run(Box::new(r.clone()))
        .write(&path)
        .expect("write");
    let back = ResultsFile::read(&path).expect("read back");
    let ResultsFile::Run(b) = &back else {
        panic!("a run file reads back as a run")
    };
    assert_eq!(b.counts, r.counts);
    assert_eq!(b.summary, r.summary);
    assert_eq!(b.requests, r.requests);
    let text = report::compare(&back, &ResultsFile::Run(Box::new(r.clone()))).expect("compare");
    assert!(
        text.contains("output tok/s") && text.contains("1.00x"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    // The same seed sends the same prompts with the same lengths.
    let again = rt.block_on(run(&o, None)).expect("run again");
    let plan = |r: &RunResult| -> Vec<(usize, usize)> {
        r.requests
            .iter()
            .map(|q| (q.prompt, q.max_tokens))
            .collect()
    };
    assert_eq!(plan(&again), plan(&r));
}

#[test]
fn ignore_eos_runs_produce_exactly_the_requested_lengths() {
    let s = serve();
    let mut o = LoadOptions::new(&format!("arbor://{}", s.server.addr));
    o.arrivals = Arrivals::Closed { concurrency: 3 };
    o.requests = Some(6);
    o.prompts = PromptSource::Chat;
    o.max_tokens = 10;
    o.output_range = 0.4;
    o.ignore_eos = true;
    o.speculation = Some(serde_json::json!({"draft": "ngram", "adaptive": false}));
    let r = rt().block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(r.counts.completed, 6, "{:?}", r.counts);
    for q in &r.requests {
        assert_eq!(q.tokens() as usize, q.max_tokens, "request {}", q.index);
        assert_eq!(q.output_tokens as usize, q.max_tokens);
        assert_eq!(
            q.outcome,
            Outcome::Completed {
                finish_reason: "length".into()
            }
        );
        assert!(
            q.spec.is_some(),
            "speculating requests report their spec figures"
        );
    }
    assert!(r.summary.acceptance_rate.is_some());
}

#[test]
fn requests_cut_off_at_the_end_are_cancelled_and_free_their_blocks() {
    let s = serve();
    let mut o = LoadOptions::new(&format!("arbor://{}", s.server.addr));
    o.arrivals = Arrivals::Open {
        rate: 8.0,
        burstiness: 1.0,
    };
    o.requests = None;
    o.duration_s = Some(1.0);
    o.drain_s = 0.0;
    o.max_tokens = 2000;
    o.ignore_eos = true;
    let r = rt().block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert!(r.counts.sent >= 1);
    assert!(r.counts.cancelled >= 1, "{:?}", r.counts);
    // The server frees the cancelled requests' KV blocks.
    let t0 = Instant::now();
    loop {
        let st = s.engine.stats().expect("stats");
        if st.running == 0 && st.kv_blocks_used == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "blocks still used: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn server_errors_and_dead_targets_are_counted_by_code() {
    let s = serve();
    let mut o = LoadOptions::new(&format!("arbor://{}", s.server.addr));
    o.arrivals = Arrivals::Closed { concurrency: 2 };
    o.requests = Some(4);
    o.max_tokens = 4;
    o.speculation = Some(serde_json::json!({"draft": "no_such_drafter"}));
    let rt = rt();
    let r = rt.block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(r.counts.failed_by_code.get("invalid_argument"), Some(&4));
    // Nothing listens here: every request fails with connect_failed, the tool goes on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    let mut o = LoadOptions::new(&format!("arbor://{addr}"));
    o.requests = Some(3);
    o.arrivals = Arrivals::Open {
        rate: 100.0,
        burstiness: 1.0,
    };
    let r = rt.block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(r.counts.failed_by_code.get("connect_failed"), Some(&3));
}

#[test]
fn the_instant_servers_take_thousands_of_requests_and_the_openai_stream_is_read() {
    let rt = rt();
    let arbor = InstantServer::start(4).expect("instant server");
    let mut o = LoadOptions::new(&format!("arbor://{}", arbor.addr));
    o.arrivals = Arrivals::Closed { concurrency: 64 };
    o.requests = Some(3000);
    o.max_tokens = 10;
    let r = rt.block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(r.counts.completed, 3000);
    // Events of 4 tokens: 4 + 4 + 2.
    assert!(r
        .requests
        .iter()
        .all(|q| q.events.len() == 3 && q.tokens() == 10));
    let openai = InstantServer::start_openai().expect("openai instant server");
    let mut o = LoadOptions::new(&format!("openai://{}", openai.addr));
    o.arrivals = Arrivals::Closed { concurrency: 8 };
    o.requests = Some(200);
    o.max_tokens = 7;
    let r = rt.block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(r.counts.completed, 200, "{:?}", r.counts);
    for q in &r.requests {
        assert_eq!(
            (q.events.len(), q.output_tokens, q.usage_completion_tokens),
            (7, 7, Some(7))
        );
    }
}

#[test]
fn the_cli_writes_results_that_compare_reads() {
    let server = InstantServer::start(1).expect("instant server");
    let dir = std::env::temp_dir().join(format!("arbor-load-cli-{}", std::process::id()));
    let a = dir.join("a.json");
    let target = format!("arbor://{}", server.addr);
    let out = common::arbor(&[
        "load",
        "--target",
        &target,
        "--requests",
        "40",
        "--rate",
        "400",
        "--max-tokens",
        "5",
        "--slo",
        "ttft=1s,tpot=100ms",
        "--quiet",
        "--out",
        a.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("sent 40 = completed 40 + cancelled 0 + failed 0"),
        "{stdout}"
    );
    assert!(stdout.contains("goodput"), "{stdout}");
    let b = dir.join("b.json");
    let out = common::arbor(&[
        "load",
        "sweep",
        "--rates",
        "200,400",
        "--target",
        &target,
        "--requests",
        "20",
        "--max-tokens",
        "3",
        "--quiet",
        "--cooldown",
        "0",
        "--out",
        b.to_str().unwrap(),
        "--plot",
        dir.join("plots").to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "sweep_throughput.png",
        "sweep_goodput.png",
        "cdf_ttft.png",
        "cdf_itl.png",
    ] {
        let md =
            std::fs::metadata(dir.join("plots").join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(md.len() > 1000, "{f} is {} bytes", md.len());
    }
    let out = common::arbor(&["load", "compare", a.to_str().unwrap(), a.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("B/A"));
    let out = common::arbor(&["load", "compare", b.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A run and a sweep do not compare; a broken file is an error, not a crash.
    let out = common::arbor(&["load", "compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(!out.status.success());
    std::fs::write(dir.join("bad.json"), "{").unwrap();
    let out = common::arbor(&[
        "load",
        "compare",
        dir.join("bad.json").to_str().unwrap(),
        a.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an arbor load results file"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_server_that_hangs_up_or_talks_nonsense_is_counted_not_fatal() {
    use std::io::{BufRead, BufReader, Write};
    // Answers each connection's first request with one token, a line of nonsense, a line for an
    // id nobody sent, then hangs up.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut w = s.try_clone().unwrap();
            let mut r = BufReader::new(s);
            let mut line = String::new();
            if r.read_line(&mut line).is_err() {
                continue;
            }
            let id = serde_json::from_str::<serde_json::Value>(&line)
                .ok()
                .and_then(|v| v.get("id").cloned())
                .unwrap_or_default();
            let _ = writeln!(
                w,
                "{}",
                serde_json::json!({"id": id, "text": "a", "tokens": [1]})
            );
            let _ = writeln!(w, "{{not json");
            let _ = writeln!(
                w,
                "{}",
                serde_json::json!({"id": 999_999, "text": "b", "tokens": [2]})
            );
        }
    });
    let mut o = LoadOptions::new(&format!("arbor://{addr}"));
    o.arrivals = Arrivals::Closed { concurrency: 1 };
    o.requests = Some(3);
    let r = rt().block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(
        r.counts.failed_by_code.get("connection_closed"),
        Some(&3),
        "{:?}",
        r.counts
    );
    assert_eq!(r.counts.stray_lines, 6, "{:?}", r.counts);
    assert!(r.requests.iter().all(|q| q.events.len() == 1));
}
