//! The Verifier actor: owns the LLM, the K/V storage (its blocks granted by the KvAllocator actor) and the scheduler on a `SyncArbiter` thread; each step is one batched forward pass (prefill chunks, decode tokens, draft trees) with verification and commit (SpecInfer tree verification inside continuous batching).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Handler, Recipient, SyncContext};
use arbor_engine::backend::cuda::open_device;
use arbor_engine::sched::{PlannedStep, RequestSpec, Scheduler, SpecPolicy, StepCost};
use arbor_engine::{CpuBackend, KvPool};

use crate::config::{DraftContext, DrafterFactory, EngineConfig};
use crate::error::{codes, Result, ServeError};
use crate::events::RequestId;
use crate::kv_allocator::{LedgerClient, LedgerTraffic};
use crate::messages::{
    Cancel, Cancelled, DraftWork, Enqueue, PlanReply, PlanStep, StepDone, StepReport,
    VerifierState, Verify,
};

pub struct Verifier {
    sched: Scheduler<'static>,
    backend: CpuBackend,
    /// The engine's drafters (what each wants from a pass, what its trees hold at most).
    drafters: Vec<DrafterFactory>,
    vocab: usize,
    max_prompt_tokens: usize,
    /// Request id → its scheduler id and speculation; scheduler id → request id.
    requests: HashMap<RequestId, Tracked>,
    to_req: HashMap<u64, RequestId>,
    /// Replies so far (orders the states the Intake receives).
    seq: u64,
    /// A step waiting for its trees: (step, plan, when it began).
    planned: Option<(u64, PlannedStep, Instant)>,
    /// When the last step ended with requests still running.
    last_end: Option<Instant>,
    step_secs: f64,
    gap_secs: f64,
    gaps: u64,
    /// Raised by the Intake before it sends a message: stop running steps back to back.
    interrupt: Arc<AtomicBool>,
    /// Messages to the KvAllocator and the time waited for them.
    kv_traffic: Arc<LedgerTraffic>,
}

/// A request the scheduler holds.
struct Tracked {
    sid: u64,
    /// Its drafters (engine indices), seed and depth cap, when it speculates.
    spec: Option<(Vec<usize>, u64, usize)>,
}

impl Actor for Verifier {
    type Context = SyncContext<Self>;
}

impl Verifier {
    /// Build the pool and the scheduler; calibrate the step cost when drafters are configured
    /// (adaptive speculation plans with it).
    pub fn new(config: &EngineConfig, ledger: LedgerClient) -> Result<Verifier> {
        let model = Arc::clone(&config.model);
        let backend = CpuBackend::new(config.threads).map_err(ServeError::from)?;
        let kv_traffic = ledger.traffic();
        let pool = KvPool::with_ledger(&model.config, model.config.n_layers, Box::new(ledger))
            .map_err(ServeError::from)?;
        let device =
            open_device(&model, config.device, pool.max_blocks()).map_err(ServeError::from)?;
        let ctx = model.config.context_length;
        let cost = if config.drafters.is_empty() {
            None
        } else {
            let sizes = [1usize, 2, 4, 8, 16, 32, 64];
            Some(StepCost::calibrate(
                &model,
                &backend,
                &sizes,
                128.min(ctx / 2).max(1),
                3,
            )?)
        };
        let mut sched = Scheduler::shared(
            model,
            Some(Arc::clone(&config.tokenizer)),
            pool,
            config.sched.clone(),
        )?;
        if let Some(c) = cost {
            sched.set_step_cost(c);
        }
        if let Some(d) = device {
            sched.set_device(d);
        }
        let max_prompt_tokens = match config.limits.max_prompt_tokens {
            0 => ctx,
            n => n.min(ctx),
        };
        Ok(Verifier {
            sched,
            backend,
            drafters: config.drafters.clone(),
            vocab: config.model.config.vocab_size,
            max_prompt_tokens,
            requests: HashMap::new(),
            to_req: HashMap::new(),
            seq: 0,
            planned: None,
            last_end: None,
            step_secs: 0.0,
            gap_secs: 0.0,
            gaps: 0,
            interrupt: Arc::new(AtomicBool::new(false)),
            kv_traffic,
        })
    }

