//! Every op of the wgpu backend against the CPU backend, in the style of ggml's
//! `test-backend-ops`: the same inputs through both, the normalised mean squared error
//! `Σ(gpu − cpu)² / Σ cpu²` of the outputs printed per case and held under a bound per op.
//!
//! Without a GPU this runs on Mesa's lavapipe (Debian `mesa-vulkan-drivers`, which `cargo
//! xtask test` installs); `U_WGPU_ADAPTER` picks another adapter by name.
//!
//! Bounds: 1e-10 for matmul (both quantize activations to the same int8 codes for block
//! formats, so only the order of f32 sums differs), 1e-9 where the GPU's own `exp`, `sin`,
//! `cos` and `tanh` enter, 1e-12 or exact for the rest.

use abi_stable::std_types::RSlice;
use std::sync::{Arc, OnceLock};
use u_kernels_wgpu::{Gpu, WgpuBackend, shaders::BLOCK_FORMATS};
use u_sdk::{
    Activation, AttentionMask, AttentionParams, BackendBox, DType, ErrorKind, Keepalive,
    KeepaliveBox, Op, RopeParams, RopeStyle, Shape, TensorDesc,
    nn::{Device, Tensor},
};

/// The two devices: the CPU plugin's and the GPU plugin's.
struct Pair {
    cpu: Device,
    gpu: Device,
}

fn pair() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        let cpu = u_kernels_cpu::CpuKernels::new(2)
            .expect("CPU kernels")
            .into_box();
        let adapter = std::env::var("U_WGPU_ADAPTER").ok();
        let gpu = Gpu::open(adapter.as_deref(), None).unwrap_or_else(|e| {
            panic!(
                "no GPU adapter ({}); without a GPU install Mesa's lavapipe: apt-get install \
                 mesa-vulkan-drivers",
                e.message
            )
        });
        eprintln!(
            "GPU adapter: {} ({:?})",
            gpu.adapter.name, gpu.adapter.backend
        );
        let gpu = BackendBox::new(WgpuBackend::new(Arc::new(gpu)));
        Pair {
            cpu: Device::new(cpu).unwrap(),
            gpu: Device::new(gpu).unwrap(),
        }
    })
}

/// Reproducible values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn nmse(gpu: &[f32], cpu: &[f32]) -> f64 {
    assert_eq!(gpu.len(), cpu.len(), "output lengths");
    let err: f64 = gpu
        .iter()
        .zip(cpu)
        .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
        .sum();
    let norm: f64 = cpu.iter().map(|&b| f64::from(b).powi(2)).sum();
    err / norm.max(1e-30)
}

/// Runs `case` on both devices and checks the outputs' error.
fn check(name: &str, bound: f64, case: impl Fn(&Device) -> u_sdk::Result<Tensor>) {
    let p = pair();
    let cpu = case(&p.cpu)
        .and_then(|t| t.to_vec())
        .unwrap_or_else(|e| panic!("{name} on the CPU: {e}"));
    let gpu = case(&p.gpu)
        .and_then(|t| t.to_vec())
        .unwrap_or_else(|e| panic!("{name} on the GPU: {e}"));
    let e = nmse(&gpu, &cpu);
    let state = if e <= bound { "OK" } else { "FAIL" };
    eprintln!("{name:<56} nmse {e:.3e} (bound {bound:.0e}) {state}");
    assert!(
        gpu.iter().all(|v| v.is_finite()) == cpu.iter().all(|v| v.is_finite()),
        "{name}: non-finite values"
    );
    assert!(e <= bound, "{name}: nmse {e:.3e} over {bound:.0e}");
}

