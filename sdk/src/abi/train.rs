//! Training the small things that change a model's behaviour: a [`Trainer`] a model makes
//! ([`Model::trainer`](crate::Model::trainer)) holds trainable parameters beside the frozen
//! model, accumulates their gradients over token sequences (reverse-mode autograd on the
//! model's own backend) and steps an optimizer. The host feeds it data, schedules the learning
//! rate, shows progress, writes checkpoints ([`Trainer::state`]) and the result
//! ([`Trainer::export`]).
//!
//! Parameters cross the boundary under the names and in the orientation of the file format the
//! result is written in (PEFT's `base_model.model.…lora_A.weight`, `[rank, in]`; PEFT prompt
//! tuning's `prompt_embeddings`), whatever order the model keeps its own weights in.

use crate::abi::error::UError;
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RSlice, RString, RVec},
};

/// What a trainer learns.
#[repr(C, u8)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub enum TrainTarget {
    /// A low-rank adapter (LoRA, Hu et al. 2021): `W + s·B·A` on each targeted projection,
    /// `s = alpha / rank` (`alpha / √rank` rank-stabilised), `A` random and `B` zero at first
    /// (PEFT's initialisation).
    Lora {
        /// The rank of every `A`/`B` pair.
        rank: u32,
        /// `alpha`.
        alpha: f32,
        /// Rank-stabilised scaling (`alpha / √rank`).
        rslora: bool,
        /// The projections adapted, in PEFT's module names (`q_proj`, `v_proj`, …).
        targets: RVec<RString>,
    },
    /// A soft prompt (prompt tuning, Lester et al. 2021): `virtual_tokens` embedding rows put
    /// before every sequence, started from the embeddings of the `init` tokens (repeated to
    /// length) or, when `init` is empty, from random vocabulary rows.
    SoftPrompt {
        /// Rows of the prompt.
        virtual_tokens: u32,
        /// Token ids whose embeddings start it.
        init: RVec<u32>,
    },
}

/// How a trainer is set up.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct TrainSpec {
    /// What it learns.
    pub target: TrainTarget,
    /// Seed of the random initialisation.
    pub seed: u64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f32,
    /// The largest global gradient norm a step uses (larger ones are scaled down); 0: none.
    pub clip: f32,
}

/// A named tensor of `f32` values.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct NamedValues {
    /// Its name.
    pub name: RString,
    /// Its dimensions.
    pub dims: RVec<u64>,
    /// Its values, row-major.
    pub values: RVec<f32>,
}

/// A training result as the file format that loads it holds it.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct Trained {
    /// The tensors (PEFT's `adapter_model.safetensors`).
    pub tensors: RVec<NamedValues>,
    /// The configuration (PEFT's `adapter_config.json`).
    pub config: RString,
}

/// A trainer over one model.
#[sabi_trait]
pub trait Trainer: Send {
    /// Runs `tokens` forward and backward, adding the gradients of the mean next-token
    /// cross-entropy over its positions to the sums the next [`Trainer::step`] uses; returns
    /// that loss.
    fn accumulate(&mut self, tokens: RSlice<'_, u32>) -> RResult<f32, UError>;

    /// The mean next-token cross-entropy of `tokens`, without gradients (evaluation).
    fn loss(&self, tokens: RSlice<'_, u32>) -> RResult<f32, UError>;

    /// One AdamW step at `learning_rate` with the gradients accumulated since the last step
    /// (averaged over the sequences), clipped as the spec says; clears them and returns the
    /// global gradient norm before clipping.
    fn step(&mut self, learning_rate: f32) -> RResult<f32, UError>;

    /// The gradients accumulated so far (averaged), by parameter name.
    fn gradients(&self) -> RResult<RVec<NamedValues>, UError>;

    /// Everything needed to resume: parameters (by their export names), the optimizer's
    /// moments (`{name}.exp_avg`, `{name}.exp_avg_sq`) and its step count (`step`).
    fn state(&self) -> RResult<RVec<NamedValues>, UError>;

    /// Takes back what [`Trainer::state`] gave; parameters alone (an existing adapter to
    /// continue from) reset the optimizer. Unknown names and wrong shapes are errors.
    fn restore(&mut self, state: RVec<NamedValues>) -> RResult<(), UError>;

    /// The result in its file format.
    fn export(&self) -> RResult<Trained, UError>;
}

/// An owned trainer object.
pub type TrainerBox = Trainer_TO<'static, RBox<()>>;
