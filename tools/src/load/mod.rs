//! `arbor load`: the bundled load tester (vLLM `bench serve`'s metrics: TTFT, TPOT, ITL, E2E, throughput, goodput under SLOs) for Arbor's TCP protocol and OpenAI-compatible servers, with sweeps, comparisons and plots.

pub mod cli;
pub mod instant;
pub mod interrupt;
pub mod metrics;
pub mod plot;
pub mod prompts;
pub mod report;
pub mod run;
pub mod schedule;
pub mod target;

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::json;

pub use metrics::{Outcome, RequestRecord, Slo, Summary};
pub use run::{run, Arrivals, LoadOptions, RunResult};

/// Errors of the load tester, each with a stable code.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{0}")]
    Invalid(String),
    #[error("i/o error on {path}: {message}")]
    Io { path: String, message: String },
    #[error("SLO calibration failed: {0}")]
    Calibration(String),
    /// A run (or every run of a sweep) where no request completed.
    #[error("no request completed ({0})")]
    NoneCompleted(String),
}

impl LoadError {
    pub fn error_type(&self) -> &'static str {
        match self {
            LoadError::Invalid(_) => "invalid_argument",
            LoadError::Io { .. } => "io_error",
            LoadError::Calibration(_) => "calibration_failed",
            LoadError::NoneCompleted(_) => "no_request_completed",
        }
    }
}

/// How the run's SLOs are chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum SloSpec {
    None,
    Given(Slo),
    /// TTFT 2 s and TPOT twice the single-stream TPOT measured first (plain decoding).
    Auto,
}

impl SloSpec {
    pub fn parse(s: Option<&str>) -> Result<SloSpec, LoadError> {
        match s {
            None => Ok(SloSpec::None),
            Some("auto") => Ok(SloSpec::Auto),
            Some(s) => Ok(SloSpec::Given(Slo::parse(s)?)),
        }
    }
}

/// Requests the SLO calibration sends one at a time.
pub const CALIBRATION_REQUESTS: usize = 5;

/// `--slo auto`: a closed loop of one client without speculation; TTFT 2 s, TPOT 2x its median.
pub async fn calibrate_slo(opts: &LoadOptions) -> Result<Slo, LoadError> {
    let mut cal = opts.clone();
    cal.arrivals = Arrivals::Closed { concurrency: 1 };
    cal.requests = Some(CALIBRATION_REQUESTS);
    cal.duration_s = None;
    cal.warmup_s = 0.0;
    cal.progress = false;
    if matches!(
        target::Target::parse(&opts.target)?,
        target::Target::Arbor { .. }
    ) {
        cal.speculation = Some(json!({ "draft": "none" }));
    }
    let r = run(&cal, None).await?;
    if r.counts.completed == 0 {
        return Err(LoadError::Calibration(format!(
            "no calibration request completed ({:?})",
            r.counts.failed_by_code
        )));
    }
    let tpot = r.summary.tpot_ms.p50;
    if tpot <= 0.0 {
        return Err(LoadError::Calibration(
            "the calibration requests produced fewer than two tokens each".into(),
        ));
    }
    Ok(Slo {
        ttft_ms: Some(2000.0),
        tpot_ms: Some(2.0 * tpot),
        e2e_ms: None,
    })
}

/// Resolve an `SloSpec` (calibrating when asked).
pub async fn resolve_slo(spec: &SloSpec, opts: &LoadOptions) -> Result<Option<Slo>, LoadError> {
    Ok(match spec {
        SloSpec::None => None,
        SloSpec::Given(s) => Some(*s),
        SloSpec::Auto => Some(calibrate_slo(opts).await?),
    })
}

/// Several open-loop runs at increasing rates with one SLO.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SweepResult {
    pub tool: String,
    pub label: Option<String>,
    pub rates: Vec<f64>,
    pub slo: Option<Slo>,
    pub runs: Vec<RunResult>,
}

impl SweepResult {
    /// The sweep made of these runs, at their rates.
    pub fn new(opts: &LoadOptions, slo: Option<Slo>, runs: Vec<RunResult>) -> SweepResult {
        SweepResult {
            tool: format!("arbor load {}", env!("CARGO_PKG_VERSION")),
            label: opts.label.clone(),
            rates: runs.iter().filter_map(RunResult::rate).collect(),
            slo,
            runs,
        }
    }

    /// The run at `rate`, or the lowest rate's when None, with its rate.
    pub fn run_at(&self, rate: Option<f64>) -> Option<(f64, &RunResult)> {
        self.runs
            .iter()
            .filter_map(|r| Some((r.rate()?, r)))
            .filter(|(x, _)| rate.is_none_or(|want| (x - want).abs() < 1e-9))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    }

    /// An error naming the failure codes, with a sample message each, when no request of any
    /// rate completed.
    pub fn check_completed(&self) -> Result<(), LoadError> {
        if self.runs.iter().any(|r| r.counts.completed > 0) {
            return Ok(());
        }
        let mut all = metrics::Counts::default();
        for r in &self.runs {
            let c = &r.counts;
            all.sent += c.sent;
            all.cancelled += c.cancelled;
            all.failed += c.failed;
            for (code, n) in &c.failed_by_code {
                *all.failed_by_code.entry(code.clone()).or_default() += n;
            }
            for (code, m) in &c.failed_samples {
                all.failed_samples
                    .entry(code.clone())
                    .or_insert_with(|| m.clone());
            }
        }
        Err(none_completed(&all))
    }

