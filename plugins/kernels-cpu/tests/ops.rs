//! Norms, RoPE, activations, softmax and embedding against f64 formulas and `u_sdk::quant`.

use u_kernels_cpu::testutil::{Rng, random_weight};
use u_kernels_cpu::{CpuKernels, Isa};
use u_sdk::abi_stable::std_types::{RSlice, RVec};
use u_sdk::{Activation, DType, RopeParams, RopeStyle, TensorView, quant};

fn all() -> Vec<CpuKernels> {
    Isa::available()
        .into_iter()
        .map(|i| CpuKernels::with_isa(i, 2).expect("isa"))
        .collect()
}

fn close(a: &[f32], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (f64::from(*x) - y).abs() <= tol * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

#[test]
fn rms_and_layer_norm() {
    let mut rng = Rng::new(3);
    for kern in all() {
        for (rows, dim) in [(1, 7), (3, 64), (5, 1000), (70, 1024)] {
            let x = rng.vec(rows * dim, 3.0);
            let w = rng.vec(dim, 1.0);
            let b = rng.vec(dim, 1.0);
            let mut y = vec![0f32; x.len()];
            kern.rms_norm(&x, &w, 1e-5, &mut y).expect("rms");
            let mut want = Vec::new();
            for r in x.chunks(dim) {
                let ms: f64 =
                    r.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / dim as f64;
                let s = 1.0 / (ms + 1e-5).sqrt();
                want.extend(
                    r.iter()
                        .zip(&w)
                        .map(|(&v, &g)| f64::from(v) * s * f64::from(g)),
                );
            }
            close(&y, &want, 1e-5, "rms_norm");
            kern.layer_norm(&x, &w, &b, 1e-5, &mut y).expect("ln");
            let mut want = Vec::new();
            for r in x.chunks(dim) {
                let mean: f64 = r.iter().map(|&v| f64::from(v)).sum::<f64>() / dim as f64;
                let var: f64 = r
                    .iter()
                    .map(|&v| (f64::from(v) - mean).powi(2))
                    .sum::<f64>()
                    / dim as f64;
                let s = 1.0 / (var + 1e-5).sqrt();
                want.extend(r.iter().zip(&w).zip(&b).map(|((&v, &g), &bb)| {
                    (f64::from(v) - mean) * s * f64::from(g) + f64::from(bb)
                }));
            }
            close(&y, &want, 1e-5, "layer_norm");
        }
        let mut y = vec![0f32; 10];
        let e = kern
            .rms_norm(&[0.0; 10], &[1.0; 3], 1e-5, &mut y)
            .expect_err("10 % 3");
        assert!(e.message.contains("rms_norm"));
    }
}

fn rope_params(style: RopeStyle, rd: usize, hd: usize, heads: usize) -> RopeParams {
    let inv: Vec<f32> = (0..rd / 2)
        .map(|i| 10000f32.powf(-((2 * i) as f32) / rd as f32))
        .collect();
    RopeParams {
        style,
        rotary_dim: rd as u32,
        head_dim: hd as u32,
        heads: heads as u32,
        inv_freq: RVec::from(inv),
        attn_factor: 1.0,
    }
}

#[test]
fn rope_normal_and_neox_match_the_formula() {
    let mut rng = Rng::new(5);
    let kern = CpuKernels::new(1).expect("kernels");
    for style in [RopeStyle::Normal, RopeStyle::NeoX] {
        for (rd, hd, heads) in [(8, 8, 2), (16, 24, 3), (64, 64, 1)] {
            let p = rope_params(style, rd, hd, heads);
            let positions = [0u32, 1, 7, 300];
            let x = rng.vec(positions.len() * heads * hd, 1.0);
            let mut y = x.clone();
            kern.rope(&mut y, &positions, &p).expect("rope");
            let mut want: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
            for (t, &pos) in positions.iter().enumerate() {
                for h in 0..heads {
                    let base = (t * heads + h) * hd;
                    for i in 0..rd / 2 {
                        let (a, b) = match style {
                            RopeStyle::Normal => (2 * i, 2 * i + 1),
                            RopeStyle::NeoX => (i, i + rd / 2),
                        };
                        let th = f64::from(pos) * f64::from(p.inv_freq[i]);
                        let (x0, x1) = (f64::from(x[base + a]), f64::from(x[base + b]));
                        want[base + a] = x0 * th.cos() - x1 * th.sin();
                        want[base + b] = x0 * th.sin() + x1 * th.cos();
                    }
                }
            }
            // Position 300 in f32: θ is rounded to ~2e-5 absolute before cos/sin.
            close(&y, &want, 1e-4, &format!("{style:?} rope"));
            // Position 0 is the identity.
            assert_eq!(&y[..heads * hd], &x[..heads * hd]);
        }
    }
    let p = rope_params(RopeStyle::Normal, 8, 8, 2);
    assert!(kern.rope(&mut [0.0; 15], &[0], &p).is_err());
}

#[test]
fn activations_and_softmax() {
    let kern = CpuKernels::new(2).expect("kernels");
    // erf at known points (Abramowitz & Stegun table).
    for (x, e) in [
        (0.5, 0.520_499_877_8),
        (1.0, 0.842_700_792_9),
        (2.0, 0.995_322_265_0),
        (-1.5, -0.966_105_146_5),
    ] {
        assert!((u_kernels_cpu::ops::erf(x) - e).abs() < 2e-7, "erf({x})");
    }
    let mut rng = Rng::new(9);
    let x = rng.vec(40_000, 6.0);
    for act in [
        Activation::Silu,
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::Sigmoid,
        Activation::Relu,
        Activation::Tanh,
        Activation::Step,
    ] {
        let mut y = x.clone();
        kern.activation(&mut y, act).expect("act");
        let want: Vec<f64> = x
            .iter()
            .map(|&v| {
                let v = f64::from(v);
                match act {
                    Activation::Silu => v / (1.0 + (-v).exp()),
                    Activation::GeluTanh => {
                        0.5 * v
                            * (1.0
                                + ((2.0 / std::f64::consts::PI).sqrt()
                                    * (v + 0.044715 * v.powi(3)))
                                .tanh())
                    }
                    Activation::GeluErf => {
                        0.5 * v * (1.0 + u_kernels_cpu::ops::erf(v / std::f64::consts::SQRT_2))
                    }
                    Activation::Sigmoid => 1.0 / (1.0 + (-v).exp()),
                    Activation::Relu => v.max(0.0),
                    Activation::Tanh => v.tanh(),
                    Activation::Step => f64::from(u8::from(v > 0.0)),
                }
            })
            .collect();
        close(&y, &want, 1e-5, &format!("{act:?}"));
    }
    let mut s = rng.vec(3 * 37, 20.0);
    let x = s.clone();
    kern.softmax(&mut s, 37).expect("softmax");
    for (r, xr) in s.chunks(37).zip(x.chunks(37)) {
        let m = xr.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f64 = xr.iter().map(|&v| f64::from(v - m).exp()).sum();
        let want: Vec<f64> = xr.iter().map(|&v| f64::from(v - m).exp() / z).collect();
        close(r, &want, 1e-6, "softmax");
    }
    assert!(kern.softmax(&mut [0.0; 10], 3).is_err());
}

#[test]
fn embedding_rows_of_every_dtype() {
    let mut rng = Rng::new(11);
    let kern = CpuKernels::new(1).expect("kernels");
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_K,
        DType::Q6_K,
        DType::Q3_K,
        DType::TQ1_0,
    ] {
        let (vocab, dim) = (13, 512);
        let data = random_weight(&mut rng, dtype, vocab, dim);
        let table = TensorView {
            dtype,
            shape: RVec::from(vec![vocab as u64, dim as u64]),
            data: RSlice::from_slice(&data),
        };
        let all = quant::dequantize_view(&table).expect("dequantize");
        let ids = [0u32, 12, 5, 5];
        let mut out = vec![0f32; ids.len() * dim];
        kern.embedding(&table, &ids, &mut out).expect("embedding");
        for (&id, row) in ids.iter().zip(out.chunks(dim)) {
            let want = &all[id as usize * dim..][..dim];
            assert!(
                row.iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{dtype:?} row {id}"
            );
        }
        let e = kern
            .embedding(&table, &[13], &mut out[..dim])
            .expect_err("id past vocab");
        assert!(
            e.message.contains("embedding") && e.message.contains("13"),
            "{}",
            e.message
        );
    }
}

