//! Control vectors and soft prompts against their references (arch-llama's
//! `tests/fixtures/gen_steering.py`): a llama.cpp-format control vector read from GGUF or
//! safetensors at strength 0.7 gives transformers' logits with the vector added to block 1's
//! output; at strength 0 the logits are the base model's bit for bit; a PEFT prompt-tuning
//! adapter's rows before the prompt give PEFT's logits; files that do not fit are refused by
//! name.

mod common;

use abi_stable::std_types::{RSlice, RSliceMut, RString};
use anyhow::Result;
use std::path::PathBuf;
use u_runner_text::extras::Extras;
use u_sdk::{
    ControlUse, ExtraKind, ModelBox, Output, Rows, RunnerExtra, Segment, SeqChunk, SeqExtras,
    Steering, WeightSetBox,
};

fn steering_dir() -> PathBuf {
    common::fixture("llama").join("../../steering")
}

fn open(file: &str) -> Result<WeightSetBox> {
    let path = steering_dir().join(file);
    if file.ends_with(".gguf") {
        return Ok(u_loader_gguf::open_path(&path)?.into_box());
    }
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    Ok(SafetensorsWeights::new(SafetensorsModel::open(&StdFs, &path)?).into_box())
}

fn extra(name: &str, kind: ExtraKind, file: &str, config: &str) -> Result<RunnerExtra> {
    Ok(RunnerExtra {
        name: name.into(),
        kind,
        weights: open(file)?,
        config: RString::from(config),
    })
}

fn reference() -> Result<(Vec<u32>, usize, Vec<Vec<f32>>)> {
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(steering_dir().join("expected.json"))?)?;
    let prompt: Vec<u32> = expected["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let vocab = expected["vocab"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(steering_dir().join("logits.bin"))?;
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let n = prompt.len() * vocab;
    Ok((prompt, vocab, all.chunks(n).map(<[f32]>::to_vec).collect()))
}

/// Every row's logits of `input` run as one fresh sequence with `steering`.
fn logits(model: &ModelBox, input: &[Segment<'_>], steering: &[Steering<'_>]) -> Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let seq = model
        .cache()
        .into_result()?
        .into_option()
        .unwrap()
        .create()
        .into_result()?;
    let chunk = SeqChunk {
        extras: SeqExtras {
            steering: RSlice::from_slice(steering),
            ..SeqExtras::default()
        },
        ..SeqChunk::tokens(seq, input, Output::Logits(Rows::All))
    };
    let mut out = vec![
        0f32;
        chunk
            .output
            .floats(chunk.rows(config.hidden as usize), &config)
    ];
    model
        .forward(
            RSlice::from_slice(&[chunk]),
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

fn steering(steer: &u_runner_text::extras::Steer) -> Vec<Steering<'_>> {
    steer
        .entries
        .iter()
        .map(|(layer, strength, v)| Steering {
            first_layer: *layer,
            last_layer: *layer,
            strength: *strength,
            vector: v.as_ref().into(),
        })
        .collect()
}

#[test]
fn control_vectors_and_soft_prompts_equal_their_references() -> Result<()> {
    let (prompt, vocab, refs) = reference()?;
    let model = common::build(common::safetensors("llama")?)?;
    let config = model.config().into_result()?;
    let soft_config = std::fs::read_to_string(steering_dir().join("soft/adapter_config.json"))?;
    let extras = Extras::read(
        vec![
            extra("cvec", ExtraKind::ControlVector, "cvec.gguf", "")?,
            extra("cvec-st", ExtraKind::ControlVector, "cvec.safetensors", "")?,
            extra(
                "soft",
                ExtraKind::SoftPrompt,
                "soft/adapter_model.safetensors",
                &soft_config,
            )?,
        ],
        &config,
    )?;
    let tokens = [Segment::Tokens(RSlice::from_slice(&prompt))];
    let base = logits(&model, &tokens, &[])?;
    let use_at = |name: &str, strength: f32| ControlUse {
        name: name.into(),
        strength,
        first_layer: 0,
        last_layer: u32::MAX,
    };
    for name in ["cvec", "cvec-st"] {
        let steer = extras.steer(&[use_at(name, 0.7)])?;
        let got = logits(&model, &tokens, &steering(&steer))?;
        let d = max_diff(&got, &refs[0]);
        eprintln!(
            "{name} at 0.7: {d:.2e} from transformers (base differs by {:.2})",
            max_diff(&base, &refs[0])
        );
        assert!(d < 1e-4 && max_diff(&base, &refs[0]) > 0.05);
        let zero = extras.steer(&[use_at(name, 0.0)])?;
        assert_eq!(
            logits(&model, &tokens, &steering(&zero))?,
            base,
            "strength 0 is the base"
        );
        // A layer range that leaves out block 1 changes nothing either.
        let outside = extras.steer(&[ControlUse {
            last_layer: 0,
            ..use_at(name, 0.7)
        }])?;
        assert!(outside.entries.is_empty());
    }

    let rows = extras.soft_prompt("soft")?.unwrap();
    let input = [
        Segment::Embeddings(RSlice::from_slice(&rows)),
        Segment::Tokens(RSlice::from_slice(&prompt)),
    ];
    let got = logits(&model, &input, &[])?;
    let virtual_rows = rows.len() / config.hidden as usize;
    let real = &got[virtual_rows * vocab..];
    let d = max_diff(real, &refs[1]);
    eprintln!("soft prompt of {virtual_rows} virtual tokens: {d:.2e} from PEFT");
    assert!(d < 1e-4);

    // Files that do not fit are refused by name.
    let refusals = [
        (
            extra(
                "x",
                ExtraKind::ControlVector,
                "soft/adapter_model.safetensors",
                "",
            )?,
            "not a `direction.{L}`",
        ),
        (
            extra("x", ExtraKind::SoftPrompt, "cvec.safetensors", &soft_config)?,
            "prompt_embeddings",
        ),
        (
            extra(
                "x",
                ExtraKind::SoftPrompt,
                "soft/adapter_model.safetensors",
                "{\"peft_type\": \"LORA\"}",
            )?,
            "not PROMPT_TUNING",
        ),
        (
            extra(
                "x",
                ExtraKind::ControlVector,
                "../models/llama/model.gguf",
                "",
            )?,
            "not a control vector",
        ),
    ];
    for (bad, says) in refusals {
        let e = Extras::read(vec![bad], &config).err().expect("refused");
        assert!(
            e.to_string().contains(says) && e.to_string().contains("`x`"),
            "{e}"
        );
    }
    let e = extras.steer(&[use_at("nope", 1.0)]).expect_err("unknown");
    assert!(e.to_string().contains("not loaded"), "{e}");
    Ok(())
}
