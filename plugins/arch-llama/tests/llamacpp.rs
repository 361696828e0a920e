//! Conformance with llama.cpp on the same GGUF files (fixtures from
//! `tests/fixtures/gen_llamacpp_reference.py`: llama-cpp-python 0.3.36, F32 KV cache, flash
//! attention off, 2 threads).
//!
//! - SmolLM2-135M-Instruct (Q4_1, Q8_0 embedding = tied head; the file comes from
//!   [`smollm2_path`]): prompt ids through the `u-tokenizer` GGUF vocabulary and chat template
//!   equal llama.cpp's; 64 greedy tokens per prompt, teacher-forced on llama.cpp's tokens (where
//!   all argmaxes agree this is free-running greedy), and logits at the first step (full vocab)
//!   and at every step (llama.cpp's top 10).
//! - The tiny random-weight fixtures as Q8_0, Q4_0 and Q4_1 (`llamacpp/<model>.<q>.gguf`):
//!   logits at every prompt position.
//! - A tiny BitNet b1.58 (`bitnet`) model as F32, TQ1_0 and TQ2_0
//!   (`tests/fixtures/gen_llamacpp_bitnet.py`): logits at every prompt position.
//!
//! Why the bounds are what they are (measured, see the report printed by each test):
//! both sides quantize activations to int8 per 32 values for the integer dot products. Int8
//! rounding is discontinuous: a float-level difference upstream (summation order, one ulp)
//! flips roundings downstream, and each flip is a whole quantum. On SmolLM2 (30 layers, large
//! activation outliers) this noise is ~1 logit, and llama.cpp does not agree with itself:
//! - its AVX-512 build against the AVX2 build the reference comes from (same version, same
//!   file, same settings; `gen_llamacpp_reference.py --other-build`): first-step logits up to
//!   1.11 apart and 14 greedy flips in 384 steps, 11 of them at top-2 gaps ≥ 0.01 (up to 0.21);
//! - the same build with the prompt fed one token at a time: up to 0.96 apart, 5 flips at gaps
//!   ≥ 0.01 (up to 0.13);
//! - an exact f32 matmul over the same weights is 1.4 away.
//!
//! U sits at the same distance (printed side by side). #5's strict rule (divergence only at a
//! top-2 gap < 0.01, [`NEAR_TIE`]) is therefore counted and printed but not asserted: only
//! bit-for-bit emulation of one llama.cpp build's float order could meet it, and llama.cpp's own
//! builds do not. #14 restated it, and that is what is asserted: no more greedy divergences in
//! the 384 steps than llama.cpp's AVX-512 build shows against its AVX2 build, plus 25%
//! ([`DIVERGENCE_MARGIN`], counted from the fixture), each only where llama.cpp's top-2 gap is
//! below what llama.cpp's own logits move when the same prompt is batched differently (its
//! recorded first-step self-difference, 0.96 — a gap that small is not settled by llama.cpp's
//! numbers either), and logits within [`SMOL_TOL`]. The other half of #14's rule, mean KL
//! divergence over a whole text, is `tests/perplexity.rs` in the workspace's test crate.
//!
//! The tiny models have too few values for a rounding flip: there kernels-cpu's activation
//! quantization (ggml's f16 block scale `d` and, for Q4_1, `s = f16(d·Σq)`) and float steps
//! leave U within a few ulp of llama.cpp, which [`tiny_activation_rounding_matches_ggml`] holds
//! to [`TINY_STRICT`].

mod support;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use std::path::PathBuf;
use support::{
    argmax, dequantized::Dequantized, max_abs_diff, reference_cache::ReferenceCache,
    reference_kernels::DequantMatmul,
};
use u_sdk::{ModelBox, Output, Rows, WeightSetBox};

/// SmolLM2 logit tolerance (logits span about −15..25). Measured: 1.12 (first step, full
/// vocab), 1.10 (top 10 of every step); llama.cpp's AVX-512 build vs its AVX2 build 1.11,
/// llama.cpp batched differently 0.96; exact f32 matmul vs llama.cpp 1.41. The int8-activation
/// noise floor with headroom.
const SMOL_TOL: f32 = 1.5;
/// The near-tie: divergences at a smaller llama.cpp top-2 gap are always fine.
const NEAR_TIE: f32 = 0.01;
/// Greedy divergences accepted in the 384 steps, as a multiple of those llama.cpp's AVX-512 build
/// shows against its AVX2 build (#14; measured: U 16, 13 of them at a gap ≥ 0.01; llama.cpp's
/// other build 14 and 11, so at most 17; batched differently: 5).
const DIVERGENCE_MARGIN: f32 = 1.25;
/// Tiny Q8_0/Q4_0/Q4_1 models (logits O(1..20), 2 layers): measured up to 0.34; ours vs an exact
/// f32 matmul up to 0.44, llama.cpp vs it up to 0.31 (int8 activation noise).
const TINY_TOL: f32 = 0.5;
/// Tiny models with ggml-identical activation rounding: equal but for float summation order.
const TINY_STRICT: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llamacpp")
}

