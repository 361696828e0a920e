//! Noise schedulers: the [`Scheduler`] a sampling loop drives, and [`from_config`], which makes
//! the one a diffusers `scheduler_config.json` names (`_class_name`) for an `n`-step run.
//!
//! A loop runs, for each step `i` of [`Scheduler::timesteps`]: `x = scale_model_input(sample,
//! i)`, the model at `timesteps()[i]` on `x`, then `sample = step(output, i, sample, noise)`,
//! starting from noise times [`Scheduler::init_noise_sigma`]. Arithmetic on samples is f32, as
//! diffusers' is; schedules are computed as diffusers computes them (its f32 tensors and f64
//! NumPy arrays), so timesteps and sigmas come out the same.

pub mod ddim;
pub mod ddpm;
pub mod euler;
pub mod flow_match;
pub mod lcm;

use crate::{Error, Result};
use serde_json::{Map, Value};

/// A sampler's schedule and update rule.
pub trait Scheduler: Send {
    /// The model's timestep at each step, first to last.
    fn timesteps(&self) -> &[f32];

    /// What unit-variance noise is multiplied by to start a sample (1 for most).
    fn init_noise_sigma(&self) -> f32 {
        1.0
    }

    /// Scales `sample` in place into the model's input at step `step` (identity for most).
    fn scale_model_input(&self, _sample: &mut [f32], step: usize) -> Result<()> {
        check_index(step, self.timesteps().len())
    }

    /// Whether [`Scheduler::step`] at `step` adds noise (and so needs some).
    fn needs_noise(&self, step: usize) -> bool;

    /// The sample after step `step`, from the model's `output` on `sample`; `noise` is
    /// unit-variance noise of the sample's length where [`Scheduler::needs_noise`] says so.
    fn step(
        &self,
        output: &[f32],
        step: usize,
        sample: &[f32],
        noise: Option<&[f32]>,
    ) -> Result<Vec<f32>>;

    /// A clean `sample` noised with unit-variance `noise` to the level of step `step` (where a
    /// run that starts from an image begins: diffusers' `add_noise`, or `scale_noise` of a
    /// flow-matching scheduler).
    fn add_noise(&self, sample: &[f32], noise: &[f32], step: usize) -> Result<Vec<f32>>;
}

/// `√ᾱ · x + √(1 − ᾱ) · n` at the training timestep of step `step` (diffusers' `add_noise` of
/// the ᾱ-parameterised schedulers: DDPM, DDIM, LCM).
fn add_noise_at_alpha(
    (alphas_cumprod, timesteps): (&[f32], &[f32]),
    sample: &[f32],
    noise: &[f32],
    step: usize,
) -> Result<Vec<f32>> {
    check_index(step, timesteps.len())?;
    check_lengths(sample, noise)?;
    let alpha = alphas_cumprod
        .get(timesteps[step] as usize)
        .copied()
        .ok_or_else(|| Error::Invalid(format!("timestep {} has no ᾱ", timesteps[step])))?;
    let (a, b) = (alpha.powf(0.5), (1.0 - alpha).powf(0.5));
    Ok(sample
        .iter()
        .zip(noise)
        .map(|(x, n)| a * x + b * n)
        .collect())
}

fn check_lengths(sample: &[f32], noise: &[f32]) -> Result<()> {
    match sample.len() == noise.len() {
        true => Ok(()),
        false => Err(Error::Invalid(format!(
            "noise of {} values for a sample of {}",
            noise.len(),
            sample.len()
        ))),
    }
}

/// The scheduler `config` (a diffusers `scheduler_config.json`) names, set for `steps` steps.
/// `mu` is the time shift of a flow-matching scheduler with `use_dynamic_shifting` (what a
/// pipeline computes from the image's size, [`flow_match::mu`]). Options it does not implement
/// are refused by name, never ignored.
pub fn from_config(config: &str, steps: usize, mu: Option<f64>) -> Result<Box<dyn Scheduler>> {
    from_config_with(config, Schedule::Steps(steps), mu)
}

/// The μ a flow-matching scheduler with `use_dynamic_shifting` needs for an image of `tokens`
/// latent tokens (after patching), from its `config`; `None` for every other scheduler.
pub fn dynamic_mu(config: &str, tokens: usize) -> Result<Option<f64>> {
    let value: Value =
        serde_json::from_str(config).map_err(|e| Error::Config(format!("not JSON: {e}")))?;
    let map = value
        .as_object()
        .ok_or_else(|| Error::Config("not a JSON object".into()))?;
    let c = Config(map);
    match c.str("_class_name", "")? == "FlowMatchEulerDiscreteScheduler"
        && c.bool("use_dynamic_shifting", false)?
    {
        true => flow_match::mu(&c, tokens).map(Some),
        false => Ok(None),
    }
}

