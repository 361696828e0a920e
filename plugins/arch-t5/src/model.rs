//! The encoder: `RelativePositions`, `SelfAttention`, `FeedForward`, `Block`, and `T5Encoder`
//! that stacks them.
//!
//! Every chunk of a batch is one whole text: its rows run together through the projections
//! (one matmul per weight per pass) and attend, bidirectionally, to the rows of their own text
//! only, each head with the relative-position bias of its text's length.

use crate::config::{Config, FeedForwardKind};
use abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, ModelConfig, ModelKind, Pooling, Result, SeqChunk, UError,
    WeightSetBox,
    encoder::{TextBatch, TextSpan},
    nn::{Device, Tensor},
};

/// A checkpoint's tensors, read into the backend.
struct Weights<'w> {
    weights: &'w WeightSetBox,
    device: Device,
}

impl Weights<'_> {
    /// `name` as a `[rows, cols]` matrix in the backend, as stored.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let t = self
            .device
            .import_weight(self.weights, name, None)
            .map_err(|e| UError::new(e.kind, format!("arch-t5: {}", e.message)))?;
        if t.dims() != [rows as u64, cols as u64] {
            return Err(UError::invalid(format!(
                "arch-t5: {name} has shape {:?}, expected [{rows}, {cols}]",
                t.dims()
            )));
        }
        Ok(t)
    }

    /// `name` as `F32` values on the host, `len` of them.
    fn values(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let view = self.weights.tensor(name.into()).into_result()?;
        let v = u_sdk::quant::dequantize_view(&view)
            .map_err(|e| UError::invalid(format!("arch-t5: {name}: {e}")))?;
        match v.len() == len {
            true => Ok(v),
            false => Err(UError::invalid(format!(
                "arch-t5: {name} has {} values, expected {len}",
                v.len()
            ))),
        }
    }

    /// `name` as an `F32` vector of `len` values in the backend.
    fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        self.device
            .from_f32(&self.values(name, len)?, &[len as u64])
    }
}

/// T5's layer norm: `x / rms(x) · weight`, no mean subtracted, no bias.
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(w: &Weights<'_>, name: &str, cfg: &Config) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: w.vector(&format!("{name}.weight"), cfg.hidden)?,
            eps: cfg.eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.weight, self.eps)
    }
}

/// The bucket of the distance `distance` (`k − q`) among `buckets` (keys after the query in
/// the upper half), as transformers' `_relative_position_bucket` computes it in `f32`: exact
/// below a quarter of the buckets, logarithmic up to `max_distance`, the last bucket past it.
pub fn relative_bucket(distance: i64, buckets: usize, max_distance: usize) -> usize {
    let half = buckets / 2;
    let exact = half / 2;
    let side = if distance > 0 { half } else { 0 };
    let d = distance.unsigned_abs() as usize;
    if d < exact {
        return side + d;
    }
    let ratio = (d as f32 / exact as f32).ln() / ((max_distance as f64 / exact as f64).ln() as f32);
    let log = exact + (ratio * (half - exact) as f32) as usize;
    side + log.min(half - 1)
}

/// The bucketed relative-position bias every block's attention adds to its scores (learned
/// once, in the first block): `bias[h][q][k] = table[bucket(k − q)][h]`.
struct RelativePositions {
    /// `[buckets, heads]`, row-major.
    table: Vec<f32>,
    heads: usize,
    buckets: usize,
    max_distance: usize,
}

impl RelativePositions {
    /// The bucket of the distance `k − q` (see [`relative_bucket`]).
    fn bucket(&self, distance: i64) -> usize {
        relative_bucket(distance, self.buckets, self.max_distance)
    }

    /// The bias of each head over a text of `n` rows, `[n, n]` each, in the backend.
    fn biases(&self, device: &Device, n: usize) -> Result<Vec<Tensor>> {
        let buckets: Vec<usize> = (0..n * n)
            .map(|i| self.bucket((i % n) as i64 - (i / n) as i64))
            .collect();
        (0..self.heads)
            .map(|h| {
                let bias: Vec<f32> = buckets
                    .iter()
                    .map(|b| self.table[b * self.heads + h])
                    .collect();
                device.from_f32(&bias, &[n as u64, n as u64])
            })
            .collect()
    }
}

/// Multi-head self-attention without score scaling (T5 folds it into its initialisation) and
/// without biases in its projections.
struct SelfAttention {
    query: Tensor,
    key: Tensor,
    value: Tensor,
    output: Tensor,
    heads: usize,
    head_dim: usize,
}

