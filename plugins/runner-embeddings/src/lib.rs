//! # u-runner-embeddings — the embeddings runner plugin
//!
//! A `runner` plugin for the **embeddings** task: the host hands it an encoder (a model of
//! [`ModelKind::Encoder`], e.g. all-MiniLM-L6-v2 built by `arch-bert`) and its tokenizer, and it
//! serves [`Engine::embed`]: the text is tokenized with the model's special tokens, truncated
//! to the model's context the way the checkpoint's tokenizer truncates (the sequence shortened,
//! its leading and trailing special tokens kept), run as one chunk, and the model's pooled
//! vector (its own pooling: mean for sentence-transformers) is L2-normalised, as
//! sentence-transformers' `Normalize` module does. An image encoder (a model whose config says
//! what image it takes, e.g. DINOv2 built by `arch-vit`) embeds images instead
//! ([`Engine::embed_image`]): the file is decoded and preprocessed as the model's image processor
//! does (`u-image`, within the `max_image_pixels` setting), and its pooled vector normalised
//! alike; such a model needs no tokenizer. A model of text and images is served as two: the
//! text encoder, and the image encoder the host builds beside it from the same checkpoint
//! ([`RunnerContext::image_encoder`], e.g. CLIP: arch-clip's text tower and arch-vit's
//! `clip.vision`, both projecting into one space): text goes to the first, images to the
//! second, each pooled its own way and normalised. Requests run on the caller's thread; the
//! model's forward pass is safe to call from many at once. Text generation and KV checkpoints
//! are another runner's task: asked for them, it says so.
#![deny(missing_docs)]

use abi_stable::std_types::{RResult, RSlice, RSliceMut, RStr, RString, RVec};
use std::sync::{
    Arc,
    atomic::{AtomicU32, AtomicU64, Ordering},
};
use u_sdk::{
    CheckpointInfo, CheckpointRequest, Engine, EngineBox, EngineStats, ErrorKind, GenerateRequest,
    GenerateSummary, HostBox, ImageInput, ModelBox, ModelConfig, ModelKind, Output, PluginInfo,
    PluginInstance, Runner, RunnerBox, RunnerContext, Segment, SeqChunk, TokenSinkBox,
    TokenizeRequest, TokenizerBox, UError,
};

/// The `runner` entry object.
#[derive(Clone, Copy, Debug, Default)]
pub struct EmbeddingsRunner {
    /// What an image may be.
    pub images: u_image::Limits,
}

impl EmbeddingsRunner {
    /// Serves `model` with `tokenizer` under `name` (what [`Runner::start`] does, for Rust
    /// callers such as tests).
    pub fn serve(
        &self,
        name: &str,
        model: ModelBox,
        tokenizer: Option<TokenizerBox>,
    ) -> u_sdk::Result<Embedder> {
        self.serve_as((name, Vec::new()), model, tokenizer)
    }

    /// [`EmbeddingsRunner::serve_as`] with an image encoder beside the text model
    /// (`image_encoder`, [`RunnerContext::image_encoder`]): images are embedded by it, text by
    /// `model`; both must make vectors of one width.
    pub fn serve_with_images(
        &self,
        names: (&str, Vec<String>),
        model: ModelBox,
        tokenizer: Option<TokenizerBox>,
        image_encoder: ModelBox,
    ) -> u_sdk::Result<Embedder> {
        self.start_with(names, model, tokenizer, Some(image_encoder))
    }

    /// [`EmbeddingsRunner::serve`] under `name` and other names, `aliases`
    /// ([`u_sdk::ANY_MODEL`]: any).
    pub fn serve_as(
        &self,
        names: (&str, Vec<String>),
        model: ModelBox,
        tokenizer: Option<TokenizerBox>,
    ) -> u_sdk::Result<Embedder> {
        self.start_with(names, model, tokenizer, None)
    }

