//! A GGUF vocabulary: the `tokenizer.ggml.*` metadata, read and checked.
//!
//! Everything here is validated before any tokenizer is built: array lengths agree, special
//! token ids are in range, token types are known, merges name vocabulary tokens. Malformed
//! metadata gives an [`UError`] that names the key and what is wrong with it.

use crate::llama::pre::Pre;
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
    /// `gpt2`, `gemma4`, `whitespace`: BPE with ranked merges after a pre-tokenizer named by
    /// `tokenizer.ggml.pre` (byte-level, or over UTF-8 with `▁` for spaces).
    Bpe,
    /// `bert`: WordPiece, greedy longest match.
    Wpm,
    /// `t5`: SentencePiece unigram (Viterbi over scores) after the precompiled normalizer.
    Ugm,
    /// `rwkv`: greedy longest match over escaped byte strings.
    Rwkv,
}

/// Token attributes beyond the type, as llama.cpp derives them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attr {
    /// Also control (a token found by its text as end-of-turn, FIM or end-of-generation).
    pub control: bool,
    /// Spaces before it in the text are dropped (`<mask>` of some embedding models).
    pub lstrip: bool,
    /// Spaces after it in the text are dropped (Phi-3's special tokens).
    pub rstrip: bool,
}

/// A checked GGUF vocabulary.
#[derive(Clone, Debug)]
pub struct GgufVocab {
    /// The family.
    pub family: Family,
    /// `tokenizer.ggml.model` as written.
    pub model: String,
    /// `tokenizer.ggml.pre` (empty when absent; `gemma4` for the `gemma4` model).
    pub pre: String,
    /// The pre-tokenizer it names (byte-pair vocabularies only).
    pub pre_tokenizer: Option<Pre>,
    /// Token texts, by id.
    pub tokens: Vec<String>,
    /// Token scores (SentencePiece log-probabilities), by id; zero when absent.
    pub scores: Vec<f32>,
    /// Token types, by id; all normal when absent. Tokens llama.cpp treats as user-defined
    /// whatever the file says (gpt-oss's channel markers) are user-defined here.
    pub types: Vec<TokenType>,
    /// Attributes derived from the texts and the model's name, by id.
    pub attrs: Vec<Attr>,
    /// End-of-generation tokens found by their text (and FIM pad/repo/file-separator).
    pub eog_by_text: Vec<u32>,
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
    /// Whether the model wants SEP after the text (embedding models read it; tokenizing never
    /// appends it, except WordPiece, which always ends with SEP).
    pub add_sep: bool,
    /// Whether a space is prepended to the text (SentencePiece).
    pub add_space_prefix: bool,
    /// Whether runs of spaces become one (unigram normalizer).
    pub remove_extra_whitespaces: bool,
    /// Whether WordPiece (and the `whitespace` model) lowercases.
    pub lowercase: bool,
    /// Whether WordPiece strips accents.
    pub strip_accents: bool,
    /// The unigram normalizer's precompiled character map (empty: none).
    pub charsmap: Vec<u8>,
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
            "gpt2" | "gemma4" | "whitespace" => Family::Bpe,
            "bert" => Family::Wpm,
            "t5" => Family::Ugm,
            "rwkv" => Family::Rwkv,
            other => {
                return Err(UError::unsupported(format!(
                    "tokenizer.ggml.model = {other:?} is not supported (supported: llama, gpt2, \
                     gemma4, whitespace, bert, t5, rwkv)"
                )));
            }
        };
        let pre = if model == "gemma4" {
            "gemma4".to_string()
        } else {
            get_str(src, &key("pre"))?.unwrap_or_default()
        };
        // Only byte-pair vocabularies consult the pre-tokenizer name.
        let pre_tokenizer = match family {
            Family::Bpe => Some(Pre::by_name(&pre).ok_or_else(|| {
                UError::unsupported(format!(
                    "tokenizer.ggml.pre = {pre:?} is not a known pre-tokenizer"
                ))
            })?),
            _ => None,
        };

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
            (Family::Bpe, None) if pre == "kimi-k2" => Vec::new(),
            (Family::Bpe, None) => {
                return Err(UError::not_found(format!(
                    "tokenizer.ggml.model is {model} but tokenizer.ggml.merges is missing"
                )));
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
            Family::Bpe if model == "gemma4" => (None, None, None, None),
            Family::Bpe => (Some(11), Some(11), None, None),
            Family::Wpm => (Some(101), None, Some(100), Some(102)),
            Family::Ugm => (None, Some(1), Some(2), None),
            Family::Rwkv => (None, None, None, None),
        };
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        bos = in_range(bos);
        eos = in_range(eos);
        unk = in_range(unk);
        sep = in_range(sep);
        if let Some(id) = get_id(src, &key("bos_token_id"), n)? {
            bos = Some(id);
        }
        if pre_tokenizer.is_some_and(|p| p.no_bos) {
            bos = None;
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
        let eot = get_id(src, &key("eot_token_id"), n)?;
        let eom = get_id(src, &key("eom_token_id"), n)?;
        let general = |k: &str| get_str(src, k).ok().flatten().unwrap_or_default();
        let Derived {
            types,
            attrs,
            eot,
            eom,
            eog_by_text,
        } = derive_attrs(
            &tokens,
            types,
            eot,
            eom,
            &pre,
            &general("general.name"),
            &general("general.architecture"),
            |k| get_id(src, &key(k), n).ok().flatten().is_some(),
        );

        let (mut add_bos, mut add_eos, mut add_sep) = match family {
            Family::Spm => (true, false, false),
            Family::Bpe => {
                let p = pre_tokenizer.expect("byte-pair vocabularies have a pre-tokenizer");
                (p.add_bos, false, p.add_sep)
            }
            Family::Wpm => (true, false, true),
            Family::Ugm => (false, true, false),
            Family::Rwkv => (false, false, false),
        };
        if let Some(b) = get_bool(src, &key("add_bos_token"))? {
            add_bos = b;
        }
        if let Some(b) = get_bool(src, &key("add_eos_token"))? {
            add_eos = b;
        }
        if let Some(b) = get_bool(src, &key("add_sep_token"))? {
            add_sep = b;
        }
        // Gemma 4's pre-tokenizer always adds BOS.
        if pre_tokenizer.is_some_and(|p| p.group == crate::llama::pre::Group::Gemma4) {
            add_bos = true;
        }
        let add_space_prefix =
            get_bool(src, &key("add_space_prefix"))?.unwrap_or(family == Family::Spm);
        let remove_extra_whitespaces =
            get_bool(src, &key("remove_extra_whitespaces"))?.unwrap_or(false);
        let lowercase = get_bool(src, &key("normalizer.lowercase"))?.unwrap_or(pre != "whitespace");
        let strip_accents = get_bool(src, &key("normalizer.strip_accents"))?.unwrap_or(lowercase);
        let charsmap = match src.meta(&key("precompiled_charsmap")) {
            None => Vec::new(),
            Some(MetaValue::UIntArray(v)) => v.iter().map(|&b| b as u8).collect(),
            Some(MetaValue::IntArray(v)) => v.iter().map(|&b| b as u8).collect(),
            Some(other) => {
                return Err(UError::invalid(format!(
                    "tokenizer.ggml.precompiled_charsmap: expected a byte array, found {}",
                    kind(&other)
                )));
            }
        };
        if matches!(family, Family::Wpm | Family::Ugm) && unk.is_none() {
            return Err(UError::invalid(format!(
                "a {model} vocabulary needs tokenizer.ggml.unknown_token_id (it has no token at \
                 the default id)"
            )));
        }
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

        let chat_template = get_str(src, "tokenizer.chat_template")?;

        Ok(Self {
            family,
            model,
            pre,
            pre_tokenizer,
            tokens,
            scores,
            types,
            attrs,
            eog_by_text,
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
            remove_extra_whitespaces,
            lowercase,
            strip_accents,
            charsmap,
            chat_template,
        })
    }

    /// The ids that end generation: EOS, EOT, EOM and the end-of-generation tokens llama.cpp
    /// recognises by their text, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = [self.eos, self.eot, self.eom]
            .into_iter()
            .flatten()
            .chain(self.eog_by_text.iter().copied())
            .collect();
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
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts llama.cpp takes as fill-in-the-middle tokens (prefix, suffix, middle, pad, repo,
/// file separator) when their ids are absent; each list names the GGUF key it stands for.
const FIM_TEXTS: &[(&str, &[&str])] = &[
    (
        "fim_pre_token_id",
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
    ),
    (
        "fim_suf_token_id",
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
    ),
    (
        "fim_mid_token_id",
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
    ),
    (
        "fim_pad_token_id",
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
    ),
    (
        "fim_rep_token_id",
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
    ),
    ("fim_sep_token_id", &["<|file_sep|>"]),
];

/// Texts llama.cpp treats as end-of-generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Tokens llama.cpp always splits out of text (gpt-oss's channel markers).
const FORCED_USER_DEFINED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// What [`derive_attrs`] finds.
struct Derived {
    types: Vec<TokenType>,
    attrs: Vec<Attr>,
    eot: Option<u32>,
    eom: Option<u32>,
    eog_by_text: Vec<u32>,
}

/// llama.cpp's attribute rules: tokens found by text as end-of-turn, end-of-message, FIM or
/// end-of-generation become control tokens (and fill `eot`/`eom` when unset); control tokens
/// named `unused` become unused; forced user-defined tokens; `<|end|>` and `</s>` demoted where
/// llama.cpp demotes them (and then do not end generation); and the strip rules of Phi-3 and
/// some embedding models. `has_key` tells whether a FIM id key is set.
#[allow(clippy::too_many_arguments)]
fn derive_attrs(
    tokens: &[String],
    mut types: Vec<TokenType>,
    mut eot: Option<u32>,
    mut eom: Option<u32>,
    pre: &str,
    name: &str,
    architecture: &str,
    has_key: impl Fn(&str) -> bool,
) -> Derived {
    let mut attrs = vec![Attr::default(); tokens.len()];
    let mut eog_by_text = Vec::new();
    let id_of = |texts: &[&str]| {
        tokens
            .iter()
            .position(|t| texts.contains(&t.as_str()))
            .map(|i| i as u32)
    };
    let control = |id: Option<u32>, attrs: &mut [Attr]| {
        if let Some(i) = id {
            attrs[i as usize].control = true;
        }
    };
    if eot.is_none() {
        eot = id_of(EOT_TEXTS);
        control(eot, &mut attrs);
    }
    if eom.is_none() {
        eom = id_of(&["<|eom_id|>"]);
        control(eom, &mut attrs);
    }
    for (k, texts) in FIM_TEXTS {
        if !has_key(k) {
            let id = id_of(texts);
            control(id, &mut attrs);
            // FIM pad, repo and file separator also end generation.
            if ["fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id"].contains(k) {
                eog_by_text.extend(id);
            }
        }
    }
    let mut end = None;
    let (mut has_return, mut has_call, mut has_flush) = (false, false, false);
    let (mut s_marker, mut s_id) = (false, None);
    for (i, t) in tokens.iter().enumerate() {
        let t = t.as_str();
        if EOG_TEXTS.contains(&t) {
            attrs[i].control = true;
            eog_by_text.push(i as u32);
        }
        match t {
            "<|return|>" => has_return = true,
            "<|call|>" | "<|calls|>" => has_call = true,
            "<|flush|>" => has_flush = true,
            "<|end|>" => end = Some(i),
            "<|tool_response>" | "<|plamo:eos|>" => s_marker = true,
            "</s>" => s_id = Some(i),
            _ => {}
        }
    }
    for (i, t) in tokens.iter().enumerate() {
        let is_control = types[i] == TokenType::Control || attrs[i].control;
        if is_control && t.contains("unused") {
            types[i] = TokenType::Unused;
            attrs[i].control = false;
        }
        if FORCED_USER_DEFINED.contains(&t.as_str()) {
            types[i] = TokenType::UserDefined;
            attrs[i] = Attr::default();
        }
    }
    if let Some(end) = end
        && has_call
        && (has_return || has_flush)
    {
        types[end] = TokenType::UserDefined;
        attrs[end] = Attr::default();
        eog_by_text.retain(|&i| i as usize != end);
    }
    if let Some(s) = s_id
        && s_marker
    {
        types[s] = TokenType::Normal;
        attrs[s] = Attr::default();
        eog_by_text.retain(|&i| i as usize != s);
    }
    let mask_lstrip = ["jina-v2-de", "jina-v2-es", "jina-v2-code"]
        .iter()
        .any(|p| pre.contains(p))
        || ["nomic-bert-moe", "jina-bert-v3"]
            .iter()
            .any(|a| architecture.contains(a));
    let lname = name.to_lowercase();
    for (i, t) in tokens.iter().enumerate() {
        let t = t.as_str();
        if mask_lstrip && t == "<mask>" {
            attrs[i].lstrip = true;
        }
        if lname.contains("modern-bert") && t == "[MASK]" {
            attrs[i].lstrip = true;
        }
        if lname.contains("phi-3") || lname.contains("phi3") {
            let special = matches!(
                types[i],
                TokenType::Control | TokenType::UserDefined | TokenType::Unknown
            ) || attrs[i].control;
            if special || t == "</s>" {
                attrs[i].rstrip = true;
            }
            if matches!(t, "<unk>" | "<s>" | "<|endoftext|>") {
                attrs[i].rstrip = false;
            }
        }
    }
    Derived {
        types,
        attrs,
        eot,
        eom,
        eog_by_text,
    }
}

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
