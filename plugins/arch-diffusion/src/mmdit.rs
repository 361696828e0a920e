//! `SD3Transformer2DModel` (Esser et al. 2024, *Scaling Rectified Flow Transformers for
//! High-Resolution Image Synthesis*, arXiv:2403.03206): the multimodal diffusion transformer
//! (MMDiT) of Stable Diffusion 3. Image patches and text rows keep separate weights but attend
//! jointly; both streams are modulated by the timestep and the pooled text (adaLN-Zero).
//!
//! ```text
//! x = patchify(z) + pos (cropped from the trained grid)     c = context_embedder(context)
//! temb = timestep_embedder(sinusoid(t)) + text_embedder(pooled)
//! joint block:  x̂ = adaLN-Zero(x, temb), ĉ = adaLN-Zero(c, temb)   (the last: ĉ = adaLN(c, temb))
//!               [a_x; a_c] = attention([q_x; q_c], [k_x; k_c], [v_x; v_c])   # RMS q/k norms
//!               x = x + g₁ ⊙ out(a_x);  x = x + g₂ ⊙ mlp(LN(x) ⊙ (1 + s₂) + b₂)
//!               c likewise with its own weights (not in the last block)
//! ε = unpatchify(proj_out(LN(x) ⊙ (1 + scale) + shift)),  (scale, shift) = norm_out(silu(temb))
//! ```

use crate::{
    config::Sd3Config,
    dit::{position_embedding, unpatchify},
    flux::AxesRope,
    layers::{Conv2d, Linear, ModulatedNorm, Weights, to_rows},
    unet::timestep_embedding,
};
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, Result, UError,
    nn::{Device, Tensor},
};

/// LayerNorm epsilon of every modulated norm (fixed in diffusers).
const EPS: f32 = 1e-6;

/// Width of the sinusoidal timestep embedding (fixed).
const TIMESTEP_CHANNELS: usize = 256;

/// `linear_2(silu(linear_1(x)))`: the timestep and pooled-text embedders.
pub(crate) struct TwoLayer {
    linear_1: Linear,
    linear_2: Linear,
}

impl TwoLayer {
    pub(crate) fn load(w: &Weights<'_>, prefix: &str) -> Result<TwoLayer> {
        Ok(TwoLayer {
            linear_1: Linear::load(w, &format!("{prefix}.linear_1"))?,
            linear_2: Linear::load(w, &format!("{prefix}.linear_2"))?,
        })
    }

    /// Width of its input.
    pub(crate) fn in_features(&self) -> usize {
        self.linear_1.in_features()
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.linear_1.forward(x)?;
        h.activation_assign(Activation::Silu)?;
        self.linear_2.forward(&h)
    }
}

/// The feed-forward network: GELU (tanh) between two linear layers.
pub(crate) struct Mlp {
    up: Linear,
    down: Linear,
}

