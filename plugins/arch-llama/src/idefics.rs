//! IDEFICS (Laurençon et al. 2023, *OBELICS: An Open Web-Scale Filtered Dataset of Interleaved
//! Image-Text Documents*, arXiv:2306.16527), the open reproduction of Flamingo (Alayrac et al.
//! 2022, *Flamingo: a Visual Language Model for Few-Shot Learning*, arXiv:2204.14198): the text
//! side of a checkpoint whose `config.json` says `"model_type": "idefics"`
//! (`IdeficsForVisionText2Text`), served as a [`u_sdk::ModelKind::CrossDecoder`] of family
//! `idefics`.
//!
//! The language model is a Llama whose blocks are interleaved with Flamingo's gated
//! cross-attention blocks ("GATED XATTN-DENSE", Flamingo §2.2 and figure 4): before every
//! `cross_layer_interval`-th Llama block `i`, a [`GatedCrossAttention`] block `j = i / interval`
//! lets the text attend to the image features,
//!
//! ```text
//! y = x + tanh(α_xattn) · CrossAttention(q = RMSNorm(x), kv = image rows)
//! y = y + tanh(α_dense) · FFW(RMSNorm(y))
//! ```
//!
//! with `α` one float or one value per channel (`alpha_type`), and optional RMSNorms of each
//! query and key head (`qk_layer_norms`). The Llama blocks are this plugin's own
//! ([`crate::model::Block`]); only the gated blocks are new here.
//!
//! **The context.** The image features the vision side makes (the vision tower's
//! `last_hidden_state`, class row first, or the perceiver resampler's latents when
//! `use_resampler`: what transformers calls `image_hidden_states` inside `IdeficsModel.forward`)
//! come in as [`u_sdk::CrossContext::rows`]: one image, `[rows, vision width]`
//! ([`u_sdk::ModelConfig::context_shape`]). The chunk that brings them computes every gated
//! block's keys and values once and keeps them in the cache sequence
//! [`u_sdk::CrossContext::kv`] (block `j` in its layer `j`; the layers past the last gated block
//! stay empty, so that sequence's `KvCache::len` reads 0 when the interval is above 1); every
//! later pass names the same `kv` with empty rows and reads them there, as Whisper's decoder
//! does with its encoded audio.
//!
//! **Which tokens see the image.** IDEFICS' processor (`image_attention_mask_for_packed_input_ids`)
//! lets a token attend to the latest image whose `<image>` token stands at or before it; tokens
//! before the first `<image>` attend to no image, and the model zeroes their cross-attention
//! output (`cross_attention_gate`; their gated FFW still applies). With one image per sequence,
//! the case this decoder supports, that is:
//!
//! - the chunk that brings the context must hold the sequence's `<image>` token (the id in
//!   `config.json`'s `image_token_id`, or `image_token_index`; IDEFICS' config does not state
//!   it, its tokenizer does): its rows before that token see no image, the token and every row
//!   after it see all of the context;
//! - every later chunk (empty rows) comes after the image: all its rows see the context.
//!
//! Refused with an error that says so: a chunk without a context (text-only prompts), a
//! context of another size, a chunk bringing a context without the `<image>` token, a second
//! `<image>` (several images per sequence: each token would attend to its own latest image), an
//! end-of-document token (`eos_token_id`) at or after the image (the processor stops the tokens
//! after it from seeing the image, packed documents), and pixels (the vision tower and the
//! resampler are the image encoder's business, family `idefics.vision`, not built here).
//!
//! **The checkpoint**, seen through [`IdeficsText`] as a Llama causal LM plus the gated blocks:
//!
//! | IDEFICS checkpoint | seen as |
//! | --- | --- |
//! | `model.layers.*`, `model.norm.*` | as they are |
//! | `model.embed_tokens.weight` and `model.embed_tokens.additional_embedding.weight` | `model.embed_tokens.weight`, the rows joined (ids `vocab_size…` are the additional ones) |
//! | `lm_head.weight` and `lm_head.additional_fc.weight` | `lm_head.weight`, the rows joined (the additional logits after the others, as `IdeficsDecoupledLinear` concatenates them) |
//! | `model.gated_cross_attn_layers.{j}.cross_attn.{q,k,v,o}_proj.weight` | `blk.{i}.xattn_{q,k,v,output}.weight`, `i = j · interval` |
//! | `model.gated_cross_attn_layers.{j}.cross_attn.{q,k}_layer_norm.weight` | `blk.{i}.xattn_{q,k}_norm.weight` |
//! | `model.gated_cross_attn_layers.{j}.input_layernorm.weight` | `blk.{i}.xattn_norm.weight` |
//! | `model.gated_cross_attn_layers.{j}.post_attention_layernorm.weight` | `blk.{i}.xattn_ffn_norm.weight` |
//! | `model.gated_cross_attn_layers.{j}.mlp.{gate,up,down}_proj.weight` | `blk.{i}.ffn_{gate,up,down}_xattn.weight` |
//! | `model.gated_cross_attn_layers.{j}.alpha_cross_attn`, `.alpha_dense` | `blk.{i}.xattn_gate.weight`, `blk.{i}.xattn_ffn_gate.weight` |
//! | `model.vision_model.*`, `model.perceiver_resampler.*` | left out (the image encoder's) |
//! | `config.model_type` | `llama` |
//! | `config.vocab_size` | `vocab_size + additional_vocab_size` |
//! | any other metadata | as it is |
//!
//! Joining the decoupled tables copies the embedding table and the LM head once at load (the
//! price of one Llama reading one table); every other tensor stays where the loader mapped it.
//!
//! Reference implementation: transformers' `modeling_idefics.py` and `processing_idefics.py`;
//! `tests/idefics.rs` checks the logits against `IdeficsForVisionText2Text` on the tiny
//! random-weight checkpoints of `tests/fixtures/idefics_tiny/`.

