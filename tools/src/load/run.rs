//! The load driver: open loop (seeded gamma arrivals at `--rate`) or closed loop (`--concurrency` clients), bounded by requests and/or duration, with warm-up, a drain period, a live progress bar and complete request accounting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::{Id as TaskId, JoinError, JoinSet};

use super::metrics::{summarize, Counts, RequestRecord, Slo, Summary};
use super::prompts::{self, LoadPrompt, PromptSource};
use super::schedule::{choice_rng, uniform, ArrivalSchedule};
use super::target::{AbortOnDrop, Client, ClientLimits, Outgoing, PenaltyFields, Target};
use super::LoadError;

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Arrivals {
    /// Open loop: `rate` requests per second with gamma gaps of shape `burstiness`.
    Open { rate: f64, burstiness: f64 },
    /// Closed loop: `concurrency` clients, each sending its next request when the last ends.
    Closed { concurrency: usize },
}

/// Everything that defines a run (echoed into the results file).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoadOptions {
    pub target: String,
    pub arrivals: Arrivals,
    pub requests: Option<usize>,
    pub duration_s: Option<f64>,
    pub warmup_s: f64,
    /// After sending stops, how long in-flight requests may run before they are cancelled.
    pub drain_s: f64,
    pub seed: u64,
    pub prompts: PromptSource,
    pub input_len: Option<usize>,
    pub max_tokens: usize,
    /// Output lengths drawn uniformly from max_tokens × [1 - r, 1 + r].
    pub output_range: f64,
    pub ignore_eos: bool,
    pub temperature: f64,
    /// Top-k and top-p of sampled requests (not sent when `None`).
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    /// Repetition, frequency and presence penalties of every request.
    #[serde(default)]
    pub penalties: PenaltyFields,
    /// Arbor's per-request `speculation` object.
    pub speculation: Option<Value>,
    /// More fields of every request body (`--extra-body`, e.g. `{"stop_token_ids": [2]}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_body: Option<serde_json::Map<String, Value>>,
    #[serde(skip)]
    pub auth_token: Option<String>,
    /// The `model` field for OpenAI targets.
    pub model: Option<String>,
    /// Draw the progress bar (it is hidden anyway when stderr is not a terminal).
    #[serde(skip)]
    pub progress: bool,
    /// A label for reports (`compare`, plots).
    pub label: Option<String>,
    /// Arbor targets: most requests in flight on one connection (below the server's
    /// `--max-requests-per-connection`, 64).
    #[serde(default = "default_per_connection")]
    pub per_connection: usize,
    /// Arbor targets: a request whose line is longer than this many bytes is not sent but
    /// counted as failed (`line_too_long`), as the server would refuse it (`--max-line-bytes`).
    #[serde(default = "default_max_line_bytes")]
    pub max_line_bytes: usize,
}

/// `--per-connection`'s default.
pub const DEFAULT_PER_CONNECTION: usize = 48;
/// `--max-line-bytes`'s default: `arbor serve`'s (1 MiB).
pub const DEFAULT_MAX_LINE_BYTES: usize = 1 << 20;
/// The longest `--duration`, `--warmup`, `--drain` and `sweep --cooldown`, in seconds (30 days).
pub const MAX_SECONDS: f64 = 30.0 * 86_400.0;
/// The lowest `--rate` (one request per 11.6 days on average).
pub const MIN_RATE: f64 = 1e-6;
/// The most `--requests` (the plan holds one entry per request).
pub const MAX_REQUESTS: usize = 10_000_000;
/// The largest `--input-len` (every prompt is padded to it in memory).
pub const MAX_INPUT_LEN: usize = 1_000_000;

fn default_per_connection() -> usize {
    DEFAULT_PER_CONNECTION
}

fn default_max_line_bytes() -> usize {
    DEFAULT_MAX_LINE_BYTES
}

/// A number of seconds for `flag`: finite, not negative (positive when `positive`), at most
/// `MAX_SECONDS`.
pub(super) fn check_seconds(flag: &str, x: f64, positive: bool) -> Result<(), LoadError> {
    let low_ok = if positive { x > 0.0 } else { x >= 0.0 };
    if x.is_finite() && low_ok && x <= MAX_SECONDS {
        return Ok(());
    }
    let what = if positive { "positive" } else { "non-negative" };
    Err(LoadError::Invalid(format!(
        "{flag} must be a {what} number of seconds up to {MAX_SECONDS} (30 days), got {x}"
    )))
}

