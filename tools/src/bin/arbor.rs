//! The `arbor` command line: generate text, fetch and list models, benchmark the engine.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

use arbor_engine::backend::cuda::{self, Device};
use arbor_engine::draft::{DraftShape, Drafter, OracleDrafter, RandomDrafter};
use arbor_engine::sample::verify::VerifyMode;
use arbor_engine::spec::{self, SpecMetrics, SpecParams};
use arbor_engine::{
    generate, ChatMessage, CpuBackend, GenerateParams, JsonSchema, Model, Penalties,
    ResponseFormat, SamplingParams, Tokenizer,
};
use arbor_tools::spec_bench::DraftSpec;
use arbor_tools::{bench, fetch, spec_bench};

#[derive(Parser)]
#[command(
    name = "arbor",
    version,
    about = "Arbor: tree-based speculative LLM inference"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, streaming it to stdout.
    Generate(GenerateArgs),
    /// List or fetch models.
    Models {
        #[command(subcommand)]
        cmd: ModelsCmd,
    },
    /// Serve the model over TCP (line-delimited JSON, docs/protocol.md) until SIGINT/SIGTERM.
    Serve(ServeArgs),
    /// Load-test a server (arbor:// or openai://): TTFT, TPOT, ITL, E2E, throughput, goodput.
    Load(Box<arbor_tools::load::cli::LoadCommand>),
    /// Benchmarks that print figures.
    Bench {
        #[command(subcommand)]
        cmd: BenchCmd,
    },
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Drafters requests may speculate with (comma-separated): ngram[:N] (prompt lookup),
    /// recycle[:K] (Token Recycling), early-exit:L (the LLM's first L layers), or a draft model (a known model name or a GGUF
    /// path; its vocabulary must be the LLM's). Model drafters draft all of a step's requests in
    /// one pass per tree depth. Requests choose a subset and caps (`speculation` field); none by
    /// default.
    #[arg(long, value_delimiter = ',')]
    draft: Vec<String>,
    /// Tree shape of model drafters: branching per depth (e.g. 1,1,3,1,1,1,1,1: a chain with
    /// three branches at depth 3) or dynamic:N (EAGLE-2 dynamic tree of N nodes).
    #[arg(long, default_value = "1,1,3,1,1,1,1,1")]
    speculate_tree: String,
    /// recycle drafters of all requests share one adjacency matrix (each request's verified
    /// candidates feed every request's draft guesses; outputs are unaffected).
    #[arg(long)]
    recycle_shared: bool,
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// KV cache memory (e.g. 2GiB, 512MiB) or auto (a quarter of the available memory).
    #[arg(long, default_value = "auto")]
    kv_memory: String,
    /// Require `{"auth": TOKEN}` as the first line of every connection (or ARBOR_AUTH_TOKEN).
    #[arg(long)]
    auth_token: Option<String>,
    /// Most requests waiting for admission at once (more are answered `overloaded`).
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Most requests in flight per connection (more are answered `too_many_requests`).
    #[arg(long, default_value_t = 64)]
    max_requests_per_connection: usize,
    /// Most connections at once.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Longest request line in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_line_bytes: usize,
    /// Most tokens one request may generate.
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Most prompt tokens (0: the model's context).
    #[arg(long, default_value_t = 0)]
    max_prompt_tokens: usize,
    /// Longest a request may run, in seconds (its `deadline_ms` may only shorten it).
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Seconds in-flight requests may run on after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 10.0)]
    shutdown_grace: f64,
    /// Seconds a connection with no request in flight may stay silent before it is closed
    /// (0: never).
    #[arg(long, default_value_t = 300.0)]
    idle_timeout: f64,
    /// Most draft nodes per request and step.
    #[arg(long, default_value_t = 64)]
    speculate_budget: usize,
    /// Most draft depth per request and step.
    #[arg(long, default_value_t = 8)]
    speculate_depth: usize,
    /// Log format on stderr (filter with RUST_LOG).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    log_format: Format,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Format {
    Text,
    Json,
}

#[derive(Args)]
struct ModelArgs {
    /// A known model name (see `arbor models list`) or a path to a GGUF file.
    #[arg(long, default_value = "smollm2-135m")]
    model: String,
    /// Worker threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Where the model runs: cpu, cuda or cuda:N (a build with `--features cuda` and an NVIDIA
    /// GPU): `serve` verifies on the GPU (drafters stay on the CPU), `generate` decodes greedily
    /// there (alone or with --draft ngram); benchmarks run on the CPU only.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    device: Device,
}

fn parse_device(s: &str) -> Result<Device, String> {
    s.parse::<Device>().map_err(|e| e.to_string())
}

/// Check `--device` for a command that runs on the CPU only: `cpu` passes; `cuda[:N]` fails with
/// the reason and its stable code (not_compiled_with_cuda, no_cuda_device), or, where a GPU is
/// usable, says what does not run on it yet.
fn cpu_only(m: &ModelArgs, what: &str) -> Result<()> {
    if m.device == Device::Cpu {
        return Ok(());
    }
    check_device(m.device)?;
    bail!(
        "{what} does not run on --device {} yet: `arbor generate` (greedy) and `arbor serve` do",
        m.device
    )
}

