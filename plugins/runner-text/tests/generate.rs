//! The engine on the arch-llama fixture models through the single-request [`Generator`].

mod common;

use abi_stable::{sabi_trait::TD_Opaque, std_types::ROption};
use anyhow::{Context, Result};
use common::{build, fixture, gguf, safetensors, tiny_tokenizer};
use serde_json::Value;
use std::sync::Arc;
use u_runner_text::{ChatMessage, GenerateOptions, Generator, sampler};
use u_sdk::SamplingParams;

const MODELS: [&str; 8] = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
];

/// (prompt, transformers' greedy continuation) of each fixture case.
fn cases(model: &str) -> Result<Vec<(Vec<u32>, Vec<u32>)>> {
    let json: Value =
        serde_json::from_slice(&std::fs::read(fixture(model).join("expected.json"))?)?;
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_u64().map(|t| t as u32))
            .collect()
    };
    json["cases"]
        .as_array()
        .context("cases")?
        .iter()
        .map(|c| Ok((ids(&c["prompt"]), ids(&c["generated"]))))
        .collect()
}

fn greedy(max_tokens: u32) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        ..GenerateOptions::default()
    }
}

#[test]
fn greedy_generation_equals_transformers_generate() -> Result<()> {
    for model in MODELS {
        for (format, weights) in [
            ("safetensors", safetensors(model)?),
            ("gguf", gguf(model, "model.gguf")?),
        ] {
            // A small prefill chunk also exercises prompts split over several passes.
            for chunk in [512, 3] {
                let g = Generator::new(build(weights.clone())?, None)?.with_prefill_chunk(chunk);
                for (prompt, expected) in cases(model)? {
                    let out = g.generate_tokens(&prompt, &greedy(32), &mut |_, _| true)?;
                    assert_eq!(
                        out.tokens, expected,
                        "{model} ({format}, prefill chunk {chunk}): prompt {prompt:?}"
                    );
                    assert_eq!(out.finish, "length");
                    assert_eq!(out.timings.prompt_tokens as usize, prompt.len());
                    assert_eq!(out.timings.generated_tokens, 32);
                }
            }
        }
    }
    Ok(())
}

fn llama_with_text() -> Result<Generator> {
    Ok(Generator::new(
        build(safetensors("llama")?)?,
        Some(tiny_tokenizer()?),
    )?)
}

