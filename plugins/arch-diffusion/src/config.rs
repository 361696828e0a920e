//! The typed hyper-parameters of diffusers' `AutoencoderKL` and `UNet2DConditionModel`, from a
//! component folder's `config.json` (`config.*` metadata, as the safetensors loader presents
//! it). A key the file leaves out takes the class's default; a setting this plugin does not
//! implement (SDXL's added embeddings, class conditioning, LCM's guidance embedding…) is an
//! error that names it, never silently ignored.

use u_sdk::{MetaValue, Result, UError, WeightSetBox};

/// The most resolution levels a network may have (each halves the map; Stable Diffusion has
/// four).
pub const MAX_LEVELS: usize = 8;

/// `config.json` of one component, read with its class's defaults.
struct Meta<'w> {
    weights: &'w WeightSetBox,
    class: &'static str,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<MetaValue> {
        self.weights
            .metadata(format!("config.{key}").as_str().into())
            .into_result()
            .ok()?
            .into_option()
    }

    fn bad(&self, why: String) -> UError {
        UError::invalid(format!("arch-diffusion: {} config.json: {why}", self.class))
    }

    /// A positive count (`default` where the key is absent).
    fn count(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0 && n < 1 << 20)
                .map(|n| n as usize)
                .ok_or_else(|| self.bad(format!("`{key}` is not a positive integer ({v:?})"))),
        }
    }

    fn float(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| self.bad(format!("`{key}` is not a number ({v:?})"))),
        }
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(MetaValue::Bool(b)) => Ok(b),
            Some(v) => Err(self.bad(format!("`{key}` is not a boolean ({v:?})"))),
        }
    }

    fn name(&self, key: &str, default: &str) -> Result<String> {
        match self.get(key) {
            None => Ok(default.to_string()),
            Some(MetaValue::Str(s)) => Ok(s.into()),
            Some(v) => Err(self.bad(format!("`{key}` is not a name ({v:?})"))),
        }
    }

    /// Resolution levels: `block_out_channels`, one entry per level (at most [`MAX_LEVELS`]).
    fn levels(&self, default: &[usize]) -> Result<Vec<usize>> {
        let levels = self.counts("block_out_channels", default)?;
        if levels.len() > MAX_LEVELS {
            return Err(self.bad(format!(
                "{} resolution levels in `block_out_channels`; at most {MAX_LEVELS}",
                levels.len()
            )));
        }
        Ok(levels)
    }

    /// A list of positive counts.
    fn counts(&self, key: &str, default: &[usize]) -> Result<Vec<usize>> {
        let list = match self.get(key) {
            None => return Ok(default.to_vec()),
            Some(MetaValue::UIntArray(v)) => v.to_vec(),
            Some(v) => return Err(self.bad(format!("`{key}` is not a list of counts ({v:?})"))),
        };
        if list.is_empty() || list.iter().any(|&n| n == 0 || n >= 1 << 20) {
            return Err(self.bad(format!("`{key}` holds a count out of range ({list:?})")));
        }
        Ok(list.into_iter().map(|n| n as usize).collect())
    }

    /// A count per block: one value for every block, or a list of one per block.
    fn per_block(&self, key: &str, default: usize, blocks: usize) -> Result<Vec<usize>> {
        match self.get(key) {
            Some(MetaValue::UIntArray(_)) => {
                let list = self.counts(key, &[])?;
                if list.len() != blocks {
                    return Err(self.bad(format!(
                        "`{key}` has {} entries for {blocks} blocks",
                        list.len()
                    )));
                }
                Ok(list)
            }
            _ => Ok(vec![self.count(key, default)?; blocks]),
        }
    }

    fn names(&self, key: &str) -> Result<Vec<String>> {
        match self.get(key) {
            Some(MetaValue::StrArray(v)) => Ok(v.iter().map(|s| s.to_string()).collect()),
            Some(v) => Err(self.bad(format!("`{key}` is not a list of names ({v:?})"))),
            None => Err(self.bad(format!("no `{key}`"))),
        }
    }

    /// Refuses a key that is present with a value other than its inert default.
    fn refuse_unless(&self, key: &str, inert: impl Fn(&MetaValue) -> bool) -> Result<()> {
        match self.get(key) {
            Some(v) if !inert(&v) => Err(UError::unsupported(format!(
                "arch-diffusion: {} with `{key}` = {v:?} is not implemented",
                self.class
            ))),
            _ => Ok(()),
        }
    }

    fn check_class(&self) -> Result<()> {
        match self.get("_class_name") {
            Some(MetaValue::Str(s)) if s.as_str() == self.class => Ok(()),
            other => Err(self.bad(format!(
                "`_class_name` is {other:?}, not `{}` (a diffusers component folder)",
                self.class
            ))),
        }
    }

    fn silu(&self, key: &str) -> Result<()> {
        match self.name(key, "silu")?.as_str() {
            "silu" | "swish" => Ok(()),
            other => Err(UError::unsupported(format!(
                "arch-diffusion: {} with `{key}` `{other}` is not implemented (silu)",
                self.class
            ))),
        }
    }
}

