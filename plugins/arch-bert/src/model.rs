//! The encoder: `Embeddings`, `SelfAttention`, `FeedForward`, `Layer`, and `Bert` that stacks
//! them.
//!
//! Every chunk of a batch is one whole input: its rows run together through the projections
//! (one matmul per weight per pass) and attend to each other only, in both directions.
//! Positions restart at 0 in every chunk, whether they enter as a learned table (BERT) or as
//! rotary embeddings of the queries and keys (nomic-bert).

use crate::{
    config::{Config, FeedForwardKind, Positions},
    naming::{Layout, blk},
};
use abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ErrorKind, ModelConfig, ModelKind, Output,
    Result, RopeParams, RopeStyle, Rows, Segment, SeqChunk, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// The tensors of a checkpoint, read by llama.cpp's names whatever its [`Layout`].
struct Names<'w> {
    weights: &'w WeightSetBox,
    layout: Layout,
    device: Device,
}

impl Names<'_> {
    fn stored(&self, name: &str) -> String {
        self.layout.stored(name)
    }

    /// Whether the checkpoint stores `name`.
    fn has(&self, name: &str) -> bool {
        self.weights
            .tensor(self.stored(name).as_str().into())
            .into_result()
            .is_ok()
    }

    /// `name` in the backend, as stored.
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.device
            .import_weight(self.weights, &self.stored(name), None)
            .map_err(|e| UError::new(e.kind, format!("arch-bert: {}", e.message)))
    }

    /// `name` as an `F32` vector of `len` values.
    fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        let view = self
            .weights
            .tensor(self.stored(name).as_str().into())
            .into_result()?;
        let stored = self.stored(name);
        let v = u_sdk::quant::dequantize_view(&view)
            .map_err(|e| UError::invalid(format!("arch-bert: {stored}: {e}")))?;
        if v.len() != len {
            return Err(UError::invalid(format!(
                "arch-bert: {stored} has {} values, expected {len}",
                v.len()
            )));
        }
        self.device.from_f32(&v, &[len as u64])
    }
}

/// `y = x·Wᵀ (+ b)` with the weight as stored; BERT's projections have biases, nomic-bert's
/// none.
struct Dense {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Dense {
    /// `name.weight` (`[outputs, inputs]`) and its `name.bias`, which must be there.
    fn load(n: &Names<'_>, name: &str, inputs: usize, outputs: usize) -> Result<Dense> {
        let mut dense = Dense::load_unbiased(n, name, inputs, outputs)?;
        dense.bias = Some(n.vector(&format!("{name}.bias"), outputs)?);
        Ok(dense)
    }

    /// `name.weight` (`[outputs, inputs]`), with `name.bias` when the checkpoint has one.
    fn load_unbiased(n: &Names<'_>, name: &str, inputs: usize, outputs: usize) -> Result<Dense> {
        let weight = n.tensor(&format!("{name}.weight"))?;
        if weight.dims() != [outputs as u64, inputs as u64] {
            return Err(UError::invalid(format!(
                "arch-bert: {} has shape {:?}, expected [{outputs}, {inputs}]",
                n.stored(&format!("{name}.weight")),
                weight.dims()
            )));
        }
        let bias = format!("{name}.bias");
        let bias = match n.has(&bias) {
            true => Some(n.vector(&bias, outputs)?),
            false => None,
        };
        Ok(Dense { weight, bias })
    }

