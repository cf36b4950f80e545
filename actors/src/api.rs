//! The in-process API: `Engine::start` runs the actors on their own threads; callers submit requests and read their events from a blocking receiver or an async `Stream`, without knowing actix.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use actix::{Actor, Addr, Arbiter, SyncArbiter};
use parking_lot::Mutex;

use crate::config::{EngineConfig, Limits};
use crate::drafter::DrafterActor;
use crate::error::{codes, Result, ServeError};
use crate::events::{Completion, EngineStats, Event, RequestId};
use crate::intake::Intake;
use crate::kv_allocator::{KvAllocator, LedgerClient};
use crate::merger::TreeMerger;
use crate::messages::{CancelRequest, EventSink, GetStats, Shutdown, Submit};
use crate::prompt::PromptTokenizer;
use crate::request::{Request, SpecLimits, ValidRequest};
use crate::verifier::Verifier;

/// What the engine runs (for clients: `health`, validation messages).
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub model: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub drafters: Vec<String>,
    pub kv_memory: usize,
}

/// A running engine. Cheap to share (`Arc<Engine>`); all methods take `&self`.
pub struct Engine {
    intake: Addr<Intake>,
    next_id: AtomicU64,
    limits: Limits,
    spec: SpecLimits,
    info: EngineInfo,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Disconnected once every compute thread (verifier, drafters, merger, tokenizer) has
    /// dropped its actor: a shutdown returns after that, its memory freed.
    threads_alive: Mutex<Option<crossbeam_channel::Receiver<()>>>,
    /// The engine thread's actix system: stopped directly where the Intake cannot stop it
    /// (it has died), so a shutdown never waits forever on the thread.
    system: actix::System,
    stopped: Arc<AtomicBool>,
}

