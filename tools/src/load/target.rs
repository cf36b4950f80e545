//! Load targets: Arbor's line-delimited JSON protocol (many requests multiplexed per connection, docs/protocol.md) and an OpenAI-compatible `/v1/completions` / `/v1/chat/completions` server-sent-event stream (llama.cpp's `llama-server`), timed per token event.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};

use super::metrics::{Outcome, SpecRecord};
use super::prompts::PromptInput;
use super::LoadError;

/// Where the load goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `arbor://HOST:PORT`: `arbor serve`.
    Arbor { addr: String },
    /// `openai://HOST:PORT`: an OpenAI-compatible HTTP server (`llama-server`).
    OpenAi { addr: String },
}

impl Target {
    /// `arbor://HOST:PORT`, `openai://HOST:PORT` (alias `http://`), or a bare `HOST:PORT`
    /// (Arbor). HOST is a name, an IPv4 address or an IPv6 address in brackets; PORT is 1 to
    /// 65535. A trailing `/` is ignored, and so is a trailing `/v1` on an OpenAI target (the
    /// tool adds the `/v1/...` paths itself); any other path is an error.
    pub fn parse(s: &str) -> Result<Target, LoadError> {
        let (scheme, rest) = s.split_once("://").unwrap_or(("arbor", s));
        let openai = match scheme {
            "arbor" => false,
            "openai" | "http" => true,
            other => {
                return Err(LoadError::Invalid(format!(
                    "unknown target scheme '{other}://' (arbor://, openai:// or its alias http://; \
                     TLS is not supported)"
                )))
            }
        };
        let mut addr = rest.trim_end_matches('/');
        if openai {
            if let Some(a) = addr.strip_suffix("/v1") {
                addr = a.trim_end_matches('/');
            }
        }
        let form = if openai {
            "openai://HOST:PORT (e.g. openai://127.0.0.1:8080 or http://127.0.0.1:8080/v1)"
        } else {
            "arbor://HOST:PORT (e.g. arbor://127.0.0.1:7070)"
        };
        let bad = |why: &str| {
            LoadError::Invalid(format!(
                "target '{s}' {why}: expected {form}, with PORT from 1 to 65535 and an IPv6 \
                 address in brackets ([::1]:PORT)"
            ))
        };
        if addr.is_empty() {
            return Err(bad("names no address"));
        }
        if let Some(i) = addr.find('/') {
            return Err(bad(&format!("has a path ('{}')", &addr[i..])));
        }
        let (host, port) = if let Some(v6) = addr.strip_prefix('[') {
            let (ip, port) = v6
                .split_once("]:")
                .ok_or_else(|| bad("has no port after its bracketed address"))?;
            if ip.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(bad(&format!("has '{ip}' in brackets, not an IPv6 address")));
            }
            (ip, port)
        } else {
            let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("has no port"))?;
            if host.contains(':') {
                return Err(bad("has an IPv6 address without brackets"));
            }
            let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_');
            if host.is_empty() || !host.chars().all(ok) {
                return Err(bad(&format!("has '{host}' as its host")));
            }
            (host, port)
        };
        if host.is_empty() {
            return Err(bad("has no host"));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err(bad(&format!("has '{port}' as its port"))),
        }
        let addr = addr.to_string();
        Ok(if openai {
            Target::OpenAi { addr }
        } else {
            Target::Arbor { addr }
        })
    }

    pub fn url(&self) -> String {
        match self {
            Target::Arbor { addr } => format!("arbor://{addr}"),
            Target::OpenAi { addr } => format!("openai://{addr}"),
        }
    }
}

/// Repetition, frequency and presence penalties of every request (not sent when `None`).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PenaltyFields {
    pub repetition: Option<f64>,
    pub frequency: Option<f64>,
    pub presence: Option<f64>,
}