/// A device check's error, with its stable code.
fn check_device(device: Device) -> Result<()> {
    cuda::check_device(device).map_err(|e| anyhow::anyhow!("{e} [{}]", e.error_type()))
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the model's chat template (ChatML).
    #[arg(long)]
    chat: bool,
    /// System message for --chat (default: the model template's own).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep tokens at least this share of the most likely one's probability (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    /// Divide positive (multiply negative) logits of tokens in the prompt or the output by this
    /// (CTRL's repetition penalty; 1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repetition_penalty: f32,
    /// Subtract this from a token's logit per time the output holds it (-2 to 2; 0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Subtract this from the logit of every token the output holds (-2 to 2; 0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Add BIAS (-100 to 100) to token ID's logit before the penalties (repeatable).
    #[arg(long, value_name = "ID=BIAS", value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
    /// Sampling seed (0 when not given). Given explicitly, it also makes `--speculate-policy
    /// auto` verify fixed trees, so the same seed gives the same text with drafters too.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Stop at this token id, as at an end-of-generation token, also with --ignore-eos
    /// (repeatable).
    #[arg(long, value_name = "ID")]
    stop_token_id: Vec<u32>,
    /// JSON mode: the output is one JSON object (tokens that cannot continue one are masked).
    #[arg(long, conflicts_with = "json_schema")]
    json: bool,
    /// The output is one JSON text matching the JSON schema in this file (the subset
    /// docs/protocol.md lists under "JSON schemas").
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// Do not stop at end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// End-of-generation tokens do not end generation before this many tokens.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    #[command(flatten)]
    spec: SpecArgs,
}

/// Speculative decoding with token trees (SpecInfer).
#[derive(Args)]
struct SpecArgs {
    /// Speculate with these drafters (repeatable or comma-separated; their trees are merged):
    /// a draft model with the LLM's vocabulary (registry name or GGUF path), ngram[:N] (prompt
    /// lookup), early-exit:L (the LLM's first L layers), space[:K] (SPACE, training-free),
    /// recycle[:K][:logits] (Token Recycling: the LLM's own top-K candidates of every verified
    /// row; `logits` also warms up from every prompt row's, at the cost of the output head over
    /// the prompt),
    /// ngram[:N]-else:DRAFTER (prompt lookup on 2..N-token matches, DRAFTER at steps without
    /// one), oracle (knows the continuation: runs incremental generation first), random.
    #[arg(long, visible_alias = "draft", value_delimiter = ',')]
    speculate: Vec<String>,
    /// Tree shape: an expansion config (branch factor per depth) or dynamic:N[:BEAM[:DEPTH]]
    /// (EAGLE-2 dynamic tree of N nodes by cumulative draft probability).
    #[arg(long, visible_alias = "tree", default_value = "1,1,3,1,1,1,1,1")]
    speculate_tree: String,
    /// Most draft nodes per verification pass (all drafters together). Default: 64, or 8 per
    /// drafter when Token Recycling is among them (its template fills any budget, and about 8
    /// nodes pay on a 2-core CPU; docs/benchmarks.md).
    #[arg(long)]
    speculate_budget: Option<usize>,
    /// Verification: auto (greedy when --temperature 0, else mss), greedy, mss, naive.
    #[arg(long, default_value = "auto")]
    speculate_verify: String,
    /// Tree size per step: adaptive (verify the depth that pays, from the measured acceptance
    /// and pass cost; plain decoding where drafts fail), fixed (the whole tree every step), or
    /// auto: adaptive, but fixed when sampling with an explicit --seed (adaptive trees follow
    /// measured timings, so a seed would no longer reproduce the same text; the distribution
    /// stays the LLM's either way).
    #[arg(long, default_value = "auto", value_parser = ["auto", "adaptive", "fixed"])]
    speculate_policy: String,
    /// SPACE auto-correct decoding: each verification pass also drafts the next candidates from
    /// placeholder groups (training-free: the previous pass's own predictions fill them). Merges
    /// with any --draft drafters.
    #[arg(long)]
    space: bool,
    /// SPACE candidates per pass (and placeholders per group).
    #[arg(long, default_value_t = 4, requires = "space")]
    space_k: usize,
    /// SPACE mask-token mode: fill placeholders with this token id (for models fine-tuned
    /// semi-autoregressively) instead of the training-free predictions.
    #[arg(long, requires = "space")]
    space_mask_token: Option<u32>,
}

