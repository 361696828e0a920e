//! The encoder's hyper-parameters, from `config.json` as transformers' `T5Config` names them
//! (a key left out takes `T5Config`'s default).

use u_sdk::{MetaValue, Result, UError, WeightSetBox};

/// The `model_type` it reads.
pub const CHECKPOINT: &str = "t5";

/// The position-wise feed-forward network (`feed_forward_proj`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedForwardKind {
    /// `wo(relu(wi(x)))` (T5 v1.0's `relu`).
    Relu,
    /// `wo(gelu_tanh(wi_0(x)) ⊙ wi_1(x))` (T5 v1.1's `gated-gelu`, T5-XXL's).
    GatedGelu,
}

/// Hyper-parameters of the encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Token ids it reads.
    pub vocab_size: usize,
    /// Width of the residual stream (`d_model`).
    pub hidden: usize,
    /// Width of one attention head (`d_kv`); the heads together need not be `hidden` wide.
    pub head_dim: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of the feed-forward layer (`d_ff`).
    pub intermediate: usize,
    /// Blocks (`num_layers`).
    pub layers: usize,
    /// Relative-position buckets (`relative_attention_num_buckets`).
    pub buckets: usize,
    /// Distances at and past this share the last bucket (`relative_attention_max_distance`).
    pub max_distance: usize,
    /// The RMS norms' epsilon (`layer_norm_epsilon`).
    pub eps: f32,
    /// The feed-forward network.
    pub feed_forward: FeedForwardKind,
    /// The longest text it reads (`n_positions`; relative positions set no hard limit, this is
    /// the length it was made for).
    pub positions: usize,
}

fn meta(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(format!("config.{key}").as_str().into())
        .into_result()
        .ok()?
        .into_option()
}

impl Config {
    /// Reads the configuration of the T5 checkpoint `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<Config> {
        let bad = |why: String| UError::invalid(format!("arch-t5: config.json: {why}"));
        let model_type = meta(w, "model_type");
        if model_type.as_ref().and_then(|v| v.as_str()) != Some(CHECKPOINT) {
            return Err(bad(format!(
                "`model_type` is {model_type:?}, not `{CHECKPOINT}`"
            )));
        }
        let count = |key: &str, default: u64| -> Result<usize> {
            match meta(w, key) {
                None => Ok(default as usize),
                Some(v) => v
                    .as_u64()
                    .filter(|n| (1..=1 << 20).contains(n))
                    .map(|n| n as usize)
                    .ok_or_else(|| bad(format!("`{key}` is not a positive count"))),
            }
        };
        let eps = match meta(w, "layer_norm_epsilon") {
            None => 1e-6,
            Some(v) => v
                .as_f64()
                .filter(|e| e.is_finite() && *e > 0.0)
                .ok_or_else(|| bad("`layer_norm_epsilon` is not a positive number".into()))?
                as f32,
        };
        let projection = meta(w, "feed_forward_proj");
        let feed_forward = match projection
            .as_ref()
            .and_then(|v| v.as_str())
            .unwrap_or("relu")
        {
            "relu" => FeedForwardKind::Relu,
            "gated-gelu" => FeedForwardKind::GatedGelu,
            other => {
                return Err(UError::unsupported(format!(
                    "arch-t5: feed_forward_proj `{other}` is not implemented (relu, gated-gelu)"
                )));
            }
        };
        let cfg = Config {
            vocab_size: count("vocab_size", 32128)?,
            hidden: count("d_model", 512)?,
            head_dim: count("d_kv", 64)?,
            heads: count("num_heads", 8)?,
            intermediate: count("d_ff", 2048)?,
            layers: count("num_layers", 6)?,
            buckets: count("relative_attention_num_buckets", 32)?,
            max_distance: count("relative_attention_max_distance", 128)?,
            eps,
            feed_forward,
            positions: count("n_positions", 512)?,
        };
        if cfg.buckets < 4 || cfg.max_distance <= cfg.buckets / 4 {
            return Err(bad(format!(
                "{} relative-position buckets over a maximum distance of {}: at least 4 buckets, \
                 and a distance past the exact quarter",
                cfg.buckets, cfg.max_distance
            )));
        }
        Ok(cfg)
    }
}