    /// Query, key and value projections from one fused `[3·hidden, hidden]` weight (rows:
    /// queries, then keys, then values) and its optional fused bias.
    fn load_fused_qkv(n: &Names<'_>, name: &str, hidden: usize) -> Result<[Dense; 3]> {
        let fused = Dense::load_unbiased(n, name, hidden, 3 * hidden)?;
        let part = |i: usize| -> Result<Dense> {
            let rows = i * hidden..(i + 1) * hidden;
            Ok(Dense {
                weight: fused.weight.rows_range(rows.clone())?,
                bias: match &fused.bias {
                    Some(b) => Some(b.reshape(&[3, hidden as u64])?.index(i)?),
                    None => None,
                },
            })
        };
        Ok([part(0)?, part(1)?, part(2)?])
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        if let Some(bias) = &self.bias {
            y.add_assign(bias)?;
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
    fn load(n: &Names<'_>, name: &str, cfg: &Config) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: n.vector(&format!("{name}.weight"), cfg.hidden)?,
            bias: n.vector(&format!("{name}.bias"), cfg.hidden)?,
            eps: cfg.eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight, &self.bias, self.eps)
    }
}

/// One chunk's rows inside the batch.
#[derive(Clone, Copy, Debug)]
struct Span {
    offset: usize,
    len: usize,
}

/// Token, position (when learned) and segment embeddings, summed and normalised.
struct Embeddings {
    word: Tensor,
    position: Option<Tensor>,
    segment: Tensor,
    norm: LayerNorm,
}

impl Embeddings {
    /// `LayerNorm(word + position + segment)` for every row: token ids through the word
    /// table, embedding rows as they are; `positions` index the learned table (rotary models
    /// have none), and the chunk's `k`-th input segment is BERT segment (token type) `k` — a
    /// sentence pair is two token segments.
    fn forward(&self, batch: &[SeqChunk<'_>], positions: &Tensor, hidden: usize) -> Result<Tensor> {
        let dev = self.word.device();
        let rows = positions.dims().iter().product::<u64>() as usize;
        let words = dev.alloc(DType::F32, &[rows as u64, hidden as u64])?;
        let types = self.segment.rows() as i32;
        let mut segment_ids = Vec::with_capacity(rows);
        let mut at = 0;
        for chunk in batch {
            for (k, segment) in chunk.input.iter().enumerate() {
                let n = segment.rows(hidden);
                segment_ids.extend(std::iter::repeat_n((k as i32).min(types - 1), n));
            }
        }
        for segment in batch.iter().flat_map(|c| c.input.iter()) {
            let n = segment.rows(hidden);
            let dst = words.rows_range(at..at + n)?;
            match segment {
                Segment::Tokens(t) => {
                    let ids: Vec<i32> = t.iter().map(|&t| t as i32).collect();
                    self.word
                        .get_rows(&dev.from_i32(&ids, &[n as u64])?)?
                        .copy_into(None, &dst)?;
                }
                Segment::Embeddings(e) => dst.write(e)?,
                Segment::Image(_) | Segment::Planes(_) => {
                    return Err(UError::unsupported(
                        "arch-bert: images and feature maps are not read",
                    ));
                }
            }
            at += n;
        }
        if let Some(table) = &self.position {
            words.add_assign(&table.get_rows(positions)?)?;
        }
        words.add_assign(
            &self
                .segment
                .get_rows(&dev.from_i32(&segment_ids, &[rows as u64])?)?,
        )?;
        self.norm.forward(&words)
    }
}

/// Bidirectional multi-head self-attention with its output projection, queries and keys
/// rotated by position when the model's positions are rotary.
struct SelfAttention {
    query: Dense,
    key: Dense,
    value: Dense,
    output: Dense,
    rope: Option<RopeParams>,
    heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    /// Separate `attn_q`/`attn_k`/`attn_v` projections (BERT), or one fused `attn_qkv`
    /// (nomic-bert); biases where the checkpoint has them, which BERT's must.
    fn load(n: &Names<'_>, cfg: &Config, i: usize) -> Result<SelfAttention> {
        let h = cfg.hidden;
        let head_dim = h / cfg.heads;
        let biased = cfg.positions == Positions::Learned;
        let dense = |t: &str, inputs, outputs| match biased {
            true => Dense::load(n, &blk(i, t), inputs, outputs),
            false => Dense::load_unbiased(n, &blk(i, t), inputs, outputs),
        };
        let [query, key, value] = match n.has(&format!("{}.weight", blk(i, "attn_qkv"))) {
            true => Dense::load_fused_qkv(n, &blk(i, "attn_qkv"), h)?,
            false => [
                dense("attn_q", h, h)?,
                dense("attn_k", h, h)?,
                dense("attn_v", h, h)?,
            ],
        };
        let rope = match cfg.positions {
            Positions::Learned => None,
            Positions::Rotary { base } => Some(RopeParams {
                style: RopeStyle::NeoX,
                rotary_dim: head_dim as u32,
                head_dim: head_dim as u32,
                heads: cfg.heads as u32,
                inv_freq: (0..head_dim / 2)
                    .map(|j| 1.0 / base.powf((2 * j) as f32 / head_dim as f32))
                    .collect(),
                attn_factor: 1.0,
            }),
        };
        Ok(SelfAttention {
            query,
            key,
            value,
            output: dense("attn_output", h, h)?,
            rope,
            heads: cfg.heads,
            head_dim,
        })
    }

