//! Initializers PyTorch's exporter left anonymous (`onnx::…`) are named after the node that
//! reads them: a `MatMul`'s right-hand side becomes the module's `weight`, transposed to
//! PyTorch's `[out, in]`; any other `<scope>.<node>.<input>`. Stored names still resolve, and a
//! constant read by two nodes, by an unscoped node, or whose name would clash keeps its own.
//! The graph itself (nodes, attributes, the renaming) travels as `onnx.graph` JSON.

use prost::Message;
use u_loader_onnx::{
    OnnxModel, Storage,
    proto::{
        AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, attribute_type, data_type,
    },
};
use u_sdk::MetaValue;

fn f32_tensor(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        data_type: data_type::FLOAT,
        dims: dims.to_vec(),
        raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

fn node(name: &str, op: &str, inputs: &[&str]) -> NodeProto {
    NodeProto {
        name: name.into(),
        op_type: op.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![format!("{name}_output_0")],
        ..Default::default()
    }
}

fn model(initializer: Vec<TensorProto>, nodes: Vec<NodeProto>) -> OnnxModel {
    let bytes = ModelProto {
        ir_version: 8,
        graph: Some(GraphProto {
            node: nodes,
            name: "g".into(),
            initializer,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    OnnxModel::from_bytes(bytes, None).unwrap()
}

fn floats(m: &OnnxModel, name: &str) -> Vec<f32> {
    m.tensor_f32(name).unwrap()
}

#[test]
fn anonymous_initializers_take_their_readers_scope() {
    // x·Wᵀ exported as MatMul(x, W.T): W.T = [[1, 4], [2, 5], [3, 6]] is [in 3, out 2].
    let m = model(
        vec![
            f32_tensor("onnx::MatMul_7", &[3, 2], &[1., 4., 2., 5., 3., 6.]),
            f32_tensor("onnx::Concat_9", &[1, 1, 2], &[7., 8.]),
            f32_tensor("enc.fc.bias", &[2], &[0.5, 0.5]),
            f32_tensor("onnx::Add_11", &[2], &[1., 1.]),
            f32_tensor("onnx::Mul_12", &[2], &[2., 2.]),
            f32_tensor("onnx::MatMul_13", &[2, 2], &[1., 0., 0., 1.]),
        ],
        vec![
            node("/enc/fc/MatMul", "MatMul", &["x", "onnx::MatMul_7"]),
            node(
                "/enc/fc/Add",
                "Add",
                &["enc.fc.bias", "/enc/fc/MatMul_output_0"],
            ),
            node("/enc/emb/Concat_6", "Concat", &["onnx::Concat_9", "y"]),
            // Read twice: keeps its name.
            node("/enc/a/Add", "Add", &["onnx::Add_11", "x"]),
            node("/enc/b/Add", "Add", &["onnx::Add_11", "x"]),
            // An unscoped reader: keeps its name.
            node("Mul_3", "Mul", &["onnx::Mul_12", "x"]),
            // Would be `enc.fc.weight` too: neither takes the name.
            node("/enc/fc/MatMul_1", "MatMul", &["x", "onnx::MatMul_13"]),
        ],
    );
    let w = m.tensor("enc.fc.weight");
    assert!(
        w.is_none(),
        "two MatMuls claim enc.fc.weight: neither gets it"
    );

    let m = model(
        vec![
            f32_tensor("onnx::MatMul_7", &[3, 2], &[1., 4., 2., 5., 3., 6.]),
            f32_tensor("onnx::Concat_9", &[1, 1, 2], &[7., 8.]),
            f32_tensor("onnx::Add_11", &[2], &[1., 1.]),
            f32_tensor("onnx::Mul_12", &[2], &[2., 2.]),
        ],
        vec![
            node("/enc/fc/MatMul", "MatMul", &["x", "onnx::MatMul_7"]),
            node("/enc/emb/Concat_6", "Concat", &["onnx::Concat_9", "y"]),
            node("/enc/a/Add", "Add", &["onnx::Add_11", "x"]),
            node("/enc/b/Add", "Add", &["onnx::Add_11", "x"]),
            node("Mul_3", "Mul", &["onnx::Mul_12", "x"]),
        ],
    );
    let w = m.tensor("enc.fc.weight").expect("the MatMul's weight");
    assert_eq!(w.shape, [2, 3]);
    assert_eq!(w.storage, Storage::Transposed);
    assert_eq!(floats(&m, "enc.fc.weight"), [1., 2., 3., 4., 5., 6.]);
    assert_eq!(floats(&m, "onnx::MatMul_7"), [1., 2., 3., 4., 5., 6.]);
    assert_eq!(floats(&m, "enc.emb.Concat_6.0"), [7., 8.]);
    assert_eq!(
        m.tensor("enc.emb.Concat_6.0").unwrap().storage,
        Storage::Raw
    );
    let names: Vec<&str> = m.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "enc.fc.weight",
            "enc.emb.Concat_6.0",
            "onnx::Add_11",
            "onnx::Mul_12"
        ]
    );
}

#[test]
fn the_graph_travels_as_json() {
    let mut matmul = node("/enc/fc/MatMul", "MatMul", &["x", "onnx::MatMul_7"]);
    matmul.attribute = vec![
        AttributeProto {
            name: "axis".into(),
            i: -1,
            r#type: attribute_type::INT,
            ..Default::default()
        },
        AttributeProto {
            name: "value".into(),
            t: Some(f32_tensor("", &[2], &[0.25, -1.5])),
            r#type: attribute_type::TENSOR,
            ..Default::default()
        },
        AttributeProto {
            name: "mode".into(),
            s: b"nearest".to_vec(),
            r#type: attribute_type::STRING,
            ..Default::default()
        },
    ];
    let m = model(
        vec![f32_tensor(
            "onnx::MatMul_7",
            &[3, 2],
            &[1., 4., 2., 5., 3., 6.],
        )],
        vec![matmul],
    );
    assert_eq!(m.architecture(), Some(u_loader_onnx::GRAPH_FAMILY));
    let Some(MetaValue::Json(text)) = m.metadata_value(u_loader_onnx::GRAPH_KEY) else {
        panic!("no graph");
    };
    let graph: serde_json::Value = serde_json::from_str(text).unwrap();
    let n = &graph["nodes"][0];
    assert_eq!(n["op"], "MatMul");
    assert_eq!(n["inputs"], serde_json::json!(["x", "onnx::MatMul_7"]));
    assert_eq!(n["attributes"]["axis"], -1);
    assert_eq!(n["attributes"]["mode"], "nearest");
    assert_eq!(
        n["attributes"]["value"],
        serde_json::json!({"dims": [2], "values": [0.25, -1.5], "integer": false})
    );
    assert_eq!(
        graph["renamed"]["onnx::MatMul_7"],
        serde_json::json!({"name": "enc.fc.weight", "transposed": true})
    );
}
