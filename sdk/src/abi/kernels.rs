//! Kernels plugins: the compute operations architectures call.
//!
//! Shaped like a ggml backend: a plugin reports what it is ([`BackendInfo`]), which operations
//! and weight dtypes it supports ([`Kernels::supports`]), and runs them on slices the caller owns.
//! Weights arrive as [`TensorView`]s straight from the loader's map, so quantized weights are
//! used in their compressed blocks.

use crate::abi::{dtype::DType, error::UError, tensor::TensorView};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RSliceMut, RString, RVec},
};

/// What a kernels plugin is and what the CPU or device offers it.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct BackendInfo {
    /// Backend name, e.g. `"cpu"`.
    pub name: RString,
    /// The instruction-set path chosen at load, e.g. `"avx2+fma+f16c"`.
    pub isa: RString,
    /// Detected features, e.g. `["avx2", "fma", "f16c", "avx512vnni"]`.
    pub features: RVec<RString>,
    /// Threads the backend computes with.
    pub threads: u32,
}

/// The operations a kernels plugin may implement.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `y = x · Wᵀ` with weights in any supported dtype.
    MatMul,
    /// Root-mean-square normalisation with a learned scale.
    RmsNorm,
    /// Layer normalisation with scale and bias.
    LayerNorm,
    /// Rotary position embedding.
    Rope,
    /// Scaled dot-product attention (flash style).
    Attention,
    /// Element-wise activations.
    Activation,
    /// Row-wise softmax.
    Softmax,
    /// Gathering rows of an embedding table (dequantising them).
    Embedding,
    /// Selecting the k largest values (MoE routing).
    TopK,
}

/// Element-wise activation functions.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// GELU, exact (erf).
    GeluErf,
}

/// How rotary embeddings pair dimensions.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` (original Llama / GGUF layout).
    Normal,
    /// Halves `(i, i + d/2)` (GPT-NeoX / HF layout).
    NeoX,
}

/// Parameters of [`Kernels::rope`].
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct RopeParams {
    /// Pairing of dimensions.
    pub style: RopeStyle,
    /// Dimensions rotated per head (≤ head_dim).
    pub rotary_dim: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Heads per token in the buffer.
    pub heads: u32,
    /// Per-pair inverse frequencies (`rotary_dim / 2` values), scaling already applied.
    pub inv_freq: RVec<f32>,
    /// Multiplier applied to cos and sin (YaRN attention factor; 1.0 otherwise).
    pub attn_factor: f32,
}

/// One run of consecutive cached positions for [`Kernels::attention`] (a KV-cache page, or a
/// whole buffer): `tokens` keys and values, each `tokens × kv_heads × head_dim` elements of
/// [`AttentionParams::kv_dtype`], in position order after the spans before it. Int8 (`I8`)
/// spans carry one `f32` scale per group of [`crate::KV_INT8_GROUP`] values of a token's row
/// (`value = q × scale`, as the cache's int8 pages); the scales are empty otherwise.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug)]
pub struct KvSpan<'a> {
    /// Positions held.
    pub tokens: u32,
    /// Keys, as bytes.
    pub keys: RSlice<'a, u8>,
    /// Values, as bytes.
    pub values: RSlice<'a, u8>,
    /// Int8 keys' scales: tokens × ⌈kv_heads × head_dim / `KV_INT8_GROUP`⌉.
    pub key_scales: RSlice<'a, f32>,
    /// Int8 values' scales, laid out like `key_scales`.
    pub value_scales: RSlice<'a, f32>,
}

impl<'a> KvSpan<'a> {
    /// A span of `tokens` f32 (or, by `kv_dtype`, f16) keys and values given as bytes.
    pub fn bytes(tokens: u32, keys: &'a [u8], values: &'a [u8]) -> Self {
        Self {
            tokens,
            keys: keys.into(),
            values: values.into(),
            key_scales: RSlice::default(),
            value_scales: RSlice::default(),
        }
    }