fn read_json(name: &str) -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixtures().join(name),
    )?)?)
}

fn read_f32(name: &str) -> Result<Vec<f32>> {
    let bytes = std::fs::read(fixtures().join(name))?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect()
}

/// The SmolLM2 GGUF: `$U_SMOLLM2_GGUF` (`cargo xtask test` sets it), else the model cache of
/// `cargo xtask fetch-model` (`$U_MODEL_CACHE`, `$XDG_CACHE_HOME/u/models`, `~/.cache/u/models`).
/// Absent is a failure.
fn smollm2_path() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let path = var("U_SMOLLM2_GGUF").unwrap_or_else(|| {
        var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .unwrap_or_else(|| var("HOME").unwrap_or_default().join(".cache/u/models"))
            .join("SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(
        path.is_file(),
        "SmolLM2 model not found at {}: run `cargo xtask fetch-model` (or set U_SMOLLM2_GGUF)",
        path.display()
    );
    path
}

fn open(path: &std::path::Path) -> Result<WeightSetBox> {
    Ok(u_loader_gguf::open_path(path)?.into_box())
}

fn forward_one(m: &ModelBox, seq: u64, tokens: &[u32], w: Output) -> Result<Vec<f32>> {
    support::forward(m, &[(seq, tokens, w)])
}

#[test]
fn smollm2_prompt_tokens_and_template_match_llama_cpp() -> Result<()> {
    let fx = read_json("smollm2.json")?;
    let tok = u_tokenizer::Tok::from_meta(&open(&smollm2_path())?)?;
    let template = fx["chat_template"].as_str().context("chat_template")?;
    for case in fx["cases"].as_array().context("cases")? {
        let text = case["text"].as_str().context("text")?;
        let want = ids(&case["prompt_ids"]);
        let got = if case["kind"] == "chat" {
            // Rendered as transformers renders it (the fixture holds llama.cpp's Jinja rendering).
            let msgs: Vec<u_chat_template::ChatMessage> = case["messages"]
                .as_array()
                .context("messages")?
                .iter()
                .map(|m| {
                    u_chat_template::ChatMessage::new(
                        m["role"].as_str().unwrap(),
                        m["content"].as_str().unwrap(),
                    )
                })
                .collect();
            let sp = tok.special_tokens();
            let name =
                |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
            let rendered = u_chat_template::render(
                template,
                &msgs,
                true,
                &name(sp.bos.into_option()),
                &name(sp.eos.first().copied()),
            )?;
            assert_eq!(rendered, text, "chat template rendering differs");
            tok.encode_with(text, false, true)?
        } else {
            tok.encode_with(text, true, false)?
        };
        assert_eq!(got, want, "token ids differ for {text:?}");
    }
    eprintln!(
        "smollm2: {} prompts tokenized (and templates rendered) as llama.cpp does",
        fx["cases"].as_array().unwrap().len()
    );
    Ok(())
}

#[test]
fn smollm2_greedy_64_and_logits_match_llama_cpp() -> Result<()> {
    let fx = read_json("smollm2.json")?;
    let full = read_f32("smollm2_logits.bin")?;
    let vocab = fx["vocab_size"].as_u64().context("vocab_size")? as usize;
    let full_idx = ids(&fx["full_logits"]);
    ensure!(
        full.len() == full_idx.len() * vocab,
        "smollm2_logits.bin size"
    );
    let path = smollm2_path();
    let model = support::build(open(&path)?, ReferenceCache::new_box(16))?;
    let exact = support::build_with(
        open(&path)?,
        DequantMatmul::new_box(support::kernels()),
        ReferenceCache::new_box(16),
    )?;

    let (mut worst_full, mut worst_exact, mut worst_top) = (0f32, 0f32, 0f32);
    let mut ties = Vec::new();
    for (i, case) in fx["cases"].as_array().context("cases")?.iter().enumerate() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["generated"]);
        let gaps: Vec<f32> = case["top2_gap"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g.as_f64().unwrap() as f32)
            .collect();
        let seq = model.cache().unwrap().unwrap().create().into_result()?;
        let mut logits = forward_one(&model, seq, &prompt, Output::Logits(Rows::Last))?;
        if let Some(k) = full_idx.iter().position(|&p| p as usize == i) {
            let reference = &full[k * vocab..(k + 1) * vocab];
            worst_full = worst_full.max(max_abs_diff(&logits, reference));
            let s = exact.cache().unwrap().unwrap().create().into_result()?;
            let l = forward_one(&exact, s, &prompt, Output::Logits(Rows::Last))?;
            worst_exact = worst_exact.max(max_abs_diff(&l, reference));
            exact.cache().unwrap().unwrap().release(s).into_result()?;
        }
        // Teacher-forced on llama.cpp's tokens: where every argmax agrees this *is* free-running
        // greedy generation, and after an accepted near-tie the rest is still checked.
        let mut generated = Vec::new();
        for (step, &t) in want.iter().enumerate() {
            let ours = argmax(&logits);
            generated.push(ours);
            for pair in case["top"][step].as_array().unwrap() {
                let id = pair[0].as_u64().unwrap() as usize;
                let v = pair[1].as_f64().unwrap() as f32;
                worst_top = worst_top.max((logits[id] - v).abs());
            }
            if ours != t {
                ties.push((i, step, ours, t, gaps[step]));
            }
            if step + 1 < want.len() {
                logits = forward_one(&model, seq, &[t], Output::Logits(Rows::Last))?;
            }
        }
        model.cache().unwrap().unwrap().release(seq).into_result()?;
        let min_gap = gaps.iter().copied().fold(f32::INFINITY, f32::min);
        eprintln!(
            "smollm2 prompt {i} ({}): {} prompt tokens, 64 greedy tokens {}, min llama.cpp top-2 gap {min_gap:.4}",
            case["kind"].as_str().unwrap(),
            prompt.len(),
            if generated == want {
                "identical"
            } else {
                "differ (below)"
            },
        );
    }
    // llama.cpp against itself, recorded by the generator: batched differently, another build.
    let batched = LlamaCppNoise::of(
        fx["cases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| &c["llama_cpp_self"]),
    );
    let other = &fx["llama_cpp_other_build"];
    let other_build = LlamaCppNoise::of(
        other["cases"]
            .as_array()
            .context("llama_cpp_other_build")?
            .iter(),
    );
    let noise_gap = batched.first_step;
    let max_divergences = (other_build.gaps.len() as f32 * DIVERGENCE_MARGIN).floor() as usize;
    for (i, step, ours, t, gap) in &ties {
        let verdict = if *gap < NEAR_TIE {
            "near-tie"
        } else if *gap < noise_gap {
            "within the int8 noise"
        } else {
            "NOT accepted"
        };
        eprintln!(
            "smollm2 divergence: prompt {i} step {step}: ours {ours}, llama.cpp {t}, llama.cpp top-2 gap {gap:.5} ({verdict})"
        );
    }
    let strict = ties.iter().filter(|t| t.4 >= NEAR_TIE).count();
    let hard = ties.iter().filter(|t| t.4 >= noise_gap).count();
    let max_gap = ties.iter().map(|t| t.4).fold(0f32, f32::max);
    eprintln!(
        "smollm2 against the llama.cpp reference ({}), {} greedy steps; max |Δlogit|:\n  {:<34} {:>10} {:>8}  divergences (at a gap ≥ {NEAR_TIE}, largest gap)\n  {:<34} {worst_full:>10.3} {worst_top:>8.3}  {} ({strict}, {max_gap:.3})\n  {:<34} {other_build}\n  {:<34} {batched}\n  {:<34} {worst_exact:>10.3} {:>8}  -",
        build_name(&fx["settings"]["system_info"]),
        64 * fx["cases"].as_array().unwrap().len(),
        "",
        "first step",
        "top 10",
        "U",
        ties.len(),
        format!("llama.cpp, {}", build_name(&other["system_info"])),
        "llama.cpp, prompt token by token",
        "exact f32 matmul, same weights",
        "-",
    );
    eprintln!(
        "tolerance {SMOL_TOL}; divergences accepted below a gap of {noise_gap:.3} (llama.cpp batched \
         differently), at most {max_divergences} ({DIVERGENCE_MARGIN} × llama.cpp's other build)"
    );
    assert_eq!(
        hard, 0,
        "{hard} greedy divergences at a top-2 gap ≥ {noise_gap}"
    );
    assert!(
        ties.len() <= max_divergences,
        "{} greedy divergences, more than {max_divergences} ({DIVERGENCE_MARGIN} × the {} of \
         llama.cpp's AVX-512 build against its AVX2 build)",
        ties.len(),
        other_build.gaps.len()
    );
    assert!(
        worst_full <= SMOL_TOL,
        "first-step logits off by {worst_full}"
    );
    assert!(worst_top <= SMOL_TOL, "top-10 logits off by {worst_top}");
    Ok(())
}

