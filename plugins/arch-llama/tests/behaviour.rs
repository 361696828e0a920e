//! Behaviour of the model beyond the numbers: batch validation, rollback, forks, chunked
//! prefill, context limits and clear errors for malformed weight sets.

mod support;

use anyhow::Result;
use std::collections::BTreeSet;
use support::{
    build, build_with, cases, forward, max_abs_diff, reference_cache::ReferenceCache,
    reference_kernels::RecordMatmul,
};
use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights};
use u_sdk::{ErrorKind, Output, Rows, WeightSetBox};

fn fixture_with_config(
    model: &str,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Result<WeightSetBox> {
    let d = support::dir(model);
    let file = std::fs::read(d.join("model.safetensors"))?;
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("config.json"))?)?;
    edit(&mut config);
    let m = SafetensorsModel::from_bytes(file, Some(&serde_json::to_vec(&config)?))?;
    Ok(SafetensorsWeights::new(m).into_box())
}

#[test]
fn model_config_reports_the_family_and_sizes() -> Result<()> {
    let m = build(support::safetensors("mixtral")?, ReferenceCache::new_box(4))?;
    let c = m.config().unwrap();
    assert_eq!(c.family.as_str(), "mixtral");
    assert_eq!(
        (c.vocab_size, c.layers, c.hidden, c.experts),
        (128, 2, 32, 4)
    );
    assert_eq!(c.context_length, 256);
    let m = build(support::gguf("qwen3")?, ReferenceCache::new_box(4))?;
    assert_eq!(m.config().unwrap().family.as_str(), "qwen3");
    assert_eq!(m.config().unwrap().experts, 0);
    Ok(())
}

#[test]
fn malformed_batches_are_refused_and_leave_the_cache_untouched() -> Result<()> {
    let m = build(support::safetensors("llama")?, ReferenceCache::new_box(4))?;
    let cache = m.cache().unwrap().unwrap();
    let s = cache.create().into_result()?;
    forward(&m, &[(s, &[5, 6, 7], Output::Nothing)])?;

    let err = |r: Result<Vec<f32>>| r.expect_err("refused").to_string();
    let e = err(forward(
        &m,
        &[
            (s, &[1], Output::Logits(Rows::Last)),
            (s, &[2], Output::Logits(Rows::Last)),
        ],
    ));
    assert!(e.contains("twice"), "{e}");
    let e = err(forward(&m, &[(s, &[128], Output::Logits(Rows::Last))]));
    assert!(e.contains("outside the vocabulary"), "{e}");
    let e = err(forward(&m, &[(s, &[], Output::Logits(Rows::Last))]));
    assert!(e.contains("no input"), "{e}");
    let e = err(forward(&m, &[(9999, &[1], Output::Logits(Rows::Last))]));
    assert!(!e.is_empty());
    // A logits buffer of the wrong size.
    let input = [u_sdk::Segment::Tokens(
        abi_stable::std_types::RSlice::from_slice(&[1]),
    )];
    let chunk = [u_sdk::SeqChunk::tokens(
        s,
        &input,
        Output::Logits(Rows::Last),
    )];
    let mut small = vec![0f32; 10];
    let r = m.forward(
        abi_stable::std_types::RSlice::from_slice(&chunk),
        abi_stable::std_types::RSliceMut::from_mut_slice(&mut small),
    );
    assert_eq!(r.into_result().unwrap_err().kind, ErrorKind::InvalidInput);

    assert_eq!(
        cache.len(s).into_result()?,
        3,
        "refused batches appended nothing"
    );
    // Nothing asked: no logits, KV still appended.
    assert!(forward(&m, &[(s, &[8], Output::Nothing)])?.is_empty());
    assert_eq!(cache.len(s).into_result()?, 4);
    Ok(())
}

#[test]
fn chunked_prefill_and_forks_give_the_same_logits() -> Result<()> {
    let (vocab, cases) = cases("qwen2_moe")?;
    let case = cases.iter().max_by_key(|c| c.prompt.len()).unwrap();
    let m = build(
        support::safetensors("qwen2_moe")?,
        ReferenceCache::new_box(4),
    )?;
    let cache = m.cache().unwrap().unwrap();

    // Prefill in chunks of 3, all logits: the same rows as one pass.
    let s = cache.create().into_result()?;
    let mut rows = Vec::new();
    for part in case.prompt.chunks(3) {
        rows.extend(forward(&m, &[(s, part, Output::Logits(Rows::All))])?);
    }
    assert!(max_abs_diff(&rows, &case.logits) <= 1e-4);

    // A fork continues exactly as its parent.
    let f = cache.fork(s).into_result()?;
    let a = forward(&m, &[(s, &[42], Output::Logits(Rows::Last))])?;
    let b = forward(&m, &[(f, &[42], Output::Logits(Rows::Last))])?;
    assert_eq!(a.len(), vocab);
    assert!(max_abs_diff(&a, &b) <= 1e-6);
    Ok(())
}

