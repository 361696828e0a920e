//! # u-runner-image — the image generation runner plugin
//!
//! A `runner` plugin for the **image-generation** task. The host hands it a latent diffusion
//! pipeline built from a diffusers folder: the denoiser (a [`u_sdk::ModelKind::Denoiser`],
//! Stable Diffusion's `UNet2DConditionModel` built by arch-diffusion) as the model, and as
//! [`u_sdk::PipelineParts`] the text encoder, the autoencoder's decoder (and encoder, for image
//! to image), the tokenizer and the configuration files. It serves
//! [`Engine::generate_image`]:
//!
//! - [`pipeline`]: the models and what the loop asks of them (prompt rows, a guided
//!   prediction, decoding, encoding an initial image);
//! - [`sampler`]: one request's loop over the scheduler's steps (`u-diffusion`), text to image
//!   or image to image, seeded and cancellable;
//! - [`cache`]: the exact caches (prompt rows; trajectories, so a cancelled request resumes);
//! - [`picture`]: initial images in, PNG files out.
//!
//! Requests run one at a time on the caller's thread (each pass already uses every core); the
//! others wait their turn, up to `max_queued`. Settings (`[plugins.config]`): `max_pixels`, the
//! largest image a request may ask for or start from (default 2048 × 2048), and `caches`
//! (default `true`; `false` computes everything every time, to measure what they save).
#![deny(missing_docs)]

pub mod cache;
pub mod picture;
pub mod pipeline;
pub mod sampler;

use abi_stable::std_types::{RResult, RSlice, RStr, RString, RVec};
use cache::Caches;
use pipeline::Pipeline;
use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU32, AtomicU64, Ordering},
};
use u_sdk::{
    CheckpointInfo, CheckpointRequest, Engine, EngineBox, EngineStats, ErrorKind, GenerateRequest,
    GenerateSummary, GeneratedImage, HostBox, ImageRequest, ImageSinkBox, ModelKind, PluginInfo,
    PluginInstance, Runner, RunnerBox, RunnerContext, TokenSinkBox, TokenizeRequest, UError,
};

/// The largest image a request may ask for unless the deployment says otherwise (2048 × 2048).
pub const DEFAULT_MAX_PIXELS: u64 = 2048 * 2048;

/// Requests that may wait for the running one unless the deployment says otherwise.
const DEFAULT_QUEUED: u32 = 16;

/// The `runner` entry object.
#[derive(Clone, Copy, Debug)]
pub struct ImageRunner {
    /// The largest image, in pixels, a request may ask for or start from.
    pub max_pixels: u64,
    /// Whether the engine keeps its caches (off: every request computes everything).
    pub caches: bool,
}

impl Default for ImageRunner {
    fn default() -> Self {
        Self {
            max_pixels: DEFAULT_MAX_PIXELS,
            caches: true,
        }
    }
}

impl ImageRunner {
    /// The engine for `context` (what [`Runner::start`] does, for Rust callers).
    pub fn serve(&self, context: RunnerContext) -> u_sdk::Result<ImageEngine> {
        let config = context.model.config().into_result()?;
        if config.kind != ModelKind::Denoiser {
            return Err(UError::invalid(format!(
                "runner-image serves diffusion pipelines; `{}` is a {:?} model",
                config.family, config.kind
            )));
        }
        let parts = context.pipeline.into_option().ok_or_else(|| {
            UError::invalid(
                "runner-image: the denoiser came without its pipeline (serve the diffusers \
                 folder holding `model_index.json`)",
            )
        })?;
        let pipeline = Pipeline::new(context.model, parts, context.tokenizer.into_option())?;
        let queued = match context.limits.max_queued {
            0 => DEFAULT_QUEUED,
            n => n,
        };
        Ok(ImageEngine(Arc::new(Inner {
            name: context.name.into(),
            aliases: context.aliases.iter().map(|a| a.to_string()).collect(),
            pipeline,
            caches: Mutex::new(Caches::new(self.caches)),
            turn: Mutex::new(()),
            max_pixels: self.max_pixels,
            max_queued: queued,
            waiting: AtomicU32::new(0),
            running: AtomicU32::new(0),
            requests: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            steps: AtomicU64::new(0),
        })))
    }
}

impl Runner for ImageRunner {
    fn start(&self, context: RunnerContext) -> RResult<EngineBox, UError> {
        self.serve(context).map(EngineBox::new).into()
    }
}

struct Inner {
    name: String,
    aliases: Vec<String>,
    pipeline: Pipeline,
    caches: Mutex<Caches>,
    /// Held by the running request.
    turn: Mutex<()>,
    max_pixels: u64,
    max_queued: u32,
    waiting: AtomicU32,
    running: AtomicU32,
    requests: AtomicU64,
    rejected: AtomicU64,
    steps: AtomicU64,
}

/// The engine of one pipeline.
#[derive(Clone)]
pub struct ImageEngine(Arc<Inner>);

impl ImageEngine {
    fn check_model(&self, model: &str) -> u_sdk::Result<()> {
        match model == self.0.name || u_sdk::serves(&self.0.aliases, model) {
            true => Ok(()),
            false => Err(UError::not_found(format!(
                "model `{model}` is not served (this engine serves `{}`)",
                self.0.name
            ))),
        }
    }

    fn not_this_task(&self, what: &str) -> UError {
        UError::unsupported(format!(
            "`{}` is an image generation pipeline: {what} needs another model",
            self.0.name
        ))
    }

    /// The pipeline it serves.
    pub fn pipeline(&self) -> &Pipeline {
        &self.0.pipeline
    }

