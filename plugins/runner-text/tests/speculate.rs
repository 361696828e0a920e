//! Speculative decoding on the tiny Llama: greedy output is the output without speculation,
//! token for token (f32 and Q8_0 weights), whether prompt lookup drafts (proposed and kept on
//! repetitive text) or a draft model does (the Llama's own Q8_0 file, whose drafts it keeps;
//! the tiny Mistral of the same vocabulary, some of whose drafts it turns down); sampled output
//! stays well-formed with the drafts verified by rejection sampling; a draft model of another
//! vocabulary is refused.

mod common;

use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut};
use anyhow::Result;
use u_runner_text::{GenerateOptions, Generator, Speculation, sampler};

fn generator(file: Option<&str>, speculation: Speculation) -> Result<Generator> {
    let weights = match file {
        None => common::safetensors("llama")?,
        Some(f) => common::gguf("llama", f)?,
    };
    let model = common::build_in(weights, common::cache())?;
    Ok(Generator::new(model, Some(common::tiny_tokenizer()?))?.with_speculation(speculation))
}

const OFF: Speculation = Speculation {
    draft_tokens: 0,
    max_running: 0,
};

#[test]
fn greedy_output_is_the_same_with_and_without_drafts() -> Result<()> {
    let on = Speculation {
        draft_tokens: 4,
        max_running: 4,
    };
    let prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return";
    let options = GenerateOptions {
        max_tokens: 48,
        ..GenerateOptions::default()
    };
    // Drafts the model takes whole (its greedy text repeats), and drafts it turns down part
    // of the way (the prompt repeats what the model does not continue with).
    let prompts = [prompt, "yyq x y z x y w x y z x y", "ddq ddw hello world"];
    for file in [None, Some("model.q8_0.gguf")] {
        let (mut drafted, mut kept) = (0, 0);
        for p in prompts {
            let plain = generator(file, OFF)?.generate(p, &options, &mut |_, _| true)?;
            let fast = generator(file, on)?.generate(p, &options, &mut |_, _| true)?;
            assert_eq!(fast.tokens, plain.tokens, "{file:?}: {p:?}");
            assert_eq!(fast.text, plain.text);
            assert_eq!(plain.timings.draft_tokens, 0);
            drafted += fast.timings.draft_tokens;
            kept += fast.timings.accepted_tokens;
        }
        eprintln!("{file:?}: {kept} of {drafted} drafted tokens kept");
        assert!(
            kept > 0 && kept < drafted,
            "{file:?}: {kept} of {drafted} kept"
        );
    }
    Ok(())
}

/// `max_tokens` tokens sampled at `temperature` with a fixed seed.
fn sampled(max_tokens: u32, temperature: f32) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: u_sdk::SamplingParams {
            temperature,
            seed: ROption::RSome(5),
            ..sampler::greedy()
        },
        ..GenerateOptions::default()
    }
}

#[test]
fn sampled_output_is_verified_by_rejection_sampling() -> Result<()> {
    let on = Speculation {
        draft_tokens: 3,
        max_running: 4,
    };
    let options = sampled(40, 0.7);
    let g = generator(None, on)?;
    let out = g.generate("a b a b a b a b", &options, &mut |_, _| true)?;
    assert_eq!(out.tokens.len(), 40);
    assert!(out.timings.draft_tokens > 0, "{:?}", out.timings);
    // The same seed gives the same draws.
    let again = g.generate("a b a b a b a b", &options, &mut |_, _| true)?;
    assert_eq!(again.tokens, out.tokens);
    Ok(())
}

/// The tiny Llama (f32) drafting with fixture `draft` (file `file`, or its safetensors).
fn with_draft_model(
    draft: &str,
    file: Option<&str>,
    speculation: Speculation,
) -> Result<Generator> {
    let weights = match file {
        None => common::safetensors(draft)?,
        Some(f) => common::gguf(draft, f)?,
    };
    let draft = common::build_in(weights, common::cache())?;
    Ok(generator(None, speculation)?.with_draft_model(Some(draft))?)
}

