//! # u-diffusion — diffusion sampling
//!
//! The noise schedulers of a diffusion pipeline, as diffusers defines them: each reads a
//! `scheduler_config.json` by diffusers' names (`num_train_timesteps`, `beta_schedule`,
//! `prediction_type`, `timestep_spacing`, `steps_offset`, …), lays out the timesteps of an
//! `n`-step run, scales the model's input and takes one denoising step from the model's output.
//! Noise, where a scheduler adds some, comes from the caller — [`Noise`] draws it from a seed —
//! so a seed reproduces a sample.
//!
//! Layout: [`scheduler`] (the [`Scheduler`] trait and [`from_config`]), with one module per
//! family: [`scheduler::ddpm`] (Ho et al. 2020), [`scheduler::ddim`] (Song et al. 2020), [`scheduler::euler`] (Karras et al. 2022's
//! Euler and ancestral Euler), [`scheduler::lcm`] (latent consistency models) and
//! [`scheduler::flow_match`] (rectified flow, Esser et al. 2024).
//! `tests/` runs every scheduler over diffusers' own test pattern against diffusers' results.
#![deny(missing_docs)]

pub mod noise;
pub mod scheduler;

pub use noise::Noise;
pub use scheduler::{Schedule, Scheduler, dynamic_mu, from_config, from_config_with};

/// Why a scheduler could not be made or run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is malformed or asks for something not implemented.
    #[error("scheduler config: {0}")]
    Config(String),
    /// A call does not fit the schedule (a step past the end, buffers of different lengths).
    #[error("scheduler: {0}")]
    Invalid(String),
}

/// This crate's results.
pub type Result<T> = std::result::Result<T, Error>;
