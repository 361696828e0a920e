//! arch-whisper against transformers' `WhisperForConditionalGeneration` on a tiny random-weight
//! Whisper (`tests/fixtures/gen_whisper_tiny.py`): the encoder's output, the decoder's logits of
//! a whole token sequence, the same logits one token at a time from the cache, and two
//! sequences reading one encoded audio in one pass, within 1e-4; bad input refused with nothing
//! advanced.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_whisper::{Whisper, WhisperArchitecture};
use u_sdk::abi_stable::std_types::{ROption, RSlice};
use u_sdk::{CrossContext, ModelKind, Output, Rows, Segment, SeqChunk, SeqExtras, SeqId};

/// Stated tolerance.
const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn model() -> Result<Whisper> {
    let dir = fixtures().join("models/whisper-tiny-random");
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, &dir)?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    let cache = u_cache_kv::KvCachePlugin::new(u_cache_kv::Config::default(), None).into_box();
    Ok(WhisperArchitecture.load(weights, backend, cache)?)
}

fn expected() -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixtures().join("whisper_tiny_expected.json"),
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

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn ids(e: &Value) -> Vec<u32> {
    e["decoder_input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

/// A chunk of `tokens` for `seq` reading the audio in `kv` (bringing `mel` when non-empty).
fn chunk<'a>(
    seq: SeqId,
    input: &'a [Segment<'a>],
    kv: SeqId,
    mel: &'a [f32],
    output: Output,
) -> SeqChunk<'a> {
    SeqChunk {
        seq,
        input: RSlice::from_slice(input),
        output,
        extras: SeqExtras {
            cross: ROption::RSome(CrossContext {
                kv,
                rows: RSlice::from_slice(mel),
            }),
            ..SeqExtras::default()
        },
    }
}

#[test]
fn encoder_output_matches_transformers() -> Result<()> {
    let model = model()?;
    let e = expected()?;
    let config = model.model_config();
    assert_eq!(config.kind, ModelKind::CrossDecoder);
    assert_eq!(config.context_shape, [80, 200]);
    let got = model.encode(&floats(&e["mel"]))?;
    let want = floats(&e["encoder_out"]);
    let d = max_diff(&got, &want);
    eprintln!("encoder output: max |Δ| {d:.2e} over {} values", want.len());
    assert!(d < TOL, "encoder output differs by {d}");
    Ok(())
}

#[test]
fn logits_match_transformers_whole_and_step_by_step() -> Result<()> {
    let model = model()?;
    let cache = model.kv_cache().clone();
    let e = expected()?;
    let (mel, tokens, want) = (floats(&e["mel"]), ids(&e), floats(&e["logits"]));
    let vocab = model.cfg.vocab_size;

    let (seq, kv) = (cache.create().into_result()?, cache.create().into_result()?);
    let input = [Segment::Tokens(RSlice::from_slice(&tokens))];
    let mut whole = vec![0f32; tokens.len() * vocab];
    model.forward(
        &[chunk(seq, &input, kv, &mel, Output::Logits(Rows::All))],
        &mut whole,
    )?;
    let d = max_diff(&whole, &want);
    eprintln!("decoder logits (one pass): max |Δ| {d:.2e}");
    assert!(d < TOL, "logits differ by {d}");
    assert_eq!(
        cache.len(kv).into_result()?,
        model.cfg.audio_positions as u64
    );

    // The same tokens one at a time, reading the audio remembered under `kv`.
    let step_seq = cache.create().into_result()?;
    let mut worst = 0f32;
    for (i, t) in tokens.iter().enumerate() {
        let one = [Segment::Tokens(RSlice::from_slice(std::slice::from_ref(t)))];
        let mut row = vec![0f32; vocab];
        model.forward(
            &[chunk(step_seq, &one, kv, &[], Output::Logits(Rows::Last))],
            &mut row,
        )?;
        worst = worst.max(max_diff(&row, &want[i * vocab..(i + 1) * vocab]));
    }
    eprintln!("decoder logits (token by token): max |Δ| {worst:.2e}");
    assert!(worst < TOL, "step-by-step logits differ by {worst}");

    // Two sequences (beams) over one audio in one pass: a fork of the first three tokens and a
    // fresh sequence, each continuing differently.
    let fork = cache.fork(step_seq).into_result()?;
    cache.truncate(fork, 3).into_result()?;
    let fresh = cache.create().into_result()?;
    let a = [Segment::Tokens(RSlice::from_slice(&tokens[3..5]))];
    let b = [Segment::Tokens(RSlice::from_slice(&tokens[..2]))];
    let mut out = vec![0f32; 2 * vocab];
    model.forward(
        &[
            chunk(fork, &a, kv, &[], Output::Logits(Rows::Last)),
            chunk(fresh, &b, kv, &[], Output::Logits(Rows::Last)),
        ],
        &mut out,
    )?;
    let d = max_diff(&out[..vocab], &want[4 * vocab..5 * vocab])
        .max(max_diff(&out[vocab..], &want[vocab..2 * vocab]));
    eprintln!("two beams in one pass: max |Δ| {d:.2e}");
    assert!(d < TOL, "batched beams differ by {d}");
    Ok(())
}

