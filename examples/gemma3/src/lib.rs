//! # u-arch-gemma3 — Gemma 3 as a third-party U architecture plugin
//!
//! Gemma 3 (Gemma Team, Google DeepMind 2025, *Gemma 3 Technical Report*, arXiv:2503.19786),
//! text decoder: token embeddings scaled by `√hidden`; blocks of grouped-query attention with
//! RMSNorm on each query and key head, rotary positions (halves pairing) with a local base on
//! the sliding-window layers and a global base on every sixth, full-attention layer; a GeGLU
//! feed-forward (GELU, tanh approximation); four RMSNorms per block — before and after each
//! sublayer — all scaling by `1 + w`; a final norm and the LM head (tied to the embeddings
//! unless the checkpoint has its own), with optional logit soft-capping.
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_gemma3.py`, checked to
//! 1e-4 on a random-weight model by `tests/`), and llama.cpp for GGUF files (its converter
//! stores norm scales as `1 + w`; its score scale is `head_dim^-1/2`).
//!
//! Built outside U's workspace against `u-sdk` alone: the interfaces it implements
//! ([`Architecture`], [`Model`]), the box constructors that guard every method against panics
//! ([`ArchitectureBox::new`], [`ModelBox::new`]), the tensors it computes with ([`u_sdk::nn`])
//! and the export macro that embeds its manifest (`plugin.toml`, families `gemma3` and
//! `gemma3_text`). Signed with its publisher's own key and trusted by the deployment beside it
//! (`deployment.toml`); see this folder's README.

#![deny(missing_docs)]

pub mod config;
pub mod model;

pub use model::Gemma3;

use u_sdk::abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RString, RVec};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, KvCacheBox, Model, ModelBox,
    ModelConfig, PluginInfo, PluginInstance, SeqChunk, SeqId, UError, WeightSetBox, nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "Gemma 3 text decoder (third-party example plugin)".into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    if !host.config().trim().is_empty() {
        return Err(UError::invalid(
            "arch-gemma3 config: the plugin has no settings",
        ));
    }
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        Gemma3Architecture,
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
pub struct Gemma3Architecture;

impl Gemma3Architecture {
    /// Builds a model from `weights` on `backend` with its KV in `cache` (what
    /// [`Architecture::build`] does, for Rust callers such as tests).
    pub fn load(
        &self,
        weights: WeightSetBox,
        backend: BackendBox,
        cache: KvCacheBox,
    ) -> u_sdk::Result<ModelBox> {
        let family = weights
            .architecture()
            .into_result()?
            .into_option()
            .map_or_else(|| "gemma3".to_string(), |f| f.into_string());
        let model = Gemma3::load(&weights, &family, Device::new(backend)?, cache)?;
        Ok(ModelBox::new(model))
    }
}

impl Architecture for Gemma3Architecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        match context.cache.into_option() {
            Some(cache) => self.load(context.weights, backend, cache).into(),
            None => RResult::RErr(UError::invalid(
                "arch-gemma3: a decoder needs a KV cache (the deployment loads no cache plugin)",
            )),
        }
    }

    fn gguf_view(&self, weights: WeightSetBox, _family: RString) -> RResult<WeightSetBox, UError> {
        u_sdk::weights::gguf_as_is("arch-gemma3", weights)
    }
}

impl Model for Gemma3 {
    fn config(&self) -> RResult<ModelConfig, UError> {
        RResult::ROk(self.model_config())
    }

    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError> {
        RResult::ROk(ROption::RSome(Gemma3::cache(self).clone()))
    }

    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        Gemma3::forward(self, batch.as_slice(), out.as_mut_slice()).into()
    }

    fn graft(&self, _dst: SeqId, _src: SeqId, _from: u64, _count: u64) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported(
            "arch-gemma3: grafting KV (re-rotation per layer base) is not implemented",
        ))
    }
}