    /// Runs `request`, with the draws of `given` in place of the seed's, `progress` told of
    /// each step (see [`sampler::generate`]); queued behind the running request.
    pub fn run(
        &self,
        request: &ImageRequest,
        given: Option<&sampler::GivenNoise>,
        progress: &mut dyn FnMut(u_sdk::ImageProgress) -> bool,
    ) -> u_sdk::Result<sampler::Outcome> {
        self.check_model(&request.model)?;
        let i = &self.0;
        i.requests.fetch_add(1, Ordering::Relaxed);
        if i.waiting.fetch_add(1, Ordering::AcqRel) >= i.max_queued {
            i.waiting.fetch_sub(1, Ordering::AcqRel);
            i.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(UError::new(
                ErrorKind::Busy,
                format!(
                    "runner-image: {} requests are waiting already; try again later",
                    i.max_queued
                ),
            ));
        }
        let turn = i.turn.lock().unwrap_or_else(|e| e.into_inner());
        i.waiting.fetch_sub(1, Ordering::AcqRel);
        i.running.fetch_add(1, Ordering::Relaxed);
        let mut counted = |p: u_sdk::ImageProgress| {
            if !p.cached {
                i.steps.fetch_add(1, Ordering::Relaxed);
            }
            progress(p)
        };
        let outcome = sampler::generate(
            &i.pipeline,
            &i.caches,
            request,
            given,
            i.max_pixels,
            &mut counted,
        );
        i.running.fetch_sub(1, Ordering::Relaxed);
        drop(turn);
        outcome
    }
}

impl Engine for ImageEngine {
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
            Ok(()) => RResult::RErr(self.not_this_task("text generation")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn stats(&self) -> RResult<EngineStats, UError> {
        let i = &self.0;
        RResult::ROk(EngineStats {
            requests: i.requests.load(Ordering::Relaxed),
            rejected: i.rejected.load(Ordering::Relaxed),
            running: i.running.load(Ordering::Relaxed),
            queued: i.waiting.load(Ordering::Relaxed),
            queue_capacity: i.max_queued,
            ..EngineStats::default()
        })
    }

    fn flush_cache(&self, model: RStr<'_>) -> RResult<u64, UError> {
        (|| {
            self.check_model(model.as_str())?;
            let caches = &self.0.caches;
            Ok(caches.lock().unwrap_or_else(|e| e.into_inner()).clear())
        })()
        .into()
    }

    fn checkpoint(&self, request: &CheckpointRequest) -> RResult<RVec<CheckpointInfo>, UError> {
        match self.check_model(&request.model) {
            Ok(()) => RResult::RErr(self.not_this_task("a KV checkpoint")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn embed(&self, model: RStr<'_>, _input: RStr<'_>) -> RResult<RVec<f32>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(self.not_this_task("an embedding")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn tokenize(&self, request: &TokenizeRequest) -> RResult<RVec<u32>, UError> {
        (|| {
            self.check_model(&request.model)?;
            Ok(self.0.pipeline.tokens(&request.prompt)?.into())
        })()
        .into()
    }

    fn detokenize(&self, model: RStr<'_>, _tokens: RSlice<'_, u32>) -> RResult<RVec<u8>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(self.not_this_task("detokenizing")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn embed_tokens(
        &self,
        model: RStr<'_>,
        _tokens: RSlice<'_, u32>,
    ) -> RResult<RVec<f32>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(self.not_this_task("an embedding")),
            Err(e) => RResult::RErr(e),
        }
    }

    fn embed_image(&self, model: RStr<'_>, _image: RSlice<'_, u8>) -> RResult<RVec<f32>, UError> {
        match self.check_model(model.as_str()) {
            Ok(()) => RResult::RErr(u_sdk::not_an_image_model(model.as_str())),
            Err(e) => RResult::RErr(e),
        }
    }

    fn generate_image(
        &self,
        request: &ImageRequest,
        mut sink: ImageSinkBox,
    ) -> RResult<GeneratedImage, UError> {
        (|| {
            let outcome = self.run(request, None, &mut |p| sink.step(&p))?;
            let size = (outcome.width, outcome.height);
            Ok(GeneratedImage {
                png: picture::png(&outcome.pixels, size)?.into(),
                width: outcome.width,
                height: outcome.height,
                seed: request.seed,
                steps: outcome.steps,
                cached_steps: outcome.cached_steps,
                approximate: outcome.approximate,
            })
        })()
        .into()
    }
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "image generation: latent diffusion pipelines, text to image and image to image"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the runner (the root module's `instantiate`) with its settings: `max_pixels`, and
/// `caches` (`false` turns every cache off, to measure what they save).
fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let mut runner = ImageRunner::default();
    for (key, value) in u_sdk::settings::table(&host, "runner-image")? {
        match (key.as_str(), value.as_integer(), value.as_bool()) {
            ("max_pixels", Some(n), _) if n > 0 => runner.max_pixels = n as u64,
            ("caches", _, Some(on)) => runner.caches = on,
            ("max_pixels" | "caches", ..) => {
                return Err(UError::invalid(format!(
                    "runner-image config: `{key}` must be {}",
                    if key == "caches" {
                        "true or false"
                    } else {
                        "a positive integer"
                    }
                )));
            }
            (other, ..) => {
                return Err(UError::invalid(format!(
                    "runner-image config: unknown key `{other}` (known: max_pixels, caches)"
                )));
            }
        }
    }
    Ok(PluginInstance::Runner(RunnerBox::new(runner)))
}

/// The exported root module and embedded manifest.
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}
