use super::*;
use crate::testing::{tiny_model, TinySpec};

/// Fill slots `len..len + n` of every layer with K = slot + layer, V = -(slot + layer).
fn fill(c: &mut KvCache, n: usize, tag: f32) {
    let pool = c.pool().clone();
    let mut g = pool.lock();
    c.reserve_in(&mut g, n).expect("reserve");
    let d = c.kv_dim();
    for l in 0..c.n_layers() {
        for s in c.len()..c.len() + n {
            let k = vec![s as f32 + l as f32 + tag; d];
            let v = vec![-(s as f32 + l as f32 + tag); d];
            c.write_rows(&mut g, l, s, &k, &v);
        }
    }
    drop(g);
    c.advance(n);
}

fn slot_value(c: &KvCache, l: usize, s: usize) -> (f32, f32) {
    (c.k_row(l, s)[0], c.v_row(l, s)[0])
}

#[test]
fn rows_are_aligned_f16_and_keep_values_when_the_pool_grows() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    let mut c = KvCache::new(&model.config, 200);
    fill(&mut c, 3, 0.0);
    {
        let g = c.pool().lock();
        for l in 0..c.n_layers() {
            let kv = c.layer(&g, l);
            assert_eq!(kv.k.as_ptr() as usize % 64, 0);
            assert_eq!(kv.v.as_ptr() as usize % 64, 0);
        }
    }
    // Growth reallocates: still aligned, the written rows kept.
    fill(&mut c, 150, 0.0);
    assert_eq!(c.len(), 153);
    assert_eq!(c.blocks().len(), 153usize.div_ceil(BLOCK_SLOTS));
    for l in 0..c.n_layers() {
        for s in [0, 2, 3, 100, 152] {
            assert_eq!(slot_value(&c, l, s), ((s + l) as f32, -((s + l) as f32)));
        }
    }
    let g = c.pool().lock();
    assert_eq!(c.layer(&g, 0).k.as_ptr() as usize % 64, 0);
    drop(g);
    // f16 storage: 2 bytes a value.
    assert_eq!(KvPool::block_bytes(64, 2), 2 * 2 * 16 * 64 * 2);
}

#[test]
fn commit_rows_compacts_the_accepted_path_across_blocks_and_frees_the_rest() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    let pool = KvPool::new(&model.config, model.config.n_layers, 8);
    let mut c = KvCache::in_pool(&pool, 128);
    fill(&mut c, 30, 0.0);
    assert_eq!(pool.stats().used, 2);
    // Base 12: rows 0, 2, 5, 17 of the pass (slots 12, 14, 17, 29) kept.
    c.commit_rows(12, &[0, 2, 5, 17]).expect("commit");
    assert_eq!(c.len(), 16);
    let want = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 17, 29];
    for l in 0..c.n_layers() {
        for (s, &w) in want.iter().enumerate() {
            assert_eq!(slot_value(&c, l, s), ((w + l) as f32, -((w + l) as f32)));
        }
    }
    // 16 slots: one block; the second went back.
    assert_eq!(c.blocks().len(), 1);
    assert_eq!(pool.stats().used, 1);
    assert!(c.commit_rows(17, &[0]).is_err());
    assert!(c.commit_rows(2, &[1, 1]).is_err());
    assert!(c.commit_rows(2, &[14]).is_err());
    c.commit_rows(2, &[]).expect("commit nothing");
    assert_eq!(c.len(), 2);
    drop(c);
    assert_eq!(pool.stats().used, 0);
    assert_eq!(pool.available(), 8);
}

#[test]
fn forks_share_blocks_until_written_and_everything_is_freed_on_drop() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    let pool = KvPool::new(&model.config, model.config.n_layers, 6);
    let mut a = KvCache::in_pool(&pool, 128);
    fill(&mut a, 20, 0.0); // blocks: 16 + 4 slots
    let mut b = a.clone();
    assert_eq!(pool.stats().used, 2);
    assert_eq!(a.blocks(), b.blocks());
    // Writing into the shared partial block copies it; the full block stays shared.
    fill(&mut b, 2, 100.0);
    assert_eq!(pool.stats().used, 3);
    assert_eq!(a.blocks()[0], b.blocks()[0]);
    assert_ne!(a.blocks()[1], b.blocks()[1]);
    for s in 0..20 {
        assert_eq!(slot_value(&a, 0, s), slot_value(&b, 0, s), "slot {s}");
    }
    assert_eq!(slot_value(&b, 0, 20).0, 120.0);
    // a is unchanged by b's write: its slot 20 does not exist yet; write another value there.
    fill(&mut a, 1, 50.0);
    assert_eq!(slot_value(&a, 0, 20).0, 70.0);
    assert_eq!(slot_value(&b, 0, 20).0, 120.0);
    // Truncating back into the shared block and writing copies nothing shared away.
    b.truncate(10);
    assert_eq!(pool.stats().used, 2);
    fill(&mut b, 1, 7.0);
    assert_ne!(a.blocks()[0], b.blocks()[0]);
    assert_eq!(slot_value(&a, 0, 10).0, 10.0);
    assert_eq!(slot_value(&b, 0, 10).0, 17.0);
    drop(a);
    drop(b);
    let st = pool.stats();
    assert_eq!((st.used, st.free + st.cached), (0, 6));
}

