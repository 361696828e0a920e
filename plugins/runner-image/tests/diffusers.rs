//! The image runner against diffusers' `StableDiffusionPipeline` on the tiny random-weight
//! pipeline of `tests/fixtures/diffusion_tiny/sd/` at the workspace root (its generator,
//! `gen_diffusion_tiny.py`, beside it), wired as the host wires a diffusers folder: the UNet as
//! the model, the CLIP text encoder and the autoencoder as pipeline components, the tokenizer
//! from `tokenizer/`, the configuration files as text.
//!
//! - The prompts tokenize to the pipeline's ids (padded to 77 with `<|endoftext|>`).
//! - A 4-step guided text-to-image run from diffusers' own starting noise equals diffusers'
//!   image within [`TOL`].
//! - The caches are exact: the same request with every cache on and off gives the same PNG,
//!   byte for byte; a request cancelled after step 2 resumes there and ends with the
//!   uninterrupted image; a finished request repeats from its cached trajectory.
//! - Image to image runs the last `steps · strength` steps from the encoded image.
//! - Bad requests are clear errors.

mod common;

use common::{EveryStep, TOL, backend, flat, image_error, serve, weights};
use serde_json::Value;
use std::path::PathBuf;
use u_arch_diffusion::UNET;
use u_runner_image::sampler::{GivenNoise, LATENT_SAMPLE_DRAW};
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::{ErrorKind, ImageProgress, ImageRequest, RunnerContext};

const PIPELINE: &str = "sd";

fn sd() -> PathBuf {
    common::folder(PIPELINE)
}

fn expected() -> Value {
    common::all_expected()
}

/// The pipeline's parts, as the host hands them over; without the autoencoder's encoder when
/// `encoder` is false.
fn context(encoder: bool) -> RunnerContext {
    let components: &[&str] = match encoder {
        true => &["text_encoder", "vae", "vae.encoder"],
        false => &["text_encoder", "vae"],
    };
    common::context(PIPELINE, ("unet", UNET), components, &[], &["tokenizer"])
}

fn engine(caches: bool) -> ImageEngine {
    serve(context(true), caches)
}

fn request(e: &Value) -> ImageRequest {
    let run = &e["txt2img"];
    ImageRequest {
        prompt: run["prompt"].as_str().expect("prompt").into(),
        negative_prompt: run["negative_prompt"].as_str().expect("negative").into(),
        steps: run["steps"].as_u64().expect("steps") as u32,
        guidance_scale: run["guidance_scale"].as_f64().expect("guidance") as f32,
        ..common::request(PIPELINE)
    }
}

fn all_steps(_: ImageProgress) -> bool {
    true
}

#[test]
fn prompts_tokenize_as_the_pipeline_pads_them() {
    let engine = engine(true);
    for text in expected()["text_encoder"].as_array().expect("texts") {
        let ids: Vec<u32> = serde_json::from_value(text["ids"].clone()).expect("ids");
        let prompt = text["prompt"].as_str().expect("prompt");
        assert_eq!(
            engine.pipeline().unwrap().tokens(prompt).unwrap(),
            ids,
            "{prompt:?}"
        );
    }
    // Past 77 positions: cut, the end token kept.
    let long = engine
        .pipeline()
        .unwrap()
        .tokens(&"cat ".repeat(100))
        .unwrap();
    assert_eq!(long.len(), 77);
    assert_eq!((long[0], long[75], long[76]), (531, 520, 532));
}

#[test]
fn text_to_image_equals_stable_diffusion_pipeline() {
    let e = expected();
    let engine = engine(true);
    let given = GivenNoise([(0, flat(&e["txt2img"]["latents"]))].into());
    let want = flat(&e["txt2img"]["image"]);
    let mut seen = Vec::new();
    let outcome = engine
        .run(&request(&e), Some(&given), &mut |p| {
            seen.push(p);
            true
        })
        .expect("an image");
    assert_eq!((outcome.width, outcome.height), (32, 32));
    assert_eq!(
        seen.iter().map(|p| (p.step, p.cached)).collect::<Vec<_>>(),
        [(1, false), (2, false), (3, false), (4, false)]
    );
    let d = image_error(&outcome.pixels, &want);
    eprintln!("4-step text to image: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");
}

