//! Flash attention against a naive `softmax(q·kᵀ·scale + mask)·v` in f64 (also with Gemma 2's
//! soft cap on the scores), on every ISA, and
//! against PyTorch `scaled_dot_product_attention` fixtures (`tests/fixtures/gen_attention.py`).
//! Tolerance: 1e-5 absolute on outputs of magnitude ≤ 1 (values are convex combinations of
//! |v| ≤ 1 for the random cases; the fixtures' v are standard normal, |out| < 3). Every case
//! also runs with the keys and values split into spans (KV-cache pages of 64 positions, and
//! uneven ones that tiles straddle), which must give the same output bit for bit.

use u_kernels_cpu::attention::{KvSpan, Params as AttentionParams};
use u_kernels_cpu::testutil::{Rng, f32_to_f16};
use u_kernels_cpu::{CpuKernels, Isa};
use u_sdk::DType;
use u_sdk::quant::f16_to_f32;

#[derive(Clone, Debug)]
struct Shape {
    heads: usize,
    kv_heads: usize,
    d: usize,
    nq: usize,
    nk: usize,
    first: usize,
    window: usize,
    dtype: DType,
}

fn params(s: &Shape, scale: f32) -> AttentionParams {
    AttentionParams {
        heads: s.heads as u32,
        kv_heads: s.kv_heads as u32,
        head_dim: s.d as u32,
        queries: s.nq as u32,
        kv_len: s.nk as u32,
        first_query_pos: s.first as u32,
        window: s.window as u32,
        scale,
        softcap: 0.0,
        kv_dtype: s.dtype,
    }
}

/// Stores f32 values as `dtype` bytes and returns the values as stored.
fn store(vals: &[f32], dtype: DType) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        DType::F16 => {
            let bits: Vec<u16> = vals.iter().map(|&v| f32_to_f16(v)).collect();
            (
                bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
                bits.iter().map(|&b| f16_to_f32(b)).collect(),
            )
        }
        _ => (
            vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            vals.to_vec(),
        ),
    }
}

fn naive(s: &Shape, scale: f32, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
    naive_capped(s, scale, 0.0, q, k, v)
}

/// [`naive`] with the scores soft-capped, `c · tanh(s / c)` (`c` = 0: none).
fn naive_capped(s: &Shape, scale: f32, cap: f32, q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
    let (h, kvh, d) = (s.heads, s.kv_heads, s.d);
    let mut out = vec![0f32; s.nq * h * d];
    for i in 0..s.nq {
        let pos = s.first + i;
        for head in 0..h {
            let g = head / (h / kvh);
            let qr = &q[(i * h + head) * d..][..d];
            let visible: Vec<usize> = (0..s.nk)
                .filter(|&j| j <= pos && (s.window == 0 || j + s.window > pos))
                .collect();
            let scores: Vec<f64> = visible
                .iter()
                .map(|&j| {
                    let kr = &k[(j * kvh + g) * d..][..d];
                    let x = f64::from(scale)
                        * qr.iter()
                            .zip(kr)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>();
                    match f64::from(cap) {
                        0.0 => x,
                        c => c * (x / c).tanh(),
                    }
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..d {
                let acc: f64 = visible
                    .iter()
                    .zip(&e)
                    .map(|(&j, p)| p * f64::from(v[(j * kvh + g) * d + c]))
                    .sum();
                out[(i * h + head) * d + c] = if visible.is_empty() {
                    0.0
                } else {
                    (acc / z) as f32
                };
            }
        }
    }
    out
}

/// Output tolerance (absolute).
const TOL: f32 = 1e-5;

/// `kb`/`vb` cut into spans of `sizes` positions (cycled), the last one taking the rest.
fn spans<'a>(s: &Shape, kb: &'a [u8], vb: &'a [u8], sizes: &[usize]) -> Vec<KvSpan<'a>> {
    let row = kb.len() / s.nk.max(1);
    let mut out = Vec::new();
    let mut t = 0;
    for &n in sizes.iter().cycle() {
        let n = n.min(s.nk - t);
        let (a, b) = (t * row, (t + n) * row);
        out.push(KvSpan::bytes(n as u32, &kb[a..b], &vb[a..b]));
        t += n;
        if t == s.nk {
            break;
        }
    }
    out
}

fn check(kern: &CpuKernels, s: &Shape, q: &[f32], kb: &[u8], vb: &[u8], scale: f32, want: &[f32]) {
    let run = |kv: &[KvSpan<'_>]| {
        let mut out = vec![f32::NAN; want.len()];
        kern.attention(q, kv, &params(s, scale), &mut out)
            .unwrap_or_else(|e| panic!("{s:?}: {e}"));
        out
    };
    let whole = KvSpan::bytes(s.nk as u32, kb, vb);
    let out = run(&[whole]);
    for (i, (a, b)) in out.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= TOL,
            "{} {s:?}: out[{i}] = {a}, want {b}",
            kern.isa().name()
        );
    }
    if s.nk > 0 {
        for sizes in [&[64][..], &[7, 50, 0, 64, 1]] {
            let paged = run(&spans(s, kb, vb, sizes));
            assert!(
                paged
                    .iter()
                    .zip(&out)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} {s:?}: spans of {sizes:?} change the output",
                kern.isa().name()
            );
        }
    }
}

