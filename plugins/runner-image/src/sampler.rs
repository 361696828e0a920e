//! One image request from start to finish, as diffusers' `StableDiffusionPipeline` (text to
//! image), `StableDiffusionImg2ImgPipeline` (image to image) and `DiTPipeline` (a class) run
//! it:
//!
//! ```text
//! cond = text_encoder(prompt);  uncond = text_encoder(negative)       # when guided (g > 1)
//!   (a class-conditioned pipeline: cond = the class label, uncond = the null label;
//!    an image-variation pipeline: cond = image_encoder(image), uncond = zeros)
//! z = noise · init_noise_sigma            | z = add_noise(vae.encode(image) · scale, noise, t₀)
//! for each step k:  ε = unet(scale_input(z), t_k, [uncond, cond]) guided;  z = step(ε, k, z)
//! image = vae.decode(z / scale)
//! ```
//!
//! Noise comes from the seed ([`u_diffusion::Noise`]): draw 0 the starting noise, draw `k + 1`
//! the noise of step `k`, [`LATENT_SAMPLE_DRAW`] the sample of an initial image's latent
//! distribution. The caches ([`crate::cache`]) take what is already known.

use crate::{
    cache::{Caches, Progress, TrajectoryKey},
    picture,
    pipeline::{Condition, Pipeline},
    text::Embedded,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use u_diffusion::Noise;
use u_sdk::{ErrorKind, ImageProgress, ImageRequest, UError};

/// The most steps a request may ask for (diffusers' schedules have 1000 training steps).
pub const MAX_STEPS: u32 = 1000;

/// The draw of the seed's noise that samples an initial image's latent distribution.
pub const LATENT_SAMPLE_DRAW: u64 = u64::MAX;

/// Noise a caller supplies instead of the seed's, by draw (a comparison with another
/// implementation that drew its own); the draws it does not hold come from the seed. A request
/// with given noise neither reads nor writes the trajectory cache.
#[derive(Clone, Debug, Default)]
pub struct GivenNoise(pub HashMap<u64, Vec<f32>>);

/// A request's noise: given draws first, then the seed's.
pub(crate) struct Draws<'a> {
    seed: Noise,
    given: Option<&'a GivenNoise>,
}

impl<'a> Draws<'a> {
    /// The draws of `seed`, those of `given` first.
    pub(crate) fn new(seed: u64, given: Option<&'a GivenNoise>) -> Self {
        Self {
            seed: Noise::new(seed),
            given,
        }
    }

    /// Draw `draw`, `len` values.
    pub(crate) fn draw(&self, draw: u64, len: usize) -> u_sdk::Result<Vec<f32>> {
        match self.given.and_then(|g| g.0.get(&draw)) {
            Some(v) if v.len() == len => Ok(v.clone()),
            Some(v) => Err(invalid(format!(
                "given noise of draw {draw} has {} values, not {len}",
                v.len()
            ))),
            None => Ok(self.seed.draw(draw, len)),
        }
    }
}

/// What a finished request made.
pub struct Outcome {
    /// The pixels, `[channels, height, width]` in [0, 1].
    pub pixels: Vec<f32>,
    /// Channels: 3 (RGB), or 1 (grey: a heightfield).
    pub channels: u32,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Steps of the schedule the request ran.
    pub steps: u32,
    /// Steps taken from the trajectory cache.
    pub cached_steps: u32,
    /// Whether the first steps followed another prompt (a handoff).
    pub approximate: bool,
}

fn invalid(why: String) -> UError {
    UError::invalid(format!("runner-image: {why}"))
}

fn scheduler_error(e: u_diffusion::Error) -> UError {
    invalid(e.to_string())
}

/// The image size a request asks for: its own, else the initial image's (rounded down to the
/// pipeline's multiple), else the pipeline's default; checked against the step and
/// `max_pixels`.
fn size_of(
    pipeline: &Pipeline,
    request: &ImageRequest,
    init: Option<(u32, u32)>,
    max_pixels: u64,
) -> u_sdk::Result<(u32, u32)> {
    let step = pipeline.multiple();
    let pick = |asked: u32, from_image: Option<u32>| match (asked, from_image) {
        (0, Some(side)) => side / step * step,
        (0, None) => pipeline.default_side(),
        (side, _) => side,
    };
    let (w, h) = (
        pick(request.width, init.map(|i| i.0)),
        pick(request.height, init.map(|i| i.1)),
    );
    if w == 0 || h == 0 || !w.is_multiple_of(step) || !h.is_multiple_of(step) {
        return Err(invalid(format!(
            "a {w}×{h} image: width and height must be positive multiples of {step}"
        )));
    }
    within_limit(w, h, max_pixels)?;
    Ok((w, h))
}

/// A `width × height` image is at most `max_pixels` pixels, or a resource error saying so.
pub(crate) fn within_limit(width: u32, height: u32, max_pixels: u64) -> u_sdk::Result<()> {
    match u64::from(width) * u64::from(height) > max_pixels {
        true => Err(UError::new(
            ErrorKind::ResourceExhausted,
            format!(
                "runner-image: a {width}×{height} image is larger than this deployment's \
                 {max_pixels} pixels (runner setting `max_pixels`)"
            ),
        )),
        false => Ok(()),
    }
}

