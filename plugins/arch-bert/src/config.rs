//! The typed hyper-parameters of a BERT-family encoder, from `config.json` (`config.*`
//! metadata, as the HF-format loaders present it) and sentence-transformers' side files
//! (`sentence_transformers.*`).

use u_sdk::{MetaValue, Pooling, Result, UError, WeightSetBox};

/// Everything the model needs besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Token ids (rows of the word embedding table).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward width.
    pub intermediate: usize,
    /// Rows of the position table.
    pub max_positions: usize,
    /// Longest input: the position table, or sentence-transformers' `max_seq_length` when the
    /// checkpoint states a shorter one.
    pub context_length: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    /// GELU flavour: exact (`gelu`) or the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    pub tanh_gelu: bool,
    /// How the checkpoint pools a sentence (sentence-transformers' pooling module; mean
    /// otherwise).
    pub pooling: Pooling,
}

fn get(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

impl Config {
    /// Reads the configuration of the encoder in `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<Config> {
        let int = |k: &str| get(w, &format!("config.{k}")).and_then(|v| v.as_u64());
        let need = |k: &str| {
            int(k)
                .map(|v| v as usize)
                .ok_or_else(|| UError::invalid(format!("arch-bert: config.json lacks `{k}`")))
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        if heads == 0 || !hidden.is_multiple_of(heads) {
            return Err(UError::invalid(format!(
                "arch-bert: hidden size {hidden} does not split into {heads} heads"
            )));
        }
        let act = get(w, "config.hidden_act")
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| "gelu".into());
        let tanh_gelu = match act.as_str() {
            "gelu" => false,
            "gelu_new" | "gelu_pytorch_tanh" => true,
            other => {
                return Err(UError::unsupported(format!(
                    "arch-bert: activation `{other}` is not implemented (gelu, gelu_new)"
                )));
            }
        };
        if let Some(kind) = get(w, "config.position_embedding_type")
            .and_then(|v| v.as_str().map(str::to_string))
            .filter(|k| k != "absolute")
        {
            return Err(UError::unsupported(format!(
                "arch-bert: position embeddings `{kind}` are not implemented (absolute)"
            )));
        }
        let max_positions = need("max_position_embeddings")?;
        let context_length = get(w, "sentence_transformers.max_seq_length")
            .and_then(|v| v.as_u64())
            .map_or(max_positions, |m| (m as usize).min(max_positions));
        let flag = |k: &str| matches!(get(w, k), Some(MetaValue::Bool(true)));
        let pooling = if flag("sentence_transformers.pooling.pooling_mode_cls_token") {
            Pooling::First
        } else {
            Pooling::Mean
        };
        Ok(Config {
            vocab_size: need("vocab_size")?,
            hidden,
            layers: need("num_hidden_layers")?,
            heads,
            intermediate: need("intermediate_size")?,
            max_positions,
            context_length,
            eps: get(w, "config.layer_norm_eps")
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-12) as f32,
            tanh_gelu,
            pooling,
        })
    }
}
