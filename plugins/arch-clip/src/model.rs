//! The text tower: `Embeddings`, `SelfAttention`, `Mlp`, `Block`, and `ClipText` that stacks
//! them and projects into the joint space.
//!
//! Every chunk of a batch is one whole text: its rows run together through the projections
//! (one matmul per weight per pass) and attend, causally, to the rows of their own text only.

use crate::config::{Act, CHECKPOINT, Config, TEXT_CHECKPOINT};
use abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ModelConfig, ModelKind, Output, Pooling,
    Result, SeqChunk, UError, WeightSetBox,
    encoder::{TextBatch, TextSpan},
    nn::{Device, Tensor},
};

/// Where the text tower's tensors live in a `CLIPModel` checkpoint (and in a tower saved alone
/// by transformers before version 5, which saves it without the prefix).
const TOWER: &str = "text_model.";

/// Where a tower saved alone may keep its tensors: as transformers 4 saves it, as transformers
/// 5 does (no prefix), and inside Stable Diffusion's single-file checkpoints (SD 1.x's
/// `cond_stage_model`, SDXL's first embedder).
const ALONE: [&str; 4] = [
    TOWER,
    "",
    "cond_stage_model.transformer.text_model.",
    "conditioner.embedders.0.transformer.text_model.",
];

/// Where SD 2.x and SDXL single-file checkpoints keep an OpenCLIP text tower, whose layout
/// (fused `in_proj` attention, `resblocks`) this plugin does not read.
const OPEN_CLIP: [&str; 2] = ["cond_stage_model.model.", "conditioner.embedders.1.model."];

/// The projection into the joint space.
const PROJECTION: &str = "text_projection.weight";

/// A checkpoint's tensors, read into the backend.
struct Weights<'w> {
    weights: &'w WeightSetBox,
    device: Device,
    /// The prefix of the tower's tensors: [`TOWER`] or none.
    tower: &'static str,
}

impl Weights<'_> {
    fn has(&self, name: &str) -> bool {
        self.weights.tensor(name.into()).into_result().is_ok()
    }

    /// `name` in the backend, as stored.
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.device
            .import_weight(self.weights, name, None)
            .map_err(|e| UError::new(e.kind, format!("arch-clip: {}", e.message)))
    }

    /// `name` as a `[rows, cols]` matrix in the backend.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let t = self.tensor(name)?;
        if t.dims() != [rows as u64, cols as u64] {
            return Err(UError::invalid(format!(
                "arch-clip: {name} has shape {:?}, expected [{rows}, {cols}]",
                t.dims()
            )));
        }
        Ok(t)
    }

    /// `name` as an `F32` vector of `len` values in the backend.
    fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        let view = self.weights.tensor(name.into()).into_result()?;
        let v = u_sdk::quant::dequantize_view(&view)
            .map_err(|e| UError::invalid(format!("arch-clip: {name}: {e}")))?;
        if v.len() != len {
            return Err(UError::invalid(format!(
                "arch-clip: {name} has {} values, expected {len}",
                v.len()
            )));
        }
        self.device.from_f32(&v, &[len as u64])
    }
}

/// `y = x·Wᵀ + b` (the bias where the layer has one).
struct Dense {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Dense {
    /// `{name}.weight` (`[outputs, inputs]`) and, when `bias`, `{name}.bias`.
    fn load(
        w: &Weights<'_>,
        name: &str,
        (inputs, outputs): (usize, usize),
        bias: bool,
    ) -> Result<Dense> {
        Ok(Dense {
            weight: w.matrix(&format!("{name}.weight"), outputs, inputs)?,
            bias: match bias {
                true => Some(w.vector(&format!("{name}.bias"), outputs)?),
                false => None,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        if let Some(b) = &self.bias {
            y.add_assign(b)?;
        }
        Ok(y)
    }
}

/// Layer normalisation with scale and shift (Ba et al. 2016).
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    fn load(w: &Weights<'_>, name: &str, cfg: &Config) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: w.vector(&format!("{name}.weight"), cfg.hidden)?,
            bias: w.vector(&format!("{name}.bias"), cfg.hidden)?,
            eps: cfg.eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight, &self.bias, self.eps)
    }
}

/// Token embeddings plus learned absolute positions (each text's from 0).
struct Embeddings {
    token: Tensor,
    position: Tensor,
}

impl Embeddings {
    fn load(w: &Weights<'_>, cfg: &Config) -> Result<Embeddings> {
        let p = |t: &str| format!("{}embeddings.{t}.weight", w.tower);
        Ok(Embeddings {
            token: w.matrix(&p("token_embedding"), cfg.vocab_size, cfg.hidden)?,
            position: w.matrix(&p("position_embedding"), cfg.max_positions, cfg.hidden)?,
        })
    }