    pub fn label(&self) -> String {
        self.label.clone().unwrap_or_else(|| {
            self.runs
                .first()
                .map_or_else(String::new, |r| r.options.target.clone())
        })
    }
}

/// The error of a run where nothing completed, from its counts.
pub(crate) fn none_completed(c: &metrics::Counts) -> LoadError {
    let mut s = format!(
        "sent {} = cancelled {} + failed {}",
        c.sent, c.cancelled, c.failed
    );
    if c.failed > 0 {
        s.push_str(": ");
        s.push_str(&c.describe_failures());
    }
    LoadError::NoneCompleted(s)
}

/// Run `opts` at each rate (open loop), pausing `cooldown_s` between rates. Every rate, the
/// cooldown and the options at each rate are checked before the first run; `on_run` sees each
/// run as it ends (so a caller keeps the runs done when a later one fails).
pub async fn sweep(
    opts: &LoadOptions,
    rates: &[f64],
    slo: Option<Slo>,
    cooldown_s: f64,
    on_run: impl FnMut(&RunResult),
) -> Result<SweepResult, LoadError> {
    let mut runs = Vec::new();
    sweep_into(opts, rates, slo, cooldown_s, &mut runs, on_run).await?;
    Ok(SweepResult::new(opts, slo, runs))
}

/// The runs of a sweep over `rates`, each checked, and the cooldown between them: every number
/// is checked before anything is sent (an SLO calibration included).
pub fn sweep_plan(
    opts: &LoadOptions,
    rates: &[f64],
    cooldown_s: f64,
) -> Result<(Vec<LoadOptions>, std::time::Duration), LoadError> {
    if rates.is_empty() {
        return Err(LoadError::Invalid("--rates needs at least one rate".into()));
    }
    let burstiness = match opts.arrivals {
        Arrivals::Open { burstiness, .. } => burstiness,
        Arrivals::Closed { .. } => 1.0,
    };
    run::check_seconds("--cooldown", cooldown_s, false)?;
    let mut each = Vec::with_capacity(rates.len());
    for &rate in rates {
        run::check_rate("--rates", rate)?;
        let mut o = opts.clone();
        o.arrivals = Arrivals::Open { rate, burstiness };
        o.check()?;
        each.push(o);
    }
    let cooldown = std::time::Duration::try_from_secs_f64(cooldown_s)
        .map_err(|e| LoadError::Invalid(format!("--cooldown: {e}")))?;
    Ok((each, cooldown))
}

/// `sweep`, pushing each run onto `runs` as it ends: when a later rate fails, the runs done
/// are still there (`SweepResult::new` makes a partial sweep of them).
pub async fn sweep_into(
    opts: &LoadOptions,
    rates: &[f64],
    slo: Option<Slo>,
    cooldown_s: f64,
    runs: &mut Vec<RunResult>,
    mut on_run: impl FnMut(&RunResult),
) -> Result<(), LoadError> {
    let (each, cooldown) = sweep_plan(opts, rates, cooldown_s)?;
    // Ctrl-C ends the rate that runs (it drains as a single run does) and the sweep with it.
    let presses = interrupt::presses();
    for (k, o) in each.iter().enumerate() {
        if k > 0 && !cooldown.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(cooldown) => {}
                _ = interrupt::after(presses) => {}
            }
        }
        if interrupt::presses() > presses {
            break;
        }
        let r = run(o, slo).await?;
        on_run(&r);
        runs.push(r);
    }
    Ok(())
}

/// A results file: one run or a sweep.
#[derive(Clone, Debug)]
pub enum ResultsFile {
    Run(Box<RunResult>),
    Sweep(SweepResult),
}

impl ResultsFile {
    pub fn read(path: &Path) -> Result<ResultsFile, LoadError> {
        let io = |e: std::io::Error| LoadError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let text = std::fs::read_to_string(path).map_err(io)?;
        let bad = |e: serde_json::Error| {
            LoadError::Invalid(format!(
                "{} is not an arbor load results file: {e}",
                path.display()
            ))
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(bad)?;
        if v.get("runs").is_some() {
            Ok(ResultsFile::Sweep(serde_json::from_value(v).map_err(bad)?))
        } else {
            Ok(ResultsFile::Run(Box::new(
                serde_json::from_value(v).map_err(bad)?,
            )))
        }
    }

    pub fn write(&self, path: &Path) -> Result<(), LoadError> {
        match self {
            ResultsFile::Run(r) => write_json(r.as_ref(), path),
            ResultsFile::Sweep(s) => write_json(s, path),
        }
    }
}

/// Write a run or a sweep as a results file (creating its folder).
pub(crate) fn write_json<T: Serialize>(value: &T, path: &Path) -> Result<(), LoadError> {
    let text =
        serde_json::to_string_pretty(value).map_err(|e| LoadError::Invalid(e.to_string()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| LoadError::Io {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?;
    }
    std::fs::write(path, text).map_err(|e| LoadError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
