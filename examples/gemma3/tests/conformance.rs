//! Gemma 3 against transformers: a tiny random-weight `Gemma3ForCausalLM` (sliding and global
//! layers with different RoPE bases, q/k norms, GELU-tanh, embedding scaling, four norms per
//! block; `tests/fixtures/gen_gemma3.py`), from its safetensors and from its GGUF conversion,
//! on U's CPU backend and KV cache: full-prompt logits within 1e-4 and 32 greedy tokens equal.

use anyhow::{Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_gemma3::Gemma3Architecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{ModelBox, Output, Rows, Segment, SeqChunk, SeqId, WeightSetBox};

/// Stated tolerance on logits.
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gemma3")
}

fn build(weights: WeightSetBox) -> Result<ModelBox> {
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    let cache = u_cache_kv::KvCachePlugin::new(u_cache_kv::Config::default(), None).into_box();
    Ok(Gemma3Architecture.load(weights, backend, cache)?)
}

fn forward(model: &ModelBox, seq: SeqId, tokens: &[u32], output: Output) -> Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let input = [Segment::Tokens(RSlice::from_slice(tokens))];
    let chunk = [SeqChunk::tokens(seq, &input, output)];
    let mut out = vec![0f32; output.floats(tokens.len(), &config)];
    model
        .forward(
            RSlice::from_slice(&chunk),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

fn check(name: &str, weights: WeightSetBox) -> Result<()> {
    let expected: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    let bytes = std::fs::read(fixture().join("logits.bin"))?;
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let vocab = expected["vocab_size"].as_u64().context("vocab_size")? as usize;
    let model = build(weights)?;
    let cache = model
        .cache()
        .into_result()?
        .into_option()
        .context("cache")?;
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_u64())
                    .map(|t| t as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut at = 0;
    let mut worst = 0f32;
    for case in expected["cases"].as_array().context("cases")? {
        let prompt = ids(&case["prompt"]);
        let want = &all[at..at + prompt.len() * vocab];
        at += prompt.len() * vocab;
        let seq = cache.create().into_result()?;
        let got = forward(&model, seq, &prompt, Output::Logits(Rows::All))?;
        let d = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        worst = worst.max(d);
        // Greedy continuation with the KV cache, as `model.generate` runs it.
        let mut next = argmax(&got[(prompt.len() - 1) * vocab..]);
        let mut generated = Vec::new();
        for _ in 0..ids(&case["generated"]).len() {
            generated.push(next);
            next = argmax(&forward(&model, seq, &[next], Output::Logits(Rows::Last))?);
        }
        assert_eq!(generated, ids(&case["generated"]), "{name}: greedy tokens");
        cache.release(seq).into_result()?;
    }
    assert_eq!(at, all.len(), "every reference row compared");
    eprintln!("gemma3 {name}: max |Δlogit| {worst:.2e}");
    assert!(worst <= TOL, "{name}: logits differ by {worst}");
    Ok(())
}

#[test]
fn safetensors_logits_and_greedy_tokens_match_transformers() -> Result<()> {
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, &fixture())?;
    check(
        "safetensors",
        u_loader_safetensors::SafetensorsWeights::new(m).into_box(),
    )
}

#[test]
fn gguf_logits_and_greedy_tokens_match_transformers() -> Result<()> {
    check(
        "gguf",
        u_loader_gguf::open_path(&fixture().join("model.gguf"))?.into_box(),
    )
}
