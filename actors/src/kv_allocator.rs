//! The KvAllocator actor: owns the paged KV cache's block metadata (reference counts, free queue, 2Q prefix index: vLLM v1's `BlockPool` of PagedAttention) on a thread of its own; grants, refuses, shares and reclaims blocks and reports the counters, through typed messages.
//!
//! The Verifier keeps the K/V storage ([`KvPool::with_ledger`]) and writes only the blocks this
//! actor granted to its sequences: its pool holds a [`LedgerClient`], which turns each question
//! the pool asks (a block for a sequence, is this tail block shared, which cached blocks hold
//! this prefix, these blocks are done) into one message and waits for the answer. Replies come
//! back in the order the questions were sent, so the Verifier sees exactly the state a pool with
//! the allocator inside would have had: outputs are unchanged, bit for bit.
//!
//! [`KvPool::with_ledger`]: arbor_engine::KvPool::with_ledger

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix::dev::ToEnvelope;
use actix::{Actor, Addr, Context, Handler, Message, MessageResult};
use arbor_engine::kv::{BlockAllocator, BlockId, BlockLedger};
use arbor_engine::PoolStats;

/// Owner of the block metadata of the server's KV pool.
pub struct KvAllocator {
    blocks: BlockAllocator,
}

impl KvAllocator {
    /// A pool of `n_blocks` free blocks.
    pub fn new(n_blocks: usize) -> KvAllocator {
        KvAllocator {
            blocks: BlockAllocator::new(n_blocks),
        }
    }
}

impl Actor for KvAllocator {
    type Context = Context<Self>;
}

/// Grant one block (refcount 1); None refuses (the pool is full: free and evictable cached
/// blocks are all taken).
#[derive(Message)]
#[rtype(result = "Option<BlockId>")]
pub struct AllocateBlock;

/// Share blocks (a fork): refcount + 1 each.
#[derive(Message)]
#[rtype(result = "Result<(), String>")]
pub struct RetainBlocks(pub Vec<BlockId>);

/// Reclaim blocks a sequence no longer holds: refcount - 1 each, to the free queue or the
/// prefix cache at 0.
#[derive(Message)]
#[rtype(result = "Result<(), String>")]
pub struct ReleaseBlocks(pub Vec<BlockId>);

/// A block's reference count.
#[derive(Message)]
#[rtype(result = "u32")]
pub struct BlockRefcount(pub BlockId);

/// A sequence is about to write into this block: shared (copy it first), or not (it leaves the
/// prefix index).
#[derive(Message)]
#[rtype(result = "bool")]
pub struct ClaimForWrite(pub BlockId);

/// Full blocks offered to the prefix cache under their chained hashes.
#[derive(Message)]
#[rtype(result = "()")]
pub struct RegisterPrefix(pub Vec<(BlockId, u64)>);

/// The cached blocks of the longest run of these chained prefix hashes, retained for the asker.
#[derive(Message)]
#[rtype(result = "Vec<BlockId>")]
pub struct LookupPrefix(pub Vec<u64>);

/// The counters: blocks total / used / cached / free, prefix hits and lookups.
#[derive(Message)]
#[rtype(result = "PoolStats")]
pub struct KvStats;

impl Handler<AllocateBlock> for KvAllocator {
    type Result = Option<BlockId>;
    fn handle(&mut self, _: AllocateBlock, _: &mut Context<Self>) -> Option<BlockId> {
        self.blocks.allocate()
    }
}

impl Handler<RetainBlocks> for KvAllocator {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: RetainBlocks, _: &mut Context<Self>) -> Result<(), String> {
        self.blocks.retain_all(&msg.0)
    }
}

impl Handler<ReleaseBlocks> for KvAllocator {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: ReleaseBlocks, _: &mut Context<Self>) -> Result<(), String> {
        let r = BlockLedger::release_all(&mut self.blocks, &msg.0);
        if let Err(e) = &r {
            tracing::error!(error = %e, "KV block release refused");
        }
        r
    }
}