/// Gemma 2's attention soft cap, at caps small enough to bend most scores.
#[test]
fn soft_capped_scores_match_the_naive_reference_on_every_isa() {
    let mut rng = Rng::new(7);
    for case in 0..20 {
        let s = random_shape(&mut rng);
        let q = rng.vec(s.nq * s.heads * s.d, 2.0);
        let (kb, kf) = store(&rng.vec(s.nk * s.kv_heads * s.d, 1.0), s.dtype);
        let (vb, vf) = store(&rng.vec(s.nk * s.kv_heads * s.d, 1.0), s.dtype);
        let (scale, cap) = (1.0 / (s.d as f32).sqrt(), [0.3, 1.0, 5.0][case % 3]);
        let want = naive_capped(&s, scale, cap, &q, &kf, &vf);
        for isa in Isa::available() {
            let kern = CpuKernels::with_isa(isa, 2).expect("isa");
            let p = AttentionParams {
                softcap: cap,
                ..params(&s, scale)
            };
            let mut out = vec![f32::NAN; want.len()];
            kern.attention(&q, &[KvSpan::bytes(s.nk as u32, &kb, &vb)], &p, &mut out)
                .unwrap_or_else(|e| panic!("{s:?}: {e}"));
            for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= TOL,
                    "{} {s:?} cap {cap}: out[{i}] = {a}, want {b}",
                    isa.name()
                );
            }
        }
    }
}

fn random_shape(rng: &mut Rng) -> Shape {
    let kv_heads = [1, 2, 3, 4][rng.below(4)];
    let heads = kv_heads * [1, 2, 4][rng.below(3)];
    let d = [1, 7, 16, 33, 64, 128][rng.below(6)];
    let nq = 1 + rng.below(40);
    let first = rng.below(90);
    // Usually the cache ends at the last query; sometimes it is longer (clamped mask) or shorter.
    let nk = match rng.below(4) {
        0 => first + nq + rng.below(20),
        1 => (first + nq).saturating_sub(rng.below(10)).max(1),
        _ => first + nq,
    };
    let window = if rng.below(3) == 0 {
        1 + rng.below(30)
    } else {
        0
    };
    let dtype = if rng.below(2) == 0 {
        DType::F32
    } else {
        DType::F16
    };
    Shape {
        heads,
        kv_heads,
        d,
        nq,
        nk,
        first,
        window,
        dtype,
    }
}

