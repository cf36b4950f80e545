//! Per-sequence KV cache: contiguous K and V rows per layer, slot-addressed (slot != position for tree tokens).

use crate::error::{EngineError, Result};
use crate::model::ModelConfig;

/// K and V for one sequence. Slot `s` of layer `l` holds the K/V row of the `s`-th token written.
#[derive(Clone)]
pub struct KvCache {
    kv_dim: usize,
    capacity: usize,
    len: usize,
    // [n_layers][capacity * kv_dim]
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// A cache able to hold `capacity` tokens (memory is allocated lazily as it fills).
    pub fn new(config: &ModelConfig, capacity: usize) -> KvCache {
        KvCache {
            kv_dim: config.kv_dim(),
            capacity,
            len: 0,
            k: vec![Vec::new(); config.n_layers],
            v: vec![Vec::new(); config.n_layers],
        }
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
        self.kv_dim
    }

    /// Make room for `n` more slots; fails when the capacity would be exceeded.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(EngineError::ContextOverflow {
                needed,
                limit: self.capacity,
            });
        }
        let want = needed * self.kv_dim;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            if buf.len() < want {
                // Grow geometrically so decoding does not reallocate on every token.
                let target = (want.max(buf.len() * 2)).min(self.capacity * self.kv_dim);
                buf.resize(target, 0.0);
            }
        }
        Ok(())
    }

    /// K and V buffers of one layer (mutable), covering every allocated slot.
    pub(crate) fn layer_mut(&mut self, layer: usize) -> (&mut [f32], &mut [f32]) {
        (&mut self.k[layer], &mut self.v[layer])
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// K row of `slot` in `layer`.
    pub fn k_row(&self, layer: usize, slot: usize) -> &[f32] {
        &self.k[layer][slot * self.kv_dim..(slot + 1) * self.kv_dim]
    }

    /// V row of `slot` in `layer`.
    pub fn v_row(&self, layer: usize, slot: usize) -> &[f32] {
        &self.v[layer][slot * self.kv_dim..(slot + 1) * self.kv_dim]
    }

    /// Drop every slot at or after `len`.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}
