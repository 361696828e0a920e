//! The unigram (T5-style, `t5`) and RWKV (`rwkv`) tokenizers against llama.cpp's own output
//! (`tests/fixtures/gen_ugm_rwkv.py`, llama-cpp-python 0.3.36): the unigram model on the
//! `nomic-bert-moe` test vocabulary with its precompiled character map, and RWKV's "world"
//! vocabulary rebuilt from the tokens the fixture keeps. No BOS/EOS, special tokens not parsed.

mod common;

use abi_stable::std_types::{RString, RVec};
use common::meta;
use serde_json::Value;
use std::collections::HashMap;
use u_sdk::MetaValue;
use u_tokenizer::Tok;

fn fixture() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ugm_rwkv.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("json")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn compare(name: &str, tok: &Tok, fx: &Value, want: &Value) {
    let texts = fx["texts"].as_array().expect("texts");
    let want = want.as_array().expect("expected ids");
    assert_eq!(texts.len(), want.len());
    let mut failures = Vec::new();
    for (text, want) in texts.iter().zip(want) {
        let text = text.as_str().expect("text");
        let got = tok.encode_with(text, false, false).expect("encode");
        if got != ids(want) {
            failures.push(format!(
                "  {text:?}\n    want {:?}\n    got  {got:?}",
                ids(want)
            ));
        }
    }
    println!(
        "{name}: {}/{} texts equal llama.cpp's",
        texts.len() - failures.len(),
        texts.len()
    );
    assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
}

#[test]
fn unigram_equals_llama_cpp() {
    let fx = fixture();
    let tok = Tok::from_meta(&meta(fx["ugm"]["vocab"].as_str().unwrap())).expect("unigram");
    compare("t5 (nomic-bert-moe)", &tok, &fx, &fx["ugm"]["ids"]);
}

#[test]
fn rwkv_equals_llama_cpp() {
    let fx = fixture();
    let n = fx["rwkv"]["vocab_size"].as_u64().unwrap() as usize;
    let kept = fx["rwkv"]["tokens"].as_object().unwrap();
    let mut tokens: Vec<RString> = (0..n).map(|i| format!("[PAD{i}]").into()).collect();
    let mut types: Vec<i64> = vec![5; n];
    tokens[0] = "<s>".into();
    types[0] = 3;
    for (id, text) in kept {
        let id: usize = id.parse().unwrap();
        tokens[id] = text.as_str().unwrap().into();
        types[id] = 1;
    }
    let mut m = HashMap::new();
    m.insert(
        "tokenizer.ggml.model".to_string(),
        MetaValue::Str("rwkv".into()),
    );
    m.insert(
        "tokenizer.ggml.tokens".to_string(),
        MetaValue::StrArray(RVec::from(tokens)),
    );
    m.insert(
        "tokenizer.ggml.token_type".to_string(),
        MetaValue::IntArray(RVec::from(types)),
    );
    let tok = Tok::from_meta(&m).expect("rwkv");
    compare("rwkv (world)", &tok, &fx, &fx["rwkv"]["ids"]);
    // Decoding gives the bytes back.
    let text = "Hello world 123\n";
    let got = tok.encode_with(text, false, false).unwrap();
    assert_eq!(tok.decode(&got, false).unwrap(), text);
}
