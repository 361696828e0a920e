//! The decoder: `Attention`, `Mlp`/`MoE`, `Block`, and the model that stacks them.
//!
//! Every forward pass runs all rows of all sequences of a batch together through the
//! projections (one matmul per weight per pass); only attention runs per sequence, over that
//! sequence's KV pages where the cache keeps them. Tensors live in the backend, which owns the
//! scratch memory; a block's `forward` is its math.

use crate::{
    config::{Config, FfnActivation, MoeConfig, RopeConfig},
    experts::{ExpertCache, ExpertLayer},
    idefics::{CrossLayers, CrossPlan, CrossSpan},
    llava::ImageSlots,
    lora::{Adapter, Fit, Group, Plan, Stack, Target},
    naming::blk,
    weights::{Linear, Norm, Weights},
};
use abi_stable::std_types::ROption;
use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
};
use u_sdk::{
    Activation, AttentionMask, AttentionParams, DType, ErrorKind, KvCacheBox, KvLayout, KvPage,
    ModelConfig, ModelKind, Output, Pooling, Result, RopeParams, Rows, Segment, SeqChunk, SeqId,
    TensorDesc, UError,
    nn::{Device, Tensor},
};

/// One sequence's run of rows inside the batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    /// The sequence.
    pub seq: SeqId,
    /// Positions already cached before this pass (the position of the first new row).
    pub start: usize,
    /// Offset of the first row in the batch.
    pub offset: usize,
    /// Number of new rows.
    pub len: usize,
}

impl Span {
    fn rows(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// What every layer of one forward pass shares.
pub(crate) struct Pass<'a> {
    /// A cache handle for this pass only: the cache keeps every page it lends out alive until
    /// the handle that borrowed it drops.
    pub(crate) cache: KvCacheBox,
    pub(crate) spans: &'a [Span],
    /// Where each chunk's rows look for their image (one per span; empty for a model without
    /// cross-attention).
    pub(crate) cross: &'a [CrossSpan],
    /// The absolute position of every row (`I32`).
    positions: Tensor,
    /// How the rows that run under low-rank adapters get their deltas.
    adapters: Plan,
}

impl Pass<'_> {
    /// Adds the adapters' deltas for projection `target` of `layer` (input `x`, output `y`).
    fn adapt(&self, layer: u32, target: Target, x: &Tensor, y: &Tensor) -> Result<()> {
        self.adapters.adapt(layer as usize, target, x, y)
    }
}

/// The rotation of `heads` heads of `head_dim` values at a token's position.
fn rope_params(rope: &RopeConfig, head_dim: usize, heads: usize) -> RopeParams {
    RopeParams {
        style: rope.style,
        rotary_dim: rope.rotary_dim as u32,
        head_dim: head_dim as u32,
        heads: heads as u32,
        inv_freq: rope.inv_freq.clone().into(),
        attn_factor: rope.attn_factor,
    }
}

/// The model's norm `blk.{i}.{t}` of `len` values.
fn block_norm(
    w: &Weights,
    dev: &Device,
    cfg: &Config,
    i: usize,
    t: &str,
    len: usize,
) -> Result<Norm> {
    let n = &cfg.norm;
    Norm::load(w, dev, &format!("blk.{i}.{t}"), len, n.kind, n.eps, n.shift)
}

/// [`block_norm`] when the block has it.
fn optional_norm(
    w: &Weights,
    dev: &Device,
    cfg: &Config,
    i: usize,
    t: &str,
) -> Result<Option<Norm>> {
    match w.has(&blk(i, t, "weight")) {
        true => block_norm(w, dev, cfg, i, t, cfg.hidden).map(Some),
        false => Ok(None),
    }
}

/// Block `i`'s sub-layer norm `t` of `len` values (BitNet b1.58), when it has one; an error
/// when the architecture requires it and the block lacks it.
fn sub_norm(
    w: &Weights,
    dev: &Device,
    cfg: &Config,
    i: usize,
    t: &str,
    len: usize,
) -> Result<Option<Norm>> {
    match (w.has(&blk(i, t, "weight")), cfg.sub_norms) {
        (true, _) => block_norm(w, dev, cfg, i, t, len).map(Some),
        (false, true) => Err(UError::not_found(format!(
            "arch-llama: tensor `{}` is missing (every {} block has sub-layer norms)",
            blk(i, t, "weight"),
            cfg.arch
        ))),
        (false, false) => Ok(None),
    }
}

/// `norm(x)`, or `x` where there is no norm.
fn maybe(norm: &Option<Norm>, x: &Tensor) -> Result<Tensor> {
    match norm {
        Some(n) => n.forward(x),
        None => Ok(x.clone()),
    }
}

/// The norm of each query/key head (Qwen3; Cohere, with a scale per head), or over the whole
/// projection (OLMoE, OLMo 2).
pub(crate) struct QkNorm {
    norm: Norm,
    /// Values per normalised row: `head_dim` (per head) or the whole projection.
    width: u64,
    /// Each head's own scales, `[heads × head_dim]`, applied after a unit-scale norm of each
    /// head (weights of shape `[heads, head_dim]`, Cohere).
    head_scales: Option<Tensor>,
}

impl QkNorm {
    pub(crate) fn load(
        w: &Weights,
        dev: &Device,
        cfg: &Config,
        i: usize,
        t: &str,
        heads: usize,
    ) -> Result<Option<QkNorm>> {
        let name = blk(i, t, "weight");
        if !w.has(&name) {
            return Ok(None);
        }
        let hd = cfg.head_dim;
        let shape = w.shape(&name)?;
        let len = shape.iter().product::<u64>() as usize;
        if let [h, d] = shape[..]
            && (h as usize, d as usize) == (heads, hd)
            && heads > 1
        {
            let n = &cfg.norm;
            let mut scales = w.f32(&name)?;
            scales.iter_mut().for_each(|g| *g += n.shift);
            return Ok(Some(QkNorm {
                norm: Norm::unit(dev, hd, n.kind, n.eps)?,
                width: hd as u64,
                head_scales: Some(dev.from_f32(&scales, &[len as u64])?),
            }));
        }
        if len != hd && len != heads * hd {
            return Err(UError::invalid(format!(
                "arch-llama: {name} has shape {shape:?}, expected [{hd}], [{}] or [{heads}, {hd}]",
                heads * hd
            )));
        }
        Ok(Some(QkNorm {
            norm: block_norm(w, dev, cfg, i, t, len)?,
            width: len as u64,
            head_scales: None,
        }))
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows = x.desc().shape.elements() / self.width;
        let y = self
            .norm
            .forward(&x.reshape(&[rows, self.width])?)?
            .reshape(&dims)?;
        match &self.head_scales {
            Some(s) => y.mul(s),
            None => Ok(y),
        }
    }
}

