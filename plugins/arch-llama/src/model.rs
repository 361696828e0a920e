//! The decoder: `Attention`, `Mlp`/`MoE`, `Block`, and the model that stacks them.
//!
//! Every forward pass runs all tokens of all sequences of a batch together through the
//! projections (one matmul per weight per pass); only attention runs per sequence, over that
//! sequence's KV pages. Activations live in reused scratch buffers.

use crate::{
    config::{Config, MoeConfig},
    weights::{Linear, Weights},
};
use abi_stable::std_types::{RSlice, RSliceMut};
use std::sync::Mutex;
use u_sdk::{
    Activation, AttentionParams, DType, KernelsBox, KvCacheBox, KvLayout, KvPage, KvSpan,
    LogitsWanted, Result, RopeParams, SeqChunk, SeqId, UError, naming::blk,
};

/// What every layer computes with.
pub(crate) struct Ctx<'a> {
    /// The kernels.
    pub k: &'a KernelsBox,
    /// The KV cache.
    pub cache: &'a KvCacheBox,
}

/// One sequence's run of tokens inside the batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Segment {
    /// The sequence.
    pub seq: SeqId,
    /// Tokens already cached before this pass (the position of the first new token).
    pub start: usize,
    /// Offset of the first token in the batch.
    pub offset: usize,
    /// Number of new tokens.
    pub len: usize,
}

/// Reused activation buffers, grown to the largest batch seen.
#[derive(Default)]
pub(crate) struct Scratch {
    tokens: Vec<u32>,
    positions: Vec<u32>,
    x: Vec<f32>,
    h: Vec<f32>,
    out: Vec<f32>,
    attn: AttnScratch,
    ffn: FfnScratch,
}

#[derive(Default)]
struct AttnScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    tmp: Vec<f32>,
    ctx: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

#[derive(Default)]
struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    router: Vec<f32>,
    xe: Vec<f32>,
    ye: Vec<f32>,
    shared: Vec<f32>,
    shared_gate: Vec<f32>,
    routes: Vec<Vec<(usize, f32)>>,
    picked: Vec<(usize, f32)>,
}