/// How far llama.cpp moves from its own reference run (a record of the fixture generator).
struct LlamaCppNoise {
    /// Largest first-step |Δlogit| over the prompts that have one.
    first_step: f32,
    /// Largest |Δlogit| over the reference's top 10 at every step, where recorded.
    top10: Option<f32>,
    /// Greedy divergences (teacher-forced) and their reference top-2 gaps.
    gaps: Vec<f32>,
}

impl LlamaCppNoise {
    fn of<'a>(cases: impl Iterator<Item = &'a Value>) -> Self {
        let mut n = LlamaCppNoise {
            first_step: 0.0,
            top10: None,
            gaps: Vec::new(),
        };
        for c in cases {
            let num = |k: &str| c[k].as_f64().map(|v| v as f32);
            n.first_step = n
                .first_step
                .max(num("first_step_max_abs_diff").unwrap_or(0.0));
            if let Some(t) = num("top10_max_abs_diff") {
                n.top10 = Some(n.top10.unwrap_or(0.0).max(t));
            }
            for d in c["divergences"].as_array().into_iter().flatten() {
                n.gaps.push(d[1].as_f64().unwrap() as f32);
            }
        }
        n
    }
}

impl std::fmt::Display for LlamaCppNoise {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let top10 = self.top10.map_or("-".into(), |t| format!("{t:.3}"));
        let strict = self.gaps.iter().filter(|&&g| g >= NEAR_TIE).count();
        let max_gap = self.gaps.iter().copied().fold(0f32, f32::max);
        write!(
            f,
            "{:>10.3} {top10:>8}  {} ({strict}, {max_gap:.3})",
            self.first_step,
            self.gaps.len()
        )
    }
}

