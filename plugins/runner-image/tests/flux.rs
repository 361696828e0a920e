//! The image runner against diffusers' `FluxPipeline` on the tiny pipeline of
//! `tests/fixtures/diffusion_tiny/flux_pipeline/` at the workspace root (its generator,
//! `gen_diffusion_tiny.py`, beside it): a FLUX transformer with its guidance embedding, a CLIP
//! text encoder (its pooled row), a T5 encoder (arch-t5; its 512 rows), their tokenizers, the
//! autoencoder with FLUX's scale and shift, and the dynamically shifted flow-matching
//! scheduler over `linspace(1, 1/steps, steps)` — wired as the host wires the folder.
//!
//! - A prompt's rows and pooled text equal `encode_prompt`'s within [`ROWS_TOL`].
//! - A 4-step run (guidance 3.5, embedded) from diffusers' starting noise equals diffusers'
//!   image within [`TOL`].
//! - The caches are exact (on and off give the same PNG; a repeat comes from the trajectory).
//! - A negative prompt is a clear error (the guidance is distilled).

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_diffusion::{DiffusionArchitecture, FLUX, VAE_DECODER};
use u_runner_image::pipeline::FLUX_T5_POSITIONS;
use u_runner_image::sampler::GivenNoise;
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::abi_stable::std_types::ROption;
use u_sdk::{
    ImageRequest, PipelineComponent, PipelineConfig, PipelineParts, PipelineTokenizer,
    RunnerContext, ServingLimits, WeightSetBox,
};

/// Stated tolerance on the image's values in [0, 1] (f32 both sides, four guided passes).
const TOL: f32 = 1e-3;

/// Stated tolerance on the prompt's rows and pooled text (f32 both sides; T5's unscaled
/// attention over 512 positions, rows up to 2.2 in size).
const ROWS_TOL: f32 = 1e-4;

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny/flux_pipeline")
}

fn expected() -> Value {
    let path = folder().join("../expected.json");
    let all: Value =
        serde_json::from_slice(&std::fs::read(path).expect("expected.json")).expect("JSON");
    all["flux_pipeline"].clone()
}

/// The CLIP and the T5.
const ALL: &[&str] = &["text_encoder", "text_encoder_2"];

fn weights(component: &str) -> WeightSetBox {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &folder().join(component),
    )
    .expect("the component's weights");
    u_loader_safetensors::SafetensorsWeights::new(m).into_box()
}

fn backend() -> u_sdk::BackendBox {
    u_kernels_cpu::CpuKernels::new(2)
        .expect("kernels")
        .into_box()
}

fn tokenizer(name: &str) -> PipelineTokenizer {
    let dir = folder().join(name);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).expect("a tokenizer file");
    let tokenizer = u_tokenizer::Tok::from_json(
        &read("tokenizer.json"),
        Some(&read("tokenizer_config.json")),
    )
    .expect("the tokenizer")
    .into_box();
    PipelineTokenizer {
        name: name.into(),
        tokenizer,
    }
}

/// The pipeline's context as the host builds it, with the components named in `encoders`.
fn context(encoders: &[&str]) -> RunnerContext {
    let encoder = |component: &str| PipelineComponent {
        name: component.into(),
        model: match component {
            "text_encoder_2" => u_arch_t5::T5Architecture.load(weights(component), backend()),
            _ => u_arch_clip::ClipArchitecture.load(weights(component), backend()),
        }
        .expect("a text encoder"),
    };
    let mut components: Vec<PipelineComponent> = encoders.iter().map(|e| encoder(e)).collect();
    components.push(PipelineComponent {
        name: "vae".into(),
        model: DiffusionArchitecture
            .load(weights("vae"), backend(), VAE_DECODER)
            .expect("the decoder"),
    });
    let configs = [
        ("model_index", "model_index.json"),
        ("scheduler", "scheduler/scheduler_config.json"),
        ("transformer", "transformer/config.json"),
        ("vae", "vae/config.json"),
        ("text_encoder", "text_encoder/config.json"),
        ("text_encoder_2", "text_encoder_2/config.json"),
    ]
    .into_iter()
    .map(|(component, file)| PipelineConfig {
        component: component.into(),
        json: std::fs::read_to_string(folder().join(file))
            .expect("a config")
            .into(),
    })
    .collect::<Vec<_>>();
    RunnerContext {
        name: "flux".into(),
        model: DiffusionArchitecture
            .load(weights("transformer"), backend(), FLUX)
            .expect("the transformer"),
        tokenizer: ROption::RNone,
        limits: ServingLimits::default(),
        aliases: Vec::new().into(),
        extras: Vec::new().into(),
        adapter_opener: ROption::RNone,
        image_encoder: ROption::RNone,
        draft_model: ROption::RNone,
        pipeline: ROption::RSome(PipelineParts {
            components: components.into(),
            configs: configs.into(),
            tokenizers: ["tokenizer", "tokenizer_2"]
                .map(tokenizer)
                .into_iter()
                .collect::<Vec<_>>()
                .into(),
        }),
    }
}

