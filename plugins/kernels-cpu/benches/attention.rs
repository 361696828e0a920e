//! Attention throughput for SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64, f32
//! KV): causal prefill of a whole context, and decode (one query against that context).
//!
//! `cargo bench -p u-kernels-cpu --bench attention` (env: `U_THREADS` threads, default all
//! cores; `U_ISA=scalar|avx2|avx512|vnni` forces a path; `U_CTX=128,512,2048` the contexts;
//! `U_ROUNDS` timing rounds, default 7, best kept; `U_KV=f16` for f16 KV).
//!
//! Prints per call the best wall time and the best process CPU time divided by the thread
//! count (on a machine shared with other work wall time counts time descheduled, CPU time does
//! not; it does count helper threads' idle spinning), and the attention GFLOP/s from the wall
//! time (`4·d` flops per visible query–key pair and head: `q·k` and `p·v`).

use std::time::Instant;
use u_kernels_cpu::attention::{KvSpan, Params as AttentionParams};
use u_kernels_cpu::testutil::{Rng, f32_to_f16};
use u_kernels_cpu::{CpuKernels, Isa};
use u_sdk::DType;

/// CPU time consumed by the whole process (all threads), in seconds.
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

fn main() {
    let threads = env_usize(
        "U_THREADS",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let rounds = env_usize("U_ROUNDS", 7).max(1);
    let isa = std::env::var("U_ISA")
        .ok()
        .and_then(|n| Isa::from_short(&n))
        .unwrap_or_else(Isa::detect);
    let dtype = match std::env::var("U_KV").as_deref() {
        Ok("f16") => DType::F16,
        _ => DType::F32,
    };
    let ctxs: Vec<usize> = std::env::var("U_CTX")
        .unwrap_or_else(|_| "128,512,2048".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let kern = CpuKernels::with_isa(isa, threads).expect("isa not available");
    let (h, kvh, d) = (9usize, 3usize, 64usize);
    println!(
        "kernels-cpu attention: isa {}, {threads} threads, {h} heads / {kvh} KV heads x {d}, \
         KV {dtype}",
        isa.name()
    );
    let mut rng = Rng::new(7);
    for &ctx in &ctxs {
        let kv = rng.vec(ctx * kvh * d, 1.0);
        let bytes: Vec<u8> = match dtype {
            DType::F16 => kv
                .iter()
                .flat_map(|&x| f32_to_f16(x).to_le_bytes())
                .collect(),
            _ => kv.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        for (name, nq) in [("prefill", ctx), ("decode", 1)] {
            let q = rng.vec(nq * h * d, 1.0);
            let mut out = vec![0f32; nq * h * d];
            let p = AttentionParams {
                heads: h as u32,
                kv_heads: kvh as u32,
                head_dim: d as u32,
                queries: nq as u32,
                kv_len: ctx as u32,
                first_query_pos: (ctx - nq) as u32,
                window: 0,
                scale: 1.0 / (d as f32).sqrt(),
                softcap: 0.0,
                kv_dtype: dtype,
            };
            // Visible query–key pairs: a triangle for prefill, the context for decode.
            let pairs: usize = (0..nq).map(|i| ctx - nq + i + 1).sum();
            let flops = (4 * d * h * pairs) as f64;
            // Enough calls per round for ~50 ms.
            let reps = (5e7 / flops).clamp(1.0, 10_000.0) as usize;
            let (mut wall, mut cpu) = (f64::MAX, f64::MAX);
            for _ in 0..rounds {
                let (t, c) = (Instant::now(), process_cpu_time());
                for _ in 0..reps {
                    let kv = KvSpan::bytes(ctx as u32, &bytes[..], &bytes[..]);
                    kern.attention(&q, &[kv], &p, &mut out).expect("attention");
                }
                wall = wall.min(t.elapsed().as_secs_f64() / reps as f64);
                cpu = cpu.min((process_cpu_time() - c) / reps as f64 / threads as f64);
            }
            println!(
                "ctx {ctx:5} {name:7}: {:9.1} us/call wall, {:9.1} us/call cpu, {:6.1} GFLOP/s",
                wall * 1e6,
                cpu * 1e6,
                flops / wall * 1e-9
            );
        }
    }
}
