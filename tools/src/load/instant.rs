//! A test-only "instant" server speaking Arbor's line protocol (or an OpenAI-style SSE stream): it answers every request at once with `max_tokens` tokens and a final line, so the load generator's own ceiling can be measured (`arbor bench load-tool`) and the tool tested without a model.

use std::net::SocketAddr;
use std::thread::JoinHandle;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A background instant server on its own thread; stops on drop.
pub struct InstantServer {
    pub addr: SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl InstantServer {
    /// Listen on loopback (Arbor protocol); each token event carries `tokens_per_event` tokens.
    pub fn start(tokens_per_event: usize) -> std::io::Result<InstantServer> {
        Self::start_with(tokens_per_event, false)
    }

    /// Listen on loopback as an OpenAI-compatible server (`/v1/completions`, `stream: true`).
    pub fn start_openai() -> std::io::Result<InstantServer> {
        Self::start_with(1, true)
    }

    fn start_with(tokens_per_event: usize, openai: bool) -> std::io::Result<InstantServer> {
        let per = tokens_per_event.max(1);
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (tx, mut rx) = oneshot::channel::<()>();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = std::sync::Arc::clone(&accepted);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("instant-server".into())
            .spawn(move || {
                rt.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(std_listener) else {
                        return;
                    };
                    loop {
                        tokio::select! {
                            _ = &mut rx => break,
                            c = listener.accept() => {
                                if let Ok((sock, _)) = c {
                                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                    if openai {
                                        tokio::spawn(http_connection(sock));
                                    } else {
                                        tokio::spawn(connection(sock, per));
                                    }
                                }
                            }
                        }
                    }
                });
            })?;
        Ok(InstantServer {
            addr,
            accepted,
            stop: Some(tx),
            thread: Some(thread),
        })
    }
}

impl InstantServer {
    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for InstantServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn connection(sock: tokio::net::TcpStream, per: usize) {
    let _ = sock.set_nodelay(true);
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    let mut out = String::new();
    while let Ok(Some(line)) = lines.next_line().await {
        out.clear();
        answer(&line, per, &mut out);
        if !out.is_empty() && w.write_all(out.as_bytes()).await.is_err() {
            break;
        }
    }
}

fn answer(line: &str, per: usize, out: &mut String) {
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        push(
            out,
            json!({"id": null, "error": {"code": "invalid_json", "message": "invalid JSON"}}),
        );
        return;
    };
    if v.get("auth").is_some() {
        push(out, json!({"auth": "ok"}));
        return;
    }
    if v.get("health").is_some() {
        push(
            out,
            json!({"health": "ok", "model": "instant", "context_length": 1 << 20, "drafters": []}),
        );
        return;
    }
    let id = v.get("id").cloned().unwrap_or(Value::Null);
    if let Some(c) = v.get("cancel") {
        push(
            out,
            // As `arbor serve` answers it: no request ends here (`"id": null`).
            json!({"id": null, "cancel": c, "error": {"code": "unknown_id", "message": "no such request"}}),
        );
        return;
    }
    let n = v.get("max_tokens").and_then(Value::as_u64).unwrap_or(128) as usize;
    let prompt_tokens = v
        .get("prompt")
        .and_then(Value::as_str)
        .map_or(1, |p| p.split_whitespace().count().max(1));
    let mut left = n;
    while left > 0 {
        let k = left.min(per);
        let toks: Vec<u32> = (0..k as u32).collect();
        push(
            out,
            json!({"id": id, "text": "x".repeat(k), "tokens": toks}),
        );
        left -= k;
    }
    push(
        out,
        json!({"id": id, "done": true, "finish_reason": "length",
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "cached_prompt_tokens": 0},
               "spec": null, "timing": {"queue_ms": 0.0, "ttft_ms": 0.0, "total_ms": 0.0}}),
    );
}

fn push(out: &mut String, v: Value) {
    out.push_str(&v.to_string());
    out.push('\n');
}

/// One HTTP/1.1 request per connection: a chunked `text/event-stream` of one-token chunks, a
/// usage chunk and `[DONE]`; a request without `max_tokens` gets a 400 with an OpenAI error body.
async fn http_connection(sock: tokio::net::TcpStream) {
    let _ = sock.set_nodelay(true);
    let (r, mut w) = sock.into_split();
    let mut r = BufReader::new(r);
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        match r.read_line(&mut h).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; len.min(1 << 20)];
    if tokio::io::AsyncReadExt::read_exact(&mut r, &mut body)
        .await
        .is_err()
    {
        return;
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let Some(n) = v.get("max_tokens").and_then(Value::as_u64) else {
        let b = json!({"error": {"type": "invalid_request_error", "message": "max_tokens is required"}}).to_string();
        let _ = w
            .write_all(format!("HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}", b.len()).as_bytes())
            .await;
        return;
    };
    let mut out = String::from(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
    );
    let mut chunk = |data: String| {
        let ev = format!("data: {data}\n\n");
        out.push_str(&format!("{:x}\r\n{ev}\r\n", ev.len()));
    };
    for i in 0..n {
        let fin = if i + 1 == n {
            json!("length")
        } else {
            Value::Null
        };
        chunk(json!({"choices": [{"index": 0, "text": "x", "finish_reason": fin}]}).to_string());
    }
    chunk(
        json!({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}}).to_string(),
    );
    chunk("[DONE]".into());
    out.push_str("0\r\n\r\n");
    let _ = w.write_all(out.as_bytes()).await;
    let _ = w.shutdown().await;
}
