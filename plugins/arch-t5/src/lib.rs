//! # u-arch-t5 — the T5 encoder as a U architecture plugin
//!
//! T5 (Raffel et al. 2020, *Exploring the Limits of Transfer Learning with a Unified
//! Text-to-Text Transformer*, arXiv:1910.10683) reads text with a stack of pre-norm blocks
//! whose norms are RMS norms without bias, whose attention is unscaled and biased by the
//! bucketed distance between query and key (no position embeddings), and whose feed-forward
//! layer is ReLU (v1.0) or gated GELU (v1.1, the T5-XXL that Stable Diffusion 3 and FLUX read
//! prompts with). As transformers' `T5EncoderModel`:
//!
//! ```text
//! x = shared[ids]
//! x = x + o(softmax(q·kᵀ + bias(k − q))·v)   on rms(x)        # per block
//! x = x + wo(gelu(wi_0·x) ⊙ wi_1·x)          on rms(x)        # (relu: wo(relu(wi·x)))
//! last_hidden_state = rms(x)
//! ```
//!
//! The bias table is learned once, in the first block, and added in every block: exact buckets
//! for distances below a quarter of the buckets, logarithmic ones up to
//! `relative_attention_max_distance`, keys before and after the query in separate halves.
//!
//! A model of the **encoder** kind (family `t5`): `Output::Hidden` at the last layer gives
//! `last_hidden_state`, at an earlier layer `l` the residual stream `hidden_states[l]`;
//! `Output::Pooled` pools the final rows (mean by default).
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_t5.py`), against which
//! `tests/` checks two tiny random-weight encoders (`tests/fixtures/t5_tiny/` at the workspace
//! root: gated GELU with an inner width unlike `d_model`, and ReLU).
//!
//! Layout: [`config`] (hyper-parameters), [`model`] (`RmsNorm`, `RelativePositions`,
//! `SelfAttention`, `FeedForward`, `Block`, `T5Encoder`), and the plugin glue below. Compute
//! goes through the backend interface (`u_sdk::nn` tensors).
#![deny(missing_docs)]

pub mod config;
pub mod model;

pub use config::Config;
pub use model::T5Encoder;

use abi_stable::std_types::{RResult, RString, RVec};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, ModelBox, ModelConfig,
    PluginInfo, PluginInstance, SeqChunk, UError, WeightSetBox,
    encoder::{Encoder, EncoderModel},
    nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "the T5 encoder: text rows for diffusion pipelines and sentence embeddings".into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-t5", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        T5Architecture,
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
pub struct T5Architecture;

impl T5Architecture {
    /// Builds the encoder of the T5 checkpoint `weights` on `backend` (what
    /// [`Architecture::build`] does, for Rust callers such as tests).
    pub fn load(&self, weights: WeightSetBox, backend: BackendBox) -> u_sdk::Result<ModelBox> {
        Ok(EncoderModel::boxed(T5Encoder::load(
            &weights,
            Device::new(backend)?,
        )?))
    }
}

impl Architecture for T5Architecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        self.load(context.weights, backend).into()
    }

    fn gguf_view(&self, _weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError> {
        RResult::RErr(UError::unsupported(format!(
            "arch-t5: the GGUF export of a {family} encoder is not implemented"
        )))
    }
}

impl Encoder for T5Encoder {
    const PLUGIN: &'static str = "arch-t5";

    fn model_config(&self) -> ModelConfig {
        T5Encoder::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        T5Encoder::forward(self, batch, out)
    }
}
