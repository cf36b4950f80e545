//! Per-request timing records and their summary: TTFT, TPOT (vLLM: (E2E - TTFT) / (output tokens - 1)), inter-token latency per token and per event, E2E, throughput and goodput under SLOs, from `hdrhistogram`.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use super::LoadError;

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "status")]
pub enum Outcome {
    /// A final `done` line (or the end of an OpenAI stream) with this finish reason.
    Completed { finish_reason: String },
    /// The tool cancelled it (the run's time was up); includes a server-side `cancelled`.
    Cancelled,
    /// An error line, an HTTP error or a broken connection, by stable code.
    Failed { code: String, message: String },
}

/// Speculation figures from a request's final line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecRecord {
    pub steps: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// Everything measured about one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub index: usize,
    /// Which prompt of the set it sent.
    pub prompt: usize,
    /// Seconds from the start of the run to sending.
    pub sent_s: f64,
    /// Sent during the warm-up: accounted for, not in the latency figures.
    pub warmup: bool,
    pub max_tokens: usize,
    pub outcome: Outcome,
    /// Milliseconds from sending to each token event, with the tokens it carried.
    pub events: Vec<(f64, u32)>,
    /// Milliseconds from sending to the final line.
    pub e2e_ms: f64,
    /// Output tokens counted from the events.
    pub output_tokens: u64,
    /// The server's own `usage` figures when it sent them.
    pub usage_prompt_tokens: Option<u64>,
    pub usage_completion_tokens: Option<u64>,
    pub spec: Option<SpecRecord>,
}

impl RequestRecord {
    pub fn ttft_ms(&self) -> Option<f64> {
        self.events.first().map(|e| e.0)
    }

    /// Output tokens: the server's count when it gave one, else the streamed count.
    pub fn tokens(&self) -> u64 {
        self.usage_completion_tokens.unwrap_or(self.output_tokens)
    }

    /// vLLM's TPOT: (E2E - TTFT) / (output tokens - 1), for requests with at least two tokens.
    pub fn tpot_ms(&self) -> Option<f64> {
        let n = self.tokens();
        match (self.ttft_ms(), n > 1) {
            (Some(t), true) => Some((self.e2e_ms - t) / (n - 1) as f64),
            _ => None,
        }
    }

    /// Inter-token latency per token: each event after the first, its gap from the previous
    /// event divided over the tokens it carried, once per token.
    pub fn itl_per_token(&self) -> impl Iterator<Item = f64> + '_ {
        self.events.windows(2).flat_map(|w| {
            let n = w[1].1.max(1);
            std::iter::repeat_n((w[1].0 - w[0].0) / f64::from(n), n as usize)
        })
    }

    pub fn completed(&self) -> bool {
        matches!(self.outcome, Outcome::Completed { .. })
    }
}

/// Service-level objectives: a request is good when it meets every one given.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// `ttft=2s,tpot=150ms,e2e=10s` (units ms or s; bare numbers are ms).
    pub fn parse(s: &str) -> Result<Slo, LoadError> {
        let mut slo = Slo::default();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                LoadError::Invalid(format!("SLO '{part}' is not key=value (e.g. ttft=2s)"))
            })?;
            let ms = parse_ms(v.trim())?;
            match k.trim() {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2e" => slo.e2e_ms = Some(ms),
                other => {
                    return Err(LoadError::Invalid(format!(
                        "unknown SLO '{other}' (ttft, tpot, e2e)"
                    )))
                }
            }
        }
        Ok(slo)
    }

    pub fn is_empty(&self) -> bool {
        self.ttft_ms.is_none() && self.tpot_ms.is_none() && self.e2e_ms.is_none()
    }

    /// Whether a completed request meets every SLO given.
    pub fn good(&self, r: &RequestRecord) -> bool {
        if !r.completed() {
            return false;
        }
        let ok = |limit: Option<f64>, v: Option<f64>| match (limit, v) {
            (None, _) => true,
            (Some(l), Some(v)) => v <= l,
            // A TTFT objective with no token at all is missed; TPOT is undefined below two tokens.
            (Some(_), None) => false,
        };
        ok(self.ttft_ms, r.ttft_ms())
            && (self.tpot_ms.is_none() || r.tokens() < 2 || ok(self.tpot_ms, r.tpot_ms()))
            && ok(self.e2e_ms, Some(r.e2e_ms))
    }

    pub fn describe(&self) -> String {
        let mut v = Vec::new();
        if let Some(t) = self.ttft_ms {
            v.push(format!("ttft={t:.0}ms"));
        }
        if let Some(t) = self.tpot_ms {
            v.push(format!("tpot={t:.1}ms"));
        }
        if let Some(t) = self.e2e_ms {
            v.push(format!("e2e={t:.0}ms"));
        }
        v.join(",")
    }
}

