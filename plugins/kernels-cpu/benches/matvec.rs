//! Decode-shaped matvec throughput per weight dtype, against this machine's read bandwidth
//! measured in the same run.
//!
//! `cargo bench -p u-kernels-cpu --bench matvec` (env: `U_THREADS` threads, default all cores;
//! `U_BENCH_MB` working set per dtype, default 1024 — larger than the last-level cache, so the
//! weights stream from DRAM as in a real decode;
//! `U_ISA=scalar|avx2|avx512|vnni|neon|neondot` forces a path; `U_M` activation rows, default 1;
//! `U_N`/`U_K` the weight shape, default 4096 × 4096;
//! `U_DTYPE=Q4_0,Q8_0` a subset; `U_ROUNDS` timing rounds, default 5, best kept).
//!
//! `cpu-us/op` is process CPU time per product divided by the thread count: on a machine shared
//! with other work, wall time also counts time descheduled, CPU time does not (it still counts
//! rayon's idle spinning, so it is an upper bound on the kernel's own time).
//!
//! Prints, for a 4096 × 4096 weight: time per product, weight bytes read per second, and that as
//! a fraction of the streaming-read bandwidth (a plain parallel sum over the same working set).

use rayon::prelude::*;
use std::time::{Duration, Instant};
use u_kernels_cpu::testutil::{Rng, random_weight};
use u_kernels_cpu::{CpuKernels, Isa};
use u_sdk::abi_stable::std_types::{RSlice, RVec};
use u_sdk::{DType, TensorView};

/// CPU time consumed by the whole process (all threads), in seconds: unlike wall time it does
/// not count time the threads spend descheduled, so it stays meaningful on a loaded machine.
fn process_cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Best-of-5 streaming read bandwidth in GB/s over `bytes` with `threads` threads.
fn read_bandwidth(bytes: usize, threads: usize) -> f64 {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let words = bytes / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = pool.install(|| {
            buf.par_chunks(1 << 16)
                .map(|c| {
                    // Four independent lanes so the sum is not latency-bound.
                    let mut a = [0u64; 4];
                    for q in c.chunks_exact(4) {
                        for i in 0..4 {
                            a[i] = a[i].wrapping_add(q[i]);
                        }
                    }
                    a.iter().fold(0u64, |x, y| x.wrapping_add(*y))
                })
                .reduce(|| 0, |a, b| a.wrapping_add(b))
        });
        std::hint::black_box(s);
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn main() {
    let threads = env_usize(
        "U_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let ws = env_usize("U_BENCH_MB", 1024) << 20;
    let m = env_usize("U_M", 1);
    let isa = std::env::var("U_ISA")
        .ok()
        .and_then(|n| Isa::from_short(&n))
        .unwrap_or_else(Isa::detect);
    let kern = CpuKernels::with_isa(isa, threads).expect("isa not available");
    let (n, k) = (env_usize("U_N", 4096), env_usize("U_K", 4096));
    let bw = read_bandwidth(ws, threads);
    println!(
        "kernels-cpu matvec: isa {}, {threads} threads, {n}x{k} weights, m = {m}, working set {} MiB",
        isa.name(),
        ws >> 20
    );
    println!("streaming read bandwidth: {bw:.1} GB/s");
    println!(
        "{:<6} {:>9} {:>10} {:>9} {:>8} {:>9} {:>12} {:>10}",
        "dtype", "MiB", "us/op", "GB/s", "of bw", "GFLOP/s", "cpu-us/op", "cpu-GB/s"
    );
    let mut rng = Rng::new(1);
    let x = rng.vec(m * k, 1.0);
    let mut y = vec![0f32; m * n];
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q6_K,
        DType::Q5_K,
        DType::Q5_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q4_0,
        DType::TQ2_0,
    ]
    .into_iter()
    .filter(|d| {
        std::env::var("U_DTYPE").map_or(true, |f| {
            f.split(',').any(|f| f.eq_ignore_ascii_case(d.name()))
        })
    }) {
        let one = random_weight(&mut rng, dtype, n, k);
        let copies = ws.div_ceil(one.len()).clamp(1, 256);
        let weights: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
        let views: Vec<TensorView<'_>> = weights
            .iter()
            .map(|w| TensorView {
                dtype,
                shape: RVec::from(vec![n as u64, k as u64]),
                data: RSlice::from_slice(w),
            })
            .collect();
        // Warm up (page faults, scratch growth), then time whole passes over the working set.
        for v in &views {
            kern.matmul(v, &x, m, &mut y).expect("matmul");
        }
        // Best of several rounds (each at least one pass and 150 ms): robust to other load on
        // a shared machine.
        let mut per = f64::MAX;
        let mut cpu_per = f64::MAX;
        let mut total_ops = 0usize;
        for _ in 0..env_usize("U_ROUNDS", 5) {
            let mut ops = 0usize;
            let t = Instant::now();
            let c = process_cpu_time();
            while ops < copies || t.elapsed() < Duration::from_millis(150) {
                kern.matmul(&views[ops % copies], &x, m, &mut y)
                    .expect("matmul");
                ops += 1;
            }
            per = per.min(t.elapsed().as_secs_f64() / ops as f64);
            cpu_per = cpu_per.min((process_cpu_time() - c) / ops as f64 / threads as f64);
            total_ops += ops;
        }
        let gbs = one.len() as f64 / per / 1e9;
        println!(
            "{:<6} {:>9.2} {:>10.1} {:>9.1} {:>7.0}% {:>9.1} {:>12.1} {:>10.1}",
            dtype.name(),
            one.len() as f64 / (1 << 20) as f64,
            per * 1e6,
            gbs,
            100.0 * gbs / bw,
            2.0 * (m * n * k) as f64 / per / 1e9,
            cpu_per * 1e6,
            one.len() as f64 / cpu_per / 1e9
        );
        std::hint::black_box(&y);
        if std::env::var_os("U_VERBOSE").is_some() {
            println!("       {total_ops} products timed");
        }
    }
}
