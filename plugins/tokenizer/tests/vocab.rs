//! Conformance with llama.cpp's tokenizer test vectors (`test-tokenizer-0`).
//!
//! For every `ggml-vocab-<name>.gguf` of llama.cpp 0.3.36's `models/` folder that has test
//! vectors (fetched from the llama-cpp-python source archive, see [`common::vocab_dir`]),
//! `<name>.gguf.inp` holds inputs separated by `\n__ggml_vocab_test__\n` and `<name>.gguf.out`
//! one line of expected ids per input, made by the model's own HF tokenizer. Each input is
//! encoded without BOS and without parsing special tokens, as llama.cpp's test does, and must
//! give exactly those ids; decoding them must give the input back (not for WordPiece, which
//! lowercases and drops accents). A missing vocabulary file fails the test.

mod common;

use common::{cases, meta, names_with_vectors};
use u_sdk::MetaValue;
use u_tokenizer::Tok;

/// The vocabularies of the 0.3.36 source archive that carry test vectors: all must be there.
const EXPECTED: [&str; 15] = [
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
];

/// Encodes every case of `name`; returns the report line and the failures.
fn conformance(name: &str, round_trip: bool) -> (String, Vec<String>) {
    let tok = match Tok::from_meta(&meta(name)) {
        Ok(tok) => tok,
        Err(e) => return (format!("{name}: not built: {e}"), vec![e.to_string()]),
    };
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
    let line = format!(
        "{name}: encode {}/{n} passed; decode round trip {}",
        n - failures.len(),
        if round_trip {
            format!("{}/{n} passed", n - rt_failures.len())
        } else {
            "not checked".into()
        }
    );
    let mut all = failures;
    all.extend(rt_failures);
    (line, all)
}

#[test]
fn every_vocabulary_with_test_vectors_passes() {
    let names = names_with_vectors();
    assert_eq!(names, EXPECTED, "the vocabularies with test vectors");
    let mut report = Vec::new();
    let mut failed = Vec::new();
    for name in &names {
        // WordPiece lowercases and drops accents: its decode is not the input.
        let model = match meta(name).get("tokenizer.ggml.model") {
            Some(MetaValue::Str(s)) => s.to_string(),
            _ => String::new(),
        };
        let (line, failures) = conformance(name, model != "bert");
        println!("{line}");
        report.push(line);
        if !failures.is_empty() {
            failed.push(format!(
                "{name}: {} failures\n{}",
                failures.len(),
                failures.join("\n")
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{}\n\n{}",
        report.join("\n"),
        failed.join("\n\n")
    );
}