    fn start_with(
        &self,
        (name, aliases): (&str, Vec<String>),
        model: ModelBox,
        tokenizer: Option<TokenizerBox>,
        image_encoder: Option<ModelBox>,
    ) -> u_sdk::Result<Embedder> {
        let config = model.config().into_result()?;
        if config.kind != ModelKind::Encoder {
            return Err(UError::invalid(format!(
                "runner-embeddings serves encoders; `{}` is a {:?} model",
                config.family, config.kind
            )));
        }
        if tokenizer.is_none() && config.image.is_none() {
            return Err(UError::invalid(format!(
                "runner-embeddings: `{name}` has no tokenizer (no tokenizer.json beside it)"
            )));
        }
        let image_encoder = match image_encoder {
            None => None,
            Some(encoder) => {
                let c = encoder.config().into_result()?;
                if c.kind != ModelKind::Encoder || c.image.is_none() || c.hidden != config.hidden {
                    return Err(UError::invalid(format!(
                        "runner-embeddings: `{name}`'s image encoder (`{}`) is a {:?} model of \
                         width {}{}; images embed beside text with an encoder of images of the \
                         text model's width {}",
                        c.family,
                        c.kind,
                        c.hidden,
                        if c.image.is_none() {
                            " that reads no images"
                        } else {
                            ""
                        },
                        config.hidden
                    )));
                }
                Some((encoder, c))
            }
        };
        Ok(Embedder(Arc::new(Inner {
            name: name.into(),
            aliases,
            model,
            tokenizer,
            config,
            image_encoder,
            images: self.images,
            requests: AtomicU64::new(0),
            running: AtomicU32::new(0),
            tokens: AtomicU64::new(0),
            passes: AtomicU64::new(0),
        })))
    }
}

impl Runner for EmbeddingsRunner {
    fn start(&self, context: RunnerContext) -> RResult<EngineBox, UError> {
        let aliases = context.aliases.iter().map(|a| a.to_string()).collect();
        self.start_with(
            (context.name.as_str(), aliases),
            context.model,
            context.tokenizer.into_option(),
            context.image_encoder.into_option(),
        )
        .map(EngineBox::new)
        .into()
    }
}

struct Inner {
    name: String,
    /// Other names the model answers to ([`u_sdk::ANY_MODEL`]: any).
    aliases: Vec<String>,
    model: ModelBox,
    /// Absent for an image encoder.
    tokenizer: Option<TokenizerBox>,
    config: ModelConfig,
    /// The model images go to when the main model reads text only (CLIP's image side), with
    /// its config.
    image_encoder: Option<(ModelBox, ModelConfig)>,
    images: u_image::Limits,
    requests: AtomicU64,
    running: AtomicU32,
    tokens: AtomicU64,
    passes: AtomicU64,
}

/// An encoder served as an [`Engine`] that embeds. Clones share the model.
#[derive(Clone)]
pub struct Embedder(Arc<Inner>);

impl Embedder {
    fn check_model(&self, model: &str) -> u_sdk::Result<()> {
        match model == self.0.name || u_sdk::serves(&self.0.aliases, model) {
            true => Ok(()),
            false => Err(UError::not_found(format!(
                "model `{model}` is not served (this engine serves `{}`)",
                self.0.name
            ))),
        }
    }

    /// The token ids of `text` as the model reads them: with its special tokens, and, when
    /// longer than the model's context, the text's own tokens cut so that the special tokens
    /// around them still fit (as a `tokenizers` truncation does).
    pub fn tokens(&self, text: &str) -> u_sdk::Result<Vec<u32>> {
        let tok = self.tokenizer()?;
        let with = tok
            .encode(text.into(), true, true)
            .into_result()?
            .into_vec();
        let max = self.0.config.context_length as usize;
        if with.len() <= max {
            return Ok(with);
        }
        let plain = tok
            .encode(text.into(), false, true)
            .into_result()?
            .into_vec();
        let extra = with.len().saturating_sub(plain.len());
        let lead = (0..=extra)
            .find(|&p| with[p..].starts_with(&plain[..plain.len().min(16)]))
            .ok_or_else(|| {
                UError::new(
                    ErrorKind::Internal,
                    "runner-embeddings: the tokenizer's special tokens do not wrap the text",
                )
            })?;
        let tail = extra - lead;
        if max <= extra {
            return Err(UError::invalid(format!(
                "runner-embeddings: a context of {max} does not fit {extra} special tokens"
            )));
        }
        let mut ids = with[..lead].to_vec();
        ids.extend_from_slice(&plain[..max - extra]);
        ids.extend_from_slice(&with[with.len() - tail..]);
        Ok(ids)
    }