impl SpecArgs {
    const DRAFTERS: [&'static str; 2] = ["oracle", "random"];

    /// The tree shape, real drafters and verification mode, checked before the model loads.
    fn validate(&self) -> Result<(DraftShape, Vec<DraftSpec>, Option<VerifyMode>)> {
        let cfg: DraftShape = self.speculate_tree.parse()?;
        let mut real = Vec::new();
        for d in &self.speculate {
            if Self::DRAFTERS.contains(&d.as_str()) {
                if cfg.is_dynamic() {
                    bail!("drafter '{d}' needs an expansion config, not a dynamic tree");
                }
            } else {
                let spec = d.parse::<DraftSpec>()?;
                if let Some(name) = spec.model() {
                    let known = fetch::known_models().iter().any(|m| m.name == name);
                    if !known && !std::path::Path::new(name).is_file() {
                        bail!(
                            "unknown drafter '{name}' (a known model or GGUF path, ngram[:N], \
                             early-exit:L, space[:K], recycle[:K], ngram[:N]-else:DRAFTER, \
                             oracle, random)"
                        );
                    }
                }
                real.push(spec);
            }
        }
        if self.space {
            if self.space_k == 0 || self.space_k > 32 {
                bail!("--space-k must be between 1 and 32");
            }
            real.push(DraftSpec::Space {
                k: self.space_k,
                mask: self.space_mask_token,
            });
        }
        let mode = match self.speculate_verify.as_str() {
            "auto" => None,
            m => Some(m.parse::<VerifyMode>()?),
        };
        Ok((cfg, real, mode))
    }
}

#[derive(Subcommand)]
enum ModelsCmd {
    /// Show known models and whether they are present.
    List,
    /// Download and verify a known model.
    Fetch { name: String },
    /// Print the local path of a model (fetching it if missing).
    Path { name: String },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Drafting cost per step of early-exit model drafters for many sequences: batched across
    /// sequences (one pass per tree depth for all) against each drafting alone.
    DraftBatch {
        #[command(flatten)]
        model: ModelArgs,
        /// Layers of the early-exit drafter.
        #[arg(long, default_value_t = 10)]
        layers: usize,
        /// Tree shape.
        #[arg(long, default_value = "1,1,1,1")]
        speculate_tree: String,
        /// Sequence counts (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
        sequences: Vec<usize>,
        /// Context tokens per sequence.
        #[arg(long, default_value_t = 100)]
        context: usize,
        /// Timed drafting steps per run.
        #[arg(long, default_value_t = 8)]
        steps: usize,
        /// Alternations of batched and alone.
        #[arg(long, default_value_t = 2)]
        rounds: usize,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// The load generator's own ceiling: `arbor load` (closed loop) against an instant server
    /// that answers every request at once (no model).
    LoadTool {
        /// Clients (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        concurrency: Vec<usize>,
        #[arg(long, default_value_t = 5000)]
        requests: usize,
        /// Tokens per request (one per event).
        #[arg(long, default_value_t = 16)]
        tokens: usize,
    },
    /// The server's own overhead: one streamed greedy request over loopback TCP against
    /// `generate` in-process (decode tok/s, alternated in one run).
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value = "def fibonacci(n):")]
        prompt: String,
        #[arg(long, default_value_t = 128)]
        tokens: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Both sides speculate with prompt lookup (ngram): the drafter actors' path against
        /// `generate --draft ngram`.
        #[arg(long)]
        ngram: bool,
    },
    /// Continuous batching: aggregate decode tok/s of N concurrent requests (one paged KV pool,
    /// one forward pass per step for all of them).
    Batch {
        #[command(flatten)]
        model: ModelArgs,
        /// Concurrent requests (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
        concurrency: Vec<usize>,
        /// Built-in prompt set: code, chat or mixed.
        #[arg(long, default_value = "mixed")]
        prompts: String,
        /// Prompt length in tokens (each prompt cut or cycled to it).
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Top-k of every request (0 = off).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Top-p of every request (1 = off).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Min-p of every request (0 = off).
        #[arg(long, default_value_t = 0.0)]
        min_p: f32,
        /// KV pool size, e.g. 2GiB, 512MiB; auto = a quarter of the available memory, at most 4GiB.
        #[arg(long, default_value = "auto")]
        kv_memory: String,
        /// Drafter of the fixed and adaptive modes: ngram[:N] (prompt lookup) or early-exit:L
        /// (the model's first L layers, along --speculate-tree).
        #[arg(long, default_value = "ngram")]
        draft: String,
        /// Tree shape of model drafters.
        #[arg(long, default_value = "1,1,3,1,1,1,1,1")]
        speculate_tree: String,
        /// Model drafters of all requests share one KV pool and draft in one pass per depth
        /// (on), or each drafts alone in its own cache (off: the comparison).
        #[arg(long, default_value = "on", value_parser = ["on", "off"])]
        draft_batching: String,
        /// Most draft nodes per request per step.
        #[arg(long, default_value_t = 8)]
        budget: usize,
        /// Modes to run (comma-separated): none, fixed, adaptive.
        #[arg(long, value_delimiter = ',', default_value = "none,fixed,adaptive")]
        modes: Vec<String>,
        /// Runs of every mode per concurrency, the modes alternated (their order rotated each
        /// round); the figures are over all rounds together, each round's tok/s listed too.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Prefill/decode throughput and forward-pass cost over 1/2/4/8/16/64 new tokens.
    Decode {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, default_value_t = 256)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 128)]
        decode_tokens: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Cost of one tree verification pass as the token tree grows (SpecInfer).
    Spec {
        #[command(flatten)]
        model: ModelArgs,
        /// oracle (knows the greedy continuation) or random.
        #[arg(long, default_value = "oracle")]
        drafter: String,
        /// Draft nodes per tree (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
        tree_sizes: Vec<usize>,
        /// Depth of the oracle's chains (a tree of N nodes is N/depth chains).
        #[arg(long, default_value_t = 8)]
        depth: usize,
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        /// Tokens generated per tree size (per prompt with --suite).
        #[arg(long, default_value_t = 32)]
        tokens: usize,
        /// Real drafters instead: incremental vs SSM chain / tree / merged / dynamic, early exit
        /// and prompt lookup over a fixed prompt set (code, chat, summarization).
        #[arg(long)]
        suite: bool,
        /// Draft model for --suite (same vocabulary as --model).
        #[arg(long)]
        draft_model: Option<String>,
        /// Early-exit layers for --suite.
        #[arg(long, default_value_t = 8)]
        early_exit: usize,
        /// Temperatures for --suite (comma-separated; 0 = greedy, checked against incremental).
        #[arg(long, value_delimiter = ',', default_value = "0,0.7")]
        temperatures: Vec<f32>,
        /// --suite: only the configurations whose names contain one of these (comma-separated,
        /// e.g. recycle,prompt lookup); all by default.
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
}

