//! DDPM (Ho et al. 2020, *Denoising Diffusion Probabilistic Models*, arXiv:2006.11239) as
//! diffusers' `DDPMScheduler` over a spaced schedule: the posterior mean of the previous
//! scheduled timestep from the predicted clean sample (clipped with `clip_sample`), plus the
//! posterior's noise (`variance_type` `fixed_small`, `fixed_small_log` or `fixed_large`) at
//! every step but the one at timestep 0.

use super::{Config, DDPM_BETAS, Prediction, Scheduler, alphas_cumprod, check_index, check_step};
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
    prediction: Prediction,
    clip: Option<f32>,
    variance: Variance,
}

impl Ddpm {
    /// DDPM from `c` for `steps` steps.
    pub fn new(c: &Config<'_>, steps: usize) -> Result<Ddpm> {
        c.refuse(&[("thresholding", Value::Bool(false))])?;
        let alphas_cumprod = alphas_cumprod(c, DDPM_BETAS)?;
        let n = alphas_cumprod.len();
        let linspace = c.str("timestep_spacing", "leading")? == "linspace";
        let timesteps: Vec<f32> = super::spaced_timesteps(c, steps, "leading")?
            .into_iter()
            .map(|t| match linspace {
                true => t.round() as f32,
                false => t as f32,
            })
            .collect();
        if let Some(t) = timesteps.iter().find(|&&t| t < 0.0 || t as usize >= n) {
            return Err(Error::Config(format!(
                "timestep {t} is outside the {n} training timesteps (steps_offset?)"
            )));
        }
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
            prediction: Prediction::read(c)?,
            clip: match c.bool("clip_sample", true)? {
                true => Some(c.f64("clip_sample_range", 1.0)? as f32),
                false => None,
            },
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

    fn init_noise_sigma(&self) -> f32 {
        1.0
    }

    fn scale_model_input(&self, _sample: &mut [f32], step: usize) -> Result<()> {
        check_index(step, self.timesteps.len())
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
        check_index(step, self.timesteps.len())?;
        check_step(output, sample, noise)?;
        let noise = match (self.needs_noise(step), noise) {
            (true, None) => {
                return Err(Error::Invalid(format!(
                    "DDPM needs noise at step {step} (timestep {})",
                    self.timesteps[step]
                )));
            }
            (true, n) => n,
            (false, _) => None,
        };
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
        Ok(output
            .iter()
            .zip(sample)
            .enumerate()
            .map(|(i, (&m, &x))| {
                let mut x0 = match self.prediction {
                    Prediction::Epsilon => (x - sb * m) / sa,
                    Prediction::Sample => m,
                    Prediction::Velocity => sa * x - sb * m,
                };
                if let Some(r) = self.clip {
                    x0 = x0.clamp(-r, r);
                }
                let mean = x0_coeff * x0 + x_coeff * x;
                match noise {
                    Some(n) => mean + sigma * n[i],
                    None => mean,
                }
            })
            .collect())
    }
}