impl Engine {
    /// Load the pool and the scheduler, start the actors, and return once they take requests.
    pub fn start(config: EngineConfig) -> Result<Engine> {
        let info = EngineInfo {
            model: config
                .model
                .gguf()
                .get_str("general.name")
                .unwrap_or("model")
                .to_string(),
            context_length: config.model.config.context_length,
            vocab_size: config.model.config.vocab_size,
            drafters: config.drafters.iter().map(|d| d.name.clone()).collect(),
            kv_memory: config.kv_bytes(),
        };
        let spec = SpecLimits {
            drafter_names: info.drafters.clone(),
            budget: config.spec_budget,
            depth: config.spec_depth,
        };
        let limits = config.limits.clone();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let (alive_tx, alive_rx) = crossbeam_channel::bounded::<()>(0);
        let stopped = Arc::new(AtomicBool::new(false));
        let stopped_in = Arc::clone(&stopped);
        let intake_limits = limits.clone();
        let thread = std::thread::Builder::new()
            .name("arbor-engine".into())
            .spawn(move || {
                let sys = actix::System::new();
                let system = actix::System::current();
                let started = sys.block_on(async move {
                    // Each compute thread's factory holds a sender (`held_alive`): all of them
                    // gone means every thread has dropped its actor (the pool, the drafters'
                    // models) and its factory.
                    let alive = || alive_tx.clone();
                    // The block metadata on a thread of its own (bookkeeping only, answered in
                    // microseconds); the Verifier's pool asks it for every block it writes.
                    let kv = KvAllocator::start_in_arbiter(&Arbiter::new().handle(), {
                        let n_blocks = config.kv_blocks();
                        move |_| KvAllocator::new(n_blocks)
                    });
                    let verifier = Verifier::new(&config, LedgerClient::new(kv))?;
                    let interrupt = verifier.interrupt_flag();
                    let slot = Arc::new(Mutex::new(Some(verifier)));
                    let first_state = slot
                        .lock()
                        .as_mut()
                        .map(Verifier::state)
                        .unwrap_or_default();
                    let verifier = SyncArbiter::start(
                        1,
                        held_alive(alive(), move || {
                            slot.lock()
                                .take()
                                .expect("the verifier is built once (SyncArbiter with one thread)")
                        }),
                    );
                    let vocab = config.model.config.vocab_size;
                    // One thread per drafter, one for the merger.
                    let drafters = config
                        .drafters
                        .iter()
                        .enumerate()
                        .map(|(i, f)| {
                            let f = f.clone();
                            SyncArbiter::start(
                                1,
                                held_alive(alive(), move || DrafterActor::new(i, f.clone(), vocab)),
                            )
                        })
                        .collect();
                    let merger = SyncArbiter::start(1, held_alive(alive(), TreeMerger::default));
                    let tokenizer = Arc::clone(&config.tokenizer);
                    let prompts = SyncArbiter::start(
                        1,
                        held_alive(alive(), move || {
                            PromptTokenizer::new(Arc::clone(&tokenizer))
                        }),
                    );
                    Ok(Intake::new(
                        verifier,
                        prompts,
                        interrupt,
                        drafters,
                        merger,
                        intake_limits,
                        first_state,
                    )
                    .start())
                });
                let failed = started.is_err();
                let _ = tx.send(started.map(|intake| (intake, system)));
                if failed {
                    actix::System::current().stop();
                }
                if let Err(e) = sys.run() {
                    tracing::error!(error = %e, "engine event loop ended with an error");
                }
                stopped_in.store(true, Ordering::SeqCst);
            })
            .map_err(|e| ServeError::internal(format!("cannot start the engine thread: {e}")))?;
        let intake = rx
            .recv()
            .map_err(|_| ServeError::internal("the engine thread stopped at start"))
            .and_then(|started| started);
        let (intake, system) = match intake {
            Ok(started) => started,
            Err(e) => {
                let _ = thread.join();
                return Err(e);
            }
        };
        Ok(Engine {
            intake,
            next_id: AtomicU64::new(0),
            limits,
            spec,
            info,
            thread: Mutex::new(Some(thread)),
            threads_alive: Mutex::new(Some(alive_rx)),
            system,
            stopped,
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Check a request without submitting it.
    pub fn validate(&self, req: Request) -> Result<ValidRequest> {
        ValidRequest::new(req, &self.limits, &self.spec)
    }

    /// Submit `req`; its events arrive on the handle's blocking receiver. Bad settings are an
    /// error here; what can only be known later (prompt too long, overload, a JSON schema that
    /// does not compile) is the stream's final `Event::Error`.
    pub fn submit(&self, req: Request) -> Result<RequestHandle> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let id = self.submit_to(self.validate(req)?, EventSink::Blocking(tx))?;
        Ok(RequestHandle {
            id,
            events: rx,
            owner: self.owner(id),
        })
    }

    /// Submit `req`; its events arrive as an async [`EventStream`].
    pub fn submit_stream(&self, req: Request) -> Result<EventStream> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let id = self.submit_to(self.validate(req)?, EventSink::Async(tx))?;
        Ok(EventStream {
            id,
            rx,
            owner: self.owner(id),
        })
    }

    /// Submit a validated request to any sink (the TCP server shares one bounded sink per
    /// connection).
    pub fn submit_to(&self, req: ValidRequest, sink: EventSink) -> Result<RequestId> {
        if self.stopped.load(Ordering::SeqCst) || !self.intake.connected() {
            return Err(ServeError::new(
                codes::SHUTTING_DOWN,
                "the engine has stopped",
            ));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.intake.do_send(Submit { id, req, sink });
        Ok(id)
    }

    fn owner(&self, id: RequestId) -> RequestOwner {
        RequestOwner {
            intake: self.intake.clone(),
            id,
            ended: AtomicBool::new(false),
        }
    }

    /// End a request: its stream gets a final `Done` with `cancelled` once its KV blocks are
    /// free. Unknown or finished ids are ignored.
    pub fn cancel(&self, id: RequestId) {
        self.intake.do_send(CancelRequest {
            id,
            reason: crate::events::FinishReason::Cancelled,
        });
    }

    /// The counters (blocking; `None` when the engine has stopped).
    pub fn stats(&self) -> Option<EngineStats> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        // `do_send`, as `submit_to`: `try_send` fails while the Intake's mailbox is over its
        // capacity (many pipelined requests), which would read as a stopped engine. A stopped
        // Intake drops the message and with it `tx`, so the receive ends at once.
        self.intake.do_send(GetStats {
            reply: Box::new(move |s| {
                let _ = tx.send(s);
            }),
        });
        rx.recv_timeout(Duration::from_secs(10)).ok()
    }

    /// The counters, for async callers.
    pub async fn stats_async(&self) -> Option<EngineStats> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.intake.do_send(GetStats {
            reply: Box::new(move |s| {
                let _ = tx.send(s);
            }),
        });
        rx.await.ok()
    }

