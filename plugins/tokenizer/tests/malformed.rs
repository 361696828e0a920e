//! Malformed metadata and inputs give a clear error, never a panic.

mod common;

use abi_stable::std_types::{RString, RVec};
use std::collections::HashMap;
use u_sdk::{ErrorKind, MetaValue, UError};
use u_tokenizer::Tok;

fn strs(v: &[&str]) -> MetaValue {
    MetaValue::StrArray(v.iter().map(|s| RString::from(*s)).collect())
}

fn ints(v: &[i64]) -> MetaValue {
    MetaValue::IntArray(RVec::from(v.to_vec()))
}

/// A small valid byte-level BPE vocabulary.
fn gpt2() -> HashMap<String, MetaValue> {
    let mut m = HashMap::new();
    m.insert("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into()));
    m.insert("tokenizer.ggml.pre".into(), MetaValue::Str("gpt-2".into()));
    m.insert(
        "tokenizer.ggml.tokens".into(),
        strs(&["a", "b", "ab", "Ġ", "<|endoftext|>"]),
    );
    m.insert("tokenizer.ggml.token_type".into(), ints(&[1, 1, 1, 1, 3]));
    m.insert("tokenizer.ggml.merges".into(), strs(&["a b"]));
    m.insert("tokenizer.ggml.eos_token_id".into(), MetaValue::UInt(4));
    m
}

/// A small valid SentencePiece vocabulary.
fn spm() -> HashMap<String, MetaValue> {
    let mut m = HashMap::new();
    m.insert(
        "tokenizer.ggml.model".into(),
        MetaValue::Str("llama".into()),
    );
    m.insert(
        "tokenizer.ggml.tokens".into(),
        strs(&["<unk>", "<s>", "</s>", "▁", "a", "▁a"]),
    );
    m.insert(
        "tokenizer.ggml.scores".into(),
        MetaValue::FloatArray(RVec::from(vec![0.0, 0.0, 0.0, -1.0, -2.0, -0.5])),
    );
    m.insert(
        "tokenizer.ggml.token_type".into(),
        ints(&[2, 3, 3, 1, 1, 1]),
    );
    m
}

fn err(m: HashMap<String, MetaValue>) -> UError {
    match Tok::from_meta(&m) {
        Ok(_) => panic!("malformed metadata was accepted"),
        Err(e) => e,
    }
}

fn expect(m: HashMap<String, MetaValue>, kind: ErrorKind, needle: &str) {
    let e = err(m);
    assert_eq!(e.kind, kind, "{e}");
    assert!(
        e.message.contains(needle),
        "error {:?} should mention {needle:?}",
        e.message.as_str()
    );
}

#[test]
fn valid_fixtures_build_and_encode() {
    let t = Tok::from_meta(&gpt2()).unwrap();
    assert_eq!(t.encode("ab", false).unwrap(), vec![2]);
    assert_eq!(t.encode("a b", false).unwrap(), vec![0, 3, 1]);
    let t = Tok::from_meta(&spm()).unwrap();
    assert_eq!(t.encode("a a", true).unwrap(), vec![1, 5, 5]);
}

#[test]
fn missing_model_key() {
    let mut m = gpt2();
    m.remove("tokenizer.ggml.model");
    expect(m, ErrorKind::NotFound, "tokenizer.ggml.model");
}

#[test]
fn missing_vocabulary() {
    let mut m = gpt2();
    m.remove("tokenizer.ggml.tokens");
    expect(m, ErrorKind::NotFound, "tokenizer.ggml.tokens");
}

#[test]
fn empty_vocabulary() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.tokens".into(), strs(&[]));
    expect(m, ErrorKind::InvalidInput, "empty");
}

#[test]
fn vocabulary_of_the_wrong_type() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.tokens".into(), ints(&[1, 2]));
    expect(m, ErrorKind::InvalidInput, "expected a string array");
}

#[test]
fn duplicate_tokens() {
    let mut m = gpt2();
    m.insert(
        "tokenizer.ggml.tokens".into(),
        strs(&["a", "b", "ab", "a", "x"]),
    );
    expect(m, ErrorKind::InvalidInput, "duplicate token");
}

#[test]
fn scores_length_mismatch() {
    let mut m = spm();
    m.insert(
        "tokenizer.ggml.scores".into(),
        MetaValue::FloatArray(RVec::from(vec![0.0; 3])),
    );
    expect(
        m,
        ErrorKind::InvalidInput,
        "tokenizer.ggml.scores has 3 entries",
    );
}

