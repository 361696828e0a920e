//! The tower: `PatchEmbedding`, `SelfAttention`, `Mlp`, `Block`, the pooling heads, and
//! `VisionTransformer` that stacks them.
//!
//! Every chunk of a batch is one image: its patch rows run together through the projections
//! (one matmul per weight per pass) and attend to each other only, in both directions.

use crate::{
    config::{Act, Config, Family},
    interpolate,
    naming::Names,
};
use abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ImageSpec, ModelConfig, ModelKind, Output,
    Pooling, Result, Rows, Segment, SeqChunk, UError,
    nn::{Device, Tensor},
};

/// `y = x·Wᵀ + b` (the bias where the checkpoint has one).
pub(crate) struct Dense {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Dense {
    fn load(n: &Names<'_>, name: &str, inputs: usize, outputs: usize) -> Result<Dense> {
        Dense::load_with(n, name, inputs, outputs, true)
    }

    /// `{name}.weight` (`[outputs, inputs]`) and, when `bias`, `{name}.bias`.
    pub(crate) fn load_with(
        n: &Names<'_>,
        name: &str,
        inputs: usize,
        outputs: usize,
        bias: bool,
    ) -> Result<Dense> {
        Ok(Dense {
            weight: n.matrix(&format!("{name}.weight"), outputs, inputs)?,
            bias: match bias {
                true => Some(n.vector(&format!("{name}.bias"), outputs)?),
                false => None,
            },
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        if let Some(b) = &self.bias {
            y.add_assign(b)?;
        }
        Ok(y)
    }
}

/// Layer normalisation with scale and shift (Ba et al. 2016).
pub(crate) struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f32,
}

impl LayerNorm {
    fn load(n: &Names<'_>, name: &str, cfg: &Config) -> Result<LayerNorm> {
        LayerNorm::load_with(n, name, cfg.hidden, cfg.eps)
    }

    /// `{name}.weight` and `{name}.bias`, `width` values each, normalising with `eps`.
    pub(crate) fn load_with(
        n: &Names<'_>,
        name: &str,
        width: usize,
        eps: f32,
    ) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: n.vector(&format!("{name}.weight"), width)?,
            bias: n.vector(&format!("{name}.bias"), width)?,
            eps,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight, &self.bias, self.eps)
    }
}

/// One chunk's rows inside the batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    /// The first row.
    pub(crate) offset: usize,
    /// Rows.
    pub(crate) len: usize,
}

/// Cuts an image into `patch × patch` squares and projects each (the stride-`patch`
/// convolution as a matmul over flattened squares), prepends the class token where the family
/// has one, and adds the learned positions.
struct PatchEmbedding {
    /// `[hidden, channels·patch²]`: the convolution's kernels, flattened as the squares are.
    projection: Dense,
    class: Option<Vec<f32>>,
    positions: Tensor,
    channels: usize,
    side: usize,
    patch: usize,
}

impl PatchEmbedding {
    fn load(n: &Names<'_>, cfg: &Config) -> Result<PatchEmbedding> {
        let (h, c, p) = (cfg.hidden, cfg.channels, cfg.patch);
        let kernel = n.tensor(n.patch_weight())?;
        if kernel.dims() != [h as u64, c as u64, p as u64, p as u64] {
            return Err(UError::invalid(format!(
                "arch-vit: {} has shape {:?}, expected [{h}, {c}, {p}, {p}]",
                n.stored(n.patch_weight()),
                kernel.dims()
            )));
        }
        let bias = match n.patch_bias() {
            Some(name) => Some(n.vector(name, h)?),
            None => None,
        };
        let class = match n.class_token() {
            Some(name) => Some(n.values(name, h)?),
            None => None,
        };
        let positions = positions(n, cfg)?;
        let positions = dev_positions(n, &positions, cfg)?;
        Ok(PatchEmbedding {
            projection: Dense {
                weight: kernel.reshape(&[h as u64, (c * p * p) as u64])?,
                bias,
            },
            class,
            positions,
            channels: c,
            side: cfg.input_size,
            patch: p,
        })
    }