#[test]
fn the_context_length_is_enforced() -> Result<()> {
    let w = fixture_with_config("mistral", |c| c["max_position_embeddings"] = 4.into())?;
    let m = build(w, ReferenceCache::new_box(4))?;
    let s = m.cache().unwrap().unwrap().create().into_result()?;
    forward(&m, &[(s, &[1, 2, 3], Output::Logits(Rows::Last))])?;
    let e = forward(&m, &[(s, &[4, 5], Output::Logits(Rows::Last))]).unwrap_err();
    assert!(e.to_string().contains("context length"), "{e}");
    assert_eq!(m.cache().unwrap().unwrap().len(s).into_result()?, 3);
    Ok(())
}

#[test]
fn malformed_weight_sets_get_clear_errors() -> Result<()> {
    let build_err = |w: WeightSetBox| {
        build(w, ReferenceCache::new_box(4))
            .err()
            .map(|e| e.to_string())
            .expect("refused")
    };
    let e = build_err(fixture_with_config("llama", |c| {
        c.as_object_mut().unwrap().remove("num_hidden_layers");
    })?);
    assert!(e.contains("block_count"), "{e}");
    let e = build_err(fixture_with_config("llama", |c| {
        c["num_attention_heads"] = 3.into()
    })?);
    assert!(e.contains("heads"), "{e}");
    let e = build_err(fixture_with_config("llama", |c| {
        c["num_hidden_layers"] = 3.into()
    })?);
    assert!(e.contains("blk.2."), "{e}");
    let e = build_err(fixture_with_config("llama", |c| {
        c["rope_parameters"]["rope_type"] = "dynamic-ntk-magic".into()
    })?);
    assert!(e.contains("rope scaling"), "{e}");
    let e = build_err(fixture_with_config("mixtral", |c| {
        c.as_object_mut().unwrap().remove("num_local_experts");
    })?);
    assert!(e.contains("router"), "{e}");
    Ok(())
}

/// The other architectures' malformed or unsupported variants: named errors, no panic.
#[test]
fn other_architectures_refuse_what_they_cannot_build() -> Result<()> {
    let build_err = |w: WeightSetBox| {
        build(w, ReferenceCache::new_box(4))
            .err()
            .map(|e| e.to_string())
            .expect("refused")
    };
    let e = build_err(fixture_with_config("gpt2", |c| {
        c["model_type"] = "gpt5".into()
    })?);
    assert!(e.contains("architecture `gpt5`"), "{e}");
    let e = build_err(fixture_with_config("falcon", |c| c["alibi"] = true.into())?);
    assert!(e.contains("ALiBi"), "{e}");
    // Two KV heads: more than the fused Q/K/V holds.
    let e = build_err(fixture_with_config("falcon", |c| {
        c["multi_query"] = false.into();
        c["num_kv_heads"] = 2.into();
    })?);
    assert!(e.contains("does not split"), "{e}");
    let e = build_err(fixture_with_config("nemotron", |c| {
        c["hidden_act"] = "swiglu-but-not-quite".into()
    })?);
    assert!(e.contains("activation `swiglu-but-not-quite`"), "{e}");
    let e = build_err(fixture_with_config("gpt2", |c| {
        c["n_positions"] = 1000.into()
    })?);
    assert!(e.contains("position_embd"), "{e}");
    let e = build_err(fixture_with_config("phi3", |c| {
        c["rope_parameters"]["rope_type"] = "longrope".into()
    })?);
    assert!(e.contains("rope scaling `longrope`"), "{e}");
    // transformers' BitNet is not llama.cpp's `bitnet` graph (only its GGUF files are built).
    let e = build_err(fixture_with_config("llama", |c| {
        c["model_type"] = "bitnet".into()
    })?);
    assert!(e.contains("transformers' BitNet"), "{e}");
    // Nemotron's LayerNorm biases under an RMSNorm architecture are not silently dropped.
    let e = build_err(fixture_with_config("nemotron", |c| {
        c["model_type"] = "llama".into()
    })?);
    assert!(
        e.contains("not part of the model") && e.contains("layernorm.bias"),
        "{e}"
    );
    Ok(())
}