impl SelfAttention {
    fn load(w: &Weights<'_>, prefix: &str, cfg: &Config) -> Result<SelfAttention> {
        let inner = cfg.heads * cfg.head_dim;
        let m = |t: &str, rows, cols| w.matrix(&format!("{prefix}{t}.weight"), rows, cols);
        Ok(SelfAttention {
            query: m("q", inner, cfg.hidden)?,
            key: m("k", inner, cfg.hidden)?,
            value: m("v", inner, cfg.hidden)?,
            output: m("o", cfg.hidden, inner)?,
            heads: cfg.heads,
            head_dim: cfg.head_dim,
        })
    }

    /// `o(concat_h softmax(q_h·k_hᵀ + bias_h)·v_h)` over each text's rows (`spans`, with the
    /// biases of their lengths).
    fn forward(&self, x: &Tensor, spans: &[(TextSpan, &[Tensor])]) -> Result<Tensor> {
        let (q, k, v) = (
            x.matmul_t(&self.query)?,
            x.matmul_t(&self.key)?,
            x.matmul_t(&self.value)?,
        );
        let mut texts = Vec::with_capacity(spans.len());
        for (span, biases) in spans {
            let rows = span.offset..span.offset + span.len;
            let transposed = |t: &Tensor| t.rows_range(rows.clone()).and_then(|r| r.transpose());
            let (qt, kt, vt) = (transposed(&q)?, transposed(&k)?, transposed(&v)?);
            let mut heads = Vec::with_capacity(self.heads);
            for (h, bias) in biases.iter().enumerate() {
                let dims = h * self.head_dim..(h + 1) * self.head_dim;
                let qh = qt.rows_range(dims.clone())?.transpose()?;
                let kh = kt.rows_range(dims.clone())?.transpose()?;
                let scores = qh.matmul_t(&kh)?;
                scores.add_assign(bias)?;
                scores.softmax_assign()?;
                heads.push(scores.matmul_t(&vt.rows_range(dims)?)?.transpose()?);
            }
            texts.push(Tensor::concat(&heads.iter().collect::<Vec<_>>())?.transpose()?);
        }
        Tensor::concat(&texts.iter().collect::<Vec<_>>())?.matmul_t(&self.output)
    }
}

/// The position-wise feed-forward network.
enum FeedForward {
    /// `wo(relu(wi(x)))`.
    Relu { wi: Tensor, wo: Tensor },
    /// `wo(gelu_tanh(wi_0(x)) ⊙ wi_1(x))`.
    GatedGelu {
        wi_0: Tensor,
        wi_1: Tensor,
        wo: Tensor,
    },
}

impl FeedForward {
    fn load(w: &Weights<'_>, prefix: &str, cfg: &Config) -> Result<FeedForward> {
        let (h, f) = (cfg.hidden, cfg.intermediate);
        let m = |t: &str, rows, cols| w.matrix(&format!("{prefix}{t}.weight"), rows, cols);
        Ok(match cfg.feed_forward {
            FeedForwardKind::Relu => FeedForward::Relu {
                wi: m("wi", f, h)?,
                wo: m("wo", h, f)?,
            },
            FeedForwardKind::GatedGelu => FeedForward::GatedGelu {
                wi_0: m("wi_0", f, h)?,
                wi_1: m("wi_1", f, h)?,
                wo: m("wo", h, f)?,
            },
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            FeedForward::Relu { wi, wo } => {
                x.matmul_t(wi)?.activation(Activation::Relu)?.matmul_t(wo)
            }
            FeedForward::GatedGelu { wi_0, wi_1, wo } => x
                .matmul_t(wi_0)?
                .gated(Activation::GeluTanh, &x.matmul_t(wi_1)?)?
                .matmul_t(wo),
        }
    }
}

/// A pre-norm block: `h = x + Attention(norm₁(x)); h + FF(norm₂(h))`.
struct Block {
    norm1: RmsNorm,
    attention: SelfAttention,
    norm2: RmsNorm,
    feed_forward: FeedForward,
}

impl Block {
    fn load(w: &Weights<'_>, cfg: &Config, i: usize) -> Result<Block> {
        let p = format!("encoder.block.{i}.layer.");
        Ok(Block {
            norm1: RmsNorm::load(w, &format!("{p}0.layer_norm"), cfg)?,
            attention: SelfAttention::load(w, &format!("{p}0.SelfAttention."), cfg)?,
            norm2: RmsNorm::load(w, &format!("{p}1.layer_norm"), cfg)?,
            feed_forward: FeedForward::load(w, &format!("{p}1.DenseReluDense."), cfg)?,
        })
    }