use crate::{
    config::Config,
    model::{Mlp, Pass, QkNorm, kv_spans},
    naming::blk,
    weights::{Linear, Norm, Weights},
};
use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
use serde_json::{Map, Value};
use std::{collections::HashMap, sync::Arc};
use u_sdk::{
    AttentionMask, AttentionParams, DType, ErrorKind, KvCacheBox, MetaValue, Result, Segment,
    SeqChunk, SeqId, TensorDesc, TensorInfo, TensorView, UError, WeightSet, WeightSetBox,
    nn::{Device, Tensor},
};

/// The family this module builds (HF `model_type`).
pub const FAMILY: &str = "idefics";

/// Whether `set` is an IDEFICS checkpoint (`config.model_type` is `idefics`).
pub fn is_idefics(set: &WeightSetBox) -> bool {
    meta(set, "config.model_type").is_some_and(|v| v.as_str() == Some(FAMILY))
}

fn meta(set: &WeightSetBox, key: &str) -> Option<MetaValue> {
    set.metadata(key.into()).into_result().ok()?.into_option()
}

fn invalid(why: impl std::fmt::Display) -> UError {
    UError::invalid(format!("arch-llama: idefics {why}"))
}

/// Part of a gated block's tensor name after `model.gated_cross_attn_layers.{j}.`, and the
/// canonical tensor it is (`blk.{i}.{canonical}.{suffix}`).
const GATED_NAMES: [(&str, &str); 11] = [
    ("cross_attn.q_proj", "xattn_q"),
    ("cross_attn.k_proj", "xattn_k"),
    ("cross_attn.v_proj", "xattn_v"),
    ("cross_attn.o_proj", "xattn_output"),
    ("cross_attn.q_layer_norm", "xattn_q_norm"),
    ("cross_attn.k_layer_norm", "xattn_k_norm"),
    ("input_layernorm", "xattn_norm"),
    ("post_attention_layernorm", "xattn_ffn_norm"),
    ("mlp.gate_proj", "ffn_gate_xattn"),
    ("mlp.up_proj", "ffn_up_xattn"),
    ("mlp.down_proj", "ffn_down_xattn"),
];

/// The canonical name of `rest`, a tensor of gated block `j`, which sits before Llama block
/// `layer`; names this module does not know keep their tail under `blk.{layer}.xattn.` so
/// that the model's check of unread layer tensors names them.
fn gated_name(layer: usize, rest: &str) -> String {
    match rest {
        "alpha_cross_attn" => return blk(layer, "xattn_gate", "weight"),
        "alpha_dense" => return blk(layer, "xattn_ffn_gate", "weight"),
        _ => {}
    }
    GATED_NAMES
        .iter()
        .find_map(|(hf, canonical)| {
            let suffix = rest.strip_prefix(hf)?.strip_prefix('.')?;
            Some(blk(layer, canonical, suffix))
        })
        .unwrap_or_else(|| format!("blk.{layer}.xattn.{rest}"))
}

