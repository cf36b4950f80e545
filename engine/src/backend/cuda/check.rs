//! Checks of a device model shared by the host tests ([`HostOps`](super::HostOps)) and the GPU
//! check (`tests/cuda_device.rs` on `CudaModel`), so both assert the same things: logits against
//! the CPU forward pass, and speculative greedy decoding against incremental decoding.

use super::model::{DeviceModel, DeviceSeq, GreedyRun};
use super::ops::DeviceOps;
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
