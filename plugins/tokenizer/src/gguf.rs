//! GGUF vocabulary → HF `tokenizers` pipeline, one recipe per `tokenizer.ggml.model`.
//!
//! - `llama` (SentencePiece BPE): a BPE model with byte fallback whose merges are derived from
//!   the scores (every split of a piece into two vocabulary pieces, ranked by the piece's score,
//!   as HF's `SentencePieceExtractor` does), after `Prepend("▁")` + `Replace(" ", "▁")`.
//! - `gpt2` (byte-level BPE): the file's ranked merges, a sequence of `Split` pre-tokenizers
//!   chosen by `tokenizer.ggml.pre` (llama.cpp's regexes for that type) and `ByteLevel`.
//! - `bert` (WordPiece): llama.cpp stores word starts as `▁x` and continuations as `x`; they
//!   become `x` and `##x` again for HF's `WordPiece`, behind `BertNormalizer` and
//!   `BertPreTokenizer`.
//!
//! Control and unknown tokens become special added tokens (matched in text only when special
//! tokens are parsed); user-defined tokens become ordinary added tokens (always matched), which
//! is how llama.cpp partitions text before tokenizing it.

use crate::vocab::{Family, GgufVocab, TokenType, is_llama3_pre};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
    Tokenizer,
    decoders::{
        byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as DecSeq, strip::Strip,
        wordpiece::WordPiece as WordPieceDecoder,
    },
    models::{bpe::BPE, bpe::Vocab, wordpiece::WordPiece},
    normalizers::replace::Replace as DecReplace,
    normalizers::{BertNormalizer, Prepend, Replace, Sequence as NormSeq},
    pre_tokenizers::{
        bert::BertPreTokenizer, byte_level::ByteLevel, sequence::Sequence as PreSeq, split::Split,
    },
    processors::template::{SpecialToken, TemplateProcessing},
};
use u_sdk::UError;

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

/// The pre-tokenizer regexes (applied in order) and whether merges are skipped for whole-word
/// tokens, for a `tokenizer.ggml.pre` value; mirrors llama.cpp's table.
pub fn bpe_pre(pre: &str) -> Result<(Vec<&'static str>, bool), UError> {
    Ok(match pre {
        p if is_llama3_pre(p) => (vec![LLAMA3], true),
        "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => (vec![LLAMA3], false),
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" | "hunyuan" => (vec![QWEN2], false),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "trillion"
        | "exaone4" | "granite-docling" | "a.x-4.0" | "mellum" | "modern-bert" => {
            (vec![GPT2], false)
        }
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec![r"\p{N}", GPT2], false)
        }
        "falcon" => (
            vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
            false,
        ),
        "deepseek-coder" => (
            vec![
                r"[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                r"[一-龥ࠀ-一가-퟿]+",
                r"\p{N}",
            ],
            false,
        ),
        "deepseek-v3" => (vec![r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3], false),
        "gpt-4o" | "llama4" => (vec![GPT4O], false),
        "tekken" => (vec![TEKKEN], true),
        "bloom" | "poro-chat" | "gpt3-finnish" => (vec![r" ?[^(\s|.,!?…。，、।۔،)]+"], false),
        "" | "default" => (
            vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            false,
        ),
        other => {
            return Err(UError::unsupported(format!(
                "tokenizer.ggml.pre = {other:?} is not a known pre-tokenizer"
            )));
        }
    })
}

fn hf_err(what: &str) -> impl Fn(tokenizers::Error) -> UError + '_ {
    move |e| UError::invalid(format!("{what}: {e}"))
}