/// Where a tensor of the view comes from.
enum Source {
    /// One tensor of the checkpoint, by its stored name.
    Stored(String),
    /// Two tables of the checkpoint joined by rows (IDEFICS' decoupled embedding and LM head).
    Joined(Joined),
}

/// Rows of two tensors joined into one, held here, aligned for any element type.
struct Joined {
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    /// Offset of the first byte in `bytes` (aligned to [`JOIN_ALIGN`]).
    start: usize,
    len: usize,
}

/// Alignment of a joined table's bytes.
const JOIN_ALIGN: usize = 64;

impl Joined {
    /// The rows of `first` then those of `second` (same dtype and row length).
    fn new(set: &WeightSetBox, first: &str, second: &str) -> Result<Joined> {
        let a = set.tensor(first.into()).into_result()?;
        let b = set.tensor(second.into()).into_result()?;
        let (Some(&row), Some(&row_b)) = (a.shape.last(), b.shape.last()) else {
            return Err(invalid(format!("`{first}` or `{second}` is a scalar")));
        };
        if a.dtype != b.dtype || row != row_b || a.shape.len() != 2 || b.shape.len() != 2 {
            return Err(invalid(format!(
                "`{first}` ({:?} {:?}) and `{second}` ({:?} {:?}) are not rows of one table",
                a.dtype, a.shape, b.dtype, b.shape
            )));
        }
        let len = a.data.len() + b.data.len();
        let mut bytes = vec![0u8; len + JOIN_ALIGN];
        let start = bytes.as_ptr().align_offset(JOIN_ALIGN);
        if start >= JOIN_ALIGN {
            return Err(UError::new(
                ErrorKind::Internal,
                "arch-llama: idefics could not align a joined table",
            ));
        }
        bytes[start..start + a.data.len()].copy_from_slice(a.data.as_slice());
        bytes[start + a.data.len()..start + len].copy_from_slice(b.data.as_slice());
        Ok(Joined {
            dtype: a.dtype,
            shape: vec![a.shape[0] + b.shape[0], row],
            bytes,
            start,
            len,
        })
    }

    fn info(&self, name: &str) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype: self.dtype,
            shape: self.shape.clone().into(),
            byte_len: self.len as u64,
        }
    }
}

/// An IDEFICS checkpoint's text side, seen as a Llama causal LM plus its gated
/// cross-attention blocks (see the module documentation's table).
#[derive(Clone)]
pub struct IdeficsText {
    inner: WeightSetBox,
    /// `vocab_size + additional_vocab_size`.
    vocab: u64,
    tensors: Arc<Vec<TensorInfo>>,
    /// Name in this view → where it comes from.
    sources: Arc<HashMap<String, Source>>,
}

