//! The T5 encoder against transformers on the tiny random-weight encoders of
//! `tests/fixtures/t5_tiny/` at the workspace root (its generator, `gen_t5_tiny.py`, beside
//! it): for the gated-GELU and the ReLU encoder, each text's `last_hidden_state` and
//! `hidden_states[1]` equal transformers' within [`TOL`], alone and three texts in one pass
//! (the 38-token one reaching the logarithmic and the clamped position buckets); the unigram
//! tokenizer gives transformers' ids; bad requests are clear errors.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_t5::T5Architecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{ErrorKind, ModelBox, ModelKind, Output, Pooling, Rows, Segment, SeqChunk};

/// Stated tolerance (f32 both sides).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/t5_tiny")
}

fn model(name: &str) -> Result<ModelBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &fixture().join(name),
    )?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    Ok(T5Architecture.load(weights, u_kernels_cpu::CpuKernels::new(2)?.into_box())?)
}

fn expected() -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixture().join("expected.json"),
    )?)?)
}

fn flat(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(items) => items.iter().flat_map(flat).collect(),
        Value::Number(n) => vec![n.as_f64().unwrap_or(f64::NAN) as f32],
        _ => Vec::new(),
    }
}

fn ids(case: &Value) -> Vec<u32> {
    serde_json::from_value(case["ids"].clone()).expect("ids")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// One chunk per text, each asking for `output`, in one pass.
fn run(model: &ModelBox, texts: &[Vec<u32>], output: Output) -> u_sdk::Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let inputs: Vec<[Segment<'_>; 1]> = texts
        .iter()
        .map(|t| [Segment::Tokens(RSlice::from_slice(t))])
        .collect();
    let chunks: Vec<SeqChunk<'_>> = inputs
        .iter()
        .map(|i| SeqChunk::tokens(0, i, output))
        .collect();
    let floats: usize = texts.iter().map(|t| output.floats(t.len(), &config)).sum();
    let mut out = vec![0f32; floats];
    model
        .forward(
            RSlice::from_slice(&chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

#[test]
fn both_encoders_equal_transformers() -> Result<()> {
    let e = expected()?;
    for name in ["gated", "relu"] {
        let model = model(name)?;
        let config = model.config().into_result()?;
        assert_eq!((config.kind, config.layers), (ModelKind::Encoder, 2));
        let cases = e[name].as_array().expect("cases");
        let texts: Vec<Vec<u32>> = cases.iter().map(ids).collect();
        let last = Output::Hidden {
            layer: 2,
            rows: Rows::All,
        };
        let first = Output::Hidden {
            layer: 1,
            rows: Rows::All,
        };
        let together = run(&model, &texts, last)?;
        let mut at = 0;
        for (case, text) in cases.iter().zip(&texts) {
            let want = flat(&case["hidden"]);
            let alone = run(&model, std::slice::from_ref(text), last)?;
            let d = max_diff(&alone, &want);
            let b = max_diff(&together[at..at + want.len()], &want);
            at += want.len();
            let l = max_diff(
                &run(&model, std::slice::from_ref(text), first)?,
                &flat(&case["layer1"]),
            );
            eprintln!(
                "{name}, {} tokens: last_hidden_state {d:.2e} (batched {b:.2e}), \
                 hidden_states[1] {l:.2e}",
                text.len()
            );
            assert!(d < TOL && b < TOL && l < TOL, "{name}: {d} {b} {l}");
        }
    }
    Ok(())
}

#[test]
fn the_unigram_tokenizer_gives_transformers_ids() -> Result<()> {
    let e = expected()?;
    let dir = fixture().join("tokenizer");
    let tok = u_tokenizer::Tok::from_json(
        &std::fs::read_to_string(dir.join("tokenizer.json"))?,
        Some(&std::fs::read_to_string(dir.join("tokenizer_config.json"))?),
    )?;
    for case in e["gated"].as_array().expect("cases") {
        let text = case["text"].as_str().expect("text");
        assert_eq!(tok.encode_with(text, true, false)?, ids(case), "{text:?}");
    }
    Ok(())
}

#[test]
fn bad_requests_are_clear_errors() -> Result<()> {
    let model = model("gated")?;
    let fails = |texts: &[Vec<u32>], output: Output, kind: ErrorKind, says: &str| {
        let err = run(&model, texts, output).expect_err("refused");
        assert_eq!(err.kind, kind, "{err}");
        assert!(err.message.contains(says), "{err} should say {says:?}");
    };
    let last = Output::Hidden {
        layer: 2,
        rows: Rows::All,
    };
    fails(
        &[vec![3, 999]],
        last,
        ErrorKind::InvalidInput,
        "outside the vocabulary",
    );
    fails(
        &[vec![3, 1]],
        Output::Hidden {
            layer: 3,
            rows: Rows::All,
        },
        ErrorKind::InvalidInput,
        "2 blocks",
    );
    fails(
        &[vec![3, 1]],
        Output::Pooled(Pooling::Head),
        ErrorKind::Unsupported,
        "no pooling head",
    );
    fails(
        &[vec![3; 513]],
        last,
        ErrorKind::ResourceExhausted,
        "longer",
    );
    // The mean of the final rows is its own pooling.
    let mean = run(&model, &[vec![3, 4, 1]], Output::Pooled(Pooling::Mean))?;
    let rows = run(&model, &[vec![3, 4, 1]], last)?;
    let by_hand: Vec<f32> = (0..12)
        .map(|c| (0..3).map(|r| rows[r * 12 + c]).sum::<f32>() / 3.0)
        .collect();
    assert!(max_diff(&mean, &by_hand) < 1e-6);
    Ok(())
}

#[test]
fn position_buckets_equal_transformers_at_t5s_usual_settings() -> Result<()> {
    let b = &expected()?["buckets"];
    let first = b["first"].as_i64().expect("first");
    let (buckets, distance) = (
        b["num_buckets"].as_u64().expect("buckets") as usize,
        b["max_distance"].as_u64().expect("distance") as usize,
    );
    let want: Vec<usize> = serde_json::from_value(b["buckets"].clone())?;
    for (i, w) in want.iter().enumerate() {
        let d = first + i as i64;
        assert_eq!(
            u_arch_t5::model::relative_bucket(d, buckets, distance),
            *w,
            "distance {d}"
        );
    }
    Ok(())
}
