//! Fuzzes encoding: for a small vocabulary of each tokenizer type (byte-pair with any of
//! llama.cpp's pre-tokenizers, SentencePiece, WordPiece, unigram, RWKV), any text must encode
//! without a panic, give ids in range, and decode again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;
use u_sdk::MetaValue;
use u_tokenizer::Tok;

const PRES: [&str; 12] = [
    "gpt-2",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "deepseek-llm",
    "deepseek-v3",
    "tekken",
    "kimi-k2",
    "afmoe",
    "superbpe",
    "chameleon",
    "gemma4",
];

fn strs(v: &[&str]) -> MetaValue {
    MetaValue::StrArray(v.iter().map(|s| (*s).into()).collect())
}

fn vocab(kind: u8) -> HashMap<String, MetaValue> {
    let mut m = HashMap::new();
    let byte_level: Vec<String> = (0..=255u8)
        .map(|b| {
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
            if printable {
                char::from(b).to_string()
            } else {
                let n = (0..b)
                    .filter(|&x| {
                        !((0x21..=0x7E).contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE)
                    })
                    .count() as u32;
                char::from_u32(0x100 + n).unwrap().to_string()
            }
        })
        .collect();
    let mut set = |k: &str, v: MetaValue| {
        m.insert(format!("tokenizer.ggml.{k}"), v);
    };
    match kind % 6 {
        0 => {
            let mut tokens = byte_level.clone();
            tokens.extend(["he", "hel", "lo", "hello", "Ġw", "Ġwo"].map(String::from));
            let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
            set("model", MetaValue::Str("gpt2".into()));
            set(
                "pre",
                MetaValue::Str(PRES[(kind as usize / 6) % PRES.len()].into()),
            );
            set("tokens", strs(&refs));
            set(
                "merges",
                strs(&["h e", "he l", "l o", "hel lo", "Ġ w", "Ġw o"]),
            );
        }
        1 => {
            let mut tokens = vec!["<unk>", "<s>", "</s>", "▁", "▁h", "e", "h", "l", "o"];
            let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
            tokens.extend(bytes.iter().map(String::as_str));
            let mut types = vec![2i64, 3, 3, 1, 1, 1, 1, 1, 1];
            types.extend(std::iter::repeat_n(6, 256));
            set("model", MetaValue::Str("llama".into()));
            set(
                "scores",
                MetaValue::FloatArray(vec![0.0; tokens.len()].into()),
            );
            set("token_type", MetaValue::IntArray(types.into()));
            set("tokens", strs(&tokens));
        }
        2 => {
            set("model", MetaValue::Str("bert".into()));
            set(
                "tokens",
                strs(&["[PAD]", "[UNK]", "[CLS]", "[SEP]", "▁hello", "lo", "▁he"]),
            );
            set("unknown_token_id", MetaValue::UInt(1));
            set("bos_token_id", MetaValue::UInt(2));
            set("seperator_token_id", MetaValue::UInt(3));
        }
        3 => {
            set("model", MetaValue::Str("t5".into()));
            set(
                "tokens",
                strs(&[
                    "<pad>", "</s>", "<unk>", "▁", "▁he", "llo", "h", "e", "l", "o",
                ]),
            );
            set(
                "scores",
                MetaValue::FloatArray(
                    vec![0.0, 0.0, 0.0, -1.0, -2.0, -2.5, -5.0, -5.0, -5.0, -5.0].into(),
                ),
            );
            set(
                "token_type",
                MetaValue::IntArray(vec![3, 3, 2, 1, 1, 1, 1, 1, 1, 1].into()),
            );
            set("add_space_prefix", MetaValue::Bool(true));
        }
        4 => {
            let mut tokens: Vec<String> = (0..=255u8).map(|b| format!("\\x{b:02x}")).collect();
            tokens.extend(["hello", "\\n\\n", " wor"].map(String::from));
            let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
            set("model", MetaValue::Str("rwkv".into()));
            set("tokens", strs(&refs));
        }
        _ => {
            let mut tokens = vec!["<pad>", "<eos>", "<bos>", "▁", "h", "e", "▁h", "he", "\n"];
            let bytes: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
            tokens.extend(bytes.iter().map(String::as_str));
            set("model", MetaValue::Str("gemma4".into()));
            set("tokens", strs(&tokens));
            set("merges", strs(&["▁ h", "h e"]));
            set("bos_token_id", MetaValue::UInt(2));
        }
    }
    m
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let tok = Tok::from_meta(&vocab(kind)).expect("the fuzz vocabularies are valid");
    let text = String::from_utf8_lossy(rest);
    for (add, parse) in [(false, false), (true, true)] {
        let ids = tok
            .encode_with(&text, add, parse)
            .expect("encoding valid text");
        assert!(ids.iter().all(|&id| id < tok.vocab_size()), "{ids:?}");
        tok.decode(&ids, false).expect("decoding the ids just made");
    }
});
