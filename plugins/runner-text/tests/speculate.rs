//! Prompt-lookup speculative decoding on the tiny Llama: greedy output is the output without
//! speculation, token for token (f32 and Q8_0 weights), drafts are proposed and kept on
//! repetitive text, and sampled output stays well-formed with the drafts verified by
//! rejection sampling.

mod common;

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

#[test]
fn sampled_output_is_verified_by_rejection_sampling() -> Result<()> {
    let on = Speculation {
        draft_tokens: 3,
        max_running: 4,
    };
    let options = GenerateOptions {
        max_tokens: 40,
        sampling: u_sdk::SamplingParams {
            temperature: 0.7,
            seed: abi_stable::std_types::ROption::RSome(5),
            ..sampler::greedy()
        },
        ..GenerateOptions::default()
    };
    let g = generator(None, on)?;
    let out = g.generate("a b a b a b a b", &options, &mut |_, _| true)?;
    assert_eq!(out.tokens.len(), 40);
    assert!(out.timings.draft_tokens > 0, "{:?}", out.timings);
    // The same seed gives the same draws.
    let again = g.generate("a b a b a b a b", &options, &mut |_, _| true)?;
    assert_eq!(again.tokens, out.tokens);
    Ok(())
}
