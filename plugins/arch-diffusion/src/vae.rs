//! `AutoencoderKL` (Rombach et al. 2022, *High-Resolution Image Synthesis with Latent
//! Diffusion Models*, arXiv:2112.10752): the encoder maps an image to the mean and log variance
//! of its latent, the decoder maps a latent back to pixels.
//!
//! ```text
//! encoder:  x → conv_in → [resnets, downsample]… → mid → silu(norm_out) → conv_out → quant_conv
//! decoder:  z → post_quant_conv → conv_in → mid → [resnets, upsample]… → silu(norm_out) → conv_out
//! mid:      resnet → self-attention → resnet
//! ```

use crate::{
    blocks::{Downsample2D, ResnetBlock2D, SpatialAttention, Upsample2D},
    config::VaeConfig,
    layers::{Conv2d, GroupNorm, Weights},
};
use u_sdk::{Activation, Result, UError, nn::Tensor};

/// GroupNorm epsilon throughout the autoencoder (fixed in diffusers).
const EPS: f32 = 1e-6;

/// `UNetMidBlock2D` of the autoencoder: resnet, self-attention, resnet.
pub struct MidBlock {
    first: ResnetBlock2D,
    attention: Option<SpatialAttention>,
    second: ResnetBlock2D,
}

impl MidBlock {
    fn load(w: &Weights<'_>, prefix: &str, cfg: &VaeConfig) -> Result<MidBlock> {
        let norm = (cfg.norm_groups, EPS);
        let channels = *cfg.block_out_channels.last().unwrap_or(&1);
        Ok(MidBlock {
            first: ResnetBlock2D::load(w, &format!("{prefix}.resnets.0"), norm, 1.0)?,
            attention: match cfg.mid_attention {
                true => Some(SpatialAttention::load(
                    w,
                    &format!("{prefix}.attentions.0"),
                    norm,
                    channels,
                )?),
                false => None,
            },
            second: ResnetBlock2D::load(w, &format!("{prefix}.resnets.1"), norm, 1.0)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.first.forward(x, None)?;
        if let Some(a) = &self.attention {
            h = a.forward(&h)?;
        }
        self.second.forward(&h, None)
    }
}

/// One resolution of the encoder or decoder: its resnets, then a resampler (all but the
/// last).
struct Stage<S> {
    resnets: Vec<ResnetBlock2D>,
    resample: Option<S>,
}

/// The output head both halves end with: `conv_out(silu(norm_out(x)))`.
struct Head {
    norm: GroupNorm,
    conv: Conv2d,
}

impl Head {
    fn load(w: &Weights<'_>, prefix: &str, groups: usize) -> Result<Head> {
        Ok(Head {
            norm: GroupNorm::load(w, &format!("{prefix}.conv_norm_out"), groups, EPS)?,
            conv: Conv2d::load(w, &format!("{prefix}.conv_out"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.norm.forward(x)?;
        h.activation_assign(Activation::Silu)?;
        self.conv.forward(&h)
    }
}

fn resnets(w: &Weights<'_>, prefix: &str, n: usize, groups: usize) -> Result<Vec<ResnetBlock2D>> {
    (0..n)
        .map(|j| ResnetBlock2D::load(w, &format!("{prefix}.resnets.{j}"), (groups, EPS), 1.0))
        .collect()
}

/// The encoder half with `quant_conv`: an image `[in_channels, H, W]` to the moments of its
/// latent, `[2·latent_channels, H/s, W/s]` (mean, then log variance).
pub struct VaeEncoder {
    cfg: VaeConfig,
    conv_in: Conv2d,
    stages: Vec<Stage<Downsample2D>>,
    mid: MidBlock,
    head: Head,
    quant_conv: Option<Conv2d>,
}

impl VaeEncoder {
    /// Reads the encoder of the `AutoencoderKL` in `w`.
    pub fn load(w: &Weights<'_>, cfg: &VaeConfig) -> Result<VaeEncoder> {
        let n = cfg.block_out_channels.len();
        let stages = (0..n)
            .map(|i| {
                let prefix = format!("encoder.down_blocks.{i}");
                Ok(Stage {
                    resnets: resnets(w, &prefix, cfg.layers_per_block, cfg.norm_groups)?,
                    resample: match i + 1 < n {
                        true => Some(Downsample2D::load(
                            w,
                            &format!("{prefix}.downsamplers.0"),
                            [0, 1],
                        )?),
                        false => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let encoder = VaeEncoder {
            cfg: cfg.clone(),
            conv_in: Conv2d::load(w, "encoder.conv_in")?,
            stages,
            mid: MidBlock::load(w, "encoder.mid_block", cfg)?,
            head: Head::load(w, "encoder", cfg.norm_groups)?,
            quant_conv: match cfg.quant_conv {
                true => Some(Conv2d::load(w, "quant_conv")?),
                false => None,
            },
        };
        let moments = 2 * cfg.latent_channels;
        if encoder.conv_in.in_channels() != cfg.in_channels
            || encoder.head.conv.out_channels() != moments
        {
            return Err(UError::invalid(format!(
                "arch-diffusion: the encoder does not map {} channels to {moments} moments",
                cfg.in_channels
            )));
        }
        Ok(encoder)
    }

    /// Its configuration.
    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// The moments of the latent of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.conv_in.forward(x)?;
        for stage in &self.stages {
            for r in &stage.resnets {
                h = r.forward(&h, None)?;
            }
            if let Some(d) = &stage.resample {
                h = d.forward(&h)?;
            }
        }
        let h = self.head.forward(&self.mid.forward(&h)?)?;
        match &self.quant_conv {
            Some(q) => q.forward(&h),
            None => Ok(h),
        }
    }
}

/// `post_quant_conv` and the decoder half: a latent `[latent_channels, h, w]` to an image
/// `[out_channels, h·s, w·s]` (values around [−1, 1]).
pub struct VaeDecoder {
    cfg: VaeConfig,
    post_quant_conv: Option<Conv2d>,
    conv_in: Conv2d,
    mid: MidBlock,
    stages: Vec<Stage<Upsample2D>>,
    head: Head,
}

impl VaeDecoder {
    /// Reads the decoder of the `AutoencoderKL` in `w`.
    pub fn load(w: &Weights<'_>, cfg: &VaeConfig) -> Result<VaeDecoder> {
        let n = cfg.block_out_channels.len();
        let stages = (0..n)
            .map(|i| {
                let prefix = format!("decoder.up_blocks.{i}");
                Ok(Stage {
                    resnets: resnets(w, &prefix, cfg.layers_per_block + 1, cfg.norm_groups)?,
                    resample: match i + 1 < n {
                        true => Some(Upsample2D::load(w, &format!("{prefix}.upsamplers.0"))?),
                        false => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let decoder = VaeDecoder {
            cfg: cfg.clone(),
            post_quant_conv: match cfg.post_quant_conv {
                true => Some(Conv2d::load(w, "post_quant_conv")?),
                false => None,
            },
            conv_in: Conv2d::load(w, "decoder.conv_in")?,
            mid: MidBlock::load(w, "decoder.mid_block", cfg)?,
            stages,
            head: Head::load(w, "decoder", cfg.norm_groups)?,
        };
        if decoder.conv_in.in_channels() != cfg.latent_channels
            || decoder.head.conv.out_channels() != cfg.out_channels
        {
            return Err(UError::invalid(format!(
                "arch-diffusion: the decoder does not map {} latent channels to {}",
                cfg.latent_channels, cfg.out_channels
            )));
        }
        Ok(decoder)
    }

    /// Its configuration.
    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// The image decoded from latent `z`.
    pub fn forward(&self, z: &Tensor) -> Result<Tensor> {
        let z = match &self.post_quant_conv {
            Some(p) => p.forward(z)?,
            None => z.clone(),
        };
        let mut h = self.mid.forward(&self.conv_in.forward(&z)?)?;
        for stage in &self.stages {
            for r in &stage.resnets {
                h = r.forward(&h, None)?;
            }
            if let Some(u) = &stage.resample {
                h = u.forward(&h)?;
            }
        }
        self.head.forward(&h)
    }
}