/// The values `ARBOR_KERNEL` may take (the engine reads it; a typo must not silently run
/// another kernel family than the one asked for).
const KERNEL_FAMILIES: [&str; 5] = ["scalar", "avx2", "avxvnni", "avx512", "amx"];

fn check_kernel_env() -> Result<()> {
    match std::env::var("ARBOR_KERNEL") {
        Ok(v)
            if !v.trim().is_empty()
                && !KERNEL_FAMILIES
                    .iter()
                    .any(|k| v.trim().eq_ignore_ascii_case(k)) =>
        {
            anyhow::bail!(
                "ARBOR_KERNEL must be one of {} (or unset for the CPU's best), got '{v}'",
                KERNEL_FAMILIES.join(", ")
            )
        }
        _ => Ok(()),
    }
}

fn main() {
    let cli = Cli::parse();
    // Commands that print to stdout end quietly, like other Unix filters, when its reader goes
    // away (`arbor generate ... | head`): Rust ignores SIGPIPE, which turns the next print into a
    // panic. (A command serving sockets must keep ignoring it: there a closed peer is an error
    // to handle, not a reason to exit. The match lists every command so a new one decides.)
    let filter = match cli.cmd {
        Cmd::Generate(_) | Cmd::Models { .. } | Cmd::Bench { .. } => true,
        // Load also writes to sockets, where a closed peer must be an error, not a signal.
        Cmd::Serve(_) | Cmd::Load(_) => false,
    };
    #[cfg(unix)]
    if filter {
        // SAFETY: restoring the default disposition of one signal before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    #[cfg(not(unix))]
    let _ = filter;
    if let Err(e) = check_kernel_env().and_then(|()| run(cli)) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Models { cmd } => cmd_models(cmd),
        Cmd::Serve(a) => cmd_serve(a),
        Cmd::Load(a) => arbor_tools::load::cli::main(*a),
        Cmd::Bench { cmd } => match cmd {
            BenchCmd::Batch {
                model,
                concurrency,
                prompts,
                prompt_tokens,
                tokens,
                temperature,
                top_k,
                top_p,
                min_p,
                kv_memory,
                draft,
                speculate_tree,
                draft_batching,
                budget,
                modes,
                rounds,
                format,
            } => {
                let kv = parse_bytes(&kv_memory)?;
                let sampling = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    ..SamplingParams::default()
                };
                sampling.validate()?;
                let (m, tok, backend, _) = load(&model)?;
                let r = arbor_tools::batch_bench::batch_bench(
                    &m,
                    &tok,
                    &backend,
                    &model.model,
                    &concurrency,
                    &prompts,
                    prompt_tokens,
                    tokens,
                    &sampling,
                    kv,
                    &arbor_tools::batch_bench::BenchDraft {
                        spec: draft.clone(),
                        shape: speculate_tree.parse()?,
                        batched: draft_batching == "on",
                    },
                    budget,
                    &modes,
                    rounds,
                )?;
                match format {
                    Format::Json => println!("{}", serde_json::to_string(&r)?),
                    Format::Text => print!("{}", arbor_tools::batch_bench::format_table(&r)),
                }
                Ok(())
            }
            BenchCmd::DraftBatch {
                model,
                layers,
                speculate_tree,
                sequences,
                context,
                steps,
                rounds,
                format,
            } => {
                let shape: DraftShape = speculate_tree.parse()?;
                let (m, _, backend, _) = load(&model)?;
                let rows = arbor_tools::batch_bench::draft_batch_bench(
                    &m, &backend, layers, &shape, &sequences, context, steps, rounds,
                )?;
                match format {
                    Format::Json => println!(
                        "{}",
                        serde_json::json!({
                            "model": model.model,
                            "cpu": arbor_tools::batch_bench::cpu_name(),
                            "threads": backend.threads(),
                            "layers": layers,
                            "tree": speculate_tree,
                            "results": rows,
                        })
                    ),
                    Format::Text => {
                        println!(
                            "{} early-exit:{layers} tree {speculate_tree}, {} threads, {}",
                            model.model,
                            backend.threads(),
                            arbor_tools::batch_bench::cpu_name()
                        );
                        print!("{}", arbor_tools::batch_bench::format_draft_batch(&rows));
                    }
                }
                Ok(())
            }
            BenchCmd::LoadTool {
                concurrency,
                requests,
                tokens,
            } => arbor_tools::load::cli::bench_load_tool(&concurrency, requests, tokens),
            BenchCmd::Serve {
                model,
                prompt,
                tokens,
                reps,
                ngram,
            } => {
                cpu_only(&model, "bench serve")?;
                let path = fetch::resolve_model(&model.model)?;
                let r = arbor_tools::serve_bench::serve_bench(
                    &path,
                    model.threads,
                    &prompt,
                    tokens,
                    reps.max(1),
                    ngram,
                )?;
                let cpu = std::fs::read_to_string("/proc/cpuinfo")
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find(|l| l.starts_with("model name"))
                            .and_then(|l| l.split(':').nth(1))
                            .map(|s| s.trim().to_string())
                    })
                    .unwrap_or_default();
                println!(
                    "# {} on {cpu}, {tokens} tokens, greedy, ignore_eos",
                    model.model
                );
                println!(
                    "| rep | generate decode tok/s | in-process API tok/s | TCP stream decode tok/s | API / generate | TCP / generate |"
                );
                println!("|--:|--:|--:|--:|--:|--:|");
                for (i, x) in r.iter().enumerate() {
                    println!(
                        "| {} | {:.1} | {:.1} | {:.1} | {:.3} | {:.3} |",
                        i + 1,
                        x.generate_tok_s,
                        x.api_tok_s,
                        x.server_tok_s,
                        x.api_tok_s / x.generate_tok_s,
                        x.server_tok_s / x.generate_tok_s
                    );
                }
                let med = |mut v: Vec<f64>| {
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 2]
                };
                let g = med(r.iter().map(|x| x.generate_tok_s).collect());
                let api = med(r.iter().map(|x| x.api_tok_s).collect());
                let sv = med(r.iter().map(|x| x.server_tok_s).collect());
                let ra = med(r.iter().map(|x| x.api_tok_s / x.generate_tok_s).collect());
                let ratio = med(r
                    .iter()
                    .map(|x| x.server_tok_s / x.generate_tok_s)
                    .collect());
                println!("| median | {g:.1} | {api:.1} | {sv:.1} | {ra:.3} | {ratio:.3} |");
                Ok(())
            }
            BenchCmd::Decode {
                model,
                prompt_tokens,
                decode_tokens,
                reps,
                format,
            } => cmd_bench_decode(model, prompt_tokens, decode_tokens, reps, format),
            BenchCmd::Spec {
                model,
                tokens,
                suite: true,
                draft_model,
                early_exit,
                temperatures,
                only,
                format,
                ..
            } => cmd_bench_suite(
                model,
                draft_model,
                early_exit,
                tokens,
                &temperatures,
                &only,
                format,
            ),
            BenchCmd::Spec {
                model,
                drafter,
                tree_sizes,
                depth,
                prompt_tokens,
                tokens,
                format,
                ..
            } => cmd_bench_spec(
                model,
                &drafter,
                &tree_sizes,
                depth,
                prompt_tokens,
                tokens,
                format,
            ),
        },
    }
}