impl IdeficsText {
    /// The text side of the IDEFICS checkpoint `inner`.
    pub fn new(inner: WeightSetBox) -> Result<IdeficsText> {
        let top = |k: &str| meta(&inner, &format!("config.{k}"));
        let interval = top("cross_layer_interval").map_or(Some(1), |v| v.as_u64());
        let interval = match interval {
            Some(n) if n > 0 => n as usize,
            _ => {
                return Err(invalid(
                    "config.json: `cross_layer_interval` is not a count",
                ));
            }
        };
        let vocab = top("vocab_size")
            .and_then(|v| v.as_u64())
            .ok_or_else(|| invalid("config.json: `vocab_size` is missing"))?;
        let additional = top("additional_vocab_size").map_or(Some(0), |v| v.as_u64());
        let additional = additional
            .ok_or_else(|| invalid("config.json: `additional_vocab_size` is not a count"))?;

        let mut tensors = Vec::new();
        let mut sources = HashMap::new();
        let mut add = |name: String, info: TensorInfo, source: Source| -> Result<()> {
            if sources.insert(name.clone(), source).is_some() {
                return Err(invalid(format!("checkpoint: two tensors are `{name}`")));
            }
            tensors.push(TensorInfo {
                name: name.into(),
                ..info
            });
            Ok(())
        };
        let decoupled = [
            (
                "model.embed_tokens.weight",
                "model.embed_tokens.additional_embedding.weight",
            ),
            ("lm_head.weight", "lm_head.additional_fc.weight"),
        ];
        for info in inner.tensors().into_result()? {
            let name = info.name.to_string();
            if name.starts_with("model.vision_model.")
                || name.starts_with("model.perceiver_resampler.")
            {
                continue;
            }
            if let Some(&(table, _)) = decoupled.iter().find(|(_, extra)| *extra == name) {
                // Joined to its table below.
                if additional == 0 {
                    return Err(invalid(format!(
                        "checkpoint: `{name}` but `additional_vocab_size` is 0 (it joins `{table}`)"
                    )));
                }
                continue;
            }
            if let Some(&(table, extra)) = decoupled.iter().find(|(t, _)| *t == name)
                && additional > 0
            {
                let joined = Joined::new(&inner, table, extra)?;
                if joined.shape[0] != vocab + additional {
                    return Err(invalid(format!(
                        "checkpoint: `{table}` and `{extra}` hold {} rows for a vocabulary of \
                         {vocab} + {additional}",
                        joined.shape[0]
                    )));
                }
                add(name.clone(), joined.info(&name), Source::Joined(joined))?;
                continue;
            }
            let renamed = match name
                .strip_prefix("model.gated_cross_attn_layers.")
                .and_then(|rest| rest.split_once('.'))
            {
                Some((j, rest)) => {
                    let j: usize = j
                        .parse()
                        .map_err(|_| invalid(format!("checkpoint: tensor `{name}`")))?;
                    gated_name(j * interval, rest)
                }
                None => name.clone(),
            };
            add(renamed, info.clone(), Source::Stored(name))?;
        }
        Ok(IdeficsText {
            inner,
            vocab: vocab + additional,
            tensors: Arc::new(tensors),
            sources: Arc::new(sources),
        })
    }

    /// This view as an ABI weight set.
    pub fn into_box(self) -> WeightSetBox {
        WeightSetBox::new(self)
    }
}

impl WeightSet for IdeficsText {
    fn format(&self) -> RResult<RString, UError> {
        self.inner.format()
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        RResult::ROk(ROption::RSome("llama".into()))
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        self.inner.metadata_keys()
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        match key.as_str() {
            "config.model_type" => RResult::ROk(ROption::RSome(MetaValue::Str("llama".into()))),
            "config.vocab_size" => RResult::ROk(ROption::RSome(MetaValue::UInt(self.vocab))),
            _ => self.inner.metadata(key),
        }
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        RResult::ROk(self.tensors.iter().cloned().collect())
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        match self.sources.get(name.as_str()) {
            Some(Source::Stored(stored)) => self.inner.tensor(stored.as_str().into()),
            Some(Source::Joined(j)) => RResult::ROk(TensorView {
                dtype: j.dtype,
                shape: j.shape.clone().into(),
                data: j.bytes[j.start..j.start + j.len].into(),
            }),
            None => RResult::RErr(UError::not_found(format!(
                "arch-llama: the idefics text model has no tensor `{name}`"
            ))),
        }
    }
}

/// A nested object of `config.json` (`config.vision_config`), parsed; empty when absent.
fn nested(w: &Weights, key: &str) -> Result<Map<String, Value>> {
    match w.meta(&format!("config.{key}")) {
        None => Ok(Map::new()),
        Some(MetaValue::Json(text)) => match serde_json::from_str(&text) {
            Ok(Value::Object(map)) => Ok(map),
            _ => Err(invalid(format!("config.json: `{key}` is not an object"))),
        },
        Some(_) => Err(invalid(format!("config.json: `{key}` is not an object"))),
    }
}

/// What the decoder cross-attends to, and the tokens that place it in a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageContext {
    /// Rows of one image's features: the vision tower's patches plus its class row, or the
    /// resampler's latents.
    pub rows: usize,
    /// Width of a row (the vision tower's `embed_dim`).
    pub width: usize,
    /// The `<image>` token id.
    pub image_token: u32,
    /// The end-of-document token id (`eos_token_id`), if the config states one.
    pub end_token: Option<u32>,
}

