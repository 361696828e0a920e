//! Compute backends: buffers the backend owns, tensors inside them, and lists of operations on
//! those tensors.
//!
//! The shape is ggml's backend interface: a backend hands out buffers of its one buffer type
//! ([`Backend::alloc`]), imports host memory it did not allocate ([`Backend::import`], e.g. a
//! weight set's memory map: a host backend uses it in place, a device backend copies it once),
//! and runs operation lists ([`Backend::compute`]) that name their operands as [`TensorDesc`]s —
//! a buffer, a byte offset, a dtype and a shape. Work may be queued: [`Backend::synchronize`]
//! (and reading a buffer) waits for it. Nothing here assumes the bytes are in host memory, so a
//! GPU backend implements the same interface; a host backend says so in [`BufferType::host`] and
//! [`Buffer::host_address`], and its users may then touch the bytes directly.
//!
//! Conventions for every [`Op`]: shapes are row-major, outermost first; `f32` activations unless
//! the op says otherwise; quantized weights (any [`DType`] the backend supports) stay in their
//! compressed blocks. An op writes only its destination, which must not overlap a source unless
//! the op says it may run in place.

use crate::abi::{dtype::DType, error::UError};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RArc, RBox, RResult, RSlice, RSliceMut, RString, RVec},
};

/// What a backend is and what the CPU or device offers it.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct BackendInfo {
    /// Backend name, e.g. `"cpu"`.
    pub name: RString,
    /// The device the work runs on, e.g. `"cpu: 2 threads"` or a GPU's adapter name.
    pub device: RString,
    /// The instruction-set path or shader profile chosen at load, e.g. `"avx2+fma+f16c"`.
    pub isa: RString,
    /// Detected features, e.g. `["avx2", "fma", "f16c", "avx512vnni"]`.
    pub features: RVec<RString>,
    /// Threads the backend computes with.
    pub threads: u32,
}

/// The kind of memory a backend's buffers are (ggml's buffer type).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct BufferType {
    /// Name, e.g. `"cpu"` or `"wgpu:storage"`.
    pub name: RString,
    /// Alignment in bytes of every buffer's first byte.
    pub alignment: u32,
    /// Whether buffers are host memory the caller may read and write through
    /// [`Buffer::host_address`].
    pub host: bool,
}

/// A block of backend memory. Cloning the handle shares the buffer; the memory is freed (or
/// returned to the backend's pool) when the last handle drops.
#[sabi_trait]
pub trait Buffer: Send + Sync + Clone {
    /// Size in bytes.
    fn byte_len(&self) -> u64;

    /// The host address of byte 0 when the bytes are host memory, else 0. Reads through it see
    /// every op that finished; writes are allowed unless [`Buffer::read_only`].
    fn host_address(&self) -> usize;

    /// Whether the buffer may not be written (imported weights, mapped files).
    fn read_only(&self) -> bool;

    /// Copies `bytes` to `offset..` (after queued work on this buffer).
    fn write(&self, offset: u64, bytes: RSlice<'_, u8>) -> RResult<(), UError>;

    /// Copies `offset..offset + out.len()` into `out`, waiting for queued work first.
    fn read(&self, offset: u64, out: RSliceMut<'_, u8>) -> RResult<(), UError>;
}

/// Keeps memory alive: dropping it releases what it owns (a weight set's map, a mapped file).
#[sabi_trait]
pub trait Keepalive: Send + Sync {
    /// What it keeps alive, for diagnostics.
    fn describe(&self) -> RString;
}

/// Dimensions of a tensor, outermost first; unused trailing entries are 1.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Number of dimensions in use (1 to 4).
    pub rank: u32,
    /// The dimensions; `dims[rank..]` are 1.
    pub dims: [u64; 4],
}

impl Shape {
    /// A shape from its dimensions (1 to 4 of them).
    pub fn new(dims: &[u64]) -> Shape {
        let mut d = [1u64; 4];
        let rank = dims.len().clamp(1, 4);
        d[..rank].copy_from_slice(&dims[..rank]);
        Shape {
            rank: rank as u32,
            dims: d,
        }
    }

    /// The dimensions in use.
    pub fn dims(&self) -> &[u64] {
        &self.dims[..self.rank.clamp(1, 4) as usize]
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.dims().iter().product()
    }

    /// The innermost dimension (the row length).
    pub fn row_len(&self) -> u64 {
        self.dims().last().copied().unwrap_or(1)
    }

    /// Elements divided by the row length.
    pub fn rows(&self) -> u64 {
        self.dims().iter().rev().skip(1).product()
    }
}

/// A tensor: `shape` elements of `dtype`, contiguous and row-major from byte `offset` of
/// `buffer`.
#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct TensorDesc {
    /// The buffer holding the bytes.
    pub buffer: BufferBox,
    /// Byte offset of the first element.
    pub offset: u64,
    /// Element type.
    pub dtype: DType,
    /// Dimensions.
    pub shape: Shape,
}

