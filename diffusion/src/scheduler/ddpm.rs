//! DDPM (Ho et al. 2020, *Denoising Diffusion Probabilistic Models*, arXiv:2006.11239) as
//! diffusers' `DDPMScheduler` over a spaced schedule: the posterior mean of the previous
//! scheduled timestep from the predicted clean sample (clipped with `clip_sample`), plus the
//! posterior's noise (`variance_type` `fixed_small`, `fixed_small_log` or `fixed_large`) at
//! every step but the one at timestep 0.

use super::{
    Config, DDPM_BETAS, Denoiser, Scheduler, add_noise_at_alpha, alphas_cumprod, check_step,
    integer_timesteps, update,
};
use crate::{Error, Result};
use serde_json::Value;

/// How the added noise is scaled (`variance_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variance {
    /// √ of the posterior variance β̃_t.
    Small,
    /// exp(½·log β̃_t), the same in log space.
    SmallLog,
    /// √β_t of the step.
    Large,
}

/// A DDPM schedule for one run.
pub struct Ddpm {
    alphas_cumprod: Vec<f32>,
    timesteps: Vec<f32>,
    denoiser: Denoiser,
    variance: Variance,
}

impl Ddpm {
    /// DDPM from `c` for `steps` steps.
    pub fn new(c: &Config<'_>, steps: usize) -> Result<Ddpm> {
        c.refuse(&[("thresholding", Value::Bool(false))])?;
        let alphas_cumprod = alphas_cumprod(c, DDPM_BETAS)?;
        let timesteps = integer_timesteps(c, steps, alphas_cumprod.len())?;
        let variance = match c.str("variance_type", "fixed_small")? {
            "fixed_small" => Variance::Small,
            "fixed_small_log" => Variance::SmallLog,
            "fixed_large" => Variance::Large,
            other => {
                return Err(Error::Config(format!(
                    "variance_type `{other}` is not implemented (fixed_small, fixed_small_log, \
                     fixed_large)"
                )));
            }
        };
        Ok(Ddpm {
            alphas_cumprod,
            timesteps,
            denoiser: Denoiser::read(c, true)?,
            variance,
        })
    }

    /// ᾱ at the step after `step` (1 after the last).
    fn alpha_after(&self, step: usize) -> f32 {
        match self.timesteps.get(step + 1) {
            Some(&t) => self.alphas_cumprod[t as usize],
            None => 1.0,
        }
    }
}

impl Scheduler for Ddpm {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn needs_noise(&self, step: usize) -> bool {
        self.timesteps.get(step).is_some_and(|&t| t > 0.0)
    }

    fn step(
        &self,
        output: &[f32],
        step: usize,
        sample: &[f32],
        noise: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let steps = ("DDPM", self.timesteps.len());
        let noise = check_step(steps, step, (output, sample), noise, self.needs_noise(step))?;
        let a = self.alphas_cumprod[self.timesteps[step] as usize];
        let a_prev = self.alpha_after(step);
        let (b, b_prev) = (1.0 - a, 1.0 - a_prev);
        let alpha_t = a / a_prev;
        let beta_t = 1.0 - alpha_t;
        let x0_coeff = (a_prev.sqrt() * beta_t) / b;
        let x_coeff = alpha_t.sqrt() * b_prev / b;
        let posterior = ((1.0 - a_prev) / (1.0 - a) * beta_t).max(1e-20);
        let sigma = match self.variance {
            Variance::Small => posterior.sqrt(),
            Variance::SmallLog => (0.5 * posterior.ln()).exp(),
            Variance::Large => beta_t.sqrt(),
        };
        let (sa, sb) = (a.sqrt(), b.sqrt());
        Ok(update(output, sample, noise.map(|n| (n, sigma)), |m, x| {
            let (x0, _) = self.denoiser.split(m, x, sa, sb);
            x0_coeff * x0 + x_coeff * x
        }))
    }

    fn add_noise(&self, sample: &[f32], noise: &[f32], step: usize) -> Result<Vec<f32>> {
        add_noise_at_alpha((&self.alphas_cumprod, &self.timesteps), sample, noise, step)
    }
}