    /// The normalised embedding of `text`.
    pub fn embed_text(&self, text: &str) -> u_sdk::Result<Vec<f32>> {
        self.embed_ids(&self.tokens(text)?)
    }

    /// The normalised embedding of token ids used as they are (at most the model's context).
    pub fn embed_ids(&self, ids: &[u32]) -> u_sdk::Result<Vec<f32>> {
        let c = &self.0.config;
        if ids.is_empty() {
            return Err(UError::invalid("runner-embeddings: no tokens to embed"));
        }
        if let Some(&bad) = ids.iter().find(|&&t| t >= c.vocab_size) {
            return Err(UError::invalid(format!(
                "runner-embeddings: token id {bad} is out of range for a vocabulary of {}",
                c.vocab_size
            )));
        }
        if ids.len() > c.context_length as usize {
            return Err(UError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "runner-embeddings: {} tokens; the model's context holds {}",
                    ids.len(),
                    c.context_length
                ),
            ));
        }
        let input = [Segment::Tokens(RSlice::from_slice(ids))];
        self.pooled((&self.0.model, c), &input, ids.len() as u64)
    }

    /// The tokenizer, or an error saying the model reads images, not text.
    fn tokenizer(&self) -> u_sdk::Result<&TokenizerBox> {
        self.0.tokenizer.as_ref().ok_or_else(|| {
            UError::unsupported(format!(
                "`{}` embeds images; it reads no text (it has no tokenizer)",
                self.0.name
            ))
        })
    }

    /// The normalised embedding of an image file's `bytes`, preprocessed as the image
    /// model's processor does: the image encoder's where one is served beside the text model,
    /// else the model's own.
    pub fn embed_image(&self, bytes: &[u8]) -> u_sdk::Result<Vec<f32>> {
        let (model, config) = match &self.0.image_encoder {
            Some((encoder, config)) => (encoder, config),
            None => (&self.0.model, &self.0.config),
        };
        let spec = config.image.into_option().ok_or_else(|| {
            UError::unsupported(format!(
                "`{}` does not embed images (a text encoder: send text)",
                self.0.name
            ))
        })?;
        let image = u_image::decode(bytes, &self.0.images)
            .map_err(|e| UError::invalid(format!("runner-embeddings: {e}")))?;
        let pixels = u_image::preprocess(&image, &spec)
            .map_err(|e| UError::invalid(format!("runner-embeddings: {e}")))?;
        let input = [Segment::Image(ImageInput {
            pixels: RSlice::from_slice(&pixels),
            rows: spec.rows,
        })];
        self.pooled((model, config), &input, u64::from(spec.rows))
    }

    /// `model`'s own pooled vector (its config `c` says which) of one chunk of `input` (`rows`
    /// positions), normalised.
    fn pooled(
        &self,
        (model, c): (&ModelBox, &ModelConfig),
        input: &[Segment<'_>],
        rows: u64,
    ) -> u_sdk::Result<Vec<f32>> {
        let chunk = [SeqChunk::tokens(0, input, Output::Pooled(c.pooling))];
        let mut v = vec![0f32; c.hidden as usize];
        self.0.running.fetch_add(1, Ordering::Relaxed);
        let result = model
            .forward(
                RSlice::from_slice(&chunk),
                RSliceMut::from_mut_slice(&mut v),
            )
            .into_result();
        self.0.running.fetch_sub(1, Ordering::Relaxed);
        result?;
        self.0.requests.fetch_add(1, Ordering::Relaxed);
        self.0.passes.fetch_add(1, Ordering::Relaxed);
        self.0.tokens.fetch_add(rows, Ordering::Relaxed);
        // sentence-transformers' Normalize: v / max(‖v‖, 1e-12).
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        v.iter_mut().for_each(|x| *x /= norm);
        Ok(v)
    }

    fn not_this_task(&self, what: &str) -> UError {
        UError::unsupported(format!(
            "`{}` is an embedding model: {what} needs a text-generation model",
            self.0.name
        ))
    }
}