    /// The most draft nodes a request's merged tree holds when at most `d` deep, for `d` up to
    /// its depth cap (each drafter built for it as the Drafter actors build it).
    fn max_nodes_by_depth(&self, drafters: &[usize], seed: u64, depth: usize) -> Vec<usize> {
        (0..=depth)
            .map(|d| {
                drafters
                    .iter()
                    .enumerate()
                    .map(|(pos, &i)| {
                        let cx = DraftContext {
                            seed: seed.wrapping_add(1 + pos as u64),
                            depth,
                            vocab: self.vocab,
                        };
                        self.drafters[i].max_nodes(&cx, d)
                    })
                    .fold(0, usize::saturating_add)
            })
            .collect()
    }

    /// The flag the Intake raises before it sends a message.
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.interrupt)
    }

    /// The scheduler and pool now (each call numbered: the Intake keeps the newest).
    pub fn state(&mut self) -> VerifierState {
        let st = self.sched.stats();
        let (kv_messages, kv_wait_secs) = self.kv_traffic.totals();
        self.seq += 1;
        VerifierState {
            seq: self.seq,
            running: self.sched.n_running(),
            waiting: self.sched.n_waiting(),
            preempted: st.preemptions,
            prefix_waits: st.prefix_waits,
            steps: st.steps,
            pool: self.sched.pool().stats(),
            step_secs: self.step_secs,
            gap_secs: self.gap_secs,
            gaps: self.gaps,
            kv_messages,
            kv_wait_secs,
        }
    }

    fn enqueue(&mut self, msg: Enqueue) -> Result<usize> {
        let req = msg.req;
        let prompt = msg.prompt;
        if prompt.len() > self.max_prompt_tokens {
            return Err(ServeError::new(
                codes::PROMPT_TOO_LONG,
                format!(
                    "the prompt has {} tokens, the limit is {}",
                    prompt.len(),
                    self.max_prompt_tokens
                ),
            ));
        }
        let seed = req.params.sampling.seed;
        // Trees are drafted by the Drafter actors (`PlanStep` lists the work).
        let spec = match &req.speculation {
            Some(sp) => {
                if let Some(&bad) = sp.drafters.iter().find(|&&i| i >= self.drafters.len()) {
                    return Err(ServeError::internal(format!("no drafter {bad}")));
                }
                Some(RequestSpec {
                    drafters: Vec::new(),
                    budget: sp.budget,
                    policy: if sp.adaptive && self.sched.step_cost().is_some() {
                        SpecPolicy::Adaptive
                    } else {
                        SpecPolicy::Fixed
                    },
                    mode: sp.verify,
                    external: true,
                    candidates: sp
                        .drafters
                        .iter()
                        .map(|&i| self.drafters[i].candidates)
                        .max()
                        .unwrap_or(0),
                    prompt_candidates: sp
                        .drafters
                        .iter()
                        .map(|&i| self.drafters[i].prompt_candidates)
                        .max()
                        .unwrap_or(0),
                    max_nodes_by_depth: self.max_nodes_by_depth(&sp.drafters, seed, sp.depth),
                })
            }
            None => None,
        };
        let n = prompt.len();
        let tracked_spec = req.speculation.map(|sp| (sp.drafters, seed, sp.depth));
        let sid = self.sched.submit_spec(prompt, req.params, spec)?;
        self.to_req.insert(sid, msg.id);
        self.requests.insert(
            msg.id,
            Tracked {
                sid,
                spec: tracked_spec,
            },
        );
        Ok(n)
    }

    /// End every request after a step failed as a whole (their state is not trusted).
    fn fail_all(&mut self, error: ServeError) -> Vec<(RequestId, ServeError)> {
        let mut out = Vec::new();
        // Every request this actor tracks, not only those the scheduler still holds: a request
        // the failed step's planning had already dropped (its `kv_pool_exhausted` event went
        // down with the step) must get a final line too.
        let mut sids: Vec<u64> = self.to_req.keys().copied().collect();
        sids.sort_unstable();
        for sid in sids {
            let _ = self.sched.cancel(sid);
            if let Some(id) = self.forget_sched(sid) {
                out.push((id, error.clone()));
            }
        }
        out
    }

    /// Stop tracking the request the scheduler calls `sid`; its request id.
    fn forget_sched(&mut self, sid: u64) -> Option<RequestId> {
        let id = self.to_req.remove(&sid)?;
        self.requests.remove(&id);
        Some(id)
    }

    /// A report of a step that ran nothing (planning failed, or a stale `Verify`).
    fn empty_report(
        &mut self,
        step: u64,
        started: Instant,
        failed: Vec<(RequestId, ServeError)>,
    ) -> StepReport {
        StepReport {
            step,
            started,
            running_ids: Vec::new(),
            events: Vec::new(),
            failed,
            drafter_failures: Vec::new(),
            commits: Vec::new(),
            state: self.state(),
        }
    }
}

