//! CLIP's image embedding (family `clip.vision`, issue #18) against transformers on the tiny
//! random-weight `CLIPModel` of `tests/fixtures/clip_tiny/` at the workspace root (its
//! generator, `gen_clip_tiny.py`, beside it): each image's pooled vector equals
//! `CLIPModel.get_image_features` — `post_layernorm` of the class row through
//! `visual_projection` — within [`TOL`], before and after L2 normalisation, alone and two in one
//! pass, and for the pixels PIL made from the fixture's PNG; the model is an encoder of the
//! joint space's width with the processor's spec; other outputs, a checkpoint without the
//! projection and the family asked of another checkpoint are refused.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_vit::VitArchitecture;
use u_sdk::abi_stable::std_types::{ROption, RSlice, RSliceMut};
use u_sdk::{
    Architecture, BuildContext, ImageInput, ModelBox, ModelKind, Output, Pooling, Resample, Rows,
    Segment, SeqChunk, WeightSetBox,
};

/// Stated tolerance (f32 both sides).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/clip_tiny")
}

fn weights(dir: &Path) -> Result<WeightSetBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, dir)?;
    Ok(u_loader_safetensors::SafetensorsWeights::new(m).into_box())
}

fn backend() -> Result<u_sdk::BackendBox> {
    Ok(u_kernels_cpu::CpuKernels::new(2)?.into_box())
}

fn model() -> Result<ModelBox> {
    Ok(VitArchitecture.load(weights(&fixture().join("model"))?, backend()?)?)
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

fn expected() -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixture().join("expected.json"),
    )?)?)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn normalised(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter().map(|x| x / norm).collect()
}

/// One chunk per image, each asking for `output`, in one pass.
fn encode(model: &ModelBox, images: &[&[f32]], output: Output) -> u_sdk::Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let rows = config.image.into_option().map_or(0, |s| s.rows);
    let inputs: Vec<[Segment<'_>; 1]> = images
        .iter()
        .map(|px| {
            [Segment::Image(ImageInput {
                pixels: RSlice::from_slice(px),
                rows,
            })]
        })
        .collect();
    let chunks: Vec<SeqChunk<'_>> = inputs
        .iter()
        .map(|input| SeqChunk::tokens(0, input, output))
        .collect();
    let floats: usize = chunks
        .iter()
        .map(|c| c.output.floats(rows as usize, &config))
        .sum();
    let mut out = vec![0f32; floats];
    model
        .forward(
            RSlice::from_slice(&chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

#[test]
fn the_encoder_embeds_into_the_joint_space() -> Result<()> {
    let config = model()?.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Encoder);
    assert_eq!(config.family.as_str(), "clip.vision");
    assert_eq!(
        (config.hidden, config.layers, config.vocab_size),
        (24, 2, 0)
    );
    assert_eq!(config.pooling, Pooling::Head);
    let spec = config.image.into_option().expect("an image spec");
    assert_eq!(
        (spec.channels, spec.height, spec.width, spec.rows),
        (3, 28, 28, 17)
    );
    assert_eq!((spec.shortest_edge, spec.resample), (28, Resample::Bicubic));
    assert_eq!(spec.mean, [0.481_454_66, 0.457_827_5, 0.408_210_73]);
    Ok(())
}

#[test]
fn image_features_equal_transformers() -> Result<()> {
    let model = model()?;
    let e = expected()?;
    let head = Output::Pooled(Pooling::Head);
    let pixels: Vec<Vec<f32>> = e["pixels"].as_array().unwrap().iter().map(floats).collect();
    let features: Vec<Vec<f32>> = e["image_features"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let embeddings: Vec<Vec<f32>> = e["image_embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let (mut worst, mut worst_normed) = (0f32, 0f32);
    let mut check = |got: &[f32], features: &[f32], embedding: &[f32]| {
        worst = worst.max(max_diff(got, features));
        worst_normed = worst_normed.max(max_diff(&normalised(got), embedding));
    };
    for i in 0..2 {
        let got = encode(&model, &[&pixels[i]], head)?;
        check(&got, &features[i], &embeddings[i]);
    }
    let both = encode(&model, &[&pixels[0], &pixels[1]], head)?;
    for (i, got) in both.chunks_exact(24).enumerate() {
        check(got, &features[i], &embeddings[i]);
    }
    // The PNG's pixels as PIL made them.
    let picture = &e["picture"];
    let got = encode(&model, &[&floats(&picture["pixels"])], head)?;
    check(
        &got,
        &floats(&picture["features"]),
        &floats(&picture["embedding"]),
    );
    eprintln!("clip image features: max |diff| {worst:.2e}, normalised {worst_normed:.2e}");
    assert!(worst <= TOL, "features: max |diff| {worst}");
    assert!(worst_normed <= TOL, "embeddings: max |diff| {worst_normed}");
    Ok(())
}

#[test]
fn bad_input_is_refused() -> Result<()> {
    let model = model()?;
    let pixels = floats(&expected()?["pixels"][0]);
    for output in [
        Output::Pooled(Pooling::Mean),
        Output::Pooled(Pooling::First),
        Output::Logits(Rows::All),
        Output::Hidden {
            layer: 2,
            rows: Rows::All,
        },
    ] {
        let e = encode(&model, &[&pixels], output).expect_err("refused");
        assert!(e.message.contains("one output"), "{output:?}: {e}");
    }
    let e = encode(&model, &[&pixels[1..]], Output::Pooled(Pooling::Head)).expect_err("short");
    assert!(e.message.contains("3×28×28 = 2352"), "{e}");

    // A CLIP checkpoint without `visual_projection`: a copy of the fixture whose tensor is
    // renamed in the safetensors header (same offsets).
    let dir = tempfile::tempdir()?;
    let src = fixture().join("model");
    for f in ["config.json", "preprocessor_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f))?;
    }
    let mut bytes = std::fs::read(src.join("model.safetensors"))?;
    let at = bytes
        .windows(17)
        .position(|w| w == b"visual_projection")
        .expect("the tensor's name");
    bytes[at..at + 6].copy_from_slice(b"VISUAL");
    std::fs::write(dir.path().join("model.safetensors"), &bytes)?;
    let e = VitArchitecture
        .load(weights(dir.path())?, backend()?)
        .err()
        .expect("no projection");
    assert!(e.message.contains("no `visual_projection.weight`"), "{e}");

    // `clip.vision` asked of a checkpoint that is not a CLIPModel (the bare tower).
    let tower =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/clip_vision_model");
    let built = VitArchitecture
        .build(BuildContext {
            weights: weights(&tower)?,
            family: "clip.vision".into(),
            backend: backend()?,
            fallback: ROption::RNone,
            cache: ROption::RNone,
        })
        .into_result();
    let e = built.err().expect("not a CLIP checkpoint");
    assert!(e.message.contains("model_type is `clip`"), "{e}");
    Ok(())
}
