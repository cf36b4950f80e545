//! Checks of a device model shared by the host tests ([`HostOps`](super::HostOps)) and the GPU
//! check (`tests/cuda_device.rs` on `CudaModel`), so both assert the same things: logits against
//! the CPU forward pass, and speculative greedy decoding against incremental decoding.

use super::model::{DeviceModel, DeviceSeq, GreedyRun};
use super::ops::{DeviceOps, PlanBufs};
use crate::backend::{BatchMask, CpuBackend};
use crate::draft::ngram::NgramDrafter;
use crate::draft::{DraftRequest, Drafter};
use crate::error::Result;
use crate::kv::KvCache;
use crate::model::Model;
use crate::sample::{argmax, Rng};
use crate::tree::{Proposal, TokenTree, TreeBuilder};
use arbor_kernels_gpu::plan::SeqMask;

/// How a device's logits compare with the CPU's over the same rows.
#[derive(Clone, Debug)]
pub struct LogitAgreement {
    pub rows: usize,
    /// Rows whose greedy pick differs.
    pub flips: usize,
    /// Largest gap, in the CPU's logits, between the CPU's pick and the device's at a flip.
    pub worst_flip_gap: f32,
    /// Largest |CPU logit - device logit|.
    pub worst_diff: f32,
    /// Largest |CPU logit| (for scale).
    pub largest_logit: f32,
}

/// Teacher-forced: `tokens` in one causal pass on the CPU backend and on `dev`, every row's
/// logits compared.
pub fn logits_against_cpu<O: DeviceOps>(
    model: &Model,
    dev: &DeviceModel<O>,
    tokens: &[u32],
) -> Result<LogitAgreement> {
    let vocab = model.config.vocab_size;
    let positions: Vec<usize> = (0..tokens.len()).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let cpu = CpuBackend::new(0)?;
    let mut cache = KvCache::new(&model.config, tokens.len());
    let want = model.forward(
        &cpu,
        &mut cache,
        tokens,
        &positions,
        BatchMask::Causal,
        &rows,
    )?;
    let mut seq = dev.sequence();
    seq.reserve(tokens.len())?;
    let got = dev
        .forward(&[DeviceSeq {
            tokens,
            positions: &positions,
            n_past: 0,
            blocks: &seq.blocks,
            mask: SeqMask::Causal,
            logit_rows: &rows,
        }])?
        .pop()
        .unwrap_or_default();
    let mut a = LogitAgreement {
        rows: tokens.len(),
        flips: 0,
        worst_flip_gap: 0.0,
        worst_diff: 0.0,
        largest_logit: want.iter().fold(0.0f32, |m, x| m.max(x.abs())),
    };
    for (w, g) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)) {
        let (i, j) = (argmax(w) as usize, argmax(g) as usize);
        if i != j {
            a.flips += 1;
            a.worst_flip_gap = a.worst_flip_gap.max(w[i] - w[j]);
        }
        a.worst_diff = w
            .iter()
            .zip(g)
            .map(|(x, y)| (x - y).abs())
            .fold(a.worst_diff, f32::max);
    }
    Ok(a)
}

/// Proposes a known continuation with `wrong` random siblings before every true child, so an
/// accepted path is never the tree's first rows and each commit moves K/V rows (across block
/// boundaries too); now and then a wrong token where the true one belongs ends the path early.
pub struct SiblingsFirstDrafter {
    truth: Vec<u32>,
    prompt_len: usize,
    wrong: usize,
    rng: Rng,
}

impl SiblingsFirstDrafter {
    /// `truth`: the continuation after a prompt of `prompt_len` tokens.
    pub fn new(truth: Vec<u32>, prompt_len: usize, wrong: usize, seed: u64) -> Self {
        SiblingsFirstDrafter {
            truth,
            prompt_len,
            wrong,
            rng: Rng::new(seed),
        }
    }
}

impl Drafter for SiblingsFirstDrafter {
    fn name(&self) -> &str {
        "siblings-first"
    }