/// What a run's schedule is given as.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// A number of steps, the scheduler spacing them.
    Steps(usize),
    /// The unshifted σ of each step (a flow-matching scheduler only; FLUX's pipelines give
    /// `linspace(1, 1/steps, steps)`).
    Sigmas(Vec<f64>),
}

/// The scheduler `config` describes for the run `schedule` (see [`from_config`]).
pub fn from_config_with(
    config: &str,
    schedule: Schedule,
    mu: Option<f64>,
) -> Result<Box<dyn Scheduler>> {
    let steps = match &schedule {
        Schedule::Steps(n) => *n,
        Schedule::Sigmas(s) => s.len(),
    };
    let value: Value =
        serde_json::from_str(config).map_err(|e| Error::Config(format!("not JSON: {e}")))?;
    let map = value
        .as_object()
        .ok_or_else(|| Error::Config("not a JSON object".into()))?;
    let c = Config(map);
    if steps == 0 {
        return Err(Error::Config("0 inference steps".into()));
    }
    match c.str("_class_name", "")? {
        other
            if other != "FlowMatchEulerDiscreteScheduler"
                && matches!(schedule, Schedule::Sigmas(_)) =>
        {
            Err(Error::Config(format!(
                "{other} takes a number of steps, not σs"
            )))
        }
        "DDPMScheduler" => Ok(Box::new(ddpm::Ddpm::new(&c, steps)?)),
        "DDIMScheduler" => Ok(Box::new(ddim::Ddim::new(&c, steps)?)),
        "EulerDiscreteScheduler" => Ok(Box::new(euler::Euler::new(&c, steps, false)?)),
        "EulerAncestralDiscreteScheduler" => Ok(Box::new(euler::Euler::new(&c, steps, true)?)),
        "LCMScheduler" => Ok(Box::new(lcm::Lcm::new(&c, steps)?)),
        "FlowMatchEulerDiscreteScheduler" => match &schedule {
            Schedule::Steps(_) => Ok(Box::new(flow_match::FlowMatchEuler::new(&c, steps, mu)?)),
            Schedule::Sigmas(s) => Ok(Box::new(flow_match::FlowMatchEuler::with_sigmas(
                &c, s, mu,
            )?)),
        },
        "" => Err(Error::Config("no `_class_name`".into())),
        other => Err(Error::Config(format!(
            "`{other}` is not implemented (DDPMScheduler, DDIMScheduler, EulerDiscreteScheduler, \
             EulerAncestralDiscreteScheduler, LCMScheduler, FlowMatchEulerDiscreteScheduler)"
        ))),
    }
}

/// A scheduler configuration read by diffusers' names, each with diffusers' default.
pub struct Config<'a>(pub &'a Map<String, Value>);

impl Config<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// A number, or `default`.
    pub fn f64(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| Error::Config(format!("`{key}` is not a number: {v}"))),
        }
    }

    /// A whole number, or `default`.
    pub fn usize(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| Error::Config(format!("`{key}` is not a whole number: {v}"))),
        }
    }

    /// A flag, or `default`.
    pub fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::Config(format!("`{key}` is not true or false: {v}"))),
        }
    }

    /// A string, or `default`.
    pub fn str<'s>(&'s self, key: &str, default: &'s str) -> Result<&'s str> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| Error::Config(format!("`{key}` is not a string: {v}"))),
        }
    }

    /// Refuses each of `keys` set away from its default (`false`, or the given value).
    pub fn refuse(&self, keys: &[(&str, Value)]) -> Result<()> {
        for (key, default) in keys {
            if let Some(v) = self.get(key)
                && v != default
            {
                return Err(Error::Config(format!(
                    "`{key}` = {v} is not implemented (only {default})"
                )));
            }
        }
        Ok(())
    }
}

/// What the model predicts (`prediction_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prediction {
    /// The noise (`epsilon`).
    Epsilon,
    /// The velocity `α·ε − σ·x₀` (`v_prediction`).
    Velocity,
    /// The clean sample (`sample`).
    Sample,
}

impl Prediction {
    /// `prediction_type`.
    pub fn read(c: &Config<'_>) -> Result<Prediction> {
        match c.str("prediction_type", "epsilon")? {
            "epsilon" => Ok(Prediction::Epsilon),
            "v_prediction" => Ok(Prediction::Velocity),
            "sample" | "original_sample" => Ok(Prediction::Sample),
            other => Err(Error::Config(format!(
                "prediction_type `{other}` is not one of epsilon, v_prediction, sample"
            ))),
        }
    }
}