/// "2GiB", "512MiB", "1.5GB", "1000000" (bytes), or "auto": a quarter of the memory the
/// system reports available (256 MiB to 4 GiB; 1 GiB when it reports nothing).
fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    if t == "auto" {
        return Ok(arbor_actors::config::default_kv_memory());
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .with_context(|| format!("'{s}' is not a size like 2GiB"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("unknown size unit '{other}' in '{s}' (B, KiB, MiB, GiB, KB, MB, GB)"),
    };
    let bytes = n * mult;
    if !(bytes.is_finite() && bytes >= 1.0) {
        bail!("'{s}' is not a positive size");
    }
    Ok(bytes as usize)
}

fn load(m: &ModelArgs) -> Result<(Model, Tokenizer, CpuBackend, PathBuf)> {
    cpu_only(m, "this command")?;
    let path = fetch::resolve_model(&m.model)?;
    let model = Model::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let tok = Tokenizer::from_gguf(model.gguf()).context("building the tokenizer")?;
    let backend = CpuBackend::new(m.threads)?;
    Ok((model, tok, backend, path))
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    use arbor_tools::serve;
    check_device(a.model.device)?;
    serve::init_logging(a.log_format == Format::Json);
    serve::check_drafters(&a.draft)?;
    a.speculate_tree.parse::<DraftShape>()?;
    // Flags checked before the model resolves (which may fetch it).
    let max_deadline = serve::secs("request-timeout", a.request_timeout, 0.001)?;
    let shutdown_grace = serve::secs("shutdown-grace", a.shutdown_grace, 0.0)?;
    let idle_timeout = serve::secs("idle-timeout", a.idle_timeout, 0.0)?;
    let idle_timeout = (!idle_timeout.is_zero()).then_some(idle_timeout);
    let max_requests_per_connection =
        serve::at_least_one("max-requests-per-connection", a.max_requests_per_connection)?;
    let max_line_bytes = serve::at_least_one("max-line-bytes", a.max_line_bytes)?;
    let max_connections = serve::at_least_one("max-connections", a.max_connections)?;
    let kv_memory = parse_bytes(&a.kv_memory).context("--kv-memory")?;
    let max_waiting = serve::at_least_one("max-waiting", a.max_waiting)?;
    let max_tokens = serve::at_least_one("max-tokens", a.max_tokens)?;
    let auth_token = a
        .auth_token
        .clone()
        .or_else(|| std::env::var("ARBOR_AUTH_TOKEN").ok())
        .filter(|t| !t.is_empty());
    let o = serve::ServeOptions {
        model_path: fetch::resolve_model(&a.model.model)?,
        threads: a.model.threads,
        device: a.model.device,
        drafters: a.draft.clone(),
        listen: a.listen.clone(),
        kv_memory,
        auth_token,
        limits: arbor_actors::Limits {
            max_waiting,
            max_prompt_tokens: a.max_prompt_tokens,
            max_tokens,
            max_deadline,
            ..Default::default()
        },
        server: arbor_actors::server::ServerConfig {
            max_line_bytes,
            max_requests_per_connection,
            max_connections,
            shutdown_grace,
            idle_timeout,
            ..Default::default()
        },
        spec_budget: a.speculate_budget,
        spec_depth: a.speculate_depth,
        spec_tree: a.speculate_tree.clone(),
        recycle_shared: a.recycle_shared,
    };
    serve::run(o)
}

/// `generate --device cuda[:N]`: greedy decoding on the GPU, incremental or speculative with
/// prompt lookup (`--draft ngram[:N]`), the token trees verified on the device. The text is
/// printed when generation ends (no streaming yet), then the same summary line as on the CPU.
fn cuda_generate(a: &GenerateArgs, params: &GenerateParams, ordinal: usize) -> Result<()> {
    check_device(Device::Cuda(ordinal))?;
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a, params);
        bail!("--device cuda: this build has no CUDA support [not_compiled_with_cuda]")
    }
    #[cfg(feature = "cuda")]
    {
        use arbor_engine::draft::ngram::NgramDrafter;
        if params.sampling.temperature != 0.0 {
            bail!("--device cuda decodes greedily only so far: use --temperature 0");
        }
        if !params.penalties.is_off() || !params.logit_bias.is_empty() {
            bail!("--device cuda applies no penalties or logit bias yet: drop --repetition-penalty, --frequency-penalty, --presence-penalty and --logit-bias");
        }
        if a.json || a.json_schema.is_some() {
            bail!("--device cuda has no JSON mode yet: drop --json / --json-schema");
        }
        // Settings this path does not honour are refused, not ignored.
        if a.format != Format::Text {
            bail!("--device cuda prints text only so far: drop --format json");
        }
        if !matches!(a.spec.speculate_verify.as_str(), "auto" | "greedy")
            || a.spec.speculate_policy != "auto"
        {
            bail!(
                "--device cuda verifies greedily with fixed trees of --speculate-budget nodes:                  drop --speculate-verify / --speculate-policy"
            );
        }
        let mut drafter: Option<NgramDrafter> = None;
        for d in &a.spec.speculate {
            match d.parse::<DraftSpec>()? {
                DraftSpec::Ngram(n) if drafter.is_none() => {
                    drafter = Some(NgramDrafter::new(n, 1, 8, 3)?);
                }
                _ => bail!(
                    "--device cuda speculates with one ngram[:N] drafter only so far, not '{d}'"
                ),
            }
        }
        if a.spec.space {
            bail!("--device cuda does not run SPACE yet");
        }
        let path = fetch::resolve_model(&a.model.model)?;
        let model = Model::open(&path).with_context(|| format!("loading {}", path.display()))?;
        let tok = Tokenizer::from_gguf(model.gguf()).context("building the tokenizer")?;
        params.validate(model.config.vocab_size)?;
        let prompt = tok.encode_prompt(&prompt_text(a, &tok))?;
        let budget = a.spec.speculate_budget.unwrap_or(16);
        let blocks = (prompt.len() + params.max_tokens + budget + 1).div_ceil(16) + 1;
        let dev = cuda::CudaModel::new(&model, ordinal, blocks)?;
        let run = dev.greedy(
            &prompt,
            params.max_tokens,
            drafter.as_mut().map(|d| d as &mut dyn Drafter),
            budget,
        )?;
        // End at the first end-of-generation or stop token past --min-tokens, like the CPU
        // path.
        let mut ids = run.tokens.clone();
        if let Some(i) = ids.iter().enumerate().position(|(i, &t)| {
            (!params.ignore_eos && i >= params.min_tokens && tok.is_eog(t))
                || params.stops_at(t, i + 1)
        }) {
            ids.truncate(i);
        }
        let mut text = tok.decode(&ids, true);
        if let Some(cut) = params
            .stop
            .iter()
            // Empty stop strings are ignored, as on the CPU path (one matched at 0).
            .filter(|st| !st.is_empty())
            .filter_map(|st| text.find(st.as_str()))
            .min()
        {
            text.truncate(cut);
        }
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "{text}\n[arbor] device: cuda:{ordinal}, prompt tokens: {}, generated tokens: {}, prefill: {:.1} tok/s, decode: {:.1} tok/s, passes: {}",
            prompt.len(),
            ids.len(),
            (prompt.len() - 1) as f64 / run.prefill_s.max(1e-9),
            run.tokens.len() as f64 / run.decode_s.max(1e-9),
            run.passes
        )?;
        Ok(())
    }
}