#[test]
fn token_type_length_mismatch() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.token_type".into(), ints(&[1, 1]));
    expect(
        m,
        ErrorKind::InvalidInput,
        "tokenizer.ggml.token_type has 2 entries",
    );
}

#[test]
fn unknown_token_type() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.token_type".into(), ints(&[1, 1, 9, 1, 3]));
    expect(m, ErrorKind::InvalidInput, "token_type[2] = 9");
}

#[test]
fn special_id_out_of_range() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.bos_token_id".into(), MetaValue::UInt(99));
    expect(
        m,
        ErrorKind::InvalidInput,
        "bos_token_id = 99 is out of range",
    );
    let mut m = spm();
    m.insert("tokenizer.ggml.eos_token_id".into(), MetaValue::UInt(6));
    expect(m, ErrorKind::InvalidInput, "eos_token_id = 6");
}

#[test]
fn special_id_of_the_wrong_type() {
    let mut m = gpt2();
    m.insert(
        "tokenizer.ggml.eos_token_id".into(),
        MetaValue::Str("4".into()),
    );
    expect(m, ErrorKind::InvalidInput, "expected a token id");
}

#[test]
fn add_bos_without_bos() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.add_bos_token".into(), MetaValue::Bool(true));
    expect(m, ErrorKind::InvalidInput, "no BOS token");
}

#[test]
fn missing_merges() {
    let mut m = gpt2();
    m.remove("tokenizer.ggml.merges");
    expect(m, ErrorKind::NotFound, "tokenizer.ggml.merges");
}

#[test]
fn merge_without_separator() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.merges".into(), strs(&["ab"]));
    expect(
        m,
        ErrorKind::InvalidInput,
        "merges[0] = \"ab\" is not two tokens",
    );
}

#[test]
fn merge_of_unknown_tokens() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.merges".into(), strs(&["a b", "a z"]));
    expect(
        m,
        ErrorKind::InvalidInput,
        "merges[1] = \"a z\": \"z\" is not in the vocabulary",
    );
}

#[test]
fn merge_whose_result_is_not_a_token() {
    let mut m = gpt2();
    m.insert("tokenizer.ggml.merges".into(), strs(&["b a"]));
    expect(m, ErrorKind::InvalidInput, "merged token \"ba\"");
}

#[test]
fn unsupported_model_and_pre_tokenizer() {
    let mut m = gpt2();
    m.insert(
        "tokenizer.ggml.model".into(),
        MetaValue::Str("plamo2".into()),
    );
    expect(m, ErrorKind::Unsupported, "\"plamo2\"");
    let mut m = gpt2();
    m.insert(
        "tokenizer.ggml.pre".into(),
        MetaValue::Str("no-such-pre".into()),
    );
    expect(m, ErrorKind::Unsupported, "no-such-pre");
}

#[test]
fn bert_without_unknown_token() {
    let mut m = HashMap::new();
    m.insert("tokenizer.ggml.model".into(), MetaValue::Str("bert".into()));
    m.insert("tokenizer.ggml.tokens".into(), strs(&["[PAD]", "▁a"]));
    m.insert(
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(false),
    );
    m.insert(
        "tokenizer.ggml.add_sep_token".into(),
        MetaValue::Bool(false),
    );
    expect(m, ErrorKind::InvalidInput, "unknown_token_id");
}

#[test]
fn bad_ids_in_decode_and_token_bytes() {
    let t = Tok::from_meta(&gpt2()).unwrap();
    let e = t.decode(&[0, 5], false).unwrap_err();
    assert!(e.message.contains("token id 5 is out of range"), "{e}");
    assert!(t.token_bytes(u32::MAX).is_err());
    assert_eq!(t.decode(&[0, 3, 1], false).unwrap(), "a b");
}

#[test]
fn malformed_tokenizer_json() {
    for bad in ["", "{", "{\"model\": 3}", "[]"] {
        let e = Tok::from_json(bad, None)
            .err()
            .expect("accepted a bad tokenizer.json");
        assert_eq!(e.kind, ErrorKind::InvalidInput, "{e}");
        assert!(e.message.contains("tokenizer.json"), "{e}");
    }
    let json = common::tiny_tokenizer_json();
    let e = Tok::from_json(&json, Some("{not json")).err().unwrap();
    assert!(e.message.contains("tokenizer_config.json"), "{e}");
}
