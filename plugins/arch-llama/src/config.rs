//! The typed hyper-parameters of a Llama-family model, read from a weight set's canonical
//! metadata (GGUF keys, or `config.json` mapped by the HF-format loaders) and tensor shapes.

use crate::naming;
use crate::weights::{NormKind, Weights};
use serde_json::Value;
use u_sdk::{Activation, MetaValue, Result, RopeStyle, UError};

/// Everything the model needs to know besides the weights themselves.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The metadata architecture (`llama`, `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`).
    pub arch: String,
    /// The family reported to the host (`config.model_type` when known, e.g. `mistral`).
    pub family: String,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Longest context.
    pub context_length: usize,
    /// Every norm of the model (RMSNorm or LayerNorm).
    pub norm: NormConfig,
    /// Rotary embedding, or `None` for learned absolute positions (GPT-2's `position_embd`).
    pub rope: Option<RopeConfig>,
    /// The feed-forward activation (gated or not follows from the tensors).
    pub activation: FfnActivation,
    /// Whether attention and feed-forward read the same block input and their outputs are
    /// summed into one residual (GPT-J-style parallel block: Falcon, Cohere, parallel StableLM).
    pub parallel: bool,
    /// Scalings and soft caps.
    pub scales: Scales,
    /// Sliding attention window per layer (0 = full attention).
    pub window: Vec<u32>,
    /// Clamp of Q, K and V projections to `[-c, c]` (OLMoE's `clip_qkv`), if any.
    pub clip_qkv: Option<f32>,
    /// Mixture of experts, if any layer has a router.
    pub moe: Option<MoeConfig>,
    /// Whether every block must have BitNet b1.58's sub-layer norms (`attn_sub_norm` before
    /// the attention output projection, `ffn_sub_norm` before the FFN's down projection).
    pub sub_norms: bool,
}

/// The norms' kind and constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormConfig {
    /// RMSNorm or LayerNorm.
    pub kind: NormKind,
    /// Variance epsilon.
    pub eps: f32,
    /// Added to every stored scale: 1 where the checkpoint stores `γ − 1` (HF Gemma, Nemotron's
    /// `LayerNorm1P`; llama.cpp's converter adds the 1 to the GGUF weights).
    pub shift: f32,
}

/// The feed-forward network's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FfnActivation {
    /// A backend activation (SiLU, GELU…).
    Act(Activation),
    /// `relu(x)²` (So et al. 2021, *Primer*: Nemotron).
    ReluSquared,
}

/// Constant scalings and soft caps of the residual stream, attention and logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scales {
    /// Multiplier of the input embeddings (Gemma: `√hidden`; Granite's `embedding_multiplier`).
    pub embedding: f32,
    /// Multiplier of each block's attention and FFN outputs before they join the residual
    /// (Granite's `residual_multiplier`).
    pub residual: f32,
    /// Attention score scale (`1/√head_dim` unless the model says otherwise).
    pub attention: f32,
    /// Soft cap of attention scores, `c · tanh(s / c)` (Gemma 2), if any.
    pub attention_softcap: Option<f32>,
    /// Multiplier of the logits (Cohere's `logit_scale`; Granite divides by `logits_scaling`).
    pub logits: f32,
    /// Soft cap of the logits, `c · tanh(l / c)` (Gemma 2), if any.
    pub final_softcap: Option<f32>,
}

/// Rotary position embedding (RoFormer), with frequency scaling already applied.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// How the stored Q/K rows pair dimensions (see [`naming`]'s note on RoPE pairing).
    pub style: RopeStyle,
    /// Dimensions rotated per head.
    pub rotary_dim: usize,
    /// `rotary_dim / 2` inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Multiplier of cos and sin (YaRN's attention factor; 1 otherwise).
    pub attn_factor: f32,
}

/// Routing of a sparse mixture-of-experts layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts each token is routed to (top-k).
    pub used: usize,
    /// Whether the top-k gate weights are renormalised to sum to one.
    pub norm_topk: bool,
}

