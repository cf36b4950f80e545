//! `arbor serve` as users run it: flags, the auth token from the environment, a request over TCP whose text equals `arbor generate`'s, and SIGTERM ending an in-flight request with a final `shutdown` line and exit code 0.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use common::json;

#[cfg(unix)]
#[test]
fn serve_answers_over_tcp_and_shuts_down_on_sigterm() {
    let want = json(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "12",
        "--format",
        "json",
    ]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--kv-memory",
            "64MiB",
            "--shutdown-grace",
            "0.2",
            "--log-format",
            "json",
        ])
        .env("ARBOR_AUTH_TOKEN", "tok")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("arbor serve runs");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("listening line");
    let addr = line
        .trim()
        .strip_prefix("arbor: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let s = std::net::TcpStream::connect(&addr).expect("connect");
    let mut w = s.try_clone().expect("clone");
    let mut r = BufReader::new(s);
    let mut recv = || {
        let mut l = String::new();
        r.read_line(&mut l).expect("read");
        serde_json::from_str::<serde_json::Value>(&l).unwrap_or_else(|e| panic!("{l:?}: {e}"))
    };
    writeln!(
        w,
        r#"{{"id": 1, "prompt": "The capital of France is", "max_tokens": 12}}"#
    )
    .unwrap();
    assert_eq!(recv()["error"]["code"], "unauthorized");
    writeln!(w, r#"{{"auth": "tok"}}"#).unwrap();
    assert_eq!(recv()["auth"], "ok");
    writeln!(
        w,
        r#"{{"id": 2, "prompt": "The capital of France is", "max_tokens": 12, "stream": false}}"#
    )
    .unwrap();
    let fin = recv();
    assert_eq!(fin["text"], want["text"], "{fin}");
    assert_eq!(fin["tokens"], want["tokens"], "{fin}");
    // A long request in flight, then SIGTERM: its final line says shutdown, the process exits 0.
    writeln!(
        w,
        r#"{{"id": 3, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": true}}"#
    )
    .unwrap();
    assert_eq!(recv()["id"], 3);
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let fin = loop {
        let v = recv();
        if v.get("done").is_some() {
            break v;
        }
    };
    assert_eq!(fin["finish_reason"], "shutdown", "{fin}");
    let status = child.wait().expect("exits");
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .expect("stderr");
    assert!(status.success(), "{status:?}: {err}");
    // JSON logs, one object per line, with the request's span.
    let logs: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("log line {l:?}: {e}")))
        .collect();
    assert!(
        logs.iter().any(|l| l["fields"]["message"] == "SIGTERM"),
        "{err}"
    );
    assert!(
        logs.iter()
            .any(|l| l["fields"]["finish"] == "shutdown" && l["span"]["id"] == "3"),
        "{err}"
    );
}
