//! Token tree tests: builder, merge, truncation, masks, and the tree-attention property (node logits = incremental path logits).

use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::backend::{BatchMask, CpuBackend};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sample::Rng;
use crate::testing::{tiny_model, TinySpec};

#[test]
fn builder_dedupes_siblings_and_orders_depth_first() {
    let mut b = TreeBuilder::new(100);
    let a = b.add_child(0, 1, Some(Proposal::picked(0, 0.5)));
    let c = b.add_child(0, 2, Some(Proposal::picked(0, 0.3)));
    b.add_child(a, 3, None);
    b.add_child(c, 4, None);
    let again = b.add_child(0, 1, Some(Proposal::sampled(1, 0.2, 2)));
    assert_eq!(again, a);
    b.add_proposal(a, Proposal::sampled(1, 0.2, 1));
    let t = b.build();
    assert_eq!(t.tokens(), vec![100, 1, 3, 2, 4]);
    assert_eq!(t.node(2).parent, Some(1));
    assert_eq!(t.node(4).parent, Some(3));
    assert_eq!(t.children(0), &[1, 3]);
    assert_eq!(t.path(4), vec![3, 4]);
    assert_eq!(t.path_tokens(2), vec![100, 1, 3]);
    assert_eq!(t.positions(10), vec![10, 11, 12, 11, 12]);
    let props = &t.node(1).proposals;
    assert_eq!(props.len(), 2);
    assert_eq!(props[1].draws, 3);
    t.validate(101).unwrap();
    assert!(t.validate(50).is_err());
}

#[test]
fn merge_is_a_trie_union_remembering_drafters() {
    let a = TokenTree::chain(7, &[1, 2, 3], 0);
    let b = TokenTree::chain(7, &[1, 2, 4], 1);
    let mut cb = TreeBuilder::new(7);
    cb.add_child(0, 5, Some(Proposal::sampled(2, 0.9, 1)));
    cb.set_child_dist(0, 2, Arc::from(vec![(5u32, 0.9f32), (6, 0.1)]));
    let c = cb.build();
    let m = TokenTree::merge(&[a, b, c]).unwrap();
    assert_eq!(m.tokens(), vec![7, 1, 2, 3, 4, 5]);
    let drafters =
        |i: usize| -> Vec<DrafterId> { m.node(i).proposals.iter().map(|p| p.drafter).collect() };
    assert_eq!(drafters(1), vec![0, 1]);
    assert_eq!(drafters(2), vec![0, 1]);
    assert_eq!(drafters(3), vec![0]);
    assert_eq!(drafters(4), vec![1]);
    assert_eq!(drafters(5), vec![2]);
    assert_eq!(m.child_dist(0, 2).map(|d| d.len()), Some(2));
    assert!(TokenTree::merge(&[TokenTree::root_only(1), TokenTree::root_only(2)]).is_err());
    assert!(TokenTree::merge(&[]).is_err());
}

#[test]
fn truncation_keeps_shallow_nodes_and_ancestors() {
    let mut r = RandomShape::new(5);
    let t = r.tree(200, 9);
    let d = t.truncate_depth(3);
    assert!(d.max_depth() <= 3);
    assert_eq!(
        d.n_draft(),
        t.nodes()
            .iter()
            .filter(|n| n.depth >= 1 && n.depth <= 3)
            .count()
    );
    d.validate(1000).unwrap();
    let n = t.truncate_nodes(37);
    assert_eq!(n.n_draft(), 37);
    n.validate(1000).unwrap();
    let max_kept = n.max_depth();
    // Every node shallower than the deepest kept level survived.
    let shallower = t.nodes().iter().filter(|x| x.depth < max_kept).count();
    assert!(n.nodes().iter().filter(|x| x.depth < max_kept).count() == shallower);
}

#[test]
fn expansion_config_parses_and_counts() {
    let c: ExpansionConfig = "1,1,3,1,1,1,1,1".parse().unwrap();
    assert_eq!(c, ExpansionConfig::specinfer());
    assert_eq!(c.max_nodes(), 1 + 1 + 3 + 3 + 3 + 3 + 3 + 3);
    assert_eq!(c.to_string(), "[1,1,3,1,1,1,1,1]");
    assert_eq!(
        "[2, 2]".parse::<ExpansionConfig>().unwrap().branches(),
        &[2, 2]
    );
    assert!("1,0".parse::<ExpansionConfig>().is_err());
    assert!("1,x".parse::<ExpansionConfig>().is_err());
    assert_eq!("".parse::<ExpansionConfig>().unwrap().depth(), 0);
}

