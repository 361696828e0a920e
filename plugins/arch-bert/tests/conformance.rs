//! arch-bert against transformers' `BertModel` on a tiny random-weight BERT
//! (`tests/fixtures/gen_bert_tiny.py`): the last hidden state and the mask-mean pooled vector
//! of single sequences, a sentence pair (the second token segment is segment 1) and a padded
//! batch of two (run as two chunks of one pass, each unpadded), within 1e-4.

use anyhow::{Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_bert::BertArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{ModelBox, ModelKind, Output, Pooling, Rows, Segment, SeqChunk};

/// Stated tolerance.
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/bert-tiny")
}

fn model() -> Result<ModelBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, &fixture())?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(BertArchitecture.load(weights, backend)?)
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

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A sequence's ids as token segments: a new segment wherever the token type changes.
fn segments<'a>(ids: &'a [u32], types: &[u64]) -> Vec<Segment<'a>> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=ids.len() {
        if i == ids.len() || types[i] != types[i - 1] {
            out.push(Segment::Tokens(RSlice::from_slice(&ids[start..i])));
            start = i;
        }
    }
    out
}

#[test]
fn hidden_states_and_mean_pooling_match_transformers() -> Result<()> {
    let model = model()?;
    let config = model.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Encoder);
    assert_eq!(config.pooling, Pooling::Mean);
    let hidden = config.hidden as usize;
    let expected: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    let mut worst = (0f32, 0f32);
    for case in expected["cases"].as_array().context("cases")? {
        let batch = case["ids"].as_array().context("ids")?.len();
        // Every sequence of the case, unpadded: ids where the attention mask is 1.
        let seqs: Vec<(Vec<u32>, Vec<u64>)> = (0..batch)
            .map(|b| {
                let mask = &case["attention_mask"][b];
                let keep = |v: &Value| -> Vec<u64> {
                    v.as_array()
                        .unwrap()
                        .iter()
                        .zip(mask.as_array().unwrap())
                        .filter(|(_, m)| m.as_u64() == Some(1))
                        .map(|(x, _)| x.as_u64().unwrap())
                        .collect()
                };
                let ids = keep(&case["ids"][b])
                    .into_iter()
                    .map(|i| i as u32)
                    .collect();
                (ids, keep(&case["token_type_ids"][b]))
            })
            .collect();
        let inputs: Vec<Vec<Segment<'_>>> = seqs.iter().map(|(i, t)| segments(i, t)).collect();
        // One pass: each sequence's hidden states, then (another pass) its pooled vector.
        for (output, what) in [
            (
                Output::Hidden {
                    layer: config.layers,
                    rows: Rows::All,
                },
                "hidden",
            ),
            (Output::Pooled(Pooling::Mean), "pooled"),
        ] {
            let chunks: Vec<SeqChunk<'_>> = inputs
                .iter()
                .enumerate()
                .map(|(b, input)| SeqChunk::tokens(b as u64, input, output))
                .collect();
            let n: usize = seqs
                .iter()
                .map(|(i, _)| output.floats(i.len(), &config))
                .sum();
            let mut out = vec![0f32; n];
            model
                .forward(
                    RSlice::from_slice(&chunks),
                    RSliceMut::from_mut_slice(&mut out),
                )
                .into_result()?;
            let mut at = 0;
            for (b, (ids, _)) in seqs.iter().enumerate() {
                let got = &out[at..at + output.floats(ids.len(), &config)];
                at += got.len();
                let want = if what == "hidden" {
                    floats(&case["last_hidden_state"][b])[..ids.len() * hidden].to_vec()
                } else {
                    floats(&case["mean_pooled"][b])
                };
                let d = max_diff(got, &want);
                if what == "hidden" {
                    worst.0 = worst.0.max(d);
                } else {
                    worst.1 = worst.1.max(d);
                }
                assert!(
                    d <= TOL,
                    "{what} of a {}-token sequence differs by {d}",
                    ids.len()
                );
            }
        }
    }
    eprintln!(
        "bert-tiny: last hidden state max |Δ| {:.2e}, mean pooled {:.2e}",
        worst.0, worst.1
    );
    Ok(())
}

#[test]
fn malformed_inputs_are_refused() -> Result<()> {
    let model = model()?;
    let run = |input: &[Segment<'_>], output: Output| {
        let config = model.config().into_result().unwrap();
        let chunk = [SeqChunk::tokens(0, input, output)];
        let rows = chunk[0].rows(config.hidden as usize);
        let mut out = vec![0f32; output.floats(rows, &config)];
        model
            .forward(
                RSlice::from_slice(&chunk),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()
    };
    let ids = [1u32, 2, 3];
    let tokens = [Segment::Tokens(RSlice::from_slice(&ids))];
    let e = run(&tokens, Output::Logits(Rows::Last)).unwrap_err();
    assert!(e.message.contains("not logits"), "{e}");
    let far = [1u32, 500];
    let e = run(
        &[Segment::Tokens(RSlice::from_slice(&far))],
        Output::Pooled(Pooling::Mean),
    )
    .unwrap_err();
    assert!(e.message.contains("outside the vocabulary"), "{e}");
    let long: Vec<u32> = vec![5; 65];
    let e = run(
        &[Segment::Tokens(RSlice::from_slice(&long))],
        Output::Pooled(Pooling::Mean),
    )
    .unwrap_err();
    assert!(e.message.contains("positions"), "{e}");
    assert!(run(&[], Output::Pooled(Pooling::Mean)).is_err());
    Ok(())
}
