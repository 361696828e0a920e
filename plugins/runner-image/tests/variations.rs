//! The image runner against diffusers' `StableDiffusionImageVariationPipeline` on the tiny
//! pipeline of `tests/fixtures/diffusion_tiny/sd_variations/` at the workspace root (its
//! generator, `gen_diffusion_tiny.py`, beside it), wired as the host wires a diffusers folder
//! with an image encoder: the UNet as the model, the `CLIPVisionModelWithProjection` (built by
//! arch-vit) and the autoencoder as components, the configuration files as text, no tokenizer.
//!
//! - The image's embedding equals transformers' `image_embeds` within [`EMBEDDING_TOL`].
//! - A 4-step guided variation of `init.png` from diffusers' starting noise equals diffusers'
//!   image within [`TOL`].
//! - The caches are exact (on and off give the same PNG; a repeat comes from the trajectory).
//! - No image, or a prompt or conditioning values beside it, are clear errors.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_diffusion::{DiffusionArchitecture, UNET, VAE_DECODER};
use u_runner_image::pipeline::Condition;
use u_runner_image::sampler::GivenNoise;
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::abi_stable::std_types::ROption;
use u_sdk::{
    ErrorKind, ImageProgress, ImageRequest, PipelineComponent, PipelineConfig, PipelineParts,
    RunnerContext, ServingLimits, WeightSetBox,
};

/// Stated tolerance on the image's values in [0, 1] (f32 both sides, four guided passes).
const TOL: f32 = 1e-3;

/// Stated tolerance on the image embedding (f32 both sides).
const EMBEDDING_TOL: f32 = 1e-5;

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny/sd_variations")
}

fn expected() -> Value {
    let path = folder().join("../expected.json");
    let all: Value =
        serde_json::from_slice(&std::fs::read(path).expect("expected.json")).expect("JSON");
    all["sd_variations"].clone()
}

fn source() -> Vec<u8> {
    std::fs::read(folder().join("../init.png")).expect("init.png")
}

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

fn engine(caches: bool) -> ImageEngine {
    let diffusion = |component: &str, family: &str| {
        DiffusionArchitecture
            .load(weights(component), backend(), family)
            .expect("a diffusion network")
    };
    let components = vec![
        PipelineComponent {
            name: "image_encoder".into(),
            model: u_arch_vit::VitArchitecture
                .load(weights("image_encoder"), backend())
                .expect("the image encoder"),
        },
        PipelineComponent {
            name: "vae".into(),
            model: diffusion("vae", VAE_DECODER),
        },
    ];
    let configs = [
        ("model_index", "model_index.json"),
        ("scheduler", "scheduler/scheduler_config.json"),
        (
            "feature_extractor",
            "feature_extractor/preprocessor_config.json",
        ),
        ("unet", "unet/config.json"),
        ("image_encoder", "image_encoder/config.json"),
        ("vae", "vae/config.json"),
    ]
    .into_iter()
    .map(|(component, file)| PipelineConfig {
        component: component.into(),
        json: std::fs::read_to_string(folder().join(file))
            .expect("a config")
            .into(),
    })
    .collect::<Vec<_>>();
    let context = RunnerContext {
        name: "variations".into(),
        model: diffusion("unet", UNET),
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
            tokenizers: Vec::new().into(),
        }),
    };
    ImageRunner {
        caches,
        ..ImageRunner::default()
    }
    .serve(context)
    .expect("the pipeline is served")
}

fn flat(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().expect("number") as f32],
        other => panic!("not a number array: {other}"),
    }
}

/// A variation of `init.png` as the fixture's run asks for it.
fn request(e: &Value) -> ImageRequest {
    ImageRequest {
        model: "variations".into(),
        prompt: "".into(),
        negative_prompt: "".into(),
        width: 0,
        height: 0,
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        seed: 7,
        init_image: source().into(),
        strength: 0.8,
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
fn a_variation_equals_the_image_variation_pipeline() {
    let e = expected();
    let engine = engine(true);
    let pipeline = engine.pipeline().expect("a pipeline");
    assert!(pipeline.varies_images());
    let (cond, uncond) = pipeline
        .encode_condition_image(&source(), 1 << 20)
        .expect("the embedding");
    let (Condition::Text(cond), Condition::Text(uncond)) = (cond, uncond) else {
        panic!("a variation is conditioned on rows");
    };
    let d = max_diff(&cond.rows, &flat(&e["embedding"]));
    eprintln!("image embedding: max |Δ| {d:.2e}");
    assert!(d < EMBEDDING_TOL, "embedding off by {d}");
    assert_eq!(
        uncond.rows,
        vec![0.0; cond.rows.len()],
        "the unguided pass reads zeros"
    );
    assert!(cond.pooled.is_empty() && uncond.pooled.is_empty());

    let given = GivenNoise([(0, flat(&e["latents"]))].into());
    let mut seen = Vec::new();
    let outcome = engine
        .run(&request(&e), Some(&given), &mut |p| {
            seen.push((p.step, p.cached));
            true
        })
        .expect("a variation");
    assert_eq!((outcome.width, outcome.height), (32, 32));
    assert_eq!(seen, [(1, false), (2, false), (3, false), (4, false)]);
    let d = image_error(&outcome.pixels, &flat(&e["image"]));
    eprintln!("4-step image variation, guidance 3: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");
}

/// A sink that lets every step run.
struct EveryStep;

impl u_sdk::ImageSink for EveryStep {
    fn step(&mut self, _: &ImageProgress) -> bool {
        true
    }
}

#[test]
fn the_caches_are_exact_for_variations() {
    let e = expected();
    let generate = |engine: &ImageEngine, req: &ImageRequest| {
        u_sdk::EngineBox::new(engine.clone())
            .generate_image(req, u_sdk::ImageSinkBox::new(EveryStep))
            .into_result()
            .expect("an image")
    };
    let req = request(&e);
    let plain = generate(&engine(false), &req);
    let cached = engine(true);
    let first = generate(&cached, &req);
    assert_eq!(
        first.png, plain.png,
        "caches on and off give the same bytes"
    );
    let again = generate(&cached, &req);
    assert_eq!((again.png == plain.png, again.cached_steps), (true, 4));
}

#[test]
fn bad_variation_requests_are_clear_errors() {
    let e = expected();
    let engine = engine(true);
    let fails = |req: ImageRequest, says: &str| {
        let err = engine
            .run(&req, None, &mut |_| true)
            .err()
            .expect("an error");
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
        assert!(err.message.contains(says), "{err} should say {says:?}");
    };
    fails(
        ImageRequest {
            init_image: Vec::new().into(),
            ..request(&e)
        },
        "needs the image to vary",
    );
    fails(
        ImageRequest {
            prompt: "a cat".into(),
            ..request(&e)
        },
        "reads only the image",
    );
    fails(
        ImageRequest {
            conditioning: vec![1.0].into(),
            ..request(&e)
        },
        "reads only the image",
    );
    fails(
        ImageRequest {
            init_image: b"not an image".to_vec().into(),
            ..request(&e)
        },
        "initial image",
    );
}
