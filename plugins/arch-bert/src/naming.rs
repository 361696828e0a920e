//! The tensor names the model reads, and how each checkpoint layout stores them.
//!
//! Loaders present each file's own names; this architecture reads llama.cpp's GGUF names (what
//! `convert_hf_to_gguf.py` writes for the `bert` architecture) and finds a Hugging Face
//! checkpoint's tensors through [`Layout::stored`]:
//!
//! | read (GGUF) | Hugging Face (`BertModel`, optionally under `bert.`) |
//! | --- | --- |
//! | `token_embd` | `embeddings.word_embeddings` |
//! | `position_embd` | `embeddings.position_embeddings` |
//! | `token_types` | `embeddings.token_type_embeddings` |
//! | `token_embd_norm` | `embeddings.LayerNorm` |
//! | `blk.{i}.attn_q` (`attn_k`, `attn_v`) | `encoder.layer.{i}.attention.self.query` (`key`, `value`) |
//! | `blk.{i}.attn_output` | `encoder.layer.{i}.attention.output.dense` |
//! | `blk.{i}.attn_output_norm` | `encoder.layer.{i}.attention.output.LayerNorm` |
//! | `blk.{i}.ffn_up` | `encoder.layer.{i}.intermediate.dense` |
//! | `blk.{i}.ffn_down` | `encoder.layer.{i}.output.dense` |
//! | `blk.{i}.layer_output_norm` | `encoder.layer.{i}.output.LayerNorm` |
//!
//! each with its `.weight` and `.bias`. Both layouts store a linear weight as
//! `[outputs, inputs]` (outermost first) in the same row order, so nothing is permuted.
//!
//! nomic-bert GGUF files have no `position_embd`, one `blk.{i}.attn_qkv` (query, key and value
//! rows stacked) in place of `attn_q`/`attn_k`/`attn_v`, a `blk.{i}.ffn_gate` beside `ffn_up`,
//! and no projection biases.

use u_sdk::{UError, WeightSetBox};

/// Embedding-level tensors: the name read and the Hugging Face stem.
const EMBEDDINGS: [(&str, &str); 4] = [
    ("token_embd", "embeddings.word_embeddings"),
    ("position_embd", "embeddings.position_embeddings"),
    ("token_types", "embeddings.token_type_embeddings"),
    ("token_embd_norm", "embeddings.LayerNorm"),
];

/// Per-layer tensors: the name read (under `blk.{i}.`) and the Hugging Face stem (under
/// `encoder.layer.{i}.`).
const LAYER: [(&str, &str); 8] = [
    ("attn_q", "attention.self.query"),
    ("attn_k", "attention.self.key"),
    ("attn_v", "attention.self.value"),
    ("attn_output", "attention.output.dense"),
    ("attn_output_norm", "attention.output.LayerNorm"),
    ("ffn_up", "intermediate.dense"),
    ("ffn_down", "output.dense"),
    ("layer_output_norm", "output.LayerNorm"),
];

/// The name of layer `i`'s tensor `t` (one of the per-layer names above), e.g.
/// `blk(2, "attn_q")` → `blk.2.attn_q`.
pub fn blk(i: usize, t: &str) -> String {
    format!("blk.{i}.{t}")
}

/// How a checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// llama.cpp's names, as read (GGUF).
    LlamaCpp,
    /// Hugging Face names, under `prefix` (`""`, or `"bert."` in task models).
    HuggingFace {
        /// Prefix of every tensor name.
        prefix: &'static str,
    },
}

impl Layout {
    /// The layout of `w`: llama.cpp's for GGUF files, else Hugging Face's, with the prefix
    /// its word embeddings carry.
    pub fn of(w: &WeightSetBox) -> u_sdk::Result<Layout> {
        let format = w.format().into_result()?;
        if format.as_str() == "gguf" {
            return Ok(Layout::LlamaCpp);
        }
        let has = |name: &str| w.tensor(name.into()).into_result().is_ok();
        ["", "bert."]
            .into_iter()
            .find(|p| has(&format!("{p}embeddings.word_embeddings.weight")))
            .map(|prefix| Layout::HuggingFace { prefix })
            .ok_or_else(|| {
                UError::invalid(
                    "arch-bert: no `embeddings.word_embeddings.weight` (nor with a `bert.` prefix)",
                )
            })
    }

    /// The stored name of `name` (a name read, with its `.weight`/`.bias` suffix).
    pub fn stored(self, name: &str) -> String {
        let Layout::HuggingFace { prefix } = self else {
            return name.to_string();
        };
        let (stem, suffix) = name.rsplit_once('.').unwrap_or((name, ""));
        let hf = match stem.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((i, t)) => LAYER
                .iter()
                .find(|(g, _)| *g == t)
                .map(|(_, h)| format!("encoder.layer.{i}.{h}")),
            None => EMBEDDINGS
                .iter()
                .find(|(g, _)| *g == stem)
                .map(|(_, h)| h.to_string()),
        };
        format!(
            "{prefix}{}.{suffix}",
            hf.unwrap_or_else(|| stem.to_string())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_names() {
        let hf = Layout::HuggingFace { prefix: "bert." };
        assert_eq!(
            hf.stored("token_embd.weight"),
            "bert.embeddings.word_embeddings.weight"
        );
        assert_eq!(
            hf.stored("token_embd_norm.bias"),
            "bert.embeddings.LayerNorm.bias"
        );
        assert_eq!(
            hf.stored(&format!("{}.weight", blk(5, "layer_output_norm"))),
            "bert.encoder.layer.5.output.LayerNorm.weight"
        );
        assert_eq!(
            Layout::HuggingFace { prefix: "" }.stored("blk.11.attn_k.bias"),
            "encoder.layer.11.attention.self.key.bias"
        );
        assert_eq!(
            Layout::LlamaCpp.stored("blk.0.ffn_up.weight"),
            "blk.0.ffn_up.weight"
        );
    }
}
