//! Paged f16 KV cache (PagedAttention, Kwon et al. 2023): a `KvPool` of fixed-size blocks shared by sequences, each a `KvCache` with its block table; slot-addressed (slot != position for tree tokens).
//!
//! Block `b` holds slots `b * 16 .. b * 16 + 16` of every layer: in each layer's K (and V) array,
//! rows `b * 16 ..` (`[pool rows, kv_dim]` f16, 64-byte aligned). A sequence's slot `s` lives in
//! row `blocks[s / 16] * 16 + s % 16`. Blocks are reference counted: forks (`Clone`) and prefix
//! hits share blocks, a write into a shared block copies it first, and a sequence gives its blocks
//! back when dropped (finish, cancel, error or panic alike).

pub mod pool;

use std::sync::{Arc, Mutex, MutexGuard};

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

pub use pool::{block_hash, BlockAllocator, BlockId, BlockLedger, PoolStats, BLOCK_SLOTS};

use crate::backend::KvLayer;
use crate::error::{EngineError, Result};
use crate::model::ModelConfig;

/// f16 values from a 64-byte boundary (so a row of a multiple of 32 values starts a cache line),
/// allocated zeroed by the system (pages are touched only when written).
#[derive(Default)]
struct F16Buf {
    raw: Vec<u16>,
    off: usize,
    len: usize,
}

impl F16Buf {
    fn zeroed(len: usize) -> F16Buf {
        // `vec![0u16; n]` asks the allocator for zeroed memory (calloc: no page is touched).
        let raw = vec![0u16; len + 32];
        let off = (raw.as_ptr() as usize).wrapping_neg() % 64 / 2;
        F16Buf { raw, off, len }
    }

    fn as_slice(&self) -> &[f16] {
        self.raw[self.off..self.off + self.len].reinterpret_cast()
    }

    fn as_mut_slice(&mut self) -> &mut [f16] {
        self.raw[self.off..self.off + self.len].reinterpret_cast_mut()
    }

    /// A buffer of `len` values starting with this one's.
    fn grown(&self, len: usize) -> F16Buf {
        let mut g = F16Buf::zeroed(len);
        g.as_mut_slice()[..self.len].copy_from_slice(self.as_slice());
        g
    }
}

/// The pool's state behind its lock: the block ledger and every layer's K and V rows.
pub(crate) struct PoolInner {
    alloc: Box<dyn BlockLedger>,
    /// An elastic pool grows up to this many blocks when it runs out; a fixed pool has
    /// `max_blocks ==` the ledger's total.
    max_blocks: usize,
    kv_dim: usize,
    k: Vec<F16Buf>, // [n_layers][total * BLOCK_SLOTS * kv_dim]
    v: Vec<F16Buf>,
}

impl PoolInner {
    /// A block for a sequence: from the allocator (free, then least recently used cached), else
    /// by growing an elastic pool.
    fn allocate(&mut self) -> Option<BlockId> {
        if let Some(b) = self.alloc.allocate() {
            return Some(b);
        }
        let total = self.alloc.stats().total;
        if total >= self.max_blocks {
            return None;
        }
        let add = total.max(4).min(self.max_blocks - total);
        let len = (total + add) * BLOCK_SLOTS * self.kv_dim;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            *buf = buf.grown(len);
        }
        self.alloc.grow(add);
        self.alloc.allocate()
    }

    /// Copy block `from`'s rows (every layer) into block `to`.
    fn copy_block(&mut self, from: BlockId, to: BlockId) {
        let n = BLOCK_SLOTS * self.kv_dim;
        let (src, dst) = (from as usize * n, to as usize * n);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.as_mut_slice().copy_within(src..src + n, dst);
        }
    }

    /// Copy slot row `from` to slot row `to` (pool rows) in every layer.
    fn copy_row(&mut self, from: usize, to: usize) {
        let d = self.kv_dim;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.as_mut_slice()
                .copy_within(from * d..(from + 1) * d, to * d);
        }
    }

    fn release_all(&mut self, blocks: &[BlockId]) {
        if blocks.is_empty() {
            return;
        }
        // A sequence holds one reference per entry of its table, so this cannot fail; a
        // failure would be a bookkeeping bug, never worth a panic in a drop path.
        let released = self.alloc.release_all(blocks);
        debug_assert!(released.is_ok(), "{released:?}");
    }
}

