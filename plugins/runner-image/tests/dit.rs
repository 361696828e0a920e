//! The image runner against diffusers' `DiTPipeline` on the tiny class-conditioned pipeline
//! of `tests/fixtures/diffusion_tiny/dit_pipeline/` at the workspace root (its generator,
//! `gen_diffusion_tiny.py`, beside it), wired as the host wires a diffusers folder without a
//! text encoder: the `DiTTransformer2DModel` as the model, the autoencoder as components, the
//! configuration files (with `model_index.json`) as text, no tokenizer.
//!
//! - A 4-step guided run of class 3 from diffusers' starting noise equals diffusers' image
//!   within [`TOL`]; the label's names in `id2label` ask for the same class.
//! - The caches are exact (on and off give the same PNG; a repeat comes from the trajectory).
//! - Bad requests (no class, a class out of range or fractional, an unknown name, a class
//!   given twice, a negative prompt, tokens) are clear errors.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_diffusion::{DIT, DiffusionArchitecture, VAE_DECODER, VAE_ENCODER};
use u_runner_image::sampler::GivenNoise;
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::abi_stable::std_types::ROption;
use u_sdk::{
    ErrorKind, ImageProgress, ImageRequest, ModelBox, PipelineComponent, PipelineConfig,
    PipelineParts, RunnerContext, ServingLimits, TokenizeRequest,
};

/// Stated tolerance on the image's values in [0, 1] (f32 both sides, four guided passes).
const TOL: f32 = 1e-3;

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny/dit_pipeline")
}

fn expected() -> Value {
    let path = folder().join("../expected.json");
    let all: Value =
        serde_json::from_slice(&std::fs::read(path).expect("expected.json")).expect("JSON");
    all["dit_pipeline"].clone()
}

fn diffusion(component: &str, family: &str) -> ModelBox {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &folder().join(component),
    )
    .expect("the component's weights");
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)
        .expect("kernels")
        .into_box();
    DiffusionArchitecture
        .load(weights, backend, family)
        .expect("a diffusion network")
}

fn engine(caches: bool) -> ImageEngine {
    let components = vec![
        PipelineComponent {
            name: "vae".into(),
            model: diffusion("vae", VAE_DECODER),
        },
        PipelineComponent {
            name: "vae.encoder".into(),
            model: diffusion("vae", VAE_ENCODER),
        },
    ];
    let configs = [
        ("model_index", "model_index.json"),
        ("scheduler", "scheduler/scheduler_config.json"),
        ("transformer", "transformer/config.json"),
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
        name: "dit".into(),
        model: diffusion("transformer", DIT),
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

/// Class `label` as the fixture's run asks for it.
fn request(e: &Value, conditioning: &[f32], prompt: &str) -> ImageRequest {
    ImageRequest {
        model: "dit".into(),
        prompt: prompt.into(),
        negative_prompt: "".into(),
        width: 0,
        height: 0,
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        seed: 7,
        init_image: Vec::new().into(),
        strength: 0.0,
        handoff_prompt: "".into(),
        handoff_step: 0,
        conditioning: conditioning.to_vec().into(),
        client: "".into(),
    }
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
fn a_class_equals_dit_pipeline() {
    let e = expected();
    let label = e["label"].as_f64().expect("label") as f32;
    let engine = engine(true);
    let given = GivenNoise([(0, flat(&e["latents"]))].into());
    let want = flat(&e["image"]);
    let mut seen = Vec::new();
    let outcome = engine
        .run(&request(&e, &[label], ""), Some(&given), &mut |p| {
            seen.push((p.step, p.cached));
            true
        })
        .expect("an image");
    assert_eq!((outcome.width, outcome.height), (16, 16));
    assert_eq!(seen, [(1, false), (2, false), (3, false), (4, false)]);
    let d = image_error(&outcome.pixels, &want);
    eprintln!("4-step DiT, class {label}, guidance 4: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");

    // Each name `id2label` gives class 3 asks for the same image; another class differs.
    for name in ["tiger shark", "Galeocerdo cuvieri"] {
        let named = engine
            .run(&request(&e, &[], name), Some(&given), &mut |_| true)
            .expect("a named class");
        assert_eq!(named.pixels, outcome.pixels, "{name:?}");
    }
    let other = engine
        .run(&request(&e, &[], "cock"), Some(&given), &mut |_| true)
        .expect("class 7");
    assert!(
        image_error(&other.pixels, &want) > TOL,
        "class 7 is another image"
    );
}

/// A sink that lets every step run.
struct EveryStep;

impl u_sdk::ImageSink for EveryStep {
    fn step(&mut self, _: &ImageProgress) -> bool {
        true
    }
}

#[test]
fn the_caches_are_exact_for_classes() {
    let e = expected();
    let boxed = |engine: &ImageEngine| u_sdk::EngineBox::new(engine.clone());
    let generate = |engine: &ImageEngine, req: &ImageRequest| {
        boxed(engine)
            .generate_image(req, u_sdk::ImageSinkBox::new(EveryStep))
            .into_result()
            .expect("an image")
    };
    let req = request(&e, &[3.0], "");
    let plain = generate(&engine(false), &req);
    let cached = engine(true);
    let first = generate(&cached, &req);
    assert_eq!(
        first.png, plain.png,
        "caches on and off give the same bytes"
    );
    let again = generate(&cached, &req);
    assert_eq!((again.png == plain.png, again.cached_steps), (true, 4));
    // Another class is another trajectory, not the cached one.
    let other = generate(&cached, &request(&e, &[7.0], ""));
    assert_eq!(other.cached_steps, 0);
    assert_ne!(other.png, plain.png);
}

#[test]
fn bad_class_requests_are_clear_errors() {
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
    fails(request(&e, &[], ""), "needs a class");
    fails(request(&e, &[1000.0], ""), "one class label in 0..1000");
    fails(request(&e, &[2.5], ""), "one class label in 0..1000");
    fails(request(&e, &[3.0, 4.0], ""), "one class label in 0..1000");
    fails(request(&e, &[], "great white shark"), "no class is named");
    fails(request(&e, &[3.0], "cock"), "not both");
    fails(
        ImageRequest {
            negative_prompt: "cock".into(),
            ..request(&e, &[3.0], "")
        },
        "no negative prompt",
    );
    let tokens = u_sdk::EngineBox::new(engine.clone())
        .tokenize(&TokenizeRequest {
            model: "dit".into(),
            prompt: "tiger shark".into(),
            messages: Vec::new().into(),
            continue_final: false,
            add_special: true,
        })
        .into_result()
        .expect_err("no tokenizer");
    assert_eq!(tokens.kind, ErrorKind::Unsupported, "{tokens}");
}
