//! The Intake actor: queues validated requests, drives the Verifier one step at a time, streams each step's tokens to their requests' sinks, and owns cancellation, deadlines, overload limits and shutdown (continuous batching's request side, as in Orca / vLLM's engine core).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, WrapFuture};
use arbor_engine::sched::{Commit, Finish};
use arbor_engine::spec::SpecMetrics;
use arbor_engine::FinishReason as EngineFinish;

use crate::config::Limits;
use crate::drafter::DrafterActor;
use crate::error::{codes, ServeError};
use crate::events::{
    Completion, EngineStats, Event, FinishReason, PromptScores, RequestId, SpecSummary, Timing,
    Usage,
};
use crate::merger::TreeMerger;
use crate::messages::{
    Cancel, CancelRequest, CommitDrafts, Draft, Drafted, Enqueue, EventSink, Forget, GetStats,
    Merge, PlanReply, PlanStep, Shutdown, SinkError, StepDone, StepReport, Submit, Tokenize,
    VerifierState, Verify,
};
use crate::prompt::PromptTokenizer;
use crate::verifier::Verifier;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EntryState {
    Active,
    /// Ending with this reason once the Verifier has dropped it.
    Cancelling(FinishReason),
}

struct Entry {
    sink: EventSink,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    deadline: Option<Instant>,
    state: EntryState,
    /// The Verifier has it (its `Enqueue` was answered).
    enqueued: bool,
    /// A `Cancel` is on its way to the Verifier.
    cancel_sent: bool,
    prompt_tokens: usize,
    /// What the consumer was sent.
    tokens: Vec<u32>,
    /// Their log-probabilities and alternatives (when asked).
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    text: String,
    /// The prompt's scores (when asked), once sent.
    prompt: Option<Box<PromptScores>>,
    /// Tokens (with their log-probabilities) of steps that ran after an early end was asked for
    /// (cancel, deadline, shutdown): dropped if the early end takes effect, streamed if the
    /// request finishes on its own first.
    held: Emitted,
}

/// Tokens of one or more steps with what came with them.
#[derive(Default)]
struct Emitted {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    text: String,
    prompt: Option<Box<PromptScores>>,
}

impl Emitted {
    fn append(&mut self, mut other: Emitted) {
        if self.prompt.is_none() {
            self.prompt = other.prompt.take();
        }
        self.tokens.append(&mut other.tokens);
        self.logprobs.append(&mut other.logprobs);
        self.top_logprobs.append(&mut other.top_logprobs);
        self.text.push_str(&other.text);
    }
}

impl Entry {
    fn timing(&self, now: Instant) -> Timing {
        let ms = |t: Instant| t.duration_since(self.submitted).as_secs_f64() * 1e3;
        Timing {
            queue_ms: ms(self.admitted.unwrap_or(now)),
            ttft_ms: self.first_token.map(ms),
            total_ms: ms(now),
        }
    }
}

struct ShutdownState {
    /// `None`: a grace too long to represent, i.e. none (requests run to their end).
    deadline: Option<Instant>,
    done: Option<Box<dyn FnOnce() + Send>>,
}

pub struct Intake {
    verifier: Addr<Verifier>,
    /// Tokenizes prompts before they go to the Verifier (off its thread).
    tokenizer: Addr<PromptTokenizer>,
    /// Raised before a message to the Verifier, so it stops running steps back to back.
    interrupt: Arc<AtomicBool>,
    drafters: Vec<Addr<DrafterActor>>,
    /// Per drafter: a `Draft` it has not answered yet (set while one is in flight).
    drafter_busy: Vec<Arc<AtomicBool>>,
    merger: Addr<TreeMerger>,
    limits: Limits,
    entries: HashMap<RequestId, Entry>,
    step: u64,
    step_in_flight: bool,
    state: VerifierState,
    started: Instant,
    /// Tokens sent per step over the last 10 s (tok/s).
    window: VecDeque<(Instant, usize)>,
    spec_steps: u64,
    spec_accepted: u64,
    drafter_failures: u64,
    /// Time the Verifier waited for drafters and merger, over the steps that drafted.
    draft_wait: Duration,
    drafted_steps: u64,
    completed: u64,
    cancelled: u64,
    failed: u64,
    slow_readers: u64,
    shutdown: Option<ShutdownState>,
}

const WINDOW: Duration = Duration::from_secs(10);
/// A drafter that has not answered by then is skipped for the step.
const DRAFT_TIMEOUT: Duration = Duration::from_secs(2);