/// int8 KV pages (cache-kv's `set_dtype`) are read by attention: the logits equal those of a
/// cache that stores the same int8 round trip as f32 (≤ 1e-5), and stay near the f32 reference
/// (≤ 0.25 here: unit-scale random weights amplify the 1/254 quantization step). A cache
/// configured with `kv_dtype = "int8"` gives the same logits without `set_dtype`.
#[test]
fn int8_kv_pages_from_the_cache_plugin_are_read() -> Result<()> {
    let (_, cases) = cases("qwen3")?;
    let int8 = build(support::safetensors("qwen3")?, support::cache_kv())?;
    let config = u_cache_kv::Config::parse("kv_dtype = \"int8\"")?;
    let configured = build(
        support::safetensors("qwen3")?,
        u_cache_kv::KvCachePlugin::new(config, None).into_box(),
    )?;
    assert!(u_cache_kv::Config::parse("kv_dtype = \"int4\"").is_err());
    let simulated = build(
        support::safetensors("qwen3")?,
        ReferenceCache::with_transform(4, Some(u_cache_kv::quant::round_trip)),
    )?;
    let (mut vs_sim, mut vs_f32) = (0f32, 0f32);
    for case in &cases {
        let s = int8.cache().unwrap().unwrap().create().into_result()?;
        int8.cache()
            .unwrap()
            .unwrap()
            .set_dtype(s, u_sdk::DType::I8)
            .into_result()?;
        let r = simulated.cache().unwrap().unwrap().create().into_result()?;
        let c = configured
            .cache()
            .unwrap()
            .unwrap()
            .create()
            .into_result()?;
        // The first token alone, then the rest attending over stored int8 pages.
        let split = 1.min(case.prompt.len());
        let (mut a, mut b, mut cfg) = (Vec::new(), Vec::new(), Vec::new());
        for part in [&case.prompt[..split], &case.prompt[split..]] {
            if !part.is_empty() {
                a.extend(forward(&int8, &[(s, part, Output::Logits(Rows::All))])?);
                b.extend(forward(
                    &simulated,
                    &[(r, part, Output::Logits(Rows::All))],
                )?);
                cfg.extend(forward(
                    &configured,
                    &[(c, part, Output::Logits(Rows::All))],
                )?);
            }
        }
        assert_eq!(a, cfg, "kv_dtype = \"int8\" differs from set_dtype(I8)");
        let cache = configured.cache().unwrap().unwrap();
        let pages = cache.pages(c, 0).into_result()?;
        assert!(pages.iter().all(|p| p.dtype == u_sdk::DType::I8));
        vs_sim = vs_sim.max(max_abs_diff(&a, &b));
        vs_f32 = vs_f32.max(max_abs_diff(&a, &case.logits));
    }
    eprintln!("int8 KV: max |Δlogit| {vs_sim:.2e} vs simulated int8, {vs_f32:.2e} vs f32");
    assert!(vs_sim <= 1e-5, "int8 pages read wrongly: {vs_sim}");
    assert!(vs_f32 <= 0.25, "int8 KV logits off by {vs_f32}");
    Ok(())
}