/// "AVX-512 build" or "AVX2 build", from a llama.cpp system-info line.
fn build_name(system_info: &Value) -> &'static str {
    match system_info.as_str() {
        Some(s) if s.contains("AVX512 = 1") => "AVX-512 build",
        Some(s) if s.contains("AVX2 = 1") => "AVX2 build",
        _ => "other build",
    }
}

/// Logits of `file` for the fixture prompts (all positions): ours and an exact f32 matmul.
fn tiny_run(e: &Value) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let file = fixtures().join(e["file"].as_str().unwrap());
    let want = read_f32(e["logits"].as_str().unwrap())?;
    let ours = support::build(open(&file)?, ReferenceCache::new_box(4))?;
    let exact = support::build_with(
        open(&file)?,
        DequantMatmul::new_box(support::kernels()),
        ReferenceCache::new_box(4),
    )?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for p in e["prompts"].as_array().unwrap() {
        let prompt = ids(p);
        for (m, out) in [(&ours, &mut a), (&exact, &mut b)] {
            let seq = m.cache().unwrap().unwrap().create().into_result()?;
            out.extend(forward_one(m, seq, &prompt, Output::Logits(Rows::All))?);
            m.cache().unwrap().unwrap().release(seq).into_result()?;
        }
    }
    ensure!(a.len() == want.len(), "{}: logits file size", e["logits"]);
    Ok((a, b, want))
}

#[test]
fn tiny_quantized_logits_match_llama_cpp() -> Result<()> {
    let mut worst = Vec::new();
    for e in read_json("tiny.json")?["models"]
        .as_array()
        .context("models")?
    {
        let (ours, exact, want) = tiny_run(e)?;
        let (d, d_exact, d_oe) = (
            max_abs_diff(&ours, &want),
            max_abs_diff(&exact, &want),
            max_abs_diff(&ours, &exact),
        );
        let (name, q) = (e["model"].as_str().unwrap(), e["quant"].as_str().unwrap());
        eprintln!(
            "{q} {name:<8} max |Δlogit| vs llama.cpp {d:.2e} (exact f32 matmul vs llama.cpp \
             {d_exact:.2e}, ours vs exact {d_oe:.2e}); tolerance {TINY_TOL}"
        );
        worst.push((format!("{name} {q}"), d));
    }
    for (what, d) in &worst {
        assert!(*d <= TINY_TOL, "{what}: logits off llama.cpp by {d}");
    }
    Ok(())
}

