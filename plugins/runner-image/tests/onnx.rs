//! A diffusers ONNX pipeline folder (`sd_onnx/`: the tiny Stable Diffusion of `sd/` exported as
//! diffusers' conversion script exports it, by `gen_onnx_pipeline.py`), wired as the host wires
//! it: arch-onnx runs the `unet/`, `text_encoder/` and `vae_decoder/` graphs, no component
//! configuration exists (the latents scale by Stable Diffusion's 0.18215, prompts pad to the
//! tokenizer's `model_max_length`). A 4-step guided run equals `OnnxStableDiffusionPipeline`
//! (onnxruntime) within [`common::TOL`] on the image; with no initial image encoder, image to
//! image is refused.

mod common;

use common::{TOL, expected_onnx, folder, image_error, run_from, tokenizer};
use u_sdk::{
    ModelBox, PipelineComponent, PipelineConfig, PipelineParts, PipelineTokenizer, RunnerContext,
};

const PIPELINE: &str = "sd_onnx";

/// The graph of `component`.
fn graph(component: &str) -> ModelBox {
    common::onnx_graph(&folder(PIPELINE).join(component).join("model.onnx"))
}

fn context() -> RunnerContext {
    let dir = folder(PIPELINE);
    let config = |component: &str, path: &str| PipelineConfig {
        component: component.into(),
        json: std::fs::read_to_string(dir.join(path))
            .expect("a configuration")
            .into(),
    };
    common::runner_context(
        PIPELINE,
        graph("unet"),
        Some(PipelineParts {
            components: ["text_encoder", "vae_decoder"]
                .into_iter()
                .map(|c| PipelineComponent {
                    name: c.into(),
                    model: graph(c),
                })
                .collect::<Vec<_>>()
                .into(),
            configs: vec![
                config("model_index", "model_index.json"),
                config("scheduler", "scheduler/scheduler_config.json"),
                config("tokenizer", "tokenizer/tokenizer_config.json"),
            ]
            .into(),
            tokenizers: vec![PipelineTokenizer {
                name: "tokenizer".into(),
                tokenizer: tokenizer(PIPELINE, "tokenizer"),
            }]
            .into(),
        }),
    )
}

#[test]
fn text_to_image_equals_onnx_stable_diffusion_pipeline() {
    let e = expected_onnx();
    let run = &e["txt2img"];
    let engine = common::serve(context(), true);
    let side = |key: &str| {
        // OnnxStableDiffusionPipeline's latent is `side // 8`; this VAE doubles it.
        run[key].as_u64().expect("size") as u32 / 8 * 2
    };
    let request = u_sdk::ImageRequest {
        prompt: run["prompt"].as_str().expect("prompt").into(),
        negative_prompt: run["negative_prompt"].as_str().expect("negative").into(),
        steps: run["steps"].as_u64().expect("steps") as u32,
        guidance_scale: run["guidance_scale"].as_f64().expect("guidance") as f32,
        width: side("width"),
        height: side("height"),
        ..common::request(PIPELINE)
    };
    let pixels = run_from(&engine, &request, &run["latents"]);
    let d = image_error(&pixels, &common::flat(&run["image"]));
    println!("OnnxStableDiffusionPipeline, 4 guided steps: max |Δ| {d:.2e}");
    assert!(d < TOL, "off by {d}");

    let init = std::fs::read(folder("init.png")).expect("init.png");
    let refine = u_sdk::ImageRequest {
        init_image: init.into(),
        strength: 0.5,
        ..request
    };
    let err = engine
        .run(&refine, None, &mut |_| true)
        .err()
        .expect("refused");
    assert!(err.message.contains("cannot start from an image"), "{err}");
}