    /// A span of `tokens` f32 keys and values.
    pub fn f32(tokens: u32, keys: &'a [f32], values: &'a [f32]) -> Self {
        fn bytes(x: &[f32]) -> &[u8] {
            // SAFETY: any f32 is 4 plain bytes; alignment 1 and the same length in bytes.
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
        }
        Self::bytes(tokens, bytes(keys), bytes(values))
    }

    /// A span of `tokens` int8 keys and values with their group scales.
    pub fn i8(
        tokens: u32,
        (keys, key_scales): (&'a [i8], &'a [f32]),
        (values, value_scales): (&'a [i8], &'a [f32]),
    ) -> Self {
        fn bytes(x: &[i8]) -> &[u8] {
            // SAFETY: i8 and u8 have the same size, alignment and (all) bit patterns.
            unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, x.len()) }
        }
        Self {
            tokens,
            keys: bytes(keys).into(),
            values: bytes(values).into(),
            key_scales: key_scales.into(),
            value_scales: value_scales.into(),
        }
    }
}

/// Parameters of [`Kernels::attention`].
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct AttentionParams {
    /// Query heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Number of query tokens.
    pub queries: u32,
    /// Number of key/value tokens.
    pub kv_len: u32,
    /// Absolute position of the first query (for the causal mask): query `i` sees keys
    /// `0..=first_query_pos + i`.
    pub first_query_pos: u32,
    /// Sliding window (0 = none): a query sees only the last `window` keys.
    pub window: u32,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Element type of the key/value spans (`F32`, `F16`, or `I8` with scales).
    pub kv_dtype: DType,
}

/// Entry interface of a `kernels` plugin.
#[sabi_trait]
pub trait Kernels: Send + Sync + Clone {
    /// What the backend is and which instruction set it chose.
    fn info(&self) -> BackendInfo;

    /// Whether `op` is implemented for weights of `dtype`.
    fn supports(&self, op: Op, dtype: DType) -> bool;

    /// `y[m × n] = x[m × k] · Wᵀ` for a weight of shape `[n, k]`.
    fn matmul(
        &self,
        weight: &TensorView<'_>,
        x: RSlice<'_, f32>,
        m: u32,
        y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;

    /// `y = x / rms(x) · weight`, row by row over rows of `weight.len()` values.
    fn rms_norm(
        &self,
        x: RSlice<'_, f32>,
        weight: RSlice<'_, f32>,
        eps: f32,
        y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;

    /// `y = (x − mean) / std · weight + bias`, row by row.
    fn layer_norm(
        &self,
        x: RSlice<'_, f32>,
        weight: RSlice<'_, f32>,
        bias: RSlice<'_, f32>,
        eps: f32,
        y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;

    /// Rotates `x` (`positions.len()` tokens × heads × head_dim) in place.
    fn rope(
        &self,
        x: RSliceMut<'_, f32>,
        positions: RSlice<'_, u32>,
        params: &RopeParams,
    ) -> RResult<(), UError>;

    /// Flash attention: `out = softmax(q·kᵀ·scale + mask)·v` without the full score matrix.
    /// `q`: queries × heads × head_dim (f32); `kv`: the `kv_len` cached positions as spans read
    /// in place (e.g. one per KV-cache page, so nothing is gathered); `out`: queries × heads ×
    /// head_dim.
    fn attention(
        &self,
        q: RSlice<'_, f32>,
        kv: RSlice<'_, KvSpan<'_>>,
        params: &AttentionParams,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;

    /// Applies `act` in place.
    fn activation(&self, x: RSliceMut<'_, f32>, act: Activation) -> RResult<(), UError>;

    /// Row-wise softmax in place over rows of `row_len`.
    fn softmax(&self, x: RSliceMut<'_, f32>, row_len: u32) -> RResult<(), UError>;

    /// Gathers and dequantises rows `ids` of `table` into `out` (ids.len() × row length).
    fn embedding(
        &self,
        table: &TensorView<'_>,
        ids: RSlice<'_, u32>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError>;
}

/// An owned kernels object.
pub type KernelsBox = Kernels_TO<'static, RBox<()>>;
