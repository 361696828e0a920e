//! What the image runner's tests against diffusers share: the tiny pipelines of
//! `tests/fixtures/diffusion_tiny/` at the workspace root (made by `gen_diffusion_tiny.py`
//! beside them) wired as the host wires a diffusers folder, what diffusers computed with them,
//! and the comparisons. Each test binary uses part of it.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::abi_stable::std_types::ROption;
use u_sdk::{
    ErrorKind, GeneratedImage, ImageProgress, ImageRequest, ModelBox, PipelineComponent,
    PipelineConfig, PipelineParts, PipelineTokenizer, RunnerContext, ServingLimits, TokenizerBox,
    WeightSetBox,
};

/// Stated tolerance on an image's values in [0, 1] (f32 both sides, four passes or pairs).
pub const TOL: f32 = 1e-3;

/// The tiny pipeline folder `name` (`sd`, `dit_pipeline`, `sd3_pipeline`…).
pub fn folder(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/diffusion_tiny")
        .join(name)
}

/// Everything diffusers computed (`expected.json`).
pub fn all_expected() -> Value {
    let path = folder("expected.json");
    serde_json::from_slice(&std::fs::read(path).expect("expected.json")).expect("JSON")
}

/// What diffusers computed, under `key` of `expected.json`.
pub fn expected(key: &str) -> Value {
    all_expected()[key].clone()
}

/// What onnxruntime computed with the ONNX pipeline `sd_onnx/` (`onnx_expected.json`).
pub fn expected_onnx() -> Value {
    let path = folder("onnx_expected.json");
    serde_json::from_slice(&std::fs::read(path).expect("onnx_expected.json")).expect("JSON")
}

/// The tensors of `component` in pipeline `pipeline`.
pub fn weights(pipeline: &str, component: &str) -> WeightSetBox {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &folder(pipeline).join(component),
    )
    .expect("the component's weights");
    u_loader_safetensors::SafetensorsWeights::new(m).into_box()
}

/// The CPU kernels on two threads.
pub fn backend() -> u_sdk::BackendBox {
    u_kernels_cpu::CpuKernels::new(2)
        .expect("kernels")
        .into_box()
}

/// `component` of `pipeline` built by arch-diffusion as `family`.
pub fn diffusion(pipeline: &str, component: &str, family: &str) -> ModelBox {
    u_arch_diffusion::DiffusionArchitecture
        .load(weights(pipeline, component), backend(), family)
        .expect("a diffusion network")
}

/// `component` of `pipeline` as a pipeline component: a text encoder (arch-clip, or arch-t5
/// for a T5), an image encoder (arch-vit), or the autoencoder's decoder or encoder
/// (`vae`, `vae.encoder`; arch-diffusion).
pub fn component(pipeline: &str, component: &str) -> PipelineComponent {
    let config = std::fs::read_to_string(folder(pipeline).join(component).join("config.json"));
    let is_t5 = config.is_ok_and(|c| c.contains("\"model_type\": \"t5\""));
    let model = match component {
        "vae" => diffusion(pipeline, "vae", u_arch_diffusion::VAE_DECODER),
        "vae.encoder" => diffusion(pipeline, "vae", u_arch_diffusion::VAE_ENCODER),
        "image_encoder" => u_arch_vit::VitArchitecture
            .load(weights(pipeline, component), backend())
            .expect("the image encoder"),
        _ if is_t5 => u_arch_t5::T5Architecture
            .load(weights(pipeline, component), backend())
            .expect("a T5 encoder"),
        _ => u_arch_clip::ClipArchitecture
            .load(weights(pipeline, component), backend())
            .expect("a CLIP text encoder"),
    };
    PipelineComponent {
        name: component.into(),
        model,
    }
}

/// The tokenizer `name` (its folder) of `pipeline`.
pub fn tokenizer(pipeline: &str, name: &str) -> TokenizerBox {
    let dir = folder(pipeline).join(name);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).expect("a tokenizer file");
    u_tokenizer::Tok::from_json(
        &read("tokenizer.json"),
        Some(&read("tokenizer_config.json")),
    )
    .expect("the tokenizer")
    .into_box()
}

/// The configuration files of `pipeline` the host hands over, for the components present:
/// `model_index.json`, the scheduler's, the `feature_extractor`'s, and each `config.json`.
pub fn configs(pipeline: &str, components: &[&str]) -> Vec<PipelineConfig> {
    let dir = folder(pipeline);
    let mut files = vec![
        ("model_index".to_string(), dir.join("model_index.json")),
        (
            "scheduler".to_string(),
            dir.join("scheduler/scheduler_config.json"),
        ),
    ];
    for c in components {
        let file = match *c {
            "feature_extractor" => "preprocessor_config.json",
            _ => "config.json",
        };
        files.push((c.to_string(), dir.join(c).join(file)));
    }
    files
        .into_iter()
        .map(|(component, path)| PipelineConfig {
            component: component.into(),
            json: std::fs::read_to_string(path).expect("a config").into(),
        })
        .collect()
}

