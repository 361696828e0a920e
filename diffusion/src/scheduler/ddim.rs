//! DDIM (Song et al. 2020, *Denoising Diffusion Implicit Models*, arXiv:2010.02502) as
//! diffusers' `DDIMScheduler`: integer timesteps, the predicted clean sample (clipped to
//! `clip_sample_range` with `clip_sample`) and noise recombined at the previous timestep's ᾱ;
//! with `eta` > 0 a share of fresh noise (η = 1 is DDPM's posterior variance).

use super::{
    Config, DDPM_BETAS, Denoiser, Scheduler, add_noise_at_alpha, alphas_cumprod, check_step,
    integer_timesteps, update,
};
use crate::{Error, Result};
use serde_json::Value;

/// A DDIM schedule for one run.
pub struct Ddim {
    alphas_cumprod: Vec<f32>,
    /// ᾱ before the first training step (`set_alpha_to_one`: 1, else ᾱ₀).
    final_alpha: f32,
    timesteps: Vec<f32>,
    stride: usize,
    denoiser: Denoiser,
    eta: f32,
}

impl Ddim {
    /// DDIM from `c` for `steps` steps.
    pub fn new(c: &Config<'_>, steps: usize) -> Result<Ddim> {
        c.refuse(&[("thresholding", Value::Bool(false))])?;
        let alphas_cumprod = alphas_cumprod(c, DDPM_BETAS)?;
        let n = alphas_cumprod.len();
        let timesteps = integer_timesteps(c, steps, n)?;
        Ok(Ddim {
            final_alpha: match c.bool("set_alpha_to_one", true)? {
                true => 1.0,
                false => alphas_cumprod[0],
            },
            alphas_cumprod,
            timesteps,
            stride: n / steps,
            denoiser: Denoiser::read(c, true)?,
            eta: 0.0,
        })
    }

    /// The same schedule with noise weight `eta` (0: deterministic DDIM; 1: DDPM's variance).
    pub fn with_eta(mut self, eta: f32) -> Result<Ddim> {
        if !(0.0..=1.0).contains(&eta) {
            return Err(Error::Invalid(format!("eta {eta} is not within [0, 1]")));
        }
        self.eta = eta;
        Ok(self)
    }

    /// ᾱ at training timestep `t`, or before the first one.
    fn alpha_at(&self, t: i64) -> f32 {
        match t >= 0 {
            true => self.alphas_cumprod[t as usize],
            false => self.final_alpha,
        }
    }
}

impl Scheduler for Ddim {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn needs_noise(&self, _step: usize) -> bool {
        self.eta > 0.0
    }

    fn step(
        &self,
        output: &[f32],
        step: usize,
        sample: &[f32],
        noise: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let steps = ("DDIM with eta > 0", self.timesteps.len());
        let noise = check_step(steps, step, (output, sample), noise, self.needs_noise(step))?;
        let t = self.timesteps[step] as i64;
        let prev = t - self.stride as i64;
        let (a, a_prev) = (self.alpha_at(t), self.alpha_at(prev));
        let b = 1.0 - a;
        let (sa, sb, sa_prev) = (a.sqrt(), b.sqrt(), a_prev.sqrt());
        let variance = ((1.0 - a_prev) / b) * (1.0 - a / a_prev);
        let std_dev = self.eta * variance.sqrt();
        let direction = (1.0 - a_prev - std_dev * std_dev).sqrt();
        let noise = noise.map(|n| (n, std_dev));
        Ok(update(output, sample, noise, |m, x| {
            let (x0, eps) = self.denoiser.split(m, x, sa, sb);
            sa_prev * x0 + direction * eps
        }))
    }

    fn add_noise(&self, sample: &[f32], noise: &[f32], step: usize) -> Result<Vec<f32>> {
        add_noise_at_alpha((&self.alphas_cumprod, &self.timesteps), sample, noise, step)
    }
}
