//! Checks the loader against files written by the reference tools (`gguf.GGUFWriter`) and the
//! dequantizers against `gguf.quants.dequantize`, bit for bit. The fixtures and their generator
//! live in the workspace's `tests/fixtures/` (`python3 tests/fixtures/gen_gguf.py`).

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString},
};
use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};
use u_loader_gguf::{
    Gguf, dequantize_to_vec, dequantize_view,
    gguf::{Array, Value},
};
use u_sdk::{
    DType, ErrorKind, Host, Host_TO, LogLevel, MetaValue, PluginInstance, UError, WeightSet,
    WriteMode,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf")
        .join(name)
}

fn expected_values() -> (Vec<serde_json::Value>, Vec<f32>) {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("quants.expected.json")).unwrap()).unwrap();
    let bin = std::fs::read(fixture("quants.expected.bin")).unwrap();
    let values = bin
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (index.as_array().unwrap().clone(), values)
}

/// Compares bit patterns; returns a description of the first few mismatches.
fn bit_mismatches(got: &[f32], want: &[f32]) -> Vec<String> {
    if got.len() != want.len() {
        return vec![format!("length {} != {}", got.len(), want.len())];
    }
    got.iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
        .take(5)
        .map(|(i, (g, w))| {
            format!(
                "[{i}] got {g:e} ({:#010x}) want {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            )
        })
        .collect()
}

#[test]
fn every_dtype_dequantizes_bit_exactly_like_gguf_py() {
    let weights = u_loader_gguf::open_path(&fixture("quants.gguf")).unwrap();
    let (index, expected) = expected_values();
    assert_eq!(weights.gguf().tensors.len(), index.len());
    let mut seen = BTreeSet::new();
    let mut failures = Vec::new();
    for entry in &index {
        let name = entry["name"].as_str().unwrap();
        let dtype = DType::from_name(entry["dtype"].as_str().unwrap()).unwrap();
        let shape: Vec<u64> = entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let offset = entry["offset"].as_u64().unwrap() as usize;
        let count = entry["count"].as_u64().unwrap() as usize;

        let view = weights.tensor(name.into()).unwrap();
        assert_eq!(view.dtype, dtype, "{name}");
        assert_eq!(view.shape.as_slice(), shape.as_slice(), "{name}");
        let got = dequantize_view(&view).unwrap();
        let mismatches = bit_mismatches(&got, &expected[offset..offset + count]);
        if !mismatches.is_empty() {
            failures.push(format!("{name} ({dtype}): {}", mismatches.join("; ")));
        }
        seen.insert(dtype);
    }
    assert!(
        failures.is_empty(),
        "dequantization differs from gguf-py:\n{}",
        failures.join("\n")
    );
    use DType::*;
    for d in [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, TQ1_0,
        TQ2_0,
    ] {
        assert!(seen.contains(&d), "fixture lacks {d}");
    }
}

#[test]
fn views_point_into_the_map_and_shapes_are_reversed() {
    let weights = u_loader_gguf::open_path(&fixture("quants.gguf")).unwrap();
    let g = weights.gguf();
    let bytes = weights.bytes();
    let range = bytes.as_ptr_range();
    for t in &g.tensors {
        let view = weights.tensor(t.name.as_str().into()).unwrap();
        let data = view.data.as_slice();
        // Zero-copy: the view lies inside the mapped file, at data_start + offset.
        assert!(range.contains(&data.as_ptr()), "{}", t.name);
        assert_eq!(
            data.as_ptr() as usize - range.start as usize,
            (g.data_start + t.offset) as usize
        );
        assert_eq!(data.len() as u64, t.byte_len);
        assert_eq!(
            data.as_ptr() as usize % g.alignment as usize,
            range.start as usize % g.alignment as usize
        );
    }
    let cube = g.tensor_info("cube.q8_0").unwrap();
    assert_eq!(cube.dims, vec![64, 3, 2]);
    assert_eq!(cube.shape(), vec![2, 3, 64]);
    let infos = weights.tensors().unwrap();
    let cube = infos.iter().find(|t| t.name == "cube.q8_0").unwrap();
    assert_eq!(cube.shape.as_slice(), &[2, 3, 64]);
    assert_eq!(cube.byte_len, 6 * 2 * 34);
    assert_eq!(
        weights.architecture().unwrap().into_option().unwrap(),
        "testarch"
    );
    let err = weights.tensor("nope".into()).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
}

#[test]
fn version_2_files_parse_like_version_3() {
    let mut bytes = std::fs::read(fixture("quants.gguf")).unwrap();
    assert_eq!(&bytes[4..8], &3u32.to_le_bytes());
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.version, 2);
    let (index, expected) = expected_values();
    let q6 = index.iter().find(|e| e["name"] == "q6_k").unwrap();
    let (offset, count) = (
        q6["offset"].as_u64().unwrap() as usize,
        q6["count"].as_u64().unwrap() as usize,
    );
    let got = dequantize_to_vec(DType::Q6_K, g.tensor_data(&bytes, "q6_k").unwrap()).unwrap();
    assert!(bit_mismatches(&got, &expected[offset..offset + count]).is_empty());
}

