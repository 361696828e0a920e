//! A tokenizer as GGUF metadata ([`u_sdk::Tokenizer::gguf_metadata`]), so that a GGUF written
//! from an HF checkpoint (`u-runner quantize`) carries its vocabulary.
//!
//! A byte-level BPE `tokenizer.json` becomes llama.cpp's `gpt2` model: the tokens by id with
//! their types (added tokens control or user-defined), the merges by rank, BOS/EOS, whether
//! BOS is added, the chat template. llama.cpp also needs the pre-tokenizer's name
//! (`tokenizer.ggml.pre`), which its converter finds by hashing a tokenization. Here the name
//! is the first — the common names of [`PREFERRED`] first, then the rest of llama.cpp's
//! ([`Pre::NAMES`]) — under which this plugin's own llama.cpp tokenizer, given the exported
//! vocabulary, encodes every [`PROBES`] text to the ids the file's HF pipeline gives; when
//! none does, the export is refused rather than guessed.
//! Other kinds of `tokenizer.json` (SentencePiece-style, WordPiece, Unigram) are refused by
//! kind, and a tokenizer built from GGUF metadata has that metadata in its file already.

use crate::{
    Tok,
    core::{Encoder, PieceScheme},
    llama::pre::Pre,
    vocab::{GgufVocab, TokenType},
};
use std::collections::HashMap;
use u_sdk::{MetaValue, UError};

/// Texts both tokenizers must encode alike: letters, contractions, digit runs, whitespace runs
/// and line breaks, punctuation, code, accents, CJK, emoji.
pub const PROBES: [&str; 8] = [
    "Hello world! It's a test: don't, won't, I'll, we're, they've, she'd.",
    "1 12 123 1234 12345 1234567890 3.14159 -42 0x1F 2026-12-01",
    "   leading spaces\n\n\ttabs\t\tand   runs  of  spaces   \r\nlast line \n",
    "fn main() { let x = a+b*(c-d)/e; if x >= 10 { return \"ok\"; } } // done",
    "Ünïcödé façade naïve résumé — “quotes” ‘single’ «angle» … ¿qué? ¡sí!",
    "你好，世界。日本語のテキスト、한국어 텍스트입니다.",
    "emoji 🤖🚀 mixed🙂text and symbols ©®™ ±×÷ ∑∫√ ≠≤≥",
    "MixedCASE camelCase snake_case kebab-case URL https://example.com/a?b=1&c=2",
];

/// The pre-tokenizer names tried first: the best-known model of each splitting (so a Llama 3
/// tokenizer is called `llama-bpe`, not another name that splits alike), the more specific
/// splitting first where a vocabulary cannot tell two apart (Qwen2's single digits before
/// Llama 3's runs of three, StarCoder's before GPT-2's runs of any length: a vocabulary
/// without multi-digit tokens encodes alike under both).
pub const PREFERRED: [&str; 12] = [
    "qwen2",
    "starcoder",
    "gpt-2",
    "llama-bpe",
    "qwen35",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "falcon",
    "gpt-4o",
    "tekken",
    "command-r",
];

impl Tok {
    /// See the module docs.
    pub fn gguf_metadata(&self) -> Result<Vec<(String, MetaValue)>, UError> {
        let p = self.p();
        let hf = match &p.encoder {
            Encoder::Hf(hf) => hf.as_ref(),
            Encoder::Llama(_) => {
                return Err(UError::unsupported(
                    "u-tokenizer: this tokenizer comes from GGUF metadata, which its file holds",
                ));
            }
        };
        if p.scheme != PieceScheme::ByteLevel || p.merges.is_empty() {
            return Err(UError::unsupported(
                "u-tokenizer: only a byte-level BPE tokenizer.json can be written as GGUF \
                 metadata (llama.cpp's gpt2 model); convert this one with convert_hf_to_gguf.py",
            ));
        }
        let mut meta: Vec<(String, MetaValue)> = vec![
            ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
            ("tokenizer.ggml.pre".into(), MetaValue::Str("".into())),
            (
                "tokenizer.ggml.tokens".into(),
                MetaValue::StrArray(p.tokens.iter().map(|t| t.as_str().into()).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                MetaValue::IntArray(p.types.iter().map(|&t| gguf_type(t)).collect()),
            ),
            (
                "tokenizer.ggml.merges".into(),
                MetaValue::StrArray(p.merges.iter().map(|m| m.as_str().into()).collect()),
            ),
        ];
        let id = |k: &str, v: Option<u32>| v.map(|v| (k.to_string(), MetaValue::UInt(v.into())));
        meta.extend(id("tokenizer.ggml.bos_token_id", p.bos));
        meta.extend(id("tokenizer.ggml.eos_token_id", p.eos));
        meta.push((
            "tokenizer.ggml.add_bos_token".into(),
            MetaValue::Bool(p.add_bos),
        ));
        if let Some(t) = &p.chat_template {
            meta.push((
                "tokenizer.chat_template".into(),
                MetaValue::Str(t.as_str().into()),
            ));
        }

        let mut want = Vec::with_capacity(PROBES.len());
        for text in PROBES {
            let enc = hf
                .encode_fast(text, false)
                .map_err(|e| UError::invalid(format!("tokenizer: encoding failed: {e}")))?;
            want.push(enc.get_ids().to_vec());
        }
        let map: HashMap<String, MetaValue> = meta.iter().cloned().collect();
        let mut vocab = GgufVocab::from_meta(&map)?;
        let mut tried: Vec<Pre> = Vec::new();
        for &name in PREFERRED.iter().chain(&Pre::NAMES) {
            let Some(pre) = Pre::by_name(name) else {
                continue;
            };
            if tried.contains(&pre) || !pre.group.patterns().1 {
                continue;
            }
            tried.push(pre);
            vocab.pre = name.to_string();
            vocab.pre_tokenizer = Some(pre);
            let candidate = Tok::from_gguf_vocab(&vocab)?;
            let same = PROBES.iter().zip(&want).all(|(text, ids)| {
                candidate.encode_with(text, false, false).ok().as_ref() == Some(ids)
            });
            if same {
                meta[1].1 = MetaValue::Str(name.into());
                return Ok(meta);
            }
        }
        Err(UError::unsupported(
            "u-tokenizer: none of llama.cpp's pre-tokenizers splits text as this \
             tokenizer.json does, so its GGUF would tokenize differently",
        ))
    }
}

/// A token type as GGUF stores it (`tokenizer.ggml.token_type`).
fn gguf_type(t: TokenType) -> i64 {
    t as i64
}