impl Handler<BlockRefcount> for KvAllocator {
    type Result = u32;
    fn handle(&mut self, msg: BlockRefcount, _: &mut Context<Self>) -> u32 {
        self.blocks.refcount(msg.0)
    }
}

impl Handler<ClaimForWrite> for KvAllocator {
    type Result = bool;
    fn handle(&mut self, msg: ClaimForWrite, _: &mut Context<Self>) -> bool {
        self.blocks.claim_for_write(msg.0)
    }
}

impl Handler<RegisterPrefix> for KvAllocator {
    type Result = ();
    fn handle(&mut self, msg: RegisterPrefix, _: &mut Context<Self>) {
        self.blocks.register_all(&msg.0);
    }
}

impl Handler<LookupPrefix> for KvAllocator {
    type Result = MessageResult<LookupPrefix>;
    fn handle(&mut self, msg: LookupPrefix, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.blocks.lookup_chain(&msg.0))
    }
}

impl Handler<KvStats> for KvAllocator {
    type Result = MessageResult<KvStats>;
    fn handle(&mut self, _: KvStats, _: &mut Context<Self>) -> Self::Result {
        MessageResult(BlockLedger::stats(&self.blocks))
    }
}

/// The Verifier's side of the ledger: questions are messages to the [`KvAllocator`], answered
/// before the call returns (the Verifier's thread waits; it runs no event loop); releases and
/// prefix registrations are sent without waiting (the mailbox keeps their order, so any later
/// question sees them). When the allocator has stopped (shutdown) every grant is refused, every
/// block counts as shared and releases are dropped, so a pool outliving it fails safe instead of
/// writing blocks it was never granted.
///
/// The Verifier's pool is the only client that changes the allocator's state, so two facts the
/// allocator told it stay true until the client itself changes them, and the client remembers
/// them instead of asking again each step: the blocks granted to one sequence and not shared or
/// offered to the prefix cache since (refcount 1, unregistered: written without a copy), and the
/// counters after its last change. A decoding sequence then costs a message only when it
/// crosses into a new block.
pub struct LedgerClient {
    addr: Addr<KvAllocator>,
    traffic: Arc<LedgerTraffic>,
    /// Blocks held by exactly one sequence and in no prefix index (as the allocator answered).
    exclusive: HashSet<BlockId>,
    /// The allocator's counters as of this client's last change (None: ask).
    counters: Cell<Option<PoolStats>>,
}

/// Messages a [`LedgerClient`] sent and the time it waited for their answers (the allocator
/// actor's cost to the Verifier, which `stats` reports per step).
#[derive(Debug, Default)]
pub struct LedgerTraffic {
    messages: AtomicU64,
    wait_nanos: AtomicU64,
}

impl LedgerTraffic {
    /// Messages answered so far and the seconds waited for them.
    pub fn totals(&self) -> (u64, f64) {
        (
            self.messages.load(Ordering::Relaxed),
            self.wait_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        )
    }
}

impl LedgerClient {
    pub fn new(addr: Addr<KvAllocator>) -> LedgerClient {
        LedgerClient {
            addr,
            traffic: Arc::default(),
            exclusive: HashSet::new(),
            counters: Cell::new(None),
        }
    }

    /// The counters of this client's messages.
    pub fn traffic(&self) -> Arc<LedgerTraffic> {
        Arc::clone(&self.traffic)
    }

    /// Send `msg`: a question waits for its answer; a change also forgets the remembered
    /// counters; a change told is not waited for (the mailbox keeps its order; the allocator logs
    /// one it refuses) and answers None.
    fn send<M>(&self, msg: M, how: Delivery) -> Option<M::Result>
    where
        M: Message + Send + 'static,
        M::Result: Send,
        KvAllocator: Handler<M>,
        <KvAllocator as Actor>::Context: ToEnvelope<KvAllocator, M>,
    {
        if how != Delivery::Question {
            self.counters.set(None);
        }
        self.traffic.messages.fetch_add(1, Ordering::Relaxed);
        if how == Delivery::Tell {
            self.addr.do_send(msg);
            return None;
        }
        let t0 = Instant::now();
        let reply = futures_executor::block_on(self.addr.send(msg)).ok();
        let waited = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.traffic.wait_nanos.fetch_add(waited, Ordering::Relaxed);
        reply
    }
}

