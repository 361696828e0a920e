//! Training over a frozen Llama: LoRA pairs on chosen projections, or a soft prompt before
//! every sequence, learned by next-token cross-entropy with AdamW (see [`u_sdk::Trainer`]).
//!
//! The forward pass is the model's own math recorded on a [`u_train::Graph`] — pre-norm
//! RMSNorm, RoPE, grouped-query causal attention, SwiGLU — over the model's weights, which stay
//! frozen (each kept with its transpose for the backward pass). A LoRA projection computes
//! `x·Wᵀ + s·(x·Aᵀ)·Bᵀ`, as PEFT does. Parameters cross the ABI in PEFT's names and orientation;
//! inside, a `B` of Q or K follows the model's row order (llama.cpp's adjacent pairs for a GGUF
//! base).

use crate::{
    config::FfnActivation,
    lora::{Target, permute_rows},
    model::{FeedForward, Llama},
    weights::{Linear, Norm},
};
use abi_stable::std_types::{RResult, RSlice, RString, RVec};
use std::{collections::HashMap, sync::Arc};
use u_sdk::{
    Activation, NamedValues, Result, RopeParams, TrainSpec, TrainTarget, Trained, Trainer, UError,
    nn::Tensor,
};
use u_train::{
    Frozen, Graph, Param, Var,
    attention::Shape,
    grad_values,
    optim::{Adam, clip_grad_norm},
};

/// A frozen projection: its weight (with `Wᵀ`), output scale and bias.
struct FrozenLinear {
    weight: Frozen,
    scale: Option<f32>,
    bias: Option<Tensor>,
    inputs: usize,
    outputs: usize,
}

impl FrozenLinear {
    fn new(l: &Linear) -> Result<FrozenLinear> {
        Ok(FrozenLinear {
            weight: Frozen::new(&l.weight)?,
            scale: l.scale,
            bias: l.bias.clone(),
            inputs: l.inputs,
            outputs: l.outputs,
        })
    }

    fn forward(&self, g: &Graph, x: Var) -> Result<Var> {
        let mut y = g.frozen_matmul_t(x, &self.weight)?;
        if let Some(s) = self.scale {
            y = g.scale(y, s)?;
        }
        if let Some(b) = &self.bias {
            y = g.add_row(y, g.constant(b.clone()))?;
        }
        Ok(y)
    }
}

/// An RMSNorm's scale and epsilon.
struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn new(n: Option<&Norm>, what: &str) -> Result<RmsNorm> {
        match n {
            Some(n) if n.bias.is_none() => Ok(RmsNorm {
                weight: n.weight.clone(),
                eps: n.eps,
            }),
            _ => Err(unsupported(&format!(
                "{what}: training needs RMSNorm pre-norms"
            ))),
        }
    }

    fn forward(&self, g: &Graph, x: Var) -> Result<Var> {
        g.rms_norm(x, &self.weight, self.eps)
    }
}

/// One block, frozen: `h = x + Attention(norm₁(x)); h + SwiGLU(norm₂(h))`.
struct Block {
    attn_norm: RmsNorm,
    /// Projections in [`Target::ALL`] order.
    proj: [FrozenLinear; 7],
    rope: (RopeParams, RopeParams),
    shape: Shape,
    window: usize,
    ffn_norm: RmsNorm,
    residual: f32,
}

fn unsupported(why: &str) -> UError {
    UError::unsupported(format!("arch-llama training: {why}"))
}

impl Block {
    fn new(b: &crate::model::Block, layer: usize) -> Result<Block> {
        let a = &b.attn;
        let FeedForward::Dense(mlp) = &b.ffn else {
            return Err(unsupported(&format!(
                "layer {layer} is a mixture of experts"
            )));
        };
        let plain = !b.parallel
            && b.post_attn_norm.is_none()
            && b.post_ffn_norm.is_none()
            && a.q_norm.is_none()
            && a.k_norm.is_none()
            && a.sub_norm.is_none()
            && mlp.sub_norm.is_none()
            && a.clip.is_none()
            && a.softcap.is_none()
            && matches!(mlp.act, FfnActivation::Act(Activation::Silu));
        let (Some(gate), Some(rope), true) = (&mlp.gate, &a.rope, plain) else {
            return Err(unsupported(&format!(
                "layer {layer} is not a Llama block (pre-norm, RoPE, SwiGLU, no extra norms)"
            )));
        };
        let proj = [&a.q, &a.k, &a.v, &a.o, gate, &mlp.up, &mlp.down];
        Ok(Block {
            attn_norm: RmsNorm::new(b.attn_norm.as_ref(), "attention norm")?,
            proj: frozen(proj)?,
            rope: rope.clone(),
            shape: Shape {
                heads: a.heads,
                kv_heads: a.kv_heads,
                head_dim: a.head_dim,
                scale: a.scale,
            },
            window: a.window as usize,
            ffn_norm: RmsNorm::new(b.ffn_norm.as_ref(), "feed-forward norm")?,
            residual: b.residual_scale,
        })
    }
}

