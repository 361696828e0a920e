//! The blocks shared by the autoencoder and the UNet, as diffusers defines them: the residual
//! block with its optional time conditioning (`ResnetBlock2D`), the stride-2 and nearest ×2
//! resamplers, the autoencoder's single-head spatial self-attention, and the text-conditioned
//! transformer (`Transformer2DModel` of `BasicTransformerBlock`s: self-attention,
//! cross-attention to the text rows, a GEGLU feed-forward).

use crate::layers::{Conv2d, GroupNorm, LayerNorm, Linear, Weights, size, to_map, to_rows};
use u_sdk::{Activation, AttentionMask, AttentionParams, DType, Result, UError, nn::Tensor};

/// `ResnetBlock2D` (He et al. 2016, as in DDPM's UNet):
///
/// ```text
/// h = conv1(silu(norm1(x))) + time_emb_proj(silu(temb))     # per channel, when conditioned
/// h = conv2(silu(norm2(h)))
/// y = (shortcut(x) + h) / output_scale
/// ```
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Conv2d,
    time_emb_proj: Option<Linear>,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
    output_scale: f32,
}

impl ResnetBlock2D {
    /// The block at `prefix`; a `time_emb_proj` and a `conv_shortcut` where the component has
    /// them.
    pub fn load(
        w: &Weights<'_>,
        prefix: &str,
        (groups, eps): (usize, f32),
        output_scale: f32,
    ) -> Result<ResnetBlock2D> {
        let time = format!("{prefix}.time_emb_proj");
        let shortcut = format!("{prefix}.conv_shortcut");
        let block = ResnetBlock2D {
            norm1: GroupNorm::load(w, &format!("{prefix}.norm1"), groups, eps)?,
            conv1: Conv2d::load(w, &format!("{prefix}.conv1"))?,
            time_emb_proj: match w.has(&format!("{time}.weight")) {
                true => Some(Linear::load(w, &time)?),
                false => None,
            },
            norm2: GroupNorm::load(w, &format!("{prefix}.norm2"), groups, eps)?,
            conv2: Conv2d::load(w, &format!("{prefix}.conv2"))?,
            conv_shortcut: match w.has(&format!("{shortcut}.weight")) {
                true => Some(Conv2d::load(w, &shortcut)?),
                false => None,
            },
            output_scale,
        };
        let (c_in, c_out) = (block.conv1.in_channels(), block.conv1.out_channels());
        let fits = block.norm1.channels() == c_in
            && block.norm2.channels() == c_out
            && block.conv2.in_channels() == c_out
            && match &block.conv_shortcut {
                Some(s) => s.in_channels() == c_in && s.out_channels() == c_out,
                None => c_in == c_out,
            }
            && block
                .time_emb_proj
                .as_ref()
                .is_none_or(|t| t.out_features() == c_out);
        if !fits {
            return Err(UError::invalid(format!(
                "arch-diffusion: {prefix}: the resnet's norms, convolutions and shortcut do not \
                 fit {c_in} → {c_out} channels"
            )));
        }
        Ok(block)
    }

    /// Input channels.
    pub fn in_channels(&self) -> usize {
        self.conv1.in_channels()
    }

    /// Output channels.
    pub fn out_channels(&self) -> usize {
        self.conv2.out_channels()
    }

    /// The block over `x` `[c_in, h, w]`, conditioned on `temb` (`[1, d]`, SiLU applied
    /// already) when it has a time projection.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Result<Tensor> {
        let h = self.norm1.forward(x)?;
        h.activation_assign(Activation::Silu)?;
        let h = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(t)) => self.conv1.forward_shifted(&h, &proj.forward(t)?)?,
            (Some(_), None) => {
                return Err(UError::invalid(
                    "arch-diffusion: a time-conditioned resnet run without a time embedding",
                ));
            }
            (None, _) => self.conv1.forward(&h)?,
        };
        let h = self.norm2.forward(&h)?;
        h.activation_assign(Activation::Silu)?;
        let h = self.conv2.forward(&h)?;
        match &self.conv_shortcut {
            Some(s) => h.add_assign(&s.forward(x)?)?,
            None => h.add_assign(x)?,
        }
        if self.output_scale != 1.0 {
            h.scale_assign(1.0 / self.output_scale)?;
        }
        Ok(h)
    }
}

