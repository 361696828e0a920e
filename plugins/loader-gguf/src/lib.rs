//! # u-loader-gguf — GGUF weights for U
//!
//! A `loader` plugin that reads GGUF v2 and v3 files (llama.cpp's format): it memory-maps the
//! file descriptor the host opens for it (so the deployment's `fs.read` grant applies), parses
//! the header, metadata and tensor infos, and hands out tensor views that point into the map.
//! Quantized tensors stay compressed; [`u_sdk::quant`] turns any supported block format into
//! `f32`, bit-exactly as the Python `gguf` package does (proven by this crate's fixture tests).
//!
//! - [`gguf`]: the format parser, a plain module over `&[u8]` with no host or ABI involved, so it
//!   can be tested and fuzzed directly ([`gguf::Gguf::parse`]).
//! - [`plugin`]: the [`u_sdk::Loader`] and the file as a [`u_sdk::weights::WeightSource`].
//!
//! Malformed files get an [`Error`] naming what is wrong and where; every count and length is
//! checked against the file's size before anything is allocated.
#![deny(missing_docs)]

mod error;
pub mod gguf;
pub mod plugin;

pub use error::{Error, Result};
pub use gguf::Gguf;
pub use plugin::{GgufFile, GgufLoader, GgufWeights, open_path};
pub use u_sdk::quant::{dequantize, dequantize_to_vec, dequantize_view};

use abi_stable::std_types::RVec;
use u_sdk::{HostBox, PluginInfo, PluginInstance};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "GGUF v2/v3 loader: memory-mapped, zero-copy, quantized tensors kept compressed"
            .into(),
        details: RVec::from(vec![
            "formats=gguf".into(),
            "dtypes=F32,F16,BF16,F64,I8,I16,I32,I64,Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q8_1,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_K,TQ1_0,TQ2_0".into(),
        ]),
    }
}

/// Creates the plugin's loader object (the `instantiate` entry of the root module).
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    Ok(PluginInstance::Loader(GgufLoader::new(host).into_box()))
}

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}