/// An open-loop request rate for `flag`: finite and at least `MIN_RATE`.
pub(super) fn check_rate(flag: &str, rate: f64) -> Result<(), LoadError> {
    if rate.is_finite() && rate >= MIN_RATE {
        return Ok(());
    }
    Err(LoadError::Invalid(format!(
        "{flag} must be a number of requests per second of at least {MIN_RATE}, got {rate}"
    )))
}

impl LoadOptions {
    /// Defaults: open loop at 1 req/s, code prompts, 128 tokens, 100 requests.
    pub fn new(target: &str) -> LoadOptions {
        LoadOptions {
            target: target.into(),
            arrivals: Arrivals::Open {
                rate: 1.0,
                burstiness: 1.0,
            },
            requests: Some(100),
            duration_s: None,
            warmup_s: 0.0,
            drain_s: 60.0,
            seed: 0,
            prompts: PromptSource::Code,
            input_len: None,
            max_tokens: 128,
            output_range: 0.0,
            ignore_eos: false,
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            penalties: PenaltyFields::default(),
            speculation: None,
            extra_body: None,
            auth_token: None,
            model: None,
            progress: false,
            label: None,
            per_connection: DEFAULT_PER_CONNECTION,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
        }
    }

    /// Every option in range (`run` calls it; a sweep calls it for each rate before the first).
    pub fn check(&self) -> Result<(), LoadError> {
        if self.requests.is_none() && self.duration_s.is_none() {
            return Err(LoadError::Invalid(
                "bound the run with --requests N and/or --duration S".into(),
            ));
        }
        if let Some(n) = self.requests {
            if !(1..=MAX_REQUESTS).contains(&n) {
                return Err(LoadError::Invalid(format!(
                    "--requests must be from 1 to {MAX_REQUESTS}, got {n}"
                )));
            }
        }
        if let Some(d) = self.duration_s {
            check_seconds("--duration", d, true)?;
        }
        check_seconds("--warmup", self.warmup_s, false)?;
        check_seconds("--drain", self.drain_s, false)?;
        match self.arrivals {
            Arrivals::Closed { concurrency: 0 } => {
                return Err(LoadError::Invalid(
                    "--concurrency must be at least 1".into(),
                ));
            }
            Arrivals::Closed { .. } => {}
            Arrivals::Open { rate, burstiness } => {
                check_rate("--rate", rate)?;
                if !(burstiness.is_finite() && burstiness > 0.0) {
                    return Err(LoadError::Invalid(format!(
                        "--burstiness must be a positive number, got {burstiness}"
                    )));
                }
            }
        }
        if self.input_len.is_some_and(|n| n > MAX_INPUT_LEN) {
            return Err(LoadError::Invalid(format!(
                "--input-len must be at most {MAX_INPUT_LEN}"
            )));
        }
        if self.per_connection == 0 {
            return Err(LoadError::Invalid(
                "--per-connection must be at least 1".into(),
            ));
        }
        if self.max_line_bytes == 0 {
            return Err(LoadError::Invalid(
                "--max-line-bytes must be at least 1".into(),
            ));
        }
        if self.max_tokens == 0 {
            return Err(LoadError::Invalid("--max-tokens must be at least 1".into()));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(LoadError::Invalid(format!(
                "--temperature must be a number from 0, got {}",
                self.temperature
            )));
        }
        if self.top_k.is_some_and(|k| k > u32::MAX as usize) {
            return Err(LoadError::Invalid(format!(
                "--top-k must be at most {}",
                u32::MAX
            )));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(LoadError::Invalid(format!(
                    "--top-p must be in (0, 1], got {p}"
                )));
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(LoadError::Invalid(format!(
                    "--min-p must be in [0, 1], got {p}"
                )));
            }
        }
        // The server's own ranges (`repetition_penalty` for --repetition-penalty, ...).
        let p = &self.penalties;
        arbor_engine::Penalties {
            repetition: p.repetition.unwrap_or(1.0) as f32,
            frequency: p.frequency.unwrap_or(0.0) as f32,
            presence: p.presence.unwrap_or(0.0) as f32,
        }
        .validate()
        .map_err(|e| LoadError::Invalid(e.to_string()))?;
        if let Some(extra) = &self.extra_body {
            check_extra_body(extra)?;
        }
        if !(0.0..1.0).contains(&self.output_range) {
            return Err(LoadError::Invalid(
                "--output-range must be in [0, 1)".into(),
            ));
        }
        Ok(())
    }
}

