//! arch-diffusion against diffusers on the tiny random-weight components of
//! `tests/fixtures/diffusion_tiny/` at the workspace root (the pipeline `sd/` and a second UNet;
//! its generator,
//! `gen_diffusion_tiny.py`, beside it): `AutoencoderKL`'s decoder and encoder and two
//! `UNet2DConditionModel`s (convolutional and linear transformer projections) and a
//! class-conditioned `DiTTransformer2DModel` (at its own size and at another, where the position
//! embedding is interpolated) and an `SD3Transformer2DModel` (MMDiT: joint attention, RMS q/k
//! norms, the last block text-free, positions cropped) and a `FluxTransformer2DModel` (double- and
//! single-stream blocks, rotary embedding over three axes, guidance embedding) equal diffusers'
//! outputs within [`TOL`], alone and batched (classifier-free guidance runs two chunks with
//! different contexts in one pass); bad input is refused with a clear error. The UNet and the
//! autoencoder also equal diffusers when read from `sd_single_file/`'s checkpoint in Stable
//! Diffusion's original layout (written by `gen_single_file.py`, which checks that diffusers'
//! `from_single_file` reads it as `sd/`).

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_diffusion::{DIT, DiffusionArchitecture, FLUX, SD3, UNET, VAE_DECODER, VAE_ENCODER};
use u_sdk::abi_stable::std_types::{ROption, RSlice, RSliceMut};
use u_sdk::{
    CrossContext, ModelBox, ModelKind, Output, PlaneSpec, Planes, Rows, Segment, SeqChunk,
    SeqExtras,
};

/// Stated tolerance on `max |Δ| / max(1, max |expected|)` (f32 both sides).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny")
}

fn expected() -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixture().join("expected.json"),
    )?)?)
}

/// The component folder `component` of the fixture, built as `family`. A folder holding only
/// its `config.json` (as in `sd_single_file/`) is the single-file checkpoint beside it with that
/// configuration, as the host presents it.
fn load(component: &str, family: &str) -> u_sdk::Result<ModelBox> {
    use u_loader_safetensors::SafetensorsModel;
    let folder = fixture().join(component);
    let invalid = |e: &dyn std::fmt::Display| u_sdk::UError::invalid(e.to_string());
    let opened = match folder.join("config.json").is_file() && !has_weights(&folder) {
        true => {
            let config = std::fs::read(folder.join("config.json")).map_err(|e| invalid(&e))?;
            let checkpoint = std::fs::read_dir(folder.parent().expect("parent"))
                .map_err(|e| invalid(&e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .expect("a single-file checkpoint beside the folder");
            let bytes = std::fs::read(checkpoint).map_err(|e| invalid(&e))?;
            SafetensorsModel::from_bytes(bytes, Some(&config))
        }
        false => SafetensorsModel::open(&u_loader_safetensors::StdFs, &folder),
    }
    .map_err(|e| invalid(&e))?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(opened).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)
        .map_err(|e| u_sdk::UError::invalid(e.to_string()))?
        .into_box();
    DiffusionArchitecture.load(weights, backend, family)
}

fn has_weights(folder: &Path) -> bool {
    std::fs::read_dir(folder)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
}

/// A nested JSON array, flattened, with its shape.
fn flat(v: &Value) -> (Vec<f32>, Vec<usize>) {
    match v {
        Value::Array(items) => {
            let mut values = Vec::new();
            let mut inner = Vec::new();
            for item in items {
                let (v, s) = flat(item);
                values.extend(v);
                inner = s;
            }
            let mut shape = vec![items.len()];
            shape.extend(inner);
            (values, shape)
        }
        Value::Number(n) => (vec![n.as_f64().expect("number") as f32], vec![]),
        other => panic!("not a number array: {other}"),
    }
}

fn planes(values: &[f32], shape: &[usize]) -> Planes<'static> {
    let leaked: &'static [f32] = Box::leak(values.to_vec().into_boxed_slice());
    Planes {
        values: RSlice::from_slice(leaked),
        channels: shape[0] as u32,
        height: shape[1] as u32,
        width: shape[2] as u32,
    }
}