impl std::fmt::Debug for TensorDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorDesc")
            .field("offset", &self.offset)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape.dims())
            .finish()
    }
}

impl TensorDesc {
    /// Bytes the elements take (for block-quantized dtypes, whole blocks per row).
    pub fn byte_len(&self) -> Option<u64> {
        let rows = self.shape.rows();
        self.dtype
            .bytes_for(self.shape.row_len())
            .and_then(|row| row.checked_mul(rows))
    }
}

/// Element-wise activation functions.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// `x · sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// GELU, exact (erf).
    GeluErf,
    /// `1 / (1 + e^−x)`.
    Sigmoid,
    /// `max(x, 0)`.
    Relu,
    /// `tanh(x)`.
    Tanh,
    /// `1` where `x > 0`, else `0`: the derivative of [`Activation::Relu`] (backward passes).
    Step,
}

/// How rotary embeddings pair dimensions.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)` (original Llama / GGUF layout).
    Normal,
    /// Halves `(i, i + d/2)` (GPT-NeoX / HF layout).
    NeoX,
}

/// Parameters of [`Op::Rope`].
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct RopeParams {
    /// Pairing of dimensions.
    pub style: RopeStyle,
    /// Dimensions rotated per head (≤ head_dim).
    pub rotary_dim: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Heads per token in the tensor.
    pub heads: u32,
    /// Per-pair inverse frequencies (`rotary_dim / 2` values), scaling already applied.
    pub inv_freq: RVec<f32>,
    /// Multiplier applied to cos and sin (YaRN attention factor; 1.0 otherwise).
    pub attn_factor: f32,
}

/// Which keys a query may attend to.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionMask {
    /// Query `i` sees keys `0..=first_query_pos + i` (decoders), limited to the last `window`
    /// of them when a window is set.
    Causal,
    /// Every query sees every key (encoders, cross-attention).
    Bidirectional,
}

/// Values per quantization group of int8 KV: a token's row of `kv_heads × head_dim` values is
/// cut into groups of this many consecutive values (the last one may be shorter), each with one
/// `f32` scale, `value = q × scale`.
pub const KV_INT8_GROUP: u32 = 32;

/// Parameters of [`Op::Attention`].
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct AttentionParams {
    /// Query heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: u32,
    /// Dimension of each head.
    pub head_dim: u32,
    /// Absolute position of the first query (for the causal mask).
    pub first_query_pos: u32,
    /// Sliding window (0 = none): a causal query sees only the last `window` keys.
    pub window: u32,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f32,
    /// Soft cap of the scaled scores, `s ← softcap · tanh(s / softcap)` before the softmax
    /// (Gemma 2); 0 = none.
    pub softcap: f32,
    /// Causal or bidirectional.
    pub mask: AttentionMask,
    /// Element type of the key/value spans: `F32`, `F16`, or `I8` with one scale tensor each.
    pub kv_dtype: DType,
}