#[test]
fn random_shapes_match_the_naive_reference_on_every_isa() {
    let mut rng = Rng::new(42);
    let kernels: Vec<CpuKernels> = Isa::available()
        .into_iter()
        .map(|i| CpuKernels::with_isa(i, 2).expect("isa"))
        .collect();
    for case in 0..60 {
        let s = random_shape(&mut rng);
        let q = rng.vec(s.nq * s.heads * s.d, 1.0);
        let (kb, kf) = store(&rng.vec(s.nk * s.kv_heads * s.d, 1.0), s.dtype);
        let (vb, vf) = store(&rng.vec(s.nk * s.kv_heads * s.d, 1.0), s.dtype);
        let scale = 1.0 / (s.d as f32).sqrt();
        let want = naive(&s, scale, &q, &kf, &vf);
        for kern in &kernels {
            check(kern, &s, &q, &kb, &vb, scale, &want);
            if case % 5 == 0 {
                // Misaligned bytes: the f32 KV path that converts tiles instead of reading in place.
                let mut kk = vec![0u8; kb.len() + 1];
                kk[1..].copy_from_slice(&kb);
                let mut vv = vec![0u8; vb.len() + 1];
                vv[1..].copy_from_slice(&vb);
                check(kern, &s, &q, &kk[1..], &vv[1..], scale, &want);
            }
        }
    }
}

/// Int8 KV spans (the cache's int8 pages: a scale per 32 values of a token's row) give the
/// output of f32 spans holding their dequantized values, bit for bit: the tile conversion is
/// `q × scale`, the cache's own dequantization. Pages of 64 and uneven spans, windows, every ISA.
#[test]
fn int8_spans_equal_their_dequantized_values() {
    let mut rng = Rng::new(8);
    let group = u_sdk::KV_INT8_GROUP as usize;
    for kern in Isa::available()
        .into_iter()
        .map(|i| CpuKernels::with_isa(i, 2).expect("isa"))
    {
        for (heads, kvh, d, nq, nk, window) in [
            (9, 3, 64, 1, 300, 0),
            (4, 2, 48, 5, 130, 0),
            (8, 8, 32, 17, 200, 70),
        ] {
            let s = Shape {
                heads,
                kv_heads: kvh,
                d,
                nq,
                nk,
                first: nk - nq,
                window,
                dtype: DType::I8,
            };
            let row = kvh * d;
            let groups = row.div_ceil(group);
            // Per token and group of 32: scale = max|x| / 127, q = round(x / scale).
            let quantize = |x: &[f32]| {
                let (mut q, mut sc) = (Vec::new(), Vec::new());
                for r in x.chunks_exact(row) {
                    for c in r.chunks(group) {
                        let s = c.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                        sc.push(s);
                        q.extend(
                            c.iter()
                                .map(|v| if s > 0.0 { (v / s).round() as i8 } else { 0 }),
                        );
                    }
                }
                (q, sc)
            };
            let (kq, ks) = quantize(&rng.vec(nk * row, 1.0));
            let (vq, vs) = quantize(&rng.vec(nk * row, 1.0));
            assert_eq!(ks.len(), nk * groups);
            let kf = u_sdk::dequantize_i8(&kq, &ks, nk as u32);
            let vf = u_sdk::dequantize_i8(&vq, &vs, nk as u32);
            let q = rng.vec(nq * heads * d, 1.0);
            let scale = 1.0 / (d as f32).sqrt();
            let run = |kv: &[KvSpan<'_>], dtype: DType| {
                let mut out = vec![f32::NAN; q.len()];
                kern.attention(
                    &q,
                    kv,
                    &params(&Shape { dtype, ..s.clone() }, scale),
                    &mut out,
                )
                .unwrap_or_else(|e| panic!("{s:?}: {e}"));
                out
            };
            let want = run(&[KvSpan::f32(nk as u32, &kf, &vf)], DType::F32);
            for pages in [nk, 64, 37] {
                let mut spans = Vec::new();
                for t0 in (0..nk).step_by(pages) {
                    let t1 = (t0 + pages).min(nk);
                    let (a, b, ga, gb) = (t0 * row, t1 * row, t0 * groups, t1 * groups);
                    spans.push(KvSpan::i8(
                        (t1 - t0) as u32,
                        (&kq[a..b], &ks[ga..gb]),
                        (&vq[a..b], &vs[ga..gb]),
                    ));
                }
                let got = run(&spans, DType::I8);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} {s:?}, pages of {pages}",
                    kern.isa().name()
                );
            }
            // Scales that do not match the span are an error, not a read past them.
            let short = KvSpan::i8(nk as u32, (&kq, &ks[1..]), (&vq, &vs));
            let mut out = vec![0f32; q.len()];
            let e = kern
                .attention(&q, &[short], &params(&s, scale), &mut out)
                .expect_err("short scales");
            assert!(e.message.contains("key and value scales"), "{}", e.message);
        }
    }
}

