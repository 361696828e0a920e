//! Logit conformance against `transformers` on tiny random-weight models
//! (`tests/fixtures/gen_llama_family.py`): Llama (Llama 3 RoPE scaling, tied embeddings),
//! Mistral (sliding window), Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE, each from
//! safetensors and from GGUF F32, with the CPU kernels plugin and with a test reference cache
//! (4-token pages) or the cache-kv plugin; and the other architectures
//! (`tests/fixtures/gen_llama_arches.py`: GPT-2, Phi-3, Gemma 2, StableLM, GPT-NeoX, OLMo 2,
//! Granite, Cohere, Falcon, Nemotron) from safetensors and from the GGUF
//! llama.cpp's converter writes. Each model runs alone per prompt and batched (all
//! prompts in one pass, prefill split in two chunks, decoding all sequences together).
//!
//! Tolerance: max |logit − reference| ≤ 1e-4 (f32 weights, f32 KV; logits are O(1..10)), and
//! the greedy continuation of 32 tokens identical to `model.generate` (the fixtures record the
//! smallest top-2 gap along each generation; all are ≥ 1e-3, far above the tolerance).

mod support;

use anyhow::Result;
use support::{
    ARCHITECTURES, MODELS, argmax, build, cases, max_abs_diff, reference_cache::ReferenceCache,
};
use u_sdk::{KvCacheBox, ModelBox, Output, Pooling, Rows, WeightSetBox};

/// Stated tolerance on logits.
const TOL: f32 = 1e-4;

/// Prefill of each prompt alone (all logits), then greedy decoding one token at a time.
fn check_sequential(name: &str, model: &ModelBox) -> Result<f32> {
    let (vocab, cases) = cases(name)?;
    let cache = model.cache().unwrap().unwrap();
    let mut worst = 0f32;
    for case in &cases {
        let seq = cache.create().into_result()?;
        let logits = support::forward(model, &[(seq, &case.prompt, Output::Logits(Rows::All))])?;
        let diff = max_abs_diff(&logits, &case.logits);
        worst = worst.max(diff);
        assert!(
            diff <= TOL,
            "{name}: prompt {:?}: max |Δlogit| {diff} > {TOL}",
            case.prompt
        );

        let mut next = argmax(&logits[logits.len() - vocab..]);
        let mut generated = vec![next];
        while generated.len() < case.generated.len() {
            let l = support::forward(model, &[(seq, &[next], Output::Logits(Rows::Last))])?;
            next = argmax(&l);
            generated.push(next);
        }
        assert_eq!(
            generated, case.generated,
            "{name}: greedy generation differs"
        );
        cache.release(seq).into_result()?;
    }
    Ok(worst)
}

/// All prompts in one batch (prefill split in two chunks, the first without logits), then all
/// sequences decoded together, one batch per step.
fn check_batched(name: &str, model: &ModelBox) -> Result<()> {
    let (vocab, cases) = cases(name)?;
    let cache = model.cache().unwrap().unwrap();
    let seqs: Vec<u64> = cases
        .iter()
        .map(|_| cache.create().into_result())
        .collect::<Result<_, _>>()?;
    // First part of each prompt (all but the last token) without logits.
    let heads: Vec<_> = cases
        .iter()
        .zip(&seqs)
        .filter(|(c, _)| c.prompt.len() > 1)
        .map(|(c, &s)| (s, &c.prompt[..c.prompt.len() - 1], Output::Nothing))
        .collect();
    support::forward(model, &heads)?;
    let tails: Vec<_> = cases
        .iter()
        .zip(&seqs)
        .map(|(c, &s)| {
            let from = c.prompt.len().saturating_sub(1);
            (s, &c.prompt[from..], Output::Logits(Rows::All))
        })
        .collect();
    let logits = support::forward(model, &tails)?;
    let mut next: Vec<u32> = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let want = &case.logits[case.logits.len() - vocab..];
        let diff = max_abs_diff(row, want);
        assert!(diff <= TOL, "{name}: batched last logits off by {diff}");
        next.push(argmax(row));
    }
    let mut generated: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
    for _ in 1..cases[0].generated.len() {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let batch: Vec<_> = seqs
            .iter()
            .zip(&toks)
            .map(|(&s, t)| (s, &t[..], Output::Logits(Rows::Last)))
            .collect();
        let l = support::forward(model, &batch)?;
        for (i, g) in generated.iter_mut().enumerate() {
            let t = argmax(&l[i * vocab..(i + 1) * vocab]);
            next[i] = t;
            g.push(t);
        }
    }
    for (case, g) in cases.iter().zip(&generated) {
        assert_eq!(
            g, &case.generated,
            "{name}: batched greedy generation differs"
        );
    }
    for s in seqs {
        cache.release(s).into_result()?;
    }
    Ok(())
}

