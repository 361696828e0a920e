//! Test helpers: a minimal GGUF metadata reader and the vocabulary files.
//!
//! A small GGUF metadata reader keeps these tests independent of the loader plugin.
#![allow(dead_code)]

use abi_stable::std_types::{RString, RVec};
use std::{collections::HashMap, path::PathBuf};
use u_sdk::MetaValue;
use u_tokenizer::Tok;

/// llama.cpp's test vocabularies, as `cargo xtask fetch-model llama-vocab` unpacks them from
/// the llama-cpp-python 0.3.36 source archive: `$U_LLAMA_VOCAB_DIR` (`cargo xtask test` sets
/// it), else the model cache (`$U_MODEL_CACHE`, `$XDG_CACHE_HOME/u/models`,
/// `~/.cache/u/models`). Absent is a failure.
pub fn vocab_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = var("U_LLAMA_VOCAB_DIR").unwrap_or_else(|| {
        var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .unwrap_or_else(|| var("HOME").unwrap_or_default().join(".cache/u/models"))
            .join("llama.cpp-0.3.36-vocab")
    });
    assert!(
        dir.is_dir(),
        "llama.cpp's vocabularies not found at {}: run `cargo xtask fetch-model llama-vocab` \
         (or set U_LLAMA_VOCAB_DIR)",
        dir.display()
    );
    dir
}

/// The names `<name>` of every `ggml-vocab-<name>.gguf` that has `.inp`/`.out` test vectors.
pub fn names_with_vectors() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(vocab_dir())
        .expect("vocabulary folder")
        .filter_map(|e| {
            let file = e.ok()?.file_name().into_string().ok()?;
            Some(
                file.strip_prefix("ggml-vocab-")?
                    .strip_suffix(".gguf.inp")?
                    .to_string(),
            )
        })
        .collect();
    names.sort();
    names
}

/// The metadata of `ggml-vocab-<name>.gguf`.
pub fn meta(name: &str) -> HashMap<String, MetaValue> {
    let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    read_gguf_meta(&bytes).unwrap_or_else(|| panic!("{}: not a GGUF file", path.display()))
}

/// Loads `ggml-vocab-<name>.gguf` and builds its tokenizer.
pub fn load(name: &str) -> Tok {
    Tok::from_meta(&meta(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

struct R<'a>(&'a [u8], usize);

impl R<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.0.get(self.1..self.1.checked_add(n)?)?;
        self.1 += n;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<String> {
        let n = self.u64()? as usize;
        Some(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn scalar(&mut self, ty: u32) -> Option<MetaValue> {
        Some(match ty {
            0 => MetaValue::UInt(self.take(1)?[0].into()),
            1 => MetaValue::Int((self.take(1)?[0] as i8).into()),
            2 => MetaValue::UInt(u16::from_le_bytes(self.take(2)?.try_into().ok()?).into()),
            3 => MetaValue::Int(i16::from_le_bytes(self.take(2)?.try_into().ok()?).into()),
            4 => MetaValue::UInt(self.u32()?.into()),
            5 => MetaValue::Int((self.u32()? as i32).into()),
            6 => MetaValue::Float(f32::from_le_bytes(self.take(4)?.try_into().ok()?).into()),
            7 => MetaValue::Bool(self.take(1)?[0] != 0),
            8 => MetaValue::Str(self.str()?.into()),
            10 => MetaValue::UInt(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_le_bytes(self.take(8)?.try_into().ok()?)),
            _ => return None,
        })
    }
    fn value(&mut self, ty: u32) -> Option<MetaValue> {
        if ty != 9 {
            return self.scalar(ty);
        }
        let ety = self.u32()?;
        let n = self.u64()? as usize;
        let items: Vec<MetaValue> = (0..n).map(|_| self.scalar(ety)).collect::<Option<_>>()?;
        Some(match ety {
            8 => MetaValue::StrArray(
                items
                    .into_iter()
                    .map(|v| match v {
                        MetaValue::Str(s) => s,
                        _ => RString::new(),
                    })
                    .collect(),
            ),
            6 | 12 => MetaValue::FloatArray(items.iter().filter_map(MetaValue::as_f64).collect()),
            7 => MetaValue::BoolArray(
                items
                    .iter()
                    .map(|v| matches!(v, MetaValue::Bool(true)))
                    .collect(),
            ),
            1 | 3 | 5 | 11 => MetaValue::IntArray(
                items
                    .iter()
                    .map(|v| match v {
                        MetaValue::Int(i) => *i,
                        _ => 0,
                    })
                    .collect::<RVec<i64>>(),
            ),
            _ => MetaValue::UIntArray(items.iter().filter_map(MetaValue::as_u64).collect()),
        })
    }
}

/// Reads the key/value metadata of a GGUF v2/v3 file.
pub fn read_gguf_meta(bytes: &[u8]) -> Option<HashMap<String, MetaValue>> {
    let mut r = R(bytes, 0);
    if r.take(4)? != b"GGUF" {
        return None;
    }
    let _version = r.u32()?;
    let _tensors = r.u64()?;
    let kvs = r.u64()?;
    let mut out = HashMap::new();
    for _ in 0..kvs {
        let k = r.str()?;
        let ty = r.u32()?;
        let v = r.value(ty)?;
        out.insert(k, v);
    }
    Some(out)
}

/// The (input, expected ids) pairs of a vocabulary's `.inp`/`.out` files, split as llama.cpp's
/// `test-tokenizer-0` splits them.
pub fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let base = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let read = |ext: &str| {
        let p = base.with_extension(format!("gguf.{ext}"));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
    };
    let raw = read("inp");
    let out = read("out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < raw.len() {
        match raw[pos..].find(sep) {
            Some(next) => {
                inputs.push(raw[pos..pos + next].to_string());
                pos += next + sep.len();
            }
            None => {
                inputs.push(raw[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("token id"))
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree on the number of tests"
    );
    assert!(!inputs.is_empty(), "{name}: no tests");
    inputs.into_iter().zip(outputs).collect()
}

/// A small word-level `tokenizer.json` (HF's format): `<unk>` 0, `<s>` 1, `Hello` 2, `world` 3,
/// and the special tokens `<|end|>` 4 and `<|im_end|>` 5; BOS added by its post-processor.
pub fn tiny_tokenizer_json() -> String {
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(4, "<|end|>"),
            special(5, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "<unk>",
            "vocab": {"<unk>": 0, "<s>": 1, "Hello": 2, "world": 3, "<|end|>": 4, "<|im_end|>": 5}}
    })
    .to_string()
}