/// Tile and task boundaries: query and key counts around multiples of the 64-key tile and the
/// 16-query block, single keys, a long cache (decode and short prefills split their keys across
/// tasks and merge), windows that start inside a tile, on 1–3 threads and every ISA.
#[test]
fn tile_and_split_boundaries_match_the_naive_reference() {
    let mut rng = Rng::new(7);
    let pools: Vec<CpuKernels> = Isa::available()
        .into_iter()
        .flat_map(|i| [1, 2, 3].map(|t| CpuKernels::with_isa(i, t).expect("isa")))
        .collect();
    let cases = [
        // (heads, kv_heads, d, queries, kv_len, window, dtype)
        (9, 3, 64, 1, 1, 0, DType::F32),
        (9, 3, 64, 1, 63, 0, DType::F32),
        (9, 3, 64, 1, 64, 0, DType::F32),
        (9, 3, 64, 1, 65, 0, DType::F32),
        (9, 3, 64, 1, 1100, 0, DType::F32),
        (9, 3, 64, 1, 1100, 100, DType::F16),
        (9, 3, 64, 1, 1100, 300, DType::F32),
        (9, 3, 64, 5, 1100, 250, DType::F16),
        (9, 3, 64, 3, 1027, 0, DType::F32),
        (9, 3, 64, 17, 700, 70, DType::F32),
        (9, 3, 64, 63, 63, 0, DType::F32),
        (9, 3, 64, 64, 64, 0, DType::F16),
        (9, 3, 64, 65, 65, 0, DType::F32),
        (9, 3, 64, 65, 1040, 0, DType::F32),
        (9, 3, 64, 129, 129, 65, DType::F32),
        (4, 1, 128, 1, 1000, 0, DType::F32),
        (4, 1, 128, 33, 200, 0, DType::F16),
        (2, 2, 7, 1, 300, 0, DType::F32),
        (2, 2, 7, 65, 65, 0, DType::F32),
        (3, 1, 40, 20, 130, 0, DType::F32),
    ];
    for (heads, kv_heads, d, nq, nk, window, dtype) in cases {
        let s = Shape {
            heads,
            kv_heads,
            d,
            nq,
            nk,
            first: nk - nq,
            window,
            dtype,
        };
        let q = rng.vec(nq * heads * d, 1.0);
        let (kb, kf) = store(&rng.vec(nk * kv_heads * d, 1.0), dtype);
        let (vb, vf) = store(&rng.vec(nk * kv_heads * d, 1.0), dtype);
        let scale = 1.0 / (d as f32).sqrt();
        let want = naive(&s, scale, &q, &kf, &vf);
        for kern in &pools {
            check(kern, &s, &q, &kb, &vb, scale, &want);
        }
    }
}

