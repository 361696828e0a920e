//! # u-arch-whisper — Whisper speech recognition as a U architecture plugin
//!
//! Whisper (Radford et al. 2022, *Robust Speech Recognition via Large-Scale Weak Supervision*,
//! arXiv:2212.04356): an encoder–decoder transformer. The audio encoder reads a log-mel
//! spectrogram of 30 s (80 or 128 bins × 3000 frames of 10 ms), downsamples it with two
//! convolutions (the second of stride 2) to 1500 positions, adds sinusoidal positions and runs
//! pre-norm blocks of bidirectional self-attention; the text decoder embeds tokens with learned
//! positions and runs pre-norm blocks of causal self-attention, cross-attention over the
//! encoded audio and a GELU MLP, its logits the final state times the (tied) token table.
//!
//! A model of the **cross-decoder** kind: a chunk's [`u_sdk::CrossContext`] brings the
//! spectrogram once (`[n_mels, 3000]`, [`u_sdk::ModelConfig::context_shape`]); the model encodes
//! it and keeps every decoder layer's cross-attention keys and values in the cache under the
//! context's sequence, which later passes — and other sequences such as beams — name with no
//! rows. Self-attention KV lives under the chunk's own sequence, as for any decoder.
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_whisper.py`) and OpenAI's
//! `whisper` package, against which `tests/` checks the encoder's output and the decoder's
//! logits of a tiny random-weight Whisper; the real tiny.en (CTranslate2) is checked against
//! CTranslate2 in the workspace tests.
//!
//! Checkpoints: Hugging Face folders (safetensors with `config.json`) and CTranslate2 model
//! folders (`model.bin` of a `WhisperSpec`: fused projections, see [`naming`]).
//!
//! Layout: [`config`] (hyper-parameters), [`naming`] (the tensor names of each checkpoint
//! layout), [`model`] (`AudioEncoder`, `EncoderBlock`, `TextDecoder`, `DecoderBlock`,
//! `Whisper`), and the plugin glue below.
#![deny(missing_docs)]

pub mod config;
pub mod model;
pub mod naming;

pub use config::Config;
pub use model::Whisper;

use abi_stable::std_types::{ROption, RResult, RSlice, RSliceMut, RString};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, KvCacheBox, Model, ModelBox,
    ModelConfig, PluginInfo, PluginInstance, SeqChunk, SeqId, UError, WeightSetBox, nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "Whisper: audio encoder and text decoder with static cross-attention KV".into(),
        details: vec!["formats=safetensors,ctranslate2".into()].into(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-whisper", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        WhisperArchitecture,
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
pub struct WhisperArchitecture;

impl WhisperArchitecture {
    /// Builds a model from `weights` on `backend` with KV in `cache` (what
    /// [`Architecture::build`] does, for Rust callers such as tests).
    pub fn load(
        &self,
        weights: WeightSetBox,
        backend: BackendBox,
        cache: KvCacheBox,
    ) -> u_sdk::Result<Whisper> {
        Whisper::load(&weights, Device::new(backend)?, cache)
    }
}

impl Architecture for WhisperArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        let ROption::RSome(cache) = context.cache else {
            return RResult::RErr(UError::invalid(
                "arch-whisper: the decoder needs a KV cache (the deployment has no cache plugin)",
            ));
        };
        self.load(context.weights, backend, cache)
            .map(ModelBox::new)
            .into()
    }

    fn gguf_view(&self, weights: WeightSetBox, _family: RString) -> RResult<WeightSetBox, UError> {
        u_sdk::weights::gguf_as_is("arch-whisper", weights)
    }
}

impl Model for Whisper {
    fn config(&self) -> RResult<ModelConfig, UError> {
        RResult::ROk(self.model_config())
    }

    fn cache(&self) -> RResult<ROption<KvCacheBox>, UError> {
        RResult::ROk(ROption::RSome(self.kv_cache().clone()))
    }

    fn forward(
        &self,
        batch: RSlice<'_, SeqChunk<'_>>,
        mut out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        Whisper::forward(self, batch.as_slice(), out.as_mut_slice()).into()
    }

    fn graft(&self, _dst: SeqId, _src: SeqId, _from: u64, _count: u64) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported(
            "arch-whisper: positions are learned and added before attention, so cached KV \
             cannot move to other positions",
        ))
    }
}
