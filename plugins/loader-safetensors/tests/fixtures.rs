//! Reads the files written by `tests/fixtures/gen_safetensors.py` (the real `safetensors`
//! package) and compares names, dtypes, shapes and values with the script's expectations.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_loader_safetensors::{Error, SafetensorsModel, StdFs};
use u_sdk::{DType, MetaValue};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/safetensors")
}

fn expected(name: &str) -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(fixtures().join(name)).expect("expected-values file");
    serde_json::from_str(&text).expect("expected JSON")
}

/// Decodes stored bytes to f64 (floats) or i64-as-f64-free comparison values.
fn decoded(dtype: DType, bytes: &[u8]) -> Vec<Value> {
    let w = dtype.block_bytes();
    bytes
        .chunks_exact(w)
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

/// Exact comparison. serde_json's default float parsing may be off by one f64 ulp, so values
/// of 32-bit-or-narrower float types compare after rounding the expectation to f32 (exact for
/// values that are f32-representable) and f64 values compare to within one ulp.
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

/// Checks every expected tensor (by the name it is stored under) and that there are no others.
fn check_against(model: &SafetensorsModel, exp: &serde_json::Map<String, Value>) {
    assert_eq!(model.tensors().len(), exp.len(), "tensor count");
    for (stored, e) in exp {
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
        assert_eq!(view.shape.as_slice(), shape.as_slice());
        let got = decoded(t.dtype, &view.data);
        let want = e["values"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "{stored} element count");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                same_value(t.dtype, g, w),
                "{stored}[{i}]: read {g}, expected {w}"
            );
        }
        assert_eq!(t.info().byte_len as usize, view.data.len());
    }
}

#[test]
fn all_dtypes_read_as_stored() {
    let model = SafetensorsModel::open(&StdFs, &fixtures().join("all_dtypes.safetensors")).unwrap();
    check_against(&model, &expected("all_dtypes.expected.json"));
    assert_eq!(
        model.metadata_value("safetensors.format"),
        Some(&MetaValue::Str("np".into()))
    );
    // No config.json next to it: no architecture.
    assert_eq!(model.architecture(), None);
    // f32 conversion on request.
    assert_eq!(model.tensor_f32("scalar_f32").unwrap(), vec![3.25]);
    assert_eq!(model.tensor_f32("empty_f32").unwrap(), Vec::<f32>::new());
    let i8s = model.tensor_f32("t_i8").unwrap();
    assert_eq!(i8s.len(), 5);
}

#[test]
fn views_point_into_one_mapped_file() {
    let path = fixtures().join("all_dtypes.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let header = u_loader_safetensors::header::parse(&bytes).unwrap();
    let model = SafetensorsModel::open(&StdFs, &path).unwrap();
    let a = &header.tensors[0];
    let pa = model.view(&a.name).unwrap().data.as_ptr() as usize;
    for t in header.tensors.iter().filter(|t| !t.range.is_empty()) {
        let p = model.view(&t.name).unwrap().data.as_ptr() as usize;
        assert_eq!(
            p - pa,
            t.range.start - a.range.start,
            "{} not at its file offset",
            t.name
        );
    }
}

fn check_llama(model: &SafetensorsModel) {
    check_against(model, &expected("llama_sharded.expected.json"));
    assert_eq!(model.architecture(), Some("llama"));
    let m = |k: &str| model.metadata_value(k).cloned();
    // The format's own content only: config.json verbatim, no model-specific keys.
    assert_eq!(m("general.architecture"), None);
    assert_eq!(m("llama.block_count"), None);
    assert_eq!(m("config.num_hidden_layers"), Some(MetaValue::UInt(2)));
    assert_eq!(m("config.hidden_size"), Some(MetaValue::UInt(8)));
    assert_eq!(m("config.rms_norm_eps"), Some(MetaValue::Float(1e-6)));
    assert_eq!(m("config.hidden_act"), Some(MetaValue::Str("silu".into())));
    assert_eq!(
        m("config.architectures"),
        Some(MetaValue::StrArray(vec!["LlamaForCausalLM".into()].into()))
    );
    assert_eq!(m("config.rope_scaling"), None, "null entries are skipped");
    assert!(matches!(
        m("safetensors.index.total_size"),
        Some(MetaValue::UInt(_))
    ));
    // Keys are unique and listed in a stable order: config.json first, file keys last.
    let keys: Vec<&str> = model.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert!(keys[0].starts_with("config."));
    let pos = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert!(pos("config.hidden_act") < pos("safetensors.format"));
    let mut unique = keys.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), keys.len());
}

#[test]
fn sharded_llama_by_directory() {
    let model = SafetensorsModel::open(&StdFs, &fixtures().join("llama_sharded")).unwrap();
    check_llama(&model);
    // Shard order, then file order: the embedding (shard 1) comes first.
    assert_eq!(model.tensors()[0].name, "model.embed_tokens.weight");
}

#[test]
fn sharded_llama_by_index_path() {
    let path = fixtures().join("llama_sharded/model.safetensors.index.json");
    check_llama(&SafetensorsModel::open(&StdFs, &path).unwrap());
}

#[test]
fn one_shard_alone_still_gets_config() {
    let path = fixtures().join("llama_sharded/model-00001-of-00002.safetensors");
    let model = SafetensorsModel::open(&StdFs, &path).unwrap();
    assert_eq!(model.architecture(), Some("llama"));
    assert!(
        model
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .is_some()
    );
    assert!(
        model
            .tensor("model.layers.1.self_attn.q_proj.weight")
            .is_none()
    );
}

#[test]
fn mixtral_experts_stay_per_expert() {
    let model = SafetensorsModel::open(&StdFs, &fixtures().join("mixtral")).unwrap();
    check_against(&model, &expected("mixtral.expected.json"));
    assert_eq!(
        model.architecture(),
        Some("mixtral"),
        "as config.json names it"
    );
    assert_eq!(
        model.metadata_value("config.num_local_experts"),
        Some(&MetaValue::UInt(2))
    );
    assert_eq!(
        model.metadata_value("config.num_experts_per_tok"),
        Some(&MetaValue::UInt(1))
    );
}

#[test]
fn missing_model_is_not_found() {
    let err = SafetensorsModel::open(&StdFs, &fixtures().join("no-such-dir")).unwrap_err();
    assert!(
        matches!(err, Error::File(u_sdk::files::FileError::NotFound { .. })),
        "{err}"
    );
    let u: u_sdk::UError = err.into();
    assert_eq!(u.kind, u_sdk::ErrorKind::NotFound);
    assert!(u.message.contains("model.safetensors"), "{}", u.message);
}