/// What an operation computes. Sources (`srcs`) and destination (`dst`) are in [`OpCall`].
#[repr(C, u8)]
#[derive(StableAbi, Clone, Debug)]
pub enum Op<'a> {
    /// `dst[m, n] = src0[m, k] · src1[n, k]ᵀ`: `src1` is a weight in any supported dtype.
    MatMul,
    /// `dst = src0 + src1`; `src1` may be one row, added to every row. May run in place.
    Add,
    /// `dst = src0 ⊙ src1`; `src1` may be one row. May run in place.
    Mul,
    /// `dst = src0 · factor`. May run in place.
    Scale(f32),
    /// `dst = src0 + factor · src1`; `src1` may be one row (a steering vector). May run in
    /// place.
    AddScaled(f32),
    /// `dst = min(max(src0, min), max)`. May run in place.
    Clamp {
        /// Lower bound.
        min: f32,
        /// Upper bound.
        max: f32,
    },
    /// `dst = src0 / sqrt(mean(src0²) + eps) · src1` row by row (`src1`: one row).
    RmsNorm(f32),
    /// The gradient of [`Op::RmsNorm`] with respect to its input, row by row: `src0` the input
    /// `x`, `src1` the scale `w` (one row), `src2` the output's gradient `dy`; with
    /// `r = 1 / sqrt(mean(x²) + eps)` and `g = dy ⊙ w`,
    /// `dst = r · g − x · r³ · mean(g ⊙ x)`.
    RmsNormBackward(f32),
    /// `dst = (src0 − mean) / sqrt(var + eps) · src1 + src2` row by row.
    LayerNorm(f32),
    /// Group normalisation of `src0` `[channels, …]` in `groups` groups, scale `src1` and
    /// shift `src2` per channel.
    GroupNorm {
        /// Channel groups.
        groups: u32,
        /// Variance epsilon.
        eps: f32,
    },
    /// Rotary position embedding of `src0` `[tokens, heads × head_dim]` at the positions in
    /// `src1` (`I32`, one per token). With a third source `src2` (`I32`), the rows were already
    /// rotated at those positions and are moved to `src1`'s (a graft's re-rotation; the YaRN
    /// factor is not applied again). May run in place.
    Rope(&'a RopeParams),
    /// Flash attention: `src0` queries `[queries, heads × head_dim]` over keys and values given
    /// as spans of consecutive positions, `srcs[1..]` = keys, values (and for `I8`, key scales,
    /// value scales) per span, each `[tokens, kv_heads × head_dim]`; `dst` like `src0`.
    Attention(&'a AttentionParams),
    /// `dst = act(src0)`. May run in place.
    Activation(Activation),
    /// `dst = act(src0) ⊙ src1` (SwiGLU with `Silu`, GeGLU with a GELU).
    Gated(Activation),
    /// Row-wise softmax of `src0`. May run in place.
    Softmax,
    /// The gradient of [`Op::Softmax`] with respect to its input, row by row: `src0` the
    /// softmax's output `y`, `src1` the output's gradient `dy`;
    /// `dst = y ⊙ (dy − Σ dy ⊙ y)`. May run in place of `src1`.
    SoftmaxBackward,
    /// `dst[i] = src0[src1[i]]`: rows of `src0` (any dtype, dequantized) at the `I32` indices of
    /// `src1` (embedding lookup, MoE token gathering).
    GetRows,
    /// `dst[src1[i]] += src2[i] · src0[i]`: rows of `src0` added, scaled by the `F32` weights of
    /// `src2`, into the rows of `dst` at the `I32` indices of `src1` (MoE combination).
    ScatterAdd,
    /// The `k` largest values of each row of `src0`: `dst` `[rows, k]` `I32` indices, largest
    /// first, ties to the lower index (as `torch.topk`).
    TopK(u32),
    /// `dst[j, i] = src0[i, j]`: a 2-D `F32` tensor transposed (backward passes: `dx = dy·W`,
    /// `dW = dyᵀ·x` through [`Op::MatMul`]).
    Transpose,
    /// Low-rank adapter deltas, row by row, added to `dst` `[rows, out]` in place:
    /// `dst[i] += Σₑ sₑ · Bᵀ[c..c+r]ᵀ · (A[c..c+r] · src0[i])` over row `i`'s entries `e` of
    /// `src3` (`F32` `[rows, 3·k]`: first column `c`, rank `r` (0: unused entry), scale `s`),
    /// with `src1` every adapter's `A` stacked `[ΣR, in]` and `src2` their `Bᵀ` stacked
    /// `[ΣR, out]`: requests under different adapters in one pass (S-LoRA's gathered matmul).
    LowRank,
    /// 1-D convolution of `src0` `[c_in, length]` with `src1` `[c_out, c_in, kernel]`, bias
    /// `src2` `[c_out]` (optional: two sources), into `dst` `[c_out, length_out]`.
    Conv1d {
        /// Step between output positions.
        stride: u32,
        /// Zeros added at each end.
        padding: u32,
    },
    /// 2-D convolution of `src0` `[c_in, h, w]` with `src1` `[c_out, c_in, kh, kw]`, bias
    /// `src2` `[c_out]` (optional), into `dst` `[c_out, h_out, w_out]`.
    Conv2d {
        /// Step between output positions (both axes).
        stride: u32,
        /// Zeros added before (top, left) and after (bottom, right) on both axes: `[1, 1]`
        /// for a "same" 3×3 convolution, `[0, 1]` for the VAE encoder's downsampling.
        padding: [u32; 2],
    },
    /// Nearest-neighbour upsampling of `src0` `[c, h, w]` by `factor` on both spatial axes.
    Upsample(u32),
    /// `dst = src0` converted to `dst`'s dtype: `F32`, `F16`, `BF16`, or a block format the
    /// backend writes ([`Backend::supports`] with that dtype), quantized byte for byte as ggml's
    /// reference quantizers (`quantize_row_*_ref`) do, row by row (`src0` and `dst` have the
    /// same row length, a whole number of blocks). A quantized `src0` is dequantized first. An
    /// `I8` `src0` of int8 KV takes its group scales as `src1` (see [`KV_INT8_GROUP`]) and
    /// dequantizes.
    Copy,
}

/// The kind of an [`Op`], without its parameters (for [`Backend::supports`]).
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// [`Op::MatMul`].
    MatMul,
    /// [`Op::Add`].
    Add,
    /// [`Op::Mul`].
    Mul,
    /// [`Op::Scale`].
    Scale,
    /// [`Op::AddScaled`].
    AddScaled,
    /// [`Op::Clamp`].
    Clamp,
    /// [`Op::RmsNorm`].
    RmsNorm,
    /// [`Op::RmsNormBackward`].
    RmsNormBackward,
    /// [`Op::LayerNorm`].
    LayerNorm,
    /// [`Op::GroupNorm`].
    GroupNorm,
    /// [`Op::Rope`].
    Rope,
    /// [`Op::Attention`].
    Attention,
    /// [`Op::Activation`].
    Activation,
    /// [`Op::Gated`].
    Gated,
    /// [`Op::Softmax`].
    Softmax,
    /// [`Op::SoftmaxBackward`].
    SoftmaxBackward,
    /// [`Op::GetRows`].
    GetRows,
    /// [`Op::ScatterAdd`].
    ScatterAdd,
    /// [`Op::TopK`].
    TopK,
    /// [`Op::Transpose`].
    Transpose,
    /// [`Op::LowRank`].
    LowRank,
    /// [`Op::Conv1d`].
    Conv1d,
    /// [`Op::Conv2d`].
    Conv2d,
    /// [`Op::Upsample`].
    Upsample,
    /// [`Op::Copy`].
    Copy,
}