fn parse_ms(v: &str) -> Result<f64, LoadError> {
    let (num, scale) = if let Some(n) = v.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1000.0)
    } else {
        (v, 1.0)
    };
    let x: f64 = num
        .trim()
        .parse()
        .map_err(|_| LoadError::Invalid(format!("'{v}' is not a duration (e.g. 2s, 150ms)")))?;
    if !(x.is_finite() && x > 0.0) {
        return Err(LoadError::Invalid(format!("SLO '{v}' must be positive")));
    }
    Ok(x * scale)
}

/// Mean and percentiles of one latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// Latency histogram in microseconds (1 µs to 1 hour, 3 significant digits).
pub struct LatencyHistogram(Histogram<u64>);

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram(
            Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static histogram bounds"),
        )
    }
}

impl LatencyHistogram {
    pub fn record_ms(&mut self, ms: f64) {
        self.0
            .saturating_record((ms * 1000.0).round().max(1.0) as u64);
    }

    pub fn stats(&self) -> Stats {
        let h = &self.0;
        if h.is_empty() {
            return Stats::default();
        }
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
        Stats {
            count: h.len(),
            mean: h.mean() / 1000.0,
            p50: q(0.50),
            p90: q(0.90),
            p99: q(0.99),
            max: h.max() as f64 / 1000.0,
        }
    }
}

/// Request accounting: every request sent ends in exactly one of these.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    pub sent: u64,
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub failed_by_code: BTreeMap<String, u64>,
    /// One message per failure code: the first failed request's (by index) with that code.
    #[serde(default)]
    pub failed_samples: BTreeMap<String, String>,
    /// Of `sent`, how many went out during the warm-up.
    pub warmup: u64,
    /// Lines the server sent that named no request (e.g. an error about an unreadable line).
    pub stray_lines: u64,
    /// Of the stray lines, the error lines by code (`line_too_long`, `invalid_json`, ... with
    /// `"id": null`).
    #[serde(default)]
    pub stray_errors_by_code: BTreeMap<String, u64>,
}

impl Counts {
    /// `code n (sample message)` for each failure code, for error messages.
    pub fn describe_failures(&self) -> String {
        let v: Vec<String> = self
            .failed_by_code
            .iter()
            .map(|(code, n)| match self.failed_samples.get(code) {
                Some(m) if !m.is_empty() => format!("{code} {n}: {m}"),
                _ => format!("{code} {n}"),
            })
            .collect();
        v.join("; ")
    }
}

/// The figures of one run over its measured (post-warm-up) requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Seconds from the first measured send to the last measured final line.
    pub window_s: f64,
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    /// Good requests per second under the SLOs (equal to `request_throughput` without SLOs).
    pub goodput: f64,
    pub good_fraction: f64,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    /// Per token: each event's gap from the previous event divided over the tokens it carried.
    pub itl_token_ms: Stats,
    /// Per event: gaps between consecutive token events.
    pub itl_event_ms: Stats,
    pub e2e_ms: Stats,
    pub mean_prompt_tokens: f64,
    pub mean_output_tokens: f64,
    /// Accepted / drafted tokens over the requests that reported speculation.
    pub acceptance_rate: Option<f64>,
    /// Accepted draft tokens per verification step.
    pub mean_accepted: Option<f64>,
    /// Output tokens per token event (1 without speculation).
    pub tokens_per_event: f64,
}

