//! Shared test helpers: fixtures, loaders, kernels and caches wired as the host wires them.
#![allow(dead_code)]

pub mod dequantized;
pub mod reference_cache;
pub mod reference_kernels;

use abi_stable::std_types::{RSlice, RSliceMut};
use anyhow::{Context, Result};
use serde_json::Value;
use std::path::PathBuf;
use u_arch_llama::LlamaArchitecture;
use u_sdk::{
    BackendBox, KvCacheBox, ModelBox, ModelConfig, Output, Segment, SeqChunk, SeqId, WeightSetBox,
};

/// Models the fixture generator writes.
pub const MODELS: [&str; 9] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "qwen2_yarn",
];

/// Models of other architectures (`tests/fixtures/gen_llama_arches.py`: safetensors and GGUF
/// from llama.cpp's converter).
pub const ARCHITECTURES: [&str; 11] = [
    "gpt2",
    "phi3",
    "gemma2",
    "stablelm",
    "gpt_neox",
    "olmo2",
    "granite",
    "cohere",
    "falcon",
    "falcon_40b",
    "nemotron",
];

/// One prompt of a fixture: its tokens, the reference logits and the greedy continuation.
pub struct Case {
    pub prompt: Vec<u32>,
    pub logits: Vec<f32>,
    pub generated: Vec<u32>,
}

/// A fixture model's directory.
pub fn dir(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(model)
}

/// The expected logits and generations of `model`.
pub fn cases(model: &str) -> Result<(usize, Vec<Case>)> {
    let d = dir(model);
    let json: Value = serde_json::from_slice(&std::fs::read(d.join("expected.json"))?)?;
    let bytes = std::fs::read(d.join("logits.bin"))?;
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let vocab = json["vocab_size"].as_u64().context("vocab_size")? as usize;
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect()
    };
    let mut at = 0;
    let mut out = Vec::new();
    for c in json["cases"].as_array().context("cases")? {
        let prompt = ids(&c["prompt"]);
        let n = prompt.len() * vocab;
        out.push(Case {
            logits: all[at..at + n].to_vec(),
            generated: ids(&c["generated"]),
            prompt,
        });
        at += n;
    }
    anyhow::ensure!(
        at == all.len(),
        "logits.bin has {} floats, cases use {at}",
        all.len()
    );
    Ok((vocab, out))
}

/// The fixture's safetensors weights through the loader's host-free path.
pub fn safetensors(model: &str) -> Result<WeightSetBox> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let m = SafetensorsModel::open(&StdFs, &dir(model))?;
    Ok(SafetensorsWeights::new(m).into_box())
}

/// The fixture's ONNX weights (`model.onnx` beside `config.json`).
pub fn onnx(model: &str) -> Result<WeightSetBox> {
    use u_loader_onnx::{OnnxModel, OnnxWeights, StdFs};
    let m = OnnxModel::open(&StdFs, &dir(model).join("model.onnx"))?;
    Ok(OnnxWeights::new(m).into_box())
}

/// The fixture's GGUF F32 weights.
pub fn gguf(model: &str) -> Result<WeightSetBox> {
    let w = u_loader_gguf::open_path(&dir(model).join("model.gguf"))?;
    Ok(w.into_box())
}

/// The fixture's GGUF Q8_0 weights (llama, mixtral, phi3 and falcon only).
pub fn gguf_q8_0(model: &str) -> Result<WeightSetBox> {
    let w = u_loader_gguf::open_path(&dir(model).join("model.q8_0.gguf"))?;
    Ok(w.into_box())
}

/// The CPU backend plugin (as an rlib).
pub fn kernels() -> BackendBox {
    u_kernels_cpu::CpuKernels::new(2)
        .expect("kernels")
        .into_box()
}

/// The real cache plugin (as an rlib), with default settings.
pub fn cache_kv() -> KvCacheBox {
    u_cache_kv::KvCachePlugin::new(u_cache_kv::Config::default(), None).into_box()
}

/// Builds a model as the host does.
pub fn build(weights: WeightSetBox, cache: KvCacheBox) -> Result<ModelBox> {
    build_with(weights, kernels(), cache)
}

/// Builds a model with the given kernels.
pub fn build_with(
    weights: WeightSetBox,
    kernels: BackendBox,
    cache: KvCacheBox,
) -> Result<ModelBox> {
    Ok(LlamaArchitecture::default().load(weights, kernels, cache)?)
}

/// Runs one batch of token chunks, returning the outputs they ask for.
pub fn forward(model: &ModelBox, batch: &[(SeqId, &[u32], Output)]) -> Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let inputs: Vec<[Segment<'_>; 1]> = batch
        .iter()
        .map(|(_, t, _)| [Segment::Tokens(RSlice::from_slice(t))])
        .collect();
    let chunks: Vec<SeqChunk<'_>> = batch
        .iter()
        .zip(&inputs)
        .map(|(&(seq, _, output), input)| SeqChunk::tokens(seq, input, output))
        .collect();
    run(model, &config, &chunks)
}

/// Runs any chunks, returning the outputs they ask for.
pub fn run(model: &ModelBox, config: &ModelConfig, chunks: &[SeqChunk<'_>]) -> Result<Vec<f32>> {
    let floats: usize = chunks
        .iter()
        .map(|c| c.output.floats(c.rows(config.hidden as usize), config))
        .sum();
    let mut out = vec![0f32; floats];
    model
        .forward(
            RSlice::from_slice(chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

/// Index of the largest value (the first on ties, as torch.argmax).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