fn run_all(
    format: &str,
    weights: fn(&str) -> Result<WeightSetBox>,
    cache: fn() -> KvCacheBox,
) -> Result<()> {
    run_models(&MODELS, format, weights, cache)
}

fn run_models(
    models: &[&str],
    format: &str,
    weights: fn(&str) -> Result<WeightSetBox>,
    cache: fn() -> KvCacheBox,
) -> Result<()> {
    for &name in models {
        let model = build(weights(name)?, cache())?;
        let worst = check_sequential(name, &model)?;
        check_batched(name, &model)?;
        eprintln!("{format:>11} {name:<10} max |Δlogit| = {worst:.2e}, greedy 32 tokens identical");
    }
    Ok(())
}

#[test]
fn safetensors_logits_and_generation_match_transformers() -> Result<()> {
    // Pages of 4 tokens: attention over many pages.
    run_all("safetensors", support::safetensors, || {
        ReferenceCache::new_box(4)
    })
}

#[test]
fn gguf_f32_logits_and_generation_match_transformers() -> Result<()> {
    run_all("gguf", support::gguf, || ReferenceCache::new_box(4))
}

/// GPT-2 (learned positions, LayerNorm, biases, GELU, Conv1D weights), Phi-3 (fused
/// projections), Gemma 2 (soft caps, sandwich norms, 1 + γ, alternating windows), StableLM
/// (parallel residual, partial RoPE), GPT-NeoX (two-norm parallel block, per-head fused QKV),
/// OLMo 2 (post-norms, Q/K norm), Granite (multipliers),
/// Cohere (parallel, bias-free LayerNorm, logit scale), Falcon 7B (multi-query fused QKV,
/// parallel) and 40B (two input norms, grouped fused QKV) and Nemotron (squared ReLU, 1 + γ
/// LayerNorm, partial RoPE) from their HF checkpoints.
#[test]
fn other_architectures_from_safetensors_match_transformers() -> Result<()> {
    run_models(&ARCHITECTURES, "safetensors", support::safetensors, || {
        ReferenceCache::new_box(4)
    })
}

/// The same models converted by llama.cpp's `convert_hf_to_gguf.py`.
#[test]
fn other_architectures_from_gguf_match_transformers() -> Result<()> {
    run_models(&ARCHITECTURES, "gguf", support::gguf, || {
        ReferenceCache::new_box(4)
    })
}

/// The same weights as ONNX initializers (HF names) with the `config.json` beside them.
#[test]
fn onnx_logits_and_generation_match_transformers() -> Result<()> {
    run_all("onnx", support::onnx, || ReferenceCache::new_box(4))
}

#[test]
fn safetensors_with_the_cache_kv_plugin() -> Result<()> {
    run_all("cache-kv", support::safetensors, support::cache_kv)?;
    run_models(
        &ARCHITECTURES,
        "cache-kv",
        support::safetensors,
        support::cache_kv,
    )
}

