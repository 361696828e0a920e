//! The graphs of a diffusers ONNX pipeline folder (`tests/fixtures/diffusion_tiny/sd_onnx/` at
//! the workspace root, the tiny Stable Diffusion of `sd/` exported as diffusers' conversion
//! script exports it, by `gen_onnx_pipeline.py`): the CLIP text encoder (token embedding
//! `Gather`, the causal mask built from `Range`/`Trilu`/`Equal`/`Where`, LayerNorm as
//! `ReduceMean`, attention as `MatMul` of computed operands, the pooled row picked by `ArgMax`),
//! the UNet (`Slice`d GEGLU halves through `Erf`, the timestep `Expand`ed to the batch) and the
//! VAE decoder each run whole and equal onnxruntime within [`TOL`] of the output's scale.

use anyhow::Result;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use u_arch_onnx::{
    Graph,
    value::{Array, Value},
};
use u_sdk::nn::Device;

/// Stated tolerance on `max |Δ| / max(1, max |expected|)`.
const TOL: f64 = 1e-5;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/diffusion_tiny")
}

fn expected() -> Result<Json> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixture().join("onnx_expected.json"),
    )?)?)
}

fn graph(component: &str) -> Result<(Graph, Device)> {
    let model = u_loader_onnx::OnnxModel::open(
        &u_loader_onnx::StdFs,
        &fixture().join("sd_onnx").join(component).join("model.onnx"),
    )?;
    let device = Device::new(u_kernels_cpu::CpuKernels::new(2)?.into_box())?;
    let weights = u_sdk::weights::SharedWeights::new(model).into_box();
    Ok((Graph::load(&weights, &device)?, device))
}

/// A nested JSON array, flattened, with its shape.
fn flat(v: &Json) -> (Vec<f32>, Vec<usize>) {
    match v {
        Json::Array(items) => {
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
        Json::Number(n) => (vec![n.as_f64().expect("number") as f32], vec![]),
        other => panic!("not a number array: {other}"),
    }
}

fn floats(v: &Json) -> Result<Value> {
    let (data, dims) = flat(v);
    Ok(Value::F32(Array::new(dims, data)?))
}

fn check(what: &str, got: &Value, want: &Json, batch_of_one: bool) -> Result<()> {
    let (want, mut dims) = flat(want);
    if batch_of_one {
        dims.insert(0, 1);
    }
    let got = got.floats(what)?;
    assert_eq!(got.dims, dims, "{what}");
    let scale = want.iter().fold(1f64, |m, v| m.max(f64::from(v.abs())));
    let worst = got
        .data
        .iter()
        .zip(&want)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max)
        / scale;
    eprintln!("{what:<32} max relative |Δ| {worst:.2e}");
    assert!(worst <= TOL, "{what}: {worst}");
    Ok(())
}

#[test]
fn the_text_encoder_graph_equals_onnxruntime() -> Result<()> {
    let e = &expected()?["text_encoder"];
    let (graph, device) = graph("text_encoder")?;
    let ids: Vec<i64> = serde_json::from_value(e["input_ids"].clone())?;
    let out = graph.run(
        &device,
        vec![Value::I64(Array::new(vec![1, ids.len()], ids)?)],
    )?;
    check(
        "text_encoder last_hidden_state",
        &out[0],
        &e["last_hidden_state"],
        true,
    )?;
    check(
        "text_encoder pooler_output",
        &out[1],
        &e["pooler_output"],
        true,
    )
}

#[test]
fn the_unet_graph_equals_onnxruntime() -> Result<()> {
    let e = &expected()?["unet"];
    let (graph, device) = graph("unet")?;
    let timestep = e["timestep"].as_f64().expect("timestep") as f32;
    let out = graph.run(
        &device,
        vec![
            floats(&e["sample"])?,
            Value::F32(Array::new(vec![1], vec![timestep])?),
            floats(&e["context"])?,
        ],
    )?;
    check("unet out_sample", &out[0], &e["out_sample"], false)
}

#[test]
fn the_vae_decoder_graph_equals_onnxruntime() -> Result<()> {
    let e = &expected()?["vae_decoder"];
    let (graph, device) = graph("vae_decoder")?;
    let (latents, mut dims) = flat(&e["latent_sample"]);
    dims.insert(0, 1);
    let out = graph.run(&device, vec![Value::F32(Array::new(dims, latents)?)])?;
    check("vae_decoder sample", &out[0], &e["sample"], true)
}
