//! One TCP connection: frames lines, answers each with its own error code when it is bad, multiplexes the connection's requests by id, and cancels them all when the client goes away or stops reading.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;
use subtle::ConstantTimeEq;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_util::codec::FramedRead;

use super::codec::{Frame, LineCodec};
use super::protocol::{self, ClientLine, LineError};
use super::{ServerConfig, ServerCounters};
use crate::api::Engine;
use crate::error::{codes, ServeError};
use crate::events::{Event, FinishReason, RequestId};
use crate::messages::EventSink;
use crate::request::ValidRequest;

/// One request line: one engine request, or one per choice when it asks for `n` > 1.
struct Group {
    client_id: Value,
    stream: bool,
    span: tracing::Span,
    /// Choices 1.. wait for choice 0's first event: its prompt's full blocks are then in the
    /// prefix cache, and the other choices share them instead of computing them again.
    deferred: Option<Deferred>,
    /// Each choice's end (its entry of the final line), by index; length `n`.
    ends: Vec<Option<Value>>,
}

struct Deferred {
    req: ValidRequest,
    submitted: Instant,
}

impl Group {
    fn n(&self) -> usize {
        self.ends.len()
    }

    /// End choices 1.. unstarted with `reason` (the request ended before they were submitted).
    fn end_unstarted(&mut self, reason: FinishReason) {
        for (i, end) in self.ends.iter_mut().enumerate().skip(1) {
            *end = Some(protocol::unstarted_choice_value(i, reason, self.stream));
        }
    }
}

pub(super) struct Session {
    engine: Arc<Engine>,
    config: Arc<ServerConfig>,
    counters: Arc<ServerCounters>,
    closing: watch::Receiver<bool>,
    authed: bool,
    /// Engine id → (canonical JSON of its client id, choice index).
    in_flight: HashMap<RequestId, (String, usize)>,
    /// Canonical JSON of a client id → its request (duplicates are refused).
    by_client: HashMap<String, Group>,
}

/// Why a session ended.
#[derive(Debug, PartialEq, Eq)]
enum End {
    ClientClosed,
    WriteFailed,
    SlowReader,
    Shutdown,
    /// Nothing in flight and nothing received for the idle timeout (or no auth in time).
    Idle,
}

/// Keep-alive probes after a minute of silence: a peer that vanished (no FIN, no RST) while a
/// non-streaming request runs is found out and its request cancelled well before its deadline.
const KEEPALIVE: Duration = Duration::from_secs(60);

/// How long a reply to a client's line waits for room in a full outgoing queue before the
/// client counts as not reading.
const REPLY_WAIT: Duration = Duration::from_secs(10);

impl Session {
    pub(super) fn new(
        engine: Arc<Engine>,
        config: Arc<ServerConfig>,
        counters: Arc<ServerCounters>,
        closing: watch::Receiver<bool>,
    ) -> Session {
        let authed = config.auth_token.is_none();
        Session {
            engine,
            config,
            counters,
            closing,
            authed,
            in_flight: HashMap::new(),
            by_client: HashMap::new(),
        }
    }