impl Handler<Enqueue> for Verifier {
    type Result = Result<usize>;

    fn handle(&mut self, msg: Enqueue, _: &mut SyncContext<Self>) -> Result<usize> {
        match catch_unwind(AssertUnwindSafe(|| self.enqueue(msg))) {
            Ok(r) => r,
            Err(p) => Err(ServeError::internal(format!(
                "queueing panicked: {}",
                arbor_engine::spec::panic_message(&*p)
            ))),
        }
    }
}

impl Handler<Cancel> for Verifier {
    type Result = actix::MessageResult<Cancel>;

    fn handle(&mut self, msg: Cancel, _: &mut SyncContext<Self>) -> Self::Result {
        let stats = self.requests.remove(&msg.id).and_then(|t| {
            self.to_req.remove(&t.sid);
            self.sched.cancel(t.sid)
        });
        actix::MessageResult(Cancelled {
            state: self.state(),
            stats,
        })
    }
}

impl Verifier {
    /// Finish a planned step and report it.
    fn finish(
        &mut self,
        step: u64,
        planned: PlannedStep,
        started: Instant,
        trees: Vec<(RequestId, arbor_engine::tree::MaskedTree)>,
    ) -> StepReport {
        let trees: Vec<(u64, arbor_engine::tree::MaskedTree)> = trees
            .into_iter()
            .filter_map(|(id, t)| self.requests.get(&id).map(|r| (r.sid, t)))
            .collect();
        let mut failed = Vec::new();
        let stepped = catch_unwind(AssertUnwindSafe(|| {
            self.sched.finish_step(&self.backend, planned, trees)
        }));
        let mut events = match stepped {
            Ok(Ok(events)) => events,
            Ok(Err(e)) => {
                failed = self.fail_all(ServeError::from(e));
                Vec::new()
            }
            Err(p) => {
                failed = self.fail_all(ServeError::internal(format!(
                    "the step panicked: {}",
                    arbor_engine::spec::panic_message(&*p)
                )));
                Vec::new()
            }
        };
        let mut running_ids: Vec<RequestId> = self
            .sched
            .running_ids()
            .iter()
            .filter_map(|sid| self.to_req.get(sid).copied())
            .collect();
        let commits = self
            .sched
            .take_commits()
            .into_iter()
            .filter_map(|mut c| {
                c.id = *self.to_req.get(&c.id)?;
                Some(c)
            })
            .collect();
        // Failures name request ids before finished requests are forgotten.
        let drafter_failures = self
            .sched
            .take_drafter_failures()
            .into_iter()
            .filter_map(|mut f| {
                f.id = *self.to_req.get(&f.id)?;
                Some(f)
            })
            .collect();
        events.retain_mut(|ev| {
            let sid = ev.id;
            let Some(&id) = self.to_req.get(&sid) else {
                return false;
            };
            if ev.finish.is_some() {
                self.forget_sched(sid);
            }
            ev.id = id;
            running_ids.push(id);
            true
        });
        let end = Instant::now();
        self.step_secs += end.duration_since(started).as_secs_f64();
        self.last_end = (!self.sched.is_idle()).then_some(end);
        StepReport {
            step,
            started,
            running_ids,
            events,
            failed,
            drafter_failures,
            commits,
            state: self.state(),
        }
    }
}

