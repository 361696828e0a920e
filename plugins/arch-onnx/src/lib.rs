//! # u-arch-onnx — an ONNX graph run as it is written
//!
//! Most architectures read a checkpoint's weights by name and compute what the paper says
//! (arch-llama, arch-diffusion…). An ONNX file, though, carries its computation: this plugin
//! runs the graph itself, for files no `config.json` names (loader-onnx's family
//! `onnx_graph`) — such as the consistency-distilled terrain UNet of PyPI's
//! `adaptive-terrain-diffusion`, whose preconditioning and sampler-facing signature exist only
//! in its graph.
//!
//! Layout: [`graph`] (the loader's `onnx.graph` JSON checked into slots, initializers loaded,
//! slots freed after their last reader), [`ops`] (the operators, attributes checked at build),
//! [`indexing`] (`Gather`, `Slice`, masks, `ReduceMean`, `MatMul` of computed operands: what
//! an exported transformer's graph needs), [`value`] (arrays and broadcasting), [`model`] (the graph's signature as the ABI's model; [`tokens`] for a text encoder's).
//! The heavy operators — `Conv`, `Gemm`, `MatMul`, `Einsum` — compute through the backend
//! interface (`u_sdk::nn`), their constant operands uploaded once.
#![deny(missing_docs)]

pub mod graph;
pub mod indexing;
pub mod model;
pub mod ops;
pub mod tokens;
pub mod value;

pub use graph::Graph;
pub use model::GraphModel;

use abi_stable::std_types::{RResult, RString, RVec};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, ModelBox, ModelConfig,
    PluginInfo, PluginInstance, SeqChunk, UError, WeightSetBox,
    encoder::{Encoder, EncoderModel},
    nn::Device,
};

/// The family it builds: an ONNX file whose graph is the architecture.
pub const FAMILY: &str = "onnx_graph";

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "ONNX graphs run as written: feature maps (with conditioning and a context) \
                  to a map, token ids to rows"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-onnx", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        OnnxArchitecture,
    )))
}

/// The exported root module and embedded manifest.
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}

/// The `architecture` entry object.
#[derive(Clone, Copy, Debug, Default)]
pub struct OnnxArchitecture;

impl OnnxArchitecture {
    /// Builds the graph of `weights` on `backend` (what [`Architecture::build`] does, for
    /// Rust callers such as tests).
    pub fn load(&self, weights: WeightSetBox, backend: BackendBox) -> u_sdk::Result<GraphModel> {
        let device = Device::new(backend)?;
        let graph = Graph::load(&weights, &device)?;
        GraphModel::new(graph, device)
    }
}

impl Architecture for OnnxArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        if context.family.as_str() != FAMILY {
            return RResult::RErr(UError::unsupported(format!(
                "arch-onnx builds `{FAMILY}`, not `{}`",
                context.family
            )));
        }
        self.load(context.weights, backend)
            .map(EncoderModel::boxed)
            .into()
    }

    fn gguf_view(&self, _weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError> {
        RResult::RErr(UError::unsupported(format!(
            "arch-onnx: llama.cpp has no GGUF layout for an ONNX graph ({family})"
        )))
    }
}

impl Encoder for GraphModel {
    const PLUGIN: &'static str = "arch-onnx";

    fn model_config(&self) -> ModelConfig {
        GraphModel::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        GraphModel::forward(self, batch, out)
    }
}
