//! Loader plugins: turn a model file (or directory) into a [`WeightSet`].
//!
//! A weight set exposes the file's own tensor names, dtypes and shapes and its metadata, and
//! hands out views whose bytes point into a memory map of the file: nothing is copied unless a
//! conversion is asked for. Loaders know formats only: what the names mean is the
//! architecture's business.

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
    fn formats(&self) -> RResult<RVec<RString>, UError>;

    /// Whether this loader recognises the file, given its path and its first bytes (at most 4 KiB).
    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> RResult<bool, UError>;

    /// Opens the model at `path` (through the host's `open_read`).
    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError>;
}

/// A loaded set of weights plus the model's metadata.
#[sabi_trait]
pub trait WeightSet: Send + Sync + Clone {
    /// The file format, e.g. `"gguf"`, `"safetensors"`, `"onnx"`.
    fn format(&self) -> RResult<RString, UError>;

    /// The architecture family as the file names it (GGUF `general.architecture`, HF
    /// `config.json` `model_type`), if known.
    fn architecture(&self) -> RResult<ROption<RString>, UError>;

    /// All metadata keys, in file order.
    fn metadata_keys(&self) -> RResult<RVec<RString>, UError>;

    /// One metadata value.
    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError>;

    /// Every tensor's name, dtype and shape.
    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError>;

    /// A zero-copy view of one tensor's bytes.
    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError>;
}

/// An owned loader object.
pub type LoaderBox = Loader_TO<'static, RBox<()>>;
/// An owned, cloneable weight-set object.
pub type WeightSetBox = WeightSet_TO<'static, RBox<()>>;
