//! The names this architecture reads, and the mapping from Hugging Face checkpoints to them.
//!
//! Loaders present each file's own names (they know formats, not models); the model code reads
//! one set of tensor names and metadata keys whatever the format. That set is llama.cpp's GGUF
//! naming, so GGUF weights are read as they are and HF checkpoints (safetensors, ONNX) through
//! [`hf_to_canonical`] and [`derived_hparams`] (see [`crate::weights::Weights`]).
//!
//! # Tensor names
//!
//! | canonical | Hugging Face (Llama family) |
//! | --- | --- |
//! | `token_embd.weight` | `model.embed_tokens.weight` |
//! | `output_norm.weight` | `model.norm.weight` |
//! | `output.weight` | `lm_head.weight` |
//! | `blk.{i}.attn_norm.weight` | `model.layers.{i}.input_layernorm.weight` |
//! | `blk.{i}.attn_q.{weight,bias}` (`attn_k`, `attn_v`) | `…self_attn.q_proj.*` (`k_proj`, `v_proj`) |
//! | `blk.{i}.attn_output.weight` | `…self_attn.o_proj.weight` |
//! | `blk.{i}.attn_q_norm.weight`, `attn_k_norm` | `…self_attn.q_norm.weight`, `k_norm` |
//! | `blk.{i}.ffn_norm.weight` | `…post_attention_layernorm.weight` (Gemma 2/3: `pre_feedforward_layernorm`) |
//! | `blk.{i}.ffn_gate/ffn_up/ffn_down.weight` | `…mlp.gate_proj/up_proj/down_proj.weight` |
//! | `blk.{i}.ffn_gate_inp.weight` (MoE router) | `…mlp.gate.weight`, `…block_sparse_moe.gate.weight` |
//! | `blk.{i}.ffn_gate.{e}.weight`, `ffn_up.{e}`, `ffn_down.{e}` | `…mlp.experts.{e}.gate_proj/up_proj/down_proj`, Mixtral `…block_sparse_moe.experts.{e}.w1/w3/w2` |
//! | `blk.{i}.ffn_gate_shexp.weight` (`ffn_up_shexp`, `ffn_down_shexp`) | `…mlp.shared_expert(s).gate_proj` (`up_proj`, `down_proj`) |
//! | `blk.{i}.ffn_gate_inp_shexp.weight` | `…mlp.shared_expert_gate.weight` |
//! | `blk.{i}.attn_qkv.*` (fused) | Phi-3 `…self_attn.qkv_proj.*` |
//! | `blk.{i}.ffn_up.weight` (fused gate, up) | Phi-3 `…mlp.gate_up_proj.weight` |
//! | `blk.{i}.post_attention_norm.weight` | Gemma 2/3, OLMo 2 `…post_attention_layernorm.weight` |
//!
//! GPT-2 and Falcon name their layers `transformer.h.{i}.` (see [`hf_to_canonical`]):
//!
//! | canonical | GPT-2 | Falcon |
//! | --- | --- | --- |
//! | `token_embd.weight` | `transformer.wte.weight` | `transformer.word_embeddings.weight` |
//! | `position_embd.weight` | `transformer.wpe.weight` | — |
//! | `output_norm.*` | `transformer.ln_f.*` | `transformer.ln_f.*` |
//! | `blk.{i}.attn_norm.*` | `…ln_1.*` | `…input_layernorm.*`, Falcon-40B `…ln_mlp.*` |
//! | `blk.{i}.attn_norm_2.*` | — | Falcon-40B `…ln_attn.*` |
//! | `blk.{i}.ffn_norm.*` | `…ln_2.*` | — |
//! | `blk.{i}.attn_qkv.*` | `…attn.c_attn.*` | `…self_attention.query_key_value.*` |
//! | `blk.{i}.attn_output.*` | `…attn.c_proj.*` | `…self_attention.dense.*` |
//! | `blk.{i}.ffn_up.*` | `…mlp.c_fc.*` | `…mlp.dense_h_to_4h.*` |
//! | `blk.{i}.ffn_down.*` | `…mlp.c_proj.*` | `…mlp.dense_4h_to_h.*` |
//!
//! GPT-2's Conv1D weights are stored `[in, out]` ([`hf_stored_transposed`]). GPT-NeoX
//! (`gpt_neox.embed_in`, `gpt_neox.layers.{i}.attention.query_key_value`, `embed_out`…) stores
//! Q, K and V rows interleaved per head ([`hf_row_order`]).
//!
//! **Experts.** GGUF stacks the experts of a layer into one 3-D tensor (`ffn_gate_exps`,
//! `[n_expert, n_ff, n_embd]`). HF checkpoints store one 2-D tensor per expert, usually not
//! adjacent in the file, so stacking would need a copy. They are therefore named per expert,
//! `blk.{i}.ffn_gate.{e}.weight` (llama.cpp's older per-expert GGUF naming), and the model
//! accepts either form: [`EXPERTS_STACKED`] names or, when absent, the per-expert names from
//! [`expert`].
//!
//! Names this module does not know pass through unchanged.
//!
//! # RoPE pairing
//!
//! llama.cpp's HF→GGUF converter permutes the rows of `attn_q`/`attn_k` for the `llama`
//! architecture so that rotary embedding pairs adjacent dimensions (`2j`, `2j+1`: "normal").
//! HF checkpoints keep the original rows and rotate dimension `j` with `j + d/2` ("NeoX",
//! `rotate_half`). Both are the same model up to a permutation of the head dimension, and the
//! attention scores are identical. Nothing is permuted: [`rope_style`] picks the rope pairing
//! from the format — adjacent pairs for GGUF `llama` and `granite` weights and for Cohere
//! (whose checkpoints pair adjacent dimensions themselves), halves for everything else (GGUF
//! Qwen, every other HF checkpoint). Zero copies, one code path.
//!
//! # Hyper-parameters
//!
//! HF `config.json` entries arrive as `config.<key>`; [`derived_hparams`] maps them to GGUF-style
//! keys under the architecture's name (see [`HF_HPARAMS`]), and the architecture itself comes
//! from `model_type` through [`hf_architecture`].

