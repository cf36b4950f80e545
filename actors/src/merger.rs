//! The TreeMerger actor: collects the drafters' trees of a step, merges them per request into one token tree (SpecInfer's tree merge: shared prefixes become one path) in drafter order so drafter ids match what each request was promised, and builds each merged tree's topology-aware attention mask.

use actix::{Actor, Handler, SyncContext};
use arbor_engine::tree::{MaskedTree, TokenTree};

use crate::messages::{Merge, Merged};

#[derive(Default)]
pub struct TreeMerger;

impl Actor for TreeMerger {
    type Context = SyncContext<Self>;
}

impl Handler<Merge> for TreeMerger {
    type Result = actix::MessageResult<Merge>;

    fn handle(&mut self, msg: Merge, _: &mut SyncContext<Self>) -> Self::Result {
        let mut trees = Vec::with_capacity(msg.work.len());
        for w in msg.work.iter() {
            let Some(&root) = w.tokens.last() else {
                continue;
            };
            // [root, drafter 0's tree, drafter 1's tree, ...] as the in-process merge does.
            let mut parts: Vec<(usize, &TokenTree)> = msg
                .drafted
                .iter()
                .flat_map(|d| d.trees.iter())
                .filter(|(id, _, _)| *id == w.id)
                .map(|(_, pos, t)| (*pos, t))
                .collect();
            parts.sort_by_key(|&(pos, _)| pos);
            let mut all = Vec::with_capacity(parts.len() + 1);
            all.push(TokenTree::root_only(root));
            all.extend(parts.into_iter().map(|(_, t)| t.clone()));
            if let Ok(t) = TokenTree::merge(&all) {
                // The Verifier attends with this mask (restricted to the rows it keeps).
                trees.push((w.id, MaskedTree::new(t)));
            }
        }
        actix::MessageResult(Merged {
            step: msg.step,
            trees,
        })
    }
}
