//! Continuous batching (iteration-level scheduling, Orca / vLLM): every step admits waiting requests while KV blocks allow, runs chunked prefill and decode rows of all running requests in one `forward_batch`, and preempts (recomputes later) the newest request when blocks run out.
//!
//! A request's output depends only on its prompt, its settings and its seed: its rows get the
//! bits they would get alone (the batch kernels are row-invariant), its sampler is its own, and
//! a preempted request keeps its tokens and sampler and recomputes its K/V when resumed.

use std::collections::VecDeque;

use crate::backend::{Backend, BatchMask};
use crate::error::{EngineError, Result};
use crate::generate::{FinishReason, GenerateParams, TokenSink};
use crate::kv::{KvCache, KvPool, BLOCK_SLOTS};
use crate::model::{Model, SeqBatch};
use crate::sample::Sampler;
use crate::tokenizer::Tokenizer;

/// Limits of one scheduler step.
#[derive(Clone, Debug)]
pub struct SchedConfig {
    /// Most rows (prefill and decode tokens together) one forward pass runs.
    pub max_step_tokens: usize,
    /// Most requests running at once.
    pub max_running: usize,
    /// Longest prefill chunk one request gets per step (a long prompt does not stall the
    /// running requests' decoding).
    pub prefill_chunk: usize,
    /// Share the K/V blocks of equal prompt prefixes between requests.
    pub prefix_caching: bool,
}

impl Default for SchedConfig {
    fn default() -> Self {
        SchedConfig {
            max_step_tokens: 256,
            max_running: 64,
            prefill_chunk: 64,
            prefix_caching: true,
        }
    }
}

/// What a step did for one request.
#[derive(Debug)]
pub struct StepEvent {
    pub id: u64,
    /// Tokens generated this step (at most one without speculation).
    pub tokens: Vec<u32>,
    /// Text that became final this step.
    pub text: String,
    /// Set on the request's last event.
    pub finish: Option<Finish>,
}

/// How a request ended.
#[derive(Debug)]
pub enum Finish {
    Done {
        reason: FinishReason,
        /// Every generated token (EOS included when it ended generation).
        tokens: Vec<u32>,
        text: String,
        prompt_tokens: usize,
        /// Prompt tokens whose K/V came from the prefix cache at the first admission.
        cached_prompt_tokens: usize,
        preemptions: usize,
    },
    /// The request cannot run (e.g. it needs more KV blocks than the whole pool).
    Failed(EngineError),
}

/// Scheduler counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct SchedStats {
    pub steps: u64,
    pub rows: u64,
    pub preemptions: u64,
    /// Most blocks in use after any step.
    pub peak_blocks: usize,
}

/// One request's state: waiting (no cache) or running (its cache holds a prefix of `tokens`).
struct Request<'a> {
    id: u64,
    /// Prompt then generated tokens: what the cache must hold before the next sample.
    seq: Vec<u32>,
    prompt_len: usize,
    params: GenerateParams,
    sampler: Sampler,
    /// Text, end-of-generation tokens and stop strings (None without a tokenizer: tokens only).
    sink: Option<TokenSink<'a, fn(&str)>>,
    cache: Option<KvCache>,
    /// Admission order (preemption takes the newest).
    admitted: u64,
    cached_prompt_tokens: Option<usize>,
    preemptions: usize,
    capacity: usize,
}

impl Request<'_> {
    fn generated(&self) -> usize {
        self.seq.len() - self.prompt_len
    }
}

/// The iteration-level scheduler over one model and one KV pool.
pub struct Scheduler<'a> {
    model: &'a Model,
    tokenizer: Option<&'a Tokenizer>,
    pool: KvPool,
    config: SchedConfig,
    waiting: VecDeque<Request<'a>>,
    running: Vec<Request<'a>>,
    next_id: u64,
    admissions: u64,
    stats: SchedStats,
}