impl PenaltyFields {
    /// Into a request body: OpenAI's `frequency_penalty` and `presence_penalty`, and
    /// `repetition_penalty` (Arbor's and vLLM's name; llama-server reads `repeat_penalty`, sent
    /// too when `openai`).
    fn write(&self, body: &mut Value, openai: bool) {
        if let Some(r) = self.repetition {
            body["repetition_penalty"] = json!(r);
            if openai {
                body["repeat_penalty"] = json!(r);
            }
        }
        if let Some(f) = self.frequency {
            body["frequency_penalty"] = json!(f);
        }
        if let Some(p) = self.presence {
            body["presence_penalty"] = json!(p);
        }
    }
}

/// One request as the generator sends it.
#[derive(Clone, Debug)]
pub struct Outgoing {
    pub input: PromptInput,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub temperature: f64,
    /// Top-k, top-p and min-p, sent with a temperature above 0.
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    /// Sent with greedy and sampled requests alike.
    pub penalties: PenaltyFields,
    pub seed: u64,
    /// Arbor's `speculation` object, passed through unchanged.
    pub speculation: Option<Value>,
    /// More body fields (`--extra-body`), checked not to touch the ones set here.
    pub extra_body: Option<Arc<serde_json::Map<String, Value>>>,
}

impl Outgoing {
    /// `--extra-body`'s fields into a request body.
    fn extra(&self, body: &mut Value) {
        if let (Some(extra), Some(obj)) = (&self.extra_body, body.as_object_mut()) {
            obj.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
    }

    /// `top_k`, `top_p` and `min_p` into a request body where given (both protocols name
    /// them so: OpenAI's API has `top_p`; vLLM and llama-server take the other two as well).
    fn truncation(&self, body: &mut Value) {
        if let Some(k) = self.top_k {
            body["top_k"] = json!(k);
        }
        if let Some(p) = self.top_p {
            body["top_p"] = json!(p);
        }
        if let Some(p) = self.min_p {
            body["min_p"] = json!(p);
        }
    }
}

/// What came back for one request.
#[derive(Clone, Debug)]
pub struct Reply {
    pub outcome: Outcome,
    /// Arrival time of each token event and the tokens it carried.
    pub events: Vec<(Instant, u32)>,
    pub end: Instant,
    pub usage_prompt_tokens: Option<u64>,
    pub usage_completion_tokens: Option<u64>,
    pub spec: Option<SpecRecord>,
}

impl Reply {
    pub(super) fn failed(code: &str, message: impl Into<String>) -> Reply {
        Reply::ended(Outcome::Failed {
            code: code.into(),
            message: message.into(),
        })
    }

    /// Forgets usage and speculation counts no request could have (more completion tokens than
    /// it allowed, more speculation steps than tokens): a buggy or hostile server's numbers
    /// would otherwise overflow the sums or spread billions of tokens over a stream's chunks.
    pub fn drop_implausible_usage(&mut self, max_tokens: usize) {
        let max = max_tokens as u64;
        if self.usage_completion_tokens.is_some_and(|n| n > max) {
            self.usage_completion_tokens = None;
        }
        if self
            .usage_prompt_tokens
            .is_some_and(|n| n > u64::from(u32::MAX))
        {
            self.usage_prompt_tokens = None;
        }
        let bound = max.max(1).saturating_mul(1 << 16);
        if self
            .spec
            .is_some_and(|s| s.steps > max || s.drafted > bound || s.accepted > max)
        {
            self.spec = None;
        }
    }

    /// A reply with no tokens that ended now.
    fn ended(outcome: Outcome) -> Reply {
        Reply {
            outcome,
            events: Vec::new(),
            end: Instant::now(),
            usage_prompt_tokens: None,
            usage_completion_tokens: None,
            spec: None,
        }
    }
}

/// Limits of the Arbor protocol client (`--per-connection`, `--max-line-bytes`).
#[derive(Clone, Copy, Debug)]
pub struct ClientLimits {
    pub per_connection: usize,
    pub max_line_bytes: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            per_connection: super::run::DEFAULT_PER_CONNECTION,
            max_line_bytes: super::run::DEFAULT_MAX_LINE_BYTES,
        }
    }
}

/// A connected client for a target, shared by every request of a run.
pub enum Client {
    Arbor(ArborClient),
    OpenAi(OpenAiClient),
}