/// Hyper-parameters of an `AutoencoderKL` (Rombach et al. 2022's KL-regularised autoencoder).
#[derive(Debug, Clone, PartialEq)]
pub struct VaeConfig {
    /// Channels of an image (3).
    pub in_channels: usize,
    /// Channels of a decoded image (3).
    pub out_channels: usize,
    /// Channels of a latent (4 for SD 1/2, 16 for SD3/FLUX).
    pub latent_channels: usize,
    /// Channels of each encoder block, first to last (the decoder's, reversed).
    pub block_out_channels: Vec<usize>,
    /// Resnets per encoder block (the decoder's blocks have one more).
    pub layers_per_block: usize,
    /// Group normalisation's groups.
    pub norm_groups: usize,
    /// Whether the mid blocks have their self-attention.
    pub mid_attention: bool,
    /// Whether the encoder's moments pass through `quant_conv`.
    pub quant_conv: bool,
    /// Whether latents pass through `post_quant_conv` before the decoder.
    pub post_quant_conv: bool,
    /// The factor latents are multiplied by for the denoiser (the pipeline's business).
    pub scaling_factor: f32,
    /// The side of the images it was trained at, in pixels.
    pub sample_size: usize,
}

/// The default `block_out_channels` of `AutoencoderKL`.
const VAE_BLOCKS: [usize; 1] = [64];

impl VaeConfig {
    /// Reads the configuration of the `AutoencoderKL` folder `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<VaeConfig> {
        let m = Meta {
            weights: w,
            class: "AutoencoderKL",
        };
        m.check_class()?;
        m.silu("act_fn")?;
        let blocks = m.levels(&VAE_BLOCKS)?;
        for (key, want) in [
            ("down_block_types", "DownEncoderBlock2D"),
            ("up_block_types", "UpDecoderBlock2D"),
        ] {
            if m.get(key).is_some() {
                let types = m.names(key)?;
                if types.len() != blocks.len() || types.iter().any(|t| t != want) {
                    return Err(UError::unsupported(format!(
                        "arch-diffusion: AutoencoderKL with `{key}` {types:?} is not \
                         implemented ({} × {want})",
                        blocks.len()
                    )));
                }
            }
        }
        let norm_groups = m.count("norm_num_groups", 32)?;
        if let Some(c) = blocks.iter().find(|&&c| !c.is_multiple_of(norm_groups)) {
            return Err(m.bad(format!(
                "{c} channels do not split into {norm_groups} norm groups"
            )));
        }
        Ok(VaeConfig {
            in_channels: m.count("in_channels", 3)?,
            out_channels: m.count("out_channels", 3)?,
            latent_channels: m.count("latent_channels", 4)?,
            layers_per_block: m.count("layers_per_block", 1)?,
            norm_groups,
            mid_attention: m.flag("mid_block_add_attention", true)?,
            quant_conv: m.flag("use_quant_conv", true)?,
            post_quant_conv: m.flag("use_post_quant_conv", true)?,
            scaling_factor: m.float("scaling_factor", 0.18215)? as f32,
            sample_size: m.count("sample_size", 32)?,
            block_out_channels: blocks,
        })
    }

    /// The side of an image over the side of its latent: 2 per downsampling block.
    pub fn scale(&self) -> u32 {
        1 << (self.block_out_channels.len() - 1)
    }
}

