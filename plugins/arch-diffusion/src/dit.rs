//! `DiTTransformer2DModel` (Peebles & Xie 2023, *Scalable Diffusion Models with Transformers*,
//! arXiv:2212.09748): a class-conditioned transformer over patches of the latent, with
//! adaLN-Zero modulation.
//!
//! ```text
//! x = patchify(z) + pos(h, w)                       # p×p convolution of stride p; 2-D sin-cos
//! c = timestep_embedder(sinusoid(t)) + class_table[y]      # each block has its own embedders
//! block:  (shift₁, scale₁, gate₁, shift₂, scale₂, gate₂) = linear(silu(c))
//!         x = x + gate₁ ⊙ attention(LN(x) ⊙ (1 + scale₁) + shift₁)
//!         x = x + gate₂ ⊙ mlp(LN(x) ⊙ (1 + scale₂) + shift₂)      # GELU (tanh) MLP
//! out:    (shift, scale) = proj_out_1(silu(c of block 0))
//!         ε = unpatchify(proj_out_2(LN(x) ⊙ (1 + scale) + shift))
//! ```
//!
//! The layer norms have no scale or shift of their own (the modulation is theirs).

use crate::{
    blocks::Attention,
    config::DitConfig,
    layers::{Conv2d, Linear, ModulatedNorm, Weights, to_rows},
    unet::timestep_embedding,
};
use u_sdk::{
    Activation, Result, UError,
    nn::{Device, Tensor},
};

/// Width of the sinusoidal timestep embedding (fixed in diffusers' DiT).
const TIMESTEP_CHANNELS: usize = 256;

/// LayerNorm epsilon of the modulated norms before attention and at the output (fixed).
const MODULATED_EPS: f32 = 1e-6;

/// The 2-D sin-cos position embedding of a `grid_h × grid_w` grid of patches, `[positions,
/// dim]`, as diffusers' `get_2d_sincos_pos_embed` makes it (in f64, then f32): grid
/// coordinates scaled by `base / grid` (so another size interpolates the trained one), the
/// first half of each row encoding the column and the second the row.
pub fn position_embedding(dim: usize, (grid_h, grid_w): (usize, usize), base: usize) -> Vec<f32> {
    let quarter = dim / 4;
    let omega: Vec<f64> = (0..quarter)
        .map(|i| 1.0 / 10_000f64.powf(i as f64 / (dim as f64 / 4.0)))
        .collect();
    // Coordinates as diffusers computes them: f32 `arange / (grid / base)`.
    let coord = |i: usize, grid: usize| f64::from(i as f32 / (grid as f32 / base as f32));
    let mut out = Vec::with_capacity(grid_h * grid_w * dim);
    for i in 0..grid_h {
        for j in 0..grid_w {
            for pos in [coord(j, grid_w), coord(i, grid_h)] {
                out.extend(omega.iter().map(|w| (pos * w).sin() as f32));
                out.extend(omega.iter().map(|w| (pos * w).cos() as f32));
            }
        }
    }
    out
}

/// `CombinedTimestepLabelEmbeddings`: the timestep's embedding plus the class's.
struct Conditioning {
    linear_1: Linear,
    linear_2: Linear,
    classes: Tensor,
}

impl Conditioning {
    fn load(w: &Weights<'_>, prefix: &str) -> Result<Conditioning> {
        Ok(Conditioning {
            linear_1: Linear::load(w, &format!("{prefix}.timestep_embedder.linear_1"))?,
            linear_2: Linear::load(w, &format!("{prefix}.timestep_embedder.linear_2"))?,
            classes: w.tensor(&format!("{prefix}.class_embedder.embedding_table.weight"))?,
        })
    }

    /// `c` for timestep `t` and class `label`, `[1, dim]`.
    fn forward(&self, t: f32, label: usize, device: &Device) -> Result<Tensor> {
        let e = timestep_embedding(t, TIMESTEP_CHANNELS, true, 1.0);
        let h = self
            .linear_1
            .forward(&device.from_f32(&e, &[1, TIMESTEP_CHANNELS as u64])?)?;
        h.activation_assign(Activation::Silu)?;
        let c = self.linear_2.forward(&h)?;
        let class = self
            .classes
            .get_rows(&device.from_i32(&[label as i32], &[1])?)?;
        c.add(&class)
    }
}

/// One DiT block: adaLN-Zero modulated self-attention and MLP.
struct DitBlock {
    conditioning: Conditioning,
    modulation: Linear,
    norm: ModulatedNorm,
    attention: Attention,
    mlp_norm: ModulatedNorm,
    mlp_in: Linear,
    mlp_out: Linear,
}

impl DitBlock {
    fn load(w: &Weights<'_>, cfg: &DitConfig, i: usize) -> Result<DitBlock> {
        let p = format!("transformer_blocks.{i}");
        let width = cfg.width();
        let norm = |eps| ModulatedNorm::new(w.device(), width, eps);
        let block = DitBlock {
            conditioning: Conditioning::load(w, &format!("{p}.norm1.emb"))?,
            modulation: Linear::load(w, &format!("{p}.norm1.linear"))?,
            norm: norm(MODULATED_EPS)?,
            attention: Attention::load(w, &format!("{p}.attn1"), cfg.heads)?,
            mlp_norm: norm(cfg.norm_eps)?,
            mlp_in: Linear::load(w, &format!("{p}.ff.net.0.proj"))?,
            mlp_out: Linear::load(w, &format!("{p}.ff.net.2"))?,
        };
        if block.modulation.out_features() != 6 * width || block.mlp_out.out_features() != width {
            return Err(UError::invalid(format!(
                "arch-diffusion: {p}: the modulation and MLP do not fit a width of {width}"
            )));
        }
        Ok(block)
    }

