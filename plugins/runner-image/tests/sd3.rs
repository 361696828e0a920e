//! The image runner against diffusers' `StableDiffusion3Pipeline` on the tiny pipeline of
//! `tests/fixtures/diffusion_tiny/sd3_pipeline/` at the workspace root (its generator,
//! `gen_diffusion_tiny.py`, beside it): an MMDiT transformer, two CLIP text encoders with
//! their projections and tokenizers, a T5 encoder (arch-t5) with its unigram tokenizer, the
//! autoencoder with SD3's scale and shift, and the flow-matching scheduler — wired as the host
//! wires the folder; and the same without its T5, as diffusers allows (`text_encoder_3=None`).
//!
//! - A prompt's rows (CLIP-L's and CLIP-G's penultimate states side by side, then T5's rows,
//!   zeros without it) and pooled text (both projections) equal `encode_prompt`'s within
//!   [`ROWS_TOL`].
//! - A 4-step guided run from diffusers' starting noise equals diffusers' image within [`TOL`],
//!   with and without the T5.
//! - The caches are exact (on and off give the same PNG; a repeat comes from the trajectory).
//! - A folder without its second CLIP is a clear error.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_diffusion::{DiffusionArchitecture, SD3, VAE_DECODER};
use u_runner_image::pipeline::SD3_T5_POSITIONS;
use u_runner_image::sampler::GivenNoise;
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::abi_stable::std_types::ROption;
use u_sdk::{
    ImageProgress, ImageRequest, PipelineComponent, PipelineConfig, PipelineParts,
    PipelineTokenizer, RunnerContext, ServingLimits, WeightSetBox,
};

/// Stated tolerance on the image's values in [0, 1] (f32 both sides, four guided passes).
const TOL: f32 = 1e-3;

/// Stated tolerance on the prompt's rows and pooled text (f32 both sides).
const ROWS_TOL: f32 = 1e-5;

fn folder() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny/sd3_pipeline")
}

/// What diffusers made with the T5 (`with_t5`) or without.
fn expected(with_t5: bool) -> Value {
    let path = folder().join("../expected.json");
    let all: Value =
        serde_json::from_slice(&std::fs::read(path).expect("expected.json")).expect("JSON");
    match with_t5 {
        true => all["sd3_pipeline"].clone(),
        false => all["sd3_pipeline_without_t5"].clone(),
    }
}

/// Both CLIPs and the T5.
const ALL: &[&str] = &["text_encoder", "text_encoder_2", "text_encoder_3"];

/// Both CLIPs alone.
const CLIPS: &[&str] = &["text_encoder", "text_encoder_2"];

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
            "text_encoder_3" => u_arch_t5::T5Architecture.load(weights(component), backend()),
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
        name: "sd3".into(),
        model: DiffusionArchitecture
            .load(weights("transformer"), backend(), SD3)
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
            tokenizers: ["tokenizer", "tokenizer_2", "tokenizer_3"]
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
        model: "sd3".into(),
        prompt: e["prompt"].as_str().expect("prompt").into(),
        negative_prompt: e["negative_prompt"].as_str().expect("negative").into(),
        width: 0,
        height: 0,
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
fn a_prompt_embeds_as_stable_diffusion_3_encodes_it() {
    for (with_t5, encoders) in [(true, ALL), (false, CLIPS)] {
        let e = expected(with_t5);
        let engine = engine(true, encoders);
        let embedded = engine
            .pipeline()
            .expect("a pipeline")
            .encode_prompt(e["prompt"].as_str().unwrap())
            .expect("the prompt's rows");
        let clip_rows = 77 * 12;
        assert_eq!(embedded.rows.len(), (77 + SD3_T5_POSITIONS) * 12);
        let want = flat(&e["rows"]);
        let d = max_diff(&embedded.rows[..clip_rows], &want[..clip_rows]);
        let t = max_diff(&embedded.rows[clip_rows..], &want[clip_rows..]);
        let p = max_diff(&embedded.pooled, &flat(&e["pooled"]));
        eprintln!(
            "SD3 prompt (T5: {with_t5}): CLIP rows max |Δ| {d:.2e}, T5 rows {t:.2e}, pooled \
             {p:.2e}"
        );
        assert!(
            d < ROWS_TOL && t < ROWS_TOL && p < ROWS_TOL,
            "rows off by {d}, T5 rows by {t}, pooled by {p}"
        );
        let zeros = embedded.rows[clip_rows..].iter().all(|v| *v == 0.0);
        assert_eq!(zeros, !with_t5, "without a T5 its rows are zeros");
    }
}

#[test]
fn text_to_image_equals_stable_diffusion_3_pipeline() {
    for (with_t5, encoders) in [(true, ALL), (false, CLIPS)] {
        let e = expected(with_t5);
        let engine = engine(true, encoders);
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
        eprintln!("4-step SD3 (T5: {with_t5}), guidance 5: max |Δ| {d:.2e} on values in [0, 1]");
        assert!(d < TOL, "image off by {d}");
    }
}

/// A sink that lets every step run.
struct EveryStep;

impl u_sdk::ImageSink for EveryStep {
    fn step(&mut self, _: &ImageProgress) -> bool {
        true
    }
}

#[test]
fn the_caches_are_exact_for_stable_diffusion_3() {
    let e = expected(true);
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
}

#[test]
fn a_pipeline_without_its_second_clip_is_refused() {
    let err = ImageRunner::default()
        .serve(context(&["text_encoder"]))
        .err()
        .expect("refused");
    assert!(err.message.contains("text_encoder_2"), "{err}");
}