#[test]
fn greedy_output_is_the_same_with_a_draft_model() -> Result<()> {
    let on = Speculation {
        draft_tokens: 4,
        max_running: 4,
    };
    let options = GenerateOptions {
        max_tokens: 40,
        ..GenerateOptions::default()
    };
    let prompts = ["hello world", "the cat sat on the mat", "ddq ddw"];
    for (draft, file) in [("llama", Some("model.q8_0.gguf")), ("mistral", None)] {
        let (mut drafted, mut kept) = (0, 0);
        for p in prompts {
            let plain = generator(None, OFF)?.generate(p, &options, &mut |_, _| true)?;
            let g = with_draft_model(draft, file, on)?;
            let fast = g.generate(p, &options, &mut |_, _| true)?;
            assert_eq!(fast.tokens, plain.tokens, "{draft}: {p:?}");
            assert_eq!(fast.text, plain.text);
            drafted += fast.timings.draft_tokens;
            kept += fast.timings.accepted_tokens;
            // The draft model's sequences continue from what the last request left behind.
            let again = g.generate(p, &options, &mut |_, _| true)?;
            assert_eq!(again.tokens, plain.tokens, "{draft}: {p:?}, second run");
        }
        eprintln!("draft model {draft}: {kept} of {drafted} drafted tokens kept");
        match draft {
            "llama" => assert!(
                kept * 10 >= drafted * 9 && drafted > 40,
                "{kept} of {drafted}"
            ),
            _ => assert!(kept < drafted && drafted > 0, "{kept} of {drafted}"),
        }
    }
    Ok(())
}

#[test]
fn sampling_with_a_draft_model_is_reproducible() -> Result<()> {
    let on = Speculation {
        draft_tokens: 3,
        max_running: 4,
    };
    let options = sampled(40, 2.0);
    let g = with_draft_model("llama", Some("model.q8_0.gguf"), on)?;
    let out = g.generate("a b c", &options, &mut |_, _| true)?;
    assert_eq!(out.tokens.len(), 40);
    // Sampling turns some of the greedy drafts down, so the draft model's sequence is cut back
    // part of the way and goes on from there.
    let t = &out.timings;
    assert!(
        t.accepted_tokens > 0 && t.accepted_tokens < t.draft_tokens,
        "{t:?}"
    );
    let again = g.generate("a b c", &options, &mut |_, _| true)?;
    assert_eq!(again.tokens, out.tokens);
    Ok(())
}

/// A model that says it has one token more than it has: a draft model of another vocabulary.
struct OtherVocabulary(u_sdk::ModelBox);

impl u_sdk::Model for OtherVocabulary {
    fn config(&self) -> RResult<u_sdk::ModelConfig, u_sdk::UError> {
        self.0.config().map(|c| u_sdk::ModelConfig {
            vocab_size: c.vocab_size + 1,
            ..c
        })
    }

    fn cache(&self) -> RResult<ROption<u_sdk::KvCacheBox>, u_sdk::UError> {
        self.0.cache()
    }

    fn forward(
        &self,
        batch: RSlice<'_, u_sdk::SeqChunk<'_>>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), u_sdk::UError> {
        self.0.forward(batch, out)
    }

    fn graft(
        &self,
        dst: u_sdk::SeqId,
        src: u_sdk::SeqId,
        from: u64,
        count: u64,
    ) -> RResult<(), u_sdk::UError> {
        self.0.graft(dst, src, from, count)
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused() -> Result<()> {
    let llama = common::build_in(common::safetensors("llama")?, common::cache())?;
    let draft = u_sdk::ModelBox::new(OtherVocabulary(llama));
    let e = match generator(None, OFF)?.with_draft_model(Some(draft)) {
        Ok(_) => panic!("a draft model of 129 tokens was accepted for a model of 128"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("draft model") && e.contains("129") && e.contains("128"),
        "{e}"
    );
    Ok(())
}