/// `v[..n]`, growing `v` when needed (never shrinking, so steady-state decoding allocates
/// nothing).
fn buf(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

fn rms_norm(k: &KernelsBox, x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) -> Result<()> {
    k.rms_norm(
        RSlice::from_slice(x),
        RSlice::from_slice(w),
        eps,
        RSliceMut::from_mut_slice(y),
    )
    .into_result()
}

/// The rotation of `heads` heads of `cfg.head_dim` values at a token's position.
fn rope_params(cfg: &Config, heads: usize) -> RopeParams {
    RopeParams {
        style: cfg.rope.style,
        rotary_dim: cfg.rope.rotary_dim as u32,
        head_dim: cfg.head_dim as u32,
        heads: heads as u32,
        inv_freq: cfg.rope.inv_freq.clone().into(),
        attn_factor: cfg.rope.attn_factor,
    }
}

/// Multi-head self-attention with grouped-query KV heads and rotary positions (RoFormer), with
/// the optional Q/K/V biases of Qwen2, the Q/K RMSNorm of Qwen3 (per head) and OLMoE (over the
/// whole projection), and OLMoE's Q/K/V clamp.
pub struct Attention {
    layer: u32,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    rope_q: RopeParams,
    rope_k: RopeParams,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: u32,
    clip: Option<f32>,
    eps: f32,
}

impl Attention {
    /// Loads layer `i`'s attention.
    pub fn load(w: &Weights, cfg: &Config, i: usize) -> Result<Attention> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let q = Linear::load(w, &format!("blk.{i}.attn_q"), h, true)?;
        let k = Linear::load(w, &format!("blk.{i}.attn_k"), h, true)?;
        let v = Linear::load(w, &format!("blk.{i}.attn_v"), h, true)?;
        let o = Linear::load(w, &format!("blk.{i}.attn_output"), cfg.heads * hd, false)?;
        if q.outputs != cfg.heads * hd
            || k.outputs != cfg.kv_heads * hd
            || v.outputs != cfg.kv_heads * hd
            || o.outputs != h
        {
            return Err(UError::invalid(format!(
                "arch-llama: layer {i} attention shapes do not match {} heads, {} KV heads of {hd}",
                cfg.heads, cfg.kv_heads
            )));
        }
        // Q/K norms scale one head (`head_dim` values) or the whole projection.
        let norm = |t: &str, heads: usize| -> Result<Option<Vec<f32>>> {
            let name = blk(i, t, "weight");
            if !w.has(&name) {
                return Ok(None);
            }
            let v = w.f32(&name)?;
            if v.len() != hd && v.len() != heads * hd {
                return Err(UError::invalid(format!(
                    "arch-llama: {name} has {} values, expected {hd} or {}",
                    v.len(),
                    heads * hd
                )));
            }
            Ok(Some(v))
        };
        Ok(Attention {
            layer: i as u32,
            q,
            k,
            v,
            o,
            q_norm: norm("attn_q_norm", cfg.heads)?,
            k_norm: norm("attn_k_norm", cfg.kv_heads)?,
            rope_q: rope_params(cfg, cfg.heads),
            rope_k: rope_params(cfg, cfg.kv_heads),
            heads: cfg.heads,
            kv_heads: cfg.kv_heads,
            head_dim: hd,
            window: cfg.window[i],
            clip: cfg.clip_qkv,
            eps: cfg.rms_eps,
        })
    }

    /// `out = Attention(h)` for every token of the batch, appending this layer's K/V.
    fn forward(
        &self,
        c: &Ctx<'_>,
        segs: &[Segment],
        positions: &[u32],
        h: &[f32],
        s: &mut AttnScratch,
        out: &mut [f32],
    ) -> Result<()> {
        let t = positions.len();
        let (qd, kd) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        let q = buf(&mut s.q, t * qd);
        let k = buf(&mut s.k, t * kd);
        let v = buf(&mut s.v, t * kd);
        let tmp = buf(&mut s.tmp, t * qd);
        match &self.q_norm {
            Some(nw) => {
                self.q.forward(c.k, h, t, tmp)?;
                rms_norm(c.k, tmp, nw, self.eps, q)?;
            }
            None => self.q.forward(c.k, h, t, q)?,
        }
        match &self.k_norm {
            Some(nw) => {
                self.k.forward(c.k, h, t, &mut tmp[..t * kd])?;
                rms_norm(c.k, &tmp[..t * kd], nw, self.eps, k)?;
            }
            None => self.k.forward(c.k, h, t, k)?,
        }
        self.v.forward(c.k, h, t, v)?;
        if let Some(c) = self.clip {
            for x in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *x = x.clamp(-c, c);
            }
        }
        let pos = RSlice::from_slice(positions);
        c.k.rope(RSliceMut::from_mut_slice(q), pos, &self.rope_q)
            .into_result()?;
        c.k.rope(RSliceMut::from_mut_slice(k), pos, &self.rope_k)
            .into_result()?;

        let ctx = buf(&mut s.ctx, t * qd);
        for seg in segs.iter().filter(|s| s.len > 0) {
            let rows = seg.offset..seg.offset + seg.len;
            c.cache
                .append(
                    seg.seq,
                    self.layer,
                    RSlice::from_slice(&k[rows.start * kd..rows.end * kd]),
                    RSlice::from_slice(&v[rows.start * kd..rows.end * kd]),
                )
                .into_result()?;
            let pages = c.cache.pages(seg.seq, self.layer).into_result()?;
            let kv_len: usize = pages.iter().map(|p| p.tokens as usize).sum();
            if kv_len != seg.start + seg.len {
                return Err(UError::new(
                    u_sdk::ErrorKind::Internal,
                    format!(
                        "arch-llama: sequence {} layer {} holds {kv_len} cached tokens, expected {}",
                        seg.seq,
                        self.layer,
                        seg.start + seg.len
                    ),
                ));
            }
            let (spans, kv_dtype) = kv_spans(&pages, kd, &mut s.keys, &mut s.values)?;
            let params = AttentionParams {
                heads: self.heads as u32,
                kv_heads: self.kv_heads as u32,
                head_dim: self.head_dim as u32,
                queries: seg.len as u32,
                kv_len: kv_len as u32,
                first_query_pos: seg.start as u32,
                window: self.window,
                scale: 1.0 / (self.head_dim as f32).sqrt(),
                kv_dtype,
            };
            c.k.attention(
                RSlice::from_slice(&q[rows.start * qd..rows.end * qd]),
                RSlice::from_slice(&spans),
                &params,
                RSliceMut::from_mut_slice(&mut ctx[rows.start * qd..rows.end * qd]),
            )
            .into_result()?;
        }
        self.o.forward(c.k, ctx, t, out)
    }
}

