//! llama.cpp's tokenizers for GGUF vocabularies, so that a GGUF model is tokenized exactly as
//! llama.cpp tokenizes it: the special-token partition, then per family
//! SentencePiece BPE ([`spm`]), byte-pair merges after a named pre-tokenizer ([`bpe`],
//! [`split`], [`pre`]), WordPiece ([`wpm`]), the unigram model with its precompiled normalizer
//! ([`ugm`]) or RWKV's greedy byte match ([`rwkv`]).

pub mod bpe;
pub mod pre;
pub mod rwkv;
pub mod split;
pub mod spm;
pub mod ugm;
pub mod unicode;
pub mod wpm;

use crate::vocab::{Family, GgufVocab, TokenType};
use std::collections::HashMap;
use u_sdk::UError;

/// The tokenizer of one family, built once.
enum Model {
    Spm,
    Bpe(bpe::Bpe),
    Wpm,
    Ugm(ugm::Ugm),
    Rwkv(rwkv::Rwkv),
}

/// A GGUF vocabulary ready to encode.
pub struct Engine {
    model: Model,
    /// Token text → id (every token).
    ids: HashMap<String, u32>,
    /// Scores by id (SentencePiece and unigram).
    scores: Vec<f32>,
    /// Tokens split out of text before tokenizing it, longest first: (id, matched only when
    /// special tokens are parsed, lstrip, rstrip).
    specials: Vec<(u32, bool, bool, bool)>,
    tokens: Vec<String>,
    family: Family,
    bos: Option<u32>,
    eos: Option<u32>,
    sep: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    escape_whitespaces: bool,
    lowercase: bool,
    strip_accents: bool,
    max_token_len: usize,
}

/// A piece of text after the special-token partition.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

impl Engine {
    /// Builds the tokenizer of a checked vocabulary.
    pub fn new(v: &GgufVocab) -> Result<Engine, UError> {
        let ids: HashMap<String, u32> = v
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let model = match v.family {
            Family::Spm => Model::Spm,
            Family::Bpe => Model::Bpe(bpe::Bpe::new(v)?),
            Family::Wpm => Model::Wpm,
            Family::Ugm => Model::Ugm(ugm::Ugm::new(v)?),
            Family::Rwkv => Model::Rwkv(rwkv::Rwkv::new(&v.tokens)),
        };
        let mut specials: Vec<(u32, bool, bool, bool)> = (0..v.tokens.len())
            .filter_map(|i| {
                let (ty, a) = (v.types[i], v.attrs[i]);
                let control = matches!(ty, TokenType::Control | TokenType::Unknown) || a.control;
                (control || ty == TokenType::UserDefined)
                    .then_some((i as u32, control, a.lstrip, a.rstrip))
            })
            .collect();
        specials.sort_by(|a, b| {
            v.tokens[b.0 as usize]
                .len()
                .cmp(&v.tokens[a.0 as usize].len())
                .then(a.0.cmp(&b.0))
        });
        Ok(Engine {
            model,
            ids,
            scores: v.scores.clone(),
            specials,
            tokens: v.tokens.clone(),
            family: v.family,
            bos: v.bos,
            eos: v.eos,
            sep: v.sep,
            unk: v.unk,
            add_bos: v.add_bos,
            add_eos: v.add_eos,
            add_space_prefix: v.add_space_prefix,
            escape_whitespaces: v.pre_tokenizer.is_some_and(|p| p.escape_whitespaces),
            lowercase: v.lowercase,
            strip_accents: v.strip_accents,
            max_token_len: v.tokens.iter().map(String::len).max().unwrap_or(0),
        })
    }

    /// The id of a token text.
    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Splits `text` at special and user-defined tokens (control and unknown tokens only when
    /// `parse_special`), longest token first, dropping the spaces a token strips.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut frags = vec![Fragment::Text(text)];
        if text.is_empty() {
            return Vec::new();
        }
        for &(id, control, lstrip, rstrip) in &self.specials {
            if control && !parse_special {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(mut rest) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    let mut left = &rest[..at];
                    if lstrip {
                        left = left.trim_end_matches(|c: char| c.is_ascii_whitespace());
                    }
                    if !left.is_empty() {
                        next.push(Fragment::Text(left));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                    if rstrip {
                        rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace());
                    }
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }

    /// Encodes `text` as llama.cpp's `llama_tokenize` does: with `add_special` the family's
    /// BOS/EOS/SEP; with `parse_special` control tokens written in the text become their ids.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, UError> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::new();
        let need = |id: Option<u32>, what: &str| {
            id.ok_or_else(|| UError::invalid(format!("the vocabulary adds {what} but has none")))
        };
        match &self.model {
            Model::Spm => {
                if add_special && self.add_bos {
                    out.push(need(self.bos, "BOS")?);
                }
                let mut prev_special = true;
                for f in frags {
                    match f {
                        Fragment::Text(t) => {
                            let mut s = String::with_capacity(t.len() + 4);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(t);
                            let s = s.replace(' ', "\u{2581}");
                            spm::tokenize(self, &s, &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
                if add_special && self.add_eos {
                    out.push(need(self.eos, "EOS")?);
                }
            }
            Model::Bpe(b) => {
                if add_special && self.add_bos {
                    out.push(need(self.bos, "BOS")?);
                }
                for f in frags {
                    match f {
                        Fragment::Text(t) if self.escape_whitespaces => {
                            b.tokenize(self, &t.replace(' ', "\u{2581}"), &mut out)
                        }
                        Fragment::Text(t) => b.tokenize(self, t, &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special && self.add_eos {
                    out.push(need(self.eos, "EOS")?);
                }
            }
            Model::Wpm => {
                if add_special {
                    out.push(need(self.bos, "CLS (BOS)")?);
                }
                for f in frags {
                    match f {
                        Fragment::Text(t) => wpm::tokenize(self, t, &mut out)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special {
                    out.push(need(self.sep, "SEP")?);
                }
            }
            Model::Ugm(u) => {
                if add_special && self.add_bos {
                    out.push(need(self.bos, "BOS")?);
                }
                for f in frags {
                    match f {
                        Fragment::Text(t) => u.tokenize(self, t, &mut out)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special && self.add_eos {
                    out.push(need(self.eos, "EOS")?);
                }
            }
            Model::Rwkv(r) => {
                for f in frags {
                    match f {
                        Fragment::Text(t) => r.tokenize(self, t, &mut out)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        Ok(out)
    }

    /// The unknown token, or an error naming why one was needed.
    fn unknown(&self, why: &str) -> Result<u32, UError> {
        self.unk.ok_or_else(|| {
            UError::invalid(format!(
                "{why}, and the vocabulary has no unknown token ({:?})",
                self.family
            ))
        })
    }
}
