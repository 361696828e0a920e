//! Shared by the tests: the fixtures' paths, their manifest and the hash it records.
#![allow(dead_code)]

use std::path::PathBuf;

use u_sdk::abi::model::{ImageSpec, Resample};

/// The fixtures folder.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A fixture's bytes.
pub fn read(rel: &str) -> Vec<u8> {
    let path = fixtures().join(rel);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `cases.json`, written by `gen_preprocess.py`.
pub fn cases() -> serde_json::Value {
    serde_json::from_slice(&read("cases.json")).expect("cases.json")
}

/// FNV-1a, 64 bits (the generator's `fnv1a64`).
pub fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// An [`ImageSpec`] from the generator's JSON.
pub fn spec(json: &serde_json::Value) -> ImageSpec {
    let f3 = |k: &str| -> [f32; 3] {
        let v: Vec<f32> = json[k]
            .as_array()
            .expect(k)
            .iter()
            .map(|x| x.as_f64().expect("number") as f32)
            .collect();
        [v[0], v[1], v[2]]
    };
    let u = |k: &str| json[k].as_u64().expect(k) as u32;
    ImageSpec {
        channels: 3,
        height: u("height"),
        width: u("width"),
        rows: 0,
        shortest_edge: u("shortest_edge"),
        resample: match json["resample"].as_str().expect("resample") {
            "nearest" => Resample::Nearest,
            "bilinear" => Resample::Bilinear,
            "bicubic" => Resample::Bicubic,
            other => panic!("resample {other}"),
        },
        rescale: 1.0 / 255.0,
        mean: f3("mean"),
        std: f3("std"),
    }
}

/// A little-endian `f32` file.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