#[test]
fn expansion_topk_and_sampled() {
    let cfg: ExpansionConfig = "2,3".parse().unwrap();
    // Distribution depends on the path length so levels differ.
    let dist = |path: &[u32]| -> crate::error::Result<Vec<(u32, f32)>> {
        let base = path.len() as u32 * 10;
        Ok(vec![
            (base, 0.5),
            (base + 1, 0.3),
            (base + 2, 0.15),
            (base + 3, 0.05),
        ])
    };
    let mut rng = Rng::new(1);
    let t = expand(&cfg, 0, 3, ExpandMode::TopK, 100, 8, &mut rng, dist).unwrap();
    assert_eq!(t.n_draft(), 2 + 6);
    assert_eq!(t.tokens(), vec![0, 10, 20, 21, 22, 11, 20, 21, 22]);
    assert!(t.nodes()[1..]
        .iter()
        .all(|n| n.proposals[0].kind == DrawKind::Picked && n.proposals[0].drafter == 3));
    // Budget cuts breadth-first; depth cap cuts levels.
    let t = expand(&cfg, 0, 3, ExpandMode::TopK, 4, 8, &mut rng, dist).unwrap();
    assert_eq!(t.n_draft(), 4);
    assert_eq!(t.nodes_by_depth(), vec![2, 2]);
    let t = expand(&cfg, 0, 3, ExpandMode::TopK, 100, 1, &mut rng, dist).unwrap();
    assert_eq!(t.n_draft(), 2);
    // Sampled: draws are counted, distributions recorded at parents.
    let t = expand(&cfg, 0, 3, ExpandMode::Sample, 100, 8, &mut rng, dist).unwrap();
    let draws_at_root: u32 = t
        .children(0)
        .iter()
        .map(|&c| t.node(c).proposals[0].draws)
        .sum();
    assert_eq!(draws_at_root, 2);
    assert!(t.child_dist(0, 3).is_some());
    for &c in t.children(0) {
        assert_eq!(t.node(c).proposals[0].kind, DrawKind::Sampled);
        let below: u32 = t
            .children(c)
            .iter()
            .map(|&g| t.node(g).proposals[0].draws)
            .sum();
        assert_eq!(below, 3);
    }
    assert!(
        expand(&cfg, 0, 3, ExpandMode::TopK, 10, 8, &mut rng, |_| Ok(
            vec![]
        ))
        .is_err()
    );
}

#[test]
fn mask_rows_are_ancestor_sets_beyond_64_bits() {
    let mut r = RandomShape::new(9);
    let t = r.tree(300, 12);
    assert_eq!(t.len(), 301);
    let m = t.mask();
    assert_eq!(m.words_per_row(), 5);
    for i in 0..t.len() {
        let mut anc = vec![false; t.len()];
        anc[i] = true;
        let mut at = i;
        while let Some(p) = t.node(at).parent {
            anc[p] = true;
            at = p;
        }
        for (j, &a) in anc.iter().enumerate() {
            assert_eq!(m.visible(i, j), a, "row {i} col {j}");
        }
        assert_eq!(m.row_count(i), t.node(i).depth + 1);
    }
}

/// A merged tree's mask restricted to the rows a truncation keeps is the truncated tree's own
/// mask (the verifier attends with the merger's mask), across the 64-bit word boundary too.
#[test]
fn restricted_masks_are_the_masks_of_truncated_trees() {
    let mut r = RandomShape::new(21);
    for (n_draft, vocab) in [(0, 5), (3, 4), (40, 6), (150, 12)] {
        let t = r.tree(n_draft, vocab);
        let masked = MaskedTree::new(t.clone());
        for depth in 0..=t.max_depth() + 1 {
            for cap in [0, 1, 2, 7, 63, 64, 65, 200] {
                let (cut, mask) = masked.clone().truncate(depth, cap).into_parts();
                let want = t.truncate_depth(depth).truncate_nodes(cap);
                assert_eq!(cut.tokens(), want.tokens(), "depth {depth} cap {cap}");
                assert_eq!(cut.positions(0), want.positions(0));
                assert_eq!(mask, want.mask(), "depth {depth} cap {cap}");
            }
        }
    }
    let m = RandomShape::new(3).tree(10, 5).mask();
    assert!(m.restrict(&[0, 2, 1]).is_none());
    assert!(m.restrict(&[0, 99]).is_none());
}

