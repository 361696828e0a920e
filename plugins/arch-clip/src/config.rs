//! The typed hyper-parameters of CLIP's text tower, from a `CLIPModel` checkpoint's
//! `config.json` (`config.*` metadata, as the HF-format loaders present it): the nested
//! `text_config` object, and the top-level `projection_dim`; or from a text tower saved alone
//! (`CLIPTextModel`, `CLIPTextModelWithProjection`: `model_type` `clip_text_model`, the text
//! configuration at the top level), as Stable Diffusion's `text_encoder/` is.
//!
//! transformers saves a sub-configuration with only the values that differ from its class's
//! defaults in older releases, so a key `text_config` leaves out takes `CLIPTextConfig`'s
//! default.

use serde_json::{Map, Value};
use u_sdk::{MetaValue, Result, UError, WeightSetBox};

/// The `model_type` of a full CLIP checkpoint (`CLIPModel`).
pub const CHECKPOINT: &str = "clip";

/// The `model_type` of a text tower saved alone (`CLIPTextModel`, with or without its
/// projection).
pub const TEXT_CHECKPOINT: &str = "clip_text_model";

/// The `eos_token_id` of CLIP configurations written before transformers PR #24773, under which
/// the pooled row is the one holding the largest token id (the end-of-text token is the last
/// id of OpenAI's vocabulary).
pub const LEGACY_EOS: u32 = 2;

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// CLIP's `x · σ(1.702 x)`.
    QuickGelu,
    /// GELU, exact (erf).
    Gelu,
    /// GELU, tanh approximation.
    GeluTanh,
}

impl Act {
    /// The activation transformers names `name` (`ACT2FN`'s keys).
    pub fn of(name: &str) -> Result<Act> {
        match name {
            "quick_gelu" => Ok(Act::QuickGelu),
            "gelu" => Ok(Act::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(Act::GeluTanh),
            other => Err(UError::unsupported(format!(
                "arch-clip: activation `{other}` is not implemented (quick_gelu, gelu, \
                 gelu_pytorch_tanh)"
            ))),
        }
    }
}

/// Which row of a text the tower pools (transformers' `CLIPTextTransformer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EosRule {
    /// The first row holding this token id (`eos_token_id` other than 2).
    First(u32),
    /// The row holding the largest token id (the legacy `eos_token_id` 2).
    LargestId,
}

impl EosRule {
    /// The row of `ids` that is pooled: as transformers' `argmax`, the first one that matches,
    /// and row 0 when none does (the argmax of a row of zeros).
    pub fn pick(self, ids: &[u32]) -> usize {
        match self {
            EosRule::First(eos) => ids.iter().position(|&t| t == eos).unwrap_or(0),
            EosRule::LargestId => {
                let mut best = 0;
                for (i, &t) in ids.iter().enumerate() {
                    if t > ids[best] {
                        best = i;
                    }
                }
                best
            }
        }
    }
}

/// Everything the text tower needs besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The checkpoint's `model_type`, the family built: [`CHECKPOINT`] or [`TEXT_CHECKPOINT`].
    pub family: &'static str,
    /// Token ids (rows of the token embedding table).
    pub vocab_size: usize,
    /// Width of a token row.
    pub hidden: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Rows of the position table: the longest text.
    pub max_positions: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    /// MLP activation.
    pub act: Act,
    /// Which row is pooled.
    pub eos: EosRule,
    /// Width of the joint space (`projection_dim`), as the configuration states it; the
    /// projection's shape is checked against it.
    pub projection: usize,
}

/// `CLIPTextConfig`'s default for `key`.
fn text_default(key: &str) -> Option<MetaValue> {
    Some(match key {
        "vocab_size" => MetaValue::UInt(49408),
        "hidden_size" => MetaValue::UInt(512),
        "intermediate_size" => MetaValue::UInt(2048),
        "num_hidden_layers" => MetaValue::UInt(12),
        "num_attention_heads" => MetaValue::UInt(8),
        "max_position_embeddings" => MetaValue::UInt(77),
        "hidden_act" => MetaValue::Str("quick_gelu".into()),
        "layer_norm_eps" => MetaValue::Float(1e-5),
        "eos_token_id" => MetaValue::UInt(49407),
        _ => return None,
    })
}

