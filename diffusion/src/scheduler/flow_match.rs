//! Flow-matching Euler (rectified flow; Esser et al. 2024, *Scaling Rectified Flow
//! Transformers for High-Resolution Image Synthesis*, arXiv:2403.03206) as diffusers'
//! `FlowMatchEulerDiscreteScheduler`: σ from 1 down to 1/`num_train_timesteps` (the ends of the
//! training schedule, shifted by `shift`), then shifted for the run — by `shift`, or with
//! `use_dynamic_shifting` by the exponential time shift `e^μ / (e^μ + (1/σ − 1))` with a μ
//! that grows with the image (FLUX) — timestep 1000·σ, and `x ← x + (σ_next − σ)·v`.

use super::{Config, Scheduler, check_index, check_lengths, check_step, update};
use crate::{Error, Result};
use serde_json::Value;

/// A flow-matching Euler schedule for one run.
pub struct FlowMatchEuler {
    timesteps: Vec<f32>,
    /// One σ per step and a final 0.
    sigmas: Vec<f32>,
}

/// The μ of dynamic shifting for an image of `tokens` latent tokens: linear from `base_shift`
/// at `base_image_seq_len` tokens to `max_shift` at `max_image_seq_len` (FLUX's pipelines).
pub fn mu(c: &Config<'_>, tokens: usize) -> Result<f64> {
    let (x1, x2) = (
        c.usize("base_image_seq_len", 256)? as f64,
        c.usize("max_image_seq_len", 4096)? as f64,
    );
    let (y1, y2) = (c.f64("base_shift", 0.5)?, c.f64("max_shift", 1.15)?);
    if x2 <= x1 {
        return Err(Error::Config(format!(
            "max_image_seq_len {x2} is not above base_image_seq_len {x1}"
        )));
    }
    let m = (y2 - y1) / (x2 - x1);
    Ok(tokens as f64 * m + (y1 - m * x1))
}

/// What a configuration says of the schedule: training timesteps, the static `shift`, and the
/// μ of dynamic shifting when it is on (`mu`, required then).
fn settings(c: &Config<'_>, mu: Option<f64>) -> Result<(usize, f64, Option<f64>)> {
    c.refuse(&[
        ("invert_sigmas", Value::Bool(false)),
        ("shift_terminal", Value::Null),
        ("use_karras_sigmas", Value::Bool(false)),
        ("use_exponential_sigmas", Value::Bool(false)),
        ("use_beta_sigmas", Value::Bool(false)),
        ("time_shift_type", Value::from("exponential")),
        ("stochastic_sampling", Value::Bool(false)),
    ])?;
    let n = c.usize("num_train_timesteps", 1000)?;
    if n == 0 {
        return Err(Error::Config("0 training timesteps".into()));
    }
    let shift = c.f64("shift", 1.0)?;
    if shift <= 0.0 {
        return Err(Error::Config(format!("shift {shift} is not positive")));
    }
    let dynamic = c.bool("use_dynamic_shifting", false)?;
    let mu = match (dynamic, mu) {
        (true, Some(mu)) if mu.is_finite() => Some(mu),
        (true, _) => {
            return Err(Error::Config(
                "`use_dynamic_shifting` needs a finite μ (from the image's size)".into(),
            ));
        }
        (false, _) => None,
    };
    Ok((n, shift, mu))
}

impl FlowMatchEuler {
    /// The schedule of `c` for `steps` steps; `mu` is required with `use_dynamic_shifting`.
    pub fn new(c: &Config<'_>, steps: usize, mu: Option<f64>) -> Result<FlowMatchEuler> {
        let (n, shift, mu) = settings(c, mu)?;
        let dynamic = mu.is_some();
        // The training schedule's ends (f32, shifted unless shifting is dynamic).
        let shifted = |s: f32| match dynamic {
            true => s,
            false => (shift as f32) * s / (1.0 + (shift as f32 - 1.0) * s),
        };
        let (max, min) = (shifted(1.0), shifted(1.0 / n as f32));
        // np.linspace(1000·max, 1000·min, steps) in f64, over num_train_timesteps.
        let (t0, t1) = (f64::from(max) * n as f64, f64::from(min) * n as f64);
        let step = (t1 - t0) / (steps.max(2) - 1) as f64;
        let mut sigmas: Vec<f32> = (0..steps)
            .map(|i| {
                let t = match i + 1 == steps && steps > 1 {
                    true => t1,
                    false => t0 + i as f64 * step,
                };
                let s = t / n as f64;
                let s = match mu {
                    Some(mu) => mu.exp() / (mu.exp() + (1.0 / s - 1.0)),
                    None => shift * s / (1.0 + (shift - 1.0) * s),
                };
                s as f32
            })
            .collect();
        let timesteps = sigmas.iter().map(|&s| s * n as f32).collect();
        sigmas.push(0.0);
        Ok(FlowMatchEuler { timesteps, sigmas })
    }

    /// The schedule of `c` over the unshifted σs `given`, one a step (FLUX's pipelines give
    /// `linspace(1, 1/steps, steps)`), shifted as `c` says — in `f32`, as diffusers shifts σs
    /// it is given.
    pub fn with_sigmas(c: &Config<'_>, given: &[f64], mu: Option<f64>) -> Result<FlowMatchEuler> {
        let (n, shift, mu) = settings(c, mu)?;
        if given.is_empty() || given.iter().any(|s| !(*s > 0.0 && *s <= 1.0)) {
            return Err(Error::Config(format!(
                "σs {given:?}: one or more, each in (0, 1]"
            )));
        }
        let mut sigmas: Vec<f32> = given
            .iter()
            .map(|&s| {
                let s = s as f32;
                match mu {
                    Some(mu) => {
                        let e = mu.exp() as f32;
                        e / (e + (1.0 / s - 1.0))
                    }
                    None => {
                        let shift = shift as f32;
                        shift * s / (1.0 + (shift - 1.0) * s)
                    }
                }
            })
            .collect();
        let timesteps = sigmas.iter().map(|&s| s * n as f32).collect();
        sigmas.push(0.0);
        Ok(FlowMatchEuler { timesteps, sigmas })
    }

    /// The σ of each step and the final 0.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }
}

impl Scheduler for FlowMatchEuler {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn needs_noise(&self, _step: usize) -> bool {
        false
    }

    fn step(
        &self,
        output: &[f32],
        step: usize,
        sample: &[f32],
        noise: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let steps = ("flow-matching Euler", self.timesteps.len());
        check_step(steps, step, (output, sample), noise, false)?;
        let dt = self.sigmas[step + 1] - self.sigmas[step];
        Ok(update(output, sample, None, |v, x| x + dt * v))
    }

    /// `σ · n + (1 − σ) · x` at the step's σ (diffusers' `scale_noise`).
    fn add_noise(&self, sample: &[f32], noise: &[f32], step: usize) -> Result<Vec<f32>> {
        check_index(step, self.timesteps.len())?;
        check_lengths(sample, noise)?;
        let sigma = self.sigmas[step];
        Ok(sample
            .iter()
            .zip(noise)
            .map(|(x, n)| sigma * n + (1.0 - sigma) * x)
            .collect())
    }
}