/// MoE layers read the routed experts' weights and no others: over the GGUF fixtures (experts
/// stacked in one mapped tensor per projection; dense layers skipped), every matmul on a
/// stacked tensor covers exactly one expert's slice, a one-token step reads exactly
/// `expert_used_count` experts per projection and layer, and a longer prompt at most
/// `used × tokens` of them.
#[test]
fn moe_layers_read_only_the_routed_experts() -> Result<()> {
    use u_sdk::weights::WeightSource;
    for model in ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"] {
        let file = u_loader_gguf::open_path(&support::dir(model).join("model.gguf"))?;
        let arch = file.architecture().unwrap().to_string();
        let meta = |k: &str| match file.metadata(&format!("{arch}.{k}")) {
            Some(u_sdk::MetaValue::UInt(v)) => v as usize,
            other => panic!("{model}: {arch}.{k} is {other:?}"),
        };
        let (experts, used, layers) = (
            meta("expert_count"),
            meta("expert_used_count"),
            meta("block_count"),
        );
        assert!(
            used < experts,
            "{model}: every expert is used, nothing to check"
        );
        let (kernels, log) = RecordMatmul::new_box(support::kernels());
        let m = build_with(file.clone().into_box(), kernels, ReferenceCache::new_box(4))?;
        let seq = m.cache().unwrap().unwrap().create().into_result()?;
        for tokens in [&[1u32, 5, 9, 13][..], &[2], &[7]] {
            log.lock().unwrap().clear();
            forward(&m, &[(seq, tokens, Output::Logits(Rows::Last))])?;
            let reads = log.lock().unwrap().clone();
            let moe_layers = (0..layers).filter(|l| {
                file.gguf()
                    .tensor_info(&format!("blk.{l}.ffn_gate_exps.weight"))
                    .is_some()
            });
            assert!(moe_layers.clone().count() > 0, "{model}: no MoE layer");
            for layer in moe_layers {
                for proj in ["gate", "up", "down"] {
                    let view = file.tensor(&format!("blk.{layer}.ffn_{proj}_exps.weight"))?;
                    let start = view.data.as_ptr() as usize;
                    let size = view.data.len() / experts;
                    let mut read = BTreeSet::new();
                    for r in reads
                        .iter()
                        .filter(|r| r.start >= start && r.start < start + size * experts)
                    {
                        assert_eq!(
                            r.len(),
                            size,
                            "{model} layer {layer} {proj}: not one expert's slice"
                        );
                        assert_eq!(
                            (r.start - start) % size,
                            0,
                            "{model}: a read across experts"
                        );
                        read.insert((r.start - start) / size);
                    }
                    let what = format!(
                        "{model} layer {layer} {proj}, {} tokens: experts {read:?}",
                        tokens.len()
                    );
                    if tokens.len() == 1 {
                        assert_eq!(read.len(), used, "{what}");
                    } else {
                        assert!((1..=used * tokens.len()).contains(&read.len()), "{what}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// The expert cache only moves pages: over the GGUF MoE fixtures, decoding with a budget so
/// small that every routing evicts, hot-set pinning from the first routings and router
/// lookahead gives the same logits, bit for bit, as with the cache doing nothing; and its
/// counters show it acted (misses, evictions, lookahead predictions and hits).
#[test]
fn the_expert_cache_changes_no_value() -> Result<()> {
    use u_arch_llama::{LlamaArchitecture, experts::ExpertPolicy};
    let off = ExpertPolicy {
        prefetch: false,
        lookahead: false,
        budget: None,
        pin_share: 0.0,
    };
    let busy = ExpertPolicy {
        prefetch: true,
        lookahead: true,
        budget: Some(1),
        pin_share: 1.0,
    };
    // (fixture, whether a later MoE layer follows one for lookahead to predict)
    for (model, several) in [("mixtral", true), ("qwen2_moe", false), ("olmoe", true)] {
        let mut logits = Vec::new();
        let mut counted = Vec::new();
        for experts in [off, busy] {
            let m = LlamaArchitecture { experts }.load(
                support::gguf(model)?,
                support::kernels(),
                ReferenceCache::new_box(4),
            )?;
            let seq = m.cache().unwrap().unwrap().create().into_result()?;
            let mut out = Vec::new();
            for tokens in [&[1u32, 5, 9, 13][..], &[2], &[7], &[3], &[11]] {
                out.extend(forward(&m, &[(seq, tokens, Output::Logits(Rows::Last))])?);
            }
            logits.push(out);
            let counters = m.counters().into_result()?;
            let value = |name: &str| {
                counters
                    .iter()
                    .find(|c| c.name == name)
                    .unwrap_or_else(|| panic!("{model}: no counter {name}"))
                    .value
            };
            counted.push(
                [
                    "expert_routed_total",
                    "expert_misses_total",
                    "expert_evictions_total",
                    "expert_predicted_total",
                    "expert_predicted_hits_total",
                    "expert_fetched_bytes_total",
                ]
                .map(value),
            );
        }
        assert_eq!(
            logits[0], logits[1],
            "{model}: the cache changed the logits"
        );
        let [routed, misses, evictions, predicted, hits, fetched] = counted[1];
        eprintln!(
            "{model}: {routed} routed, {misses} misses, {evictions} evictions, \
             {hits}/{predicted} predictions hit"
        );
        assert!(
            routed > 0.0 && misses > 0.0 && evictions > 0.0 && fetched > 0.0,
            "{model}"
        );
        if several {
            assert!(predicted > 0.0 && hits > 0.0, "{model}: lookahead idle");
        }
        // With the cache off the ledger still counts routings, and fetches nothing.
        let [routed_off, _, evictions_off, predicted_off, _, fetched_off] = counted[0];
        assert_eq!(routed_off, routed, "{model}");
        assert_eq!((evictions_off, predicted_off, fetched_off), (0.0, 0.0, 0.0));
    }
    Ok(())
}
