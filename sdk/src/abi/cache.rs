//! Cache plugins: the key/value memory of running sequences.
//!
//! Sequences are handles into a paged store. Forking a sequence shares its pages (copy on
//! write); the model appends each layer's keys and values and reads them back page by page, so
//! attention runs over pages in place.

use crate::abi::{dtype::DType, error::UError};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RStr, RString, RVec},
};

/// Identifies a sequence inside one cache.
pub type SeqId = u64;

/// The shape of the KV data a model stores per token and layer.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Number of transformer layers.
    pub layers: u32,
    /// Key/value heads per layer.
    pub kv_heads: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Storage type (`F32`, `F16` or `I8` for int8 KV).
    pub dtype: DType,
    /// An identity of the model (e.g. a hash of its weights), so cached KV of another model is
    /// never used.
    pub model_id: RString,
}

/// One page of a sequence's keys and values for one layer, borrowed from the cache.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct KvPage<'a> {
    /// Number of tokens stored in this page.
    pub tokens: u32,
    /// Keys: tokens × kv_heads × head_dim, as f32.
    pub keys: RSlice<'a, f32>,
    /// Values: tokens × kv_heads × head_dim, as f32.
    pub values: RSlice<'a, f32>,
}

/// The deepest cached prefix found for a token sequence.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct PrefixMatch {
    /// A new sequence holding the matched prefix's KV (shared, not copied).
    pub seq: SeqId,
    /// Number of leading tokens whose KV is cached.
    pub matched: u64,
}

/// Entry interface of a `cache` plugin.
#[sabi_trait]
pub trait KvCache: Send + Sync + Clone {
    /// Declares the layout; must be called once before any sequence is created.
    fn configure(&self, layout: KvLayout) -> RResult<(), UError>;

    /// Creates an empty sequence.
    fn create(&self) -> RResult<SeqId, UError>;

    /// Forks `seq`: the new sequence shares every page (no data copied).
    fn fork(&self, seq: SeqId) -> RResult<SeqId, UError>;

    /// Frees a sequence (its pages once nothing else shares them).
    fn release(&self, seq: SeqId) -> RResult<(), UError>;

    /// Number of tokens stored for `seq`.
    fn len(&self, seq: SeqId) -> RResult<u64, UError>;

    /// Drops tokens past `len` (rollback).
    fn truncate(&self, seq: SeqId, len: u64) -> RResult<(), UError>;

    /// Appends `tokens` positions of keys and values for `layer` (tokens × kv_heads × head_dim).
    fn append(
        &self,
        seq: SeqId,
        layer: u32,
        keys: RSlice<'_, f32>,
        values: RSlice<'_, f32>,
    ) -> RResult<(), UError>;

    /// The pages holding `layer`'s KV for `seq`, in token order.
    fn pages<'a>(&'a self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage<'a>>, UError>;

    /// Finds the deepest cached prefix of `tokens` and returns a sequence holding it.
    fn lookup_prefix(&self, tokens: RSlice<'_, u32>) -> RResult<PrefixMatch, UError>;

    /// Records that `seq` holds the KV of `tokens`, so later lookups can share it.
    fn insert_prefix(&self, tokens: RSlice<'_, u32>, seq: SeqId) -> RResult<(), UError>;

    /// Saves `seq` under `name` as a checkpoint.
    fn save_checkpoint(&self, name: RStr<'_>, seq: SeqId) -> RResult<(), UError>;

    /// Returns a new sequence forked from checkpoint `name`.
    fn load_checkpoint(&self, name: RStr<'_>) -> RResult<SeqId, UError>;

    /// Names of all checkpoints.
    fn checkpoints(&self) -> RResult<RVec<RString>, UError>;

    /// Deletes checkpoint `name`.
    fn delete_checkpoint(&self, name: RStr<'_>) -> RResult<(), UError>;
}

/// An owned cache object.
pub type KvCacheBox = KvCache_TO<'static, RBox<()>>;
