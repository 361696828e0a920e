//! Special tokens, decoding (byte fallback, partial UTF-8, skip_special), tokenizer.json,
//! llama.cpp's per-token round trip, and the plugin through its ABI objects.

mod common;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RStr, RString, RVec},
};
use common::{cases, load, meta, tiny_tokenizer_json};
use std::{collections::HashMap, os::fd::IntoRawFd, path::PathBuf};
use u_sdk::{
    ErrorKind, Host, Host_TO, HostBox, LogLevel, MetaValue, PluginInstance, TensorInfo, TensorView,
    TokenizerFactoryBox, UError, WeightSet, WeightSet_TO, WriteMode,
};
use u_tokenizer::{Tok, vocab::TokenType};

const ALL: [&str; 8] = [
    "llama-spm",
    "phi-3",
    "llama-bpe",
    "qwen2",
    "gpt-2",
    "starcoder",
    "mpt",
    "bert-bge",
];

/// Feeds token bytes one token at a time and emits only complete UTF-8, as a streaming client
/// would.
fn stream(tok: &Tok, ids: &[u32]) -> String {
    let mut pending = Vec::new();
    let mut out = String::new();
    for &id in ids {
        pending.extend(tok.token_bytes(id).unwrap());
        let valid = match std::str::from_utf8(&pending) {
            Ok(s) => s.len(),
            Err(e) => e.valid_up_to(),
        };
        out.push_str(std::str::from_utf8(&pending[..valid]).unwrap());
        pending.drain(..valid);
    }
    out.push_str(&String::from_utf8_lossy(&pending));
    out
}

#[test]
fn add_special_follows_the_model() {
    let spm = load("llama-spm");
    assert_eq!(
        spm.encode("Hello world", true).unwrap(),
        vec![1, 15043, 3186]
    );
    let bpe = load("llama-bpe");
    assert_eq!(
        bpe.encode("Hello world", true).unwrap(),
        vec![128000, 9906, 1917]
    );
    let gpt2 = load("gpt-2");
    assert_eq!(
        gpt2.encode("Hello world", true).unwrap(),
        gpt2.encode("Hello world", false).unwrap()
    );
    let bert = load("bert-bge");
    let ids = bert.encode("Hello world", true).unwrap();
    assert_eq!((ids[0], *ids.last().unwrap()), (101, 102));
    assert_eq!(
        &ids[1..ids.len() - 1],
        bert.encode("Hello world", false).unwrap().as_slice()
    );
}

#[test]
fn special_tokens_and_templates() {
    let s = load("llama-bpe").special_tokens();
    assert_eq!(s.bos, ROption::RSome(128000));
    assert!(s.add_bos);
    assert!(
        s.eos.contains(&128001) && s.eos.contains(&128009),
        "{:?}",
        s.eos
    );
    let q = load("qwen2");
    let s = q.special_tokens();
    assert!(!s.add_bos);
    assert!(
        s.eos.contains(&151643) && s.eos.contains(&151645),
        "{:?}",
        s.eos
    );
    assert!(q.chat_template().unwrap().contains("<|im_start|>"));
    let p = load("phi-3");
    assert!(p.special_tokens().eos.contains(&32000));
    assert!(
        p.special_tokens().eos.contains(&32007),
        "<|end|> ends a turn"
    );
    assert!(load("gpt-2").chat_template().is_none());
}