impl Intake {
    pub fn new(
        verifier: Addr<Verifier>,
        tokenizer: Addr<PromptTokenizer>,
        interrupt: Arc<AtomicBool>,
        drafters: Vec<Addr<DrafterActor>>,
        merger: Addr<TreeMerger>,
        limits: Limits,
        state: VerifierState,
    ) -> Intake {
        Intake {
            verifier,
            tokenizer,
            interrupt,
            drafter_busy: drafters.iter().map(|_| Arc::default()).collect(),
            drafters,
            merger,
            limits,
            entries: HashMap::new(),
            step: 0,
            step_in_flight: false,
            state,
            started: Instant::now(),
            window: VecDeque::new(),
            spec_steps: 0,
            spec_accepted: 0,
            drafter_failures: 0,
            draft_wait: Duration::ZERO,
            drafted_steps: 0,
            completed: 0,
            cancelled: 0,
            failed: 0,
            slow_readers: 0,
            shutdown: None,
        }
    }

    /// Send the next `PlanStep` unless one is in flight or nothing can run.
    fn maybe_step(&mut self, ctx: &mut Context<Self>) {
        if self.step_in_flight {
            return;
        }
        let work = self
            .entries
            .values()
            .any(|e| e.enqueued && e.state == EntryState::Active);
        if !work {
            return;
        }
        self.step += 1;
        self.step_in_flight = true;
        let step = self.step;
        // Plan → (drafters → merger →) verify: one chain of messages per step.
        let verifier = self.verifier.clone();
        let drafters = self.drafters.clone();
        let busy = self.drafter_busy.clone();
        let merger = self.merger.clone();
        let report_to = ctx.address().recipient::<StepDone>();
        let chain = async move {
            let (step, work) = match verifier
                .send(PlanStep {
                    step,
                    report_to: report_to.clone(),
                })
                .await?
            {
                PlanReply::Looped { last_step } => return Ok((last_step, Vec::new(), None)),
                PlanReply::Draft { step, work } => (step, work),
            };
            // The Verifier idles from here until `Verify`: this is what overlapping the next
            // step's drafting with verification could win at most.
            let t_draft = Instant::now();
            // Only drafters some request of this step uses, and none still busy with an
            // earlier step it did not answer in time (its reply would be stale; the send
            // would queue behind it).
            let asks = (0..drafters.len())
                .filter(|&i| work.iter().any(|w| w.drafters.contains(&i)))
                .filter(|&i| !busy[i].swap(true, Ordering::AcqRel))
                .map(|i| {
                    let sent = drafters[i].send(Draft {
                        step,
                        work: Arc::clone(&work),
                    });
                    let busy = Arc::clone(&busy[i]);
                    // Spawned, so the reply is still awaited (and the drafter marked free)
                    // after the step stops waiting for it.
                    let reply = actix::spawn(async move {
                        let r = sent.await;
                        busy.store(false, Ordering::Release);
                        r
                    });
                    async move { (i, tokio::time::timeout(DRAFT_TIMEOUT, reply).await) }
                });
            let mut drafted: Vec<Drafted> = Vec::new();
            let mut lost = Vec::new();
            let mut dropped = Vec::new();
            for (i, r) in futures_util::future::join_all(asks).await {
                match r {
                    Ok(Ok(Ok(mut d))) if d.step == step => {
                        for (id, why) in std::mem::take(&mut d.failures) {
                            lost.push((i, format!("request {id}: {why}")));
                        }
                        drafted.push(d)
                    }
                    Ok(Ok(Ok(_))) => lost.push((i, "stale reply".to_string())),
                    Ok(Ok(Err(e))) => lost.push((i, e.to_string())),
                    Ok(Err(e)) => lost.push((i, format!("the reply task failed: {e}"))),
                    Err(_) => {
                        // Too slow for this step: the step's requests drop it.
                        dropped.extend(
                            work.iter()
                                .filter(|w| w.drafters.contains(&i))
                                .map(|w| (w.id, i)),
                        );
                        lost.push((i, format!("no reply within {DRAFT_TIMEOUT:?}")))
                    }
                }
            }
            let merged = merger
                .send(Merge {
                    step,
                    work,
                    drafted: std::mem::take(&mut drafted),
                })
                .await?;
            let waited = t_draft.elapsed();
            // The report comes as a `StepDone` message, in order with the others.
            verifier
                .send(Verify {
                    step,
                    trees: merged.trees,
                    dropped,
                    report_to,
                })
                .await?;
            Ok::<_, actix::MailboxError>((step, lost, Some(waited)))
        };
        ctx.spawn(chain.into_actor(self).map(move |res, act, ctx| {
            act.step_in_flight = false;
            match res {
                Ok((last_step, lost, waited)) => {
                    act.step = act.step.max(last_step);
                    if let Some(w) = waited {
                        act.draft_wait += w;
                        act.drafted_steps += 1;
                    }
                    for (i, why) in lost {
                        act.drafter_failures += 1;
                        tracing::warn!(
                            drafter = i,
                            error = %why,
                            "drafter failed; the step goes on without it"
                        );
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "the verifier is gone");
                    let ids: Vec<RequestId> = act.entries.keys().copied().collect();
                    for id in ids {
                        act.fail(id, ServeError::internal("the verifier stopped"));
                    }
                }
            }
            act.maybe_step(ctx);
            act.maybe_finish_shutdown();
        }));
    }