    /// The squares of one `channels × side × side` image, row-major over the grid, each
    /// flattened channel by channel, row by row (the kernel's own order).
    fn squares(&self, pixels: &[f32]) -> Vec<f32> {
        let (c, s, p) = (self.channels, self.side, self.patch);
        let grid = s / p;
        let mut out = Vec::with_capacity(pixels.len());
        for gy in 0..grid {
            for gx in 0..grid {
                for ch in 0..c {
                    for y in 0..p {
                        let at = ch * s * s + (gy * p + y) * s + gx * p;
                        out.extend_from_slice(&pixels[at..at + p]);
                    }
                }
            }
        }
        out
    }

    /// The rows of every image of `images`, in order, into `dst` (`[Σ rows, hidden]`).
    fn forward(&self, images: &[&[f32]], dst: &Tensor) -> Result<()> {
        let dev = dst.device();
        let per_image = self.positions.rows();
        let lead = usize::from(self.class.is_some());
        let squares: Vec<f32> = images.iter().flat_map(|px| self.squares(px)).collect();
        let width = (self.channels * self.patch * self.patch) as u64;
        let squares = dev.from_f32(&squares, &[squares.len() as u64 / width, width])?;
        let patches = self.projection.forward(&squares)?;
        let per_patches = per_image - lead;
        for i in 0..images.len() {
            let rows = dst.rows_range(i * per_image..(i + 1) * per_image)?;
            if let Some(class) = &self.class {
                rows.rows_range(0..1)?.write(class)?;
            }
            patches
                .rows_range(i * per_patches..(i + 1) * per_patches)?
                .copy_into(None, &rows.rows_range(lead..per_image)?)?;
            rows.add_assign(&self.positions)?;
        }
        Ok(())
    }
}

/// The learned position table of `cfg`'s tower, `[rows, hidden]` for its input size: as stored
/// where the input is the table's size, else (DINOv2) the patch positions resized as
/// transformers' `interpolate_pos_encoding` does — bicubic, [`interpolate::bicubic`] — the
/// class position kept.
fn positions(n: &Names<'_>, cfg: &Config) -> Result<Vec<f32>> {
    let (h, lead) = (cfg.hidden, usize::from(cfg.family.has_class_token()));
    let (table, grid) = (cfg.table_grid(), cfg.grid());
    let stored = n.position_values(table * table + lead, h)?;
    if grid == table {
        return Ok(stored);
    }
    let (class, patches) = stored.split_at(lead * h);
    // `[table², hidden]` → channels first, resized, back to `[grid², hidden]`.
    let mut planes = vec![0f32; h * table * table];
    for (p, row) in patches.chunks_exact(h).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            planes[c * table * table + p] = v;
        }
    }
    let resized: Vec<Vec<f32>> = planes
        .chunks_exact(table * table)
        .map(|plane| interpolate::bicubic(plane, (table, table), (grid, grid)))
        .collect();
    let mut out = class.to_vec();
    for p in 0..grid * grid {
        out.extend(resized.iter().map(|plane| plane[p]));
    }
    Ok(out)
}

/// `values` (`[rows, hidden]`) on `n`'s device.
fn dev_positions(n: &Names<'_>, values: &[f32], cfg: &Config) -> Result<Tensor> {
    n.device()
        .from_f32(values, &[cfg.rows() as u64, cfg.hidden as u64])
}

/// Bidirectional multi-head self-attention with its output projection.
struct SelfAttention {
    query: Dense,
    key: Dense,
    value: Dense,
    output: Dense,
    params: AttentionParams,
}

impl SelfAttention {
    fn params(heads: usize, hidden: usize) -> AttentionParams {
        let head_dim = hidden / heads;
        AttentionParams {
            heads: heads as u32,
            kv_heads: heads as u32,
            head_dim: head_dim as u32,
            first_query_pos: 0,
            window: 0,
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: 0.0,
            mask: AttentionMask::Bidirectional,
            kv_dtype: DType::F32,
        }
    }

