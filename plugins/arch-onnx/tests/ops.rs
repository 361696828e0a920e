//! Every operator arch-onnx implements, against onnxruntime: a small graph
//! (`tests/fixtures/onnx_ops/ops.onnx` at the workspace root, made with its outputs by
//! `gen_onnx_ops.py`) runs `Constant`, a strided `Conv` without bias, `Relu`, `Tanh`,
//! `Transpose`, `MatMul`, `Neg`, `Exp`, `Identity`, `Reshape`, `Gemm` (alpha, beta, B not
//! transposed), `Unsqueeze`, the broadcast arithmetic, `Sqrt`, `Log`, `Reciprocal`, `Sin`,
//! `Cos`, `Split` by sizes, `Concat`, `Softmax` on either axis, `Clip` with one bound, `Cast`
//! both ways, `Shape` from an axis, `AveragePool`, `Resize`, `InstanceNormalization`, `Sigmoid`,
//! a lone `Einsum` and `Squeeze`; each output equals onnxruntime's within 1e-5. Graphs the
//! plugin cannot run are refused when they load, naming what is missing; values a graph
//! cannot take are errors naming the node.

use anyhow::Result;
use prost::Message;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use u_arch_onnx::{
    Graph,
    value::{Array, Value},
};
use u_loader_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto, attribute_type,
    data_type,
};
use u_sdk::nn::Device;

const TOL: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/onnx_ops")
}

fn device() -> Result<Device> {
    Ok(Device::new(u_kernels_cpu::CpuKernels::new(2)?.into_box())?)
}

fn load(model: u_loader_onnx::OnnxModel) -> u_sdk::Result<(Graph, Device)> {
    let device = device().expect("kernels");
    let weights = u_sdk::weights::SharedWeights::new(model).into_box();
    Ok((Graph::load(&weights, &device)?, device))
}

fn floats(v: &Json) -> Vec<f32> {
    v.as_array()
        .expect("numbers")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

#[test]
fn every_operator_equals_onnxruntime() -> Result<()> {
    let model =
        u_loader_onnx::OnnxModel::open(&u_loader_onnx::StdFs, &fixtures().join("ops.onnx"))?;
    let (graph, device) = load(model)?;
    let expected: Json = serde_json::from_slice(&std::fs::read(fixtures().join("expected.json"))?)?;
    let feeds = vec![
        Value::F32(Array::new(
            vec![2, 2, 4, 4],
            floats(&expected["inputs"]["x"]),
        )?),
        Value::F32(Array::new(vec![2], floats(&expected["inputs"]["t"]))?),
    ];
    let outputs = graph.run(&device, feeds)?;
    assert_eq!(outputs.len(), graph.outputs.len());
    for (port, got) in graph.outputs.iter().zip(&outputs) {
        let want = &expected["outputs"][&port.name];
        let dims: Vec<usize> = want["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let got = got.floats(&port.name)?;
        assert_eq!(got.dims, dims, "{}", port.name);
        let worst = got
            .data
            .iter()
            .zip(want["values"].as_array().unwrap())
            .map(|(a, b)| (f64::from(*a) - b.as_f64().unwrap()).abs())
            .fold(0.0, f64::max);
        eprintln!("{:<10} max |Δ| {worst:.2e}", port.name);
        assert!(worst <= TOL, "{}: {worst}", port.name);
    }
    Ok(())
}

fn node(op: &str, inputs: &[&str], outputs: &[&str], attributes: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute: attributes,
        ..Default::default()
    }
}

fn int(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        i,
        r#type: attribute_type::INT,
        ..Default::default()
    }
}

fn weight(name: &str, dims: &[i64]) -> TensorProto {
    let n: i64 = dims.iter().product();
    TensorProto {
        name: name.into(),
        data_type: data_type::FLOAT,
        dims: dims.to_vec(),
        raw_data: (0..n)
            .flat_map(|i| (i as f32 * 0.1).to_le_bytes())
            .collect(),
        ..Default::default()
    }
}

/// The error loading a one-graph model of `nodes` gives.
fn refusal(nodes: Vec<NodeProto>, initializer: Vec<TensorProto>) -> String {
    let bytes = ModelProto {
        ir_version: 9,
        graph: Some(GraphProto {
            node: nodes,
            name: "g".into(),
            initializer,
            input: vec![ValueInfoProto {
                name: "x".into(),
                r#type: None,
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let model = u_loader_onnx::OnnxModel::from_bytes(bytes, None).expect("a model");
    match load(model) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.message.to_string(),
    }
}

#[test]
fn graphs_it_cannot_run_are_refused_by_name() {
    // What diffusers' exported VAE encoder draws its latent with.
    let e = refusal(
        vec![node("RandomNormalLike", &["x"], &["y"], vec![])],
        vec![],
    );
    assert!(e.contains("`RandomNormalLike` is not implemented"), "{e}");
    let e = refusal(
        vec![node("Conv", &["x", "w"], &["y"], vec![int("group", 2)])],
        vec![weight("w", &[2, 1, 3, 3])],
    );
    assert!(e.contains("grouped Conv"), "{e}");
    let e = refusal(vec![node("Conv", &["x", "w"], &["y"], vec![])], vec![]);
    assert!(e.contains("reads `w`"), "{e}");
    let e = refusal(
        vec![node(
            "Softmax",
            &["x"],
            &["y"],
            vec![int("axis", 1), int("extra", 0)],
        )],
        vec![],
    );
    assert!(e.contains("`extra`"), "{e}");
    let e = refusal(
        vec![node(
            "Einsum",
            &["x", "x"],
            &["y"],
            vec![AttributeProto {
                name: "equation".into(),
                s: b"ij,jk->ik".to_vec(),
                r#type: attribute_type::STRING,
                ..Default::default()
            }],
        )],
        vec![],
    );
    assert!(e.contains("ij,jk->ik"), "{e}");
}

#[test]
fn values_the_graph_cannot_take_are_errors() -> Result<()> {
    let model =
        u_loader_onnx::OnnxModel::open(&u_loader_onnx::StdFs, &fixtures().join("ops.onnx"))?;
    let (graph, device) = load(model)?;
    let run = |x: Vec<usize>, t: usize| {
        let n: usize = x.iter().product();
        graph.run(
            &device,
            vec![
                Value::F32(Array::new(x, vec![0.5; n]).unwrap()),
                Value::F32(Array::new(vec![t], vec![1.0; t]).unwrap()),
            ],
        )
    };
    let e = run(vec![2, 3, 4, 4], 2).unwrap_err();
    assert!(
        e.message.contains("Mul") && e.message.contains("broadcast"),
        "{}",
        e.message
    );
    let e = run(vec![2, 2, 4, 4], 3).unwrap_err();
    assert!(e.message.contains("broadcast"), "{}", e.message);
    let e = run(vec![2, 2, 1, 1], 2).unwrap_err();
    assert!(e.message.contains("Gemm (node"), "{}", e.message);
    // An empty batch or empty maps: an answer or an error, never a panic.
    for x in [vec![0, 2, 4, 4], vec![2, 2, 0, 4]] {
        if let Err(e) = run(x, 2) {
            assert!(!e.message.is_empty());
        }
    }
    Ok(())
}