    /// `token[ids] + position[0..len]` for every text of `texts`, one after another.
    fn forward(&self, texts: &[Vec<u32>]) -> Result<Tensor> {
        let dev = self.token.device();
        let ids: Vec<i32> = texts.iter().flatten().map(|&t| t as i32).collect();
        let positions: Vec<i32> = texts.iter().flat_map(|t| 0..t.len() as i32).collect();
        let rows = ids.len() as u64;
        let x = self.token.get_rows(&dev.from_i32(&ids, &[rows])?)?;
        x.add_assign(
            &self
                .position
                .get_rows(&dev.from_i32(&positions, &[rows])?)?,
        )?;
        Ok(x)
    }
}

/// Causal multi-head self-attention with its output projection.
struct SelfAttention {
    query: Dense,
    key: Dense,
    value: Dense,
    output: Dense,
    params: AttentionParams,
}

impl SelfAttention {
    fn load(w: &Weights<'_>, prefix: &str, cfg: &Config) -> Result<SelfAttention> {
        let h = cfg.hidden;
        let dense = |t: &str| Dense::load(w, &format!("{prefix}{t}"), (h, h), true);
        let head_dim = h / cfg.heads;
        Ok(SelfAttention {
            query: dense("q_proj")?,
            key: dense("k_proj")?,
            value: dense("v_proj")?,
            output: dense("out_proj")?,
            params: AttentionParams {
                heads: cfg.heads as u32,
                kv_heads: cfg.heads as u32,
                head_dim: head_dim as u32,
                first_query_pos: 0,
                window: 0,
                scale: 1.0 / (head_dim as f32).sqrt(),
                softcap: 0.0,
                mask: AttentionMask::Causal,
                kv_dtype: DType::F32,
            },
        })
    }