    /// Tell the drafters what was accepted, and which requests ended.
    fn follow_drafters(&mut self, commits: Vec<Commit>, ended: Vec<RequestId>) {
        if self.drafters.is_empty() {
            return;
        }
        let commits = Arc::new(commits);
        for d in &self.drafters {
            if !commits.is_empty() {
                d.do_send(CommitDrafts {
                    commits: Arc::clone(&commits),
                });
            }
            if !ended.is_empty() {
                d.do_send(Forget { ids: ended.clone() });
            }
        }
    }

    /// Keep the newest state (replies of the Verifier may be read out of order).
    fn set_state(&mut self, state: VerifierState) {
        if state.seq > self.state.seq {
            self.state = state;
        }
    }

    fn forget(&self, id: RequestId) {
        for d in &self.drafters {
            d.do_send(Forget { ids: vec![id] });
        }
    }

    fn on_report(&mut self, mut report: StepReport, ctx: &mut Context<Self>) {
        self.set_state(report.state);
        // Failed requests are forgotten by `fail`.
        let ended: Vec<RequestId> = report
            .events
            .iter()
            .filter(|e| e.finish.is_some())
            .map(|e| e.id)
            .collect();
        self.follow_drafters(std::mem::take(&mut report.commits), ended);
        for id in &report.running_ids {
            if let Some(e) = self.entries.get_mut(id) {
                e.admitted.get_or_insert(report.started);
            }
        }
        for (id, error) in report.failed {
            tracing::error!(request = id, error = %error, "request failed with its step");
            self.fail(id, error);
        }
        for f in report.drafter_failures {
            self.drafter_failures += 1;
            tracing::warn!(
                request = f.id,
                drafter = %f.drafter,
                error = %f.message,
                "drafter failed; the request goes on without it"
            );
        }
        let now = Instant::now();
        let mut sent = 0;
        for ev in report.events {
            let Some(e) = self.entries.get_mut(&ev.id) else {
                continue;
            };
            let id = ev.id;
            sent += ev.tokens.len();
            // Tokens of steps after an early end was asked for are held back, so an early final
            // line reports exactly what the consumer got; a request that finishes on its own
            // first sends them with its last step's (its final line has the whole output).
            let mut out = Emitted {
                tokens: ev.tokens,
                logprobs: ev.logprobs,
                top_logprobs: ev.top_logprobs,
                text: ev.text,
                prompt: ev.prompt,
            };
            if e.state != EntryState::Active {
                e.held.append(out);
                out = if matches!(ev.finish, Some(Finish::Done { .. })) {
                    std::mem::take(&mut e.held)
                } else {
                    Emitted::default()
                };
            }
            if !out.tokens.is_empty() {
                e.tokens.extend_from_slice(&out.tokens);
                e.logprobs.extend_from_slice(&out.logprobs);
                e.top_logprobs.extend_from_slice(&out.top_logprobs);
                e.text.push_str(&out.text);
                e.first_token.get_or_insert(now);
                if e.prompt.is_none() {
                    e.prompt.clone_from(&out.prompt);
                }
                let ev = Event::Tokens {
                    id,
                    tokens: out.tokens,
                    logprobs: out.logprobs,
                    top_logprobs: out.top_logprobs,
                    text: out.text,
                    prompt: out.prompt,
                };
                if let Err(err) = e.sink.send(ev) {
                    self.sink_failed(id, err, ctx);
                }
            }
            match ev.finish {
                None => {}
                Some(Finish::Done {
                    reason,
                    tokens,
                    text,
                    prompt_tokens,
                    cached_prompt_tokens,
                    preemptions,
                    spec,
                }) => {
                    let Some(mut e) = self.entries.remove(&id) else {
                        continue;
                    };
                    let spec = spec.map(|m| self.spec_summary(&m));
                    // A request that finished before its cancel took effect ends as it finished.
                    let finish_reason = match reason {
                        EngineFinish::Length => FinishReason::Length,
                        EngineFinish::Eos | EngineFinish::Stop => FinishReason::Stop,
                    };
                    if finish_reason == FinishReason::Cancelled {
                        self.cancelled += 1;
                    } else {
                        self.completed += 1;
                    }
                    let c = Completion {
                        id,
                        finish_reason,
                        usage: Usage {
                            prompt_tokens,
                            completion_tokens: tokens.len(),
                            cached_prompt_tokens,
                        },
                        text,
                        tokens,
                        logprobs: std::mem::take(&mut e.logprobs),
                        top_logprobs: std::mem::take(&mut e.top_logprobs),
                        prompt: e.prompt.take(),
                        spec,
                        timing: e.timing(now),
                        preemptions,
                    };
                    tracing::debug!(
                        request = id,
                        reason = finish_reason.as_str(),
                        "request done"
                    );
                    let _ = e.sink.send(Event::Done(Box::new(c)));
                }
                Some(Finish::Failed(err)) => self.fail(id, ServeError::from(err)),
            }
        }
        if sent > 0 {
            self.window.push_back((now, sent));
        }
        while self
            .window
            .front()
            .is_some_and(|&(t, _)| now.duration_since(t) > WINDOW)
        {
            self.window.pop_front();
        }
        self.check_deadlines(ctx);
    }