#[test]
fn every_metadata_type_reads_back() {
    let weights = u_loader_gguf::open_path(&fixture("metadata.gguf")).unwrap();
    let g = weights.gguf();
    assert_eq!(g.alignment, 64);
    assert_eq!(g.data_start % 64, 0);
    let exact = |k: &str| g.get(k).unwrap_or_else(|| panic!("missing {k}")).clone();
    assert_eq!(exact("general.alignment"), Value::U32(64));
    assert_eq!(exact("t.u8"), Value::U8(200));
    assert_eq!(exact("t.i8"), Value::I8(-100));
    assert_eq!(exact("t.u16"), Value::U16(60000));
    assert_eq!(exact("t.i16"), Value::I16(-30000));
    assert_eq!(exact("t.u32"), Value::U32(4_000_000_000));
    assert_eq!(exact("t.i32"), Value::I32(-2_000_000_000));
    assert_eq!(exact("t.f32"), Value::F32(0.1));
    assert_eq!(exact("t.bool"), Value::Bool(true));
    assert_eq!(exact("t.bool_false"), Value::Bool(false));
    assert_eq!(exact("t.str"), Value::Str("héllo, GGUF ✓".into()));
    assert_eq!(exact("t.u64"), Value::U64(18_000_000_000_000_000_000));
    assert_eq!(exact("t.i64"), Value::I64(-9_000_000_000_000_000_000));
    assert_eq!(exact("t.f64"), Value::F64(std::f64::consts::PI));
    assert_eq!(exact("a.u8"), Value::Array(Array::U8(vec![0, 1, 255])));
    assert_eq!(exact("a.i8"), Value::Array(Array::I8(vec![-128, 0, 127])));
    assert_eq!(exact("a.u16"), Value::Array(Array::U16(vec![0, 65535])));
    assert_eq!(
        exact("a.i16"),
        Value::Array(Array::I16(vec![-32768, 32767]))
    );
    assert_eq!(exact("a.u32"), Value::Array(Array::U32(vec![0, u32::MAX])));
    assert_eq!(
        exact("a.i32"),
        Value::Array(Array::I32(vec![-1, 0, 1, i32::MAX]))
    );
    assert_eq!(
        exact("a.f32"),
        Value::Array(Array::F32(vec![0.5, -1.25, 1e-3]))
    );
    assert_eq!(
        exact("a.bool"),
        Value::Array(Array::Bool(vec![true, false, true]))
    );
    assert_eq!(
        exact("a.str"),
        Value::Array(Array::Str(vec!["alpha".into(), "".into(), "γ".into()]))
    );
    assert_eq!(exact("a.u64"), Value::Array(Array::U64(vec![0, u64::MAX])));
    assert_eq!(
        exact("a.i64"),
        Value::Array(Array::I64(vec![i64::MIN, i64::MAX]))
    );
    assert_eq!(exact("a.f64"), Value::Array(Array::F64(vec![2.5, -0.1])));
    assert_eq!(
        exact("a.nested"),
        Value::Array(Array::Array(vec![
            Array::I32(vec![1, 2]),
            Array::I32(vec![3]),
            Array::Str(vec!["x".into(), "y".into()]),
            Array::Array(vec![Array::Bool(vec![true])]),
        ]))
    );

    // The same through the ABI.
    let keys: Vec<String> = weights
        .metadata_keys()
        .unwrap()
        .iter()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(keys.len(), g.metadata.len());
    assert_eq!(keys[0], "general.architecture");
    assert_eq!(keys.last().unwrap(), "a.nested");
    let meta = |k: &str| weights.metadata(k.into()).unwrap().into_option().unwrap();
    assert_eq!(meta("t.u8"), MetaValue::UInt(200));
    assert_eq!(meta("t.i16"), MetaValue::Int(-30000));
    assert_eq!(meta("t.u64"), MetaValue::UInt(18_000_000_000_000_000_000));
    assert_eq!(meta("t.f32"), MetaValue::Float(f64::from(0.1f32)));
    assert_eq!(meta("t.f64"), MetaValue::Float(std::f64::consts::PI));
    assert_eq!(meta("t.bool"), MetaValue::Bool(true));
    assert_eq!(meta("t.str").as_str(), Some("héllo, GGUF ✓"));
    assert_eq!(meta("a.u8"), MetaValue::UIntArray(vec![0, 1, 255].into()));
    assert_eq!(
        meta("a.i64"),
        MetaValue::IntArray(vec![i64::MIN, i64::MAX].into())
    );
    assert_eq!(
        meta("a.f32"),
        MetaValue::FloatArray(vec![0.5, -1.25, f64::from(1e-3f32)].into())
    );
    assert_eq!(
        meta("a.bool"),
        MetaValue::BoolArray(vec![true, false, true].into())
    );
    assert_eq!(
        meta("a.str"),
        MetaValue::StrArray(vec![RString::from("alpha"), "".into(), "γ".into()].into())
    );
    assert_eq!(
        meta("a.nested"),
        MetaValue::Json(r#"[[1,2],[3],["x","y"],[[true]]]"#.into())
    );
    assert!(weights.metadata("absent".into()).unwrap().is_none());
    assert_eq!(
        weights.architecture().unwrap().into_option().unwrap(),
        "metaarch"
    );

    let w = dequantize_view(&weights.tensor("weight".into()).unwrap()).unwrap();
    assert_eq!(w, (0..12).map(|i| i as f32).collect::<Vec<_>>());
}

/// A host that opens any path under the fixtures directory, and denies the rest.
#[derive(Clone)]
struct TestHost {
    root: PathBuf,
}

impl Host for TestHost {
    fn plugin_name(&self) -> RString {
        "loader-gguf".into()
    }
    fn log(&self, _level: LogLevel, _message: RStr<'_>) {}
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        use std::os::fd::IntoRawFd;
        let p = Path::new(path.as_str());
        if !p.starts_with(&self.root) {
            return RResult::RErr(UError::denied(format!("fs.read does not cover {path}")));
        }
        std::fs::File::open(p)
            .map(|f| f.into_raw_fd())
            .map_err(|e| UError::io(format!("open {path}"), e))
            .into()
    }
    fn open_write(&self, _: RStr<'_>, _: WriteMode) -> RResult<i32, UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn rename(&self, _: RStr<'_>, _: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn remove(&self, _: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn threads(&self) -> u32 {
        1
    }
    fn config(&self) -> RString {
        RString::new()
    }
}

#[test]
fn the_plugin_opens_files_through_the_host() {
    let root = fixture("").canonicalize().unwrap();
    let host = Host_TO::from_value(TestHost { root: root.clone() }, TD_Opaque);
    let Ok(PluginInstance::Loader(loader)) = u_loader_gguf::instantiate(host) else {
        panic!("instantiate did not return a loader");
    };
    assert_eq!(
        loader
            .formats()
            .unwrap()
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>(),
        ["gguf"]
    );
    let path = root.join("quants.gguf");
    let head = std::fs::read(&path).unwrap();
    assert!(
        loader
            .can_open(path.to_str().unwrap().into(), head[..64].into())
            .unwrap()
    );
    assert!(
        !loader
            .can_open("x.safetensors".into(), b"\x08\0\0\0\0\0\0\0{}"[..].into())
            .unwrap()
    );

    let set = loader.open(path.to_str().unwrap().into()).unwrap();
    assert_eq!(set.format().unwrap(), "gguf");
    let infos = set.tensors().unwrap();
    let q4k = infos.iter().find(|t| t.name == "q4_k").unwrap();
    assert_eq!(
        (q4k.dtype, q4k.shape.as_slice()),
        (DType::Q4_K, &[2u64, 512][..])
    );
    let view = set.tensor("q4_k".into()).unwrap();
    assert_eq!(view.data.len(), 4 * 144);
    let clone = set.clone();
    drop(set);
    assert_eq!(clone.tensor("q4_k".into()).unwrap().data.len(), 4 * 144);

    let open_err = |p: &str| match loader.open(p.into()) {
        RResult::RErr(e) => e,
        RResult::ROk(_) => panic!("{p} opened"),
    };
    let denied = open_err("/etc/hostname");
    assert_eq!(denied.kind, ErrorKind::PermissionDenied);
    let missing = open_err(root.join("absent.gguf").to_str().unwrap());
    assert_eq!(missing.kind, ErrorKind::NotFound);
    let not_gguf = open_err(root.join("quants.expected.json").to_str().unwrap());
    assert_eq!(not_gguf.kind, ErrorKind::InvalidInput);
    assert!(
        not_gguf.message.contains("quants.expected.json"),
        "{}",
        not_gguf.message
    );
    assert!(
        not_gguf.message.contains("not a GGUF file"),
        "{}",
        not_gguf.message
    );
}
