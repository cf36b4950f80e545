//! Blocked sums and inverse-CDF draws over masses in token order: lanes and blocks keyed by token id, so a dense `[vocab]` array and its sparse (token, mass) entries give the same bits, and the dense form vectorizes.
//!
//! A sequential f64 sum over a 49k-150k vocabulary is a chain of dependent adds (~4 cycles
//! each): two of them (the total, then the scan) were most of a sampled row's cost. Here a
//! block is [`BLOCK`] consecutive token ids; its sum adds token `t` into lane `t % LANES` in token
//! order and combines the lanes in a fixed tree; the total adds the block sums in block order. A
//! draw walks the block sums to the block holding `u`, then scans that block's tokens. Absent
//! tokens and zero masses add exactly nothing, so every view of one distribution (dense with
//! zeros, sparse without them) gives the same total and the same token.

use crate::backend::simd::widened;

/// Token ids per block.
pub const BLOCK: usize = 64;
/// Lanes per block sum.
const LANES: usize = 8;

/// The fixed combination of a block's lanes.
#[inline(always)]
fn combine(l: &[f64; LANES]) -> f64 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// A mass as the sums read it: NaN counts as no mass (callers leave NaN logits out).
pub trait Mass: Copy {
    fn mass(self) -> f64;
}

impl Mass for f32 {
    /// Widened exactly (a NaN stays NaN, so it has no mass either).
    #[inline(always)]
    fn mass(self) -> f64 {
        f64::from(self).mass()
    }
}

impl Mass for f64 {
    #[inline(always)]
    fn mass(self) -> f64 {
        if self.is_nan() {
            0.0
        } else {
            self
        }
    }
}

/// The sum of one block of a dense array (`m.len() <= BLOCK`, token ids from a multiple of
/// `BLOCK`).
#[inline(always)]
fn block_sum<T: Mass>(m: &[T]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = m.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v.mass();
        }
    }
    for (a, &v) in acc.iter_mut().zip(tail) {
        *a += v.mass();
    }
    combine(&acc)
}

widened! {
    /// Every block's sum of the dense masses `m` (index = token id) into `sums`.
    pub fn block_sums<T: Mass>(m: &[T], sums: &mut Vec<f64>) -> () = block_sums_of;
}

#[inline(always)]
fn block_sums_of<T: Mass>(m: &[T], sums: &mut Vec<f64>) {
    sums.clear();
    sums.extend(m.chunks(BLOCK).map(block_sum));
}

widened! {
    /// The total of the dense masses `m`: the block sums added in block order.
    pub fn total<T: Mass>(m: &[T]) -> f64 = total_of;
}

#[inline(always)]
fn total_of<T: Mass>(m: &[T]) -> f64 {
    m.chunks(BLOCK).map(block_sum).fold(0.0, |s, b| s + b)
}

/// The total of sparse masses in strictly increasing token order: [`total`] of their dense
/// copy, bit for bit.
pub fn total_in_order(entries: impl Iterator<Item = (u32, f64)>) -> f64 {
    let mut t = 0.0;
    sparse_blocks(entries, |_, s| t += s);
    t
}

/// The total of masses in the order given, with [`LANES`] running sums (entry `i` in sum
/// `i % LANES`) combined as a block's lanes are: for distributions sorted by probability, whose
/// token ids do not run in blocks.
pub fn total_in_sequence(masses: impl Iterator<Item = f64>) -> f64 {
    let mut acc = [0.0f64; LANES];
    for (i, v) in masses.enumerate() {
        acc[i % LANES] += v.mass();
    }
    combine(&acc)
}

/// Calls `f(block, sum)` for every block holding an entry, in order (entries in strictly
/// increasing token order; empty blocks, whose sum is 0, are skipped: adding 0 changes nothing).
fn sparse_blocks(entries: impl Iterator<Item = (u32, f64)>, mut f: impl FnMut(usize, f64)) {
    let mut acc = [0.0f64; LANES];
    let mut cur = None;
    for (t, v) in entries {
        let b = t as usize / BLOCK;
        if cur != Some(b) {
            if let Some(c) = cur {
                f(c, combine(&acc));
            }
            acc = [0.0; LANES];
            cur = Some(b);
        }
        acc[t as usize % LANES] += v.mass();
    }
    if let Some(c) = cur {
        f(c, combine(&acc));
    }
}

/// Where a draw of `u` (in `[0, total)`) lands among block sums: the first block whose sum
/// exceeds what is left of `u`, and what is left of `u` there (`None`: rounding left `u` past
/// every block).
#[inline]
fn find_block(sums: impl Iterator<Item = (usize, f64)>, mut u: f64) -> (Option<usize>, f64) {
    for (b, s) in sums {
        if u < s {
            return (Some(b), u);
        }
        u -= s;
    }
    (None, u)
}

