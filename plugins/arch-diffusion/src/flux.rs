//! `FluxTransformer2DModel` (Black Forest Labs' FLUX.1): double-stream blocks (text and image
//! rows with their own weights, one attention over both, text first) followed by
//! single-stream blocks over the joined rows, with a rotary position embedding over three axes
//! (the pipelines' ids: 0, row, column for each 2×2 patch of the latent; zeros for text).
//!
//! ```text
//! x = x_embedder(pack(z))          c = context_embedder(context)
//! temb = timestep_embedder(sinusoid(1000 t)) [+ guidance_embedder(sinusoid(1000 g))] + text_embedder(pooled)
//! double block: as SD3's joint block (adaLN-Zero on both streams), RoPE on [q_c; q_x], [k_c; k_x]
//! single block: h = [c; x];  (shift, scale, gate) = linear(silu(temb));  n = LN(h) ⊙ (1 + scale) + shift
//!               h = h + gate ⊙ proj_out([attention(n) (RoPE, no output projection); gelu(proj_mlp(n))])
//! ε = unpack(proj_out(LN(x) ⊙ (1 + scale) + shift)),  (scale, shift) = norm_out(silu(temb))
//! ```
//!
//! The model takes and gives feature maps: it packs the latent's 2×2 patches into rows (and
//! back) as the FLUX pipelines do around it.

use crate::{
    config::FluxConfig,
    layers::{Linear, ModulatedNorm, Weights},
    mmdit::{JointBlock, JointShape, Stream, TwoLayer, attention},
    unet::timestep_embedding,
};
use u_sdk::{
    Activation, Result, UError,
    nn::{Device, Tensor},
};

/// LayerNorm epsilon of every modulated norm (fixed).
const EPS: f32 = 1e-6;

/// Width of the sinusoidal timestep embedding (fixed).
const TIMESTEP_CHANNELS: usize = 256;

/// RoPE base of FLUX's position embedding.
const THETA: f64 = 10_000.0;

/// Rotary position embedding over several axes: each row has one position per axis, each axis
/// its slice of a head's dimensions, and pairs `(2i, 2i + 1)` turn by `position · θ^(−2i/d)`
/// (diffusers' `FluxPosEmbed` and `apply_rotary_emb`, angles in f64).
pub struct AxesRope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    head_dim: usize,
}

impl AxesRope {
    /// The rotation of rows at positions `ids` (one per axis) over axes of `axes` dimensions.
    pub fn new(ids: &[Vec<f32>], axes: &[usize]) -> AxesRope {
        let head_dim: usize = axes.iter().sum();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for row in ids {
            for (&d, &pos) in axes.iter().zip(row) {
                for i in (0..d).step_by(2) {
                    let freq = 1.0 / THETA.powf(i as f64 / d as f64);
                    let angle = f64::from(pos) * freq;
                    let (c, s) = (angle.cos() as f32, angle.sin() as f32);
                    cos.extend([c, c]);
                    sin.extend([s, s]);
                }
            }
        }
        AxesRope { cos, sin, head_dim }
    }

    /// `x` `[rows, heads · head_dim]` rotated.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (rows, width) = (x.rows(), x.row_len());
        if rows * self.head_dim != self.cos.len() || !width.is_multiple_of(self.head_dim) {
            return Err(UError::invalid(format!(
                "arch-diffusion: rotating {rows} rows of {width} with positions for {} rows",
                self.cos.len() / self.head_dim.max(1)
            )));
        }
        let mut v = x.to_vec()?;
        for (r, row) in v.chunks_exact_mut(width).enumerate() {
            let (cos, sin) = (
                &self.cos[r * self.head_dim..][..self.head_dim],
                &self.sin[r * self.head_dim..][..self.head_dim],
            );
            for head in row.chunks_exact_mut(self.head_dim) {
                for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * cos[2 * i] + -b * sin[2 * i];
                    pair[1] = b * cos[2 * i + 1] + a * sin[2 * i + 1];
                }
            }
        }
        x.device().from_f32(&v, x.dims())
    }
}

/// A single-stream block over the joined text and image rows.
struct SingleBlock {
    modulation: Linear,
    norm: ModulatedNorm,
    qkv: Stream,
    proj_mlp: Linear,
    /// `proj_out`'s columns over the attention's output (with its bias) …
    out_attention: Linear,
    /// … and over the MLP's.
    out_mlp: Linear,
    heads: usize,
    head_dim: usize,
}

