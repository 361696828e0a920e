//! Gemma 3's hyper-parameters, from GGUF metadata (`gemma3.*`, as llama.cpp's converter writes
//! them) or from an HF checkpoint's `config.json` (`config.*`, as U's HF-format loaders present
//! it). Names and keys are this plugin's to know: loaders hand over the file's own.

use serde_json::Value;
use u_sdk::{MetaValue, Result, UError, WeightSetBox};

/// Everything the model needs besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Whether the weights are GGUF (llama.cpp's names; norm scales stored as `1 + w`).
    pub gguf: bool,
    /// Rows of the embedding table.
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Longest context.
    pub context_length: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Sliding window of the local layers.
    pub window: u32,
    /// Whether each layer attends locally (sliding window) rather than globally.
    pub sliding: Vec<bool>,
    /// RoPE base of the global layers.
    pub rope_global: f32,
    /// RoPE base of the local layers.
    pub rope_local: f32,
    /// Linear position scaling of the global layers (1 = none).
    pub rope_scale: f32,
    /// Score scale: `query_pre_attn_scalar^-1/2` (GGUF: `head_dim^-1/2`, as llama.cpp).
    pub query_scale: f32,
    /// `tanh(l / c) · c` on the logits, if set.
    pub final_softcap: Option<f32>,
}

/// Metadata lookup on a weight set.
struct Meta<'w>(&'w WeightSetBox);

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<MetaValue> {
        self.0
            .metadata(key.into())
            .into_result()
            .ok()?
            .into_option()
    }

    fn u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(|v| v.as_u64())
    }

    fn f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(|v| v.as_f64())
    }

    fn need(&self, key: &str) -> Result<usize> {
        self.u64(key)
            .map(|v| v as usize)
            .ok_or_else(|| UError::invalid(format!("arch-gemma3: metadata `{key}` is missing")))
    }

    fn json(&self, key: &str) -> Option<Value> {
        match self.get(key)? {
            MetaValue::Json(text) => serde_json::from_str(&text).ok(),
            _ => None,
        }
    }
}

/// Layer `i` attends locally unless it is every `n`-th (Gemma 3's 5 local : 1 global).
fn pattern(layers: usize, n: usize) -> Vec<bool> {
    (0..layers).map(|i| n == 0 || (i + 1) % n != 0).collect()
}

