//! Typed messages between the actors (and from the in-process API to the Intake), and the event sinks requests stream into.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix::Message;
use arbor_engine::sched::{DrafterFailure, StepEvent};
use arbor_engine::PoolStats;

use crate::error::ServeError;
use crate::events::{EngineStats, Event, FinishReason, RequestId};
use crate::request::ValidRequest;

/// Where a request's events go.
#[derive(Clone, Debug)]
pub enum EventSink {
    /// Unbounded, for blocking callers.
    Blocking(crossbeam_channel::Sender<Event>),
    /// Unbounded, for async callers.
    Async(tokio::sync::mpsc::UnboundedSender<Event>),
    /// Bounded and shared by the requests of one consumer (a TCP connection): when it is full
    /// the consumer has stopped reading; its requests are cancelled and `overflowed` is set.
    Bounded {
        tx: tokio::sync::mpsc::Sender<Event>,
        overflowed: Arc<AtomicBool>,
    },
}

/// Why an event could not be delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinkError {
    /// The receiver is gone (caller dropped its stream, connection closed).
    Closed,
    /// A bounded sink is full (slow reader).
    Full,
}

impl EventSink {
    pub fn send(&self, ev: Event) -> Result<(), SinkError> {
        match self {
            EventSink::Blocking(tx) => tx.send(ev).map_err(|_| SinkError::Closed),
            EventSink::Async(tx) => tx.send(ev).map_err(|_| SinkError::Closed),
            EventSink::Bounded { tx, overflowed } => {
                if overflowed.load(Ordering::Relaxed) {
                    return Err(SinkError::Full);
                }
                tx.try_send(ev).map_err(|e| match e {
                    tokio::sync::mpsc::error::TrySendError::Full(_) => {
                        overflowed.store(true, Ordering::Relaxed);
                        SinkError::Full
                    }
                    tokio::sync::mpsc::error::TrySendError::Closed(_) => SinkError::Closed,
                })
            }
        }
    }
}

/// API → Intake: queue a request.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Submit {
    pub id: RequestId,
    pub req: ValidRequest,
    pub sink: EventSink,
}

/// API → Intake: end a request (its final `Done` follows once its blocks are free).
#[derive(Message)]
#[rtype(result = "()")]
pub struct CancelRequest {
    pub id: RequestId,
    pub reason: FinishReason,
}

/// API → Intake: read the counters.
#[derive(Message)]
#[rtype(result = "()")]
pub struct GetStats {
    pub reply: Box<dyn FnOnce(EngineStats) + Send>,
}

/// API → Intake: stop taking requests, let running ones finish within `grace`, end the rest
/// with `shutdown`, then stop the actors; `done` runs when everything has ended.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Shutdown {
    pub grace: std::time::Duration,
    pub done: Box<dyn FnOnce() + Send>,
}

/// Intake → Verifier: tokenize and queue a request.
#[derive(Message)]
#[rtype(result = "Result<usize, ServeError>")]
pub struct Enqueue {
    pub id: RequestId,
    pub req: ValidRequest,
}

/// Intake → Verifier: drop a request; replies whether it was known, and the pool after.
#[derive(Message)]
#[rtype(result = "VerifierState")]
pub struct Cancel {
    pub id: RequestId,
}

/// Intake → Verifier: run one scheduler step.
#[derive(Message)]
#[rtype(result = "StepReport")]
pub struct RunStep {
    pub step: u64,
}

/// The scheduler and pool as the verifier saw them last.
#[derive(Clone, Copy, Debug, Default)]
pub struct VerifierState {
    /// Order of the Verifier's replies (replies may be read out of order: keep the newest).
    pub seq: u64,
    pub found: bool,
    pub running: usize,
    pub waiting: usize,
    pub preempted: u64,
    pub steps: u64,
    pub pool: PoolStats,
}

/// What one step did.
pub struct StepReport {
    pub step: u64,
    /// When the step began (requests running in it were admitted by then).
    pub started: Instant,
    /// Requests running in this step (their queue time ends at `started`).
    pub running_ids: Vec<RequestId>,
    /// Per request: tokens and finishes (ids are the Intake's).
    pub events: Vec<StepEvent>,
    /// A step that failed as a whole: the requests it ended, with the error.
    pub failed: Vec<(RequestId, ServeError)>,
    pub drafter_failures: Vec<DrafterFailure>,
    pub state: VerifierState,
    /// No request left in the scheduler.
    pub idle: bool,
}