impl Config {
    /// Reads the configuration of the model in `w`.
    pub fn from_weights(w: &Weights) -> Result<Config> {
        let arch = w
            .meta_str(naming::ARCHITECTURE_KEY)
            .ok_or_else(|| UError::invalid("arch-llama: metadata has no general.architecture"))?;
        let key = |k: &str| format!("{arch}.{k}");
        let family = w
            .meta_str("config.model_type")
            .unwrap_or_else(|| arch.clone());

        if !SUPPORTED.contains(&arch.as_str()) {
            return Err(UError::unsupported(format!(
                "arch-llama: architecture `{arch}` is not one this plugin builds ({})",
                SUPPORTED.join(", ")
            )));
        }
        for (a, flag, what) in HF_UNSUPPORTED {
            if arch == *a && w.meta_bool(&format!("config.{flag}")) == Some(true) {
                return Err(UError::unsupported(format!(
                    "arch-llama: {what} (`{flag}`) are not implemented"
                )));
            }
        }
        if arch == "bitnet" && w.format() != "gguf" {
            return Err(UError::unsupported(
                "arch-llama: transformers' BitNet checkpoints (squared ReLU, weights quantized \
                 on the fly) are not implemented; llama.cpp's `bitnet` GGUF files are",
            ));
        }
        let embd = w.shape("token_embd.weight")?;
        let [vocab_size, hidden] = dims2("token_embd.weight", &embd)?;
        let layers = w.required_u64(&key("block_count"))? as usize;
        let heads = w.required_u64(&key("attention.head_count"))? as usize;
        let kv_heads = w
            .meta_u64(&key("attention.head_count_kv"))
            .map_or(heads, |v| v as usize);
        if layers == 0 || heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(UError::invalid(format!(
                "arch-llama: {layers} layers, {heads} heads and {kv_heads} KV heads do not make a model"
            )));
        }
        let head_dim = head_dim(w, &arch, hidden as usize, heads)?;
        let context_length = w.meta_u64(&key("context_length")).unwrap_or(4096) as usize;
        let norm = NormConfig::read(w, &arch);
        let rope = match w.has("position_embd.weight") {
            true => None,
            false => Some(RopeConfig::read(w, &arch, head_dim, context_length)?),
        };
        let window = sliding_windows(w, &arch, layers);
        let parallel = w
            .meta_bool(&key("use_parallel_residual"))
            .or_else(|| w.meta_bool("config.use_parallel_residual"))
            .or_else(|| w.meta_bool("config.parallel_attn"))
            .unwrap_or(false)
            || (PARALLEL_WHEN_ONE_NORM.contains(&arch.as_str())
                && !w.has(&naming::blk(0, "ffn_norm", "weight")));

        let moe = match w.meta_u64(&key("expert_count")).filter(|&e| e > 0) {
            None => None,
            Some(experts) => {
                let used = w.required_u64(&key("expert_used_count"))? as usize;
                if used == 0 || used as u64 > experts {
                    return Err(UError::invalid(format!(
                        "arch-llama: {used} experts used per token out of {experts}"
                    )));
                }
                // llama.cpp's defaults: Mixtral and Qwen3-MoE renormalise, Qwen2-MoE and
                // OLMoE do not.
                let norm_topk = w
                    .meta_bool(&key("expert_weights_norm"))
                    .or_else(|| w.meta_bool("config.norm_topk_prob"))
                    .unwrap_or(matches!(arch.as_str(), "llama" | "qwen3moe"));
                Some(MoeConfig {
                    experts: experts as usize,
                    used,
                    norm_topk,
                })
            }
        };

        let clip_qkv = w
            .meta_f64("config.clip_qkv")
            .or_else(|| w.meta_f64(&key("attention.clamp_kqv")))
            .map(|c| c as f32);

