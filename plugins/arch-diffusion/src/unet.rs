//! `UNet2DConditionModel`: the text-conditioned denoiser of Stable Diffusion 1 and 2 (Rombach
//! et al. 2022, on the UNet of Ronneberger et al. 2015 as DDPM uses it).
//!
//! ```text
//! temb = linear_2(silu(linear_1(sinusoid(t))))
//! h = conv_in(x);  skips = [h]
//! down block:  h = resnet(h, temb) [→ transformer(h, context)], skips += h   # per resnet
//!              h = downsample(h), skips += h                                 # all but the last
//! mid:         h = resnet(h, temb) → transformer(h, context) → resnet(h, temb)
//! up block:    h = resnet(cat(h, skips.pop()), temb) [→ transformer(h, context)]  # per resnet
//!              h = upsample(h)                                               # all but the last
//! ε = conv_out(silu(norm_out(h)))
//! ```

use crate::{
    blocks::{Downsample2D, KeysValues, ResnetBlock2D, Transformer2D, Upsample2D},
    config::{UnetBlock, UnetConfig},
    layers::{Conv2d, GroupNorm, Linear, Weights},
};
use u_sdk::{
    Activation, Result, UError,
    nn::{Device, Tensor},
};

/// The sinusoidal embedding of a timestep (DDPM's, as diffusers' `get_timestep_embedding`
/// computes it in `f32`): `dim / 2` frequencies `exp(−ln(10⁴)·i / (dim/2 − shift))`, sines
/// then cosines (cosines first when `flip`), a zero appended for an odd `dim`.
pub fn timestep_embedding(t: f32, dim: usize, flip: bool, shift: f32) -> Vec<f32> {
    let half = dim / 2;
    let log_period = -(10_000f64.ln() as f32);
    let args: Vec<f32> = (0..half)
        .map(|i| t * (log_period * i as f32 / (half as f32 - shift)).exp())
        .collect();
    let sin = args.iter().map(|a| a.sin());
    let cos = args.iter().map(|a| a.cos());
    let mut e: Vec<f32> = match flip {
        true => cos.chain(sin).collect(),
        false => sin.chain(cos).collect(),
    };
    e.resize(dim, 0.0);
    e
}

/// `TimestepEmbedding`: the sinusoid through `linear_1`, SiLU, `linear_2`.
pub struct TimestepEmbedding {
    linear_1: Linear,
    linear_2: Linear,
    flip: bool,
    shift: f32,
}

impl TimestepEmbedding {
    fn load(w: &Weights<'_>, cfg: &UnetConfig) -> Result<TimestepEmbedding> {
        Ok(TimestepEmbedding {
            linear_1: Linear::load(w, "time_embedding.linear_1")?,
            linear_2: Linear::load(w, "time_embedding.linear_2")?,
            flip: cfg.flip_sin_to_cos,
            shift: cfg.freq_shift,
        })
    }

    /// The embedding of timestep `t`, `[1, d]`.
    pub fn forward(&self, t: f32, device: &Device) -> Result<Tensor> {
        let dim = self.linear_1.in_features();
        let e = timestep_embedding(t, dim, self.flip, self.shift);
        let h = self
            .linear_1
            .forward(&device.from_f32(&e, &[1, dim as u64])?)?;
        h.activation_assign(Activation::Silu)?;
        self.linear_2.forward(&h)
    }
}

/// A down block (`DownBlock2D`, or `CrossAttnDownBlock2D` with its transformers).
pub struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2D>,
    downsample: Option<Downsample2D>,
}

/// An up block (`UpBlock2D`, or `CrossAttnUpBlock2D` with its transformers).
pub struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2D>,
    upsample: Option<Upsample2D>,
}

/// `UNetMidBlock2DCrossAttn`: resnet, then (transformer, resnet) pairs.
pub struct MidBlock {
    first: ResnetBlock2D,
    pairs: Vec<(Transformer2D, ResnetBlock2D)>,
}

/// The keys and values every cross-attention of the UNet reads from one context, transformer
/// by transformer in the order the forward pass meets them: the same for every step of a
/// sample.
pub struct CrossKeysValues(Vec<Vec<KeysValues>>);