#[test]
fn bad_input_is_refused_and_nothing_advances() -> Result<()> {
    let model = model()?;
    let cache = model.kv_cache().clone();
    let e = expected()?;
    let (mel, tokens) = (floats(&e["mel"]), ids(&e));
    let vocab = model.cfg.vocab_size;
    let (seq, kv) = (cache.create().into_result()?, cache.create().into_result()?);
    let input = [Segment::Tokens(RSlice::from_slice(&tokens[..2]))];
    let mut out = vec![0f32; vocab];

    let short = &mel[..mel.len() - 80];
    let err = model
        .forward(
            &[chunk(seq, &input, kv, short, Output::Logits(Rows::Last))],
            &mut out,
        )
        .unwrap_err();
    assert!(err.message.contains("mel bins"), "{}", err.message);
    let err = model
        .forward(
            &[chunk(seq, &input, kv, &[], Output::Logits(Rows::Last))],
            &mut out,
        )
        .unwrap_err();
    assert!(err.message.contains("no encoded audio"), "{}", err.message);
    let mut nan = mel.clone();
    nan[7] = f32::NAN;
    let err = model
        .forward(
            &[chunk(seq, &input, kv, &nan, Output::Logits(Rows::Last))],
            &mut out,
        )
        .unwrap_err();
    assert!(err.message.contains("not finite"), "{}", err.message);
    let past = [vocab as u32];
    let outside = [Segment::Tokens(RSlice::from_slice(&past))];
    let err = model
        .forward(
            &[chunk(seq, &outside, kv, &mel, Output::Logits(Rows::Last))],
            &mut out,
        )
        .unwrap_err();
    assert!(
        err.message.contains("outside the vocabulary"),
        "{}",
        err.message
    );
    let plain = SeqChunk::tokens(seq, &input, Output::Logits(Rows::Last));
    let err = model.forward(&[plain], &mut out).unwrap_err();
    assert!(err.message.contains("cross context"), "{}", err.message);
    assert_eq!(cache.len(seq).into_result()?, 0);
    assert_eq!(cache.len(kv).into_result()?, 0);

    // A good pass still works after the refusals, and a second spectrogram for the same audio
    // sequence is refused.
    model.forward(
        &[chunk(seq, &input, kv, &mel, Output::Logits(Rows::Last))],
        &mut out,
    )?;
    let again = [Segment::Tokens(RSlice::from_slice(&tokens[2..3]))];
    let err = model
        .forward(
            &[chunk(seq, &again, kv, &mel, Output::Logits(Rows::Last))],
            &mut out,
        )
        .unwrap_err();
    assert!(err.message.contains("already holds"), "{}", err.message);
    assert_eq!(cache.len(seq).into_result()?, 2);
    Ok(())
}
