//! Runs the kernels that the `ptoxide` PTX interpreter can execute as written (data movement and
//! f32 adds: `add_f32`, `gather_rows_f32`, `kv_copy_rows_f16`) on small inputs, against the CPU.
//! The others use instructions ptoxide lacks (`ex2`, `shfl`, `selp`, `div`, f16 conversions); see
//! docs/gpu.md for how each kernel is checked.

use arbor_kernels_gpu::plan::{self, KvCommitPlan};
use arbor_kernels_gpu::{ADD_F32, GATHER_ROWS_F32, KV_COPY_ROWS_F16};
use ptoxide::{Argument, Context, LaunchParams};
use rand::{Rng, SeedableRng};

fn launch(d: plan::LaunchDims) -> LaunchParams<'static> {
    LaunchParams::func_id(0)
        .grid2d(d.grid.0, d.grid.1)
        .block1d(d.block.0)
}

#[test]
fn add_f32_residual_and_bias() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (rows, width) = (3usize, 300usize);
    let x: Vec<f32> = (0..rows * width)
        .map(|_| rng.gen_range(-2.0..2.0))
        .collect();
    let y: Vec<f32> = (0..rows * width)
        .map(|_| rng.gen_range(-2.0..2.0))
        .collect();
    for bias in [false, true] {
        let mut ctx = Context::new_with_module(ADD_F32).expect("ptoxide parses add_f32");
        let dx = ctx.alloc::<f32>(x.len());
        let dy = ctx.alloc::<f32>(y.len());
        ctx.write(dx, &x);
        ctx.write(dy, &y);
        let stride = if bias { 0 } else { width as u32 };
        ctx.run(
            launch(plan::per_row(rows, 256).unwrap()),
            &[
                Argument::ptr(dx),
                Argument::ptr(dy),
                Argument::U32(width as u32),
                Argument::U32(stride),
            ],
        )
        .expect("add_f32 runs");
        let mut got = vec![0f32; x.len()];
        ctx.read(dx, &mut got);
        for (i, g) in got.iter().enumerate() {
            let yi = if bias { y[i % width] } else { y[i] };
            assert_eq!(
                g.to_bits(),
                (x[i] + yi).to_bits(),
                "element {i}, bias {bias}"
            );
        }
    }
}

#[test]
fn gather_rows_f32_selects_rows() {
    let (n, width) = (6usize, 200usize);
    let x: Vec<f32> = (0..n * width).map(|i| i as f32 * 0.5).collect();
    let rows = [4u32, 0, 4, 5];
    let mut ctx =
        Context::new_with_module(GATHER_ROWS_F32).expect("ptoxide parses gather_rows_f32");
    let dx = ctx.alloc::<f32>(x.len());
    let dr = ctx.alloc::<u32>(rows.len());
    let dout = ctx.alloc::<f32>(rows.len() * width);
    ctx.write(dx, &x);
    ctx.write(dr, &rows);
    ctx.run(
        launch(plan::per_row(rows.len(), 128).unwrap()),
        &[
            Argument::ptr(dx),
            Argument::ptr(dr),
            Argument::ptr(dout),
            Argument::U32(width as u32),
        ],
    )
    .expect("gather_rows_f32 runs");
    let mut got = vec![0f32; rows.len() * width];
    ctx.read(dout, &mut got);
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        assert_eq!(
            &got[i * width..(i + 1) * width],
            &x[r * width..(r + 1) * width]
        );
    }
}

#[test]
fn kv_copy_rows_f16_commits_chained_paths_in_every_plane() {
    // 3 layers x (K, V) planes of 40 pool rows of kv_dim 20 f16 values (as raw u16 bits).
    let (planes, pool_rows, kv_dim) = (6usize, 40usize, 20usize);
    let pool: Vec<u16> = (0..planes * pool_rows * kv_dim).map(|i| i as u16).collect();
    // An accepted path whose rows chain (12 -> 11, then 15 -> 12), across a block boundary
    // (31 -> 13), and a no-op pair.
    let commit = KvCommitPlan::new([(10, 10), (12, 11), (15, 12), (31, 13)]);
    let mut ctx =
        Context::new_with_module(KV_COPY_ROWS_F16).expect("ptoxide parses kv_copy_rows_f16");
    let dp = ctx.alloc::<u16>(pool.len());
    let ds = ctx.alloc::<u32>(commit.src.len());
    let dd = ctx.alloc::<u32>(commit.dst.len());
    ctx.write(dp, &pool);
    ctx.write(ds, &commit.src);
    ctx.write(dd, &commit.dst);
    ctx.run(
        launch(plan::kv_copy(planes).unwrap()),
        &[
            Argument::ptr(dp),
            Argument::ptr(ds),
            Argument::ptr(dd),
            Argument::U32(commit.src.len() as u32),
            Argument::U32((kv_dim / 2) as u32),
            Argument::U64((pool_rows * kv_dim / 2) as u64),
        ],
    )
    .expect("kv_copy_rows_f16 runs");
    let mut got = vec![0u16; pool.len()];
    ctx.read(dp, &mut got);
    let mut want = pool.clone();
    for plane in want.chunks_exact_mut(pool_rows * kv_dim) {
        commit.apply(plane, kv_dim);
    }
    assert_eq!(got, want);
    assert_ne!(got, pool);
}