impl Op<'_> {
    /// The op's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::MatMul => OpKind::MatMul,
            Op::Add => OpKind::Add,
            Op::Mul => OpKind::Mul,
            Op::Scale(_) => OpKind::Scale,
            Op::AddScaled(_) => OpKind::AddScaled,
            Op::Clamp { .. } => OpKind::Clamp,
            Op::RmsNorm(_) => OpKind::RmsNorm,
            Op::RmsNormBackward(_) => OpKind::RmsNormBackward,
            Op::LayerNorm(_) => OpKind::LayerNorm,
            Op::GroupNorm { .. } => OpKind::GroupNorm,
            Op::Rope(_) => OpKind::Rope,
            Op::Attention(_) => OpKind::Attention,
            Op::Activation(_) => OpKind::Activation,
            Op::Gated(_) => OpKind::Gated,
            Op::Softmax => OpKind::Softmax,
            Op::SoftmaxBackward => OpKind::SoftmaxBackward,
            Op::GetRows => OpKind::GetRows,
            Op::ScatterAdd => OpKind::ScatterAdd,
            Op::TopK(_) => OpKind::TopK,
            Op::Transpose => OpKind::Transpose,
            Op::LowRank => OpKind::LowRank,
            Op::Conv1d { .. } => OpKind::Conv1d,
            Op::Conv2d { .. } => OpKind::Conv2d,
            Op::Upsample(_) => OpKind::Upsample,
            Op::Copy => OpKind::Copy,
        }
    }
}

/// One operation of a list: what it computes, its sources in order, and where it writes.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct OpCall<'a> {
    /// The operation.
    pub op: Op<'a>,
    /// Its sources, as the op documents them.
    pub srcs: RSlice<'a, &'a TensorDesc>,
    /// Its destination.
    pub dst: &'a TensorDesc,
}

/// Entry interface of a `kernels` plugin: one compute backend.
#[sabi_trait]
pub trait Backend: Send + Sync + Clone {
    /// What the backend is and which instruction set or device it chose.
    fn info(&self) -> RResult<BackendInfo, UError>;

    /// The type of the buffers [`Backend::alloc`] returns.
    fn buffer_type(&self) -> RResult<BufferType, UError>;

    /// Whether `op` is implemented with `dtype` as its first weight-like source (the weight of
    /// a matmul, the table of `GetRows`, the KV of attention; for `Copy`, a dtype it converts
    /// to and from; `F32` for the rest).
    fn supports(&self, op: OpKind, dtype: DType) -> RResult<bool, UError>;

    /// A new buffer of `bytes` bytes (contents unspecified).
    fn alloc(&self, bytes: u64) -> RResult<BufferBox, UError>;

    /// A buffer over host memory `bytes` that `owner` keeps alive: a host backend uses the bytes
    /// in place (no copy) and holds `owner` as long as the buffer lives; a device backend copies
    /// them once. The caller promises the bytes stay valid and unchanged while `owner` lives.
    fn import(&self, bytes: RSlice<'_, u8>, owner: KeepaliveBox) -> RResult<BufferBox, UError>;

    /// Runs (or queues, in order) every op of the list.
    fn compute(&self, ops: RSlice<'_, OpCall<'_>>) -> RResult<(), UError>;

    /// Waits until every queued op has finished.
    fn synchronize(&self) -> RResult<(), UError>;
}

/// A shared buffer handle.
pub type BufferBox = Buffer_TO<'static, RArc<()>>;
/// An owned keep-alive object.
pub type KeepaliveBox = Keepalive_TO<'static, RBox<()>>;
/// An owned backend object.
pub type BackendBox = Backend_TO<'static, RBox<()>>;
