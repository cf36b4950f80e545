//! TEMPORARY allocator stub (replaced by the kvpool branch): paged KV block allocation with reference counts and prefix hashes.
use std::collections::{HashMap, VecDeque};

pub type BlockId = u32;
/// Slots (tokens) per block.
pub const BLOCK_SLOTS: usize = 16;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub total: usize,
    pub used: usize,
    pub cached: usize,
    pub free: usize,
    pub prefix_hits: u64,
    pub prefix_lookups: u64,
}

pub struct BlockAllocator {
    refs: Vec<u32>,
    hash: Vec<Option<u64>>,
    free: VecDeque<BlockId>,
    lru: VecDeque<BlockId>,
    map: HashMap<u64, BlockId>,
    hits: u64,
    lookups: u64,
}

impl BlockAllocator {
    pub fn new(n_blocks: usize) -> BlockAllocator {
        let mut a = BlockAllocator {
            refs: Vec::new(),
            hash: Vec::new(),
            free: VecDeque::new(),
            lru: VecDeque::new(),
            map: HashMap::new(),
            hits: 0,
            lookups: 0,
        };
        a.grow(n_blocks);
        a
    }
    pub fn grow(&mut self, n: usize) {
        let t = self.refs.len();
        self.refs.resize(t + n, 0);
        self.hash.resize(t + n, None);
        self.free.extend((t..t + n).map(|b| b as BlockId));
    }
    pub fn total(&self) -> usize {
        self.refs.len()
    }
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop_front() {
            Some(b) => b,
            None => {
                let b = self.lru.pop_front()?;
                self.unregister(b);
                b
            }
        };
        self.refs[b as usize] = 1;
        Some(b)
    }
    pub fn retain(&mut self, b: BlockId) -> Result<(), String> {
        let i = b as usize;
        if i >= self.refs.len() {
            return Err("out of range".into());
        }
        if self.refs[i] == 0 {
            let p = self.lru.iter().position(|&x| x == b).ok_or("free block")?;
            self.lru.remove(p);
        }
        self.refs[i] += 1;
        Ok(())
    }
    pub fn release(&mut self, b: BlockId) -> Result<(), String> {
        let i = b as usize;
        if i >= self.refs.len() || self.refs[i] == 0 {
            return Err("double free".into());
        }
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            if self.hash[i].is_some() {
                self.lru.push_back(b);
            } else {
                self.free.push_back(b);
            }
        }
        Ok(())
    }
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }
    pub fn register(&mut self, b: BlockId, hash: u64) {
        if self.map.contains_key(&hash) {
            return;
        }
        self.unregister(b);
        self.map.insert(hash, b);
        self.hash[b as usize] = Some(hash);
    }
    pub fn unregister(&mut self, b: BlockId) {
        if let Some(h) = self.hash[b as usize].take() {
            self.map.remove(&h);
            if self.refs[b as usize] == 0 {
                if let Some(p) = self.lru.iter().position(|&x| x == b) {
                    self.lru.remove(p);
                    self.free.push_back(b);
                }
            }
        }
    }
    pub fn hash_of(&self, b: BlockId) -> Option<u64> {
        self.hash.get(b as usize).copied().flatten()
    }
    pub fn lookup(&mut self, hash: u64) -> Option<BlockId> {
        self.lookups += 1;
        let b = *self.map.get(&hash)?;
        self.hits += 1;
        self.retain(b).ok()?;
        Some(b)
    }
    pub fn stats(&self) -> PoolStats {
        let used = self.refs.iter().filter(|&&r| r > 0).count();
        PoolStats {
            total: self.refs.len(),
            used,
            cached: self.lru.len(),
            free: self.free.len(),
            prefix_hits: self.hits,
            prefix_lookups: self.lookups,
        }
    }
}

pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in parent
        .unwrap_or(0)
        .to_le_bytes()
        .into_iter()
        .chain(tokens.iter().flat_map(|t| t.to_le_bytes()))
    {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}