    fn propose(&mut self, req: &DraftRequest<'_>) -> Result<TokenTree> {
        let mut b = TreeBuilder::new(req.root());
        let done = req.tokens.len().saturating_sub(self.prompt_len);
        let vocab = req.vocab.max(1) as u32;
        let mut at = TreeBuilder::ROOT;
        let depth = 1 + self.rng.next_u64() % req.max_depth.clamp(1, 6) as u64;
        // At most `req.budget` nodes besides the root (the drafter contract).
        let room = |b: &TreeBuilder| b.len() <= req.budget;
        for i in 0..depth as usize {
            for _ in 0..self.wrong {
                if !room(&b) {
                    return Ok(b.build());
                }
                let t = (self.rng.next_u64() % vocab as u64) as u32;
                b.add_child(at, t, Some(Proposal::picked(req.drafter, 0.1)));
            }
            let Some(&t) = self.truth.get(done + i) else {
                break;
            };
            if !room(&b) {
                break;
            }
            let t = if self.rng.next_f64() < 0.15 {
                (t + 1) % vocab
            } else {
                t
            };
            at = b.add_child(at, t, Some(Proposal::picked(req.drafter, 0.9)));
        }
        Ok(b.build())
    }
}

/// Greedy decoding of `n` tokens on `dev`: incremental, speculative with prompt lookup (16
/// nodes), and speculative with [`SiblingsFirstDrafter`] trees (40 nodes) along the incremental
/// output.
pub struct GreedyRuns {
    pub incremental: GreedyRun,
    pub ngram: GreedyRun,
    pub trees: GreedyRun,
}

pub fn greedy_runs<O: DeviceOps>(
    dev: &DeviceModel<O>,
    prompt: &[u32],
    n: usize,
    seed: u64,
) -> Result<GreedyRuns> {
    let incremental = dev.greedy(prompt, n, None, 0)?;
    let mut ngram = NgramDrafter::default();
    let by_ngram = dev.greedy(prompt, n, Some(&mut ngram), 16)?;
    let mut trees = SiblingsFirstDrafter::new(incremental.tokens.clone(), prompt.len(), 3, seed);
    let by_trees = dev.greedy(prompt, n, Some(&mut trees), 40)?;
    Ok(GreedyRuns {
        incremental,
        ngram: by_ngram,
        trees: by_trees,
    })
}

/// Greedy incremental decoding of `n` tokens after a prompt (the reference of
/// [`scheduler_against_incremental`]).
pub type Incremental<'a> = &'a dyn Fn(&[u32], usize) -> Result<Vec<u32>>;

/// What a continuous-batching run on a device gave ([`scheduler_against_incremental`]).
#[derive(Clone, Debug)]
pub struct SchedulerCheck {
    /// Requests whose tokens differ from the device's own incremental greedy tokens.
    pub mismatches: Vec<u64>,
    pub finished: usize,
    pub preemptions: u64,
    pub prefix_hits: u64,
    /// Blocks still in use after every request finished.
    pub blocks_in_use: usize,
    pub drafter_failures: usize,
    /// Accepted draft tokens of each speculating request.
    pub accepted: Vec<usize>,
}

impl SchedulerCheck {
    /// What is wrong with a run over `blocks` blocks (12 must preempt, more must hit a prefix):
    /// `Err` with the reason.
    pub fn verdict(&self, blocks: usize) -> std::result::Result<(), String> {
        let fail = |why: &str| Err(format!("pool {blocks}: {why}: {self:?}"));
        if !self.mismatches.is_empty() || self.finished != 6 {
            return fail("outputs differ from incremental decoding");
        }
        if self.drafter_failures > 0 || self.accepted.contains(&0) {
            return fail("speculation failed or accepted nothing");
        }
        if self.blocks_in_use > 0 {
            return fail("blocks still in use");
        }
        if blocks <= 12 && self.preemptions == 0 {
            return fail("no preemption");
        }
        if blocks > 12 && self.prefix_hits == 0 {
            return fail("no prefix hit");
        }
        Ok(())
    }
}