#[test]
fn an_unshared_fork_owns_copies_of_every_block() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    let pool = KvPool::new(&model.config, model.config.n_layers, 5);
    let mut a = KvCache::in_pool(&pool, 128);
    fill(&mut a, 20, 0.0);
    let mut b = a.clone();
    b.unshare().expect("room for two copies");
    assert_eq!(pool.stats().used, 4);
    for (x, y) in a.blocks().iter().zip(b.blocks()) {
        assert_ne!(x, y);
    }
    for l in 0..a.n_layers() {
        for s in 0..20 {
            assert_eq!(
                slot_value(&a, l, s),
                slot_value(&b, l, s),
                "layer {l} slot {s}"
            );
        }
    }
    // Nothing shared is left to copy; a third fork finds the pool too small.
    b.unshare().expect("nothing to copy");
    assert_eq!(pool.stats().used, 4);
    let mut c = a.clone();
    let err = c.unshare().expect_err("one block left for two");
    assert_eq!(err.error_type(), "kv_pool_exhausted");
    drop((a, b, c));
    assert_eq!(pool.stats().used, 0);
}

#[test]
fn an_exhausted_pool_is_an_error_that_changes_nothing() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    let pool = KvPool::new(&model.config, model.config.n_layers, 2);
    let mut a = KvCache::in_pool(&pool, 128);
    fill(&mut a, 20, 0.0);
    let mut b = KvCache::in_pool(&pool, 128);
    let err = b.reserve(1).expect_err("pool is full");
    assert_eq!(err.error_type(), "kv_pool_exhausted");
    assert_eq!(b.blocks().len(), 0);
    let err = a.reserve(20).expect_err("needs two more blocks");
    assert_eq!(err.error_type(), "kv_pool_exhausted");
    assert_eq!(a.blocks().len(), 2);
    assert_eq!(pool.stats().used, 2);
    assert_eq!(
        a.reserve(200).expect_err("capacity").error_type(),
        "context_overflow"
    );
    drop(a);
    b.reserve(20).expect("room again");
}

#[test]
fn prefix_blocks_are_found_by_token_hash_and_evicted_lru() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    let pool = KvPool::new(&model.config, model.config.n_layers, 4);
    let toks: Vec<u32> = (0..40).collect();
    let mut a = KvCache::in_pool(&pool, 128);
    fill(&mut a, 40, 0.0);
    a.register_prefix(&toks);
    // A second sequence with the same first 35 tokens gets both full blocks (32 slots).
    let b = KvCache::with_prefix(&pool, 128, &toks[..35]);
    assert_eq!(b.len(), 32);
    assert_eq!(b.blocks(), &a.blocks()[..2]);
    // b reads what a wrote (layer 1, slot s: s + 1 and its negation, f16-exact here).
    for s in [0, 31] {
        let want = ((s + 1) as f32, -((s + 1) as f32));
        assert_eq!(slot_value(&b, 1, s), want);
    }
    // Exactly one full block and the last token never cached: 17 tokens -> 16 slots; 16 -> 0.
    assert_eq!(KvCache::with_prefix(&pool, 128, &toks[..17]).len(), 16);
    assert_eq!(KvCache::with_prefix(&pool, 128, &toks[..16]).len(), 0);
    // Another first block: no hit although block 2's tokens match.
    let mut other = toks.clone();
    other[0] = 99;
    assert_eq!(KvCache::with_prefix(&pool, 128, &other).len(), 0);
    let st = pool.stats();
    assert!(st.prefix_hits >= 3 && st.prefix_lookups > st.prefix_hits);
    drop(b);
    drop(a);
    // Unreferenced but cached: still found.
    let st = pool.stats();
    assert_eq!((st.used, st.cached), (0, 2));
    let c = KvCache::with_prefix(&pool, 128, &toks);
    assert_eq!(c.len(), 32);
    drop(c);
    // A sequence needing the whole pool evicts them.
    let mut d = KvCache::in_pool(&pool, 128);
    fill(&mut d, 64, 0.0);
    drop(d);
    assert_eq!(KvCache::with_prefix(&pool, 128, &toks).len(), 0);
}

#[test]
fn a_dropped_sequence_leaves_its_prefix_cached_longest() {
    let model = tiny_model(&TinySpec::default(), 1).expect("model");
    // Three blocks: all of them go to the cache when the sequence ends.
    let pool = KvPool::new(&model.config, model.config.n_layers, 3);
    let toks: Vec<u32> = (0..48).collect();
    let mut a = KvCache::in_pool(&pool, 128);
    fill(&mut a, 48, 0.0);
    a.register_prefix(&toks);
    drop(a);
    assert_eq!(pool.stats().cached, 3);
    // A new sequence needing two blocks evicts the tail blocks, not the shared prefix.
    let mut b = KvCache::in_pool(&pool, 128);
    fill(&mut b, 32, 1.0);
    let c = KvCache::with_prefix(&pool, 128, &toks);
    assert_eq!(c.len(), 16, "the first block of the prefix survives");
    drop((b, c));
}