/// Request fields `--extra-body` may not set: the tester sends them itself (from its own
/// options, or per request), and `n` / `best_of` would make one request several completions,
/// which its per-completion latency and token counts do not describe.
const RESERVED_BODY_FIELDS: [(&str, &str); 27] = [
    ("id", "the tester numbers its requests"),
    ("prompt", "use --prompts"),
    ("messages", "use --prompts"),
    ("max_tokens", "use --max-tokens"),
    ("stream", "the tester streams every request"),
    ("stream_options", "the tester streams every request"),
    ("model", "use --model"),
    ("seed", "use --seed (request i gets seed + i)"),
    ("temperature", "use --temperature"),
    ("top_k", "use --top-k"),
    ("top_p", "use --top-p"),
    ("min_p", "use --min-p"),
    ("ignore_eos", "use --ignore-eos"),
    ("repetition_penalty", "use --repetition-penalty"),
    ("repeat_penalty", "use --repetition-penalty"),
    ("frequency_penalty", "use --frequency-penalty"),
    ("presence_penalty", "use --presence-penalty"),
    ("speculation", "use --speculation"),
    ("n", ONE_COMPLETION),
    ("best_of", ONE_COMPLETION),
    ("use_beam_search", ONE_COMPLETION),
    ("max_completion_tokens", "use --max-tokens"),
    ("echo", "the prompt's text would count as output"),
    // Arbor's control lines: a request carrying one of these is not a request.
    ("auth", "use --auth-token"),
    ("stats", "it makes each line a control line"),
    ("health", "it makes each line a control line"),
    ("cancel", "it makes each line a control line"),
];
const ONE_COMPLETION: &str =
    "one request must be one completion for its latencies and token counts";

fn check_extra_body(extra: &serde_json::Map<String, Value>) -> Result<(), LoadError> {
    for key in extra.keys() {
        let reserved = RESERVED_BODY_FIELDS.iter().find(|(k, _)| k == key);
        if let Some((_, why)) = reserved {
            return Err(LoadError::Invalid(format!(
                "--extra-body may not set \"{key}\": {why}"
            )));
        }
    }
    Ok(())
}

/// One run's results (what `--out` writes and `compare` reads).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    pub tool: String,
    pub options: LoadOptions,
    pub slo: Option<Slo>,
    pub counts: Counts,
    pub summary: Summary,
    pub requests: Vec<RequestRecord>,
    /// Requests the driver started, counted as it starts them (independently of the records:
    /// `counts.sent` must equal it).
    #[serde(default)]
    pub spawned: u64,
}

impl RunResult {
    pub fn label(&self) -> String {
        self.options
            .label
            .clone()
            .unwrap_or_else(|| match self.options.arrivals {
                Arrivals::Open { rate, .. } => format!("{} @ {rate} req/s", self.options.target),
                Arrivals::Closed { concurrency } => {
                    format!("{} x{concurrency}", self.options.target)
                }
            })
    }

    /// An error naming the failure codes, with a sample message each, when no request
    /// completed.
    pub fn check_completed(&self) -> Result<(), LoadError> {
        if self.counts.completed > 0 {
            return Ok(());
        }
        Err(super::none_completed(&self.counts))
    }

    /// The open-loop request rate (None for a closed loop).
    pub fn rate(&self) -> Option<f64> {
        match self.options.arrivals {
            Arrivals::Open { rate, .. } => Some(rate),
            Arrivals::Closed { .. } => None,
        }
    }

    /// Re-derive counts and figures under other SLOs (e.g. to compare runs under one SLO).
    pub fn resummarize(&mut self, slo: Option<Slo>) {
        let (mut c, s) = summarize(
            &self.requests,
            &slo.unwrap_or_default(),
            self.counts.stray_lines,
        );
        c.stray_errors_by_code = std::mem::take(&mut self.counts.stray_errors_by_code);
        self.counts = c;
        self.summary = s;
        self.slo = slo;
    }
}

/// Every request's prompt and length, the same for every run with the same seed; a request's
/// text is built only when it is sent (a duration-bound plan can hold a million entries).
struct Plan {
    prompts: Vec<LoadPrompt>,
    /// (prompt index, max_tokens) per request index.
    picks: Vec<(usize, usize)>,
    ignore_eos: bool,
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    min_p: Option<f64>,
    penalties: PenaltyFields,
    seed: u64,
    speculation: Option<Value>,
    extra_body: Option<Arc<serde_json::Map<String, Value>>>,
}