/// Builds the HF tokenizer for a checked GGUF vocabulary.
pub fn build(v: &GgufVocab) -> Result<Tokenizer, UError> {
    let mut tok = match v.family {
        Family::Spm => build_spm(v)?,
        Family::Bpe => build_bpe(v)?,
        Family::Wpm => build_wpm(v)?,
    };
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (t, ty) in v.tokens.iter().zip(&v.types) {
        match ty {
            TokenType::Control | TokenType::Unknown => {
                special.push(AddedToken::from(t.as_str(), true).normalized(false));
            }
            TokenType::UserDefined => {
                user.push(AddedToken::from(t.as_str(), false).normalized(false));
            }
            _ => {}
        }
    }
    tok.add_special_tokens(&special);
    tok.add_tokens(&user);
    tok.with_decoder(Some(decoder(v)?));
    if let Some(post) = post_processor(v)? {
        tok.with_post_processor(Some(post));
    }
    Ok(tok)
}

/// HF's decoder for the family, so that [`Tokenizer::to_string`] is a complete `tokenizer.json`.
fn decoder(v: &GgufVocab) -> Result<DecoderWrapper, UError> {
    Ok(match v.family {
        Family::Spm => {
            let mut steps: Vec<DecoderWrapper> = vec![
                DecReplace::new("▁", " ")
                    .map_err(hf_err("space decoder"))?
                    .into(),
                ByteFallback::new().into(),
                Fuse::new().into(),
            ];
            if v.add_space_prefix {
                steps.push(Strip::new(' ', 1, 0).into());
            }
            DecSeq::new(steps).into()
        }
        Family::Bpe => ByteLevel::new(false, false, false).into(),
        Family::Wpm => WordPieceDecoder::new("##".into(), false).into(),
    })
}

/// BOS/EOS/SEP as a `TemplateProcessing` post-processor (what `add_special` adds).
fn post_processor(v: &GgufVocab) -> Result<Option<TemplateProcessing>, UError> {
    let mut pieces = Vec::new();
    let mut specials = Vec::new();
    let mut add = |name: &str, id: Option<u32>, pieces: &mut Vec<String>| -> Result<(), UError> {
        let id = id.ok_or_else(|| {
            UError::invalid(format!("add_{name} is set but there is no {name} token"))
        })?;
        pieces.push(name.to_string());
        specials.push(
            SpecialToken::new(name.into(), vec![id], vec![v.tokens[id as usize].clone()])
                .map_err(hf_err("special token"))?,
        );
        Ok(())
    };
    if v.add_bos {
        add("bos", v.bos, &mut pieces)?;
    }
    pieces.push("$A".into());
    if v.add_eos {
        add("eos", v.eos, &mut pieces)?;
    }
    if v.add_sep {
        add("sep", v.sep, &mut pieces)?;
    }
    if pieces.len() == 1 {
        return Ok(None);
    }
    let mut pair = pieces.clone();
    pair.extend(pieces.iter().filter(|p| *p != "bos").map(|p| {
        if p == "$A" {
            "$B:1".to_string()
        } else {
            format!("{p}:1")
        }
    }));
    let post = TemplateProcessing::builder()
        .try_single(pieces)
        .and_then(|b| b.try_pair(pair))
        .map_err(|e| UError::invalid(format!("post-processor template: {e}")))?
        .special_tokens(specials)
        .build()
        .map_err(|e| UError::invalid(format!("post-processor: {e}")))?;
    Ok(Some(post))
}

fn full_vocab(v: &GgufVocab) -> Vocab {
    v.tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

fn build_spm(v: &GgufVocab) -> Result<Tokenizer, UError> {
    let merges = spm_merges(v);
    let mut b = BPE::builder()
        .vocab_and_merges(full_vocab(v), merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = v.unk {
        b = b.unk_token(v.tokens[unk as usize].clone());
    }
    let model = b
        .build()
        .map_err(hf_err("building the SentencePiece BPE model"))?;
    let mut tok = Tokenizer::new(model);
    let mut norms: Vec<NormalizerWrapper> = Vec::new();
    if v.add_space_prefix {
        norms.push(Prepend::new("▁".into()).into());
    }
    norms.push(
        Replace::new(" ", "▁")
            .map_err(hf_err("space normalizer"))?
            .into(),
    );
    tok.with_normalizer(Some(NormSeq::new(norms)));
    Ok(tok)
}

/// Merges implied by SentencePiece scores: each normal piece, split every way into two normal
/// pieces, ranked by the piece's score (highest first), ties by piece id then part ids.
fn spm_merges(v: &GgufVocab) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, u32> = v
        .tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| v.types[*i] == TokenType::Normal)
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    let mut found: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (&t, &id) in &ids {
        for (k, _) in t.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&t[..k]), ids.get(&t[k..])) {
                found.push((v.scores[id as usize], id, l, r));
            }
        }
    }
    found.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    found
        .into_iter()
        .map(|(_, _, l, r)| (v.tokens[l as usize].clone(), v.tokens[r as usize].clone()))
        .collect()
}