use std::borrow::Cow;
use u_sdk::{MetaValue, RopeStyle};

/// Metadata key holding the architecture name (`llama`, `qwen2`…), as in GGUF.
pub const ARCHITECTURE_KEY: &str = "general.architecture";

/// How the stored Q/K rows of `arch` weights in `format` pair dimensions for rotary embedding
/// (see the module documentation).
pub fn rope_style(format: &str, arch: &str) -> RopeStyle {
    match arch {
        // Cohere's own checkpoints rotate adjacent pairs too.
        "command-r" => RopeStyle::Normal,
        a if format == "gguf" && converter_permutes_qk(a) => RopeStyle::Normal,
        _ => RopeStyle::NeoX,
    }
}

/// Whether llama.cpp's converter permutes the Q/K rows of `arch` into adjacent-pair order
/// (Llama-based conversions, Granite too), so that GGUF files of it hold them so.
pub fn converter_permutes_qk(arch: &str) -> bool {
    matches!(arch, "llama" | "granite")
}

/// Canonical names of the stacked expert tensors (GGUF), per layer: gate, up, down.
pub const EXPERTS_STACKED: [&str; 3] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];

/// The canonical name of a per-layer tensor, e.g. `blk(3, "attn_q", "weight")` →
/// `blk.3.attn_q.weight`.
pub fn blk(layer: usize, tensor: &str, suffix: &str) -> String {
    format!("blk.{layer}.{tensor}.{suffix}")
}

/// The canonical name of one expert's tensor, e.g. `expert(0, "ffn_up", 5)` →
/// `blk.0.ffn_up.5.weight`.
pub fn expert(layer: usize, tensor: &str, expert: usize) -> String {
    format!("blk.{layer}.{tensor}.{expert}.weight")
}

/// Maps an HF `model_type` to the GGUF architecture name that llama.cpp's converter writes.
///
/// Mistral and Mixtral are converted as `llama` (Mixtral with `expert_count`); Qwen MoE types
/// lose their underscore; everything else keeps its name.
pub fn hf_architecture(model_type: &str) -> Cow<'_, str> {
    match model_type {
        "mistral" | "mixtral" => Cow::Borrowed("llama"),
        "cohere" => Cow::Borrowed("command-r"),
        "gpt_neox" => Cow::Borrowed("gptneox"),
        "qwen2_moe" => Cow::Borrowed("qwen2moe"),
        "qwen3_moe" => Cow::Borrowed("qwen3moe"),
        other => Cow::Borrowed(other),
    }
}

