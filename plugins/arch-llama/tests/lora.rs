//! Low-rank adapters against PEFT (`tests/fixtures/gen_lora.py`): one adapter, and three
//! different adapters and none in one batch, give PEFT's logits to 1e-4, on a safetensors and a
//! GGUF base, from PEFT's files and from llama.cpp's GGUF LoRA; scale 0 is the base bit for bit;
//! bad adapters are refused with a clear error while the loaded ones keep working.

mod support;

use abi_stable::std_types::{RSlice, RStr};
use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use support::{build, cache_kv, max_abs_diff, run};
use u_sdk::{AdapterScale, ModelBox, Output, Rows, Segment, SeqChunk, SeqExtras, WeightSetBox};

fn lora_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora")
}

/// A PEFT adapter directory's weights and config text.
fn peft(dir: &Path) -> Result<(WeightSetBox, String)> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let m = SafetensorsModel::open(&StdFs, &dir.join("adapter_model.safetensors"))?;
    let config = std::fs::read_to_string(dir.join("adapter_config.json"))?;
    Ok((SafetensorsWeights::new(m).into_box(), config))
}

fn load(model: &ModelBox, name: &str, (weights, config): (WeightSetBox, String)) -> Result<()> {
    model
        .load_adapter(name.into(), weights, RStr::from_str(&config))
        .into_result()?;
    Ok(())
}

/// One of PEFT's cases: prompt, adapter (or none) and logits.
type Case = (Vec<u32>, Option<String>, Vec<f32>);

/// A tensor to write: name, shape, values.
type Written<'a> = (&'a str, Vec<u64>, Vec<f32>);