/// A pool of KV blocks shared by sequences (cheap to clone: a handle).
#[derive(Clone)]
pub struct KvPool {
    inner: Arc<Mutex<PoolInner>>,
    kv_dim: usize,
    n_layers: usize,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvPool {
    /// A fixed pool of `n_blocks` blocks for `n_layers` layers of `config`'s K/V rows.
    pub fn new(config: &ModelConfig, n_layers: usize, n_blocks: usize) -> KvPool {
        Self::build(config.kv_dim(), n_layers, n_blocks, n_blocks)
    }

    /// A fixed pool of as many blocks as `bytes` holds (at least one).
    pub fn with_memory(config: &ModelConfig, bytes: usize) -> KvPool {
        let n_layers = config.n_layers;
        let per = Self::block_bytes(config.kv_dim(), n_layers);
        Self::new(config, n_layers, (bytes / per).max(1))
    }

    /// A pool that starts small and grows (reallocating) up to `max_blocks` blocks: one
    /// sequence's private cache, as `KvCache::new` makes.
    pub fn elastic(config: &ModelConfig, n_layers: usize, max_blocks: usize) -> KvPool {
        Self::build(config.kv_dim(), n_layers, max_blocks.min(4), max_blocks)
    }

    /// A fixed pool whose metadata `ledger` keeps (a ledger none of whose blocks is handed out
    /// yet): the K/V storage for the ledger's blocks lives here, and every allocation, share,
    /// copy-on-write check, prefix lookup and release is asked of the ledger.
    pub fn with_ledger(
        config: &ModelConfig,
        n_layers: usize,
        ledger: Box<dyn BlockLedger>,
    ) -> Result<KvPool> {
        let s = ledger.stats();
        if s.total == 0 || s.free != s.total {
            return Err(EngineError::InvalidArgument(format!(
                "a KV pool needs a ledger with every block free ({} of {} are)",
                s.free, s.total
            )));
        }
        Ok(Self::build_with(
            config.kv_dim(),
            n_layers,
            s.total,
            s.total,
            ledger,
        ))
    }

    fn build(kv_dim: usize, n_layers: usize, n_blocks: usize, max_blocks: usize) -> KvPool {
        let ledger = Box::new(BlockAllocator::new(n_blocks));
        Self::build_with(kv_dim, n_layers, n_blocks, max_blocks, ledger)
    }

    fn build_with(
        kv_dim: usize,
        n_layers: usize,
        n_blocks: usize,
        max_blocks: usize,
        ledger: Box<dyn BlockLedger>,
    ) -> KvPool {
        let len = n_blocks * BLOCK_SLOTS * kv_dim;
        let inner = PoolInner {
            alloc: ledger,
            max_blocks: max_blocks.max(n_blocks),
            kv_dim,
            k: (0..n_layers).map(|_| F16Buf::zeroed(len)).collect(),
            v: (0..n_layers).map(|_| F16Buf::zeroed(len)).collect(),
        };
        KvPool {
            inner: Arc::new(Mutex::new(inner)),
            kv_dim,
            n_layers,
        }
    }

    /// Bytes of one block: K and V, `BLOCK_SLOTS` slots of every layer, f16.
    pub fn block_bytes(kv_dim: usize, n_layers: usize) -> usize {
        2 * n_layers * BLOCK_SLOTS * kv_dim * std::mem::size_of::<f16>()
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Blocks total / used / cached / free and the prefix-cache counters.
    pub fn stats(&self) -> PoolStats {
        self.lock().alloc.stats()
    }

    /// Blocks that can be handed out now (free, evictable cached, and an elastic pool's growth).
    pub fn available(&self) -> usize {
        let g = self.lock();
        let s = g.alloc.stats();
        s.free + s.cached + g.max_blocks.saturating_sub(s.total)
    }

    /// Most blocks this pool can ever hold (a sequence needing more can never run).
    pub fn max_blocks(&self) -> usize {
        self.lock().max_blocks
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolInner> {
        // A panic while the lock was held leaves counts that are still consistent (every
        // mutation is a few field updates), so a poisoned lock is taken over.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn same_pool(&self, other: &KvPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// The pool's identity (equal for clones of one pool while it lives).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as *const () as usize
    }
}

/// K and V of one sequence: its block table in a pool. Slot `s` of layer `l` holds the K/V row of
/// the `s`-th token written. Dropping it gives its blocks back; cloning it forks the sequence
/// (the blocks are shared until either side writes into them).
pub struct KvCache {
    pool: KvPool,
    blocks: Vec<BlockId>,
    /// Chained hashes of the leading full blocks that hold committed tokens (prefix cache).
    hashes: Vec<u64>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// A private cache able to hold `capacity` tokens (its pool grows as it fills).
    pub fn new(config: &ModelConfig, capacity: usize) -> KvCache {
        Self::with_layers(config, config.n_layers, capacity)
    }

    /// A private cache for the first `n_layers` layers only (an early-exit drafter's).
    pub fn with_layers(config: &ModelConfig, n_layers: usize, capacity: usize) -> KvCache {
        // Forks of a private cache share its pool: room for a few diverging copies.
        let max_blocks = 4 * capacity.div_ceil(BLOCK_SLOTS).max(1);
        KvCache::in_pool(&KvPool::elastic(config, n_layers, max_blocks), capacity)
    }

    /// An empty sequence in `pool`, able to hold `capacity` tokens.
    pub fn in_pool(pool: &KvPool, capacity: usize) -> KvCache {
        KvCache {
            pool: pool.clone(),
            blocks: Vec::new(),
            hashes: Vec::new(),
            len: 0,
            capacity,
        }
    }

    /// A sequence in `pool` that starts with the cached blocks of the longest prefix of `tokens`
    /// whose full blocks the pool holds (prefix caching). At least the last token is left
    /// uncached, so the caller always computes it (its logits are needed). Returns the cache;
    /// its `len()` is the number of tokens found.
    pub fn with_prefix(pool: &KvPool, capacity: usize, tokens: &[u32]) -> KvCache {
        let mut c = KvCache::in_pool(pool, capacity);
        let full = tokens.len().saturating_sub(1) / BLOCK_SLOTS;
        let mut parent = None;
        let hashes: Vec<u64> = tokens
            .chunks_exact(BLOCK_SLOTS)
            .take(full)
            .map(|chunk| {
                let h = block_hash(parent, chunk);
                parent = Some(h);
                h
            })
            .collect();
        if !hashes.is_empty() {
            c.blocks = pool.lock().alloc.lookup_chain(&hashes);
            c.hashes = hashes[..c.blocks.len()].to_vec();
        }
        c.len = c.blocks.len() * BLOCK_SLOTS;
        c
    }

    /// Offer this sequence's full blocks to the prefix cache: `tokens` are the tokens at slots
    /// `0..` (slots must equal positions there, i.e. after tree rows were committed).
    pub fn register_prefix(&mut self, tokens: &[u32]) {
        let full = self.len.min(tokens.len()) / BLOCK_SLOTS;
        if self.hashes.len() >= full {
            return;
        }
        let mut entries = Vec::with_capacity(full - self.hashes.len());
        for i in self.hashes.len()..full {
            let parent = i.checked_sub(1).map(|p| self.hashes[p]);
            let h = block_hash(parent, &tokens[i * BLOCK_SLOTS..(i + 1) * BLOCK_SLOTS]);
            entries.push((self.blocks[i], h));
            self.hashes.push(h);
        }
        self.pool.lock().alloc.register_all(&entries);
    }

    /// Number of filled slots.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn kv_dim(&self) -> usize {
        self.pool.kv_dim
    }

    pub fn n_layers(&self) -> usize {
        self.pool.n_layers
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// The block table: block `i` holds slots `16 i .. 16 i + 16`.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Blocks `reserve(n)` would take from the pool now (new blocks and copies of shared ones).
    pub fn blocks_needed(&self, n: usize) -> usize {
        let want = (self.len + n).div_ceil(BLOCK_SLOTS);
        let mut need = want.saturating_sub(self.blocks.len());
        if n > 0 && !self.len.is_multiple_of(BLOCK_SLOTS) {
            let g = self.pool.lock();
            if g.alloc.refcount(self.blocks[self.len / BLOCK_SLOTS]) > 1 {
                need += 1;
            }
        }
        need
    }

    /// Make slots `len()..len() + n` writable: blocks allocated, a shared block copied first, a
    /// block in the prefix cache taken out of it. Fails (changing nothing) when the capacity
    /// would be exceeded or the pool has no block left.
    pub(crate) fn reserve_in(&mut self, g: &mut PoolInner, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(EngineError::ContextOverflow {
                needed,
                limit: self.capacity,
            });
        }
        if n == 0 {
            return Ok(());
        }
        let first = self.len / BLOCK_SLOTS;
        // The block holding slot `len` may be shared (a fork, a prefix hit) or cached: it is
        // about to change.
        if first < self.blocks.len() {
            if g.alloc.claim_for_write(self.blocks[first]) {
                self.copy_block_at(g, first)?;
            }
            self.hashes.truncate(first);
        }
        let want = needed.div_ceil(BLOCK_SLOTS);
        let have = self.blocks.len();
        while self.blocks.len() < want {
            match g.allocate() {
                Some(b) => self.blocks.push(b),
                None => {
                    let got = self.blocks.split_off(have);
                    g.release_all(&got);
                    return Err(EngineError::KvPoolExhausted {
                        needed: want - have,
                    });
                }
            }
        }
        Ok(())
    }

    /// [`KvCache::reserve_in`] taking the pool's lock.
    pub fn reserve(&mut self, n: usize) -> Result<()> {
        let pool = self.pool.clone();
        let mut g = pool.lock();
        self.reserve_in(&mut g, n)
    }

    /// Write the K and V rows (`[n, kv_dim]` f32, rounded to f16 here) of slots `start..start+n`
    /// of `layer` (reserved before).
    pub(crate) fn write_rows(
        &self,
        g: &mut PoolInner,
        layer: usize,
        start: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let d = g.kv_dim;
        for (i, (kr, vr)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let s = start + i;
            let row = self.pool_row(s);
            g.k[layer].as_mut_slice()[row * d..(row + 1) * d].convert_from_f32_slice(kr);
            g.v[layer].as_mut_slice()[row * d..(row + 1) * d].convert_from_f32_slice(vr);
        }
    }

    /// One layer of this sequence as attention reads it.
    pub(crate) fn layer<'a>(&'a self, g: &'a PoolInner, layer: usize) -> KvLayer<'a> {
        KvLayer {
            k: g.k[layer].as_slice(),
            v: g.v[layer].as_slice(),
            blocks: &self.blocks,
        }
    }

    /// The pool row holding slot `slot` (a slot whose block is reserved).
    pub fn pool_row(&self, slot: usize) -> usize {
        self.blocks[slot / BLOCK_SLOTS] as usize * BLOCK_SLOTS + slot % BLOCK_SLOTS
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    fn row_f32(&self, buf: fn(&PoolInner) -> &[F16Buf], layer: usize, slot: usize) -> Vec<f32> {
        let g = self.pool.lock();
        let d = g.kv_dim;
        let row = self.pool_row(slot);
        buf(&g)[layer].as_slice()[row * d..(row + 1) * d]
            .iter()
            .map(|h| h.to_f32())
            .collect()
    }

    /// K row of `slot` in `layer` (slot below `len()`), as f32.
    pub fn k_row(&self, layer: usize, slot: usize) -> Vec<f32> {
        self.row_f32(|g| &g.k, layer, slot)
    }

    /// V row of `slot` in `layer` (slot below `len()`), as f32.
    pub fn v_row(&self, layer: usize, slot: usize) -> Vec<f32> {
        self.row_f32(|g| &g.v, layer, slot)
    }

    /// Commit the accepted rows of a tree verification pass (SpecInfer's depth-first KV update):
    /// the pass wrote its rows at slots `base..len()`; `keep` lists the rows (relative to `base`,
    /// strictly increasing) on the accepted path. Row `keep[j]` moves to slot `base + j` (across
    /// block boundaries too), every other scratch slot is dropped, blocks no longer needed go
    /// back to the pool, and `len()` becomes `base + keep.len()`, so slots equal positions
    /// again. Nothing is recomputed.
    pub fn commit_rows(&mut self, base: usize, keep: &[usize]) -> Result<()> {
        let scratch = self.len.checked_sub(base).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "commit base {base} is past the cache length {}",
                self.len
            ))
        })?;
        if keep.windows(2).any(|w| w[0] >= w[1]) || keep.last().is_some_and(|&r| r >= scratch) {
            return Err(EngineError::InvalidArgument(format!(
                "rows to keep must be strictly increasing and below {scratch}"
            )));
        }
        let pool = self.pool.clone();
        let mut g = pool.lock();
        for (j, &r) in keep.iter().enumerate() {
            // r >= j, so a source is never a slot already overwritten. The scratch rows were
            // written by this sequence after `reserve`, so their blocks are its own.
            if r != j {
                g.copy_row(self.pool_row(base + r), self.pool_row(base + j));
            }
        }
        self.len = base + keep.len();
        self.shrink(&mut g);
        Ok(())
    }

    /// Give back the blocks past the last filled slot (also those a failed pass reserved).
    pub(crate) fn shrink(&mut self, g: &mut PoolInner) {
        let want = self.len.div_ceil(BLOCK_SLOTS);
        if self.blocks.len() > want {
            let gone = self.blocks.split_off(want);
            g.release_all(&gone);
        }
        self.hashes.truncate(self.len / BLOCK_SLOTS);
    }

    /// Drop every slot at or after `len`.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let pool = self.pool.clone();
        let mut g = pool.lock();
        self.shrink(&mut g);
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Give this sequence its own copy of every block it shares (a fork made a deep copy: its
    /// K/V then live in their own memory, as distinct sequences' do). Fails, changing nothing
    /// more than the blocks already copied, when the pool runs out.
    pub fn unshare(&mut self) -> Result<()> {
        let pool = self.pool.clone();
        let mut g = pool.lock();
        for i in 0..self.blocks.len() {
            if self.copy_if_shared(&mut g, i)? {
                self.hashes.truncate(i);
            }
        }
        Ok(())
    }

    /// Replace table entry `i` by a private copy when its block is shared; whether it was.
    fn copy_if_shared(&mut self, g: &mut PoolInner, i: usize) -> Result<bool> {
        if g.alloc.refcount(self.blocks[i]) <= 1 {
            return Ok(false);
        }
        self.copy_block_at(g, i)?;
        Ok(true)
    }

    /// Replace table entry `i` (a shared block) by a private copy.
    fn copy_block_at(&mut self, g: &mut PoolInner, i: usize) -> Result<()> {
        let b = self.blocks[i];
        let nb = g
            .allocate()
            .ok_or(EngineError::KvPoolExhausted { needed: 1 })?;
        g.copy_block(b, nb);
        g.release_all(&[b]);
        self.blocks[i] = nb;
        Ok(())
    }
}

impl Clone for KvCache {
    /// A fork: the same slots, sharing every block (copied on the first write into it).
    fn clone(&self) -> KvCache {
        if !self.blocks.is_empty() {
            let r = self.pool.lock().alloc.retain_all(&self.blocks);
            debug_assert!(r.is_ok(), "{r:?}");
        }
        KvCache {
            pool: self.pool.clone(),
            blocks: self.blocks.clone(),
            hashes: self.hashes.clone(),
            len: self.len,
            capacity: self.capacity,
        }
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        let mut blocks = std::mem::take(&mut self.blocks);
        // Tail first (as vLLM v1 frees): a sequence's prefix blocks, the ones other requests
        // share, become the most recently released cached blocks and are evicted last.
        blocks.reverse();
        self.pool.lock().release_all(&blocks);
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("blocks", &self.blocks)
            .finish()
    }
}

#[cfg(test)]
mod tests;
