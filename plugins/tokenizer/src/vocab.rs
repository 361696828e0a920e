//! A GGUF vocabulary: the `tokenizer.ggml.*` metadata, read and checked.
//!
//! Everything here is validated before any tokenizer is built: array lengths agree, special
//! token ids are in range, token types are known, merges name vocabulary tokens. Malformed
//! metadata gives an [`UError`] that names the key and what is wrong with it.

use std::collections::HashMap;
use u_sdk::{MetaValue, UError, WeightSetBox};

/// Where metadata comes from: a weight set, or a map in tests and tools.
pub trait MetaSource {
    /// The value stored under `key`, if any.
    fn meta(&self, key: &str) -> Option<MetaValue>;
}

impl MetaSource for WeightSetBox {
    fn meta(&self, key: &str) -> Option<MetaValue> {
        self.metadata(key.into()).into_result().ok()?.into_option()
    }
}

impl MetaSource for HashMap<String, MetaValue> {
    fn meta(&self, key: &str) -> Option<MetaValue> {
        self.get(key).cloned()
    }
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TokenType {
    /// Type 0: not defined.
    Undefined = 0,
    /// Type 1: an ordinary vocabulary piece.
    Normal = 1,
    /// Type 2: the unknown token.
    Unknown = 2,
    /// Type 3: a control token (BOS, EOS, chat markers); special.
    Control = 3,
    /// Type 4: an added token matched verbatim in text; not special.
    UserDefined = 4,
    /// Type 5: a reserved, unused slot.
    Unused = 5,
    /// Type 6: a byte-fallback token `<0xXX>`.
    Byte = 6,
}

impl TokenType {
    fn from_i64(v: i64) -> Option<Self> {
        Some(match v {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// Control and unknown tokens: left out by `decode(skip_special)`, matched in text only
    /// when special tokens are parsed.
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// The tokenizer family (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `llama`: SentencePiece BPE over scores, byte fallback, `▁` for spaces.
    Spm,
    /// `gpt2`: byte-level BPE with ranked merges and a regex pre-tokenizer.
    Bpe,
    /// `bert`: WordPiece, greedy longest match.
    Wpm,
}

/// A checked GGUF vocabulary.
#[derive(Clone, Debug)]
pub struct GgufVocab {
    /// The family.
    pub family: Family,
    /// `tokenizer.ggml.pre` (empty when absent).
    pub pre: String,
    /// Token texts, by id.
    pub tokens: Vec<String>,
    /// Token scores (SentencePiece log-probabilities), by id; zero when absent.
    pub scores: Vec<f32>,
    /// Token types, by id; all normal when absent.
    pub types: Vec<TokenType>,
    /// BPE merges `(left, right)`, by rank.
    pub merges: Vec<(String, String)>,
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// End-of-turn token.
    pub eot: Option<u32>,
    /// End-of-message token.
    pub eom: Option<u32>,
    /// Unknown token.
    pub unk: Option<u32>,
    /// Separator token (BERT's `[SEP]`).
    pub sep: Option<u32>,
    /// Padding token.
    pub pad: Option<u32>,
    /// Whether `encode(add_special)` prepends BOS.
    pub add_bos: bool,
    /// Whether `encode(add_special)` appends EOS.
    pub add_eos: bool,
    /// Whether `encode(add_special)` appends SEP (BERT).
    pub add_sep: bool,
    /// Whether a space is prepended to the text (SentencePiece).
    pub add_space_prefix: bool,
    /// Whether WordPiece lowercases (and strips accents).
    pub lowercase: bool,
    /// `tokenizer.chat_template`, if present.
    pub chat_template: Option<String>,
}

const P: &str = "tokenizer.ggml.";

fn key(k: &str) -> String {
    format!("{P}{k}")
}

fn get_str(src: &dyn MetaSource, k: &str) -> Result<Option<String>, UError> {
    match src.meta(k) {
        None => Ok(None),
        Some(MetaValue::Str(s)) => Ok(Some(s.into())),
        Some(other) => Err(UError::invalid(format!(
            "{k}: expected a string, found {}",
            kind(&other)
        ))),
    }
}

fn get_bool(src: &dyn MetaSource, k: &str) -> Result<Option<bool>, UError> {
    match src.meta(k) {
        None => Ok(None),
        Some(MetaValue::Bool(b)) => Ok(Some(b)),
        Some(MetaValue::UInt(v)) => Ok(Some(v != 0)),
        Some(MetaValue::Int(v)) => Ok(Some(v != 0)),
        Some(other) => Err(UError::invalid(format!(
            "{k}: expected a boolean, found {}",
            kind(&other)
        ))),
    }
}

fn get_id(src: &dyn MetaSource, k: &str, n: usize) -> Result<Option<u32>, UError> {
    let Some(v) = src.meta(k) else {
        return Ok(None);
    };
    // llama.cpp writes -1 (as a signed value) for "no such token".
    if let MetaValue::Int(i) = v
        && i < 0
    {
        return Ok(None);
    }
    let id = v
        .as_u64()
        .ok_or_else(|| UError::invalid(format!("{k}: expected a token id, found {}", kind(&v))))?;
    if id >= n as u64 {
        return Err(UError::invalid(format!(
            "{k} = {id} is out of range: the vocabulary has {n} tokens"
        )));
    }
    Ok(Some(id as u32))
}

fn kind(v: &MetaValue) -> &'static str {
    match v {
        MetaValue::Bool(_) => "a boolean",
        MetaValue::Int(_) | MetaValue::UInt(_) => "an integer",
        MetaValue::Float(_) => "a float",
        MetaValue::Str(_) => "a string",
        MetaValue::IntArray(_) | MetaValue::UIntArray(_) => "an integer array",
        MetaValue::FloatArray(_) => "a float array",
        MetaValue::BoolArray(_) => "a boolean array",
        MetaValue::StrArray(_) => "a string array",
        MetaValue::Json(_) => "a nested array",
    }
}

fn check_len(k: &str, found: usize, n: usize) -> Result<(), UError> {
    if found != n {
        return Err(UError::invalid(format!(
            "{k} has {found} entries but tokenizer.ggml.tokens has {n}"
        )));
    }
    Ok(())
}

impl GgufVocab {
    /// Reads and checks the vocabulary from GGUF-style metadata.
    pub fn from_meta(src: &dyn MetaSource) -> Result<Self, UError> {
        let model = get_str(src, &key("model"))?.ok_or_else(|| {
            UError::not_found("no tokenizer.ggml.model in the model metadata: it has no vocabulary")
        })?;
        let family = match model.as_str() {
            "llama" => Family::Spm,
            "gpt2" => Family::Bpe,
            "bert" => Family::Wpm,
            other => {
                return Err(UError::unsupported(format!(
                    "tokenizer.ggml.model = {other:?} is not supported (supported: llama, gpt2, bert)"
                )));
            }
        };
        let pre = get_str(src, &key("pre"))?.unwrap_or_default();

        let tokens: Vec<String> = match src.meta(&key("tokens")) {
            None => {
                return Err(UError::not_found(
                    "no tokenizer.ggml.tokens in the model metadata (missing vocabulary)",
                ));
            }
            Some(MetaValue::StrArray(v)) => v.into_iter().map(String::from).collect(),
            Some(other) => {
                return Err(UError::invalid(format!(
                    "tokenizer.ggml.tokens: expected a string array, found {}",
                    kind(&other)
                )));
            }
        };
        let n = tokens.len();
        if n == 0 {
            return Err(UError::invalid("tokenizer.ggml.tokens is empty"));
        }
        if n > u32::MAX as usize {
            return Err(UError::invalid(
                "tokenizer.ggml.tokens has too many entries",
            ));
        }
        // Empty texts get a placeholder (as llama.cpp does); duplicates are refused.
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t
                }
            })
            .collect();
        {
            let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n);
            for (i, t) in tokens.iter().enumerate() {
                if let Some(j) = seen.insert(t.as_str(), i) {
                    return Err(UError::invalid(format!(
                        "tokenizer.ggml.tokens: duplicate token {t:?} at ids {j} and {i}"
                    )));
                }
            }
        }

