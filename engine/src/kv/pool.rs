//! Paged KV block allocation with reference counts, a LIFO free list and hash-chained prefix caching (the vLLM v1 `BlockPool` metadata of PagedAttention, Kwon et al. 2023); no K/V storage here.
//!
//! Every block is in exactly one of three states:
//! - *used*: refcount > 0 (held by one or more sequences; forks share blocks);
//! - *cached*: refcount 0 but still registered under a prefix hash, kept so a later request with
//!   the same prefix can revive it, in two LRU lists (least recently released first), as in 2Q
//!   (Johnson and Shasha 1994): *probation* for blocks no lookup has found yet (most generated
//!   text), *protected* for blocks a prefix lookup has hit (shared system prompts, templates);
//!   probation is evicted first;
//! - *free*: refcount 0 and no hash, most recently freed first; never-used blocks come last.
//!
//! `allocate` hands out a block whose memory is already resident before touching a new one: a
//! freed block (most recently freed first), else the least recently released cached block
//! (probation before protected; dropping its hash), and only then a never-used block. So a server's resident memory follows
//! its peak live K/V and never creeps up to the pool's size as finished requests leave cached
//! prefixes behind (the prefix cache lives in memory the pool has touched already). Every
//! operation is O(1) amortized: the LRU is an intrusive doubly linked list over block ids, the
//! free queue a `VecDeque`, the prefix map a `HashMap`.

use std::collections::{HashMap, VecDeque};

/// Index of a block in the pool.
pub type BlockId = u32;

/// Slots (tokens) per block.
pub const BLOCK_SLOTS: usize = 16;

/// "No block" link in the LRU list; also why a pool holds at most `u32::MAX` blocks.
const NIL: u32 = u32::MAX;

/// Largest number of blocks a pool can hold (ids `0..MAX_BLOCKS`; `u32::MAX` is the LRU's "none").
const MAX_BLOCKS: usize = NIL as usize;

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// All blocks of the pool (`used + cached + free`).
    pub total: usize,
    /// Blocks with refcount > 0.
    pub used: usize,
    /// Blocks with refcount 0 that still hold a registered prefix hash (evictable).
    pub cached: usize,
    /// Blocks with refcount 0 and no hash.
    pub free: usize,
    /// Prefix-cache lookups that found a block.
    pub prefix_hits: u64,
    /// Prefix-cache lookups made.
    pub prefix_lookups: u64,
}

/// Block allocator of a paged KV cache: refcounts, free queue, cached-block LRU and prefix map.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    /// Reference count per block.
    refs: Vec<u32>,
    /// Registered prefix hash per block; `Some(h)` implies `prefix[h] == b`.
    hashes: Vec<Option<u64>>,
    /// Prefix hash -> the one block registered under it.
    prefix: HashMap<u64, BlockId>,
    /// Free blocks (refcount 0, no hash), handed out front first.
    free: VecDeque<BlockId>,
    /// LRU links of cached blocks (refcount 0, hashed); `NIL` at the ends / for blocks not in one.
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Whether a prefix lookup has found the block since it was registered: which LRU it is in.
    reused: Vec<bool>,
    /// Least recently released cached block of each list, [probation, protected] (evicted first).
    head: [u32; 2],
    /// Most recently released cached block of each list.
    tail: [u32; 2],
    /// Number of blocks in the LRU.
    cached: usize,
    /// Blocks `fresh_from..` have never been handed out (they sit at the back of `free`, in order).
    fresh_from: usize,
    prefix_hits: u64,
    prefix_lookups: u64,
}

impl BlockAllocator {
    /// A pool of `n_blocks` free blocks (ids `0..n_blocks`, capped below `u32::MAX`).
    pub fn new(n_blocks: usize) -> BlockAllocator {
        let mut pool = BlockAllocator {
            refs: Vec::new(),
            hashes: Vec::new(),
            prefix: HashMap::new(),
            free: VecDeque::new(),
            prev: Vec::new(),
            next: Vec::new(),
            reused: Vec::new(),
            head: [NIL; 2],
            tail: [NIL; 2],
            cached: 0,
            fresh_from: 0,
            prefix_hits: 0,
            prefix_lookups: 0,
        };
        pool.grow(n_blocks);
        pool
    }

    /// Add `n` new blocks (ids total..total+n) to the free queue (elastic pools grow).
    /// The pool never exceeds `u32::MAX` blocks (`u32::MAX - 1` is the last id); blocks past
    /// that are not added.
    pub fn grow(&mut self, n: usize) {
        let start = self.refs.len();
        let end = start.saturating_add(n).min(MAX_BLOCKS);
        if end <= start {
            return;
        }
        self.refs.resize(end, 0);
        self.hashes.resize(end, None);
        self.prev.resize(end, NIL);
        self.next.resize(end, NIL);
        self.reused.resize(end, false);
        // `end <= MAX_BLOCKS < 2^32`, so every id fits a u32.
        self.free.extend((start..end).map(|i| i as BlockId));
    }

