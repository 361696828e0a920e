//! Conformance with llama.cpp's tokenizer test vectors (`test-tokenizer-0`).
//!
//! For every `ggml-vocab-<name>.gguf` in `../shared/vocab` (relative to the workspace root),
//! `<name>.gguf.inp` holds inputs separated by `\n__ggml_vocab_test__\n` and `<name>.gguf.out`
//! one line of expected ids per input, made by the model's own HF tokenizer. Each input is
//! encoded without BOS and without parsing special tokens, as llama.cpp's test does, and must
//! give exactly those ids; decoding them must give the input back (not for WordPiece, which
//! lowercases and drops accents). A missing vocabulary file fails the test.

mod common;

use common::{cases, load};

fn conformance(name: &str, round_trip: bool) {
    let tok = load(name);
    let cases = cases(name);
    let mut failures = Vec::new();
    let mut rt_failures = Vec::new();
    for (text, want) in &cases {
        let got = tok.encode_with(text, false, false).unwrap();
        if &got != want {
            failures.push(format!("  {text:?}\n    want {want:?}\n    got  {got:?}"));
        }
        if round_trip {
            let back = tok.decode(want, false).unwrap();
            if &back != text {
                rt_failures.push(format!("  {text:?} decoded to {back:?}"));
            }
        }
    }
    let n = cases.len();
    println!(
        "{name}: encode {}/{n} passed; decode round trip {}",
        n - failures.len(),
        if round_trip {
            format!("{}/{n} passed", n - rt_failures.len())
        } else {
            "not checked".into()
        }
    );
    assert!(
        failures.is_empty() && rt_failures.is_empty(),
        "{name}: {} encode failures, {} round-trip failures\n{}\n{}",
        failures.len(),
        rt_failures.len(),
        failures.join("\n"),
        rt_failures.join("\n")
    );
}

#[test]
fn llama_spm() {
    conformance("llama-spm", true);
}

#[test]
fn phi_3() {
    conformance("phi-3", true);
}

#[test]
fn llama_bpe() {
    conformance("llama-bpe", true);
}

#[test]
fn qwen2() {
    conformance("qwen2", true);
}

#[test]
fn gpt_2() {
    conformance("gpt-2", true);
}

#[test]
fn starcoder() {
    conformance("starcoder", true);
}

#[test]
fn mpt() {
    conformance("mpt", true);
}

#[test]
fn bert_bge() {
    conformance("bert-bge", false);
}
