//! `arbor load` against a real server on loopback (smollm2-135m through the actors and TCP server) and against the instant servers: every request accounted for, TTFT <= E2E, streamed tokens equal the server's usage, exact lengths with ignore_eos, cancelled requests free their KV blocks, failures counted by code, results files that `compare` reads back.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_actors::server::{BackgroundServer, ServerConfig};
use arbor_actors::{DrafterFactory, Engine, EngineConfig};
use arbor_tools::load::instant::InstantServer;
use arbor_tools::load::metrics::Outcome;
use arbor_tools::load::prompts::PromptSource;
use arbor_tools::load::schedule::ArrivalSchedule;
use arbor_tools::load::target::Target;
use arbor_tools::load::{
    report, run, sweep, Arrivals, LoadError, LoadOptions, ResultsFile, RunResult, Slo,
};

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
    // The driver counts what it starts; every request started has exactly one record.
    assert_eq!(
        c.sent, r.spawned,
        "a request started without a record: {c:?}"
    );
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
    // The seeded arrivals before the 1 s bound are sent, no more and no fewer...
    let mut schedule = ArrivalSchedule::new(8.0, 1.0, o.seed).unwrap();
    let expected = 1 + std::iter::repeat_with(|| schedule.next_arrival())
        .take_while(|&t| t < 1.0)
        .count() as u64;
    assert_eq!(r.counts.sent, expected, "{:?}", r.counts);
    // ... and none of them can finish 2000 tokens within the second: with no drain, every one
    // is cancelled (none completed, none failed).
    assert_eq!(r.counts.cancelled, r.counts.sent, "{:?}", r.counts);
    assert!(r.requests.iter().all(|q| q.outcome == Outcome::Cancelled));
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

