//! Malformed input gets a clear error, never a panic or a huge allocation: every truncation of
//! real files, byte flips, and hand-made broken shard sets.

use std::path::{Path, PathBuf};
use u_loader_safetensors::{Error, HeaderError, SafetensorsModel, StdFs};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/safetensors")
}

#[test]
fn every_truncation_is_an_error() {
    let full = std::fs::read(fixtures().join("all_dtypes.safetensors")).unwrap();
    assert!(SafetensorsModel::from_bytes(full.clone(), None).is_ok());
    for len in 0..full.len() {
        let res = SafetensorsModel::from_bytes(full[..len].to_vec(), None);
        let err = res.expect_err(&format!("truncated to {len} bytes must fail"));
        assert!(matches!(err, Error::Header { .. }), "{len}: {err}");
    }
}

#[test]
fn byte_flips_never_panic() {
    let full = std::fs::read(fixtures().join("all_dtypes.safetensors")).unwrap();
    let mut failures = 0;
    for i in 0..full.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut bytes = full.clone();
            bytes[i] ^= mask;
            if let Ok(m) = SafetensorsModel::from_bytes(bytes, None) {
                // Whatever parsed must be readable in full.
                for t in m.tensors() {
                    let v = m.view(&t.name).unwrap();
                    assert_eq!(v.data.len() as u64, t.info().byte_len);
                }
            } else {
                failures += 1;
            }
        }
    }
    assert!(
        failures > 0,
        "some flips (e.g. in the header length) must be refused"
    );
}

#[test]
fn header_length_is_bounded() {
    let mut bytes = (200u64 * 1024 * 1024).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let err = SafetensorsModel::from_bytes(bytes, None).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Header {
                source: HeaderError::HeaderTooLarge { .. },
                ..
            }
        ),
        "{err}"
    );
    let u: u_sdk::UError = err.into();
    assert_eq!(u.kind, u_sdk::ErrorKind::ResourceExhausted);
}

/// Copies the sharded fixture into a temp dir for mutation.
fn sharded_copy() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixtures().join("llama_sharded")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

#[test]
fn every_truncation_of_a_shard_is_an_error() {
    let dir = sharded_copy();
    let shard = dir.path().join("model-00002-of-00002.safetensors");
    let full = std::fs::read(&shard).unwrap();
    for len in (0..full.len()).step_by(7).chain([full.len() - 1]) {
        std::fs::write(&shard, &full[..len]).unwrap();
        let err = SafetensorsModel::open(&StdFs, dir.path()).expect_err("truncated shard");
        assert!(err.to_string().contains("model-00002-of-00002"), "{err}");
    }
}

#[test]
fn broken_shard_sets_are_refused() {
    let index_name = "model.safetensors.index.json";
    let cases: &[(&str, &str, &str)] = &[
        (
            index_name,
            r#"{"weight_map":{"x":"../escape.safetensors"}}"#,
            "plain file name",
        ),
        (
            index_name,
            r#"{"weight_map":{"x":"missing.safetensors"}}"#,
            "not found",
        ),
        (
            index_name,
            r#"{"weight_map":{"model.norm.weight":"model-00001-of-00002.safetensors"}}"#,
            "does not hold it",
        ),
        (index_name, "{not json", "not valid JSON"),
        ("config.json", "{not json", "bad config.json"),
        ("config.json", "[1,2]", "not a JSON object"),
    ];
    for (file, content, want) in cases {
        let dir = sharded_copy();
        std::fs::write(dir.path().join(file), content).unwrap();
        let err = SafetensorsModel::open(&StdFs, dir.path()).unwrap_err();
        assert!(err.to_string().contains(want), "{file}={content}: {err}");
    }
}

#[test]
fn duplicate_tensors_across_shards_are_refused() {
    let dir = sharded_copy();
    // Make shard 2 a copy of shard 1: every tensor of shard 1 now appears twice.
    std::fs::copy(
        dir.path().join("model-00001-of-00002.safetensors"),
        dir.path().join("model-00002-of-00002.safetensors"),
    )
    .unwrap();
    let err = SafetensorsModel::open(&StdFs, dir.path()).unwrap_err();
    assert!(err.to_string().contains("is also in"), "{err}");
}

#[test]
fn names_are_kept_as_stored() {
    // `model.norm.weight` and `output_norm.weight` mean the same to an architecture, but the
    // format knows no models: both are kept, each under its own name.
    let header = r#"{"model.norm.weight":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"output_norm.weight":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[1, 2]);
    let model = SafetensorsModel::from_bytes(bytes, None).unwrap();
    assert_eq!(model.tensor_f32("model.norm.weight").unwrap(), vec![1.0]);
    assert_eq!(model.tensor_f32("output_norm.weight").unwrap(), vec![2.0]);
}
