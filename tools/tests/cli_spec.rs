//! End-to-end tests of `arbor generate --speculate…` and `arbor bench spec` (SpecInfer token trees): same tokens, spec metrics in the stats line and JSON.

mod common;

use common::{arbor, json};

const BASE: [&str; 7] = [
    "generate",
    "--prompt",
    "The capital of France is",
    "--max-tokens",
    "16",
    "--ignore-eos",
    "--format=json",
];

#[test]
fn greedy_speculation_reports_metrics_and_matches_plain_generation() {
    let plain = json(&BASE);
    assert!(plain.get("spec").is_none());
    for (drafters, tree) in [
        ("oracle", "1,1,3,1,1,1,1,1"),
        ("random", "2,2"),
        ("oracle,random", "2,2,2"),
    ] {
        // Fixed trees verify every drafted node; the adaptive policy (the default) what pays.
        for policy in ["fixed", "adaptive"] {
            let mut args = BASE.to_vec();
            args.extend(["--speculate", drafters, "--speculate-tree", tree]);
            args.extend(["--speculate-policy", policy]);
            let j = json(&args);
            assert_eq!(j["tokens"], plain["tokens"], "{drafters} {tree} {policy}");
            assert_eq!(j["text"], plain["text"]);
            let s = &j["spec"];
            assert_eq!(s["mode"], "greedy");
            let steps = s["steps"].as_u64().unwrap();
            let accepted = s["accepted"].as_u64().unwrap();
            assert!(steps >= 1);
            if policy == "fixed" {
                assert!(s["drafted"].as_u64().unwrap() >= steps);
            }
            assert_eq!(
                accepted + steps,
                15,
                "every token after the first is accepted or a bonus"
            );
            assert_eq!(s["drafter_contract_failures"], 0, "{s}");
            let mean = s["mean_accepted"].as_f64().unwrap();
            assert!((mean - accepted as f64 / steps as f64).abs() < 1e-9);
            if drafters.contains("oracle") && policy == "fixed" {
                assert!(mean >= 1.0, "{s}");
            }
        }
    }
}

/// Same seed, same text; another seed, other text; temperature 0.01 gives the greedy text of
/// plain generation, 0.9 not (pinned seeds: the outcomes are fixed). Text mode ends with one
/// stats line.
#[test]
fn sampled_speculation_is_reproducible_and_text_mode_prints_one_stats_line() {
    let run = |seed: &str, temperature: &str| {
        let out = arbor(&[
            "generate",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "12",
            "--temperature",
            temperature,
            "--seed",
            seed,
            "--ignore-eos",
            "--speculate",
            "random",
            "--speculate-verify",
            "mss",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // The generated text; only the timings on the stats line may differ between runs.
    let body = |t: &str| t.rsplit_once("\n[arbor]").map(|(body, _)| body.to_string());
    let text = run("7", "0.9");
    assert!(body(&text).is_some(), "{text}");
    assert_eq!(body(&text), body(&run("7", "0.9")));
    assert_ne!(body(&text), body(&run("8", "0.9")), "the seed is used");
    let plain = arbor(&[
        "generate",
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]);
    let greedy = body(&String::from_utf8(plain.stdout).unwrap());
    assert!(greedy.is_some());
    assert_ne!(body(&text), greedy, "temperature 0.9 is not greedy");
    assert_eq!(
        body(&run("7", "0.01")),
        greedy,
        "temperature 0.01 samples the argmax"
    );
    let last = text.trim_end().lines().last().unwrap();
    assert!(last.starts_with("[arbor] prompt tokens:"), "{last}");
    assert!(last.contains("spec (mss): steps:"), "{last}");
    assert!(last.contains("mean accepted:"), "{last}");
    assert!(last.contains("drafter contract failures: 0"), "{last}");
}

#[test]
fn bad_speculation_options_are_clear_errors() {
    for (flag, value, needle) in [
        ("--speculate", "psychic", "unknown drafter"),
        ("--speculate-tree", "1,0,2", "branch factors"),
        ("--speculate-verify", "maybe", "unknown verification mode"),
    ] {
        let mut args = vec!["generate", "--prompt", "x", "--speculate", "random"];
        args.extend([flag, value]);
        let out = arbor(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn bench_spec_prints_one_row_per_tree_size() {
    let j = json(&[
        "bench",
        "spec",
        "--drafter",
        "oracle",
        "--tree-sizes",
        "1,4,16",
        "--tokens",
        "8",
        "--prompt-tokens",
        "32",
        "--format",
        "json",
    ]);
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for (row, n) in rows.iter().zip([1, 4, 16]) {
        assert_eq!(row["tree_nodes"], n);
        assert!(row["ms_per_pass"].as_f64().unwrap() > 0.0);
        // The oracle's chain is always accepted: min(n, depth) tokens per pass.
        assert!(row["mean_accepted"].as_f64().unwrap() >= (n.min(8) as f64) * 0.5);
    }
    let out = arbor(&["bench", "spec", "--drafter", "psychic"]);
    assert!(!out.status.success());
}

/// `--speculate-policy auto` under sampling: adaptive trees (drafts that never pay are dropped:
/// random guesses back off to plain steps), but fixed ones, every drafted node verified, when
/// the user gives `--seed` (the same seed then gives the same text).
#[test]
fn sampled_auto_policy_is_fixed_only_with_an_explicit_seed() {
    let spec = |seed: Option<&str>| {
        let mut args = vec![
            "generate",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "48",
            "--ignore-eos",
            "--temperature",
            "0.9",
            "--speculate",
            "random",
            "--speculate-tree",
            "2,2",
            "--format=json",
        ];
        if let Some(s) = seed {
            args.extend(["--seed", s]);
        }
        let j = json(&args);
        let n = |k: &str| j["spec"][k].as_u64().unwrap();
        (n("steps"), n("drafted"))
    };
    let (steps, drafted) = spec(None);
    assert!(
        drafted < steps,
        "adaptive: {drafted} drafted in {steps} steps"
    );
    let (steps, drafted) = spec(Some("7"));
    assert!(
        drafted >= 4 * steps,
        "fixed: {drafted} drafted in {steps} steps"
    );
}
