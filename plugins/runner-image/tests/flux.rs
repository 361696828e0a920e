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

mod common;

use common::{TOL, expected, flat, generate, image_error, max_diff, request, serve};
use serde_json::Value;
use u_runner_image::ImageEngine;
use u_runner_image::pipeline::FLUX_T5_POSITIONS;
use u_sdk::ImageRequest;

/// Stated tolerance on the prompt's rows and pooled text (f32 both sides; T5's unscaled
/// attention over 512 positions, rows up to 2.2 in size).
const ROWS_TOL: f32 = 1e-4;

const PIPELINE: &str = "flux_pipeline";

fn engine(caches: bool) -> ImageEngine {
    let context = common::context(
        PIPELINE,
        ("transformer", u_arch_diffusion::FLUX),
        &["text_encoder", "text_encoder_2", "vae"],
        &[],
        &["tokenizer", "tokenizer_2"],
    );
    serve(context, caches)
}

/// The fixture's run.
fn prompt(e: &Value) -> ImageRequest {
    ImageRequest {
        prompt: e["prompt"].as_str().expect("prompt").into(),
        width: e["width"].as_u64().expect("width") as u32,
        height: e["height"].as_u64().expect("height") as u32,
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        ..request(PIPELINE)
    }
}

#[test]
fn a_prompt_embeds_as_flux_encodes_it() {
    let e = expected(PIPELINE);
    let embedded = engine(true)
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
    let e = expected(PIPELINE);
    let pixels = common::run_from(&engine(true), &prompt(&e), &e["latents"]);
    assert_eq!(pixels.len(), 3 * 16 * 16);
    let d = image_error(&pixels, &flat(&e["image"]));
    eprintln!("4-step FLUX, guidance 3.5: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");
}

#[test]
fn a_negative_prompt_is_refused() {
    let req = ImageRequest {
        negative_prompt: "blue sky".into(),
        ..prompt(&expected(PIPELINE))
    };
    let err = engine(true)
        .run(&req, None, &mut |_| true)
        .err()
        .expect("refused");
    assert!(err.message.contains("no negative prompt"), "{err}");
}

#[test]
fn the_caches_are_exact_for_flux() {
    let req = prompt(&expected(PIPELINE));
    let plain = generate(&engine(false), &req);
    let cached = engine(true);
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