        let activation = activation(w, &arch)?;
        let sub_norms = arch == "bitnet";
        let scales = Scales::read(w, &arch, hidden as usize, heads, head_dim, layers);
        Ok(Config {
            arch,
            family,
            vocab_size: vocab_size as usize,
            hidden: hidden as usize,
            layers,
            heads,
            kv_heads,
            head_dim,
            context_length,
            norm,
            rope,
            activation,
            parallel,
            scales,
            window,
            clip_qkv,
            moe,
            sub_norms,
        })
    }
}

/// The architectures (GGUF `general.architecture` names) this plugin builds.
pub const SUPPORTED: &[&str] = &[
    "llama",
    "qwen2",
    "qwen3",
    "qwen2moe",
    "qwen3moe",
    "olmoe",
    "gpt2",
    "phi3",
    "gemma2",
    "stablelm",
    "olmo2",
    "granite",
    "command-r",
    "falcon",
    "nemotron",
    "gptneox",
    "bitnet",
];

/// HF checkpoint variants this plugin refuses (`config.<key>` true), with the reason.
const HF_UNSUPPORTED: &[(&str, &str, &str)] = &[("falcon", "alibi", "ALiBi positions")];

/// Architectures whose blocks are parallel when they have a single input norm (no
/// `ffn_norm`), as llama.cpp decides for StableLM.
const PARALLEL_WHEN_ONE_NORM: &[&str] = &["falcon", "command-r", "stablelm"];

/// Values per head: from `attn_q`'s rows, else `attention.key_length`, else `hidden / heads`
/// (fused QKV projections).
fn head_dim(w: &Weights, arch: &str, hidden: usize, heads: usize) -> Result<usize> {
    let q = naming::blk(0, "attn_q", "weight");
    let dim = match w.has(&q) {
        true => {
            let rows = w.shape(&q)?;
            match rows.first() {
                Some(&rows) if (rows as usize).is_multiple_of(heads) => rows as usize / heads,
                _ => {
                    return Err(UError::invalid(format!(
                        "arch-llama: attn_q of shape {rows:?} does not split into {heads} heads"
                    )));
                }
            }
        }
        false => w
            .meta_u64(&format!("{arch}.attention.key_length"))
            .map_or(hidden / heads, |d| d as usize),
    };
    if dim == 0 {
        return Err(UError::invalid(format!(
            "arch-llama: {heads} heads of hidden size {hidden} leave no head dimension"
        )));
    }
    Ok(dim)
}

impl NormConfig {
    /// LayerNorm for the architectures llama.cpp builds with it, RMSNorm otherwise, with the
    /// epsilon of that kind (HF `rms_norm_eps`; `layer_norm_eps`, `layer_norm_epsilon`,
    /// `norm_eps`).
    fn read(w: &Weights, arch: &str) -> NormConfig {
        let key = |k: &str| format!("{arch}.attention.{k}");
        let (kind, eps) = match arch {
            "gpt2" | "gptneox" | "stablelm" | "command-r" | "falcon" | "nemotron" => (
                NormKind::Layer,
                w.meta_f64(&key("layer_norm_epsilon")).unwrap_or(1e-5),
            ),
            _ => (
                NormKind::Rms,
                w.meta_f64(&key("layer_norm_rms_epsilon")).unwrap_or(1e-6),
            ),
        };
        let one_plus = w.format() != "gguf" && matches!(arch, "gemma2" | "nemotron");
        NormConfig {
            kind,
            eps: eps as f32,
            shift: if one_plus { 1.0 } else { 0.0 },
        }
    }
}

/// The FFN activation: HF `hidden_activation`, `hidden_act` or `activation_function`, else the
/// architecture's own (GGUF files do not say).
fn activation(w: &Weights, arch: &str) -> Result<FfnActivation> {
    use Activation::{GeluErf, GeluTanh, Relu, Silu};
    let named = ["hidden_activation", "hidden_act", "activation_function"]
        .iter()
        .find_map(|k| w.meta_str(&format!("config.{k}")));
    Ok(FfnActivation::Act(match named.as_deref() {
        None => match arch {
            "gpt2" | "gemma2" => GeluTanh,
            // transformers' Falcon and GPT-NeoX use the exact GELU (llama.cpp its tanh
            // approximation).
            "falcon" | "gptneox" => GeluErf,
            "nemotron" => return Ok(FfnActivation::ReluSquared),
            _ => Silu,
        },
        Some("silu" | "swish") => Silu,
        Some("gelu_new" | "gelu_pytorch_tanh" | "gelu_fast") => GeluTanh,
        Some("gelu") => GeluErf,
        Some("relu") => Relu,
        Some("relu2") => return Ok(FfnActivation::ReluSquared),
        Some(other) => {
            return Err(UError::unsupported(format!(
                "arch-llama: activation `{other}` is not implemented"
            )));
        }
    }))
}