/// Six greedy requests through the scheduler with every forward pass on `device` (over a host
/// pool of `blocks` blocks): plain ones, fixed- and adaptive-tree ones (siblings-first trees along
/// the reference, so accepted paths move), the last two arriving after four steps with the
/// prompt of an earlier one (prefix hits). `reference` decodes a prompt incrementally on the
/// same kind of device.
pub fn scheduler_against_incremental(
    model: &Model,
    device: std::sync::Arc<dyn super::DeviceForward>,
    blocks: usize,
    reference: Incremental<'_>,
) -> Result<SchedulerCheck> {
    use crate::generate::GenerateParams;
    use crate::kv::KvPool;
    use crate::sample::SamplingParams;
    use crate::sched::{Finish, RequestSpec, SchedConfig, Scheduler, SpecPolicy, StepCost};
    let vocab = model.config.vocab_size as u32;
    let pool = KvPool::new(&model.config, model.config.n_layers, blocks);
    let mut s = Scheduler::new(model, None, pool.clone(), SchedConfig::default())?;
    s.set_device(device);
    s.set_step_cost(StepCost::from_points(vec![(1, 0.010), (64, 0.012)]));
    let cpu = CpuBackend::new(1)?;
    let (mut want, mut done) = (Vec::new(), Vec::new());
    for i in 0..6usize {
        if i == 4 {
            for _ in 0..4 {
                for ev in s.step(&cpu)? {
                    done.extend(ev.finish.map(|f| (ev.id, f)));
                }
            }
        }
        // Repetitive prompts (prompt lookup finds matches); requests 4 and 5 repeat request 3's.
        let k = i.min(3) as u32;
        let p: Vec<u32> = (0..20 + 9 * k).map(|j| ((j % 9) * 5 + k) % vocab).collect();
        let n = 10 + 3 * i;
        let truth = reference(&p, n)?;
        let spec = |policy| RequestSpec {
            drafters: vec![Box::new(SiblingsFirstDrafter::new(
                truth.clone(),
                p.len(),
                2,
                i as u64,
            )) as Box<dyn Drafter>],
            budget: 12,
            policy,
            mode: None,
            external: false,
            candidates: 0,
            prompt_candidates: 0,
            max_nodes_by_depth: Vec::new(),
        };
        let sp = match i % 3 {
            0 => None,
            1 => Some(spec(SpecPolicy::Fixed)),
            _ => Some(spec(SpecPolicy::Adaptive)),
        };
        let params = GenerateParams {
            max_tokens: n,
            sampling: SamplingParams::greedy(),
            ..GenerateParams::default()
        };
        s.submit_spec(p, params, sp)?;
        want.push(truth);
    }
    done.extend(s.run_to_completion(&cpu)?);
    let mut check = SchedulerCheck {
        mismatches: Vec::new(),
        finished: done.len(),
        preemptions: s.stats().preemptions,
        prefix_hits: pool.stats().prefix_hits,
        blocks_in_use: pool.stats().used,
        drafter_failures: s.take_drafter_failures().len(),
        accepted: Vec::new(),
    };
    for (id, f) in &done {
        match f {
            Finish::Done { tokens, spec, .. } => {
                if tokens[..] != want[*id as usize][..] {
                    check.mismatches.push(*id);
                }
                if let Some(m) = spec {
                    check.accepted.push(m.accepted);
                }
            }
            Finish::Failed(_) => check.mismatches.push(*id),
        }
    }
    Ok(check)
}

