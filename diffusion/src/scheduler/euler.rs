//! Euler and ancestral Euler over the σ of a discrete-time model (Karras et al. 2022,
//! *Elucidating the Design Space of Diffusion-Based Generative Models*, arXiv:2206.00364), as
//! diffusers' `EulerDiscreteScheduler` and `EulerAncestralDiscreteScheduler`: σ_t =
//! √((1 − ᾱ_t)/ᾱ_t) interpolated at the spaced timesteps (or Karras' ρ = 7 ramp between the
//! ends, with timesteps found back from σ), the input scaled by 1/√(σ² + 1), one Euler step of
//! `dx/dσ = (x − x₀)/σ` per timestep; the ancestral one steps to σ_down and adds σ_up of noise.

use super::{
    Config, DDPM_BETAS, Prediction, Scheduler, alphas_cumprod, check_index, check_lengths,
    check_step, update,
};
use crate::{Error, Result};
use serde_json::Value;

/// An Euler schedule for one run.
pub struct Euler {
    timesteps: Vec<f32>,
    /// One σ per step and a final 0.
    sigmas: Vec<f32>,
    init_noise_sigma: f32,
    prediction: Prediction,
    ancestral: bool,
}

impl Euler {
    /// Euler (or, with `ancestral`, ancestral Euler) from `c` for `steps` steps.
    pub fn new(c: &Config<'_>, steps: usize, ancestral: bool) -> Result<Euler> {
        c.refuse(&[
            ("interpolation_type", Value::from("linear")),
            ("use_exponential_sigmas", Value::Bool(false)),
            ("use_beta_sigmas", Value::Bool(false)),
            ("timestep_type", Value::from("discrete")),
            ("final_sigmas_type", Value::from("zero")),
            ("sigma_min", Value::Null),
            ("sigma_max", Value::Null),
        ])?;
        let prediction = Prediction::read(c)?;
        if ancestral && prediction == Prediction::Sample {
            return Err(Error::Config(
                "ancestral Euler does not take prediction_type `sample` (neither does diffusers)"
                    .into(),
            ));
        }
        let alphas = alphas_cumprod(c, DDPM_BETAS)?;
        // σ over the training timesteps, computed in f32 as the tensor is.
        let table: Vec<f32> = alphas.iter().map(|&a| ((1.0 - a) / a).sqrt()).collect();
        let spaced = super::spaced_timesteps(c, steps, "linspace")?;
        // The timesteps as f32, as NumPy holds them, then σ interpolated linearly (in f64).
        let mut timesteps: Vec<f64> = spaced.iter().map(|&t| t as f32 as f64).collect();
        let mut sigmas: Vec<f64> = timesteps.iter().map(|&t| interp(t, &table)).collect();
        let karras = c.bool("use_karras_sigmas", false)?;
        if karras && ancestral {
            return Err(Error::Config(
                "`use_karras_sigmas` is not an option of ancestral Euler".into(),
            ));
        }
        if karras {
            let log_table: Vec<f32> = table.iter().map(|&s| s.ln()).collect();
            sigmas = karras_sigmas(sigmas[sigmas.len() - 1], sigmas[0], steps);
            timesteps = sigmas.iter().map(|&s| sigma_to_t(s, &log_table)).collect();
        }
        let mut sigmas: Vec<f32> = sigmas.into_iter().map(|s| s as f32).collect();
        sigmas.push(0.0);
        let max = sigmas.iter().copied().fold(0f32, f32::max);
        let init_noise_sigma = match c.str("timestep_spacing", "linspace")? {
            "linspace" | "trailing" => max,
            _ => (max * max + 1.0).sqrt(),
        };
        Ok(Euler {
            timesteps: timesteps.into_iter().map(|t| t as f32).collect(),
            sigmas,
            init_noise_sigma,
            prediction,
            ancestral,
        })
    }

    /// The σ of each step and the final 0.
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }
}