    /// A finished request's speculation counters, added to the server's totals.
    fn spec_summary(&mut self, m: &SpecMetrics) -> SpecSummary {
        self.spec_steps += m.steps as u64;
        self.spec_accepted += m.accepted as u64;
        SpecSummary {
            steps: m.steps,
            drafted: m.drafted,
            accepted: m.accepted,
            mean_accepted: m.mean_accepted(),
        }
    }

    fn sink_failed(&mut self, id: RequestId, err: SinkError, ctx: &mut Context<Self>) {
        if err == SinkError::Full {
            self.slow_readers += 1;
            tracing::warn!(
                request = id,
                "consumer stopped reading; request cancelled (slow reader)"
            );
        } else {
            tracing::info!(request = id, "consumer gone; request cancelled");
        }
        self.begin_cancel(id, FinishReason::Cancelled, ctx);
    }

    /// End a request with an error event.
    fn fail(&mut self, id: RequestId, error: ServeError) {
        self.forget(id);
        if let Some(e) = self.entries.remove(&id) {
            self.failed += 1;
            let _ = e.sink.send(Event::Error { id, error });
        }
    }

    /// Drop `id` from the Verifier, then send its final `Done` with `reason` (unless it
    /// finishes on its own first).
    fn begin_cancel(&mut self, id: RequestId, reason: FinishReason, ctx: &mut Context<Self>) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if e.state == EntryState::Active {
            e.state = EntryState::Cancelling(reason);
        }
        if !e.enqueued || e.cancel_sent {
            return; // the Enqueue reply sends the Cancel
        }
        e.cancel_sent = true;
        self.interrupt.store(true, Ordering::Release);
        let fut = self.verifier.send(Cancel { id });
        ctx.spawn(fut.into_actor(self).map(move |res, act, ctx| {
            let stats = match res {
                Ok(c) => {
                    act.set_state(c.state);
                    c.stats.unwrap_or_default()
                }
                Err(_) => Default::default(),
            };
            act.forget(id);
            if let Some(e) = act.entries.remove(&id) {
                let reason = match e.state {
                    EntryState::Cancelling(r) => r,
                    EntryState::Active => FinishReason::Cancelled,
                };
                if reason == FinishReason::Cancelled {
                    act.cancelled += 1;
                } else {
                    act.completed += 1;
                }
                tracing::info!(
                    request = id,
                    reason = reason.as_str(),
                    "request ended early"
                );
                let c = Completion {
                    id,
                    finish_reason: reason,
                    usage: Usage {
                        prompt_tokens: e.prompt_tokens,
                        completion_tokens: e.tokens.len(),
                        cached_prompt_tokens: stats.cached_prompt_tokens,
                    },
                    text: e.text.clone(),
                    tokens: e.tokens.clone(),
                    logprobs: e.logprobs.clone(),
                    top_logprobs: e.top_logprobs.clone(),
                    prompt: e.prompt.clone(),
                    spec: stats.spec.map(|m| act.spec_summary(&m)),
                    timing: e.timing(Instant::now()),
                    preemptions: stats.preemptions,
                };
                let _ = e.sink.send(Event::Done(Box::new(c)));
            }
            act.maybe_step(ctx);
            act.maybe_finish_shutdown();
        }));
    }

    fn check_deadlines(&mut self, ctx: &mut Context<Self>) {
        let now = Instant::now();
        let shutdown_due = self
            .shutdown
            .as_ref()
            .is_some_and(|s| s.deadline.is_some_and(|d| now >= d));
        let due: Vec<(RequestId, FinishReason)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.state == EntryState::Active)
            .filter_map(|(&id, e)| {
                if shutdown_due {
                    Some((id, FinishReason::Shutdown))
                } else if e.deadline.is_some_and(|d| now >= d) {
                    Some((id, FinishReason::Deadline))
                } else {
                    None
                }
            })
            .collect();
        for (id, reason) in due {
            self.begin_cancel(id, reason, ctx);
        }
    }

    fn maybe_finish_shutdown(&mut self) {
        if self.entries.is_empty() && !self.step_in_flight {
            if let Some(s) = self.shutdown.as_mut() {
                if let Some(done) = s.done.take() {
                    tracing::info!("all requests ended; stopping the engine");
                    done();
                    actix::System::current().stop();
                }
            }
        }
    }

    /// Requests not yet running: submitted but not admitted by the scheduler.
    fn waiting(&self) -> usize {
        self.entries
            .values()
            .filter(|e| e.admitted.is_none() && e.state == EntryState::Active)
            .count()
    }

    fn stats(&self) -> EngineStats {
        let st = &self.state;
        let now = Instant::now();
        let span = now.duration_since(self.started).min(WINDOW).as_secs_f64();
        let recent: usize = self.window.iter().map(|&(_, n)| n).sum();
        EngineStats {
            running: st.running,
            waiting: st.waiting,
            preempted: st.preempted,
            prefix_waits: st.prefix_waits,
            kv_blocks_total: st.pool.total,
            kv_blocks_used: st.pool.used,
            kv_blocks_cached: st.pool.cached,
            kv_blocks_free: st.pool.free,
            prefix_hit_rate: if st.pool.prefix_lookups == 0 {
                0.0
            } else {
                st.pool.prefix_hits as f64 / st.pool.prefix_lookups as f64
            },
            mean_accepted: if self.spec_steps == 0 {
                0.0
            } else {
                self.spec_accepted as f64 / self.spec_steps as f64
            },
            tok_s: if span > 0.0 {
                recent as f64 / span
            } else {
                0.0
            },
            drafter_failures: self.drafter_failures,
            draft_wait_ms: if self.drafted_steps == 0 {
                0.0
            } else {
                self.draft_wait.as_secs_f64() * 1e3 / self.drafted_steps as f64
            },
            drafted_steps: self.drafted_steps,
            completed: self.completed,
            cancelled: self.cancelled,
            failed: self.failed,
            slow_readers: self.slow_readers,
            steps: st.steps,
            step_ms: if st.steps == 0 {
                0.0
            } else {
                st.step_secs * 1e3 / st.steps as f64
            },
            step_gap_ms: if st.gaps == 0 {
                0.0
            } else {
                st.gap_secs * 1e3 / st.gaps as f64
            },
            kv_messages_per_step: st.kv_messages as f64 / st.steps.max(1) as f64,
            kv_wait_ms: st.kv_wait_secs * 1e3 / st.steps.max(1) as f64,
        }
    }
}