    fn forward(&self, x: &Tensor, positions: &Tensor, spans: &[Span]) -> Result<Tensor> {
        let (q, k, v) = (
            self.query.forward(x)?,
            self.key.forward(x)?,
            self.value.forward(x)?,
        );
        if let Some(rope) = &self.rope {
            q.rope_assign(positions, rope)?;
            k.rope_assign(positions, rope)?;
        }
        let ctx = x.device().alloc(DType::F32, q.dims())?;
        let params = AttentionParams {
            heads: self.heads as u32,
            kv_heads: self.heads as u32,
            head_dim: self.head_dim as u32,
            first_query_pos: 0,
            window: 0,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            softcap: 0.0,
            mask: AttentionMask::Bidirectional,
            kv_dtype: DType::F32,
        };
        for s in spans.iter().filter(|s| s.len > 0) {
            let rows = s.offset..s.offset + s.len;
            let (kr, vr) = (k.rows_range(rows.clone())?, v.rows_range(rows.clone())?);
            q.rows_range(rows.clone())?.attention_into(
                &[kr.desc(), vr.desc()],
                &params,
                &ctx.rows_range(rows)?,
            )?;
        }
        self.output.forward(&ctx)
    }
}

/// The position-wise feed-forward network: `down(GELU(up(x)))` (BERT) or
/// `down(SiLU(gate(x)) ⊙ up(x))` (nomic-bert).
struct FeedForward {
    gate: Option<Dense>,
    up: Dense,
    down: Dense,
    act: Activation,
}

impl FeedForward {
    fn load(n: &Names<'_>, cfg: &Config, i: usize) -> Result<FeedForward> {
        let (h, f) = (cfg.hidden, cfg.intermediate);
        let p = |t: &str| blk(i, t);
        Ok(match cfg.feed_forward {
            FeedForwardKind::Gelu | FeedForwardKind::GeluTanh => FeedForward {
                gate: None,
                up: Dense::load(n, &p("ffn_up"), h, f)?,
                down: Dense::load(n, &p("ffn_down"), f, h)?,
                act: match cfg.feed_forward {
                    FeedForwardKind::GeluTanh => Activation::GeluTanh,
                    _ => Activation::GeluErf,
                },
            },
            FeedForwardKind::SwiGlu => FeedForward {
                gate: Some(Dense::load_unbiased(n, &p("ffn_gate"), h, f)?),
                up: Dense::load_unbiased(n, &p("ffn_up"), h, f)?,
                down: Dense::load_unbiased(n, &p("ffn_down"), f, h)?,
                act: Activation::Silu,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let up = self.up.forward(x)?;
        let inner = match &self.gate {
            Some(gate) => gate.forward(x)?.gated(self.act, &up)?,
            None => up.activation(self.act)?,
        };
        self.down.forward(&inner)
    }
}

/// A post-norm encoder layer: `h = LN(x + Attention(x)); LN(h + FFN(h))`.
struct Layer {
    attention: SelfAttention,
    attention_norm: LayerNorm,
    ffn: FeedForward,
    output_norm: LayerNorm,
}

impl Layer {
    fn load(n: &Names<'_>, cfg: &Config, i: usize) -> Result<Layer> {
        Ok(Layer {
            attention: SelfAttention::load(n, cfg, i)?,
            attention_norm: LayerNorm::load(n, &blk(i, "attn_output_norm"), cfg)?,
            ffn: FeedForward::load(n, cfg, i)?,
            output_norm: LayerNorm::load(n, &blk(i, "layer_output_norm"), cfg)?,
        })
    }

    fn forward(&self, x: &Tensor, positions: &Tensor, spans: &[Span]) -> Result<Tensor> {
        let h = self
            .attention_norm
            .forward(&x.add(&self.attention.forward(x, positions, spans)?)?)?;
        self.output_norm.forward(&h.add(&self.ffn.forward(&h)?)?)
    }
}

/// A BERT-family encoder.
pub struct Bert {
    /// Hyper-parameters.
    pub cfg: Config,
    embeddings: Embeddings,
    layers: Vec<Layer>,
}

impl Bert {
    /// Builds the encoder of `weights` (a Hugging Face checkpoint or a llama.cpp GGUF file,
    /// see [`crate::naming`]) on `device`.
    pub fn load(weights: &WeightSetBox, device: Device) -> Result<Bert> {
        let layout = Layout::of(weights)?;
        let cfg = Config::from_weights(weights)?;
        let n = Names {
            weights,
            layout,
            device,
        };
        let word = n.tensor("token_embd.weight")?;
        let position = match cfg.positions {
            Positions::Learned => Some(n.tensor("position_embd.weight")?),
            Positions::Rotary { .. } => None,
        };
        let segment = n.tensor("token_types.weight")?;
        let h = cfg.hidden as u64;
        if word.dims() != [cfg.vocab_size as u64, h]
            || position
                .as_ref()
                .is_some_and(|p| p.dims() != [cfg.max_positions as u64, h])
            || !matches!(segment.dims(), [rows, w] if *rows > 0 && *w == h)
        {
            return Err(UError::invalid(format!(
                "arch-bert: embedding tables {:?}, {:?}, {:?} do not fit vocabulary {}, {} \
                 positions and hidden size {h}",
                word.dims(),
                position.as_ref().map(Tensor::dims),
                segment.dims(),
                cfg.vocab_size,
                cfg.max_positions
            )));
        }
        let embeddings = Embeddings {
            word,
            position,
            segment,
            norm: LayerNorm::load(&n, "token_embd_norm", &cfg)?,
        };
        let layers = (0..cfg.layers)
            .map(|i| Layer::load(&n, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            cfg,
            embeddings,
            layers,
        })
    }

    /// What the model is, as the ABI says it.
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        ModelConfig {
            kind: ModelKind::Encoder,
            family: c.family.into(),
            vocab_size: c.vocab_size as u32,
            hidden: c.hidden as u32,
            layers: c.layers as u32,
            context_length: c.context_length as u32,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: c.pooling,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    fn check(&self, chunk: &SeqChunk<'_>) -> Result<usize> {
        let (hidden, vocab) = (self.cfg.hidden, self.cfg.vocab_size);
        let bad = |why: String| UError::invalid(format!("arch-bert: {why}"));
        for segment in chunk.input.iter() {
            match segment {
                Segment::Tokens(t) => {
                    if let Some(&id) = t.iter().find(|&&t| t as usize >= vocab) {
                        return Err(bad(format!(
                            "token {id} is outside the vocabulary of {vocab}"
                        )));
                    }
                }
                Segment::Embeddings(e) if !e.len().is_multiple_of(hidden) => {
                    return Err(bad(format!(
                        "{} embedding values are not whole rows of {hidden}",
                        e.len()
                    )));
                }
                Segment::Embeddings(_) => {}
                Segment::Image(_) | Segment::Planes(_) => {
                    return Err(UError::unsupported(
                        "arch-bert: the model reads token ids and embedding rows, not images or \
                         feature maps",
                    ));
                }
            }
        }
        let x = &chunk.extras;
        if !x.adapters.is_empty()
            || !x.steering.is_empty()
            || x.cross.is_some()
            || !x.conditioning.is_empty()
        {
            return Err(UError::unsupported(
                "arch-bert: the encoder applies no adapters, steering, cross-attention or \
                 conditioning",
            ));
        }
        let rows = chunk.rows(hidden);
        match chunk.output {
            Output::Logits(_) | Output::Planes => {
                return Err(UError::unsupported(
                    "arch-bert: an encoder produces hidden states and pooled vectors, not logits \
                     or feature maps",
                ));
            }
            Output::Hidden { layer, .. } if layer as usize > self.cfg.layers => {
                return Err(bad(format!(
                    "hidden state after layer {layer} of a {}-layer encoder",
                    self.cfg.layers
                )));
            }
            Output::Nothing => {}
            _ if rows == 0 => return Err(bad("asks for output of no input".into())),
            _ => {}
        }
        if rows > self.cfg.context_length {
            return Err(UError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "arch-bert: {rows} rows, past the encoder's {} positions",
                    self.cfg.context_length
                ),
            ));
        }
        Ok(rows)
    }

    /// Encodes every chunk of `batch` and writes the outputs they ask for into `out`, in batch
    /// order (see [`u_sdk::Model::forward`]).
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        let mut spans = Vec::with_capacity(batch.len());
        let (mut offset, mut floats) = (0, 0);
        for chunk in batch {
            let len = self.check(chunk)?;
            floats += chunk.output.floats(len, &config);
            spans.push(Span { offset, len });
            offset += len;
        }
        if out.len() != floats {
            return Err(UError::invalid(format!(
                "arch-bert: the output buffer holds {} floats, the batch asks for {floats}",
                out.len()
            )));
        }
        if offset == 0 {
            return Ok(());
        }
        let hidden = self.cfg.hidden;
        let positions: Vec<i32> = spans.iter().flat_map(|s| 0..s.len as i32).collect();
        let positions = self
            .embeddings
            .word
            .device()
            .from_i32(&positions, &[offset as u64])?;
        let mut states = vec![self.embeddings.forward(batch, &positions, hidden)?];
        for layer in &self.layers {
            let x = layer.forward(states.last().expect("embeddings first"), &positions, &spans)?;
            states.push(x);
        }
        // `states[0]` is the embeddings' output and `states[i + 1]` the state after block `i`;
        // the last is the final state (BERT has no final norm). Only the states some chunk asks
        // for are read back.
        let mut read: Vec<Option<Vec<f32>>> = vec![None; states.len()];
        let mut at = 0;
        for (chunk, span) in batch.iter().zip(&spans) {
            let layer = match chunk.output {
                Output::Nothing => continue,
                Output::Hidden { layer, .. } => (layer as usize + 1).min(self.cfg.layers),
                _ => self.cfg.layers,
            };
            if read[layer].is_none() {
                read[layer] = Some(states[layer].to_vec()?);
            }
            let all = read[layer].as_deref().unwrap_or_default();
            let rows = &all[span.offset * hidden..(span.offset + span.len) * hidden];
            let n = chunk.output.floats(span.len, &config);
            let dst = &mut out[at..at + n];
            match chunk.output {
                Output::Hidden {
                    rows: Rows::All, ..
                } => dst.copy_from_slice(rows),
                Output::Hidden {
                    rows: Rows::Last, ..
                } => dst.copy_from_slice(&rows[rows.len() - hidden..]),
                Output::Pooled(p) => p.pool(rows, hidden, dst)?,
                Output::Nothing | Output::Logits(_) | Output::Planes => {}
            }
            at += n;
        }
        Ok(())
    }
}
