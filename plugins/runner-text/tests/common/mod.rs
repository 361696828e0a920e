//! Fixture wiring shared by the engine's test crates: the arch-llama fixture models (tiny
//! random-weight models with `transformers` references) wired as the host wires them — loader →
//! architecture with the CPU backend and cache-kv → generator. Plugin rlibs stand in for the signed
//! `.so` files.
// Each test crate uses a subset of these helpers.
#![allow(dead_code)]

use anyhow::Result;
use std::{path::PathBuf, sync::Arc};
use u_runner_text::Generator;
use u_sdk::{KvCacheBox, ModelBox, TokenizerBox, WeightSetBox};

/// The directory of fixture model `model`.
pub fn fixture(model: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../arch-llama/tests/fixtures/models")
        .join(model)
}

/// The fixture's safetensors weights (f32).
pub fn safetensors(model: &str) -> Result<WeightSetBox> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let m = SafetensorsModel::open(&StdFs, &fixture(model))?;
    Ok(SafetensorsWeights::new(m).into_box())
}

/// The fixture's GGUF weights (`model.gguf`, or e.g. `model.q8_0.gguf`).
pub fn gguf(model: &str, file: &str) -> Result<WeightSetBox> {
    Ok(u_loader_gguf::open_path(&fixture(model).join(file))?.into_box())
}

/// A fresh cache-kv cache with default settings.
pub fn cache() -> KvCacheBox {
    u_cache_kv::KvCachePlugin::new(u_cache_kv::Config::default(), None).into_box()
}

/// A model built from `weights` with kernels-cpu (2 threads) storing KV in `cache`.
pub fn build_in(weights: WeightSetBox, cache: KvCacheBox) -> Result<ModelBox> {
    let kernels = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(u_arch_llama::LlamaArchitecture::default().load(weights, kernels, cache)?)
}

/// A model built from `weights` with a cache of its own.
pub fn build(weights: WeightSetBox) -> Result<ModelBox> {
    build_in(weights, cache())
}

/// The tiny 128-token tokenizer (BOS 1, EOS 2) that fits every fixture model.
pub fn tiny_tokenizer() -> Result<TokenizerBox> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-tokenizer");
    let json = std::fs::read_to_string(dir.join("tokenizer.json"))?;
    let config = std::fs::read_to_string(dir.join("tokenizer_config.json"))?;
    Ok(u_tokenizer::Tok::from_json(&json, Some(&config))?.into_box())
}

/// A generator for fixture `weights` with the tiny tokenizer, and the cache its KV lives in.
pub fn generator(weights: WeightSetBox) -> Result<(Arc<Generator>, KvCacheBox)> {
    let cache = cache();
    let model = build_in(weights, cache.clone())?;
    Ok((
        Arc::new(Generator::new(model, Some(tiny_tokenizer()?))?),
        cache,
    ))
}
