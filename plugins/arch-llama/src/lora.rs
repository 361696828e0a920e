//! Low-rank adapters (LoRA; Hu et al. 2021). A projection `y = W·x` of a sequence that runs
//! under adapters becomes `y = W·x + Σₐ sₐ·kₐ·Bₐ·(Aₐ·x)`: `A` is `[r, in]`, `B` is `[out, r]`,
//! `kₐ` the adapter's scaling (`alpha / r`, or `alpha / √r` rank-stabilised) and `sₐ` the scale
//! the sequence asks for. The base matmul runs once over every row of the batch; then one
//! [`Op::LowRank`](u_sdk::Op::LowRank) per projection adds every row's own adapters' deltas,
//! reading them from the [`Stack`] of all resident adapters (`A`s stacked, `Bᵀ`s stacked) at
//! the columns a per-pass table gives each row — one operation per projection however the
//! adapters interleave in the batch, with no copy of any weight per sequence.
//!
//! Two file forms are read:
//! - PEFT (`adapter_model.safetensors` + `adapter_config.json`): tensors
//!   `base_model.model.<module>.lora_A.weight` / `lora_B.weight`, modules in the base checkpoint's
//!   Hugging Face names (mapped as the base's own tensors are, [`naming::canonical_name`]);
//! - llama.cpp's GGUF LoRA (`general.type = adapter`, `adapter.lora.alpha`): tensors
//!   `blk.{i}.{attn_q…}.weight.lora_a` / `lora_b`.
//!
//! GGUF `llama` weights hold their Q/K rows permuted for adjacent-pair RoPE (see
//! [`naming::rope_style`]); a `B` of Q or K is permuted the same way when the adapter's rows and
//! the base's are in different orders (a PEFT adapter on a GGUF base, a GGUF adapter on a
//! safetensors base).

use crate::naming::{self, ARCHITECTURE_KEY};
use std::{ops::Range, sync::Arc};
use u_sdk::{
    AdapterInfo, ErrorKind, Result, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// The projections an adapter can change, by the model's (GGUF) names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Attention query projection.
    Q,
    /// Attention key projection.
    K,
    /// Attention value projection.
    V,
    /// Attention output projection.
    Output,
    /// Feed-forward gate.
    Gate,
    /// Feed-forward up projection.
    Up,
    /// Feed-forward down projection.
    Down,
}

impl Target {
    /// Every target, in the order [`Adapter`] stores them.
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::Output,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    /// The tensor name the model gives it (`blk.{i}.<name>.weight`).
    pub fn name(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::Output => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }

    fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The module PEFT and Hugging Face name it by (`self_attn.q_proj`, `mlp.down_proj`…).
    pub fn hf_module(self) -> &'static str {
        match self {
            Target::Q => "self_attn.q_proj",
            Target::K => "self_attn.k_proj",
            Target::V => "self_attn.v_proj",
            Target::Output => "self_attn.o_proj",
            Target::Gate => "mlp.gate_proj",
            Target::Up => "mlp.up_proj",
            Target::Down => "mlp.down_proj",
        }
    }

    /// The target of a PEFT `target_modules` entry (`q_proj`…).
    pub fn from_hf_module(name: &str) -> Option<Target> {
        Target::ALL
            .into_iter()
            .find(|t| t.hf_module().rsplit('.').next() == Some(name))
    }
}

/// What an adapter must fit: the model's projections and the row order of its Q/K weights.
pub struct Fit {
    /// The base's architecture (`general.architecture`).
    pub arch: String,
    /// Per layer and [`Target`], the projection's `(inputs, outputs)`, or `None` where the layer
    /// has no such dense projection (an MoE layer's feed-forward).
    pub layers: Vec<[Option<(usize, usize)>; 7]>,
    /// Whether the base's Q/K rows are in llama.cpp's adjacent-pair order.
    pub permuted: bool,
    /// Rows per attention head (for permuting a `B` of Q or K).
    pub head_dim: usize,
}

/// One projection's pair as read: `A` `[r, in]`, and `Bᵀ` `[r, out]` with the adapter's
/// scaling folded in (kept to build the [`Stack`] again when the resident set changes).
struct LowRank {
    rank: usize,
    a: Vec<f32>,
    bt: Vec<f32>,
}