impl Config {
    /// Reads the configuration of the Gemma 3 model in `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<Config> {
        let format = w.format().into_result()?;
        let m = Meta(w);
        if format.as_str() == "gguf" {
            Self::from_gguf(&m)
        } else {
            Self::from_hf(&m)
        }
    }

    fn from_gguf(m: &Meta<'_>) -> Result<Config> {
        let k = |s: &str| format!("gemma3.{s}");
        let layers = m.need(&k("block_count"))?;
        let heads = m.need(&k("attention.head_count"))?;
        let hidden = m.need(&k("embedding_length"))?;
        let head_dim = m
            .u64(&k("attention.key_length"))
            .map_or(hidden / heads.max(1), |v| v as usize);
        let sliding = match m.get(&k("attention.sliding_window_pattern")) {
            Some(MetaValue::BoolArray(b)) if b.len() == layers => b.to_vec(),
            Some(v) => pattern(layers, v.as_u64().unwrap_or(6) as usize),
            None => pattern(layers, 6),
        };
        let window = m.u64(&k("attention.sliding_window")).unwrap_or(0) as u32;
        let rope_scale = match m
            .get(&k("rope.scaling.type"))
            .as_ref()
            .and_then(|v| v.as_str())
        {
            Some("linear") => m.f64(&k("rope.scaling.factor")).unwrap_or(1.0) as f32,
            _ => 1.0,
        };
        Ok(Config {
            gguf: true,
            vocab_size: 0,
            hidden,
            layers,
            heads,
            kv_heads: m
                .u64(&k("attention.head_count_kv"))
                .map_or(heads, |v| v as usize),
            head_dim,
            context_length: m.u64(&k("context_length")).unwrap_or(8192) as usize,
            eps: m
                .f64(&k("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-6) as f32,
            sliding: if window == 0 {
                vec![false; layers]
            } else {
                sliding
            },
            window,
            rope_global: m.f64(&k("rope.freq_base")).unwrap_or(10_000.0) as f32,
            rope_local: m.f64(&k("rope.freq_base_swa")).unwrap_or(10_000.0) as f32,
            rope_scale,
            query_scale: 1.0 / (head_dim as f32).sqrt(),
            final_softcap: m.f64(&k("final_logit_softcapping")).map(|c| c as f32),
        })
    }

    fn from_hf(m: &Meta<'_>) -> Result<Config> {
        let k = |s: &str| format!("config.{s}");
        let layers = m.need(&k("num_hidden_layers"))?;
        let heads = m.need(&k("num_attention_heads"))?;
        let hidden = m.need(&k("hidden_size"))?;
        let head_dim = m
            .u64(&k("head_dim"))
            .map_or(hidden / heads.max(1), |v| v as usize);
        let sliding = match m.get(&k("layer_types")) {
            Some(MetaValue::StrArray(t)) if t.len() == layers => t
                .iter()
                .map(|t| t.as_str() == "sliding_attention")
                .collect(),
            _ => pattern(
                layers,
                m.u64(&k("_sliding_window_pattern"))
                    .or_else(|| m.u64(&k("sliding_window_pattern")))
                    .unwrap_or(6) as usize,
            ),
        };
        let rope = m.json(&k("rope_parameters"));
        let theta = |layer: &str| {
            rope.as_ref()
                .and_then(|r| r.get(layer))
                .and_then(|r| r.get("rope_theta"))
                .and_then(Value::as_f64)
        };
        let scaling = m.json(&k("rope_scaling"));
        let linear = |r: Option<&Value>| match r {
            Some(r) if r.get("rope_type").or_else(|| r.get("type")) == Some(&"linear".into()) => {
                r.get("factor").and_then(Value::as_f64)
            }
            _ => None,
        };
        let rope_scale = linear(rope.as_ref().and_then(|r| r.get("full_attention")))
            .or_else(|| linear(scaling.as_ref()))
            .unwrap_or(1.0) as f32;
        let query = m
            .f64(&k("query_pre_attn_scalar"))
            .unwrap_or(head_dim as f64);
        Ok(Config {
            gguf: false,
            vocab_size: 0,
            hidden,
            layers,
            heads,
            kv_heads: m
                .u64(&k("num_key_value_heads"))
                .map_or(heads, |v| v as usize),
            head_dim,
            context_length: m.u64(&k("max_position_embeddings")).unwrap_or(8192) as usize,
            eps: m.f64(&k("rms_norm_eps")).unwrap_or(1e-6) as f32,
            sliding,
            window: m.u64(&k("sliding_window")).unwrap_or(4096) as u32,
            rope_global: theta("full_attention")
                .or_else(|| m.f64(&k("rope_theta")))
                .unwrap_or(1_000_000.0) as f32,
            rope_local: theta("sliding_attention")
                .or_else(|| m.f64(&k("rope_local_base_freq")))
                .unwrap_or(10_000.0) as f32,
            rope_scale,
            query_scale: (1.0 / query.sqrt()) as f32,
            final_softcap: m.f64(&k("final_logit_softcapping")).map(|c| c as f32),
        })
    }

    /// Checks the shapes that must agree.
    pub fn check(&self) -> Result<()> {
        if self.layers == 0
            || self.heads == 0
            || self.kv_heads == 0
            || !self.heads.is_multiple_of(self.kv_heads)
            || self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
        {
            return Err(UError::invalid(format!(
                "arch-gemma3: {} layers, {} heads, {} KV heads of {} do not make a model",
                self.layers, self.heads, self.kv_heads, self.head_dim
            )));
        }
        Ok(())
    }
}