/// A request's initial image, decoded, with its strength checked; `None` without one.
pub(crate) fn initial_image(
    request: &ImageRequest,
    max_pixels: u64,
) -> u_sdk::Result<Option<u_image::Rgb8Image>> {
    if request.init_image.is_empty() {
        return Ok(None);
    }
    let strength = request.strength;
    if !(strength > 0.0 && strength <= 1.0) {
        return Err(invalid(format!(
            "strength {strength}: starting from an image takes a strength in (0, 1]"
        )));
    }
    picture::decode(&request.init_image, max_pixels).map(Some)
}

/// What `prompt` embeds to (the text encoders' rows), from the cache when it holds it.
fn prompt_rows(
    pipeline: &Pipeline,
    caches: &Mutex<Caches>,
    prompt: &str,
) -> u_sdk::Result<Arc<Embedded>> {
    let lock = || caches.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rows) = lock().prompt(prompt) {
        return Ok(rows);
    }
    let rows = Arc::new(pipeline.encode_prompt(prompt)?);
    lock().keep_prompt(prompt, rows.clone());
    Ok(rows)
}

/// What `request` conditions `pipeline`'s denoiser on, and what the unguided pass of a guided
/// request (guidance above 1) is conditioned on: a prompt's and the negative prompt's rows, an
/// image's embedding and zeros, or a class and the null class.
fn conditions(
    pipeline: &Pipeline,
    caches: &Mutex<Caches>,
    request: &ImageRequest,
    max_pixels: u64,
) -> u_sdk::Result<(Condition, Option<Condition>)> {
    let guided = request.guidance_scale > 1.0;
    let texts = [
        &request.prompt,
        &request.negative_prompt,
        &request.handoff_prompt,
    ];
    if pipeline.varies_images() {
        if texts.iter().any(|t| !t.is_empty()) || !request.conditioning.is_empty() {
            return Err(invalid(
                "an image-variation pipeline reads only the image it varies: no prompt, \
                 negative prompt, handoff or conditioning values"
                    .into(),
            ));
        }
        if request.init_image.is_empty() {
            return Err(invalid(
                "an image-variation pipeline needs the image to vary (the initial image)".into(),
            ));
        }
        let (cond, uncond) = pipeline.encode_condition_image(&request.init_image, max_pixels)?;
        return Ok((cond, guided.then_some(uncond)));
    }
    match pipeline.classes() {
        None if !request.conditioning.is_empty() => Err(invalid(format!(
            "{} conditioning values given to a text-conditioned pipeline: it reads its prompt",
            request.conditioning.len()
        ))),
        None if pipeline.guidance_distilled() && !request.negative_prompt.is_empty() => {
            Err(invalid(
                "this pipeline's guidance is distilled into its transformer (FLUX): it takes no \
                 negative prompt"
                    .into(),
            ))
        }
        None => {
            let rows = |prompt| prompt_rows(pipeline, caches, prompt).map(Condition::Text);
            let uncond = match guided && !pipeline.guidance_distilled() {
                true => Some(rows(&request.negative_prompt)?),
                false => None,
            };
            Ok((rows(&request.prompt)?, uncond))
        }
        Some(_) if texts[1..].iter().any(|t| !t.is_empty()) => Err(invalid(
            "a class-conditioned pipeline takes no negative prompt or handoff prompt".into(),
        )),
        Some(null) => Ok((
            Condition::Class(pipeline.class_of(&request.prompt, &request.conditioning)?),
            guided.then_some(Condition::Class(null)),
        )),
    }
}

