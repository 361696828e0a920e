//! Gemma 3's decoder: `Attention`, `Mlp`, `Block`, and `Gemma3` that stacks them.
//!
//! Every forward pass runs the rows of all sequences of a batch together through the
//! projections; attention runs per sequence over its KV pages where the cache keeps them, over a
//! sliding window on the local layers.

use crate::config::Config;
use u_sdk::abi_stable::std_types::ROption;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ErrorKind, KvCacheBox, KvLayout, KvPage,
    ModelConfig, ModelKind, Output, Pooling, Result, RopeParams, RopeStyle, Rows, Segment,
    SeqChunk, SeqId, TensorDesc, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// Tensor names: this plugin's own (llama.cpp's, as GGUF stores them) mapped to an HF
/// checkpoint's when the weights come from one.
struct Names<'w> {
    weights: &'w WeightSetBox,
    gguf: bool,
    /// `model.` (Gemma3ForCausalLM) or `language_model.model.` (the multimodal checkpoint).
    prefix: &'static str,
    device: Device,
}

impl Names<'_> {
    fn has(&self, stored: &str) -> bool {
        self.weights.tensor(stored.into()).into_result().is_ok()
    }

    /// The stored name of `blk.{i}.{t}.weight`-style canonical names.
    fn stored(&self, canonical: &str) -> String {
        if self.gguf {
            return canonical.to_string();
        }
        let p = self.prefix;
        let layer = |rest: &str| {
            let (i, t) = rest.split_once('.').unwrap_or((rest, ""));
            let t = t.strip_suffix(".weight").unwrap_or(t);
            let hf = match t {
                "attn_norm" => "input_layernorm",
                "attn_q" => "self_attn.q_proj",
                "attn_k" => "self_attn.k_proj",
                "attn_v" => "self_attn.v_proj",
                "attn_output" => "self_attn.o_proj",
                "attn_q_norm" => "self_attn.q_norm",
                "attn_k_norm" => "self_attn.k_norm",
                "post_attention_norm" => "post_attention_layernorm",
                "ffn_norm" => "pre_feedforward_layernorm",
                "post_ffw_norm" => "post_feedforward_layernorm",
                "ffn_gate" => "mlp.gate_proj",
                "ffn_up" => "mlp.up_proj",
                "ffn_down" => "mlp.down_proj",
                other => other,
            };
            format!("{p}layers.{i}.{hf}.weight")
        };
        match canonical {
            "token_embd.weight" => format!("{p}embed_tokens.weight"),
            "output_norm.weight" => format!("{p}norm.weight"),
            "output.weight" => match p {
                "language_model.model." => "language_model.lm_head.weight".into(),
                _ => "lm_head.weight".into(),
            },
            c => match c.strip_prefix("blk.") {
                Some(rest) => layer(rest),
                None => c.to_string(),
            },
        }
    }

    /// A weight in the backend, as stored (no copy on a host backend).
    fn weight(&self, canonical: &str, dims: &[u64]) -> Result<Tensor> {
        let stored = self.stored(canonical);
        let t = self
            .device
            .import_weight(self.weights, &stored, Some(dims))
            .map_err(|e| UError::new(e.kind, format!("arch-gemma3: {}", e.message)))?;
        Ok(t)
    }

    /// A norm scale of `len` values: GGUF stores `1 + w` (llama.cpp's converter adds the one),
    /// HF checkpoints store `w`.
    fn norm(&self, canonical: &str, len: usize, eps: f32) -> Result<RmsNorm> {
        let stored = self.stored(canonical);
        let view = self.weights.tensor(stored.as_str().into()).into_result()?;
        let mut w = u_sdk::quant::dequantize_view(&view)
            .map_err(|e| UError::invalid(format!("arch-gemma3: {stored}: {e}")))?;
        if w.len() != len {
            return Err(UError::invalid(format!(
                "arch-gemma3: {stored} has {} values, expected {len}",
                w.len()
            )));
        }
        if !self.gguf {
            w.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(RmsNorm {
            weight: self.device.from_f32(&w, &[len as u64])?,
            eps,
        })
    }
}

/// RMSNorm with Gemma's `(1 + w)` scale folded in at load.
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.weight, self.eps)
    }

    /// Normalises each `width`-value group of every row (per-head Q/K norms).
    fn forward_groups(&self, x: &Tensor, width: u64) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows = x.desc().shape.elements() / width;
        self.forward(&x.reshape(&[rows, width])?)?.reshape(&dims)
    }
}

/// One sequence's run of rows inside the batch.
#[derive(Debug, Clone, Copy)]
struct Span {
    seq: SeqId,
    start: usize,
    offset: usize,
    len: usize,
}

