//! Malformed input gets a clear error, never a panic or a huge allocation: every truncation of
//! real files, byte flips, protobuf garbage, and hand-made broken initializers and external
//! references.

use prost::Message;
use std::path::{Path, PathBuf};
use u_loader_onnx::{
    Error, OnnxModel, StdFs,
    proto::{GraphProto, ModelProto, StringStringEntryProto, TensorProto, data_type},
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/onnx")
}

/// Every initializer's (name, bytes), for comparing a parse with the intact file.
fn contents(m: &OnnxModel) -> Vec<(String, Vec<u8>)> {
    m.tensors()
        .iter()
        .map(|t| (t.name.clone(), t.bytes().to_vec()))
        .collect()
}

#[test]
fn every_truncation_fails_or_keeps_every_initializer() {
    let full = std::fs::read(fixtures().join("tiny_llama.onnx")).unwrap();
    let whole = contents(&OnnxModel::from_bytes(full.clone(), None).unwrap());
    let mut failures = 0;
    for len in 0..full.len() {
        match OnnxModel::from_bytes(full[..len].to_vec(), None) {
            // Protobuf has no end marker: a cut between top-level fields after the graph
            // (opset, metadata) is a valid, smaller model. It must still hold every weight.
            Ok(m) => assert_eq!(contents(&m), whole, "truncated to {len}"),
            Err(_) => failures += 1,
        }
    }
    assert!(
        failures > full.len() * 9 / 10,
        "only {failures} of {} failed",
        full.len()
    );
}

#[test]
fn byte_flips_and_garbage_never_panic() {
    let full = std::fs::read(fixtures().join("tiny_llama.onnx")).unwrap();
    for i in 0..full.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut bytes = full.clone();
            bytes[i] ^= mask;
            if let Ok(m) = OnnxModel::from_bytes(bytes, None) {
                for t in m.tensors() {
                    let want = t.dtype.bytes_for(t.shape.iter().product()).unwrap();
                    assert_eq!(t.bytes().len() as u64, want, "{}", t.name);
                }
            }
        }
    }
    // Deterministic pseudo-random garbage.
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for n in 0..2000usize {
        let bytes: Vec<u8> = (0..n % 300)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let _ = OnnxModel::from_bytes(bytes, None);
    }
}