/// Runs `chunks` in one pass, the output sized by the model's spec.
fn run(model: &ModelBox, chunks: &[SeqChunk<'_>]) -> u_sdk::Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let total: usize = chunks
        .iter()
        .map(|c| c.output.floats(c.rows(config.hidden as usize), &config))
        .sum();
    let mut out = vec![f32::NAN; total];
    model
        .forward(
            RSlice::from_slice(chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

fn max_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "output length");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let d = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(got.iter().all(|v| v.is_finite()), "non-finite output");
    d / scale
}

fn chunk<'a>(input: &'a [Segment<'a>], extras: SeqExtras<'a>) -> SeqChunk<'a> {
    SeqChunk {
        seq: 0,
        input: RSlice::from_slice(input),
        output: Output::Planes,
        extras,
    }
}

#[test]
fn the_vae_decoder_equals_diffusers() -> Result<()> {
    vae_decoder_equals_diffusers("sd/vae")
}

/// The autoencoder stored in Stable Diffusion's single-file layout (its attention projections
/// 1×1 convolutions, its decoder's blocks numbered from the other end) decodes and encodes as
/// the diffusers folder does.
#[test]
fn the_single_file_vae_equals_diffusers() -> Result<()> {
    vae_decoder_equals_diffusers("sd_single_file/vae")?;
    vae_encoder_equals_diffusers("sd_single_file/vae")
}

fn vae_decoder_equals_diffusers(folder: &str) -> Result<()> {
    let e = expected()?;
    let model = load(folder, VAE_DECODER)?;
    let config = model.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Autoencoder);
    assert_eq!(
        config.planes.into_option(),
        Some(PlaneSpec {
            in_channels: 4,
            out_channels: 3,
            scale: [2, 1],
            multiple: 1,
            sample_size: 16,
        })
    );
    let (latents, shape) = flat(&e["vae.decode"]["latents"]);
    let (image, image_shape) = flat(&e["vae.decode"]["image"]);
    assert_eq!(image_shape, [3, 16, 16]);
    let input = [Segment::Planes(planes(&latents, &shape))];
    let got = run(&model, &[chunk(&input, SeqExtras::default())])?;
    let err = max_error(&got, &image);
    println!("AutoencoderKL decode: max relative |Δ| {err:.2e}");
    assert!(err < TOL, "decoder off by {err}");
    Ok(())
}

#[test]
fn the_vae_encoder_equals_diffusers() -> Result<()> {
    vae_encoder_equals_diffusers("sd/vae")
}

fn vae_encoder_equals_diffusers(folder: &str) -> Result<()> {
    let e = expected()?;
    let model = load(folder, VAE_ENCODER)?;
    let config = model.config().into_result()?;
    assert_eq!(
        config
            .planes
            .into_option()
            .map(|p| (p.out_channels, p.scale)),
        Some((8, [1, 2]))
    );
    let (pixels, shape) = flat(&e["vae.encode"]["image"]);
    let (moments, moments_shape) = flat(&e["vae.encode"]["moments"]);
    assert_eq!(moments_shape, [8, 8, 8]);
    let input = [Segment::Planes(planes(&pixels, &shape))];
    let got = run(&model, &[chunk(&input, SeqExtras::default())])?;
    let err = max_error(&got, &moments);
    println!("AutoencoderKL encode: max relative |Δ| {err:.2e}");
    assert!(err < TOL, "encoder off by {err}");

    // A 15×16 image does not halve.
    let odd = [Segment::Planes(planes(
        &pixels[..3 * 15 * 16],
        &[3, 15, 16],
    ))];
    let err = run(&model, &[chunk(&odd, SeqExtras::default())]).unwrap_err();
    assert!(err.message.contains("multiples of 2"), "{}", err.message);
    Ok(())
}

