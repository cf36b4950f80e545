//! The Drafter actor: one per configured drafter on its own `SyncArbiter` thread; keeps every request's instance of its drafter and drafts their trees each step (a failing instance is dropped, never the request).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use actix::{Actor, Handler, SyncContext};
use arbor_engine::draft::{Drafter, PassCandidates};
use arbor_engine::spec::{panic_message, propose_many, ProposeItem};

use crate::config::{DraftContext, DrafterFactory};
use crate::events::RequestId;
use crate::messages::{CommitDrafts, Draft, Drafted, Forget};

pub struct DrafterActor {
    /// Index among the engine's drafters.
    index: usize,
    factory: DrafterFactory,
    vocab: usize,
    /// Per request: its instance, or `None` once it failed.
    instances: HashMap<RequestId, Option<Box<dyn Drafter>>>,
    /// Failures in `accept`, reported with the next `Drafted`.
    pending_failures: Vec<(RequestId, String)>,
    /// Prompt candidates (Token Recycling's warm start) of requests whose instance is built at
    /// their first `Draft`, after their prefill.
    early_candidates: HashMap<RequestId, Vec<PassCandidates>>,
}

impl DrafterActor {
    pub fn new(index: usize, factory: DrafterFactory, vocab: usize) -> DrafterActor {
        DrafterActor {
            index,
            factory,
            vocab,
            instances: HashMap::new(),
            pending_failures: Vec::new(),
            early_candidates: HashMap::new(),
        }
    }
}

impl Actor for DrafterActor {
    type Context = SyncContext<Self>;
}

impl Handler<Draft> for DrafterActor {
    type Result = actix::MessageResult<Draft>;

    fn handle(&mut self, msg: Draft, _: &mut SyncContext<Self>) -> Self::Result {
        let mut out = Drafted {
            step: msg.step,
            drafter: self.index,
            trees: Vec::new(),
            failures: std::mem::take(&mut self.pending_failures),
        };
        for w in msg.work.iter() {
            let Some(pos) = w.drafters.iter().position(|&d| d == self.index) else {
                continue;
            };
            self.instances.entry(w.id).or_insert_with(|| {
                let cx = DraftContext {
                    seed: w.seed.wrapping_add(1 + pos as u64),
                    depth: w.depth,
                    vocab: self.vocab,
                };
                let early = self.early_candidates.remove(&w.id).unwrap_or_default();
                let built = catch_unwind(AssertUnwindSafe(|| {
                    let mut d = self.factory.build(&cx)?;
                    for c in &early {
                        d.observe_candidates(&c.rows());
                    }
                    Ok::<_, arbor_engine::EngineError>(d)
                }));
                match built {
                    Ok(Ok(d)) => Some(d),
                    Ok(Err(e)) => {
                        out.failures.push((w.id, format!("build: {e}")));
                        None
                    }
                    Err(p) => {
                        out.failures
                            .push((w.id, format!("build panicked: {}", panic_message(&*p))));
                        None
                    }
                }
            });
        }
        // Every request's instance proposes in one call: model drafters sharing this drafter's
        // pool run one forward pass per tree depth for all of the step's requests.
        let order: HashMap<RequestId, usize> = msg
            .work
            .iter()
            .enumerate()
            .map(|(k, w)| (w.id, k))
            .collect();
        let mut live: Vec<(usize, RequestId, &mut Box<dyn Drafter>)> = self
            .instances
            .iter_mut()
            .filter_map(|(id, slot)| Some((*order.get(id)?, *id, slot.as_mut()?)))
            .collect();
        live.sort_by_key(|&(k, _, _)| k);
        let mut items = Vec::with_capacity(live.len());
        let mut who = Vec::with_capacity(live.len());
        for (k, id, d) in live {
            let w = &msg.work[k];
            let Some(pos) = w.drafters.iter().position(|&i| i == self.index) else {
                continue;
            };
            who.push((id, pos));
            d.set_row_costs(&w.row_costs);
            items.push(ProposeItem {
                drafter: &mut **d,
                tokens: &w.tokens,
                index: pos,
                of: w.drafters.len(),
                budget: w.budget,
                max_depth: w.max_depth,
                vocab: self.vocab,
            });
        }
        let proposed = propose_many(&mut items);
        drop(items);
        for ((id, pos), r) in who.into_iter().zip(proposed) {
            match r {
                Ok(t) => out.trees.push((id, pos, t)),
                Err(e) => {
                    self.instances.insert(id, None);
                    out.failures.push((id, e.to_string()));
                }
            }
        }
        actix::MessageResult(out)
    }
}

impl Handler<CommitDrafts> for DrafterActor {
    type Result = ();

    fn handle(&mut self, msg: CommitDrafts, _: &mut SyncContext<Self>) {
        let failures = &mut self.pending_failures;
        for c in msg.commits.iter() {
            let Some(slot) = self.instances.get_mut(&c.id) else {
                // Not drafted for yet: keep a prefill's candidates for its first `Draft`.
                if let (true, Some(cands), true) = (
                    c.prefill,
                    c.candidates.as_ref(),
                    self.factory.prompt_candidates > 0,
                ) {
                    self.early_candidates
                        .entry(c.id)
                        .or_default()
                        .push(cands.clone());
                }
                continue;
            };
            let Some(d) = slot.as_mut() else {
                continue;
            };
            let r = catch_unwind(AssertUnwindSafe(|| {
                if !c.prefill {
                    d.observe(None);
                }
                if let Some(cands) = c.candidates.as_ref() {
                    let wanted = if c.prefill {
                        d.prompt_candidates()
                    } else {
                        d.candidates_wanted()
                    };
                    if wanted > 0 {
                        d.observe_candidates(&cands.rows());
                    }
                }
                if !c.prefill {
                    d.accept(&c.accepted, c.bonus);
                }
            }));
            if let Err(p) = r {
                *slot = None;
                failures.push((c.id, format!("accept panicked: {}", panic_message(&*p))));
            }
        }
    }
}

impl Handler<Forget> for DrafterActor {
    type Result = ();

    fn handle(&mut self, msg: Forget, _: &mut SyncContext<Self>) {
        for id in msg.ids {
            self.instances.remove(&id);
            self.early_candidates.remove(&id);
        }
    }
}