/// Keeps nothing alive: the test's bytes are `'static`.
struct Nothing;

impl u_sdk::Keepalive for Nothing {
    fn describe(&self) -> abi_stable::std_types::RString {
        "static test bytes".into()
    }
}

#[test]
fn the_abi_object_reports_the_isa_and_catches_errors() {
    let kern = CpuKernels::new(2).expect("kernels");
    let isa = kern.isa();
    let boxed = kern.into_box();
    let info = boxed.info().unwrap();
    assert_eq!(info.isa.as_str(), isa.name());
    assert_eq!(info.threads, 2);
    assert!(boxed.supports(u_sdk::OpKind::MatMul, DType::Q4_K).unwrap());
    assert!(
        !boxed
            .supports(u_sdk::OpKind::Attention, DType::Q4_0)
            .unwrap()
    );
    static W: [u8; 4] = [0; 4];
    let weight = u_sdk::TensorDesc {
        buffer: boxed
            .import(RSlice::from_slice(&W), u_sdk::KeepaliveBox::new(Nothing))
            .unwrap(),
        offset: 0,
        dtype: DType::F32,
        shape: u_sdk::Shape::new(&[1, 2]),
    };
    let dev = u_sdk::nn::Device::new(boxed).unwrap();
    let x = dev.from_f32(&[1.0, 2.0], &[1, 2]).unwrap();
    let r = x.matmul_t(&dev.tensor(weight));
    assert!(
        r.is_err(),
        "4 bytes for a [1, 2] f32 weight must be refused"
    );
}