impl Client {
    pub fn new(
        target: &Target,
        auth_token: Option<String>,
        model: Option<String>,
        limits: ClientLimits,
    ) -> Client {
        match target {
            Target::Arbor { addr } => {
                let mut c = ArborClient::new(addr.clone(), auth_token);
                c.per_connection = limits.per_connection.max(1);
                c.max_line_bytes = limits.max_line_bytes;
                Client::Arbor(c)
            }
            Target::OpenAi { addr } => Client::OpenAi(OpenAiClient {
                addr: addr.clone(),
                auth_token,
                model,
            }),
        }
    }

    /// Send one request and wait for its end; when `stop` turns true the request is cancelled.
    pub async fn send(&self, req: &Outgoing, stop: watch::Receiver<bool>) -> Reply {
        match self {
            Client::Arbor(c) => c.send(req, stop).await,
            Client::OpenAi(c) => c.send(req, stop).await,
        }
    }

    /// Lines the server sent that named no request in flight.
    pub fn stray_lines(&self) -> u64 {
        match self {
            Client::Arbor(c) => c.stray.lines.load(Ordering::Relaxed),
            Client::OpenAi(_) => 0,
        }
    }

    /// Of the stray lines, the error lines, by code (e.g. `line_too_long`, which has
    /// `"id": null`).
    pub fn stray_errors_by_code(&self) -> BTreeMap<String, u64> {
        match self {
            Client::Arbor(c) => c.stray.errors.lock().clone(),
            Client::OpenAi(_) => BTreeMap::new(),
        }
    }
}

/// Lines from an Arbor server that named no request in flight.
#[derive(Default)]
struct Stray {
    lines: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
}

impl Stray {
    fn line(&self) {
        self.lines.fetch_add(1, Ordering::Relaxed);
    }

    /// A stray line; an error line is also counted by its code.
    fn value(&self, v: &Value) {
        self.line();
        if let Some(e) = v.get("error") {
            let code = e.get("code").and_then(Value::as_str).unwrap_or("unknown");
            *self.errors.lock().entry(code.to_string()).or_default() += 1;
        }
    }
}

/// A line from an Arbor server, routed to its request.
enum Line {
    Tokens(Instant, u32),
    Final(Instant, Value),
    Closed(String),
}

struct ArborConn {
    tx: mpsc::UnboundedSender<String>,
    pending: Mutex<HashMap<u64, mpsc::UnboundedSender<Line>>>,
    alive: AtomicBool,
    /// The server closed the connection as idle (an `idle_timeout` line): a request sent as
    /// it closed never started there and is sent again on a new connection.
    idle_closed: AtomicBool,
    in_flight: AtomicUsize,
}

/// How long a new connection may take to open (a server dropping connection attempts
/// otherwise holds every request queued behind the pool's lock for the kernel's ~2 minutes).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP connection to `addr` within [`CONNECT_TIMEOUT`], or why not.
async fn connect(addr: &str) -> Result<TcpStream, String> {
    match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("cannot connect to {addr}: {e}")),
        Err(_) => Err(format!(
            "cannot connect to {addr}: no answer within {CONNECT_TIMEOUT:?}"
        )),
    }
}

/// Arbor protocol client: a pool of connections, each carrying up to `per_connection` requests.
pub struct ArborClient {
    addr: String,
    auth_token: Option<String>,
    conns: tokio::sync::Mutex<Vec<Arc<ArborConn>>>,
    next_id: AtomicU64,
    stray: Arc<Stray>,
    /// Below the server's `--max-requests-per-connection` (64): `--per-connection`.
    pub per_connection: usize,
    /// Longer request lines are not sent (the server would drop them with an error that names
    /// no request): `--max-line-bytes`.
    pub max_line_bytes: usize,
}

impl ArborClient {
    pub fn new(addr: String, auth_token: Option<String>) -> ArborClient {
        ArborClient {
            addr,
            auth_token,
            conns: tokio::sync::Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            stray: Arc::new(Stray::default()),
            per_connection: super::run::DEFAULT_PER_CONNECTION,
            max_line_bytes: super::run::DEFAULT_MAX_LINE_BYTES,
        }
    }

