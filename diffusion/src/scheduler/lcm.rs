//! Latent consistency models' multistep sampler (Luo et al. 2023, *Latent Consistency Models*,
//! arXiv:2310.04378) as diffusers' `LCMScheduler`: timesteps picked evenly from the
//! `original_inference_steps` skipping schedule of the distillation, each step the consistency
//! function's boundary-condition mix `c_out·x̂₀ + c_skip·x` of the predicted clean sample, then
//! noised back to the next timestep (fresh noise at every step but the last).

use super::{
    Betas, Config, Denoiser, Scheduler, add_noise_at_alpha, alphas_cumprod, check_step, update,
};
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
    denoiser: Denoiser,
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
            denoiser: Denoiser::read(c, false)?,
            timestep_scaling: c.f64("timestep_scaling", 10.0)?,
        })
    }
}

impl Scheduler for Lcm {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
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
        let steps = ("LCM", self.timesteps.len());
        let noise = check_step(steps, step, (output, sample), noise, self.needs_noise(step))?;
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
        // With noise, the denoised sample is noised back to the next timestep.
        let keep = if noise.is_some() { sa_prev } else { 1.0 };
        Ok(update(
            output,
            sample,
            noise.map(|n| (n, sb_prev)),
            |m, x| {
                let (x0, _) = self.denoiser.split(m, x, sa, sb);
                keep * (c_out * x0 + c_skip * x)
            },
        ))
    }

    fn add_noise(&self, sample: &[f32], noise: &[f32], step: usize) -> Result<Vec<f32>> {
        add_noise_at_alpha((&self.alphas_cumprod, &self.timesteps), sample, noise, step)
    }
}