impl Plan {
    fn new(opts: &LoadOptions, prompts: Vec<LoadPrompt>, n: usize) -> Plan {
        let mut rng = choice_rng(opts.seed);
        let picks = (0..n)
            .map(|_| {
                let p = prompts::pick(&mut rng, prompts.len());
                let base = prompts[p].max_tokens.unwrap_or(opts.max_tokens);
                let lo = ((base as f64) * (1.0 - opts.output_range)).round().max(1.0) as usize;
                let hi = ((base as f64) * (1.0 + opts.output_range)).round() as usize;
                (p, uniform(&mut rng, lo, hi.max(lo)))
            })
            .collect();
        Plan {
            prompts,
            picks,
            ignore_eos: opts.ignore_eos,
            temperature: opts.temperature,
            top_k: opts.top_k,
            top_p: opts.top_p,
            min_p: opts.min_p,
            penalties: opts.penalties,
            seed: opts.seed,
            speculation: opts.speculation.clone(),
            extra_body: opts.extra_body.clone().map(Arc::new),
        }
    }

    /// Request `i`: its prompt index and what is sent.
    fn request(&self, i: usize) -> (usize, Outgoing) {
        let (p, max_tokens) = self.picks[i];
        let req = Outgoing {
            input: self.prompts[p].input.clone(),
            max_tokens,
            ignore_eos: self.ignore_eos,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            penalties: self.penalties,
            seed: self.seed.wrapping_add(i as u64),
            speculation: self.speculation.clone(),
            extra_body: self.extra_body.clone(),
        };
        (p, req)
    }
}

#[derive(Default)]
struct Live {
    done: AtomicUsize,
    failed: AtomicUsize,
    in_flight: AtomicUsize,
    tokens: AtomicU64,
}

/// What the driver knows of a request it started, to account for it if its task panics.
#[derive(Clone, Copy, Debug)]
struct Started {
    index: usize,
    prompt: usize,
    max_tokens: usize,
    at: Instant,
}

/// The record a finished request task returned, or for a task that panicked, a failed record
/// with code `panic` built from what was known when it started.
fn joined(
    res: Result<(TaskId, RequestRecord), JoinError>,
    started: &mut HashMap<TaskId, Started>,
    start: Instant,
    warmup_s: f64,
) -> RequestRecord {
    match res {
        Ok((id, r)) => {
            started.remove(&id);
            r
        }
        Err(e) => {
            let s = started.remove(&e.id()).unwrap_or(Started {
                index: usize::MAX,
                prompt: 0,
                max_tokens: 0,
                at: start,
            });
            let why = if e.is_panic() {
                "the request's task panicked (a bug in arbor load)"
            } else {
                "the request's task was cancelled"
            };
            let reply = super::target::Reply::failed("panic", why);
            record(
                s.index,
                s.prompt,
                s.max_tokens,
                start,
                s.at,
                warmup_s,
                reply,
            )
        }
    }
}