impl Actor for Intake {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Deadlines and the shutdown grace period are checked between steps too.
        ctx.run_interval(Duration::from_millis(20), |act, ctx| {
            act.check_deadlines(ctx);
            act.maybe_finish_shutdown();
        });
    }
}

impl Handler<Submit> for Intake {
    type Result = ();

    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) {
        let Submit { id, req, sink } = msg;
        let refuse = if self.shutdown.is_some() {
            Some(ServeError::new(
                codes::SHUTTING_DOWN,
                "the server is shutting down",
            ))
        } else if self.waiting() >= self.limits.max_waiting {
            Some(ServeError::new(
                codes::OVERLOADED,
                format!(
                    "{} requests are waiting (the limit is {}); retry later",
                    self.waiting(),
                    self.limits.max_waiting
                ),
            ))
        } else {
            None
        };
        if let Some(error) = refuse {
            self.failed += 1;
            let _ = sink.send(Event::Error { id, error });
            return;
        }
        let now = Instant::now();
        self.entries.insert(
            id,
            Entry {
                sink,
                submitted: now,
                admitted: None,
                first_token: None,
                // A deadline past what `Instant` can represent is none (it panicked here).
                deadline: req.deadline.and_then(|d| now.checked_add(d)),
                state: EntryState::Active,
                enqueued: false,
                cancel_sent: false,
                prompt_tokens: 0,
                tokens: Vec::new(),
                text: String::new(),
                logprobs: Vec::new(),
                top_logprobs: Vec::new(),
                prompt: None,
                held: Emitted::default(),
            },
        );
        // Tokenized on the PromptTokenizer's thread, then queued on the Verifier's.
        let tokenized = self.tokenizer.send(Tokenize {
            input: req.input.clone(),
            format: req.params.response_format.clone(),
        });
        let queued = tokenized.into_actor(self).then(move |res, act, _| {
            let res = res.unwrap_or_else(|e| Err(ServeError::internal(e.to_string())));
            let verifier = act.verifier.clone();
            if res.is_ok() {
                act.interrupt.store(true, Ordering::Release);
            }
            async move {
                let prompt = res?;
                verifier
                    .send(Enqueue { id, req, prompt })
                    .await
                    .unwrap_or_else(|e| Err(ServeError::internal(e.to_string())))
            }
            .into_actor(act)
        });
        ctx.spawn(queued.map(move |res, act, ctx| {
            match res {
                Ok(n) => {
                    let Some(e) = act.entries.get_mut(&id) else {
                        return;
                    };
                    e.enqueued = true;
                    e.prompt_tokens = n;
                    if let EntryState::Cancelling(r) = e.state {
                        act.begin_cancel(id, r, ctx);
                    }
                }
                Err(error) => {
                    tracing::debug!(request = id, error = %error, "request refused");
                    act.fail(id, error);
                }
            }
            act.maybe_step(ctx);
            act.maybe_finish_shutdown();
        }));
    }
}