/// Multi-head self-attention with grouped-query KV heads and rotary positions (RoFormer, over
/// all or the first part of each head) or none (learned positions), with the optional Q/K/V
/// and output biases (Qwen2, GPT-2), fused Q/K/V projections (GPT-2, Phi-3, Falcon), the Q/K
/// norms of Qwen3 and Cohere (per head) and OLMoE and OLMo 2 (over the whole projection),
/// OLMoE's Q/K/V clamp, and BitNet's sub-layer norm of the attention output before its
/// projection.
pub struct Attention {
    pub(crate) layer: u32,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<QkNorm>,
    pub(crate) k_norm: Option<QkNorm>,
    pub(crate) sub_norm: Option<Norm>,
    pub(crate) rope: Option<(RopeParams, RopeParams)>,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) window: u32,
    pub(crate) scale: f32,
    pub(crate) softcap: Option<f32>,
    pub(crate) clip: Option<f32>,
}

impl Attention {
    /// Loads layer `i`'s attention.
    pub fn load(w: &Weights, dev: &Device, cfg: &Config, i: usize) -> Result<Attention> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let (q_rows, kv_rows) = (cfg.heads * hd, cfg.kv_heads * hd);
        let proj = |t: &str| Linear::load(w, dev, &format!("blk.{i}.{t}"), h, true);
        let (q, k, v) = match w.has(&blk(i, "attn_qkv", "weight")) {
            true => {
                let [q, k, v] = proj("attn_qkv")?.split([q_rows, kv_rows, kv_rows])?;
                (q, k, v)
            }
            false => (proj("attn_q")?, proj("attn_k")?, proj("attn_v")?),
        };
        let o = Linear::load(w, dev, &format!("blk.{i}.attn_output"), q_rows, true)?;
        if q.outputs != q_rows || k.outputs != kv_rows || v.outputs != kv_rows || o.outputs != h {
            return Err(UError::invalid(format!(
                "arch-llama: layer {i} attention shapes do not match {} heads, {} KV heads of {hd}",
                cfg.heads, cfg.kv_heads
            )));
        }
        Ok(Attention {
            layer: i as u32,
            q,
            k,
            v,
            o,
            q_norm: QkNorm::load(w, dev, cfg, i, "attn_q_norm", cfg.heads)?,
            k_norm: QkNorm::load(w, dev, cfg, i, "attn_k_norm", cfg.kv_heads)?,
            sub_norm: sub_norm(w, dev, cfg, i, "attn_sub_norm", q_rows)?,
            rope: cfg.rope.as_ref().map(|r| {
                (
                    rope_params(r, hd, cfg.heads),
                    rope_params(r, hd, cfg.kv_heads),
                )
            }),
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: hd,
            window: cfg.window[i],
            scale: cfg.scales.attention,
            softcap: cfg.scales.attention_softcap,
            clip: cfg.clip_qkv,
        })
    }

    /// `Attention(h)` for every row of the batch, appending this layer's K/V to the cache.
    fn forward(&self, h: &Tensor, pass: &Pass<'_>) -> Result<Tensor> {
        let norm = |n: &Option<QkNorm>, x: Tensor| match n {
            Some(n) => n.forward(&x),
            None => Ok(x),
        };
        let project = |w: &Linear, target: Target| -> Result<Tensor> {
            let y = w.forward(h)?;
            pass.adapt(self.layer, target, h, &y)?;
            Ok(y)
        };
        let q = norm(&self.q_norm, project(&self.q, Target::Q)?)?;
        let k = norm(&self.k_norm, project(&self.k, Target::K)?)?;
        let v = project(&self.v, Target::V)?;
        if let Some(c) = self.clip {
            for x in [&q, &k, &v] {
                x.clamp_assign(-c, c)?;
            }
        }
        if let Some((rope_q, rope_k)) = &self.rope {
            q.rope_assign(&pass.positions, rope_q)?;
            k.rope_assign(&pass.positions, rope_k)?;
        }

        let ctx = h.device().alloc(DType::F32, q.dims())?;
        for span in pass.spans.iter().filter(|s| s.len > 0) {
            let rows = span.rows();
            let (kr, vr) = (k.rows_range(rows.clone())?, v.rows_range(rows.clone())?);
            pass.cache
                .append(span.seq, self.layer, kr.desc(), vr.desc())
                .into_result()?;
            let pages = pass.cache.pages(span.seq, self.layer).into_result()?;
            let kv_len: usize = pages.iter().map(|p| p.tokens as usize).sum();
            if kv_len != span.start + span.len {
                return Err(UError::new(
                    ErrorKind::Internal,
                    format!(
                        "arch-llama: sequence {} layer {} holds {kv_len} cached positions, expected {}",
                        span.seq,
                        self.layer,
                        span.start + span.len
                    ),
                ));
            }
            let (spans, kv_dtype) = kv_spans(h.device(), &pages)?;
            let params = AttentionParams {
                heads: self.heads as u32,
                kv_heads: self.kv_heads as u32,
                head_dim: self.head_dim as u32,
                first_query_pos: span.start as u32,
                window: self.window,
                scale: self.scale,
                softcap: self.softcap.unwrap_or(0.0),
                mask: AttentionMask::Causal,
                kv_dtype,
            };
            let spans: Vec<&TensorDesc> = spans.iter().collect();
            q.rows_range(rows.clone())?
                .attention_into(&spans, &params, &ctx.rows_range(rows)?)?;
        }
        let ctx = maybe(&self.sub_norm, &ctx)?;
        let out = self.o.forward(&ctx)?;
        pass.adapt(self.layer, Target::Output, &ctx, &out)?;
        Ok(out)
    }

    /// `(inputs, outputs)` of each attention projection, for [`Target::Q`] to
    /// [`Target::Output`].
    fn projections(&self) -> [(usize, usize); 4] {
        [&self.q, &self.k, &self.v, &self.o].map(|l| (l.inputs, l.outputs))
    }
}

