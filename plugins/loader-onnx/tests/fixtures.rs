//! Reads the files written by `tests/fixtures/gen_onnx.py` (the real `onnx` package) and
//! compares names, dtypes, shapes, values and storage with the script's expectations.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_loader_onnx::{OnnxModel, StdFs, Storage};
use u_sdk::{DType, MetaValue};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/onnx")
}

fn expected() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(fixtures().join("tiny_llama.expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn decoded(dtype: DType, bytes: &[u8]) -> Vec<Value> {
    bytes
        .chunks_exact(dtype.block_bytes())
        .map(|c| match dtype {
            DType::F64 => Value::from(f64::from_le_bytes(c.try_into().unwrap())),
            DType::F32 | DType::F16 | DType::BF16 => {
                Value::from(f64::from(u_sdk::convert::to_f32(dtype, c).unwrap()[0]))
            }
            DType::I8 => Value::from(c[0] as i8),
            DType::U8 => Value::from(c[0]),
            DType::I16 => Value::from(i16::from_le_bytes(c.try_into().unwrap())),
            DType::I32 => Value::from(i32::from_le_bytes(c.try_into().unwrap())),
            DType::I64 => Value::from(i64::from_le_bytes(c.try_into().unwrap())),
            other => panic!("unexpected dtype {other}"),
        })
        .collect()
}

/// Exact comparison; serde_json's float parsing may be one f64 ulp off, so narrow floats
/// compare after rounding the expectation to f32 and f64 values to within one ulp.
fn same_value(dtype: DType, got: &Value, want: &Value) -> bool {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            got.as_f64().map(|g| g as f32) == want.as_f64().map(|w| w as f32)
        }
        DType::F64 => match (got.as_f64(), want.as_f64()) {
            (Some(g), Some(w)) => (g - w).abs() <= w.abs() * f64::EPSILON,
            _ => false,
        },
        _ => got == want,
    }
}

fn check_against(model: &OnnxModel) {
    let exp = expected();
    assert_eq!(model.tensors().len(), exp.len(), "initializer count");
    for (stored, e) in &exp {
        let t = model
            .tensor(stored)
            .unwrap_or_else(|| panic!("missing tensor {stored}"));
        assert_eq!(&t.name, stored);
        assert_eq!(
            t.dtype.name(),
            e["dtype"].as_str().unwrap(),
            "{stored} dtype"
        );
        let shape: Vec<u64> = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(t.shape, shape, "{stored} shape");
        let view = model.view(stored).unwrap();
        let got = decoded(t.dtype, &view.data);
        let want = e["values"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "{stored} element count");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                same_value(t.dtype, g, w),
                "{stored}[{i}]: read {g}, expected {w}"
            );
        }
    }
}

#[test]
fn inline_initializers_match_onnx() {
    let model = OnnxModel::open(&StdFs, &fixtures().join("tiny_llama.onnx")).unwrap();
    check_against(&model);
    let storage = |n: &str| model.tensor(n).unwrap().storage;
    assert_eq!(storage("model.embed_tokens.weight"), Storage::Raw);
    assert_eq!(
        storage("model.layers.0.self_attn.v_proj.weight"),
        Storage::Raw
    );
    assert_eq!(
        storage("model.layers.0.input_layernorm.weight"),
        Storage::Typed
    );
    assert_eq!(
        storage("model.layers.0.mlp.gate_proj.weight"),
        Storage::Typed
    );
    // No config.json names it: its graph is the architecture.
    assert_eq!(model.architecture(), Some(u_loader_onnx::GRAPH_FAMILY));
    let m = |k: &str| model.metadata_value(k).cloned();
    assert_eq!(
        m("onnx.producer_name"),
        Some(MetaValue::Str("u-gen-onnx".into()))
    );
    assert_eq!(m("onnx.ir_version"), Some(MetaValue::Int(8)));
    assert_eq!(m("onnx.opset.ai.onnx"), Some(MetaValue::Int(17)));
    assert_eq!(
        m("onnx.meta.purpose"),
        Some(MetaValue::Str("u-fixture".into()))
    );
    assert_eq!(
        m("onnx.graph_name"),
        Some(MetaValue::Str("tiny_llama".into()))
    );
    assert_eq!(
        model
            .tensor_f32("model.layers.0.mlp.up_proj.weight")
            .unwrap()
            .len(),
        96
    );
}

/// Raw initializers are slices of the mapped file: their addresses differ by exactly their
/// distance in the file.
#[test]
fn raw_data_is_not_copied() {
    let path = fixtures().join("tiny_llama.onnx");
    let file = std::fs::read(&path).unwrap();
    let model = OnnxModel::open(&StdFs, &path).unwrap();
    let find = |needle: &[u8]| {
        file.windows(needle.len())
            .position(|w| w == needle)
            .expect("raw bytes appear in the file")
    };
    let raw: Vec<_> = model
        .tensors()
        .iter()
        .filter(|t| t.storage == Storage::Raw)
        .collect();
    assert!(raw.len() >= 5);
    let base_ptr = raw[0].bytes().as_ptr() as isize;
    let base_off = find(raw[0].bytes()) as isize;
    for t in &raw {
        let delta = t.bytes().as_ptr() as isize - base_ptr;
        assert_eq!(
            delta,
            find(t.bytes()) as isize - base_off,
            "{} was copied",
            t.name
        );
    }
}

#[test]
fn external_data_matches_onnx() {
    let model = OnnxModel::open(&StdFs, &fixtures().join("external/model.onnx")).unwrap();
    check_against(&model);
    let external: Vec<_> = model
        .tensors()
        .iter()
        .filter(|t| t.storage == Storage::External)
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(
        external,
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.0.mlp.down_proj.weight"
        ]
    );
    // External views are contiguous slices of one mapped weights.bin.
    let p = |n: &str| model.view(n).unwrap().data.as_ptr() as usize;
    assert_eq!(
        p("model.layers.0.self_attn.q_proj.weight") - p("model.embed_tokens.weight"),
        512
    );
    // config.json next to the model, verbatim.
    assert_eq!(model.architecture(), Some("llama"));
    let m = |k: &str| model.metadata_value(k).cloned();
    assert_eq!(m("config.rope_theta"), Some(MetaValue::Float(500000.0)));
    assert_eq!(m("config.num_key_value_heads"), Some(MetaValue::UInt(1)));
    assert_eq!(m("llama.block_count"), None, "no model-specific keys");
    assert!(model.metadata()[0].0.starts_with("config."));
}