    pub(super) async fn run(mut self, stream: TcpStream) {
        tracing::debug!("connected");
        if let Some(n) = self.config.send_buffer_bytes {
            let _ = socket2::SockRef::from(&stream).set_send_buffer_size(n);
        }
        let _ = stream.set_nodelay(true);
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE)
                .with_interval(Duration::from_secs(10)),
        );
        let opened = tokio::time::Instant::now();
        let mut last_line = opened;
        let (rd, wr) = stream.into_split();
        let (out_tx, out_rx) = mpsc::channel::<String>(self.config.out_queue_lines.max(1));
        let write_failed = Arc::new(AtomicBool::new(false));
        let mut writer = tokio::spawn(write_lines(wr, out_rx, Arc::clone(&write_failed)));
        let (ev_tx, mut ev_rx) = mpsc::channel::<Event>(self.config.event_queue.max(1));
        let overflowed = Arc::new(AtomicBool::new(false));
        let sink = EventSink::Bounded {
            tx: ev_tx,
            overflowed: Arc::clone(&overflowed),
        };
        let mut lines = FramedRead::new(rd, LineCodec::new(self.config.max_line_bytes));
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let end = loop {
            if overflowed.load(Ordering::Relaxed) {
                break End::SlowReader;
            }
            if write_failed.load(Ordering::Relaxed) {
                break End::WriteFailed;
            }
            if *self.closing.borrow() && self.in_flight.is_empty() {
                break End::Shutdown;
            }
            // Idle time counts from the last line or the last request's end, whichever is later.
            if !self.in_flight.is_empty() {
                last_line = tokio::time::Instant::now();
            }
            if let Some(line) = self.timed_out(opened, last_line) {
                let _ = out_tx.try_send(line);
                break End::Idle;
            }
            tokio::select! {
                frame = lines.next() => match frame {
                    None | Some(Err(_)) => break End::ClientClosed,
                    Some(Ok(frame)) => {
                        last_line = tokio::time::Instant::now();
                        let reply = self.on_frame(frame, &sink).await;
                        // Replies to the client's own lines wait for room in the queue (a
                        // burst of pipelined lines is read as fast as the client takes the
                        // answers); only a client that takes none for `REPLY_WAIT` is slow.
                        for line in reply {
                            let sent = tokio::time::timeout(REPLY_WAIT, out_tx.send(line)).await;
                            if !matches!(sent, Ok(Ok(()))) {
                                overflowed.store(true, Ordering::Relaxed);
                                break;
                            }
                        }
                    }
                },
                ev = ev_rx.recv() => {
                    let Some(ev) = ev else { break End::Shutdown };
                    if let Some(line) = self.on_event(ev, &sink) {
                        if out_tx.try_send(line).is_err() {
                            overflowed.store(true, Ordering::Relaxed);
                        }
                    }
                }
                _ = tick.tick() => {}
                _ = self.closing.changed() => {}
            }
        };
        match end {
            End::SlowReader => {
                self.counters.slow_readers.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    requests = self.in_flight.len(),
                    "client stopped reading: its requests are cancelled, connection closed"
                );
            }
            End::ClientClosed | End::WriteFailed if !self.in_flight.is_empty() => {
                tracing::info!(
                    requests = self.in_flight.len(),
                    "client went away: its requests are cancelled"
                );
            }
            _ => {}
        }
        for (&id, (key, _)) in &self.in_flight {
            if let Some(g) = self.by_client.get(key) {
                g.span
                    .in_scope(|| tracing::info!(request = id, "cancelled: connection ended"));
            }
            self.engine.cancel(id);
        }
        drop(out_tx);
        if end == End::SlowReader || end == End::WriteFailed {
            writer.abort();
        } else if tokio::time::timeout(Duration::from_secs(5), &mut writer)
            .await
            .is_err()
        {
            // A peer that does not read its last lines: dropping the handle would leave the
            // task (and the socket) behind.
            writer.abort();
        }
        self.counters.connections.fetch_sub(1, Ordering::Relaxed);
        tracing::debug!(?end, "disconnected");
    }

    /// The line to close an idle (or never authenticated) connection with, when it is time.
    fn timed_out(
        &self,
        opened: tokio::time::Instant,
        last_line: tokio::time::Instant,
    ) -> Option<String> {
        if !self.authed && opened.elapsed() >= self.config.auth_timeout {
            tracing::info!("no auth in time: connection closed");
            return Some(protocol::error_line(
                None,
                &ServeError::new(
                    codes::UNAUTHORIZED,
                    format!(
                        "no {{\"auth\": TOKEN}} within {} s: connection closed",
                        self.config.auth_timeout.as_secs_f64()
                    ),
                ),
            ));
        }
        let idle = self.config.idle_timeout?;
        if self.in_flight.is_empty() && last_line.elapsed() >= idle {
            tracing::debug!("idle: connection closed");
            return Some(protocol::error_line(
                None,
                &ServeError::new(
                    codes::IDLE_TIMEOUT,
                    format!(
                        "no request and no line for {} s: connection closed",
                        idle.as_secs_f64()
                    ),
                ),
            ));
        }
        None
    }

    /// The lines that answer one frame.
    async fn on_frame(&mut self, frame: Frame, sink: &EventSink) -> Vec<String> {
        let bytes = match frame {
            Frame::TooLong { bytes } => {
                self.counters.bad_lines.fetch_add(1, Ordering::Relaxed);
                return vec![protocol::error_line(
                    None,
                    &ServeError::new(
                        codes::LINE_TOO_LONG,
                        format!(
                            "a line of {bytes} bytes is over the limit of {} (dropped)",
                            self.config.max_line_bytes
                        ),
                    ),
                )];
            }
            Frame::Line(b) => b,
        };
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Vec::new(); // blank lines are keep-alives
        }
        let parsed = protocol::parse_line(&bytes);
        let line = match parsed {
            Ok(l) => l,
            Err(LineError { id, error }) => {
                self.counters.bad_lines.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(code = error.code, "bad line");
                // A bad line reusing the id of a running request must not read as its end.
                return match id {
                    Some(id) if self.by_client.contains_key(&id.to_string()) => {
                        vec![protocol::rejected_line("rejected_id", &id, &error)]
                    }
                    id => vec![protocol::error_line(id.as_ref(), &error)],
                };
            }
        };
        if !self.authed {
            return match line {
                ClientLine::Auth(t) => {
                    let want = self.config.auth_token.as_deref().unwrap_or_default();
                    if bool::from(t.as_bytes().ct_eq(want.as_bytes())) {
                        self.authed = true;
                        vec![r#"{"auth":"ok"}"#.to_string()]
                    } else {
                        tracing::warn!("wrong auth token");
                        vec![protocol::error_line(
                            None,
                            &ServeError::new(codes::UNAUTHORIZED, "wrong auth token"),
                        )]
                    }
                }
                ClientLine::Request { id, .. } => {
                    vec![protocol::error_line(Some(&id), &unauthorized())]
                }
                ClientLine::Cancel(id) => {
                    vec![protocol::rejected_line("cancel", &id, &unauthorized())]
                }
                _ => vec![protocol::error_line(None, &unauthorized())],
            };
        }
        match line {
            // Already authenticated: the token is still checked (a client asking whether its
            // token is good is not told so when it is not); a server without a token says so.
            ClientLine::Auth(t) => match self.config.auth_token.as_deref() {
                None => vec![r#"{"auth":"not_required"}"#.to_string()],
                Some(want) if bool::from(t.as_bytes().ct_eq(want.as_bytes())) => {
                    vec![r#"{"auth":"ok"}"#.to_string()]
                }
                Some(_) => vec![protocol::error_line(
                    None,
                    &ServeError::new(codes::UNAUTHORIZED, "wrong auth token"),
                )],
            },
            ClientLine::Health => vec![protocol::health_line(self.engine.info())],
            ClientLine::Stats => {
                let conns = self.counters.connections.load(Ordering::Relaxed);
                match self.engine.stats_async().await {
                    Some(s) => {
                        let slow = self.counters.slow_readers.load(Ordering::Relaxed);
                        vec![protocol::stats_line(&s, conns, slow)]
                    }
                    None => vec![protocol::error_line(
                        None,
                        &ServeError::new(codes::SHUTTING_DOWN, "the engine has stopped"),
                    )],
                }
            }
            ClientLine::Cancel(id) => match self.by_client.get_mut(&id.to_string()) {
                // The final `done` (cancelled) follows once the request's blocks are free.
                Some(g) => {
                    // Choices not started yet end here.
                    if g.deferred.take().is_some() {
                        g.end_unstarted(FinishReason::Cancelled);
                    }
                    let key = id.to_string();
                    for (&eid, _) in self.in_flight.iter().filter(|(_, (k, _))| *k == key) {
                        self.engine.cancel(eid);
                    }
                    Vec::new()
                }
                None => vec![protocol::rejected_line(
                    "cancel",
                    &id,
                    &ServeError::new(
                        codes::UNKNOWN_ID,
                        format!("no request {id} in flight on this connection"),
                    ),
                )],
            },
            ClientLine::Request { id, stream, n, req } => {
                let key = id.to_string();
                if self.by_client.contains_key(&key) {
                    return vec![protocol::rejected_line(
                        "rejected_id",
                        &id,
                        &ServeError::new(
                            codes::DUPLICATE_ID,
                            format!("request {id} is still in flight on this connection"),
                        ),
                    )];
                }
                // Every choice counts; one request can never have more choices than the
                // connection or the engine's waiting queue holds.
                let (per_conn, waiting) = (
                    self.config.max_requests_per_connection,
                    self.engine.limits().max_waiting,
                );
                if n > per_conn || n - 1 > waiting {
                    return vec![protocol::error_line(
                        Some(&id),
                        &ServeError::invalid(format!(
                            "'n' must be at most {} (--max-requests-per-connection {per_conn}, \
                             --max-waiting {waiting})",
                            per_conn.min(waiting + 1)
                        )),
                    )];
                }
                let choices: usize = self.by_client.values().map(Group::n).sum();
                if choices + n > per_conn {
                    return vec![protocol::error_line(
                        Some(&id),
                        &ServeError::new(
                            codes::TOO_MANY_REQUESTS,
                            format!(
                                "this connection has {choices} requests (choices) in flight; {n} \
                                 more would pass the limit of {}",
                                self.config.max_requests_per_connection
                            ),
                        ),
                    )];
                }
                if *self.closing.borrow() {
                    return vec![protocol::error_line(
                        Some(&id),
                        &ServeError::new(codes::SHUTTING_DOWN, "the server is shutting down"),
                    )];
                }
                let valid = match self.engine.validate(*req) {
                    Ok(v) => v,
                    Err(e) => return vec![protocol::error_line(Some(&id), &e)],
                };
                let deferred = (n > 1).then(|| Deferred {
                    req: valid.clone(),
                    submitted: Instant::now(),
                });
                match self.engine.submit_to(valid, sink.clone()) {
                    Ok(eid) => {
                        let span = tracing::info_span!("request", id = %id, engine_id = eid);
                        span.in_scope(|| tracing::debug!(stream, n, "submitted"));
                        self.in_flight.insert(eid, (key.clone(), 0));
                        self.by_client.insert(
                            key,
                            Group {
                                client_id: id,
                                stream,
                                span,
                                deferred,
                                ends: vec![None; n],
                            },
                        );
                        Vec::new()
                    }
                    Err(e) => vec![protocol::error_line(Some(&id), &e)],
                }
            }
        }
    }

    fn on_event(&mut self, ev: Event, sink: &EventSink) -> Option<String> {
        let eid = ev.id();
        let (key, index) = self.in_flight.get(&eid)?.clone();
        let g = self.by_client.get(&key)?;
        if g.n() == 1 {
            let line = protocol::event_line(&g.client_id, &ev, g.stream);
            if ev.is_final() {
                self.in_flight.remove(&eid);
                if let Some(g) = self.by_client.remove(&key) {
                    g.span.in_scope(|| log_end(&ev));
                }
            }
            return line;
        }
        // Choice 0's first event: its prompt is in the cache, the other choices start (or end
        // as it did, if it ended before producing anything).
        if index == 0 && g.deferred.is_some() {
            let early = match &ev {
                Event::Done(c)
                    if matches!(
                        c.finish_reason,
                        FinishReason::Cancelled | FinishReason::Deadline | FinishReason::Shutdown
                    ) =>
                {
                    Some(c.finish_reason)
                }
                _ => None,
            };
            if let Err(e) = self.start_choices(&key, early, matches!(ev, Event::Error { .. }), sink)
            {
                return Some(self.fail_group(&key, &e));
            }
        }
        match &ev {
            Event::Tokens { .. } => {
                let g = self.by_client.get(&key)?;
                protocol::choice_tokens_line(&g.client_id, index, &ev, g.stream)
            }
            Event::Done(c) => {
                self.in_flight.remove(&eid);
                let g = self.by_client.get_mut(&key)?;
                g.ends[index] = Some(protocol::choice_value(index, c, g.stream));
                self.end_if_complete(&key)
            }
            // A later choice the engine refused because it is shutting down (submitted as the
            // shutdown began) ends unstarted, as the docs say, instead of failing the others.
            Event::Error { error, .. } if index > 0 && error.code == codes::SHUTTING_DOWN => {
                self.in_flight.remove(&eid);
                let g = self.by_client.get_mut(&key)?;
                g.ends[index] = Some(protocol::unstarted_choice_value(
                    index,
                    FinishReason::Shutdown,
                    g.stream,
                ));
                self.end_if_complete(&key)
            }
            Event::Error { error, .. } => Some(self.fail_group(&key, error)),
        }
    }

    /// The final line of request `key` once every choice has ended.
    fn end_if_complete(&mut self, key: &str) -> Option<String> {
        if self.by_client.get(key)?.ends.iter().any(Option::is_none) {
            return None;
        }
        let g = self.by_client.remove(key)?;
        let ends: Vec<Value> = g.ends.into_iter().flatten().collect();
        let completion: u64 = ends
            .iter()
            .map(|c| c["usage"]["completion_tokens"].as_u64().unwrap_or(0))
            .sum();
        g.span.in_scope(|| {
            tracing::info!(choices = ends.len(), completion_tokens = completion, "done")
        });
        Some(protocol::choices_line(&g.client_id, ends))
    }

    /// Submit choices 1.. of the request `key` (seeds `seed + i`, the deadline what is left of
    /// the request's), or end them unstarted: with `early` (choice 0 was cancelled or ran out
    /// of time first), or `shutdown` when the server is closing; when choice 0 failed
    /// (`failed`) the request fails with it.
    fn start_choices(
        &mut self,
        key: &str,
        early: Option<FinishReason>,
        failed: bool,
        sink: &EventSink,
    ) -> Result<(), ServeError> {
        let Some(g) = self.by_client.get_mut(key) else {
            return Ok(());
        };
        let Some(d) = g.deferred.take() else {
            return Ok(());
        };
        if failed {
            return Ok(());
        }
        let early = early.or_else(|| (*self.closing.borrow()).then_some(FinishReason::Shutdown));
        if let Some(reason) = early {
            g.end_unstarted(reason);
            return Ok(());
        }
        let elapsed = d.submitted.elapsed();
        for i in 1..g.n() {
            let mut req = d.req.clone();
            req.params.sampling.seed = req.params.sampling.seed.wrapping_add(i as u64);
            // The prompt is scored once, by choice 0 (the others read it from the cache).
            req.params.prompt_logprobs = None;
            req.deadline = req
                .deadline
                .map(|t| t.saturating_sub(elapsed).max(Duration::from_millis(1)));
            let eid = self.engine.submit_to(req, sink.clone())?;
            self.in_flight.insert(eid, (key.to_string(), i));
        }
        Ok(())
    }

    /// End request `key` with `error`: its other choices are cancelled and their events
    /// dropped.
    fn fail_group(&mut self, key: &str, error: &ServeError) -> String {
        let ids: Vec<RequestId> = self
            .in_flight
            .iter()
            .filter(|(_, (k, _))| k == key)
            .map(|(&eid, _)| eid)
            .collect();
        for eid in ids {
            self.in_flight.remove(&eid);
            self.engine.cancel(eid);
        }
        match self.by_client.remove(key) {
            Some(g) => {
                g.span.in_scope(
                    || tracing::info!(code = error.code, error = %error.message, "failed"),
                );
                protocol::error_line(Some(&g.client_id), error)
            }
            None => protocol::error_line(None, error),
        }
    }
}

fn log_end(ev: &Event) {
    match ev {
        Event::Done(c) => tracing::info!(
            finish = c.finish_reason.as_str(),
            prompt_tokens = c.usage.prompt_tokens,
            completion_tokens = c.usage.completion_tokens,
            total_ms = c.timing.total_ms,
            "done"
        ),
        Event::Error { error, .. } => {
            tracing::info!(code = error.code, error = %error.message, "failed")
        }
        Event::Tokens { .. } => {}
    }
}

fn unauthorized() -> ServeError {
    ServeError::new(
        codes::UNAUTHORIZED,
        "send {\"auth\": TOKEN} before anything else",
    )
}

/// Write queued lines, flushing whenever the queue runs dry.
async fn write_lines(
    wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::Receiver<String>,
    failed: Arc<AtomicBool>,
) {
    let mut wr = tokio::io::BufWriter::new(wr);
    while let Some(mut line) = rx.recv().await {
        line.push('\n');
        if wr.write_all(line.as_bytes()).await.is_err() {
            failed.store(true, Ordering::Relaxed);
            return;
        }
        if rx.is_empty() && wr.flush().await.is_err() {
            failed.store(true, Ordering::Relaxed);
            return;
        }
    }
    let _ = wr.flush().await;
    let _ = wr.shutdown().await;
}
