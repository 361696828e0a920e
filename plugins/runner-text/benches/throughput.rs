//! Continuous batching throughput: aggregate generated tokens/s of N concurrent greedy clients
//! against one client alone, side by side in one run through [`EngineHandle`], on the llama
//! fixture model (f32 safetensors and Q8_0 GGUF).
//!
//! `cargo bench -p u-runner-text --bench throughput` (`-- <clients> <tokens> <rounds>` to vary).
//! `U_ENGINE_BENCH_GGUF=<model.gguf>` adds a run on that model (its own vocabulary), e.g. the
//! 244M-parameter bench llama of `tests/fixtures/gen_bench_llama.py`: on the 128-token,
//! hidden-32 fixture a pass costs almost nothing but dispatch, so only a model whose weights
//! dominate shows what sharing a pass saves.

#[path = "../tests/common/mod.rs"]
mod common;

use abi_stable::sabi_trait::TD_Opaque;
use anyhow::Result;
use std::{
    sync::{Arc, Barrier},
    time::Instant,
};
use u_runner_text::{EngineHandle, Generator, Limits, sampler};
use u_sdk::{EngineBox, GenerateRequest, GeneratedToken, TokenSink, TokenSink_TO};

struct Discard;

impl TokenSink for Discard {
    fn token(&mut self, _: &GeneratedToken<'_>) -> bool {
        true
    }
}

/// Runs `clients` distinct greedy requests at once; returns (tokens generated, seconds from the
/// first client's start to the last one's end, as the clients clock them).
fn round(engine: &EngineBox, clients: usize, tokens: u32) -> Result<(u64, f64)> {
    let gate = Barrier::new(clients);
    std::thread::scope(|s| -> Result<(u64, f64)> {
        let handles: Vec<_> = (0..clients)
            .map(|i| {
                let (engine, gate) = (engine.clone(), &gate);
                s.spawn(move || -> Result<(u64, Instant, Instant)> {
                    let request = GenerateRequest::new(
                        "tiny",
                        &format!("Client {i} asks: what does the quick brown fox do?"),
                        tokens,
                        sampler::greedy(),
                    );
                    gate.wait();
                    let start = Instant::now();
                    let sink = TokenSink_TO::from_value(Discard, TD_Opaque);
                    let summary = engine.generate(&request, sink).into_result()?;
                    Ok((u64::from(summary.generated_tokens), start, Instant::now()))
                })
            })
            .collect();
        let mut runs = Vec::new();
        for h in handles {
            runs.push(h.join().map_err(|_| anyhow::anyhow!("client panicked"))??);
        }
        let first = runs.iter().map(|r| r.1).min().unwrap_or_else(Instant::now);
        let last = runs.iter().map(|r| r.2).max().unwrap_or(first);
        let generated = runs.iter().map(|r| r.0).sum();
        Ok((generated, (last - first).as_secs_f64()))
    })
}

/// Best tokens/s over `rounds` rounds.
fn best(engine: &EngineBox, clients: usize, tokens: u32, rounds: usize) -> Result<f64> {
    let mut best = 0f64;
    for _ in 0..rounds {
        let (n, s) = round(engine, clients, tokens)?;
        best = best.max(n as f64 / s);
    }
    Ok(best)
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let clients = args.first().copied().unwrap_or(16);
    let tokens = args.get(1).copied().unwrap_or(128) as u32;
    let rounds = args.get(2).copied().unwrap_or(5);
    let mut models = vec![
        (
            "llama fixture f32".to_string(),
            common::generator(common::safetensors("llama")?)?.0,
        ),
        (
            "llama fixture q8_0".to_string(),
            common::generator(common::gguf("llama", "model.q8_0.gguf")?)?.0,
        ),
    ];
    if let Some(path) = std::env::var_os("U_ENGINE_BENCH_GGUF") {
        let path = std::path::PathBuf::from(path);
        let weights = u_loader_gguf::open_path(&path)?.into_box();
        let tokenizer = u_tokenizer::Tok::from_meta(&weights)?.into_box();
        let model = common::build(weights)?;
        models.push((
            path.display().to_string(),
            Arc::new(Generator::new(model, Some(tokenizer))?),
        ));
    }
    for (label, g) in models {
        let limits = Limits {
            max_running: clients.max(1),
            ..Limits::default()
        };
        let engine = EngineHandle::with_limits("tiny", g, limits).into_box();
        // Warm-up (thread pools, scratch buffers).
        round(&engine, clients, 8)?;
        let one = best(&engine, 1, tokens, rounds)?;
        let many = best(&engine, clients, tokens, rounds)?;
        println!(
            "{label}: 1 client {one:.0} tok/s, {clients} clients {many:.0} tok/s aggregate, ratio {:.2}x",
            many / one
        );
    }
    Ok(())
}