#[test]
fn image_to_image_equals_stable_diffusion_img2img_pipeline() {
    let e = expected();
    let run = &e["img2img"];
    let engine = engine(true);
    let req = ImageRequest {
        prompt: run["prompt"].as_str().expect("prompt").into(),
        init_image: std::fs::read(sd().join("../init.png")).unwrap().into(),
        strength: run["strength"].as_f64().unwrap() as f32,
        ..request(&e)
    };
    let given = GivenNoise(
        [
            (LATENT_SAMPLE_DRAW, flat(&run["sample"])),
            (0, flat(&run["noise"])),
        ]
        .into(),
    );
    let mut steps = Vec::new();
    let out = engine
        .run(&req, Some(&given), &mut |p| {
            steps.push(p.step);
            true
        })
        .expect("image to image");
    assert_eq!(steps, [2, 3, 4], "strength 0.75 of 4 steps runs the last 3");
    let d = image_error(&out.pixels, &flat(&run["image"]));
    eprintln!("4-step image to image, strength 0.75: max |Δ| {d:.2e} on values in [0, 1]");
    assert!(d < TOL, "image off by {d}");
}

#[test]
fn the_caches_are_exact_and_a_cancelled_request_resumes() {
    let e = expected();
    let req = request(&e);
    let boxed = |engine: &ImageEngine| u_sdk::EngineBox::new(engine.clone());
    let sink = || u_sdk::ImageSinkBox::new(EveryStep);
    let plain = boxed(&engine(false))
        .generate_image(&req, sink())
        .into_result()
        .expect("without caches");
    let cached = engine(true);
    let first = boxed(&cached)
        .generate_image(&req, sink())
        .into_result()
        .expect("with caches");
    assert_eq!(
        first.png, plain.png,
        "caches on and off give the same bytes"
    );
    assert_eq!(first.cached_steps, 0);
    let again = boxed(&cached)
        .generate_image(&req, sink())
        .into_result()
        .expect("repeated");
    assert_eq!((again.png == plain.png, again.cached_steps), (true, 4));

    // Cancelled after step 2, then resumed: steps 3 and 4 run, the image is the same.
    let other = ImageRequest {
        seed: 8,
        ..req.clone()
    };
    let uninterrupted = boxed(&engine(false))
        .generate_image(&other, sink())
        .into_result()
        .expect("uninterrupted");
    let resumable = engine(true);
    let stop = resumable
        .run(&other, None, &mut |p: ImageProgress| p.step < 2)
        .err()
        .expect("cancelled");
    assert_eq!(stop.kind, ErrorKind::Cancelled, "{stop}");
    let mut seen = Vec::new();
    let resumed = resumable
        .run(&other, None, &mut |p| {
            seen.push((p.step, p.cached));
            true
        })
        .expect("resumed");
    assert_eq!(seen, [(2, true), (3, false), (4, false)]);
    assert_eq!(resumed.cached_steps, 2);
    let png = u_runner_image::picture::png(&resumed.pixels, 3, (32, 32)).unwrap();
    assert_eq!(png, uninterrupted.png.to_vec(), "resumed = uninterrupted");
    assert_ne!(uninterrupted.png, plain.png, "another seed, another image");
}

#[test]
fn an_edited_prompt_hands_off_from_a_kept_trajectory_approximately() {
    let e = expected();
    let engine = engine(true);
    let first = request(&e);
    let edited = ImageRequest {
        prompt: "two dogs!".into(),
        ..first.clone()
    };
    let handoff = ImageRequest {
        handoff_prompt: first.prompt.clone(),
        handoff_step: 2,
        ..edited.clone()
    };
    // Nothing kept yet: a clear error.
    let err = engine.run(&handoff, None, &mut all_steps).err().unwrap();
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    let original = engine.run(&first, None, &mut all_steps).unwrap();
    let mut seen = Vec::new();
    let handed = engine
        .run(&handoff, None, &mut |p| {
            seen.push((p.step, p.cached));
            true
        })
        .unwrap();
    assert_eq!(seen, [(2, true), (3, false), (4, false)]);
    assert!(handed.approximate && handed.cached_steps == 2);
    let own = engine.run(&edited, None, &mut all_steps).unwrap();
    assert!(
        !own.approximate && own.cached_steps == 0,
        "not taken from the handoff"
    );
    assert_ne!(
        handed.pixels, own.pixels,
        "a handoff is not the edited prompt's own image"
    );
    assert_ne!(handed.pixels, original.pixels);
    let again = engine.run(&handoff, None, &mut all_steps).unwrap();
    assert_eq!(again.pixels, handed.pixels, "a handoff is deterministic");
    // Past the kept trajectory's steps, or before its start: refused.
    let late = ImageRequest {
        handoff_step: 5,
        ..handoff.clone()
    };
    assert!(engine.run(&late, None, &mut all_steps).is_err());
}