impl ImageContext {
    /// From the checkpoint's `config.json`: `image_token_id` (or `image_token_index`),
    /// `eos_token_id`, `use_resampler` with `perceiver_config.resampler_n_latents` (64 by
    /// default), else `vision_config.image_size` and `patch_size` (224 and 14), and
    /// `vision_config.embed_dim` (768), transformers' defaults where the file is silent.
    fn read(w: &Weights, vocab: usize) -> Result<ImageContext> {
        let top = |k: &str| w.meta(&format!("config.{k}"));
        let image_token = top("image_token_id")
            .or_else(|| top("image_token_index"))
            .ok_or_else(|| {
                UError::unsupported(
                    "arch-llama: idefics config.json does not say which token is `<image>`: \
                     add `image_token_id` (its id in the checkpoint's tokenizer)",
                )
            })?
            .as_u64()
            .filter(|&t| (t as usize) < vocab)
            .ok_or_else(|| {
                invalid(format!(
                    "config.json: `image_token_id` is not a token of the vocabulary of {vocab}"
                ))
            })? as u32;
        let end_token = top("eos_token_id")
            .and_then(|v| v.as_u64())
            .map(|t| t as u32);
        let vision = nested(w, "vision_config")?;
        let vision_int = |k: &str, default: u64| match vision.get(k) {
            None | Some(Value::Null) => Some(default),
            Some(v) => v.as_u64(),
        };
        let width = vision_int("embed_dim", 768)
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid("config.json: `vision_config.embed_dim` is not a width"))?;
        let resampler = match top("use_resampler") {
            None => false,
            Some(MetaValue::Bool(b)) => b,
            Some(_) => return Err(invalid("config.json: `use_resampler` is not true or false")),
        };
        let rows = if resampler {
            let perceiver = nested(w, "perceiver_config")?;
            match perceiver.get("resampler_n_latents") {
                None | Some(Value::Null) => Some(64),
                Some(v) => v.as_u64(),
            }
        } else {
            match (vision_int("image_size", 224), vision_int("patch_size", 14)) {
                (Some(side), Some(patch)) if patch > 0 && side.is_multiple_of(patch) => {
                    Some((side / patch).pow(2) + 1)
                }
                _ => None,
            }
        };
        let rows = rows.filter(|&r| r > 0 && r < 1 << 20).ok_or_else(|| {
            invalid(
                "config.json: the rows of an image (the vision tower's `image_size` / \
                 `patch_size`, or the resampler's `resampler_n_latents`) are not a count",
            )
        })?;
        Ok(ImageContext {
            rows: rows as usize,
            width: width as usize,
            image_token,
            end_token,
        })
    }
}

/// A gate `tanh(α)`: one value for every channel (`alpha_type` "float") or one per channel
/// ("vector").
enum Gate {
    Scalar(f32),
    Vector(Tensor),
}

impl Gate {
    /// `tanh` of the stored `α` `name`, of one or `hidden` values.
    fn load(w: &Weights, dev: &Device, name: &str, hidden: usize) -> Result<Gate> {
        let alpha = w.f32(name)?;
        match alpha.len() {
            1 => Ok(Gate::Scalar(alpha[0].tanh())),
            n if n == hidden => {
                let g: Vec<f32> = alpha.iter().map(|a| a.tanh()).collect();
                Ok(Gate::Vector(dev.from_f32(&g, &[hidden as u64])?))
            }
            n => Err(invalid(format!(
                "{name} has {n} values, expected 1 or {hidden}"
            ))),
        }
    }

    /// `tanh(α) ⊙ y`.
    fn apply(&self, y: &Tensor) -> Result<Tensor> {
        match self {
            Gate::Scalar(g) => y.scale(*g),
            Gate::Vector(g) => y.mul(g),
        }
    }
}

/// Multi-head attention from the text rows to the image rows: queries from the text, keys and
/// values from the context (no positions: the image rows are a set), with IDEFICS' optional
/// RMSNorm of each query and key head.
pub struct CrossAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<QkNorm>,
    k_norm: Option<QkNorm>,
    heads: usize,
    head_dim: usize,
    /// The cache layer (of the context's sequence) holding this block's keys and values.
    lane: u32,
    /// Rows of the context.
    context_rows: usize,
}

