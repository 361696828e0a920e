//! Real weights: the consistency-distilled terrain UNet of PyPI's `adaptive-terrain-diffusion`
//! 0.4.2 (`terrain_consistency_unet_difficulty100.onnx`: 10.5 M parameters, 2,103 nodes —
//! guided-diffusion's UNet with its EDM preconditioning exported into the graph), read by
//! loader-onnx and run by arch-onnx, equals onnxruntime's output on the same input within
//! 1e-4 (`tests/fixtures/gen_terrain_onnx.py` at the workspace root wrote it).
//!
//! The model comes from the registry (`cargo xtask fetch-model terrain-unet`, which `cargo
//! xtask test` runs): `$U_TERRAIN_ONNX`, else the model cache. Absent is a failure, never a
//! skip.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use u_arch_onnx::OnnxArchitecture;
use u_sdk::abi_stable::std_types::RSlice;
use u_sdk::{ModelKind, Output, Planes, Segment, SeqChunk, SeqExtras};

/// Stated tolerance.
const TOL: f32 = 1e-4;
const SIDE: usize = 128;
const SIGMAS: [f32; 2] = [80.0, 2.5];
const LABELS: [f32; 2] = [0.0, 0.5];

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

/// The script's pattern: `1.7 sin(0.13 x + 0.07 y + b) cos(0.05 x − 0.11 y + 0.3 b)`, times σ.
fn noisy(b: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(SIDE * SIDE);
    for y in 0..SIDE {
        for x in 0..SIDE {
            let (b, y, x) = (b as f64, y as f64, x as f64);
            let v = 1.7 * (0.13 * x + 0.07 * y + b).sin() * (0.05 * x - 0.11 * y + 0.3 * b).cos();
            out.push(v as f32 * SIGMAS[b as usize]);
        }
    }
    out
}

fn expected() -> Result<Vec<f32>> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/terrain/denoised.f32");
    let bytes = std::fs::read(&path).with_context(|| path.display().to_string())?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

fn load() -> Result<u_arch_onnx::GraphModel> {
    let onnx = u_loader_onnx::OnnxModel::open(&u_loader_onnx::StdFs, &model_file()?)?;
    assert_eq!(onnx.architecture(), Some(u_arch_onnx::FAMILY));
    let weights = u_sdk::weights::SharedWeights::new(onnx).into_box();
    Ok(OnnxArchitecture.load(weights, u_kernels_cpu::CpuKernels::new(2)?.into_box())?)
}

#[test]
fn terrain_unet_equals_onnxruntime() -> Result<()> {
    let model = load()?;
    let config = model.model_config();
    assert_eq!(config.kind, ModelKind::Denoiser);
    let spec = config.planes.into_option().context("a map model")?;
    assert_eq!(
        (spec.in_channels, spec.out_channels, spec.sample_size),
        (1, 1, 128)
    );
    assert_eq!(model.input_names(), ["noisy", "sigma", "difficulty"]);

    let inputs: Vec<Vec<f32>> = (0..2).map(noisy).collect();
    let conditioning: Vec<[f32; 2]> = (0..2).map(|b| [SIGMAS[b], LABELS[b]]).collect();
    let segments: Vec<[Segment<'_>; 1]> = inputs
        .iter()
        .map(|v| {
            [Segment::Planes(Planes {
                values: RSlice::from_slice(v),
                channels: 1,
                height: SIDE as u32,
                width: SIDE as u32,
            })]
        })
        .collect();
    let chunks: Vec<SeqChunk<'_>> = (0..2)
        .map(|b| SeqChunk {
            seq: b as u64,
            input: RSlice::from_slice(&segments[b]),
            output: Output::Planes,
            extras: SeqExtras {
                conditioning: RSlice::from_slice(&conditioning[b]),
                ..SeqExtras::default()
            },
        })
        .collect();
    let mut out = vec![0.0f32; 2 * SIDE * SIDE];
    let started = std::time::Instant::now();
    model.forward(&chunks, &mut out)?;
    eprintln!("batch of 2 in {:.2} s", started.elapsed().as_secs_f64());
    let want = expected()?;
    let worst = out
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("max |Δ| against onnxruntime: {worst:.2e}");
    assert!(worst <= TOL, "max |Δ| {worst} > {TOL}");

    // One entry alone gives the same map as in the batch.
    let mut alone = vec![0.0f32; SIDE * SIDE];
    model.forward(&chunks[1..], &mut alone)?;
    assert_eq!(alone, out[SIDE * SIDE..]);
    Ok(())
}

/// The error a one-map pass of `side`² values and `conditioning` gives.
fn refusal(model: &u_arch_onnx::GraphModel, side: u32, conditioning: &[f32]) -> String {
    let values = vec![0.0f32; (side * side) as usize];
    let segment = [Segment::Planes(Planes {
        values: RSlice::from_slice(&values),
        channels: 1,
        height: side,
        width: side,
    })];
    let chunk = SeqChunk {
        seq: 0,
        input: RSlice::from_slice(&segment),
        output: Output::Planes,
        extras: SeqExtras {
            conditioning: RSlice::from_slice(conditioning),
            ..SeqExtras::default()
        },
    };
    let mut out = vec![0.0f32; values.len()];
    match model.forward(&[chunk], &mut out) {
        Ok(()) => panic!("a {side}² map with {conditioning:?} was accepted"),
        Err(e) => e.message.to_string(),
    }
}

#[test]
fn bad_input_is_a_clear_error() -> Result<()> {
    let model = load()?;
    let err = refusal(&model, 64, &[80.0, 0.5]);
    assert!(err.contains("takes 128×128"), "{err}");
    let err = refusal(&model, 128, &[80.0]);
    assert!(err.contains("sigma, difficulty"), "{err}");
    let err = refusal(&model, 128, &[f32::NAN, 0.5]);
    assert!(err.contains("finite"), "{err}");
    Ok(())
}