/// Every kernel once on small seeded inputs through `ops` (shapes chosen to hit edge cases: rows
/// not a multiple of the matmul tile, outputs not a multiple of its warps, partial RoPE, an
/// out-of-vocabulary token, argmax ties and NaN, a chained commit): each kernel's name, output
/// (as f32; f16 bits as their values) and the tolerance against the host reference (0: exact).
/// The GPU check compares `CudaOps` with `HostOps` kernel by kernel, so a wrong kernel is named.
pub fn kernel_outputs<O: DeviceOps>(ops: &O) -> Result<Vec<(&'static str, Vec<f32>, f32)>> {
    use arbor_kernels_gpu::plan::{AttentionPlan, KvCommitPlan, SeqRows};
    use half::f16;
    let mut rng = Rng::new(17);
    let mut f = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale)
            .collect()
    };
    let bits = |v: &[f32]| -> Vec<u16> { v.iter().map(|&x| f16::from_f32(x).to_bits()).collect() };
    let vals = |v: &[u16]| -> Vec<f32> { v.iter().map(|&b| f16::from_bits(b).to_f32()).collect() };
    let mut out = Vec::new();
    let got = |b: &O::Buf<f32>, n: usize| -> Result<Vec<f32>> {
        let mut h = vec![0.0f32; n];
        ops.download(b, &mut h)?;
        Ok(h)
    };

    // embed_rows: vocab 50, d 40; token 60 is out of the vocabulary (a zero row).
    let table = ops.upload(&bits(&f(50 * 40, 1.0)))?;
    let tokens = ops.upload(&[3u32, 49, 60, 0, 3])?;
    let e = ops.zeroed::<f32>(5 * 40)?;
    ops.embed_rows(&table, &tokens, &e, 5, 40, 50)?;
    out.push(("embed_rows_f16", got(&e, 200)?, 0.0));

    // rms_norm: 3 rows of 72.
    let (x, w) = (ops.upload(&f(3 * 72, 2.0))?, ops.upload(&f(72, 1.0))?);
    let y = ops.zeroed::<f32>(3 * 72)?;
    ops.rms_norm(&x, &w, &y, 3, 72, 1e-5)?;
    out.push(("rms_norm_f32", got(&y, 216)?, 1e-4));

    // matmul: 37 outputs (not a multiple of 4 warps) of 64 inputs, 5 rows (one partial tile).
    let (wm, xm) = (
        ops.upload(&bits(&f(37 * 64, 0.5)))?,
        ops.upload(&f(5 * 64, 1.0))?,
    );
    let ym = ops.zeroed::<f32>(5 * 37)?;
    ops.matmul(&wm, &xm, &ym, 5, 37, 64)?;
    out.push(("matmul_f16", got(&ym, 185)?, 1e-4));

    // add: residual, then a bias row.
    let (xa, ya, b) = (
        ops.upload(&f(3 * 50, 1.0))?,
        ops.upload(&f(3 * 50, 1.0))?,
        ops.upload(&f(50, 1.0))?,
    );
    ops.add(&xa, &ya, 3, 50, 50)?;
    ops.add(&xa, &b, 3, 50, 0)?;
    out.push(("add_f32", got(&xa, 150)?, 0.0));

    // rope: 3 rows of 2 heads of 64, 16 rotated pairs (partial), both pairings.
    for neox in [false, true] {
        let xr = ops.upload(&f(3 * 128, 1.0))?;
        let (c, s) = (ops.upload(&f(3 * 16, 1.0))?, ops.upload(&f(3 * 16, 1.0))?);
        ops.rope(&xr, &c, &s, 3, 2, 64, 16, neox)?;
        out.push(("rope_f32", got(&xr, 384)?, 0.0));
    }

    // kv_write: 3 new rows of 24 into pool rows 5, 17 and 30 of a 2-plane pool of 32 rows.
    let pool = ops.zeroed::<u16>(2 * 32 * 24)?;
    let (kn, vn) = (ops.upload(&f(3 * 24, 3.0))?, ops.upload(&f(3 * 24, 3.0))?);
    let rows = ops.upload(&[5u32, 17, 30])?;
    ops.kv_write(&pool, 0, 32 * 24, &kn, &vn, &rows, 3, 24)?;
    let mut p = vec![0u16; 2 * 32 * 24];
    ops.download(&pool, &mut p)?;
    out.push(("kv_write_f16", vals(&p), 0.0));

    // kv_copy_rows: a chained commit in 4 planes.
    let pool = ops.upload(&bits(&f(4 * 32 * 24, 1.0)))?;
    ops.kv_copy_rows(
        &pool,
        &KvCommitPlan::new([(12, 11), (15, 12), (31, 13)]),
        4,
        32,
        24,
    )?;
    let mut p = vec![0u16; 4 * 32 * 24];
    ops.download(&pool, &mut p)?;
    out.push(("kv_copy_rows_f16", vals(&p), 0.0));

    // attention: a 5-node tree after 37 slots and a causal chunk of 3 from empty; 4 heads over
    // 2 KV heads of 32; an 8-block pool.
    let tree = [0b00001u64, 0b00011, 0b00101, 0b01011, 0b10101];
    let seqs = [
        SeqRows {
            n_past: 37,
            n_new: 5,
            blocks: &[6, 1, 4],
            mask: SeqMask::Bits {
                words_per_row: 1,
                bits: &tree,
            },
        },
        SeqRows {
            n_past: 0,
            n_new: 3,
            blocks: &[2],
            mask: SeqMask::Causal,
        },
    ];
    let plan = AttentionPlan::new(&seqs, 4, 2, 32, 8 * 16)?;
    let plane = 8 * 16 * 64;
    let pool = ops.upload(&bits(&f(2 * plane, 1.0)))?;
    let bufs = PlanBufs::upload(ops, &plan)?;
    let q = ops.upload(&f(8 * 4 * 32, 2.0))?;
    let att = ops.zeroed::<f32>(8 * 4 * 32)?;
    ops.attention(&plan, &bufs, &q, &pool, 0, plane, &att)?;
    out.push(("tree_attention_f16", got(&att, 8 * 128)?, 1e-3));

    // silu_mul over 100 values.
    let (g, u) = (ops.upload(&f(100, 4.0))?, ops.upload(&f(100, 1.0))?);
    ops.silu_mul(&g, &u, 100)?;
    out.push(("silu_mul_f32", got(&g, 100)?, 1e-5));

    // gather_rows: rows 4, 0, 4 of 6 rows of 20.
    let (xg, rg) = (ops.upload(&f(6 * 20, 1.0))?, ops.upload(&[4u32, 0, 4])?);
    let og = ops.zeroed::<f32>(3 * 20)?;
    ops.gather_rows(&xg, &rg, &og, 3, 20)?;
    out.push(("gather_rows_f32", got(&og, 60)?, 0.0));

    // argmax: a tie (first index wins), a NaN row entry, a row of -inf.
    let mut l = f(3 * 1000, 1.0);
    l[17] = 5.0;
    l[900] = 5.0;
    l[1000 + 3] = f32::NAN;
    l[1000 + 500] = 4.0;
    l[2000..3000].fill(f32::NEG_INFINITY);
    let (ld, best) = (ops.upload(&l)?, ops.zeroed::<u32>(3)?);
    ops.argmax(&ld, &best, 3, 1000)?;
    let mut bi = [0u32; 3];
    ops.download(&best, &mut bi)?;
    out.push(("argmax_f32", bi.iter().map(|&i| i as f32).collect(), 0.0));
    Ok(out)
}

/// The largest difference between two runs of [`kernel_outputs`], per kernel (infinite where a
/// value is NaN on one side only or the lengths differ), with the allowed tolerance.
pub fn kernel_differences(
    a: &[(&'static str, Vec<f32>, f32)],
    b: &[(&'static str, Vec<f32>, f32)],
) -> Vec<(&'static str, f32, f32)> {
    a.iter()
        .zip(b)
        .map(|((name, x, tol), (_, y, _))| {
            let worst = if x.len() != y.len() {
                f32::INFINITY
            } else {
                x.iter()
                    .zip(y)
                    .fold(0.0f32, |m, (p, q)| match (p.is_nan(), q.is_nan()) {
                        (true, true) => m,
                        (false, false) => m.max((p - q).abs() / p.abs().max(1.0)),
                        _ => f32::INFINITY,
                    })
            };
            (*name, worst, *tol)
        })
        .collect()
}
