//! [`Tok`]: one tokenizer, whatever it was built from, and its ABI face.
//!
//! Encoding runs llama.cpp's algorithms for GGUF vocabularies ([`crate::llama`]) and the HF
//! `tokenizers` pipeline for `tokenizer.json`. Decoding is done here, from each token's raw
//! bytes ([`Tok::token_bytes`]), so that `decode` is exactly the concatenation of the pieces a
//! streaming client receives: byte-fallback tokens and byte-level pieces that split a UTF-8
//! character join up again, and only the final text is made valid UTF-8 (lossily).

use crate::vocab::TokenType;
use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec, Tuple2};
use std::{
    borrow::Cow,
    sync::{Arc, OnceLock},
};
use u_sdk::{MetaValue, SpecialTokens, Tokenizer as AbiTokenizer, TokenizerBox, UError};

/// How a normal token's text maps to bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PieceScheme {
    /// GPT-2 byte-to-unicode alphabet (`Ġ` for space).
    ByteLevel,
    /// SentencePiece: `▁` (or the given replacement) for space, `<0xXX>` byte tokens.
    Spm(char),
    /// WordPiece: continuation pieces carry the prefix, other pieces start a word (a space).
    WordPiece(String),
    /// The text as it is.
    Raw,
    /// RWKV: escaped byte strings (`\n`, `\xHH`).
    Rwkv,
}

/// What encodes: llama.cpp's tokenizer of a GGUF vocabulary, or HF's pipeline of a
/// `tokenizer.json`.
pub(crate) enum Encoder {
    Llama(Box<crate::llama::Engine>),
    Hf(Box<tokenizers::Tokenizer>),
}

/// Everything a built tokenizer knows.
pub(crate) struct Parts {
    pub encoder: Encoder,
    pub tokens: Vec<String>,
    pub types: Vec<TokenType>,
    pub scheme: PieceScheme,
    /// Drop one leading space of the first decoded piece (SentencePiece's space prefix).
    pub strip_leading_space: bool,
    pub bos: Option<u32>,
    /// The end-of-sequence token the file names (GGUF `eos_token_id`, the config's
    /// `eos_token`).
    pub eos: Option<u32>,
    pub eog: Vec<u32>,
    /// BPE merges by rank, `"left right"` (from a `tokenizer.json`; empty for GGUF, whose
    /// metadata holds them).
    pub merges: Vec<String>,
    pub add_bos: bool,
    /// The padding token the file names.
    pub pad: Option<u32>,
    pub chat_template: Option<String>,
}

struct Inner {
    parts: Parts,
    /// The same pipeline with special tokens treated as plain text, made on first use.
    raw: OnceLock<tokenizers::Tokenizer>,
}

/// A ready tokenizer; cloning shares it.
#[derive(Clone)]
pub struct Tok(Arc<Inner>);

impl Tok {
    pub(crate) fn new(parts: Parts) -> Self {
        Self(Arc::new(Inner {
            parts,
            raw: OnceLock::new(),
        }))
    }

    pub(crate) fn p(&self) -> &Parts {
        &self.0.parts
    }

    /// Number of token ids.
    pub fn vocab_size(&self) -> u32 {
        self.p().tokens.len() as u32
    }

