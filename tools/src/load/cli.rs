//! The `arbor load` command line: one run, `sweep` over rates, `compare` two results files, and `bench load-tool` (the generator's own ceiling against the instant server).

use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::Value;

use super::prompts::PromptSource;
use super::run::{Arrivals, LoadOptions, DEFAULT_MAX_LINE_BYTES, DEFAULT_PER_CONNECTION};
use super::target::PenaltyFields;
use super::{plot, report, resolve_slo, sweep_into, ResultsFile, RunResult, SloSpec, SweepResult};

/// `arbor load [OPTIONS]` or `arbor load sweep|compare ...`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct LoadCommand {
    #[command(subcommand)]
    pub cmd: Option<LoadSubcommand>,
    #[command(flatten)]
    pub args: LoadArgs,
}

#[derive(Subcommand)]
pub enum LoadSubcommand {
    /// Open-loop runs at several request rates, one after another, with one SLO.
    Sweep {
        /// Request rates in req/s (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        rates: Vec<f64>,
        /// Seconds to pause between rates.
        #[arg(long, default_value_t = 2.0)]
        cooldown: f64,
        #[command(flatten)]
        args: Box<LoadArgs>,
    },
    /// Charts of several results files together: latency CDFs of runs, throughput and goodput
    /// by rate of sweeps (each file's label names its line).
    Plot {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Folder for the PNGs.
        #[arg(long, default_value = "plots")]
        dir: PathBuf,
        /// The rate whose latency CDFs a sweep contributes (default: its lowest).
        #[arg(long)]
        rate: Option<f64>,
    },
    /// Two results files side by side (two runs or two sweeps), with B/A ratios.
    Compare {
        a: PathBuf,
        b: PathBuf,
        /// Re-score both under this SLO (e.g. ttft=2s,tpot=80ms) so their goodput compares.
        #[arg(long)]
        slo: Option<String>,
        /// Also write the two runs' latency CDFs (or the sweeps' charts) as PNGs here.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
}

/// The options of a run.
#[derive(Args, Clone)]
pub struct LoadArgs {
    /// arbor://HOST:PORT (`arbor serve`) or openai://HOST:PORT, alias http://HOST:PORT (e.g.
    /// llama.cpp's llama-server; a trailing /v1 is ignored). IPv6 in brackets: [::1]:7070.
    #[arg(long, default_value = "arbor://127.0.0.1:7070")]
    pub target: String,
    /// Open loop: mean arrivals per second.
    #[arg(long, conflicts_with = "concurrency")]
    pub rate: Option<f64>,
    /// Gamma shape of the gaps between arrivals: 1 = Poisson, below 1 burstier, above 1 more even.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Closed loop: this many clients, each sending its next request when the last ends.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Requests to send (default 100 when --duration is not given).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Seconds to send for.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Requests sent during the first S seconds are accounted for but not measured.
    #[arg(long, default_value_t = 0.0)]
    pub warmup: f64,
    /// Seconds in-flight requests may run after sending stops; then they are cancelled.
    #[arg(long, default_value_t = 120.0)]
    pub drain: f64,
    /// Seed of the arrival times and of the prompt and length choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prompt set: code, chat, summarize (long context), or a .jsonl file of
    /// {"prompt"|"messages", "max_tokens"} lines.
    #[arg(long, default_value = "code")]
    pub prompts: String,
    /// Pad every prompt with context to about this many tokens (summarize: document length).
    #[arg(long)]
    pub input_len: Option<usize>,
    /// Output tokens per request (a file's max_tokens wins).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Draw output lengths uniformly from max_tokens x [1 - R, 1 + R].
    #[arg(long, default_value_t = 0.0)]
    pub output_range: f64,
    /// Generate exactly max_tokens tokens (end-of-generation tokens do not stop a request).
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Top-k of every sampled request (sent only with a temperature above 0).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Top-p of every sampled request (sent only with a temperature above 0).
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Min-p of every sampled request (sent only with a temperature above 0).
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Repetition penalty of every request (`repetition_penalty`; 1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f64>,
    /// Frequency penalty of every request (`frequency_penalty`, -2 to 2).
    #[arg(long, allow_negative_numbers = true)]
    pub frequency_penalty: Option<f64>,
    /// Presence penalty of every request (`presence_penalty`, -2 to 2).
    #[arg(long, allow_negative_numbers = true)]
    pub presence_penalty: Option<f64>,
    /// Arbor's per-request `speculation` object, as JSON (e.g. '{"draft":"ngram","adaptive":false}').
    #[arg(long, conflicts_with = "no_speculation")]
    pub speculation: Option<String>,
    /// More fields for every request body, as a JSON object (e.g. '{"stop_token_ids": [2],
    /// "prompt_logprobs": 1}'); fields the tester sets from its own options are refused.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Send `"speculation": {"draft": "none"}` (plain decoding on an Arbor server).
    #[arg(long)]
    pub no_speculation: bool,
    /// Goodput SLOs: ttft=2s,tpot=150ms,e2e=10s, or auto (TTFT 2 s, TPOT twice the
    /// single-stream TPOT of plain decoding, measured first).
    #[arg(long)]
    pub slo: Option<String>,
    /// Token for `arbor serve --auth-token` (or ARBOR_AUTH_TOKEN), or an OpenAI bearer token.
    #[arg(long, env = "ARBOR_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// The `model` field sent to OpenAI targets.
    #[arg(long)]
    pub model: Option<String>,
    /// A name for this run in reports and plots.
    #[arg(long)]
    pub label: Option<String>,
    /// Write the results (every request's timings included) as JSON.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write PNG charts here (latency CDFs; a sweep adds throughput and goodput by rate).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Arbor targets: most requests in flight on one connection (keep it at or below the
    /// server's --max-requests-per-connection, 64).
    #[arg(long, default_value_t = DEFAULT_PER_CONNECTION)]
    pub per_connection: usize,
    /// Arbor targets: a request line longer than this is not sent but counted as failed
    /// (line_too_long); match the server's --max-line-bytes.
    #[arg(long, default_value_t = DEFAULT_MAX_LINE_BYTES)]
    pub max_line_bytes: usize,
}

impl LoadArgs {
    /// Checked options for the driver.
    pub fn options(&self) -> Result<LoadOptions> {
        let mut o = LoadOptions::new(&self.target);
        super::target::Target::parse(&self.target)?;
        o.arrivals = match (self.concurrency, self.rate) {
            (Some(c), _) => Arrivals::Closed { concurrency: c },
            (None, r) => Arrivals::Open {
                rate: r.unwrap_or(1.0),
                burstiness: self.burstiness,
            },
        };
        o.requests = match (self.requests, self.duration) {
            (None, None) => Some(100),
            (r, _) => r,
        };
        o.duration_s = self.duration;
        o.warmup_s = self.warmup;
        o.drain_s = self.drain;
        o.seed = self.seed;
        o.prompts = PromptSource::parse(&self.prompts)?;
        o.input_len = self.input_len;
        o.max_tokens = self.max_tokens;
        o.output_range = self.output_range;
        o.ignore_eos = self.ignore_eos;
        o.temperature = self.temperature;
        o.top_k = self.top_k;
        o.top_p = self.top_p;
        o.min_p = self.min_p;
        o.penalties = PenaltyFields {
            repetition: self.repetition_penalty,
            frequency: self.frequency_penalty,
            presence: self.presence_penalty,
        };
        o.speculation = match (&self.speculation, self.no_speculation) {
            (Some(s), _) => {
                let v: Value = serde_json::from_str(s).context("--speculation is not JSON")?;
                if !v.is_object() {
                    bail!("--speculation must be a JSON object");
                }
                Some(v)
            }
            (None, true) => Some(serde_json::json!({ "draft": "none" })),
            (None, false) => None,
        };
        o.extra_body = match &self.extra_body {
            Some(s) => match serde_json::from_str(s).context("--extra-body is not JSON")? {
                Value::Object(m) => Some(m),
                _ => bail!("--extra-body must be a JSON object"),
            },
            None => None,
        };
        o.auth_token = self.auth_token.clone();
        o.model = self.model.clone();
        o.label = self.label.clone();
        o.progress = !self.quiet;
        o.per_connection = self.per_connection;
        o.max_line_bytes = self.max_line_bytes;
        Ok(o)
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// `arbor load ...`
pub fn main(cmd: LoadCommand) -> Result<()> {
    match cmd.cmd {
        None => one_run(&cmd.args),
        Some(LoadSubcommand::Sweep {
            rates,
            cooldown,
            args,
        }) => one_sweep(&args, &rates, cooldown),
        Some(LoadSubcommand::Plot { files, dir, rate }) => {
            let read: Vec<ResultsFile> = files
                .iter()
                .map(|f| ResultsFile::read(f))
                .collect::<Result<_, _>>()?;
            let mut runs = Vec::new();
            let mut sweeps = Vec::new();
            for f in &read {
                match f {
                    ResultsFile::Run(r) => runs.push((r.label(), r.as_ref())),
                    ResultsFile::Sweep(s) => {
                        sweeps.push((s.label(), s));
                        if let Some((x, r)) = s.run_at(rate) {
                            runs.push((format!("{} @ {x} req/s", s.label()), r));
                        }
                    }
                }
            }
            let mut written = Vec::new();
            if !runs.is_empty() {
                let v: Vec<(&str, &super::RunResult)> =
                    runs.iter().map(|(l, r)| (l.as_str(), *r)).collect();
                written.extend(plot::cdfs(&v, &dir)?);
            }
            if !sweeps.is_empty() {
                let v: Vec<(&str, &super::SweepResult)> =
                    sweeps.iter().map(|(l, s)| (l.as_str(), *s)).collect();
                written.extend(plot::sweeps(&v, &dir)?);
            }
            let list: String = written
                .iter()
                .map(|f| format!("{}\n", f.display()))
                .collect();
            print_out(&list)
        }
        Some(LoadSubcommand::Compare { a, b, slo, plot }) => {
            let mut fa = ResultsFile::read(&a)?;
            let mut fb = ResultsFile::read(&b)?;
            if let Some(s) = slo {
                let slo = Some(super::Slo::parse(&s)?);
                for f in [&mut fa, &mut fb] {
                    match f {
                        ResultsFile::Run(r) => r.resummarize(slo),
                        ResultsFile::Sweep(s) => {
                            s.slo = slo;
                            s.runs.iter_mut().for_each(|r| r.resummarize(slo));
                        }
                    }
                }
            }
            print_out(&report::compare(&fa, &fb)?)?;
            if let Some(dir) = plot {
                let files = match (&fa, &fb) {
                    (ResultsFile::Run(x), ResultsFile::Run(y)) => {
                        let (lx, ly) = (x.label(), y.label());
                        plot::cdfs(&[(lx.as_str(), x), (ly.as_str(), y)], &dir)?
                    }
                    (ResultsFile::Sweep(x), ResultsFile::Sweep(y)) => {
                        let (lx, ly) = (x.label(), y.label());
                        plot::sweeps(&[(lx.as_str(), x), (ly.as_str(), y)], &dir)?
                    }
                    _ => Vec::new(),
                };
                for f in files {
                    eprintln!("wrote {}", f.display());
                }
            }
            Ok(())
        }
    }
}

/// Print `text` on stdout. A reader that went away (`arbor load compare a b | head`) is not an
/// error: the output ends quietly and the command goes on (results files are still written).
fn print_out(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

/// Draw plots; a failure is a warning naming the folder (the results are already written).
fn plots(dir: &Path, draw: impl FnOnce() -> Result<Vec<PathBuf>, super::LoadError>) {
    match draw() {
        Ok(files) => {
            for f in files {
                eprintln!("wrote {}", f.display());
            }
        }
        Err(e) => eprintln!("warning: plots in {} not drawn: {e}", dir.display()),
    }
}

fn one_run(args: &LoadArgs) -> Result<()> {
    let opts = args.options()?;
    let spec = SloSpec::parse(args.slo.as_deref())?;
    // Before `--slo auto` sends its calibration requests.
    opts.check()?;
    let rt = runtime()?;
    let result = rt.block_on(async {
        super::interrupt::watch();
        let slo = resolve_slo(&spec, &opts).await?;
        if super::interrupt::presses() > 0 {
            return Err(super::LoadError::Invalid(
                "interrupted during the SLO calibration".into(),
            ));
        }
        if let (SloSpec::Auto, Some(s)) = (&spec, &slo) {
            eprintln!("slo auto: {}", s.describe());
        }
        super::run(&opts, slo).await
    })?;
    let printed = print_out(&report::summary(&result));
    // The results before anything that may fail: nothing may lose the run.
    if let Some(out) = &args.out {
        super::write_json(&result, out)?;
        eprintln!("wrote {}", out.display());
    }
    if let Some(dir) = &args.plot {
        let l = result.label();
        plots(dir, || plot::cdfs(&[(l.as_str(), &result)], dir));
    }
    printed?;
    result.check_completed()?;
    Ok(())
}

fn one_sweep(args: &LoadArgs, rates: &[f64], cooldown: f64) -> Result<()> {
    if args.concurrency.is_some() || args.rate.is_some() {
        bail!("sweep takes --rates, not --rate or --concurrency");
    }
    let opts = args.options()?;
    let spec = SloSpec::parse(args.slo.as_deref())?;
    // Before `--slo auto` sends its calibration requests.
    super::sweep_plan(&opts, rates, cooldown)?;
    let rt = runtime()?;
    let mut runs: Vec<RunResult> = Vec::new();
    let mut slo = None;
    let ended = rt.block_on(async {
        super::interrupt::watch();
        slo = resolve_slo(&spec, &opts).await?;
        if super::interrupt::presses() > 0 {
            return Err(super::LoadError::Invalid(
                "interrupted during the SLO calibration".into(),
            ));
        }
        if let (SloSpec::Auto, Some(s)) = (&spec, &slo) {
            eprintln!("slo auto: {}", s.describe());
        }
        sweep_into(&opts, rates, slo, cooldown, &mut runs, |r| {
            eprintln!(
                "rate {:?}: completed {}/{}, {:.1} tok/s, goodput {:.3} req/s",
                r.options.arrivals,
                r.counts.completed,
                r.counts.sent,
                r.summary.output_token_throughput,
                r.summary.goodput
            );
        })
        .await
    });
    let result = SweepResult::new(&opts, slo, runs);
    if let Err(e) = ended {
        // Keep the rates that ran: write them before reporting the error.
        if let (Some(out), false) = (&args.out, result.runs.is_empty()) {
            super::write_json(&result, out)?;
            eprintln!(
                "wrote {} (the rates that ran before the error)",
                out.display()
            );
        }
        return Err(e.into());
    }
    let printed = print_out(&report::sweep_table(&result));
    if let Some(out) = &args.out {
        super::write_json(&result, out)?;
        eprintln!("wrote {}", out.display());
    }
    if let Some(dir) = &args.plot {
        plots(dir, || {
            let l = result.label();
            let mut files = plot::sweeps(&[(l.as_str(), &result)], dir)?;
            let labels: Vec<String> = result
                .runs
                .iter()
                .map(|r| r.rate().map_or_else(String::new, |x| format!("{x} req/s")))
                .collect();
            let runs: Vec<(&str, &RunResult)> = labels
                .iter()
                .map(String::as_str)
                .zip(result.runs.iter())
                .collect();
            files.extend(plot::cdfs(&runs, dir)?);
            Ok(files)
        });
    }
    printed?;
    result.check_completed()?;
    Ok(())
}

/// `arbor bench load-tool`: the generator against the instant server (no model), closed loop.
pub fn bench_load_tool(concurrency: &[usize], requests: usize, tokens: usize) -> Result<()> {
    let server = super::instant::InstantServer::start(1)?;
    let rt = runtime()?;
    println!("# arbor load against the instant server (loopback, {tokens} tokens per request, one token per event)");
    println!("| concurrency | requests | completed | req/s | token events/s | TTFT p50 ms | ITL p99 ms |");
    println!("|--:|--:|--:|--:|--:|--:|--:|");
    for &c in concurrency {
        let mut o = LoadOptions::new(&format!("arbor://{}", server.addr));
        o.arrivals = Arrivals::Closed { concurrency: c };
        o.requests = Some(requests);
        o.max_tokens = tokens;
        let r = rt.block_on(super::run(&o, None))?;
        println!(
            "| {c} | {} | {} | {:.0} | {:.0} | {:.3} | {:.3} |",
            r.counts.sent,
            r.counts.completed,
            r.summary.request_throughput,
            r.summary.output_token_throughput,
            r.summary.ttft_ms.p50,
            r.summary.itl_token_ms.p99
        );
    }
    Ok(())
}