/// One inverse-CDF draw from the dense masses `m` (index = token id, any positive total) with
/// one uniform `r` in `[0, 1)`: the block holding `r · total`, then the first token there (or,
/// should rounding leave the block's scan short, after it) at which the remainder falls below
/// 0; the last token with mass when rounding leaves it short everywhere (token 0 without any).
pub fn draw_dense<T: Mass>(m: &[T], r: f64) -> u32 {
    let mut sums = Vec::with_capacity(m.len().div_ceil(BLOCK));
    block_sums(m, &mut sums);
    let total = sums.iter().fold(0.0, |s, &b| s + b);
    let (block, mut u) = find_block(sums.iter().copied().enumerate(), r * total);
    if let Some(b) = block {
        for (i, &v) in m.iter().enumerate().skip(b * BLOCK) {
            let v = v.mass();
            if v > 0.0 {
                u -= v;
                if u < 0.0 {
                    return i as u32;
                }
            }
        }
    }
    m.iter().rposition(|&v| v.mass() > 0.0).unwrap_or(0) as u32
}

/// [`draw_dense`] of the dense copy of `entries` (strictly increasing token order), bit for bit.
pub fn draw_in_order<T: Mass>(entries: &[(u32, T)], r: f64) -> u32 {
    let mut sums = Vec::new();
    sparse_blocks(entries.iter().map(|&(t, v)| (t, v.mass())), |b, s| {
        sums.push((b, s))
    });
    let total = sums.iter().fold(0.0, |s, &(_, b)| s + b);
    let (block, mut u) = find_block(sums.iter().copied(), r * total);
    if let Some(b) = block {
        let start = entries.partition_point(|e| (e.0 as usize) < b * BLOCK);
        for &(t, v) in &entries[start..] {
            let v = v.mass();
            if v > 0.0 {
                u -= v;
                if u < 0.0 {
                    return t;
                }
            }
        }
    }
    entries
        .iter()
        .rev()
        .find(|e| e.1.mass() > 0.0)
        .map_or(0, |e| e.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Rng;

    /// Masses with zeros, tiny values, NaNs and a few large entries over `n` tokens.
    fn masses(rng: &mut Rng, n: usize) -> Vec<f64> {
        (0..n)
            .map(|_| match rng.next_u64() % 8 {
                0 => 0.0,
                1 => 1e-300,
                2 if rng.next_u64().is_multiple_of(16) => f64::NAN,
                3 => rng.next_f64() * 1e3,
                _ => rng.next_f64(),
            })
            .collect()
    }

    /// The sequential inverse-CDF scan the blocked draw replaces.
    fn draw_sequential(m: &[f64], r: f64) -> u32 {
        let total: f64 = m.iter().map(|v| v.mass()).sum();
        let mut u = r * total;
        let mut last = 0;
        for (i, &v) in m.iter().enumerate() {
            if v.mass() > 0.0 {
                last = i;
                u -= v.mass();
                if u < 0.0 {
                    return i as u32;
                }
            }
        }
        last as u32
    }

    /// Dense and sparse views agree bit for bit (totals and draws), and the draw is the
    /// sequential scan's token (the two differ only where `u` falls within rounding of a
    /// boundary, which these draws never hit).
    #[test]
    fn dense_and_sparse_views_agree_and_draw_the_sequential_token() {
        let mut rng = Rng::new(3);
        for case in 0..300 {
            let n = 1 + (rng.next_u64() % 700) as usize;
            let m = masses(&mut rng, n);
            let sparse: Vec<(u32, f64)> = m
                .iter()
                .enumerate()
                .filter(|(_, v)| v.mass() > 0.0 || case % 3 == 0)
                .map(|(i, &v)| (i as u32, v))
                .collect();
            let t = total(&m);
            assert_eq!(
                t.to_bits(),
                total_in_order(sparse.iter().copied()).to_bits()
            );
            let m32: Vec<f32> = m.iter().map(|&v| v as f32).collect();
            let s32: Vec<(u32, f32)> = m32
                .iter()
                .enumerate()
                .filter(|(_, v)| v.mass() > 0.0)
                .map(|(i, &v)| (i as u32, v))
                .collect();
            for _ in 0..20 {
                let r = rng.next_f64();
                let d = draw_dense(&m, r);
                assert_eq!(d, draw_in_order(&sparse, r), "case {case}");
                assert_eq!(d, draw_sequential(&m, r), "case {case}, r {r}");
                assert!(m[d as usize].mass() > 0.0 || t == 0.0, "case {case}");
                assert_eq!(draw_dense(&m32, r), draw_in_order(&s32, r), "case {case}");
            }
            // The ends: r = 0 gives the first token with mass; r just below 1 one with mass
            // at or after the last block's start (rounding may leave it short of every block).
            let first = m.iter().position(|v| v.mass() > 0.0).unwrap_or(0) as u32;
            assert_eq!(draw_dense(&m, 0.0), first, "case {case}");
            let top = draw_dense(&m, 1.0 - f64::EPSILON / 2.0);
            assert_eq!(top, draw_in_order(&sparse, 1.0 - f64::EPSILON / 2.0));
            assert!(m[top as usize].mass() > 0.0 || t == 0.0, "case {case}");
        }
    }

    /// Nothing to draw from: token 0, as the sequential scan.
    #[test]
    fn no_mass_draws_token_zero() {
        for m in [vec![], vec![0.0f64; 200], vec![f64::NAN; 70]] {
            assert_eq!(draw_dense(&m, 0.5), 0);
            let sparse: Vec<(u32, f64)> =
                m.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
            assert_eq!(draw_in_order(&sparse, 0.5), 0);
            assert_eq!(total(&m), 0.0);
        }
    }
}