#[test]
fn special_tokens_in_text_are_parsed_only_when_asked() {
    let q = load("qwen2");
    let text = "<|im_start|>user\nHi<|im_end|>";
    let parsed = q.encode_with(text, false, true).unwrap();
    assert_eq!(parsed.first(), Some(&151644));
    assert_eq!(parsed.last(), Some(&151645));
    let plain = q.encode_with(text, false, false).unwrap();
    assert!(!plain.contains(&151644) && !plain.contains(&151645));
    assert_eq!(
        q.decode(&plain, true).unwrap(),
        text,
        "plain text survives skip_special"
    );
    assert_eq!(q.decode(&parsed, false).unwrap(), text);
    assert_eq!(q.decode(&parsed, true).unwrap(), "user\nHi");
    // SentencePiece: a space prefix follows a special token, as in llama.cpp.
    let spm = load("llama-spm");
    let ids = spm.encode_with("<s>Hi", false, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(spm.decode(&ids, true).unwrap(), "Hi");
}

#[test]
fn skip_special_drops_bos_and_eos() {
    let spm = load("llama-spm");
    let ids = spm.encode("Hello world", true).unwrap();
    assert_eq!(spm.decode(&ids, true).unwrap(), "Hello world");
    assert_eq!(spm.decode(&ids, false).unwrap(), "<s> Hello world");
    let mut ids = load("llama-bpe").encode("Hi", true).unwrap();
    ids.push(128009);
    let bpe = load("llama-bpe");
    assert_eq!(bpe.decode(&ids, true).unwrap(), "Hi");
    assert_eq!(
        bpe.decode(&ids, false).unwrap(),
        "<|begin_of_text|>Hi<|eot_id|>"
    );
}

#[test]
fn byte_fallback_and_partial_utf8() {
    let spm = load("llama-spm");
    // U+1F999 (llama) is not in the SentencePiece vocabulary: four byte tokens.
    let ids = spm.encode(" 🦙", false).unwrap();
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&i| spm.token_bytes(i).unwrap()).collect();
    assert!(
        bytes
            .iter()
            .filter(|b| b.len() == 1 && b[0] >= 0x80)
            .count()
            == 4,
        "{bytes:?}"
    );
    assert_eq!(
        bytes.concat(),
        "  🦙".as_bytes(),
        "the space prefix plus the text"
    );
    assert_eq!(spm.decode(&ids, false).unwrap(), " 🦙");
    // A prefix that ends inside the character decodes lossily; streaming holds it back.
    assert!(
        spm.decode(&ids[..ids.len() - 1], false)
            .unwrap()
            .ends_with('\u{FFFD}')
    );
    assert_eq!(stream(&spm, &ids), "  🦙");

    // Byte-level BPE splits emoji into tokens that are not UTF-8 on their own.
    let bpe = load("llama-bpe");
    let text = "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～";
    let ids = bpe.encode(text, false).unwrap();
    assert!(
        ids.iter()
            .any(|&i| std::str::from_utf8(&bpe.token_bytes(i).unwrap()).is_err())
    );
    assert_eq!(stream(&bpe, &ids), text);
    assert_eq!(bpe.decode(&ids, false).unwrap(), text);
}

#[test]
fn streaming_equals_decode_on_every_vector() {
    for name in ALL {
        let tok = load(name);
        for (text, ids) in cases(name) {
            let whole = String::from_utf8(tok.decode_bytes(&ids, false).unwrap()).unwrap();
            let streamed = stream(&tok, &ids);
            // Streaming keeps the SentencePiece / WordPiece leading space that decode drops.
            assert!(
                streamed == whole || streamed == format!(" {whole}"),
                "{name}: {text:?}: streamed {streamed:?}, decoded {whole:?}"
            );
        }
    }
}

/// llama.cpp's `test-tokenizer-1-{bpe,spm}`: every token's text re-encodes (with special tokens
/// parsed) and decodes back to the same text. Checked on every 7th id to keep debug builds
/// quick (`U_TOKENIZER_ALL_TOKENS=1` checks every id), plus every token that is not a normal
/// piece.
#[test]
fn per_token_round_trip() {
    let stride = if std::env::var_os("U_TOKENIZER_ALL_TOKENS").is_some() {
        1
    } else {
        7
    };
    for name in [
        "llama-spm",
        "phi-3",
        "llama-bpe",
        "qwen2",
        "gpt-2",
        "starcoder",
        "mpt",
    ] {
        let tok = load(name);
        let mut checked = 0;
        let mut failures = Vec::new();
        for id in 0..tok.vocab_size() {
            if id % stride != 0 && tok.token_type(id) == Some(TokenType::Normal) {
                continue;
            }
            let Ok(text) = String::from_utf8(tok.decode_bytes(&[id], false).unwrap()) else {
                continue; // not valid UTF-8 on its own (a partial character)
            };
            let ids = tok.encode_with(&text, false, true).unwrap();
            let back = tok.decode(&ids, false).unwrap();
            checked += 1;
            if back != text {
                failures.push(format!("{id} {text:?} -> {ids:?} -> {back:?}"));
            }
        }
        println!(
            "{name}: {checked} tokens round-tripped, {} failures",
            failures.len()
        );
        assert!(
            failures.is_empty(),
            "{name}:\n{}",
            failures[..failures.len().min(20)].join("\n")
        );
    }
}

#[test]
fn tokenizer_config_gives_template_and_specials() {
    let json = tiny_tokenizer_json();
    let config = r#"{"bos_token": null, "eos_token": {"content": "<|im_end|>"}, "add_bos_token": false,
        "chat_template": [{"name": "default", "template": "T{{ messages | length }}"}, {"name": "tool_use", "template": "X"}]}"#;
    let back = Tok::from_json(&json, Some(config)).unwrap();
    assert_eq!(back.chat_template(), Some("T{{ messages | length }}"));
    assert!(back.special_tokens().eos.contains(&5));
    // `add_bos_token: false` wins over the post-processor; BOS stays the token it would add.
    assert!(!back.special_tokens().add_bos);
    assert_eq!(back.special_tokens().bos, ROption::RSome(1));
    assert_eq!(back.encode("Hello world", true).unwrap(), [1, 2, 3]);
}

// ---- the plugin through its ABI objects ----