/// One down or up block of a UNet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnetBlock {
    /// Its output channels.
    pub channels: usize,
    /// Whether its resnets are each followed by a cross-attention transformer.
    pub cross_attention: bool,
    /// Attention heads of those transformers.
    pub heads: usize,
}

/// Hyper-parameters of a `UNet2DConditionModel` (the text-conditioned UNet of Stable
/// Diffusion 1 and 2).
#[derive(Debug, Clone, PartialEq)]
pub struct UnetConfig {
    /// Latent channels read.
    pub in_channels: usize,
    /// Channels of the prediction.
    pub out_channels: usize,
    /// The down blocks, first to last (`block_out_channels`, `down_block_types`).
    pub down: Vec<UnetBlock>,
    /// The up blocks, first (deepest) to last (`up_block_types`, channels reversed).
    pub up: Vec<UnetBlock>,
    /// Heads of the mid block's transformer (the last block's).
    pub mid_heads: usize,
    /// Resnets per down block (up blocks have one more).
    pub layers_per_block: usize,
    /// Group normalisation's groups.
    pub norm_groups: usize,
    /// Group normalisation's epsilon (resnets and the output norm).
    pub norm_eps: f32,
    /// Width of a row of the text encoder's output (the cross-attention context).
    pub cross_attention_dim: usize,
    /// Whether the transformers project in and out with linear layers (SD 2) rather than
    /// 1×1 convolutions (SD 1).
    pub linear_projection: bool,
    /// Whether the sinusoidal timestep embedding puts cosines first.
    pub flip_sin_to_cos: bool,
    /// The frequency shift of the timestep embedding.
    pub freq_shift: f32,
    /// Whether a sample is mapped to `2x − 1` first.
    pub center_input: bool,
    /// Kernel of `conv_in` (odd: "same" padding).
    pub conv_in_kernel: usize,
    /// Kernel of `conv_out` (odd).
    pub conv_out_kernel: usize,
    /// Padding of the down blocks' stride-2 convolutions.
    pub downsample_padding: u32,
    /// What the mid block's resnets divide their output by.
    pub mid_scale: f32,
    /// The side of the latents it was trained at.
    pub sample_size: usize,
}

impl UnetConfig {
    /// Reads the configuration of the `UNet2DConditionModel` folder `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<UnetConfig> {
        let m = Meta {
            weights: w,
            class: "UNet2DConditionModel",
        };
        m.check_class()?;
        m.silu("act_fn")?;
        for key in [
            "addition_embed_type",
            "class_embed_type",
            "num_class_embeds",
            "time_cond_proj_dim",
            "encoder_hid_dim",
            "encoder_hid_dim_type",
            "time_embedding_act_fn",
            "timestep_post_act",
            "cross_attention_norm",
            "time_embedding_dim",
            "reverse_transformer_layers_per_block",
        ] {
            m.refuse_unless(key, |_| false)?;
        }
        let is = |want: &'static str| move |v: &MetaValue| v.as_str() == Some(want);
        let off = |v: &MetaValue| *v == MetaValue::Bool(false);
        m.refuse_unless("time_embedding_type", is("positional"))?;
        m.refuse_unless("resnet_time_scale_shift", is("default"))?;
        m.refuse_unless("attention_type", is("default"))?;
        m.refuse_unless("mid_block_type", is("UNetMidBlock2DCrossAttn"))?;
        m.refuse_unless("only_cross_attention", off)?;
        m.refuse_unless("dual_cross_attention", off)?;
        m.refuse_unless("resnet_skip_time_act", off)?;
        m.refuse_unless("class_embeddings_concat", off)?;
        m.refuse_unless("resnet_out_scale_factor", |v| v.as_f64() == Some(1.0))?;
        m.refuse_unless("transformer_layers_per_block", |v| v.as_u64() == Some(1))?;

