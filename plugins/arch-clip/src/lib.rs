//! # u-arch-clip — CLIP's text side as a U architecture plugin
//!
//! CLIP (Radford et al. 2021, *Learning Transferable Visual Models From Natural Language
//! Supervision*, arXiv:2103.00020) embeds texts and images into one space. This plugin builds
//! the text side of a full CLIP checkpoint (`CLIPModel`, `model_type` `clip`): token embeddings
//! plus learned positions, pre-norm blocks of **causal** multi-head self-attention and a
//! quick-GELU MLP, a final norm; the row of the end-of-text token is the text's pooled vector,
//! projected by `text_projection` (no bias) into the joint space. As transformers'
//! `CLIPModel.get_text_features`:
//!
//! ```text
//! x = token_embedding[ids] + position_embedding[0..n]
//! x = x + attn(ln1(x))   (causal);   x = x + mlp(ln2(x))      # per block
//! features = text_projection(final_layer_norm(x)[eos])
//! ```
//!
//! where `eos` is the first `eos_token_id` of the text (the legacy `eos_token_id` 2: the row of
//! the largest id). A model of the **encoder** kind whose width ([`u_sdk::ModelConfig::hidden`])
//! is the joint space's `projection_dim`, its own pooling [`u_sdk::Pooling::Head`]: what
//! `/v1/embeddings` serves for text. The image side (family `clip.vision`: the vision tower and
//! `visual_projection`) is arch-vit's; the host builds both from one checkpoint and the
//! embeddings runner sends images to that one.
//!
//! A text tower saved alone (`model_type` `clip_text_model`: `CLIPTextModel`, as Stable
//! Diffusion's `text_encoder/` is, or `CLIPTextModelWithProjection`) is family
//! `clip_text_model`: without a projection its rows are the tower's own width, and
//! `Output::Hidden` at the last layer gives transformers' `last_hidden_state` — every
//! final-normed row, what a diffusion UNet cross-attends to.
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_clip.py`), against which
//! `tests/` checks a tiny random-weight CLIP (`tests/fixtures/clip_tiny/` at the workspace root).
//!
//! Layout: [`config`] (hyper-parameters from `text_config`), [`model`] (`Embeddings`,
//! `SelfAttention`, `Mlp`, `Block`, `ClipText`), and the plugin glue below. Compute goes through
//! the backend interface (`u_sdk::nn` tensors).
#![deny(missing_docs)]

pub mod config;
pub mod model;

pub use config::Config;
pub use model::ClipText;

use abi_stable::std_types::{RResult, RString, RVec};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, ModelBox, ModelConfig,
    PluginInfo, PluginInstance, SeqChunk, UError, WeightSetBox,
    encoder::{Encoder, EncoderModel},
    nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "CLIP text tower and projection: text embeddings in the joint image-text space"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-clip", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        ClipArchitecture,
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
pub struct ClipArchitecture;

impl ClipArchitecture {
    /// Builds the text side of the CLIP checkpoint `weights` on `backend` (what
    /// [`Architecture::build`] does, for Rust callers such as tests).
    pub fn load(&self, weights: WeightSetBox, backend: BackendBox) -> u_sdk::Result<ModelBox> {
        Ok(EncoderModel::boxed(ClipText::load(
            &weights,
            Device::new(backend)?,
        )?))
    }
}

impl Architecture for ClipArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        self.load(context.weights, backend).into()
    }

    fn gguf_view(&self, _weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError> {
        RResult::RErr(UError::unsupported(format!(
            "arch-clip: llama.cpp has no GGUF layout for a {family} text tower"
        )))
    }
}

impl Encoder for ClipText {
    const PLUGIN: &'static str = "arch-clip";

    fn model_config(&self) -> ModelConfig {
        ClipText::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        ClipText::forward(self, batch, out)
    }
}
