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

mod common;

use common::{TOL, expected, flat, generate, image_error, max_diff, request, serve};
use serde_json::Value;
use u_runner_image::ImageEngine;
use u_runner_image::pipeline::Condition;
use u_sdk::ImageRequest;

/// Stated tolerance on the image embedding (f32 both sides).
const EMBEDDING_TOL: f32 = 1e-5;

const PIPELINE: &str = "sd_variations";

fn source() -> Vec<u8> {
    std::fs::read(common::folder("init.png")).expect("init.png")
}

fn engine(caches: bool) -> ImageEngine {
    let context = common::context(
        PIPELINE,
        ("unet", u_arch_diffusion::UNET),
        &["image_encoder", "vae"],
        &["feature_extractor"],
        &[],
    );
    serve(context, caches)
}

/// A variation of `init.png` as the fixture's run asks for it.
fn variation(e: &Value) -> ImageRequest {
    ImageRequest {
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        init_image: source().into(),
        strength: 0.8,
        ..request(PIPELINE)
    }
}

#[test]
fn a_variation_equals_the_image_variation_pipeline() {
    let e = expected(PIPELINE);
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

    let pixels = common::run_from(&engine, &variation(&e), &e["latents"]);
    assert_eq!(pixels.len(), 3 * 32 * 32);
    let d = image_error(&pixels, &flat(&e["image"]));
    eprintln!("4-step image variation, guidance 3: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");
}

#[test]
fn the_caches_are_exact_for_variations() {
    let e = expected(PIPELINE);
    let req = variation(&e);
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
    let e = expected(PIPELINE);
    let engine = engine(true);
    let fails = |req: ImageRequest, says: &str| common::invalid(&engine, &req, says);
    fails(
        ImageRequest {
            init_image: Vec::new().into(),
            ..variation(&e)
        },
        "needs the image to vary",
    );
    fails(
        ImageRequest {
            prompt: "a cat".into(),
            ..variation(&e)
        },
        "reads only the image",
    );
    fails(
        ImageRequest {
            conditioning: vec![1.0].into(),
            ..variation(&e)
        },
        "reads only the image",
    );
    fails(
        ImageRequest {
            init_image: b"not an image".to_vec().into(),
            ..variation(&e)
        },
        "initial image",
    );
}
