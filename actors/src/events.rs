//! What a request's stream carries: token events (one per scheduler step, with every token accepted in it), then exactly one final `Done` or `Error`.

pub use arbor_engine::sched::PromptScores;

use crate::error::ServeError;

/// Engine-wide request id (unique for the engine's lifetime).
pub type RequestId = u64;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the model's context reached.
    Length,
    /// Cancelled by the caller (or its connection went away).
    Cancelled,
    /// The request's deadline passed.
    Deadline,
    /// The engine shut down before the request finished.
    Shutdown,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Deadline => "deadline",
            FinishReason::Shutdown => "shutdown",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

/// Speculation counters of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecSummary {
    /// Verification passes.
    pub steps: usize,
    /// Draft nodes verified.
    pub drafted: usize,
    /// Draft tokens accepted (bonus tokens not counted).
    pub accepted: usize,
    /// Accepted draft tokens per verification pass.
    pub mean_accepted: f64,
}

/// Milliseconds from submission.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timing {
    /// Until the request first ran (was admitted into a step).
    pub queue_ms: f64,
    /// Until its first token was sent (`None`: no token).
    pub ttft_ms: Option<f64>,
    /// Until its final event.
    pub total_ms: f64,
}

/// The final event of a request that ran (or was cancelled).
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub id: RequestId,
    pub finish_reason: FinishReason,
    /// The whole generated text.
    pub text: String,
    /// Every generated token id.
    pub tokens: Vec<u32>,
    /// Their log-probabilities when the request asked (`Request::logprobs`); empty otherwise.
    pub logprobs: Vec<f32>,
    /// Per token, its most likely alternatives (token, log-probability) when the request asked
    /// (`Request::top_logprobs`); empty otherwise.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// The prompt's scores when the request asked (`Request::prompt_logprobs`).
    pub prompt: Option<Box<PromptScores>>,
    pub usage: Usage,
    pub spec: Option<SpecSummary>,
    pub timing: Timing,
    pub preemptions: usize,
}

/// One item of a request's event stream.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Tokens accepted in one scheduler step (several under speculation) and the text that
    /// became final with them.
    Tokens {
        id: RequestId,
        tokens: Vec<u32>,
        /// One per token when the request asked for log-probabilities; empty otherwise.
        logprobs: Vec<f32>,
        /// One list of alternatives per token when the request asked (`top_logprobs`).
        top_logprobs: Vec<Vec<(u32, f32)>>,
        text: String,
        /// The prompt's scores, on the first event, when the request asked
        /// (`Request::prompt_logprobs`).
        prompt: Option<Box<PromptScores>>,
    },
    /// Final: the request ended.
    Done(Box<Completion>),
    /// Final: the request failed (bad input found after submission, capacity, internal).
    Error { id: RequestId, error: ServeError },
}

impl Event {
    pub fn id(&self) -> RequestId {
        match self {
            Event::Tokens { id, .. } | Event::Error { id, .. } => *id,
            Event::Done(c) => c.id,
        }
    }

    /// The last event of its request.
    pub fn is_final(&self) -> bool {
        !matches!(self, Event::Tokens { .. })
    }
}

/// Engine counters (`{"stats": true}` on the wire).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Requests holding KV blocks (admitted, not finished).
    pub running: usize,
    /// Requests queued for admission.
    pub waiting: usize,
    /// Preemptions since start.
    pub preempted: u64,
    /// Steps an admission waited for the shared prefix of a prompt still being computed (cache-
    /// aware admission), since start.
    pub prefix_waits: u64,
    pub kv_blocks_total: usize,
    /// Blocks referenced by live sequences (0 when idle).
    pub kv_blocks_used: usize,
    /// Unreferenced blocks kept for prefix reuse.
    pub kv_blocks_cached: usize,
    pub kv_blocks_free: usize,
    /// Prefix-cache hits per lookup since start.
    pub prefix_hit_rate: f64,
    /// Mean accepted draft tokens per verification pass of the finished speculating requests.
    pub mean_accepted: f64,
    /// Tokens generated per second over the last 10 seconds.
    pub tok_s: f64,
    pub drafter_failures: u64,
    /// Mean milliseconds a drafting step waits for the drafters and the merger (the Verifier
    /// idles meanwhile: the most that overlapping drafting with verification could win).
    pub draft_wait_ms: f64,
    /// Steps that drafted trees through the drafter actors.
    pub drafted_steps: u64,
    /// Requests that ended: finished, cancelled, failed.
    pub completed: u64,
    pub cancelled: u64,
    pub failed: u64,
    /// Requests cancelled because their consumer stopped reading.
    pub slow_readers: u64,
    /// Forward passes run.
    pub steps: u64,
    /// Mean milliseconds per step (plan to report, drafting included).
    pub step_ms: f64,
    /// Mean milliseconds the Verifier idled between consecutive steps while requests ran: the
    /// actors' own per-step overhead.
    pub step_gap_ms: f64,
    /// Mean messages per step from the Verifier's pool to the KvAllocator actor, and the mean
    /// milliseconds per step the Verifier waited for their answers.
    pub kv_messages_per_step: f64,
    pub kv_wait_ms: f64,
}
