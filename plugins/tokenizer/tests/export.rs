//! A byte-level BPE `tokenizer.json` written as GGUF metadata ([`Tok::gguf_metadata`]).
//!
//! The `tokenizer.json` files are made here from llama.cpp's test vocabularies: their tokens,
//! types and merges, and their pre-tokenizer written as HF writes it for that model family
//! (GPT-2's byte-level regex; a `Split` on the Llama 3 or Qwen2 pattern before a byte-level
//! step; StarCoder's single digits). The export must name a pre-tokenizer of the original's
//! splitting, and encode every test vector to the ids llama.cpp's HF reference gave
//! (`.inp`/`.out`), through this plugin's llama.cpp tokenizer.

mod common;

use common::{cases, meta};
use serde_json::{Value, json};
use std::collections::HashMap;
use u_sdk::MetaValue;
use u_tokenizer::{Tok, llama::pre::Pre};

/// A `tokenizer.json` of GGUF vocabulary `name` with `pre_tokenizer`.
fn tokenizer_json(name: &str, pre_tokenizer: Value, ignore_merges: bool) -> String {
    let m = meta(name);
    let strings = |k: &str| match &m[k] {
        MetaValue::StrArray(v) => v.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        other => panic!("{k}: {other:?}"),
    };
    let tokens = strings("tokenizer.ggml.tokens");
    let merges = strings("tokenizer.ggml.merges");
    let types: Vec<i64> = match &m["tokenizer.ggml.token_type"] {
        MetaValue::IntArray(v) => v.to_vec(),
        other => panic!("token_type: {other:?}"),
    };
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = types
        .iter()
        .enumerate()
        .filter(|(_, t)| matches!(t, 3 | 4))
        .map(|(i, &t)| {
            json!({"id": i, "content": tokens[i], "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t == 3})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                  "vocab": vocab, "merges": merges},
    })
    .to_string()
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
           "use_regex": use_regex})
}

/// HF's `Split` on pre-tokenizer `pre`'s (single) pattern, then bytes.
fn split_then_bytes(pre: &str) -> Value {
    let (patterns, _) = Pre::by_name(pre).expect(pre).group.patterns();
    assert_eq!(patterns.len(), 1, "{pre}");
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": patterns[0]}, "behavior": "Isolated",
         "invert": false},
        byte_level(false),
    ]})
}

#[test]
fn byte_level_tokenizer_json_exports_as_llama_cpp_tokenizes_it() {
    let digits = json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true}, byte_level(true)]});
    let families = [
        ("gpt-2", byte_level(true), false),
        ("llama-bpe", split_then_bytes("llama-bpe"), true),
        ("qwen2", split_then_bytes("qwen2"), false),
        ("starcoder", digits, false),
    ];
    let mut report = Vec::new();
    for (name, pre_tokenizer, ignore_merges) in families {
        let json = tokenizer_json(name, pre_tokenizer, ignore_merges);
        let hf = Tok::from_json(&json, None).expect(name);
        let exported: HashMap<String, MetaValue> = hf
            .gguf_metadata()
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .into_iter()
            .collect();
        assert_eq!(
            exported["tokenizer.ggml.model"],
            MetaValue::Str("gpt2".into())
        );
        let MetaValue::Str(pre) = &exported["tokenizer.ggml.pre"] else {
            panic!("{name}: no pre name");
        };
        let MetaValue::Str(original) = &meta(name)["tokenizer.ggml.pre"] else {
            panic!("{name}: the vocabulary names no pre-tokenizer");
        };
        assert_eq!(
            Pre::by_name(pre).map(|p| p.group),
            Pre::by_name(original).map(|p| p.group),
            "{name}: exported as {pre}, the vocabulary says {original}"
        );
        let tok = Tok::from_meta(&exported).expect(name);
        let cases = cases(name);
        let wrong: Vec<String> = cases
            .iter()
            .filter(|(text, want)| &tok.encode_with(text, false, false).unwrap() != want)
            .map(|(text, _)| format!("{text:?}"))
            .collect();
        report.push(format!(
            "{name}: pre {pre}, {}/{} vectors",
            cases.len() - wrong.len(),
            cases.len()
        ));
        assert!(wrong.is_empty(), "{name} (pre {pre}): {wrong:?}");
    }
    println!("{}", report.join("\n"));
}

/// What GGUF cannot describe is refused, not guessed: a tokenizer.json whose splitting no
/// llama.cpp pre-tokenizer reproduces (here: none at all), and a tokenizer that came from GGUF.
#[test]
fn what_gguf_cannot_describe_is_refused() {
    let json = tokenizer_json("gpt-2", Value::Null, false);
    let e = Tok::from_json(&json, None)
        .unwrap()
        .gguf_metadata()
        .expect_err("no pre-tokenizer");
    assert!(
        e.message.contains("none of llama.cpp's pre-tokenizers"),
        "{}",
        e.message
    );
    let e = Tok::from_meta(&meta("gpt-2"))
        .unwrap()
        .gguf_metadata()
        .expect_err("from GGUF");
    assert!(e.message.contains("GGUF metadata"), "{}", e.message);
}
