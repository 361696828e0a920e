//! The tensor names the model reads, and how each checkpoint layout stores them.
//!
//! The model reads Hugging Face's names (`WhisperModel`, without the `model.` prefix of
//! `WhisperForConditionalGeneration`). CTranslate2's converter renames everything and fuses
//! projections: self-attention's query, key and value are one `[3d, d]` matrix
//! (`self_attention/linear_0`, rows in that order) and cross-attention's key and value one
//! `[2d, d]` (`attention/linear_1`); [`Layout::stored`] says which rows of which tensor a name
//! is.
//!
//! | read (Hugging Face) | CTranslate2 |
//! | --- | --- |
//! | `encoder.conv1` (`conv2`) | `encoder/conv1` (`conv2`) |
//! | `encoder.embed_positions.weight` | `encoder/position_encodings/encodings` |
//! | `decoder.embed_tokens.weight` | `decoder/embeddings/weight` |
//! | `decoder.embed_positions.weight` | `decoder/position_encodings/encodings` |
//! | `{s}.layer_norm` | `{s}/layer_norm` |
//! | `{s}.layers.{i}.self_attn.{q,k,v}_proj` | `{s}/layer_{i}/self_attention/linear_0`, rows ⅓ each |
//! | `{s}.layers.{i}.self_attn.out_proj` | `{s}/layer_{i}/self_attention/linear_1` |
//! | `{s}.layers.{i}.self_attn_layer_norm` | `{s}/layer_{i}/self_attention/layer_norm` |
//! | `decoder.layers.{i}.encoder_attn.q_proj` | `decoder/layer_{i}/attention/linear_0` |
//! | `decoder.layers.{i}.encoder_attn.{k,v}_proj` | `decoder/layer_{i}/attention/linear_1`, rows ½ each |
//! | `decoder.layers.{i}.encoder_attn.out_proj` | `decoder/layer_{i}/attention/linear_2` |
//! | `decoder.layers.{i}.encoder_attn_layer_norm` | `decoder/layer_{i}/attention/layer_norm` |
//! | `{s}.layers.{i}.fc1` (`fc2`) | `{s}/layer_{i}/ffn/linear_0` (`linear_1`) |
//! | `{s}.layers.{i}.final_layer_norm` | `{s}/layer_{i}/ffn/layer_norm` |
//!
//! with `.weight`/`.bias` (CTranslate2's layer norms: `gamma`/`beta`). whisper.cpp's GGML files
//! keep openai-whisper's own names ([`Layout::OpenAi`]; see `openai` below). Hugging Face's key
//! projections have no bias; CTranslate2 stores zeros in their place. Both store a linear
//! weight as `[outputs, inputs]`.

use u_sdk::{UError, WeightSetBox};

/// How a checkpoint names its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Hugging Face names under `prefix` (`""` or `"model."`).
    HuggingFace {
        /// Prefix of every tensor name.
        prefix: &'static str,
    },
    /// CTranslate2's `WhisperSpec` names.
    CTranslate2,
    /// openai-whisper's names, as whisper.cpp's GGML files keep them.
    OpenAi,
}

/// Where a tensor the model reads is stored: all of `name`, or part `part` of `parts` equal
/// slices of its rows (its outermost dimension).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The stored tensor's name.
    pub name: String,
    /// Which slice, when several tensors were fused into one: `(index, count)`.
    pub part: Option<(usize, usize)>,
}

impl Layout {
    /// The layout of `w`: CTranslate2's for its format, else Hugging Face's, with the prefix its
    /// tensors carry.
    pub fn of(w: &WeightSetBox) -> u_sdk::Result<Layout> {
        match w.format().into_result()?.as_str() {
            "ctranslate2" => return Ok(Layout::CTranslate2),
            "ggml" => return Ok(Layout::OpenAi),
            _ => {}
        }
        let has = |name: &str| w.tensor(name.into()).into_result().is_ok();
        ["model.", ""]
            .into_iter()
            .find(|p| has(&format!("{p}decoder.embed_tokens.weight")))
            .map(|prefix| Layout::HuggingFace { prefix })
            .ok_or_else(|| {
                UError::invalid(
                    "arch-whisper: no `decoder.embed_tokens.weight` (nor with a `model.` prefix)",
                )
            })
    }

    /// Where tensor `name` (a Hugging Face name without prefix, with `.weight`/`.bias`) is
    /// stored.
    pub fn stored(self, name: &str) -> Stored {
        let whole = |name: String| Stored { name, part: None };
        match self {
            Layout::HuggingFace { prefix } => whole(format!("{prefix}{name}")),
            Layout::CTranslate2 => ct2(name).unwrap_or_else(|| whole(name.to_string())),
            Layout::OpenAi => whole(openai(name)),
        }
    }
}

