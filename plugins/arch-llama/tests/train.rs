//! The trainer against PyTorch autograd (`tests/fixtures/gen_train.py`): the gradients of every
//! LoRA matrix (a rank-4 adapter on all seven projections) and of a soft prompt equal PEFT's to
//! 1e-5,
//! on a safetensors and a GGUF base (whose Q/K rows are permuted); AdamW steps lower the loss;
//! a checkpoint resumes bit for bit; the exported adapter, loaded back for inference, gives the
//! trainer's own loss; bad specs and states are refused.

mod support;

use abi_stable::std_types::{RSlice, RStr, RVec};
use anyhow::Result;
use serde_json::Value;
use std::path::Path;
use support::{build, cache_kv, max_abs_diff, run};
use u_sdk::{
    AdapterScale, ModelBox, NamedValues, Output, Rows, Segment, SeqChunk, SeqExtras, TrainSpec,
    TrainTarget, TrainerBox, WeightSetBox,
};

const ALL: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

fn fixtures() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures"))
}

fn reference() -> Result<Value> {
    Ok(serde_json::from_slice(&std::fs::read(
        fixtures().join("train/grads.json"),
    )?)?)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn tokens(r: &Value) -> Vec<u32> {
    r["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn lora_spec(rank: u32, alpha: f32, rslora: bool, targets: &[&str]) -> TrainSpec {
    TrainSpec {
        target: TrainTarget::Lora {
            rank,
            alpha,
            rslora,
            targets: targets.iter().map(|&t| t.into()).collect(),
        },
        seed: 7,
        weight_decay: 0.0,
        clip: 1.0,
    }
}

fn trainer(model: &ModelBox, spec: TrainSpec) -> Result<TrainerBox> {
    Ok(model.trainer(spec).into_result()?)
}

/// Every f32 tensor of a weight set, by name.
fn tensors(w: &WeightSetBox) -> Result<RVec<NamedValues>> {
    let mut out = RVec::new();
    for info in w.tensors().into_result()?.iter() {
        let view = w.tensor(info.name.as_str().into()).into_result()?;
        let values = view
            .data
            .as_slice()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        out.push(NamedValues {
            name: info.name.clone(),
            dims: view.shape.clone(),
            values,
        });
    }
    Ok(out)
}

/// The adapter the reference gradients were taken at.
fn adapter() -> Result<WeightSetBox> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let path = fixtures().join("train/adapter/adapter_model.safetensors");
    let m = SafetensorsModel::open(&StdFs, &path)?;
    Ok(SafetensorsWeights::new(m).into_box())
}

fn bases() -> Result<Vec<(&'static str, ModelBox)>> {
    Ok(vec![
        (
            "safetensors",
            build(support::safetensors("llama")?, cache_kv())?,
        ),
        ("gguf", build(support::gguf("llama")?, cache_kv())?),
    ])
}

#[test]
fn lora_gradients_equal_pytorch_autograd() -> Result<()> {
    let r = reference()?;
    let tokens = tokens(&r);
    let expected = r["lora"]["grads"].as_object().unwrap();
    for (base, model) in bases()? {
        let mut t = trainer(&model, lora_spec(4, 8.0, false, &ALL))?;
        t.restore(tensors(&adapter()?)?).into_result()?;
        let loss = t.accumulate(RSlice::from_slice(&tokens)).into_result()?;
        let want = r["lora"]["loss"].as_f64().unwrap() as f32;
        assert!(
            (loss - want).abs() < 1e-4,
            "{base}: loss {loss}, PyTorch {want}"
        );
        let grads = t.gradients().into_result()?;
        assert_eq!(
            grads.len(),
            expected.len(),
            "{base}: one gradient per matrix"
        );
        let mut worst = 0f32;
        for g in grads.iter() {
            let want = floats(&expected[g.name.as_str()]);
            let diff = max_abs_diff(&g.values, &want);
            assert!(diff < 1e-5, "{base}: {} differs by {diff}", g.name);
            worst = worst.max(diff);
        }
        let largest = expected
            .values()
            .flat_map(floats)
            .fold(0f32, |a, b| a.max(b.abs()));
        assert!(
            largest > 0.1,
            "the reference gradients are not trivially small"
        );
        eprintln!("{base}: worst gradient difference {worst:e} (largest gradient {largest})");
    }
    Ok(())
}

#[test]
fn soft_prompt_gradients_equal_pytorch_autograd() -> Result<()> {
    let r = reference()?;
    let tokens = tokens(&r);
    let sp = &r["soft_prompt"];
    let rows = sp["rows"].as_u64().unwrap() as u32;
    for (base, model) in bases()? {
        let spec = TrainSpec {
            target: TrainTarget::SoftPrompt {
                virtual_tokens: rows,
                init: RVec::new(),
            },
            seed: 1,
            weight_decay: 0.0,
            clip: 0.0,
        };
        let mut t = trainer(&model, spec)?;
        let hidden = model.config().into_result()?.hidden as u64;
        t.restore(
            vec![NamedValues {
                name: "prompt_embeddings".into(),
                dims: vec![rows as u64, hidden].into(),
                values: floats(&sp["prompt"]).into(),
            }]
            .into(),
        )
        .into_result()?;
        let loss = t.accumulate(RSlice::from_slice(&tokens)).into_result()?;
        let want = sp["loss"].as_f64().unwrap() as f32;
        assert!(
            (loss - want).abs() < 1e-4,
            "{base}: loss {loss}, PyTorch {want}"
        );
        let g = &t.gradients().into_result()?[0];
        let diff = max_abs_diff(&g.values, &floats(&sp["grad"]));
        assert!(
            diff < 1e-5,
            "{base}: the prompt's gradient differs by {diff}"
        );
    }
    Ok(())
}

/// The model's own mean next-token loss of `tokens` under adapter `name` (inference path).
fn inference_loss(model: &ModelBox, tokens: &[u32], name: &str) -> Result<f32> {
    let config = model.config().into_result()?;
    let vocab = config.vocab_size as usize;
    let cache = model.cache().into_result()?.into_option().unwrap();
    let seq = cache.create().into_result()?;
    let input = [Segment::Tokens(RSlice::from_slice(tokens))];
    let adapters = [AdapterScale {
        name: RStr::from_str(name),
        scale: 1.0,
    }];
    let chunk = SeqChunk {
        extras: SeqExtras {
            adapters: RSlice::from_slice(&adapters),
            ..SeqExtras::default()
        },
        ..SeqChunk::tokens(seq, &input, Output::Logits(Rows::All))
    };
    let logits = run(model, &config, &[chunk])?;
    let mut sum = 0f64;
    for (row, &next) in logits.chunks_exact(vocab).zip(&tokens[1..]) {
        let max = row.iter().copied().fold(f32::MIN, f32::max);
        let lse = row
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .sum::<f64>()
            .ln()
            + f64::from(max);
        sum += lse - f64::from(row[next as usize]);
    }
    Ok((sum / (tokens.len() - 1) as f64) as f32)
}

#[test]
fn steps_lower_the_loss_resume_exactly_and_export_what_inference_loads() -> Result<()> {
    let tokens = tokens(&reference()?);
    for (base, model) in bases()? {
        let spec = lora_spec(4, 8.0, false, &["q_proj", "k_proj", "v_proj", "down_proj"]);
        let mut t = trainer(&model, spec.clone())?;
        let first = t.loss(RSlice::from_slice(&tokens)).into_result()?;
        for _ in 0..3 {
            t.accumulate(RSlice::from_slice(&tokens)).into_result()?;
            t.step(1e-2).into_result()?;
        }
        let checkpoint = t.state().into_result()?;
        assert!(
            checkpoint
                .iter()
                .any(|n| n.name == "step" && n.values[0] == 3.0)
        );
        let mut continued = Vec::new();
        for _ in 0..3 {
            continued.push(t.accumulate(RSlice::from_slice(&tokens)).into_result()?);
            t.step(1e-2).into_result()?;
        }
        let last = t.loss(RSlice::from_slice(&tokens)).into_result()?;
        assert!(
            last < first - 0.5,
            "{base}: loss {first} → {last} after six steps"
        );

        // A fresh trainer resumed from the checkpoint takes the same steps, bit for bit.
        let mut resumed = trainer(&model, spec)?;
        resumed.restore(checkpoint).into_result()?;
        for want in continued {
            let got = resumed
                .accumulate(RSlice::from_slice(&tokens))
                .into_result()?;
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{base}: the resumed run differs"
            );
            resumed.step(1e-2).into_result()?;
        }
        assert_eq!(t.export().into_result()?, resumed.export().into_result()?);

        // The exported adapter (PEFT names and orientation), loaded for inference, gives the
        // trainer's loss.
        let trained = t.export().into_result()?;
        let config: Value = serde_json::from_str(&trained.config)?;
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["r"], 4);
        let dir =
            std::env::temp_dir().join(format!("u-train-export-{base}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let file = dir.join("adapter_model.safetensors");
        std::fs::write(&file, u_train::state::encode(&trained.tensors)?)?;
        use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
        let weights = SafetensorsWeights::new(SafetensorsModel::open(&StdFs, &file)?).into_box();
        model
            .load_adapter("trained".into(), weights, RStr::from_str(&trained.config))
            .into_result()?;
        let served = inference_loss(&model, &tokens, "trained")?;
        assert!(
            (served - last).abs() < 1e-4,
            "{base}: inference under the export gives {served}, the trainer {last}"
        );
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}

#[test]
fn bad_specs_and_states_are_refused() -> Result<()> {
    let model = build(support::safetensors("llama")?, cache_kv())?;
    let refused = |spec: TrainSpec, says: &str| {
        let e = model.trainer(spec).into_result().err().expect("refused");
        assert!(e.message.contains(says), "{}", e.message);
    };
    refused(lora_spec(0, 1.0, false, &["q_proj"]), "rank of 0");
    refused(
        lora_spec(2, 1.0, false, &["qq_proj"]),
        "unknown target module `qq_proj`",
    );
    refused(lora_spec(2, 1.0, false, &[]), "no target modules");
    let mut t = trainer(&model, lora_spec(2, 4.0, false, &["q_proj"]))?;
    let e = t.step(1e-3).into_result().unwrap_err();
    assert!(
        e.message.contains("no accumulated gradients"),
        "{}",
        e.message
    );
    let e = t
        .accumulate(RSlice::from_slice(&[1u32]))
        .into_result()
        .unwrap_err();
    assert!(e.message.contains("at least two tokens"), "{}", e.message);
    let e = t
        .accumulate(RSlice::from_slice(&[1u32, 9999]))
        .into_result()
        .unwrap_err();
    assert!(
        e.message.contains("outside the vocabulary"),
        "{}",
        e.message
    );
    let mut state = t.state().into_result()?;
    state[0].values[0] = f32::NAN;
    let e = t.restore(state.clone()).into_result().unwrap_err();
    assert!(e.message.contains("non-finite"), "{}", e.message);
    state[0].dims = vec![1, 1].into();
    let e = t.restore(state).into_result().unwrap_err();
    assert!(e.message.contains("has shape"), "{}", e.message);
    let e = t
        .restore(
            vec![NamedValues {
                name: "nonsense".into(),
                dims: vec![1].into(),
                values: vec![0.0].into(),
            }]
            .into(),
        )
        .into_result()
        .unwrap_err();
    assert!(e.message.contains("not a parameter"), "{}", e.message);
    Ok(())
}