        let scores: Vec<f32> = match src.meta(&key("scores")) {
            None => vec![0.0; n],
            Some(MetaValue::FloatArray(v)) => {
                check_len("tokenizer.ggml.scores", v.len(), n)?;
                v.iter().map(|&x| x as f32).collect()
            }
            Some(MetaValue::IntArray(v)) => {
                check_len("tokenizer.ggml.scores", v.len(), n)?;
                v.iter().map(|&x| x as f32).collect()
            }
            Some(MetaValue::UIntArray(v)) => {
                check_len("tokenizer.ggml.scores", v.len(), n)?;
                v.iter().map(|&x| x as f32).collect()
            }
            Some(other) => {
                return Err(UError::invalid(format!(
                    "tokenizer.ggml.scores: expected a number array, found {}",
                    kind(&other)
                )));
            }
        };

        let types: Vec<TokenType> = match src.meta(&key("token_type")) {
            None => vec![TokenType::Normal; n],
            Some(MetaValue::IntArray(v)) => {
                check_len("tokenizer.ggml.token_type", v.len(), n)?;
                collect_types(v.iter().copied())?
            }
            Some(MetaValue::UIntArray(v)) => {
                check_len("tokenizer.ggml.token_type", v.len(), n)?;
                collect_types(v.iter().map(|&x| i64::try_from(x).unwrap_or(i64::MAX)))?
            }
            Some(other) => {
                return Err(UError::invalid(format!(
                    "tokenizer.ggml.token_type: expected an integer array, found {}",
                    kind(&other)
                )));
            }
        };