/// `np.interp(t, arange(len), table)`.
fn interp(t: f64, table: &[f32]) -> f64 {
    let last = table.len() - 1;
    if t <= 0.0 {
        return f64::from(table[0]);
    }
    if t >= last as f64 {
        return f64::from(table[last]);
    }
    let i = t.floor() as usize;
    let w = t - i as f64;
    let (a, b) = (f64::from(table[i]), f64::from(table[i + 1]));
    a + (b - a) * w
}

/// Karras' ramp of `steps` σ from `max` to `min` (ρ = 7).
fn karras_sigmas(min: f64, max: f64, steps: usize) -> Vec<f64> {
    let rho = 7.0;
    let (min_inv, max_inv) = (min.powf(1.0 / rho), max.powf(1.0 / rho));
    (0..steps)
        .map(|i| {
            let ramp = match steps {
                1 => 0.0,
                _ => i as f64 / (steps - 1) as f64,
            };
            (max_inv + ramp * (min_inv - max_inv)).powf(rho)
        })
        .collect()
}

/// The fractional training timestep of `sigma`: where log σ falls in the table of log σ (f32,
/// as NumPy holds it), as diffusers' `_sigma_to_t` finds it.
fn sigma_to_t(sigma: f64, log_table: &[f32]) -> f64 {
    let log_sigma = sigma.max(1e-10).ln();
    // The last index whose log σ is at most this one's (cumsum-argmax: 0 when none is), kept
    // below the end.
    let low = log_table
        .iter()
        .rposition(|&l| log_sigma - f64::from(l) >= 0.0)
        .unwrap_or(0)
        .min(log_table.len() - 2);
    let (lo, hi) = (log_table[low], log_table[low + 1]);
    let w = ((f64::from(lo) - log_sigma) / f64::from(lo - hi)).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * (low + 1) as f64
}

impl Scheduler for Euler {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f32 {
        self.init_noise_sigma
    }

    fn scale_model_input(&self, sample: &mut [f32], step: usize) -> Result<()> {
        super::check_index(step, self.timesteps.len())?;
        let sigma = self.sigmas[step];
        let scale = (sigma * sigma + 1.0).sqrt();
        sample.iter_mut().for_each(|x| *x /= scale);
        Ok(())
    }

    fn needs_noise(&self, _step: usize) -> bool {
        self.ancestral
    }

    fn step(
        &self,
        output: &[f32],
        step: usize,
        sample: &[f32],
        noise: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let steps = ("ancestral Euler", self.timesteps.len());
        let noise = check_step(steps, step, (output, sample), noise, self.needs_noise(step))?;
        let (sigma, next) = (self.sigmas[step], self.sigmas[step + 1]);
        let x0 = |m: f32, x: f32| match self.prediction {
            Prediction::Epsilon => x - sigma * m,
            Prediction::Velocity => {
                m * (-sigma / (sigma * sigma + 1.0).sqrt()) + x / (sigma * sigma + 1.0)
            }
            Prediction::Sample => m,
        };
        // Ancestral: step to σ_down, then add σ_up of fresh noise.
        let (to, up) = match self.ancestral {
            true => {
                let up = (next * next * (sigma * sigma - next * next) / (sigma * sigma)).sqrt();
                ((next * next - up * up).sqrt(), up)
            }
            false => (next, 0.0),
        };
        let dt = to - sigma;
        Ok(update(output, sample, noise.map(|n| (n, up)), |m, x| {
            x + (x - x0(m, x)) / sigma * dt
        }))
    }

    /// `x + n · σ` at the step's σ (diffusers' `add_noise` from the begin index).
    fn add_noise(&self, sample: &[f32], noise: &[f32], step: usize) -> Result<Vec<f32>> {
        check_index(step, self.timesteps.len())?;
        check_lengths(sample, noise)?;
        let sigma = self.sigmas[step];
        Ok(sample
            .iter()
            .zip(noise)
            .map(|(x, n)| x + n * sigma)
            .collect())
    }
}
