//! # loader-safetensors — safetensors weights for U
//!
//! Reads a single `.safetensors` file or a sharded model (`model.safetensors.index.json`, given
//! directly or found in a directory), or a diffusers component folder (`vae/`, `unet/`: its
//! `diffusion_pytorch_model.safetensors`). Files are opened through the host's `open_read` (so the
//! deployment's `fs.read` grant applies) and memory-mapped; tensor views point into the maps,
//! nothing is copied. Tensors keep their stored dtype (F16, BF16, F32, F64, I8, U8, I16, I32,
//! I64); [`SafetensorsModel::tensor_f32`] converts on request.
//!
//! The loader knows the format, not models: tensors keep the names they are stored under, and
//! a `config.json` next to the weights becomes metadata, every entry as `config.<key>`
//! ([`u_sdk::weights::config_metadata`]); its `model_type` (diffusers: `_class_name`) names the
//! architecture. What the
//! names and keys mean is for the architecture plugin to say.
//!
//! The parsing core ([`header`], [`index`], [`model`]) is plain Rust that needs no host, so it
//! is unit-tested and fuzzed (`fuzz/`); the plugin glue below only adapts it to the ABI
//! (panic-guarded by the SDK's boxes).

#![deny(missing_docs)]

pub mod error;
pub mod header;
pub mod index;
pub mod model;

pub use error::{Error, HeaderError};
pub use model::{FileOpener, SafetensorsModel, StdFs, Tensor};

use std::path::Path;
use u_sdk::{
    HostBox, MetaValue, PluginInfo, PluginInstance, TensorInfo, TensorView,
    weights::{FileLoader, OpenWeights, SharedWeights, WeightSource},
};

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}

/// Run-time self-description.
pub fn describe() -> PluginInfo {
    PluginInfo {
        summary: "safetensors loader: single or sharded files, memory-mapped, names as stored"
            .into(),
        details: vec!["formats=safetensors".into()].into(),
    }
}

/// Creates the loader with its host services.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Loader(
        FileLoader::<SafetensorsModel>::new(host).into_box(),
    ))
}

/// Whether `path`/`head` look like safetensors: the file name, or a plausible header length
/// followed by `{`.
pub fn sniff(path: &str, head: &[u8]) -> bool {
    if path.ends_with(".safetensors") || path.ends_with(".safetensors.index.json") {
        return true;
    }
    match head.get(..9) {
        Some(h) => {
            let mut len = [0u8; 8];
            len.copy_from_slice(&h[..8]);
            let len = u64::from_le_bytes(len);
            h[8] == b'{' && (2..=header::MAX_HEADER_LEN).contains(&len)
        }
        None => false,
    }
}

/// The weight set handed to the host: a shared, loaded [`SafetensorsModel`].
pub type SafetensorsWeights = SharedWeights<SafetensorsModel>;

impl OpenWeights for SafetensorsModel {
    fn sniff(path: &str, head: &[u8]) -> bool {
        sniff(path, head)
    }

    fn open(files: &dyn u_sdk::files::FileOpener, path: &Path) -> u_sdk::Result<Self> {
        Ok(SafetensorsModel::open(files, path)?)
    }
}

impl WeightSource for SafetensorsModel {
    const FORMAT: &'static str = "safetensors";

    fn architecture(&self) -> Option<&str> {
        SafetensorsModel::architecture(self)
    }

    fn metadata_keys(&self) -> Vec<&str> {
        SafetensorsModel::metadata(self)
            .iter()
            .map(|(k, _)| k.as_str())
            .collect()
    }

    fn metadata(&self, key: &str) -> Option<MetaValue> {
        self.metadata_value(key).cloned()
    }

    fn tensors(&self) -> Vec<TensorInfo> {
        SafetensorsModel::tensors(self)
            .iter()
            .map(Tensor::info)
            .collect()
    }

    fn tensor(&self, name: &str) -> u_sdk::Result<TensorView<'_>> {
        Ok(self.view(name)?)
    }
}
