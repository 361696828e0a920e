//! arch-vit against transformers on tiny random-weight towers of every family
//! (`tests/fixtures/gen_vision_tiny.py`): the final rows (`last_hidden_state`), the state after
//! block 0 (`hidden_states[1]`) and the family's pooled output (`pooler_output`) of one image,
//! within 1e-4; two images in one pass give each its own answer; the image processor's settings
//! reach the model's `ImageSpec`; bad input is refused.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_vit::VitArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{
    ImageInput, ModelBox, ModelConfig, ModelKind, Output, Pooling, Resample, Rows, Segment,
    SeqChunk,
};

/// Stated tolerance.
const TOL: f32 = 1e-4;
const FAMILIES: [&str; 4] = ["vit", "clip_vision_model", "siglip_vision_model", "dinov2"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn model(family: &str) -> Result<ModelBox> {
    let dir = fixtures().join("models").join(family);
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, &dir)?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(VitArchitecture.load(weights, backend)?)
}

fn expected() -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixtures().join("vision_tiny_expected.json"),
    )?)?)
}

fn floats(v: &Value) -> Vec<f32> {
    fn flat(v: &Value, out: &mut Vec<f32>) {
        match v {
            Value::Array(a) => a.iter().for_each(|x| flat(x, out)),
            Value::Number(n) => out.push(n.as_f64().unwrap_or(f64::NAN) as f32),
            _ => {}
        }
    }
    let mut out = Vec::new();
    flat(v, &mut out);
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Runs one chunk per `(pixels, output)` in one pass and splits the answers.
fn run(
    model: &ModelBox,
    config: &ModelConfig,
    images: &[(&[f32], Output)],
) -> Result<Vec<Vec<f32>>> {
    let rows = config.image.into_option().unwrap().rows;
    let inputs: Vec<[Segment<'_>; 1]> = images
        .iter()
        .map(|(px, _)| {
            [Segment::Image(ImageInput {
                pixels: RSlice::from_slice(px),
                rows,
            })]
        })
        .collect();
    let chunks: Vec<SeqChunk<'_>> = inputs
        .iter()
        .zip(images)
        .map(|(input, (_, output))| SeqChunk::tokens(0, input, *output))
        .collect();
    let sizes: Vec<usize> = images
        .iter()
        .map(|(_, o)| o.floats(rows as usize, config))
        .collect();
    let mut out = vec![0f32; sizes.iter().sum()];
    model
        .forward(
            RSlice::from_slice(&chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    let mut at = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            at += n;
            out[at - n..at].to_vec()
        })
        .collect())
}

#[test]
fn every_family_equals_transformers() -> Result<()> {
    let e = expected()?;
    let pixels = floats(&e["pixels"]);
    for family in FAMILIES {
        let want = &e["families"][family];
        let model = model(family)?;
        let config = model.config().into_result()?;
        assert_eq!(config.kind, ModelKind::Encoder);
        assert_eq!(config.family.as_str(), family);
        assert_eq!(config.pooling, Pooling::Head, "{family}");
        let last = Output::Hidden {
            layer: config.layers,
            rows: Rows::All,
        };
        let first_block = Output::Hidden {
            layer: 0,
            rows: Rows::All,
        };
        let got = run(
            &model,
            &config,
            &[
                (&pixels, last),
                (&pixels, first_block),
                (&pixels, Output::Pooled(Pooling::Head)),
            ],
        )?;
        let checks = [
            ("last_hidden_state", &got[0]),
            ("hidden_1", &got[1]),
            ("pooler_output", &got[2]),
        ];
        for (name, got) in checks {
            let d = max_diff(got, &floats(&want[name]));
            eprintln!("{family} {name}: max |diff| {d:.2e}");
            assert!(d < TOL, "{family} {name}: {d}");
        }
        let rows = if family == "siglip_vision_model" {
            16
        } else {
            17
        };
        assert_eq!(got[0].len(), rows * 32, "{family}");
    }
    Ok(())
}

#[test]
fn images_in_one_pass_are_encoded_apart() -> Result<()> {
    let e = expected()?;
    let pixels = floats(&e["pixels"]);
    let flipped: Vec<f32> = pixels.iter().rev().copied().collect();
    for family in FAMILIES {
        let model = model(family)?;
        let config = model.config().into_result()?;
        let pooled = Output::Pooled(Pooling::Head);
        let alone = run(&model, &config, &[(&flipped, pooled)])?;
        let both = run(&model, &config, &[(&pixels, pooled), (&flipped, pooled)])?;
        let want = floats(&e["families"][family]["pooler_output"]);
        assert!(max_diff(&both[0], &want) < TOL, "{family}");
        assert!(max_diff(&both[1], &alone[0]) < 1e-5, "{family}");
        assert!(
            max_diff(&both[0], &both[1]) > 1e-2,
            "{family}: the images look alike"
        );
        // The plain poolings read the final rows.
        let rows = run(
            &model,
            &config,
            &[
                (
                    &pixels,
                    Output::Hidden {
                        layer: config.layers,
                        rows: Rows::All,
                    },
                ),
                (&pixels, Output::Pooled(Pooling::First)),
                (&pixels, Output::Pooled(Pooling::Mean)),
            ],
        )?;
        assert_eq!(rows[1], rows[0][..32]);
        let n = rows[0].len() / 32;
        let mean: Vec<f32> = (0..32)
            .map(|c| (0..n).map(|r| rows[0][r * 32 + c]).sum::<f32>() / n as f32)
            .collect();
        assert!(max_diff(&rows[2], &mean) < 1e-5, "{family}");
    }
    Ok(())
}

#[test]
fn processor_settings_reach_the_image_spec() -> Result<()> {
    let spec = |f: &str| -> Result<_> {
        Ok(model(f)?
            .config()
            .into_result()?
            .image
            .into_option()
            .unwrap())
    };
    let clip = spec("clip_vision_model")?;
    assert_eq!(
        (clip.channels, clip.height, clip.width, clip.rows),
        (3, 32, 32, 17)
    );
    assert_eq!(clip.shortest_edge, 32);
    assert_eq!(clip.resample, Resample::Bicubic);
    assert_eq!(clip.mean, [0.481_454_66, 0.457_827_5, 0.408_210_73]);
    assert!((clip.rescale - 1.0 / 255.0).abs() < 1e-9);
    let vit = spec("vit")?;
    assert_eq!((vit.shortest_edge, vit.resample), (0, Resample::Bilinear));
    assert_eq!((vit.mean, vit.std), ([0.5; 3], [0.5; 3]));
    let siglip = spec("siglip_vision_model")?;
    assert_eq!((siglip.rows, siglip.resample), (16, Resample::Bicubic));
    // No processor file: DINOv2's own defaults (ImageNet statistics).
    let dino = spec("dinov2")?;
    assert_eq!(dino.mean, [0.485, 0.456, 0.406]);
    Ok(())
}

#[test]
fn bad_input_is_refused() -> Result<()> {
    let e = expected()?;
    let pixels = floats(&e["pixels"]);
    let model = model("vit")?;
    let config = model.config().into_result()?;
    let pooled = Output::Pooled(Pooling::Head);
    let short = &pixels[..pixels.len() - 1];
    let err = run(&model, &config, &[(short, pooled)]).unwrap_err();
    assert!(err.to_string().contains("3×32×32"), "{err}");
    let mut nan = pixels.clone();
    nan[5] = f32::NAN;
    let err = run(&model, &config, &[(&nan, pooled)]).unwrap_err();
    assert!(err.to_string().contains("non-finite"), "{err}");
    let err = run(&model, &config, &[(&pixels, Output::Logits(Rows::Last))]).unwrap_err();
    assert!(err.to_string().contains("not logits"), "{err}");
    // Wrong row count, and tokens instead of an image.
    let input = [Segment::Image(ImageInput {
        pixels: RSlice::from_slice(&pixels),
        rows: 16,
    })];
    let tokens = [Segment::Tokens(RSlice::from_slice(&[1u32, 2]))];
    for input in [&input[..], &tokens[..]] {
        let chunk = [SeqChunk::tokens(0, input, pooled)];
        let mut out = vec![0f32; 32];
        let err = model
            .forward(
                RSlice::from_slice(&chunk),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()
            .unwrap_err();
        assert!(
            err.message.contains("rows") || err.message.contains("no tokens"),
            "{}",
            err.message
        );
    }
    Ok(())
}
