//! The TCP server: line-delimited JSON over one connection per client (many requests multiplexed by id), each connection a session task that talks to the Engine only through its API.

pub mod codec;
pub mod protocol;
mod session;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tracing::Instrument;

use crate::api::Engine;

/// Server limits and settings.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Longest line accepted (bytes, newline excluded).
    pub max_line_bytes: usize,
    /// Most requests in flight on one connection (more: `too_many_requests`).
    pub max_requests_per_connection: usize,
    /// Most connections at once (more are closed at accept).
    pub max_connections: usize,
    /// Lines a connection may have waiting to be written; a client that lets more pile up is a
    /// slow reader: its requests are cancelled and the connection closed.
    pub out_queue_lines: usize,
    /// Token events a connection may have waiting (the engine side of the same rule).
    pub event_queue: usize,
    /// `{"auth": TOKEN}` must come first when set.
    pub auth_token: Option<String>,
    /// How long in-flight requests may run on after a shutdown signal.
    pub shutdown_grace: Duration,
    /// Socket send buffer size (tests make it small to exercise slow readers).
    pub send_buffer_bytes: Option<usize>,
    /// A connection with no request in flight that sends no line for this long is closed
    /// (after an `idle_timeout` line); None: never.
    pub idle_timeout: Option<Duration>,
    /// With `auth_token`, a connection that has not authenticated this long after it opened is
    /// closed (after an `unauthorized` line).
    pub auth_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_line_bytes: 1 << 20,
            max_requests_per_connection: 64,
            max_connections: 1024,
            out_queue_lines: 4096,
            event_queue: 4096,
            auth_token: None,
            shutdown_grace: Duration::from_secs(10),
            send_buffer_bytes: None,
            idle_timeout: Some(Duration::from_secs(300)),
            auth_timeout: Duration::from_secs(10),
        }
    }
}

/// Counters of the server itself.
#[derive(Debug, Default)]
pub struct ServerCounters {
    pub connections: AtomicUsize,
    pub connections_total: AtomicU64,
    pub slow_readers: AtomicU64,
    pub bad_lines: AtomicU64,
}

/// Serve `engine` on `listener` until `shutdown` resolves; then stop accepting, let in-flight
/// requests finish within the grace period (the rest end with `shutdown`), close every
/// connection after its final lines, and stop the engine.
pub async fn serve(
    engine: Arc<Engine>,
    listener: TcpListener,
    config: ServerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let config = Arc::new(config);
    let counters = Arc::new(ServerCounters::default());
    let (closing_tx, closing_rx) = tokio::sync::watch::channel(false);
    let mut sessions = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    let local = listener.local_addr()?;
    tracing::info!(%local, model = %engine.info().model, "listening");
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                if counters.connections.load(Ordering::Relaxed) >= config.max_connections {
                    tracing::warn!(%peer, "too many connections; closed");
                    // One error line, if the socket takes it now (never waits on the client).
                    let line = protocol::error_line(
                        None,
                        &crate::error::ServeError::new(
                            crate::error::codes::TOO_MANY_CONNECTIONS,
                            format!(
                                "the server has {} connections (its limit); try again later",
                                config.max_connections
                            ),
                        ),
                    ) + "\n";
                    let _ = stream.try_write(line.as_bytes());
                    drop(stream);
                    continue;
                }
                counters.connections.fetch_add(1, Ordering::Relaxed);
                let conn = counters.connections_total.fetch_add(1, Ordering::Relaxed);
                let s = session::Session::new(
                    Arc::clone(&engine),
                    Arc::clone(&config),
                    Arc::clone(&counters),
                    closing_rx.clone(),
                );
                let span = tracing::info_span!("connection", conn, %peer);
                sessions.spawn(s.run(stream).instrument(span));
            }
            Some(_) = sessions.join_next(), if !sessions.is_empty() => {}
        }
    }
    tracing::info!(
        in_flight_connections = sessions.len(),
        grace_ms = config.shutdown_grace.as_millis() as u64,
        "shutdown: no new connections"
    );
    drop(listener);
    // Sessions refuse new requests from here; the engine ends what is left after the grace.
    let _ = closing_tx.send(true);
    Arc::clone(&engine)
        .shutdown_async(config.shutdown_grace)
        .await;
    // Sessions have their final lines now: let them flush and close.
    while tokio::time::timeout(Duration::from_secs(5), sessions.join_next())
        .await
        .ok()
        .flatten()
        .is_some()
    {}
    sessions.abort_all();
    tracing::info!("server stopped");
    Ok(())
}

/// A server on its own thread and tokio runtime (tests, benchmarks, programs that embed it).
pub struct BackgroundServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl BackgroundServer {
    /// Bind `addr` (`127.0.0.1:0` for any free port) and serve `engine` until shut down.
    pub fn start(
        engine: Arc<Engine>,
        addr: &str,
        config: ServerConfig,
    ) -> std::io::Result<BackgroundServer> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let listener = rt.block_on(TcpListener::bind(addr))?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("arbor-server".into())
            .spawn(move || {
                rt.block_on(serve(engine, listener, config, async {
                    let _ = stopped.await;
                }))
            })?;
        Ok(BackgroundServer {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Begin the graceful shutdown (as SIGTERM does) without waiting for it.
    pub fn signal_shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// Shut down and wait until the server has stopped.
    pub fn shutdown(&mut self) -> std::io::Result<()> {
        self.signal_shutdown();
        match self.thread.take().map(std::thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(std::io::Error::other("the server thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

/// Bind `addr` (e.g. `127.0.0.1:7070`).
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

pub fn local_addr(l: &TcpListener) -> std::io::Result<SocketAddr> {
    l.local_addr()
}
