//! # u-runner-image — the image generation runner plugin
//!
//! A `runner` plugin for the **image-generation** task. The host hands it a latent diffusion
//! pipeline built from a diffusers folder (its components' own weights, a single-file
//! checkpoint beside its configuration, or its ONNX export): the denoiser (a
//! [`u_sdk::ModelKind::Denoiser`]: Stable Diffusion's `UNet2DConditionModel`, a
//! class-conditioned `DiTTransformer2DModel`, an MMDiT, built by arch-diffusion; an exported
//! UNet graph, run by arch-onnx) as the model, and as [`u_sdk::PipelineParts`] the text encoder
//! and tokenizer (a class-conditioned pipeline has none), the autoencoder's decoder (and
//! encoder, for image to image) and the configuration files — or a denoiser alone, a
//! pixel-space consistency model (such as the terrain UNet arch-onnx runs), sampled in one
//! step. It serves [`Engine::generate_image`]:
//!
//! - [`pipeline`]: the models and what the loop asks of them (prompt rows or a class label, a
//!   guided prediction, decoding, encoding an initial image);
//! - [`sampler`]: one request's loop over the scheduler's steps (`u-diffusion`), text to image
//!   or image to image, seeded and cancellable;
//! - [`cache`]: the exact caches (prompt rows; trajectories, so a cancelled request resumes);
//! - [`consistency`]: a consistency model's one step, text-free, and its image variations;
//! - [`picture`]: initial images in, PNG files out.
//!
//! Requests run one at a time on the caller's thread (each pass already uses every core); the
//! others wait their turn, up to `max_queued`. Settings (`[plugins.config]`): `max_pixels`, the
//! largest image a request may ask for or start from (default 2048 × 2048), `caches`
//! (default `true`; `false` computes everything every time, to measure what they save), and
//! a consistency model's noise range `sigma_min` and `sigma_max` (EDM's 0.002 and 80).
#![deny(missing_docs)]

pub mod cache;
pub mod consistency;
pub mod picture;
pub mod pipeline;
pub mod sampler;
pub mod text;

use abi_stable::std_types::{RResult, RSlice, RStr, RString, RVec};
use cache::Caches;
use consistency::ConsistencyModel;
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
    /// A consistency model's σ of a clean image.
    pub sigma_min: f32,
    /// A consistency model's σ of pure noise.
    pub sigma_max: f32,
}

impl Default for ImageRunner {
    fn default() -> Self {
        Self {
            max_pixels: DEFAULT_MAX_PIXELS,
            caches: true,
            sigma_min: consistency::SIGMA_MIN,
            sigma_max: consistency::SIGMA_MAX,
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
        let served = match context.pipeline.into_option() {
            Some(parts) => Served::Pipeline(Box::new(Pipeline::new(
                context.model,
                parts,
                context.tokenizer.into_option(),
            )?)),
            None => Served::Consistency(ConsistencyModel::new(
                context.model,
                self.sigma_min,
                self.sigma_max,
            )?),
        };
        let queued = match context.limits.max_queued {
            0 => DEFAULT_QUEUED,
            n => n,
        };
        Ok(ImageEngine(Arc::new(Inner {
            name: context.name.into(),
            aliases: context.aliases.iter().map(|a| a.to_string()).collect(),
            served,
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

/// What an engine serves.
pub enum Served {
    /// A latent diffusion pipeline (a diffusers folder).
    Pipeline(Box<Pipeline>),
    /// A pixel-space consistency model alone (one step, no text).
    Consistency(ConsistencyModel),
}

struct Inner {
    name: String,
    aliases: Vec<String>,
    served: Served,
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

    /// What it serves.
    pub fn served(&self) -> &Served {
        &self.0.served
    }

    /// The pipeline it serves, or why it serves none.
    pub fn pipeline(&self) -> u_sdk::Result<&Pipeline> {
        match &self.0.served {
            Served::Pipeline(p) => Ok(p),
            Served::Consistency(_) => Err(self.not_this_task("a text encoder's tokens")),
        }
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
        let outcome = match &i.served {
            Served::Pipeline(pipeline) => sampler::generate(
                pipeline,
                &i.caches,
                request,
                given,
                i.max_pixels,
                &mut counted,
            ),
            Served::Consistency(model) => {
                model.generate(request, given, i.max_pixels, &mut counted)
            }
        };
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
            Ok(self.pipeline()?.tokens(&request.prompt)?.into())
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
                png: picture::png(&outcome.pixels, outcome.channels, size)?.into(),
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
        summary: "image generation: latent diffusion pipelines (text or class conditioned), text \
                  to image and image to image; one-step consistency models"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the runner (the root module's `instantiate`) with its settings: `max_pixels`,
/// `caches` (`false` turns every cache off, to measure what they save), and a consistency
/// model's `sigma_min` and `sigma_max`.
fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    let mut runner = ImageRunner::default();
    for (key, value) in u_sdk::settings::table(&host, "runner-image")? {
        let number = value.as_float().or(value.as_integer().map(|n| n as f64));
        match (key.as_str(), value.as_integer(), value.as_bool(), number) {
            ("max_pixels", Some(n), ..) if n > 0 => runner.max_pixels = n as u64,
            ("caches", _, Some(on), _) => runner.caches = on,
            ("sigma_min", .., Some(v)) if v > 0.0 => runner.sigma_min = v as f32,
            ("sigma_max", .., Some(v)) if v > 0.0 && v.is_finite() => runner.sigma_max = v as f32,
            ("max_pixels" | "caches" | "sigma_min" | "sigma_max", ..) => {
                return Err(UError::invalid(format!(
                    "runner-image config: `{key}` must be {}",
                    match key.as_str() {
                        "caches" => "true or false",
                        "max_pixels" => "a positive integer",
                        _ => "a positive number",
                    }
                )));
            }
            (other, ..) => {
                return Err(UError::invalid(format!(
                    "runner-image config: unknown key `{other}` (known: max_pixels, caches, \
                     sigma_min, sigma_max)"
                )));
            }
        }
    }
    if runner.sigma_min >= runner.sigma_max {
        return Err(UError::invalid(format!(
            "runner-image config: sigma_min {} must be below sigma_max {}",
            runner.sigma_min, runner.sigma_max
        )));
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
