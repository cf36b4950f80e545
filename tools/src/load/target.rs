//! Load targets: Arbor's line-delimited JSON protocol (many requests multiplexed per connection, docs/protocol.md) and an OpenAI-compatible `/v1/completions` / `/v1/chat/completions` server-sent-event stream (llama.cpp's `llama-server`), timed per token event.

use std::collections::HashMap;
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
    pub fn parse(s: &str) -> Result<Target, LoadError> {
        let (scheme, addr) = s.split_once("://").unwrap_or(("arbor", s));
        let addr = addr.trim_end_matches('/').to_string();
        if addr.is_empty() || !addr.contains(':') {
            return Err(LoadError::Invalid(format!(
                "target '{s}' needs HOST:PORT (e.g. arbor://127.0.0.1:7070)"
            )));
        }
        match scheme {
            "arbor" => Ok(Target::Arbor { addr }),
            "openai" | "http" => Ok(Target::OpenAi { addr }),
            other => Err(LoadError::Invalid(format!(
                "unknown target scheme '{other}://' (arbor://, openai://)"
            ))),
        }
    }

    pub fn url(&self) -> String {
        match self {
            Target::Arbor { addr } => format!("arbor://{addr}"),
            Target::OpenAi { addr } => format!("openai://{addr}"),
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
    pub seed: u64,
    /// Arbor's `speculation` object, passed through unchanged.
    pub speculation: Option<Value>,
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
    fn failed(code: &str, message: impl Into<String>) -> Reply {
        Reply::ended(Outcome::Failed {
            code: code.into(),
            message: message.into(),
        })
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

/// A connected client for a target, shared by every request of a run.
pub enum Client {
    Arbor(ArborClient),
    OpenAi(OpenAiClient),
}

impl Client {
    pub fn new(target: &Target, auth_token: Option<String>, model: Option<String>) -> Client {
        match target {
            Target::Arbor { addr } => Client::Arbor(ArborClient::new(addr.clone(), auth_token)),
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
            Client::Arbor(c) => c.stray.load(Ordering::Relaxed),
            Client::OpenAi(_) => 0,
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
    in_flight: AtomicUsize,
}

/// Arbor protocol client: a pool of connections, each carrying up to `per_connection` requests.
pub struct ArborClient {
    addr: String,
    auth_token: Option<String>,
    conns: tokio::sync::Mutex<Vec<Arc<ArborConn>>>,
    next_id: AtomicU64,
    stray: Arc<AtomicU64>,
    /// Below the server's `--max-requests-per-connection` (64).
    pub per_connection: usize,
}

impl ArborClient {
    pub fn new(addr: String, auth_token: Option<String>) -> ArborClient {
        ArborClient {
            addr,
            auth_token,
            conns: tokio::sync::Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            stray: Arc::new(AtomicU64::new(0)),
            per_connection: 48,
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
        let stream = TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.addr))?;
        let _ = stream.set_nodelay(true);
        let (r, mut w) = stream.into_split();
        let (tx, mut rx) = mpsc::unbounded_channel::<String>();
        let conn = Arc::new(ArborConn {
            tx,
            pending: Mutex::new(HashMap::new()),
            alive: AtomicBool::new(true),
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

    async fn send(&self, req: &Outgoing, mut stop: watch::Receiver<bool>) -> Reply {
        let conn = match self.conn().await {
            Ok(c) => c,
            Err(e) => return Reply::failed("connect_failed", e),
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, mut rx) = mpsc::unbounded_channel();
        conn.pending.lock().insert(id, tx);
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
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
        }
        if let Some(s) = &req.speculation {
            body["speculation"] = s.clone();
        }
        let mut reply = Reply::failed("connection_closed", "no reply");
        if conn.tx.send(body.to_string()).is_err() || !conn.alive.load(Ordering::Acquire) {
            conn.pending.lock().remove(&id);
            conn.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Reply::failed(
                "connection_closed",
                "the connection was closed before sending",
            );
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
        reply
    }
}

/// Route one server line to its request.
fn route(conn: &ArborConn, line: &str, stray: &AtomicU64) {
    let at = Instant::now();
    if line.trim().is_empty() {
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        stray.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let Some(id) = v.get("id").and_then(Value::as_u64) else {
        // auth / health answers carry no id; an error about an unreadable line has `id: null`.
        if v.get("error").is_some() {
            stray.fetch_add(1, Ordering::Relaxed);
        }
        return;
    };
    let pending = conn.pending.lock();
    let Some(tx) = pending.get(&id) else {
        // A cancel that crossed the request's final line is answered `unknown_id`: expected.
        let late_cancel = v["error"]["code"].as_str() == Some("unknown_id");
        if !late_cancel {
            stray.fetch_add(1, Ordering::Relaxed);
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
    // A request that finished before the tool's cancel reached the server counts as completed.
    reply.outcome = if reason == "cancelled" {
        Outcome::Cancelled
    } else {
        Outcome::Completed {
            finish_reason: reason,
        }
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
        if req.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        let chat = path.ends_with("chat/completions");
        tokio::select! {
            r = self.stream(path, body, chat) => r.unwrap_or_else(|(code, msg)| Reply::failed(code, msg)),
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
    ) -> Result<Reply, (&'static str, String)> {
        let stream = TcpStream::connect(&self.addr).await.map_err(|e| {
            (
                "connect_failed",
                format!("cannot connect to {}: {e}", self.addr),
            )
        })?;
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
                let text = if chat {
                    choice["delta"]["content"].as_str()
                } else {
                    choice["text"].as_str()
                };
                if text.is_some_and(|t| !t.is_empty()) {
                    reply.events.push((at, 1));
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
}
