//! Cache plugins: the key/value memory of running sequences.
//!
//! Sequences are handles into a paged store. Forking a sequence shares its pages (copy on
//! write); the model appends each layer's keys and values and reads them back page by page, so
//! attention runs over pages in place. Pages live in buffers of the model's backend (the cache
//! allocates them there), so a device backend never copies KV per step. A cache stores and
//! indexes: position-dependent math (re-rotating keys for a graft) is the model's.
//!
//! Pages are `f32` unless a sequence opted into int8 ([`KvCache::set_dtype`], or a cache
//! configured so): then the pages it writes from then on hold `i8` values with one `f32` scale
//! per [`KV_INT8_GROUP`] values, which attention reads in place.

use crate::abi::{
    backend::{BackendBox, KV_INT8_GROUP, TensorDesc},
    dtype::DType,
    error::UError,
    transport::CheckpointInfo,
};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
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

/// One page of a sequence's keys and values for one layer: tensors in backend buffers the cache
/// owns (or a file it maps), read in place by attention.
///
/// An `F32` page's `keys`/`values` are `[tokens, kv_heads × head_dim]` `F32`; an `I8` page's are
/// `I8` with one `F32` scale per [`KV_INT8_GROUP`] values in `key_scales`/`value_scales`
/// (`[tokens, ⌈kv_heads × head_dim / KV_INT8_GROUP⌉]`).
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct KvPage {
    /// Number of tokens stored in this page.
    pub tokens: u32,
    /// Storage type of this page: `F32` or `I8`.
    pub dtype: DType,
    /// Keys.
    pub keys: TensorDesc,
    /// Values.
    pub values: TensorDesc,
    /// Int8 key scales (`I8` pages only).
    pub key_scales: ROption<TensorDesc>,
    /// Int8 value scales (`I8` pages only).
    pub value_scales: ROption<TensorDesc>,
}

/// Dequantizes `tokens` rows of int8 KV with per-group scales (see [`KV_INT8_GROUP`]).
pub fn dequantize_i8(q: &[i8], scales: &[f32], tokens: u32) -> Vec<f32> {
    if tokens == 0 {
        return Vec::new();
    }
    let row = q.len() / tokens as usize;
    let group = KV_INT8_GROUP as usize;
    let groups = row.div_ceil(group);
    let mut out = Vec::with_capacity(q.len());
    for (t, r) in q.chunks_exact(row.max(1)).enumerate() {
        for (g, chunk) in r.chunks(group).enumerate() {
            let s = scales.get(t * groups + g).copied().unwrap_or(0.0);
            out.extend(chunk.iter().map(|&v| v as f32 * s));
        }
    }
    out
}

/// Counters of a cache, for budgets and measurements.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Tokens per page.
    pub page_tokens: u32,
    /// Bytes of KV held in memory (every live page once, however many sequences share it).
    pub bytes: u64,
    /// Live pages in memory.
    pub pages: u64,
    /// Live sequences.
    pub sequences: u64,
    /// Nodes of the prefix tree.
    pub prefix_nodes: u64,
    /// Named checkpoints (in memory or on disk).
    pub checkpoints: u64,
    /// Prefix-tree entries evicted so far to stay within the byte budget.
    pub evictions: u64,
    /// The byte budget of KV in memory (0: none).
    pub capacity_bytes: u64,
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
    /// Declares the layout and the backend whose buffers hold the pages; must be called once
    /// before any sequence is created.
    fn configure(&self, layout: KvLayout, backend: BackendBox) -> RResult<(), UError>;

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

    /// Appends positions of keys and values for `layer`: `F32` tensors `[tokens, kv_heads ×
    /// head_dim]` of the configured backend.
    fn append(
        &self,
        seq: SeqId,
        layer: u32,
        keys: &TensorDesc,
        values: &TensorDesc,
    ) -> RResult<(), UError>;

    /// The pages holding `layer`'s KV for `seq`, in token order.
    ///
    /// The pages stay unchanged whatever is later done to `seq` (the returned tensors share
    /// their buffers): a page is never written again once it can be seen.
    fn pages(&self, seq: SeqId, layer: u32) -> RResult<RVec<KvPage>, UError>;

    /// Finds the deepest cached prefix of `tokens` and returns a sequence holding it.
    fn lookup_prefix(&self, tokens: RSlice<'_, u32>) -> RResult<PrefixMatch, UError>;

    /// Records that `seq` holds the KV of `tokens`, so later lookups can share it.
    fn insert_prefix(&self, tokens: RSlice<'_, u32>, seq: SeqId) -> RResult<(), UError>;

    /// Forgets every cached prefix no sequence is using (SGLang's `flush_cache`): later lookups
    /// start cold. Returns how many prefix entries went. Checkpoints are kept.
    fn flush_prefixes(&self) -> RResult<u64, UError>;

    /// Saves `seq` under `name` as a checkpoint.
    fn save_checkpoint(&self, name: RStr<'_>, seq: SeqId) -> RResult<(), UError>;

    /// Returns a new sequence forked from checkpoint `name`.
    fn load_checkpoint(&self, name: RStr<'_>) -> RResult<SeqId, UError>;

    /// All checkpoints with the tokens each holds (those in memory and those on disk, read
    /// after a restart too); files that are torn or corrupt are not listed.
    fn checkpoints(&self) -> RResult<RVec<CheckpointInfo>, UError>;

    /// Deletes checkpoint `name`.
    fn delete_checkpoint(&self, name: RStr<'_>) -> RResult<(), UError>;

    /// Sets the storage type (`F32` or `I8`) of the pages `seq` writes from now on; pages it
    /// already holds keep theirs. New sequences start with [`KvLayout::dtype`].
    fn set_dtype(&self, seq: SeqId, dtype: DType) -> RResult<(), UError>;

    /// Counters: bytes and pages held, sequences, prefix nodes, checkpoints, page size.
    fn stats(&self) -> RResult<KvStats, UError>;
}

/// An owned cache object.
pub type KvCacheBox = KvCache_TO<'static, RBox<()>>;
