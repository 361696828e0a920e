//! Latent consistency models' multistep sampler (Luo et al. 2023, *Latent Consistency Models*,
//! arXiv:2310.04378) as diffusers' `LCMScheduler`: timesteps picked evenly from the
//! `original_inference_steps` skipping schedule of the distillation, each step the consistency
//! function's boundary-condition mix `c_out·x̂₀ + c_skip·x` of the predicted clean sample, then
//! noised back to the next timestep (fresh noise at every step but the last).

use super::{Betas, Config, Prediction, Scheduler, alphas_cumprod, check_index, check_step};
use crate::{Error, Result};
use serde_json::Value;

/// LCM's β: Stable Diffusion's scaled-linear schedule.
const LCM_BETAS: Betas = Betas {
    start: 0.00085,
    end: 0.012,
    schedule: "scaled_linear",
};

/// An LCM schedule for one run.
pub struct Lcm {
    alphas_cumprod: Vec<f32>,
    timesteps: Vec<f32>,
    prediction: Prediction,
    clip: Option<f32>,
    timestep_scaling: f64,
}

impl Lcm {
    /// LCM from `c` for `steps` steps.
    pub fn new(c: &Config<'_>, steps: usize) -> Result<Lcm> {
        c.refuse(&[("thresholding", Value::Bool(false))])?;
        let alphas_cumprod = alphas_cumprod(c, LCM_BETAS)?;
        let n = alphas_cumprod.len();
        let original = c.usize("original_inference_steps", 50)?;
        if original == 0 || original > n {
            return Err(Error::Config(format!(
                "original_inference_steps {original} is not within 1..={n}"
            )));
        }
        if steps > original {
            return Err(Error::Config(format!(
                "{steps} inference steps is more than original_inference_steps {original}"
            )));
        }
        // The distillation's schedule k−1, 2k−1, …, reversed, sampled at floor(i·len/steps).
        let k = n / original;
        let origin: Vec<usize> = (1..=original).rev().map(|i| i * k - 1).collect();
        let timesteps = (0..steps)
            .map(|i| origin[(i as f64 * original as f64 / steps as f64).floor() as usize] as f32)
            .collect();
        Ok(Lcm {
            alphas_cumprod,
            timesteps,
            prediction: Prediction::read(c)?,
            clip: match c.bool("clip_sample", false)? {
                true => Some(c.f64("clip_sample_range", 1.0)? as f32),
                false => None,
            },
            timestep_scaling: c.f64("timestep_scaling", 10.0)?,
        })
    }
}

impl Scheduler for Lcm {
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
        step + 1 < self.timesteps.len()
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
                    "LCM needs noise at every step but the last (step {step})"
                )));
            }
            (true, n) => n,
            (false, _) => None,
        };
        let t = self.timesteps[step];
        let a = self.alphas_cumprod[t as usize];
        let a_prev = match self.timesteps.get(step + 1) {
            Some(&p) => self.alphas_cumprod[p as usize],
            None => a,
        };
        let (sa, sb) = (a.sqrt(), (1.0 - a).sqrt());
        let (sa_prev, sb_prev) = (a_prev.sqrt(), (1.0 - a_prev).sqrt());
        // The boundary condition of the consistency function (σ_data = 0.5), in f64 as
        // diffusers computes it from the integer timestep.
        let scaled = f64::from(t) * self.timestep_scaling;
        let c_skip = (0.25 / (scaled * scaled + 0.25)) as f32;
        let c_out = (scaled / (scaled * scaled + 0.25).sqrt()) as f32;
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
                let denoised = c_out * x0 + c_skip * x;
                match noise {
                    Some(n) => sa_prev * denoised + sb_prev * n[i],
                    None => denoised,
                }
            })
            .collect())
    }
}
