//! End-to-end tests of `arbor generate --draft …` with real drafters (SSM, prompt lookup, early exit, SPACE, Token Recycling, prompt lookup with a fallback; merged and dynamic trees): same tokens as plain generation, acceptance reported.

mod common;

use common::{arbor, json};

const BASE: [&str; 9] = [
    "generate",
    "--model",
    "smollm2-135m",
    "--prompt",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "--max-tokens",
    "16",
    "--ignore-eos",
    "--format=json",
];

#[test]
fn real_drafters_match_plain_generation_and_report_acceptance() {
    let plain = json(&BASE);
    for extra in [
        &[
            "--draft",
            "ngram",
            "--draft",
            "early-exit:8",
            "--tree",
            "1,1,3,1,1",
        ][..],
        &["--draft", "smollm2-135m", "--tree", "dynamic:8"][..],
        &["--space", "--space-k", "3"][..],
        &["--space", "--space-mask-token", "0", "--draft", "ngram"][..],
        &["--draft", "ngram-else:smollm2-135m", "--tree", "1,1,1,1"][..],
        &["--draft", "recycle", "--draft", "ngram"][..],
        &["--draft", "ngram-else:recycle:4", "--speculate-budget", "8"][..],
        &["--draft", "recycle:logits"][..],
    ] {
        // Fixed trees (every drafted node verified) and the adaptive policy (the default: the
        // depth that pays): the same tokens either way.
        for policy in ["fixed", "adaptive"] {
            let mut args = BASE.to_vec();
            args.extend(extra);
            args.extend(["--speculate-policy", policy]);
            let j = json(&args);
            if extra.contains(&"--space") {
                assert!(j["spec"]["placeholder_rows"].as_u64().unwrap() > 0, "{j}");
            }
            assert_eq!(j["tokens"], plain["tokens"], "{extra:?} {policy}");
            let s = &j["spec"];
            assert_eq!(s["mode"], "greedy");
            assert!(s["mean_accepted"].as_f64().is_some(), "{s}");
            let self_drafting =
                extra.contains(&"smollm2-135m") || extra.contains(&"ngram-else:smollm2-135m");
            if self_drafting && policy == "fixed" {
                // The LLM drafting for itself: (almost) everything is accepted.
                assert!(s["mean_accepted"].as_f64().unwrap() >= 2.0, "{s}");
            }
        }
    }
}

#[test]
fn bad_drafters_and_trees_are_refused() {
    for extra in [
        &["--draft", "early-exit"][..],
        &["--draft", "early-exit:0"][..],
        &["--draft", "ngram:x"][..],
        &["--draft", "ngram:1-else:smollm2-135m"][..],
        &["--draft", "ngram-else:ngram-else:ngram"][..],
        &["--draft", "early-exit:4-else:ngram"][..],
        &["--draft", "ngram-else:no-such-model"][..],
        &["--draft", "ngram", "--tree", "dynamic:0"][..],
        &["--draft", "oracle", "--tree", "dynamic:8"][..],
        &["--draft", "early-exit:999"][..],
        &["--draft", "recycle:0"][..],
        &["--draft", "recycle:33"][..],
        &["--draft", "recycle:x"][..],
        &["--draft", "recycle:logits:4"][..],
        &["--draft", "recycle:4:logits:logits"][..],
        &["--draft", "recycle:8:9"][..],
        &["--space", "--space-k", "0"][..],
        &["--space", "--space-mask-token", "99999999"][..],
        &["--space-k", "3"][..],
    ] {
        let mut args = BASE.to_vec();
        args.extend(extra);
        let out = arbor(&args);
        assert!(!out.status.success(), "{extra:?} should fail");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("error"),
            "{extra:?}"
        );
    }
}
