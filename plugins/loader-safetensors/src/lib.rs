//! # loader-safetensors — safetensors weights for U
//!
//! Reads a single `.safetensors` file or a sharded model (`model.safetensors.index.json`, given
//! directly or found in a directory). Files are opened through the host's `open_read` (so the
//! deployment's `fs.read` grant applies) and memory-mapped; tensor views point into the maps,
//! nothing is copied. Tensors keep their stored dtype (F16, BF16, F32, F64, I8, U8, I16, I32,
//! I64); [`SafetensorsModel::tensor_f32`] converts on request.
//!
//! Names are presented in U's canonical (GGUF) scheme through [`u_sdk::naming`]: Hugging Face
//! Llama-family names are mapped, unknown names pass through, per-expert MoE tensors stay
//! separate (`blk.{i}.ffn_up.{e}.weight`, no stacking copy), and HF-origin weights carry
//! `u.rope.pairing = "neox"`. A `config.json` next to the weights becomes metadata: GGUF-style
//! hyper-parameters (`llama.block_count`…) plus every entry as `config.<key>`.
//!
//! The parsing core ([`header`], [`index`], [`model`]) is plain Rust that needs no host, so it
//! is unit-tested and fuzzed (`fuzz/`); the plugin glue below only adapts it to the ABI, with
//! every exported call run under [`u_sdk::guard`].

#![deny(missing_docs)]

pub mod error;
pub mod header;
pub mod index;
pub mod model;

pub use error::{Error, HeaderError};
pub use model::{FileOpener, SafetensorsModel, StdFs, Tensor};

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RNone, ROption, RResult, RSlice, RSome, RStr, RString, RVec},
};
use std::{path::Path, sync::Arc};
use u_sdk::{
    HostBox, Loader, Loader_TO, MetaValue, PluginInfo, PluginInstance, TensorInfo, TensorView,
    UError, WeightSet, WeightSet_TO, WeightSetBox, guard, guard_infallible,
};

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}

/// Run-time self-description.
pub fn describe() -> PluginInfo {
    PluginInfo {
        summary: "safetensors loader: single or sharded files, memory-mapped, canonical names"
            .into(),
        details: vec!["formats=safetensors".into()].into(),
    }
}

/// Creates the loader with its host services.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Loader(Loader_TO::from_value(
        SafetensorsLoader { host },
        TD_Opaque,
    )))
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

/// The `loader` entry object.
#[derive(Clone)]
pub struct SafetensorsLoader {
    host: HostBox,
}

impl Loader for SafetensorsLoader {
    fn formats(&self) -> RVec<RString> {
        guard_infallible(|| vec![RString::from("safetensors")].into(), RVec::new)
    }

    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> bool {
        guard_infallible(|| sniff(path.as_str(), head.as_slice()), || false)
    }

    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError> {
        guard("loader-safetensors.open", || {
            let model = SafetensorsModel::open(
                &u_sdk::files::HostFiles(&self.host),
                Path::new(path.as_str()),
            )?;
            Ok(WeightSet_TO::from_value(
                SafetensorsWeights(Arc::new(model)),
                TD_Opaque,
            ))
        })
    }
}

/// The weight set handed to the host: a shared, loaded [`SafetensorsModel`].
#[derive(Clone)]
pub struct SafetensorsWeights(pub Arc<SafetensorsModel>);

impl WeightSet for SafetensorsWeights {
    fn format(&self) -> RString {
        guard_infallible(|| "safetensors".into(), RString::new)
    }

    fn architecture(&self) -> ROption<RString> {
        guard_infallible(
            || match self.0.architecture() {
                Some(a) => RSome(a.into()),
                None => RNone,
            },
            || RNone,
        )
    }

    fn metadata_keys(&self) -> RVec<RString> {
        guard_infallible(
            || {
                self.0
                    .metadata()
                    .iter()
                    .map(|(k, _)| k.as_str().into())
                    .collect()
            },
            RVec::new,
        )
    }

    fn metadata(&self, key: RStr<'_>) -> ROption<MetaValue> {
        guard_infallible(
            || self.0.metadata_value(key.as_str()).cloned().into(),
            || RNone,
        )
    }

    fn tensors(&self) -> RVec<TensorInfo> {
        guard_infallible(
            || self.0.tensors().iter().map(Tensor::info).collect(),
            RVec::new,
        )
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        guard("loader-safetensors.tensor", || {
            Ok(self.0.view(name.as_str())?)
        })
    }
}