impl Verifier {
    /// Plan one step: run it at once when nothing is drafted outside (`None`), or keep the plan
    /// and return the draft work.
    fn plan_one(
        &mut self,
        step: u64,
        report_to: &Recipient<StepDone>,
    ) -> Option<Arc<Vec<DraftWork>>> {
        let started = Instant::now();
        if let Some(t) = self.last_end.take() {
            self.gap_secs += started.duration_since(t).as_secs_f64();
            self.gaps += 1;
        }
        let mut planned = match catch_unwind(AssertUnwindSafe(|| self.sched.begin_step())) {
            Ok(p) => p,
            Err(p) => {
                let failed = self.fail_all(ServeError::internal(format!(
                    "planning panicked: {}",
                    arbor_engine::spec::panic_message(&*p)
                )));
                let report = self.empty_report(step, started, failed);
                report_to.do_send(StepDone(Box::new(report)));
                return None;
            }
        };
        let work: Vec<DraftWork> = std::mem::take(&mut planned.jobs)
            .into_iter()
            .filter_map(|j| {
                let id = *self.to_req.get(&j.id)?;
                let (drafters, seed, depth) = self.requests.get(&id)?.spec.clone()?;
                Some(DraftWork {
                    id,
                    tokens: j.tokens,
                    budget: j.budget,
                    // The request's own depth cap (a drafter built for it may not know it).
                    max_depth: j.max_depth.min(depth),
                    drafters,
                    seed,
                    depth,
                    row_costs: j.row_costs,
                })
            })
            .collect();
        if work.is_empty() {
            let report = self.finish(step, planned, started, Vec::new());
            report_to.do_send(StepDone(Box::new(report)));
            return None;
        }
        self.planned = Some((step, planned, started));
        Some(Arc::new(work))
    }
}

impl Handler<PlanStep> for Verifier {
    type Result = actix::MessageResult<PlanStep>;

    /// Runs steps back to back (each report goes to `report_to` as it is done) until the
    /// scheduler is idle, a step needs drafting, or the Intake has messages waiting (it raises
    /// `interrupt` before sending them): no round trip between consecutive plain steps.
    fn handle(&mut self, msg: PlanStep, _: &mut SyncContext<Self>) -> Self::Result {
        let mut step = msg.step;
        loop {
            if let Some(work) = self.plan_one(step, &msg.report_to) {
                return actix::MessageResult(PlanReply::Draft { step, work });
            }
            if self.sched.is_idle() || self.interrupt.swap(false, Ordering::AcqRel) {
                return actix::MessageResult(PlanReply::Looped { last_step: step });
            }
            step += 1;
        }
    }
}

impl Handler<Verify> for Verifier {
    type Result = ();

    fn handle(&mut self, msg: Verify, _: &mut SyncContext<Self>) {
        for (id, drafter) in &msg.dropped {
            if let Some(t) = self.requests.get_mut(id) {
                if let Some((drafters, ..)) = t.spec.as_mut() {
                    drafters.retain(|d| d != drafter);
                    if drafters.is_empty() {
                        t.spec = None;
                    }
                }
            }
        }
        let report_to = msg.report_to.clone();
        let report = match self.planned.take() {
            Some((step, planned, started)) if step == msg.step => {
                self.finish(step, planned, started, msg.trees)
            }
            other => {
                // No plan for this step (stale): keep any other plan, report nothing.
                self.planned = other;
                self.empty_report(msg.step, Instant::now(), Vec::new())
            }
        };
        report_to.do_send(StepDone(Box::new(report)));
    }
}