struct Case {
    sample: (Vec<f32>, Vec<usize>),
    timestep: f32,
    context: Vec<f32>,
    prediction: Vec<f32>,
}

fn cases(e: &Value, name: &str) -> Vec<Case> {
    e[name]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            sample: flat(&c["sample"]),
            timestep: c["timestep"].as_f64().expect("timestep") as f32,
            context: flat(&c["context"]).0,
            prediction: flat(&c["prediction"]).0,
        })
        .collect()
}

/// The UNet of `folder`, against the cases of `component` in `expected.json`.
fn unet_equals_diffusers(folder: &str, component: &str) -> Result<()> {
    let folder = folder.to_string();
    let e = expected()?;
    let model = load(&folder, UNET)?;
    let config = model.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Denoiser);
    assert_eq!(config.context_shape, [0, 16]);
    let cases = cases(&e, component);
    let inputs: Vec<[Segment<'_>; 1]> = cases
        .iter()
        .map(|c| [Segment::Planes(planes(&c.sample.0, &c.sample.1))])
        .collect();
    let timesteps: Vec<[f32; 1]> = cases.iter().map(|c| [c.timestep]).collect();
    let chunks: Vec<SeqChunk<'_>> = cases
        .iter()
        .zip(&inputs)
        .zip(&timesteps)
        .map(|((c, input), t)| {
            chunk(
                input,
                SeqExtras {
                    conditioning: RSlice::from_slice(t),
                    cross: ROption::RSome(CrossContext {
                        kv: 1,
                        rows: RSlice::from_slice(&c.context),
                    }),
                    ..SeqExtras::default()
                },
            )
        })
        .collect();
    // Alone, then both in one pass (as classifier-free guidance batches its two halves).
    for (c, one) in cases.iter().zip(&chunks) {
        let got = run(&model, std::slice::from_ref(one))?;
        let err = max_error(&got, &c.prediction);
        println!("{component} t={}: max relative |Δ| {err:.2e}", c.timestep);
        assert!(err < TOL, "{component} at t={} off by {err}", c.timestep);
    }
    let both = run(&model, &chunks)?;
    let n = cases[0].prediction.len();
    assert_eq!(both[..n], run(&model, &chunks[..1])?[..]);
    assert_eq!(both[n..], run(&model, &chunks[1..])?[..]);
    Ok(())
}

#[test]
fn the_unet_equals_diffusers() -> Result<()> {
    unet_equals_diffusers("sd/unet", "unet")
}

/// The UNet stored in Stable Diffusion's single-file layout (`input_blocks`, `middle_block`,
/// `output_blocks`) predicts as the diffusers folder does.
#[test]
fn the_single_file_unet_equals_diffusers() -> Result<()> {
    unet_equals_diffusers("sd_single_file/unet", "unet")
}

#[test]
fn the_unet_with_linear_projections_equals_diffusers() -> Result<()> {
    unet_equals_diffusers("unet_linear", "unet_linear")
}

#[test]
fn the_dit_equals_diffusers() -> Result<()> {
    let e = expected()?;
    let model = load("dit", DIT)?;
    let config = model.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Denoiser);
    let spec = config.planes.into_option().expect("planes");
    assert_eq!(
        (spec.in_channels, spec.out_channels, spec.multiple),
        (4, 8, 2)
    );
    for case in e["dit"].as_array().expect("cases") {
        let (sample, shape) = flat(&case["sample"]);
        let conditioning = [
            case["timestep"].as_f64().unwrap() as f32,
            case["label"].as_f64().unwrap() as f32,
        ];
        let input = [Segment::Planes(planes(&sample, &shape))];
        let extras = SeqExtras {
            conditioning: RSlice::from_slice(&conditioning),
            ..SeqExtras::default()
        };
        let got = run(&model, &[chunk(&input, extras)])?;
        let err = max_error(&got, &flat(&case["prediction"]).0);
        println!(
            "DiT {shape:?} t={} y={}: max relative |Δ| {err:.2e}",
            conditioning[0], conditioning[1]
        );
        assert!(err < TOL, "DiT {shape:?} off by {err}");
    }
    // A label past the null class, a missing label, a context: refused.
    let (sample, shape) = flat(&e["dit"][0]["sample"]);
    let input = [Segment::Planes(planes(&sample, &shape))];
    for conditioning in [&[5.0f32, 11.0][..], &[5.0], &[5.0, 2.5]] {
        let extras = SeqExtras {
            conditioning: RSlice::from_slice(conditioning),
            ..SeqExtras::default()
        };
        let err = run(&model, &[chunk(&input, extras)]).unwrap_err();
        assert!(err.message.contains("class label"), "{err}");
    }
    Ok(())
}

