//! `u-runner bench`: prompt-processing and token-generation speed of one model, measured the
//! way llama.cpp's `llama-bench` measures them, so both can run on the same file side by side
//! (`tests/bench/llama_bench.py` prints the ratios).
//!
//! The model is opened and wired exactly as for `u-runner generate` ([`wiring::open`]), and
//! `Model::forward` is timed directly:
//!
//! - **ppP**: `P` random token ids on a fresh sequence, in the engine's prefill chunks
//!   ([`PREFILL_CHUNK`] tokens per forward pass, as the text runner prefills), logits for the
//!   last token
//!   only — llama-bench's `pp` (one batch, last logits). Rate: `P` ÷ time.
//! - **tgN**: `N` single-token forward passes on a fresh sequence, each producing its logits,
//!   each fed a random token id (no sampling) — llama-bench's `tg`. Rate: `N` ÷ time.
//! - **`-d D`** (llama-bench's `-d`): each run first fills the fresh sequence with `D` random
//!   tokens in prefill chunks, untimed, so `pp`/`tg` measure at that context depth (named
//!   `pp512 @ d4096` as llama-bench names them).
//!
//! Each test runs once untimed (warm-up: page faults on the mapped weights, scratch buffers)
//! and then `--reps` times; the mean and sample standard deviation of the per-rep rates are
//! reported, as llama-bench does.

use crate::{load_default, threads};
use abi_stable::std_types::{RSlice, RSliceMut};
use anyhow::{Context, Result, anyhow};
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;
use u_runner::wiring;
use u_sdk::{KvCacheBox, ModelBox, ModelCounter, Output, Rows, Segment, SeqChunk, SeqId};

/// Prompt tokens per prefill pass (the text runner's default chunk).
pub const PREFILL_CHUNK: usize = 512;

/// Random token ids (SplitMix64): reproducible from `--seed`.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Options of `u-runner bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// The model file (or model directory).
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// Prompt tokens of the prompt-processing test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: u32,
    /// Tokens of the generation test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: u32,
    /// Context depth: tokens already in the sequence (prefilled untimed) before each test.
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    n_depth: u32,
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long, short = 't')]
    threads: Option<u32>,
    /// Timed repetitions of each test (after one untimed warm-up).
    #[arg(long, short = 'r', default_value_t = 5)]
    reps: u32,
    /// Seed of the random prompt token ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON array, one object per test (field names as llama-bench's `-o json`).
    #[arg(long)]
    json: bool,
    /// The deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// Mean and sample standard deviation (n − 1; 0 for one sample).
fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 {
        xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)
    } else {
        0.0
    };
    (mean, var.sqrt())
}

/// The lengths of one test: tokens already in the sequence, prompt tokens, generated tokens.
#[derive(Clone, Copy)]
struct Test {
    depth: u32,
    prompt: u32,
    gen_tokens: u32,
}

/// Seconds of one test on a fresh sequence filled with `test.depth` tokens first (untimed):
/// `test.prompt` tokens in prefill chunks, or `test.gen_tokens` single-token passes.
fn run_once(
    model: &ModelBox,
    cache: &KvCacheBox,
    vocab: u32,
    rng: &mut Rng,
    test: Test,
) -> Result<f64> {
    let vocab = u64::from(vocab.max(1));
    let mut draw =
        |n: u32| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect() };
    let (depth, prompt, generated) = (draw(test.depth), draw(test.prompt), draw(test.gen_tokens));
    let mut logits = vec![0f32; vocab as usize];
    let seq = cache
        .create()
        .into_result()
        .map_err(|e| anyhow!("cache.create: {e}"))?;
    let filled = depth
        .chunks(PREFILL_CHUNK)
        .try_for_each(|chunk| forward(model, seq, chunk, &mut []));
    if let Err(e) = filled {
        let _ = cache.release(seq);
        return Err(e);
    }
    let start = Instant::now();
    let chunks = prompt.len().div_ceil(PREFILL_CHUNK);
    let result = prompt
        .chunks(PREFILL_CHUNK)
        .enumerate()
        .try_for_each(|(i, chunk)| {
            if i + 1 == chunks {
                forward(model, seq, chunk, &mut logits)
            } else {
                forward(model, seq, chunk, &mut [])
            }
        })
        .and_then(|()| {
            generated
                .iter()
                .try_for_each(|t| forward(model, seq, std::slice::from_ref(t), &mut logits))
        })
        .map(|()| start.elapsed().as_secs_f64());
    // Releasing can only fail for an unknown sequence; the result matters more.
    let _ = cache.release(seq);
    result
}

