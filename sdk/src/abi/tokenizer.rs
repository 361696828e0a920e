//! Tokenizer plugins: text ↔ token ids, special tokens and chat templates.

use crate::abi::{error::UError, loader::WeightSetBox, tensor::MetaValue};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec, Tuple2},
};

/// Token ids with a special meaning.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence, if the model uses one.
    pub bos: ROption<u32>,
    /// Tokens that end generation (EOS, end-of-turn).
    pub eos: RVec<u32>,
    /// Whether `encode` with `add_special` prepends BOS.
    pub add_bos: bool,
    /// The token that pads a text to a fixed length (the config's `pad_token`, GGUF
    /// `padding_token_id`), where the model names one: what a diffusion pipeline fills its
    /// text encoder's 77 positions with.
    pub pad: ROption<u32>,
}

/// Entry interface of a `tokenizer` plugin: builds tokenizers from model files.
#[sabi_trait]
pub trait TokenizerFactory: Send + Sync + Clone {
    /// Builds the tokenizer a weight set describes (GGUF `tokenizer.ggml.*` metadata).
    fn build_from_weights(&self, weights: WeightSetBox) -> RResult<TokenizerBox, UError>;

    /// Builds a tokenizer from a HF `tokenizer.json` (read through the host).
    fn build_from_file(&self, path: RStr<'_>) -> RResult<TokenizerBox, UError>;
}

/// A ready tokenizer.
#[sabi_trait]
pub trait Tokenizer: Send + Sync + Clone {
    /// Number of token ids.
    fn vocab_size(&self) -> RResult<u32, UError>;

    /// Encodes `text`; with `add_special`, adds BOS (and other template tokens) as the model
    /// expects; with `parse_special`, special tokens written in the text (`<|im_start|>`) are
    /// their ids, otherwise plain text (user-defined tokens always match).
    fn encode(
        &self,
        text: RStr<'_>,
        add_special: bool,
        parse_special: bool,
    ) -> RResult<RVec<u32>, UError>;

    /// Decodes ids to text; with `skip_special`, special tokens are left out.
    fn decode(&self, ids: RSlice<'_, u32>, skip_special: bool) -> RResult<RString, UError>;

    /// The raw bytes of one token (for streaming partial UTF-8).
    fn token_bytes(&self, id: u32) -> RResult<RVec<u8>, UError>;

    /// BOS/EOS and friends.
    fn special_tokens(&self) -> RResult<SpecialTokens, UError>;

    /// The model's chat template (Jinja), if it ships one.
    fn chat_template(&self) -> RResult<ROption<RString>, UError>;

    /// This tokenizer as GGUF `tokenizer.ggml.*` metadata (and `tokenizer.chat_template`), in
    /// the order llama.cpp's converter writes the keys, so that a host writing GGUF from
    /// another format carries the vocabulary along; a tokenizer GGUF cannot describe is an
    /// error that says why.
    fn gguf_metadata(&self) -> RResult<RVec<Tuple2<RString, MetaValue>>, UError>;
}

/// An owned tokenizer factory.
pub type TokenizerFactoryBox = TokenizerFactory_TO<'static, RBox<()>>;
/// An owned tokenizer.
pub type TokenizerBox = Tokenizer_TO<'static, RBox<()>>;