/// What every layer of one forward pass shares.
struct Pass<'a> {
    cache: KvCacheBox,
    spans: &'a [Span],
    positions: Tensor,
}

/// Grouped-query self-attention with RMSNorm on each query and key head before RoPE, over a
/// sliding window on local layers.
struct Attention {
    layer: u32,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    rope_q: RopeParams,
    rope_k: RopeParams,
    window: u32,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
}

impl Attention {
    fn forward(&self, h: &Tensor, pass: &Pass<'_>) -> Result<Tensor> {
        let hd = self.head_dim as u64;
        let q = self.q_norm.forward_groups(&h.matmul_t(&self.q)?, hd)?;
        let k = self.k_norm.forward_groups(&h.matmul_t(&self.k)?, hd)?;
        let v = h.matmul_t(&self.v)?;
        q.rope_assign(&pass.positions, &self.rope_q)?;
        k.rope_assign(&pass.positions, &self.rope_k)?;
        let ctx = h.device().alloc(DType::F32, q.dims())?;
        for s in pass.spans.iter().filter(|s| s.len > 0) {
            let rows = s.offset..s.offset + s.len;
            pass.cache
                .append(
                    s.seq,
                    self.layer,
                    k.rows_range(rows.clone())?.desc(),
                    v.rows_range(rows.clone())?.desc(),
                )
                .into_result()?;
            let pages = pass.cache.pages(s.seq, self.layer).into_result()?;
            let held: usize = pages.iter().map(|p| p.tokens as usize).sum();
            if held != s.start + s.len {
                return Err(UError::new(
                    ErrorKind::Internal,
                    format!(
                        "arch-gemma3: sequence {} layer {} holds {held} positions, expected {}",
                        s.seq,
                        self.layer,
                        s.start + s.len
                    ),
                ));
            }
            let (spans, kv_dtype) = kv_spans(h.device(), &pages)?;
            let params = AttentionParams {
                heads: self.heads as u32,
                kv_heads: self.kv_heads as u32,
                head_dim: self.head_dim as u32,
                first_query_pos: s.start as u32,
                window: self.window,
                scale: self.scale,
                softcap: 0.0,
                mask: AttentionMask::Causal,
                kv_dtype,
            };
            let spans: Vec<&TensorDesc> = spans.iter().collect();
            q.rows_range(rows.clone())?
                .attention_into(&spans, &params, &ctx.rows_range(rows)?)?;
        }
        ctx.matmul_t(&self.o)
    }
}

/// The KV pages as attention spans: all f32, all int8 (with scales), or, mixed, int8 pages
/// dequantized into f32 tensors.
fn kv_spans(dev: &Device, pages: &[KvPage]) -> Result<(Vec<TensorDesc>, DType)> {
    let scales = |p: &KvPage| match (&p.key_scales, &p.value_scales) {
        (ROption::RSome(k), ROption::RSome(v)) => Ok((k.clone(), v.clone())),
        _ => Err(UError::new(
            ErrorKind::Internal,
            "arch-gemma3: an int8 KV page without its scales",
        )),
    };
    if pages.iter().all(|p| p.dtype == DType::I8) {
        let mut out = Vec::with_capacity(pages.len() * 4);
        for p in pages {
            let (ks, vs) = scales(p)?;
            out.extend([p.keys.clone(), p.values.clone(), ks, vs]);
        }
        return Ok((out, DType::I8));
    }
    let mut out = Vec::with_capacity(pages.len() * 2);
    for p in pages {
        if p.dtype == DType::I8 {
            let (ks, vs) = scales(p)?;
            for (q, s) in [(&p.keys, ks), (&p.values, vs)] {
                let f = dev.alloc(DType::F32, q.shape.dims())?;
                dev.tensor(q.clone()).copy_into(Some(&dev.tensor(s)), &f)?;
                out.push(f.desc().clone());
            }
        } else {
            out.extend([p.keys.clone(), p.values.clone()]);
        }
    }
    Ok((out, DType::F32))
}

/// GeGLU feed-forward: `down(gelu_tanh(gate(x)) ⊙ up(x))`.
struct Mlp {
    gate: Tensor,
    up: Tensor,
    down: Tensor,
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = x
            .matmul_t(&self.gate)?
            .gated(Activation::GeluTanh, &x.matmul_t(&self.up)?)?;
        h.matmul_t(&self.down)
    }
}

/// A Gemma 3 block, four norms around two sublayers:
/// `h = x + post_attn_norm(Attention(input_norm(x))); h + post_ffw_norm(Mlp(pre_ffw_norm(h)))`.
struct Block {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_ffw_norm: RmsNorm,
    mlp: Mlp,
    post_ffw_norm: RmsNorm,
}

