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
    /// Scalar values by key, as numbers (integers of any width alike) or text.
    values: BTreeMap<String, String>,
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
    /// One scalar value of GGUF type `t`, as text (integers of every width alike).
    fn scalar(&mut self, t: u32) -> String {
        let width = match t {
            8 => return self.string(),
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            other => panic!("value type {other}"),
        };
        let b = self.take(width);
        let signed = matches!(t, 1 | 3 | 5 | 11);
        let mut v = [if signed && b[width - 1] & 0x80 != 0 {
            0xff
        } else {
            0
        }; 8];
        v[..width].copy_from_slice(b);
        match t {
            6 => f32::from_le_bytes(b.try_into().unwrap()).to_string(),
            12 => (f64::from_le_bytes(v) as f32).to_string(),
            7 => (b[0] != 0).to_string(),
            _ if signed => i64::from_le_bytes(v).to_string(),
            _ => u64::from_le_bytes(v).to_string(),
        }
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
    let mut values = BTreeMap::new();
    for _ in 0..n_kv {
        let name = r.string();
        let t = r.u32();
        let mut key = vec![name.clone(), VALUE_TYPES[t as usize].to_string()];
        if t == 9 {
            let (et, n) = (r.u32(), r.u64());
            key.push(VALUE_TYPES[et as usize].to_string());
            for _ in 0..n {
                r.skip(et);
            }
        } else {
            values.insert(name, r.scalar(t));
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
    Described {
        tensors,
        keys,
        values,
    }
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

/// The arch-llama fixture checkpoints (random weights, `config.json`) whose GGUF (`model.gguf`)
/// llama.cpp's converter made, or a writer of the same layout (`gen_llama_family.py`).
fn checkpoint(family: &str) -> std::path::PathBuf {
    root()
        .join("plugins/arch-llama/tests/fixtures/models")
        .join(family)
}

/// #14: an HF checkpoint (safetensors + `config.json`, no `tokenizer.json`) quantizes to the
/// same tensors, byte for byte, as the GGUF converted from it: names, shapes and row order
/// (Llama's Q/K rows permuted to adjacent rotary pairs, GPT-2's Conv1D transposed, GPT-NeoX's
/// and Falcon-40B's fused Q/K/V regrouped) and the hyper-parameters under their GGUF keys.
/// Families whose conversion changes values (norm offsets) or stacks experts are refused.
#[test]
fn a_safetensors_checkpoint_quantizes_to_its_converted_ggufs_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let mut report = Vec::new();
    for family in [
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "granite",
        "stablelm",
        "olmo2",
        "cohere",
        "phi3",
        "gpt2",
        "gpt_neox",
        "falcon",
        "falcon_40b",
    ] {
        let src = checkpoint(family);
        let ckpt = dir.path().join(family);
        std::fs::create_dir_all(&ckpt).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), ckpt.join(f)).unwrap();
        }
        let (from_st, from_gguf) = (
            dir.path().join(format!("{family}.st.gguf")),
            dir.path().join(format!("{family}.gguf")),
        );
        for (input, output) in [(&ckpt, &from_st), (&src.join("model.gguf"), &from_gguf)] {
            let o = run(&mut quantize(input, output, "Q8_0", &[]));
            assert!(o.status.success(), "{family}: {}", text(&o));
        }
        let (got, want) = (describe(&from_st), describe(&from_gguf));
        let names = |d: &Described| d.tensors.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "{family}: tensor names");
        for (name, w) in &want.tensors {
            assert_eq!(&got.tensors[name], w, "{family}: {name}");
        }
        let arch = want.values["general.architecture"].clone();
        assert_eq!(got.values["general.architecture"], arch, "{family}");
        // Every hyper-parameter the converted file has, with its value (the checkpoint may
        // give more: an explicit head size, say, that this fixture's writer left out).
        let hparams: Vec<&String> = want
            .values
            .keys()
            .filter(|k| k.starts_with(&format!("{arch}.")))
            .collect();
        assert!(hparams.len() >= 5, "{family}: {hparams:?}");
        // A head size equal to the default (`embedding_length / head_count`): the fixture
        // writer of `gen_llama_family.py` writes it always, llama.cpp's converter only when
        // `config.json` has `head_dim`, and llama.cpp reads the default then.
        let default_head = want.values[&format!("{arch}.embedding_length")]
            .parse::<u64>()
            .unwrap()
            / want.values[&format!("{arch}.attention.head_count")]
                .parse::<u64>()
                .unwrap();
        // Likewise a RoPE scaling type of `none` (Cohere's converter writes it) and a sliding
        // window of 0 (Phi-3's).
        for k in &hparams {
            let implied = ((k.ends_with(".key_length") || k.ends_with(".value_length"))
                && want.values[*k] == default_head.to_string())
                || (k.ends_with(".rope.scaling.type") && want.values[*k] == "none")
                || (k.ends_with(".attention.sliding_window") && want.values[*k] == "0");
            if !got.values.contains_key(*k) && implied {
                continue;
            }
            assert_eq!(got.values.get(*k), want.values.get(*k), "{family}: {k}");
        }
        let ours = got
            .values
            .keys()
            .filter(|k| k.starts_with(&format!("{arch}.")))
            .count();
        report.push(format!(
            "{family}: {} tensors, {} of {ours} hyper-parameters checked",
            want.tensors.len(),
            hparams.len()
        ));
    }
    println!("{}", report.join("\n"));
    for (family, says) in [
        ("gemma2", "not supported"),
        ("mixtral", "experts stored one tensor each"),
    ] {
        let ckpt = dir.path().join(format!("{family}-refused"));
        std::fs::create_dir_all(&ckpt).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(checkpoint(family).join(f), ckpt.join(f)).unwrap();
        }
        let out = dir.path().join(format!("{family}.gguf"));
        let o = run(&mut quantize(&ckpt, &out, "Q8_0", &[]));
        assert_eq!(o.status.code(), Some(2), "{family}: {}", text(&o));
        assert!(text(&o).contains(says), "{family}: {}", text(&o));
    }
}