    /// Number of blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that `allocate` can hand out now (free + cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.cached
    }

    /// A block with refcount 1: the most recently freed block first, else evicts the least recently
    /// released cached block (dropping its hash from the prefix map), else a never-used block.
    /// None when nothing is available.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let freed = self
            .free
            .front()
            .is_some_and(|&b| (b as usize) < self.fresh_from);
        let b = if freed || self.cached == 0 {
            let b = self.free.pop_front()?;
            self.fresh_from = self.fresh_from.max(b as usize + 1);
            b
        } else {
            let b = if self.head[0] != NIL {
                self.head[0]
            } else {
                self.head[1]
            };
            self.lru_unlink(b);
            self.reused[b as usize] = false;
            if let Some(h) = self.hashes[b as usize].take() {
                self.prefix.remove(&h);
            }
            b
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// refcount += 1 (a fork shares the block). A cached block (refcount 0, hashed) becomes used again.
    /// Err(String) for an id out of range or a block with refcount 0 that is not cached (free),
    /// or a refcount that would overflow; on Err nothing changes.
    pub fn retain(&mut self, b: BlockId) -> Result<(), String> {
        let i = self.index(b)?;
        match self.refs[i] {
            0 if self.hashes[i].is_none() => Err(format!("retain of free block {b}")),
            0 => {
                self.lru_unlink(b);
                self.refs[i] = 1;
                Ok(())
            }
            r => {
                self.refs[i] = r
                    .checked_add(1)
                    .ok_or_else(|| format!("refcount of block {b} overflows"))?;
                Ok(())
            }
        }
    }

    /// refcount -= 1; at 0 the block goes to the cached LRU (if it has a hash) or the free queue.
    /// Err on out-of-range id or refcount already 0 (double free) — and the state stays unchanged.
    pub fn release(&mut self, b: BlockId) -> Result<(), String> {
        let i = self.index(b)?;
        if self.refs[i] == 0 {
            return Err(format!(
                "release of block {b} with refcount 0 (double free)"
            ));
        }
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            if self.hashes[i].is_some() {
                self.lru_push_back(b);
            } else {
                self.free.push_front(b);
            }
        }
        Ok(())
    }

    /// Reference count of `b` (0 for an out-of-range id).
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    /// Record that block `b` (used, full) holds the tokens whose chained hash is `hash`; later
    /// `lookup(hash)` finds it. If `hash` is already mapped to another block, nothing changes (first wins).
    /// A block has at most one hash; registering a new one replaces its old mapping.
    /// A no-op for an out-of-range id or a block with refcount 0 (only used blocks are registered).
    pub fn register(&mut self, b: BlockId, hash: u64) {
        let i = b as usize;
        if self.refs.get(i).copied().unwrap_or(0) == 0 || self.prefix.contains_key(&hash) {
            return;
        }
        if let Some(old) = self.hashes[i].replace(hash) {
            self.prefix.remove(&old);
        }
        // New content: on probation until a lookup finds it (the block is used, in no list).
        self.reused[i] = false;
        self.prefix.insert(hash, b);
    }

    /// Forget `b`'s hash (before it is modified in place). No-op when it has none (or `b` is out
    /// of range). A cached block so unregistered becomes free (first in line).
    pub fn unregister(&mut self, b: BlockId) {
        let i = b as usize;
        let Some(h) = self.hashes.get_mut(i).and_then(Option::take) else {
            return;
        };
        self.prefix.remove(&h);
        if self.refs[i] == 0 {
            self.lru_unlink(b);
            self.free.push_front(b);
        }
        self.reused[i] = false;
    }

    /// The prefix hash registered for `b`, if any.
    pub fn hash_of(&self, b: BlockId) -> Option<u64> {
        self.hashes.get(b as usize).copied().flatten()
    }

    /// Prefix-cache lookup: counts a lookup; on a hit counts a hit, retains the block (refcount+1,
    /// taking it out of the cached LRU when it was there) and returns it.
    /// A block whose refcount would overflow is reported as a miss.
    pub fn lookup(&mut self, hash: u64) -> Option<BlockId> {
        self.prefix_lookups += 1;
        let b = *self.prefix.get(&hash)?;
        // A mapped block is used or cached, so `retain` fails only on refcount overflow.
        self.retain(b).ok()?;
        // Out of any list now (refcount > 0): when released it goes to the protected LRU.
        self.reused[b as usize] = true;
        self.prefix_hits += 1;
        Some(b)
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        let total = self.total();
        let free = self.free.len();
        PoolStats {
            total,
            used: total - free - self.cached,
            cached: self.cached,
            free,
            prefix_hits: self.prefix_hits,
            prefix_lookups: self.prefix_lookups,
        }
    }

    /// `b` as an index, or Err when out of range.
    fn index(&self, b: BlockId) -> Result<usize, String> {
        let i = b as usize;
        if i < self.refs.len() {
            Ok(i)
        } else {
            Err(format!(
                "block {b} out of range (pool of {})",
                self.refs.len()
            ))
        }
    }

    /// Append `b` (in no list) as the most recently released block of its list.
    fn lru_push_back(&mut self, b: BlockId) {
        let i = b as usize;
        let l = usize::from(self.reused[i]);
        self.prev[i] = self.tail[l];
        self.next[i] = NIL;
        if self.tail[l] == NIL {
            self.head[l] = b;
        } else {
            self.next[self.tail[l] as usize] = b;
        }
        self.tail[l] = b;
        self.cached += 1;
    }

    /// Take `b` (in its list) out of it.
    fn lru_unlink(&mut self, b: BlockId) {
        let i = b as usize;
        let l = usize::from(self.reused[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head[l] = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail[l] = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.cached -= 1;
    }
}

/// The block metadata a [`KvPool`](super::KvPool) consults: reference counts, the free queue and
/// the prefix index. The pool keeps the K/V storage and asks its ledger which blocks a sequence
/// may write; by default the ledger is a [`BlockAllocator`] inside the pool, and a server keeps it
/// in an actor of its own (arbor-actors' `KvAllocator`) that answers these calls as messages.
/// Calls are batched where the pool has several blocks at hand, so one step of a sequence asks
/// about twice (a refcount query while planning, a write claim while reserving).
pub trait BlockLedger: Send {
    /// A block with refcount 1, or None when none is left (see [`BlockAllocator::allocate`]).
    fn allocate(&mut self) -> Option<BlockId>;
    /// Add `n` new blocks (an elastic pool grows).
    fn grow(&mut self, n: usize);
    /// refcount += 1 for each block (a fork shares them), stopping at the first error.
    fn retain_all(&mut self, blocks: &[BlockId]) -> Result<(), String>;
    /// refcount -= 1 for each block; the first error is returned after trying them all.
    fn release_all(&mut self, blocks: &[BlockId]) -> Result<(), String>;
    /// Reference count of `b`.
    fn refcount(&self, b: BlockId) -> u32;
    /// Before a write into `b`: true when `b` is shared (the writer copies it first); otherwise
    /// `b` leaves the prefix index (its content is about to change) and false.
    fn claim_for_write(&mut self, b: BlockId) -> bool;
    /// Register full blocks under their chained prefix hashes ([`BlockAllocator::register`]).
    fn register_all(&mut self, entries: &[(BlockId, u64)]);
    /// Look the chained hashes up in order, stopping at the first miss; the blocks found are
    /// retained for the caller ([`BlockAllocator::lookup`]).
    fn lookup_chain(&mut self, hashes: &[u64]) -> Vec<BlockId>;
    /// The counters (blocks total / used / cached / free, prefix hits and lookups).
    fn stats(&self) -> PoolStats;
}

impl BlockLedger for BlockAllocator {
    fn allocate(&mut self) -> Option<BlockId> {
        BlockAllocator::allocate(self)
    }

    fn grow(&mut self, n: usize) {
        BlockAllocator::grow(self, n)
    }

    fn retain_all(&mut self, blocks: &[BlockId]) -> Result<(), String> {
        blocks.iter().try_for_each(|&b| self.retain(b))
    }

    fn release_all(&mut self, blocks: &[BlockId]) -> Result<(), String> {
        let mut first = Ok(());
        for &b in blocks {
            let r = self.release(b);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    fn refcount(&self, b: BlockId) -> u32 {
        BlockAllocator::refcount(self, b)
    }

    fn claim_for_write(&mut self, b: BlockId) -> bool {
        if BlockAllocator::refcount(self, b) > 1 {
            return true;
        }
        self.unregister(b);
        false
    }

    fn register_all(&mut self, entries: &[(BlockId, u64)]) {
        for &(b, h) in entries {
            self.register(b, h);
        }
    }

    fn lookup_chain(&mut self, hashes: &[u64]) -> Vec<BlockId> {
        hashes.iter().map_while(|&h| self.lookup(h)).collect()
    }

    fn stats(&self) -> PoolStats {
        BlockAllocator::stats(self)
    }
}

/// The process's secret key of [`block_hash`] (random at first use).
static BLOCK_HASH_KEY: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();

/// Hash of one full block of tokens chained with its parent block's hash (None for the first
/// block): equal prefixes give equal chains; the same tokens after another prefix a different hash.
/// Keyed SipHash (std's `RandomState`, one random key per process): a client cannot build a prompt
/// whose block collides with another user's prefix and so have its K/V read in that prefix's
/// place (as an unkeyed FNV-1a could be made to; vLLM's CVE-2025-25183 is that attack). Stable
/// within a process only; nothing outlives it.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = BLOCK_HASH_KEY
        .get_or_init(std::hash::RandomState::new)
        .build_hasher();
    match parent {
        None => h.write_u8(0),
        Some(p) => {
            h.write_u8(1);
            h.write_u64(p);
        }
    }
    h.write_usize(tokens.len());
    for &t in tokens {
        h.write_u32(t);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::sample::Index;

    impl BlockAllocator {
        /// Cached blocks in eviction order: probation, then protected, each from least to most
        /// recently released, walking `next` (and checking `prev` and each block's list).
        fn lru_order(&self) -> Vec<BlockId> {
            let mut out = Vec::new();
            for l in 0..2 {
                let mut prev = NIL;
                let mut b = self.head[l];
                while b != NIL {
                    assert_eq!(self.prev[b as usize], prev, "prev link of {b}");
                    assert_eq!(usize::from(self.reused[b as usize]), l, "list of {b}");
                    out.push(b);
                    assert!(out.len() <= self.total(), "LRU cycle");
                    prev = b;
                    b = self.next[b as usize];
                }
                assert_eq!(self.tail[l], prev, "LRU tail");
            }
            assert_eq!(out.len(), self.cached, "cached counter");
            out
        }
    }

    fn release_all(pool: &mut BlockAllocator, blocks: &[BlockId]) {
        for &b in blocks {
            pool.release(b).expect("release of a held block");
        }
    }

    #[test]
    fn allocate_until_empty_returns_none() {
        let mut pool = BlockAllocator::new(3);
        let got: Vec<_> = (0..3).filter_map(|_| pool.allocate()).collect();
        assert_eq!(got, vec![0, 1, 2]);
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.available(), 0);
        let s = pool.stats();
        assert_eq!((s.total, s.used, s.cached, s.free), (3, 3, 0, 0));
        assert_eq!(BlockAllocator::new(0).allocate(), None);
    }

    #[test]
    fn the_most_recently_freed_block_is_reused_first() {
        let mut pool = BlockAllocator::new(6);
        let got: Vec<_> = (0..4).filter_map(|_| pool.allocate()).collect();
        assert_eq!(got, vec![0, 1, 2, 3]);
        release_all(&mut pool, &[2, 0, 3, 1]);
        // Freed blocks in reverse order of release, then the never-used ones.
        let again: Vec<_> = (0..6).filter_map(|_| pool.allocate()).collect();
        assert_eq!(again, vec![1, 3, 0, 2, 4, 5]);
    }

    #[test]
    fn freed_then_cached_then_never_used_blocks() {
        let mut pool = BlockAllocator::new(3);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, 7);
        release_all(&mut pool, &[a, b]);
        // `b` (freed), then the cached `a` (evicted: its memory is resident), then block 2
        // (never used) last.
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.hash_of(a), Some(7));
        assert_eq!(pool.allocate(), Some(a));
        assert_eq!(pool.hash_of(a), None);
        assert_eq!(pool.lookup(7), None);
        assert_eq!(pool.allocate(), Some(2));
        assert_eq!(pool.allocate(), None);
    }

    #[test]
    fn blocks_a_lookup_found_are_evicted_after_those_none_did() {
        let mut pool = BlockAllocator::new(3);
        let blocks: Vec<_> = (0..3).filter_map(|_| pool.allocate()).collect();
        for (&b, h) in blocks.iter().zip([10, 11, 12]) {
            pool.register(b, h);
        }
        release_all(&mut pool, &[0, 1, 2]);
        // Block 0 (a shared prefix, say) is found and released again: the most recently
        // released block now, yet evicted last, after the probation blocks 1 and 2.
        assert_eq!(pool.lookup(10), Some(0));
        release_all(&mut pool, &[0]);
        assert_eq!(pool.lru_order(), vec![1, 2, 0]);
        // Block 1 is found too: protected, after 0.
        assert_eq!(pool.lookup(11), Some(1));
        release_all(&mut pool, &[1]);
        assert_eq!(pool.lru_order(), vec![2, 0, 1]);
        assert_eq!(pool.allocate(), Some(2));
        assert_eq!(pool.allocate(), Some(0));
        assert_eq!(pool.lookup(10), None);
        // Re-registered content starts on probation again.
        let b = pool.allocate().expect("block 1");
        pool.register(b, 13);
        release_all(&mut pool, &[b]);
        let c = pool.allocate().expect("the only cached block");
        assert_eq!(c, b);
        assert_eq!(pool.allocate(), None);
    }

    #[test]
    fn cached_blocks_evicted_lru_and_hash_dropped() {
        let mut pool = BlockAllocator::new(3);
        let blocks: Vec<_> = (0..3).filter_map(|_| pool.allocate()).collect();
        for (&b, h) in blocks.iter().zip([10, 11, 12]) {
            pool.register(b, h);
        }
        // Released 1, 2, 0: that is the eviction order.
        release_all(&mut pool, &[1, 2, 0]);
        let s = pool.stats();
        assert_eq!((s.used, s.cached, s.free), (0, 3, 0));
        assert_eq!(pool.allocate(), Some(1));
        assert_eq!(pool.hash_of(1), None);
        assert_eq!(pool.lookup(11), None, "evicted block's hash still mapped");
        assert_eq!(pool.allocate(), Some(2));
        assert_eq!(pool.allocate(), Some(0));
        assert_eq!(pool.lookup(10), None);
        assert_eq!(pool.lookup(12), None);
        assert_eq!(pool.allocate(), None);
        let s = pool.stats();
        assert_eq!((s.prefix_hits, s.prefix_lookups), (0, 3));
    }

    #[test]
    fn lookup_revives_cached_block() {
        let mut pool = BlockAllocator::new(2);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, 1);
        pool.register(b, 2);
        release_all(&mut pool, &[a, b]);
        assert_eq!(pool.lookup(1), Some(a));
        assert_eq!(pool.refcount(a), 1);
        let s = pool.stats();
        assert_eq!(
            (s.used, s.cached, s.free, s.prefix_hits, s.prefix_lookups),
            (1, 1, 0, 1, 1)
        );
        // Only `b` can be evicted now; then the pool is empty and `a` was never handed out.
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.lookup(1), Some(a));
        assert_eq!(pool.refcount(a), 2);
        // Retaining a cached block revives it as well.
        release_all(&mut pool, &[a, a]);
        pool.retain(a).unwrap();
        assert_eq!((pool.refcount(a), pool.stats().cached), (1, 0));
    }

    #[test]
    fn double_release_is_err_and_changes_nothing() {
        let mut pool = BlockAllocator::new(3);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        pool.register(b, 5);
        release_all(&mut pool, &[a, b]);
        let before = (pool.stats(), pool.free.clone(), pool.lru_order());
        assert!(pool.release(a).is_err());
        assert!(pool.release(b).is_err());
        assert!(pool.release(2).is_err(), "never allocated");
        assert!(pool.release(99).is_err(), "out of range");
        assert_eq!((pool.stats(), pool.free.clone(), pool.lru_order()), before);
        assert_eq!(
            (pool.refcount(a), pool.refcount(b), pool.refcount(99)),
            (0, 0, 0)
        );
    }

    #[test]
    fn retain_of_free_block_is_err() {
        let mut pool = BlockAllocator::new(2);
        assert!(pool.retain(0).is_err());
        assert!(pool.retain(2).is_err(), "out of range");
        let a = pool.allocate().unwrap();
        pool.retain(a).unwrap();
        assert_eq!(pool.refcount(a), 2);
        release_all(&mut pool, &[a, a]);
        assert!(pool.retain(a).is_err());
        assert_eq!(pool.refcount(a), 0);
        assert_eq!(pool.stats().free, 2);
    }

    #[test]
    fn register_first_wins_and_replaces_own_hash() {
        let mut pool = BlockAllocator::new(3);
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, 42);
        pool.register(b, 42);
        assert_eq!((pool.hash_of(a), pool.hash_of(b)), (Some(42), None));
        assert_eq!(pool.lookup(42), Some(a));
        // A new hash for `a` replaces its old mapping.
        pool.register(a, 43);
        assert_eq!(pool.hash_of(a), Some(43));
        assert_eq!(pool.lookup(42), None);
        assert_eq!(pool.lookup(43), Some(a));
        // Now 42 is free for `b`; `b` cannot take `a`'s 43.
        pool.register(b, 42);
        pool.register(b, 43);
        assert_eq!(pool.hash_of(b), Some(42));
        // Free blocks and out-of-range ids are not registered.
        pool.register(2, 44);
        pool.register(9, 45);
        assert_eq!(
            (pool.hash_of(2), pool.lookup(44), pool.lookup(45)),
            (None, None, None)
        );
        // Unregistering forgets the hash; a cached block so unregistered becomes free.
        pool.unregister(b);
        assert_eq!((pool.hash_of(b), pool.lookup(42)), (None, None));
        release_all(&mut pool, &[a, a, a]);
        assert_eq!(pool.stats().cached, 1);
        pool.unregister(a);
        pool.unregister(a);
        let s = pool.stats();
        assert_eq!((s.cached, s.free, s.used), (0, 2, 1));
    }

    #[test]
    fn grow_adds_free_blocks_at_the_back() {
        let mut pool = BlockAllocator::new(1);
        let a = pool.allocate().unwrap();
        pool.release(a).unwrap();
        pool.grow(2);
        assert_eq!(pool.total(), 3);
        let got: Vec<_> = (0..3).filter_map(|_| pool.allocate()).collect();
        assert_eq!(got, vec![0, 1, 2]);
        pool.grow(0);
        assert_eq!(pool.total(), 3);
    }

    #[test]
    fn block_hash_chains() {
        let t: Vec<u32> = (0..BLOCK_SLOTS as u32).collect();
        let u: Vec<u32> = (100..100 + BLOCK_SLOTS as u32).collect();
        let h0 = block_hash(None, &t);
        assert_eq!(h0, block_hash(None, &t), "deterministic");
        let h1 = block_hash(Some(h0), &u);
        assert_eq!(
            h1,
            block_hash(Some(block_hash(None, &t)), &u),
            "equal prefixes, equal chains"
        );
        // The same tokens after another prefix (or none) hash differently.
        assert_ne!(h1, block_hash(None, &u));
        assert_ne!(h1, block_hash(Some(block_hash(None, &u)), &u));
        assert_ne!(
            block_hash(None, &t),
            block_hash(Some(0), &t),
            "no parent != parent 0"
        );
        assert_ne!(block_hash(None, &t), block_hash(None, &u));
        assert_ne!(block_hash(None, &[1, 2]), block_hash(None, &[2, 1]));
        // The same from another thread (one key per process, not per thread).
        let t2 = t.clone();
        let other = std::thread::spawn(move || block_hash(None, &t2))
            .join()
            .unwrap();
        assert_eq!(other, h0);
        // Keyed: not the unkeyed SipHash-1-3 of the same input (std's `DefaultHasher::new` has
        // the all-zero key).
        let mut unkeyed = std::hash::DefaultHasher::new();
        {
            use std::hash::Hasher;
            unkeyed.write_u8(0);
            unkeyed.write_usize(t.len());
            t.iter().for_each(|&x| unkeyed.write_u32(x));
            assert_ne!(unkeyed.finish(), h0);
        }
    }

    /// One step of the property test; indices pick among the live sequences / their blocks.
    #[derive(Clone, Debug)]
    enum Op {
        /// Allocate one block onto a sequence (or a new one).
        Alloc(Index, bool),
        /// Allocate `n` blocks into a new sequence (pressure: evicts cached blocks).
        AllocMany(usize),
        /// Fork: a copy of a sequence retaining every block.
        Fork(Index),
        /// Prefix lookup of a hash; a hit joins a sequence (or a new one).
        Share(u64, Index, bool),
        /// Copy-on-write: allocate a new block, release the old one in the sequence's table.
        Cow(Index, Index),
        /// Register a (full) block of a sequence under a hash.
        Register(Index, Index, u64),
        /// Unregister a block of a sequence.
        Unregister(Index, Index),
        /// Release a whole sequence.
        Drop(Index),
        /// Release one block of a sequence.
        ReleaseOne(Index, Index),
        /// Grow the pool.
        Grow(usize),
        /// Retain, release, register or unregister an arbitrary id (maybe free, cached or out of range).
        RawRetain(u32),
        RawRelease(u32),
        RawRegister(u32, u64),
        RawUnregister(u32),
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        let h = 0u64..24;
        prop_oneof![
            6 => (any::<Index>(), any::<bool>()).prop_map(|(s, n)| Op::Alloc(s, n)),
            1 => (1usize..6).prop_map(Op::AllocMany),
            2 => any::<Index>().prop_map(Op::Fork),
            4 => (h.clone(), any::<Index>(), any::<bool>()).prop_map(|(h, s, n)| Op::Share(h, s, n)),
            2 => (any::<Index>(), any::<Index>()).prop_map(|(s, i)| Op::Cow(s, i)),
            5 => (any::<Index>(), any::<Index>(), h).prop_map(|(s, i, h)| Op::Register(s, i, h)),
            1 => (any::<Index>(), any::<Index>()).prop_map(|(s, i)| Op::Unregister(s, i)),
            3 => any::<Index>().prop_map(Op::Drop),
            2 => (any::<Index>(), any::<Index>()).prop_map(|(s, i)| Op::ReleaseOne(s, i)),
            1 => (0usize..3).prop_map(Op::Grow),
            1 => (0u32..40).prop_map(Op::RawRetain),
            1 => (0u32..40).prop_map(Op::RawRelease),
            1 => (0u32..40, 0u64..24).prop_map(|(b, h)| Op::RawRegister(b, h)),
            1 => (0u32..40).prop_map(Op::RawUnregister),
        ]
    }

    /// Reference model: live sequences, and a naive (O(n)) free queue, LRU and prefix map.
    struct Model {
        seqs: Vec<Vec<BlockId>>,
        total: usize,
        hash: Vec<Option<u64>>,
        map: HashMap<u64, BlockId>,
        free: VecDeque<BlockId>,
        /// Cached blocks no lookup found yet, then those one did (each least recent first).
        probation: Vec<BlockId>,
        protected: Vec<BlockId>,
        reused: Vec<bool>,
        /// Ids from here on were never handed out.
        fresh_from: usize,
        hits: u64,
        lookups: u64,
    }

    impl Model {
        fn new(n: usize) -> Model {
            Model {
                seqs: Vec::new(),
                total: n,
                hash: vec![None; n],
                map: HashMap::new(),
                free: (0..n as u32).collect(),
                probation: Vec::new(),
                protected: Vec::new(),
                reused: vec![false; n],
                fresh_from: 0,
                hits: 0,
                lookups: 0,
            }
        }

        fn count(&self, b: BlockId) -> u32 {
            self.seqs.iter().flatten().filter(|&&x| x == b).count() as u32
        }

        /// Model of `allocate`, checked against the pool's answer.
        fn allocate(&mut self, got: Option<BlockId>) -> Option<BlockId> {
            let freed = self
                .free
                .front()
                .is_some_and(|&b| (b as usize) < self.fresh_from);
            let want = if freed || self.probation.is_empty() && self.protected.is_empty() {
                let b = self.free.pop_front();
                if let Some(b) = b {
                    self.fresh_from = self.fresh_from.max(b as usize + 1);
                }
                b
            } else {
                let b = if self.probation.is_empty() {
                    self.protected.remove(0)
                } else {
                    self.probation.remove(0)
                };
                self.reused[b as usize] = false;
                if let Some(h) = self.hash[b as usize].take() {
                    self.map.remove(&h);
                }
                Some(b)
            };
            assert_eq!(got, want, "allocate");
            if let Some(b) = got {
                assert_eq!(
                    self.count(b),
                    0,
                    "allocate handed out a referenced block {b}"
                );
            }
            got
        }

        /// Model of a new reference to `b` (retain / lookup hit); Err when free.
        fn retain(&mut self, b: BlockId) -> Result<(), ()> {
            if b as usize >= self.total || (self.count(b) == 0 && self.hash[b as usize].is_none()) {
                return Err(());
            }
            self.unlist(b);
            Ok(())
        }

        /// Take `b` out of whichever cached list holds it.
        fn unlist(&mut self, b: BlockId) {
            self.probation.retain(|&x| x != b);
            self.protected.retain(|&x| x != b);
        }

        /// The cached blocks in eviction order.
        fn lru(&self) -> Vec<BlockId> {
            self.probation
                .iter()
                .chain(&self.protected)
                .copied()
                .collect()
        }

        /// Model of dropping one reference to `b` (already removed from `seqs`).
        fn released(&mut self, b: BlockId) {
            if self.count(b) == 0 {
                if self.hash[b as usize].is_some() {
                    if self.reused[b as usize] {
                        self.protected.push(b);
                    } else {
                        self.probation.push(b);
                    }
                } else {
                    self.free.push_front(b);
                }
            }
        }

        fn pick(&self, s: &Index) -> Option<usize> {
            (!self.seqs.is_empty()).then(|| s.index(self.seqs.len()))
        }

        fn pick_block(&self, s: &Index, i: &Index) -> Option<(usize, usize)> {
            let s = self.pick(s)?;
            let len = self.seqs[s].len();
            (len > 0).then(|| (s, i.index(len)))
        }

        /// Model of `register`: only used blocks, first wins, a new hash replaces the old one.
        fn register(&mut self, b: BlockId, h: u64) {
            if b as usize >= self.total || self.count(b) == 0 || self.map.contains_key(&h) {
                return;
            }
            if let Some(old) = self.hash[b as usize].replace(h) {
                self.map.remove(&old);
            }
            self.reused[b as usize] = false;
            self.map.insert(h, b);
        }

        /// Model of `unregister`: a cached block so unregistered becomes free.
        fn unregister(&mut self, b: BlockId) {
            let Some(h) = self.hash.get_mut(b as usize).and_then(Option::take) else {
                return;
            };
            self.map.remove(&h);
            if self.count(b) == 0 {
                self.unlist(b);
                self.free.push_front(b);
            }
            self.reused[b as usize] = false;
        }

        /// Release sequence `s` block by block (a sequence may hold a block more than once).
        fn drop_seq(&mut self, pool: &mut BlockAllocator, s: usize) {
            while let Some(b) = self.seqs[s].pop() {
                pool.release(b).expect("release of a live block");
                self.released(b);
            }
            self.seqs.swap_remove(s);
        }

        /// Push a new reference `b` onto sequence `s` (or a new sequence).
        fn push(&mut self, s: &Index, new: bool, b: BlockId) {
            match self.pick(s) {
                Some(s) if !new => self.seqs[s].push(b),
                _ => self.seqs.push(vec![b]),
            }
        }
    }

    fn apply(pool: &mut BlockAllocator, m: &mut Model, op: &Op) {
        match op {
            Op::Alloc(s, new) => {
                if let Some(b) = m.allocate(pool.allocate()) {
                    m.push(s, *new, b);
                }
            }
            Op::AllocMany(n) => {
                let mut seq = Vec::new();
                for _ in 0..*n {
                    match m.allocate(pool.allocate()) {
                        Some(b) => seq.push(b),
                        None => break,
                    }
                }
                m.seqs.push(seq);
            }
            Op::Fork(s) => {
                if let Some(s) = m.pick(s) {
                    let seq = m.seqs[s].clone();
                    for &b in &seq {
                        pool.retain(b).expect("retain of a live block");
                        m.retain(b).expect("model: live block");
                    }
                    m.seqs.push(seq);
                }
            }
            Op::Share(h, s, new) => {
                let got = pool.lookup(*h);
                m.lookups += 1;
                let want = m.map.get(h).copied();
                assert_eq!(got, want, "lookup({h})");
                if let Some(b) = got {
                    m.hits += 1;
                    m.retain(b).expect("model: mapped block is live or cached");
                    m.reused[b as usize] = true;
                    m.push(s, *new, b);
                }
            }
            Op::Cow(s, i) => {
                if let Some((s, i)) = m.pick_block(s, i) {
                    if let Some(nb) = m.allocate(pool.allocate()) {
                        let old = std::mem::replace(&mut m.seqs[s][i], nb);
                        pool.release(old).expect("release of a live block");
                        m.released(old);
                    }
                }
            }
            Op::Register(s, i, h) => {
                if let Some((s, i)) = m.pick_block(s, i) {
                    let b = m.seqs[s][i];
                    pool.register(b, *h);
                    m.register(b, *h);
                }
            }
            Op::Unregister(s, i) => {
                if let Some((s, i)) = m.pick_block(s, i) {
                    let b = m.seqs[s][i];
                    pool.unregister(b);
                    m.unregister(b);
                }
            }
            Op::RawRegister(b, h) => {
                pool.register(*b, *h);
                m.register(*b, *h);
            }
            Op::RawUnregister(b) => {
                pool.unregister(*b);
                m.unregister(*b);
            }
            Op::Drop(s) => {
                if let Some(s) = m.pick(s) {
                    m.drop_seq(pool, s);
                }
            }
            Op::ReleaseOne(s, i) => {
                if let Some((s, i)) = m.pick_block(s, i) {
                    let b = m.seqs[s].remove(i);
                    pool.release(b).expect("release of a live block");
                    m.released(b);
                }
            }
            Op::Grow(n) => {
                pool.grow(*n);
                m.free.extend(m.total as u32..(m.total + n) as u32);
                m.total += n;
                m.hash.resize(m.total, None);
                m.reused.resize(m.total, false);
            }
            Op::RawRetain(b) => {
                let got = pool.retain(*b);
                let want = m.retain(*b);
                assert_eq!(got.is_ok(), want.is_ok(), "retain({b})");
                if got.is_ok() {
                    m.seqs.push(vec![*b]);
                }
            }
            Op::RawRelease(b) => {
                // Releasing a block nobody holds must fail and change nothing; a held block is
                // released through its sequence (ReleaseOne), so only try the unheld ones here.
                if m.count(*b) == 0 {
                    let before = (pool.stats(), pool.free.clone(), pool.lru_order());
                    assert!(pool.release(*b).is_err(), "release({b}) of an unheld block");
                    assert_eq!((pool.stats(), pool.free.clone(), pool.lru_order()), before);
                }
            }
        }
    }

    fn check(pool: &BlockAllocator, m: &Model) {
        let s = pool.stats();
        assert_eq!(pool.total(), m.total);
        assert_eq!(s.total, m.total);
        let mut used = 0;
        for b in 0..m.total as u32 {
            let c = m.count(b);
            assert_eq!(pool.refcount(b), c, "refcount({b})");
            assert_eq!(pool.hash_of(b), m.hash[b as usize], "hash_of({b})");
            used += usize::from(c > 0);
        }
        assert_eq!(pool.refcount(m.total as u32), 0);
        assert_eq!(s.used, used);
        assert_eq!(s.used + s.cached + s.free, s.total);
        assert_eq!(pool.available(), s.free + s.cached);
        // Free queue and LRU, exactly in order; no free or cached block is referenced.
        assert_eq!(pool.free, m.free, "free queue");
        let lru = m.lru();
        assert_eq!(pool.lru_order(), lru, "cached LRU");
        for &b in pool.free.iter().chain(&lru) {
            assert_eq!(m.count(b), 0, "block {b} queued while referenced");
        }
        assert_eq!(s.free, m.free.len());
        assert_eq!(s.cached, lru.len());
        assert_eq!(pool.prefix, m.map, "prefix map");
        assert_eq!((s.prefix_hits, s.prefix_lookups), (m.hits, m.lookups));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn prop_pool_matches_model(
            n_blocks in 0usize..12,
            ops in prop::collection::vec(arb_op(), 150..250),
        ) {
            let mut pool = BlockAllocator::new(n_blocks);
            let mut m = Model::new(n_blocks);
            check(&pool, &m);
            for op in &ops {
                apply(&mut pool, &mut m, op);
                check(&pool, &m);
            }
            while !m.seqs.is_empty() {
                m.drop_seq(&mut pool, 0);
                check(&pool, &m);
            }
            let s = pool.stats();
            prop_assert_eq!(s.used, 0);
            prop_assert_eq!(pool.available(), pool.total());
        }
    }
}