#[test]
fn image_to_image_runs_the_last_steps_from_the_encoded_image() {
    let e = expected();
    let engine = engine(true);
    let start = u_runner_image::picture::png(&vec![0.25; 3 * 32 * 32], 3, (32, 32)).unwrap();
    let req = ImageRequest {
        init_image: start.into(),
        strength: 0.5,
        ..request(&e)
    };
    let mut steps = Vec::new();
    let out = engine
        .run(&req, None, &mut |p| {
            steps.push(p.step);
            true
        })
        .expect("image to image");
    assert_eq!(steps, [3, 4], "strength 0.5 of 4 steps runs the last 2");
    assert_eq!((out.width, out.height), (32, 32));
    let again = engine.run(&req, None, &mut all_steps).expect("repeated");
    assert_eq!(again.pixels, out.pixels);
    assert_eq!(again.cached_steps, 2);

    // Without the encoder, starting from an image is refused.
    let no_encoder = ImageRunner::default().serve(context(false)).unwrap();
    let err = no_encoder.run(&req, None, &mut all_steps).err().unwrap();
    assert!(err.message.contains("cannot start from an image"), "{err}");
}

#[test]
fn bad_requests_are_clear_errors() {
    let e = expected();
    let engine = ImageRunner {
        max_pixels: 64 * 64,
        ..ImageRunner::default()
    }
    .serve(context(true))
    .unwrap();
    let base = request(&e);
    let fails = |req: ImageRequest| engine.run(&req, None, &mut all_steps).err().unwrap();
    let err = fails(ImageRequest {
        conditioning: vec![0.5].into(),
        ..base.clone()
    });
    assert!(
        err.message.contains("conditioning values"),
        "{}",
        err.message
    );
    let err = fails(ImageRequest {
        steps: 0,
        ..base.clone()
    });
    assert!(err.message.contains("0 steps"), "{err}");
    let err = fails(ImageRequest {
        width: 30,
        ..base.clone()
    });
    assert!(err.message.contains("multiples of 4"), "{err}");
    let err = fails(ImageRequest {
        width: 128,
        height: 128,
        ..base.clone()
    });
    assert_eq!(err.kind, ErrorKind::ResourceExhausted, "{err}");
    let err = fails(ImageRequest {
        model: "other".into(),
        ..base.clone()
    });
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    let err = fails(ImageRequest {
        init_image: b"not an image".to_vec().into(),
        strength: 0.5,
        ..base.clone()
    });
    assert!(err.message.contains("initial image"), "{err}");
    let png = u_runner_image::picture::png(&[0.5; 3 * 32 * 32], 3, (32, 32)).unwrap();
    let err = fails(ImageRequest {
        init_image: png.clone().into(),
        strength: 1.5,
        ..base.clone()
    });
    assert!(err.message.contains("strength"), "{err}");
    let err = fails(ImageRequest {
        init_image: png.into(),
        strength: 0.1,
        ..base.clone()
    });
    assert!(err.message.contains("runs none"), "{err}");
    let err = fails(ImageRequest {
        guidance_scale: f32::NAN,
        ..base
    });
    assert!(err.message.contains("guidance"), "{err}");

    // A pipeline with a text model where its denoiser should be is refused.
    let mut wrong = context(true);
    wrong.model = u_arch_clip::ClipArchitecture
        .load(weights(PIPELINE, "text_encoder"), backend())
        .unwrap();
    let err = ImageRunner::default().serve(wrong).err().unwrap();
    assert!(err.message.contains("serves diffusion pipelines"), "{err}");
}
