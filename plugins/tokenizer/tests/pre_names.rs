//! Every pre-tokenizer name llama.cpp 0.3.36 knows, against llama.cpp itself
//! (`tests/fixtures/gen_pre_names.py`): each byte-level test vocabulary of the fixture with its
//! `tokenizer.ggml.pre` replaced by each name must tokenize the fixture's texts (no BOS, special
//! tokens not parsed) to llama.cpp's ids. An unknown name is a clear error.

mod common;

use common::meta;
use serde_json::Value;
use u_sdk::{ErrorKind, MetaValue};
use u_tokenizer::Tok;

#[test]
fn every_pre_tokenizer_name_equals_llama_cpp() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/pre_names.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let texts: Vec<&str> = fx["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let results = fx["results"].as_array().unwrap();
    let mut checked = 0;
    let mut failures = Vec::new();
    for (base, names) in fx["names"].as_object().unwrap() {
        let mut m = meta(base);
        for (name, index) in names.as_object().unwrap() {
            m.insert(
                "tokenizer.ggml.pre".into(),
                MetaValue::Str(name.as_str().into()),
            );
            let tok = Tok::from_meta(&m).unwrap_or_else(|e| panic!("{base} with {name}: {e}"));
            let want = results[index.as_u64().unwrap() as usize]
                .as_array()
                .unwrap();
            for (text, want) in texts.iter().zip(want) {
                let want: Vec<u32> = want
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect();
                let got = tok.encode_with(text, false, false).unwrap();
                if got != want {
                    failures.push(format!(
                        "{base} {name}: {text:?}\n    want {want:?}\n    got  {got:?}"
                    ));
                }
                checked += 1;
            }
        }
    }
    println!(
        "{checked} (vocabulary, name, text) cases, {} differ",
        failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {checked} differ:\n{}",
        failures.len(),
        failures[..failures.len().min(30)].join("\n")
    );
    assert!(checked >= 2 * 90 * texts.len(), "{checked} cases");
}

#[test]
fn an_unknown_pre_tokenizer_is_named() {
    let mut m = meta("qwen2");
    m.insert(
        "tokenizer.ggml.pre".into(),
        MetaValue::Str("not-a-pre-tokenizer".into()),
    );
    let e = Tok::from_meta(&m)
        .err()
        .expect("an unknown name was accepted");
    assert_eq!(e.kind, ErrorKind::Unsupported);
    assert!(e.message.contains("\"not-a-pre-tokenizer\""), "{e}");
}