impl CrossAttention {
    fn load(
        w: &Weights,
        dev: &Device,
        cfg: &Config,
        layer: usize,
        lane: u32,
        image: &ImageContext,
    ) -> Result<CrossAttention> {
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let width = cfg.heads * hd;
        let proj = |t: &str, inputs: usize| {
            Linear::load(w, dev, &format!("blk.{layer}.{t}"), inputs, false)
        };
        let attn = CrossAttention {
            q: proj("xattn_q", h)?,
            k: proj("xattn_k", image.width)?,
            v: proj("xattn_v", image.width)?,
            o: proj("xattn_output", width)?,
            q_norm: QkNorm::load(w, dev, cfg, layer, "xattn_q_norm", cfg.heads)?,
            k_norm: QkNorm::load(w, dev, cfg, layer, "xattn_k_norm", cfg.heads)?,
            heads: cfg.heads,
            head_dim: hd,
            lane,
            context_rows: image.rows,
        };
        let outputs = [&attn.q, &attn.k, &attn.v].map(|l| l.outputs);
        if outputs != [width; 3] || attn.o.outputs != h {
            return Err(invalid(format!(
                "block {layer}: cross-attention shapes do not match {} heads of {hd}",
                cfg.heads
            )));
        }
        Ok(attn)
    }

    /// Keeps the keys and values of `context` (`[rows, width]`) in layer `lane` of `kv`.
    fn remember(&self, cache: &KvCacheBox, kv: SeqId, context: &Tensor) -> Result<()> {
        let mut k = self.k.forward(context)?;
        if let Some(n) = &self.k_norm {
            k = n.forward(&k)?;
        }
        let v = self.v.forward(context)?;
        cache
            .append(kv, self.lane, k.desc(), v.desc())
            .into_result()
    }

    /// `CrossAttention(h)` for every row of the batch: the rows that see their sequence's
    /// image attend to all of its rows; the others get zeros (transformers'
    /// `cross_attention_gate`: their output projection of zero is zero, there are no biases).
    fn forward(&self, h: &Tensor, pass: &Pass<'_>) -> Result<Tensor> {
        let dev = h.device();
        let mut q = self.q.forward(h)?;
        if let Some(n) = &self.q_norm {
            q = n.forward(&q)?;
        }
        let ctx = dev.from_f32(&vec![0.0; q.desc().shape.elements() as usize], q.dims())?;
        for (span, cross) in pass.spans.iter().zip(pass.cross) {
            if cross.sees_from >= span.len {
                continue;
            }
            let rows = span.offset + cross.sees_from..span.offset + span.len;
            let pages = pass.cache.pages(cross.kv, self.lane).into_result()?;
            let held: usize = pages.iter().map(|p| p.tokens as usize).sum();
            if held != self.context_rows {
                return Err(UError::new(
                    ErrorKind::Internal,
                    format!(
                        "arch-llama: idefics context sequence {} layer {} holds {held} rows, \
                         expected {}",
                        cross.kv, self.lane, self.context_rows
                    ),
                ));
            }
            let (spans, kv_dtype) = kv_spans(dev, &pages)?;
            let params = AttentionParams {
                heads: self.heads as u32,
                kv_heads: self.heads as u32,
                head_dim: self.head_dim as u32,
                first_query_pos: 0,
                window: 0,
                scale: (self.head_dim as f32).powf(-0.5),
                softcap: 0.0,
                mask: AttentionMask::Bidirectional,
                kv_dtype,
            };
            let spans: Vec<&TensorDesc> = spans.iter().collect();
            q.rows_range(rows.clone())?
                .attention_into(&spans, &params, &ctx.rows_range(rows)?)?;
        }
        self.o.forward(&ctx)
    }
}

/// Flamingo's gated cross-attention block (GATED XATTN-DENSE), IDEFICS'
/// `IdeficsGatedCrossAttentionLayer`:
/// `y = x + tanh(α_xattn)·CrossAttention(norm₁(x)); y + tanh(α_dense)·FFW(norm₂(y))`.
pub struct GatedCrossAttention {
    attn_norm: Norm,
    attn: CrossAttention,
    attn_gate: Gate,
    ffn_norm: Norm,
    mlp: Mlp,
    ffn_gate: Gate,
}