/// One forward pass of `tokens` appended to `seq`; the last token's logits go to `logits`
/// unless it is empty.
fn forward(model: &ModelBox, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
    let input = [Segment::Tokens(RSlice::from_slice(tokens))];
    let output = if logits.is_empty() {
        Output::Nothing
    } else {
        Output::Logits(Rows::Last)
    };
    let chunk = [SeqChunk::tokens(seq, &input, output)];
    model
        .forward(
            RSlice::from_slice(&chunk),
            RSliceMut::from_mut_slice(logits),
        )
        .into_result()
        .map_err(|e| anyhow!("model.forward: {e}"))
}

/// The model's own counters ([`u_sdk::Model::counters`]).
fn counters(model: &ModelBox) -> Result<Vec<ModelCounter>> {
    Ok(model
        .counters()
        .into_result()
        .map_err(|e| anyhow!("model.counters: {e}"))?
        .into_vec())
}

/// What the counters counted between `before` and `after` (running totals), or their level at
/// the end (gauges), by name.
fn counted_during(before: &[ModelCounter], after: &[ModelCounter]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for c in after {
        let start = before
            .iter()
            .find(|b| b.name == c.name && !c.gauge)
            .map_or(0.0, |b| b.value);
        out.insert(c.name.to_string(), json!(c.value - start));
    }
    out.into()
}

/// Runs `u-runner bench`.
pub fn run(args: BenchArgs) -> Result<i32> {
    let d = load_default(args.deployment)?;
    let threads = args.threads.unwrap_or_else(|| threads(&d)).max(1);
    let opened = wiring::open(&d, &args.model, threads, wiring::Want::Model)?;
    let model = opened.model.context("no model was built")?;
    let (_, config) = opened.built.context("no model was built")?;
    let family = config.family;
    let cache = model
        .cache()
        .into_result()
        .map_err(|e| anyhow!("model.cache: {e}"))?
        .into_option()
        .context("the model keeps no KV cache: `bench` measures decoders")?;
    let tensors = opened
        .weights
        .tensors()
        .into_result()
        .map_err(|e| anyhow!("{}: {e}", opened.loader))?;
    let size: u64 = tensors.iter().map(|t| t.byte_len).sum();
    let params: u64 = tensors
        .iter()
        .map(|t| t.shape.iter().product::<u64>())
        .sum();
    let mut rng = Rng(args.seed);
    let reps = args.reps.max(1);
    let tests = [(args.n_prompt, 0), (0, args.n_gen)]
        .into_iter()
        .filter(|&(p, n)| p + n > 0);
    let depth = args.n_depth;
    let mut results = Vec::new();
    for (n_prompt, n_gen) in tests {
        let vocab = config.vocab_size;
        let test = Test {
            depth,
            prompt: n_prompt,
            gen_tokens: n_gen,
        };
        run_once(&model, &cache, vocab, &mut rng, test)?;
        let before = counters(&model)?;
        let secs = (0..reps)
            .map(|_| run_once(&model, &cache, vocab, &mut rng, test))
            .collect::<Result<Vec<f64>>>()?;
        let counted = counted_during(&before, &counters(&model)?);
        let n = f64::from(n_prompt + n_gen);
        let ts: Vec<f64> = secs.iter().map(|s| n / s).collect();
        let ns: Vec<u64> = secs.iter().map(|s| (s * 1e9).round() as u64).collect();
        let (avg_ts, stddev_ts) = mean_std(&ts);
        let (avg_s, stddev_s) = mean_std(&secs);
        let mut test = if n_gen == 0 {
            format!("pp{n_prompt}")
        } else {
            format!("tg{n_gen}")
        };
        if depth > 0 {
            test.push_str(&format!(" @ d{depth}"));
        }
        if !args.json {
            if results.is_empty() {
                println!("| model | size | params | threads | test | t/s |");
                println!("| --- | ---: | ---: | ---: | ---: | ---: |");
            }
            println!(
                "| {family} | {:.2} MiB | {:.2} M | {threads} | {test} | {avg_ts:.2} ± {stddev_ts:.2} |",
                size as f64 / f64::from(1u32 << 20),
                params as f64 / 1e6,
            );
        }
        results.push(json!({
            "model_filename": args.model.display().to_string(),
            "model_type": family.as_str(),
            "model_size": size,
            "model_n_params": params,
            "n_threads": threads,
            "n_prompt": n_prompt,
            "n_gen": n_gen,
            "n_depth": depth,
            "loader": opened.loader,
            "avg_ns": (avg_s * 1e9).round() as u64,
            "stddev_ns": (stddev_s * 1e9).round() as u64,
            "avg_ts": avg_ts,
            "stddev_ts": stddev_ts,
            "samples_ns": ns,
            "samples_ts": ts,
            "model_counters": counted,
        }));
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(0)
}