/// The seven projections of a block, frozen.
fn frozen(l: [&Linear; 7]) -> Result<[FrozenLinear; 7]> {
    let [q, k, v, o, gate, up, down] = l.map(FrozenLinear::new);
    Ok([q?, k?, v?, o?, gate?, up?, down?])
}

/// What is learned.
enum Learned {
    /// LoRA: `A` of `(layer, target)` at `params[i]`, its `B` at `params[i + 1]`.
    Lora {
        pairs: HashMap<(usize, Target), usize>,
        scaling: f32,
    },
    /// A soft prompt, `params[0]` `[rows, hidden]`.
    Prompt,
}

/// A small deterministic generator for the initial values (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-bound, bound)`.
    fn uniform(&mut self, bound: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * bound
    }
}

/// A trainer over a frozen [`Llama`].
pub struct LlamaTrainer {
    model: Arc<Llama>,
    blocks: Vec<Block>,
    norm: RmsNorm,
    head: FrozenLinear,
    spec: TrainSpec,
    learned: Learned,
    /// Export names, parallel to `params`.
    names: Vec<String>,
    params: Vec<Param>,
    optimizer: Adam,
    /// Gradient sums since the last step, and over how many sequences.
    grads: Vec<Vec<f32>>,
    sequences: u32,
}