/// A loaded adapter.
pub struct Adapter {
    /// Per layer, per [`Target`] (in [`Target::ALL`] order), the pair where it has one.
    layers: Vec<[Option<LowRank>; 7]>,
    /// What it is, as the ABI reports it.
    pub info: AdapterInfo,
}

/// A matrix as read from the file: its values and shape.
type Matrix = (Vec<f32>, Vec<u64>);

/// The hyper-parameters of a PEFT `adapter_config.json` this plugin applies.
struct PeftConfig {
    alpha: f64,
    rank: f64,
    rslora: bool,
    /// The base model the adapter was trained on, as its config names it.
    base: Option<String>,
}

fn peft_config(name: &str, text: &str) -> Result<PeftConfig> {
    let bad = |why: String| UError::invalid(format!("adapter `{name}`: adapter_config.json {why}"));
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("is not JSON: {e}")))?;
    let field = |k: &str| v.get(k).filter(|x| !x.is_null());
    if let Some(t) = field("peft_type").and_then(|t| t.as_str())
        && t != "LORA"
    {
        return Err(bad(format!("is a {t} adapter; only LoRA is applied")));
    }
    let number = |k: &str| {
        field(k)
            .and_then(|x| x.as_f64())
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| bad(format!("needs a positive `{k}`")))
    };
    let (rank, alpha) = (number("r")?, number("lora_alpha")?);
    let set = |k: &str| field(k).is_some_and(|x| x.as_bool() == Some(true));
    for (key, what) in [
        ("use_dora", "DoRA's magnitude vectors"),
        ("fan_in_fan_out", "Conv1D-shaped (fan_in_fan_out) weights"),
        ("lora_bias", "trained biases on lora_B"),
    ] {
        if set(key) {
            return Err(bad(format!(
                "asks for {what}, which this plugin does not apply"
            )));
        }
    }
    if field("bias")
        .and_then(|b| b.as_str())
        .is_some_and(|b| b != "none")
    {
        return Err(bad(
            "trains biases (`bias` is not \"none\"), which this plugin does not apply".into(),
        ));
    }
    let nonempty = |k: &str| match field(k) {
        Some(serde_json::Value::Object(m)) => !m.is_empty(),
        Some(serde_json::Value::Array(a)) => !a.is_empty(),
        _ => false,
    };
    for key in ["alpha_pattern", "modules_to_save"] {
        if nonempty(key) {
            return Err(bad(format!(
                "sets `{key}`, which this plugin does not apply"
            )));
        }
    }
    Ok(PeftConfig {
        alpha,
        rank,
        rslora: set("use_rslora"),
        base: field("base_model_name_or_path")
            .and_then(|b| b.as_str())
            .map(str::to_string),
    })
}

/// `(layer, target, is_b)` of a PEFT tensor name, through the base's own HF naming.
fn peft_slot(arch: &str, stored: &str) -> Option<(usize, Target, bool)> {
    let module = stored.strip_prefix("base_model.model.")?;
    let (module, is_b) = match module.strip_suffix(".lora_A.weight") {
        Some(m) => (m, false),
        None => (module.strip_suffix(".lora_B.weight")?, true),
    };
    let canonical = naming::canonical_name(Some(arch), &format!("{module}.weight")).into_owned();
    let (layer, target) = gguf_slot(canonical.strip_suffix(".weight")?)?;
    Some((layer, target, is_b))
}

/// `(layer, target)` of a GGUF projection name `blk.{i}.{target}`.
fn gguf_slot(name: &str) -> Option<(usize, Target)> {
    let (layer, target) = name.strip_prefix("blk.")?.split_once('.')?;
    Some((layer.parse().ok()?, Target::from_name(target)?))
}

/// Reorders the rows of `b` (`[out, r]`, heads of `head_dim` rows) between Hugging Face's
/// order and llama.cpp's adjacent-pair order (`to_pairs`) or back.
pub(crate) fn permute_rows(b: &[f32], r: usize, head_dim: usize, to_pairs: bool) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0.0; b.len()];
    for (row, dst) in out.chunks_exact_mut(r).enumerate() {
        let (head, p) = (row / head_dim, row % head_dim);
        // Row `2i + j` of a head in pair order is row `j·half + i` in HF order.
        let (i, j) = if to_pairs {
            (p / 2, p % 2)
        } else {
            (p % half, p / half)
        };
        let src = head * head_dim + if to_pairs { j * half + i } else { 2 * i + j };
        dst.copy_from_slice(&b[src * r..(src + 1) * r]);
    }
    out
}

