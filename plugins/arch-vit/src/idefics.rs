//! IDEFICS's image encoder (Laurençon et al. 2023, an open reproduction of Flamingo: Alayrac et
//! al. 2022, *Flamingo: a Visual Language Model for Few-Shot Learning*, arXiv:2204.14198): the
//! vision tower of a checkpoint whose `config.json` says `"model_type": "idefics"` and, where
//! the checkpoint uses one, the Perceiver resampler (Jaegle et al. 2021, *Perceiver*,
//! arXiv:2103.03206) that turns an image's rows into a fixed number of latent rows.
//!
//! An IDEFICS checkpoint is served as two models built from one weight set: this encoder
//! (family `idefics.vision`) and the cross-attention decoder (family `idefics`, another
//! plugin's business), which reads the rows made here as the context of its gated
//! cross-attention blocks. As transformers' `IdeficsModel`:
//!
//! ```text
//! h = vision_model(pixels).last_hidden_state      # CLIP's tower: no post_layernorm, class row kept
//! rows = perceiver_resampler(h)  if use_resampler  # n_latents rows
//!      = h                       otherwise
//! ```
//!
//! The tower is CLIP's [`VisionTransformer`] (IDEFICS' `vision_config` names its width
//! `embed_dim` and defaults to exact GELU), its tensors under `model.vision_model.`. The
//! resampler ([`Resampler`], under `model.perceiver_resampler.`) is, as `perceiver.py` has it,
//! with `x` the context (the image's rows) and `z` the latents, learned and shared by every
//! image:
//!
//! ```text
//! for each block:
//!     z = z + PerceiverAttention(x, z)
//!     z = z + MLP(z)                               # ln, fc, ReLU, c_proj; no biases
//! rows = LN(z)
//!
//! PerceiverAttention(x, z):
//!     x̂, ẑ = LN_x(x), LN_z(z)
//!     q = ẑ W_q;  k = [x̂; ẑ] W_k;  v = [x̂; ẑ] W_v    # per head; no biases
//!     (q, k = LN_q(q), LN_k(k)  with qk_layer_norms_perceiver)
//!     out = softmax(q kᵀ / √d_head) v · W_o
//! ```

use crate::{
    config::{self, Config, Family},
    model::{Dense, LayerNorm, Span, VisionTransformer},
    naming::Names,
};
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ImageSpec, MetaValue, ModelConfig, Result,
    SeqChunk, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// The family this module builds: the image encoder of HF `model_type` `idefics`.
pub const FAMILY: &str = "idefics.vision";

/// The `model_type` of the checkpoints it reads.
pub const CHECKPOINT: &str = "idefics";

/// Prefixes of the vision tower in an IDEFICS checkpoint.
const TOWER: [&str; 2] = ["model.vision_model.", "vision_model."];

/// Prefixes of the Perceiver resampler in an IDEFICS checkpoint.
const RESAMPLER: [&str; 2] = ["model.perceiver_resampler.", "perceiver_resampler."];

/// The epsilon of the resampler's norms (`nn.LayerNorm`'s default; the config states none).
const RESAMPLER_EPS: f32 = 1e-5;

fn meta(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

/// Whether `w` is an IDEFICS checkpoint (`config.model_type` is `idefics`).
pub fn is_idefics(w: &WeightSetBox) -> bool {
    meta(w, "config.model_type").is_some_and(|v| v.as_str() == Some(CHECKPOINT))
}

/// transformers' `IdeficsVisionConfig` defaults, for keys a `vision_config` leaves out.
fn vision_default(key: &str) -> Option<MetaValue> {
    Some(match key {
        "embed_dim" => MetaValue::UInt(768),
        "image_size" => MetaValue::UInt(224),
        "intermediate_size" => MetaValue::UInt(5120),
        "patch_size" => MetaValue::UInt(14),
        "num_hidden_layers" => MetaValue::UInt(32),
        "num_attention_heads" => MetaValue::UInt(16),
        "num_channels" => MetaValue::UInt(3),
        "layer_norm_eps" => MetaValue::Float(1e-5),
        "hidden_act" => MetaValue::Str("gelu".into()),
        _ => return None,
    })
}

/// The Perceiver resampler's hyper-parameters (`perceiver_config`).
#[derive(Debug, Clone, PartialEq)]
pub struct ResamplerConfig {
    /// Latent rows: the rows one image becomes (`resampler_n_latents`).
    pub latents: usize,
    /// Blocks (`resampler_depth`).
    pub depth: usize,
    /// Attention heads (`resampler_n_heads`).
    pub heads: usize,
    /// Width of a head (`resampler_head_dim`).
    pub head_dim: usize,
    /// Whether queries and keys are layer-normed per head (`qk_layer_norms_perceiver`).
    pub qk_norms: bool,
}

/// What the encoder is, besides its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct IdeficsConfig {
    /// The vision tower (`vision_config`), CLIP's.
    pub tower: Config,
    /// The resampler, where `use_resampler` is set.
    pub resampler: Option<ResamplerConfig>,
}

