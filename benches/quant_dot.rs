//! Criterion benchmark of the quantized matmul (`arbor_engine::quant::matmul`) at 1..64 activation rows.
//!
//! Shapes: Q4_1 576x1536 (smollm2-135m FFN down), Q4_K and Q6_K 1536 rows x 8960 inputs (qwen2.5-1.5b
//! FFN down). Weights are random rows built with `quantize_row`. Runs on rayon's global pool: one
//! thread per core (2 on the target machine) unless `RAYON_NUM_THREADS` says otherwise. Throughput
//! is reported in weight bytes per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;

use arbor_engine::quant::{matmul, quantize_row, GgmlType, QMatrix};

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64), so the bench needs no RNG crate.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn weights(ty: GgmlType, n_out: usize, n_in: usize) -> Vec<u8> {
    let rb = ty.row_bytes(n_in).expect("whole blocks");
    let mut data = vec![0u8; rb * n_out];
    for (o, row) in data.chunks_mut(rb).enumerate() {
        quantize_row(ty, &values(n_in, o as u64 + 1), row).expect("quantize");
    }
    data
}

fn bench(c: &mut Criterion) {
    let cases = [
        (GgmlType::Q4_1, 576usize, 1536usize),
        (GgmlType::Q4_K, 1536, 8960),
        (GgmlType::Q6_K, 1536, 8960),
    ];
    for (ty, n_out, n_in) in cases {
        let data = weights(ty, n_out, n_in);
        let w = QMatrix::new(ty, &data, n_out, n_in).expect("matrix");
        let mut group = c.benchmark_group(format!("matmul_{}_{}x{}", ty.name(), n_out, n_in));
        group.sample_size(10);
        group.warm_up_time(Duration::from_millis(300));
        group.measurement_time(Duration::from_secs(1));
        group.throughput(Throughput::Bytes(data.len() as u64));
        for n_tok in [1usize, 4, 16, 64] {
            let x = values(n_tok * n_in, 1000 + n_tok as u64);
            let mut y = vec![0f32; n_tok * n_out];
            group.bench_with_input(BenchmarkId::new("n_tok", n_tok), &n_tok, |b, &n_tok| {
                b.iter(|| matmul(&w, &x, n_tok, &mut y).expect("matmul"))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