impl Scales {
    /// From GGUF keys (llama.cpp's) or HF `config.json` names.
    fn read(
        w: &Weights,
        arch: &str,
        hidden: usize,
        heads: usize,
        head_dim: usize,
        layers: usize,
    ) -> Scales {
        let get = |gguf: &str, hf: &str| {
            w.meta_f64(&format!("{arch}.{gguf}"))
                .or_else(|| w.meta_f64(&format!("config.{hf}")))
                .map(|v| v as f32)
        };
        let embedding = match arch {
            "gemma2" => (hidden as f32).sqrt(),
            _ => get("embedding_scale", "embedding_multiplier").unwrap_or(1.0),
        };
        // Gemma 2 scales by `query_pre_attn_scalar^-½`. GGUF files do not keep it: llama.cpp
        // takes `(hidden / heads)^-½` for the 46-layer 27B model, `1/√head_dim` otherwise.
        let gemma2_27b = arch == "gemma2" && w.format() == "gguf" && layers == 46;
        let attention = get("attention.scale", "attention_multiplier")
            .or_else(|| {
                w.meta_f64("config.query_pre_attn_scalar")
                    .map(|q| (q as f32).powf(-0.5))
            })
            .or_else(|| gemma2_27b.then(|| ((hidden / heads) as f32).powf(-0.5)))
            .unwrap_or(1.0 / (head_dim as f32).sqrt());
        // Same key, opposite meanings: Granite divides the logits, Cohere multiplies them.
        let logits = match (arch, get("logit_scale", "logits_scaling")) {
            ("granite", Some(s)) => 1.0 / s,
            ("command-r", _) => get("logit_scale", "logit_scale").unwrap_or(1.0),
            _ => 1.0,
        };
        Scales {
            embedding,
            residual: get("residual_scale", "residual_multiplier").unwrap_or(1.0),
            attention,
            attention_softcap: get("attn_logit_softcapping", "attn_logit_softcapping"),
            logits,
            final_softcap: get("final_logit_softcapping", "final_logit_softcapping"),
        }
    }
}

impl RopeConfig {
    fn read(w: &Weights, arch: &str, head_dim: usize, context: usize) -> Result<RopeConfig> {
        let key = |k: &str| format!("{arch}.{k}");
        // transformers 5 writes `rope_parameters`, earlier versions `rope_theta` + `rope_scaling`.
        let hf_rope = w
            .meta_json("config.rope_parameters")
            .or_else(|| w.meta_json("config.rope_scaling"))
            .filter(Value::is_object);
        let hf = |k: &str| hf_rope.as_ref().and_then(|r| r.get(k));
        let base = w
            .meta_f64(&key("rope.freq_base"))
            .or_else(|| hf("rope_theta").and_then(Value::as_f64))
            .unwrap_or(10_000.0);
        let rotary_dim = rotary_dim(w, arch, head_dim);
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(UError::invalid(format!(
                "arch-llama: rotary dimension {rotary_dim} for head dimension {head_dim}"
            )));
        }
        let style = naming::rope_style(w.format(), arch);

