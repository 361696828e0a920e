//! # loader-ggml — whisper.cpp's GGML model files for U
//!
//! Reads the `ggml-*.bin` files whisper.cpp runs (its legacy GGML container, as its
//! `convert-pt-to-ggml.py` and `convert-h5-to-ggml.py` write them, in F32, F16 or its
//! quantized types), so that a Whisper model converted for whisper.cpp is served without
//! converting it back. The file is opened through the host's `open_read` (the deployment's
//! `fs.read` grant applies) and memory-mapped; [`model`] gives the byte layout.
//!
//! What it presents:
//! - **Tensors** under their stored names (openai-whisper's: `encoder.blocks.0.attn.query.weight`,
//!   `decoder.token_embedding.weight`), dimensions outermost first (the file stores them
//!   innermost first). The format has no padding, so a tensor whose data is not 16-byte aligned
//!   is copied once into an aligned buffer; aligned ones stay views of the map.
//! - **Metadata**: the hyper-parameters as `whisper.n_vocab`, `whisper.n_audio_state`, … (see
//!   [`model::HPARAMS`]), the mel filterbank whisper.cpp computes its input with
//!   (`whisper.mel_filters`), and the vocabulary (`whisper.vocab`).
//! - **Architecture**: `whisper` (the container's hyper-parameters are Whisper's).
//!
//! The parsing core needs no host, so it is unit-tested and fuzzed (`fuzz/`); the glue below
//! adapts it to the ABI.

#![deny(missing_docs)]

pub mod error;
pub mod model;

pub use error::Error;
pub use model::{GgmlModel, Tensor};

use std::{path::Path, sync::Arc};
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
        summary: "GGML loader: whisper.cpp model files, memory-mapped, names as stored".into(),
        details: vec!["formats=ggml".into()].into(),
    }
}

/// Creates the loader with its host services.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Loader(
        FileLoader::<GgmlModel>::new(host).into_box(),
    ))
}

/// Whether `head` (a file's first bytes) starts with the GGML magic.
pub fn sniff(_path: &str, head: &[u8]) -> bool {
    head.starts_with(&model::MAGIC.to_le_bytes())
}

/// The weight set handed to the host: a shared, loaded [`GgmlModel`].
pub type GgmlWeights = SharedWeights<GgmlModel>;

impl OpenWeights for GgmlModel {
    fn sniff(path: &str, head: &[u8]) -> bool {
        sniff(path, head)
    }

    fn open(files: &dyn u_sdk::files::FileOpener, path: &Path) -> u_sdk::Result<Self> {
        let map = u_sdk::files::map_file(files, path).map_err(Error::from)?;
        Ok(GgmlModel::parse(Arc::new(map))?)
    }
}

impl WeightSource for GgmlModel {
    const FORMAT: &'static str = "ggml";

    fn architecture(&self) -> Option<&str> {
        Some("whisper")
    }

    fn metadata_keys(&self) -> Vec<&str> {
        GgmlModel::metadata(self)
            .iter()
            .map(|(k, _)| k.as_str())
            .collect()
    }

    fn metadata(&self, key: &str) -> Option<MetaValue> {
        GgmlModel::metadata(self)
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn tensors(&self) -> Vec<TensorInfo> {
        GgmlModel::tensors(self).iter().map(Tensor::info).collect()
    }

    fn tensor(&self, name: &str) -> u_sdk::Result<TensorView<'_>> {
        Ok(self.view(name)?)
    }
}
