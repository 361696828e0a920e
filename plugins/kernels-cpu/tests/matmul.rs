//! Quantized and float matmul against dequantize-then-f64 references, on every ISA this CPU has.
//!
//! Tolerances (all relative to the magnitude `M = Σ_j |w_j|·|x_j|` of each output, since outputs
//! of random data cancel and can be near zero):
//! - **tight**, against the reference that uses the *same* int8 activations: the integer block
//!   sums are exact, so only f32 rounding differs — a few ulps per block scale product plus the
//!   running f32 sum over ≤ 88 blocks (≈ 88 · 6e-8 ≈ 5e-6), and for Q4_K/Q5_K the minimum applied
//!   per super-block instead of per value (cancellation up to ~3×). Bound: `3e-5 · M`.
//! - **loose**, against pure f32 activations: each activation moves by at most half its block's
//!   quantization step (`d_x / 2`, `d_x = amax/127`), so `|Δy| ≤ Σ_j |w_j| · d_x(j)/2` plus the
//!   tight bound. This bound is computed per output from the actual data.
//! - **SIMD vs scalar**: k-quant, TQ1_0 and TQ2_0 kernels are bit-identical (exact integer sums, same
//!   f32 operations per super-block); 32-block and float kernels accumulate in vector lanes, so
//!   `2e-5 · M`.

use u_kernels_cpu::act::{dequantize_q8, dequantize_q8k, quantize_q8, quantize_q8k};
use u_kernels_cpu::testutil::{Rng, random_weight};
use u_kernels_cpu::{CpuKernels, Isa};
use u_sdk::abi_stable::std_types::{RSlice, RVec};
use u_sdk::{DType, TensorView, quant};

const DIRECT: [DType; 12] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::TQ1_0,
    DType::TQ2_0,
];

fn view(dtype: DType, n: usize, k: usize, data: &[u8]) -> TensorView<'_> {
    TensorView {
        dtype,
        shape: RVec::from(vec![n as u64, k as u64]),
        data: RSlice::from_slice(data),
    }
}

/// The activations the integer kernels actually see, and each value's quantization step.
fn seen_activations(dtype: DType, x: &[f32], k: usize) -> (Vec<f32>, Vec<f32>) {
    let mut out = Vec::new();
    let mut step = Vec::new();
    for row in x.chunks_exact(k) {
        match dtype.block_size() {
            1 => {
                out.extend_from_slice(row);
                step.extend(std::iter::repeat_n(0.0, k));
            }
            32 => {
                let mut b = vec![Default::default(); k / 32];
                quantize_q8(row, &mut b);
                out.extend(dequantize_q8(&b));
                step.extend(b.iter().flat_map(|b| std::iter::repeat_n(b.d, 32)));
            }
            _ => {
                let mut b = vec![Default::default(); k / 256];
                quantize_q8k(row, &mut b);
                out.extend(dequantize_q8k(&b));
                step.extend(b.iter().flat_map(|b| std::iter::repeat_n(b.d, 256)));
            }
        }
    }
    (out, step)
}

struct Case {
    dtype: DType,
    n: usize,
    k: usize,
    m: usize,
    w: Vec<u8>,
    x: Vec<f32>,
}

impl Case {
    fn new(seed: u64, dtype: DType, n: usize, k: usize, m: usize) -> Case {
        let mut rng = Rng::new(seed);
        let w = random_weight(&mut rng, dtype, n, k);
        let x = rng.vec(m * k, 2.0);
        Case {
            dtype,
            n,
            k,
            m,
            w,
            x,
        }
    }

    fn run(&self, isa: Isa) -> Vec<f32> {
        let kern = CpuKernels::with_isa(isa, 2).expect("isa");
        let mut y = vec![f32::NAN; self.m * self.n];
        kern.matmul(
            &view(self.dtype, self.n, self.k, &self.w),
            &self.x,
            self.m,
            &mut y,
        )
        .expect("matmul");
        y
    }