        // θ_i = base^(−2i/d), computed in f32 as the reference does.
        let mut inv_freq: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| 1.0 / (base as f32).powf((2 * i) as f32 / rotary_dim as f32))
            .collect();

        let rope_type = hf("rope_type")
            .or_else(|| hf("type"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| w.meta_str(&key("rope.scaling.type")));
        let factor = hf("factor")
            .and_then(Value::as_f64)
            .or_else(|| w.meta_f64(&key("rope.scaling.factor")))
            .unwrap_or(1.0) as f32;
        let mut attn_factor = 1.0;
        match rope_type.as_deref() {
            None | Some("default") | Some("none") => {}
            Some("linear") => inv_freq.iter_mut().for_each(|f| *f /= factor),
            Some("llama3") => {
                let get = |k: &str, d: f64| hf(k).and_then(Value::as_f64).unwrap_or(d) as f32;
                llama3_scaling(
                    &mut inv_freq,
                    factor,
                    get("low_freq_factor", 1.0),
                    get("high_freq_factor", 4.0),
                    get("original_max_position_embeddings", 8192.0),
                );
            }
            Some("yarn") => {
                let get = |k: &str, gguf: &str| {
                    hf(k)
                        .and_then(Value::as_f64)
                        .or_else(|| w.meta_f64(&key(gguf)))
                };
                let original = get(
                    "original_max_position_embeddings",
                    "rope.scaling.original_context_length",
                )
                .unwrap_or(context as f64) as f32;
                let yarn = Yarn {
                    base: base as f32,
                    factor,
                    original_context: original,
                    beta_fast: get("beta_fast", "rope.scaling.yarn_beta_fast").unwrap_or(32.0)
                        as f32,
                    beta_slow: get("beta_slow", "rope.scaling.yarn_beta_slow").unwrap_or(1.0)
                        as f32,
                    truncate: hf("truncate").and_then(Value::as_bool).unwrap_or(true),
                };
                inv_freq = yarn.inv_freq(rotary_dim);
                let mscale = |m: f64| {
                    if factor <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * (factor as f64).ln() + 1.0
                    }
                };
                attn_factor = match (
                    get("attention_factor", "rope.scaling.attn_factor"),
                    hf("mscale").and_then(Value::as_f64),
                    hf("mscale_all_dim").and_then(Value::as_f64),
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
                    _ => mscale(1.0),
                } as f32;
            }
            Some(other) => {
                return Err(UError::unsupported(format!(
                    "arch-llama: rope scaling `{other}` is not implemented"
                )));
            }
        }
        // Phi-3's long-context variants (LongRoPE) in GGUF: per-frequency factors chosen by
        // context length, not implemented.
        if let Some(t) = ["rope_factors_long.weight", "rope_factors_short.weight"]
            .into_iter()
            .find(|t| w.has(t))
        {
            return Err(UError::unsupported(format!(
                "arch-llama: LongRoPE scaling (`{t}`) is not implemented"
            )));
        }
        // GGUF carries Llama 3 scaling as per-frequency divisors.
        if w.has("rope_freqs.weight") {
            let factors = w.f32("rope_freqs.weight")?;
            if factors.len() != inv_freq.len() {
                return Err(UError::invalid(format!(
                    "arch-llama: rope_freqs.weight has {} values, expected {}",
                    factors.len(),
                    inv_freq.len()
                )));
            }
            inv_freq.iter_mut().zip(factors).for_each(|(f, d)| *f /= d);
        }
        Ok(RopeConfig {
            style,
            rotary_dim,
            inv_freq,
            attn_factor,
        })
    }
}

/// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequencies that turn
/// fewer than `beta_slow` times over the original context are interpolated (divided by
/// `factor`), those turning more than `beta_fast` times are kept, with a linear ramp between;
/// computed as transformers' `_compute_yarn_parameters` does.
pub struct Yarn {
    /// RoPE base θ.
    pub base: f32,
    /// Context extension factor.
    pub factor: f32,
    /// The context length the model was trained with.
    pub original_context: f32,
    /// Rotations above which a frequency is kept.
    pub beta_fast: f32,
    /// Rotations below which a frequency is interpolated.
    pub beta_slow: f32,
    /// Round the ramp's ends outwards to whole dimensions.
    pub truncate: bool,
}

