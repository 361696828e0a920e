//! # u-arch-bert — BERT-family encoders as a U architecture plugin
//!
//! BERT (Devlin et al. 2018, *BERT: Pre-training of Deep Bidirectional Transformers for
//! Language Understanding*, arXiv:1810.04805) and its distilled sentence encoders such as
//! MiniLM (Wang et al. 2020, arXiv:2002.10957) as sentence-transformers ships them
//! (Reimers & Gurevych 2019, arXiv:1908.10084): token, position and segment embeddings summed
//! and layer-normed, then post-norm blocks of bidirectional multi-head self-attention and a
//! GELU feed-forward network. A model of the **encoder** kind: every chunk is a whole input,
//! attended in both directions, with no KV cache; it answers hidden states after any layer and
//! pooled vectors (mean, first row) — what `/v1/embeddings` needs. nomic-bert (Nussbaum et al.
//! 2024, arXiv:2402.01613) is the same encoder with rotary positions, a fused query/key/value
//! projection, a SwiGLU feed-forward network and no projection biases.
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_bert.py`) and
//! sentence-transformers' `Pooling`, against which `tests/` checks hidden states and pooled
//! vectors of a tiny random-weight BERT and the real all-MiniLM-L6-v2.
//!
//! Checkpoints: Hugging Face folders (safetensors, ONNX: `config.json` and sentence-transformers'
//! side files) and llama.cpp GGUF files of architecture `bert` or `nomic-bert` (as
//! `convert_hf_to_gguf.py` writes them: `{arch}.*` hyper-parameters, `{arch}.pooling_type`,
//! llama.cpp's tensor names), which give the same model: `tests/` checks all-MiniLM-L6-v2 from GGUF against llama.cpp's
//! `llama-embedding` and against the safetensors folder, and a random nomic-bert GGUF (written
//! by llama.cpp's converter) against transformers' `NomicBertModel` and `llama-embedding`.
//!
//! Layout: [`config`] (hyper-parameters), [`naming`] (the tensor names of each checkpoint
//! layout), [`model`] (`Embeddings`, `SelfAttention`, `FeedForward`, `Layer`, `Bert`), and the
//! plugin glue below. Compute goes through the backend interface (`u_sdk::nn` tensors).
#![deny(missing_docs)]

pub mod config;
pub mod model;
pub mod naming;

pub use config::Config;
pub use model::Bert;

use abi_stable::std_types::{RResult, RString, RVec};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, ModelBox, ModelConfig,
    PluginInfo, PluginInstance, SeqChunk, UError, WeightSetBox,
    encoder::{Encoder, EncoderModel},
    nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "BERT-family encoder: bidirectional attention, mean/CLS pooling".into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-bert", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        BertArchitecture,
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
pub struct BertArchitecture;

impl BertArchitecture {
    /// Builds a model from `weights` on `backend` (what [`Architecture::build`] does, for Rust
    /// callers such as tests).
    pub fn load(&self, weights: WeightSetBox, backend: BackendBox) -> u_sdk::Result<ModelBox> {
        Ok(EncoderModel::boxed(Bert::load(
            &weights,
            Device::new(backend)?,
        )?))
    }
}

impl Architecture for BertArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        self.load(context.weights, backend).into()
    }

    fn gguf_view(&self, weights: WeightSetBox, _family: RString) -> RResult<WeightSetBox, UError> {
        u_sdk::weights::gguf_as_is("arch-bert", weights)
    }
}

impl Encoder for Bert {
    const PLUGIN: &'static str = "arch-bert";

    fn model_config(&self) -> ModelConfig {
        Bert::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        Bert::forward(self, batch, out)
    }
}
