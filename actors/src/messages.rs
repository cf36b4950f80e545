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

/// Intake → PromptTokenizer: a request's prompt tokens; its JSON schema compiled (and the
/// JSON vocabulary built) there too, off the Verifier's thread.
#[derive(Message)]
#[rtype(result = "Result<Vec<u32>, ServeError>")]
pub struct Tokenize {
    pub input: crate::request::Input,
    pub format: arbor_engine::ResponseFormat,
}

/// Intake → Verifier: queue a request (its prompt tokenized by the PromptTokenizer); replies
/// with the prompt's token count.
#[derive(Message)]
#[rtype(result = "Result<usize, ServeError>")]
pub struct Enqueue {
    pub id: RequestId,
    pub req: ValidRequest,
    pub prompt: Vec<u32>,
}

/// Intake → Verifier: drop a request (if it still runs); replies with the pool after.
#[derive(Message)]
#[rtype(result = "Cancelled")]
pub struct Cancel {
    pub id: RequestId,
}

/// The Verifier's reply to [`Cancel`].
pub struct Cancelled {
    pub state: VerifierState,
    /// What the request had done, if the scheduler still held it (None: it had finished or
    /// failed on its own, or was never queued).
    pub stats: Option<arbor_engine::sched::CancelledStats>,
}

/// The scheduler and pool as the verifier saw them last.
#[derive(Clone, Copy, Debug, Default)]
pub struct VerifierState {
    /// Order of the Verifier's replies (replies may be read out of order: keep the newest).
    pub seq: u64,
    pub running: usize,
    pub waiting: usize,
    pub preempted: u64,
    /// Steps an admission waited for a shared prompt prefix being computed.
    pub prefix_waits: u64,
    pub steps: u64,
    pub pool: PoolStats,
    /// Time in steps (plan to report), and idle time between a step and the next one while
    /// requests were running (the actors' own overhead), with the count of such gaps.
    pub step_secs: f64,
    pub gap_secs: f64,
    pub gaps: u64,
    /// Messages the Verifier's pool sent the KvAllocator, and the seconds it waited for them.
    pub kv_messages: u64,
    pub kv_wait_secs: f64,
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
    /// What verification accepted for externally drafted requests.
    pub commits: Vec<arbor_engine::sched::Commit>,
    pub state: VerifierState,
}

/// Intake → Verifier: run steps. Steps without trees to draft run at once, back to back;
/// a step with trees to draft is held until `Verify`.
#[derive(Message)]
#[rtype(result = "PlanReply")]
pub struct PlanStep {
    pub step: u64,
    /// Where every step's report goes (in order).
    pub report_to: actix::Recipient<StepDone>,
}

pub enum PlanReply {
    /// Steps up to `last_step` ran (their reports were sent); the Verifier stopped because it
    /// is idle or the Intake has messages waiting.
    Looped { last_step: u64 },
    /// This step waits for trees (`Verify`).
    Draft {
        step: u64,
        work: Arc<Vec<DraftWork>>,
    },
}

/// Verifier → Intake: a step's report.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StepDone(pub Box<StepReport>);

/// One request's tree to draft this step.
#[derive(Clone, Debug)]
pub struct DraftWork {
    pub id: RequestId,
    /// The request's tokens (the root is the last).
    pub tokens: Vec<u32>,
    /// Most draft nodes, shared by the request's drafters.
    pub budget: usize,
    pub max_depth: usize,
    /// The engine's drafters this request uses, in merge order (drafter id = position).
    pub drafters: Vec<usize>,
    /// The request's sampling seed (drafter k derives `seed + 1 + k`).
    pub seed: u64,
    /// The request's depth cap (drafters are built for it).
    pub depth: usize,
    /// What each further verified row costs, in plain passes (`Drafter::set_row_costs`).
    pub row_costs: Vec<f64>,
}

/// Intake → Drafter: draft the trees of the step's requests that use this drafter.
#[derive(Message)]
#[rtype(result = "Drafted")]
pub struct Draft {
    pub step: u64,
    pub work: Arc<Vec<DraftWork>>,
}

/// A drafter's trees for one step (each checked: root, budget share, depth, vocabulary).
#[derive(Debug)]
pub struct Drafted {
    pub step: u64,
    pub drafter: usize,
    /// (request, position of this drafter in the request's list, tree).
    pub trees: Vec<(RequestId, usize, arbor_engine::tree::TokenTree)>,
    /// Requests whose instance of this drafter failed (it is dropped for them).
    pub failures: Vec<(RequestId, String)>,
}

/// Intake → Drafter: what verification accepted (drafters with caches follow).
#[derive(Message)]
#[rtype(result = "()")]
pub struct CommitDrafts {
    pub commits: Arc<Vec<arbor_engine::sched::Commit>>,
}

/// Intake → Drafter: these requests ended; drop their drafter state.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Forget {
    pub ids: Vec<RequestId>,
}

/// Intake → TreeMerger: merge the drafters' trees per request.
#[derive(Message)]
#[rtype(result = "Merged")]
pub struct Merge {
    pub step: u64,
    pub work: Arc<Vec<DraftWork>>,
    pub drafted: Vec<Drafted>,
}

pub struct Merged {
    pub step: u64,
    /// Per request, its merged tree and the tree's attention mask.
    pub trees: Vec<(RequestId, arbor_engine::tree::MaskedTree)>,
}

/// Intake (via TreeMerger's trees) → Verifier: run the planned step with these trees.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Verify {
    pub step: u64,
    pub trees: Vec<(RequestId, arbor_engine::tree::MaskedTree)>,
    /// (request, engine drafter) pairs to drop: the drafter did not answer this step in time,
    /// so the request speculates on without it.
    pub dropped: Vec<(RequestId, usize)>,
    pub report_to: actix::Recipient<StepDone>,
}