impl Handler<StepDone> for Intake {
    type Result = ();

    fn handle(&mut self, msg: StepDone, ctx: &mut Context<Self>) {
        let report = *msg.0;
        self.step = self.step.max(report.step);
        self.on_report(report, ctx);
        self.maybe_step(ctx);
        self.maybe_finish_shutdown();
    }
}

impl Handler<CancelRequest> for Intake {
    type Result = ();

    fn handle(&mut self, msg: CancelRequest, ctx: &mut Context<Self>) {
        self.begin_cancel(msg.id, msg.reason, ctx);
    }
}

impl Handler<GetStats> for Intake {
    type Result = ();

    fn handle(&mut self, msg: GetStats, _: &mut Context<Self>) {
        (msg.reply)(self.stats());
    }
}

impl Handler<Shutdown> for Intake {
    type Result = ();

    fn handle(&mut self, msg: Shutdown, ctx: &mut Context<Self>) {
        tracing::info!(
            grace_ms = msg.grace.as_millis() as u64,
            in_flight = self.entries.len(),
            "shutting down"
        );
        match self.shutdown.as_mut() {
            Some(s) => {
                // A second shutdown: the earlier deadline wins; both callbacks run.
                let first = s.done.take();
                let second = msg.done;
                s.done = Some(Box::new(move || {
                    if let Some(f) = first {
                        f();
                    }
                    second();
                }));
                let second_deadline = Instant::now().checked_add(msg.grace);
                s.deadline = match (s.deadline, second_deadline) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            None => {
                self.shutdown = Some(ShutdownState {
                    // A grace past what `Instant` can represent (`Duration::MAX`) is none; the
                    // addition panicked, and the engine thread with it.
                    deadline: Instant::now().checked_add(msg.grace),
                    done: Some(msg.done),
                })
            }
        }
        self.check_deadlines(ctx);
        self.maybe_finish_shutdown();
    }
}
