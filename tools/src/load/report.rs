//! Text reports: one run's summary table, and two runs or sweeps side by side (`arbor load compare`).

use std::fmt::Write;

use super::metrics::Stats;
use super::run::{Arrivals, RunResult};
use super::{ResultsFile, SweepResult};

fn arrivals(r: &RunResult) -> String {
    match r.options.arrivals {
        Arrivals::Open { rate, burstiness } => {
            format!("open loop {rate} req/s, burstiness {burstiness}")
        }
        Arrivals::Closed { concurrency } => format!("closed loop, concurrency {concurrency}"),
    }
}

/// One line per failure code with its sample message, the first prefixed with `head`.
fn failure_samples(
    out: &mut String,
    head: &str,
    samples: &std::collections::BTreeMap<String, String>,
) {
    for (k, (code, message)) in samples.iter().enumerate() {
        let lead = if k == 0 {
            head.to_string()
        } else {
            " ".repeat(head.len())
        };
        let _ = writeln!(out, "{lead}{code}: {message}");
    }
}

fn stats_row(out: &mut String, name: &str, s: &Stats) {
    let _ = writeln!(
        out,
        "  {name:<11} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8}",
        s.mean, s.p50, s.p90, s.p99, s.max, s.count
    );
}

/// The summary table printed at the end of a run.
pub fn summary(r: &RunResult) -> String {
    let c = &r.counts;
    let s = &r.summary;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "target       {} ({}, seed {})",
        r.options.target,
        arrivals(r),
        r.options.seed
    );
    let by_code = if c.failed_by_code.is_empty() {
        String::new()
    } else {
        let v: Vec<String> = c
            .failed_by_code
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        format!(" ({})", v.join(", "))
    };
    let _ = writeln!(
        out,
        "requests     sent {} = completed {} + cancelled {} + failed {}{by_code}; warm-up {}",
        c.sent, c.completed, c.cancelled, c.failed, c.warmup
    );
    failure_samples(&mut out, "failures     ", &c.failed_samples);
    if c.stray_lines > 0 {
        let errors = if c.stray_errors_by_code.is_empty() {
            String::new()
        } else {
            let v: Vec<String> = c
                .stray_errors_by_code
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            format!(" (errors naming no request: {})", v.join(", "))
        };
        let _ = writeln!(out, "stray lines  {}{errors}", c.stray_lines);
    }
    let _ = writeln!(
        out,
        "window       {:.1} s; mean prompt {:.0} tokens, mean output {:.1} tokens",
        s.window_s, s.mean_prompt_tokens, s.mean_output_tokens
    );
    let _ = writeln!(
        out,
        "throughput   {:.3} req/s, {:.1} output tok/s",
        s.request_throughput, s.output_token_throughput
    );
    match &r.slo {
        Some(slo) => {
            let _ = writeln!(
                out,
                "goodput      {:.3} req/s ({:.1}% of measured requests good; SLO {})",
                s.goodput,
                100.0 * s.good_fraction,
                slo.describe()
            );
        }
        None => {
            let _ = writeln!(out, "goodput      (no SLO given)");
        }
    }
    if let (Some(a), Some(m)) = (s.acceptance_rate, s.mean_accepted) {
        let _ = writeln!(
            out,
            "speculation  acceptance {:.1}%, {:.2} accepted tokens per step, {:.2} tokens per event",
            100.0 * a,
            m,
            s.tokens_per_event
        );
    } else {
        let _ = writeln!(
            out,
            "speculation  none reported; {:.2} tokens per event",
            s.tokens_per_event
        );
    }
    let _ = writeln!(
        out,
        "latency ms        mean       p50       p90       p99       max    count"
    );
    stats_row(&mut out, "TTFT", &s.ttft_ms);
    stats_row(&mut out, "TPOT", &s.tpot_ms);
    stats_row(&mut out, "ITL/token", &s.itl_token_ms);
    stats_row(&mut out, "ITL/event", &s.itl_event_ms);
    stats_row(&mut out, "E2E", &s.e2e_ms);
    out
}

fn ratio(a: f64, b: f64) -> String {
    if a > 0.0 && b.is_finite() {
        format!("{:.2}x", b / a)
    } else {
        "-".into()
    }
}