/// Maps a Hugging Face tensor name to its canonical name, or `None` if the name is not one this
/// module knows. `arch` is the canonical architecture (see [`hf_architecture`]), when known: a
/// few names mean different things in different families (Gemma 2/3 norms).
pub fn hf_to_canonical(arch: Option<&str>, name: &str) -> Option<String> {
    let parts: Vec<&str> = name.split('.').collect();
    let join = |head: &str, rest: &[&str]| -> Option<String> {
        (!rest.is_empty() && rest.iter().all(|p| !p.is_empty()))
            .then(|| format!("{head}.{}", rest.join(".")))
    };
    match parts.as_slice() {
        ["model", "embed_tokens", rest @ ..] => join("token_embd", rest),
        ["model", "norm", rest @ ..] => join("output_norm", rest),
        ["lm_head", rest @ ..] => join("output", rest),
        ["model", "layers", layer, rest @ ..] => {
            let layer: usize = parse_index(layer)?;
            let (tensor, rest) = map_layer(arch, rest)?;
            join(&format!("blk.{layer}.{tensor}"), rest)
        }
        // GPT-NeoX.
        ["gpt_neox", "embed_in", rest @ ..] => join("token_embd", rest),
        ["gpt_neox", "final_layer_norm", rest @ ..] => join("output_norm", rest),
        ["embed_out", rest @ ..] => join("output", rest),
        ["gpt_neox", "layers", layer, rest @ ..] => {
            let layer: usize = parse_index(layer)?;
            let (tensor, rest) = map_neox_layer(rest)?;
            join(&format!("blk.{layer}.{tensor}"), rest)
        }
        // GPT-2 and Falcon.
        ["transformer", "wte" | "word_embeddings", rest @ ..] => join("token_embd", rest),
        ["transformer", "wpe", rest @ ..] => join("position_embd", rest),
        ["transformer", "ln_f", rest @ ..] => join("output_norm", rest),
        ["transformer", "h", layer, rest @ ..] => {
            let layer: usize = parse_index(layer)?;
            let (tensor, rest) = map_transformer_layer(rest)?;
            join(&format!("blk.{layer}.{tensor}"), rest)
        }
        _ => None,
    }
}

/// [`hf_to_canonical`], passing unknown names through unchanged.
pub fn canonical_name<'a>(arch: Option<&str>, name: &'a str) -> Cow<'a, str> {
    match hf_to_canonical(arch, name) {
        Some(mapped) => Cow::Owned(mapped),
        None => Cow::Borrowed(name),
    }
}

/// Decimal index without sign or leading zeros (so `01` is not silently `1`).
fn parse_index(s: &str) -> Option<usize> {
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    s.parse().ok()
}

/// Maps the part of a layer tensor name after `model.layers.{i}.` to the canonical tensor name
/// and the remaining suffix (`weight`, `bias`…).
fn map_layer<'n, 'p>(arch: Option<&str>, rest: &'p [&'n str]) -> Option<(String, &'p [&'n str])> {
    // Gemma 2/3 and OLMo 2 normalise the attention output: their `post_attention_layernorm`
    // is not the FFN's input norm.
    let gemma_norms = matches!(arch, Some("gemma2" | "gemma3" | "gemma3_text" | "olmo2"));
    let simple = |t: &str, r: &'p [&'n str]| Some((t.to_string(), r));
    match rest {
        ["input_layernorm", r @ ..] => simple("attn_norm", r),
        ["post_attention_layernorm", r @ ..] if gemma_norms => simple("post_attention_norm", r),
        ["post_attention_layernorm", r @ ..] => simple("ffn_norm", r),
        ["pre_feedforward_layernorm", r @ ..] => simple("ffn_norm", r),
        ["post_feedforward_layernorm", r @ ..] => simple("post_ffw_norm", r),
        ["self_attn", proj, r @ ..] => {
            let t = match *proj {
                "q_proj" => "attn_q",
                "k_proj" => "attn_k",
                "v_proj" => "attn_v",
                "o_proj" => "attn_output",
                "q_norm" => "attn_q_norm",
                "k_norm" => "attn_k_norm",
                "qkv_proj" => "attn_qkv",
                _ => return None,
            };
            simple(t, r)
        }
        ["mlp", "experts", e, proj, r @ ..] => {
            let e = parse_index(e)?;
            let t = match *proj {
                "gate_proj" => "ffn_gate",
                "up_proj" => "ffn_up",
                "down_proj" => "ffn_down",
                _ => return None,
            };
            Some((format!("{t}.{e}"), r))
        }
        ["block_sparse_moe", "experts", e, w, r @ ..] => {
            let e = parse_index(e)?;
            let t = match *w {
                "w1" => "ffn_gate",
                "w3" => "ffn_up",
                "w2" => "ffn_down",
                _ => return None,
            };
            Some((format!("{t}.{e}"), r))
        }
        ["block_sparse_moe", "gate", r @ ..] => simple("ffn_gate_inp", r),
        ["mlp", "shared_expert" | "shared_experts", proj, r @ ..] => {
            let t = match *proj {
                "gate_proj" => "ffn_gate_shexp",
                "up_proj" => "ffn_up_shexp",
                "down_proj" => "ffn_down_shexp",
                _ => return None,
            };
            simple(t, r)
        }
        ["mlp", "shared_expert_gate", r @ ..] => simple("ffn_gate_inp_shexp", r),
        ["mlp", "gate", r @ ..] => simple("ffn_gate_inp", r),
        ["mlp", proj, r @ ..] => {
            let t = match *proj {
                "gate_proj" => "ffn_gate",
                "up_proj" => "ffn_up",
                // Phi-3's fused gate and up rows, `ffn_up` as llama.cpp names it.
                "gate_up_proj" => "ffn_up",
                "down_proj" => "ffn_down",
                _ => return None,
            };
            simple(t, r)
        }
        _ => None,
    }
}