impl Engine for Embedder {
    fn models(&self) -> RResult<RVec<RString>, UError> {
        let names = std::iter::once(&self.0.name).chain(&self.0.aliases);
        RResult::ROk(names.map(|n| RString::from(n.as_str())).collect())
    }

    fn generate(
        &self,
        request: &GenerateRequest,
        _sink: TokenSinkBox,
    ) -> RResult<GenerateSummary, UError> {
        match self.check_model(&request.model) {
            Ok(()) => RResult::RErr(self.not_this_task("generation")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn stats(&self) -> RResult<EngineStats, UError> {
        RResult::ROk(EngineStats {
            requests: self.0.requests.load(Ordering::Relaxed),
            running: self.0.running.load(Ordering::Relaxed),
            prompt_tokens: self.0.tokens.load(Ordering::Relaxed),
            forward_passes: self.0.passes.load(Ordering::Relaxed),
            ..EngineStats::default()
        })
    }

    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        // An encoder keeps no prompt cache: nothing to flush.
        self.check_model(model.as_str()).map(|()| 0).into()
    }

    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        match self.check_model(&request.model) {
            Ok(()) => RResult::RErr(self.not_this_task("a KV checkpoint")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn embed_image(&self, model: RStr<'_>, image: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        self.check_model(model.as_str())
            .and_then(|()| self.embed_image(image.as_slice()))
            .map(RVec::from)
            .into()
    }

    fn embed(&self, model: RStr<'_>, input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        self.check_model(model.as_str())
            .and_then(|()| self.embed_text(input.as_str()))
            .map(RVec::from)
            .into()
    }

    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        (|| {
            self.check_model(&request.model)?;
            if !request.messages.is_empty() {
                return Err(self.not_this_task("a chat conversation"));
            }
            if request.add_special {
                return self.tokens(&request.prompt);
            }
            Ok(self
                .tokenizer()?
                .encode(request.prompt.as_str().into(), false, true)
                .into_result()?
                .into_vec())
        })()
        .map(RVec::from)
        .into()
    }

    fn detokenize(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        (|| {
            self.check_model(model.as_str())?;
            let (tok, mut bytes) = (self.tokenizer()?, Vec::new());
            for &id in tokens.iter() {
                bytes.extend_from_slice(&tok.token_bytes(id).into_result()?);
            }
            Ok(RVec::from(bytes))
        })()
        .into()
    }

    fn embed_tokens(&self, model: RStr<'_>, tokens: RSlice<'_, u32>) -> RResult<RVec<f32>, UError> {
        self.check_model(model.as_str())
            .and_then(|()| self.embed_ids(tokens.as_slice()))
            .map(RVec::from)
            .into()
    }
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "embeddings: an encoder's pooled, normalised vector per input".into(),
        details: RVec::new(),
    }
}

/// Creates the runner (the root module's `instantiate`) with its one setting,
/// `max_image_pixels` (the most pixels an image may have; PIL's default limit when absent).
fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let mut images = u_image::Limits::default();
    for (key, value) in u_sdk::settings::table(&host, "runner-embeddings")? {
        match (key.as_str(), value.as_integer()) {
            ("max_image_pixels", Some(n)) if n > 0 => images.max_pixels = n as u64,
            ("max_image_pixels", _) => {
                return Err(UError::invalid(
                    "runner-embeddings config: `max_image_pixels` must be a positive integer",
                ));
            }
            (other, _) => {
                return Err(UError::invalid(format!(
                    "runner-embeddings config: unknown key `{other}` (known: max_image_pixels)"
                )));
            }
        }
    }
    Ok(PluginInstance::Runner(RunnerBox::new(EmbeddingsRunner {
        images,
    })))
}

/// The exported root module and embedded manifest.
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}
