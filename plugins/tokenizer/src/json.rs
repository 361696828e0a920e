//! HF `tokenizer.json` (plus, when present, `tokenizer_config.json`) → [`Tok`].
//!
//! The pipeline is HF's own, loaded as is. What `tokenizers` does not expose is read from the
//! JSON: how the decoder turns pieces into bytes (byte-level, SentencePiece `▁` and byte
//! fallback, WordPiece `##`), and from the config the chat template, BOS/EOS/padding and
//! `add_bos_token`.

use crate::{
    Tok,
    core::{Parts, PieceScheme, parse_byte_token},
    vocab::TokenType,
};
use serde_json::Value;
use u_sdk::UError;

/// Texts of end-of-generation tokens recognised among a tokenizer's special tokens.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
];

fn collect_types(v: &Value, out: &mut Vec<&'static str>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(t)) = m.get("type") {
                out.push(match t.as_str() {
                    "ByteLevel" => "ByteLevel",
                    "ByteFallback" => "ByteFallback",
                    "Metaspace" => "Metaspace",
                    "WordPiece" => "WordPiece",
                    "Strip" => "Strip",
                    "Replace" => "Replace",
                    _ => "other",
                });
            }
            for x in m.values() {
                collect_types(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect_types(x, out)),
        _ => {}
    }
}

/// A BPE model's merges by rank as `"left right"` (written either way: as such strings, or as
/// `[left, right]` pairs); none for other models.
fn bpe_merges(model: &Value) -> Vec<String> {
    if model["type"] != "BPE" {
        return Vec::new();
    }
    let Some(merges) = model["merges"].as_array() else {
        return Vec::new();
    };
    merges
        .iter()
        .filter_map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(pair) => match pair.as_slice() {
                [Value::String(a), Value::String(b)] => Some(format!("{a} {b}")),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn token_content(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s),
        Value::Object(m) => m.get("content").and_then(Value::as_str),
        _ => None,
    }
}

impl Tok {
    /// Builds a tokenizer from the text of a `tokenizer.json` and, optionally, of the
    /// `tokenizer_config.json` beside it.
    pub fn from_json(tokenizer_json: &str, config_json: Option<&str>) -> Result<Self, UError> {
        let mut hf: tokenizers::Tokenizer = tokenizer_json
            .parse()
            .map_err(|e| UError::invalid(format!("tokenizer.json: {e}")))?;
        // Lengths are the runner's to decide (its model's context, a checkpoint's recipe): the
        // file's own padding and truncation (e.g. MiniLM's fixed 128) would change the ids.
        hf.with_padding(None);
        hf.with_truncation(None)
            .map_err(|e| UError::invalid(format!("tokenizer.json: {e}")))?;
        let doc: Value = serde_json::from_str(tokenizer_json)
            .map_err(|e| UError::invalid(format!("tokenizer.json: {e}")))?;
        let config: Option<Value> = match config_json {
            None => None,
            Some(c) => Some(
                serde_json::from_str(c)
                    .map_err(|e| UError::invalid(format!("tokenizer_config.json: {e}")))?,
            ),
        };

        // Decoder → how pieces become bytes.
        let mut dec = Vec::new();
        collect_types(&doc["decoder"], &mut dec);
        let mut pre = Vec::new();
        collect_types(&doc["pre_tokenizer"], &mut pre);
        let has = |v: &[&str], t: &str| v.contains(&t);
        let (scheme, strip) = if has(&dec, "ByteLevel") {
            (PieceScheme::ByteLevel, false)
        } else if has(&dec, "WordPiece") {
            let prefix = doc["decoder"]["prefix"]
                .as_str()
                .unwrap_or("##")
                .to_string();
            (PieceScheme::WordPiece(prefix), true)
        } else if has(&dec, "Metaspace") {
            let rep = doc["decoder"]["replacement"]
                .as_str()
                .and_then(|s| s.chars().next())
                .unwrap_or('▁');
            let never = doc["decoder"]["prepend_scheme"].as_str() == Some("never")
                || doc["decoder"]["add_prefix_space"].as_bool() == Some(false);
            (PieceScheme::Spm(rep), !never)
        } else if has(&dec, "ByteFallback") || has(&dec, "Replace") {
            (PieceScheme::Spm('▁'), has(&dec, "Strip"))
        } else if has(&pre, "ByteLevel") {
            (PieceScheme::ByteLevel, false)
        } else {
            (PieceScheme::Raw, false)
        };
        let byte_fallback = doc["model"]["byte_fallback"].as_bool().unwrap_or(false);

        // Token table, with added tokens typed as special (control) or user-defined.
        let vocab = hf.get_vocab(true);
        let n = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let mut tokens = vec![String::new(); n];
        let mut types = vec![TokenType::Unused; n];
        for (t, &id) in &vocab {
            let i = id as usize;
            tokens[i] = t.clone();
            types[i] = if matches!(scheme, PieceScheme::Spm(_))
                && byte_fallback
                && parse_byte_token(t).is_some()
            {
                TokenType::Byte
            } else {
                TokenType::Normal
            };
        }
        for (id, added) in hf.get_added_tokens_decoder() {
            if let Some(ty) = types.get_mut(id as usize) {
                *ty = if added.special {
                    TokenType::Control
                } else {
                    TokenType::UserDefined
                };
            }
        }

        let id_of = |v: Option<&Value>| v.and_then(token_content).and_then(|t| hf.token_to_id(t));
        let cfg = config.as_ref();
        let mut bos = cfg.and_then(|c| id_of(c.get("bos_token")));
        let cfg_eos = cfg.and_then(|c| id_of(c.get("eos_token")));
        let pad = cfg.and_then(|c| id_of(c.get("pad_token")));
        // Whether the post-processor adds a leading special token tells `add_bos`.
        let probe = hf
            .encode_fast("", true)
            .map_err(|e| UError::invalid(format!("tokenizer.json: {e}")))?;
        let lead = probe
            .get_ids()
            .first()
            .copied()
            .filter(|&id| types.get(id as usize) == Some(&TokenType::Control));
        let mut add_bos = lead.is_some();
        if bos.is_none() {
            bos = lead;
        }
        if let Some(b) = cfg
            .and_then(|c| c.get("add_bos_token"))
            .and_then(Value::as_bool)
        {
            add_bos = b && bos.is_some();
        }
        let mut eog: Vec<u32> = cfg_eos.into_iter().collect();
        for (i, t) in tokens.iter().enumerate() {
            if types[i] == TokenType::Control && EOG_TEXTS.contains(&t.as_str()) {
                eog.push(i as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        let chat_template = cfg.and_then(|c| match c.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        });

        Ok(Tok::new(Parts {
            encoder: crate::core::Encoder::Hf(Box::new(hf)),
            tokens,
            types,
            scheme,
            strip_leading_space: strip,
            bos,
            eos: cfg_eos,
            eog,
            merges: bpe_merges(&doc["model"]),
            add_bos,
            pad,
            chat_template,
        }))
    }
}
