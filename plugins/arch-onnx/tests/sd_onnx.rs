//! The graphs of a diffusers ONNX pipeline folder (`tests/fixtures/diffusion_tiny/sd_onnx/` at
//! the workspace root, the tiny Stable Diffusion of `sd/` exported as diffusers' conversion
//! script exports it, by `gen_onnx_pipeline.py`): the CLIP text encoder (token embedding
//! `Gather`, the causal mask built from `Range`/`Trilu`/`Equal`/`Where`, LayerNorm as
//! `ReduceMean`, attention as `MatMul` of computed operands, the pooled row picked by `ArgMax`),
//! the UNet (`Slice`d GEGLU halves through `Erf`, the timestep `Expand`ed to the batch) and the
//! VAE decoder each run whole and equal onnxruntime within [`TOL`] of the output's scale.
//! Through the ABI, their signatures make the text encoder a token encoder (rows and pooled
//! row), the UNet a denoiser with a cross-attention context (its free channels read from its
//! first `Conv`), and the VAE decoder an autoencoder whose scale is measured at build.

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

/// The graph of `component` as the ABI's model.
fn model(component: &str) -> Result<u_arch_onnx::GraphModel> {
    let model = u_loader_onnx::OnnxModel::open(
        &u_loader_onnx::StdFs,
        &fixture().join("sd_onnx").join(component).join("model.onnx"),
    )?;
    let weights = u_sdk::weights::SharedWeights::new(model).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(u_arch_onnx::OnnxArchitecture.load(weights, backend)?)
}

fn near(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale;
    eprintln!("{what:<32} max relative |Δ| {worst:.2e}");
    assert!(f64::from(worst) <= TOL, "{what}: {worst}");
}

/// The text encoder's signature (ids in, rows out) makes it an encoder: its rows are
/// `Hidden` at its one layer, its pooled row `Pooled(Head)`.
#[test]
fn the_text_encoder_is_a_token_encoder() -> Result<()> {
    use u_sdk::{ModelKind, Output, Pooling, Rows, Segment, SeqChunk};
    let e = &expected()?["text_encoder"];
    let model = model("text_encoder")?;
    let config = model.model_config();
    assert_eq!(
        (
            config.kind,
            config.hidden,
            config.layers,
            config.context_length
        ),
        (ModelKind::Encoder, 16, 1, 0)
    );
    let ids: Vec<u32> = serde_json::from_value(e["input_ids"].clone())?;
    let input = [Segment::Tokens(
        u_sdk::abi_stable::std_types::RSlice::from_slice(&ids),
    )];
    let hidden = Output::Hidden {
        layer: 1,
        rows: Rows::All,
    };
    let chunks = [
        SeqChunk::tokens(0, &input, hidden),
        SeqChunk::tokens(1, &input, Output::Pooled(Pooling::Head)),
    ];
    let mut out = vec![f32::NAN; ids.len() * 16 + 16];
    model.forward(&chunks, &mut out)?;
    near(
        "rows",
        &out[..ids.len() * 16],
        &flat(&e["last_hidden_state"]).0,
    );
    near(
        "pooled",
        &out[ids.len() * 16..],
        &flat(&e["pooler_output"]).0,
    );
    let other = [SeqChunk::tokens(
        0,
        &input,
        Output::Hidden {
            layer: 0,
            rows: Rows::All,
        },
    )];
    let err = model
        .forward(&other, &mut out[..ids.len() * 16])
        .unwrap_err();
    assert!(err.message.contains("last layer's rows"), "{}", err.message);
    Ok(())
}

/// The UNet's signature: a map, its timestep (conditioning) and `encoder_hidden_states` (the
/// chunk's cross-attention context); its free channels read from its first `Conv`, its scale
/// measured. Two chunks run as one batch equal onnxruntime's batch of two.
#[test]
fn the_unet_is_a_denoiser_with_a_context() -> Result<()> {
    use u_sdk::abi_stable::std_types::{ROption, RSlice};
    use u_sdk::{CrossContext, ModelKind, Output, Planes, Segment, SeqChunk, SeqExtras};
    let e = &expected()?["unet"];
    let model = model("unet")?;
    let config = model.model_config();
    assert_eq!(
        (config.kind, config.context_shape),
        (ModelKind::Denoiser, [0, 16])
    );
    let spec = config.planes.into_option().expect("planes");
    assert_eq!(
        (spec.in_channels, spec.out_channels, spec.scale),
        (4, 4, [1, 1])
    );
    let (sample, _) = flat(&e["sample"]);
    let (context, _) = flat(&e["context"]);
    let t = [e["timestep"].as_f64().expect("timestep") as f32];
    let chunk = |i: usize| {
        let planes = Planes {
            values: RSlice::from_slice(&sample[i * 256..(i + 1) * 256]),
            channels: 4,
            height: 8,
            width: 8,
        };
        (planes, &context[i * 80..(i + 1) * 80])
    };
    let parts = [chunk(0), chunk(1)];
    let inputs: Vec<[Segment<'_>; 1]> = parts.iter().map(|p| [Segment::Planes(p.0)]).collect();
    let chunks: Vec<SeqChunk<'_>> = parts
        .iter()
        .zip(&inputs)
        .map(|(p, input)| SeqChunk {
            seq: 0,
            input: RSlice::from_slice(input),
            output: Output::Planes,
            extras: SeqExtras {
                conditioning: RSlice::from_slice(&t),
                cross: ROption::RSome(CrossContext {
                    kv: 1,
                    rows: RSlice::from_slice(p.1),
                }),
                ..SeqExtras::default()
            },
        })
        .collect();
    let mut out = vec![f32::NAN; 512];
    model.forward(&chunks, &mut out)?;
    near("unet through the ABI", &out, &flat(&e["out_sample"]).0);
    let alone = SeqChunk {
        extras: SeqExtras {
            conditioning: RSlice::from_slice(&t),
            ..SeqExtras::default()
        },
        ..chunks[0]
    };
    let err = model.forward(&[alone], &mut out[..256]).unwrap_err();
    assert!(err.message.contains("give one"), "{}", err.message);
    Ok(())
}

/// The VAE decoder's signature: an autoencoder whose doubling (its export leaves every size
/// free) is measured at build.
#[test]
fn the_vae_decoder_is_an_autoencoder_of_measured_scale() -> Result<()> {
    use u_sdk::abi_stable::std_types::RSlice;
    use u_sdk::{ModelKind, Output, Planes, Segment, SeqChunk, SeqExtras};
    let e = &expected()?["vae_decoder"];
    let model = model("vae_decoder")?;
    let config = model.model_config();
    assert_eq!(config.kind, ModelKind::Autoencoder);
    let spec = config.planes.into_option().expect("planes");
    assert_eq!(
        (spec.in_channels, spec.out_channels, spec.scale),
        (4, 3, [2, 1])
    );
    let (latents, _) = flat(&e["latent_sample"]);
    let input = [Segment::Planes(Planes {
        values: RSlice::from_slice(&latents),
        channels: 4,
        height: 6,
        width: 8,
    })];
    let chunk = SeqChunk {
        seq: 0,
        input: RSlice::from_slice(&input),
        output: Output::Planes,
        extras: SeqExtras::default(),
    };
    let mut out = vec![f32::NAN; 3 * 12 * 16];
    model.forward(&[chunk], &mut out)?;
    near("vae_decoder through the ABI", &out, &flat(&e["sample"]).0);
    Ok(())
}