/// The keys and values of `pages` as spans for the attention kernel, read where they lie: every
/// page f32, or every page int8 (with its scales); a sequence that mixes the two (int8 switched
/// on part-way) is dequantized into `keys`/`values` as one f32 span. Returns the spans' dtype.
fn kv_spans<'p>(
    pages: &'p [KvPage<'p>],
    kd: usize,
    keys: &'p mut Vec<f32>,
    values: &'p mut Vec<f32>,
) -> Result<(Vec<KvSpan<'p>>, DType)> {
    let short = |p: &KvPage<'_>| {
        UError::new(
            u_sdk::ErrorKind::Internal,
            format!("arch-llama: KV page of {} tokens is short", p.tokens),
        )
    };
    let groups = kd.div_ceil(u_sdk::KV_INT8_GROUP as usize);
    for dtype in [DType::F32, DType::I8] {
        if !pages.iter().all(|p| p.dtype == dtype) {
            continue;
        }
        let spans = pages
            .iter()
            .map(|p| {
                let (n, ns) = (p.tokens as usize * kd, p.tokens as usize * groups);
                Ok(if dtype == DType::F32 {
                    let k = p.keys.as_slice().get(..n).ok_or_else(|| short(p))?;
                    let v = p.values.as_slice().get(..n).ok_or_else(|| short(p))?;
                    KvSpan::f32(p.tokens, k, v)
                } else {
                    let part = |q: &'p [i8], s: &'p [f32]| {
                        q.get(..n).zip(s.get(..ns)).ok_or_else(|| short(p))
                    };
                    KvSpan::i8(
                        p.tokens,
                        part(p.keys_i8.as_slice(), p.key_scales.as_slice())?,
                        part(p.values_i8.as_slice(), p.value_scales.as_slice())?,
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok((spans, dtype));
    }
    keys.clear();
    values.clear();
    for p in pages {
        let n = p.tokens as usize * kd;
        let (k, v) = (p.keys_f32(), p.values_f32());
        keys.extend_from_slice(k.get(..n).ok_or_else(|| short(p))?);
        values.extend_from_slice(v.get(..n).ok_or_else(|| short(p))?);
    }
    let tokens = (keys.len() / kd.max(1)) as u32;
    Ok((vec![KvSpan::f32(tokens, keys, values)], DType::F32))
}

/// The SwiGLU feed-forward network (Shazeer 2020): `down(silu(gate(x)) ⊙ up(x))`.
pub struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    /// Asks for the pages of its three weights ahead of use (see [`Linear::prefetch`]).
    pub fn prefetch(&self) {
        self.gate.prefetch();
        self.up.prefetch();
        self.down.prefetch();
    }

    /// Loads `blk.{i}.ffn_{gate,up,down}{suffix}`.
    pub fn load(w: &Weights, hidden: usize, i: usize, suffix: &str) -> Result<Mlp> {
        let gate = Linear::load(w, &format!("blk.{i}.ffn_gate{suffix}"), hidden, false)?;
        let up = Linear::load(w, &format!("blk.{i}.ffn_up{suffix}"), hidden, false)?;
        let down = Linear::load(w, &format!("blk.{i}.ffn_down{suffix}"), gate.outputs, false)?;
        Mlp::new(gate, up, down, hidden)
    }

    fn new(gate: Linear, up: Linear, down: Linear, hidden: usize) -> Result<Mlp> {
        if up.outputs != gate.outputs || down.inputs != gate.outputs || down.outputs != hidden {
            return Err(UError::invalid(format!(
                "arch-llama: feed-forward shapes do not agree ({} → {}/{} → {})",
                hidden, gate.outputs, up.outputs, down.outputs
            )));
        }
        Ok(Mlp { gate, up, down })
    }

    fn forward(
        &self,
        c: &Ctx<'_>,
        x: &[f32],
        t: usize,
        gate: &mut Vec<f32>,
        up: &mut Vec<f32>,
        out: &mut [f32],
    ) -> Result<()> {
        let ff = self.gate.outputs;
        let g = buf(gate, t * ff);
        let u = buf(up, t * ff);
        self.gate.forward(c.k, x, t, g)?;
        self.up.forward(c.k, x, t, u)?;
        c.k.activation(RSliceMut::from_mut_slice(g), Activation::Silu)
            .into_result()?;
        g.iter_mut().zip(u.iter()).for_each(|(g, u)| *g *= u);
        self.down.forward(c.k, g, t, out)
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
    prefetch: bool,
    shared: Option<(Mlp, Option<Linear>)>,
}

impl MoE {
    /// Loads layer `i`'s experts: stacked (`ffn_gate_exps`, GGUF) or one tensor per expert
    /// (`ffn_gate.{e}`, HF).
    pub fn load(w: &Weights, cfg: &Config, moe: &MoeConfig, i: usize) -> Result<MoE> {
        let h = cfg.hidden;
        let router = Linear::load(w, &format!("blk.{i}.ffn_gate_inp"), h, false)?;
        if router.outputs != moe.experts {
            return Err(UError::invalid(format!(
                "arch-llama: layer {i} router has {} outputs for {} experts",
                router.outputs, moe.experts
            )));
        }
        let stacked = w.has(&blk(i, "ffn_gate_exps", "weight"));
        let experts = (0..moe.experts)
            .map(|e| {
                if stacked {
                    let gate = Linear::stacked(w, &blk(i, "ffn_gate_exps", "weight"), e, h)?;
                    let up = Linear::stacked(w, &blk(i, "ffn_up_exps", "weight"), e, h)?;
                    let down =
                        Linear::stacked(w, &blk(i, "ffn_down_exps", "weight"), e, gate.outputs)?;
                    Mlp::new(gate, up, down, h)
                } else {
                    Mlp::load(w, h, i, &format!(".{e}"))
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = if w.has(&blk(i, "ffn_gate_shexp", "weight")) {
            let mlp = Mlp::load(w, h, i, "_shexp")?;
            let gate = if w.has(&blk(i, "ffn_gate_inp_shexp", "weight")) {
                Some(Linear::load(
                    w,
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
            prefetch: moe.prefetch,
            shared,
        })
    }

    fn forward(
        &self,
        c: &Ctx<'_>,
        x: &[f32],
        t: usize,
        s: &mut FfnScratch,
        out: &mut [f32],
    ) -> Result<()> {
        let (n_exp, hidden) = (self.experts.len(), self.router.inputs);
        let probs = buf(&mut s.router, t * n_exp);
        self.router.forward(c.k, x, t, probs)?;
        c.k.softmax(RSliceMut::from_mut_slice(probs), n_exp as u32)
            .into_result()?;

        // Route: per expert, the tokens it serves and their gate weights.
        s.routes.resize_with(n_exp, Vec::new);
        s.routes.iter_mut().for_each(Vec::clear);
        let picked = &mut s.picked;
        for (tok, row) in probs.chunks_exact(n_exp).enumerate() {
            picked.clear();
            picked.extend(row.iter().copied().enumerate());
            // Largest first; ties to the lower index, as torch.topk.
            picked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let top = &picked[..self.used];
            let sum: f32 = top.iter().map(|p| p.1).sum();
            for &(e, p) in top {
                let g = if self.norm_topk { p / sum } else { p };
                s.routes[e].push((tok, g));
            }
        }

        // Only the routed experts' weights are read: ask for their pages before computing.
        if self.prefetch {
            for (expert, routes) in self.experts.iter().zip(&s.routes) {
                if !routes.is_empty() {
                    expert.prefetch();
                }
            }
        }
        out[..t * hidden].fill(0.0);
        for (expert, routes) in self.experts.iter().zip(&s.routes) {
            if routes.is_empty() {
                continue;
            }
            let n = routes.len();
            let xe = buf(&mut s.xe, n * hidden);
            for (row, &(tok, _)) in xe.chunks_exact_mut(hidden).zip(routes) {
                row.copy_from_slice(&x[tok * hidden..(tok + 1) * hidden]);
            }
            let ye = buf(&mut s.ye, n * hidden);
            expert.forward(c, xe, n, &mut s.gate, &mut s.up, ye)?;
            for (row, &(tok, g)) in ye.chunks_exact(hidden).zip(routes) {
                let o = &mut out[tok * hidden..(tok + 1) * hidden];
                o.iter_mut().zip(row).for_each(|(o, y)| *o += g * y);
            }
        }

        if let Some((mlp, gate)) = &self.shared {
            let y = buf(&mut s.shared, t * hidden);
            mlp.forward(c, x, t, &mut s.gate, &mut s.up, y)?;
            let sg = buf(&mut s.shared_gate, t);
            if let Some(gate) = gate {
                gate.forward(c.k, x, t, sg)?;
                sg.iter_mut().for_each(|g| *g = 1.0 / (1.0 + (-*g).exp()));
            } else {
                sg.fill(1.0);
            }
            for ((o, y), g) in out
                .chunks_exact_mut(hidden)
                .zip(y.chunks_exact(hidden))
                .zip(sg.iter())
            {
                o.iter_mut().zip(y).for_each(|(o, y)| *o += g * y);
            }
        }
        Ok(())
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

/// A pre-norm transformer block: `x += Attention(RMSNorm(x)); x += FFN(RMSNorm(x))`.
pub struct Block {
    attn_norm: Vec<f32>,
    attn: Attention,
    ffn_norm: Vec<f32>,
    ffn: FeedForward,
    eps: f32,
}

impl Block {
    /// Loads block `i`.
    pub fn load(w: &Weights, cfg: &Config, i: usize) -> Result<Block> {
        let ffn = match (&cfg.moe, w.has(&blk(i, "ffn_gate_inp", "weight"))) {
            (Some(moe), true) => FeedForward::MoE(MoE::load(w, cfg, moe, i)?),
            (None, true) => {
                return Err(UError::invalid(format!(
                    "arch-llama: layer {i} has a router but the metadata gives no expert count"
                )));
            }
            (_, false) => FeedForward::Dense(Mlp::load(w, cfg.hidden, i, "")?),
        };
        Ok(Block {
            attn_norm: w.vector(&blk(i, "attn_norm", "weight"), cfg.hidden)?,
            attn: Attention::load(w, cfg, i)?,
            ffn_norm: w.vector(&blk(i, "ffn_norm", "weight"), cfg.hidden)?,
            ffn,
            eps: cfg.rms_eps,
        })
    }

    fn forward(&self, c: &Ctx<'_>, segs: &[Segment], s: &mut Scratch) -> Result<()> {
        let t = s.positions.len();
        let hidden = self.attn_norm.len();
        let x = &mut s.x[..t * hidden];
        let h = buf(&mut s.h, t * hidden);
        let out = buf(&mut s.out, t * hidden);
        rms_norm(c.k, x, &self.attn_norm, self.eps, h)?;
        self.attn
            .forward(c, segs, &s.positions, h, &mut s.attn, out)?;
        x.iter_mut().zip(out.iter()).for_each(|(x, o)| *x += o);
        rms_norm(c.k, x, &self.ffn_norm, self.eps, h)?;
        match &self.ffn {
            FeedForward::Dense(mlp) => mlp.forward(c, h, t, &mut s.ffn.gate, &mut s.ffn.up, out)?,
            FeedForward::MoE(moe) => moe.forward(c, h, t, &mut s.ffn, out)?,
        }
        x.iter_mut().zip(out.iter()).for_each(|(x, o)| *x += o);
        Ok(())
    }
}

/// The Llama-family decoder: embedding, blocks, final norm, LM head (the embedding matrix when
/// `output.weight` is absent: tied embeddings).
pub struct Llama {
    /// Hyper-parameters.
    pub cfg: Config,
    kernels: KernelsBox,
    cache: KvCacheBox,
    blocks: Vec<Block>,
    norm: Vec<f32>,
    lm_head: Linear,
    /// The embedding table, `[vocab, hidden]`.
    embed: Linear,
    scratch: Mutex<Scratch>,
}

impl Llama {
    /// Builds the model and declares its KV layout to `cache`, with the plugin's settings.
    pub fn load(
        weights: Weights,
        kernels: KernelsBox,
        cache: KvCacheBox,
        settings: &crate::LlamaArchitecture,
    ) -> Result<Llama> {
        let mut cfg = Config::from_weights(&weights)?;
        if let Some(moe) = &mut cfg.moe {
            moe.prefetch = settings.expert_prefetch;
        }
        let blocks = (0..cfg.layers)
            .map(|i| Block::load(&weights, &cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let head = if weights.has("output.weight") {
            "output"
        } else {
            "token_embd"
        };
        let embed = Linear::load(&weights, "token_embd", cfg.hidden, false)?;
        let lm_head = Linear::load(&weights, head, cfg.hidden, false)?;
        if lm_head.outputs != cfg.vocab_size {
            return Err(UError::invalid(format!(
                "arch-llama: LM head has {} outputs for a vocabulary of {}",
                lm_head.outputs, cfg.vocab_size
            )));
        }
        let norm = weights.vector("output_norm.weight", cfg.hidden)?;
        cache
            .configure(KvLayout {
                layers: cfg.layers as u32,
                kv_heads: cfg.kv_heads as u32,
                head_dim: cfg.head_dim as u32,
                dtype: DType::F32,
                model_id: model_id(&weights, &cfg).into(),
            })
            .into_result()?;
        Ok(Llama {
            cfg,
            kernels,
            cache,
            blocks,
            norm,
            lm_head,
            embed,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// The rotation applied to one token's cached keys (all KV heads).
    pub fn key_rope(&self) -> RopeParams {
        rope_params(&self.cfg, self.cfg.kv_heads)
    }

    /// The cache the model's KV lives in.
    pub fn cache(&self) -> &KvCacheBox {
        &self.cache
    }

    /// Runs `batch`, writing the requested logits (see [`u_sdk::Model::forward`]). On error the
    /// sequences are rolled back to their lengths before the call.
    pub fn forward(&self, batch: &[SeqChunk<'_>], logits: &mut [f32]) -> Result<()> {
        let mut segs = Vec::with_capacity(batch.len());
        let mut offset = 0;
        let mut wanted = 0;
        for (n, chunk) in batch.iter().enumerate() {
            if batch[..n].iter().any(|c| c.seq == chunk.seq) {
                return Err(UError::invalid(format!(
                    "arch-llama: sequence {} appears twice in one batch",
                    chunk.seq
                )));
            }
            let len = chunk.tokens.len();
            wanted += match chunk.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last if len > 0 => 1,
                LogitsWanted::All => len,
                LogitsWanted::Last => {
                    return Err(UError::invalid(format!(
                        "arch-llama: sequence {} asks for the last logits of no tokens",
                        chunk.seq
                    )));
                }
            };
            if let Some(&bad) = chunk
                .tokens
                .iter()
                .find(|&&t| t as usize >= self.cfg.vocab_size)
            {
                return Err(UError::invalid(format!(
                    "arch-llama: token {bad} is outside the vocabulary of {}",
                    self.cfg.vocab_size
                )));
            }
            let start = self.cache.len(chunk.seq).into_result()? as usize;
            if start + len > self.cfg.context_length {
                return Err(UError::new(
                    u_sdk::ErrorKind::ResourceExhausted,
                    format!(
                        "arch-llama: sequence {} would reach {} tokens, past the context length {}",
                        chunk.seq,
                        start + len,
                        self.cfg.context_length
                    ),
                ));
            }
            segs.push(Segment {
                seq: chunk.seq,
                start,
                offset,
                len,
            });
            offset += len;
        }
        let vocab = self.cfg.vocab_size;
        if logits.len() != wanted * vocab {
            return Err(UError::invalid(format!(
                "arch-llama: logits buffer holds {} floats, the batch asks for {wanted} rows of {vocab}",
                logits.len()
            )));
        }
        if offset == 0 {
            return Ok(());
        }
        let mut scratch = self
            .scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = self.run(batch, &segs, &mut scratch, Output::Logits(logits));
        if result.is_err() {
            for seg in &segs {
                let _ = self.cache.truncate(seg.seq, seg.start as u64);
            }
        }
        result
    }

    /// The mean over `tokens` of the final hidden state (after the output norm), run in a
    /// scratch sequence of the cache that is released afterwards (see [`u_sdk::Model::embed`]).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(UError::invalid("arch-llama: nothing to embed"));
        }
        if tokens.len() > self.cfg.context_length {
            return Err(UError::new(
                u_sdk::ErrorKind::ResourceExhausted,
                format!(
                    "arch-llama: {} tokens to embed, past the context length {}",
                    tokens.len(),
                    self.cfg.context_length
                ),
            ));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(UError::invalid(format!(
                "arch-llama: token {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        let hidden = self.cfg.hidden;
        let seq = self.cache.create().into_result()?;
        let mut sum = vec![0f64; hidden];
        let mut rows = Vec::new();
        let mut result = Ok(());
        let mut scratch = self
            .scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (i, chunk) in tokens.chunks(EMBED_CHUNK).enumerate() {
            let batch = [SeqChunk {
                seq,
                tokens: RSlice::from_slice(chunk),
                logits: LogitsWanted::None,
            }];
            let segs = [Segment {
                seq,
                start: i * EMBED_CHUNK,
                offset: 0,
                len: chunk.len(),
            }];
            result = self.run(&batch, &segs, &mut scratch, Output::Hidden(&mut rows));
            if result.is_err() {
                break;
            }
            for row in rows.chunks_exact(hidden) {
                sum.iter_mut()
                    .zip(row)
                    .for_each(|(s, &v)| *s += f64::from(v));
            }
        }
        drop(scratch);
        self.cache.release(seq).into_result()?;
        result?;
        Ok(sum
            .iter()
            .map(|s| (s / tokens.len() as f64) as f32)
            .collect())
    }

    fn run(
        &self,
        batch: &[SeqChunk<'_>],
        segs: &[Segment],
        s: &mut Scratch,
        out: Output<'_>,
    ) -> Result<()> {
        // A handle per pass: the cache keeps every page it lends out alive until the handle that
        // borrowed it drops, so borrowing through the model's long-lived handle would keep every
        // page ever read.
        let cache = self.cache.clone();
        let c = Ctx {
            k: &self.kernels,
            cache: &cache,
        };
        let hidden = self.cfg.hidden;
        s.tokens.clear();
        s.positions.clear();
        for (chunk, seg) in batch.iter().zip(segs) {
            s.tokens.extend_from_slice(&chunk.tokens);
            s.positions
                .extend((seg.start..seg.start + seg.len).map(|p| p as u32));
        }
        let t = s.tokens.len();
        let x = buf(&mut s.x, t * hidden);
        c.k.embedding(
            self.embed.view(),
            RSlice::from_slice(&s.tokens),
            RSliceMut::from_mut_slice(x),
        )
        .into_result()?;
        for block in &self.blocks {
            block.forward(&c, segs, s)?;
        }

        let logits = match out {
            Output::Logits(logits) => logits,
            Output::Hidden(rows) => {
                rows.resize(t * hidden, 0.0);
                return rms_norm(c.k, &s.x[..t * hidden], &self.norm, self.cfg.rms_eps, rows);
            }
        };
        // Gather the rows whose logits are wanted, then norm and project only those.
        let h = buf(&mut s.h, t * hidden);
        let mut rows = 0;
        for (chunk, seg) in batch.iter().zip(segs) {
            let range = match chunk.logits {
                LogitsWanted::None => continue,
                LogitsWanted::Last => seg.offset + seg.len - 1..seg.offset + seg.len,
                LogitsWanted::All => seg.offset..seg.offset + seg.len,
            };
            let n = range.len();
            h[rows * hidden..(rows + n) * hidden]
                .copy_from_slice(&s.x[range.start * hidden..range.end * hidden]);
            rows += n;
        }
        if rows == 0 {
            return Ok(());
        }
        let normed = buf(&mut s.out, rows * hidden);
        rms_norm(
            c.k,
            &h[..rows * hidden],
            &self.norm,
            self.cfg.rms_eps,
            normed,
        )?;
        self.lm_head.forward(c.k, normed, rows, logits)
    }
}

/// Tokens per pass when embedding.
const EMBED_CHUNK: usize = 512;

/// What a pass produces.
enum Output<'a> {
    /// The logits the batch asks for.
    Logits(&'a mut [f32]),
    /// The normed final hidden state of every token.
    Hidden(&'a mut Vec<f32>),
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