/// How the ᾱ-parametrised schedulers (DDPM, DDIM, LCM) read the model: its prediction, and the
/// clipping of the clean sample it implies (`clip_sample`, `clip_sample_range`).
#[derive(Clone, Copy, Debug)]
pub struct Denoiser {
    prediction: Prediction,
    clip: Option<f32>,
}

impl Denoiser {
    /// From `c`, clipping by default where `clip_default` (the class's default).
    pub fn read(c: &Config<'_>, clip_default: bool) -> Result<Denoiser> {
        Ok(Denoiser {
            prediction: Prediction::read(c)?,
            clip: match c.bool("clip_sample", clip_default)? {
                true => Some(c.f64("clip_sample_range", 1.0)? as f32),
                false => None,
            },
        })
    }

    /// The clean sample (clipped) and the noise that the model's `output` on `x` stands for,
    /// where `sa = √ᾱ_t` and `sb = √(1 − ᾱ_t)`.
    #[inline]
    pub fn split(&self, output: f32, x: f32, sa: f32, sb: f32) -> (f32, f32) {
        let (x0, eps) = match self.prediction {
            Prediction::Epsilon => ((x - sb * output) / sa, output),
            Prediction::Sample => (output, (x - sa * output) / sb),
            Prediction::Velocity => (sa * x - sb * output, sa * output + sb * x),
        };
        match self.clip {
            Some(r) => (x0.clamp(-r, r), eps),
            None => (x0, eps),
        }
    }
}

/// The β schedule a scheduler class assumes when its config leaves it out.
#[derive(Clone, Copy, Debug)]
pub struct Betas {
    /// `beta_start`.
    pub start: f64,
    /// `beta_end`.
    pub end: f64,
    /// `beta_schedule`.
    pub schedule: &'static str,
}

/// DDPM's linear β from 1e-4 to 0.02, the default of most classes.
pub const DDPM_BETAS: Betas = Betas {
    start: 0.0001,
    end: 0.02,
    schedule: "linear",
};

/// ᾱ_t for every training timestep (`alphas_cumprod`), from `beta_schedule` (`linear`,
/// `scaled_linear`, `squaredcos_cap_v2`), `beta_start`, `beta_end` and `num_train_timesteps`
/// (`defaults` where the config is silent), in f32 as diffusers' tensors hold them.
pub fn alphas_cumprod(c: &Config<'_>, defaults: Betas) -> Result<Vec<f32>> {
    let n = c.usize("num_train_timesteps", 1000)?;
    if !(2..=100_000).contains(&n) {
        return Err(Error::Config(format!("{n} training timesteps")));
    }
    c.refuse(&[
        ("trained_betas", Value::Null),
        ("rescale_betas_zero_snr", Value::Bool(false)),
    ])?;
    let (start, end) = (
        c.f64("beta_start", defaults.start)?,
        c.f64("beta_end", defaults.end)?,
    );
    let betas: Vec<f32> = match c.str("beta_schedule", defaults.schedule)? {
        "linear" => linspace_f32(start as f32, end as f32, n),
        "scaled_linear" => linspace_f32(start.sqrt() as f32, end.sqrt() as f32, n)
            .into_iter()
            .map(|b| b * b)
            .collect(),
        "squaredcos_cap_v2" => {
            let bar = |t: f64| {
                ((t + 0.008) / 1.008 * std::f64::consts::FRAC_PI_2)
                    .cos()
                    .powi(2)
            };
            (0..n)
                .map(|i| {
                    let (t1, t2) = (i as f64 / n as f64, (i + 1) as f64 / n as f64);
                    (1.0 - bar(t2) / bar(t1)).min(0.999) as f32
                })
                .collect()
        }
        other => {
            return Err(Error::Config(format!(
                "beta_schedule `{other}` is not one of linear, scaled_linear, squaredcos_cap_v2"
            )));
        }
    };
    let mut prod = 1f32;
    Ok(betas
        .into_iter()
        .map(|b| {
            prod *= 1.0 - b;
            prod
        })
        .collect())
}

/// `torch.linspace(start, end, n)` in f32: the first half stepped from `start`, the second from
/// `end`, as PyTorch computes it.
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| match i < half {
            true => start + step * i as f32,
            false => end - step * (n - 1 - i) as f32,
        })
        .collect()
}