        let merges = match (family, src.meta(&key("merges"))) {
            (Family::Bpe, None) => {
                return Err(UError::not_found(
                    "tokenizer.ggml.model is gpt2 but tokenizer.ggml.merges is missing",
                ));
            }
            (_, None) => Vec::new(),
            (_, Some(MetaValue::StrArray(v))) => parse_merges(&v, &tokens)?,
            (_, Some(other)) => {
                return Err(UError::invalid(format!(
                    "tokenizer.ggml.merges: expected a string array, found {}",
                    kind(&other)
                )));
            }
        };

        // Family defaults, as llama.cpp sets them.
        let (mut bos, mut eos, mut unk, mut sep) = match family {
            Family::Spm => (Some(1), Some(2), Some(0), None),
            Family::Bpe => (None, None, None, None),
            Family::Wpm => (Some(101), None, Some(100), Some(102)),
        };
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        bos = in_range(bos);
        eos = in_range(eos);
        unk = in_range(unk);
        sep = in_range(sep);
        if let Some(id) = get_id(src, &key("bos_token_id"), n)? {
            bos = Some(id);
        } else if family == Family::Wpm
            && let Some(id) = get_id(src, &key("cls_token_id"), n)?
        {
            bos = Some(id);
        }
        if let Some(id) = get_id(src, &key("eos_token_id"), n)? {
            eos = Some(id);
        }
        if let Some(id) = get_id(src, &key("unknown_token_id"), n)? {
            unk = Some(id);
        }
        if let Some(id) = get_id(src, &key("seperator_token_id"), n)? {
            sep = Some(id);
        }
        let pad = get_id(src, &key("padding_token_id"), n)?;
        let mut eot = get_id(src, &key("eot_token_id"), n)?;
        let eom = get_id(src, &key("eom_token_id"), n)?;
        if eot.is_none() {
            eot = EOT_TEXTS
                .iter()
                .find_map(|t| tokens.iter().position(|x| x == t))
                .map(|i| i as u32);
        }

