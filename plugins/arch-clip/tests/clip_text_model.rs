//! A CLIP text tower saved alone (`CLIPTextModel`, family `clip_text_model`): Stable
//! Diffusion's `text_encoder/` of the tiny pipeline in `tests/fixtures/diffusion_tiny/sd/` at
//! the workspace root (its generator, `gen_diffusion_tiny.py`, beside it). Its final-normed
//! rows — every one of the 77, padding included, what the UNet cross-attends to — equal
//! transformers' `last_hidden_state` within [`TOL`], texts alone and batched.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_clip::ClipArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{ModelBox, Output, Pooling, Rows, Segment, SeqChunk};

/// Stated tolerance (f32 both sides).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny")
}

fn model() -> Result<ModelBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &fixture().join("sd/text_encoder"),
    )?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(ClipArchitecture.load(weights, backend)?)
}

struct Text {
    ids: Vec<u32>,
    hidden: Vec<f32>,
}

fn texts() -> Result<Vec<Text>> {
    let e: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    Ok(e["text_encoder"]
        .as_array()
        .expect("text_encoder")
        .iter()
        .map(|t| Text {
            ids: serde_json::from_value(t["ids"].clone()).expect("ids"),
            hidden: t["hidden"]
                .as_array()
                .expect("rows")
                .iter()
                .flat_map(|r| r.as_array().expect("row").clone())
                .map(|v| v.as_f64().expect("value") as f32)
                .collect(),
        })
        .collect())
}

fn rows(model: &ModelBox, texts: &[&Text]) -> Result<Vec<f32>> {
    let inputs: Vec<[Segment<'_>; 1]> = texts
        .iter()
        .map(|t| [Segment::Tokens(RSlice::from_slice(&t.ids))])
        .collect();
    let output = Output::Hidden {
        layer: 2,
        rows: Rows::All,
    };
    let chunks: Vec<SeqChunk<'_>> = inputs
        .iter()
        .map(|i| SeqChunk::tokens(0, i, output))
        .collect();
    let mut out = vec![f32::NAN; texts.iter().map(|t| t.ids.len() * 16).sum()];
    model
        .forward(
            RSlice::from_slice(&chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

#[test]
fn the_rows_equal_transformers_last_hidden_state() -> Result<()> {
    let model = model()?;
    let config = model.config().into_result()?;
    assert_eq!(config.family.as_str(), "clip_text_model");
    assert_eq!((config.hidden, config.context_length), (16, 77));
    assert_eq!(config.pooling, Pooling::Head);
    let texts = texts()?;
    assert_eq!(texts.len(), 3);
    for t in &texts {
        let got = rows(&model, &[t])?;
        let d = got
            .iter()
            .zip(&t.hidden)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{} ids: max |Δ| {d:.2e}", t.ids.len());
        assert!(d < TOL, "off by {d}");
    }
    let all: Vec<&Text> = texts.iter().collect();
    let together = rows(&model, &all)?;
    let alone: Vec<f32> = all
        .iter()
        .map(|t| rows(&model, &[t]))
        .collect::<Result<Vec<_>>>()?
        .concat();
    assert_eq!(together, alone, "batched texts are computed as alone");
    Ok(())
}
