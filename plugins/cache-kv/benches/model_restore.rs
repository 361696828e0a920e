//! Issue 6 speed, on the real SmolLM2-135M model: a 2,000-token prefix restored from the prefix
//! tree vs prefilled, and, after a "restart" (a fresh cache and model), first token with the
//! disk tier (a checkpoint, or the prefix tree rebuilt from its segment files) vs without.
//! Prints the ratios.
//!
//! Run: `cargo xtask fetch-model && cargo bench -p u-cache-kv --bench model_restore`
//! (model path: `$U_SMOLLM2_GGUF`, else the model cache `cargo xtask fetch-model` fills).

#[path = "../tests/common/mod.rs"]
mod common;

use abi_stable::std_types::{RSlice, RSliceMut};
use std::{path::PathBuf, time::Instant};
use u_arch_llama::LlamaArchitecture;
use u_cache_kv::{Config, KvCachePlugin};
use u_sdk::{KvCacheBox, ModelBox, Output, Rows, Segment, SeqChunk, SeqId};

const PREFIX: usize = 2000;
const CHUNK: usize = 512;

fn model_path() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("U_SMOLLM2_GGUF").unwrap_or_else(|| {
        let cache = var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .unwrap_or_else(|| var("HOME").unwrap_or_default().join(".cache/u/models"));
        cache.join("SmolLM2-135M-Instruct.Q4_1.gguf")
    })
}

fn build(cache: KvCacheBox) -> ModelBox {
    let weights = u_loader_gguf::open_path(&model_path())
        .expect("SmolLM2 GGUF: run `cargo xtask fetch-model`")
        .into_box();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernels = u_kernels_cpu::CpuKernels::new(threads)
        .expect("kernels")
        .into_box();
    LlamaArchitecture::default()
        .load(weights, kernels, cache)
        .expect("build model")
}

/// Runs `tokens` through `seq` in chunks; returns the argmax of the last logits.
fn run(model: &ModelBox, seq: SeqId, tokens: &[u32]) -> u32 {
    let vocab = model.config().unwrap().vocab_size as usize;
    let mut logits = vec![0f32; vocab];
    for chunk in tokens.chunks(CHUNK) {
        let input = [Segment::Tokens(RSlice::from_slice(chunk))];
        let batch = [SeqChunk::tokens(seq, &input, Output::Logits(Rows::Last))];
        model
            .forward(
                RSlice::from_slice(&batch),
                RSliceMut::from_mut_slice(&mut logits),
            )
            .into_result()
            .expect("forward");
    }
    (0..vocab).fold(0, |b, i| if logits[i] > logits[b] { i } else { b }) as u32
}

fn main() {
    let tokens: Vec<u32> = (0..PREFIX as u32)
        .map(|i| 100 + (i * 7919) % 49000)
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = || {
        let config = Config {
            dir: Some(dir.path().to_str().expect("utf-8 path").to_string()),
            ..Config::default()
        };
        KvCachePlugin::new(config, Some(common::host(dir.path(), ""))).into_box()
    };

    // In one process: prefill vs restore from the prefix tree, each followed by one token.
    let cache = disk();
    let model = build(cache.clone());
    let seq = cache.create().into_result().unwrap();
    let t = Instant::now();
    let next = run(&model, seq, &tokens);
    run(&model, seq, &[next]);
    let prefill = t.elapsed();
    cache.truncate(seq, PREFIX as u64).into_result().unwrap();
    cache
        .insert_prefix(tokens.as_slice().into(), seq)
        .into_result()
        .unwrap();
    cache
        .save_checkpoint("system-prompt".into(), seq)
        .into_result()
        .unwrap();
    let mut query = tokens.clone();
    query.push(next);
    let t = Instant::now();
    let found = cache
        .lookup_prefix(query.as_slice().into())
        .into_result()
        .unwrap();
    assert_eq!(found.matched as usize, PREFIX);
    run(&model, found.seq, &[next]);
    let restored = t.elapsed();
    drop(model);
    drop(cache);

    // After a restart: a fresh cache and model, with and without the disk tier.
    let t = Instant::now();
    let cache = KvCachePlugin::new(Config::default(), None).into_box();
    let model = build(cache.clone());
    let seq = cache.create().into_result().unwrap();
    let cold_next = run(&model, seq, &tokens);
    run(&model, seq, &[cold_next]);
    let cold = t.elapsed();
    drop(model);
    drop(cache);
    let t = Instant::now();
    let cache = disk();
    let model = build(cache.clone());
    let seq = cache
        .load_checkpoint("system-prompt".into())
        .into_result()
        .unwrap();
    let warm_next = run(&model, seq, &[next]);
    let warm = t.elapsed();
    drop(model);
    drop(cache);
    let t = Instant::now();
    let cache = disk();
    let model = build(cache.clone());
    let found = cache
        .lookup_prefix(query.as_slice().into())
        .into_result()
        .unwrap();
    assert_eq!(found.matched as usize, PREFIX, "the prefix tree survived");
    let tree_next = run(&model, found.seq, &[next]);
    let warm_tree = t.elapsed();
    assert_eq!(cold_next, next, "prefill is deterministic");
    assert_eq!(tree_next, warm_next, "tree and checkpoint restore agree");

    println!("SmolLM2-135M Q4_1, {PREFIX}-token prefix, then one token:");
    println!("  prefill + token:               {prefill:>10.1?}");
    println!("  prefix-tree restore + token:   {restored:>10.1?}");
    println!(
        "  ratio prefill / restore:       {:.0}x",
        prefill.as_secs_f64() / restored.as_secs_f64()
    );
    println!("  restart, no disk tier:         {cold:>10.1?}  (load + prefill + token)");
    println!("  restart, disk tier:            {warm:>10.1?}  (load + map checkpoint + token)");
    println!(
        "  ratio without / with disk tier: {:.1}x",
        cold.as_secs_f64() / warm.as_secs_f64()
    );
    println!("  restart, disk prefix tree:     {warm_tree:>10.1?}  (load + map tree + token)");
    println!(
        "  ratio without / with tree:      {:.1}x",
        cold.as_secs_f64() / warm_tree.as_secs_f64()
    );
}