#[test]
fn the_sd3_mmdit_equals_diffusers() -> Result<()> {
    let e = expected()?;
    let model = load("sd3", SD3)?;
    let config = model.config().into_result()?;
    assert_eq!(
        (config.kind, config.context_shape),
        (ModelKind::Denoiser, [0, 12])
    );
    for case in e["sd3"].as_array().expect("cases") {
        let (sample, shape) = flat(&case["sample"]);
        let mut conditioning = vec![case["timestep"].as_f64().unwrap() as f32];
        conditioning.extend(flat(&case["pooled"]).0);
        let context = flat(&case["context"]).0;
        let input = [Segment::Planes(planes(&sample, &shape))];
        let extras = SeqExtras {
            conditioning: RSlice::from_slice(&conditioning),
            cross: ROption::RSome(CrossContext {
                kv: 0,
                rows: RSlice::from_slice(&context),
            }),
            ..SeqExtras::default()
        };
        let got = run(&model, &[chunk(&input, extras)])?;
        let err = max_error(&got, &flat(&case["prediction"]).0);
        println!("SD3 MMDiT {shape:?}: max relative |Δ| {err:.2e}");
        assert!(err < TOL, "SD3 {shape:?} off by {err}");
    }
    // No pooled text; a grid past the trained 16 × 16 patches.
    let (sample, shape) = flat(&e["sd3"][0]["sample"]);
    let input = [Segment::Planes(planes(&sample, &shape))];
    let context = flat(&e["sd3"][0]["context"]).0;
    let cross = || {
        ROption::RSome(CrossContext {
            kv: 0,
            rows: RSlice::from_slice(&context),
        })
    };
    let t = [5.0f32];
    let extras = SeqExtras {
        conditioning: RSlice::from_slice(&t),
        cross: cross(),
        ..SeqExtras::default()
    };
    let err = run(&model, &[chunk(&input, extras)]).unwrap_err();
    assert!(err.message.contains("pooled text"), "{err}");
    let big = vec![0.0; 4 * 34 * 34];
    let input = [Segment::Planes(planes(&big, &[4, 34, 34]))];
    let conditioning = [5.0f32; 11];
    let extras = SeqExtras {
        conditioning: RSlice::from_slice(&conditioning),
        cross: cross(),
        ..SeqExtras::default()
    };
    let err = run(&model, &[chunk(&input, extras)]).unwrap_err();
    assert!(err.message.contains("larger than the trained"), "{err}");
    Ok(())
}