    /// Stop taking requests; running ones may finish within `grace`, the rest end with
    /// `shutdown`. Returns once the actors have stopped (blocking).
    pub fn shutdown(&self, grace: Duration) {
        let (tx, rx) = crossbeam_channel::bounded::<()>(1);
        // `do_send`: a full mailbox must not lose the shutdown (the join below would wait on an
        // engine thread that never stops). A stopped Intake drops `tx`: the receive ends.
        self.intake.do_send(Shutdown {
            grace,
            done: Box::new(move || {
                let _ = tx.send(());
            }),
        });
        if rx.recv().is_err() {
            // The Intake dropped the shutdown without running it: it has stopped (or died) and
            // will not stop the system.
            self.system.stop();
        }
        self.join_threads();
    }

    /// Wait for the engine thread, then for the compute threads to drop their actors (at most
    /// a minute: a drafter stuck in a proposal must not hang the caller).
    fn join_threads(&self) {
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        if let Some(alive) = self.threads_alive.lock().take() {
            if let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                alive.recv_timeout(Duration::from_secs(60))
            {
                tracing::warn!("a compute thread did not stop within 60 s of the shutdown");
            }
        }
    }

    /// [`Engine::shutdown`] for async callers (the final join runs on a blocking thread).
    pub async fn shutdown_async(self: Arc<Self>, grace: Duration) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.intake.do_send(Shutdown {
            grace,
            done: Box::new(move || {
                let _ = tx.send(());
            }),
        });
        if rx.await.is_err() {
            self.system.stop();
        }
        let me = Arc::clone(&self);
        let _ = tokio::task::spawn_blocking(move || me.join_threads()).await;
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.thread.lock().is_some() {
            self.shutdown(Duration::ZERO);
        }
    }
}

/// `factory`, holding `alive` until the factory (and what it captured) has been dropped: a
/// SyncArbiter thread drops its actor, then its factory, as it ends.
fn held_alive<A>(
    alive: crossbeam_channel::Sender<()>,
    factory: impl Fn() -> A + Send + Sync + 'static,
) -> impl Fn() -> A + Send + Sync + 'static {
    // Tuple fields drop in order: the factory first, then the sender. (`&both` captures the
    // whole tuple; naming its fields would capture them one by one, in no set drop order.)
    let both = (factory, alive);
    move || {
        let (factory, _alive) = &both;
        factory()
    }
}

/// What ties a request to its handle: dropping the handle before the request's final event
/// cancels it (a waiting request no longer counts toward `max_waiting` nor gets prefilled; a
/// running one frees its KV blocks).
struct RequestOwner {
    intake: Addr<Intake>,
    id: RequestId,
    ended: AtomicBool,
}

impl RequestOwner {
    fn saw(&self, ev: Option<&Event>) {
        if matches!(ev, Some(Event::Done(_) | Event::Error { .. }) | None) {
            self.ended.store(true, Ordering::Relaxed);
        }
    }
}

impl Drop for RequestOwner {
    fn drop(&mut self) {
        // Unknown and finished ids are ignored (events read from `events` directly are not
        // seen here).
        if !self.ended.load(Ordering::Relaxed) {
            self.intake.do_send(CancelRequest {
                id: self.id,
                reason: crate::events::FinishReason::Cancelled,
            });
        }
    }
}

/// A submitted request's events, for callers without an async runtime. Dropping it before the
/// final event cancels the request.
pub struct RequestHandle {
    pub id: RequestId,
    pub events: crossbeam_channel::Receiver<Event>,
    owner: RequestOwner,
}

impl RequestHandle {
    /// The next event (`None` after the final one, or if the engine stopped).
    pub fn recv(&self) -> Option<Event> {
        let ev = self.events.recv().ok();
        self.owner.saw(ev.as_ref());
        ev
    }

    /// Read events until the final one: the completion, or the request's error.
    pub fn wait(self) -> Result<Completion> {
        while let Some(ev) = self.recv() {
            match ev {
                Event::Tokens { .. } => {}
                Event::Done(c) => return Ok(*c),
                Event::Error { error, .. } => return Err(error),
            }
        }
        Err(ServeError::new(codes::SHUTTING_DOWN, "the engine stopped"))
    }
}

/// A submitted request's events as an async `Stream`. Dropping it before the final event
/// cancels the request.
pub struct EventStream {
    pub id: RequestId,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    owner: RequestOwner,
}

impl EventStream {
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        self.owner.saw(ev.as_ref());
        ev
    }
}

impl futures_core::Stream for EventStream {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Event>> {
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(ev) = &polled {
            self.owner.saw(ev.as_ref());
        }
        polled
    }
}