/// The keys and values of `pages` as attention spans, read where they lie: every page f32, or
/// every page int8 (with its scales); a sequence that mixes the two (int8 switched on part-way)
/// has its int8 pages dequantized into f32 tensors. Returns the spans' dtype.
pub(crate) fn kv_spans(dev: &Device, pages: &[KvPage]) -> Result<(Vec<TensorDesc>, DType)> {
    let scales = |p: &KvPage| match (&p.key_scales, &p.value_scales) {
        (ROption::RSome(k), ROption::RSome(v)) => Ok((k.clone(), v.clone())),
        _ => Err(UError::new(
            ErrorKind::Internal,
            "arch-llama: an int8 KV page without its scales",
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

/// The feed-forward network: gated, `down(act(gate(x)) ⊙ up(x))` (SwiGLU, GeGLU: Shazeer
/// 2020), or plain, `down(act(up(x)))` (GPT-2, Falcon, Nemotron's squared ReLU). The gate and
/// up rows may be fused in one `ffn_up` tensor (Phi-3), gate first. BitNet b1.58 normalises
/// the hidden values before `down` (its sub-layer norm).
pub struct Mlp {
    pub(crate) gate: Option<Linear>,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
    pub(crate) act: FfnActivation,
    pub(crate) sub_norm: Option<Norm>,
}

impl Mlp {
    /// Its weight tensors (gate, up, down), for page advice.
    pub fn weights(&self) -> Vec<Tensor> {
        self.gate
            .iter()
            .chain([&self.up, &self.down])
            .map(|l| l.weight().clone())
            .collect()
    }

    /// Loads `blk.{i}.ffn_{gate,up,down}{suffix}` (with biases where present): gated when there
    /// is a gate or `ffn_up` has twice the rows `ffn_down` takes.
    pub fn load(
        w: &Weights,
        dev: &Device,
        hidden: usize,
        i: usize,
        suffix: &str,
        act: FfnActivation,
    ) -> Result<Mlp> {
        let name = |t: &str| format!("blk.{i}.{t}{suffix}");
        let up = Linear::load(w, dev, &name("ffn_up"), hidden, true)?;
        let down = Linear::load(
            w,
            dev,
            &name("ffn_down"),
            w.inputs(&name("ffn_down"))?,
            true,
        )?;
        let ff = down.inputs;
        let (gate, up) = if w.has(&format!("{}.weight", name("ffn_gate"))) {
            (
                Some(Linear::load(w, dev, &name("ffn_gate"), hidden, true)?),
                up,
            )
        } else if up.outputs == 2 * ff {
            let [gate, up] = up.split([ff, ff])?;
            (Some(gate), up)
        } else {
            (None, up)
        };
        Mlp::new(gate, up, down, hidden, act)
    }

    fn new(
        gate: Option<Linear>,
        up: Linear,
        down: Linear,
        hidden: usize,
        act: FfnActivation,
    ) -> Result<Mlp> {
        let gate_ok = gate.as_ref().is_none_or(|g| g.outputs == up.outputs);
        if !gate_ok || down.inputs != up.outputs || down.outputs != hidden {
            return Err(UError::invalid(format!(
                "arch-llama: feed-forward shapes do not agree ({} → {}{} → {})",
                hidden,
                gate.as_ref()
                    .map_or(String::new(), |g| format!("{}/", g.outputs)),
                up.outputs,
                down.outputs
            )));
        }
        Ok(Mlp {
            gate,
            up,
            down,
            act,
            sub_norm: None,
        })
    }

    /// The hidden width (`down`'s inputs).
    pub fn width(&self) -> usize {
        self.down.inputs
    }

    /// This network with `norm` applied to its hidden values before `down`.
    pub fn with_sub_norm(self, norm: Option<Norm>) -> Mlp {
        Mlp {
            sub_norm: norm,
            ..self
        }
    }

    /// `down(act(gate(x)) · up(x))`, with the adapters of `site` (a pass and its layer; none
    /// for experts) added to each projection.
    pub(crate) fn forward(&self, x: &Tensor, site: Option<(&Pass<'_>, u32)>) -> Result<Tensor> {
        let project = |w: &Linear, target: Target, x: &Tensor| -> Result<Tensor> {
            let y = w.forward(x)?;
            if let Some((pass, layer)) = site {
                pass.adapt(layer, target, x, &y)?;
            }
            Ok(y)
        };
        let up = project(&self.up, Target::Up, x)?;
        let h = match (&self.gate, self.act) {
            (Some(gate), FfnActivation::Act(act)) => {
                project(gate, Target::Gate, x)?.gated(act, &up)?
            }
            (Some(gate), act) => activate(act, project(gate, Target::Gate, x)?)?.mul(&up)?,
            (None, act) => activate(act, up)?,
        };
        project(&self.down, Target::Down, &maybe(&self.sub_norm, &h)?)
    }

    /// `(inputs, outputs)` of the gate (where there is one), up and down projections.
    fn projections(&self) -> [Option<(usize, usize)>; 3] {
        let dims = |l: &Linear| (l.inputs, l.outputs);
        [
            self.gate.as_ref().map(dims),
            Some(dims(&self.up)),
            Some(dims(&self.down)),
        ]
    }
}

/// `act(x)`.
fn activate(act: FfnActivation, x: Tensor) -> Result<Tensor> {
    match act {
        FfnActivation::Act(a) => x.activation(a),
        FfnActivation::ReluSquared => {
            let r = x.activation(Activation::Relu)?;
            r.mul(&r)
        }
    }
}

/// A sparse mixture of experts (Shazeer 2017; Mixtral, Jiang 2024): a softmax router picks the
/// top-k experts per token, their outputs are summed weighted by the (optionally renormalised)
/// gate values. Qwen2-MoE adds an always-on shared expert scaled by `sigmoid(x·w)`.
pub struct MoE {
    router: Linear,
    experts: Vec<Mlp>,
    used: usize,
    norm_topk: bool,
    shared: Option<(Mlp, Option<Linear>)>,
    /// The model's expert cache and this layer's index in it.
    cache: Option<(Arc<ExpertCache>, usize)>,
}

impl MoE {
    /// Loads layer `i`'s experts: stacked (`ffn_gate_exps`, GGUF) or one tensor per expert
    /// (`ffn_gate.{e}`, HF).
    pub fn load(w: &Weights, dev: &Device, cfg: &Config, moe: &MoeConfig, i: usize) -> Result<MoE> {
        let h = cfg.hidden;
        let router = Linear::load(w, dev, &format!("blk.{i}.ffn_gate_inp"), h, false)?;
        if router.outputs != moe.experts {
            return Err(UError::invalid(format!(
                "arch-llama: layer {i} router has {} outputs for {} experts",
                router.outputs, moe.experts
            )));
        }
        let experts = if w.has(&blk(i, "ffn_gate_exps", "weight")) {
            let [gate, up, down] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
                .map(|t| w.import(dev, &blk(i, t, "weight"), None));
            let (gate, up, down) = (gate?, up?, down?);
            (0..moe.experts)
                .map(|e| {
                    let g = Linear::expert(&gate, e, h)?;
                    let u = Linear::expert(&up, e, h)?;
                    let d = Linear::expert(&down, e, g.outputs)?;
                    Mlp::new(Some(g), u, d, h, cfg.activation)
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..moe.experts)
                .map(|e| Mlp::load(w, dev, h, i, &format!(".{e}"), cfg.activation))
                .collect::<Result<Vec<_>>>()?
        };
        let shared = if w.has(&blk(i, "ffn_gate_shexp", "weight")) {
            let mlp = Mlp::load(w, dev, h, i, "_shexp", cfg.activation)?;
            let gate = if w.has(&blk(i, "ffn_gate_inp_shexp", "weight")) {
                Some(Linear::load(
                    w,
                    dev,
                    &format!("blk.{i}.ffn_gate_inp_shexp"),
                    h,
                    false,
                )?)
            } else {
                None
            };
            Some((mlp, gate))
        } else {
            None
        };
        Ok(MoE {
            router,
            experts,
            used: moe.used,
            norm_topk: moe.norm_topk,
            shared,
            cache: None,
        })
    }

    /// What the expert cache advises on for this layer: its router and experts' weights.
    pub fn cache_layer(&self) -> ExpertLayer {
        ExpertLayer {
            router: self.router.weight().clone(),
            experts: self.experts.iter().map(Mlp::weights).collect(),
        }
    }

    /// Joins the model's expert cache as layer `layer`.
    pub fn attach(&mut self, cache: Arc<ExpertCache>, layer: usize) {
        self.cache = Some((cache, layer));
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n_exp, t, dev) = (self.experts.len(), x.rows(), x.device());
        let probs = self.router.forward(x)?;
        probs.softmax_assign()?;
        let top = probs.top_k(self.used)?.to_vec_i32()?;
        let p = probs.to_vec()?;

        // Route: per expert, the tokens it serves and their gate weights.
        let mut routes: Vec<(Vec<i32>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n_exp];
        for (tok, picked) in top.chunks_exact(self.used).enumerate() {
            let row = &p[tok * n_exp..(tok + 1) * n_exp];
            let sum: f32 = picked.iter().map(|&e| row[e as usize]).sum();
            for &e in picked {
                let g = row[e as usize];
                let (toks, gates) = &mut routes[e as usize];
                toks.push(tok as i32);
                gates.push(if self.norm_topk { g / sum } else { g });
            }
        }

        // Only the routed experts' weights are read: the cache has their pages asked for (and
        // the next layer's likely ones) before computing.
        if let Some((cache, layer)) = &self.cache {
            let routed: Vec<(usize, usize)> = routes
                .iter()
                .enumerate()
                .filter(|(_, (toks, _))| !toks.is_empty())
                .map(|(e, (toks, _))| (e, toks.len()))
                .collect();
            cache.before_experts(*layer, &routed, x)?;
        }
        let out = dev.from_f32(&vec![0.0; x.desc().shape.elements() as usize], x.dims())?;
        for (expert, (toks, gates)) in self.experts.iter().zip(&routes) {
            if toks.is_empty() {
                continue;
            }
            let ids = dev.from_i32(toks, &[toks.len() as u64])?;
            let y = expert.forward(&x.get_rows(&ids)?, None)?;
            out.scatter_add_assign(&y, &ids, &dev.from_f32(gates, &[gates.len() as u64])?)?;
        }

        if let Some((mlp, gate)) = &self.shared {
            let y = mlp.forward(x, None)?;
            let g = match gate {
                Some(gate) => {
                    let g = gate.forward(x)?;
                    g.activation_assign(Activation::Sigmoid)?;
                    g.to_vec()?
                }
                None => vec![1.0; t],
            };
            let all: Vec<i32> = (0..t as i32).collect();
            out.scatter_add_assign(
                &y,
                &dev.from_i32(&all, &[t as u64])?,
                &dev.from_f32(&g, &[t as u64])?,
            )?;
        }
        Ok(out)
    }
}

/// A block's feed-forward part: dense or mixture of experts, chosen per layer by whether the
/// layer has a router (`ffn_gate_inp`).
#[allow(clippy::large_enum_variant)] // one per layer, built once
pub enum FeedForward {
    /// Dense SwiGLU.
    Dense(Mlp),
    /// Sparse mixture of experts.
    MoE(MoE),
}

impl FeedForward {
    fn forward(&self, x: &Tensor, pass: &Pass<'_>, layer: u32) -> Result<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x, Some((pass, layer))),
            FeedForward::MoE(moe) => moe.forward(x),
        }
    }
}

/// A transformer block. Sequential (Llama and most):
/// `h = x + s·post₁(Attention(norm₁(x))); h + s·post₂(FFN(norm₂(h)))`, where the pre-norms
/// `norm` (absent in OLMo 2) and the post-norms `post` (Gemma 2's sandwich, OLMo 2) are there
/// when the checkpoint has them and `s` is the residual multiplier (Granite; 1 otherwise).
/// Parallel (GPT-J; GPT-NeoX, Falcon, Cohere, StableLM):
/// `x + s·Attention(norm₁(x)) + s·FFN(norm₂(x))`, with `norm₂ = norm₁` when the block has one
/// input norm. BitNet b1.58's sub-layer norms sit inside [`Attention`] and [`Mlp`].
pub struct Block {
    pub(crate) attn_norm: Option<Norm>,
    pub(crate) attn: Attention,
    pub(crate) post_attn_norm: Option<Norm>,
    pub(crate) ffn_norm: Option<Norm>,
    pub(crate) ffn: FeedForward,
    pub(crate) post_ffn_norm: Option<Norm>,
    pub(crate) parallel: bool,
    pub(crate) residual_scale: f32,
}

impl Block {
    /// Loads block `i`.
    pub fn load(w: &Weights, dev: &Device, cfg: &Config, i: usize) -> Result<Block> {
        let ffn = match (&cfg.moe, w.has(&blk(i, "ffn_gate_inp", "weight"))) {
            (Some(moe), true) => FeedForward::MoE(MoE::load(w, dev, cfg, moe, i)?),
            (None, true) => {
                return Err(UError::invalid(format!(
                    "arch-llama: layer {i} has a router but the metadata gives no expert count"
                )));
            }
            (_, false) => {
                let mlp = Mlp::load(w, dev, cfg.hidden, i, "", cfg.activation)?;
                let norm = sub_norm(w, dev, cfg, i, "ffn_sub_norm", mlp.width())?;
                FeedForward::Dense(mlp.with_sub_norm(norm))
            }
        };
        let norm = |t: &str| optional_norm(w, dev, cfg, i, t);
        // Falcon-40B's parallel block, in llama.cpp's names: `attn_norm_2` feeds attention,
        // `attn_norm` the FFN.
        let (attn_norm, ffn_norm) = match norm("attn_norm_2")? {
            Some(attn) => (Some(attn), norm("attn_norm")?),
            None => (norm("attn_norm")?, norm("ffn_norm")?),
        };
        let (post_attn_norm, post_ffn_norm) =
            (norm("post_attention_norm")?, norm("post_ffw_norm")?);
        if attn_norm.is_none() && post_attn_norm.is_none() {
            return Err(UError::not_found(format!(
                "arch-llama: tensor `{}` is missing",
                blk(i, "attn_norm", "weight")
            )));
        }
        if !cfg.parallel && ffn_norm.is_none() && post_ffn_norm.is_none() {
            return Err(UError::not_found(format!(
                "arch-llama: tensor `{}` is missing",
                blk(i, "ffn_norm", "weight")
            )));
        }
        Ok(Block {
            attn_norm,
            attn: Attention::load(w, dev, cfg, i)?,
            post_attn_norm,
            ffn_norm,
            ffn,
            post_ffn_norm,
            parallel: cfg.parallel,
            residual_scale: cfg.scales.residual,
        })
    }

    fn forward(&self, x: &Tensor, pass: &Pass<'_>) -> Result<Tensor> {
        let a_in = maybe(&self.attn_norm, x)?;
        let a = maybe(&self.post_attn_norm, &self.attn.forward(&a_in, pass)?)?;
        if self.parallel {
            let f_in = match &self.ffn_norm {
                Some(n) => n.forward(x)?,
                None => a_in,
            };
            let f = self.ffn.forward(&f_in, pass, self.attn.layer)?;
            return self.residual(&self.residual(x, &a)?, &f);
        }
        let h = self.residual(x, &a)?;
        let f = self
            .ffn
            .forward(&maybe(&self.ffn_norm, &h)?, pass, self.attn.layer)?;
        self.residual(&h, &maybe(&self.post_ffn_norm, &f)?)
    }

    /// `(inputs, outputs)` of each projection an adapter may change, in [`Target::ALL`] order
    /// (`None` for an MoE layer's feed-forward).
    fn projections(&self) -> [Option<(usize, usize)>; 7] {
        let [q, k, v, o] = self.attn.projections().map(Some);
        let [gate, up, down] = match &self.ffn {
            FeedForward::Dense(mlp) => mlp.projections(),
            FeedForward::MoE(_) => [None; 3],
        };
        [q, k, v, o, gate, up, down]
    }

    /// `x + s·y`.
    fn residual(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        if self.residual_scale == 1.0 {
            return x.add(y);
        }
        x.add(&y.scale(self.residual_scale)?)
    }
}

/// The adapters a model holds.
#[derive(Default)]
struct Resident {
    /// By name.
    by_name: HashMap<String, Arc<Adapter>>,
    /// All of them stacked, for passes that mix them (rebuilt when one loads or unloads).
    stack: Option<Arc<Stack>>,
}

impl Resident {
    fn restack(&mut self, fit: &Fit, device: &Device) -> Result<()> {
        let mut all: Vec<(&String, &Arc<Adapter>)> = self.by_name.iter().collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        let all: Vec<Arc<Adapter>> = all.into_iter().map(|(_, a)| a.clone()).collect();
        self.stack = Stack::build(&all, fit, device)?.map(Arc::new);
        Ok(())
    }
}

/// The decoder: embedding (scaled, plus learned positions where the model has them), blocks
/// (with a gated cross-attention block over an image's features before every
/// `cross_layer_interval`-th one where the checkpoint has them: IDEFICS, see
/// [`crate::idefics`]), final norm, LM head (the embedding matrix when `output.weight` is absent:
/// tied embeddings), logits scaled and soft-capped where the model says so.
pub struct Llama {
    /// Hyper-parameters.
    pub cfg: Config,
    pub(crate) device: Device,
    cache: KvCacheBox,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Norm,
    pub(crate) lm_head: Linear,
    /// The embedding table, `[vocab, hidden]`.
    pub(crate) embed: Tensor,
    /// Learned absolute position embeddings, `[context, hidden]` (GPT-2).
    pub(crate) positions: Option<Tensor>,
    /// Low-rank adapters sequences may run under, by name, and their stack.
    adapters: RwLock<Resident>,
    /// What an adapter must fit.
    pub(crate) fit: Fit,
    /// Where images stand among the tokens (LLaVA's decoder), if the model reads any.
    images: Option<ImageSlots>,
    /// Gated cross-attention blocks over an image's features (IDEFICS), if the model has any.
    pub(crate) cross: Option<CrossLayers>,
    /// The expert cache of an MoE model.
    experts: Option<Arc<ExpertCache>>,
}

impl Llama {
    /// Builds the model on `device` and declares its KV layout to `cache`, with the plugin's
    /// settings.
    pub fn load(
        weights: Weights,
        device: Device,
        cache: KvCacheBox,
        settings: &crate::LlamaArchitecture,
    ) -> Result<Llama> {
        let mut cfg = Config::from_weights(&weights)?;
        // Where the expert cache prefetches it decides what is read: the OS's read-ahead is off.
        let advise = cfg.moe.is_some()
            && settings.experts.effective().prefetch
            && weights.format() == "gguf";
        if advise {
            crate::experts::random_access(weights.set())?;
        }
        let dev = &device;
        let mut blocks = (0..cfg.layers)
            .map(|i| Block::load(&weights, dev, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let experts = cfg.moe.as_ref().map(|moe| {
            let layers = blocks
                .iter()
                .map(|b| match &b.ffn {
                    FeedForward::MoE(m) => Some(m.cache_layer()),
                    FeedForward::Dense(_) => None,
                })
                .collect();
            ExpertCache::new(settings.experts, moe.used, layers)
        });
        if let Some(cache) = &experts {
            for (i, b) in blocks.iter_mut().enumerate() {
                if let FeedForward::MoE(m) = &mut b.ffn {
                    m.attach(cache.clone(), i);
                }
            }
        }
        let cross = CrossLayers::load(&weights, dev, &cfg)?;
        if cross.is_some() {
            cfg.family = crate::idefics::FAMILY.into();
        }
        let head = if weights.has("output.weight") {
            "output"
        } else {
            "token_embd"
        };
        let embed = weights.import(dev, "token_embd.weight", None)?;
        let lm_head = Linear::load(&weights, dev, head, cfg.hidden, false)?;
        if let Some(cache) = experts.as_ref().filter(|_| advise) {
            // Embedding rows are read a few at a time, unless the table is the LM head too.
            let sparse = [&embed];
            let tied = head == "token_embd";
            cache.will_need_dense(weights.set(), if tied { &[] } else { &sparse })?;
        }
        if lm_head.outputs != cfg.vocab_size {
            return Err(UError::invalid(format!(
                "arch-llama: LM head has {} outputs for a vocabulary of {}",
                lm_head.outputs, cfg.vocab_size
            )));
        }
        let n = &cfg.norm;
        let norm = Norm::load(
            &weights,
            dev,
            "output_norm",
            cfg.hidden,
            n.kind,
            n.eps,
            n.shift,
        )?;
        let positions = match cfg.rope {
            Some(_) => None,
            None => {
                let table = weights.import(dev, "position_embd.weight", None)?;
                if table.row_len() != cfg.hidden || table.rows() < cfg.context_length {
                    return Err(UError::invalid(format!(
                        "arch-llama: position_embd.weight of shape {:?} for {} positions of {}",
                        table.dims(),
                        cfg.context_length,
                        cfg.hidden
                    )));
                }
                Some(table)
            }
        };
        let unread = weights.unread_layer_tensors();
        if let Some(first) = unread.first() {
            return Err(UError::unsupported(format!(
                "arch-llama: {} layer tensors of this {} checkpoint are not part of the model \
                 this plugin implements (a variant it does not support), e.g. `{first}`",
                unread.len(),
                cfg.arch
            )));
        }
        cache
            .configure(
                KvLayout {
                    layers: cfg.layers as u32,
                    kv_heads: cfg.kv_heads as u32,
                    head_dim: cfg.head_dim as u32,
                    dtype: DType::F32,
                    model_id: model_id(&weights, &cfg).into(),
                },
                device.backend().clone(),
            )
            .into_result()?;
        let fit = Fit {
            arch: cfg.arch.clone(),
            layers: blocks.iter().map(Block::projections).collect(),
            permuted: weights.format() == "gguf" && crate::naming::converter_permutes_qk(&cfg.arch),
            head_dim: cfg.head_dim,
        };
        Ok(Llama {
            cfg,
            device,
            cache,
            blocks,
            norm,
            lm_head,
            embed,
            positions,
            adapters: RwLock::default(),
            fit,
            images: None,
            cross,
            experts,
        })
    }

    /// The counters of its expert cache (none for dense models).
    pub fn counters(&self) -> Vec<u_sdk::ModelCounter> {
        self.experts
            .as_ref()
            .map_or_else(Vec::new, |c| c.counters())
    }

    /// Makes the model the decoder of a multimodal checkpoint of `family` (LLaVA): its
    /// [`ModelConfig`] says what an image is and which token stands for one, and the rows its
    /// image encoder makes come in as [`Segment::Embeddings`] where those tokens stand.
    pub fn read_images(&mut self, family: &str, slots: ImageSlots) {
        self.cfg.family = family.to_string();
        self.images = Some(slots);
    }

    /// What the model is, as the ABI says it.
    pub fn model_config(&self) -> ModelConfig {
        let c = &self.cfg;
        let (kind, context_shape) = match &self.cross {
            Some(x) => (
                ModelKind::CrossDecoder,
                [x.image.rows as u32, x.image.width as u32],
            ),
            None => (ModelKind::Decoder, [0, 0]),
        };
        ModelConfig {
            kind,
            family: c.family.as_str().into(),
            vocab_size: c.vocab_size as u32,
            hidden: c.hidden as u32,
            layers: c.layers as u32,
            context_length: c.context_length as u32,
            experts: c.moe.map_or(0, |m| m.experts) as u32,
            attention: AttentionMask::Causal,
            pooling: Pooling::Mean,
            context_shape,
            image: self.images.map(|i| i.spec).into(),
            image_token: match (&self.cross, self.images) {
                (Some(x), _) => x.image.image_token,
                (None, Some(i)) => i.token,
                (None, None) => u_sdk::NO_IMAGE_TOKEN,
            },
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    /// Whether the model cross-attends to a context (IDEFICS' gated blocks).
    pub fn is_cross_decoder(&self) -> bool {
        self.cross.is_some()
    }

    /// The cache the model's KV lives in.
    pub fn cache(&self) -> &KvCacheBox {
        &self.cache
    }

    /// Checks one chunk against the model: inputs in range, extras this model applies.
    fn check(&self, chunk: &SeqChunk<'_>) -> Result<usize> {
        let hidden = self.cfg.hidden;
        let bad =
            |why: String| UError::invalid(format!("arch-llama: sequence {}: {why}", chunk.seq));
        for segment in chunk.input.iter() {
            match segment {
                Segment::Tokens(t) => {
                    if let Some(&id) = t.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
                        return Err(bad(format!(
                            "token {id} is outside the vocabulary of {}",
                            self.cfg.vocab_size
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
                Segment::Image(_) if self.images.is_some() => {
                    return Err(UError::unsupported(format!(
                        "arch-llama: images reach a {} decoder as rows its image encoder made \
                         (embedding rows where the image token stands), not as pixels",
                        self.cfg.family
                    )));
                }
                Segment::Image(_) | Segment::Planes(_) => {
                    return Err(UError::unsupported(
                        "arch-llama: the model reads token ids and embedding rows, not images or \
                         feature maps",
                    ));
                }
            }
        }
        if chunk.output == Output::Planes {
            return Err(UError::unsupported(
                "arch-llama: a decoder writes logits and hidden states, not feature maps",
            ));
        }
        let x = &chunk.extras;
        if !x.conditioning.is_empty() {
            return Err(UError::unsupported(
                "arch-llama: the model takes no conditioning",
            ));
        }
        if x.cross.is_some() && self.cross.is_none() {
            return Err(UError::unsupported(
                "arch-llama: a decoder-only model takes no cross-attention context",
            ));
        }
        for s in x.steering.iter() {
            if s.vector.len() != hidden
                || s.first_layer > s.last_layer
                || s.last_layer as usize >= self.cfg.layers
            {
                return Err(bad(format!(
                    "a steering vector of {} values for blocks {}..={} (the model has {} blocks of \
                     width {hidden})",
                    s.vector.len(),
                    s.first_layer,
                    s.last_layer,
                    self.cfg.layers
                )));
            }
        }
        let rows = chunk.rows(hidden);
        if rows == 0 && chunk.output != Output::Nothing {
            return Err(bad("asks for output of no input".into()));
        }
        Ok(rows)
    }

    /// Runs `batch`, writing the outputs it asks for (see [`u_sdk::Model::forward`]). On error
    /// the sequences are rolled back to their lengths before the call.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let config = self.model_config();
        let mut spans = Vec::with_capacity(batch.len());
        let (mut offset, mut floats) = (0, 0);
        for (n, chunk) in batch.iter().enumerate() {
            if batch[..n].iter().any(|c| c.seq == chunk.seq) {
                return Err(UError::invalid(format!(
                    "arch-llama: sequence {} appears twice in one batch",
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
                        "arch-llama: sequence {} would reach {} positions, past the context length {}",
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
                "arch-llama: the output buffer holds {} floats, the batch asks for {floats}",
                out.len()
            )));
        }
        let cross = match &self.cross {
            Some(c) => c.plan(batch, &self.cache)?,
            None => CrossPlan::default(),
        };
        if offset == 0 {
            return Ok(());
        }
        let adapters = self.adapter_plan(batch, &spans, offset)?;
        let result = self.run(batch, &spans, &cross, adapters, out);
        if result.is_err() {
            for s in &spans {
                let _ = self.cache.truncate(s.seq, s.start as u64);
            }
            for &(kv, _) in &cross.brought {
                let _ = self.cache.truncate(kv, 0);
            }
        }
        result
    }

    /// The batch's input rows: token embeddings and embedding rows, in order.
    fn input(&self, batch: &[SeqChunk<'_>], rows: usize) -> Result<Tensor> {
        let dev = &self.device;
        let segments = || batch.iter().flat_map(|c| c.input.iter());
        if segments().all(|s| matches!(s, Segment::Tokens(_))) {
            let ids: Vec<i32> = segments()
                .flat_map(|s| match s {
                    Segment::Tokens(t) => t.as_slice(),
                    Segment::Embeddings(_) | Segment::Image(_) | Segment::Planes(_) => &[],
                })
                .map(|&t| t as i32)
                .collect();
            return self
                .embed
                .get_rows(&dev.from_i32(&ids, &[ids.len() as u64])?);
        }
        let hidden = self.cfg.hidden;
        let x = dev.alloc(DType::F32, &[rows as u64, hidden as u64])?;
        let mut at = 0;
        for s in segments() {
            let n = s.rows(hidden);
            let dst = x.rows_range(at..at + n)?;
            match s {
                Segment::Tokens(t) => {
                    let ids: Vec<i32> = t.iter().map(|&t| t as i32).collect();
                    let e = self.embed.get_rows(&dev.from_i32(&ids, &[n as u64])?)?;
                    e.copy_into(None, &dst)?;
                }
                Segment::Embeddings(e) => dst.write(e)?,
                Segment::Image(_) | Segment::Planes(_) => {
                    return Err(UError::unsupported(
                        "arch-llama: images and feature maps are not read",
                    ));
                }
            }
            at += n;
        }
        Ok(x)
    }

    /// How `batch` (of `rows` rows) applies the adapters it names: the rows under each (as
    /// ranges, consecutive sequences under the same adapter at the same scale merged), through
    /// the stack when there are several ([`Plan::new`]).
    fn adapter_plan(&self, batch: &[SeqChunk<'_>], spans: &[Span], rows: usize) -> Result<Plan> {
        let resident = self.adapters.read().unwrap_or_else(|e| e.into_inner());
        let held = &resident.by_name;
        let mut groups: Vec<Group> = Vec::new();
        for (chunk, span) in batch.iter().zip(spans) {
            for asked in chunk.extras.adapters.iter() {
                let Some(adapter) = held.get(asked.name.as_str()) else {
                    return Err(UError::not_found(format!(
                        "arch-llama: sequence {} asks for adapter `{}`, which is not loaded",
                        chunk.seq, asked.name
                    )));
                };
                if !asked.scale.is_finite() {
                    return Err(UError::invalid(format!(
                        "arch-llama: adapter `{}` at scale {}",
                        asked.name, asked.scale
                    )));
                }
                let extends = groups.iter_mut().rev().find(|g| {
                    g.rows.end == span.offset
                        && Arc::ptr_eq(&g.adapter, adapter)
                        && g.strength == asked.scale
                });
                match extends {
                    Some(g) => g.rows.end = span.offset + span.len,
                    None => groups.push(Group {
                        rows: span.rows(),
                        adapter: adapter.clone(),
                        strength: asked.scale,
                    }),
                }
            }
        }
        Plan::new(&groups, resident.stack.clone(), rows, &self.device)
    }

    /// Loads adapter `name` (see [`u_sdk::Model::load_adapter`]).
    pub fn load_adapter(
        &self,
        name: &str,
        weights: &u_sdk::WeightSetBox,
        config: &str,
    ) -> Result<u_sdk::AdapterInfo> {
        if name.is_empty() {
            return Err(UError::invalid("arch-llama: an adapter needs a name"));
        }
        let adapter = Adapter::load(name, weights, config, &self.fit)?;
        let info = adapter.info.clone();
        let mut resident = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        let replaced = resident.by_name.insert(name.to_string(), Arc::new(adapter));
        if let Err(e) = resident.restack(&self.fit, &self.device) {
            match replaced {
                Some(old) => resident.by_name.insert(name.to_string(), old),
                None => resident.by_name.remove(name),
            };
            resident.restack(&self.fit, &self.device)?;
            return Err(e);
        }
        Ok(info)
    }

    /// Forgets adapter `name`; whether it was held.
    pub fn unload_adapter(&self, name: &str) -> Result<bool> {
        let mut resident = self.adapters.write().unwrap_or_else(|e| e.into_inner());
        let gone = resident.by_name.remove(name).is_some();
        if gone {
            resident.restack(&self.fit, &self.device)?;
        }
        Ok(gone)
    }

    /// The adapters held, by name.
    pub fn adapters(&self) -> Vec<u_sdk::AdapterInfo> {
        let resident = self.adapters.read().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<_> = resident.by_name.values().map(|a| a.info.clone()).collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    fn run(
        &self,
        batch: &[SeqChunk<'_>],
        spans: &[Span],
        cross: &CrossPlan<'_>,
        adapters: Plan,
        out: &mut [f32],
    ) -> Result<()> {
        let dev = &self.device;
        let rows: usize = spans.iter().map(|s| s.len).sum();
        let positions: Vec<i32> = spans
            .iter()
            .flat_map(|s| (s.start..s.start + s.len).map(|p| p as i32))
            .collect();
        let pass = Pass {
            cache: self.cache.clone(),
            spans,
            cross: &cross.spans,
            positions: dev.from_i32(&positions, &[rows as u64])?,
            adapters,
        };
        let wants_layer = |i: usize| {
            batch
                .iter()
                .any(|c| matches!(c.output, Output::Hidden { layer, .. } if layer as usize == i))
        };
        let mut captured: Vec<(usize, Tensor)> = Vec::new();
        let mut x = self.input(batch, rows)?;
        if self.cfg.scales.embedding != 1.0 {
            x = x.scale(self.cfg.scales.embedding)?;
        }
        if let Some(table) = &self.positions {
            x = x.add(&table.get_rows(&pass.positions)?)?;
        }
        if let Some(c) = &self.cross {
            c.remember(dev, &self.cache, cross)?;
        }
        for (i, block) in self.blocks.iter().enumerate() {
            if let Some(gated) = self.cross.as_ref().and_then(|c| c.before(i)) {
                x = gated.forward(&x, &pass)?;
            }
            x = block.forward(&x, &pass)?;
            for (chunk, span) in batch.iter().zip(spans) {
                for s in chunk.extras.steering.iter() {
                    if (s.first_layer as usize..=s.last_layer as usize).contains(&i) {
                        let v = dev.from_f32(&s.vector, &[1, s.vector.len() as u64])?;
                        x.rows_range(span.rows())?
                            .add_scaled_assign(&v, s.strength)?;
                    }
                }
            }
            if wants_layer(i) {
                captured.push((i, x.clone()));
            }
        }
        self.write_outputs(batch, spans, &x, &captured, out)
    }

    /// Writes each chunk's output into its part of `out`, in batch order: logits through one
    /// LM-head matmul over every row that wants them, hidden states and pooled vectors from the
    /// normed final rows (or a captured block's rows).
    fn write_outputs(
        &self,
        batch: &[SeqChunk<'_>],
        spans: &[Span],
        x: &Tensor,
        captured: &[(usize, Tensor)],
        out: &mut [f32],
    ) -> Result<()> {
        let dev = &self.device;
        let (hidden, vocab, layers) = (self.cfg.hidden, self.cfg.vocab_size, self.cfg.layers);
        let wanted = |rows: &Rows, span: &Span| match rows {
            Rows::Last => span.offset + span.len - 1..span.offset + span.len,
            Rows::All => span.rows(),
        };
        let logit_rows: Vec<i32> = batch
            .iter()
            .zip(spans)
            .filter_map(|(c, s)| match &c.output {
                Output::Logits(r) => Some(wanted(r, s)),
                _ => None,
            })
            .flatten()
            .map(|r| r as i32)
            .collect();
        let logits = if logit_rows.is_empty() {
            None
        } else {
            let ids = dev.from_i32(&logit_rows, &[logit_rows.len() as u64])?;
            let h = self.norm.forward(&x.get_rows(&ids)?)?;
            Some(self.logits(&h)?)
        };
        let needs_final = batch.iter().any(|c| {
            matches!(c.output, Output::Pooled(_))
                || matches!(c.output, Output::Hidden { layer, .. } if layer as usize == layers)
        });
        let normed = match needs_final {
            true => Some(self.norm.forward(x)?.to_vec()?),
            false => None,
        };
        let layer_rows = |layer: usize| -> Result<Vec<f32>> {
            match captured.iter().find(|(i, _)| *i == layer) {
                Some((_, t)) => t.to_vec(),
                None => Ok(normed.clone().unwrap_or_default()),
            }
        };
        let (mut at, mut next_logit) = (0, 0);
        for (chunk, span) in batch.iter().zip(spans) {
            match &chunk.output {
                // `check` refused feature maps before the pass.
                Output::Nothing | Output::Planes => {}
                Output::Logits(r) => {
                    let rows = wanted(r, span).len();
                    let logits = logits.as_ref().ok_or_else(|| {
                        UError::new(ErrorKind::Internal, "arch-llama: logits were not computed")
                    })?;
                    logits
                        .rows_range(next_logit..next_logit + rows)?
                        .read_into(&mut out[at..at + rows * vocab])?;
                    next_logit += rows;
                    at += rows * vocab;
                }
                Output::Hidden { layer, rows } => {
                    let all = layer_rows(*layer as usize)?;
                    let r = wanted(rows, span);
                    let n = r.len() * hidden;
                    out[at..at + n].copy_from_slice(&all[r.start * hidden..r.end * hidden]);
                    at += n;
                }
                Output::Pooled(pooling) => {
                    let all = normed.as_deref().unwrap_or_default();
                    let rows = &all[span.offset * hidden..(span.offset + span.len) * hidden];
                    pooling.pool(rows, hidden, &mut out[at..at + hidden])?;
                    at += hidden;
                }
            }
        }
        Ok(())
    }

    /// The LM head over normed rows `h`, scaled and soft-capped: `c · tanh(m·l / c)`.
    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let s = &self.cfg.scales;
        let mut logits = self.lm_head.forward(h)?;
        if s.logits != 1.0 {
            logits.scale_assign(s.logits)?;
        }
        if let Some(cap) = s.final_softcap {
            logits = logits.scale(1.0 / cap)?;
            logits.activation_assign(Activation::Tanh)?;
            logits.scale_assign(cap)?;
        }
        Ok(logits)
    }

    /// Appends positions `from..from + count` of `src`'s KV to `dst`, keys re-rotated from their
    /// old positions to `dst`'s (see [`u_sdk::Model::graft`]); on error `dst` is unchanged.
    pub fn graft(&self, dst: SeqId, src: SeqId, from: u64, count: u64) -> Result<()> {
        let cache = self.cache.clone();
        let held = cache.len(src).into_result()?;
        if from.checked_add(count).is_none_or(|end| end > held) {
            return Err(UError::invalid(format!(
                "arch-llama: graft of positions {from}..{} but sequence {src} holds {held}",
                from.saturating_add(count)
            )));
        }
        let q0 = cache.len(dst).into_result()?;
        if q0 + count > self.cfg.context_length as u64 {
            return Err(UError::new(
                ErrorKind::ResourceExhausted,
                format!(
                    "arch-llama: the graft would take sequence {dst} to {} positions, past the \
                     context length {}",
                    q0 + count,
                    self.cfg.context_length
                ),
            ));
        }
        let Some(rope) = &self.cfg.rope else {
            return Err(UError::unsupported(
                "arch-llama: a model with learned absolute positions cannot move cached keys",
            ));
        };
        let result = self.graft_layers(&cache, rope, (dst, src), from, count, q0);
        if result.is_err() {
            let _ = cache.truncate(dst, q0);
        }
        result
    }

    fn graft_layers(
        &self,
        cache: &KvCacheBox,
        rope: &RopeConfig,
        (dst, src): (SeqId, SeqId),
        from: u64,
        count: u64,
        q0: u64,
    ) -> Result<()> {
        let dev = &self.device;
        let n = count as usize;
        let to: Vec<i32> = (q0..q0 + count).map(|p| p as i32).collect();
        let was: Vec<i32> = (from..from + count).map(|p| p as i32).collect();
        let (to, was) = (dev.from_i32(&to, &[count])?, dev.from_i32(&was, &[count])?);
        let rope = RopeParams {
            attn_factor: 1.0,
            ..rope_params(rope, self.cfg.head_dim, self.cfg.kv_heads)
        };
        let kd = (self.cfg.kv_heads * self.cfg.head_dim) as u64;
        for layer in 0..self.cfg.layers as u32 {
            let pages = cache.pages(src, layer).into_result()?;
            let (k, v) = (
                dev.alloc(DType::F32, &[count, kd])?,
                dev.alloc(DType::F32, &[count, kd])?,
            );
            let mut start = 0usize;
            for p in &pages {
                let len = p.tokens as usize;
                let (a, b) = (
                    (from as usize).max(start),
                    (from as usize + n).min(start + len),
                );
                if a < b {
                    let rows = a - start..b - start;
                    let dst_rows = a - from as usize..b - from as usize;
                    let scales = [&p.key_scales, &p.value_scales];
                    for ((t, s), d) in [&p.keys, &p.values].into_iter().zip(scales).zip([&k, &v]) {
                        let s = match s {
                            ROption::RSome(s) => {
                                Some(dev.tensor(s.clone()).rows_range(rows.clone())?)
                            }
                            ROption::RNone => None,
                        };
                        dev.tensor(t.clone())
                            .rows_range(rows.clone())?
                            .copy_into(s.as_ref(), &d.rows_range(dst_rows.clone())?)?;
                    }
                }
                start += len;
            }
            k.rope_move_assign(&to, &was, &rope)?;
            cache.append(dst, layer, k.desc(), v.desc()).into_result()?;
        }
        Ok(())
    }
}

/// An identity of the model for the cache: FNV-1a over the architecture, every tensor's name,
/// dtype and shape, and the first bytes of the embedding table.
fn model_id(w: &Weights, cfg: &Config) -> String {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(cfg.arch.as_bytes());
    let mut names: Vec<(&String, &Vec<u64>)> = w.shapes().collect();
    names.sort();
    for (name, shape) in names {
        eat(name.as_bytes());
        shape.iter().for_each(|d| eat(&d.to_le_bytes()));
    }
    if let Ok(v) = w.view("token_embd.weight") {
        eat(&v.data.as_slice()[..v.data.len().min(4096)]);
    }
    format!("arch-llama:{}:{hash:016x}", cfg.family)
}