/// The training timesteps an `steps`-step run visits, first to last, by `timestep_spacing`
/// (`linspace`, `leading` with `steps_offset`, `trailing`), as f64 before each scheduler rounds
/// or casts them its own way.
pub fn spaced_timesteps(c: &Config<'_>, steps: usize, default: &str) -> Result<Vec<f64>> {
    let n = c.usize("num_train_timesteps", 1000)?;
    if steps > n {
        return Err(Error::Config(format!(
            "{steps} inference steps is more than the {n} training timesteps"
        )));
    }
    let offset = c.usize("steps_offset", 0)? as f64;
    Ok(match c.str("timestep_spacing", default)? {
        "linspace" => {
            // np.linspace(0, n − 1, steps): i·step, the last exactly n − 1; reversed.
            let last = (n - 1) as f64;
            let step = last / (steps.max(2) - 1) as f64;
            (0..steps)
                .rev()
                .map(|i| match i + 1 == steps && steps > 1 {
                    true => last,
                    false => i as f64 * step,
                })
                .collect()
        }
        "leading" => {
            let ratio = (n / steps) as f64;
            (0..steps)
                .rev()
                .map(|i| (i as f64 * ratio).round() + offset)
                .collect()
        }
        "trailing" => {
            let ratio = n as f64 / steps as f64;
            // np.arange(n, 0, -ratio): n, n − ratio, … while above 0.
            let mut out = Vec::with_capacity(steps);
            let mut k = 0;
            loop {
                let t = n as f64 - k as f64 * ratio;
                if t <= 0.0 {
                    break;
                }
                out.push(t.round() - 1.0);
                k += 1;
            }
            out
        }
        other => {
            return Err(Error::Config(format!(
                "timestep_spacing `{other}` is not one of linspace, leading, trailing"
            )));
        }
    })
}

/// The integer training timesteps of an `steps`-step run over `n` training timesteps (DDPM's and
/// DDIM's: `linspace` spacing rounded), each checked to be one of them.
fn integer_timesteps(c: &Config<'_>, steps: usize, n: usize) -> Result<Vec<f32>> {
    let linspace = c.str("timestep_spacing", "leading")? == "linspace";
    let timesteps: Vec<f32> = spaced_timesteps(c, steps, "leading")?
        .into_iter()
        .map(|t| match linspace {
            true => t.round() as f32,
            false => t as f32,
        })
        .collect();
    match timesteps.iter().find(|&&t| t < 0.0 || t as usize >= n) {
        Some(t) => Err(Error::Config(format!(
            "timestep {t} is outside the {n} training timesteps (steps_offset?)"
        ))),
        None => Ok(timesteps),
    }
}

/// Checks one step of `scheduler` (a schedule of `steps` steps): the index, and `output`,
/// `sample` and, when given, `noise` of one length; returns the noise the step adds — `None`
/// unless `needs_noise`, which without noise is an error.
fn check_step<'n>(
    (scheduler, steps): (&str, usize),
    step: usize,
    (output, sample): (&[f32], &[f32]),
    noise: Option<&'n [f32]>,
    needs_noise: bool,
) -> Result<Option<&'n [f32]>> {
    check_index(step, steps)?;
    if output.len() != sample.len() || noise.is_some_and(|n| n.len() != sample.len()) {
        return Err(Error::Invalid(format!(
            "the model output has {} values, the sample {}, the noise {}",
            output.len(),
            sample.len(),
            noise.map_or("none".into(), |n| n.len().to_string())
        )));
    }
    match (needs_noise, noise) {
        (true, None) => Err(Error::Invalid(format!(
            "{scheduler} needs noise at step {step}"
        ))),
        (true, n) => Ok(n),
        (false, _) => Ok(None),
    }
}

/// One update of every element: `f(output, sample)`, plus `scale·noise` where a step adds noise.
fn update(
    output: &[f32],
    sample: &[f32],
    noise: Option<(&[f32], f32)>,
    f: impl Fn(f32, f32) -> f32,
) -> Vec<f32> {
    let moved = output.iter().zip(sample).map(|(&m, &x)| f(m, x));
    match noise {
        Some((n, scale)) => moved.zip(n).map(|(v, &n)| v + scale * n).collect(),
        None => moved.collect(),
    }
}

/// The step index checked against a schedule of `len` steps.
fn check_index(step: usize, len: usize) -> Result<()> {
    match step < len {
        true => Ok(()),
        false => Err(Error::Invalid(format!(
            "step {step} of a {len}-step schedule"
        ))),
    }
}
