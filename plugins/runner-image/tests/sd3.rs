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

mod common;

use common::{TOL, expected, flat, generate, image_error, max_diff, request, serve};
use serde_json::Value;
use u_runner_image::pipeline::SD3_T5_POSITIONS;
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::{ImageRequest, RunnerContext};

/// Stated tolerance on the prompt's rows and pooled text (f32 both sides).
const ROWS_TOL: f32 = 1e-5;

const PIPELINE: &str = "sd3_pipeline";

/// Both CLIPs and the T5.
const ALL: &[&str] = &["text_encoder", "text_encoder_2", "text_encoder_3"];

/// Both CLIPs alone.
const CLIPS: &[&str] = &["text_encoder", "text_encoder_2"];

/// What diffusers made with the T5 (`with_t5`) or without.
fn made(with_t5: bool) -> Value {
    expected(match with_t5 {
        true => "sd3_pipeline",
        false => "sd3_pipeline_without_t5",
    })
}

/// The pipeline with the text encoders `encoders` (and the decoder).
fn context(encoders: &[&str]) -> RunnerContext {
    let components: Vec<&str> = encoders.iter().copied().chain(["vae"]).collect();
    common::context(
        PIPELINE,
        ("transformer", u_arch_diffusion::SD3),
        &components,
        &[],
        &["tokenizer", "tokenizer_2", "tokenizer_3"],
    )
}

fn engine(caches: bool, encoders: &[&str]) -> ImageEngine {
    serve(context(encoders), caches)
}

/// The fixture's run.
fn prompt(e: &Value) -> ImageRequest {
    ImageRequest {
        prompt: e["prompt"].as_str().expect("prompt").into(),
        negative_prompt: e["negative_prompt"].as_str().expect("negative").into(),
        steps: e["steps"].as_u64().expect("steps") as u32,
        guidance_scale: e["guidance_scale"].as_f64().expect("guidance") as f32,
        ..request(PIPELINE)
    }
}

#[test]
fn a_prompt_embeds_as_stable_diffusion_3_encodes_it() {
    for (with_t5, encoders) in [(true, ALL), (false, CLIPS)] {
        let e = made(with_t5);
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
        let e = made(with_t5);
        let pixels = common::run_from(&engine(true, encoders), &prompt(&e), &e["latents"]);
        assert_eq!(pixels.len(), 3 * 16 * 16);
        let d = image_error(&pixels, &flat(&e["image"]));
        eprintln!("4-step SD3 (T5: {with_t5}), guidance 5: max |Δ| {d:.2e} on values in [0, 1]");
        assert!(d < TOL, "image off by {d}");
    }
}

#[test]
fn the_caches_are_exact_for_stable_diffusion_3() {
    let req = prompt(&made(true));
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