fn run_rows(a: &RunResult, b: &RunResult) -> Vec<(&'static str, f64, f64)> {
    let (x, y) = (&a.summary, &b.summary);
    vec![
        (
            "completed",
            a.counts.completed as f64,
            b.counts.completed as f64,
        ),
        ("failed", a.counts.failed as f64, b.counts.failed as f64),
        ("req/s", x.request_throughput, y.request_throughput),
        (
            "output tok/s",
            x.output_token_throughput,
            y.output_token_throughput,
        ),
        ("goodput req/s", x.goodput, y.goodput),
        ("TTFT p50 ms", x.ttft_ms.p50, y.ttft_ms.p50),
        ("TTFT p99 ms", x.ttft_ms.p99, y.ttft_ms.p99),
        ("TPOT p50 ms", x.tpot_ms.p50, y.tpot_ms.p50),
        ("TPOT p99 ms", x.tpot_ms.p99, y.tpot_ms.p99),
        ("ITL/token p50 ms", x.itl_token_ms.p50, y.itl_token_ms.p50),
        ("ITL/token p99 ms", x.itl_token_ms.p99, y.itl_token_ms.p99),
        ("E2E p50 ms", x.e2e_ms.p50, y.e2e_ms.p50),
        ("E2E p99 ms", x.e2e_ms.p99, y.e2e_ms.p99),
        (
            "acceptance %",
            100.0 * x.acceptance_rate.unwrap_or(0.0),
            100.0 * y.acceptance_rate.unwrap_or(0.0),
        ),
        ("tokens/event", x.tokens_per_event, y.tokens_per_event),
    ]
}

/// Two runs side by side, with B/A ratios.
pub fn compare_runs(a: &RunResult, b: &RunResult) -> String {
    let mut out = String::new();
    let (la, lb) = (a.label(), b.label());
    let _ = writeln!(out, "A: {la}\nB: {lb}");
    if a.slo != b.slo {
        let _ = writeln!(out, "note: the runs used different SLOs; goodput is not comparable (compare --slo re-scores both)");
    }
    let _ = writeln!(out, "{:<18} {:>12} {:>12} {:>8}", "", "A", "B", "B/A");
    for (name, x, y) in run_rows(a, b) {
        let _ = writeln!(out, "{name:<18} {x:>12.2} {y:>12.2} {:>8}", ratio(x, y));
    }
    out
}

/// Two sweeps side by side, one row per rate.
pub fn compare_sweeps(a: &SweepResult, b: &SweepResult) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "A: {}\nB: {}", a.label(), b.label());
    let _ = writeln!(
        out,
        "{:>7} | {:>9} {:>9} {:>7} | {:>9} {:>9} {:>7} | {:>9} {:>9} | {:>9} {:>9}",
        "req/s",
        "good A",
        "good B",
        "B/A",
        "tok/s A",
        "tok/s B",
        "B/A",
        "TTFT50 A",
        "TTFT50 B",
        "TPOT50 A",
        "TPOT50 B"
    );
    for ra in &a.runs {
        let Some(rate) = ra.rate() else {
            continue;
        };
        let Some((_, rb)) = b.run_at(Some(rate)) else {
            continue;
        };
        let (x, y) = (&ra.summary, &rb.summary);
        let _ = writeln!(
            out,
            "{rate:>7} | {:>9.3} {:>9.3} {:>7} | {:>9.1} {:>9.1} {:>7} | {:>9.1} {:>9.1} | {:>9.1} {:>9.1}",
            x.goodput,
            y.goodput,
            ratio(x.goodput, y.goodput),
            x.output_token_throughput,
            y.output_token_throughput,
            ratio(x.output_token_throughput, y.output_token_throughput),
            x.ttft_ms.p50,
            y.ttft_ms.p50,
            x.tpot_ms.p50,
            y.tpot_ms.p50
        );
    }
    out
}

/// One line per rate of a sweep.
pub fn sweep_table(s: &SweepResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "req/s",
        "done",
        "failed",
        "out tok/s",
        "goodput",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "accept"
    );
    for r in &s.runs {
        let rate = r.rate().unwrap_or(f64::NAN);
        let m = &r.summary;
        let _ = writeln!(
            out,
            "{rate:>7} {:>6} {:>6} {:>9.1} {:>9.3} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7}",
            r.counts.completed,
            r.counts.failed + r.counts.cancelled,
            m.output_token_throughput,
            m.goodput,
            m.ttft_ms.p50,
            m.ttft_ms.p99,
            m.tpot_ms.p50,
            m.tpot_ms.p99,
            m.itl_token_ms.p99,
            m.acceptance_rate
                .map_or_else(|| "-".into(), |a| format!("{:.1}%", 100.0 * a))
        );
    }
    for r in &s.runs {
        if !r.counts.failed_samples.is_empty() {
            let head = format!("failures at {} req/s: ", r.rate().unwrap_or(f64::NAN));
            failure_samples(&mut out, &head, &r.counts.failed_samples);
        }
    }
    out
}

/// `compare`: runs with runs, sweeps with sweeps.
pub fn compare(a: &ResultsFile, b: &ResultsFile) -> Result<String, super::LoadError> {
    match (a, b) {
        (ResultsFile::Run(a), ResultsFile::Run(b)) => Ok(compare_runs(a, b)),
        (ResultsFile::Sweep(a), ResultsFile::Sweep(b)) => Ok(compare_sweeps(a, b)),
        _ => Err(super::LoadError::Invalid(
            "compare takes two single runs or two sweeps".into(),
        )),
    }
}