fn model_with(tensors: Vec<TensorProto>) -> Vec<u8> {
    ModelProto {
        ir_version: 8,
        graph: Some(GraphProto {
            name: "g".into(),
            initializer: tensors,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn tensor(name: &str, data_type: i32, dims: &[i64]) -> TensorProto {
    TensorProto {
        name: name.into(),
        data_type,
        dims: dims.to_vec(),
        ..Default::default()
    }
}

#[test]
fn malformed_initializers_are_refused() {
    let mut cases: Vec<(TensorProto, &str)> = vec![
        (tensor("a", data_type::FLOAT, &[-1]), "negative dimension"),
        (
            tensor("a", data_type::FLOAT, &[i64::MAX, i64::MAX]),
            "overflows",
        ),
        (tensor("a", data_type::FLOAT, &[1 << 62]), "overflows"),
        (
            tensor("a", data_type::STRING, &[1]),
            "STRING (8) is not supported",
        ),
        (tensor("a", 99, &[1]), "unknown (99)"),
        (
            tensor("a", data_type::FLOAT, &[2]),
            "float_data holds 0 values",
        ),
    ];
    let mut t = tensor("a", data_type::FLOAT, &[2]);
    t.raw_data = vec![0u8; 7].into();
    cases.push((t, "raw_data holds 7 bytes"));
    let mut t = tensor("a", data_type::INT8, &[1]);
    t.int32_data = vec![300];
    cases.push((t, "300 does not fit I8"));
    let mut t = tensor("a", data_type::FLOAT16, &[1]);
    t.int32_data = vec![70000];
    cases.push((t, "does not fit F16"));
    let mut t = tensor("a", data_type::FLOAT, &[1]);
    t.data_location = 7;
    cases.push((t, "unknown data_location"));
    let mut t = tensor("a", data_type::FLOAT, &[1]);
    t.data_location = 1;
    cases.push((t, "cannot be resolved"));
    for (t, want) in cases {
        let err = OnnxModel::from_bytes(model_with(vec![t]), None).unwrap_err();
        assert!(
            err.to_string().contains(want),
            "expected `{want}`, got `{err}`"
        );
    }
    let mut a = tensor("a", data_type::UINT8, &[1]);
    a.int32_data = vec![1];
    let err = OnnxModel::from_bytes(model_with(vec![a.clone(), a]), None).unwrap_err();
    assert!(matches!(err, Error::NameClash { .. }), "{err}");
    let err = OnnxModel::from_bytes(ModelProto::default().encode_to_vec(), None).unwrap_err();
    assert!(matches!(err, Error::NoGraph { .. }), "{err}");
}

fn external(location: &str, offset: Option<&str>, length: Option<&str>) -> TensorProto {
    let mut t = tensor("w", data_type::FLOAT, &[2]);
    t.data_location = 1;
    let kv = |k: &str, v: &str| StringStringEntryProto {
        key: k.into(),
        value: v.into(),
    };
    t.external_data.push(kv("location", location));
    if let Some(o) = offset {
        t.external_data.push(kv("offset", o));
    }
    if let Some(l) = length {
        t.external_data.push(kv("length", l));
    }
    t
}

#[test]
fn external_references_are_confined_and_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let model_dir = dir.path().join("m");
    std::fs::create_dir(&model_dir).unwrap();
    std::fs::write(model_dir.join("w.bin"), [0u8; 12]).unwrap();
    std::fs::write(dir.path().join("outside.bin"), [0u8; 8]).unwrap();
    let path = model_dir.join("model.onnx");
    let cases = [
        (external("w.bin", Some("4"), Some("8")), None),
        (external("w.bin", None, None), None),
        (
            external("../outside.bin", None, None),
            Some("relative path inside"),
        ),
        (
            external(dir.path().join("outside.bin").to_str().unwrap(), None, None),
            Some("relative path inside"),
        ),
        (external("", None, None), Some("relative path inside")),
        (external("missing.bin", None, None), Some("not found")),
        (
            external("w.bin", Some("8"), Some("8")),
            Some("run past the end"),
        ),
        (
            external("w.bin", Some("18446744073709551615"), Some("8")),
            Some("run past the end"),
        ),
        (
            external("w.bin", Some("0"), Some("4")),
            Some("needs 8 bytes"),
        ),
        (external("w.bin", Some("x"), None), Some("not a number")),
        (external(".", None, None), Some("relative path inside")),
    ];
    for (t, want) in cases {
        std::fs::write(&path, model_with(vec![t.clone()])).unwrap();
        match (OnnxModel::open(&StdFs, &path), want) {
            (Ok(m), None) => assert_eq!(m.tensors()[0].bytes().len(), 8),
            (Err(e), Some(w)) => assert!(e.to_string().contains(w), "expected `{w}`, got `{e}`"),
            (Ok(_), Some(w)) => panic!("{:?} loaded, expected `{w}`", t.external_data),
            (Err(e), None) => panic!("{:?} failed: {e}", t.external_data),
        }
    }
    let mut no_loc = external("w.bin", None, None);
    no_loc.external_data.remove(0);
    std::fs::write(&path, model_with(vec![no_loc])).unwrap();
    let err = OnnxModel::open(&StdFs, &path).unwrap_err();
    assert!(err.to_string().contains("no `location`"), "{err}");
}

#[test]
fn every_truncation_of_external_data_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    for f in ["model.onnx", "weights.bin"] {
        std::fs::copy(fixtures().join("external").join(f), dir.path().join(f)).unwrap();
    }
    let weights = dir.path().join("weights.bin");
    let full = std::fs::read(&weights).unwrap();
    for len in 0..full.len() {
        std::fs::write(&weights, &full[..len]).unwrap();
        let err = OnnxModel::open(&StdFs, &dir.path().join("model.onnx")).unwrap_err();
        assert!(err.to_string().contains("run past the end"), "{len}: {err}");
    }
}