/// Bytes a weight import keeps alive (the CPU backend uses them in place).
struct Bytes(#[allow(dead_code)] Arc<Vec<u8>>);

impl Keepalive for Bytes {
    fn describe(&self) -> abi_stable::std_types::RString {
        "test weight".into()
    }
}

/// `data` (`[rows, k]`) quantized to `dtype` by the CPU backend's reference quantizers, the
/// bytes returned.
fn quantized(data: &[f32], rows: u64, k: u64, dtype: DType) -> Vec<u8> {
    let cpu = &pair().cpu;
    let x = cpu.from_f32(data, &[rows, k]).unwrap();
    let q = cpu.alloc(dtype, &[rows, k]).unwrap();
    x.copy_into(None, &q).unwrap();
    let mut bytes = vec![0u8; q.desc().byte_len().unwrap() as usize];
    q.desc()
        .buffer
        .read(
            0,
            abi_stable::std_types::RSliceMut::from_mut_slice(&mut bytes),
        )
        .into_result()
        .unwrap();
    bytes
}

/// A weight of `dtype` holding `bytes`, imported as a loader's weights are.
fn weight(dev: &Device, bytes: &Arc<Vec<u8>>, dtype: DType, dims: &[u64]) -> Tensor {
    let owner = KeepaliveBox::new(Bytes(bytes.clone()));
    let buffer = dev
        .backend()
        .import(RSlice::from_slice(bytes), owner)
        .into_result()
        .unwrap();
    dev.tensor(TensorDesc {
        buffer,
        offset: 0,
        dtype,
        shape: Shape::new(dims),
    })
}

/// Every weight format the plugin reads in place.
const WEIGHT_FORMATS: [DType; 7] = BLOCK_FORMATS;

#[test]
fn matmul_on_every_weight_format() {
    for dtype in WEIGHT_FORMATS {
        // Against exact arithmetic: floats to f32 rounding, block formats within the error of
        // their int8 activations (ggml's bound for MUL_MAT).
        let exact_bound = if matches!(dtype, DType::F32 | DType::F16) {
            1e-10
        } else {
            5e-4
        };
        let shapes: &[(u64, u64, u64)] = match dtype {
            DType::F32 | DType::F16 => &[(1, 67, 256), (5, 33, 512), (17, 40, 256), (3, 20, 100)],
            _ => &[(1, 67, 256), (5, 33, 512), (17, 40, 256)],
        };
        for &(m, n, k) in shapes {
            let w = Arc::new(quantized(&values((n * k) as usize, 1), n, k, dtype));
            let x = values((m * k) as usize, 2);
            check(
                &format!("MUL_MAT {dtype:?} m={m} n={n} k={k}"),
                1e-10,
                |dev| {
                    let w = weight(dev, &w, dtype, &[n, k]);
                    dev.from_f32(&x, &[m, k])?.matmul_t(&w)
                },
            );
            // The GPU against exact arithmetic on the same dequantized weights.
            let gpu = &pair().gpu;
            let wt = weight(gpu, &w, dtype, &[n, k]);
            let out = gpu.from_f32(&x, &[m, k]).unwrap().matmul_t(&wt).unwrap();
            let dense = gpu.alloc(DType::F32, &[n, k]).unwrap();
            wt.copy_into(None, &dense).unwrap();
            let dense = dense.to_vec().unwrap();
            let exact: Vec<f32> = (0..(m * n) as usize)
                .map(|i| {
                    let (r, c) = (i / n as usize, i % n as usize);
                    let xr = &x[r * k as usize..][..k as usize];
                    let wr = &dense[c * k as usize..][..k as usize];
                    xr.iter()
                        .zip(wr)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>() as f32
                })
                .collect();
            let e = nmse(&out.to_vec().unwrap(), &exact);
            eprintln!(
                "MUL_MAT {dtype:?} m={m} n={n} k={k} against f64 on its own blocks: nmse {e:.3e}"
            );
            assert!(
                e < exact_bound,
                "{dtype:?} m={m} n={n} k={k}: nmse {e:.3e} against f64"
            );
        }
    }
}

#[test]
fn matmul_past_one_dimension_of_workgroups() {
    let (m, n, k) = (2u64, 70_000u64, 32u64);
    let w = Arc::new(quantized(&values((n * k) as usize, 3), n, k, DType::Q8_0));
    let x = values((m * k) as usize, 4);
    check(
        "MUL_MAT Q8_0 n=70000 (two-dimensional grid)",
        1e-10,
        |dev| {
            let w = weight(dev, &w, DType::Q8_0, &[n, k]);
            dev.from_f32(&x, &[m, k])?.matmul_t(&w)
        },
    );
}

#[test]
fn rows_of_every_table_format() {
    let (rows, k) = (50u64, 256u64);
    for dtype in WEIGHT_FORMATS {
        let table = Arc::new(quantized(&values((rows * k) as usize, 5), rows, k, dtype));
        check(&format!("GET_ROWS {dtype:?}"), 1e-12, |dev| {
            let t = weight(dev, &table, dtype, &[rows, k]);
            t.get_rows(&dev.from_i32(&[3, 0, 49, 7, 7], &[5])?)
        });
        check(&format!("CPY {dtype:?} -> F32"), 1e-12, |dev| {
            let t = weight(dev, &table, dtype, &[rows, k]);
            let out = dev.alloc(DType::F32, &[rows, k])?;
            t.copy_into(None, &out)?;
            Ok(out)
        });
    }
}

#[test]
fn f32_to_f16_and_back() {
    let x = values(1000, 6);
    check("CPY F32 -> F16 -> F32", 1e-12, |dev| {
        let half = dev.alloc(DType::F16, &[10, 100])?;
        dev.from_f32(&x, &[10, 100])?.copy_into(None, &half)?;
        let back = dev.alloc(DType::F32, &[10, 100])?;
        half.copy_into(None, &back)?;
        Ok(back)
    });
}

#[test]
fn elementwise_ops_and_activations() {
    let (a, b, row) = (values(3000, 7), values(3000, 8), values(300, 9));
    let dims = [10u64, 300];
    check("ADD", 1e-12, |d| {
        d.from_f32(&a, &dims)?.add(&d.from_f32(&b, &dims)?)
    });
    check("ADD (one row, broadcast)", 1e-12, |d| {
        d.from_f32(&a, &dims)?.add(&d.from_f32(&row, &[300])?)
    });
    check("MUL", 1e-12, |d| {
        d.from_f32(&a, &dims)?.mul(&d.from_f32(&b, &dims)?)
    });
    check("SCALE", 1e-12, |d| d.from_f32(&a, &dims)?.scale(0.37));
    check("ADD_SCALED (in place)", 1e-12, |d| {
        let x = d.from_f32(&a, &dims)?;
        x.add_scaled_assign(&d.from_f32(&row, &[300])?, -1.5)?;
        Ok(x)
    });
    check("CLAMP (in place)", 1e-12, |d| {
        let x = d.from_f32(&a, &dims)?;
        x.clamp_assign(-0.25, 0.5)?;
        Ok(x)
    });
    check("ADD (in place)", 1e-12, |d| {
        let x = d.from_f32(&a, &dims)?;
        x.add_assign(&d.from_f32(&b, &dims)?)?;
        Ok(x)
    });
    let wide: Vec<f32> = a.iter().map(|v| v * 6.0).collect();
    for act in [
        Activation::Silu,
        Activation::GeluTanh,
        Activation::GeluErf,
        Activation::Sigmoid,
        Activation::Relu,
        Activation::Tanh,
        Activation::Step,
    ] {
        check(&format!("UNARY {act:?}"), 1e-9, |d| {
            d.from_f32(&wide, &dims)?.activation(act)
        });
        check(&format!("GLU {act:?}"), 1e-9, |d| {
            d.from_f32(&wide, &dims)?
                .gated(act, &d.from_f32(&b, &dims)?)
        });
    }
}

#[test]
fn norms_and_softmax() {
    let (x, w, b) = (values(7 * 576, 10), values(576, 11), values(576, 12));
    check("RMS_NORM", 1e-10, |d| {
        d.from_f32(&x, &[7, 576])?
            .rms_norm(&d.from_f32(&w, &[576])?, 1e-5)
    });
    check("NORM (LayerNorm)", 1e-10, |d| {
        d.from_f32(&x, &[7, 576])?.layer_norm(
            &d.from_f32(&w, &[576])?,
            &d.from_f32(&b, &[576])?,
            1e-6,
        )
    });
    let logits: Vec<f32> = x.iter().map(|v| v * 20.0).collect();
    check("SOFT_MAX (in place)", 1e-10, |d| {
        let t = d.from_f32(&logits, &[7, 576])?;
        t.softmax_assign()?;
        Ok(t)
    });
    check("SOFT_MAX (into another tensor)", 1e-10, |d| {
        let t = d.from_f32(&logits, &[7, 576])?;
        d.compute(Op::Softmax, &[&t], DType::F32, &[7, 576])
    });
}

#[test]
fn rope_in_both_styles_far_out() {
    let (tokens, heads, head_dim) = (5u64, 3u32, 64u32);
    let x = values((tokens * u64::from(heads * head_dim)) as usize, 13);
    let positions = [0, 1, 4095, 50_000, 131_071];
    for (style, rotary_dim) in [(RopeStyle::Normal, 64u32), (RopeStyle::NeoX, 32)] {
        let half = rotary_dim / 2;
        let params = RopeParams {
            style,
            rotary_dim,
            head_dim,
            heads,
            inv_freq: (0..half)
                .map(|i| 10_000f32.powf(-(2.0 * i as f32) / rotary_dim as f32))
                .collect(),
            attn_factor: 1.0,
        };
        check(
            &format!("ROPE {style:?} rotary {rotary_dim}/{head_dim}"),
            1e-9,
            |d| {
                let t = d.from_f32(&x, &[tokens, u64::from(heads * head_dim)])?;
                t.rope_assign(&d.from_i32(&positions, &[tokens])?, &params)?;
                Ok(t)
            },
        );
    }
}

/// KV of `tokens` rows per span on `dev`, as F32 or F16 tensors.
fn kv_spans(dev: &Device, spans: &[(Vec<f32>, Vec<f32>)], row: u64, dtype: DType) -> Vec<Tensor> {
    let mut out = Vec::new();
    for (k, v) in spans {
        for data in [k, v] {
            let t = dev.from_f32(data, &[data.len() as u64 / row, row]).unwrap();
            if dtype == DType::F16 {
                let h = dev.alloc(DType::F16, t.dims()).unwrap();
                t.copy_into(None, &h).unwrap();
                out.push(h);
            } else {
                out.push(t);
            }
        }
    }
    out
}

#[test]
fn flash_attention_cases() {
    let head_dim = 64u32;
    struct Case {
        name: &'static str,
        heads: u32,
        kv_heads: u32,
        queries: u64,
        spans: &'static [u64],
        first: u32,
        window: u32,
        softcap: f32,
        mask: AttentionMask,
    }
    let cases = [
        Case {
            name: "decode, GQA 4:1",
            heads: 8,
            kv_heads: 2,
            queries: 1,
            spans: &[37],
            first: 36,
            window: 0,
            softcap: 0.0,
            mask: AttentionMask::Causal,
        },
        Case {
            name: "prefill, causal",
            heads: 4,
            kv_heads: 4,
            queries: 9,
            spans: &[9],
            first: 0,
            window: 0,
            softcap: 0.0,
            mask: AttentionMask::Causal,
        },
        Case {
            name: "prefill after a prefix, three spans",
            heads: 4,
            kv_heads: 2,
            queries: 5,
            spans: &[64, 64, 13],
            first: 136,
            window: 0,
            softcap: 0.0,
            mask: AttentionMask::Causal,
        },
        Case {
            name: "sliding window 16, soft-cap 30",
            heads: 4,
            kv_heads: 1,
            queries: 3,
            spans: &[100],
            first: 97,
            window: 16,
            softcap: 30.0,
            mask: AttentionMask::Causal,
        },
        Case {
            name: "bidirectional",
            heads: 2,
            kv_heads: 2,
            queries: 6,
            spans: &[11],
            first: 0,
            window: 0,
            softcap: 0.0,
            mask: AttentionMask::Bidirectional,
        },
    ];
    for c in &cases {
        for dtype in [DType::F32, DType::F16] {
            let row = u64::from(c.kv_heads * head_dim);
            let q = values((c.queries * u64::from(c.heads * head_dim)) as usize, 14);
            let spans: Vec<(Vec<f32>, Vec<f32>)> = c
                .spans
                .iter()
                .enumerate()
                .map(|(i, &t)| {
                    (
                        values((t * row) as usize, 20 + i as u64),
                        values((t * row) as usize, 40 + i as u64),
                    )
                })
                .collect();
            let params = AttentionParams {
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim,
                first_query_pos: c.first,
                window: c.window,
                scale: 1.0 / (head_dim as f32).sqrt(),
                softcap: c.softcap,
                mask: c.mask,
                kv_dtype: dtype,
            };
            check(
                &format!("FLASH_ATTN_EXT {} KV {dtype:?}", c.name),
                1e-9,
                |d| {
                    let kv = kv_spans(d, &spans, row, dtype);
                    let descs: Vec<&TensorDesc> = kv.iter().map(Tensor::desc).collect();
                    d.from_f32(&q, &[c.queries, u64::from(c.heads * head_dim)])?
                        .attention(&descs, &params)
                },
            );
        }
    }
}

/// KV in host memory (a cache's pages are) is read by the GPU backend for the op.
#[test]
fn attention_over_host_kv_pages() {
    let p = pair();
    let (heads, head_dim, tokens) = (2u32, 32u32, 20u64);
    let row = u64::from(heads * head_dim);
    let (q, k, v) = (
        values(row as usize, 50),
        values((tokens * row) as usize, 51),
        values((tokens * row) as usize, 52),
    );
    let params = AttentionParams {
        heads,
        kv_heads: heads,
        head_dim,
        first_query_pos: tokens as u32 - 1,
        window: 0,
        scale: 0.2,
        softcap: 0.0,
        mask: AttentionMask::Causal,
        kv_dtype: DType::F32,
    };
    let host_k = p.cpu.from_f32(&k, &[tokens, row]).unwrap();
    let host_v = p.cpu.from_f32(&v, &[tokens, row]).unwrap();
    check("FLASH_ATTN_EXT over host-memory KV", 1e-9, |d| {
        d.from_f32(&q, &[1, row])?
            .attention(&[host_k.desc(), host_v.desc()], &params)
    });
}

#[test]
fn convolution_group_norm_upsampling() {
    let (c_in, h, w, c_out) = (3u64, 9u64, 11u64, 4u64);
    let x = values((c_in * h * w) as usize, 60);
    let kernel = values((c_out * c_in * 9) as usize, 61);
    let bias = values(c_out as usize, 62);
    for (stride, padding) in [(1u32, [1u32, 1u32]), (2, [0, 1])] {
        check(
            &format!("CONV_2D 3x3 stride {stride} padding {padding:?}"),
            1e-10,
            |d| {
                d.from_f32(&x, &[c_in, h, w])?.conv2d(
                    &d.from_f32(&kernel, &[c_out, c_in, 3, 3])?,
                    Some(&d.from_f32(&bias, &[c_out])?),
                    stride,
                    padding,
                )
            },
        );
    }
    check("CONV_2D 3x3 F16 weights, no bias", 1e-10, |d| {
        let w32 = d.from_f32(&kernel, &[c_out, c_in, 3, 3])?;
        let w16 = d.alloc(DType::F16, w32.dims())?;
        w32.copy_into(None, &w16)?;
        d.from_f32(&x, &[c_in, h, w])?.conv2d(&w16, None, 1, [1, 1])
    });
    let signal = values(3 * 40, 63);
    let k1 = values(5 * 3 * 3, 64);
    check("CONV_1D k=3 stride 2 padding 1", 1e-10, |d| {
        let out_len = (40 + 2 - 3) / 2 + 1;
        d.compute(
            Op::Conv1d {
                stride: 2,
                padding: 1,
            },
            &[
                &d.from_f32(&signal, &[3, 40])?,
                &d.from_f32(&k1, &[5, 3, 3])?,
            ],
            DType::F32,
            &[5, out_len],
        )
    });
    let maps = values(8 * 6 * 5, 65);
    let (gw, gb) = (values(8, 66), values(8, 67));
    check("GROUP_NORM 8 channels in 4 groups", 1e-10, |d| {
        d.from_f32(&maps, &[8, 6, 5])?.group_norm(
            &d.from_f32(&gw, &[8])?,
            &d.from_f32(&gb, &[8])?,
            4,
            1e-6,
        )
    });
    check("UPSCALE nearest x2", 0.0, |d| {
        d.from_f32(&maps, &[8, 6, 5])?.upsample(2)
    });
}

#[test]
fn missing_ops_and_bad_shapes_are_errors() {
    let gpu = &pair().gpu;
    let x = gpu.from_f32(&values(40, 70), &[4, 10]).unwrap();
    let e = x.top_k(2).expect_err("top-k is not on the GPU");
    assert_eq!(e.kind, ErrorKind::Unsupported, "{}", e.message);
    assert!(
        !gpu.backend()
            .supports(u_sdk::OpKind::TopK, DType::F32)
            .into_result()
            .unwrap()
    );
    let w = gpu.from_f32(&values(30, 71), &[3, 10]).unwrap();
    let bad = gpu.alloc(DType::F32, &[4, 4]).unwrap();
    let e = gpu
        .run(Op::MatMul, &[&x, &w], &bad)
        .expect_err("a destination of the wrong size");
    assert_eq!(e.kind, ErrorKind::InvalidInput, "{}", e.message);
    let imported = weight(gpu, &Arc::new(vec![0u8; 64]), DType::F32, &[16]);
    let e = imported
        .write(&[1.0; 16])
        .expect_err("weights are read-only");
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{}", e.message);
}

#[test]
fn buffers_read_and_write_at_any_offset() {
    let gpu = &pair().gpu;
    let buffer = gpu.backend().alloc(10).into_result().unwrap();
    buffer
        .write(0, RSlice::from_slice(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
        .into_result()
        .unwrap();
    buffer
        .write(3, RSlice::from_slice(&[30, 40, 50]))
        .into_result()
        .unwrap();
    let mut out = [0u8; 5];
    buffer
        .read(
            2,
            abi_stable::std_types::RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()
        .unwrap();
    assert_eq!(out, [3, 30, 40, 50, 7]);
    let e = buffer
        .read(
            8,
            abi_stable::std_types::RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()
        .expect_err("past the end");
    assert_eq!(e.kind, ErrorKind::InvalidInput);
}

/// Past its memory limit the backend refuses buffers as out of memory (what the host falls
/// back to the CPU on), and memory released counts again.
#[test]
fn a_memory_limit_refuses_uploads_past_it_and_frees_on_drop() {
    let adapter = std::env::var("U_WGPU_ADAPTER").ok();
    let gpu = Gpu::open(adapter.as_deref(), Some(1 << 20)).expect("the adapter opens");
    let dev = Device::new(BackendBox::new(WgpuBackend::new(Arc::new(gpu)))).unwrap();
    let big = Arc::new(vec![0u8; 700 << 10]);
    let first = weight(&dev, &big, DType::F32, &[700 << 8]);
    let owner = KeepaliveBox::new(Bytes(big.clone()));
    let Err(e) = dev
        .backend()
        .import(RSlice::from_slice(&big), owner)
        .into_result()
    else {
        panic!("an upload over the limit was accepted");
    };
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{}", e.message);
    assert!(e.message.contains("memory_limit_mb"), "{}", e.message);
    drop(first);
    let again = weight(&dev, &big, DType::F32, &[700 << 8]);
    assert_eq!(again.dims(), &[700 << 8]);
}