/// #14: a checkpoint's byte-level BPE `tokenizer.json` (`tests/fixtures/gen_bpe_tokenizer.py`)
/// travels into the GGUF as llama.cpp's `gpt2` vocabulary with a pre-tokenizer named, and the
/// GGUF tokenizes Macbeth as the `tokenizer.json` does. (With 512 tokens and no multi-digit
/// ones, several llama.cpp pre-tokenizers split this vocabulary alike; the export takes the
/// first that does, here Qwen2's.)
#[test]
fn a_checkpoints_tokenizer_travels_into_the_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("llama-with-tokenizer");
    std::fs::create_dir_all(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(checkpoint("llama").join(f), ckpt.join(f)).unwrap();
    }
    let bpe = root().join("tests/fixtures/tokenizer/bpe");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(bpe.join(f), ckpt.join(f)).unwrap();
    }
    let out = dir.path().join("out.gguf");
    let o = run(&mut quantize(&ckpt, &out, "Q8_0", &[]));
    assert!(o.status.success(), "{}", text(&o));
    let d = describe(&out);
    assert_eq!(d.values["tokenizer.ggml.model"], "gpt2");
    assert_eq!(d.values["tokenizer.ggml.pre"], "qwen2");
    assert_eq!(d.values["tokenizer.ggml.eos_token_id"], "2");
    assert!(d.values["tokenizer.chat_template"].contains("<|im_start|>"));
    let arrays: Vec<&str> = d
        .keys
        .iter()
        .filter(|k| k[1] == "ARRAY")
        .map(|k| k[0].as_str())
        .collect();
    for k in [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
    ] {
        assert!(arrays.contains(&k), "{k} in {arrays:?}");
    }
    let tokenize = |model: &Path| {
        let o = run(Command::new(bin("u-runner"))
            .arg("tokenize")
            .arg("--model")
            .arg(model)
            .arg("--deployment")
            .arg(root().join("manifests/dev.toml"))
            .args(["--no-special", "--separator", "\n", "--file"])
            .arg(root().join("tests/fixtures/text/macbeth.txt")));
        assert!(o.status.success(), "{}: {}", model.display(), text(&o));
        String::from_utf8(o.stdout).unwrap()
    };
    let (from_json, from_gguf) = (tokenize(&ckpt), tokenize(&out));
    assert!(from_json.lines().count() > 1000, "{from_json}");
    assert_eq!(from_gguf, from_json);
}