/// `Downsample2D`: a 3×3 convolution of stride 2.
pub struct Downsample2D {
    conv: Conv2d,
}

impl Downsample2D {
    /// `{prefix}.conv`, padded with `padding` zeros before and after (`[1, 1]`; the
    /// autoencoder's `padding=0` pads only after: `[0, 1]`).
    pub fn load(w: &Weights<'_>, prefix: &str, padding: [u32; 2]) -> Result<Downsample2D> {
        Ok(Downsample2D {
            conv: Conv2d::strided(w, &format!("{prefix}.conv"), padding)?,
        })
    }

    /// The map at half the height and width.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(x)
    }
}

/// `Upsample2D`: nearest-neighbour ×2, then a 3×3 convolution.
pub struct Upsample2D {
    conv: Conv2d,
}

impl Upsample2D {
    /// `{prefix}.conv`.
    pub fn load(w: &Weights<'_>, prefix: &str) -> Result<Upsample2D> {
        Ok(Upsample2D {
            conv: Conv2d::load(w, &format!("{prefix}.conv"))?,
        })
    }

    /// The map at twice the height and width.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(&x.upsample(2)?)
    }
}

/// Multi-head scaled dot-product attention (Vaswani et al. 2017) of query rows over key and
/// value rows, every query seeing every key.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, heads: usize) -> Result<Tensor> {
    let width = q.dims()[1] as usize;
    if heads == 0 || !width.is_multiple_of(heads) {
        return Err(UError::invalid(format!(
            "arch-diffusion: {width} attention channels do not split into {heads} heads"
        )));
    }
    let head_dim = width / heads;
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

/// The autoencoder's mid-block attention (diffusers' `Attention` with its own group norm and
/// a residual connection): every position of the map attends to every other.
///
/// ```text
/// r = rows(group_norm(x));   y = x + map(to_out(attention(to_q(r), to_k(r), to_v(r))))
/// ```
pub struct SpatialAttention {
    norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
}

impl SpatialAttention {
    /// The attention at `prefix`, one head per `head_dim` channels.
    pub fn load(
        w: &Weights<'_>,
        prefix: &str,
        (groups, eps): (usize, f32),
        head_dim: usize,
    ) -> Result<SpatialAttention> {
        let norm = GroupNorm::load(w, &format!("{prefix}.group_norm"), groups, eps)?;
        let channels = norm.channels();
        Ok(SpatialAttention {
            norm,
            to_q: Linear::load(w, &format!("{prefix}.to_q"))?,
            to_k: Linear::load(w, &format!("{prefix}.to_k"))?,
            to_v: Linear::load(w, &format!("{prefix}.to_v"))?,
            to_out: Linear::load(w, &format!("{prefix}.to_out.0"))?,
            heads: (channels / head_dim.max(1)).max(1),
        })
    }

    /// `x` `[c, h, w]` plus its attention.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let r = to_rows(&self.norm.forward(x)?)?;
        let (q, k, v) = (
            self.to_q.forward(&r)?,
            self.to_k.forward(&r)?,
            self.to_v.forward(&r)?,
        );
        let y = to_map(
            &self.to_out.forward(&attend(&q, &k, &v, self.heads)?)?,
            size(x)?,
        )?;
        y.add_assign(x)?;
        Ok(y)
    }
}

/// diffusers' `Attention` inside a transformer block: bias-free query, key and value
/// projections, an output projection with a bias; self-attention over the rows, or
/// cross-attention to a context.
pub struct Attention {
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
    heads: usize,
}

impl Attention {
    /// The attention at `prefix` with `heads` heads.
    pub fn load(w: &Weights<'_>, prefix: &str, heads: usize) -> Result<Attention> {
        Ok(Attention {
            to_q: Linear::load(w, &format!("{prefix}.to_q"))?,
            to_k: Linear::load(w, &format!("{prefix}.to_k"))?,
            to_v: Linear::load(w, &format!("{prefix}.to_v"))?,
            to_out: Linear::load(w, &format!("{prefix}.to_out.0"))?,
            heads,
        })
    }