impl Adapter {
    /// Reads adapter `name` from `set` (and, for PEFT, its `config` text), checked against
    /// `fit`.
    pub fn load(name: &str, set: &WeightSetBox, config: &str, fit: &Fit) -> Result<Adapter> {
        let bad = |why: String| UError::invalid(format!("adapter `{name}`: {why}"));
        let format = set.format().into_result()?.into_string();
        let meta = |k: &str| set.metadata(k.into()).into_result().ok()?.into_option();
        let text = |k: &str| meta(k).and_then(|v| v.as_str().map(str::to_string));
        let gguf = format == "gguf";
        let (alpha, rank, rslora, arch, base) = if gguf {
            if text("general.type").as_deref() != Some("adapter")
                || text("adapter.type").as_deref() != Some("lora")
            {
                return Err(bad("this GGUF file is not a LoRA adapter (general.type = adapter, adapter.type = lora)".into()));
            }
            let alpha = meta("adapter.lora.alpha")
                .and_then(|a| a.as_f64())
                .unwrap_or(0.0);
            (alpha, None, false, text(ARCHITECTURE_KEY), None)
        } else {
            let c = peft_config(name, config)?;
            (c.alpha, Some(c.rank), c.rslora, None, c.base)
        };
        let trained_on = match &base {
            Some(b) => format!("it was trained on `{b}`"),
            None => "an adapter for another model?".into(),
        };
        if let Some(arch) = &arch
            && *arch != fit.arch
        {
            return Err(bad(format!(
                "made for a `{arch}` model, this one is `{}`",
                fit.arch
            )));
        }
        let adapter_permuted = gguf && arch.as_deref().is_some_and(naming::converter_permutes_qk);
        let mut pairs: Vec<[[Option<Matrix>; 2]; 7]> =
            (0..fit.layers.len()).map(|_| Default::default()).collect();
        let tensors = set.tensors().into_result()?;
        if tensors.is_empty() {
            return Err(bad("the file holds no tensors".into()));
        }
        for t in tensors.iter() {
            let stored = t.name.as_str();
            let slot = if gguf {
                let (module, is_b) = match stored.strip_suffix(".weight.lora_a") {
                    Some(m) => (Some(m), false),
                    None => (stored.strip_suffix(".weight.lora_b"), true),
                };
                module.and_then(gguf_slot).map(|(l, t)| (l, t, is_b))
            } else {
                peft_slot(&fit.arch, stored)
            };
            let Some((layer, target, is_b)) = slot else {
                return Err(bad(format!(
                    "tensor `{stored}` names no projection of this {} model's layers \
                     ({trained_on})",
                    fit.arch
                )));
            };
            if layer >= fit.layers.len() {
                return Err(bad(format!(
                    "tensor `{stored}` is for layer {layer}; the model has {} layers",
                    fit.layers.len()
                )));
            }
            let view = set.tensor(stored.into()).into_result()?;
            let values =
                u_sdk::quant::dequantize_view(&view).map_err(|e| bad(format!("{stored}: {e}")))?;
            if values.iter().any(|v| !v.is_finite()) {
                return Err(bad(format!(
                    "tensor `{stored}` holds NaN or infinite values"
                )));
            }
            let at = &mut pairs[layer][target as usize][usize::from(is_b)];
            if at.is_some() {
                return Err(bad(format!("tensor `{stored}` appears twice")));
            }
            *at = Some((values, t.shape.to_vec()));
        }
        let mut layers = Vec::with_capacity(fit.layers.len());
        let (mut targets, mut max_rank, mut bytes) = (Vec::new(), 0usize, 0u64);
        let mut scaling = 0.0f32;
        for (layer, slots) in pairs.into_iter().enumerate() {
            let mut built: [Option<LowRank>; 7] = Default::default();
            for (target, [a, b]) in Target::ALL.into_iter().zip(slots) {
                let what = format!("layer {layer} {}", target.name());
                let ((a, a_shape), (b, b_shape)) = match (a, b) {
                    (None, None) => continue,
                    (Some(a), Some(b)) => (a, b),
                    _ => {
                        return Err(bad(format!(
                            "{what} has one of lora_A and lora_B, not both"
                        )));
                    }
                };
                let Some((inputs, outputs)) = fit.layers[layer][target as usize] else {
                    return Err(bad(format!(
                        "{what}: the model has no dense projection there (an MoE layer?)"
                    )));
                };
                let r = a_shape.first().copied().unwrap_or(0) as usize;
                if a_shape != [r as u64, inputs as u64]
                    || b_shape != [outputs as u64, r as u64]
                    || r == 0
                {
                    return Err(bad(format!(
                        "{what}: lora_A {a_shape:?} and lora_B {b_shape:?} do not fit the model's \
                         {inputs} → {outputs} projection (want [r, {inputs}] and [{outputs}, r]; an \
                         adapter for another base?)"
                    )));
                }
                // llama.cpp applies a GGUF adapter without alpha at scale 1. A module's rank is
                // its tensors' (PEFT's `rank_pattern` may differ from `r`).
                let alpha = if gguf && alpha == 0.0 {
                    r as f64
                } else {
                    alpha
                };
                let k = if rslora {
                    alpha / (r as f64).sqrt()
                } else {
                    alpha / r as f64
                } as f32;
                if scaling == 0.0 || rank.is_some_and(|n| n as usize == r) {
                    scaling = k;
                }
                let b = match target {
                    Target::Q | Target::K if adapter_permuted != fit.permuted => {
                        permute_rows(&b, r, fit.head_dim, fit.permuted)
                    }
                    _ => b,
                };
                // Bᵀ, scaled: row `c` holds column `c` of B times the scaling.
                let mut bt = vec![0f32; b.len()];
                for (o, row) in b.chunks_exact(r).enumerate() {
                    for (c, v) in row.iter().enumerate() {
                        bt[c * outputs + o] = v * k;
                    }
                }
                bytes += 4 * (a.len() + bt.len()) as u64;
                max_rank = max_rank.max(r);
                if !targets.contains(&target.name()) {
                    targets.push(target.name());
                }
                built[target as usize] = Some(LowRank { rank: r, a, bt });
            }
            layers.push(built);
        }
        Ok(Adapter {
            layers,
            info: AdapterInfo {
                name: name.into(),
                rank: max_rank as u32,
                scaling,
                targets: targets.into_iter().map(Into::into).collect(),
                bytes,
            },
        })
    }
}