impl GatedCrossAttention {
    /// Loads the gated block that sits before Llama block `layer`, its keys and values kept
    /// in cache layer `lane`.
    fn load(
        w: &Weights,
        dev: &Device,
        cfg: &Config,
        layer: usize,
        lane: u32,
        image: &ImageContext,
    ) -> Result<GatedCrossAttention> {
        let n = &cfg.norm;
        let norm = |t: &str| {
            Norm::load(
                w,
                dev,
                &format!("blk.{layer}.{t}"),
                cfg.hidden,
                n.kind,
                n.eps,
                n.shift,
            )
        };
        let gate = |t: &str| Gate::load(w, dev, &blk(layer, t, "weight"), cfg.hidden);
        Ok(GatedCrossAttention {
            attn_norm: norm("xattn_norm")?,
            attn: CrossAttention::load(w, dev, cfg, layer, lane, image)?,
            attn_gate: gate("xattn_gate")?,
            ffn_norm: norm("xattn_ffn_norm")?,
            mlp: Mlp::load(w, dev, cfg.hidden, layer, "_xattn", cfg.activation)?,
            ffn_gate: gate("xattn_ffn_gate")?,
        })
    }

    /// The block over every row of the batch.
    pub(crate) fn forward(&self, x: &Tensor, pass: &Pass<'_>) -> Result<Tensor> {
        let a = self.attn.forward(&self.attn_norm.forward(x)?, pass)?;
        let y = x.add(&self.attn_gate.apply(&a)?)?;
        let f = self.mlp.forward(&self.ffn_norm.forward(&y)?, None)?;
        y.add(&self.ffn_gate.apply(&f)?)
    }
}

/// Where one chunk's rows look for their image.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CrossSpan {
    /// The cache sequence holding the image's keys and values.
    pub kv: SeqId,
    /// The first row (within the chunk) that sees the image: the `<image>` token's, 0 in a
    /// chunk after it.
    pub sees_from: usize,
}

/// A pass's images: where each chunk's rows look, and the contexts brought to remember.
#[derive(Default)]
pub(crate) struct CrossPlan<'b> {
    /// One per chunk, in batch order.
    pub spans: Vec<CrossSpan>,
    /// Contexts brought in this pass, by the sequence that will keep them.
    pub brought: Vec<(SeqId, &'b [f32])>,
}

/// The gated cross-attention blocks of a model, one before every `interval`-th Llama block.
pub struct CrossLayers {
    blocks: Vec<GatedCrossAttention>,
    interval: usize,
    /// Width of the text rows.
    hidden: usize,
    /// What the blocks attend to.
    pub image: ImageContext,
}

impl CrossLayers {
    /// The gated blocks of `w` (an [`IdeficsText`] view), or `None` when the checkpoint has
    /// none (`config.cross_layer_interval` absent and no `xattn` tensors).
    pub fn load(w: &Weights, dev: &Device, cfg: &Config) -> Result<Option<CrossLayers>> {
        let interval = w.meta_u64("config.cross_layer_interval");
        let has_blocks = w.shapes().any(|(name, _)| name.contains(".xattn"));
        let interval = match (interval, has_blocks) {
            (None, false) => return Ok(None),
            (Some(n), _) if n > 0 => n as usize,
            _ => {
                return Err(invalid(
                    "config.json: `cross_layer_interval` is not a count",
                ));
            }
        };
        if cfg.kv_heads != cfg.heads {
            return Err(UError::unsupported(format!(
                "arch-llama: idefics with {} KV heads for {} heads (the gated blocks' keys share \
                 the cache layout, which has one KV head per head)",
                cfg.kv_heads, cfg.heads
            )));
        }
        let image = ImageContext::read(w, cfg.vocab_size)?;
        let blocks = (0..cfg.layers / interval)
            .map(|j| GatedCrossAttention::load(w, dev, cfg, j * interval, j as u32, &image))
            .collect::<Result<Vec<_>>>()?;
        if let Some(qk) = w.meta_bool("config.qk_layer_norms")
            && blocks
                .iter()
                .any(|b| b.attn.q_norm.is_some() != qk || b.attn.k_norm.is_some() != qk)
        {
            return Err(invalid(format!(
                "checkpoint: `qk_layer_norms` is {qk} but the Q/K norm tensors say otherwise"
            )));
        }
        Ok(Some(CrossLayers {
            blocks,
            interval,
            hidden: cfg.hidden,
            image,
        }))
    }

    /// The gated block before Llama block `layer`, if there is one.
    pub(crate) fn before(&self, layer: usize) -> Option<&GatedCrossAttention> {
        match layer.is_multiple_of(self.interval) {
            true => self.blocks.get(layer / self.interval),
            false => None,
        }
    }