fn meta(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

impl Config {
    /// Reads the text tower's configuration of the CLIP checkpoint `w` (a `CLIPModel`, or a
    /// text tower saved alone).
    pub fn from_weights(w: &WeightSetBox) -> Result<Config> {
        let bad = |why: String| UError::invalid(format!("arch-clip: config.json: {why}"));
        let alone = match meta(w, "config.model_type")
            .as_ref()
            .and_then(|v| v.as_str())
        {
            Some(CHECKPOINT) => false,
            Some(TEXT_CHECKPOINT) => true,
            _ => {
                return Err(bad(format!(
                    "`model_type` is neither `{CHECKPOINT}` (a full CLIP checkpoint, `CLIPModel`) \
                     nor `{TEXT_CHECKPOINT}` (its text tower alone)"
                )));
            }
        };
        let text: Map<String, Value> = match meta(w, "config.text_config") {
            _ if alone => Map::new(),
            Some(MetaValue::Json(t)) => match serde_json::from_str(&t) {
                Ok(Value::Object(map)) => map,
                _ => return Err(bad("`text_config` is not an object".into())),
            },
            _ => return Err(bad("no `text_config` object".into())),
        };
        let value = |k: &str| match alone {
            true => meta(w, &format!("config.{k}")).or_else(|| text_default(k)),
            false => match text.get(k) {
                None | Some(Value::Null) => text_default(k),
                Some(v) => Some(u_sdk::weights::json_to_meta(v)),
            },
        };
        let need = |k: &str| {
            value(k)
                .and_then(|v| v.as_u64())
                .filter(|&v| v > 0 && v < 1 << 31)
                .map(|v| v as usize)
                .ok_or_else(|| bad(format!("`text_config` lacks a positive `{k}`")))
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        if !hidden.is_multiple_of(heads) {
            return Err(bad(format!(
                "text hidden size {hidden} does not split into {heads} heads"
            )));
        }
        let act = match value("hidden_act").and_then(|v| v.as_str().map(str::to_string)) {
            Some(name) => Act::of(&name)?,
            None => return Err(bad("`text_config.hidden_act` is not a name".into())),
        };
        let eps = value("layer_norm_eps")
            .and_then(|v| v.as_f64())
            .filter(|e| e.is_finite() && *e >= 0.0)
            .ok_or_else(|| bad("`text_config.layer_norm_eps` is not a number".into()))?
            as f32;
        let eos = match value("eos_token_id").and_then(|v| v.as_u64()) {
            Some(2) => EosRule::LargestId,
            Some(id) if id < u64::from(u32::MAX) => EosRule::First(id as u32),
            _ => return Err(bad("`text_config.eos_token_id` is not a token id".into())),
        };
        // The top-level `projection_dim` is the joint space's (a sub-configuration's own
        // `projection_dim` is a stale class default in many saves); a tower saved alone keeps
        // it at the top level too.
        let projection = meta(w, "config.projection_dim")
            .map_or(Some(512), |v| v.as_u64())
            .filter(|&v| v > 0 && v < 1 << 31)
            .ok_or_else(|| bad("`projection_dim` is not a positive integer".into()))?
            as usize;
        Ok(Config {
            family: if alone { TEXT_CHECKPOINT } else { CHECKPOINT },
            vocab_size: need("vocab_size")?,
            hidden,
            layers: need("num_hidden_layers")?,
            heads,
            intermediate: need("intermediate_size")?,
            max_positions: need("max_position_embeddings")?,
            eps,
            act,
            eos,
            projection,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::EosRule;

    #[test]
    fn the_pooled_row_follows_transformers() {
        // Current configurations: the first end-of-text token, even before a larger id.
        assert_eq!(EosRule::First(7).pick(&[5, 9, 7, 7, 3]), 2);
        // None: argmax of zeros, the first row.
        assert_eq!(EosRule::First(7).pick(&[5, 9, 3]), 0);
        // Legacy (`eos_token_id` 2): the first of the largest ids.
        assert_eq!(EosRule::LargestId.pick(&[5, 9, 7, 9, 3]), 1);
        assert_eq!(EosRule::LargestId.pick(&[49406, 320, 1929, 49407]), 3);
    }
}