/// Run the load against the target; Ctrl-C ends sending and cancels what is in flight.
pub async fn run(opts: &LoadOptions, slo: Option<Slo>) -> Result<RunResult, LoadError> {
    opts.check()?;
    let target = Target::parse(&opts.target)?;
    let prompts = prompts::load(&opts.prompts, opts.input_len)?;
    let client = Arc::new(Client::new(
        &target,
        opts.auth_token.clone(),
        opts.model.clone(),
        ClientLimits {
            per_connection: opts.per_connection,
            max_line_bytes: opts.max_line_bytes,
        },
    ));
    // Plan far enough ahead for any duration bound (plans are cheap; requests bound it exactly).
    let cap = opts.requests.unwrap_or(match opts.arrivals {
        Arrivals::Open { rate, .. } => {
            (rate * opts.duration_s.unwrap_or(0.0) * 3.0 + 1000.0).min(MAX_REQUESTS as f64) as usize
        }
        Arrivals::Closed { .. } => 1_000_000,
    });
    let planned = Arc::new(Plan::new(opts, prompts, cap.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let live = Arc::new(Live::default());
    let (bar, by_time) = progress_bar(opts);
    let start = Instant::now();
    // `check` bounds the duration; a deadline past the clock's range is no deadline.
    let deadline = opts
        .duration_s
        .and_then(|d| start.checked_add(Duration::try_from_secs_f64(d).ok()?));
    let warmup_s = opts.warmup_s;
    let mut tasks: JoinSet<RequestRecord> = JoinSet::new();
    let mut started: HashMap<TaskId, Started> = HashMap::new();
    let mut spawned = 0u64;
    let mut spawn =
        |tasks: &mut JoinSet<RequestRecord>, started: &mut HashMap<TaskId, Started>, i: usize| {
            let client = Arc::clone(&client);
            let planned = Arc::clone(&planned);
            let live = Arc::clone(&live);
            let stop = stop_rx.clone();
            let (prompt, max_tokens) = planned.picks[i];
            let handle = tasks.spawn(async move {
                let (p, req) = planned.request(i);
                let sent = Instant::now();
                live.in_flight.fetch_add(1, Ordering::Relaxed);
                let reply = client.send(&req, stop).await;
                live.in_flight.fetch_sub(1, Ordering::Relaxed);
                let rec = record(i, p, req.max_tokens, start, sent, warmup_s, reply);
                live.done.fetch_add(1, Ordering::Relaxed);
                if !rec.completed() {
                    live.failed.fetch_add(1, Ordering::Relaxed);
                }
                live.tokens.fetch_add(rec.tokens(), Ordering::Relaxed);
                rec
            });
            started.insert(
                handle.id(),
                Started {
                    index: i,
                    prompt,
                    max_tokens,
                    at: Instant::now(),
                },
            );
            spawned += 1;
        };
    let mut records = Vec::new();
    let ctrl_c = super::interrupt::after(super::interrupt::presses());
    tokio::pin!(ctrl_c);
    let mut interrupted = false;
    let ticker_bar = bar.clone();
    let ticker_live = Arc::clone(&live);
    let ticker = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            refresh(&ticker_bar, &ticker_live, start, by_time);
        }
    });
    let _ticker = AbortOnDrop(ticker);
    match opts.arrivals {
        Arrivals::Open { rate, burstiness } => {
            let mut schedule = ArrivalSchedule::new(rate, burstiness, opts.seed)?;
            let mut at = 0.0;
            for i in 0..cap {
                if i > 0 {
                    at = schedule.next_arrival();
                }
                // An arrival beyond the clock's range (a huge gamma gap) never comes: stop.
                let Some(when) = Duration::try_from_secs_f64(at)
                    .ok()
                    .and_then(|d| start.checked_add(d))
                else {
                    break;
                };
                if deadline.is_some_and(|d| when >= d) {
                    break;
                }
                // Collect finished requests while waiting for the next arrival.
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep_until(when.into()) => break,
                        Some(r) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                            records.push(joined(r, &mut started, start, warmup_s));
                        }
                        _ = &mut ctrl_c, if !interrupted => { interrupted = true; break; }
                    }
                }
                if interrupted {
                    break;
                }
                spawn(&mut tasks, &mut started, i);
            }
        }
        Arrivals::Closed { concurrency } => {
            let mut next = 0usize;
            let mut running = 0usize;
            let mut launch = |tasks: &mut JoinSet<RequestRecord>,
                              started: &mut HashMap<TaskId, Started>,
                              running: &mut usize|
             -> bool {
                let i = next;
                next += 1;
                if i >= cap || deadline.is_some_and(|d| Instant::now() >= d) {
                    return false;
                }
                spawn(tasks, started, i);
                *running += 1;
                true
            };
            for _ in 0..concurrency {
                if !launch(&mut tasks, &mut started, &mut running) {
                    break;
                }
            }
            let mut sending = true;
            while running > 0 && sending {
                tokio::select! {
                    Some(r) = tasks.join_next_with_id() => {
                        running -= 1;
                        records.push(joined(r, &mut started, start, warmup_s));
                        sending = launch(&mut tasks, &mut started, &mut running);
                    }
                    _ = &mut ctrl_c, if !interrupted => { interrupted = true; sending = false; }
                    // The duration ends sending (and starts the drain) even while no request
                    // finishes: a stalled server or slow requests must not hold the run.
                    _ = sleep_until_opt(deadline) => { sending = false; }
                }
            }
        }
    }
    // Drain: in-flight requests may finish for `drain_s`, then they are cancelled.
    let drain_until = Duration::try_from_secs_f64(opts.drain_s)
        .ok()
        .and_then(|d| Instant::now().checked_add(d));
    let mut stopped = interrupted;
    if stopped {
        let _ = stop_tx.send(true);
    }
    while !tasks.is_empty() {
        tokio::select! {
            Some(r) = tasks.join_next_with_id() => {
                records.push(joined(r, &mut started, start, warmup_s));
            }
            _ = sleep_until_opt(drain_until), if !stopped => {
                stopped = true;
                let _ = stop_tx.send(true);
            }
            _ = &mut ctrl_c, if !stopped => {
                stopped = true;
                let _ = stop_tx.send(true);
            }
        }
    }
    refresh(&bar, &live, start, by_time);
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);
    let (mut counts, summary) = summarize(&records, &slo.unwrap_or_default(), client.stray_lines());
    counts.stray_errors_by_code = client.stray_errors_by_code();
    Ok(RunResult {
        tool: format!("arbor load {}", env!("CARGO_PKG_VERSION")),
        options: opts.clone(),
        slo,
        counts,
        summary,
        requests: records,
        spawned,
    })
}