impl SingleBlock {
    fn load(w: &Weights<'_>, cfg: &FluxConfig, i: usize) -> Result<SingleBlock> {
        let p = format!("single_transformer_blocks.{i}");
        let width = cfg.width();
        let (out_attention, out_mlp) =
            Linear::load_column_split(w, &format!("{p}.proj_out"), width)?;
        let block = SingleBlock {
            modulation: Linear::load(w, &format!("{p}.norm.linear"))?,
            norm: ModulatedNorm::new(w.device(), width, EPS)?,
            qkv: Stream::load(
                w,
                &format!("{p}.attn"),
                ["to_q", "to_k", "to_v", "norm_q", "norm_k"],
                cfg.head_dim,
            )?,
            proj_mlp: Linear::load(w, &format!("{p}.proj_mlp"))?,
            out_attention,
            out_mlp,
            heads: cfg.heads,
            head_dim: cfg.head_dim,
        };
        if block.modulation.out_features() != 3 * width
            || block.out_mlp.in_features() != block.proj_mlp.out_features()
        {
            return Err(UError::invalid(format!(
                "arch-diffusion: {p}: the modulation and MLP do not fit a width of {width}"
            )));
        }
        Ok(block)
    }

    fn forward(&self, h: &Tensor, temb: &Tensor, rope: &AxesRope) -> Result<Tensor> {
        let m = self
            .modulation
            .forward(temb)?
            .reshape(&[3, h.row_len() as u64])?;
        let row = |i: usize| m.rows_range(i..i + 1);
        let n = self.norm.forward(h, &row(0)?, &row(1)?)?;
        let mlp = self
            .proj_mlp
            .forward(&n)?
            .activation(Activation::GeluTanh)?;
        let [q, k, v] = self.qkv.project(&n)?;
        let a = attention(
            [&rope.apply(&q)?, &rope.apply(&k)?, &v],
            self.heads,
            self.head_dim,
        )?;
        let out = self.out_attention.forward(&a)?;
        out.add_assign(&self.out_mlp.forward(&mlp)?)?;
        out.mul(&row(2)?)?.add(h)
    }
}

/// The whole FLUX transformer.
pub struct Flux {
    cfg: FluxConfig,
    x_embedder: Linear,
    timestep: TwoLayer,
    guidance: Option<TwoLayer>,
    pooled: TwoLayer,
    context_embedder: Linear,
    double: Vec<JointBlock>,
    single: Vec<SingleBlock>,
    norm_out: Linear,
    final_norm: ModulatedNorm,
    proj_out: Linear,
}

/// Rows of the 2×2 patches of `z` `[c, h, w]`, each `(c, p, q)` (the FLUX pipelines' packing).
fn pack(z: &[f32], (c, h, w): (usize, usize, usize)) -> Vec<f32> {
    let mut out = Vec::with_capacity(z.len());
    for i in 0..h / 2 {
        for j in 0..w / 2 {
            for ch in 0..c {
                for (pi, qi) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                    out.push(z[(ch * h + 2 * i + pi) * w + 2 * j + qi]);
                }
            }
        }
    }
    out
}

/// The map `[c, h, w]` of packed rows (the inverse of [`pack`]).
fn unpack(rows: &[f32], (c, h, w): (usize, usize, usize)) -> Vec<f32> {
    let mut out = vec![0f32; c * h * w];
    for (n, row) in rows.chunks_exact(4 * c).enumerate() {
        let (i, j) = (n / (w / 2), n % (w / 2));
        for (e, &v) in row.iter().enumerate() {
            let (ch, pi, qi) = (e / 4, e / 2 % 2, e % 2);
            out[(ch * h + 2 * i + pi) * w + 2 * j + qi] = v;
        }
    }
    out
}