impl LlamaTrainer {
    /// A trainer of `spec` over `model`.
    pub fn new(model: Arc<Llama>, spec: TrainSpec) -> Result<LlamaTrainer> {
        if model.positions.is_some() {
            return Err(unsupported("learned absolute positions"));
        }
        if model.cfg.scales.final_softcap.is_some() {
            return Err(unsupported("soft-capped logits"));
        }
        let blocks = model
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| Block::new(b, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(Some(&model.norm), "final norm")?;
        let head = FrozenLinear::new(&model.lm_head)?;
        let mut rng = Rng(spec.seed);
        let (mut names, mut params) = (Vec::new(), Vec::new());
        let learned = match &spec.target {
            TrainTarget::Lora {
                rank,
                alpha,
                rslora,
                targets,
            } => {
                let r = *rank as usize;
                if r == 0 {
                    return Err(UError::invalid("arch-llama training: a LoRA rank of 0"));
                }
                let targets = targets
                    .iter()
                    .map(|t| {
                        Target::from_hf_module(t).ok_or_else(|| {
                            UError::invalid(format!(
                                "arch-llama training: unknown target module `{t}` (q_proj, \
                                 k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                if targets.is_empty() {
                    return Err(UError::invalid("arch-llama training: no target modules"));
                }
                let mut pairs = HashMap::new();
                for (layer, block) in blocks.iter().enumerate() {
                    for (slot, t) in Target::ALL.iter().enumerate() {
                        if !targets.contains(t) {
                            continue;
                        }
                        let p = &block.proj[slot];
                        let key = |m: &str| {
                            format!(
                                "base_model.model.model.layers.{layer}.{}.lora_{m}.weight",
                                t.hf_module()
                            )
                        };
                        // PEFT's start: A ~ kaiming_uniform(a = √5) = U(±1/√in), B = 0.
                        let bound = 1.0 / (p.inputs as f32).sqrt();
                        let a: Vec<f32> = (0..r * p.inputs).map(|_| rng.uniform(bound)).collect();
                        pairs.insert((layer, *t), params.len());
                        names.push(key("A"));
                        params.push(Param::new(a, &[r as u64, p.inputs as u64])?);
                        names.push(key("B"));
                        params.push(Param::new(
                            vec![0.0; p.outputs * r],
                            &[p.outputs as u64, r as u64],
                        )?);
                    }
                }
                let scaling = match rslora {
                    true => alpha / (r as f32).sqrt(),
                    false => alpha / r as f32,
                };
                Learned::Lora { pairs, scaling }
            }
            TrainTarget::SoftPrompt {
                virtual_tokens,
                init,
            } => {
                let (n, hidden, vocab) = (
                    *virtual_tokens as usize,
                    model.cfg.hidden,
                    model.cfg.vocab_size,
                );
                if n == 0 {
                    return Err(UError::invalid(
                        "arch-llama training: a soft prompt of 0 virtual tokens",
                    ));
                }
                let ids: Vec<i32> = (0..n)
                    .map(|i| match init.is_empty() {
                        true => (rng.next() % vocab as u64) as i32,
                        false => init[i % init.len()] as i32,
                    })
                    .collect();
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(UError::invalid(format!(
                        "arch-llama training: init token {bad} is outside the vocabulary of {vocab}"
                    )));
                }
                let rows = model
                    .embed
                    .get_rows(&model.device.from_i32(&ids, &[n as u64])?)?;
                let rows = rows.scale(model.cfg.scales.embedding)?.to_vec()?;
                names.push("prompt_embeddings".into());
                params.push(Param::new(rows, &[n as u64, hidden as u64])?);
                Learned::Prompt
            }
        };
        let grads = params.iter().map(|p| vec![0.0; p.values.len()]).collect();
        Ok(LlamaTrainer {
            model,
            blocks,
            norm,
            head,
            optimizer: Adam::adamw(0.0, spec.weight_decay),
            spec,
            learned,
            names,
            params,
            grads,
            sequences: 0,
        })
    }

    /// Rows of the soft prompt put before the tokens (0 for LoRA).
    fn prompt_rows(&self) -> usize {
        match self.learned {
            Learned::Prompt => self.params[0].dims[0] as usize,
            Learned::Lora { .. } => 0,
        }
    }

    /// `x·Wᵀ` of projection `t` of `layer`, plus its LoRA delta when it has one.
    fn project(&self, g: &Graph, leaves: &[Var], layer: usize, t: Target, x: Var) -> Result<Var> {
        let slot = Target::ALL.iter().position(|&s| s == t).unwrap_or(0);
        let y = self.blocks[layer].proj[slot].forward(g, x)?;
        let Learned::Lora { pairs, scaling } = &self.learned else {
            return Ok(y);
        };
        let Some(&i) = pairs.get(&(layer, t)) else {
            return Ok(y);
        };
        let delta = g.matmul_t(g.matmul_t(x, leaves[i])?, leaves[i + 1])?;
        g.add(y, g.scale(delta, *scaling)?)
    }

    /// The mean next-token cross-entropy of `tokens` as a graph node.
    fn forward(&self, g: &Graph, leaves: &[Var], tokens: &[u32]) -> Result<(Var, f32)> {
        let cfg = &self.model.cfg;
        let p = self.prompt_rows();
        let n = tokens.len();
        if n < 2 {
            return Err(UError::invalid(
                "arch-llama training: a sequence needs at least two tokens",
            ));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(UError::invalid(format!(
                "arch-llama training: token {bad} is outside the vocabulary of {}",
                cfg.vocab_size
            )));
        }
        let len = p + n;
        if len > cfg.context_length {
            return Err(UError::invalid(format!(
                "arch-llama training: {len} positions exceed the context length {}",
                cfg.context_length
            )));
        }
        if let Some(w) = self
            .blocks
            .iter()
            .map(|b| b.window)
            .find(|&w| w > 0 && w < len)
        {
            return Err(UError::invalid(format!(
                "arch-llama training: {len} positions exceed the sliding window of {w}"
            )));
        }
        let dev = &self.model.device;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let embedded = self
            .model
            .embed
            .get_rows(&dev.from_i32(&ids, &[n as u64])?)?;
        let embedded = match cfg.scales.embedding {
            1.0 => embedded,
            s => embedded.scale(s)?,
        };
        let mut x = g.constant(embedded);
        if let Learned::Prompt = self.learned {
            x = g.concat_rows(leaves[0], x)?;
        }
        let positions: Vec<i32> = (0..len as i32).collect();
        for (layer, b) in self.blocks.iter().enumerate() {
            let h = b.attn_norm.forward(g, x)?;
            let q = self.project(g, leaves, layer, Target::Q, h)?;
            let k = self.project(g, leaves, layer, Target::K, h)?;
            let v = self.project(g, leaves, layer, Target::V, h)?;
            let q = g.rope(q, &positions, &b.rope.0)?;
            let k = g.rope(k, &positions, &b.rope.1)?;
            let a = g.attention(q, k, v, b.shape)?;
            let a = self.project(g, leaves, layer, Target::Output, a)?;
            x = g.add(x, residual(g, a, b.residual)?)?;
            let h = b.ffn_norm.forward(g, x)?;
            let gate = self.project(g, leaves, layer, Target::Gate, h)?;
            let up = self.project(g, leaves, layer, Target::Up, h)?;
            let m = g.mul(g.silu(gate)?, up)?;
            let d = self.project(g, leaves, layer, Target::Down, m)?;
            x = g.add(x, residual(g, d, b.residual)?)?;
        }
        // Rows of the tokens that have a next token.
        let x = g.rows(x, p..p + n - 1)?;
        let mut logits = self.head.forward(g, self.norm.forward(g, x)?)?;
        if cfg.scales.logits != 1.0 {
            logits = g.scale(logits, cfg.scales.logits)?;
        }
        g.cross_entropy(logits, &tokens[1..])
    }

    fn leaves(&self, g: &Graph) -> Result<Vec<Var>> {
        self.params.iter().map(|p| p.leaf(g)).collect()
    }

    /// Whether `params[i]` is a `B` of Q or K kept in llama.cpp's row order.
    fn permuted(&self, i: usize) -> bool {
        let fit = &self.model.fit;
        let Learned::Lora { pairs, .. } = &self.learned else {
            return false;
        };
        fit.permuted
            && pairs
                .iter()
                .any(|(&(_, t), &a)| a + 1 == i && matches!(t, Target::Q | Target::K))
    }

    /// `values` of `params[i]` between the model's order and the export's (`to_export`).
    fn orient(&self, i: usize, values: &[f32], to_export: bool) -> Vec<f32> {
        match self.permuted(i) {
            true => {
                let r = self.params[i].dims[1] as usize;
                permute_rows(values, r, self.model.fit.head_dim, !to_export)
            }
            false => values.to_vec(),
        }
    }

    fn named(&self, i: usize, suffix: &str, values: &[f32]) -> NamedValues {
        NamedValues {
            name: format!("{}{suffix}", self.names[i]).into(),
            dims: self.params[i].dims.clone().into(),
            values: self.orient(i, values, true).into(),
        }
    }

    fn averaged(&self) -> Vec<Vec<f32>> {
        let n = self.sequences.max(1) as f32;
        self.grads
            .iter()
            .map(|g| g.iter().map(|v| v / n).collect())
            .collect()
    }

    fn adapter_config(&self) -> String {
        let cfg = &self.model.cfg;
        let value = match &self.spec.target {
            TrainTarget::Lora {
                rank,
                alpha,
                rslora,
                targets,
            } => serde_json::json!({
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": alpha,
                "use_rslora": rslora,
                "target_modules": targets.iter().map(|t| t.as_str()).collect::<Vec<_>>(),
                "lora_dropout": 0.0,
                "bias": "none",
                "fan_in_fan_out": false,
                "inference_mode": true,
                "base_model_name_or_path": null,
            }),
            TrainTarget::SoftPrompt { virtual_tokens, .. } => serde_json::json!({
                "peft_type": "PROMPT_TUNING",
                "task_type": "CAUSAL_LM",
                "num_virtual_tokens": virtual_tokens,
                "token_dim": cfg.hidden,
                "num_transformer_submodules": 1,
                "num_attention_heads": cfg.heads,
                "num_layers": cfg.layers,
                "prompt_tuning_init": "RANDOM",
                "inference_mode": true,
                "base_model_name_or_path": null,
            }),
        };
        value.to_string()
    }

    fn restore_state(&mut self, state: RVec<NamedValues>) -> Result<()> {
        let index: HashMap<&str, usize> = self
            .names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let mut values = vec![None; self.params.len()];
        let (mut m, mut v) = (values.clone(), values.clone());
        let mut steps = None;
        for t in state.iter() {
            let name = t.name.as_str();
            if name == "step" {
                steps = t.values.first().map(|&s| s as i32);
                continue;
            }
            let (base, slot) = match (
                name.strip_suffix(".exp_avg"),
                name.strip_suffix(".exp_avg_sq"),
            ) {
                (Some(b), _) => (b, &mut m),
                (_, Some(b)) => (b, &mut v),
                _ => (name, &mut values),
            };
            let Some(&i) = index.get(base) else {
                return Err(UError::invalid(format!(
                    "arch-llama training: `{name}` is not a parameter of this trainer"
                )));
            };
            if t.dims.as_slice() != self.params[i].dims.as_slice()
                || t.values.len() != self.params[i].values.len()
            {
                return Err(UError::invalid(format!(
                    "arch-llama training: `{name}` has shape {:?} ({} values), the parameter {:?}",
                    t.dims.as_slice(),
                    t.values.len(),
                    self.params[i].dims
                )));
            }
            if t.values.iter().any(|x| !x.is_finite()) {
                return Err(UError::invalid(format!(
                    "arch-llama training: `{name}` holds non-finite values"
                )));
            }
            slot[i] = Some(self.orient(i, &t.values, false));
        }
        if values.iter().any(Option::is_none) {
            return Err(UError::invalid(
                "arch-llama training: the state lacks some parameters",
            ));
        }
        let full = |s: Vec<Option<Vec<f32>>>| s.into_iter().collect::<Option<Vec<_>>>();
        for (p, new) in self.params.iter_mut().zip(values.into_iter().flatten()) {
            p.values = new;
        }
        self.optimizer = Adam::adamw(0.0, self.spec.weight_decay);
        if let (Some(steps), Some(m), Some(v)) = (steps, full(m), full(v)) {
            self.optimizer.set_moments(steps, m, v);
        }
        self.grads.iter_mut().for_each(|g| g.fill(0.0));
        self.sequences = 0;
        Ok(())
    }
}

/// `s·y`, skipped when `s` is 1.
fn residual(g: &Graph, y: Var, s: f32) -> Result<Var> {
    match s {
        1.0 => Ok(y),
        s => g.scale(y, s),
    }
}

impl Trainer for LlamaTrainer {
    fn accumulate(&mut self, tokens: RSlice<'_, u32>) -> RResult<f32, UError> {
        let run = || -> Result<(Vec<Vec<f32>>, f32)> {
            let g = Graph::new(self.model.device.clone());
            let leaves = self.leaves(&g)?;
            let (loss, value) = self.forward(&g, &leaves, tokens.as_slice())?;
            if !value.is_finite() {
                return Err(UError::invalid(format!(
                    "arch-llama training: the loss is {value}"
                )));
            }
            g.backward(loss)?;
            let grads = leaves
                .iter()
                .map(|&l| grad_values(&g, l))
                .collect::<Result<Vec<_>>>()?;
            Ok((grads, value))
        };
        match run() {
            Ok((grads, loss)) => {
                for (sum, g) in self.grads.iter_mut().zip(grads) {
                    sum.iter_mut().zip(g).for_each(|(s, v)| *s += v);
                }
                self.sequences += 1;
                RResult::ROk(loss)
            }
            Err(e) => RResult::RErr(e),
        }
    }

    fn loss(&self, tokens: RSlice<'_, u32>) -> RResult<f32, UError> {
        let g = Graph::new(self.model.device.clone());
        self.leaves(&g)
            .and_then(|leaves| self.forward(&g, &leaves, tokens.as_slice()))
            .map(|(_, loss)| loss)
            .into()
    }

    fn step(&mut self, learning_rate: f32) -> RResult<f32, UError> {
        if self.sequences == 0 {
            return RResult::RErr(UError::invalid(
                "arch-llama training: a step with no accumulated gradients",
            ));
        }
        let mut grads = self.averaged();
        let norm = match self.spec.clip {
            c if c > 0.0 => clip_grad_norm(&mut grads, c),
            _ => clip_grad_norm(&mut grads, f32::INFINITY),
        };
        self.optimizer.set_lr(learning_rate);
        if let Err(e) = self.optimizer.step(&mut self.params, &grads) {
            return RResult::RErr(e);
        }
        self.grads.iter_mut().for_each(|g| g.fill(0.0));
        self.sequences = 0;
        RResult::ROk(norm)
    }

    fn gradients(&self) -> RResult<RVec<NamedValues>, UError> {
        let grads = self.averaged();
        RResult::ROk(
            grads
                .iter()
                .enumerate()
                .map(|(i, g)| self.named(i, "", g))
                .collect(),
        )
    }

    fn state(&self) -> RResult<RVec<NamedValues>, UError> {
        let mut out: Vec<NamedValues> = (0..self.params.len())
            .map(|i| self.named(i, "", &self.params[i].values))
            .collect();
        let (steps, m, v) = self.optimizer.moments();
        if steps > 0 {
            for (i, (m, v)) in m.iter().zip(v).enumerate() {
                out.push(self.named(i, ".exp_avg", m));
                out.push(self.named(i, ".exp_avg_sq", v));
            }
            out.push(NamedValues {
                name: "step".into(),
                dims: vec![1].into(),
                values: vec![steps as f32].into(),
            });
        }
        RResult::ROk(out.into())
    }

    fn restore(&mut self, state: RVec<NamedValues>) -> RResult<(), UError> {
        self.restore_state(state).into()
    }

    fn export(&self) -> RResult<Trained, UError> {
        RResult::ROk(Trained {
            tensors: (0..self.params.len())
                .map(|i| self.named(i, "", &self.params[i].values))
                .collect(),
            config: RString::from(self.adapter_config()),
        })
    }
}