/// The pipeline `pipeline` as the host wires it: `denoiser` (the folder holding it, and its
/// family) as the model, `components` built, `configs` of those and of `extra` (the denoiser's
/// own folder, a `feature_extractor`), the `tokenizers` named.
pub fn context(
    pipeline: &str,
    (denoiser, family): (&str, &str),
    components: &[&str],
    extra: &[&str],
    tokenizers: &[&str],
) -> RunnerContext {
    let with_configs: Vec<&str> = components
        .iter()
        .filter(|c| **c != "vae.encoder")
        .chain(extra)
        .chain([&denoiser])
        .copied()
        .collect();
    runner_context(
        pipeline,
        diffusion(pipeline, denoiser, family),
        Some(PipelineParts {
            components: components
                .iter()
                .map(|c| component(pipeline, c))
                .collect::<Vec<_>>()
                .into(),
            configs: configs(pipeline, &with_configs).into(),
            tokenizers: tokenizers
                .iter()
                .map(|t| PipelineTokenizer {
                    name: (*t).into(),
                    tokenizer: tokenizer(pipeline, t),
                })
                .collect::<Vec<_>>()
                .into(),
        }),
    )
}

/// What the host hands the image runner for `model` served as `name`, with the `pipeline`'s
/// other parts when it has them (nothing else: no tokenizer of its own, default limits).
pub fn runner_context(
    name: &str,
    model: ModelBox,
    pipeline: Option<PipelineParts>,
) -> RunnerContext {
    RunnerContext {
        name: name.into(),
        model,
        tokenizer: ROption::RNone,
        limits: ServingLimits::default(),
        aliases: Vec::new().into(),
        extras: Vec::new().into(),
        adapter_opener: ROption::RNone,
        image_encoder: ROption::RNone,
        draft_model: ROption::RNone,
        pipeline: pipeline.into(),
        device: "cpu".into(),
    }
}

/// The ONNX graph at `path` as arch-onnx builds it.
pub fn onnx_graph(path: &Path) -> ModelBox {
    let model = u_loader_onnx::OnnxModel::open(&u_loader_onnx::StdFs, path).expect("a graph");
    let weights = u_sdk::weights::SharedWeights::new(model).into_box();
    let built = u_arch_onnx::OnnxArchitecture
        .load(weights, backend())
        .expect("arch-onnx builds it");
    u_sdk::encoder::EncoderModel::boxed(built)
}

/// The engine of `context`, with its caches on or off.
pub fn serve(context: RunnerContext, caches: bool) -> ImageEngine {
    ImageRunner {
        caches,
        ..ImageRunner::default()
    }
    .serve(context)
    .expect("the pipeline is served")
}

/// A request to `model` with nothing set but 4 steps and seed 7.
pub fn request(model: &str) -> ImageRequest {
    ImageRequest {
        model: model.into(),
        prompt: "".into(),
        negative_prompt: "".into(),
        width: 0,
        height: 0,
        steps: 4,
        guidance_scale: 1.0,
        seed: 7,
        init_image: Vec::new().into(),
        strength: 0.0,
        handoff_prompt: "".into(),
        handoff_step: 0,
        conditioning: Vec::new().into(),
        client: "".into(),
    }
}

/// The numbers of a nested JSON array, flattened.
pub fn flat(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().expect("number") as f32],
        other => panic!("not a number array: {other}"),
    }
}

/// The largest difference between `a` and `b`.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// The largest difference of our `[3][H][W]` pixels from diffusers' `[H][W][3]` ones.
pub fn image_error(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len());
    let plane = ours.len() / 3;
    (0..plane * 3)
        .map(|i| (ours[(i % 3) * plane + i / 3] - theirs[i]).abs())
        .fold(0f32, f32::max)
}

/// A sink that lets every step run.
pub struct EveryStep;

impl u_sdk::ImageSink for EveryStep {
    fn step(&mut self, _: &ImageProgress) -> bool {
        true
    }
}

/// `request` through the engine's ABI entry (`generate_image`), every step let run.
pub fn generate(engine: &ImageEngine, request: &ImageRequest) -> GeneratedImage {
    u_sdk::EngineBox::new(engine.clone())
        .generate_image(request, u_sdk::ImageSinkBox::new(EveryStep))
        .into_result()
        .expect("an image")
}

/// Runs `request` from diffusers' starting noise `latents` (draw 0), checking that every step
/// ran, and returns its pixels `[3][H][W]`.
pub fn run_from(engine: &ImageEngine, request: &ImageRequest, latents: &Value) -> Vec<f32> {
    let given = u_runner_image::sampler::GivenNoise([(0, flat(latents))].into());
    let mut seen = Vec::new();
    let outcome = engine
        .run(request, Some(&given), &mut |p| {
            seen.push((p.step, p.cached));
            true
        })
        .expect("an image");
    let all: Vec<(u32, bool)> = (1..=request.steps).map(|s| (s, false)).collect();
    assert_eq!(seen, all, "every step runs, none from a cache");
    outcome.pixels
}

/// `request` on `engine` fails as invalid input, saying `says`.
pub fn invalid(engine: &ImageEngine, request: &ImageRequest, says: &str) {
    let err = engine
        .run(request, None, &mut |_| true)
        .err()
        .expect("an error");
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains(says), "{err} should say {says:?}");
}
