//! DDIM (Song et al. 2020, *Denoising Diffusion Implicit Models*, arXiv:2010.02502) as
//! diffusers' `DDIMScheduler`: integer timesteps, the predicted clean sample (clipped to
//! `clip_sample_range` with `clip_sample`) and noise recombined at the previous timestep's ᾱ;
//! with `eta` > 0 a share of fresh noise (η = 1 is DDPM's posterior variance).

use super::{Config, DDPM_BETAS, Prediction, Scheduler, alphas_cumprod, check_index, check_step};
use crate::{Error, Result};
use serde_json::Value;

/// A DDIM schedule for one run.
pub struct Ddim {
    alphas_cumprod: Vec<f32>,
    /// ᾱ before the first training step (`set_alpha_to_one`: 1, else ᾱ₀).
    final_alpha: f32,
    timesteps: Vec<f32>,
    stride: usize,
    prediction: Prediction,
    clip: Option<f32>,
    eta: f32,
}

impl Ddim {
    /// DDIM from `c` for `steps` steps.
    pub fn new(c: &Config<'_>, steps: usize) -> Result<Ddim> {
        c.refuse(&[("thresholding", Value::Bool(false))])?;
        let alphas_cumprod = alphas_cumprod(c, DDPM_BETAS)?;
        let n = alphas_cumprod.len();
        let spaced = super::spaced_timesteps(c, steps, "leading")?;
        let linspace = c.str("timestep_spacing", "leading")? == "linspace";
        let timesteps: Vec<f32> = spaced
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
        Ok(Ddim {
            final_alpha: match c.bool("set_alpha_to_one", true)? {
                true => 1.0,
                false => alphas_cumprod[0],
            },
            alphas_cumprod,
            timesteps,
            stride: n / steps,
            prediction: Prediction::read(c)?,
            clip: match c.bool("clip_sample", true)? {
                true => Some(c.f64("clip_sample_range", 1.0)? as f32),
                false => None,
            },
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

    fn init_noise_sigma(&self) -> f32 {
        1.0
    }

    fn scale_model_input(&self, _sample: &mut [f32], step: usize) -> Result<()> {
        check_index(step, self.timesteps.len())
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
        check_index(step, self.timesteps.len())?;
        check_step(output, sample, noise)?;
        let noise = match (self.eta > 0.0, noise) {
            (true, None) => {
                return Err(Error::Invalid(format!(
                    "DDIM with eta {} needs noise at every step",
                    self.eta
                )));
            }
            (true, n) => n,
            (false, _) => None,
        };
        let t = self.timesteps[step] as i64;
        let prev = t - self.stride as i64;
        let (a, a_prev) = (self.alpha_at(t), self.alpha_at(prev));
        let b = 1.0 - a;
        let (sa, sb, sa_prev) = (a.sqrt(), b.sqrt(), a_prev.sqrt());
        let variance = ((1.0 - a_prev) / b) * (1.0 - a / a_prev);
        let std_dev = self.eta * variance.sqrt();
        let direction = (1.0 - a_prev - std_dev * std_dev).sqrt();
        Ok(output
            .iter()
            .zip(sample)
            .enumerate()
            .map(|(i, (&m, &x))| {
                let (mut x0, eps) = match self.prediction {
                    Prediction::Epsilon => ((x - sb * m) / sa, m),
                    Prediction::Sample => (m, (x - sa * m) / sb),
                    Prediction::Velocity => (sa * x - sb * m, sa * m + sb * x),
                };
                if let Some(r) = self.clip {
                    x0 = x0.clamp(-r, r);
                }
                let prev = sa_prev * x0 + direction * eps;
                match noise {
                    Some(n) => prev + std_dev * n[i],
                    None => prev,
                }
            })
            .collect())
    }
}