impl Yarn {
    /// The `dim / 2` scaled inverse frequencies.
    pub fn inv_freq(&self, dim: usize) -> Vec<f32> {
        let d = dim as f32;
        // The dimension at which a frequency turns `rotations` times over the original context.
        let correction = |rotations: f32| {
            d * (self.original_context / (rotations * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * self.base.ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dim / 2)
            .map(|i| {
                let pos = self.base.powf((2 * i) as f32 / d);
                let (extrapolated, interpolated) = (1.0 / pos, 1.0 / (self.factor * pos));
                let keep = 1.0 - ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                interpolated * (1.0 - keep) + extrapolated * keep
            })
            .collect()
    }
}

/// How many dimensions of each head RoPE rotates: GGUF's `rope.dimension_count`, else HF's
/// partial rotary factor (or GPT-NeoX's `rotary_pct`) of `head_dim`, else all of it.
pub fn rotary_dim(w: &Weights, arch: &str, head_dim: usize) -> usize {
    let partial = || {
        w.meta_json("config.rope_parameters")
            .or_else(|| w.meta_json("config.rope_scaling"))
            .and_then(|r| r.get("partial_rotary_factor").and_then(Value::as_f64))
    };
    match w.meta_u64(&format!("{arch}.rope.dimension_count")) {
        Some(d) => d as usize,
        None => w
            .meta_f64("config.partial_rotary_factor")
            .or_else(partial)
            .or_else(|| w.meta_f64("config.rotary_pct"))
            .map_or(head_dim, |f| (head_dim as f64 * f) as usize),
    }
}

/// Llama 3.1's frequency-dependent RoPE scaling: long wavelengths divided by `factor`, short ones
/// kept, the band between interpolated smoothly (as transformers' `_compute_llama3_parameters`).
pub fn llama3_scaling(inv_freq: &mut [f32], factor: f32, low: f32, high: f32, old_ctx: f32) {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    for f in inv_freq {
        let wavelen = 2.0 * std::f32::consts::PI / *f;
        if wavelen > low_wavelen {
            *f /= factor;
        } else if wavelen >= high_wavelen {
            let smooth = (old_ctx / wavelen - low) / (high - low);
            *f = (1.0 - smooth) * *f / factor + smooth * *f;
        }
    }
}

/// The sliding window of each layer: `config.layer_types` when given (transformers 5), Gemma 2's
/// alternation, Qwen2's `use_sliding_window`/`max_window_layers`, otherwise the window (if any)
/// on every layer.
fn sliding_windows(w: &Weights, arch: &str, layers: usize) -> Vec<u32> {
    // llama.cpp's Gemma 2 default: 4096.
    let window = w
        .meta_u64(&format!("{arch}.attention.sliding_window"))
        .unwrap_or(if arch == "gemma2" { 4096 } else { 0 }) as u32;
    if window == 0 {
        return vec![0; layers];
    }
    if let Some(MetaValue::StrArray(types)) = w.meta("config.layer_types") {
        return (0..layers)
            .map(|i| match types.get(i).map(|t| t.as_str()) {
                Some("sliding_attention") => window,
                _ => 0,
            })
            .collect();
    }
    if arch == "gemma2" {
        // Local and global attention alternate, the first layer local (llama.cpp's pattern).
        return (0..layers)
            .map(|i| if i % 2 == 0 { window } else { 0 })
            .collect();
    }
    if w.meta_bool("config.use_sliding_window") == Some(false) {
        return vec![0; layers];
    }
    let first = w.meta_u64("config.max_window_layers").unwrap_or(0) as usize;
    let first = if arch.starts_with("qwen") { first } else { 0 };
    (0..layers)
        .map(|i| if i >= first { window } else { 0 })
        .collect()
}

fn dims2(name: &str, shape: &[u64]) -> Result<[u64; 2]> {
    match shape {
        [a, b] => Ok([*a, *b]),
        _ => Err(UError::invalid(format!(
            "arch-llama: {name} has shape {shape:?}, expected two dimensions"
        ))),
    }
}