    fn forward(&self, x: &Tensor, spans: &[(TextSpan, &[Tensor])]) -> Result<Tensor> {
        let h = x.add(&self.attention.forward(&self.norm1.forward(x)?, spans)?)?;
        h.add(&self.feed_forward.forward(&self.norm2.forward(&h)?)?)
    }
}

/// The T5 encoder: token ids in, its final-normed rows out.
pub struct T5Encoder {
    /// Hyper-parameters.
    pub cfg: Config,
    embeddings: Tensor,
    positions: RelativePositions,
    blocks: Vec<Block>,
    final_norm: RmsNorm,
}

impl T5Encoder {
    /// Builds the encoder of the T5 checkpoint `weights` on `device` (its embeddings are
    /// `shared`, or `encoder.embed_tokens` where only that is stored).
    pub fn load(weights: &WeightSetBox, device: Device) -> Result<T5Encoder> {
        let cfg = Config::from_weights(weights)?;
        let w = Weights { weights, device };
        let has = |name: &str| weights.tensor(name.into()).into_result().is_ok();
        let embeddings = match has("shared.weight") {
            true => "shared.weight",
            false => "encoder.embed_tokens.weight",
        };
        let table = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
        Ok(T5Encoder {
            embeddings: w.matrix(embeddings, cfg.vocab_size, cfg.hidden)?,
            positions: RelativePositions {
                table: w.values(table, cfg.buckets * cfg.heads)?,
                heads: cfg.heads,
                buckets: cfg.buckets,
                max_distance: cfg.max_distance,
            },
            blocks: (0..cfg.layers)
                .map(|i| Block::load(&w, &cfg, i))
                .collect::<Result<_>>()?,
            final_norm: RmsNorm::load(&w, "encoder.final_layer_norm", &cfg)?,
            cfg,
        })
    }

    /// What the model is, as the ABI says it: an encoder of `d_model`-wide rows, its own
    /// pooling the mean (as sentence encoders built on T5 pool).
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        ModelConfig {
            kind: ModelKind::Encoder,
            family: crate::config::CHECKPOINT.into(),
            vocab_size: c.vocab_size as u32,
            hidden: c.hidden as u32,
            layers: c.layers as u32,
            context_length: c.positions as u32,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Mean,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: ROption::RNone,
        }
    }

    /// Encodes every chunk of `batch` (one text each) and writes the outputs they ask for into
    /// `out`, in batch order (see [`u_sdk::Model::forward`]): the final-normed rows (`Hidden`
    /// at the last layer: transformers' `last_hidden_state`), the residual stream after an
    /// earlier block (`Hidden` at layer `l`: `hidden_states[l]`), or a pooling of the final
    /// rows.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        let read = TextBatch::read("arch-t5", batch, &config, (self.cfg.positions, false), out)?;
        if read.floats == 0 {
            return Ok(());
        }
        let device = self.embeddings.device();
        let ids: Vec<i32> = read.texts.iter().flatten().map(|&t| t as i32).collect();
        let mut x = self
            .embeddings
            .get_rows(&device.from_i32(&ids, &[ids.len() as u64])?)?;
        let mut lengths: Vec<(usize, Vec<Tensor>)> = Vec::new();
        for s in &read.spans {
            if s.len > 0 && !lengths.iter().any(|(n, _)| *n == s.len) {
                lengths.push((s.len, self.positions.biases(device, s.len)?));
            }
        }
        let with_biases: Vec<(TextSpan, &[Tensor])> = read
            .spans
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| {
                let (_, b) = lengths
                    .iter()
                    .find(|(n, _)| *n == s.len)
                    .expect("made above");
                (*s, b.as_slice())
            })
            .collect();
        let mut states = Vec::new();
        for (l, block) in self.blocks.iter().enumerate() {
            if TextBatch::wants_layer(batch, l) {
                states.push((l, x.to_vec()?));
            }
            x = block.forward(&x, &with_biases)?;
        }
        let last = self.final_norm.forward(&x)?.to_vec()?;
        let no_head = |_: &[u32]| 0;
        read.write(batch, (&last, &states), &config, &no_head, out)
    }
}