impl Mlp {
    pub(crate) fn load(w: &Weights<'_>, prefix: &str) -> Result<Mlp> {
        Ok(Mlp {
            up: Linear::load(w, &format!("{prefix}.net.0.proj"))?,
            down: Linear::load(w, &format!("{prefix}.net.2"))?,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down
            .forward(&self.up.forward(x)?.activation(Activation::GeluTanh)?)
    }
}

/// The RMS norm of each head's part of a row (SD 3.5's q/k norms).
struct HeadNorm {
    weight: Tensor,
    head_dim: usize,
}

impl HeadNorm {
    fn load(w: &Weights<'_>, name: &str, head_dim: usize) -> Result<Option<HeadNorm>> {
        let name = format!("{name}.weight");
        match w.has(&name) {
            true => Ok(Some(HeadNorm {
                weight: w.vector(&name, Some(head_dim))?,
                head_dim,
            })),
            false => Ok(None),
        }
    }

    fn apply(norm: &Option<HeadNorm>, x: Tensor) -> Result<Tensor> {
        let Some(n) = norm else { return Ok(x) };
        let dims = x.dims().to_vec();
        let heads = x.row_len() / n.head_dim;
        x.reshape(&[(x.rows() * heads) as u64, n.head_dim as u64])?
            .rms_norm(&n.weight, EPS)?
            .reshape(&dims)
    }
}

/// One stream's query, key and value projections and their norms.
pub(crate) struct Stream {
    q: Linear,
    k: Linear,
    v: Linear,
    norm_q: Option<HeadNorm>,
    norm_k: Option<HeadNorm>,
}

impl Stream {
    pub(crate) fn load(
        w: &Weights<'_>,
        p: &str,
        names: [&str; 5],
        head_dim: usize,
    ) -> Result<Stream> {
        let l = |n: &str| Linear::load(w, &format!("{p}.{n}"));
        Ok(Stream {
            q: l(names[0])?,
            k: l(names[1])?,
            v: l(names[2])?,
            norm_q: HeadNorm::load(w, &format!("{p}.{}", names[3]), head_dim)?,
            norm_k: HeadNorm::load(w, &format!("{p}.{}", names[4]), head_dim)?,
        })
    }

    pub(crate) fn project(&self, x: &Tensor) -> Result<[Tensor; 3]> {
        Ok([
            HeadNorm::apply(&self.norm_q, self.q.forward(x)?)?,
            HeadNorm::apply(&self.norm_k, self.k.forward(x)?)?,
            self.v.forward(x)?,
        ])
    }
}

/// Bidirectional attention of `q` over `k`, `v` (`[rows, heads·head_dim]` each).
pub(crate) fn attention([q, k, v]: [&Tensor; 3], heads: usize, head_dim: usize) -> Result<Tensor> {
    let params = AttentionParams {
        heads: heads as u32,
        kv_heads: heads as u32,
        head_dim: head_dim as u32,
        first_query_pos: 0,
        window: 0,
        scale: 1.0 / (head_dim as f32).sqrt(),
        softcap: 0.0,
        mask: AttentionMask::Bidirectional,
        kv_dtype: DType::F32,
    };
    q.attention(&[k.desc(), v.desc()], &params)
}

/// Joint attention: the image and text rows in one attention (SD3: image first; FLUX: text
/// first, with its rotary embedding over both).
struct JointAttention {
    image: Stream,
    text: Stream,
    to_out: Linear,
    to_add_out: Option<Linear>,
    heads: usize,
    head_dim: usize,
    text_first: bool,
}

impl JointAttention {
    /// The image rows' and (unless the block is text-free) the text rows' outputs.
    fn forward(
        &self,
        x: &Tensor,
        c: &Tensor,
        rope: Option<&AxesRope>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let [qx, kx, vx] = self.image.project(x)?;
        let [qc, kc, vc] = self.text.project(c)?;
        let join = |a: &Tensor, b: &Tensor| match self.text_first {
            true => Tensor::concat(&[b, a]),
            false => Tensor::concat(&[a, b]),
        };
        let (mut q, mut k, v) = (join(&qx, &qc)?, join(&kx, &kc)?, join(&vx, &vc)?);
        if let Some(rope) = rope {
            q = rope.apply(&q)?;
            k = rope.apply(&k)?;
        }
        let o = attention([&q, &k, &v], self.heads, self.head_dim)?;
        let (n, m) = (x.rows(), c.rows());
        let (image, text) = match self.text_first {
            true => (o.rows_range(m..m + n)?, o.rows_range(0..m)?),
            false => (o.rows_range(0..n)?, o.rows_range(n..n + m)?),
        };
        let text = match &self.to_add_out {
            Some(out) => Some(out.forward(&text)?),
            None => None,
        };
        Ok((self.to_out.forward(&image)?, text))
    }
}

/// How a block modulates the text rows: adaLN-Zero (six rows), or in the last block, which
/// only feeds the image rows, a plain adaptive norm (scale, then shift).
enum TextNorm {
    Zero(Linear),
    Continuous(Linear),
}

/// A joint block of two streams (FLUX's double-stream block too).
pub(crate) struct JointBlock {
    norm1: Linear,
    norm1_context: TextNorm,
    attention: JointAttention,
    ff: Mlp,
    ff_context: Option<Mlp>,
    norm: ModulatedNorm,
}

/// The shape of a joint block.
pub(crate) struct JointShape {
    /// Attention heads.
    pub heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Whether the block only feeds the image rows (SD3's last).
    pub text_free: bool,
    /// Whether the text rows come first in the attention (FLUX).
    pub text_first: bool,
}

impl JointBlock {
    /// The block at `p`.
    pub(crate) fn load(w: &Weights<'_>, p: &str, shape: &JointShape) -> Result<JointBlock> {
        let last = shape.text_free;
        let context_norm = Linear::load(w, &format!("{p}.norm1_context.linear"))?;
        let attention = JointAttention {
            image: Stream::load(
                w,
                &format!("{p}.attn"),
                ["to_q", "to_k", "to_v", "norm_q", "norm_k"],
                shape.head_dim,
            )?,
            text: Stream::load(
                w,
                &format!("{p}.attn"),
                [
                    "add_q_proj",
                    "add_k_proj",
                    "add_v_proj",
                    "norm_added_q",
                    "norm_added_k",
                ],
                shape.head_dim,
            )?,
            to_out: Linear::load(w, &format!("{p}.attn.to_out.0"))?,
            to_add_out: match last {
                true => None,
                false => Some(Linear::load(w, &format!("{p}.attn.to_add_out"))?),
            },
            heads: shape.heads,
            head_dim: shape.head_dim,
            text_first: shape.text_first,
        };
        let width = shape.heads * shape.head_dim;
        let block = JointBlock {
            norm1: Linear::load(w, &format!("{p}.norm1.linear"))?,
            norm1_context: match last {
                true => TextNorm::Continuous(context_norm),
                false => TextNorm::Zero(context_norm),
            },
            attention,
            ff: Mlp::load(w, &format!("{p}.ff"))?,
            ff_context: match last {
                true => None,
                false => Some(Mlp::load(w, &format!("{p}.ff_context"))?),
            },
            norm: ModulatedNorm::new(w.device(), width, EPS)?,
        };
        let rows = match &block.norm1_context {
            TextNorm::Zero(l) => l.out_features() / width,
            TextNorm::Continuous(l) => l.out_features() / width,
        };
        if block.norm1.out_features() != 6 * width || rows != if last { 2 } else { 6 } {
            return Err(UError::invalid(format!(
                "arch-diffusion: {p}: the modulations do not fit a width of {width}"
            )));
        }
        Ok(block)
    }

    /// `(x, c)` after the block, `temb` (SiLU applied) modulating both, `rope` rotating the
    /// queries and keys; `c` is gone after a text-free block.
    pub(crate) fn forward(
        &self,
        x: &Tensor,
        c: &Tensor,
        temb: &Tensor,
        rope: Option<&AxesRope>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let width = x.row_len() as u64;
        let mx = self.norm1.forward(temb)?.reshape(&[6, width])?;
        let row = |m: &Tensor, i: usize| m.rows_range(i..i + 1);
        let nx = self.norm.forward(x, &row(&mx, 0)?, &row(&mx, 1)?)?;
        let (nc, mc) = match &self.norm1_context {
            TextNorm::Zero(l) => {
                let mc = l.forward(temb)?.reshape(&[6, width])?;
                (
                    self.norm.forward(c, &row(&mc, 0)?, &row(&mc, 1)?)?,
                    Some(mc),
                )
            }
            TextNorm::Continuous(l) => {
                let m = l.forward(temb)?.reshape(&[2, width])?;
                (self.norm.forward(c, &row(&m, 1)?, &row(&m, 0)?)?, None)
            }
        };
        let (ax, ac) = self.attention.forward(&nx, &nc, rope)?;
        let x = ax.mul(&row(&mx, 2)?)?.add(x)?;
        let h = self.norm.forward(&x, &row(&mx, 3)?, &row(&mx, 4)?)?;
        let x = self.ff.forward(&h)?.mul(&row(&mx, 5)?)?.add(&x)?;
        let c = match (mc, ac, &self.ff_context) {
            (Some(mc), Some(ac), Some(ff)) => {
                let c = ac.mul(&row(&mc, 2)?)?.add(c)?;
                let h = self.norm.forward(&c, &row(&mc, 3)?, &row(&mc, 4)?)?;
                Some(ff.forward(&h)?.mul(&row(&mc, 5)?)?.add(&c)?)
            }
            _ => None,
        };
        Ok((x, c))
    }
}

/// Where the position embedding comes from.
enum Positions {
    /// Centre crops of a trained `side × side` grid (`pos_embed_max_size`).
    Cropped { table: Vec<f32>, side: usize },
    /// 2-D sin-cos made for each grid, scaled to the trained one's `base` side.
    SinCos { base: usize },
}

/// The whole MMDiT.
pub struct Sd3Transformer {
    cfg: Sd3Config,
    patchify: Conv2d,
    positions: Positions,
    timestep: TwoLayer,
    pooled: TwoLayer,
    context_embedder: Linear,
    blocks: Vec<JointBlock>,
    norm_out: Linear,
    final_norm: ModulatedNorm,
    proj_out: Linear,
}

impl Sd3Transformer {
    /// Reads the `SD3Transformer2DModel` in `w`.
    pub fn load(w: &Weights<'_>, cfg: &Sd3Config) -> Result<Sd3Transformer> {
        let width = cfg.width();
        let positions = match cfg.pos_embed_max_size {
            Some(side) => {
                let table = w.values("pos_embed.pos_embed")?;
                if table.len() != side * side * width {
                    return Err(UError::invalid(format!(
                        "arch-diffusion: pos_embed.pos_embed holds {} values, not {side}² rows \
                         of {width}",
                        table.len()
                    )));
                }
                Positions::Cropped { table, side }
            }
            None => Positions::SinCos {
                base: cfg.sample_size / cfg.patch,
            },
        };
        let model = Sd3Transformer {
            cfg: cfg.clone(),
            patchify: Conv2d::patches(w, "pos_embed.proj", cfg.patch)?,
            positions,
            timestep: TwoLayer::load(w, "time_text_embed.timestep_embedder")?,
            pooled: TwoLayer::load(w, "time_text_embed.text_embedder")?,
            context_embedder: Linear::load(w, "context_embedder")?,
            blocks: (0..cfg.layers)
                .map(|i| {
                    let shape = JointShape {
                        heads: cfg.heads,
                        head_dim: cfg.head_dim,
                        text_free: i + 1 == cfg.layers,
                        text_first: false,
                    };
                    JointBlock::load(w, &format!("transformer_blocks.{i}"), &shape)
                })
                .collect::<Result<_>>()?,
            norm_out: Linear::load(w, "norm_out.linear")?,
            final_norm: ModulatedNorm::new(w.device(), width, EPS)?,
            proj_out: Linear::load(w, "proj_out")?,
        };
        let fits = model.patchify.in_channels() == cfg.in_channels
            && model.patchify.out_channels() == width
            && model.context_embedder.in_features() == cfg.context_width
            && model.context_embedder.out_features() == width
            && model.pooled.linear_1.in_features() == cfg.pooled_width
            && model.norm_out.out_features() == 2 * width
            && model.proj_out.out_features() == cfg.patch * cfg.patch * cfg.out_channels;
        if !fits {
            return Err(UError::invalid(format!(
                "arch-diffusion: SD3: the embedders and projections do not fit a width of {width}"
            )));
        }
        Ok(model)
    }

    /// Its configuration.
    pub fn config(&self) -> &Sd3Config {
        &self.cfg
    }

    /// The position rows of a `grid_h × grid_w` grid of patches.
    fn positions(&self, (gh, gw): (usize, usize)) -> Result<Vec<f32>> {
        let width = self.cfg.width();
        match &self.positions {
            Positions::SinCos { base } => Ok(position_embedding(width, (gh, gw), *base)),
            Positions::Cropped { table, side } => {
                if gh > *side || gw > *side {
                    return Err(UError::invalid(format!(
                        "arch-diffusion: SD3: a {gh}×{gw} grid of patches is larger than the \
                         trained {side}×{side}"
                    )));
                }
                let (top, left) = ((side - gh) / 2, (side - gw) / 2);
                let mut out = Vec::with_capacity(gh * gw * width);
                for i in 0..gh {
                    let start = ((top + i) * side + left) * width;
                    out.extend_from_slice(&table[start..start + gw * width]);
                }
                Ok(out)
            }
        }
    }

    /// The prediction for latents `z` `[in_channels, h, w]` at timestep `t`, conditioned on
    /// the pooled text `pooled` and the text rows `context` `[rows, context_width]`.
    pub fn forward(&self, z: &Tensor, t: f32, pooled: &[f32], context: &Tensor) -> Result<Tensor> {
        let cfg = &self.cfg;
        let device: &Device = z.device();
        let (h, w) = match z.dims() {
            &[_, h, w] => (h as usize, w as usize),
            d => return Err(UError::invalid(format!("arch-diffusion: SD3 input {d:?}"))),
        };
        let grid = (h / cfg.patch, w / cfg.patch);
        let width = cfg.width();
        let x = to_rows(&self.patchify.forward(z)?)?;
        let pos = self.positions(grid)?;
        x.add_assign(&device.from_f32(&pos, &[(grid.0 * grid.1) as u64, width as u64])?)?;
        let e = timestep_embedding(t, TIMESTEP_CHANNELS, true, 0.0);
        let temb = self
            .timestep
            .forward(&device.from_f32(&e, &[1, TIMESTEP_CHANNELS as u64])?)?
            .add(
                &self
                    .pooled
                    .forward(&device.from_f32(pooled, &[1, pooled.len() as u64])?)?,
            )?;
        temb.activation_assign(Activation::Silu)?;
        let mut c = Some(self.context_embedder.forward(context)?);
        let mut x = x;
        for block in &self.blocks {
            let text = c.take().ok_or_else(|| {
                UError::invalid("arch-diffusion: SD3: a block after the last text block")
            })?;
            (x, c) = block.forward(&x, &text, &temb, None)?;
        }
        let m = self.norm_out.forward(&temb)?.reshape(&[2, width as u64])?;
        let x = self
            .final_norm
            .forward(&x, &m.rows_range(1..2)?, &m.rows_range(0..1)?)?;
        let patches = self.proj_out.forward(&x)?.to_vec()?;
        let out = unpatchify(&patches, (h, w), cfg.patch, cfg.out_channels);
        device.from_f32(&out, &[cfg.out_channels as u64, h as u64, w as u64])
    }
}
