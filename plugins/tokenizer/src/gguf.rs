//! GGUF vocabulary → [`Tok`]: llama.cpp's tokenizer of the family ([`crate::llama::Engine`])
//! for encoding, and the piece scheme that turns token texts into bytes for decoding.

use crate::{
    Tok,
    core::{Encoder, Parts, PieceScheme},
    llama::Engine,
    vocab::{Family, GgufVocab},
};
use u_sdk::UError;

impl Tok {
    /// Builds a tokenizer from GGUF-style metadata (`tokenizer.ggml.*`).
    pub fn from_meta(src: &dyn crate::vocab::MetaSource) -> Result<Self, UError> {
        Self::from_gguf_vocab(&GgufVocab::from_meta(src)?)
    }

    /// Builds a tokenizer from a checked GGUF vocabulary.
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Self, UError> {
        let engine = Engine::new(v)?;
        let byte_level = v.pre_tokenizer.is_some_and(|p| p.group.patterns().1);
        let (scheme, strip) = match v.family {
            Family::Spm | Family::Ugm => (PieceScheme::Spm('▁'), v.add_space_prefix),
            Family::Bpe if byte_level => (PieceScheme::ByteLevel, false),
            Family::Bpe => (PieceScheme::Spm('▁'), false),
            // llama.cpp keeps the word-start marker as `▁`; decoding drops the first space.
            Family::Wpm => (PieceScheme::Spm('▁'), true),
            Family::Rwkv => (PieceScheme::Rwkv, false),
        };
        Ok(Self::new(Parts {
            encoder: Encoder::Llama(Box::new(engine)),
            tokens: v.tokens.clone(),
            types: v.types.clone(),
            scheme,
            strip_leading_space: strip,
            bos: v.bos,
            eos: v.eos,
            eog: v.eog_ids(),
            merges: Vec::new(),
            add_bos: v.add_bos,
            pad: v.pad,
            chat_template: v.chat_template.clone(),
        }))
    }
}