        let channels = m.levels(&[320, 640, 1280, 1280])?;
        let n = channels.len();
        // diffusers' legacy naming: `attention_head_dim` is the number of heads unless
        // `num_attention_heads` is given.
        let heads = match m.get("num_attention_heads") {
            Some(_) => m.per_block("num_attention_heads", 8, n)?,
            None => m.per_block("attention_head_dim", 8, n)?,
        };
        let kinds = |key: &str, plain: &str, cross: &str| -> Result<Vec<bool>> {
            let types = m.names(key)?;
            if types.len() != n {
                return Err(m.bad(format!(
                    "`{key}` has {} entries for {n} blocks",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match t {
                    t if t == plain => Ok(false),
                    t if t == cross => Ok(true),
                    other => Err(UError::unsupported(format!(
                        "arch-diffusion: UNet2DConditionModel block `{other}` is not \
                         implemented ({plain}, {cross})"
                    ))),
                })
                .collect()
        };
        let down_cross = kinds("down_block_types", "DownBlock2D", "CrossAttnDownBlock2D")?;
        let up_cross = kinds("up_block_types", "UpBlock2D", "CrossAttnUpBlock2D")?;
        let down = (0..n)
            .map(|i| UnetBlock {
                channels: channels[i],
                cross_attention: down_cross[i],
                heads: heads[i],
            })
            .collect();
        let up = (0..n)
            .map(|i| UnetBlock {
                channels: channels[n - 1 - i],
                cross_attention: up_cross[i],
                heads: heads[n - 1 - i],
            })
            .collect();
        let norm_groups = m.count("norm_num_groups", 32)?;
        if let Some(c) = channels.iter().find(|&&c| !c.is_multiple_of(norm_groups)) {
            return Err(m.bad(format!(
                "{c} channels do not split into {norm_groups} norm groups"
            )));
        }
        let kernel = |key: &str| -> Result<usize> {
            let k = m.count(key, 3)?;
            if k.is_multiple_of(2) {
                return Err(m.bad(format!("`{key}` {k} is even (no \"same\" padding)")));
            }
            Ok(k)
        };
        Ok(UnetConfig {
            in_channels: m.count("in_channels", 4)?,
            out_channels: m.count("out_channels", 4)?,
            down,
            up,
            mid_heads: heads[n - 1],
            layers_per_block: m.count("layers_per_block", 2)?,
            norm_groups,
            norm_eps: m.float("norm_eps", 1e-5)? as f32,
            cross_attention_dim: m.count("cross_attention_dim", 1280)?,
            linear_projection: m.flag("use_linear_projection", false)?,
            flip_sin_to_cos: m.flag("flip_sin_to_cos", true)?,
            freq_shift: m.float("freq_shift", 0.0)? as f32,
            center_input: m.flag("center_input_sample", false)?,
            conv_in_kernel: kernel("conv_in_kernel")?,
            conv_out_kernel: kernel("conv_out_kernel")?,
            downsample_padding: match m.get("downsample_padding") {
                None => 1,
                Some(v) => v
                    .as_u64()
                    .filter(|&p| p <= 1)
                    .ok_or_else(|| m.bad(format!("`downsample_padding` {v:?} is not 0 or 1")))?
                    as u32,
            },
            mid_scale: m.float("mid_block_scale_factor", 1.0)? as f32,
            sample_size: m.count("sample_size", 64)?,
        })
    }

    /// Input sides must be multiples of this: 2 per downsampling block.
    pub fn multiple(&self) -> u32 {
        1 << (self.down.len() - 1)
    }
}

/// Hyper-parameters of a class-conditioned `DiTTransformer2DModel`.
#[derive(Debug, Clone, PartialEq)]
pub struct DitConfig {
    /// Latent channels read.
    pub in_channels: usize,
    /// Channels of the prediction (twice the input's with a learned variance).
    pub out_channels: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Blocks.
    pub layers: usize,
    /// Side of a square patch.
    pub patch: usize,
    /// Side of the latents it was trained at.
    pub sample_size: usize,
    /// Classes (the table has one more: the null class of classifier-free guidance).
    pub classes: usize,
    /// LayerNorm epsilon before the MLP.
    pub norm_eps: f32,
}

impl DitConfig {
    /// Reads the configuration of the `DiTTransformer2DModel` folder `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<DitConfig> {
        let m = Meta {
            weights: w,
            class: "DiTTransformer2DModel",
        };
        m.check_class()?;
        let is = |want: &'static str| move |v: &MetaValue| v.as_str() == Some(want);
        m.refuse_unless("norm_type", is("ada_norm_zero"))?;
        m.refuse_unless("activation_fn", is("gelu-approximate"))?;
        m.refuse_unless("norm_elementwise_affine", |v| *v == MetaValue::Bool(false))?;
        let in_channels = m.count("in_channels", 4)?;
        let cfg = DitConfig {
            in_channels,
            out_channels: m.count("out_channels", in_channels)?,
            heads: m.count("num_attention_heads", 16)?,
            head_dim: m.count("attention_head_dim", 72)?,
            layers: m.count("num_layers", 28)?,
            patch: m.count("patch_size", 2)?,
            sample_size: m.count("sample_size", 32)?,
            classes: m.count("num_embeds_ada_norm", 1000)?,
            norm_eps: m.float("norm_eps", 1e-5)? as f32,
        };
        if !cfg.width().is_multiple_of(4) || cfg.patch > 64 || cfg.layers > 1024 {
            return Err(m.bad(format!(
                "a width of {} (heads × head dim: a multiple of 4 for the 2-D position \
                 embedding), patch {} and {} blocks do not make a DiT",
                cfg.width(),
                cfg.patch,
                cfg.layers
            )));
        }
        Ok(cfg)
    }

    /// Width of a row (heads × head dim).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Hyper-parameters of an `SD3Transformer2DModel` (MMDiT).
#[derive(Debug, Clone, PartialEq)]
pub struct Sd3Config {
    /// Latent channels read.
    pub in_channels: usize,
    /// Channels of the prediction.
    pub out_channels: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Joint blocks.
    pub layers: usize,
    /// Side of a square patch.
    pub patch: usize,
    /// Side of the latents it was trained at.
    pub sample_size: usize,
    /// Width of a text row (`joint_attention_dim`).
    pub context_width: usize,
    /// Width of the pooled text (`pooled_projection_dim`).
    pub pooled_width: usize,
    /// Side of the trained position grid that other sizes crop (`pos_embed_max_size`).
    pub pos_embed_max_size: Option<usize>,
}

impl Sd3Config {
    /// Reads the configuration of the `SD3Transformer2DModel` folder `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<Sd3Config> {
        let m = Meta {
            weights: w,
            class: "SD3Transformer2DModel",
        };
        m.check_class()?;
        m.refuse_unless("qk_norm", |v| v.as_str() == Some("rms_norm"))?;
        m.refuse_unless(
            "dual_attention_layers",
            |v| matches!(v, MetaValue::Json(j) if j.as_str() == "[]"),
        )?;
        let in_channels = m.count("in_channels", 16)?;
        let cfg = Sd3Config {
            in_channels,
            out_channels: m.count("out_channels", in_channels)?,
            heads: m.count("num_attention_heads", 18)?,
            head_dim: m.count("attention_head_dim", 64)?,
            layers: m.count("num_layers", 18)?,
            patch: m.count("patch_size", 2)?,
            sample_size: m.count("sample_size", 128)?,
            context_width: m.count("joint_attention_dim", 4096)?,
            pooled_width: m.count("pooled_projection_dim", 2048)?,
            pos_embed_max_size: match m.get("pos_embed_max_size") {
                None => None,
                Some(_) => Some(m.count("pos_embed_max_size", 96)?),
            },
        };
        let caption = m.count("caption_projection_dim", cfg.width())?;
        if caption != cfg.width()
            || !cfg.width().is_multiple_of(4)
            || cfg.patch > 64
            || cfg.layers > 1024
        {
            return Err(m.bad(format!(
                "caption_projection_dim {caption}, a width of {} (heads × head dim), patch {} \
                 and {} blocks do not make an MMDiT",
                cfg.width(),
                cfg.patch,
                cfg.layers
            )));
        }
        Ok(cfg)
    }

    /// Width of a row (heads × head dim).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// Hyper-parameters of a `FluxTransformer2DModel`.
#[derive(Debug, Clone, PartialEq)]
pub struct FluxConfig {
    /// Channels of a packed row (four times the latent's: its 2×2 patches).
    pub in_channels: usize,
    /// Channels of an output row.
    pub out_channels: usize,
    /// Attention heads.
    pub heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Double-stream blocks.
    pub layers: usize,
    /// Single-stream blocks.
    pub single_layers: usize,
    /// Width of a text row (`joint_attention_dim`).
    pub context_width: usize,
    /// Width of the pooled text.
    pub pooled_width: usize,
    /// Whether the model embeds a guidance scale (FLUX.1-dev's distilled guidance).
    pub guidance: bool,
    /// Dimensions of a head each rotary axis turns (they sum to `head_dim`).
    pub axes: Vec<usize>,
}

impl FluxConfig {
    /// Reads the configuration of the `FluxTransformer2DModel` folder `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<FluxConfig> {
        let m = Meta {
            weights: w,
            class: "FluxTransformer2DModel",
        };
        m.check_class()?;
        m.refuse_unless("patch_size", |v| v.as_u64() == Some(1))?;
        let in_channels = m.count("in_channels", 64)?;
        let cfg = FluxConfig {
            in_channels,
            out_channels: m.count("out_channels", in_channels)?,
            heads: m.count("num_attention_heads", 24)?,
            head_dim: m.count("attention_head_dim", 128)?,
            layers: m.count("num_layers", 19)?,
            single_layers: m.count("num_single_layers", 38)?,
            context_width: m.count("joint_attention_dim", 4096)?,
            pooled_width: m.count("pooled_projection_dim", 768)?,
            guidance: m.flag("guidance_embeds", false)?,
            axes: m.counts("axes_dims_rope", &[16, 56, 56])?,
        };
        let even = cfg.axes.iter().all(|a| a.is_multiple_of(2));
        if cfg.axes.iter().sum::<usize>() != cfg.head_dim
            || cfg.axes.len() != 3
            || !even
            || !cfg.in_channels.is_multiple_of(4)
            || !cfg.out_channels.is_multiple_of(4)
            || cfg.layers + cfg.single_layers > 1024
        {
            return Err(m.bad(format!(
                "rotary axes {:?} (three even parts of a head of {}), {} → {} packed channels \
                 (multiples of 4) and {} + {} blocks do not make a FLUX transformer",
                cfg.axes,
                cfg.head_dim,
                cfg.in_channels,
                cfg.out_channels,
                cfg.layers,
                cfg.single_layers
            )));
        }
        Ok(cfg)
    }

    /// Width of a row (heads × head dim).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Values of the conditioning: the timestep, the guidance scale if embedded, the pooled
    /// text.
    pub fn conditioning(&self) -> usize {
        1 + usize::from(self.guidance) + self.pooled_width
    }
}