impl IdeficsConfig {
    /// Reads the configuration of the IDEFICS checkpoint `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<IdeficsConfig> {
        let source = "idefics config.json";
        let bad = |why: String| UError::invalid(format!("arch-vit: {source}: {why}"));
        let vision = config::nested(w, "vision_config", source)?
            .ok_or_else(|| bad("no `vision_config` object".into()))?;
        // CLIP's tower under IDEFICS' names: `embed_dim` is the width.
        let value = |k: &str| {
            let k = match k {
                "model_type" => return Some(MetaValue::Str(Family::Clip.name().into())),
                "hidden_size" => "embed_dim",
                k => k,
            };
            match vision.get(k) {
                None | Some(serde_json::Value::Null) => vision_default(k),
                Some(v) => Some(u_sdk::weights::json_to_meta(v)),
            }
        };
        let tower = Config::from_meta(&value, &format!("{source}: vision_config"))?;
        let perceiver = config::nested(w, "perceiver_config", source)?.unwrap_or_default();
        let flag = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_bool);
        // transformers builds the resampler on the top-level `use_resampler`.
        let use_resampler = match meta(w, "config.use_resampler") {
            Some(MetaValue::Bool(b)) => b,
            None => flag(perceiver.get("use_resampler")).unwrap_or(false),
            Some(other) => return Err(bad(format!("`use_resampler` {other:?} is not a bool"))),
        };
        let resampler = if use_resampler {
            let int = |k: &str, default: u64| -> Result<usize> {
                match perceiver.get(k) {
                    None | Some(serde_json::Value::Null) => Ok(default as usize),
                    Some(v) => v
                        .as_u64()
                        .filter(|&n| n > 0 && n < 1 << 20)
                        .map(|n| n as usize)
                        .ok_or_else(|| {
                            bad(format!(
                                "perceiver_config: `{k}` {v} is not a positive count"
                            ))
                        }),
                }
            };
            Some(ResamplerConfig {
                latents: int("resampler_n_latents", 64)?,
                depth: int("resampler_depth", 6)?,
                heads: int("resampler_n_heads", 16)?,
                head_dim: int("resampler_head_dim", 96)?,
                qk_norms: flag(perceiver.get("qk_layer_norms_perceiver")).unwrap_or(false),
            })
        } else {
            None
        };
        Ok(IdeficsConfig { tower, resampler })
    }

    /// Rows one image becomes: the resampler's latents, else the tower's rows (class row
    /// first).
    pub fn rows(&self) -> usize {
        match &self.resampler {
            Some(r) => r.latents,
            None => self.tower.rows(),
        }
    }
}

/// The Perceiver's cross-attention: the latents' queries attend to the context's rows and the
/// latents' own, joined.
pub struct PerceiverAttention {
    context_norm: LayerNorm,
    latents_norm: LayerNorm,
    q_norm: Option<LayerNorm>,
    k_norm: Option<LayerNorm>,
    q_proj: Dense,
    k_proj: Dense,
    v_proj: Dense,
    output_proj: Dense,
    params: AttentionParams,
    head_dim: usize,
}

impl PerceiverAttention {
    fn load(n: &Names<'_>, cfg: &ResamplerConfig, width: usize) -> Result<PerceiverAttention> {
        let inner = cfg.heads * cfg.head_dim;
        let norm = |name: &str, w: usize| LayerNorm::load_with(n, name, w, RESAMPLER_EPS);
        let qk = |name: &str| cfg.qk_norms.then(|| norm(name, cfg.head_dim)).transpose();
        Ok(PerceiverAttention {
            context_norm: norm("context_layer_norm", width)?,
            latents_norm: norm("latents_layer_norm", width)?,
            q_norm: qk("q_layer_norm")?,
            k_norm: qk("k_layer_norm")?,
            q_proj: Dense::load_with(n, "q_proj", width, inner, false)?,
            k_proj: Dense::load_with(n, "k_proj", width, inner, false)?,
            v_proj: Dense::load_with(n, "v_proj", width, inner, false)?,
            output_proj: Dense::load_with(n, "output_proj", inner, width, false)?,
            params: AttentionParams {
                heads: cfg.heads as u32,
                kv_heads: cfg.heads as u32,
                head_dim: cfg.head_dim as u32,
                first_query_pos: 0,
                window: 0,
                scale: 1.0 / (cfg.head_dim as f32).sqrt(),
                softcap: 0.0,
                mask: AttentionMask::Bidirectional,
                kv_dtype: DType::F32,
            },
            head_dim: cfg.head_dim,
        })
    }