fn sampled(seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_tokens: 24,
        sampling: SamplingParams {
            // The random fixture weights make peaked logits: a high temperature spreads them.
            temperature: 20.0,
            top_k: 64,
            top_p: 0.99,
            seed: ROption::RSome(seed),
            ..sampler::greedy()
        },
        ..GenerateOptions::default()
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_streams_the_decoded_text() -> Result<()> {
    let g = llama_with_text()?;
    let tok = g.tokenizer().unwrap().clone();
    let run = |seed| -> Result<(u_runner_text::Generation, String)> {
        let mut streamed = String::new();
        let out = g.generate("Hello, world", &sampled(seed), &mut |_, piece| {
            streamed.push_str(piece);
            true
        })?;
        Ok((out, streamed))
    };
    let (a, streamed) = run(11)?;
    let (b, _) = run(11)?;
    let (c, _) = run(12)?;
    assert_eq!(a.tokens, b.tokens, "same seed, same tokens");
    assert_ne!(a.tokens, c.tokens, "another seed, other tokens");
    assert_eq!(streamed, a.text);
    let decoded = tok
        .decode(a.tokens.as_slice().into(), false)
        .into_result()?;
    assert_eq!(a.text, decoded.as_str());
    // The prompt was encoded with BOS (id 1), as the tokenizer asks.
    assert_eq!(g.encode("Hi")?, vec![1, 43, 76]);
    Ok(())
}

#[test]
fn stop_strings_and_cancellation_end_generation() -> Result<()> {
    let g = llama_with_text()?;
    let full = g.generate("Hello, world", &sampled(5), &mut |_, _| true)?;
    assert!(full.text.chars().count() >= 10, "{:?}", full.text);
    // Stop at the text's 5th character: everything before it is kept, nothing after.
    let stop: String = full.text.chars().skip(4).take(2).collect();
    let mut options = sampled(5);
    options.stop = vec![stop.clone()];
    let cut = g.generate("Hello, world", &options, &mut |_, _| true)?;
    let at = full.text.find(&stop).unwrap();
    assert_eq!(cut.text, full.text[..at]);
    assert_eq!(cut.finish, "stop");
    assert!(cut.tokens.len() < full.tokens.len());
    // A sink that says stop after 3 tokens cancels.
    let mut n = 0;
    let cancelled = g.generate("Hello, world", &sampled(5), &mut |_, _| {
        n += 1;
        n < 3
    })?;
    assert_eq!(cancelled.finish, "cancelled");
    assert_eq!(cancelled.tokens.len(), 3);
    Ok(())
}

#[test]
fn chat_prompt_renders_the_template_without_doubling_bos() -> Result<()> {
    let g = llama_with_text()?;
    let prompt = g.chat_prompt(&[ChatMessage::new("user", "Hi")])?;
    assert_eq!(prompt, "<s>user: Hi\nassistant:");
    let ids = g.encode(&prompt)?;
    assert_eq!(ids[0], 1);
    assert_ne!(ids[1], 1, "BOS doubled: {ids:?}");
    Ok(())
}

#[test]
fn bad_prompts_get_clear_errors() -> Result<()> {
    let g = llama_with_text()?;
    let e = g
        .generate_tokens(&[], &greedy(4), &mut |_, _| true)
        .unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let e = g
        .generate_tokens(&[5, 128], &greedy(4), &mut |_, _| true)
        .unwrap_err();
    assert!(e.to_string().contains("128"), "{e}");
    let too_long = vec![5u32; g.config().context_length as usize];
    let e = g
        .generate_tokens(&too_long, &greedy(4), &mut |_, _| true)
        .unwrap_err();
    assert!(e.to_string().contains("context"), "{e}");
    // max_tokens is clipped to what the context still holds.
    let near = vec![5u32; g.config().context_length as usize - 3];
    let out = g.generate_tokens(&near, &greedy(10), &mut |_, _| true)?;
    assert_eq!(out.tokens.len(), 3);
    Ok(())
}

#[test]
fn generation_stops_at_the_tokenizers_eos_id() -> Result<()> {
    let g = llama_with_text()?;
    let eos = g
        .tokenizer()
        .unwrap()
        .special_tokens()
        .unwrap()
        .eos
        .to_vec();
    assert_eq!(eos, vec![2], "the tiny tokenizer's </s>");
    // Near-uniform sampling reaches </s> within a few seeds; the run that does must end right
    // before it, where the same seed with `ignore_eos` goes on through it.
    let mut options = sampled(0);
    options.max_tokens = 64;
    for seed in 0..200 {
        options.sampling.seed = ROption::RSome(seed);
        options.ignore_eos = false;
        let stopped = g.generate("Hello, world", &options, &mut |_, _| true)?;
        if stopped.finish != "stop" {
            continue;
        }
        options.ignore_eos = true;
        let through = g.generate("Hello, world", &options, &mut |_, _| true)?;
        let n = stopped.tokens.len();
        assert_eq!(through.tokens[..n], stopped.tokens[..], "seed {seed}");
        assert_eq!(through.tokens[n], 2, "seed {seed}");
        assert!(!stopped.tokens.contains(&2));
        return Ok(());
    }
    anyhow::bail!("no seed in 0..200 produced </s>")
}

#[test]
fn the_abi_engine_streams_into_a_token_sink() -> Result<()> {
    use u_runner_text::EngineHandle;
    use u_sdk::{FinishReason, GenerateRequest, TokenSink, TokenSink_TO};

    struct Collect(std::sync::Arc<std::sync::Mutex<(Vec<u32>, String)>>);
    impl TokenSink for Collect {
        fn token(&mut self, token: &u_sdk::GeneratedToken<'_>) -> bool {
            let mut g = self.0.lock().unwrap();
            g.0.push(token.id);
            g.1.push_str(token.text.as_str());
            true
        }
    }
    let g = Arc::new(llama_with_text()?);
    let engine = EngineHandle::new("tiny", g.clone()).into_box();
    assert_eq!(
        engine.models().unwrap().to_vec(),
        vec![abi_stable::std_types::RString::from("tiny")]
    );
    let seen = std::sync::Arc::new(std::sync::Mutex::new((Vec::new(), String::new())));
    let request = GenerateRequest::new("tiny", "Hello, world", 12, sampled(3).sampling);
    let sink = TokenSink_TO::from_value(Collect(seen.clone()), TD_Opaque);
    let summary = engine.generate(&request, sink).into_result()?;
    assert_eq!(summary.prompt_tokens, 13);
    assert_eq!(summary.generated_tokens, 12);
    assert_eq!(summary.finish, FinishReason::Length);
    let direct = g.generate("Hello, world", &sampled(3), &mut |_, _| true)?;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.0[..12], direct.tokens[..12]);
    assert_eq!(seen.1, direct.text[..seen.1.len()]);
    // Another model name is refused with NotFound.
    let other = GenerateRequest {
        model: "other".into(),
        ..request
    };
    let sink = TokenSink_TO::from_value(Collect(Default::default()), TD_Opaque);
    let e = engine.generate(&other, sink).into_result().unwrap_err();
    assert_eq!(e.kind, u_sdk::ErrorKind::NotFound);
    Ok(())
}
