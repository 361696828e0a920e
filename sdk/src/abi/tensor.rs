//! Tensor descriptions and zero-copy views of tensor bytes.
//!
//! Shapes are row-major with the outermost dimension first, as PyTorch writes them: a linear
//! layer's weight is `[out_features, in_features]`. (GGUF stores dimensions innermost first; its
//! loader reverses them.) For a quantized dtype the innermost dimension counts values, not blocks.

use crate::abi::dtype::DType;
use abi_stable::{
    StableAbi,
    std_types::{RSlice, RString, RVec},
};

/// Name, type and shape of a tensor in a weight set, without its data.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name as the file stores it (e.g. `blk.0.attn_q.weight` in GGUF,
    /// `model.layers.0.self_attn.q_proj.weight` in an HF checkpoint).
    pub name: RString,
    /// Element type as stored.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: RVec<u64>,
    /// Size of the stored bytes.
    pub byte_len: u64,
}

/// A borrowed view of a tensor's bytes, valid while the weight set that produced it lives.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct TensorView<'a> {
    /// Element type of `data`.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: RVec<u64>,
    /// The stored bytes, typically pointing into a memory map of the model file.
    pub data: RSlice<'a, u8>,
}

impl TensorView<'_> {
    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Length of the innermost dimension (the row length).
    pub fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows: all elements divided by the row length.
    pub fn rows(&self) -> u64 {
        self.shape.iter().rev().skip(1).product()
    }
}

/// A metadata value of a weight set (GGUF key/value, `config.json` entry, ONNX property).
///
/// Arrays of scalars are typed; anything nested deeper travels as JSON text.
#[repr(C, u8)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// A boolean.
    Bool(bool),
    /// A signed integer.
    Int(i64),
    /// An unsigned integer.
    UInt(u64),
    /// A floating-point number.
    Float(f64),
    /// A UTF-8 string.
    Str(RString),
    /// An array of signed integers.
    IntArray(RVec<i64>),
    /// An array of unsigned integers.
    UIntArray(RVec<u64>),
    /// An array of floats.
    FloatArray(RVec<f64>),
    /// An array of booleans.
    BoolArray(RVec<bool>),
    /// An array of strings (e.g. a tokenizer vocabulary).
    StrArray(RVec<RString>),
    /// A nested structure (arrays of arrays, objects) as JSON.
    Json(RString),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            MetaValue::UInt(v) => Some(*v),
            MetaValue::Int(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            MetaValue::Float(v) => Some(*v),
            MetaValue::UInt(v) => Some(*v as f64),
            MetaValue::Int(v) => Some(*v as f64),
            _ => None,
        }
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s.as_str()),
            _ => None,
        }
    }
}