impl Adapter {
    /// Its pair for projection `target` of `layer`, if it adapts that one.
    fn pair(&self, layer: usize, target: Target) -> Option<&LowRank> {
        self.layers.get(layer)?[target as usize].as_ref()
    }
}

/// Every resident adapter's pairs stacked, per projection: `A`s `[ΣR, in]` and `Bᵀ`s
/// `[ΣR, out]` (an adapter without that projection contributes zero rows), so that one
/// [`Op::LowRank`](u_sdk::Op::LowRank) applies any mix of them.
pub struct Stack {
    /// The adapters, each with its first row in the stacks.
    members: Vec<(Arc<Adapter>, usize)>,
    layers: Vec<[Option<(Tensor, Tensor)>; 7]>,
}

impl Stack {
    /// Stacks `adapters` for a model of `fit` (`None` when there are none).
    pub fn build(adapters: &[Arc<Adapter>], fit: &Fit, device: &Device) -> Result<Option<Stack>> {
        if adapters.is_empty() {
            return Ok(None);
        }
        let mut members = Vec::with_capacity(adapters.len());
        let mut columns = 0;
        for a in adapters {
            members.push((a.clone(), columns));
            columns += a.info.rank as usize;
        }
        let mut layers = Vec::with_capacity(fit.layers.len());
        for (layer, dims) in fit.layers.iter().enumerate() {
            let mut built: [Option<(Tensor, Tensor)>; 7] = Default::default();
            for target in Target::ALL {
                let Some((inputs, outputs)) = dims[target as usize] else {
                    continue;
                };
                if adapters.iter().all(|a| a.pair(layer, target).is_none()) {
                    continue;
                }
                let mut a_all = vec![0f32; columns * inputs];
                let mut bt_all = vec![0f32; columns * outputs];
                for (member, first) in &members {
                    if let Some(p) = member.pair(layer, target) {
                        a_all[first * inputs..(first + p.rank) * inputs].copy_from_slice(&p.a);
                        bt_all[first * outputs..(first + p.rank) * outputs].copy_from_slice(&p.bt);
                    }
                }
                built[target as usize] = Some((
                    device.from_f32(&a_all, &[columns as u64, inputs as u64])?,
                    device.from_f32(&bt_all, &[columns as u64, outputs as u64])?,
                ));
            }
            layers.push(built);
        }
        Ok(Some(Stack { members, layers }))
    }

