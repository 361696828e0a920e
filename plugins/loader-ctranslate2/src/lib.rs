//! # loader-ctranslate2 — CTranslate2 weights for U
//!
//! Reads the `model.bin` that CTranslate2's converters write (binary versions 5 and 6, as
//! CTranslate2 3.x and 4.x produce them), given as a model directory or as the file itself, so
//! that models converted for CTranslate2 and faster-whisper — Whisper among them — can be served
//! without converting them back. Files are opened through the host's `open_read` (so the
//! deployment's `fs.read` grant applies) and memory-mapped.
//!
//! ## The format
//!
//! A `model.bin` is one flat little-endian stream: the container version, the name of the
//! Python *spec* class that described the model (`WhisperSpec`) and its revision, then every
//! variable as a header (name, rank, dimensions, a dtype id, a byte count) immediately followed
//! by its raw values, and finally a table of aliases — second names for variables, such as a
//! decoder projection tied to the embeddings. Strings carry a 16-bit length that counts their
//! NUL terminator. Model options (head counts, activation, pre-norm) are stored as rank-0
//! variables rather than in a separate header. [`model_bin`] gives the byte layout.
//!
//! ## What the loader presents
//!
//! - **Tensors**: every variable of rank ≥ 1 under its stored name, dtype (F32, I8, I16, I32,
//!   F16, BF16) and shape, then every alias under its own name with its target's bytes.
//! - **Alignment**: values follow their headers with no padding, so most start at odd offsets.
//!   CPU kernels read weights through typed pointers, so a tensor whose data is not 16-byte
//!   aligned is copied once, at open, into an aligned buffer; aligned ones stay views of the
//!   map. Every view the loader hands out is aligned to [`ALIGN`].
//! - **Metadata**: `ctranslate2.binary_version`, `ctranslate2.spec`, `ctranslate2.revision`;
//!   each rank-0 variable as `ctranslate2.<name>` (integers as `Int`, floats as `Float`); a
//!   `config.json` beside the file as `config.<key>` ([`u_sdk::weights::config_metadata`]).
//! - **Architecture**: the spec name lower-cased without `Spec` (`WhisperSpec` → `whisper`).
//!
//! The loader knows the format, not models: what the names and options mean is for the
//! architecture plugin to say. The parsing core ([`model_bin`], [`model`]) is plain Rust that needs
//! no host, so it is unit-tested and fuzzed (`fuzz/`); the plugin glue below only adapts it to
//! the ABI (panic-guarded by the SDK's boxes).

#![deny(missing_docs)]

pub mod error;
pub mod model;
pub mod model_bin;
#[cfg(test)]
mod test_writer;

pub use error::{Error, FormatError};
pub use model::{ALIGN, CTranslate2Model, FileOpener, StdFs, Tensor};

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
        summary:
            "CTranslate2 loader: model.bin (binary versions 5, 6), memory-mapped, names as stored"
                .into(),
        details: vec!["formats=ctranslate2".into()].into(),
    }
}

/// Creates the loader with its host services.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Loader(
        FileLoader::<CTranslate2Model>::new(host).into_box(),
    ))
}

/// Whether `path`/`head` look like a CTranslate2 model. A non-empty `head` (the file's first
/// bytes) decides: it must start like a `model.bin` ([`model_bin::sniff_head`]). With no head —
/// the host passes a directory with an empty one — the path decides: a file named `model.bin`,
/// or a directory holding one (checked with a `stat`, nothing is read outside the host's
/// grant; `open` then reads the file through the host).
pub fn sniff(path: &str, head: &[u8]) -> bool {
    if !head.is_empty() {
        return model_bin::sniff_head(head);
    }
    let path = Path::new(path);
    path.file_name().is_some_and(|n| n == model_bin::MODEL_FILE)
        || path.join(model_bin::MODEL_FILE).is_file()
}

/// The weight set handed to the host: a shared, loaded [`CTranslate2Model`].
pub type CTranslate2Weights = SharedWeights<CTranslate2Model>;

impl OpenWeights for CTranslate2Model {
    fn sniff(path: &str, head: &[u8]) -> bool {
        sniff(path, head)
    }

    fn open(files: &dyn u_sdk::files::FileOpener, path: &Path) -> u_sdk::Result<Self> {
        Ok(CTranslate2Model::open(files, path)?)
    }
}

impl WeightSource for CTranslate2Model {
    const FORMAT: &'static str = "ctranslate2";

    fn architecture(&self) -> Option<&str> {
        CTranslate2Model::architecture(self)
    }

    fn metadata_keys(&self) -> Vec<&str> {
        CTranslate2Model::metadata(self)
            .iter()
            .map(|(k, _)| k.as_str())
            .collect()
    }

    fn metadata(&self, key: &str) -> Option<MetaValue> {
        self.metadata_value(key).cloned()
    }

    fn tensors(&self) -> Vec<TensorInfo> {
        CTranslate2Model::tensors(self)
            .iter()
            .map(Tensor::info)
            .collect()
    }

    fn tensor(&self, name: &str) -> u_sdk::Result<TensorView<'_>> {
        Ok(self.view(name)?)
    }
}
