//! The encoder: `Embeddings`, `SelfAttention`, `FeedForward`, `Layer`, and `Bert` that stacks
//! them.
//!
//! Every chunk of a batch is one whole input: its rows run together through the projections
//! (one matmul per weight per pass) and attend to each other only, in both directions.

use crate::{
    config::Config,
    naming::{Layout, blk},
};
use abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ErrorKind, ModelConfig, ModelKind, Output,
    Result, Rows, Segment, SeqChunk, UError, WeightSetBox,
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

/// `y = x·Wᵀ + b` with the weight as stored.
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    fn load(n: &Names<'_>, name: &str, inputs: usize, outputs: usize) -> Result<Dense> {
        let weight = n.tensor(&format!("{name}.weight"))?;
        if weight.dims() != [outputs as u64, inputs as u64] {
            return Err(UError::invalid(format!(
                "arch-bert: {} has shape {:?}, expected [{outputs}, {inputs}]",
                n.stored(&format!("{name}.weight")),
                weight.dims()
            )));
        }
        Ok(Dense {
            weight,
            bias: n.vector(&format!("{name}.bias"), outputs)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        y.add_assign(&self.bias)?;
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

/// Token, position and segment embeddings, summed and normalised.
struct Embeddings {
    word: Tensor,
    position: Tensor,
    segment: Tensor,
    norm: LayerNorm,
}

impl Embeddings {
    /// `LayerNorm(word + position + segment)` for every row: token ids through the word
    /// table, embedding rows as they are; positions restart at 0 in every chunk, and the
    /// chunk's `k`-th input segment is BERT segment (token type) `k` — a sentence pair is two
    /// token segments.
    fn forward(&self, batch: &[SeqChunk<'_>], spans: &[Span], hidden: usize) -> Result<Tensor> {
        let dev = self.word.device();
        let rows: usize = spans.iter().map(|s| s.len).sum();
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
                Segment::Image(_) => {
                    return Err(UError::unsupported("arch-bert: images are not read"));
                }
            }
            at += n;
        }
        let positions: Vec<i32> = spans.iter().flat_map(|s| 0..s.len as i32).collect();
        let positions = dev.from_i32(&positions, &[rows as u64])?;
        let x = words.add(&self.position.get_rows(&positions)?)?;
        x.add_assign(
            &self
                .segment
                .get_rows(&dev.from_i32(&segment_ids, &[rows as u64])?)?,
        )?;
        self.norm.forward(&x)
    }
}

/// Bidirectional multi-head self-attention with its output projection.
struct SelfAttention {
    query: Dense,
    key: Dense,
    value: Dense,
    output: Dense,
    heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    fn forward(&self, x: &Tensor, spans: &[Span]) -> Result<Tensor> {
        let (q, k, v) = (
            self.query.forward(x)?,
            self.key.forward(x)?,
            self.value.forward(x)?,
        );
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

/// The position-wise feed-forward network: `down(gelu(up(x)))`.
struct FeedForward {
    up: Dense,
    down: Dense,
    act: Activation,
}

impl FeedForward {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down
            .forward(&self.up.forward(x)?.activation(self.act)?)
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
        let p = |t: &str| blk(i, t);
        let h = cfg.hidden;
        Ok(Layer {
            attention: SelfAttention {
                query: Dense::load(n, &p("attn_q"), h, h)?,
                key: Dense::load(n, &p("attn_k"), h, h)?,
                value: Dense::load(n, &p("attn_v"), h, h)?,
                output: Dense::load(n, &p("attn_output"), h, h)?,
                heads: cfg.heads,
                head_dim: h / cfg.heads,
            },
            attention_norm: LayerNorm::load(n, &p("attn_output_norm"), cfg)?,
            ffn: FeedForward {
                up: Dense::load(n, &p("ffn_up"), h, cfg.intermediate)?,
                down: Dense::load(n, &p("ffn_down"), cfg.intermediate, h)?,
                act: if cfg.tanh_gelu {
                    Activation::GeluTanh
                } else {
                    Activation::GeluErf
                },
            },
            output_norm: LayerNorm::load(n, &p("layer_output_norm"), cfg)?,
        })
    }

    fn forward(&self, x: &Tensor, spans: &[Span]) -> Result<Tensor> {
        let h = self
            .attention_norm
            .forward(&x.add(&self.attention.forward(x, spans)?)?)?;
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
        let position = n.tensor("position_embd.weight")?;
        let segment = n.tensor("token_types.weight")?;
        let h = cfg.hidden as u64;
        if word.dims() != [cfg.vocab_size as u64, h]
            || position.dims() != [cfg.max_positions as u64, h]
            || !matches!(segment.dims(), [rows, w] if *rows > 0 && *w == h)
        {
            return Err(UError::invalid(format!(
                "arch-bert: embedding tables {:?}, {:?}, {:?} do not fit vocabulary {}, {} \
                 positions and hidden size {h}",
                word.dims(),
                position.dims(),
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
            family: "bert".into(),
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
                Segment::Image(_) => {
                    return Err(UError::unsupported(
                        "arch-bert: the model reads token ids and embedding rows, not images",
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
            Output::Logits(_) => {
                return Err(UError::unsupported(
                    "arch-bert: an encoder produces hidden states and pooled vectors, not logits",
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
        let mut states = vec![self.embeddings.forward(batch, &spans, hidden)?];
        for layer in &self.layers {
            let x = layer.forward(states.last().expect("embeddings first"), &spans)?;
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
                Output::Nothing | Output::Logits(_) => {}
            }
            at += n;
        }
        Ok(())
    }
}
