//! The model: `AudioEncoder` (two convolutions, sinusoidal positions, `EncoderBlock`s) and
//! `TextDecoder` (token and learned position embeddings, `DecoderBlock`s of causal
//! self-attention, cross-attention over the encoder's output and a GELU MLP), as in Radford et
//! al. 2022, §2.2 and figure 1. Every block is pre-norm: `x + f(LayerNorm(x))`.
//!
//! The decoder's self-attention keys and values live in the cache under each chunk's sequence;
//! the cross-attention keys and values of the encoded audio — computed once, when a chunk brings
//! its spectrogram — live in the cache under the chunk's [`CrossContext::kv`] sequence, which
//! every later pass (and every beam) reads.

use crate::{
    config::{Config, LAYER_NORM_EPS},
    naming::Layout,
};
use abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, CrossContext, DType, ErrorKind, KvCacheBox,
    KvLayout, KvPage, ModelConfig, ModelKind, Op, Output, Pooling, Result, Rows, Segment, SeqChunk,
    SeqId, TensorDesc, UError, WeightSetBox,
    nn::{Device, Tensor},
};

fn invalid(why: impl std::fmt::Display) -> UError {
    UError::invalid(format!("arch-whisper: {why}"))
}

/// The tensors of a checkpoint, read by Hugging Face's names whatever its [`Layout`].
struct Names<'w> {
    weights: &'w WeightSetBox,
    layout: Layout,
    device: Device,
}

impl Names<'_> {
    /// Whether `name` is stored.
    fn has(&self, name: &str) -> bool {
        let stored = self.layout.stored(name);
        self.weights
            .tensor(stored.name.as_str().into())
            .into_result()
            .is_ok()
    }

    /// Weight `name` in the backend as stored (its rows of a fused tensor), shaped `dims`.
    fn tensor(&self, name: &str, dims: &[u64]) -> Result<Tensor> {
        let stored = self.layout.stored(name);
        let t = self
            .device
            .import_weight(self.weights, &stored.name, None)
            .map_err(|e| UError::new(e.kind, format!("arch-whisper: {}", e.message)))?;
        if matches!(t.dtype(), DType::I8 | DType::I16 | DType::I32) {
            return Err(UError::unsupported(format!(
                "arch-whisper: {} is stored as {:?} (a quantized CTranslate2 model, whose scales \
                 this plugin does not apply); convert it with `--quantization float16` or float32",
                stored.name,
                t.dtype()
            )));
        }
        let t = match stored.part {
            None => t,
            Some((index, count)) => {
                if t.dims().len() != 2 || !(t.dims()[0] as usize).is_multiple_of(count) {
                    return Err(invalid(format!(
                        "{} has shape {:?}, not {count} fused matrices",
                        stored.name,
                        t.dims()
                    )));
                }
                let n = t.dims()[0] as usize / count;
                t.rows_range(index * n..(index + 1) * n)?
            }
        };
        if t.dims() != dims {
            return Err(invalid(format!(
                "{} ({name}) has shape {:?}, expected {dims:?}",
                stored.name,
                t.dims()
            )));
        }
        Ok(t)
    }

    /// `name` as `f32` values (its slice of a fused tensor), `len` of them.
    fn values(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let stored = self.layout.stored(name);
        let view = self
            .weights
            .tensor(stored.name.as_str().into())
            .into_result()
            .map_err(|e| UError::new(e.kind, format!("arch-whisper: {}", e.message)))?;
        let all = u_sdk::quant::dequantize_view(&view)
            .map_err(|e| invalid(format!("{}: {e}", stored.name)))?;
        let v = match stored.part {
            None => all,
            Some((index, count)) => {
                let n = all.len() / count;
                all[index * n..(index + 1) * n].to_vec()
            }
        };
        if v.len() != len {
            return Err(invalid(format!(
                "{} ({name}) has {} values, expected {len}",
                stored.name,
                v.len()
            )));
        }
        Ok(v)
    }

    /// `name` as an `F32` tensor of `dims` in the backend (a converted copy).
    fn f32(&self, name: &str, dims: &[u64]) -> Result<Tensor> {
        let v = self.values(name, dims.iter().product::<u64>() as usize)?;
        self.device.from_f32(&v, dims)
    }
}