impl<'a> Scheduler<'a> {
    /// Without a tokenizer requests produce tokens only: no text, no stop strings, no EOS.
    pub fn new(
        model: &'a Model,
        tokenizer: Option<&'a Tokenizer>,
        pool: KvPool,
        config: SchedConfig,
    ) -> Result<Scheduler<'a>> {
        if pool.kv_dim() != model.config.kv_dim() || pool.n_layers() != model.config.n_layers {
            return Err(EngineError::InvalidArgument(
                "the KV pool was made for another model".into(),
            ));
        }
        if config.max_step_tokens == 0 || config.max_running == 0 || config.prefill_chunk == 0 {
            return Err(EngineError::InvalidArgument(
                "scheduler limits must be positive".into(),
            ));
        }
        Ok(Scheduler {
            model,
            tokenizer,
            pool,
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            admissions: 0,
            stats: SchedStats::default(),
        })
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    /// No request waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn n_running(&self) -> usize {
        self.running.len()
    }

    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Queue a request; returns its id. Bad prompts and settings are errors here, never later.
    pub fn submit(&mut self, prompt: Vec<u32>, params: GenerateParams) -> Result<u64> {
        crate::generate::check_prompt(self.model, &prompt)?;
        params.sampling.validate()?;
        let vocab = self.model.config.vocab_size;
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidArgument(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
        let capacity = (prompt.len() + params.max_tokens).min(self.model.config.context_length);
        let id = self.next_id;
        self.next_id += 1;
        let noop: fn(&str) = |_| {};
        self.waiting.push_back(Request {
            id,
            prompt_len: prompt.len(),
            seq: prompt,
            sampler: Sampler::new(params.sampling.clone())?,
            sink: self.tokenizer.map(|t| TokenSink::new(t, &params, noop)),
            params,
            cache: None,
            admitted: 0,
            cached_prompt_tokens: None,
            preemptions: 0,
            capacity,
        });
        Ok(id)
    }

    /// Drop a request wherever it is; its blocks go back to the pool. False if unknown.
    pub fn cancel(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.running.remove(i);
            return true;
        }
        false
    }

    /// Admit waiting requests (oldest first) while the pool has blocks for their whole
    /// uncached prompt, and fail those that could never fit.
    fn admit(&mut self, events: &mut Vec<StepEvent>) {
        while self.running.len() < self.config.max_running {
            let Some(req) = self.waiting.front() else {
                break;
            };
            if req.params.max_tokens == 0 {
                let req = self.waiting.pop_front().expect("front exists");
                events.push(StepEvent {
                    id: req.id,
                    tokens: Vec::new(),
                    text: String::new(),
                    finish: Some(Finish::Done {
                        reason: FinishReason::Length,
                        tokens: Vec::new(),
                        text: String::new(),
                        prompt_tokens: req.prompt_len,
                        cached_prompt_tokens: 0,
                        preemptions: 0,
                    }),
                });
                continue;
            }
            let need_all = (req.seq.len() + 1).div_ceil(BLOCK_SLOTS);
            if need_all > self.pool.max_blocks() {
                let mut req = self.waiting.pop_front().expect("front exists");
                req.cache = None;
                events.push(StepEvent {
                    id: req.id,
                    tokens: Vec::new(),
                    text: String::new(),
                    finish: Some(Finish::Failed(EngineError::KvPoolExhausted {
                        needed: need_all,
                    })),
                });
                continue;
            }
            let cache = if self.config.prefix_caching {
                KvCache::with_prefix(&self.pool, req.capacity, &req.seq)
            } else {
                KvCache::in_pool(&self.pool, req.capacity)
            };
            let need = (req.seq.len() + 1).div_ceil(BLOCK_SLOTS) - cache.blocks().len();
            if need > self.pool.available() {
                break; // its prefix blocks go back with `cache`
            }
            let mut req = self.waiting.pop_front().expect("front exists");
            if req.cached_prompt_tokens.is_none() {
                req.cached_prompt_tokens = Some(cache.len().min(req.prompt_len));
            }
            req.cache = Some(cache);
            self.admissions += 1;
            req.admitted = self.admissions;
            self.running.push(req);
        }
    }

    /// Free the newest running request's blocks and queue it first (it recomputes later).
    fn preempt_newest(&mut self) -> bool {
        if self.running.len() <= 1 {
            return false;
        }
        let i = (0..self.running.len())
            .max_by_key(|&i| self.running[i].admitted)
            .expect("non-empty");
        let mut req = self.running.remove(i);
        req.cache = None;
        req.preemptions += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(req);
        true
    }

    /// One iteration: admission, then one forward pass over every running request's rows
    /// (decode tokens first, then prefill chunks within the step's token budget), sampling and
    /// stop checks. Returns one event per request that produced tokens or finished.
    pub fn step<B: Backend>(&mut self, backend: &B) -> Result<Vec<StepEvent>> {
        let mut events = Vec::new();
        self.admit(&mut events);
        // Rows per running request: decode (1 row) first, then prefill chunks in admission order.
        let mut plan = loop {
            let mut order: Vec<usize> = (0..self.running.len()).collect();
            order.sort_by_key(|&i| {
                let r = &self.running[i];
                let left = r.seq.len() - r.cache.as_ref().map_or(0, KvCache::len);
                (left > 1, r.admitted)
            });
            let mut budget = self.config.max_step_tokens;
            let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, rows)
            let mut blocks = 0;
            for i in order {
                let r = &self.running[i];
                let cache = r.cache.as_ref().expect("running requests have a cache");
                let left = r.seq.len() - cache.len();
                let n = left.min(self.config.prefill_chunk).min(budget);
                if n == 0 {
                    continue;
                }
                budget -= n;
                blocks += cache.blocks_needed(n);
                plan.push((i, n));
            }
            if blocks <= self.pool.available() {
                break plan;
            }
            if !self.preempt_newest() {
                // One request alone does not fit: it can never run.
                if let Some(req) = self.running.pop() {
                    events.push(StepEvent {
                        id: req.id,
                        tokens: Vec::new(),
                        text: String::new(),
                        finish: Some(Finish::Failed(EngineError::KvPoolExhausted {
                            needed: blocks,
                        })),
                    });
                }
                return Ok(events);
            }
        };
        if plan.is_empty() {
            return Ok(events);
        }
        plan.sort_by_key(|&(i, _)| i);
        // Inputs: each request's next rows, logits for the last row when it completes the sequence.
        let inputs: Vec<(Vec<u32>, Vec<usize>, Vec<usize>)> = plan
            .iter()
            .map(|&(i, n)| {
                let r = &self.running[i];
                let start = r.cache.as_ref().map_or(0, KvCache::len);
                let toks = r.seq[start..start + n].to_vec();
                let pos: Vec<usize> = (start..start + n).collect();
                let rows = if start + n == r.seq.len() {
                    vec![n - 1]
                } else {
                    vec![]
                };
                (toks, pos, rows)
            })
            .collect();
        let logits = {
            let mut chosen: Vec<&mut Request<'a>> = Vec::with_capacity(plan.len());
            let mut rest = self.running.iter_mut().enumerate();
            for &(i, _) in &plan {
                for (j, r) in rest.by_ref() {
                    if j == i {
                        chosen.push(r);
                        break;
                    }
                }
            }
            let mut batch: Vec<SeqBatch<'_>> = chosen
                .into_iter()
                .zip(&inputs)
                .map(|(r, (toks, pos, rows))| SeqBatch {
                    cache: r.cache.as_mut().expect("running requests have a cache"),
                    tokens: toks,
                    positions: pos,
                    mask: BatchMask::Causal,
                    logit_rows: rows,
                })
                .collect();
            self.model.forward_batch(backend, &mut batch)?
        };
        self.stats.steps += 1;
        self.stats.rows += inputs.iter().map(|x| x.0.len() as u64).sum::<u64>();
        // Sample, stream, stop.
        let mut finished = Vec::new();
        for (&(i, _), lg) in plan.iter().zip(&logits) {
            let r = &mut self.running[i];
            if let (Some(c), true) = (r.cache.as_mut(), self.config.prefix_caching) {
                c.register_prefix(&r.seq);
            }
            if lg.is_empty() {
                continue;
            }
            let tok = r.sampler.sample(lg);
            let (mut reason, text) = match r.sink.as_mut() {
                Some(sink) => {
                    let before = sink.text().len();
                    let reason = sink.push(tok);
                    (reason, sink.text()[before..].to_string())
                }
                None => (None, String::new()),
            };
            // The cache holds `seq` but its last token: it is fed next step (if any).
            r.seq.push(tok);
            if reason.is_none()
                && (r.generated() >= r.params.max_tokens || r.seq.len() > r.capacity)
            {
                reason = Some(FinishReason::Length);
            }
            events.push(StepEvent {
                id: r.id,
                tokens: vec![tok],
                text,
                finish: None,
            });
            if let Some(reason) = reason {
                finished.push((i, reason, events.len() - 1));
            }
        }
        // Remove finished requests (highest index first); their blocks go back on drop.
        finished.sort_by_key(|&(i, _, _)| std::cmp::Reverse(i));
        for (i, reason, ev) in finished {
            let r = self.running.remove(i);
            let (text, tokens, reason) = match r.sink {
                Some(sink) => {
                    let before = sink.text().len();
                    let (text, tokens, reason) = sink.finish(reason);
                    events[ev].text.push_str(&text[before..]);
                    (text, tokens, reason)
                }
                None => (String::new(), r.seq[r.prompt_len..].to_vec(), reason),
            };
            events[ev].finish = Some(Finish::Done {
                reason,
                tokens,
                text,
                prompt_tokens: r.prompt_len,
                cached_prompt_tokens: r.cached_prompt_tokens.unwrap_or(0),
                preemptions: r.preemptions,
            });
        }
        self.stats.peak_blocks = self.stats.peak_blocks.max(self.pool.stats().used);
        Ok(events)
    }

    /// Step until every request has finished; returns each request's finish, by id.
    pub fn run_to_completion<B: Backend>(&mut self, backend: &B) -> Result<Vec<(u64, Finish)>> {
        let mut done = Vec::new();
        while !self.is_idle() {
            for ev in self.step(backend)? {
                if let Some(f) = ev.finish {
                    done.push((ev.id, f));
                }
            }
        }
        done.sort_by_key(|(id, _)| *id);
        Ok(done)
    }
}

#[cfg(test)]
mod tests;