    /// `norm` applied to each head's slice of `x` (`[rows, heads·head_dim]`).
    fn per_head(norm: &Option<LayerNorm>, x: Tensor, head_dim: usize) -> Result<Tensor> {
        let Some(norm) = norm else { return Ok(x) };
        let dims = x.dims().to_vec();
        let heads = (x.rows() * x.row_len() / head_dim) as u64;
        norm.forward(&x.reshape(&[heads, head_dim as u64])?)?
            .reshape(&dims)
    }

    /// The attention's output for the latents `z` (`[images·latents, width]`) of the images
    /// whose context rows are `x` (`[images·rows, width]`, `context` spans).
    fn forward(&self, x: &Tensor, context: &[Span], z: &Tensor, latents: usize) -> Result<Tensor> {
        let (x, z) = (self.context_norm.forward(x)?, self.latents_norm.forward(z)?);
        let width = z.row_len() as u64;
        let dev = z.device();
        // `[x̂; ẑ]` of each image, one after the other.
        let joined_rows: usize = context.iter().map(|s| s.len + latents).sum();
        let joined = dev.alloc(DType::F32, &[joined_rows as u64, width])?;
        let mut spans = Vec::with_capacity(context.len());
        let mut at = 0;
        for (i, s) in context.iter().enumerate() {
            x.rows_range(s.offset..s.offset + s.len)?
                .copy_into(None, &joined.rows_range(at..at + s.len)?)?;
            z.rows_range(i * latents..(i + 1) * latents)?
                .copy_into(None, &joined.rows_range(at + s.len..at + s.len + latents)?)?;
            spans.push(Span {
                offset: at,
                len: s.len + latents,
            });
            at += s.len + latents;
        }
        let q = Self::per_head(&self.q_norm, self.q_proj.forward(&z)?, self.head_dim)?;
        let k = Self::per_head(&self.k_norm, self.k_proj.forward(&joined)?, self.head_dim)?;
        let v = self.v_proj.forward(&joined)?;
        let out = dev.alloc(DType::F32, q.dims())?;
        for (i, s) in spans.iter().enumerate() {
            let kv = s.offset..s.offset + s.len;
            let (k, v) = (k.rows_range(kv.clone())?, v.rows_range(kv)?);
            let mine = i * latents..(i + 1) * latents;
            q.rows_range(mine.clone())?.attention_into(
                &[k.desc(), v.desc()],
                &self.params,
                &out.rows_range(mine)?,
            )?;
        }
        self.output_proj.forward(&out)
    }
}

/// The resampler's feed-forward: `c_proj(ReLU(fc(LN(z))))`, no biases.
pub struct PerceiverMlp {
    ln: LayerNorm,
    fc: Dense,
    c_proj: Dense,
}

impl PerceiverMlp {
    fn load(n: &Names<'_>, width: usize) -> Result<PerceiverMlp> {
        // transformers sizes it four times the vision width.
        let inner = 4 * width;
        Ok(PerceiverMlp {
            ln: LayerNorm::load_with(n, "ln", width, RESAMPLER_EPS)?,
            fc: Dense::load_with(n, "fc", width, inner, false)?,
            c_proj: Dense::load_with(n, "c_proj", inner, width, false)?,
        })
    }

    fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let h = self.fc.forward(&self.ln.forward(z)?)?;
        self.c_proj.forward(&h.activation(Activation::Relu)?)
    }
}

/// One resampler block: `z = z + Attention(x, z); z = z + MLP(z)`.
pub struct PerceiverBlock {
    attention: PerceiverAttention,
    mlp: PerceiverMlp,
}

impl PerceiverBlock {
    fn forward(&self, x: &Tensor, context: &[Span], z: &Tensor, latents: usize) -> Result<Tensor> {
        let z = z.add(&self.attention.forward(x, context, z, latents)?)?;
        z.add(&self.mlp.forward(&z)?)
    }
}

/// The Perceiver resampler: learned latents cross-attend to an image's rows, block after
/// block, and are normed.
pub struct Resampler {
    /// `[latents, width]`, the same for every image.
    latents: Vec<f32>,
    blocks: Vec<PerceiverBlock>,
    norm: LayerNorm,
    count: usize,
    width: usize,
}