    /// The image rows `kv` holds (those of its first gated block).
    fn held(&self, cache: &KvCacheBox, kv: SeqId) -> Result<usize> {
        let pages = cache.pages(kv, 0).into_result()?;
        Ok(pages.iter().map(|p| p.tokens as usize).sum())
    }

    /// Checks every chunk's context and finds which of its rows see the image (see the
    /// module documentation).
    pub(crate) fn plan<'b>(
        &self,
        batch: &[SeqChunk<'b>],
        cache: &KvCacheBox,
    ) -> Result<CrossPlan<'b>> {
        let image = &self.image;
        let mut plan = CrossPlan::default();
        for chunk in batch {
            let bad = |why: String| invalid(format!("sequence {}: {why}", chunk.seq));
            let ROption::RSome(cross) = chunk.extras.cross else {
                return Err(bad(format!(
                    "a chunk without a cross context: the decoder attends to the features of \
                     one image ({} rows of {}); text-only prompts are not supported",
                    image.rows, image.width
                )));
            };
            if cross.kv == chunk.seq {
                return Err(bad("the cross context's sequence is the chunk's own".into()));
            }
            // Rows (within the chunk) of the `<image>` and end-of-document tokens.
            let (mut images, mut ends, mut at) = (Vec::new(), Vec::new(), 0);
            for segment in chunk.input.iter() {
                if let Segment::Tokens(t) = segment {
                    for (n, &id) in t.iter().enumerate() {
                        if id == image.image_token {
                            images.push(at + n);
                        }
                        if Some(id) == image.end_token {
                            ends.push(at + n);
                        }
                    }
                }
                at += segment.rows(self.hidden);
            }
            let brought_here = plan.brought.iter().any(|&(kv, _)| kv == cross.kv);
            let rows = cross.rows.as_slice();
            let sees_from = if rows.is_empty() {
                if !brought_here && self.held(cache, cross.kv)? == 0 {
                    return Err(bad(format!(
                        "cross sequence {} holds no image features and the chunk brings none",
                        cross.kv
                    )));
                }
                if let Some(&p) = images.first() {
                    return Err(bad(format!(
                        "an `<image>` token (id {}) at row {p} after the image the context \
                         holds: one image per sequence",
                        image.image_token
                    )));
                }
                0
            } else {
                if rows.len() != image.rows * image.width {
                    return Err(bad(format!(
                        "a context of {} values; the decoder reads one image's features, {} \
                         rows of {} (context_shape)",
                        rows.len(),
                        image.rows,
                        image.width
                    )));
                }
                if rows.iter().any(|v| !v.is_finite()) {
                    return Err(bad("the context holds values that are not finite".into()));
                }
                if brought_here || self.held(cache, cross.kv)? > 0 {
                    return Err(bad(format!(
                        "cross sequence {} already holds (or receives in this pass) an image's \
                         features",
                        cross.kv
                    )));
                }
                let Some(&first) = images.first() else {
                    return Err(bad(format!(
                        "the chunk bringing the image's features holds no `<image>` token (id \
                         {}): the text before the image and its `<image>` token come with it",
                        image.image_token
                    )));
                };
                if images.len() > 1 {
                    return Err(bad(format!(
                        "{} `<image>` tokens: one image per sequence",
                        images.len()
                    )));
                }
                plan.brought.push((cross.kv, rows));
                first
            };
            if let Some(p) = ends.iter().find(|&&p| p >= sees_from) {
                return Err(UError::unsupported(format!(
                    "arch-llama: idefics sequence {}: an end-of-document token at row {p}, after \
                     the image (IDEFICS' processor stops the tokens after it from seeing the \
                     image, packed documents, which this decoder does not follow)",
                    chunk.seq
                )));
            }
            plan.spans.push(CrossSpan {
                kv: cross.kv,
                sees_from,
            });
        }
        Ok(plan)
    }

    /// Computes and keeps every gated block's keys and values of the contexts `plan` brings.
    pub(crate) fn remember(
        &self,
        dev: &Device,
        cache: &KvCacheBox,
        plan: &CrossPlan<'_>,
    ) -> Result<()> {
        for &(kv, rows) in &plan.brought {
            let context = dev.from_f32(rows, &[self.image.rows as u64, self.image.width as u64])?;
            for block in &self.blocks {
                block.attn.remember(cache, kv, &context)?;
            }
        }
        Ok(())
    }
}