/// kernels-cpu rounds activations as ggml does: each 32-value block's scale `d` to f16 and, for
/// Q8_1 (Q4_1 weights), `s = f16(d·Σq)`; Q4_0's `−8·d·Σq` from the f16 `d`. With f32 scales
/// (as kernels-cpu first had) these logits were 0.1–0.3 off llama.cpp.
#[test]
fn tiny_activation_rounding_matches_ggml() -> Result<()> {
    let mut worst = Vec::new();
    for e in read_json("tiny.json")?["models"]
        .as_array()
        .context("models")?
    {
        let (ours, _, want) = tiny_run(e)?;
        let d = max_abs_diff(&ours, &want);
        worst.push((
            format!(
                "{} {}",
                e["model"].as_str().unwrap(),
                e["quant"].as_str().unwrap()
            ),
            d,
        ));
    }
    eprintln!("tiny models, max |Δlogit| vs llama.cpp: {worst:?}; strict tolerance {TINY_STRICT}");
    for (what, d) in &worst {
        assert!(
            *d <= TINY_STRICT,
            "{what}: {d} > {TINY_STRICT}: activation rounding differs from ggml"
        );
    }
    Ok(())
}

/// The BitNet b1.58 fixture (`tests/fixtures/gen_llamacpp_bitnet.py`): llama.cpp's `bitnet`
/// model, its logits at every position of each prompt on the F32 model and on the TQ1_0 and
/// TQ2_0 files llama.cpp's quantizer made of it. The F32 model is read as the TQ2_0 file
/// dequantized: the generator checks that the two hold the same values (every block's scale
/// is its tensor's f16 scale, so ternary quantization is exact).
fn bitnet_weights(e: &Value, fx: &Value) -> Result<WeightSetBox> {
    Ok(match e["file"].as_str() {
        Some(file) => open(&fixtures().join(file))?,
        None => Dequantized::new_box(open(
            &fixtures().join(fx["f32_values_from"].as_str().context("f32_values_from")?),
        )?)?,
    })
}

/// BitNet logits (O(10)) against llama.cpp on the same file. F32: both sides multiply in f32,
/// only the summation order differs. TQ1_0/TQ2_0: both quantize the activations to int8 per
/// 256 values (Q8_K, f32 scale) and sum exact integer products of the ternary weights, as
/// ggml's `vec_dot_tq{1,2}_0_q8_K` does (kernels-cpu: the same scalar arithmetic for TQ1_0,
/// AVX2 for TQ2_0), so the only noise is float order upstream, within a few ulp unless it
/// flips an int8 rounding — too few values here for one.
const BITNET_TOL: f32 = 1e-4;

#[test]
fn bitnet_logits_match_llama_cpp_on_f32_tq1_0_and_tq2_0() -> Result<()> {
    let fx = read_json("bitnet.json")?;
    let prompts: Vec<Vec<u32>> = fx["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(ids)
        .collect();
    let mut worst = Vec::new();
    for e in fx["models"].as_array().context("models")? {
        let q = e["quant"].as_str().context("quant")?;
        let want = read_f32(e["logits"].as_str().context("logits")?)?;
        let m = support::build(bitnet_weights(e, &fx)?, ReferenceCache::new_box(4))?;
        let mut ours = Vec::new();
        for p in &prompts {
            let seq = m.cache().unwrap().unwrap().create().into_result()?;
            ours.extend(forward_one(&m, seq, p, Output::Logits(Rows::All))?);
            m.cache().unwrap().unwrap().release(seq).into_result()?;
        }
        ensure!(ours.len() == want.len(), "{q}: logits file size");
        let d = max_abs_diff(&ours, &want);
        eprintln!("bitnet {q}: max |Δlogit| vs llama.cpp {d:.2e}; tolerance {BITNET_TOL}");
        worst.push((q.to_string(), d));
    }
    for (q, d) in &worst {
        assert!(*d <= BITNET_TOL, "bitnet {q}: logits off llama.cpp by {d}");
    }
    Ok(())
}

/// A `bitnet` file without one of its sub-layer norms is refused with the tensor's name (the
/// other architectures do without them).
#[test]
fn bitnet_without_a_sub_norm_is_a_clear_error() -> Result<()> {
    let fx = read_json("bitnet.json")?;
    let file = fixtures().join(fx["f32_values_from"].as_str().context("f32_values_from")?);
    for missing in ["blk.0.attn_sub_norm.weight", "blk.1.ffn_sub_norm.weight"] {
        let weights = Dequantized::without(open(&file)?, &[missing])?;
        let Err(e) = support::build(weights, ReferenceCache::new_box(4)) else {
            panic!("a bitnet model without {missing} was built");
        };
        let message = format!("{e:#}");
        assert!(
            message.contains(&format!("`{missing}` is missing")),
            "{missing}: {message}"
        );
    }
    Ok(())
}