/// `y = x·Wᵀ (+ b)` with the weight as stored.
struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// The projection `name` from `inputs` to `outputs`; its bias is optional when `biased` is
    /// false (Whisper's key projections have none).
    fn load(
        n: &Names<'_>,
        name: &str,
        inputs: usize,
        outputs: usize,
        biased: bool,
    ) -> Result<Linear> {
        let bias_name = format!("{name}.bias");
        let bias = if biased || n.has(&bias_name) {
            Some(n.f32(&bias_name, &[outputs as u64])?)
        } else {
            None
        };
        Ok(Linear {
            weight: n.tensor(&format!("{name}.weight"), &[outputs as u64, inputs as u64])?,
            bias,
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
}

impl LayerNorm {
    fn load(n: &Names<'_>, name: &str, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: n.f32(&format!("{name}.weight"), &[width as u64])?,
            bias: n.f32(&format!("{name}.bias"), &[width as u64])?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(&self.weight, &self.bias, LAYER_NORM_EPS)
    }
}

/// Multi-head attention's four projections. Whisper scales queries and keys by `d_head^-¼`
/// each, i.e. the scores by `1/√d_head`.
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    heads: usize,
}

impl Attention {
    fn load(n: &Names<'_>, name: &str, width: usize, heads: usize) -> Result<Attention> {
        let p = |t: &str| format!("{name}.{t}_proj");
        Ok(Attention {
            q: Linear::load(n, &p("q"), width, width, true)?,
            k: Linear::load(n, &p("k"), width, width, false)?,
            v: Linear::load(n, &p("v"), width, width, true)?,
            out: Linear::load(n, &p("out"), width, width, true)?,
            heads,
        })
    }

    fn params(&self, width: usize, first_query_pos: usize, mask: AttentionMask) -> AttentionParams {
        let head_dim = width / self.heads;
        AttentionParams {
            heads: self.heads as u32,
            kv_heads: self.heads as u32,
            head_dim: head_dim as u32,
            first_query_pos: first_query_pos as u32,
            window: 0,
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: 0.0,
            mask,
            kv_dtype: DType::F32,
        }
    }
}

/// `fc2(GELU(fc1(x)))`.
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    fn load(n: &Names<'_>, name: &str, width: usize, ffn: usize) -> Result<Mlp> {
        Ok(Mlp {
            fc1: Linear::load(n, &format!("{name}.fc1"), width, ffn, true)?,
            fc2: Linear::load(n, &format!("{name}.fc2"), ffn, width, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(x)?;
        h.activation_assign(Activation::GeluErf)?;
        self.fc2.forward(&h)
    }
}

/// An encoder block: `h = x + SelfAttention(LN(x))` (every frame sees every frame), then
/// `h + MLP(LN(h))`.
struct EncoderBlock {
    attn_norm: LayerNorm,
    attn: Attention,
    mlp_norm: LayerNorm,
    mlp: Mlp,
}

impl EncoderBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let width = x.row_len();
        let h = self.attn_norm.forward(x)?;
        let (q, k, v) = (
            self.attn.q.forward(&h)?,
            self.attn.k.forward(&h)?,
            self.attn.v.forward(&h)?,
        );
        let params = self.attn.params(width, 0, AttentionMask::Bidirectional);
        let ctx = q.attention(&[k.desc(), v.desc()], &params)?;
        let x = x.add(&self.attn.out.forward(&ctx)?)?;
        x.add_assign(&self.mlp.forward(&self.mlp_norm.forward(&x)?)?)?;
        Ok(x)
    }
}

/// A 1-D convolution of kernel 3 with bias.
struct Conv {
    weight: Tensor,
    bias: Tensor,
    stride: u32,
}

impl Conv {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let length = x.dims()[1] as usize;
        let out_len = (length + 2 - 3) / self.stride as usize + 1;
        let y = x
            .device()
            .alloc(DType::F32, &[self.weight.dims()[0], out_len as u64])?;
        x.device().run(
            Op::Conv1d {
                stride: self.stride,
                padding: 1,
            },
            &[x, &self.weight, &self.bias],
            &y,
        )?;
        Ok(y)
    }
}