        let (mut add_bos, mut add_sep) = match family {
            Family::Spm => (true, false),
            Family::Bpe => (is_llama3_pre(&pre), false),
            Family::Wpm => (true, true),
        };
        if let Some(b) = get_bool(src, &key("add_bos_token"))? {
            add_bos = b;
        }
        let add_eos = get_bool(src, &key("add_eos_token"))?.unwrap_or(false);
        if let Some(b) = get_bool(src, &key("add_sep_token"))? {
            add_sep = b;
        }
        let add_space_prefix =
            get_bool(src, &key("add_space_prefix"))?.unwrap_or(family == Family::Spm);
        let lowercase = get_bool(src, &key("normalizer.lowercase"))?.unwrap_or(true);
        if add_bos && bos.is_none() {
            return Err(UError::invalid(
                "tokenizer.ggml.add_bos_token is true but there is no BOS token",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(UError::invalid(
                "tokenizer.ggml.add_eos_token is true but there is no EOS token",
            ));
        }
        if add_sep && sep.is_none() {
            return Err(UError::invalid(
                "tokenizer.ggml.add_sep_token is true but there is no separator token",
            ));
        }

        let chat_template = get_str(src, "tokenizer.chat_template")?;

        Ok(Self {
            family,
            pre,
            tokens,
            scores,
            types,
            merges,
            bos,
            eos,
            eot,
            eom,
            unk,
            sep,
            pad,
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
            lowercase,
            chat_template,
        })
    }

    /// The ids that end generation: EOS, EOT, EOM and the end-of-turn markers llama.cpp
    /// recognises by their text, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = [self.eos, self.eot, self.eom]
            .into_iter()
            .flatten()
            .collect();
        for (i, t) in self.tokens.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str()) && self.types[i] != TokenType::Normal {
                ids.push(i as u32);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Texts llama.cpp takes as the end-of-turn token when `eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
];

/// Texts llama.cpp treats as end-of-generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
];

fn collect_types(v: impl Iterator<Item = i64>) -> Result<Vec<TokenType>, UError> {
    v.enumerate()
        .map(|(i, t)| {
            TokenType::from_i64(t).ok_or_else(|| {
                UError::invalid(format!(
                    "tokenizer.ggml.token_type[{i}] = {t} is not a token type (0..=6)"
                ))
            })
        })
        .collect()
}

fn parse_merges(
    merges: &[abi_stable::std_types::RString],
    tokens: &[String],
) -> Result<Vec<(String, String)>, UError> {
    let vocab: std::collections::HashSet<&str> = tokens.iter().map(String::as_str).collect();
    merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let m = m.as_str();
            // The separator is the first space after the first character (as llama.cpp reads it).
            let first_len = m.chars().next().map_or(0, char::len_utf8);
            let pos = m
                .get(first_len..)
                .and_then(|rest| rest.find(' '))
                .map(|p| p + first_len)
                .ok_or_else(|| {
                    UError::invalid(format!(
                        "tokenizer.ggml.merges[{i}] = {m:?} is not two tokens separated by a space"
                    ))
                })?;
            let (a, b) = (&m[..pos], &m[pos + 1..]);
            for part in [a, b] {
                if !vocab.contains(part) {
                    return Err(UError::invalid(format!(
                        "tokenizer.ggml.merges[{i}] = {m:?}: {part:?} is not in the vocabulary"
                    )));
                }
            }
            let joined = format!("{a}{b}");
            if !vocab.contains(joined.as_str()) {
                return Err(UError::invalid(format!(
                    "tokenizer.ggml.merges[{i}] = {m:?}: the merged token {joined:?} is not in the vocabulary"
                )));
            }
            Ok((a.to_string(), b.to_string()))
        })
        .collect()
}

/// Pre-tokenizer names of the Llama-3 family (llama.cpp's `LLAMA3` type).
pub fn is_llama3_pre(pre: &str) -> bool {
    matches!(
        pre,
        "llama3"
            | "llama-v3"
            | "llama-bpe"
            | "falcon3"
            | "falcon-h1"
            | "pixtral"
            | "midm-2.0"
            | "lfm2"
    )
}