fn engine(caches: bool, encoders: &[&str]) -> ImageEngine {
    ImageRunner {
        caches,
        ..ImageRunner::default()
    }
    .serve(context(encoders))
    .expect("the pipeline is served")
}

fn flat(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().expect("number") as f32],
        other => panic!("not a number array: {other}"),
    }
}

fn request(e: &Value) -> ImageRequest {
    ImageRequest {
        model: "flux".into(),
        prompt: e["prompt"].as_str().expect("prompt").into(),
        negative_prompt: "".into(),
        width: e["width"].as_u64().expect("width") as u32,
        height: e["height"].as_u64().expect("height") as u32,
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        seed: 7,
        init_image: Vec::new().into(),
        strength: 0.0,
        handoff_prompt: "".into(),
        handoff_step: 0,
        conditioning: Vec::new().into(),
        client: "".into(),
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// The largest difference of our `[3][H][W]` pixels from diffusers' `[H][W][3]` ones.
fn image_error(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    let plane = ours.len() / 3;
    (0..plane * 3)
        .map(|i| (ours[(i % 3) * plane + i / 3] - theirs[i]).abs())
        .fold(0f32, f32::max)
}

#[test]
fn a_prompt_embeds_as_flux_encodes_it() {
    let e = expected();
    let engine = engine(true, ALL);
    let embedded = engine
        .pipeline()
        .expect("a pipeline")
        .encode_prompt(e["prompt"].as_str().unwrap())
        .expect("the prompt's rows");
    assert_eq!(embedded.rows.len(), FLUX_T5_POSITIONS * 12);
    let d = max_diff(&embedded.rows, &flat(&e["rows"]));
    let p = max_diff(&embedded.pooled, &flat(&e["pooled"]));
    eprintln!("FLUX prompt: T5 rows max |Δ| {d:.2e}, pooled {p:.2e}");
    assert!(
        d < ROWS_TOL && p < ROWS_TOL,
        "rows off by {d}, pooled by {p}"
    );
}

#[test]
fn text_to_image_equals_flux_pipeline() {
    let e = expected();
    let engine = engine(true, ALL);
    let given = GivenNoise([(0, flat(&e["latents"]))].into());
    let mut seen = Vec::new();
    let outcome = engine
        .run(&request(&e), Some(&given), &mut |p| {
            seen.push((p.step, p.cached));
            true
        })
        .expect("an image");
    assert_eq!((outcome.width, outcome.height), (16, 16));
    assert_eq!(seen, [(1, false), (2, false), (3, false), (4, false)]);
    let d = image_error(&outcome.pixels, &flat(&e["image"]));
    eprintln!("4-step FLUX, guidance 3.5: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");
}

#[test]
fn a_negative_prompt_is_refused() {
    let e = expected();
    let req = ImageRequest {
        negative_prompt: "blue sky".into(),
        ..request(&e)
    };
    let err = engine(true, ALL)
        .run(&req, None, &mut |_| true)
        .err()
        .expect("refused");
    assert!(err.message.contains("no negative prompt"), "{err}");
}

/// A sink that lets every step run.
struct EveryStep;

impl u_sdk::ImageSink for EveryStep {
    fn step(&mut self, _: &u_sdk::ImageProgress) -> bool {
        true
    }
}

#[test]
fn the_caches_are_exact_for_flux() {
    let e = expected();
    let generate = |engine: &ImageEngine, req: &ImageRequest| {
        u_sdk::EngineBox::new(engine.clone())
            .generate_image(req, u_sdk::ImageSinkBox::new(EveryStep))
            .into_result()
            .expect("an image")
    };
    let req = request(&e);
    let plain = generate(&engine(false, ALL), &req);
    let cached = engine(true, ALL);
    let first = generate(&cached, &req);
    assert_eq!(
        first.png, plain.png,
        "caches on and off give the same bytes"
    );
    let again = generate(&cached, &req);
    assert_eq!((again.png == plain.png, again.cached_steps), (true, 4));
    // Another guidance scale is another trajectory.
    let other = generate(
        &cached,
        &ImageRequest {
            guidance_scale: 2.0,
            ..req
        },
    );
    assert_eq!(other.cached_steps, 0);
    assert_ne!(other.png, plain.png);
}