    /// Checks `y` against both references; returns the worst tight error ratio.
    fn check(&self, y: &[f32], what: &str) -> f64 {
        let wf = quant::dequantize_to_vec(self.dtype, &self.w).expect("dequantize");
        let (xq, step) = seen_activations(self.dtype, &self.x, self.k);
        let mut worst = 0f64;
        for i in 0..self.m {
            for r in 0..self.n {
                let wr = &wf[r * self.k..(r + 1) * self.k];
                let (xr, qr, sr) = (
                    &self.x[i * self.k..(i + 1) * self.k],
                    &xq[i * self.k..(i + 1) * self.k],
                    &step[i * self.k..(i + 1) * self.k],
                );
                let (mut tight, mut pure, mut mag, mut qerr) = (0f64, 0f64, 0f64, 0f64);
                for j in 0..self.k {
                    let (w, a, b) = (f64::from(wr[j]), f64::from(qr[j]), f64::from(xr[j]));
                    tight += w * a;
                    pure += w * b;
                    mag += (w * a).abs();
                    qerr += w.abs() * f64::from(sr[j]) * 0.5001;
                }
                let got = f64::from(y[i * self.n + r]);
                let tol = 3e-5 * mag + 1e-30;
                let e = (got - tight).abs();
                assert!(
                    e <= tol,
                    "{what} {:?} n{} k{} m{}: y[{i},{r}] = {got}, same-activation ref {tight}, |Δ| {e:e} > {tol:e}",
                    self.dtype,
                    self.n,
                    self.k,
                    self.m
                );
                let e2 = (got - pure).abs();
                assert!(
                    e2 <= qerr + tol,
                    "{what} {:?}: y[{i},{r}] = {got}, f32 ref {pure}, |Δ| {e2:e} > {:e}",
                    self.dtype,
                    qerr + tol
                );
                worst = worst.max(e / tol);
            }
        }
        worst
    }
}

fn shapes(dtype: DType) -> Vec<(usize, usize, usize)> {
    let mut s = vec![(7, 512, 1), (33, 1024, 5), (5, 2816, 17), (64, 256, 3)];
    if dtype.block_size() < 256 {
        // Odd block counts (the 2-block unroll's tail) and rows narrower than a k-block.
        s.extend([(9, 96, 1), (3, 32, 2), (11, 160, 4)]);
    }
    if dtype.block_size() == 1 {
        s.extend([(5, 37, 3), (2, 7, 1)]);
    }
    s
}

#[test]
fn every_isa_matches_the_dequantized_reference() {
    for isa in Isa::available() {
        for dtype in DIRECT {
            for (seed, (n, k, m)) in shapes(dtype).into_iter().enumerate() {
                let c = Case::new(seed as u64 + 1, dtype, n, k, m);
                let y = c.run(isa);
                c.check(&y, isa.name());
            }
        }
    }
}

#[test]
fn fallback_dtypes_match_the_dequantized_reference() {
    for dtype in [DType::Q5_1, DType::Q2_K, DType::Q3_K] {
        let c = Case::new(9, dtype, 5, 512, 2);
        let y = c.run(Isa::detect());
        // No activation quantization on this path: the tight reference is the f32 one.
        let c2 = Case {
            dtype: c.dtype,
            n: c.n,
            k: c.k,
            m: c.m,
            w: c.w.clone(),
            x: c.x.clone(),
        };
        let wf = quant::dequantize_to_vec(dtype, &c2.w).expect("dequantize");
        for i in 0..c.m {
            for r in 0..c.n {
                let (mut want, mut mag) = (0f64, 0f64);
                for j in 0..c.k {
                    let p = f64::from(wf[r * c.k + j]) * f64::from(c.x[i * c.k + j]);
                    want += p;
                    mag += p.abs();
                }
                let got = f64::from(y[i * c.n + r]);
                assert!(
                    (got - want).abs() <= 1e-5 * mag,
                    "{dtype:?} [{i},{r}] {got} vs {want}"
                );
            }
        }
    }
}

fn is_bit_exact(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::TQ1_0 | DType::TQ2_0
    )
}