/// The audio encoder: `GELU(conv1)`, `GELU(conv2)` with stride 2 (3000 frames → 1500
/// positions), plus sinusoidal positions, then the blocks and a final norm.
struct AudioEncoder {
    conv1: Conv,
    conv2: Conv,
    positions: Tensor,
    blocks: Vec<EncoderBlock>,
    norm: LayerNorm,
}

impl AudioEncoder {
    fn load(n: &Names<'_>, c: &Config) -> Result<AudioEncoder> {
        let (d, m) = (c.hidden as u64, c.n_mels as u64);
        let conv = |name: &str, inputs: u64, stride| -> Result<Conv> {
            Ok(Conv {
                weight: n.tensor(&format!("encoder.{name}.weight"), &[d, inputs, 3])?,
                bias: n.f32(&format!("encoder.{name}.bias"), &[d])?,
                stride,
            })
        };
        let blocks = (0..c.encoder_layers)
            .map(|i| {
                let p = format!("encoder.layers.{i}");
                Ok(EncoderBlock {
                    attn_norm: LayerNorm::load(n, &format!("{p}.self_attn_layer_norm"), c.hidden)?,
                    attn: Attention::load(n, &format!("{p}.self_attn"), c.hidden, c.encoder_heads)?,
                    mlp_norm: LayerNorm::load(n, &format!("{p}.final_layer_norm"), c.hidden)?,
                    mlp: Mlp::load(n, &p, c.hidden, c.encoder_ffn)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AudioEncoder {
            conv1: conv("conv1", m, 1)?,
            conv2: conv("conv2", d, 2)?,
            positions: n.f32(
                "encoder.embed_positions.weight",
                &[c.audio_positions as u64, d],
            )?,
            blocks,
            norm: LayerNorm::load(n, "encoder.layer_norm", c.hidden)?,
        })
    }

    /// The encoded audio `[positions, d]` of a spectrogram `[n_mels, frames]`.
    fn forward(&self, mel: &Tensor) -> Result<Tensor> {
        let h = self.conv1.forward(mel)?;
        h.activation_assign(Activation::GeluErf)?;
        let h = self.conv2.forward(&h)?;
        h.activation_assign(Activation::GeluErf)?;
        let mut x = h.transpose()?;
        x.add_assign(&self.positions)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.norm.forward(&x)
    }
}

/// One chunk's rows inside the batch and the cache sequences it reads and writes.
#[derive(Clone, Copy, Debug)]
struct Span {
    seq: SeqId,
    kv: SeqId,
    /// Positions `seq` held before this pass.
    start: usize,
    offset: usize,
    len: usize,
}

impl Span {
    fn rows(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// A decoder block: causal self-attention over the text so far, cross-attention over the
/// encoded audio, an MLP; each pre-norm and residual.
struct DecoderBlock {
    layer: u32,
    self_norm: LayerNorm,
    self_attn: Attention,
    cross_norm: LayerNorm,
    cross_attn: Attention,
    mlp_norm: LayerNorm,
    mlp: Mlp,
}

impl DecoderBlock {
    fn load(n: &Names<'_>, c: &Config, i: usize) -> Result<DecoderBlock> {
        let p = format!("decoder.layers.{i}");
        let d = c.hidden;
        Ok(DecoderBlock {
            layer: i as u32,
            self_norm: LayerNorm::load(n, &format!("{p}.self_attn_layer_norm"), d)?,
            self_attn: Attention::load(n, &format!("{p}.self_attn"), d, c.decoder_heads)?,
            cross_norm: LayerNorm::load(n, &format!("{p}.encoder_attn_layer_norm"), d)?,
            cross_attn: Attention::load(n, &format!("{p}.encoder_attn"), d, c.decoder_heads)?,
            mlp_norm: LayerNorm::load(n, &format!("{p}.final_layer_norm"), d)?,
            mlp: Mlp::load(n, &p, d, c.decoder_ffn)?,
        })
    }

    /// Stores this block's cross-attention keys and values of `audio` under `kv`.
    fn remember_audio(&self, cache: &KvCacheBox, kv: SeqId, audio: &Tensor) -> Result<()> {
        let k = self.cross_attn.k.forward(audio)?;
        let v = self.cross_attn.v.forward(audio)?;
        cache
            .append(kv, self.layer, k.desc(), v.desc())
            .into_result()
    }

    fn forward(&self, x: &Tensor, cache: &KvCacheBox, spans: &[Span]) -> Result<Tensor> {
        let width = x.row_len();
        let dev = x.device();
        // Causal self-attention; this pass's keys and values join the sequence's.
        let h = self.self_norm.forward(x)?;
        let a = &self.self_attn;
        let (q, k, v) = (a.q.forward(&h)?, a.k.forward(&h)?, a.v.forward(&h)?);
        let ctx = dev.alloc(DType::F32, q.dims())?;
        for s in spans.iter().filter(|s| s.len > 0) {
            let rows = s.rows();
            let (kr, vr) = (k.rows_range(rows.clone())?, v.rows_range(rows.clone())?);
            cache
                .append(s.seq, self.layer, kr.desc(), vr.desc())
                .into_result()?;
            let pages = pages(cache, s.seq, self.layer, s.start + s.len)?;
            let pages: Vec<&TensorDesc> = pages.iter().collect();
            let params = a.params(width, s.start, AttentionMask::Causal);
            q.rows_range(rows.clone())?
                .attention_into(&pages, &params, &ctx.rows_range(rows)?)?;
        }
        let x = x.add(&a.out.forward(&ctx)?)?;
        // Cross-attention over the encoded audio, every query seeing every position.
        let h = self.cross_norm.forward(&x)?;
        let c = &self.cross_attn;
        let q = c.q.forward(&h)?;
        let ctx = dev.alloc(DType::F32, q.dims())?;
        for s in spans.iter().filter(|s| s.len > 0) {
            let rows = s.rows();
            let pages = pages(cache, s.kv, self.layer, 0)?;
            let pages: Vec<&TensorDesc> = pages.iter().collect();
            let params = c.params(width, 0, AttentionMask::Bidirectional);
            q.rows_range(rows.clone())?
                .attention_into(&pages, &params, &ctx.rows_range(rows)?)?;
        }
        x.add_assign(&c.out.forward(&ctx)?)?;
        x.add_assign(&self.mlp.forward(&self.mlp_norm.forward(&x)?)?)?;
        Ok(x)
    }
}

/// The pages of `seq`'s `layer` as attention spans; `expect` positions unless 0.
fn pages(cache: &KvCacheBox, seq: SeqId, layer: u32, expect: usize) -> Result<Vec<TensorDesc>> {
    let pages = cache.pages(seq, layer).into_result()?;
    let held: usize = pages.iter().map(|p| p.tokens as usize).sum();
    if (expect != 0 && held != expect) || held == 0 {
        return Err(UError::new(
            ErrorKind::Internal,
            format!(
                "arch-whisper: sequence {seq} layer {layer} holds {held} positions, expected {expect}"
            ),
        ));
    }
    pages
        .iter()
        .map(|p: &KvPage| match p.dtype {
            DType::F32 => Ok([p.keys.clone(), p.values.clone()]),
            other => Err(UError::unsupported(format!(
                "arch-whisper: {other:?} KV pages (the model keeps F32 KV)"
            ))),
        })
        .collect::<Result<Vec<_>>>()
        .map(|v| v.into_iter().flatten().collect())
}

/// The text decoder's embeddings: token rows (the table doubles as the output projection)
/// plus learned positions.
struct TextDecoder {
    embed: Tensor,
    positions: Tensor,
    blocks: Vec<DecoderBlock>,
    norm: LayerNorm,
}

/// Whisper: the audio encoder and the text decoder, with the cache holding both the decoder's
/// self-attention KV and the encoded audio's cross-attention KV.
pub struct Whisper {
    /// Hyper-parameters.
    pub cfg: Config,
    device: Device,
    cache: KvCacheBox,
    encoder: AudioEncoder,
    decoder: TextDecoder,
}

impl Whisper {
    /// Builds the model of `weights` (Hugging Face safetensors or CTranslate2, see
    /// [`crate::naming`]) on `device`, keeping KV in `cache` (configured here).
    pub fn load(weights: &WeightSetBox, device: Device, cache: KvCacheBox) -> Result<Whisper> {
        let layout = Layout::of(weights)?;
        let cfg = Config::from_weights(weights, layout)?;
        let n = Names {
            weights,
            layout,
            device: device.clone(),
        };
        let d = cfg.hidden as u64;
        let encoder = AudioEncoder::load(&n, &cfg)?;
        let decoder = TextDecoder {
            embed: n.tensor("decoder.embed_tokens.weight", &[cfg.vocab_size as u64, d])?,
            positions: n.tensor(
                "decoder.embed_positions.weight",
                &[cfg.text_positions as u64, d],
            )?,
            blocks: (0..cfg.decoder_layers)
                .map(|i| DecoderBlock::load(&n, &cfg, i))
                .collect::<Result<Vec<_>>>()?,
            norm: LayerNorm::load(&n, "decoder.layer_norm", cfg.hidden)?,
        };
        cache
            .configure(
                KvLayout {
                    layers: cfg.decoder_layers as u32,
                    kv_heads: cfg.decoder_heads as u32,
                    head_dim: (cfg.hidden / cfg.decoder_heads) as u32,
                    dtype: DType::F32,
                    model_id: model_id(weights, &cfg).into(),
                },
                device.backend().clone(),
            )
            .into_result()?;
        Ok(Whisper {
            cfg,
            device,
            cache,
            encoder,
            decoder,
        })
    }

    /// The cache holding the model's KV.
    pub fn kv_cache(&self) -> &KvCacheBox {
        &self.cache
    }

    /// The encoded audio `[audio_positions, hidden]` of a log-mel spectrogram `[n_mels,
    /// frames]` (row-major, as `u_audio::log_mel_spectrogram` makes it).
    pub fn encode(&self, mel: &[f32]) -> Result<Vec<f32>> {
        self.encode_tensor(mel)?.to_vec()
    }

    fn encode_tensor(&self, mel: &[f32]) -> Result<Tensor> {
        let (m, f) = (self.cfg.n_mels, self.cfg.frames());
        if mel.len() != m * f {
            return Err(invalid(format!(
                "a spectrogram of {} values; the encoder reads {m} mel bins × {f} frames",
                mel.len()
            )));
        }
        if mel.iter().any(|v| !v.is_finite()) {
            return Err(invalid("the spectrogram holds values that are not finite"));
        }
        let mel = self.device.from_f32(mel, &[m as u64, f as u64])?;
        self.encoder.forward(&mel)
    }

    /// What the model is, as the ABI says it.
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        ModelConfig {
            kind: ModelKind::CrossDecoder,
            family: "whisper".into(),
            vocab_size: c.vocab_size as u32,
            hidden: c.hidden as u32,
            layers: c.decoder_layers as u32,
            context_length: c.text_positions as u32,
            experts: 0,
            attention: AttentionMask::Causal,
            pooling: Pooling::Last,
            context_shape: [c.n_mels as u32, c.frames() as u32],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    /// The chunk's tokens and its cross context, checked.
    fn check<'a>(&self, chunk: &'a SeqChunk<'a>) -> Result<(Vec<u32>, CrossContext<'a>)> {
        let vocab = self.cfg.vocab_size;
        let mut tokens = Vec::new();
        for segment in chunk.input.iter() {
            match segment {
                Segment::Tokens(t) => tokens.extend_from_slice(t),
                Segment::Embeddings(_) | Segment::Image(_) | Segment::Planes(_) => {
                    return Err(UError::unsupported(
                        "arch-whisper: the decoder reads token ids, not embedding rows or images",
                    ));
                }
            }
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!(
                "token {id} is outside the vocabulary of {vocab}"
            )));
        }
        let x = &chunk.extras;
        if !x.adapters.is_empty() || !x.steering.is_empty() || !x.conditioning.is_empty() {
            return Err(UError::unsupported(
                "arch-whisper: no adapters, steering or conditioning",
            ));
        }
        let ROption::RSome(cross) = x.cross else {
            return Err(invalid(
                "a chunk without a cross context: the decoder attends to encoded audio",
            ));
        };
        if cross.kv == chunk.seq {
            return Err(invalid("the cross context's sequence is the chunk's own"));
        }
        match chunk.output {
            Output::Pooled(_) | Output::Planes => {
                return Err(UError::unsupported(
                    "arch-whisper: no pooled output or feature maps",
                ));
            }
            Output::Hidden { layer, .. } if layer as usize > self.cfg.decoder_layers => {
                return Err(invalid(format!(
                    "hidden state after layer {layer} of a {}-layer decoder",
                    self.cfg.decoder_layers
                )));
            }
            Output::Nothing => {}
            _ if tokens.is_empty() => return Err(invalid("asks for output of no input")),
            _ => {}
        }
        Ok((tokens, cross))
    }

    /// Runs every chunk of `batch` and writes the outputs they ask for into `out`, in batch
    /// order (see [`u_sdk::Model::forward`]). On error no sequence has advanced and no audio
    /// is half remembered.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        let (mut spans, mut tokens, mut audio) = (Vec::new(), Vec::new(), Vec::new());
        let (mut offset, mut floats) = (0, 0);
        for chunk in batch {
            let (t, cross) = self.check(chunk)?;
            let start = self.cache.len(chunk.seq).into_result()? as usize;
            if start + t.len() > self.cfg.text_positions {
                return Err(UError::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "arch-whisper: sequence {} would reach {} tokens, past the decoder's {}",
                        chunk.seq,
                        start + t.len(),
                        self.cfg.text_positions
                    ),
                ));
            }
            let held = self.cache.len(cross.kv).into_result()?;
            match (cross.rows.is_empty(), held) {
                (true, 0) if !audio.iter().any(|&(kv, _)| kv == cross.kv) => {
                    return Err(invalid(format!(
                        "cross sequence {} holds no encoded audio and the chunk brings none",
                        cross.kv
                    )));
                }
                (false, h) if h > 0 => {
                    return Err(invalid(format!(
                        "cross sequence {} already holds encoded audio",
                        cross.kv
                    )));
                }
                (false, _) if audio.iter().any(|&(kv, _)| kv == cross.kv) => {
                    return Err(invalid(format!(
                        "two chunks bring audio for cross sequence {}",
                        cross.kv
                    )));
                }
                (false, _) => audio.push((cross.kv, cross.rows.as_slice())),
                _ => {}
            }
            floats += chunk.output.floats(t.len(), &config);
            spans.push(Span {
                seq: chunk.seq,
                kv: cross.kv,
                start,
                offset,
                len: t.len(),
            });
            offset += t.len();
            tokens.extend(t);
        }
        if out.len() != floats {
            return Err(invalid(format!(
                "the output buffer holds {} floats, the batch asks for {floats}",
                out.len()
            )));
        }
        let result = self.run(batch, &spans, &tokens, &audio, out);
        if result.is_err() {
            for s in &spans {
                let _ = self.cache.truncate(s.seq, s.start as u64);
            }
            for &(kv, _) in &audio {
                let _ = self.cache.truncate(kv, 0);
            }
        }
        result
    }