    /// Width of the context rows it reads keys and values from.
    pub fn context_width(&self) -> usize {
        self.to_k.in_features()
    }

    /// The keys and values of `rows`.
    pub fn keys_values(&self, rows: &Tensor) -> Result<KeysValues> {
        Ok(KeysValues {
            keys: self.to_k.forward(rows)?,
            values: self.to_v.forward(rows)?,
        })
    }

    /// Rows `x` attending to themselves.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_to(x, &self.keys_values(x)?)
    }

    /// Rows `x` attending to the keys and values `kv` of a context.
    pub fn forward_to(&self, x: &Tensor, kv: &KeysValues) -> Result<Tensor> {
        let q = self.to_q.forward(x)?;
        self.to_out
            .forward(&attend(&q, &kv.keys, &kv.values, self.heads)?)
    }
}

/// The keys and values a cross-attention reads from its context: the same for every step of a
/// sample, so a denoiser keeps them ([`crate::model`]).
pub struct KeysValues {
    keys: Tensor,
    values: Tensor,
}

/// The transformer's feed-forward network with a GEGLU (Shazeer 2020):
/// `out(h ⊙ gelu(g))` where `[h, g]` are the two halves of one projection.
pub struct FeedForward {
    hidden: Linear,
    gate: Linear,
    out: Linear,
}

impl FeedForward {
    /// `{prefix}.net.0.proj` (both halves) and `{prefix}.net.2`.
    pub fn load(w: &Weights<'_>, prefix: &str) -> Result<FeedForward> {
        let proj = format!("{prefix}.net.0.proj");
        let both = w.tensor(&format!("{proj}.weight"))?.dims()[0] as usize;
        if !both.is_multiple_of(2) {
            return Err(UError::invalid(format!(
                "arch-diffusion: {proj} has {both} outputs, not two equal halves"
            )));
        }
        let inner = both / 2;
        Ok(FeedForward {
            hidden: Linear::load_rows(w, &proj, 0..inner)?,
            gate: Linear::load_rows(w, &proj, inner..both)?,
            out: Linear::load(w, &format!("{prefix}.net.2"))?,
        })
    }

    /// The network over rows `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.hidden.forward(x)?;
        let g = self.gate.forward(x)?;
        self.out.forward(&g.gated(Activation::GeluErf, &h)?)
    }
}

/// `BasicTransformerBlock`: pre-norm self-attention, cross-attention to the context and a
/// feed-forward network, each added to the rows.
pub struct BasicTransformerBlock {
    norm1: LayerNorm,
    attn1: Attention,
    norm2: LayerNorm,
    attn2: Attention,
    norm3: LayerNorm,
    ff: FeedForward,
}

/// LayerNorm epsilon of a transformer block (diffusers' `norm_eps` default).
const BLOCK_EPS: f32 = 1e-5;

impl BasicTransformerBlock {
    /// The block at `prefix` over rows of `width` with `heads` heads.
    pub fn load(
        w: &Weights<'_>,
        prefix: &str,
        width: usize,
        heads: usize,
    ) -> Result<BasicTransformerBlock> {
        let norm = |i: usize| LayerNorm::load(w, &format!("{prefix}.norm{i}"), width, BLOCK_EPS);
        Ok(BasicTransformerBlock {
            norm1: norm(1)?,
            attn1: Attention::load(w, &format!("{prefix}.attn1"), heads)?,
            norm2: norm(2)?,
            attn2: Attention::load(w, &format!("{prefix}.attn2"), heads)?,
            norm3: norm(3)?,
            ff: FeedForward::load(w, &format!("{prefix}.ff"))?,
        })
    }

    /// The rows `x` after the block, cross-attending to a context's keys and values `cross`
    /// (its [`Attention::keys_values`]).
    pub fn forward(&self, x: &Tensor, cross: &KeysValues) -> Result<Tensor> {
        let x = self.attn1.forward(&self.norm1.forward(x)?)?.add(x)?;
        let x = self
            .attn2
            .forward_to(&self.norm2.forward(&x)?, cross)?
            .add(&x)?;
        self.ff.forward(&self.norm3.forward(&x)?)?.add(&x)
    }
}