impl Flux {
    /// Reads the `FluxTransformer2DModel` in `w`.
    pub fn load(w: &Weights<'_>, cfg: &FluxConfig) -> Result<Flux> {
        let width = cfg.width();
        let shape = JointShape {
            heads: cfg.heads,
            head_dim: cfg.head_dim,
            text_free: false,
            text_first: true,
        };
        let model = Flux {
            cfg: cfg.clone(),
            x_embedder: Linear::load(w, "x_embedder")?,
            timestep: TwoLayer::load(w, "time_text_embed.timestep_embedder")?,
            guidance: match cfg.guidance {
                true => Some(TwoLayer::load(w, "time_text_embed.guidance_embedder")?),
                false => None,
            },
            pooled: TwoLayer::load(w, "time_text_embed.text_embedder")?,
            context_embedder: Linear::load(w, "context_embedder")?,
            double: (0..cfg.layers)
                .map(|i| JointBlock::load(w, &format!("transformer_blocks.{i}"), &shape))
                .collect::<Result<_>>()?,
            single: (0..cfg.single_layers)
                .map(|i| SingleBlock::load(w, cfg, i))
                .collect::<Result<_>>()?,
            norm_out: Linear::load(w, "norm_out.linear")?,
            final_norm: ModulatedNorm::new(w.device(), width, EPS)?,
            proj_out: Linear::load(w, "proj_out")?,
        };
        let fits = model.x_embedder.in_features() == cfg.in_channels
            && model.x_embedder.out_features() == width
            && model.context_embedder.in_features() == cfg.context_width
            && model.pooled.in_features() == cfg.pooled_width
            && model.norm_out.out_features() == 2 * width
            && model.proj_out.out_features() == cfg.out_channels;
        if !fits {
            return Err(UError::invalid(format!(
                "arch-diffusion: FLUX: the embedders and projections do not fit a width of {width}"
            )));
        }
        Ok(model)
    }

    /// Its configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.cfg
    }

    /// The sinusoid of `1000 · v` through `embedder`.
    fn embed(embedder: &TwoLayer, v: f32, device: &Device) -> Result<Tensor> {
        let e = timestep_embedding(v * 1000.0, TIMESTEP_CHANNELS, true, 0.0);
        embedder.forward(&device.from_f32(&e, &[1, TIMESTEP_CHANNELS as u64])?)
    }

    /// The prediction for latents `z` `[in_channels / 4, h, w]` at timestep `t` (and guidance
    /// `g` for a guidance-distilled model), conditioned on the pooled text `pooled` and the text
    /// rows `context` `[rows, context_width]`.
    pub fn forward(
        &self,
        z: &Tensor,
        (t, g): (f32, f32),
        pooled: &[f32],
        context: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let device = z.device();
        let (c, h, w) = match z.dims() {
            &[c, h, w] => (c as usize, h as usize, w as usize),
            d => return Err(UError::invalid(format!("arch-diffusion: FLUX input {d:?}"))),
        };
        let packed = pack(&z.to_vec()?, (c, h, w));
        let n = (h / 2) * (w / 2);
        let x = self
            .x_embedder
            .forward(&device.from_f32(&packed, &[n as u64, 4 * c as u64])?)?;
        let mut temb = Self::embed(&self.timestep, t, device)?;
        if let Some(guidance) = &self.guidance {
            temb = temb.add(&Self::embed(guidance, g, device)?)?;
        }
        let temb = temb.add(
            &self
                .pooled
                .forward(&device.from_f32(pooled, &[1, pooled.len() as u64])?)?,
        )?;
        temb.activation_assign(Activation::Silu)?;
        let text = self.context_embedder.forward(context)?;
        let m = text.rows();
        // Text rows at the origin, patch (i, j) at (0, i, j).
        let mut ids = vec![vec![0f32; 3]; m];
        ids.extend((0..n).map(|p| vec![0.0, (p / (w / 2)) as f32, (p % (w / 2)) as f32]));
        let rope = AxesRope::new(&ids, &cfg.axes);
        let (mut x, mut text) = (x, text);
        for block in &self.double {
            let (nx, nc) = block.forward(&x, &text, &temb, Some(&rope))?;
            x = nx;
            text = nc.ok_or_else(|| UError::invalid("arch-diffusion: FLUX: a text-free block"))?;
        }
        let mut joined = Tensor::concat(&[&text, &x])?;
        for block in &self.single {
            joined = block.forward(&joined, &temb, &rope)?;
        }
        let x = joined.rows_range(m..m + n)?;
        let mo = self
            .norm_out
            .forward(&temb)?
            .reshape(&[2, cfg.width() as u64])?;
        let x = self
            .final_norm
            .forward(&x, &mo.rows_range(1..2)?, &mo.rows_range(0..1)?)?;
        let rows = self.proj_out.forward(&x)?.to_vec()?;
        let out_c = cfg.out_channels / 4;
        let out = unpack(&rows, (out_c, h, w));
        device.from_f32(&out, &[out_c as u64, h as u64, w as u64])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_is_undone_by_unpacking() {
        let z: Vec<f32> = (0..3 * 4 * 6).map(|v| v as f32).collect();
        let rows = pack(&z, (3, 4, 6));
        // Patch (0, 0), channel 0: pixels (0,0), (0,1), (1,0), (1,1).
        assert_eq!(&rows[..4], &[0.0, 1.0, 6.0, 7.0]);
        assert_eq!(unpack(&rows, (3, 4, 6)), z);
    }
}