/// Runs `request` on `pipeline`, reporting each step to `progress` (which returns `false` to
/// cancel), with the draws of `given` in place of the seed's.
pub fn generate(
    pipeline: &Pipeline,
    caches: &Mutex<Caches>,
    request: &ImageRequest,
    given: Option<&GivenNoise>,
    max_pixels: u64,
    progress: &mut dyn FnMut(ImageProgress) -> bool,
) -> u_sdk::Result<Outcome> {
    let steps = request.steps;
    if steps == 0 || steps > MAX_STEPS {
        return Err(invalid(format!(
            "{steps} steps: a request runs 1 to {MAX_STEPS}"
        )));
    }
    let guidance = request.guidance_scale;
    if !guidance.is_finite() {
        return Err(invalid(format!("guidance scale {guidance}")));
    }
    // An image-variation pipeline reads its image as the condition and starts from noise.
    let init = match pipeline.varies_images() {
        true => None,
        false => initial_image(request, max_pixels)?,
    };
    let (width, height) = size_of(
        pipeline,
        request,
        init.as_ref().map(|i| (i.width(), i.height())),
        max_pixels,
    )?;
    let s = pipeline.vae_scale();
    let latent = (height / s, width / s);
    let len = (pipeline.channels() * latent.0 * latent.1) as usize;
    let scheduler = pipeline.scheduler(steps, latent)?;
    let timesteps = scheduler.timesteps().to_vec();
    let (cond, uncond) = conditions(pipeline, caches, request, max_pixels)?;
    let noise = Draws::new(request.seed, given);

    // Where the trajectory starts: pure noise, or the initial image's latent noised to the
    // first step that runs.
    let (first, mut latents) = match &init {
        None => {
            let sigma = scheduler.init_noise_sigma();
            let z = noise.draw(0, len)?;
            (0, z.into_iter().map(|v| v * sigma).collect::<Vec<f32>>())
        }
        Some(image) => {
            let pixels = picture::normalised(image, (width, height))?;
            let (mean, std) = pipeline.encode_image(&pixels, (height, width))?;
            let sample = noise.draw(LATENT_SAMPLE_DRAW, len)?;
            let l = pipeline.latent_scale();
            let clean: Vec<f32> = mean
                .iter()
                .zip(&std)
                .zip(&sample)
                .map(|((m, sd), n)| (m + sd * n - l.shift) * l.scale)
                .collect();
            // diffusers' `int(steps · strength)` in Python floats, the strength as written
            // (0.7, not the f32 nearest it: 10 · 0.7 runs 7 steps, not 6).
            let strength: f64 = request.strength.to_string().parse().unwrap_or(0.0);
            let runs = ((f64::from(steps) * strength) as u32).min(steps);
            if runs == 0 {
                return Err(invalid(format!(
                    "strength {} of {steps} steps runs none; raise either",
                    request.strength
                )));
            }
            let first = (steps - runs) as usize;
            let start = noise.draw(0, len)?;
            let z = scheduler
                .add_noise(&clean, &start, first)
                .map_err(scheduler_error)?;
            (first, z)
        }
    };

    let key = TrajectoryKey {
        prompt: request.prompt.to_string(),
        negative: request.negative_prompt.to_string(),
        conditioning: request.conditioning.iter().map(|v| v.to_bits()).collect(),
        seed: request.seed,
        size: latent,
        steps,
        guidance: guidance.to_bits(),
        scheduler: pipeline.scheduler_config().into(),
        init_image: request.init_image.as_slice().into(),
        strength: if init.is_some() {
            request.strength.to_bits()
        } else {
            0
        },
    };
    let lock = || caches.lock().unwrap_or_else(|e| e.into_inner());
    let mut done = first;
    let mut history = Vec::new();
    let approximate = !request.handoff_prompt.is_empty();
    if approximate {
        // The edited prompt takes over the earlier one's trajectory at the step asked for.
        let earlier = TrajectoryKey {
            prompt: request.handoff_prompt.to_string(),
            ..key.clone()
        };
        let at = request.handoff_step;
        let kept = lock().trajectory(&earlier);
        let start = kept.as_ref().and_then(|p| p.after(at)).ok_or_else(|| {
            UError::not_found(format!(
                "runner-image: no kept trajectory of the handoff prompt has reached step {at} \
                 (with this seed, size, steps, guidance and scheduler)"
            ))
        })?;
        latents = start.to_vec();
        done = at as usize;
    } else if given.is_none()
        && let Some(p) = lock().trajectory(&key)
        && p.step() as usize > first
    {
        done = p.step() as usize;
        latents = p.history.last().map(|l| l.to_vec()).unwrap_or(latents);
        history = p.history;
    }
    let cached_steps = (done - first) as u32;
    if cached_steps > 0 {
        progress(ImageProgress {
            step: done as u32,
            steps,
            cached: true,
        });
    }
    let mut contexts = lock().contexts();
    let keep_contexts = lock().keeps_contexts();
    for (k, &t) in timesteps.iter().enumerate().skip(done) {
        if !keep_contexts {
            contexts = lock().contexts();
        }
        let mut x = latents.clone();
        scheduler
            .scale_model_input(&mut x, k)
            .map_err(scheduler_error)?;
        let prediction =
            pipeline.denoise(&x, latent, t, (&cond, uncond.as_ref()), guidance, contexts)?;
        let fresh = match scheduler.needs_noise(k) {
            true => Some(noise.draw(k as u64 + 1, len)?),
            false => None,
        };
        latents = scheduler
            .step(&prediction, k, &latents, fresh.as_deref())
            .map_err(scheduler_error)?;
        history.push(Arc::new(latents.clone()));
        // A trajectory from given noise or a handoff is not the request's own: not kept.
        let keep = |history: &[Arc<Vec<f32>>]| {
            if given.is_none() && !approximate {
                let progress = Progress {
                    first: first as u32,
                    history: history.to_vec(),
                };
                lock().keep_trajectory(key.clone(), progress);
            }
        };
        let go_on = progress(ImageProgress {
            step: k as u32 + 1,
            steps,
            cached: false,
        });
        if !go_on {
            keep(&history);
            return Err(UError::new(
                ErrorKind::Cancelled,
                format!(
                    "runner-image: cancelled after step {} of {steps} (the same request resumes \
                     there)",
                    k + 1
                ),
            ));
        }
        if k + 1 == steps as usize {
            keep(&history);
        }
    }
    Ok(Outcome {
        pixels: pipeline.decode(&latents, latent)?,
        channels: 3,
        width,
        height,
        steps,
        cached_steps,
        approximate,
    })
}