/// How a transformer moves between the map and its rows.
enum Projection {
    /// 1×1 convolutions on the map (SD 1).
    Conv(Conv2d),
    /// Linear layers on the rows (SD 2, `use_linear_projection`).
    Linear(Linear),
}

/// `Transformer2DModel` over a feature map, conditioned on context rows:
///
/// ```text
/// r = rows(proj_in(group_norm(x)));   r = block(r, context)   # per block
/// y = x + proj_out(map(r))
/// ```
pub struct Transformer2D {
    norm: GroupNorm,
    proj_in: Projection,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Projection,
}

/// GroupNorm epsilon of a transformer's input norm (fixed in diffusers).
const TRANSFORMER_GROUP_EPS: f32 = 1e-6;

impl Transformer2D {
    /// The transformer at `prefix`: `groups` norm groups, `heads` heads, projections linear
    /// or convolutional, every `transformer_blocks.N` the component has.
    pub fn load(
        w: &Weights<'_>,
        prefix: &str,
        groups: usize,
        heads: usize,
        linear: bool,
    ) -> Result<Transformer2D> {
        let norm = GroupNorm::load(w, &format!("{prefix}.norm"), groups, TRANSFORMER_GROUP_EPS)?;
        let projection = |name: &str| -> Result<Projection> {
            let p = format!("{prefix}.{name}");
            Ok(match linear {
                true => Projection::Linear(Linear::load(w, &p)?),
                false => Projection::Conv(Conv2d::load(w, &p)?),
            })
        };
        let proj_in = projection("proj_in")?;
        let inner = match &proj_in {
            Projection::Linear(l) => l.out_features(),
            Projection::Conv(c) => c.out_channels(),
        };
        let mut blocks = Vec::new();
        while w.has(&format!(
            "{prefix}.transformer_blocks.{}.norm1.weight",
            blocks.len()
        )) {
            let p = format!("{prefix}.transformer_blocks.{}", blocks.len());
            blocks.push(BasicTransformerBlock::load(w, &p, inner, heads)?);
        }
        if blocks.is_empty() {
            return Err(UError::invalid(format!(
                "arch-diffusion: {prefix} has no transformer_blocks"
            )));
        }
        Ok(Transformer2D {
            norm,
            proj_in,
            blocks,
            proj_out: projection("proj_out")?,
        })
    }

    /// Width of the context rows its cross-attention reads.
    pub fn context_width(&self) -> usize {
        self.blocks[0].attn2.context_width()
    }

    /// The keys and values each block's cross-attention reads from `context`
    /// `[rows, context_width]`.
    pub fn cross_keys_values(&self, context: &Tensor) -> Result<Vec<KeysValues>> {
        self.blocks
            .iter()
            .map(|b| b.attn2.keys_values(context))
            .collect()
    }

    /// `x` `[c, h, w]` plus the transformer's output, cross-attending with `cross` (its
    /// [`Transformer2D::cross_keys_values`] of the context).
    pub fn forward(&self, x: &Tensor, cross: &[KeysValues]) -> Result<Tensor> {
        if cross.len() != self.blocks.len() {
            return Err(UError::invalid(format!(
                "arch-diffusion: {} cross-attention keys and values for {} blocks",
                cross.len(),
                self.blocks.len()
            )));
        }
        let hw = size(x)?;
        let n = self.norm.forward(x)?;
        let mut r = match &self.proj_in {
            Projection::Conv(c) => to_rows(&c.forward(&n)?)?,
            Projection::Linear(l) => l.forward(&to_rows(&n)?)?,
        };
        for (block, kv) in self.blocks.iter().zip(cross) {
            r = block.forward(&r, kv)?;
        }
        let y = match &self.proj_out {
            Projection::Conv(c) => c.forward(&to_map(&r, hw)?)?,
            Projection::Linear(l) => to_map(&l.forward(&r)?, hw)?,
        };
        y.add_assign(x)?;
        Ok(y)
    }
}
