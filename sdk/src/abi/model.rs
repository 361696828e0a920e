//! Architecture plugins: build a runnable [`Model`] from a weight set, kernels and a cache.

use crate::abi::{
    cache::{KvCacheBox, SeqId},
    error::UError,
    kernels::{KernelsBox, RopeParams},
    loader::WeightSetBox,
};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RSliceMut, RString, RVec},
};

/// Hyper-parameters a server needs to know about a built model.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family the architecture recognised (`"llama"`, `"qwen3"`, `"mixtral"`…).
    pub family: RString,
    /// Vocabulary size (length of one logits row).
    pub vocab_size: u32,
    /// Longest context the model supports.
    pub context_length: u32,
    /// Transformer layers.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Experts per MoE layer (0 for dense models).
    pub experts: u32,
}

/// Which logits a sequence's chunk asks for.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// Only the last token's.
    Last,
    /// Every token's.
    All,
}

/// One sequence's part of a batched forward pass.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct SeqChunk<'a> {
    /// The sequence (its KV lives in the model's cache).
    pub seq: SeqId,
    /// New tokens to run; their positions continue from the sequence's current length.
    pub tokens: RSlice<'a, u32>,
    /// Which logits to produce.
    pub logits: LogitsWanted,
}

/// Entry interface of an `architecture` plugin.
#[sabi_trait]
pub trait Architecture: Send + Sync + Clone {
    /// Model families this plugin builds, e.g. `["llama", "mistral", "qwen2", "mixtral"]`.
    fn families(&self) -> RVec<RString>;

    /// Builds a model from `weights`, computing with `kernels` and storing KV in `cache`.
    fn build(
        &self,
        weights: WeightSetBox,
        kernels: KernelsBox,
        cache: KvCacheBox,
    ) -> RResult<ModelBox, UError>;
}

/// A built model.
#[sabi_trait]
pub trait Model: Send + Sync {
    /// Its hyper-parameters.
    fn config(&self) -> ModelConfig;

    /// The cache its KV lives in (to create, fork and release sequences).
    fn cache(&self) -> KvCacheBox;

    /// The rotation applied to cached keys (`None` for a model without RoPE), so a cache
    /// graft can re-rotate keys to other positions.
    fn key_rope(&self) -> ROption<RopeParams> {
        ROption::RNone
    }

    /// Mean over `tokens` of the final hidden state (after the output norm), `hidden` floats,
    /// computed in a scratch sequence that is released afterwards.
    fn embed(&self, _tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        RResult::RErr(UError::unsupported("this model computes no embeddings"))
    }

    /// Runs every chunk of `batch` in one pass, appending their KV, and writes the requested
    /// logits into `logits` in batch order (vocab_size floats per requested token).
    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        logits: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;
}

/// An owned architecture object.
pub type ArchitectureBox = Architecture_TO<'static, RBox<()>>;
/// An owned model object.
pub type ModelBox = Model_TO<'static, RBox<()>>;