/// Random tree shapes: each new node picks a random existing parent and a random token.
struct RandomShape(Rng);

impl RandomShape {
    fn new(seed: u64) -> Self {
        RandomShape(Rng::new(seed))
    }

    fn tree(&mut self, n_draft: usize, vocab: u32) -> TokenTree {
        let mut b = TreeBuilder::new((self.0.next_u64() % vocab as u64) as u32);
        // Sibling collisions just retry (bounded).
        for _ in 0..100 * (n_draft + 1) {
            if b.len() > n_draft {
                break;
            }
            let parent = (self.0.next_u64() % b.len() as u64) as usize;
            let tok = (self.0.next_u64() % vocab as u64) as u32;
            b.add_child(parent, tok, Some(Proposal::picked(0, 1.0)));
        }
        b.build()
    }
}

fn tiny(spec: &TinySpec, seed: u64) -> Model {
    tiny_model(spec, seed).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The core tree-attention invariant: node i's logits from one tree pass equal the logits of
/// incremental decoding along node i's root-to-node path (within 1e-4).
fn check_tree_logits(model: &Model, prompt: &[u32], tree: &TokenTree) {
    let be = CpuBackend::new(1).unwrap();
    let v = model.config.vocab_size;
    let mut base = KvCache::new(&model.config, prompt.len() + tree.len() + 2);
    let pos: Vec<usize> = (0..prompt.len()).collect();
    model
        .forward(&be, &mut base, prompt, &pos, BatchMask::Causal, &[])
        .unwrap();
    let mut tc = base.clone();
    let logits = crate::spec::tree_logits(model, &be, &mut tc, tree).unwrap();
    assert_eq!(logits.len(), tree.len() * v);
    assert_eq!(tc.len(), prompt.len() + tree.len());
    for i in 0..tree.len() {
        let path = tree.path_tokens(i);
        let mut c = base.clone();
        let mut last = Vec::new();
        for &t in &path {
            let p = c.len();
            last = model
                .forward(&be, &mut c, &[t], &[p], BatchMask::Causal, &[0])
                .unwrap();
        }
        let d = max_diff(&logits[i * v..(i + 1) * v], &last);
        assert!(
            d <= 1e-4,
            "node {i} (depth {}): max diff {d}",
            tree.node(i).depth
        );
    }
}

#[test]
fn tree_logits_match_incremental_on_256_node_tree() {
    let model = tiny(&TinySpec::default(), 21);
    let mut r = RandomShape::new(77);
    let tree = r.tree(256, 96);
    assert_eq!(tree.n_draft(), 256);
    check_tree_logits(&model, &[3, 14, 15, 92, 65], &tree);
}

fn arb_spec() -> impl Strategy<Value = TinySpec> {
    (
        any::<bool>(),
        1usize..3,
        prop::sample::select(vec![(4, 2), (4, 4), (2, 1)]),
    )
        .prop_map(|(qwen, layers, (h, hkv))| TinySpec {
            arch: if qwen { "qwen2" } else { "llama" },
            n_layers: layers,
            n_embd: 32,
            n_head: h,
            n_head_kv: hkv,
            n_ff: 64,
            vocab: 40,
            context: 256,
            ..TinySpec::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn prop_tree_logits_match_incremental(
        spec in arb_spec(),
        model_seed in 0u64..1000,
        shape_seed in 0u64..100_000,
        n_draft in 1usize..40,
        prompt in prop::collection::vec(0u32..40, 1..12),
    ) {
        let model = tiny(&spec, model_seed);
        let tree = RandomShape::new(shape_seed).tree(n_draft, 40);
        check_tree_logits(&model, &prompt, &tree);
    }
}
