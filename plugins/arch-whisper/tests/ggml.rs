//! Whisper from whisper.cpp's GGML container (`tests/fixtures/gen_whisper_ggml.py`: the tiny
//! random Whisper written as whisper.cpp's converter writes it, F16 for matrices — a file
//! whisper.cpp itself loads): loader-ggml reads it under openai-whisper's names and arch-whisper
//! builds the same model as from the Hugging Face folder. Its logits equal transformers' with
//! the same F16-rounded weights within 1e-4; a GGML file missing a tensor is refused by name.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use u_arch_whisper::WhisperArchitecture;
use u_sdk::abi_stable::std_types::{ROption, RSlice};
use u_sdk::{CrossContext, Output, Rows, Segment, SeqChunk, SeqExtras, weights::SharedWeights};

/// Stated tolerance.
const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn json(name: &str) -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixtures().join(name),
    )?)?)
}

fn floats(v: &Value) -> Vec<f32> {
    fn flat(v: &Value, out: &mut Vec<f32>) {
        match v {
            Value::Array(a) => a.iter().for_each(|x| flat(x, out)),
            Value::Number(n) => out.push(n.as_f64().unwrap_or(f64::NAN) as f32),
            _ => {}
        }
    }
    let mut out = Vec::new();
    flat(v, &mut out);
    out
}

fn build(bytes: Vec<u8>) -> u_sdk::Result<u_arch_whisper::Whisper> {
    let model = u_loader_ggml::GgmlModel::parse(Arc::new(bytes))?;
    let weights = SharedWeights::new(model).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    let cache = u_cache_kv::KvCachePlugin::new(u_cache_kv::Config::default(), None).into_box();
    WhisperArchitecture.load(weights, backend, cache)
}

#[test]
fn ggml_logits_match_transformers() -> Result<()> {
    let expected = json("whisper_ggml_expected.json")?;
    assert_eq!(
        expected["whisper_cpp_loaded"], true,
        "whisper.cpp read the fixture"
    );
    let reference = json("whisper_tiny_expected.json")?;
    let file = std::fs::read(
        fixtures()
            .join("models")
            .join(expected["file"].as_str().unwrap_or_default()),
    )?;
    let model = build(file)?;
    let mel = floats(&reference["mel"]);
    let tokens: Vec<u32> = reference["decoder_input_ids"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect()
        })
        .unwrap_or_default();
    let cache = model.kv_cache().clone();
    let (seq, kv) = (cache.create().into_result()?, cache.create().into_result()?);
    let input = [Segment::Tokens(RSlice::from_slice(&tokens))];
    let chunk = SeqChunk {
        seq,
        input: RSlice::from_slice(&input),
        output: Output::Logits(Rows::All),
        extras: SeqExtras {
            cross: ROption::RSome(CrossContext {
                kv,
                rows: RSlice::from_slice(&mel),
            }),
            ..SeqExtras::default()
        },
    };
    let mut logits = vec![0f32; tokens.len() * model.cfg.vocab_size];
    model.forward(&[chunk], &mut logits)?;
    let want = floats(&expected["logits"]);
    let d = logits
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("GGML (F16) decoder logits: max |Δ| {d:.2e}");
    assert_eq!(logits.len(), want.len());
    assert!(d < TOL, "logits differ by {d}");
    Ok(())
}

#[test]
fn a_ggml_file_without_a_tensor_is_refused_by_name() -> Result<()> {
    let expected = json("whisper_ggml_expected.json")?;
    let mut file = std::fs::read(
        fixtures()
            .join("models")
            .join(expected["file"].as_str().unwrap_or_default()),
    )?;
    // Rename the last tensor (the decoder's final norm bias, `decoder.ln.bias`) in place.
    let at = file
        .windows(15)
        .rposition(|w| w == b"decoder.ln.bias")
        .expect("the tensor's name");
    file[at] = b'X';
    let e = build(file).err().expect("refused");
    assert!(e.message.contains("decoder.ln.bias"), "{}", e.message);
    Ok(())
}