    fn forward(&self, x: &Tensor, t: f32, label: usize) -> Result<Tensor> {
        let c = self.conditioning.forward(t, label, x.device())?;
        c.activation_assign(Activation::Silu)?;
        let width = x.row_len() as u64;
        let m = self.modulation.forward(&c)?.reshape(&[6, width])?;
        let part = |i: usize| m.rows_range(i..i + 1);
        let h = self.norm.forward(x, &part(0)?, &part(1)?)?;
        let x = self.attention.forward(&h)?.mul(&part(2)?)?.add(x)?;
        let h = self.mlp_norm.forward(&x, &part(3)?, &part(4)?)?;
        let h = self.mlp_in.forward(&h)?.activation(Activation::GeluTanh)?;
        self.mlp_out.forward(&h)?.mul(&part(5)?)?.add(&x)
    }
}

/// The whole DiT.
pub struct Dit {
    cfg: DitConfig,
    patchify: Conv2d,
    blocks: Vec<DitBlock>,
    norm_out: ModulatedNorm,
    proj_out_1: Linear,
    proj_out_2: Linear,
}

impl Dit {
    /// Reads the `DiTTransformer2DModel` in `w`.
    pub fn load(w: &Weights<'_>, cfg: &DitConfig) -> Result<Dit> {
        let width = cfg.width();
        let dit = Dit {
            cfg: cfg.clone(),
            patchify: Conv2d::patches(w, "pos_embed.proj", cfg.patch)?,
            blocks: (0..cfg.layers)
                .map(|i| DitBlock::load(w, cfg, i))
                .collect::<Result<_>>()?,
            norm_out: ModulatedNorm::new(w.device(), width, MODULATED_EPS)?,
            proj_out_1: Linear::load(w, "proj_out_1")?,
            proj_out_2: Linear::load(w, "proj_out_2")?,
        };
        let p2 = cfg.patch * cfg.patch;
        if dit.patchify.in_channels() != cfg.in_channels
            || dit.patchify.out_channels() != width
            || dit.proj_out_1.out_features() != 2 * width
            || dit.proj_out_2.out_features() != p2 * cfg.out_channels
        {
            return Err(UError::invalid(format!(
                "arch-diffusion: DiT: the patch embedding and output projections do not fit {} \
                 → {} channels of width {width}",
                cfg.in_channels, cfg.out_channels
            )));
        }
        Ok(dit)
    }

    /// Its configuration.
    pub fn config(&self) -> &DitConfig {
        &self.cfg
    }

    /// The prediction for noisy latents `z` `[in_channels, h, w]` at timestep `t` for class
    /// `label` (`classes`: the null class of classifier-free guidance).
    pub fn forward(&self, z: &Tensor, t: f32, label: usize) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (h, w) = match z.dims() {
            &[_, h, w] => (h as usize, w as usize),
            d => return Err(UError::invalid(format!("arch-diffusion: DiT input {d:?}"))),
        };
        let grid = (h / cfg.patch, w / cfg.patch);
        let device = z.device();
        let width = cfg.width();
        let x = to_rows(&self.patchify.forward(z)?)?;
        let base = cfg.sample_size / cfg.patch;
        let pos = position_embedding(width, grid, base);
        x.add_assign(&device.from_f32(&pos, &[(grid.0 * grid.1) as u64, width as u64])?)?;
        let mut x = x;
        for block in &self.blocks {
            x = block.forward(&x, t, label)?;
        }
        let first = self
            .blocks
            .first()
            .ok_or_else(|| UError::invalid("arch-diffusion: DiT without blocks"))?;
        let c = first.conditioning.forward(t, label, device)?;
        c.activation_assign(Activation::Silu)?;
        let m = self.proj_out_1.forward(&c)?.reshape(&[2, width as u64])?;
        let x = self
            .norm_out
            .forward(&x, &m.rows_range(0..1)?, &m.rows_range(1..2)?)?;
        let patches = self.proj_out_2.forward(&x)?.to_vec()?;
        let c = cfg.out_channels;
        let out = unpatchify(&patches, (h, w), cfg.patch, c);
        device.from_f32(&out, &[c as u64, h as u64, w as u64])
    }
}

/// A map `[channels, h, w]` from its patches' rows (row-major over the `h/p × w/p` grid), each
/// `[p, p, channels]`: patch (i, j)'s value (p′, q′, c) goes to pixel (i·p + p′, j·p + q′).
pub fn unpatchify(patches: &[f32], (h, w): (usize, usize), p: usize, channels: usize) -> Vec<f32> {
    let grid_w = w / p;
    let mut out = vec![0f32; channels * h * w];
    for (n, patch) in patches.chunks_exact(p * p * channels).enumerate() {
        let (i, j) = (n / grid_w, n % grid_w);
        for (e, &v) in patch.iter().enumerate() {
            let (pi, qi, ch) = (e / (p * channels), e / channels % p, e % channels);
            out[(ch * h + i * p + pi) * w + j * p + qi] = v;
        }
    }
    out
}