/// The whole denoiser.
pub struct Unet2dCondition {
    cfg: UnetConfig,
    time: TimestepEmbedding,
    conv_in: Conv2d,
    down: Vec<DownBlock>,
    mid: MidBlock,
    up: Vec<UpBlock>,
    norm_out: GroupNorm,
    conv_out: Conv2d,
}

/// The transformers of a block: one per resnet when it cross-attends, none otherwise.
fn transformers(
    w: &Weights<'_>,
    prefix: &str,
    block: &UnetBlock,
    count: usize,
    cfg: &UnetConfig,
) -> Result<Vec<Transformer2D>> {
    if !block.cross_attention {
        return Ok(Vec::new());
    }
    (0..count)
        .map(|j| {
            Transformer2D::load(
                w,
                &format!("{prefix}.attentions.{j}"),
                cfg.norm_groups,
                block.heads,
                cfg.linear_projection,
            )
        })
        .collect()
}

impl Unet2dCondition {
    /// Reads the `UNet2DConditionModel` in `w`.
    pub fn load(w: &Weights<'_>, cfg: &UnetConfig) -> Result<Unet2dCondition> {
        let norm = (cfg.norm_groups, cfg.norm_eps);
        let resnet = |p: String| ResnetBlock2D::load(w, &p, norm, 1.0);
        let n = cfg.down.len();
        let down = cfg
            .down
            .iter()
            .enumerate()
            .map(|(i, block)| {
                let prefix = format!("down_blocks.{i}");
                Ok(DownBlock {
                    resnets: (0..cfg.layers_per_block)
                        .map(|j| resnet(format!("{prefix}.resnets.{j}")))
                        .collect::<Result<_>>()?,
                    attentions: transformers(w, &prefix, block, cfg.layers_per_block, cfg)?,
                    downsample: match i + 1 < n {
                        true => Some(Downsample2D::load(
                            w,
                            &format!("{prefix}.downsamplers.0"),
                            [cfg.downsample_padding, 1],
                        )?),
                        false => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let up = cfg
            .up
            .iter()
            .enumerate()
            .map(|(i, block)| {
                let prefix = format!("up_blocks.{i}");
                let count = cfg.layers_per_block + 1;
                Ok(UpBlock {
                    resnets: (0..count)
                        .map(|j| resnet(format!("{prefix}.resnets.{j}")))
                        .collect::<Result<_>>()?,
                    attentions: transformers(w, &prefix, block, count, cfg)?,
                    upsample: match i + 1 < n {
                        true => Some(Upsample2D::load(w, &format!("{prefix}.upsamplers.0"))?),
                        false => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mid_resnet = |j: usize| {
            ResnetBlock2D::load(w, &format!("mid_block.resnets.{j}"), norm, cfg.mid_scale)
        };
        let mut pairs = Vec::new();
        while w.has(&format!(
            "mid_block.resnets.{}.conv1.weight",
            pairs.len() + 1
        )) {
            let j = pairs.len();
            let t = Transformer2D::load(
                w,
                &format!("mid_block.attentions.{j}"),
                cfg.norm_groups,
                cfg.mid_heads,
                cfg.linear_projection,
            )?;
            pairs.push((t, mid_resnet(j + 1)?));
        }
        let unet = Unet2dCondition {
            cfg: cfg.clone(),
            time: TimestepEmbedding::load(w, cfg)?,
            conv_in: Conv2d::load(w, "conv_in")?,
            down,
            mid: MidBlock {
                first: mid_resnet(0)?,
                pairs,
            },
            up,
            norm_out: GroupNorm::load(w, "conv_norm_out", cfg.norm_groups, cfg.norm_eps)?,
            conv_out: Conv2d::load(w, "conv_out")?,
        };
        unet.check()?;
        Ok(unet)
    }

    /// That the channels chain from block to block and every cross-attention reads rows of
    /// `cross_attention_dim`.
    fn check(&self) -> Result<()> {
        let cfg = &self.cfg;
        let bad = |why: String| Err(UError::invalid(format!("arch-diffusion: UNet: {why}")));
        if self.conv_in.in_channels() != cfg.in_channels
            || self.conv_out.out_channels() != cfg.out_channels
        {
            return bad(format!(
                "conv_in/conv_out do not map {} to {} channels",
                cfg.in_channels, cfg.out_channels
            ));
        }
        let mut skips = vec![self.conv_in.out_channels()];
        let mut c = skips[0];
        for (i, block) in self.down.iter().enumerate() {
            for r in &block.resnets {
                if r.in_channels() != c {
                    return bad(format!("down block {i} gets {c} channels"));
                }
                c = r.out_channels();
                skips.push(c);
            }
            if block.downsample.is_some() {
                skips.push(c);
            }
        }
        for (i, block) in self.up.iter().enumerate() {
            for r in &block.resnets {
                let skip = skips.pop().unwrap_or_default();
                if r.in_channels() != c + skip {
                    return bad(format!(
                        "up block {i} gets {c} + {skip} channels, its resnet reads {}",
                        r.in_channels()
                    ));
                }
                c = r.out_channels();
            }
        }
        if !skips.is_empty() || self.norm_out.channels() != c {
            return bad("the up blocks do not consume the down blocks' outputs".into());
        }
        let transformers = self.transformers();
        for t in transformers {
            if t.context_width() != cfg.cross_attention_dim {
                return bad(format!(
                    "a cross-attention reads rows of {}, not cross_attention_dim {}",
                    t.context_width(),
                    cfg.cross_attention_dim
                ));
            }
        }
        Ok(())
    }

    /// Its configuration.
    pub fn config(&self) -> &UnetConfig {
        &self.cfg
    }

    /// The transformers in the order the forward pass meets them.
    fn transformers(&self) -> impl Iterator<Item = &Transformer2D> {
        self.down
            .iter()
            .flat_map(|b| &b.attentions)
            .chain(self.mid.pairs.iter().map(|(t, _)| t))
            .chain(self.up.iter().flat_map(|b| &b.attentions))
    }

    /// The keys and values of `context` `[rows, cross_attention_dim]` for every
    /// cross-attention.
    pub fn cross_keys_values(&self, context: &Tensor) -> Result<CrossKeysValues> {
        Ok(CrossKeysValues(
            self.transformers()
                .map(|t| t.cross_keys_values(context))
                .collect::<Result<_>>()?,
        ))
    }

    /// The prediction for noisy latents `x` `[in_channels, h, w]` at timestep `t`,
    /// conditioned on a context through its keys and values `cross`.
    pub fn forward(&self, x: &Tensor, t: f32, cross: &CrossKeysValues) -> Result<Tensor> {
        let mut cross = cross.0.iter();
        let mut context = || {
            cross.next().map(Vec::as_slice).ok_or_else(|| {
                UError::invalid(
                    "arch-diffusion: UNet: fewer cross keys and values than transformers",
                )
            })
        };
        let temb = self.time.forward(t, x.device())?;
        temb.activation_assign(Activation::Silu)?;
        let temb = Some(&temb);
        let x = match self.cfg.center_input {
            true => {
                let row = x.row_len();
                let centred = x.scale(2.0)?;
                centred.add_assign(&x.device().from_f32(&vec![-1.0; row], &[row as u64])?)?;
                centred
            }
            false => x.clone(),
        };
        let mut h = self.conv_in.forward(&x)?;
        let mut skips = vec![h.clone()];
        for block in &self.down {
            for (j, r) in block.resnets.iter().enumerate() {
                h = r.forward(&h, temb)?;
                if let Some(t) = block.attentions.get(j) {
                    h = t.forward(&h, context()?)?;
                }
                skips.push(h.clone());
            }
            if let Some(d) = &block.downsample {
                h = d.forward(&h)?;
                skips.push(h.clone());
            }
        }
        h = self.mid.first.forward(&h, temb)?;
        for (t, r) in &self.mid.pairs {
            h = r.forward(&t.forward(&h, context()?)?, temb)?;
        }
        for block in &self.up {
            for (j, r) in block.resnets.iter().enumerate() {
                let skip = skips
                    .pop()
                    .ok_or_else(|| UError::invalid("arch-diffusion: UNet: skips run out"))?;
                h = r.forward(&Tensor::concat(&[&h, &skip])?, temb)?;
                if let Some(t) = block.attentions.get(j) {
                    h = t.forward(&h, context()?)?;
                }
            }
            if let Some(u) = &block.upsample {
                h = u.forward(&h)?;
            }
        }
        let h = self.norm_out.forward(&h)?;
        h.activation_assign(Activation::Silu)?;
        self.conv_out.forward(&h)
    }
}
