//! The consistency sampler on real weights: the terrain UNet of PyPI's
//! `adaptive-terrain-diffusion` 0.4.2 (read by loader-onnx, run by arch-onnx), served alone,
//! makes the image the package's own one-step sampler (`TerrainGenerator._sample_native`)
//! makes from the same noise within 1e-4 — from pure noise, and as a variation of a grey
//! image at strength 0.5 (`tests/fixtures/gen_terrain_onnx.py` at the workspace root wrote
//! both). The model comes from the registry (`cargo xtask fetch-model terrain-unet`, which
//! `cargo xtask test` runs); absent is a failure, never a skip.

mod common;

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use u_runner_image::sampler::GivenNoise;
use u_runner_image::{ImageEngine, ImageRunner};
use u_sdk::{ErrorKind, ImageProgress, ImageRequest};

const TOL: f32 = 1e-4;
const SIDE: usize = 128;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/terrain")
}

fn model_file() -> Result<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = match var("U_TERRAIN_ONNX") {
        Some(p) => p,
        None => var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/u/models")))
            .context("no model cache")?
            .join("terrain_consistency_unet.onnx"),
    };
    anyhow::ensure!(
        path.is_file(),
        "{} is missing: run `cargo xtask fetch-model terrain-unet`",
        path.display()
    );
    Ok(path)
}

fn floats(name: &str) -> Result<Vec<f32>> {
    let bytes = std::fs::read(fixtures().join(name)).with_context(|| name.to_string())?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// The script's pattern of entry 0: `1.7 sin(0.13 x + 0.07 y) cos(0.05 x − 0.11 y)`.
fn pattern() -> Vec<f32> {
    let mut out = Vec::with_capacity(SIDE * SIDE);
    for y in 0..SIDE {
        for x in 0..SIDE {
            let (y, x) = (y as f64, x as f64);
            out.push((1.7 * (0.13 * x + 0.07 * y).sin() * (0.05 * x - 0.11 * y).cos()) as f32);
        }
    }
    out
}

fn engine() -> Result<ImageEngine> {
    let model = common::onnx_graph(&model_file()?);
    let context = common::runner_context("terrain", model, None);
    Ok(ImageRunner::default().serve(context)?)
}

fn request() -> ImageRequest {
    ImageRequest {
        model: "terrain".into(),
        prompt: "".into(),
        negative_prompt: "".into(),
        width: 0,
        height: 0,
        steps: 1,
        guidance_scale: 1.0,
        seed: 3,
        init_image: Vec::new().into(),
        strength: 0.0,
        handoff_prompt: "".into(),
        handoff_step: 0,
        conditioning: vec![0.5].into(),
        client: "".into(),
    }
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn one_step_and_variation_equal_the_package_sampler() -> Result<()> {
    let engine = engine()?;
    let given = GivenNoise([(0, pattern())].into_iter().collect());
    let mut steps = Vec::new();
    let out = engine.run(&request(), Some(&given), &mut |p: ImageProgress| {
        steps.push(p.step);
        true
    })?;
    assert_eq!(
        (out.width, out.height, out.channels, out.steps),
        (128, 128, 1, 1)
    );
    assert_eq!(steps, [1]);
    let d = worst(&out.pixels, &floats("one_step.f32")?);
    eprintln!("one step: max |Δ| {d:.2e}");
    assert!(d <= TOL, "one step: {d}");

    let variation = ImageRequest {
        init_image: std::fs::read(fixtures().join("source.png"))?.into(),
        strength: 0.5,
        ..request()
    };
    let out = engine.run(&variation, Some(&given), &mut |_| true)?;
    let d = worst(&out.pixels, &floats("variation.f32")?);
    eprintln!("variation: max |Δ| {d:.2e}");
    assert!(d <= TOL, "variation: {d}");

    // The seed's own noise: the same seed gives the same PNG, another seed another.
    let png = |seed| {
        let req = ImageRequest { seed, ..request() };
        u_sdk::Engine::generate_image(&engine, &req, u_sdk::ImageSinkBox::new(Quiet))
            .into_result()
            .map(|i| i.png.to_vec())
    };
    let (a, b, c) = (png(3)?, png(3)?, png(4)?);
    assert_eq!(a, b);
    assert_ne!(a, c);
    let decoded = image::load_from_memory(&a)?;
    assert_eq!(decoded.color(), image::ColorType::L16);
    Ok(())
}

struct Quiet;

impl u_sdk::ImageSink for Quiet {
    fn step(&mut self, _: &ImageProgress) -> bool {
        true
    }
}

#[test]
fn bad_requests_are_clear_errors() -> Result<()> {
    let engine = engine()?;
    let refusal = |req: ImageRequest| match engine.run(&req, None, &mut |_| true) {
        Ok(_) => panic!("accepted"),
        Err(e) => e,
    };
    let e = refusal(ImageRequest {
        steps: 4,
        ..request()
    });
    assert!(e.message.contains("one step"), "{}", e.message);
    let e = refusal(ImageRequest {
        prompt: "a mountain".into(),
        ..request()
    });
    assert!(e.message.contains("reads no text"), "{}", e.message);
    let e = refusal(ImageRequest {
        conditioning: Vec::new().into(),
        ..request()
    });
    assert!(e.message.contains("sigma, difficulty"), "{}", e.message);
    let e = refusal(ImageRequest {
        width: 64,
        ..request()
    });
    assert!(e.message.contains("128×128"), "{}", e.message);
    let e = refusal(ImageRequest {
        width: 8192,
        height: 8192,
        ..request()
    });
    assert_eq!(e.kind, ErrorKind::ResourceExhausted, "{}", e.message);
    let e = refusal(ImageRequest {
        init_image: b"not an image".to_vec().into(),
        strength: 0.5,
        ..request()
    });
    assert!(e.message.contains("initial image"), "{}", e.message);
    Ok(())
}