/// Count outcomes and summarize the measured requests.
pub fn summarize(records: &[RequestRecord], slo: &Slo, stray_lines: u64) -> (Counts, Summary) {
    let mut c = Counts {
        stray_lines,
        ..Counts::default()
    };
    for r in records {
        c.sent += 1;
        c.warmup += u64::from(r.warmup);
        match &r.outcome {
            Outcome::Completed { .. } => c.completed += 1,
            Outcome::Cancelled => c.cancelled += 1,
            Outcome::Failed { code, message } => {
                c.failed += 1;
                *c.failed_by_code.entry(code.clone()).or_default() += 1;
                c.failed_samples
                    .entry(code.clone())
                    .or_insert_with(|| message.clone());
            }
        }
    }
    let measured: Vec<&RequestRecord> = records.iter().filter(|r| !r.warmup).collect();
    let mut s = Summary::default();
    let mut h_ttft = LatencyHistogram::default();
    let mut h_tpot = LatencyHistogram::default();
    let mut h_itl_t = LatencyHistogram::default();
    let mut h_itl_e = LatencyHistogram::default();
    let mut h_e2e = LatencyHistogram::default();
    let (mut start, mut end) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut tokens, mut events, mut good, mut completed) = (0u64, 0u64, 0u64, 0u64);
    let (mut prompt_sum, mut prompt_n) = (0u64, 0u64);
    let (mut drafted, mut accepted, mut steps, mut spec_n) = (0u64, 0u64, 0u64, 0u64);
    for r in &measured {
        start = start.min(r.sent_s);
        end = end.max(r.sent_s + r.e2e_ms / 1000.0);
        if !r.completed() {
            continue;
        }
        completed += 1;
        tokens += r.tokens();
        events += r.events.len() as u64;
        good += u64::from(slo.good(r));
        if let Some(p) = r.usage_prompt_tokens {
            prompt_sum += p;
            prompt_n += 1;
        }
        if let Some(t) = r.ttft_ms() {
            h_ttft.record_ms(t);
        }
        if let Some(t) = r.tpot_ms() {
            h_tpot.record_ms(t);
        }
        h_e2e.record_ms(r.e2e_ms);
        for w in r.events.windows(2) {
            h_itl_e.record_ms(w[1].0 - w[0].0);
        }
        for itl in r.itl_per_token() {
            h_itl_t.record_ms(itl);
        }
        if let Some(sp) = r.spec {
            spec_n += 1;
            drafted += sp.drafted;
            accepted += sp.accepted;
            steps += sp.steps;
        }
    }
    if start.is_finite() && end > start {
        s.window_s = end - start;
        s.request_throughput = completed as f64 / s.window_s;
        s.output_token_throughput = tokens as f64 / s.window_s;
        s.goodput = good as f64 / s.window_s;
    }
    s.good_fraction = if measured.is_empty() {
        0.0
    } else {
        good as f64 / measured.len() as f64
    };
    s.ttft_ms = h_ttft.stats();
    s.tpot_ms = h_tpot.stats();
    s.itl_token_ms = h_itl_t.stats();
    s.itl_event_ms = h_itl_e.stats();
    s.e2e_ms = h_e2e.stats();
    s.mean_prompt_tokens = if prompt_n > 0 {
        prompt_sum as f64 / prompt_n as f64
    } else {
        0.0
    };
    s.mean_output_tokens = if completed > 0 {
        tokens as f64 / completed as f64
    } else {
        0.0
    };
    if spec_n > 0 {
        s.acceptance_rate = (drafted > 0).then(|| accepted as f64 / drafted as f64);
        s.mean_accepted = (steps > 0).then(|| accepted as f64 / steps as f64);
    }
    s.tokens_per_event = if events > 0 {
        tokens as f64 / events as f64
    } else {
        0.0
    };
    (c, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(events: Vec<(f64, u32)>, e2e: f64, usage: Option<u64>) -> RequestRecord {
        RequestRecord {
            index: 0,
            prompt: 0,
            sent_s: 0.0,
            warmup: false,
            max_tokens: 16,
            outcome: Outcome::Completed {
                finish_reason: "length".into(),
            },
            output_tokens: events.iter().map(|e| u64::from(e.1)).sum(),
            events,
            e2e_ms: e2e,
            usage_prompt_tokens: Some(5),
            usage_completion_tokens: usage,
            spec: None,
        }
    }

    #[test]
    fn tpot_follows_vllm_and_itl_divides_an_events_gap_over_its_tokens() {
        // First token at 100 ms, then an event of 3 tokens at 160 ms and one of 1 at 180 ms.
        let r = rec(vec![(100.0, 1), (160.0, 3), (180.0, 1)], 190.0, Some(5));
        assert_eq!(r.ttft_ms(), Some(100.0));
        assert_eq!(r.tpot_ms(), Some((190.0 - 100.0) / 4.0));
        let (c, s) = summarize(std::slice::from_ref(&r), &Slo::default(), 0);
        assert_eq!((c.sent, c.completed), (1, 1));
        // Per token: 20, 20, 20 (the 60 ms gap over 3 tokens) and 20: four values.
        assert_eq!(s.itl_token_ms.count, 4);
        assert!(
            (s.itl_token_ms.mean - 20.0).abs() < 0.05,
            "{:?}",
            s.itl_token_ms
        );
        // Per event: 60 and 20.
        assert_eq!(s.itl_event_ms.count, 2);
        assert!((s.itl_event_ms.max - 60.0).abs() < 0.1);
        assert!((s.tokens_per_event - 5.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let fast = rec(vec![(50.0, 1), (60.0, 1)], 70.0, Some(3));
        let slow_first = rec(vec![(3000.0, 1), (3010.0, 1)], 3020.0, Some(3));
        let slow_tokens = rec(vec![(50.0, 1), (400.0, 1)], 750.0, Some(3));
        let mut failed = fast.clone();
        failed.outcome = Outcome::Failed {
            code: "overloaded".into(),
            message: String::new(),
        };
        let slo = Slo::parse("ttft=2s,tpot=100ms").unwrap();
        assert_eq!(slo.ttft_ms, Some(2000.0));
        assert_eq!(slo.tpot_ms, Some(100.0));
        assert!(slo.good(&fast));
        assert!(!slo.good(&slow_first));
        assert!(!slo.good(&slow_tokens));
        assert!(!slo.good(&failed));
        let all = [fast, slow_first, slow_tokens, failed];
        let (c, s) = summarize(&all, &slo, 0);
        assert_eq!((c.sent, c.completed, c.failed), (4, 3, 1));
        assert_eq!(c.failed_by_code.get("overloaded"), Some(&1));
        assert!((s.good_fraction - 0.25).abs() < 1e-9);
        assert!(Slo::parse("ttft=2x").is_err());
        assert!(Slo::parse("latency=2s").is_err());
        assert!(Slo::parse("tpot=-1ms").is_err());
    }

    #[test]
    fn warmup_requests_are_counted_but_not_measured() {
        let mut w = rec(vec![(5000.0, 1)], 5000.0, Some(1));
        w.warmup = true;
        let m = rec(vec![(10.0, 1)], 10.0, Some(1));
        let (c, s) = summarize(&[w, m], &Slo::default(), 0);
        assert_eq!((c.sent, c.warmup, c.completed), (2, 1, 2));
        assert_eq!(s.ttft_ms.count, 1);
        assert!(s.ttft_ms.max < 11.0);
    }
}