/// openai-whisper's name for `name` (whisper.cpp keeps them); the table above, in its own
/// words: `encoder.positional_embedding`, `decoder.token_embedding.weight`, `{s}.ln_post` /
/// `decoder.ln`, `{s}.blocks.{i}.{attn,cross_attn}.{query,key,value,out}`, `…attn_ln`,
/// `…cross_attn_ln`, `…mlp.0` / `mlp.2`, `…mlp_ln`.
fn openai(name: &str) -> String {
    match name {
        "encoder.embed_positions.weight" => return "encoder.positional_embedding".into(),
        "decoder.embed_positions.weight" => return "decoder.positional_embedding".into(),
        "decoder.embed_tokens.weight" => return "decoder.token_embedding.weight".into(),
        _ => {}
    }
    let mut n = name
        .replacen("encoder.layer_norm.", "encoder.ln_post.", 1)
        .replacen("decoder.layer_norm.", "decoder.ln.", 1)
        .replacen(".layers.", ".blocks.", 1);
    for (hf, openai) in [
        ("self_attn_layer_norm", "attn_ln"),
        ("encoder_attn_layer_norm", "cross_attn_ln"),
        ("final_layer_norm", "mlp_ln"),
        ("self_attn.", "attn."),
        ("encoder_attn.", "cross_attn."),
        ("q_proj", "query"),
        ("k_proj", "key"),
        ("v_proj", "value"),
        ("out_proj", "out"),
        (".fc1.", ".mlp.0."),
        (".fc2.", ".mlp.2."),
    ] {
        n = n.replacen(hf, openai, 1);
    }
    n
}

/// CTranslate2's name for `name`, `None` for a name it has no counterpart of.
fn ct2(name: &str) -> Option<Stored> {
    let (stem, suffix) = name.rsplit_once('.')?;
    let (stack, rest) = stem.split_once('.')?;
    let whole = |n: String| Stored {
        name: n,
        part: None,
    };
    let part = |n: String, index, count| Stored {
        name: n,
        part: Some((index, count)),
    };
    let norm_suffix = if suffix == "weight" { "gamma" } else { "beta" };
    match rest {
        "conv1" | "conv2" => return Some(whole(format!("{stack}/{rest}/{suffix}"))),
        "embed_positions" => return Some(whole(format!("{stack}/position_encodings/encodings"))),
        "embed_tokens" => return Some(whole(format!("{stack}/embeddings/weight"))),
        "layer_norm" => return Some(whole(format!("{stack}/layer_norm/{norm_suffix}"))),
        _ => {}
    }
    let rest = rest.strip_prefix("layers.")?;
    let (i, module) = rest.split_once('.')?;
    let layer = format!("{stack}/layer_{i}");
    Some(match module {
        "self_attn_layer_norm" => whole(format!("{layer}/self_attention/layer_norm/{norm_suffix}")),
        "encoder_attn_layer_norm" => whole(format!("{layer}/attention/layer_norm/{norm_suffix}")),
        "final_layer_norm" => whole(format!("{layer}/ffn/layer_norm/{norm_suffix}")),
        "fc1" => whole(format!("{layer}/ffn/linear_0/{suffix}")),
        "fc2" => whole(format!("{layer}/ffn/linear_1/{suffix}")),
        "self_attn.q_proj" => part(format!("{layer}/self_attention/linear_0/{suffix}"), 0, 3),
        "self_attn.k_proj" => part(format!("{layer}/self_attention/linear_0/{suffix}"), 1, 3),
        "self_attn.v_proj" => part(format!("{layer}/self_attention/linear_0/{suffix}"), 2, 3),
        "self_attn.out_proj" => whole(format!("{layer}/self_attention/linear_1/{suffix}")),
        "encoder_attn.q_proj" => whole(format!("{layer}/attention/linear_0/{suffix}")),
        "encoder_attn.k_proj" => part(format!("{layer}/attention/linear_1/{suffix}"), 0, 2),
        "encoder_attn.v_proj" => part(format!("{layer}/attention/linear_1/{suffix}"), 1, 2),
        "encoder_attn.out_proj" => whole(format!("{layer}/attention/linear_2/{suffix}")),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ctranslate2_names() {
        let s = |n: &str| Layout::CTranslate2.stored(n);
        assert_eq!(s("encoder.conv2.bias").name, "encoder/conv2/bias");
        assert_eq!(
            s("decoder.embed_positions.weight").name,
            "decoder/position_encodings/encodings"
        );
        assert_eq!(s("encoder.layer_norm.bias").name, "encoder/layer_norm/beta");
        let k = s("encoder.layers.3.self_attn.k_proj.weight");
        assert_eq!(k.name, "encoder/layer_3/self_attention/linear_0/weight");
        assert_eq!(k.part, Some((1, 3)));
        let v = s("decoder.layers.0.encoder_attn.v_proj.bias");
        assert_eq!(v.name, "decoder/layer_0/attention/linear_1/bias");
        assert_eq!(v.part, Some((1, 2)));
        assert_eq!(
            s("decoder.layers.1.encoder_attn_layer_norm.weight").name,
            "decoder/layer_1/attention/layer_norm/gamma"
        );
        assert_eq!(
            s("decoder.layers.1.fc2.weight").name,
            "decoder/layer_1/ffn/linear_1/weight"
        );
    }

    #[test]
    fn hugging_face_names_keep_their_prefix() {
        let hf = Layout::HuggingFace { prefix: "model." };
        assert_eq!(
            hf.stored("decoder.layers.1.fc1.bias"),
            Stored {
                name: "model.decoder.layers.1.fc1.bias".into(),
                part: None
            }
        );
    }
}