/// Sharply peaked scores (large logits): the running maximum must rescale earlier tiles exactly.
#[test]
fn large_scores_rescale_earlier_tiles() {
    let mut rng = Rng::new(11);
    let s = Shape {
        heads: 2,
        kv_heads: 1,
        d: 64,
        nq: 70,
        nk: 300,
        first: 230,
        window: 0,
        dtype: DType::F32,
    };
    let q = rng.vec(s.nq * s.heads * s.d, 2.0);
    // Keys growing along the sequence, so later tiles keep raising the maximum (scores up to
    // ~±30: larger ones exceed what f32 scores can give to 1e-5 against the f64 reference).
    let k: Vec<f32> = (0..s.nk * s.d)
        .map(|i| (0.5 + 2.0 * (i / s.d) as f32 / s.nk as f32) * rng.uniform())
        .collect();
    let (kb, kf) = store(&k, DType::F32);
    let (vb, vf) = store(&rng.vec(s.nk * s.d, 1.0), DType::F32);
    let want = naive(&s, 1.0, &q, &kf, &vf);
    for isa in Isa::available() {
        check(
            &CpuKernels::with_isa(isa, 2).expect("isa"),
            &s,
            &q,
            &kb,
            &vb,
            1.0,
            &want,
        );
    }
}

#[test]
fn pytorch_sdpa_fixtures() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/attention");
    let mut cases = 0;
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read json")).expect("json");
        let get = |k: &str| meta[k].as_u64().unwrap_or_else(|| panic!("{k}")) as usize;
        let s = Shape {
            heads: get("heads"),
            kv_heads: get("kv_heads"),
            d: get("head_dim"),
            nq: get("queries"),
            nk: get("kv_len"),
            first: get("first_query_pos"),
            window: get("window"),
            dtype: if meta["kv_dtype"] == "f16" {
                DType::F16
            } else {
                DType::F32
            },
        };
        let scale = meta["scale"].as_f64().expect("scale") as f32;
        let stem = path.with_extension("");
        let bin = |part: &str| std::fs::read(format!("{}.{part}.bin", stem.display())).expect(part);
        let f32s = |b: Vec<u8>| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let (q, k, v, want) = (f32s(bin("q")), bin("k"), bin("v"), f32s(bin("out")));
        for isa in Isa::available() {
            let kern = CpuKernels::with_isa(isa, 2).expect("isa");
            check(&kern, &s, &q, &k, &v, scale, &want);
        }
        cases += 1;
    }
    assert!(
        cases >= 5,
        "expected the attention fixtures in {}",
        dir.display()
    );
}

#[test]
fn bad_parameters_are_errors() {
    let kern = CpuKernels::new(1).expect("kernels");
    let s = Shape {
        heads: 3,
        kv_heads: 2,
        d: 4,
        nq: 1,
        nk: 2,
        first: 1,
        window: 0,
        dtype: DType::F32,
    };
    let q = vec![0f32; 12];
    let kv = vec![0u8; 2 * 2 * 4 * 4];
    let mut out = vec![0f32; 12];
    fn span<'a>(k: &'a [u8], v: &'a [u8]) -> KvSpan<'a> {
        KvSpan::bytes(2, k, v)
    }
    let e = kern
        .attention(&q, &[span(&kv, &kv)], &params(&s, 1.0), &mut out)
        .expect_err("3 heads / 2 kv");
    assert!(e.message.contains("attention"), "{}", e.message);
    let s = Shape {
        heads: 2,
        kv_heads: 2,
        ..s
    };
    let e = kern
        .attention(
            &q[..8],
            &[span(&kv[..30], &kv)],
            &params(&s, 1.0),
            &mut out[..8],
        )
        .expect_err("short k");
    assert!(e.message.contains("span 0 of 2 tokens"), "{}", e.message);
    let one = KvSpan::bytes(1, &kv[..32], &kv[..32]);
    let e = kern
        .attention(&q[..8], &[one], &params(&s, 1.0), &mut out[..8])
        .expect_err("spans short of kv_len");
    assert!(
        e.message.contains("hold 1 positions, not kv_len"),
        "{}",
        e.message
    );
    let s = Shape {
        dtype: DType::BF16,
        ..s
    };
    assert!(
        kern.attention(&q[..8], &[span(&kv, &kv)], &params(&s, 1.0), &mut out[..8])
            .is_err()
    );
}