/// [`map_layer`] for the `transformer.h.{i}.` names of GPT-2 and Falcon.
fn map_transformer_layer<'n, 'p>(rest: &'p [&'n str]) -> Option<(&'static str, &'p [&'n str])> {
    Some(match rest {
        // Falcon-40B's two input norms, named as llama.cpp's converter names them: `ln_mlp`
        // (the FFN's) is `attn_norm`, `ln_attn` (attention's) `attn_norm_2`.
        ["ln_1" | "input_layernorm" | "ln_mlp", r @ ..] => ("attn_norm", r),
        ["ln_attn", r @ ..] => ("attn_norm_2", r),
        ["ln_2", r @ ..] => ("ffn_norm", r),
        ["attn", "c_attn", r @ ..] | ["self_attention", "query_key_value", r @ ..] => {
            ("attn_qkv", r)
        }
        ["attn", "c_proj", r @ ..] | ["self_attention", "dense", r @ ..] => ("attn_output", r),
        ["mlp", "c_fc" | "dense_h_to_4h", r @ ..] => ("ffn_up", r),
        ["mlp", "c_proj" | "dense_4h_to_h", r @ ..] => ("ffn_down", r),
        _ => return None,
    })
}

/// [`map_layer`] for the `gpt_neox.layers.{i}.` names of GPT-NeoX.
fn map_neox_layer<'n, 'p>(rest: &'p [&'n str]) -> Option<(&'static str, &'p [&'n str])> {
    Some(match rest {
        ["input_layernorm", r @ ..] => ("attn_norm", r),
        ["post_attention_layernorm", r @ ..] => ("ffn_norm", r),
        ["attention", "query_key_value", r @ ..] => ("attn_qkv", r),
        ["attention", "dense", r @ ..] => ("attn_output", r),
        ["mlp", "dense_h_to_4h", r @ ..] => ("ffn_up", r),
        ["mlp", "dense_4h_to_h", r @ ..] => ("ffn_down", r),
        _ => return None,
    })
}

/// For each row of canonical tensor `name` (`rows` rows, `heads` query and `kv_heads` KV heads)
/// in the HF checkpoint of `arch`, the stored row it is, when the two orders differ: GPT-NeoX
/// and Falcon fuse Q, K and V per KV group (the group's query heads, then its key and its value
/// head: GPT-NeoX one group per head, Falcon-40B one per KV head), llama.cpp's order (and this
/// plugin's) is every Q row, then K, then V, as its converter rewrites them. One group (Falcon-7B's
/// multi-query) is already in order.
pub fn hf_row_order(
    arch: &str,
    name: &str,
    rows: usize,
    heads: usize,
    kv_heads: usize,
) -> Option<Vec<usize>> {
    let fused = name.starts_with("blk.")
        && (name.ends_with(".attn_qkv.weight") || name.ends_with(".attn_qkv.bias"));
    let groups = match arch {
        "gptneox" => heads,
        "falcon" => kv_heads,
        _ => return None,
    };
    let slots = heads + 2 * groups;
    if !fused || groups <= 1 || !heads.is_multiple_of(groups) || !rows.is_multiple_of(slots) {
        return None;
    }
    let (hd, q) = (rows / slots, heads / groups);
    Some(
        (0..rows)
            .map(|r| {
                let (slot, group) = match r / hd {
                    h if h < heads => (h % q, h / q),
                    kv => (q + (kv - heads) / groups, (kv - heads) % groups),
                };
                (group * (q + 2) + slot) * hd + r % hd
            })
            .collect(),
    )
}

/// Whether the HF checkpoint of `arch` stores canonical weight `name` as `[in, out]`: GPT-2's
/// Conv1D layers (llama.cpp's converter transposes them).
pub fn hf_stored_transposed(arch: &str, name: &str) -> bool {
    arch == "gpt2"
        && ["attn_qkv", "attn_output", "ffn_up", "ffn_down"]
            .iter()
            .any(|t| name.starts_with("blk.") && name.ends_with(&format!(".{t}.weight")))
}

/// HF `config.json` hyper-parameter → GGUF key suffix (the full key is `{arch}.{suffix}`).
///
/// When `num_key_value_heads` (Falcon: `num_kv_heads`) is absent, `attention.head_count_kv` is
/// set to the head count, as llama.cpp does; Falcon's `multi_query` makes it 1. `head_dim` yields both `attention.key_length` and
/// `attention.value_length`.
pub const HF_HPARAMS: &[(&str, &str)] = &[
    ("num_hidden_layers", "block_count"),
    ("hidden_size", "embedding_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("num_kv_heads", "attention.head_count_kv"),
    ("max_position_embeddings", "context_length"),
    ("rope_theta", "rope.freq_base"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("layer_norm_eps", "attention.layer_norm_epsilon"),
    ("layer_norm_epsilon", "attention.layer_norm_epsilon"),
    ("norm_eps", "attention.layer_norm_epsilon"),
    // GPT-2's names.
    ("n_layer", "block_count"),
    ("n_embd", "embedding_length"),
    ("n_head", "attention.head_count"),
    ("n_positions", "context_length"),
    ("intermediate_size", "feed_forward_length"),
    ("num_local_experts", "expert_count"),
    ("num_experts", "expert_count"),
    ("num_experts_per_tok", "expert_used_count"),
    ("moe_intermediate_size", "expert_feed_forward_length"),
    (
        "shared_expert_intermediate_size",
        "expert_shared_feed_forward_length",
    ),
    ("vocab_size", "vocab_size"),
    ("head_dim", "attention.key_length"),
    ("head_dim", "attention.value_length"),
    ("sliding_window", "attention.sliding_window"),
];

/// GGUF-style hyper-parameters derived from an HF checkpoint's `config.<key>` metadata (as the
/// HF-format loaders present `config.json`), for architecture `arch` (see [`hf_architecture`]):
/// the keys of [`HF_HPARAMS`] under `{arch}.`, and `attention.head_count_kv` set to the head
/// count when `num_key_value_heads` is absent, as llama.cpp does.
pub fn derived_hparams(
    arch: &str,
    config: impl Fn(&str) -> Option<MetaValue>,
) -> Vec<(String, MetaValue)> {
    let numeric = |v: &MetaValue| {
        matches!(
            v,
            MetaValue::UInt(_) | MetaValue::Int(_) | MetaValue::Float(_)
        )
    };
    let mut out = Vec::new();
    for (hf, suffix) in HF_HPARAMS {
        if let Some(v) = config(&format!("config.{hf}")).filter(numeric) {
            out.push((format!("{arch}.{suffix}"), v));
        }
    }
    let flag = |k: &str| matches!(config(&format!("config.{k}")), Some(MetaValue::Bool(true)));
    if flag("multi_query") && !flag("new_decoder_architecture") {
        // Falcon-7B: one KV head whatever `num_kv_heads` says (as transformers reads it).
        out.retain(|(k, _)| !k.ends_with(".attention.head_count_kv"));
        out.push((
            format!("{arch}.attention.head_count_kv"),
            MetaValue::UInt(1),
        ));
    } else if config("config.num_key_value_heads").is_none()
        && config("config.num_kv_heads").is_none()
        && let Some(v) = config("config.num_attention_heads").filter(numeric)
    {
        out.push((format!("{arch}.attention.head_count_kv"), v));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The safetensors fixtures' generator writes each HF name's canonical name from its own
    /// table (`tests/fixtures/gen_safetensors.py`), independently of this module.
    #[test]
    fn names_match_the_fixture_generators_table() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        for (file, arch) in [
            ("safetensors/llama_sharded.expected.json", "llama"),
            ("safetensors/mixtral.expected.json", "mixtral"),
        ] {
            let text = std::fs::read_to_string(root.join(file)).expect(file);
            let expected: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&text).expect(file);
            assert!(expected.len() > 5, "{file}");
            for (stored, e) in &expected {
                assert_eq!(
                    canonical_name(Some(arch), stored),
                    e["canonical"].as_str().expect("canonical"),
                    "{file}: {stored}"
                );
            }
        }
    }

    #[test]
    fn llama_names_map_to_gguf_names() {
        let cases = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
            (
                "model.layers.0.input_layernorm.weight",
                "blk.0.attn_norm.weight",
            ),
            (
                "model.layers.12.self_attn.q_proj.weight",
                "blk.12.attn_q.weight",
            ),
            ("model.layers.1.self_attn.q_proj.bias", "blk.1.attn_q.bias"),
            (
                "model.layers.1.self_attn.k_proj.weight",
                "blk.1.attn_k.weight",
            ),
            (
                "model.layers.1.self_attn.v_proj.weight",
                "blk.1.attn_v.weight",
            ),
            (
                "model.layers.1.self_attn.o_proj.weight",
                "blk.1.attn_output.weight",
            ),
            (
                "model.layers.1.self_attn.q_norm.weight",
                "blk.1.attn_q_norm.weight",
            ),
            (
                "model.layers.1.self_attn.k_norm.weight",
                "blk.1.attn_k_norm.weight",
            ),
            (
                "model.layers.1.post_attention_layernorm.weight",
                "blk.1.ffn_norm.weight",
            ),
            (
                "model.layers.1.mlp.gate_proj.weight",
                "blk.1.ffn_gate.weight",
            ),
            ("model.layers.1.mlp.up_proj.weight", "blk.1.ffn_up.weight"),
            (
                "model.layers.1.mlp.down_proj.weight",
                "blk.1.ffn_down.weight",
            ),
            (
                "model.layers.2.mlp.gate.weight",
                "blk.2.ffn_gate_inp.weight",
            ),
            (
                "model.layers.2.mlp.experts.7.up_proj.weight",
                "blk.2.ffn_up.7.weight",
            ),
            (
                "model.layers.2.block_sparse_moe.gate.weight",
                "blk.2.ffn_gate_inp.weight",
            ),
            (
                "model.layers.2.block_sparse_moe.experts.3.w1.weight",
                "blk.2.ffn_gate.3.weight",
            ),
            (
                "model.layers.2.block_sparse_moe.experts.3.w2.weight",
                "blk.2.ffn_down.3.weight",
            ),
            (
                "model.layers.2.block_sparse_moe.experts.3.w3.weight",
                "blk.2.ffn_up.3.weight",
            ),
            (
                "model.layers.2.mlp.shared_expert.gate_proj.weight",
                "blk.2.ffn_gate_shexp.weight",
            ),
            (
                "model.layers.2.mlp.shared_experts.down_proj.weight",
                "blk.2.ffn_down_shexp.weight",
            ),
            (
                "model.layers.2.mlp.shared_expert_gate.weight",
                "blk.2.ffn_gate_inp_shexp.weight",
            ),
        ];
        for (hf, canonical) in cases {
            assert_eq!(
                hf_to_canonical(Some("llama"), hf).as_deref(),
                Some(canonical),
                "{hf}"
            );
        }
        assert_eq!(expert(2, "ffn_up", 7), "blk.2.ffn_up.7.weight");
        assert_eq!(blk(12, "attn_q", "weight"), "blk.12.attn_q.weight");
    }

    #[test]
    fn gpt2_falcon_and_phi3_names_map_to_gguf_names() {
        let cases = [
            ("transformer.wte.weight", "token_embd.weight"),
            ("transformer.word_embeddings.weight", "token_embd.weight"),
            ("transformer.wpe.weight", "position_embd.weight"),
            ("transformer.ln_f.bias", "output_norm.bias"),
            ("transformer.h.1.ln_1.weight", "blk.1.attn_norm.weight"),
            ("transformer.h.1.ln_2.bias", "blk.1.ffn_norm.bias"),
            ("transformer.h.1.attn.c_attn.bias", "blk.1.attn_qkv.bias"),
            (
                "transformer.h.1.attn.c_proj.weight",
                "blk.1.attn_output.weight",
            ),
            ("transformer.h.1.mlp.c_fc.weight", "blk.1.ffn_up.weight"),
            ("transformer.h.1.mlp.c_proj.weight", "blk.1.ffn_down.weight"),
            (
                "transformer.h.0.self_attention.query_key_value.weight",
                "blk.0.attn_qkv.weight",
            ),
            (
                "transformer.h.0.self_attention.dense.weight",
                "blk.0.attn_output.weight",
            ),
            (
                "transformer.h.0.mlp.dense_h_to_4h.weight",
                "blk.0.ffn_up.weight",
            ),
            (
                "transformer.h.0.mlp.dense_4h_to_h.weight",
                "blk.0.ffn_down.weight",
            ),
            ("transformer.h.0.ln_mlp.weight", "blk.0.attn_norm.weight"),
            ("transformer.h.0.ln_attn.weight", "blk.0.attn_norm_2.weight"),
            (
                "model.layers.0.self_attn.qkv_proj.weight",
                "blk.0.attn_qkv.weight",
            ),
            (
                "model.layers.0.mlp.gate_up_proj.weight",
                "blk.0.ffn_up.weight",
            ),
        ];
        for (hf, canonical) in cases {
            assert_eq!(
                hf_to_canonical(None, hf).as_deref(),
                Some(canonical),
                "{hf}"
            );
        }
        assert!(hf_stored_transposed("gpt2", "blk.0.attn_qkv.weight"));
        assert!(hf_stored_transposed("gpt2", "blk.3.ffn_down.weight"));
        assert!(!hf_stored_transposed("gpt2", "blk.0.attn_qkv.bias"));
        assert!(!hf_stored_transposed("gpt2", "token_embd.weight"));
        assert!(!hf_stored_transposed("falcon", "blk.0.attn_qkv.weight"));
    }

    #[test]
    fn gpt_neox_names_and_per_head_qkv_rows() {
        for (hf, canonical) in [
            ("gpt_neox.embed_in.weight", "token_embd.weight"),
            ("gpt_neox.final_layer_norm.bias", "output_norm.bias"),
            ("embed_out.weight", "output.weight"),
            (
                "gpt_neox.layers.3.attention.query_key_value.bias",
                "blk.3.attn_qkv.bias",
            ),
            (
                "gpt_neox.layers.3.attention.dense.weight",
                "blk.3.attn_output.weight",
            ),
            (
                "gpt_neox.layers.3.post_attention_layernorm.weight",
                "blk.3.ffn_norm.weight",
            ),
            (
                "gpt_neox.layers.3.mlp.dense_4h_to_h.weight",
                "blk.3.ffn_down.weight",
            ),
        ] {
            assert_eq!(
                hf_to_canonical(None, hf).as_deref(),
                Some(canonical),
                "{hf}"
            );
        }
        // Two heads of two: stored q0 q0 k0 k0 v0 v0 q1 q1 k1 k1 v1 v1.
        assert_eq!(
            hf_row_order("gptneox", "blk.0.attn_qkv.weight", 12, 2, 2),
            Some(vec![0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11])
        );
        // Falcon-40B, four heads in two groups, one row each: q0 q1 k0 v0 q2 q3 k1 v1.
        assert_eq!(
            hf_row_order("falcon", "blk.0.attn_qkv.bias", 8, 4, 2),
            Some(vec![0, 1, 4, 5, 2, 6, 3, 7])
        );
        // Falcon-7B's one group is already in order.
        assert_eq!(
            hf_row_order("falcon", "blk.0.attn_qkv.weight", 6, 4, 1),
            None
        );
        assert_eq!(
            hf_row_order("gptneox", "blk.0.attn_output.weight", 12, 2, 2),
            None
        );
        assert_eq!(
            hf_row_order("phi3", "blk.0.attn_qkv.weight", 12, 2, 2),
            None
        );
    }

    #[test]
    fn gemma_norms_depend_on_architecture() {
        let n = "model.layers.0.post_attention_layernorm.weight";
        assert_eq!(
            hf_to_canonical(Some("gemma2"), n).as_deref(),
            Some("blk.0.post_attention_norm.weight")
        );
        assert_eq!(
            hf_to_canonical(None, n).as_deref(),
            Some("blk.0.ffn_norm.weight")
        );
    }

    #[test]
    fn unknown_names_pass_through() {
        for n in [
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.01.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj",
            "model.layers.0.mlp.up_proj.",
            "model.embed_tokens",
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "",
        ] {
            assert_eq!(hf_to_canonical(None, n), None, "{n}");
            assert_eq!(canonical_name(None, n), n);
        }
    }

    #[test]
    fn architectures_follow_llama_cpp() {
        assert_eq!(hf_architecture("mistral"), "llama");
        assert_eq!(hf_architecture("qwen3_moe"), "qwen3moe");
        assert_eq!(hf_architecture("qwen2"), "qwen2");
    }

    #[test]
    fn hf_hyper_parameters_map_to_gguf_keys() {
        use MetaValue::{Float, Str, UInt};
        let config: std::collections::HashMap<&str, MetaValue> = [
            ("config.hidden_size", UInt(64)),
            ("config.num_hidden_layers", UInt(2)),
            ("config.num_attention_heads", UInt(4)),
            ("config.rms_norm_eps", Float(1e-5)),
            ("config.rope_theta", Float(10000.0)),
            ("config.num_local_experts", UInt(8)),
            ("config.num_experts_per_tok", UInt(2)),
            ("config.sliding_window", Str("none".into())),
        ]
        .into_iter()
        .collect();
        let meta = derived_hparams("llama", |k| config.get(k).cloned());
        let get = |k: &str| {
            meta.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get("llama.embedding_length"), Some(UInt(64)));
        assert_eq!(get("llama.block_count"), Some(UInt(2)));
        assert_eq!(get("llama.attention.head_count_kv"), Some(UInt(4)));
        assert_eq!(get("llama.expert_count"), Some(UInt(8)));
        assert_eq!(get("llama.expert_used_count"), Some(UInt(2)));
        assert_eq!(get("llama.rope.freq_base"), Some(Float(10000.0)));
        assert_eq!(
            get("llama.attention.layer_norm_rms_epsilon"),
            Some(Float(1e-5))
        );
        assert_eq!(get("llama.attention.sliding_window"), None, "not a number");
    }

    #[test]
    fn falcon_kv_heads_follow_multi_query() {
        use MetaValue::{Bool, UInt};
        let kv = |entries: &[(&str, MetaValue)]| {
            let config: std::collections::HashMap<&str, MetaValue> =
                entries.iter().cloned().collect();
            derived_hparams("falcon", |k| config.get(k).cloned())
                .into_iter()
                .filter(|(k, _)| k == "falcon.attention.head_count_kv")
                .map(|(_, v)| v)
                .collect::<Vec<_>>()
        };
        let heads = ("config.num_attention_heads", UInt(8));
        assert_eq!(kv(std::slice::from_ref(&heads)), [UInt(8)]);
        assert_eq!(
            kv(&[heads.clone(), ("config.num_kv_heads", UInt(2))]),
            [UInt(2)]
        );
        let mq = ("config.multi_query", Bool(true));
        assert_eq!(
            kv(&[heads.clone(), ("config.num_kv_heads", UInt(8)), mq.clone()]),
            [UInt(1)]
        );
        let new = ("config.new_decoder_architecture", Bool(true));
        assert_eq!(
            kv(&[heads, ("config.num_kv_heads", UInt(2)), mq, new]),
            [UInt(2)]
        );
    }

    #[test]
    fn rope_pairing_follows_the_format() {
        assert_eq!(rope_style("gguf", "granite"), RopeStyle::Normal);
        assert_eq!(rope_style("safetensors", "granite"), RopeStyle::NeoX);
        assert_eq!(rope_style("safetensors", "command-r"), RopeStyle::Normal);
        assert_eq!(rope_style("gguf", "llama"), RopeStyle::Normal);
        assert_eq!(rope_style("gguf", "qwen2"), RopeStyle::NeoX);
        assert_eq!(rope_style("safetensors", "llama"), RopeStyle::NeoX);
    }
}
