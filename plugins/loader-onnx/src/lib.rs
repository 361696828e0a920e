//! # loader-onnx — ONNX initializers as a U weight set
//!
//! Reads the initializers (weights) of an ONNX `ModelProto`. The protobuf schema subset is
//! hand-written ([`proto`], `prost` derives, no `protoc`). Files are opened through the host's
//! `open_read` (so the deployment's `fs.read` grant applies) and memory-mapped:
//!
//! - `raw_data` initializers are views into the model file's map (zero-copy);
//! - external-data initializers (`location`/`offset`/`length`, resolved relative to the model
//!   file and confined to its directory) are views into the external file's map;
//! - typed-field initializers (`float_data`, `int32_data`, `int64_data`, `double_data`) are
//!   converted once into their stored little-endian layout (ONNX writes them only for small
//!   tensors).
//!
//! Dtypes: FLOAT, FLOAT16, BFLOAT16, DOUBLE, INT8, UINT8, INT16, INT32, INT64; anything else is
//! a clear `Unsupported` error. Sparse initializers are ignored.
//!
//! The graph itself (inputs, outputs, nodes with their attributes) is the metadata value
//! `onnx.graph`, JSON ([`model::graph_json`]), for an architecture that runs it; a file that no
//! `config.json` names is of the family `onnx_graph` ([`GRAPH_FAMILY`]).
//!
//! Initializers keep their stored names (HF names, as `torch.onnx`/optimum exports keep them);
//! those PyTorch's exporter left anonymous (`onnx::MatMul_1966`) are named after the module
//! scope of the node that reads them, a `MatMul`'s constant becoming the linear layer's
//! `weight` in PyTorch's layout ([`OnnxModel::open`]). A `config.json` next to the model
//! becomes `config.*` metadata as in the safetensors loader, a `preprocessor_config.json`
//! `preprocessor.*`, and the model's own properties appear as `onnx.*`. What names mean is the
//! architecture plugin's business.
//!
//! The parsing core ([`model`]) needs no host, so it is unit-tested and fuzzed (`fuzz/`); the
//! plugin glue below only adapts it to the ABI, with every exported call run under
//! [`u_sdk::guard`].

#![deny(missing_docs)]

pub mod error;
pub mod model;
pub mod proto;

pub use error::Error;
pub use model::{FileOpener, GRAPH_FAMILY, GRAPH_KEY, OnnxModel, StdFs, Storage, Tensor};

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
            "ONNX loader: initializers (raw, typed, external data), memory-mapped, names as stored"
                .into(),
        details: vec!["formats=onnx".into()].into(),
    }
}

/// Creates the loader with its host services.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Loader(
        FileLoader::<OnnxModel>::new(host).into_box(),
    ))
}

/// Whether `path`/`head` look like ONNX: the `.onnx` extension, or a `ModelProto` that starts
/// with `ir_version` (field 1, varint) followed by another known top-level field.
pub fn sniff(path: &str, head: &[u8]) -> bool {
    if path.ends_with(".onnx") {
        return true;
    }
    match head {
        // 0x08: field 1 varint; a small IR version (1..=15); then field 2..8 length-delimited
        // (producer name, version, domain, graph, opset import) or field 5 varint.
        [0x08, v, next, ..] if (1..=15).contains(v) => {
            matches!(next, 0x12 | 0x1a | 0x22 | 0x28 | 0x32 | 0x3a | 0x42)
        }
        _ => false,
    }
}

/// The weight set handed to the host: a shared, loaded [`OnnxModel`].
pub type OnnxWeights = SharedWeights<OnnxModel>;

impl OpenWeights for OnnxModel {
    fn sniff(path: &str, head: &[u8]) -> bool {
        sniff(path, head)
    }

    fn open(files: &dyn u_sdk::files::FileOpener, path: &Path) -> u_sdk::Result<Self> {
        Ok(OnnxModel::open(files, path)?)
    }
}

impl WeightSource for OnnxModel {
    const FORMAT: &'static str = "onnx";

    fn architecture(&self) -> Option<&str> {
        OnnxModel::architecture(self)
    }

    fn metadata_keys(&self) -> Vec<&str> {
        OnnxModel::metadata(self)
            .iter()
            .map(|(k, _)| k.as_str())
            .collect()
    }

    fn metadata(&self, key: &str) -> Option<MetaValue> {
        self.metadata_value(key).cloned()
    }

    fn tensors(&self) -> Vec<TensorInfo> {
        OnnxModel::tensors(self).iter().map(Tensor::info).collect()
    }

    fn tensor(&self, name: &str) -> u_sdk::Result<TensorView<'_>> {
        Ok(self.view(name)?)
    }
}