impl Block {
    fn load(n: &Names<'_>, cfg: &Config, i: usize) -> Result<Block> {
        let (h, hd) = (cfg.hidden as u64, cfg.head_dim as u64);
        let (qd, kd) = (cfg.heads as u64 * hd, cfg.kv_heads as u64 * hd);
        let name = |t: &str| format!("blk.{i}.{t}.weight");
        let norm = |t: &str, len: usize| n.norm(&name(t), len, cfg.eps);
        let ff = n
            .weights
            .tensor(n.stored(&name("ffn_gate")).as_str().into())
            .into_result()?
            .shape
            .first()
            .copied()
            .unwrap_or(0);
        let sliding = cfg.sliding[i];
        let rope = |heads: usize| RopeParams {
            style: RopeStyle::NeoX,
            rotary_dim: cfg.head_dim as u32,
            head_dim: cfg.head_dim as u32,
            heads: heads as u32,
            inv_freq: inv_freq(
                if sliding {
                    cfg.rope_local
                } else {
                    cfg.rope_global
                },
                cfg.head_dim,
                if sliding { 1.0 } else { cfg.rope_scale },
            )
            .into(),
            attn_factor: 1.0,
        };
        Ok(Block {
            input_norm: norm("attn_norm", cfg.hidden)?,
            attn: Attention {
                layer: i as u32,
                q: n.weight(&name("attn_q"), &[qd, h])?,
                k: n.weight(&name("attn_k"), &[kd, h])?,
                v: n.weight(&name("attn_v"), &[kd, h])?,
                o: n.weight(&name("attn_output"), &[h, qd])?,
                q_norm: norm("attn_q_norm", cfg.head_dim)?,
                k_norm: norm("attn_k_norm", cfg.head_dim)?,
                rope_q: rope(cfg.heads),
                rope_k: rope(cfg.kv_heads),
                window: if sliding { cfg.window } else { 0 },
                heads: cfg.heads,
                kv_heads: cfg.kv_heads,
                head_dim: cfg.head_dim,
                scale: cfg.query_scale,
            },
            post_attn_norm: norm("post_attention_norm", cfg.hidden)?,
            pre_ffw_norm: norm("ffn_norm", cfg.hidden)?,
            mlp: Mlp {
                gate: n.weight(&name("ffn_gate"), &[ff, h])?,
                up: n.weight(&name("ffn_up"), &[ff, h])?,
                down: n.weight(&name("ffn_down"), &[h, ff])?,
            },
            post_ffw_norm: norm("post_ffw_norm", cfg.hidden)?,
        })
    }

    fn forward(&self, x: &Tensor, pass: &Pass<'_>) -> Result<Tensor> {
        let a = self.attn.forward(&self.input_norm.forward(x)?, pass)?;
        let h = x.add(&self.post_attn_norm.forward(&a)?)?;
        let m = self.mlp.forward(&self.pre_ffw_norm.forward(&h)?)?;
        h.add(&self.post_ffw_norm.forward(&m)?)
    }
}

/// `head_dim / 2` inverse frequencies `base^(−2i/d) / scale`, in f32 as the reference computes.
fn inv_freq(base: f32, head_dim: usize, scale: f32) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32) / scale)
        .collect()
}

/// The Gemma 3 text decoder: scaled embeddings, blocks, final norm, LM head (the embedding
/// matrix unless the checkpoint has its own).
pub struct Gemma3 {
    /// Hyper-parameters.
    pub cfg: Config,
    family: String,
    device: Device,
    cache: KvCacheBox,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: RmsNorm,
    lm_head: Tensor,
}