fn build_bpe(v: &GgufVocab) -> Result<Tokenizer, UError> {
    let (regexes, ignore_merges) = bpe_pre(&v.pre)?;
    let model = BPE::builder()
        .vocab_and_merges(full_vocab(v), v.merges.clone())
        .ignore_merges(ignore_merges)
        .build()
        .map_err(hf_err("building the byte-level BPE model"))?;
    let mut tok = Tokenizer::new(model);
    let mut pres: Vec<PreTokenizerWrapper> = Vec::new();
    for r in regexes {
        let split = Split::new(
            tokenizers::pre_tokenizers::split::SplitPattern::Regex(r.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(hf_err("pre-tokenizer regex"))?;
        pres.push(split.into());
    }
    pres.push(ByteLevel::new(false, false, false).into());
    tok.with_pre_tokenizer(Some(PreSeq::new(pres)));
    Ok(tok)
}

fn build_wpm(v: &GgufVocab) -> Result<Tokenizer, UError> {
    let mut vocab = Vocab::default();
    for (i, (t, ty)) in v.tokens.iter().zip(&v.types).enumerate() {
        let hf = if *ty == TokenType::Normal {
            match t.strip_prefix('▁') {
                Some(word) if !word.is_empty() => word.to_string(),
                _ => format!("##{t}"),
            }
        } else {
            t.clone()
        };
        if vocab.insert(hf.clone(), i as u32).is_some() {
            return Err(UError::invalid(format!(
                "tokenizer.ggml.tokens: WordPiece token {hf:?} occurs twice"
            )));
        }
    }
    let unk = v.unk.map(|u| v.tokens[u as usize].clone()).ok_or_else(|| {
        UError::invalid("a bert vocabulary needs tokenizer.ggml.unknown_token_id")
    })?;
    let model = WordPiece::builder()
        .vocab(vocab)
        .unk_token(unk)
        .continuing_subword_prefix("##".into())
        .build()
        .map_err(hf_err("building the WordPiece model"))?;
    let mut tok = Tokenizer::new(model);
    tok.with_normalizer(Some(BertNormalizer::new(true, true, None, v.lowercase)));
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    Ok(tok)
}

impl crate::Tok {
    /// Builds a tokenizer from GGUF-style metadata (`tokenizer.ggml.*`).
    pub fn from_meta(src: &dyn crate::vocab::MetaSource) -> Result<Self, UError> {
        Self::from_gguf_vocab(&GgufVocab::from_meta(src)?)
    }

    /// Builds a tokenizer from a checked GGUF vocabulary.
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Self, UError> {
        use crate::core::{Parts, PieceScheme};
        let hf = build(v)?;
        let (scheme, strip) = match v.family {
            Family::Spm => (PieceScheme::Spm('▁'), v.add_space_prefix),
            Family::Bpe => (PieceScheme::ByteLevel, false),
            // llama.cpp keeps the word-start marker as `▁`; HF strips the first space.
            Family::Wpm => (PieceScheme::Spm('▁'), true),
        };
        Ok(Self::new(Parts {
            hf,
            tokens: v.tokens.clone(),
            types: v.types.clone(),
            scheme,
            strip_leading_space: strip,
            bos: v.bos,
            eog: v.eog_ids(),
            add_bos: v.add_bos,
            chat_template: v.chat_template.clone(),
        }))
    }
}