/// PEFT's cases.
fn cases() -> Result<Vec<Case>> {
    let expected: Value =
        serde_json::from_slice(&std::fs::read(lora_dir().join("expected.json"))?)?;
    let vocab = expected["vocab"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(lora_dir().join("logits.bin"))?;
    let all: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let mut at = 0;
    let mut out = Vec::new();
    for case in expected["cases"].as_array().unwrap() {
        let prompt: Vec<u32> = case["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let n = prompt.len() * vocab;
        let adapter = case["adapter"].as_str().map(str::to_string);
        out.push((prompt, adapter, all[at..at + n].to_vec()));
        at += n;
    }
    assert_eq!(at, all.len());
    Ok(out)
}

fn new_seq(model: &ModelBox) -> Result<u64> {
    let cache = model.cache().into_result()?.into_option().unwrap();
    Ok(cache.create().into_result()?)
}

/// Runs `prompts` (each with its adapters) as one batch of fresh sequences; every row's logits.
fn logits(model: &ModelBox, prompts: &[(&[u32], Vec<AdapterScale<'_>>)]) -> Result<Vec<Vec<f32>>> {
    let config = model.config().into_result()?;
    let inputs: Vec<[Segment<'_>; 1]> = prompts
        .iter()
        .map(|(p, _)| [Segment::Tokens(RSlice::from_slice(p))])
        .collect();
    let mut chunks = Vec::new();
    for ((_, adapters), input) in prompts.iter().zip(&inputs) {
        chunks.push(SeqChunk {
            extras: SeqExtras {
                adapters: RSlice::from_slice(adapters),
                ..SeqExtras::default()
            },
            ..SeqChunk::tokens(new_seq(model)?, input, Output::Logits(Rows::All))
        });
    }
    let out = run(model, &config, &chunks)?;
    let mut rows = Vec::new();
    let mut at = 0;
    for (p, _) in prompts {
        let n = p.len() * config.vocab_size as usize;
        rows.push(out[at..at + n].to_vec());
        at += n;
    }
    Ok(rows)
}

fn under(name: &Option<String>) -> Vec<AdapterScale<'_>> {
    name.iter()
        .map(|n| AdapterScale {
            name: RStr::from_str(n),
            scale: 1.0,
        })
        .collect()
}

#[test]
fn adapters_alone_and_mixed_in_one_batch_equal_peft() -> Result<()> {
    let cases = cases()?;
    for (base, weights) in [
        ("safetensors", support::safetensors("llama")?),
        ("gguf", support::gguf("llama")?),
    ] {
        let model = build(weights, cache_kv())?;
        for name in ["a", "b", "c"] {
            load(&model, name, peft(&lora_dir().join(name))?)?;
        }
        let gguf_a = u_loader_gguf::open_path(&lora_dir().join("a.gguf"))?.into_box();
        model
            .load_adapter("a.gguf".into(), gguf_a, "".into())
            .into_result()?;
        let listed: Vec<String> = model
            .adapters()
            .into_result()?
            .iter()
            .map(|a| format!("{}:r{}:{:.4}", a.name, a.rank, a.scaling))
            .collect();
        assert_eq!(
            listed,
            [
                "a:r8:2.0000",
                "a.gguf:r8:2.0000",
                "b:r4:2.0000",
                "c:r2:2.8284"
            ]
        );

        let mut worst = 0f32;
        for (prompt, adapter, want) in &cases {
            let got = logits(&model, &[(prompt, under(adapter))])?;
            worst = worst.max(max_abs_diff(&got[0], want));
        }
        let batch: Vec<(&[u32], Vec<AdapterScale<'_>>)> = cases
            .iter()
            .map(|(p, a, _)| (p.as_slice(), under(a)))
            .collect();
        let mixed = logits(&model, &batch)?;
        let mut worst_mixed = 0f32;
        for ((_, _, want), got) in cases.iter().zip(&mixed) {
            worst_mixed = worst_mixed.max(max_abs_diff(got, want));
        }
        // llama.cpp's GGUF form of adapter `a` (Q/K rows as the converter orders them).
        let (prompt, _, want) = &cases[0];
        let from_gguf = logits(&model, &[(prompt, under(&Some("a.gguf".into())))])?;
        let gguf_diff = max_abs_diff(&from_gguf[0], want);
        eprintln!(
            "{base} base: solo {worst:.2e}, mixed batch {worst_mixed:.2e}, GGUF adapter {gguf_diff:.2e}"
        );
        assert!(worst < 1e-4 && worst_mixed < 1e-4 && gguf_diff < 1e-4);

        // The adapter really moves the logits, and scale 0 is the base bit for bit.
        let plain = logits(&model, &[(prompt, vec![])])?;
        assert!(max_abs_diff(&plain[0], want) > 0.1);
        let zero = vec![AdapterScale {
            name: "a".into(),
            scale: 0.0,
        }];
        assert_eq!(logits(&model, &[(prompt, zero)])?[0], plain[0]);
        assert!(model.unload_adapter("a".into()).into_result()?);
        let e = logits(&model, &[(prompt, under(&Some("a".into())))]).unwrap_err();
        assert!(e.to_string().contains("not loaded"), "{e}");
    }
    Ok(())
}

/// A safetensors file of f32 tensors.
fn write_safetensors(path: &Path, tensors: &[Written<'_>]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&header)?;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header);
    file.extend(data);
    std::fs::write(path, file)?;
    Ok(())
}

#[test]
fn bad_adapters_are_refused_and_the_loaded_ones_keep_working() -> Result<()> {
    let model = build(support::safetensors("llama")?, cache_kv())?;
    load(&model, "a", peft(&lora_dir().join("a"))?)?;
    let config = std::fs::read_to_string(lora_dir().join("a/adapter_config.json"))?;
    let dir = tempfile::tempdir()?;
    let q = |ab: &str| format!("base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight");
    let (qa, qb) = (q("A"), q("B"));
    let cases: Vec<(&str, Vec<Written<'_>>, String, &str)> = vec![
        (
            "another base's width",
            vec![
                (&qa, vec![8, 64], vec![0.1; 512]),
                (&qb, vec![32, 8], vec![0.1; 256]),
            ],
            config.clone(),
            "do not fit",
        ),
        (
            "ranks that disagree",
            vec![
                (&qa, vec![8, 32], vec![0.1; 256]),
                (&qb, vec![32, 4], vec![0.1; 128]),
            ],
            config.clone(),
            "do not fit",
        ),
        (
            "NaN",
            vec![
                (&qa, vec![8, 32], vec![f32::NAN; 256]),
                (&qb, vec![32, 8], vec![0.1; 256]),
            ],
            config.clone(),
            "NaN",
        ),
        (
            "lora_A without lora_B",
            vec![(&qa, vec![8, 32], vec![0.1; 256])],
            config.clone(),
            "not both",
        ),
        (
            "a T5 adapter",
            vec![(
                "base_model.model.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight",
                vec![16, 32],
                vec![0.1; 512],
            )],
            config.clone(),
            "names no projection",
        ),
        (
            "a layer past the model's",
            vec![
                (
                    "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight",
                    vec![8, 32],
                    vec![0.1; 256],
                ),
                (
                    "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight",
                    vec![32, 8],
                    vec![0.1; 256],
                ),
            ],
            config.clone(),
            "layer 9",
        ),
        (
            "DoRA",
            vec![
                (&qa, vec![8, 32], vec![0.1; 256]),
                (&qb, vec![32, 8], vec![0.1; 256]),
            ],
            config.replace("\"use_dora\": false", "\"use_dora\": true"),
            "DoRA",
        ),
        (
            "a config without r",
            vec![
                (&qa, vec![8, 32], vec![0.1; 256]),
                (&qb, vec![32, 8], vec![0.1; 256]),
            ],
            config.replace("\"r\": 8", "\"r\": null"),
            "positive `r`",
        ),
    ];
    for (what, tensors, config, expect) in cases {
        let path = dir
            .path()
            .join(format!("{}.safetensors", what.replace(' ', "_")));
        write_safetensors(&path, &tensors)?;
        use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
        let weights = SafetensorsWeights::new(SafetensorsModel::open(&StdFs, &path)?).into_box();
        let e = model
            .load_adapter("bad".into(), weights, RStr::from_str(&config))
            .into_result()
            .unwrap_err();
        assert!(
            e.message.contains(expect) && e.message.contains("`bad`"),
            "{what}: {e}"
        );
        eprintln!("{what}: {}", e.message);
    }
    // A truncated file is the loader's to refuse; a GGUF model file is no adapter.
    let whole = std::fs::read(lora_dir().join("a/adapter_model.safetensors"))?;
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &whole[..whole.len() - 100])?;
    use u_loader_safetensors::{SafetensorsModel, StdFs};
    let e = SafetensorsModel::open(&StdFs, &cut).unwrap_err();
    eprintln!("truncated: {e}");
    let not_lora = support::gguf("llama")?;
    let e = model
        .load_adapter("bad".into(), not_lora, "".into())
        .into_result()
        .unwrap_err();
    assert!(e.message.contains("not a LoRA adapter"), "{e}");

    let names: Vec<String> = model
        .adapters()
        .into_result()?
        .iter()
        .map(|a| a.name.to_string())
        .collect();
    assert_eq!(names, ["a"]);
    let (prompt, _, want) = &cases_of_a()?;
    let got = logits(&model, &[(prompt, under(&Some("a".into())))])?;
    assert!(max_abs_diff(&got[0], want) < 1e-4);
    Ok(())
}

fn cases_of_a() -> Result<Case> {
    Ok(cases()?.remove(0))
}