/// The prompt text: `--prompt`, wrapped in the chat template with `--chat`.
fn prompt_text(a: &GenerateArgs, tok: &Tokenizer) -> String {
    if !a.chat {
        return a.prompt.clone();
    }
    let mut msgs = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage {
            role: "system".into(),
            content: s.clone(),
        });
    }
    msgs.push(ChatMessage {
        role: "user".into(),
        content: a.prompt.clone(),
    });
    tok.apply_chat_template(&msgs, true)
}

/// `ID=BIAS` of `--logit-bias`.
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS, got '{s}'"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|_| format!("'{id}' is not a token id"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|_| format!("'{bias}' is not a number"))?;
    Ok((id, bias))
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    if a.prompt.is_empty() {
        bail!("--prompt must not be empty");
    }
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            seed: a.seed.unwrap_or(0),
        },
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        min_tokens: a.min_tokens,
        logprobs: false,
        top_logprobs: 0,
        penalties: Penalties {
            repetition: a.repetition_penalty,
            frequency: a.frequency_penalty,
            presence: a.presence_penalty,
        },
        logit_bias: a.logit_bias.clone(),
        stop_token_ids: a.stop_token_id.clone(),
        prompt_logprobs: None,
        response_format: match &a.json_schema {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --json-schema {}", path.display()))?;
                let schema: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
                let schema = JsonSchema::new(schema);
                schema
                    .grammar()
                    .with_context(|| format!("--json-schema {}", path.display()))?;
                ResponseFormat::JsonSchema(Arc::new(schema))
            }
            None if a.json => ResponseFormat::JsonObject,
            None => ResponseFormat::Text,
        },
    };
    // Token ids against the vocabulary once the model is loaded (`generate`, `spec::generate`).
    params.validate(usize::MAX)?;
    a.spec.validate()?;
    if let Device::Cuda(ordinal) = a.model.device {
        return cuda_generate(&a, &params, ordinal);
    }
    let (model, tok, backend, _) = load(&a.model)?;
    let prompt = tok.encode_prompt(&prompt_text(&a, &tok))?;
    let stream = a.format == Format::Text;
    let mut stdout = std::io::stdout().lock();
    let on_text = |piece: &str| {
        if stream {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    };
    let (out, spec_metrics) = if a.spec.speculate.is_empty() && !a.spec.space {
        (
            generate(&model, &backend, &tok, &prompt, &params, on_text)?,
            None,
        )
    } else {
        let seeded = a.seed.is_some();
        let (out, m) = speculate(
            &a.spec, seeded, &model, &backend, &tok, &prompt, &params, on_text,
        )?;
        (out, Some(m))
    };
    let mut stdout = std::io::stdout().lock();
    match a.format {
        Format::Text => {
            let spec = match &spec_metrics {
                Some((mode, m)) => {
                    let by_depth: Vec<String> = m
                        .acceptance_by_depth()
                        .iter()
                        .map(|r| format!("{r:.2}"))
                        .collect();
                    format!(
                        ", spec ({mode}): steps: {}, drafted: {}, accepted: {}, mean accepted: {:.2}/step, acceptance by depth: [{}], drafter contract failures: {}",
                        m.steps,
                        m.drafted,
                        m.accepted,
                        m.mean_accepted(),
                        by_depth.join(", "),
                        m.drafter_contract_failures
                    )
                }
                None => String::new(),
            };
            writeln!(
                stdout,
                "\n[arbor] prompt tokens: {}, generated tokens: {}, prefill: {:.1} tok/s, decode: {:.1} tok/s, finish: {}{spec}",
                out.prompt_tokens,
                out.generated_tokens(),
                out.prefill_tok_s(),
                out.decode_tok_s(),
                out.finish_reason.as_str()
            )?;
        }
        Format::Json => {
            let mut j = serde_json::json!({
                "text": out.text,
                "tokens": out.tokens,
                "prompt_tokens": out.prompt_tokens,
                "generated_tokens": out.generated_tokens(),
                "prefill_tok_s": out.prefill_tok_s(),
                "decode_tok_s": out.decode_tok_s(),
                "finish_reason": out.finish_reason.as_str(),
            });
            if let Some((mode, m)) = &spec_metrics {
                j["spec"] = serde_json::json!({
                    "mode": mode.as_str(),
                    "steps": m.steps,
                    "drafted": m.drafted,
                    "accepted": m.accepted,
                    "mean_accepted": m.mean_accepted(),
                    "acceptance_by_depth": m.acceptance_by_depth(),
                    "placeholder_rows": m.placeholder_rows,
                    "drafter_contract_failures": m.drafter_contract_failures,
                });
            }
            writeln!(stdout, "{j}")?;
        }
    }
    Ok(())
}

