//! The typed hyper-parameters of a BERT-family encoder, from `config.json` (`config.*`
//! metadata, as the HF-format loaders present it) and sentence-transformers' side files
//! (`sentence_transformers.*`), or from a GGUF file's `{arch}.*` keys as llama.cpp's
//! `convert_hf_to_gguf.py` writes them for the `bert` and `nomic-bert` architectures.

use u_sdk::{MetaValue, Pooling, Result, UError, WeightSetBox};

/// Everything the model needs besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The architecture family: `bert`, or `nomic-bert` for a nomic-bert GGUF file.
    pub family: &'static str,
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
    /// The feed-forward network's activation.
    pub feed_forward: FeedForwardKind,
    /// How positions enter the model.
    pub positions: Positions,
    /// How the checkpoint pools a sentence (sentence-transformers' pooling module; mean
    /// otherwise).
    pub pooling: Pooling,
}

/// The feed-forward network of each layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedForwardKind {
    /// `down(GELU(up(x)))` with the exact (erf) GELU (BERT's `gelu`).
    Gelu,
    /// `down(GELU(up(x)))` with the tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// `down(SiLU(gate(x)) ⊙ up(x))` (Shazeer 2020; nomic-bert's `swiglu`).
    SwiGlu,
}

/// How a token's position enters the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Positions {
    /// A learned table added to the token embeddings (BERT).
    Learned,
    /// Rotary embeddings on every head's queries and keys, dimensions paired as halves
    /// (`i`, `i + d/2`), `θ_i = base^(−2i/d)` (Su et al. 2021; nomic-bert).
    Rotary {
        /// The frequency base.
        base: f32,
    },
}

/// The GGUF architectures read: BERT and nomic-bert (Nussbaum et al. 2024, *Nomic Embed*,
/// arXiv:2402.01613), which replaces learned positions with rotary ones, the GELU feed-forward
/// network with SwiGLU, and drops the projections' biases.
const GGUF_ARCHITECTURES: [&str; 2] = ["bert", "nomic-bert"];

fn get(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

impl Config {
    /// Reads the configuration of the encoder in `w`: a GGUF file's keys, else `config.json`'s.
    pub fn from_weights(w: &WeightSetBox) -> Result<Config> {
        if w.format().into_result()?.as_str() == "gguf" {
            return Config::from_gguf(w);
        }
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
        let feed_forward = match act.as_str() {
            "gelu" => FeedForwardKind::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => FeedForwardKind::GeluTanh,
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
            family: "bert",
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
            feed_forward,
            positions: Positions::Learned,
            pooling,
        })
    }

    /// Reads the `{arch}.*` keys of a GGUF file (`arch` its `general.architecture`, `bert` or
    /// `nomic-bert`): block count, context length (the position table, or the trained context
    /// of rotary positions), embedding and feed-forward lengths, head count, LayerNorm epsilon,
    /// `pooling_type` (llama.cpp's numbering: 1 mean, 2 CLS, 3 last; 0, none, and an absent key
    /// mean the mean here, as for a checkpoint without a pooling module) and, for nomic-bert,
    /// `rope.freq_base` (llama.cpp's default 10000 when absent). The vocabulary is the word
    /// embedding table's rows. The file does not say which GELU a BERT checkpoint was trained
    /// with; BERT's is the exact (erf) one, which this reads (llama.cpp's graph computes the
    /// tanh approximation).
    fn from_gguf(w: &WeightSetBox) -> Result<Config> {
        let arch = w
            .architecture()
            .into_result()?
            .into_option()
            .ok_or_else(|| {
                UError::invalid("arch-bert: the GGUF file has no general.architecture")
            })?;
        if !GGUF_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(UError::unsupported(format!(
                "arch-bert: GGUF architecture `{arch}` is not implemented ({})",
                GGUF_ARCHITECTURES.join(", ")
            )));
        }
        let nomic = arch.as_str() == "nomic-bert";
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| {
            get(w, &key(k))
                .and_then(|v| v.as_u64())
                .map(|v| v as usize)
                .ok_or_else(|| {
                    UError::invalid(format!("arch-bert: the GGUF file lacks `{}`", key(k)))
                })
        };
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        if heads == 0 || !hidden.is_multiple_of(heads) {
            return Err(UError::invalid(format!(
                "arch-bert: hidden size {hidden} does not split into {heads} heads"
            )));
        }
        if matches!(
            get(w, &key("attention.causal")),
            Some(MetaValue::Bool(true))
        ) {
            return Err(UError::unsupported(format!(
                "arch-bert: `{}` is true; a BERT encoder attends in both directions",
                key("attention.causal")
            )));
        }
        let pooling = match get(w, &key("pooling_type")).and_then(|v| v.as_u64()) {
            None | Some(0 | 1) => Pooling::Mean,
            Some(2) => Pooling::First,
            Some(3) => Pooling::Last,
            Some(other) => {
                return Err(UError::unsupported(format!(
                    "arch-bert: `{}` = {other} is not implemented (0 none, 1 mean, 2 cls, 3 last)",
                    key("pooling_type")
                )));
            }
        };
        let word = w.tensor("token_embd.weight".into()).into_result()?;
        let vocab_size = match word.shape.as_slice() {
            [rows, _] => *rows as usize,
            other => {
                return Err(UError::invalid(format!(
                    "arch-bert: token_embd.weight has shape {other:?}, expected [vocabulary, {hidden}]"
                )));
            }
        };
        let max_positions = need("context_length")?;
        Ok(Config {
            family: if nomic { "nomic-bert" } else { "bert" },
            vocab_size,
            hidden,
            layers: need("block_count")?,
            heads,
            intermediate: need("feed_forward_length")?,
            max_positions,
            context_length: max_positions,
            eps: get(w, &key("attention.layer_norm_epsilon"))
                .and_then(|v| v.as_f64())
                .unwrap_or(1e-12) as f32,
            feed_forward: if nomic {
                FeedForwardKind::SwiGlu
            } else {
                FeedForwardKind::Gelu
            },
            positions: if nomic {
                let base = get(w, &key("rope.freq_base"))
                    .and_then(|v| v.as_f64())
                    .unwrap_or(10_000.0) as f32;
                if !(base.is_finite() && base > 1.0) {
                    return Err(UError::invalid(format!(
                        "arch-bert: `{}` = {base} is not a rotary frequency base",
                        key("rope.freq_base")
                    )));
                }
                Positions::Rotary { base }
            } else {
                Positions::Learned
            },
            pooling,
        })
    }
}