    async fn conn(&self) -> Result<Arc<ArborConn>, String> {
        let mut conns = self.conns.lock().await;
        conns.retain(|c| c.alive.load(Ordering::Acquire));
        if let Some(c) = conns
            .iter()
            .filter(|c| c.in_flight.load(Ordering::Acquire) < self.per_connection)
            .min_by_key(|c| c.in_flight.load(Ordering::Acquire))
        {
            return Ok(Arc::clone(c));
        }
        let stream = connect(&self.addr).await?;
        let _ = stream.set_nodelay(true);
        let (r, mut w) = stream.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let conn = Arc::new(ArborConn {
            tx,
            pending: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
            idle_closed: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
        });
        if let Some(t) = &self.auth_token {
            let _ = conn.tx.send(json!({ "auth": t }).to_string());
        }
        tokio::spawn(async move {
            while let Some(mut line) = rx.recv().await {
                line.push('\n');
                if w.write_all(line.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
        let reader = Arc::clone(&conn);
        let stray = Arc::clone(&self.stray);
        tokio::spawn(async move {
            let mut lines = BufReader::new(r).lines();
            let why = loop {
                match lines.next_line().await {
                    Ok(Some(l)) => route(&reader, &l, &stray),
                    Ok(None) => break "the server closed the connection".to_string(),
                    Err(e) => break format!("connection error: {e}"),
                }
            };
            reader.alive.store(false, Ordering::Release);
            for (_, tx) in reader.pending.lock().drain() {
                let _ = tx.send(Line::Closed(why.clone()));
            }
        });
        conns.push(Arc::clone(&conn));
        Ok(conn)
    }

    async fn send(&self, req: &Outgoing, stop: watch::Receiver<bool>) -> Reply {
        let mut retried = false;
        loop {
            let (mut reply, idle_closed) = self.send_once(req, stop.clone()).await;
            reply.drop_implausible_usage(req.max_tokens);
            let unsent = reply.events.is_empty()
                && matches!(&reply.outcome, Outcome::Failed { code, .. } if code == "connection_closed");
            if idle_closed && unsent && !retried && !*stop.borrow() {
                retried = true;
                continue;
            }
            return reply;
        }
    }

    /// Send a request on a pooled connection; the reply, and whether the server had closed that
    /// connection as idle.
    async fn send_once(&self, req: &Outgoing, mut stop: watch::Receiver<bool>) -> (Reply, bool) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut body = json!({
            "id": id,
            "max_tokens": req.max_tokens,
            "stream": true,
        });
        match &req.input {
            PromptInput::Text(t) => body["prompt"] = json!(t),
            PromptInput::Messages(m) => body["messages"] = json!(m),
        }
        if req.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if req.temperature > 0.0 {
            body["temperature"] = json!(req.temperature);
            body["seed"] = json!(req.seed);
            req.truncation(&mut body);
        }
        req.penalties.write(&mut body, false);
        if let Some(s) = &req.speculation {
            body["speculation"] = s.clone();
        }
        req.extra(&mut body);
        let line = body.to_string();
        if line.len() > self.max_line_bytes {
            // The server would drop the line with an error that names no request, and the
            // request would wait for a final line that never comes.
            let reply = Reply::failed(
                "line_too_long",
                format!(
                    "the request line is {} bytes, over --max-line-bytes {} (not sent)",
                    line.len(),
                    self.max_line_bytes
                ),
            );
            return (reply, false);
        }
        // A connection attempt the server never answers (a dropped SYN) must not outlast the
        // run: the stop ends the wait, and the connect itself times out.
        let conn = tokio::select! {
            c = self.conn() => match c {
                Ok(c) => c,
                Err(e) => return (Reply::failed("connect_failed", e), false),
            },
            _ = wait_stop(&mut stop) => return (Reply::ended(Outcome::Cancelled), false),
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        conn.pending.lock().insert(id, tx);
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        let mut reply = Reply::failed("connection_closed", "no reply");
        if conn.tx.send(line).is_err() || !conn.alive.load(Ordering::Acquire) {
            conn.pending.lock().remove(&id);
            conn.in_flight.fetch_sub(1, Ordering::AcqRel);
            let reply = Reply::failed(
                "connection_closed",
                "the connection was closed before sending",
            );
            return (reply, conn.idle_closed.load(Ordering::Acquire));
        }
        let mut cancelled_at: Option<Instant> = None;
        loop {
            let line = if cancelled_at.is_some() || *stop.borrow() {
                if cancelled_at.is_none() {
                    cancelled_at = Some(Instant::now());
                    let _ = conn.tx.send(json!({ "cancel": id }).to_string());
                }
                // The server answers a cancel with the final line once the KV blocks are free.
                match tokio::time::timeout(Duration::from_secs(10), rx.recv()).await {
                    Ok(l) => l,
                    Err(_) => {
                        reply.outcome = Outcome::Cancelled;
                        break;
                    }
                }
            } else {
                tokio::select! {
                    l = rx.recv() => l,
                    _ = stop.changed() => continue,
                }
            };
            match line {
                Some(Line::Tokens(at, n)) => reply.events.push((at, n)),
                Some(Line::Final(at, v)) => {
                    reply.end = at;
                    read_final(&v, &mut reply);
                    break;
                }
                Some(Line::Closed(why)) => {
                    reply.end = Instant::now();
                    reply.outcome = if cancelled_at.is_some() {
                        Outcome::Cancelled
                    } else {
                        Outcome::Failed {
                            code: "connection_closed".into(),
                            message: why,
                        }
                    };
                    break;
                }
                None => break,
            }
        }
        conn.pending.lock().remove(&id);
        conn.in_flight.fetch_sub(1, Ordering::AcqRel);
        (reply, conn.idle_closed.load(Ordering::Acquire))
    }
}

/// Route one server line to its request.
fn route(conn: &ArborConn, line: &str, stray: &Stray) {
    let at = Instant::now();
    if line.trim().is_empty() {
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        stray.line();
        return;
    };
    if v["error"]["code"].as_str() == Some("idle_timeout") {
        // Pooled connections idle between requests; the server closes them after a while.
        conn.idle_closed.store(true, Ordering::Release);
        conn.alive.store(false, Ordering::Release);
        return;
    }
    let Some(id) = v.get("id").and_then(Value::as_u64) else {
        // auth / health answers carry no id; an error about an unreadable line (or one too
        // long, `line_too_long`) has `id: null` and is counted by code. A cancel that crossed
        // the request's final line is answered `unknown_id` (with `"cancel": ID`): expected.
        if v.get("error").is_some() && !late_cancel(&v) {
            stray.value(&v);
        }
        return;
    };
    let pending = conn.pending.lock();
    let Some(tx) = pending.get(&id) else {
        if !late_cancel(&v) {
            stray.value(&v);
        }
        return;
    };
    let msg = if v.get("done").is_some() || v.get("error").is_some() {
        Line::Final(at, v)
    } else {
        let n = v
            .get("tokens")
            .and_then(Value::as_array)
            .map_or(0, |t| t.len());
        Line::Tokens(at, n as u32)
    };
    let _ = tx.send(msg);
}

/// The `unknown_id` answer to a cancel whose request had already ended.
fn late_cancel(v: &Value) -> bool {
    v["error"]["code"].as_str() == Some("unknown_id")
}

/// Fill a reply from a `done` or `error` line.
fn read_final(v: &Value, reply: &mut Reply) {
    if let Some(e) = v.get("error") {
        let code = e.get("code").and_then(Value::as_str).unwrap_or("unknown");
        reply.outcome = Outcome::Failed {
            code: code.into(),
            message: e
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .into(),
        };
        return;
    }
    let reason = v
        .get("finish_reason")
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_string();
    // A request that finished before the tool's cancel reached the server counts as completed;
    // one the server ended at its deadline or at shutdown did not complete: it failed.
    reply.outcome = match reason.as_str() {
        "cancelled" => Outcome::Cancelled,
        "deadline" => Outcome::Failed {
            code: "deadline".into(),
            message: "the server ended the request at its deadline (`--request-timeout`)".into(),
        },
        "shutdown" => Outcome::Failed {
            code: "shutdown".into(),
            message: "the server ended the request as it shut down".into(),
        },
        _ => Outcome::Completed {
            finish_reason: reason,
        },
    };
    let usage = &v["usage"];
    reply.usage_prompt_tokens = usage.get("prompt_tokens").and_then(Value::as_u64);
    reply.usage_completion_tokens = usage.get("completion_tokens").and_then(Value::as_u64);
    if let Some(s) = v.get("spec").filter(|s| s.is_object()) {
        let g = |k: &str| s.get(k).and_then(Value::as_u64).unwrap_or(0);
        reply.spec = Some(SpecRecord {
            steps: g("steps"),
            drafted: g("drafted"),
            accepted: g("accepted"),
        });
    }
}

/// OpenAI-compatible client: one HTTP/1.1 connection per request, `stream: true`.
pub struct OpenAiClient {
    addr: String,
    auth_token: Option<String>,
    /// The `model` field (llama-server ignores it).
    model: Option<String>,
}

impl OpenAiClient {
    async fn send(&self, req: &Outgoing, mut stop: watch::Receiver<bool>) -> Reply {
        let (path, mut body) = match &req.input {
            PromptInput::Text(t) => ("/v1/completions", json!({ "prompt": t })),
            PromptInput::Messages(m) => ("/v1/chat/completions", json!({ "messages": m })),
        };
        body["max_tokens"] = json!(req.max_tokens);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        body["temperature"] = json!(req.temperature);
        body["seed"] = json!(req.seed);
        if req.temperature > 0.0 {
            req.truncation(&mut body);
        }
        req.penalties.write(&mut body, true);
        if req.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        req.extra(&mut body);
        let chat = path.ends_with("chat/completions");
        tokio::select! {
            r = self.stream(path, body, chat, req.max_tokens) => r.unwrap_or_else(|(code, msg)| Reply::failed(code, msg)),
            _ = wait_stop(&mut stop) => {
                // Dropping the stream closes the connection, which cancels the request.
                Reply::ended(Outcome::Cancelled)
            }
        }
    }

    async fn stream(
        &self,
        path: &str,
        body: Value,
        chat: bool,
        max_tokens: usize,
    ) -> Result<Reply, (&'static str, String)> {
        let stream = connect(&self.addr)
            .await
            .map_err(|e| ("connect_failed", e))?;
        let _ = stream.set_nodelay(true);
        let io = hyper_util::rt::TokioIo::new(stream);
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| ("connection_closed", format!("HTTP handshake: {e}")))?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let _abort = AbortOnDrop(driver);
        let mut request = hyper::Request::post(path)
            .header(hyper::header::HOST, &self.addr)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::ACCEPT, "text/event-stream");
        if let Some(t) = &self.auth_token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| ("invalid_request", e.to_string()))?;
        let mut resp = sender
            .send_request(request)
            .await
            .map_err(|e| ("connection_closed", format!("HTTP request: {e}")))?;
        let status = resp.status();
        let mut reply = Reply::failed("connection_closed", "the stream ended without [DONE]");
        let mut buf: Vec<u8> = Vec::new();
        let mut finish: Option<String> = None;
        let mut done = false;
        // Text bytes per token event (a chunk may carry several tokens: see `spread_tokens`).
        let mut chunk_bytes: Vec<usize> = Vec::new();
        while let Some(frame) = resp.body_mut().frame().await {
            let frame = frame.map_err(|e| ("connection_closed", format!("HTTP body: {e}")))?;
            let at = Instant::now();
            let Some(data) = frame.data_ref() else {
                continue;
            };
            buf.extend_from_slice(data);
            if !status.is_success() {
                continue;
            }
            while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.trim().strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    done = true;
                    break;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(e) = v.get("error") {
                    return Err(("server_error", e.to_string()));
                }
                let choice = &v["choices"][0];
                let bytes = chunk_text_bytes(choice, chat);
                if bytes > 0 {
                    reply.events.push((at, 1));
                    chunk_bytes.push(bytes);
                }
                if let Some(f) = choice["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
                if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                    reply.usage_prompt_tokens = u["prompt_tokens"].as_u64();
                    reply.usage_completion_tokens = u["completion_tokens"].as_u64();
                }
            }
            if done {
                reply.end = at;
                break;
            }
        }
        if !status.is_success() {
            let v: Value = serde_json::from_slice(&buf).unwrap_or(Value::Null);
            let e = &v["error"];
            let code = e["type"]
                .as_str()
                .or_else(|| e["code"].as_str())
                .map(str::to_string)
                .unwrap_or_else(|| format!("http_{}", status.as_u16()));
            let message = e["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| String::from_utf8_lossy(&buf).into_owned());
            return Ok(Reply::ended(Outcome::Failed { code, message }));
        }
        // Usage no request could have is not believed (nor spread over the chunks).
        reply.drop_implausible_usage(max_tokens);
        if let Some(n) = reply.usage_completion_tokens {
            for (e, k) in reply.events.iter_mut().zip(spread_tokens(&chunk_bytes, n)) {
                e.1 = k;
            }
        }
        if done || finish.is_some() {
            if !done {
                reply.end = Instant::now();
            }
            reply.outcome = Outcome::Completed {
                finish_reason: finish.unwrap_or_else(|| "unknown".into()),
            };
        }
        Ok(reply)
    }
}

/// Text bytes one SSE chunk's choice carries: `text` (completions) or the delta's `content`
/// plus its reasoning text (`reasoning_content`, or `reasoning`: a reasoning model's first tokens,
/// which count toward TTFT and usage like the answer's).
pub fn chunk_text_bytes(choice: &Value, chat: bool) -> usize {
    let len = |v: &Value| v.as_str().map_or(0, str::len);
    if chat {
        let d = &choice["delta"];
        len(&d["content"]) + len(&d["reasoning_content"]) + len(&d["reasoning"])
    } else {
        len(&choice["text"])
    }
}

/// Tokens per SSE chunk when the server's `usage` counts `n` tokens over chunks of `bytes`
/// text bytes: OpenAI streams do not say how many tokens a chunk carries, and a speculating
/// server sends several per chunk. One each when `n` is at most the chunk count (the usual
/// case, exact); else every chunk one, and the surplus shared in proportion to the chunks'
/// bytes (largest remainders first): an estimate, so per-token ITL is not overstated by the
/// tokens per chunk.
pub fn spread_tokens(bytes: &[usize], n: u64) -> Vec<u32> {
    let chunks = bytes.len() as u64;
    let mut out = vec![1u32; bytes.len()];
    if chunks == 0 || n <= chunks {
        return out;
    }
    let surplus = n - chunks;
    let total: u64 = bytes.iter().map(|&b| b as u64).sum::<u64>().max(1);
    let mut given = 0u64;
    let mut rest: Vec<(u64, usize)> = Vec::with_capacity(bytes.len());
    for (i, &b) in bytes.iter().enumerate() {
        // u128: `surplus * b` can pass u64 for an absurd `n`.
        let share = u128::from(surplus) * b as u128;
        let k = (share / u128::from(total)) as u64;
        out[i] = out[i].saturating_add(u32::try_from(k).unwrap_or(u32::MAX));
        given += k;
        rest.push(((share % u128::from(total)) as u64, i));
    }
    rest.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in rest.iter().take((surplus - given) as usize) {
        out[i] = out[i].saturating_add(1);
    }
    out
}

/// A spawned task that is aborted when this handle goes (the HTTP connection driver, the
/// progress ticker).
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolve once `stop` is true (never if the sender is gone).
pub async fn wait_stop(stop: &mut watch::Receiver<bool>) {
    loop {
        if *stop.borrow() {
            return;
        }
        if stop.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse() {
        assert_eq!(
            Target::parse("arbor://127.0.0.1:7070").unwrap(),
            Target::Arbor {
                addr: "127.0.0.1:7070".into()
            }
        );
        assert_eq!(
            Target::parse("127.0.0.1:7070").unwrap(),
            Target::Arbor {
                addr: "127.0.0.1:7070".into()
            }
        );
        assert_eq!(
            Target::parse("openai://localhost:8080/").unwrap(),
            Target::OpenAi {
                addr: "localhost:8080".into()
            }
        );
        assert!(Target::parse("ftp://x:1").is_err());
        assert!(Target::parse("arbor://").is_err());
    }

    #[test]
    fn chunk_tokens_follow_usage_and_bytes() {
        // As many tokens as chunks (or fewer: a token split over chunks): one each.
        assert_eq!(spread_tokens(&[3, 5, 1], 3), vec![1, 1, 1]);
        assert_eq!(spread_tokens(&[3, 5, 1], 2), vec![1, 1, 1]);
        assert!(spread_tokens(&[], 9).is_empty());
        // 9 tokens over 3 chunks of 4, 8 and 0 bytes: 6 extra, 2 and 4 by bytes.
        assert_eq!(spread_tokens(&[4, 8, 0], 9), vec![3, 5, 1]);
        // Remainders: 2 extra over equal chunks go to the first ones.
        assert_eq!(spread_tokens(&[2, 2, 2], 5), vec![2, 2, 1]);
        // The sum is always the usage count.
        for n in 4..40u64 {
            let k = spread_tokens(&[7, 1, 13, 2], n);
            assert_eq!(k.iter().map(|&x| u64::from(x)).sum::<u64>(), n);
        }
        // An absurd count saturates instead of overflowing.
        assert_eq!(spread_tokens(&[1, 1], u64::MAX), vec![u32::MAX, u32::MAX]);
    }

    /// A chunk's text: a completion's `text`, a chat delta's answer and reasoning text.
    #[test]
    fn chunk_text_counts_answer_and_reasoning() {
        let c = |v: Value| v;
        assert_eq!(chunk_text_bytes(&c(json!({"text": "abc"})), false), 3);
        assert_eq!(
            chunk_text_bytes(&c(json!({"delta": {"content": "ab"}})), true),
            2
        );
        assert_eq!(
            chunk_text_bytes(&c(json!({"delta": {"reasoning_content": "think"}})), true),
            5
        );
        assert_eq!(
            chunk_text_bytes(&c(json!({"delta": {"reasoning": "hm"}})), true),
            2
        );
        assert_eq!(
            chunk_text_bytes(&c(json!({"delta": {"role": "assistant"}})), true),
            0
        );
        assert_eq!(
            chunk_text_bytes(&c(json!({"finish_reason": "stop"})), false),
            0
        );
    }

    /// A server's usage beyond what the request allowed, or speculation counts beyond it, are
    /// forgotten; plausible ones are kept.
    #[test]
    fn implausible_usage_is_dropped() {
        let mut r = Reply::ended(Outcome::Completed {
            finish_reason: "length".into(),
        });
        r.usage_completion_tokens = Some(16);
        r.usage_prompt_tokens = Some(5);
        r.spec = Some(SpecRecord {
            steps: 10,
            drafted: 40,
            accepted: 6,
        });
        let kept = {
            let mut k = r.clone();
            k.drop_implausible_usage(16);
            k
        };
        assert_eq!(kept.usage_completion_tokens, Some(16));
        assert_eq!(kept.usage_prompt_tokens, Some(5));
        assert!(kept.spec.is_some());
        r.usage_completion_tokens = Some(4_294_967_295);
        r.usage_prompt_tokens = Some(u64::MAX);
        r.spec = Some(SpecRecord {
            steps: u64::MAX,
            drafted: 1,
            accepted: 1,
        });
        r.drop_implausible_usage(16);
        assert_eq!(r.usage_completion_tokens, None);
        assert_eq!(r.usage_prompt_tokens, None);
        assert_eq!(r.spec, None);
    }
}