/// `arbor generate --speculate …`: speculative generation with the chosen drafters (`seeded`:
/// the user gave `--seed`).
#[allow(clippy::too_many_arguments)]
fn speculate(
    a: &SpecArgs,
    seeded: bool,
    model: &Model,
    backend: &CpuBackend,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: impl FnMut(&str),
) -> Result<(arbor_engine::GenerateOutput, (VerifyMode, SpecMetrics))> {
    let (shape, real, mode) = a.validate()?;
    let mut ssms = Vec::new();
    for d in &real {
        if let Some(name) = d.model() {
            let path = fetch::resolve_model(name)?;
            ssms.push(Model::open(&path).with_context(|| format!("loading {}", path.display()))?);
        }
    }
    let ssm_refs: Vec<&Model> = ssms.iter().collect();
    let mut drafters = spec_bench::build_drafters(
        &real,
        model,
        &ssm_refs,
        backend,
        &shape,
        params.sampling.seed,
    )?;
    for (i, name) in a.speculate.iter().enumerate() {
        let seed = params.sampling.seed.wrapping_add(1 + i as u64);
        let cfg = match &shape {
            DraftShape::Expand(c) => c.clone(),
            DraftShape::Dynamic { .. } => continue,
        };
        match name.as_str() {
            "oracle" => {
                let reference = generate(model, backend, tok, prompt, params, |_| {})?;
                let mut truth = prompt.to_vec();
                truth.extend(&reference.tokens);
                drafters.push(Box::new(OracleDrafter::new(truth, cfg.clone(), seed)));
            }
            "random" => drafters.push(Box::new(RandomDrafter::new(cfg.clone(), seed))),
            _ => {}
        }
    }
    let budget = a
        .speculate_budget
        .unwrap_or(if real.iter().any(DraftSpec::recycles) {
            8 * drafters.len().max(1)
        } else {
            64
        });
    let sp = SpecParams {
        budget,
        mode,
        adaptive: match a.speculate_policy.as_str() {
            "auto" => params.sampling.is_greedy() || !seeded,
            p => p == "adaptive",
        },
        step_cost: None,
    };
    let mut refs: Vec<&mut dyn Drafter> = drafters
        .iter_mut()
        .map(|d| d.as_mut() as &mut dyn Drafter)
        .collect();
    let out = spec::generate(model, backend, tok, prompt, params, &sp, &mut refs, on_text)?;
    Ok((out.output, (out.mode, out.metrics)))
}

