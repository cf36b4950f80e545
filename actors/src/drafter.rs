//! The Drafter actor: one per configured drafter on its own `SyncArbiter` thread; keeps every request's instance of its drafter and drafts their trees each step (a failing instance is dropped, never the request).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use actix::{Actor, Handler, SyncContext};
use arbor_engine::draft::Drafter;
use arbor_engine::spec::{panic_message, propose_checked};

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
}

impl DrafterActor {
    pub fn new(index: usize, factory: DrafterFactory, vocab: usize) -> DrafterActor {
        DrafterActor {
            index,
            factory,
            vocab,
            instances: HashMap::new(),
            pending_failures: Vec::new(),
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
            let slot = self.instances.entry(w.id).or_insert_with(|| {
                let cx = DraftContext {
                    seed: w.seed.wrapping_add(1 + pos as u64),
                    depth: w.depth,
                    vocab: self.vocab,
                };
                match catch_unwind(AssertUnwindSafe(|| self.factory.build(&cx))) {
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
            let Some(d) = slot.as_mut() else {
                continue;
            };
            let n = w.drafters.len();
            let r = catch_unwind(AssertUnwindSafe(|| {
                propose_checked(
                    &mut **d,
                    pos,
                    n,
                    &w.tokens,
                    w.budget,
                    w.max_depth,
                    self.vocab,
                )
            }));
            match r {
                Ok(Ok(t)) => out.trees.push((w.id, pos, t)),
                Ok(Err(e)) => {
                    *slot = None;
                    out.failures.push((w.id, e.to_string()));
                }
                Err(p) => {
                    *slot = None;
                    out.failures
                        .push((w.id, format!("panicked: {}", panic_message(&*p))));
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
                continue;
            };
            let Some(d) = slot.as_mut() else {
                continue;
            };
            let r = catch_unwind(AssertUnwindSafe(|| {
                d.observe(None);
                d.accept(&c.accepted, c.bonus);
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
        }
    }
}