    /// Encodes `text`. With `add_special`, adds BOS/EOS/SEP as the model expects; with
    /// `parse_special`, special tokens written in the text (`<|im_start|>`) become their ids,
    /// otherwise they are tokenized as plain text (llama.cpp's `parse_special = false`).
    /// User-defined tokens are always matched.
    pub fn encode_with(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, UError> {
        let p = self.p();
        let base = match &p.encoder {
            Encoder::Llama(engine) => return engine.encode(text, add_special, parse_special),
            Encoder::Hf(hf) => hf.as_ref(),
        };
        let hf = if parse_special {
            base
        } else {
            self.0.raw.get_or_init(|| {
                let mut t = base.clone();
                t.set_encode_special_tokens(true);
                t
            })
        };
        let enc = hf
            .encode_fast(text, add_special)
            .map_err(|e| UError::invalid(format!("tokenizer: encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes `text`, parsing special tokens written in it (what a rendered chat prompt needs).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, UError> {
        self.encode_with(text, add_special, true)
    }

    fn check(&self, id: u32) -> Result<usize, UError> {
        let n = self.p().tokens.len();
        if (id as usize) < n {
            Ok(id as usize)
        } else {
            Err(UError::invalid(format!(
                "token id {id} is out of range: the vocabulary has {n} tokens"
            )))
        }
    }

    /// The type of a token (added tokens from tokenizer.json are control or user-defined).
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.p().types.get(id as usize).copied()
    }

    /// Whether `id` is a special (control or unknown) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.p()
            .types
            .get(id as usize)
            .is_some_and(|t| t.is_special())
    }

    /// The raw bytes of one token: what it contributes to decoded text. A byte-fallback or
    /// byte-level token may hold part of a UTF-8 character; special tokens give their text.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, UError> {
        let i = self.check(id)?;
        Ok(self.piece(i).into_owned())
    }

    fn piece(&self, i: usize) -> Cow<'_, [u8]> {
        let p = self.p();
        let text = p.tokens[i].as_str();
        match p.types[i] {
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
                Cow::Borrowed(text.as_bytes())
            }
            TokenType::Unused => Cow::Borrowed(&[]),
            TokenType::Byte => match parse_byte_token(text) {
                Some(b) => Cow::Owned(vec![b]),
                None => Cow::Borrowed(text.as_bytes()),
            },
            TokenType::Normal | TokenType::Undefined => match &p.scheme {
                PieceScheme::Raw => Cow::Borrowed(text.as_bytes()),
                PieceScheme::Rwkv => Cow::Owned(crate::llama::rwkv::unescape(text)),
                PieceScheme::Spm(space) => {
                    if text.contains(*space) {
                        Cow::Owned(text.replace(*space, " ").into_bytes())
                    } else {
                        Cow::Borrowed(text.as_bytes())
                    }
                }
                PieceScheme::ByteLevel => Cow::Owned(byte_level_decode(text)),
                PieceScheme::WordPiece(prefix) => match text.strip_prefix(prefix.as_str()) {
                    Some(rest) => Cow::Borrowed(rest.as_bytes()),
                    None => Cow::Owned(format!(" {text}").into_bytes()),
                },
            },
        }
    }

    /// Decodes ids to bytes; with `skip_special`, control and unknown tokens are left out.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>, UError> {
        let mut out = Vec::new();
        let mut first = true;
        for &id in ids {
            let i = self.check(id)?;
            if skip_special && self.p().types[i].is_special() {
                continue;
            }
            let piece = self.piece(i);
            if first && self.p().strip_leading_space && piece.first() == Some(&b' ') {
                out.extend_from_slice(&piece[1..]);
            } else {
                out.extend_from_slice(&piece);
            }
            first = false;
        }
        Ok(out)
    }

    /// Decodes ids to text (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, UError> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The text of a token as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.p().tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a token text, if it is in the vocabulary.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.p().encoder {
            Encoder::Llama(engine) => engine.id(text),
            Encoder::Hf(hf) => hf.token_to_id(text),
        }
    }

    /// BOS, end-of-generation ids, whether BOS is added, and the padding token.
    pub fn special_tokens(&self) -> SpecialTokens {
        let p = self.p();
        SpecialTokens {
            bos: p.bos.into(),
            eos: p.eog.iter().copied().collect(),
            add_bos: p.add_bos,
            pad: p.pad.into(),
        }
    }

    /// The chat template (Jinja), if the model ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.p().chat_template.as_deref()
    }

    /// The HF tokenizer of a `tokenizer.json` (GGUF vocabularies have none).
    pub fn hf(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.p().encoder {
            Encoder::Hf(hf) => Some(hf.as_ref()),
            Encoder::Llama(_) => None,
        }
    }

    /// This tokenizer as an ABI object.
    pub fn into_box(self) -> TokenizerBox {
        TokenizerBox::new(self)
    }
}

/// `<0xAB>` → `0xAB`.
pub(crate) fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The inverse of GPT-2's `bytes_to_unicode`, indexed by code point (all are below 324).
fn byte_level_table() -> &'static [i16; 324] {
    static TABLE: OnceLock<[i16; 324]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [-1i16; 324];
        let mut n = 0usize;
        for b in 0..=255u16 {
            let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
            if printable {
                t[b as usize] = b as i16;
            } else {
                t[256 + n] = b as i16;
                n += 1;
            }
        }
        t
    })
}

/// Byte-level text → bytes; characters outside the alphabet keep their UTF-8.
fn byte_level_decode(text: &str) -> Vec<u8> {
    let table = byte_level_table();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match table.get(c as usize) {
            Some(&b) if b >= 0 => out.push(b as u8),
            _ => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

impl AbiTokenizer for Tok {
    fn vocab_size(&self) -> RResult<u32, UError> {
        RResult::ROk(Tok::vocab_size(self))
    }

    fn encode(
        &self,
        text: RStr<'_>,
        add_special: bool,
        parse_special: bool,
    ) -> RResult<RVec<u32>, UError> {
        Tok::encode_with(self, text.as_str(), add_special, parse_special)
            .map(RVec::from)
            .into()
    }

    fn decode(&self, ids: RSlice<'_, u32>, skip_special: bool) -> RResult<RString, UError> {
        Tok::decode(self, ids.as_slice(), skip_special)
            .map(RString::from)
            .into()
    }

    fn token_bytes(&self, id: u32) -> RResult<RVec<u8>, UError> {
        Tok::token_bytes(self, id).map(RVec::from).into()
    }

    fn special_tokens(&self) -> RResult<SpecialTokens, UError> {
        RResult::ROk(Tok::special_tokens(self))
    }

    fn chat_template(&self) -> RResult<ROption<RString>, UError> {
        RResult::ROk(Tok::chat_template(self).map(RString::from).into())
    }

    fn gguf_metadata(&self) -> RResult<RVec<Tuple2<RString, MetaValue>>, UError> {
        Tok::gguf_metadata(self)
            .map(|pairs| {
                pairs
                    .into_iter()
                    .map(|(k, v)| Tuple2(RString::from(k), v))
                    .collect()
            })
            .into()
    }
}