    fn forward(&self, x: &Tensor, spans: &[Span]) -> Result<Tensor> {
        let (q, k, v) = (
            self.query.forward(x)?,
            self.key.forward(x)?,
            self.value.forward(x)?,
        );
        let ctx = x.device().alloc(DType::F32, q.dims())?;
        for s in spans {
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

/// `act(h)`, elementwise.
pub(crate) fn activate(h: &Tensor, act: Act) -> Result<Tensor> {
    match act {
        Act::Gelu => h.activation(Activation::GeluErf),
        Act::GeluTanh => h.activation(Activation::GeluTanh),
        Act::QuickGelu => h.mul(&h.scale(1.702)?.activation(Activation::Sigmoid)?),
    }
}

/// The position-wise MLP: `fc2(act(fc1(x)))`.
struct Mlp {
    fc1: Dense,
    fc2: Dense,
    act: Act,
}

impl Mlp {
    fn load(n: &Names<'_>, fc1: &str, fc2: &str, cfg: &Config) -> Result<Mlp> {
        Ok(Mlp {
            fc1: Dense::load(n, fc1, cfg.hidden, cfg.intermediate)?,
            fc2: Dense::load(n, fc2, cfg.intermediate, cfg.hidden)?,
            act: cfg.act,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2
            .forward(&activate(&self.fc1.forward(x)?, self.act)?)
    }
}

/// A pre-norm block: `h = x + γ₁ ⊙ Attention(LN₁(x)); h + γ₂ ⊙ MLP(LN₂(h))`, with DINOv2's
/// per-channel layer scales `γ` (1 elsewhere).
struct Block {
    norm1: LayerNorm,
    attention: SelfAttention,
    scale1: Option<Tensor>,
    norm2: LayerNorm,
    mlp: Mlp,
    scale2: Option<Tensor>,
}

impl Block {
    fn load(n: &Names<'_>, cfg: &Config, i: usize) -> Result<Block> {
        let h = cfg.hidden;
        let b = n.block(i);
        let scale = |name: Option<String>| name.map(|s| n.vector(&s, h)).transpose();
        Ok(Block {
            norm1: LayerNorm::load(n, &b.norm1, cfg)?,
            attention: SelfAttention {
                query: Dense::load(n, &b.query, h, h)?,
                key: Dense::load(n, &b.key, h, h)?,
                value: Dense::load(n, &b.value, h, h)?,
                output: Dense::load(n, &b.output, h, h)?,
                params: SelfAttention::params(cfg.heads, h),
            },
            scale1: scale(b.scale1)?,
            norm2: LayerNorm::load(n, &b.norm2, cfg)?,
            mlp: Mlp::load(n, &b.fc1, &b.fc2, cfg)?,
            scale2: scale(b.scale2)?,
        })
    }

    fn forward(&self, x: &Tensor, spans: &[Span]) -> Result<Tensor> {
        let scaled = |y: Tensor, s: &Option<Tensor>| match s {
            Some(s) => y.mul(s),
            None => Ok(y),
        };
        let a = scaled(
            self.attention.forward(&self.norm1.forward(x)?, spans)?,
            &self.scale1,
        )?;
        let h = x.add(&a)?;
        let m = scaled(self.mlp.forward(&self.norm2.forward(&h)?)?, &self.scale2)?;
        h.add(&m)
    }
}

/// SigLIP's multi-head attention pooling (Lee et al. 2019, "PMA"): a learned probe attends to
/// the image's rows, then `p + MLP(LN(p))`.
struct AttentionPool {
    probe: Tensor,
    query: Dense,
    key: Dense,
    value: Dense,
    output: Dense,
    norm: LayerNorm,
    mlp: Mlp,
    params: AttentionParams,
}

impl AttentionPool {
    fn load(n: &Names<'_>, cfg: &Config) -> Result<AttentionPool> {
        let h = cfg.hidden;
        let probe = n.values("head.probe", h)?;
        let in_proj = n.matrix("head.attention.in_proj_weight", 3 * h, h)?;
        let in_bias = n.values("head.attention.in_proj_bias", 3 * h)?;
        let dev = in_proj.device().clone();
        let part = |i: usize| -> Result<Dense> {
            Ok(Dense {
                weight: in_proj.rows_range(i * h..(i + 1) * h)?,
                bias: Some(dev.from_f32(&in_bias[i * h..(i + 1) * h], &[h as u64])?),
            })
        };
        Ok(AttentionPool {
            probe: dev.from_f32(&probe, &[1, h as u64])?,
            query: part(0)?,
            key: part(1)?,
            value: part(2)?,
            output: Dense::load(n, "head.attention.out_proj", h, h)?,
            norm: LayerNorm::load(n, "head.layernorm", cfg)?,
            mlp: Mlp::load(n, "head.mlp.fc1", "head.mlp.fc2", cfg)?,
            params: SelfAttention::params(cfg.heads, h),
        })
    }

    /// One pooled row for the image whose final rows are `x`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let q = self.query.forward(&self.probe)?;
        let (k, v) = (self.key.forward(x)?, self.value.forward(x)?);
        let ctx = q.attention(&[k.desc(), v.desc()], &self.params)?;
        let p = self.output.forward(&ctx)?;
        p.add(&self.mlp.forward(&self.norm.forward(&p)?)?)
    }
}

/// The family's pooler over an image's final rows: what transformers calls `pooler_output`.
enum Head {
    /// ViT: `tanh(dense(class row))`.
    Tanh(Dense),
    /// CLIP: `LN(class row)` (the class row before the final norm, which CLIP keeps for it).
    ClassNorm(LayerNorm),
    /// DINOv2: the normed class row as it is.
    Class,
    /// SigLIP: attention pooling.
    Attention(Box<AttentionPool>),
}

/// A Vision Transformer encoder.
pub struct VisionTransformer {
    /// Hyper-parameters.
    pub cfg: Config,
    /// What an image must be, and how to make it from a picture.
    pub spec: ImageSpec,
    embedding: PatchEmbedding,
    /// CLIP's norm of the embeddings before the first block.
    pre_norm: Option<LayerNorm>,
    blocks: Vec<Block>,
    /// The norm of every final row (ViT, SigLIP, DINOv2; CLIP has none).
    final_norm: Option<LayerNorm>,
    head: Option<Head>,
}

impl VisionTransformer {
    /// Builds the tower of `names`'s checkpoint on its device.
    pub fn load(n: &Names<'_>, cfg: Config, spec: ImageSpec) -> Result<VisionTransformer> {
        let embedding = PatchEmbedding::load(n, &cfg)?;
        let norm = |name: &str| LayerNorm::load(n, name, &cfg);
        let blocks = (0..cfg.layers)
            .map(|i| Block::load(n, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let (pre_norm, final_norm, head) = match cfg.family {
            Family::Vit => {
                let pooler = if n.has("pooler.dense.weight") {
                    Some(Head::Tanh(Dense::load(
                        n,
                        "pooler.dense",
                        cfg.hidden,
                        cfg.hidden,
                    )?))
                } else {
                    None
                };
                (None, Some(norm("layernorm")?), pooler)
            }
            Family::Dinov2 => (None, Some(norm("layernorm")?), Some(Head::Class)),
            Family::Clip => (
                Some(norm("pre_layrnorm")?),
                None,
                Some(Head::ClassNorm(norm("post_layernorm")?)),
            ),
            Family::Siglip => {
                let head = if n.has("head.probe") {
                    Some(Head::Attention(Box::new(AttentionPool::load(n, &cfg)?)))
                } else {
                    None
                };
                (None, Some(norm("post_layernorm")?), head)
            }
        };
        Ok(VisionTransformer {
            cfg,
            spec,
            embedding,
            pre_norm,
            blocks,
            final_norm,
            head,
        })
    }

    /// What the model is, as the ABI says it. Its own pooling is the family's head
    /// ([`Pooling::Head`]) where the checkpoint has one, else the class row (SigLIP without a
    /// head: the mean).
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        let pooling = match (&self.head, c.family.has_class_token()) {
            (Some(_), _) => Pooling::Head,
            (None, true) => Pooling::First,
            (None, false) => Pooling::Mean,
        };
        ModelConfig {
            kind: ModelKind::Encoder,
            family: c.family.name().into(),
            vocab_size: 0,
            hidden: c.hidden as u32,
            layers: c.layers as u32,
            context_length: c.rows() as u32,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling,
            context_shape: [0, 0],
            image: ROption::RSome(self.spec),
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    /// The chunk's one image, checked against the spec, and the output it asks for.
    fn image<'a>(&self, chunk: &SeqChunk<'a>) -> Result<&'a [f32]> {
        let bad = |why: String| UError::invalid(format!("arch-vit: {why}"));
        let pixels = self.pixels(chunk, self.cfg.rows())?;
        match chunk.output {
            Output::Logits(_) | Output::Planes => Err(UError::unsupported(
                "arch-vit: an encoder produces hidden states and pooled vectors, not logits or \
                 feature maps",
            )),
            Output::Hidden { layer, .. } if layer as usize > self.cfg.layers => Err(bad(format!(
                "hidden state after layer {layer} of a {}-layer encoder",
                self.cfg.layers
            ))),
            Output::Pooled(Pooling::Head) if self.head.is_none() => Err(UError::unsupported(
                "arch-vit: the checkpoint has no pooling head (ask for the first row or the mean)",
            )),
            _ => Ok(pixels),
        }
    }

    /// For an image encoder built on the tower whose one output is every row of an image
    /// (LLaVA's projected rows, IDEFICS' context rows, `what` describing them in errors): the
    /// pixels of the chunks of `batch` that ask for them, each image `spec.rows` rows of
    /// `hidden`, the output buffer checked to fit.
    pub(crate) fn row_images<'a>(
        &self,
        batch: &[SeqChunk<'a>],
        (spec, hidden): (&ImageSpec, usize),
        out: usize,
        what: &str,
    ) -> Result<Vec<&'a [f32]>> {
        let layers = self.cfg.layers as u32;
        let mut images = Vec::with_capacity(batch.len());
        for chunk in batch {
            let pixels = self.pixels(chunk, spec.rows as usize)?;
            match chunk.output {
                Output::Nothing => {}
                Output::Hidden {
                    layer,
                    rows: Rows::All,
                } if layer == layers => images.push(pixels),
                other => {
                    return Err(UError::unsupported(format!(
                        "arch-vit: {what} (`Output::Hidden {{ layer: {layers}, rows: \
                         Rows::All }}`), not {other:?}"
                    )));
                }
            }
        }
        let floats = images.len() * spec.rows as usize * hidden;
        if out != floats {
            return Err(UError::invalid(format!(
                "arch-vit: the output buffer holds {out} floats, the batch asks for {floats}"
            )));
        }
        Ok(images)
    }

    /// What an image encoder built on the tower is, as the ABI says it: `family`, rows of
    /// `hidden` per image as `spec` says, the tower's `layers`.
    pub(crate) fn row_encoder_config(
        family: &str,
        hidden: usize,
        layers: usize,
        spec: ImageSpec,
    ) -> ModelConfig {
        ModelConfig {
            kind: ModelKind::Encoder,
            family: family.into(),
            vocab_size: 0,
            hidden: hidden as u32,
            layers: layers as u32,
            context_length: spec.rows,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Mean,
            context_shape: [0, 0],
            image: ROption::RSome(spec),
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    /// The pixels of the chunk's one image, checked against the spec, the image said to be
    /// `rows` rows; no extras.
    pub(crate) fn pixels<'a>(&self, chunk: &SeqChunk<'a>, rows: usize) -> Result<&'a [f32]> {
        let bad = |why: String| UError::invalid(format!("arch-vit: {why}"));
        let [Segment::Image(image)] = chunk.input.as_slice() else {
            return Err(bad(format!(
                "a chunk is one image segment (this one has {} segments{})",
                chunk.input.len(),
                if chunk.input.iter().any(|s| !matches!(s, Segment::Image(_))) {
                    ", not all images: the tower reads no tokens or embedding rows"
                } else {
                    ""
                }
            )));
        };
        let want = self.cfg.pixels();
        if image.pixels.len() != want {
            return Err(bad(format!(
                "an image of {} values; the model takes {}×{}×{} = {want}",
                image.pixels.len(),
                self.cfg.channels,
                self.cfg.input_size,
                self.cfg.input_size
            )));
        }
        if image.rows as usize != rows {
            return Err(bad(format!(
                "the image is said to be {} rows; it is {rows}",
                image.rows
            )));
        }
        if image.pixels.iter().any(|v| !v.is_finite()) {
            return Err(bad("the image holds non-finite values".into()));
        }
        let x = &chunk.extras;
        if !x.adapters.is_empty()
            || !x.steering.is_empty()
            || x.cross.is_some()
            || !x.conditioning.is_empty()
        {
            return Err(UError::unsupported(
                "arch-vit: the encoder applies no adapters, steering, cross-attention or \
                 conditioning",
            ));
        }
        Ok(image.pixels.as_slice())
    }

    /// The tower's states over `images` (one span of [`Config::rows`] rows each, in order):
    /// `states[0]` the embeddings (after CLIP's pre-norm) and `states[i + 1]` the rows after
    /// block `i`, up to `states[last]` (transformers' `hidden_states[..=last]`: no final norm).
    pub(crate) fn states(
        &self,
        images: &[&[f32]],
        last: usize,
    ) -> Result<(Vec<Tensor>, Vec<Span>)> {
        let rows = self.cfg.rows();
        let spans: Vec<Span> = (0..images.len())
            .map(|i| Span {
                offset: i * rows,
                len: rows,
            })
            .collect();
        let dev: &Device = self.embedding.positions.device();
        let x = dev.alloc(
            DType::F32,
            &[(rows * images.len()) as u64, self.cfg.hidden as u64],
        )?;
        self.embedding.forward(images, &x)?;
        let x = match &self.pre_norm {
            Some(norm) => norm.forward(&x)?,
            None => x,
        };
        let mut states = vec![x];
        for block in self.blocks.iter().take(last) {
            let x = block.forward(states.last().expect("embeddings first"), &spans)?;
            states.push(x);
        }
        Ok((states, spans))
    }

    /// Encodes every chunk of `batch` and writes the outputs they ask for into `out`, in batch
    /// order (see [`u_sdk::Model::forward`]).
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        let rows = self.cfg.rows();
        let mut images = Vec::with_capacity(batch.len());
        let mut floats = 0;
        for chunk in batch {
            images.push(self.image(chunk)?);
            floats += chunk.output.floats(rows, &config);
        }
        if out.len() != floats {
            return Err(UError::invalid(format!(
                "arch-vit: the output buffer holds {} floats, the batch asks for {floats}",
                out.len()
            )));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let hidden = self.cfg.hidden;
        // `states[0]` is the embeddings' output and `states[i + 1]` the state after block `i`.
        let (states, spans) = self.states(&images, self.cfg.layers)?;
        let last = states.last().expect("embeddings first");
        let normed = match &self.final_norm {
            Some(norm) => norm.forward(last)?,
            None => last.clone(),
        };
        let layers = self.cfg.layers;
        let mut read: Vec<Option<Vec<f32>>> = vec![None; layers + 1];
        let mut at = 0;
        for (chunk, span) in batch.iter().zip(&spans) {
            let n = chunk.output.floats(rows, &config);
            let dst = &mut out[at..at + n];
            at += n;
            let layer = match chunk.output {
                Output::Nothing | Output::Logits(_) | Output::Planes => continue,
                Output::Pooled(Pooling::Head) => {
                    let image = span.offset..span.offset + span.len;
                    let pooled = match self.head.as_ref() {
                        Some(Head::Tanh(dense)) => dense
                            .forward(&normed.rows_range(span.offset..span.offset + 1)?)?
                            .activation(Activation::Tanh)?,
                        Some(Head::ClassNorm(norm)) => {
                            norm.forward(&last.rows_range(span.offset..span.offset + 1)?)?
                        }
                        Some(Head::Class) => normed.rows_range(span.offset..span.offset + 1)?,
                        Some(Head::Attention(pool)) => pool.forward(&normed.rows_range(image)?)?,
                        None => {
                            return Err(UError::unsupported("arch-vit: no pooling head"));
                        }
                    };
                    pooled.read_into(dst)?;
                    continue;
                }
                Output::Hidden { layer, .. } if (layer as usize) < layers => layer as usize + 1,
                _ => layers,
            };
            let all = if layer == layers {
                &normed
            } else {
                &states[layer]
            };
            if read[layer].is_none() {
                read[layer] = Some(all.to_vec()?);
            }
            let all = read[layer].as_deref().unwrap_or_default();
            let image = &all[span.offset * hidden..(span.offset + span.len) * hidden];
            match chunk.output {
                Output::Hidden {
                    rows: Rows::All, ..
                } => dst.copy_from_slice(image),
                Output::Hidden {
                    rows: Rows::Last, ..
                } => dst.copy_from_slice(&image[image.len() - hidden..]),
                Output::Pooled(p) => p.pool(image, hidden, dst)?,
                Output::Nothing | Output::Logits(_) | Output::Planes => {}
            }
        }
        Ok(())
    }
}
