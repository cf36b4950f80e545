//! `arbor serve`: load a model, start the engine's actors and serve the line-delimited JSON protocol on TCP until SIGINT/SIGTERM.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arbor_actors::engine::draft::DraftShape;
use arbor_actors::engine::Model;
use arbor_actors::server::{self, ServerConfig};
use arbor_actors::{DrafterFactory, Engine, EngineConfig, Limits};

use crate::spec_bench::DraftSpec;

/// What `arbor serve` was asked for.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub model_path: std::path::PathBuf,
    pub threads: usize,
    /// Where the verification passes run (`--device`).
    pub device: arbor_engine::backend::cuda::Device,
    pub drafters: Vec<String>,
    pub listen: String,
    pub kv_memory: usize,
    pub auth_token: Option<String>,
    pub limits: Limits,
    pub server: ServerConfig,
    pub spec_budget: usize,
    pub spec_depth: usize,
    /// Tree shape of model drafters (`--speculate-tree`).
    pub spec_tree: String,
    /// `recycle` drafters of all requests share one matrix (`--recycle-shared`).
    pub recycle_shared: bool,
}

/// The drafters a server runs, parsed and checked before any model loads: `ngram[:N]`,
/// `early-exit:L` (the LLM's first L layers) and small speculative models (a known model name or
/// a GGUF path).
pub fn check_drafters(specs: &[String]) -> anyhow::Result<Vec<DraftSpec>> {
    specs
        .iter()
        .map(|d| {
            let spec: DraftSpec = d.parse()?;
            match spec {
                // A draft model must name a known model or a file: a mistyped drafter
                // (`ngarm`) is refused now, not after the LLM has been fetched and loaded.
                DraftSpec::Model(ref m)
                    if crate::fetch::find_known(m).is_none() && !std::path::Path::new(m).is_file() =>
                {
                    anyhow::bail!(
                        "unknown drafter '{d}': not ngram[:N], recycle[:K][:logits], early-exit:L,                          a known model (`arbor models list`) or a GGUF file"
                    )
                }
                DraftSpec::Ngram(_)
                | DraftSpec::EarlyExit(_)
                | DraftSpec::Model(_)
                | DraftSpec::Recycle { .. } => Ok(spec),
                _ => anyhow::bail!(
                    "the server runs ngram[:N], recycle[:K][:logits], early-exit:L and draft models (got '{d}': \
                     SPACE and fallback drafters are not served yet)"
                ),
            }
        })
        .collect()
}

/// Build the engine config from the options (drafters checked before the model loads; draft
/// models load after the LLM, their K/V in a pool of `kv_memory` bytes each).
pub fn engine_config(o: &ServeOptions) -> anyhow::Result<EngineConfig> {
    let specs = check_drafters(&o.drafters)?;
    let shape: DraftShape = o.spec_tree.parse()?;
    let mut config = EngineConfig::open(&o.model_path)?;
    let mut drafters = Vec::with_capacity(specs.len());
    for spec in &specs {
        drafters.push(match spec {
            DraftSpec::Ngram(n) => DrafterFactory::ngram(*n)?,
            DraftSpec::Recycle { k, prompt_logits } => DrafterFactory::recycle(
                config.model.config.vocab_size,
                *k,
                o.recycle_shared,
                *prompt_logits,
            )?,
            DraftSpec::EarlyExit(l) => DrafterFactory::early_exit(
                &config.model,
                *l,
                shape.clone(),
                o.threads,
                o.kv_memory,
            )?,
            DraftSpec::Model(name) => {
                let path = crate::fetch::resolve_model(name)?;
                let draft = Model::open(&path)
                    .with_context(|| format!("loading the draft model {}", path.display()))?;
                DrafterFactory::ssm(
                    name.clone(),
                    Arc::new(draft),
                    &config.model,
                    shape.clone(),
                    o.threads,
                    o.kv_memory,
                )?
            }
            other => anyhow::bail!("the server does not run {other:?}"),
        });
    }
    config.threads = o.threads;
    config.device = o.device;
    config.kv_memory = Some(o.kv_memory);
    config.drafters = drafters;
    config.limits = o.limits.clone();
    config.spec_budget = o.spec_budget;
    config.spec_depth = o.spec_depth;
    Ok(config)
}

/// Run the server until a signal; in-flight requests get the grace period.
pub fn run(o: ServeOptions) -> anyhow::Result<()> {
    let config = engine_config(&o)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = server::bind(&o.listen)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", o.listen))?;
        let addr = listener.local_addr()?;
        let engine = Arc::new(Engine::start(config)?);
        tracing::info!(
            kv_memory = engine.info().kv_memory,
            drafters = ?engine.info().drafters,
            auth = o.auth_token.is_some(),
            cpu = %crate::batch_bench::cpu_name(),
            "engine started"
        );
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            writeln!(out, "arbor: listening on {addr}")?;
            out.flush()?;
        }
        let mut server_config = o.server.clone();
        server_config.auth_token = o.auth_token.clone();
        server::serve(engine, listener, server_config, shutdown_signal()).await?;
        Ok(())
    })
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot watch SIGTERM");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
            _ = term.recv() => tracing::info!("SIGTERM"),
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Logs to stderr through `tracing` (`RUST_LOG`, default `info`), as text or JSON lines.
pub fn init_logging(json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        b.json().try_init()
    } else {
        b.try_init()
    };
}

/// Longest duration a CLI flag may give (a year): later than any server runs, and far from
/// where `Instant + Duration` overflows.
pub const MAX_FLAG_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// Seconds given by `--flag` as a `Duration`: finite, at least `min` and at most a year (a NaN,
/// `inf` or `1e19` used to panic at start or on the first request).
pub fn secs(flag: &str, s: f64, min: f64) -> anyhow::Result<Duration> {
    if !(s.is_finite() && s >= min && s <= MAX_FLAG_SECS) {
        anyhow::bail!("--{flag} must be a number of seconds in [{min}, {MAX_FLAG_SECS}], got {s}");
    }
    Ok(Duration::from_secs_f64(s))
}

/// A count given by `--flag` that must be at least 1.
pub fn at_least_one(flag: &str, n: usize) -> anyhow::Result<usize> {
    if n == 0 {
        anyhow::bail!("--{flag} must be at least 1");
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_seconds_are_checked() {
        assert_eq!(
            secs("request-timeout", 1.5, 0.001).unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(secs("shutdown-grace", 0.0, 0.0).unwrap(), Duration::ZERO);
        for bad in [f64::NAN, f64::INFINITY, 1e19, -1.0, 0.0] {
            let e = secs("request-timeout", bad, 0.001).unwrap_err().to_string();
            assert!(e.contains("--request-timeout"), "{bad}: {e}");
        }
        assert!(at_least_one("max-line-bytes", 0).is_err());
        assert_eq!(at_least_one("max-line-bytes", 7).unwrap(), 7);
    }
}