fn cmd_bench_spec(
    m: ModelArgs,
    drafter: &str,
    sizes: &[usize],
    depth: usize,
    prompt_tokens: usize,
    tokens: usize,
    format: Format,
) -> Result<()> {
    if !SpecArgs::DRAFTERS.contains(&drafter) {
        bail!("unknown drafter '{drafter}' for bench spec (oracle, random)");
    }
    let (model, tok, backend, _) = load(&m)?;
    let r = spec_bench::spec_bench(
        &model,
        &tok,
        &backend,
        &m.model,
        drafter,
        sizes,
        depth,
        prompt_tokens,
        tokens,
    )?;
    match format {
        Format::Json => println!("{}", serde_json::to_string(&r)?),
        Format::Text => print!("{}", spec_bench::format_table(&r)),
    }
    Ok(())
}

fn cmd_bench_suite(
    m: ModelArgs,
    draft_model: Option<String>,
    early_exit: usize,
    tokens: usize,
    temperatures: &[f32],
    only: &[String],
    format: Format,
) -> Result<()> {
    if tokens == 0 || temperatures.is_empty() || temperatures.iter().any(|t| t.is_nan() || *t < 0.0)
    {
        bail!("--tokens must be positive and --temperatures non-negative");
    }
    let (model, tok, backend, _) = load(&m)?;
    let ssm = match &draft_model {
        Some(name) => {
            let path = fetch::resolve_model(name)?;
            Some(Model::open(&path).with_context(|| format!("loading {}", path.display()))?)
        }
        None => None,
    };
    let r = spec_bench::suite_bench(
        &model,
        &tok,
        &backend,
        &m.model,
        draft_model.as_deref().zip(ssm.as_ref()),
        early_exit,
        tokens,
        temperatures,
        only,
    )?;
    match format {
        Format::Json => println!("{}", serde_json::to_string(&r)?),
        Format::Text => print!("{}", spec_bench::format_suite(&r)),
    }
    Ok(())
}

fn cmd_models(cmd: ModelsCmd) -> Result<()> {
    match cmd {
        ModelsCmd::List => {
            println!(
                "{:<22} {:>14}  {:<8} description",
                "name", "bytes", "present"
            );
            for m in fetch::known_models() {
                let present = fetch::installed(&m, &fetch::model_path(&m));
                println!(
                    "{:<22} {:>14}  {:<8} {}",
                    m.name,
                    m.bytes,
                    if present { "yes" } else { "no" },
                    m.description
                );
            }
            println!("home: {}", fetch::arbor_home().display());
        }
        ModelsCmd::Fetch { name } => {
            let m = fetch::find_known(&name)
                .ok_or_else(|| fetch::FetchError::UnknownModel(name.clone()))?;
            let p = fetch::fetch(&m, |msg| eprintln!("[arbor] {msg}"))?;
            println!("{}", p.display());
        }
        ModelsCmd::Path { name } => println!("{}", fetch::resolve_model(&name)?.display()),
    }
    Ok(())
}

fn cmd_bench_decode(
    m: ModelArgs,
    prompt_tokens: usize,
    decode_tokens: usize,
    reps: usize,
    format: Format,
) -> Result<()> {
    if prompt_tokens == 0 || reps == 0 {
        bail!("--prompt-tokens and --reps must be positive");
    }
    let (model, tok, backend, _) = load(&m)?;
    let r = bench::decode_bench(
        &model,
        &tok,
        &backend,
        &m.model,
        prompt_tokens,
        decode_tokens,
        reps,
    )?;
    match format {
        Format::Json => println!("{}", serde_json::to_string(&r)?),
        Format::Text => {
            println!("model: {}  cpu: {}  threads: {}", r.model, r.cpu, r.threads);
            println!(
                "prefill: {:.1} tok/s ({} tokens)",
                r.prefill_tok_s, r.prompt_tokens
            );
            println!(
                "decode:  {:.2} tok/s ({} tokens)",
                r.decode_tok_s, r.decode_tokens
            );
            println!(
                "forward over N new tokens at context {} (median of {reps}):",
                r.context
            );
            println!("  (logits for all N / for the last token only)");
            let mut sizes: Vec<&String> = r.forward_ms.keys().collect();
            sizes.sort_by_key(|n| n.parse::<usize>().unwrap_or(usize::MAX));
            for n in sizes {
                let ms = r.forward_ms[n];
                let last = r.forward_last_ms.get(n).copied().unwrap_or(f64::NAN);
                println!("  N={n:>3}: {ms:8.2} ms / {last:8.2} ms");
            }
        }
    }
    Ok(())
}