#[test]
fn every_simd_path_equals_the_scalar_path() {
    for isa in Isa::available().into_iter().filter(|&i| i != Isa::Scalar) {
        for dtype in DIRECT {
            for (seed, (n, k, m)) in shapes(dtype).into_iter().enumerate() {
                let c = Case::new(100 + seed as u64, dtype, n, k, m);
                let (ys, yv) = (c.run(Isa::Scalar), c.run(isa));
                let wf = quant::dequantize_to_vec(dtype, &c.w).expect("dequantize");
                let (xq, _) = seen_activations(dtype, &c.x, k);
                for i in 0..m {
                    for r in 0..n {
                        let (a, b) = (ys[i * n + r], yv[i * n + r]);
                        if is_bit_exact(dtype) {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{} {dtype:?} [{i},{r}]: {a} vs {b}",
                                isa.name()
                            );
                            continue;
                        }
                        let mag: f64 = (0..k)
                            .map(|j| (f64::from(wf[r * k + j]) * f64::from(xq[i * k + j])).abs())
                            .sum();
                        let e = (f64::from(a) - f64::from(b)).abs();
                        assert!(
                            e <= 2e-5 * mag,
                            "{} {dtype:?} n{n} k{k} m{m} [{i},{r}]: scalar {a} vs {b}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

/// The tolerance is tight enough to notice one wrong 4-bit code among 1024 values.
#[test]
fn the_bound_catches_a_single_flipped_code() {
    for dtype in [DType::Q4_0, DType::Q4_K] {
        let c = Case::new(7, dtype, 4, 1024, 1);
        let mut y = c.run(Isa::detect());
        // Pretend the kernel misread one code: recompute output 2 with one nibble changed.
        let mut bad = c.w.clone();
        let at = 2 * bad.len() / 4 + dtype.block_bytes() / 2 + 20;
        bad[at] ^= 0x04;
        let cb = Case {
            w: bad,
            ..Case::new(7, dtype, 4, 1024, 1)
        };
        let yb = cb.run(Isa::detect());
        y[2] = yb[2];
        let r = std::panic::catch_unwind(|| c.check(&y, "flipped"));
        assert!(r.is_err(), "{dtype:?}: a flipped code went unnoticed");
    }
}

#[test]
fn bad_shapes_are_errors_naming_the_op() {
    let kern = CpuKernels::new(1).expect("kernels");
    let w = vec![0u8; 18 * 4];
    let x = vec![0f32; 64];
    let mut y = vec![0f32; 2];
    // 4 blocks = 128 values as [2, 64]: fine.
    kern.matmul(&view(DType::Q4_0, 2, 64, &w), &x, 1, &mut y)
        .expect("ok");
    for (n, k, m, ylen) in [(2, 60, 1, 2), (4, 64, 1, 4), (2, 64, 2, 2), (2, 64, 1, 3)] {
        let mut y = vec![0f32; ylen];
        let xs = vec![0f32; 64 * m.max(1)];
        let e = kern
            .matmul(
                &view(DType::Q4_0, n, k, &w),
                &xs[..64.min(xs.len())],
                m,
                &mut y,
            )
            .expect_err("bad shape accepted");
        assert!(e.message.contains("matmul"), "{}", e.message);
    }
}

/// A row's result does not depend on its batch neighbours: every output of a many-row product
/// equals, bit for bit, the same weight row against the same activation row computed alone
/// (one activation row, one weight row), on every ISA and dtype. Batched decoding relies on it,
/// and so does the tile path's padding of a last partial group of eight rows.
#[test]
fn a_rows_result_does_not_depend_on_its_neighbours() {
    for isa in Isa::available() {
        let kern = CpuKernels::with_isa(isa, 2).expect("isa");
        for dtype in DIRECT {
            // Float rows of 100 values: vector steps and a scalar tail (prefill reads the
            // vector steps from a converted f32 panel, one row alone from the row itself).
            let k = match dtype.block_size() {
                256 => 512,
                1 => 100,
                _ => 96,
            };
            let (n, m) = (13, 11);
            let c = Case::new(90, dtype, n, k, m);
            let all = c.run(isa);
            let rb = c.w.len() / n;
            for r in [0, 5, 7, 8, 12] {
                let row = &c.w[r * rb..(r + 1) * rb];
                for i in [0, 3, 8, 10] {
                    let mut y = [f32::NAN];
                    kern.matmul(&view(dtype, 1, k, row), &c.x[i * k..(i + 1) * k], 1, &mut y)
                        .expect("matmul");
                    assert_eq!(
                        y[0].to_bits(),
                        all[i * n + r].to_bits(),
                        "{} {dtype:?} [{i},{r}]: alone {} vs in the batch {}",
                        isa.name(),
                        y[0],
                        all[i * n + r]
                    );
                }
            }
        }
    }
}