/// Q8_0 matrices used in their blocks: a stacked-expert tensor sliced per expert in whole
/// blocks, fused Q/K/V and gate/up projections (Phi-3, Falcon: `--outtype q8_0` of llama.cpp's
/// converter) sliced in whole rows, a Q8_0 embedding and tied LM head.
///
/// - With a reference f32 matmul over dequantized blocks (test kernels), the logits equal those
///   of the same values stored as F32 (max |Δlogit| ≤ 1e-4): the architecture hands the right
///   bytes to the kernels.
/// - With the CPU kernels (int8 activations on the fly) the gap is printed and bounded loosely
///   (≤ 0.5 on logits of magnitude ~20); the kernels' accuracy is tested in their own crate.
#[test]
fn gguf_q8_0_runs_quantized_weights_in_place() -> Result<()> {
    use support::{dequantized::Dequantized, reference_kernels::DequantMatmul};
    for name in ["llama", "mixtral", "phi3", "falcon"] {
        let (_, cases) = cases(name)?;
        let cache = || ReferenceCache::new_box(4);
        let in_place = build(support::gguf_q8_0(name)?, cache())?;
        let reference = support::build_with(
            support::gguf_q8_0(name)?,
            DequantMatmul::new_box(support::kernels()),
            cache(),
        )?;
        let f32 = build(Dequantized::new_box(support::gguf_q8_0(name)?)?, cache())?;
        let run = |m: &ModelBox, prompt: &[u32]| -> Result<Vec<f32>> {
            let seq = m.cache().unwrap().unwrap().create().into_result()?;
            support::forward(m, &[(seq, prompt, Output::Logits(Rows::All))])
        };
        let (mut exact, mut kernels, mut weights) = (0f32, 0f32, 0f32);
        for case in &cases {
            let want = run(&f32, &case.prompt)?;
            exact = exact.max(max_abs_diff(&run(&reference, &case.prompt)?, &want));
            kernels = kernels.max(max_abs_diff(&run(&in_place, &case.prompt)?, &want));
            weights = weights.max(max_abs_diff(&want, &case.logits));
        }
        eprintln!(
            "q8_0 {name:<8} max |Δlogit| vs same values in F32: {exact:.2e} (reference matmul), \
             {kernels:.2e} (CPU kernels); weight quantization vs transformers: {weights:.2e}"
        );
        assert!(exact <= TOL, "{name}: Q8_0 blocks read wrongly: {exact}");
        assert!(
            kernels <= 0.5,
            "{name}: Q8_0 with CPU kernels off by {kernels}"
        );
    }
    Ok(())
}

/// `Output::Pooled(Mean)`: the mean final hidden state over a prompt equals transformers'
/// `last_hidden_state.mean(0)`; a pooled output of no input is refused.
#[test]
fn pooled_output_matches_transformers_mean_hidden_state() -> Result<()> {
    for name in ["llama", "qwen3"] {
        let reference: serde_json::Value =
            serde_json::from_slice(&std::fs::read(support::dir(name).join("embedding.json"))?)?;
        let prompt: Vec<u32> = serde_json::from_value(reference["prompt"].clone())?;
        let want: Vec<f32> = serde_json::from_value(reference["mean_hidden"].clone())?;
        let cache = support::cache_kv();
        let model = build(support::safetensors(name)?, cache.clone())?;
        let seq = cache.create().into_result()?;
        let got = support::forward(&model, &[(seq, &prompt, Output::Pooled(Pooling::Mean))])?;
        let worst = max_abs_diff(&got, &want);
        eprintln!(
            "pooled {name:<6} max |Δ| = {worst:.2e} over {} values",
            want.len()
        );
        assert!(worst <= 1e-5, "{name}: {worst}");
        let fresh = cache.create().into_result()?;
        let empty = support::forward(&model, &[(fresh, &[], Output::Pooled(Pooling::Mean))]);
        assert!(empty.is_err());
    }
    Ok(())
}