    /// The first row of `adapter` in the stacks, if it is a member.
    fn first(&self, adapter: &Arc<Adapter>) -> Option<usize> {
        self.members
            .iter()
            .find(|(m, _)| Arc::ptr_eq(m, adapter))
            .map(|(_, first)| *first)
    }
}

/// Rows of a pass that run under one adapter at one scale.
pub struct Group {
    /// Rows of the batch (one sequence's).
    pub rows: Range<usize>,
    /// The adapter.
    pub adapter: Arc<Adapter>,
    /// The scale the sequence asked for.
    pub strength: f32,
}

/// How a pass applies its sequences' adapters.
pub enum Plan {
    /// None of its sequences uses one.
    None,
    /// Through the stack of resident adapters.
    Stacked {
        /// The stack.
        stack: Arc<Stack>,
        /// `[rows, 3·k]`: each row's adapters (first row in the stacks, rank, scale).
        table: Tensor,
    },
}

impl Plan {
    /// The plan for `groups` over a batch of `rows` rows, read from `stack`, which holds every
    /// adapter they name.
    pub fn new(
        groups: &[Group],
        stack: Option<Arc<Stack>>,
        rows: usize,
        device: &Device,
    ) -> Result<Plan> {
        let Some(stack) = stack.filter(|_| !groups.is_empty()) else {
            return Ok(Plan::None);
        };
        let mut per_row = vec![0usize; rows];
        for g in groups {
            for r in g.rows.clone() {
                per_row[r] += 1;
            }
        }
        let k = per_row.iter().copied().max().unwrap_or(0);
        let mut table = vec![0f32; rows * 3 * k];
        per_row.fill(0);
        for g in groups {
            let first = stack.first(&g.adapter).ok_or_else(|| {
                UError::new(
                    ErrorKind::Internal,
                    format!("adapter `{}` is not in the stack", g.adapter.info.name),
                )
            })?;
            for r in g.rows.clone() {
                let e = &mut table[(r * k + per_row[r]) * 3..][..3];
                e.copy_from_slice(&[first as f32, g.adapter.info.rank as f32, g.strength]);
                per_row[r] += 1;
            }
        }
        Ok(Plan::Stacked {
            stack,
            table: device.from_f32(&table, &[rows as u64, 3 * k as u64])?,
        })
    }

    /// Adds, for layer `layer`'s projection `target` with input `x` and output `y` over the
    /// whole batch, each row's adapter deltas.
    pub fn adapt(&self, layer: usize, target: Target, x: &Tensor, y: &Tensor) -> Result<()> {
        let Plan::Stacked { stack, table } = self else {
            return Ok(());
        };
        match stack
            .layers
            .get(layer)
            .and_then(|l| l[target as usize].as_ref())
        {
            Some((a, bt)) => y.low_rank_assign(x, a, bt, table),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Permuting to pair order and back is the identity, and pair order puts a head's two
    /// halves side by side (llama.cpp's `permute`).
    #[test]
    fn q_k_rows_permute_to_pairs_and_back() {
        let (r, hd) = (1, 4);
        let hf: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let pairs = permute_rows(&hf, r, hd, true);
        assert_eq!(pairs, [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]);
        assert_eq!(permute_rows(&pairs, r, hd, false), hf);
    }

    #[test]
    fn peft_names_map_through_the_bases_naming() {
        assert_eq!(
            peft_slot(
                "llama",
                "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
            ),
            Some((1, Target::Q, true))
        );
        assert_eq!(
            peft_slot(
                "llama",
                "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
            ),
            Some((0, Target::Down, false))
        );
        assert_eq!(
            peft_slot(
                "llama",
                "base_model.model.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight"
            ),
            None
        );
    }
}
