//! Loader plugins: turn a model file (or directory) into a [`WeightSet`].
//!
//! A weight set exposes canonical tensor names, dtypes and shapes, and hands out views whose
//! bytes point into a memory map of the file: nothing is copied unless a conversion is asked for.

use crate::abi::{
    error::UError,
    tensor::{MetaValue, TensorInfo, TensorView},
};
use abi_stable::{
    sabi_trait,
    std_types::{RBox, ROption, RResult, RSlice, RStr, RString, RVec},
};

/// Entry interface of a `loader` plugin.
#[sabi_trait]
pub trait Loader: Send + Sync + Clone {
    /// The formats this loader reads, e.g. `["gguf"]`.
    fn formats(&self) -> RVec<RString>;

    /// Whether this loader recognises the file, given its path and its first bytes (at most 4 KiB).
    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> bool;

    /// Opens the model at `path` (through the host's `open_read`).
    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError>;
}

/// A loaded set of weights plus the model's metadata.
#[sabi_trait]
pub trait WeightSet: Send + Sync + Clone {
    /// The file format, e.g. `"gguf"`, `"safetensors"`, `"onnx"`.
    fn format(&self) -> RString;

    /// The architecture family as the file names it (`"llama"`, `"qwen2"`…), if known.
    fn architecture(&self) -> ROption<RString>;

    /// All metadata keys, in file order.
    fn metadata_keys(&self) -> RVec<RString>;

    /// One metadata value.
    fn metadata(&self, key: RStr<'_>) -> ROption<MetaValue>;

    /// Every tensor's name, dtype and shape.
    fn tensors(&self) -> RVec<TensorInfo>;

    /// A zero-copy view of one tensor's bytes.
    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError>;
}

/// An owned loader object.
pub type LoaderBox = Loader_TO<'static, RBox<()>>;
/// An owned, cloneable weight-set object.
pub type WeightSetBox = WeightSet_TO<'static, RBox<()>>;