impl Gemma3 {
    /// Builds the model of `weights` on `device`, its KV in `cache`.
    pub fn load(
        weights: &WeightSetBox,
        family: &str,
        device: Device,
        cache: KvCacheBox,
    ) -> Result<Gemma3> {
        let mut cfg = Config::from_weights(weights)?;
        cfg.check()?;
        let gguf = cfg.gguf;
        let mut n = Names {
            weights,
            gguf,
            prefix: "model.",
            device: device.clone(),
        };
        if !gguf && !n.has("model.embed_tokens.weight") {
            n.prefix = "language_model.model.";
        }
        let embed_name = n.stored("token_embd.weight");
        let shape = weights
            .tensor(embed_name.as_str().into())
            .into_result()
            .map_err(|e| UError::new(e.kind, format!("arch-gemma3: {}", e.message)))?
            .shape;
        match shape.as_slice() {
            [v, h] if *h as usize == cfg.hidden => cfg.vocab_size = *v as usize,
            s => {
                return Err(UError::invalid(format!(
                    "arch-gemma3: {embed_name} has shape {s:?}, expected [_, {}]",
                    cfg.hidden
                )));
            }
        }
        let h = cfg.hidden as u64;
        let embed = n.weight("token_embd.weight", &[cfg.vocab_size as u64, h])?;
        let lm_head = if n.has(&n.stored("output.weight")) {
            n.weight("output.weight", &[cfg.vocab_size as u64, h])?
        } else {
            embed.clone()
        };
        let blocks = (0..cfg.layers)
            .map(|i| Block::load(&n, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = n.norm("output_norm.weight", cfg.hidden, cfg.eps)?;
        cache
            .configure(
                KvLayout {
                    layers: cfg.layers as u32,
                    kv_heads: cfg.kv_heads as u32,
                    head_dim: cfg.head_dim as u32,
                    dtype: DType::F32,
                    model_id: model_id(weights, &cfg).into(),
                },
                device.backend().clone(),
            )
            .into_result()?;
        Ok(Gemma3 {
            cfg,
            family: family.into(),
            device,
            cache,
            embed,
            blocks,
            norm,
            lm_head,
        })
    }

    /// What the model is, as the ABI says it.
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        ModelConfig {
            kind: ModelKind::Decoder,
            family: self.family.as_str().into(),
            vocab_size: c.vocab_size as u32,
            hidden: c.hidden as u32,
            layers: c.layers as u32,
            context_length: c.context_length as u32,
            experts: 0,
            attention: AttentionMask::Causal,
            pooling: Pooling::Mean,
            context_shape: [0, 0],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: u_sdk::abi_stable::std_types::ROption::RNone,
        }
    }

    /// The cache the model's KV lives in.
    pub fn cache(&self) -> &KvCacheBox {
        &self.cache
    }

    fn check(&self, chunk: &SeqChunk<'_>) -> Result<usize> {
        let (hidden, vocab) = (self.cfg.hidden, self.cfg.vocab_size);
        let bad =
            |why: String| UError::invalid(format!("arch-gemma3: sequence {}: {why}", chunk.seq));
        for s in chunk.input.iter() {
            match s {
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
                        "arch-gemma3: the model reads token ids and embedding rows, not images or \
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
                "arch-gemma3: adapters, steering, cross-attention and conditioning are not \
                 implemented",
            ));
        }
        if let Output::Hidden { layer, .. } = chunk.output
            && layer as usize > self.cfg.layers
        {
            return Err(bad(format!(
                "hidden state after block {layer} of {}",
                self.cfg.layers
            )));
        }
        if chunk.output == Output::Planes {
            return Err(UError::unsupported(
                "arch-gemma3: a decoder writes logits and hidden states, not feature maps",
            ));
        }
        let rows = chunk.rows(hidden);
        if rows == 0 && chunk.output != Output::Nothing {
            return Err(bad("asks for output of no input".into()));
        }
        Ok(rows)
    }