/// How [`LedgerClient`] sends a message.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Delivery {
    /// Reads the allocator's state; waits for the answer.
    Question,
    /// Changes it; waits for the answer.
    Change,
    /// Changes it; does not wait.
    Tell,
}

impl BlockLedger for LedgerClient {
    fn allocate(&mut self) -> Option<BlockId> {
        let b = self.send(AllocateBlock, Delivery::Change).flatten()?;
        self.exclusive.insert(b);
        Some(b)
    }

    /// A pool with this ledger is fixed (`KvPool::with_ledger`): it never asks to grow.
    fn grow(&mut self, _n: usize) {}

    fn retain_all(&mut self, blocks: &[BlockId]) -> Result<(), String> {
        for b in blocks {
            self.exclusive.remove(b);
        }
        self.send(RetainBlocks(blocks.to_vec()), Delivery::Change)
            .unwrap_or_else(|| Err("the KV allocator has stopped".into()))
    }

    fn release_all(&mut self, blocks: &[BlockId]) -> Result<(), String> {
        for b in blocks {
            self.exclusive.remove(b);
        }
        self.send(ReleaseBlocks(blocks.to_vec()), Delivery::Tell);
        Ok(())
    }

    fn refcount(&self, b: BlockId) -> u32 {
        if self.exclusive.contains(&b) {
            return 1;
        }
        self.send(BlockRefcount(b), Delivery::Question)
            .unwrap_or(u32::MAX)
    }

    fn claim_for_write(&mut self, b: BlockId) -> bool {
        if self.exclusive.contains(&b) {
            return false;
        }
        let shared = self
            .send(ClaimForWrite(b), Delivery::Change)
            .unwrap_or(true);
        if !shared {
            self.exclusive.insert(b);
        }
        shared
    }

    fn register_all(&mut self, entries: &[(BlockId, u64)]) {
        for (b, _) in entries {
            self.exclusive.remove(b);
        }
        self.send(RegisterPrefix(entries.to_vec()), Delivery::Tell);
    }

    fn lookup_chain(&mut self, hashes: &[u64]) -> Vec<BlockId> {
        self.send(LookupPrefix(hashes.to_vec()), Delivery::Change)
            .unwrap_or_default()
    }