#[test]
fn the_flux_transformer_equals_diffusers() -> Result<()> {
    let e = expected()?;
    let model = load("flux", FLUX)?;
    let config = model.config().into_result()?;
    let spec = config.planes.into_option().expect("planes");
    assert_eq!(
        (spec.in_channels, spec.out_channels, spec.multiple),
        (4, 4, 2)
    );
    for case in e["flux"].as_array().expect("cases") {
        let (sample, shape) = flat(&case["sample"]);
        let mut conditioning = vec![
            case["timestep"].as_f64().unwrap() as f32,
            case["guidance"].as_f64().unwrap() as f32,
        ];
        conditioning.extend(flat(&case["pooled"]).0);
        let context = flat(&case["context"]).0;
        let input = [Segment::Planes(planes(&sample, &shape))];
        let extras = SeqExtras {
            conditioning: RSlice::from_slice(&conditioning),
            cross: ROption::RSome(CrossContext {
                kv: 0,
                rows: RSlice::from_slice(&context),
            }),
            ..SeqExtras::default()
        };
        let got = run(&model, &[chunk(&input, extras)])?;
        let err = max_error(&got, &flat(&case["prediction"]).0);
        println!("FLUX {shape:?}: max relative |Δ| {err:.2e}");
        assert!(err < TOL, "FLUX {shape:?} off by {err}");
    }
    // Without the guidance scale the conditioning is one value short.
    let (sample, shape) = flat(&e["flux"][0]["sample"]);
    let input = [Segment::Planes(planes(&sample, &shape))];
    let conditioning = [0.5f32; 11];
    let context = flat(&e["flux"][0]["context"]).0;
    let extras = SeqExtras {
        conditioning: RSlice::from_slice(&conditioning),
        cross: ROption::RSome(CrossContext {
            kv: 0,
            rows: RSlice::from_slice(&context),
        }),
        ..SeqExtras::default()
    };
    let err = run(&model, &[chunk(&input, extras)]).unwrap_err();
    assert!(err.message.contains("guidance scale"), "{err}");
    Ok(())
}

#[test]
fn a_contexts_keys_and_values_are_kept_exactly() -> Result<()> {
    let e = expected()?;
    let unet = load("sd/unet", UNET)?;
    let cases = cases(&e, "unet");
    let input = [Segment::Planes(planes(
        &cases[0].sample.0,
        &cases[0].sample.1,
    ))];
    let t = [cases[0].timestep];
    let with = |kv: u64, rows: &'static [f32]| SeqExtras {
        conditioning: RSlice::from_slice(&t),
        cross: ROption::RSome(CrossContext {
            kv,
            rows: RSlice::from_slice(rows),
        }),
        ..SeqExtras::default()
    };
    let first: &'static [f32] = Box::leak(cases[0].context.clone().into_boxed_slice());
    let second: &'static [f32] = Box::leak(cases[1].context.clone().into_boxed_slice());
    let fresh = run(&unet, &[chunk(&input, with(7, first))])?;
    // Kept: given again, or sent empty, the same bits come out.
    assert_eq!(run(&unet, &[chunk(&input, with(7, first))])?, fresh);
    assert_eq!(run(&unet, &[chunk(&input, with(7, &[]))])?, fresh);
    // Another context under the same sequence replaces it.
    let other = run(&unet, &[chunk(&input, with(7, second))])?;
    assert_ne!(other, fresh);
    assert_eq!(run(&unet, &[chunk(&input, with(8, second))])?, other);
    // A sequence that holds nothing must send its rows.
    let err = run(&unet, &[chunk(&input, with(9, &[]))]).unwrap_err();
    assert!(err.message.contains("holds no keys and values"), "{err}");
    // Only the most recent contexts stay.
    for kv in 10..10 + u_arch_diffusion::model::CROSS_CONTEXTS as u64 {
        run(&unet, &[chunk(&input, with(kv, first))])?;
    }
    let err = run(&unet, &[chunk(&input, with(7, &[]))]).unwrap_err();
    assert!(err.message.contains("holds no keys and values"), "{err}");
    Ok(())
}