    /// Runs `batch`, writing the outputs it asks for (see [`u_sdk::Model::forward`]); on error
    /// no sequence has advanced.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        let (mut spans, mut offset, mut floats) = (Vec::with_capacity(batch.len()), 0, 0);
        for (i, chunk) in batch.iter().enumerate() {
            if batch[..i].iter().any(|c| c.seq == chunk.seq) {
                return Err(UError::invalid(format!(
                    "arch-gemma3: sequence {} appears twice in one batch",
                    chunk.seq
                )));
            }
            let len = self.check(chunk)?;
            floats += chunk.output.floats(len, &config);
            let start = self.cache.len(chunk.seq).into_result()? as usize;
            if start + len > self.cfg.context_length {
                return Err(UError::new(
                    ErrorKind::ResourceExhausted,
                    format!(
                        "arch-gemma3: sequence {} would reach {} positions, past the context \
                         length {}",
                        chunk.seq,
                        start + len,
                        self.cfg.context_length
                    ),
                ));
            }
            spans.push(Span {
                seq: chunk.seq,
                start,
                offset,
                len,
            });
            offset += len;
        }
        if out.len() != floats {
            return Err(UError::invalid(format!(
                "arch-gemma3: the output buffer holds {} floats, the batch asks for {floats}",
                out.len()
            )));
        }
        if offset == 0 {
            return Ok(());
        }
        let result = self.run(batch, &spans, out);
        if result.is_err() {
            for s in &spans {
                let _ = self.cache.truncate(s.seq, s.start as u64);
            }
        }
        result
    }

    /// `√hidden ·` the token embeddings (embedding rows of the input are used as they are).
    fn input(&self, batch: &[SeqChunk<'_>], rows: usize) -> Result<Tensor> {
        let (dev, hidden) = (&self.device, self.cfg.hidden);
        let x = dev.alloc(DType::F32, &[rows as u64, hidden as u64])?;
        let mut at = 0;
        for s in batch.iter().flat_map(|c| c.input.iter()) {
            let n = s.rows(hidden);
            let dst = x.rows_range(at..at + n)?;
            match s {
                Segment::Tokens(t) => {
                    let ids: Vec<i32> = t.iter().map(|&t| t as i32).collect();
                    let e = self.embed.get_rows(&dev.from_i32(&ids, &[n as u64])?)?;
                    e.scale_assign((hidden as f32).sqrt())?;
                    e.copy_into(None, &dst)?;
                }
                Segment::Embeddings(e) => dst.write(e)?,
                Segment::Image(_) | Segment::Planes(_) => {
                    return Err(UError::unsupported(
                        "arch-gemma3: images and feature maps are not read",
                    ));
                }
            }
            at += n;
        }
        Ok(x)
    }

    fn run(&self, batch: &[SeqChunk<'_>], spans: &[Span], out: &mut [f32]) -> Result<()> {
        let dev = &self.device;
        let rows: usize = spans.iter().map(|s| s.len).sum();
        let positions: Vec<i32> = spans
            .iter()
            .flat_map(|s| (s.start..s.start + s.len).map(|p| p as i32))
            .collect();
        let pass = Pass {
            cache: self.cache.clone(),
            spans,
            positions: dev.from_i32(&positions, &[rows as u64])?,
        };
        let mut captured: Vec<(usize, Tensor)> = Vec::new();
        let mut x = self.input(batch, rows)?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, &pass)?;
            if batch
                .iter()
                .any(|c| matches!(c.output, Output::Hidden { layer, .. } if layer as usize == i))
            {
                captured.push((i, x.clone()));
            }
        }
        let normed = self.norm.forward(&x)?;
        let (hidden, vocab) = (self.cfg.hidden, self.cfg.vocab_size);
        let wanted = |r: &Rows, s: &Span| match r {
            Rows::Last => s.offset + s.len - 1..s.offset + s.len,
            Rows::All => s.offset..s.offset + s.len,
        };
        let mut at = 0;
        for (chunk, span) in batch.iter().zip(spans) {
            match &chunk.output {
                // `check` refused feature maps before the pass.
                Output::Nothing | Output::Planes => {}
                Output::Logits(r) => {
                    let rows = wanted(r, span);
                    let logits = normed.rows_range(rows.clone())?.matmul_t(&self.lm_head)?;
                    if let Some(c) = self.cfg.final_softcap {
                        logits.scale_assign(1.0 / c)?;
                        logits.activation_assign(Activation::Tanh)?;
                        logits.scale_assign(c)?;
                    }
                    let n = rows.len() * vocab;
                    logits.read_into(&mut out[at..at + n])?;
                    at += n;
                }
                Output::Hidden { layer, rows } => {
                    let source = match captured.iter().find(|(i, _)| *i == *layer as usize) {
                        Some((_, t)) => t,
                        None => &normed,
                    };
                    let r = wanted(rows, span);
                    let n = r.len() * hidden;
                    source.rows_range(r)?.read_into(&mut out[at..at + n])?;
                    at += n;
                }
                Output::Pooled(p) => {
                    let all = normed
                        .rows_range(span.offset..span.offset + span.len)?
                        .to_vec()?;
                    let dst = &mut out[at..at + hidden];
                    p.pool(&all, hidden, dst)?;
                    at += hidden;
                }
            }
        }
        Ok(())
    }
}

/// An identity of the model for the cache: FNV-1a over the hyper-parameters, every tensor's
/// name and shape, and the first bytes of the embedding table.
fn model_id(w: &WeightSetBox, cfg: &Config) -> String {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(format!("{cfg:?}").as_bytes());
    let mut tensors = w
        .tensors()
        .into_result()
        .map(|t| t.to_vec())
        .unwrap_or_default();
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    for t in &tensors {
        eat(t.name.as_bytes());
        t.shape.iter().for_each(|d| eat(&d.to_le_bytes()));
    }
    if let Some(first) = tensors.first()
        && let Ok(v) = w.tensor(first.name.as_str().into()).into_result()
    {
        eat(&v.data.as_slice()[..v.data.len().min(4096)]);
    }
    format!("arch-gemma3:{hash:016x}")
}