    fn stats(&self) -> PoolStats {
        if let Some(c) = self.counters.get() {
            return c;
        }
        let c = self.send(KvStats, Delivery::Question);
        self.counters.set(c);
        c.unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix::Arbiter;
    use arbor_engine::quant::GgmlType;
    use arbor_engine::sched::{SchedConfig, Scheduler};
    use arbor_engine::testing::{tiny_model, TinySpec};
    use arbor_engine::{CpuBackend, GenerateParams, KvCache, KvPool, SamplingParams};

    /// A KvAllocator on an arbiter thread of its own (as `Engine::start` runs it).
    fn allocator(n_blocks: usize) -> Addr<KvAllocator> {
        actix::System::new().block_on(async move {
            KvAllocator::start_in_arbiter(&Arbiter::new().handle(), move |_| {
                KvAllocator::new(n_blocks)
            })
        })
    }

    /// The scheduler over a pool whose metadata the actor keeps behaves exactly as over a pool
    /// with its allocator inside: same outputs, same counters after every step (admission,
    /// chunked prefill, prefix hits and copy-on-write, preemption in a pool too small for all
    /// requests, release at finish), and the actor's own counters are the pool's.
    #[test]
    fn a_pool_whose_blocks_the_actor_grants_matches_a_local_one() {
        let be = CpuBackend::new(2).unwrap();
        let model = tiny_model(
            &TinySpec {
                n_embd: 128,
                n_ff: 256,
                n_head: 4,
                n_head_kv: 2,
                weight_type: GgmlType::Q8_0,
                ..TinySpec::default()
            },
            3,
        )
        .unwrap();
        let vocab = model.config.vocab_size as u32;
        let n_blocks = 14;
        let kv = allocator(n_blocks);
        let local = KvPool::new(&model.config, model.config.n_layers, n_blocks);
        let remote = KvPool::with_ledger(
            &model.config,
            model.config.n_layers,
            Box::new(LedgerClient::new(kv.clone())),
        )
        .unwrap();
        // A 48-token shared prefix (three full blocks), then each request's own tokens.
        let prefix: Vec<u32> = (0..48).map(|j| (j * 7 + 5) % vocab).collect();
        let prompts: Vec<Vec<u32>> = (0..6u32)
            .map(|i| {
                let mut p = prefix.clone();
                p.extend((0..3 + 9 * i).map(|j| (j * 13 + i * 29 + 1) % vocab));
                p
            })
            .collect();
        let params = GenerateParams {
            max_tokens: 24,
            sampling: SamplingParams::greedy(),
            ..GenerateParams::default()
        };
        let config = SchedConfig {
            prefix_caching: true,
            prefill_chunk: 32,
            ..SchedConfig::default()
        };
        let mut scheds = [&local, &remote].map(|pool| {
            let mut s = Scheduler::new(&model, None, pool.clone(), config.clone()).unwrap();
            for p in &prompts {
                s.submit(p.clone(), params.clone()).unwrap();
            }
            s
        });
        let mut finished = [Vec::new(), Vec::new()];
        let mut steps = 0;
        while !scheds[0].is_idle() {
            for (s, out) in scheds.iter_mut().zip(finished.iter_mut()) {
                for ev in s.step(&be).unwrap() {
                    if let Some(f) = ev.finish {
                        out.push((ev.id, format!("{f:?}")));
                    }
                }
            }
            assert_eq!(local.stats(), remote.stats(), "after step {steps}");
            let actor = futures_executor::block_on(kv.send(KvStats)).unwrap();
            assert_eq!(actor, remote.stats());
            steps += 1;
            assert!(steps < 10_000);
        }
        assert!(scheds[1].is_idle());
        assert_eq!(finished[0], finished[1]);
        assert_eq!(finished[0].len(), prompts.len());
        assert!(finished[0].iter().all(|(_, f)| f.starts_with("Done")));
        let st = scheds[1].stats();
        assert!(st.preemptions > 0, "the pool is small enough to preempt");
        let pool = remote.stats();
        assert!(pool.prefix_hits > 0, "{pool:?}");
        assert_eq!(pool.used, 0);
        // Copy-on-write: a sequence that starts from the cached prefix is forked; writing into
        // its last (shared) block gives it a copy, in both pools alike.
        let forks = [&local, &remote].map(|pool| {
            let mut a = KvCache::with_prefix(pool, 256, &prompts[0]);
            assert_eq!(a.len(), 48, "the shared prefix is cached");
            let b = a.clone();
            a.truncate(a.len() - 1);
            a.reserve(1).unwrap();
            assert_ne!(a.blocks()[2], b.blocks()[2], "the shared block was copied");
            assert_eq!(a.blocks()[..2], b.blocks()[..2]);
            (a, b, pool.stats())
        });
        assert_eq!(forks[0].0.blocks(), forks[1].0.blocks());
        assert_eq!(forks[0].2, forks[1].2);
        drop(forks);
        assert_eq!(local.stats(), remote.stats());
        assert_eq!(remote.stats().used, 0);
        // A pool with a ledger that has handed out blocks already is refused.
        let kv = allocator(4);
        futures_executor::block_on(kv.send(AllocateBlock)).unwrap();
        let ledger = Box::new(LedgerClient::new(kv));
        assert!(KvPool::with_ledger(&model.config, model.config.n_layers, ledger).is_err());
    }
}