#[test]
fn bad_input_is_a_clear_error() -> Result<()> {
    let e = expected()?;
    let unet = load("sd/unet", UNET)?;
    let case = &cases(&e, "unet")[0];
    let input = [Segment::Planes(planes(&case.sample.0, &case.sample.1))];
    let t = [case.timestep];
    let context = || {
        ROption::RSome(CrossContext {
            kv: 1,
            rows: RSlice::from_slice(&case.context),
        })
    };
    let with = |conditioning: &'static [f32], cross| SeqExtras {
        conditioning: RSlice::from_slice(conditioning),
        cross,
        ..SeqExtras::default()
    };
    let message = |chunks: &[SeqChunk<'_>]| run(&unet, chunks).unwrap_err().message.to_string();

    // No context, no timestep, two timesteps, a context of partial rows.
    let m = message(&[chunk(&input, with(&[5.0], ROption::RNone))]);
    assert!(m.contains("none given"), "{m}");
    let m = message(&[chunk(&input, with(&[], context()))]);
    assert!(m.contains("timestep"), "{m}");
    let m = message(&[chunk(&input, with(&[1.0, 2.0], context()))]);
    assert!(m.contains("timestep"), "{m}");
    let partial = ROption::RSome(CrossContext {
        kv: 1,
        rows: RSlice::from_slice(&case.context[..20]),
    });
    let m = message(&[chunk(&input, with(&[5.0], partial))]);
    assert!(m.contains("rows of 16"), "{m}");

    // Wrong channels, a size that does not halve, values that do not fill the map.
    let wrong_channels = [Segment::Planes(planes(&case.sample.0, &[8, 8, 16]))];
    let extras = SeqExtras {
        conditioning: RSlice::from_slice(&t),
        cross: context(),
        ..SeqExtras::default()
    };
    let m = message(&[chunk(&wrong_channels, extras)]);
    assert!(m.contains("8 channels"), "{m}");
    let odd = [Segment::Planes(planes(
        &case.sample.0[..4 * 15 * 16],
        &[4, 15, 16],
    ))];
    let m = message(&[chunk(&odd, with(&[5.0], context()))]);
    assert!(m.contains("multiples of 2"), "{m}");
    let short = [Segment::Planes(Planes {
        values: RSlice::from_slice(&case.sample.0[..100]),
        channels: 4,
        height: 16,
        width: 16,
    })];
    let m = message(&[chunk(&short, with(&[5.0], context()))]);
    assert!(m.contains("100 floats"), "{m}");

    // Tokens, logits, a map too large to write.
    let tokens = [Segment::Tokens(RSlice::from_slice(&[1u32, 2]))];
    let m = message(&[chunk(&tokens, with(&[5.0], context()))]);
    assert!(m.contains("one feature map"), "{m}");
    let mut logits = chunk(&input, with(&[5.0], context()));
    logits.output = Output::Logits(Rows::Last);
    let m = message(&[logits]);
    assert!(m.contains("not Logits"), "{m}");
    let huge = [Segment::Planes(Planes {
        values: RSlice::from_slice(&[]),
        channels: 4,
        height: 1 << 16,
        width: 1 << 16,
    })];
    let err = unet
        .forward(
            RSlice::from_slice(&[chunk(&huge, with(&[5.0], context()))]),
            RSliceMut::from_mut_slice(&mut []),
        )
        .into_result()
        .unwrap_err();
    assert!(err.message.contains("0 floats"), "{}", err.message);

    // A VAE takes no conditioning; a family the plugin does not build.
    let vae = load("sd/vae", VAE_DECODER)?;
    let latents = [Segment::Planes(planes(&[0.0; 4 * 8 * 8], &[4, 8, 8]))];
    let err = run(&vae, &[chunk(&latents, with(&[1.0], ROption::RNone))]).unwrap_err();
    assert!(err.message.contains("no conditioning"), "{}", err.message);
    let err = load("sd/vae", "DiTTransformer2DModel")
        .err()
        .expect("refused");
    assert!(
        err.message.contains("not `DiTTransformer2DModel`"),
        "{}",
        err.message
    );
    // The UNet's folder is not an AutoencoderKL.
    let err = load("sd/unet", VAE_DECODER).err().expect("refused");
    assert!(err.message.contains("_class_name"), "{}", err.message);
    Ok(())
}