fn dead_addr() -> std::net::SocketAddr {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = dead.local_addr().unwrap();
    drop(dead);
    addr
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("arbor-load-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_run_where_nothing_completes_fails_with_each_code_and_a_sample_message() {
    let dir = temp_dir("nothing");
    let out_file = dir.join("dead.json");
    let target = format!("arbor://{}", dead_addr());
    let out = common::arbor(&[
        "load",
        "--target",
        &target,
        "--requests",
        "3",
        "--rate",
        "100",
        "--quiet",
        "--out",
        out_file.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("no request completed")
            && stderr.contains("connect_failed 3: cannot connect"),
        "{stderr}"
    );
    // The summary names each failure code with one message.
    assert!(
        stdout.contains("failed 3 (connect_failed 3)")
            && stdout.contains("failures     connect_failed: cannot connect to"),
        "{stdout}"
    );
    // The results were written before the error.
    let ResultsFile::Run(r) = ResultsFile::read(&out_file).expect("results written") else {
        panic!("a run file")
    };
    assert_eq!(r.counts.failed_by_code.get("connect_failed"), Some(&3));
    assert!(r.counts.failed_samples["connect_failed"].contains("cannot connect"));
    assert_eq!(
        r.check_completed().unwrap_err().error_type(),
        "no_request_completed"
    );
    // A sweep where no rate completes anything fails the same way.
    let out = common::arbor(&[
        "load",
        "sweep",
        "--rates",
        "100,200",
        "--target",
        &target,
        "--requests",
        "2",
        "--cooldown",
        "0",
        "--quiet",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("connect_failed 4: cannot connect"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn out_of_range_numbers_are_refused_naming_the_flag_not_a_panic() {
    let server = InstantServer::start(1).expect("instant server");
    let target = format!("arbor://{}", server.addr);
    let cases: &[(&[&str], &str)] = &[
        (&["--duration", "1e20"], "--duration"),
        (&["--duration", "NaN"], "--duration"),
        (&["--rate", "1e-30", "--requests", "2"], "--rate"),
        (&["--rate", "inf"], "--rate"),
        (&["--burstiness", "1e400"], "--burstiness"),
        (&["--warmup", "1e20"], "--warmup"),
        (&["--warmup", "NaN"], "--warmup"),
        (&["--drain", "1e20"], "--drain"),
        (&["--drain=-1"], "--drain"),
        (&["--requests", "100000000000"], "--requests"),
        (&["--top-p", "1.5"], "--top-p"),
        (&["--top-p", "0"], "--top-p"),
        (&["--top-k", "100000000000"], "--top-k"),
        (&["--min-p", "1.5"], "--min-p"),
        (&["--min-p=-0.1"], "--min-p"),
        (&["--input-len", "100000000000"], "--input-len"),
        (&["--per-connection", "0"], "--per-connection"),
        (&["--extra-body", "[1]"], "--extra-body"),
        (&["--extra-body", "{"], "--extra-body"),
        (&["--extra-body", r#"{"n": 4}"#], "--extra-body"),
        (
            &["sweep", "--rates", "1", "--cooldown", "1e20"],
            "--cooldown",
        ),
        (
            &["sweep", "--rates", "1", "--cooldown", "NaN"],
            "--cooldown",
        ),
        (&["sweep", "--rates", "1e-30"], "--rates"),
    ];
    for (args, flag) in cases {
        let mut all = vec!["load"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--target", &target, "--quiet"]);
        let started = Instant::now();
        let out = common::arbor(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(started.elapsed() < Duration::from_secs(10), "{args:?} ran");
    }
    // The library refuses them too.
    let mut o = LoadOptions::new(&target);
    o.arrivals = Arrivals::Open {
        rate: 1e-30,
        burstiness: 1.0,
    };
    let e = rt().block_on(run(&o, None)).unwrap_err();
    assert!(matches!(e, LoadError::Invalid(_)), "{e}");
    assert_eq!(e.error_type(), "invalid_argument");
}

/// `--slo auto` calibrates with requests of its own: a bad number elsewhere is refused before
/// any of them is sent.
#[test]
fn bad_numbers_are_refused_before_an_slo_calibration_sends_anything() {
    let server = InstantServer::start(1).expect("instant server");
    let target = format!("arbor://{}", server.addr);
    let cases: &[(&[&str], &str)] = &[
        (&["--rate", "0", "--requests", "2"], "--rate"),
        (&["--concurrency", "0"], "--concurrency"),
        (&["--duration", "NaN"], "--duration"),
        (&["sweep", "--rates", "1,0", "--requests", "2"], "--rates"),
        (
            &["sweep", "--rates", "1", "--cooldown", "NaN"],
            "--cooldown",
        ),
    ];
    for (args, flag) in cases {
        let mut all = vec!["load"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--slo", "auto", "--target", &target, "--quiet"]);
        let out = common::arbor(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran");
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert_eq!(
            server.connections(),
            0,
            "{args:?}: calibration requests were sent"
        );
    }
}

#[test]
fn a_plot_that_cannot_be_drawn_is_a_warning_after_the_results_are_written() {
    let server = InstantServer::start(1).expect("instant server");
    let dir = temp_dir("plot");
    let out_file = dir.join("run.json");
    // A file where the plot folder should be: plots cannot be written there.
    let not_a_dir = dir.join("plots");
    std::fs::write(&not_a_dir, "a file").unwrap();
    let out = common::arbor(&[
        "load",
        "--target",
        &format!("arbor://{}", server.addr),
        "--requests",
        "5",
        "--rate",
        "500",
        "--max-tokens",
        "3",
        "--quiet",
        "--out",
        out_file.to_str().unwrap(),
        "--plot",
        not_a_dir.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning") && stderr.contains(not_a_dir.to_str().unwrap()),
        "{stderr}"
    );
    let ResultsFile::Run(r) = ResultsFile::read(&out_file).expect("results written") else {
        panic!("a run file")
    };
    assert_eq!(r.counts.completed, 5);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn targets_must_be_host_and_port() {
    let ok = [
        (
            "arbor://127.0.0.1:7070",
            Target::Arbor {
                addr: "127.0.0.1:7070".into(),
            },
        ),
        (
            "127.0.0.1:7070",
            Target::Arbor {
                addr: "127.0.0.1:7070".into(),
            },
        ),
        (
            "arbor://localhost:1/",
            Target::Arbor {
                addr: "localhost:1".into(),
            },
        ),
        (
            "arbor://[::1]:7070",
            Target::Arbor {
                addr: "[::1]:7070".into(),
            },
        ),
        (
            "openai://localhost:8080/",
            Target::OpenAi {
                addr: "localhost:8080".into(),
            },
        ),
        (
            "http://127.0.0.1:8080/v1",
            Target::OpenAi {
                addr: "127.0.0.1:8080".into(),
            },
        ),
        (
            "http://127.0.0.1:8080/v1/",
            Target::OpenAi {
                addr: "127.0.0.1:8080".into(),
            },
        ),
        (
            "openai://my-host.lan:65535",
            Target::OpenAi {
                addr: "my-host.lan:65535".into(),
            },
        ),
    ];
    for (s, want) in ok {
        assert_eq!(
            Target::parse(s).unwrap_or_else(|e| panic!("{s}: {e}")),
            want
        );
    }
    for (s, why) in [
        ("http://127.0.0.1:8080/v2", "has a path ('/v2')"),
        ("openai://127.0.0.1:8080/v1/completions", "has a path"),
        ("arbor://127.0.0.1:7070/v1", "has a path"),
        ("arbor://127.0.0.1", "has no port"),
        ("arbor://127.0.0.1:0", "as its port"),
        ("arbor://127.0.0.1:65536", "as its port"),
        ("arbor://127.0.0.1:http", "as its port"),
        ("arbor://127.0.0.1:", "as its port"),
        ("arbor://:7070", "as its host"),
        ("arbor://::1:7070", "without brackets"),
        ("arbor://[::1]", "no port"),
        ("arbor://[nope]:7070", "not an IPv6 address"),
        ("arbor://user@host:7070", "as its host"),
        ("arbor://", "names no address"),
        ("ftp://x:1", "unknown target scheme"),
    ] {
        let e = Target::parse(s)
            .err()
            .unwrap_or_else(|| panic!("{s} parsed"));
        let msg = e.to_string();
        assert!(msg.contains(why), "{s}: {msg}");
        assert_eq!(e.error_type(), "invalid_argument");
        if why != "unknown target scheme" {
            assert!(msg.contains("HOST:PORT"), "{s}: {msg}");
        }
    }
    // The CLI refuses a bad target before sending anything.
    let out = common::arbor(&["load", "--target", "http://127.0.0.1:1/v2", "--quiet"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has a path"));
}

#[test]
fn a_sweep_checks_every_rate_before_the_first_run() {
    let server = InstantServer::start(1).expect("instant server");
    let mut o = LoadOptions::new(&format!("arbor://{}", server.addr));
    o.requests = Some(5);
    o.max_tokens = 2;
    let rt = rt();
    for rates in [[100.0, -1.0], [100.0, f64::NAN], [100.0, 0.0]] {
        let mut ran = 0;
        let e = rt
            .block_on(sweep(&o, &rates, None, 0.0, |_| ran += 1))
            .unwrap_err();
        assert_eq!(ran, 0, "{rates:?}: a rate ran before the error");
        assert!(e.to_string().contains("--rates"), "{e}");
    }
    let e = rt
        .block_on(sweep(&o, &[100.0], None, f64::INFINITY, |_| {}))
        .unwrap_err();
    assert!(e.to_string().contains("--cooldown"), "{e}");
    // The CLI: nothing runs, nothing is written.
    let dir = temp_dir("sweep-rates");
    let out_file = dir.join("sweep.json");
    let out = common::arbor(&[
        "load",
        "sweep",
        "--rates",
        "100,-1",
        "--target",
        &format!("arbor://{}", server.addr),
        "--requests",
        "5",
        "--quiet",
        "--cooldown",
        "0",
        "--out",
        out_file.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--rates") && !stderr.contains("completed"),
        "{stderr}"
    );
    assert!(!out_file.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_oversized_request_fails_at_once_and_the_servers_idless_errors_are_counted() {
    // Client side: lines over --max-line-bytes are not sent, and nothing waits for the drain.
    let server = InstantServer::start(1).expect("instant server");
    let mut o = LoadOptions::new(&format!("arbor://{}", server.addr));
    o.arrivals = Arrivals::Closed { concurrency: 2 };
    o.requests = Some(4);
    o.max_tokens = 2;
    o.max_line_bytes = 40;
    let started = Instant::now();
    let r = rt().block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        r.counts.failed_by_code.get("line_too_long"),
        Some(&4),
        "{:?}",
        r.counts
    );
    assert!(r.counts.failed_samples["line_too_long"].contains("--max-line-bytes 40"));
    // The same requests fit the default limit.
    o.max_line_bytes = arbor_tools::load::run::DEFAULT_MAX_LINE_BYTES;
    let r = rt().block_on(run(&o, None)).expect("run");
    assert_eq!(r.counts.completed, 4, "{:?}", r.counts);
}

/// A fake Arbor server answering each request line in turn with the next of `finals` as its
/// final line (after one token), plus, on the first request, an error line with `"id": null`
/// and a late-cancel answer (both name no request).
fn fake_server(finals: Vec<&'static str>) -> std::net::SocketAddr {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut k = 0usize;
        for s in l.incoming().flatten() {
            let mut w = s.try_clone().unwrap();
            for line in BufReader::new(s).lines() {
                let Ok(line) = line else { break };
                let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
                let Some(id) = v.get("id").cloned() else {
                    continue;
                };
                if k == 0 {
                    let _ = writeln!(
                        w,
                        "{}",
                        serde_json::json!({"id": null, "error": {"code": "line_too_long", "message": "a line of 9 bytes is over the limit"}})
                    );
                    let _ = writeln!(
                        w,
                        "{}",
                        serde_json::json!({"id": null, "cancel": 77, "error": {"code": "unknown_id", "message": "no such request"}})
                    );
                }
                let reason = finals[k % finals.len()];
                k += 1;
                let _ = writeln!(
                    w,
                    "{}",
                    serde_json::json!({"id": id, "text": "a", "tokens": [1]})
                );
                let _ = writeln!(
                    w,
                    "{}",
                    serde_json::json!({"id": id, "done": true, "finish_reason": reason, "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
                );
            }
        }
    });
    addr
}

/// Sampled requests carry the run's temperature, seed, top-k, top-p and min-p; greedy ones none of
/// them (the server's defaults); both carry the penalties given and `--extra-body`'s fields.
#[test]
fn sampled_requests_carry_top_k_top_p_and_min_p() {
    use std::io::{BufRead, BufReader, Write};
    let lines = Arc::new(parking_lot::Mutex::new(Vec::<serde_json::Value>::new()));
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::clone(&lines);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let mut w = s.try_clone().unwrap();
            for line in BufReader::new(s).lines() {
                let Ok(line) = line else { break };
                let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
                let id = v["id"].clone();
                seen.lock().push(v);
                let _ = writeln!(
                    w,
                    "{}",
                    serde_json::json!({"id": id, "done": true, "finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 0}})
                );
            }
        }
    });
    for temperature in [0.8, 0.0] {
        lines.lock().clear();
        let mut o = LoadOptions::new(&format!("arbor://{addr}"));
        o.arrivals = Arrivals::Closed { concurrency: 1 };
        o.requests = Some(2);
        o.temperature = temperature;
        o.top_k = Some(40);
        o.top_p = Some(0.95);
        o.min_p = Some(0.05);
        o.penalties.repetition = Some(1.1);
        o.penalties.presence = Some(-0.5);
        o.extra_body = serde_json::json!({"stop_token_ids": [2], "prompt_logprobs": 1})
            .as_object()
            .cloned();
        rt().block_on(run(&o, None)).expect("run");
        let got = lines.lock().clone();
        assert_eq!(got.len(), 2);
        for v in got {
            if temperature > 0.0 {
                assert_eq!(v["temperature"], 0.8, "{v}");
                assert_eq!(v["top_k"], 40, "{v}");
                assert_eq!(v["top_p"], 0.95, "{v}");
                assert_eq!(v["min_p"], 0.05, "{v}");
                assert!(v["seed"].is_u64(), "{v}");
            } else {
                for k in ["temperature", "top_k", "top_p", "min_p", "seed"] {
                    assert!(v.get(k).is_none(), "{k} in {v}");
                }
            }
            // Penalties go with greedy requests too; those not given are not sent.
            assert_eq!(v["repetition_penalty"], 1.1, "{v}");
            assert_eq!(v["presence_penalty"], -0.5, "{v}");
            assert!(v.get("frequency_penalty").is_none(), "{v}");
            assert!(v.get("repeat_penalty").is_none(), "{v}");
            // `--extra-body`'s fields go with every request.
            assert_eq!(v["stop_token_ids"], serde_json::json!([2]), "{v}");
            assert_eq!(v["prompt_logprobs"], 1, "{v}");
        }
    }
    // Fields the tester sets itself are refused, naming the field.
    for key in [
        "n",
        "max_tokens",
        "temperature",
        "stream",
        "seed",
        "auth",
        "max_completion_tokens",
    ] {
        let mut o = LoadOptions::new(&format!("arbor://{addr}"));
        o.extra_body = serde_json::json!({ key: 2 }).as_object().cloned();
        let e = rt().block_on(run(&o, None)).unwrap_err();
        assert_eq!(e.error_type(), "invalid_argument");
        assert!(e.to_string().contains(&format!("\"{key}\"")), "{e}");
    }
}

#[test]
fn requests_the_server_ends_at_deadline_or_shutdown_are_failures() {
    let addr = fake_server(vec!["deadline", "shutdown", "length"]);
    let mut o = LoadOptions::new(&format!("arbor://{addr}"));
    o.arrivals = Arrivals::Closed { concurrency: 1 };
    o.requests = Some(3);
    let r = rt().block_on(run(&o, None)).expect("run");
    check_accounting(&r);
    assert_eq!(
        (r.counts.completed, r.counts.failed),
        (1, 2),
        "{:?}",
        r.counts
    );
    assert_eq!(r.counts.failed_by_code.get("deadline"), Some(&1));
    assert_eq!(r.counts.failed_by_code.get("shutdown"), Some(&1));
    assert_eq!(
        r.summary.e2e_ms.count, 1,
        "only the completed request is measured"
    );
    // The id-less error is a stray line counted by code; the late-cancel answer is not stray.
    assert_eq!(r.counts.stray_lines, 1, "{:?}", r.counts);
    assert_eq!(r.counts.stray_errors_by_code.get("line_too_long"), Some(&1));
    let text = report::summary(&r);
    assert!(
        text.contains("errors naming no request: line_too_long 1"),
        "{text}"
    );
    assert!(
        text.contains("deadline: the server ended the request at its deadline"),
        "{text}"
    );
}

/// A fake Arbor server whose connection `k` closes as idle when its first request line arrives
/// (the line crossed the server's `idle_timeout`) where `closes(k)`, and answers otherwise;
/// returns its address and the count of connections it accepted.
fn idle_closing_server(
    closes: fn(usize) -> bool,
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    std::thread::spawn(move || {
        for (k, s) in l.incoming().flatten().enumerate() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut w = s.try_clone().unwrap();
            for line in BufReader::new(s).lines() {
                let Ok(line) = line else { break };
                let v: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
                let Some(id) = v.get("id").cloned() else {
                    continue;
                };
                if closes(k) {
                    let _ = writeln!(
                        w,
                        "{}",
                        serde_json::json!({"id": null, "error": {"code": "idle_timeout", "message": "no request and no line for 0.1 s: connection closed"}})
                    );
                    break;
                }
                let _ = writeln!(
                    w,
                    "{}",
                    serde_json::json!({"id": id, "text": "a", "tokens": [1]})
                );
                let _ = writeln!(
                    w,
                    "{}",
                    serde_json::json!({"id": id, "done": true, "finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
                );
            }
        }
    });
    (addr, accepted)
}

/// A request line that crosses the server's idle close of its pooled connection is sent again
/// on a new connection (once), and the close is not a stray error.
#[test]
fn a_request_that_crosses_an_idle_close_is_sent_again_once() {
    let run_on = |addr: std::net::SocketAddr| {
        let mut o = LoadOptions::new(&format!("arbor://{addr}"));
        o.arrivals = Arrivals::Closed { concurrency: 1 };
        o.requests = Some(2);
        let r = rt().block_on(run(&o, None)).expect("run");
        check_accounting(&r);
        assert_eq!(r.counts.stray_lines, 0, "{:?}", r.counts);
        r
    };
    // Connection 0 closes: the first request goes again on connection 1, which serves both.
    let (addr, accepted) = idle_closing_server(|k| k == 0);
    let r = run_on(addr);
    assert_eq!(r.counts.completed, 2, "{:?}", r.counts);
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
    // Every connection closes: each request tries two connections, then fails.
    let (addr, accepted) = idle_closing_server(|_| true);
    let r = run_on(addr);
    assert_eq!(
        r.counts.failed_by_code.get("connection_closed"),
        Some(&2),
        "{:?}",
        r.counts
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 4);
}

#[test]
fn compare_into_a_closed_pipe_ends_quietly() {
    let server = InstantServer::start(1).expect("instant server");
    let mut o = LoadOptions::new(&format!("arbor://{}", server.addr));
    o.requests = Some(3);
    o.max_tokens = 2;
    o.arrivals = Arrivals::Closed { concurrency: 1 };
    let r = rt().block_on(run(&o, None)).expect("run");
    let dir = temp_dir("pipe");
    let a = dir.join("a.json");
    ResultsFile::Run(Box::new(r)).write(&a).unwrap();
    // A pipe whose reader is gone before arbor prints (as `| head` is once it has its lines).
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["load", "compare", a.to_str().unwrap(), a.to_str().unwrap()])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("arbor runs");
    let out = child.wait_with_output().expect("arbor ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ctrl-C during a sweep ends the rate that runs and the sweep with it (before, each rate had
/// its own handler: the next rate started); the finished part is written.
#[cfg(unix)]
#[test]
fn ctrl_c_ends_a_sweep_and_keeps_what_ran() {
    let server = InstantServer::start(1).expect("instant server");
    let dir = temp_dir("sigint");
    let out = dir.join("sweep.json");
    let t0 = std::time::Instant::now();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args([
            "load",
            "sweep",
            "--target",
            &format!("arbor://{}", server.addr),
            "--rates",
            "20,20,20",
            "--duration",
            "3",
            "--cooldown",
            "1",
            "--max-tokens",
            "2",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("arbor runs");
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let done = child.wait_with_output().expect("arbor ends");
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{:?}: {stderr}", done.status);
    // Three rates would take 3 x 3 s + 2 cooldowns.
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(7),
        "{:?}: {stderr}",
        t0.elapsed()
    );
    let ResultsFile::Sweep(s) = ResultsFile::read(&out).expect("results written") else {
        panic!("not a sweep");
    };
    assert_eq!(s.runs.len(), 1, "{stderr}");
    assert!(s.runs[0].counts.completed > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A closed loop against a server that accepts and never answers: the duration ends sending
/// and the drain cancels the requests, although none ever finishes (the run waited for a
/// completion before it looked at the clock).
#[test]
fn a_closed_loop_ends_at_its_duration_against_a_silent_server() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming().flatten() {
            held.push(s); // read nothing, write nothing
        }
    });
    let mut o = LoadOptions::new(&format!("arbor://{addr}"));
    o.arrivals = Arrivals::Closed { concurrency: 2 };
    o.requests = None;
    o.duration_s = Some(1.0);
    o.drain_s = 0.0;
    o.max_tokens = 4;
    let t0 = Instant::now();
    let r = rt()
        .block_on(async { tokio::time::timeout(Duration::from_secs(30), run(&o, None)).await })
        .expect("the run ends")
        .expect("run");
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    check_accounting(&r);
    assert_eq!(r.counts.sent, 2, "{:?}", r.counts);
    assert_eq!(r.counts.cancelled, 2, "{:?}", r.counts);
}

/// A target whose accept queue is full (connection attempts go unanswered): the run's end
/// cancels the requests waiting to connect instead of waiting out the kernel's retries.
#[test]
fn a_target_that_never_accepts_does_not_outlast_the_run() {
    let full = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = full.local_addr().unwrap();
    // Fill the accept queue (never accepted) until a connection attempt goes unanswered.
    let mut queued = Vec::new();
    let filled = (0..2000).any(|_| {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
            Ok(s) => {
                queued.push(s);
                false
            }
            Err(_) => true,
        }
    });
    if !filled {
        eprintln!("SKIP: this kernel answered 2000 connections to a listener that never accepts");
        return;
    }
    let mut o = LoadOptions::new(&format!("arbor://{addr}"));
    o.arrivals = Arrivals::Closed { concurrency: 2 };
    o.requests = None;
    o.duration_s = Some(1.0);
    o.drain_s = 0.5;
    o.max_tokens = 4;
    let t0 = Instant::now();
    let r = rt()
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), run(&o, None)).await })
        .expect("the run ends")
        .expect("run");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    check_accounting(&r);
    assert_eq!(r.counts.cancelled, r.counts.sent, "{:?}", r.counts);
    drop((full, queued));
}
