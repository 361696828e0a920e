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

mod common;

use common::{TOL, expected, flat, generate, image_error, request, serve};
use serde_json::Value;
use u_runner_image::ImageEngine;
use u_runner_image::sampler::GivenNoise;
use u_sdk::{ErrorKind, ImageRequest, TokenizeRequest};

const PIPELINE: &str = "dit_pipeline";

fn engine(caches: bool) -> ImageEngine {
    let context = common::context(
        PIPELINE,
        ("transformer", u_arch_diffusion::DIT),
        &["vae", "vae.encoder"],
        &[],
        &[],
    );
    serve(context, caches)
}

/// The fixture's run with `conditioning` and `prompt`.
fn class(e: &Value, conditioning: &[f32], prompt: &str) -> ImageRequest {
    ImageRequest {
        prompt: prompt.into(),
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        conditioning: conditioning.to_vec().into(),
        ..request(PIPELINE)
    }
}

#[test]
fn a_class_equals_dit_pipeline() {
    let e = expected(PIPELINE);
    let label = e["label"].as_f64().expect("label") as f32;
    let engine = engine(true);
    let want = flat(&e["image"]);
    let pixels = common::run_from(&engine, &class(&e, &[label], ""), &e["latents"]);
    assert_eq!(pixels.len(), 3 * 16 * 16);
    let d = image_error(&pixels, &want);
    eprintln!("4-step DiT, class {label}, guidance 4: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");

    // Each name `id2label` gives class 3 asks for the same image; another class differs.
    let given = GivenNoise([(0, flat(&e["latents"]))].into());
    for name in ["tiger shark", "Galeocerdo cuvieri"] {
        let named = engine
            .run(&class(&e, &[], name), Some(&given), &mut |_| true)
            .expect("a named class");
        assert_eq!(named.pixels, pixels, "{name:?}");
    }
    let other = engine
        .run(&class(&e, &[], "cock"), Some(&given), &mut |_| true)
        .expect("class 7");
    assert!(
        image_error(&other.pixels, &want) > TOL,
        "class 7 is another image"
    );
}

#[test]
fn the_caches_are_exact_for_classes() {
    let e = expected(PIPELINE);
    let req = class(&e, &[3.0], "");
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
    let other = generate(&cached, &class(&e, &[7.0], ""));
    assert_eq!(other.cached_steps, 0);
    assert_ne!(other.png, plain.png);
}

#[test]
fn bad_class_requests_are_clear_errors() {
    let e = expected(PIPELINE);
    let engine = engine(true);
    let fails = |req: ImageRequest, says: &str| common::invalid(&engine, &req, says);
    fails(class(&e, &[], ""), "needs a class");
    fails(class(&e, &[1000.0], ""), "one class label in 0..1000");
    fails(class(&e, &[2.5], ""), "one class label in 0..1000");
    fails(class(&e, &[3.0, 4.0], ""), "one class label in 0..1000");
    fails(class(&e, &[], "great white shark"), "no class is named");
    fails(class(&e, &[3.0], "cock"), "not both");
    fails(
        ImageRequest {
            negative_prompt: "cock".into(),
            ..class(&e, &[3.0], "")
        },
        "no negative prompt",
    );
    let tokens = u_sdk::EngineBox::new(engine.clone())
        .tokenize(&TokenizeRequest {
            model: PIPELINE.into(),
            prompt: "tiger shark".into(),
            messages: Vec::new().into(),
            continue_final: false,
            add_special: true,
        })
        .into_result()
        .expect_err("no tokenizer");
    assert_eq!(tokens.kind, ErrorKind::Unsupported, "{tokens}");
}
