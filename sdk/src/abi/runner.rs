//! Runner plugins: one per task (text generation, embeddings; later transcription and image
//! generation). A runner turns a built model and its tokenizer into the [`Engine`](crate::abi::transport::Engine) transports
//! serve: scheduling, sampling, chat templates and prompt caching live here, inside a sandboxed
//! plugin, so the host only verifies, grants, wires and locks down. The tasks a runner serves
//! are declared in its signed manifest (`tasks = […]`).

use crate::abi::{
    error::UError, loader::WeightSetBox, model::ModelBox, tokenizer::TokenizerBox,
    transport::EngineBox,
};
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, ROption, RResult, RStr, RString, RVec},
};

/// How much work a runner takes on at once; 0 leaves a field to the runner's default.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServingLimits {
    /// Requests running (sharing forward passes) at once.
    pub max_running: u32,
    /// Requests that may wait for a running slot before new ones are refused.
    pub max_queued: u32,
    /// Tokens per forward pass (decodes first, the rest to prefill).
    pub step_tokens: u32,
    /// Bytes the low-rank adapters loaded at run time may take beside those the deployment
    /// loads (0: no limit); the least recently used one not in use makes room.
    pub adapter_bytes: u64,
}

/// What a runner starts an engine from.
#[repr(C)]
#[derive(StableAbi)]
pub struct RunnerContext {
    /// The name clients ask for the model by.
    pub name: RString,
    /// The built model.
    pub model: ModelBox,
    /// Its tokenizer, when it reads or writes text.
    pub tokenizer: ROption<TokenizerBox>,
    /// Batch and queue sizes from the deployment.
    pub limits: ServingLimits,
    /// Other names clients may ask for the model by (`[model] aliases`); [`ANY_MODEL`] accepts
    /// any name (the Safebox runner form: its clients name models their own way).
    pub aliases: RVec<RString>,
    /// What the deployment loads beside the model for requests to ask for by name (control
    /// vectors, soft prompts).
    pub extras: RVec<RunnerExtra>,
    /// Opens adapters at run time, when the deployment allows directories of them.
    pub adapter_opener: ROption<AdapterOpenerBox>,
    /// For a decoder that reads images among its tokens ([`ModelConfig::image_token`]): the
    /// encoder that turns an image into the rows standing for it, built from the same
    /// checkpoint by the architecture declaring the family `<family>.vision` (LLaVA's vision
    /// tower and projector).
    ///
    /// [`ModelConfig::image_token`]: crate::abi::model::ModelConfig::image_token
    pub image_encoder: ROption<ModelBox>,
    /// A smaller decoder over the same vocabulary that drafts tokens for speculative decoding
    /// (`[model] draft`), with its own KV cache; the runner verifies its drafts with `model`.
    pub draft_model: ROption<ModelBox>,
    /// For a diffusion pipeline (a diffusers folder, `model` its denoiser): the other parts.
    pub pipeline: ROption<PipelineParts>,
    /// The compute device the model runs on, as its backend names it (e.g. `"cpu: 2 threads"`
    /// or a GPU adapter), for the engine's reports ([`crate::EngineStats::device`]).
    pub device: RString,
}

/// The parts of a diffusion pipeline besides its denoiser, as a diffusers folder holds them.
#[repr(C)]
#[derive(StableAbi)]
pub struct PipelineParts {
    /// Built components by their `model_index.json` names: `vae` (the autoencoder's
    /// decoder), `text_encoder` or `image_encoder` where the pipeline has one (a
    /// class-conditioned DiT has neither) and, where an architecture builds it, `vae.encoder`.
    pub components: RVec<PipelineComponent>,
    /// The configuration files of its parts as text, by component name: `model_index` (the
    /// folder's `model_index.json`), `scheduler` (its `scheduler_config.json`),
    /// `feature_extractor` (its `preprocessor_config.json`, where listed), and the `config.json`
    /// of the denoiser (`unet` or `transformer`), `vae` and the encoder where present (the
    /// autoencoder's `scaling_factor` is the pipeline's to apply).
    pub configs: RVec<PipelineConfig>,
    /// Its tokenizers by their `model_index.json` names (`tokenizer`, and `tokenizer_2`,
    /// `tokenizer_3` of a pipeline with several text encoders, as Stable Diffusion 3's).
    pub tokenizers: RVec<PipelineTokenizer>,
}

