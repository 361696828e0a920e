//! A CLIP text tower saved alone (`CLIPTextModel`, family `clip_text_model`): Stable
//! Diffusion's `text_encoder/` of the tiny pipeline in `tests/fixtures/diffusion_tiny/sd/` at
//! the workspace root (its generator, `gen_diffusion_tiny.py`, beside it). Its final-normed
//! rows — every one of the 77, padding included, what the UNet cross-attends to — equal
//! transformers' `last_hidden_state` within [`TOL`], texts alone and batched; so does the same
//! tower read from `sd_single_file/`'s single-file checkpoint.

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
    build(m)
}

/// The same tower inside `sd_single_file/`'s checkpoint (under
/// `cond_stage_model.transformer.text_model.`), with the text encoder's `config.json`, as the
/// host presents a single-file checkpoint's component.
fn single_file_model() -> Result<ModelBox> {
    let folder = fixture().join("sd_single_file");
    let config = std::fs::read(folder.join("text_encoder/config.json"))?;
    let checkpoint = std::fs::read(folder.join("tiny-sd-ldm.safetensors"))?;
    build(u_loader_safetensors::SafetensorsModel::from_bytes(
        checkpoint,
        Some(&config),
    )?)
}

/// An SD 2.x single-file checkpoint's text tower is OpenCLIP's, which arch-clip does not read:
/// it says so rather than reporting a missing tensor.
#[test]
fn an_open_clip_tower_is_refused_by_name() -> Result<()> {
    let header = br#"{"cond_stage_model.model.ln_final.weight":{"dtype":"F32","shape":[16],"data_offsets":[0,64]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0; 64]);
    let config = std::fs::read(fixture().join("sd_single_file/text_encoder/config.json"))?;
    let m = u_loader_safetensors::SafetensorsModel::from_bytes(file, Some(&config))?;
    let err = build(m).err().expect("refused").to_string();
    assert!(err.contains("OpenCLIP's layout"), "{err}");
    Ok(())
}

fn build(m: u_loader_safetensors::SafetensorsModel) -> Result<ModelBox> {
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
    rows_equal_transformers(&model()?)
}

#[test]
fn a_single_file_checkpoints_tower_equals_transformers() -> Result<()> {
    rows_equal_transformers(&single_file_model()?)
}

fn rows_equal_transformers(model: &ModelBox) -> Result<()> {
    let config = model.config().into_result()?;
    assert_eq!(config.family.as_str(), "clip_text_model");
    assert_eq!((config.hidden, config.context_length), (16, 77));
    assert_eq!(config.pooling, Pooling::Head);
    let texts = texts()?;
    assert_eq!(texts.len(), 3);
    for t in &texts {
        let got = rows(model, &[t])?;
        let d = got
            .iter()
            .zip(&t.hidden)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{} ids: max |Δ| {d:.2e}", t.ids.len());
        assert!(d < TOL, "off by {d}");
    }
    let all: Vec<&Text> = texts.iter().collect();
    let together = rows(model, &all)?;
    let alone: Vec<f32> = all
        .iter()
        .map(|t| rows(model, &[t]))
        .collect::<Result<Vec<_>>>()?
        .concat();
    assert_eq!(together, alone, "batched texts are computed as alone");
    Ok(())
}
