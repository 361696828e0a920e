//! Cache plugins: the key/value memory of running sequences.
//!
//! Sequences are handles into a paged store. Forking a sequence shares its pages (copy on
//! write); the model appends each layer's keys and values and reads them back page by page, so
//! attention runs over pages in place.
//!
//! Pages are `f32` unless a sequence opted into int8 ([`KvCache::set_dtype`], or a cache
//! configured so): then the pages it writes from then on hold `i8` values with one `f32` scale
//! per [`KV_INT8_GROUP`] values. Attention reads them in place as int8 spans
//! ([`crate::KvSpan::i8`]); [`KvPage::keys_f32`] / [`KvPage::values_f32`] dequantize them where
//! f32 is needed.

use crate::abi::{dtype::DType, error::UError, kernels::RopeParams};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RStr, RString, RVec},
};
use std::borrow::Cow;

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

/// Values per quantization group of int8 KV: a token's row of `kv_heads × head_dim` values is
/// cut into groups of this many consecutive values (the last one may be shorter), each with one
/// `f32` scale, `value = q × scale`.
pub const KV_INT8_GROUP: u32 = 32;

/// One page of a sequence's keys and values for one layer, borrowed from the cache.
///
/// An `F32` page fills `keys`/`values`; an `I8` page leaves them empty and fills the `*_i8` and
/// `*_scales` fields instead. [`KvPage::keys_f32`] and [`KvPage::values_f32`] read either.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct KvPage<'a> {
    /// Number of tokens stored in this page.
    pub tokens: u32,
    /// Keys: tokens × kv_heads × head_dim, as f32 (empty for an `I8` page).
    pub keys: RSlice<'a, f32>,
    /// Values: tokens × kv_heads × head_dim, as f32 (empty for an `I8` page).
    pub values: RSlice<'a, f32>,
    /// Storage type of this page: `F32` or `I8`.
    pub dtype: DType,
    /// `I8` keys: tokens × kv_heads × head_dim (empty for an `F32` page).
    pub keys_i8: RSlice<'a, i8>,
    /// `I8` values: tokens × kv_heads × head_dim (empty for an `F32` page).
    pub values_i8: RSlice<'a, i8>,
    /// Key scales: tokens × ⌈kv_heads × head_dim / [`KV_INT8_GROUP`]⌉.
    pub key_scales: RSlice<'a, f32>,
    /// Value scales, laid out like `key_scales`.
    pub value_scales: RSlice<'a, f32>,
}

impl<'a> KvPage<'a> {
    /// An `F32` page.
    pub fn f32(tokens: u32, keys: &'a [f32], values: &'a [f32]) -> Self {
        Self {
            tokens,
            keys: keys.into(),
            values: values.into(),
            dtype: DType::F32,
            keys_i8: RSlice::default(),
            values_i8: RSlice::default(),
            key_scales: RSlice::default(),
            value_scales: RSlice::default(),
        }
    }

    /// Keys as f32: borrowed for an `F32` page, dequantized for an `I8` page.
    pub fn keys_f32(&self) -> Cow<'a, [f32]> {
        match self.dtype {
            DType::I8 => Cow::Owned(dequantize_i8(
                self.keys_i8.as_slice(),
                self.key_scales.as_slice(),
                self.tokens,
            )),
            _ => Cow::Borrowed(self.keys.as_slice()),
        }
    }

    /// Values as f32: borrowed for an `F32` page, dequantized for an `I8` page.
    pub fn values_f32(&self) -> Cow<'a, [f32]> {
        match self.dtype {
            DType::I8 => Cow::Owned(dequantize_i8(
                self.values_i8.as_slice(),
                self.value_scales.as_slice(),
                self.tokens,
            )),
            _ => Cow::Borrowed(self.values.as_slice()),
        }
    }
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
    ///
    /// The slices stay valid and unchanged for as long as this handle lives, whatever is later
    /// done to `seq`: the handle keeps every page it handed out. Clone the cache handle for a
    /// forward pass and drop the clone afterwards to let those pages go.
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

    /// Sets the storage type (`F32` or `I8`) of the pages `seq` writes from now on; pages it
    /// already holds keep theirs. New sequences start with [`KvLayout::dtype`].
    fn set_dtype(&self, _seq: SeqId, _dtype: DType) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("this cache has no int8 KV"))
    }

    /// Grafts tokens `from..from + count` of `src` (computed at those positions) onto the end of
    /// `dst`, at positions `dst.len()..`: keys are re-rotated by `dst.len() − from` with `rope`'s
    /// inverse frequencies, so they equal keys computed at the new positions. Values are copied.
    fn graft(
        &self,
        _dst: SeqId,
        _src: SeqId,
        _from: u64,
        _count: u64,
        _rope: &RopeParams,
    ) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("this cache cannot graft"))
    }

    /// Counters: bytes and pages held, sequences, prefix nodes, checkpoints, page size.
    fn stats(&self) -> RResult<KvStats, UError> {
        RResult::RErr(UError::unsupported("this cache keeps no statistics"))
    }
}

/// An owned cache object.
pub type KvCacheBox = KvCache_TO<'static, RBox<()>>;