    fn forward(&self, x: &Tensor, spans: &[TextSpan]) -> Result<Tensor> {
        let (q, k, v) = (
            self.query.forward(x)?,
            self.key.forward(x)?,
            self.value.forward(x)?,
        );
        let ctx = x.device().alloc(DType::F32, q.dims())?;
        for s in spans.iter().filter(|s| s.len > 0) {
            let rows = s.offset..s.offset + s.len;
            let (kr, vr) = (k.rows_range(rows.clone())?, v.rows_range(rows.clone())?);
            q.rows_range(rows.clone())?.attention_into(
                &[kr.desc(), vr.desc()],
                &self.params,
                &ctx.rows_range(rows)?,
            )?;
        }
        self.output.forward(&ctx)
    }
}

/// The position-wise MLP: `fc2(act(fc1(x)))`.
struct Mlp {
    fc1: Dense,
    fc2: Dense,
    act: Act,
}

impl Mlp {
    fn load(w: &Weights<'_>, prefix: &str, cfg: &Config) -> Result<Mlp> {
        let (h, m) = (cfg.hidden, cfg.intermediate);
        Ok(Mlp {
            fc1: Dense::load(w, &format!("{prefix}fc1"), (h, m), true)?,
            fc2: Dense::load(w, &format!("{prefix}fc2"), (m, h), true)?,
            act: cfg.act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(x)?;
        let h = match self.act {
            Act::QuickGelu => h.mul(&h.scale(1.702)?.activation(Activation::Sigmoid)?)?,
            Act::Gelu => h.activation(Activation::GeluErf)?,
            Act::GeluTanh => h.activation(Activation::GeluTanh)?,
        };
        self.fc2.forward(&h)
    }
}

/// A pre-norm block: `h = x + Attention(LN₁(x)); h + MLP(LN₂(h))`.
struct Block {
    norm1: LayerNorm,
    attention: SelfAttention,
    norm2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn load(w: &Weights<'_>, cfg: &Config, i: usize) -> Result<Block> {
        let p = format!("{}encoder.layers.{i}.", w.tower);
        Ok(Block {
            norm1: LayerNorm::load(w, &format!("{p}layer_norm1"), cfg)?,
            attention: SelfAttention::load(w, &format!("{p}self_attn."), cfg)?,
            norm2: LayerNorm::load(w, &format!("{p}layer_norm2"), cfg)?,
            mlp: Mlp::load(w, &format!("{p}mlp."), cfg)?,
        })
    }

    fn forward(&self, x: &Tensor, spans: &[TextSpan]) -> Result<Tensor> {
        let h = x.add(&self.attention.forward(&self.norm1.forward(x)?, spans)?)?;
        h.add(&self.mlp.forward(&self.norm2.forward(&h)?)?)
    }
}

/// CLIP's text encoder with its projection: token ids in, vectors of the joint image-text space
/// out.
pub struct ClipText {
    /// Hyper-parameters.
    pub cfg: Config,
    embeddings: Embeddings,
    blocks: Vec<Block>,
    final_norm: LayerNorm,
    /// `text_projection` (no bias): the tower's width to the joint space's; none for a tower
    /// saved without it.
    projection: Option<Dense>,
    /// Width of the output rows: the joint space's, or the tower's own without a projection.
    width: usize,
}

impl ClipText {
    /// Builds the text tower of the CLIP checkpoint `weights` on `device`. A `CLIPModel`
    /// must have its `text_projection`; a tower saved alone is used with its projection when
    /// it has one (`CLIPTextModelWithProjection`) and without (`CLIPTextModel`, whose rows
    /// Stable Diffusion's UNet reads) otherwise.
    pub fn load(weights: &WeightSetBox, device: Device) -> Result<ClipText> {
        let cfg = Config::from_weights(weights)?;
        let mut w = Weights {
            weights,
            device,
            tower: TOWER,
        };
        if cfg.family == TEXT_CHECKPOINT {
            let stored = ALONE
                .into_iter()
                .find(|p| w.has(&format!("{p}final_layer_norm.weight")));
            match stored {
                Some(tower) => w.tower = tower,
                None if OPEN_CLIP
                    .iter()
                    .any(|p| w.has(&format!("{p}ln_final.weight"))) =>
                {
                    return Err(UError::unsupported(format!(
                        "arch-clip: the checkpoint's text tower is in OpenCLIP's layout (under \
                         {}), which arch-clip does not read; give the text encoder's folder \
                         its own weights in transformers' layout",
                        OPEN_CLIP.join(" or ")
                    )));
                }
                None => {}
            }
        }
        let projected = w.has(PROJECTION);
        if !projected && cfg.family == CHECKPOINT {
            return Err(UError::invalid(format!(
                "arch-clip: the checkpoint has no `{PROJECTION}`: a CLIP text embedding is the \
                 tower's pooled row projected into the joint space (a `CLIPModel` or \
                 `CLIPTextModelWithProjection` save has it)"
            )));
        }
        let width = match projected {
            false => cfg.hidden,
            true => match w.tensor(PROJECTION)?.dims() {
                [p, h] if *h == cfg.hidden as u64 && *p == cfg.projection as u64 => cfg.projection,
                dims => {
                    return Err(UError::invalid(format!(
                        "arch-clip: {PROJECTION} has shape {dims:?}, expected [{}, {}] \
                         (projection_dim, the text tower's width)",
                        cfg.projection, cfg.hidden
                    )));
                }
            },
        };
        let blocks = (0..cfg.layers)
            .map(|i| Block::load(&w, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(ClipText {
            embeddings: Embeddings::load(&w, &cfg)?,
            blocks,
            final_norm: LayerNorm::load(&w, &format!("{}final_layer_norm", w.tower), &cfg)?,
            projection: match projected {
                true => Some(Dense::load(
                    &w,
                    "text_projection",
                    (cfg.hidden, width),
                    false,
                )?),
                false => None,
            },
            width,
            cfg,
        })
    }

    /// What the model is, as the ABI says it: an encoder whose rows and pooled vectors are in
    /// the joint space ([`ModelConfig::hidden`] is `projection_dim`; the tower's own width for
    /// a tower saved without its projection); its own pooling is the checkpoint's head
    /// ([`Pooling::Head`]: the end-of-text row, projected).
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        ModelConfig {
            kind: ModelKind::Encoder,
            family: c.family.into(),
            vocab_size: c.vocab_size as u32,
            hidden: self.width as u32,
            layers: c.layers as u32,
            context_length: c.max_positions as u32,
            experts: 0,
            attention: AttentionMask::Causal,
            pooling: Pooling::Head,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    /// Refuses an earlier layer's rows where the projection changes the width (they would not
    /// be the joint space's rows the model's width promises).
    fn check_layers(&self, batch: &[SeqChunk<'_>]) -> Result<()> {
        let layers = self.cfg.layers;
        for chunk in batch {
            if let Output::Hidden { layer, .. } = chunk.output
                && (layer as usize) < layers
                && self.width != self.cfg.hidden
            {
                return Err(UError::unsupported(format!(
                    "arch-clip: the rows of the joint space are the final ones (layer {layers}); \
                     the state after block {layer} is of the tower's own width, {}, not the \
                     projection's {}",
                    self.cfg.hidden, self.width
                )));
            }
        }
        Ok(())
    }

    /// Encodes every chunk of `batch` (one text each) and writes the outputs they ask for into
    /// `out`, in batch order (see [`u_sdk::Model::forward`]): the pooled vector
    /// (`Pooled(Head)`: the final-normed row at the end-of-text token, projected; `Pooled`
    /// `Mean`/`First`/`Last`: over the projected final rows), the projected final rows
    /// (`Hidden` at the last layer), or the residual stream after an earlier block (`Hidden`
    /// at layer `l`: transformers' `hidden_states[l]`, as Stable Diffusion 3 reads its
    /// penultimate one; where the projection keeps the tower's width).
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        self.check_layers(batch)?;
        let read = TextBatch::read(
            "arch-clip",
            batch,
            &config,
            (self.cfg.max_positions, true),
            out,
        )?;
        if read.floats == 0 {
            return Ok(());
        }
        let mut x = self.embeddings.forward(&read.texts)?;
        let mut states = Vec::new();
        for (l, block) in self.blocks.iter().enumerate() {
            if TextBatch::wants_layer(batch, l) {
                states.push((l, x.to_vec()?));
            }
            x = block.forward(&x, &read.spans)?;
        }
        let normed = self.final_norm.forward(&x)?;
        let projected = match &self.projection {
            Some(p) => p.forward(&normed)?.to_vec()?,
            None => normed.to_vec()?,
        };
        let eos = |ids: &[u32]| self.cfg.eos.pick(ids);
        read.write(batch, (&projected, &states), &config, &eos, out)
    }
}