#[derive(Clone)]
struct TestHost {
    grants: Vec<PathBuf>,
}

impl Host for TestHost {
    fn plugin_name(&self) -> RString {
        "tokenizer".into()
    }
    fn log(&self, _: LogLevel, _: RStr<'_>) {}
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        let p = PathBuf::from(path.as_str());
        if !self.grants.iter().any(|g| p.starts_with(g)) {
            return RResult::RErr(UError::denied(format!(
                "{} is outside the grant",
                p.display()
            )));
        }
        match std::fs::File::open(&p) {
            Ok(f) => RResult::ROk(f.into_raw_fd()),
            Err(e) => RResult::RErr(UError::io(p.display(), e)),
        }
    }
    fn open_write(&self, _: RStr<'_>, _: WriteMode) -> RResult<i32, UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn rename(&self, _: RStr<'_>, _: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn remove(&self, _: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn threads(&self) -> u32 {
        1
    }
    fn config(&self) -> RString {
        RString::new()
    }
}

/// A weight set that has only metadata.
#[derive(Clone)]
struct MetaOnly(HashMap<String, MetaValue>);

impl WeightSet for MetaOnly {
    fn format(&self) -> RResult<RString, UError> {
        RResult::ROk("gguf".into())
    }
    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        RResult::ROk(ROption::RNone)
    }
    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        RResult::ROk(self.0.keys().map(|k| RString::from(k.as_str())).collect())
    }
    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        RResult::ROk(self.0.get(key.as_str()).cloned().into())
    }
    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        RResult::ROk(RVec::new())
    }
    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        RResult::RErr(UError::not_found(format!("no tensor {name}")))
    }
}

fn fails<T>(r: RResult<T, UError>) -> UError {
    match r {
        RResult::ROk(_) => panic!("expected an error"),
        RResult::RErr(e) => e,
    }
}

fn factory(grants: Vec<PathBuf>) -> TokenizerFactoryBox {
    let host: HostBox = Host_TO::from_value(TestHost { grants }, TD_Opaque);
    match u_tokenizer::instantiate(host).unwrap() {
        PluginInstance::Tokenizer(f) => f,
        other => panic!("wrong kind {}", other.kind_name()),
    }
}

#[test]
fn plugin_builds_from_weights() {
    let f = factory(vec![]);
    let ws = WeightSet_TO::from_value(MetaOnly(meta("llama-bpe")), TD_Opaque);
    let tok = f.build_from_weights(ws).unwrap();
    assert_eq!(tok.vocab_size().unwrap(), 128256);
    let ids = tok.encode("Hello world".into(), true, true).unwrap();
    assert_eq!(ids.as_slice(), &[128000, 9906, 1917]);
    assert_eq!(
        tok.decode(ids.as_slice().into(), true).unwrap().as_str(),
        "Hello world"
    );
    assert_eq!(tok.token_bytes(1917).unwrap().as_slice(), b" world");
    assert_eq!(tok.special_tokens().unwrap().bos, ROption::RSome(128000));
    assert!(tok.chat_template().unwrap().is_none());
    let e = tok
        .decode(vec![999_999u32].as_slice().into(), false)
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidInput);

    let mut bad = meta("gpt-2");
    bad.remove("tokenizer.ggml.tokens");
    let ws = WeightSet_TO::from_value(MetaOnly(bad), TD_Opaque);
    let e = fails(f.build_from_weights(ws));
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
}

#[test]
fn plugin_builds_from_tokenizer_json_through_the_host() {
    let dir = std::env::temp_dir().join(format!("u-tokenizer-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = tiny_tokenizer_json();
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{{ bos_token }}{{ messages[0].content }}", "eos_token": "<|end|>"}"#,
    )
    .unwrap();
    let path = dir.join("tokenizer.json");
    let path_str = path.to_str().unwrap();

    let tok = factory(vec![dir.clone()])
        .build_from_file(path_str.into())
        .unwrap();
    assert_eq!(
        tok.encode("Hello world".into(), true, true)
            .unwrap()
            .as_slice(),
        &[1, 2, 3]
    );
    assert_eq!(
        tok.chat_template().unwrap().unwrap().as_str(),
        "{{ bos_token }}{{ messages[0].content }}"
    );
    assert!(tok.special_tokens().unwrap().eos.contains(&4));

    // Without the grant the host refuses, and the error says so.
    let e = fails(factory(vec![]).build_from_file(path_str.into()));
    assert_eq!(e.kind, ErrorKind::PermissionDenied, "{e}");
    // A file that is not a tokenizer.json.
    std::fs::write(dir.join("tokenizer.json"), "{\"nope\": 1}").unwrap();
    let e = fails(factory(vec![dir.clone()]).build_from_file(path_str.into()));
    assert_eq!(e.kind, ErrorKind::InvalidInput, "{e}");
    assert!(e.message.contains("tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