/// One tokenizer of a pipeline.
#[repr(C)]
#[derive(StableAbi)]
pub struct PipelineTokenizer {
    /// Its name in `model_index.json`.
    pub name: RString,
    /// The tokenizer.
    pub tokenizer: TokenizerBox,
}

/// One configuration file of a pipeline.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct PipelineConfig {
    /// The component it configures.
    pub component: RString,
    /// Its JSON text.
    pub json: RString,
}

/// One built component of a pipeline.
#[repr(C)]
#[derive(StableAbi)]
pub struct PipelineComponent {
    /// Its name in `model_index.json` (`.encoder` appended for an autoencoder's encoder).
    pub name: RString,
    /// The model.
    pub model: ModelBox,
}

/// An adapter's files as a loader read them.
#[repr(C)]
#[derive(StableAbi)]
pub struct OpenedAdapter {
    /// Its tensors and metadata.
    pub weights: WeightSetBox,
    /// The text of its `adapter_config.json` (empty for GGUF).
    pub config: RString,
}

/// Opens adapter files for a runner, on the host's side: the deployment's loaders, within the
/// directories it allows.
#[sabi_trait]
pub trait AdapterOpener: Send + Sync + Clone {
    /// Opens the adapter at `path` (a PEFT directory, its safetensors file, a llama.cpp GGUF
    /// LoRA); a path outside the allowed directories is refused.
    fn open(&self, path: RStr<'_>) -> RResult<OpenedAdapter, UError>;
}

/// An owned adapter opener.
pub type AdapterOpenerBox = AdapterOpener_TO<'static, RBox<()>>;

/// What a [`RunnerExtra`] is.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtraKind {
    /// A control (steering) vector: llama.cpp's or repeng's `direction.{L}` tensors, one per
    /// block `L` whose output it is added to (GGUF `general.architecture = controlvector`, or
    /// the same tensors as safetensors).
    ControlVector,
    /// A soft prompt: PEFT prompt tuning's `prompt_embeddings` `[virtual tokens, hidden]`, rows
    /// that stand before the prompt's own embeddings.
    SoftPrompt,
}

/// A named extra the runner serves requests with, as a loader read it.
#[repr(C)]
#[derive(StableAbi)]
pub struct RunnerExtra {
    /// The name requests ask for it by.
    pub name: RString,
    /// What it is.
    pub kind: ExtraKind,
    /// Its tensors and metadata.
    pub weights: WeightSetBox,
    /// The text of its config file beside it (PEFT's `adapter_config.json`), or empty.
    pub config: RString,
}

/// The alias that makes an engine answer to any model name. [`Engine::models`](crate::abi::transport::Engine)
/// lists it after the names when set, so transports know.
pub const ANY_MODEL: &str = "*";

/// Whether `models` (as [`Engine::models`](crate::abi::transport::Engine) lists them: the
/// model's names, then its adapters') serve `name`: one of them is it, one is [`ANY_MODEL`], or
/// it is `base:adapter` with both listed (an adapter of the model, as vLLM names them).
pub fn serves(models: &[impl AsRef<str>], name: &str) -> bool {
    let listed = |n: &str| {
        models
            .iter()
            .any(|m| m.as_ref() == n || m.as_ref() == ANY_MODEL)
    };
    listed(name)
        || name
            .rsplit_once(':')
            .is_some_and(|(base, adapter)| listed(base) && listed(adapter))
}

/// Entry interface of a `runner` plugin.
#[sabi_trait]
pub trait Runner: Send + Sync + Clone {
    /// Starts serving `context.model`; the engine runs until the last handle to it drops.
    fn start(&self, context: RunnerContext) -> RResult<EngineBox, UError>;
}

/// An owned runner object.
pub type RunnerBox = Runner_TO<'static, RBox<()>>;