    fn run(
        &self,
        batch: &[SeqChunk<'_>],
        spans: &[Span],
        tokens: &[u32],
        audio: &[(SeqId, &[f32])],
        out: &mut [f32],
    ) -> Result<()> {
        for &(kv, mel) in audio {
            let encoded = self.encode_tensor(mel)?;
            for block in &self.decoder.blocks {
                block.remember_audio(&self.cache, kv, &encoded)?;
            }
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let dev = &self.device;
        let rows = tokens.len() as u64;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let positions: Vec<i32> = spans
            .iter()
            .flat_map(|s| (s.start..s.start + s.len).map(|p| p as i32))
            .collect();
        let x = self.decoder.embed.get_rows(&dev.from_i32(&ids, &[rows])?)?;
        x.add_assign(
            &self
                .decoder
                .positions
                .get_rows(&dev.from_i32(&positions, &[rows])?)?,
        )?;
        // `states[i]` is the state after block `i - 1` (`states[0]`: the embeddings); only the
        // last is kept unless a chunk asks for an inner one.
        let wanted = |layer: usize| {
            batch
                .iter()
                .any(|c| matches!(c.output, Output::Hidden { layer: l, .. } if l as usize == layer))
        };
        let mut states: Vec<Option<Tensor>> = vec![None; self.cfg.decoder_layers + 1];
        let mut x = x;
        for (i, block) in self.decoder.blocks.iter().enumerate() {
            if wanted(i) {
                states[i] = Some(x.clone());
            }
            x = block.forward(&x, &self.cache, spans)?;
        }
        let last = self.decoder.norm.forward(&x)?;
        states[self.cfg.decoder_layers] = Some(last.clone());
        self.write_outputs(batch, spans, &states, &last, out)
    }

    /// Writes each chunk's output: logits of its last or every row, or a hidden state.
    fn write_outputs(
        &self,
        batch: &[SeqChunk<'_>],
        spans: &[Span],
        states: &[Option<Tensor>],
        last: &Tensor,
        out: &mut [f32],
    ) -> Result<()> {
        let d = self.cfg.hidden;
        let pick = |span: &Span, rows: Rows| -> Vec<i32> {
            match rows {
                Rows::Last => vec![(span.offset + span.len - 1) as i32],
                Rows::All => span.rows().map(|r| r as i32).collect(),
            }
        };
        let logit_rows: Vec<i32> = batch
            .iter()
            .zip(spans)
            .filter_map(|(c, s)| match c.output {
                Output::Logits(r) => Some(pick(s, r)),
                _ => None,
            })
            .flatten()
            .collect();
        let logits = if logit_rows.is_empty() {
            Vec::new()
        } else {
            let idx = self
                .device
                .from_i32(&logit_rows, &[logit_rows.len() as u64])?;
            last.get_rows(&idx)?
                .matmul_t(&self.decoder.embed)?
                .to_vec()?
        };
        let mut read: Vec<Option<Vec<f32>>> = vec![None; states.len()];
        let (mut at, mut logit_at) = (0, 0);
        for (chunk, span) in batch.iter().zip(spans) {
            let n = chunk.output.floats(span.len, &self.model_config());
            let dst = &mut out[at..at + n];
            match chunk.output {
                Output::Logits(_) => {
                    dst.copy_from_slice(&logits[logit_at..logit_at + n]);
                    logit_at += n;
                }
                Output::Hidden { layer, rows } => {
                    let layer = layer as usize;
                    if read[layer].is_none() {
                        let state = states[layer].as_ref().ok_or_else(|| {
                            UError::new(ErrorKind::Internal, "arch-whisper: a state not kept")
                        })?;
                        read[layer] = Some(state.to_vec()?);
                    }
                    let all = read[layer].as_deref().unwrap_or_default();
                    let mine = &all[span.offset * d..(span.offset + span.len) * d];
                    match rows {
                        Rows::All => dst.copy_from_slice(mine),
                        Rows::Last => dst.copy_from_slice(&mine[mine.len() - d..]),
                    }
                }
                Output::Nothing | Output::Pooled(_) | Output::Planes => {}
            }
            at += n;
        }
        Ok(())
    }
}

/// An identity of the weights (FNV-1a over the tensor names, shapes and the first bytes of the
/// token table), so cached KV of another model is never used.
fn model_id(w: &WeightSetBox, cfg: &Config) -> String {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    if let Ok(infos) = w.tensors().into_result() {
        let mut infos: Vec<_> = infos.into_iter().collect();
        infos.sort_by(|a, b| a.name.cmp(&b.name));
        for t in infos {
            eat(t.name.as_bytes());
            t.shape.iter().for_each(|d| eat(&d.to_le_bytes()));
        }
    }
    for name in [
        "decoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
        "decoder/embeddings/weight",
    ] {
        if let Ok(v) = w.tensor(name.into()).into_result() {
            eat(&v.data.as_slice()[..v.data.len().min(4096)]);
        }
    }
    format!("arch-whisper:{}x{}:{hash:016x}", cfg.vocab_size, cfg.hidden)
}
