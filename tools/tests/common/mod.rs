//! Helpers shared by the CLI tests: run the `arbor` binary, parse its JSON output.
#![allow(dead_code)]

use std::process::{Command, Output};

pub fn arbor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(args)
        .output()
        .expect("arbor runs")
}

/// Run `arbor` expecting success and one JSON object on stdout.
pub fn json(args: &[&str]) -> serde_json::Value {
    let out = arbor(args);
    assert!(
        out.status.success(),
        "{args:?}: stderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}