/// Sleep until `t`, or forever when there is no `t`.
async fn sleep_until_opt(t: Option<Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

fn record(
    index: usize,
    prompt: usize,
    max_tokens: usize,
    start: Instant,
    sent: Instant,
    warmup_s: f64,
    reply: super::target::Reply,
) -> RequestRecord {
    let ms = |t: Instant| t.saturating_duration_since(sent).as_secs_f64() * 1000.0;
    let sent_s = sent.duration_since(start).as_secs_f64();
    let events: Vec<(f64, u32)> = reply.events.iter().map(|&(t, n)| (ms(t), n)).collect();
    let output_tokens = events.iter().map(|e| u64::from(e.1)).sum();
    let end = reply
        .events
        .last()
        .map_or(reply.end, |&(t, _)| t.max(reply.end));
    RequestRecord {
        index,
        prompt,
        sent_s,
        warmup: sent_s < warmup_s,
        max_tokens,
        outcome: reply.outcome,
        events,
        e2e_ms: ms(end),
        output_tokens,
        usage_prompt_tokens: reply.usage_prompt_tokens,
        usage_completion_tokens: reply.usage_completion_tokens,
        spec: reply.spec,
    }
}

/// The live bar: by requests when only `--requests` bounds the run, else by seconds.
fn progress_bar(opts: &LoadOptions) -> (ProgressBar, bool) {
    let by_time = opts.duration_s.is_some();
    if !opts.progress {
        return (ProgressBar::hidden(), by_time);
    }
    let (len, unit) = match (by_time, opts.requests) {
        (true, _) => (opts.duration_s.unwrap_or(0.0).ceil() as u64, "s"),
        (false, n) => (n.unwrap_or(0) as u64, "req"),
    };
    let bar = ProgressBar::new(len);
    let tmpl =
        format!("{{spinner}} [{{elapsed_precise}}] {{bar:30}} {{pos}}/{{len}} {unit}  {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&tmpl) {
        bar.set_style(style);
    }
    (bar, by_time)
}

fn refresh(bar: &ProgressBar, live: &Live, start: Instant, by_time: bool) {
    if bar.is_hidden() {
        return;
    }
    let done = live.done.load(Ordering::Relaxed) as u64;
    let secs = start.elapsed().as_secs_f64();
    bar.set_position(if by_time { secs as u64 } else { done });
    bar.set_message(format!(
        "done {done}  in flight {}  not completed {}  {:.1} tok/s",
        live.in_flight.load(Ordering::Relaxed),
        live.failed.load(Ordering::Relaxed),
        live.tokens.load(Ordering::Relaxed) as f64 / secs.max(1e-3)
    ));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::metrics::Outcome;

    fn boom() -> RequestRecord {
        panic!("a bug in a request task (this panic is the test's)")
    }

    #[test]
    fn a_request_task_that_panics_is_a_failed_record_with_code_panic() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let start = Instant::now();
            let mut tasks: JoinSet<RequestRecord> = JoinSet::new();
            let mut started = HashMap::new();
            let h = tasks.spawn(async { boom() });
            let s = Started {
                index: 7,
                prompt: 2,
                max_tokens: 9,
                at: start,
            };
            started.insert(h.id(), s);
            let res = tasks.join_next_with_id().await.expect("one task");
            assert!(res.is_err());
            let r = joined(res, &mut started, start, 1.0);
            assert!(started.is_empty());
            assert_eq!((r.index, r.prompt, r.max_tokens, r.warmup), (7, 2, 9, true));
            match &r.outcome {
                Outcome::Failed { code, message } => {
                    assert_eq!(code, "panic");
                    assert!(message.contains("panicked"), "{message}");
                }
                o => panic!("{o:?}"),
            }
        });
    }
}
