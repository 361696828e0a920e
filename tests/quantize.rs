//! `u-runner quantize` against llama.cpp 0.3.36's `llama-quantize` (#14): the tiny Llama of
//! `tests/fixtures/quantize/` quantized to every file type gives, tensor for tensor, the type,
//! shape and bytes (SHA-256) llama-quantize wrote from the same file, and its metadata keys in
//! the same order with the same GGUF value types (`expected.json`, made by
//! `tests/fixtures/gen_quantize.py`). Also the bad inputs: an unknown type, a missing or
//! malformed input, an already quantized input without `--allow-requantize`.

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::{collections::BTreeMap, path::Path, process::Command};
use u_conformance::{bin, root, run, text};
use u_sdk::DType;

fn quantize(input: &Path, output: &Path, file_type: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.arg("quantize")
        .arg(input)
        .arg(output)
        .arg(file_type)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"))
        .args(extra);
    cmd
}

fn fixture() -> std::path::PathBuf {
    root().join("tests/fixtures/quantize")
}

/// What a GGUF file holds: tensors (name → type, shape innermost first, SHA-256) and the keys
/// in order with their value types (an array's element type after it), as gguf-py names them.
struct Described {
    tensors: BTreeMap<String, (String, Vec<u64>, String)>,
    keys: Vec<Vec<String>>,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }
    /// Skips one value of GGUF type `t`.
    fn skip(&mut self, t: u32) {
        match t {
            0 | 1 | 7 => drop(self.take(1)),
            2 | 3 => drop(self.take(2)),
            4..=6 => drop(self.take(4)),
            8 => drop(self.string()),
            10..=12 => drop(self.take(8)),
            other => panic!("value type {other}"),
        }
    }
}

const VALUE_TYPES: [&str; 13] = [
    "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
    "UINT64", "INT64", "FLOAT64",
];

fn ggml_type(id: u32) -> DType {
    use DType::*;
    match id {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        10 => Q2_K,
        11 => Q3_K,
        12 => Q4_K,
        13 => Q5_K,
        14 => Q6_K,
        30 => BF16,
        34 => TQ1_0,
        35 => TQ2_0,
        other => panic!("ggml type {other}"),
    }
}

fn describe(path: &Path) -> Described {
    let b = std::fs::read(path).unwrap();
    let mut r = Reader { b: &b, at: 0 };
    assert_eq!(r.take(4), b"GGUF");
    assert_eq!(r.u32(), 3, "GGUF version");
    let (n_tensors, n_kv) = (r.u64(), r.u64());
    let mut keys = Vec::new();
    for _ in 0..n_kv {
        let name = r.string();
        let t = r.u32();
        let mut key = vec![name, VALUE_TYPES[t as usize].to_string()];
        if t == 9 {
            let (et, n) = (r.u32(), r.u64());
            key.push(VALUE_TYPES[et as usize].to_string());
            for _ in 0..n {
                r.skip(et);
            }
        } else {
            r.skip(t);
        }
        keys.push(key);
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = r.string();
        let dims: Vec<u64> = (0..r.u32()).map(|_| r.u64()).collect();
        let dtype = ggml_type(r.u32());
        infos.push((name, dims, dtype, r.u64()));
    }
    let data = r.at.next_multiple_of(32);
    let mut tensors = BTreeMap::new();
    for (name, dims, dtype, offset) in infos {
        assert_eq!(offset % 32, 0, "{name} is aligned");
        let rows: u64 = dims[1..].iter().product();
        let len = (dtype.bytes_for(dims[0]).unwrap() * rows) as usize;
        let at = data + offset as usize;
        let sha = hex::encode(Sha256::digest(&b[at..at + len]));
        tensors.insert(name, (dtype.name().to_string(), dims, sha));
    }
    Described { tensors, keys }
}

#[test]
fn every_file_type_equals_llama_quantize_tensor_for_tensor() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json")).unwrap())
            .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let types = expected["types"].as_object().unwrap();
    assert_eq!(types.len(), 10);
    let mut report = Vec::new();
    for (file_type, want) in types {
        let out = dir.path().join(format!("{file_type}.gguf"));
        let o = run(&mut quantize(
            &fixture().join("model.gguf"),
            &out,
            file_type,
            &[],
        ));
        assert!(o.status.success(), "{file_type}: {}", text(&o));
        let got = describe(&out);
        let want_tensors = want["tensors"].as_object().unwrap();
        assert_eq!(got.tensors.len(), want_tensors.len(), "{file_type}");
        let mut same = 0;
        for (name, w) in want_tensors {
            let (ty, dims, sha) = &got.tensors[name];
            let want_dims: Vec<u64> = serde_json::from_value(w["shape"].clone()).unwrap();
            assert_eq!(ty, w["type"].as_str().unwrap(), "{file_type} {name}: type");
            assert_eq!(dims, &want_dims, "{file_type} {name}: shape");
            assert_eq!(
                sha,
                w["sha256"].as_str().unwrap(),
                "{file_type} {name}: bytes"
            );
            same += 1;
        }
        let want_keys: Vec<Vec<String>> = serde_json::from_value(want["keys"].clone()).unwrap();
        assert_eq!(got.keys, want_keys, "{file_type}: metadata keys and types");
        report.push(format!(
            "{file_type}: {same}/{} tensors",
            want_tensors.len()
        ));
    }
    println!("{}", report.join("\n"));
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture().join("model.gguf");
    let out = dir.path().join("out.gguf");
    let fails = |cmd: &mut Command, says: &str| {
        let o = run(cmd);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(says), "wanted {says:?} in {}", text(&o));
    };
    fails(
        &mut quantize(&model, &out, "Q7_X", &[]),
        "unknown TYPE `Q7_X`",
    );
    fails(
        &mut quantize(&dir.path().join("missing.gguf"), &out, "Q8_0", &[]),
        "does not exist",
    );
    fails(
        &mut quantize(&model, &model, "Q8_0", &[]),
        "would overwrite the input",
    );
    // A GGUF cut short after its header.
    let bytes = std::fs::read(&model).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..4096]).unwrap();
    fails(&mut quantize(&cut, &out, "Q8_0", &[]), "loader-gguf");
    // An already quantized model: refused unless asked for, as llama-quantize does.
    let q8 = dir.path().join("q8.gguf");
    assert!(
        run(&mut quantize(&model, &q8, "Q8_0", &[]))
            .status
            .success()
    );
    fails(&mut quantize(&q8, &out, "Q4_0", &[]), "--allow-requantize");
    assert_eq!(
        std::fs::metadata(&out).unwrap().len(),
        0,
        "no half-written file"
    );
    let o = run(&mut quantize(&q8, &out, "Q4_0", &["--allow-requantize"]));
    assert!(o.status.success(), "{}", text(&o));
    let (ty, _, _) = &describe(&out).tensors["blk.0.attn_q.weight"];
    assert_eq!(ty, "Q4_0");
}