impl Resampler {
    fn load(n: &Names<'_>, cfg: &ResamplerConfig, width: usize) -> Result<Resampler> {
        let latents = n.values("latents", cfg.latents * width)?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                Ok(PerceiverBlock {
                    attention: PerceiverAttention::load(
                        &n.within(&format!("blocks.{i}.0.")),
                        cfg,
                        width,
                    )?,
                    mlp: PerceiverMlp::load(&n.within(&format!("blocks.{i}.1.")), width)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Resampler {
            latents,
            blocks,
            norm: LayerNorm::load_with(n, "layer_norm", width, RESAMPLER_EPS)?,
            count: cfg.latents,
            width,
        })
    }

    /// Each image's latent rows (`[images·latents, width]`) from its rows `x` (`context`
    /// spans).
    fn forward(&self, x: &Tensor, context: &[Span]) -> Result<Tensor> {
        let dev = x.device();
        let repeated: Vec<f32> = context
            .iter()
            .flat_map(|_| self.latents.iter().copied())
            .collect();
        let rows = (context.len() * self.count) as u64;
        let mut z = dev.from_f32(&repeated, &[rows, self.width as u64])?;
        for block in &self.blocks {
            z = block.forward(x, context, &z, self.count)?;
        }
        self.norm.forward(&z)
    }
}

/// IDEFICS's image encoder: the vision tower's last rows, resampled where the checkpoint says.
pub struct IdeficsVision {
    /// Hyper-parameters.
    pub cfg: IdeficsConfig,
    /// What an image must be; [`ImageSpec::rows`] is the rows it becomes for the decoder.
    pub spec: ImageSpec,
    tower: VisionTransformer,
    resampler: Option<Resampler>,
}

impl IdeficsVision {
    /// Builds the encoder of the IDEFICS checkpoint `w` on `device`.
    pub fn load(w: &WeightSetBox, device: Device) -> Result<IdeficsVision> {
        let cfg = IdeficsConfig::from_weights(w)?;
        // CLIP's processor values are IDEFICS' defaults too (OpenAI's statistics, bicubic, a
        // resize to `image_size`).
        let tower_spec = config::image_spec(w, &cfg.tower)?;
        let names = Names::under(w, Family::Clip, device, &TOWER)?;
        let tower = VisionTransformer::load(&names, cfg.tower.clone(), tower_spec)?;
        let resampler = match &cfg.resampler {
            None => None,
            Some(r) => {
                let n = RESAMPLER
                    .iter()
                    .map(|p| names.beside(p))
                    .find(|n| n.has("latents"))
                    .ok_or_else(|| {
                        UError::invalid(format!(
                            "arch-vit: the IDEFICS config sets `use_resampler` but the checkpoint \
                             has no perceiver resampler (`latents` under {RESAMPLER:?})"
                        ))
                    })?;
                Some(Resampler::load(&n, r, cfg.tower.hidden)?)
            }
        };
        let spec = ImageSpec {
            rows: cfg.rows() as u32,
            ..tower_spec
        };
        Ok(IdeficsVision {
            cfg,
            spec,
            tower,
            resampler,
        })
    }

    /// What the model is, as the ABI says it: an encoder of images into context rows of the
    /// vision width ([`ModelConfig::hidden`]); `layers` is the tower's.
    pub fn model_config(&self) -> ModelConfig {
        VisionTransformer::row_encoder_config(
            FAMILY,
            self.cfg.tower.hidden,
            self.cfg.tower.layers,
            self.spec,
        )
    }

    /// Encodes every chunk of `batch` (one image each) and writes the context rows of those
    /// that ask for them into `out`, in batch order: `[rows, hidden]` per image (see
    /// [`u_sdk::Model::forward`]).
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let images = self.tower.row_images(
            batch,
            (&self.spec, self.cfg.tower.hidden),
            out.len(),
            "an IDEFICS image encoder gives one output, the image's context rows for the decoder",
        )?;
        if images.is_empty() {
            return Ok(());
        }
        // `last_hidden_state`: the state after the last block, no final norm (CLIP's tower).
        let (mut states, spans) = self.tower.states(&images, self.cfg.tower.layers)?;
        let h = states
            .pop()
            .ok_or_else(|| UError::invalid("arch-vit: the tower gave no states"))?;
        match &self.resampler {
            Some(resampler) => resampler.forward(&h, &spans)?.read_into(out),
            None => h.read_into(out),
        }
    }
}
