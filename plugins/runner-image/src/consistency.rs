//! A pixel-space consistency model served alone, without a pipeline (Song et al. 2023,
//! *Consistency Models*, arXiv:2303.01469): a denoiser `f(x, σ, c)` distilled to map a noisy
//! image at any noise level σ straight to a clean one, its EDM preconditioning inside the
//! network. Such a model reads the chunk's conditioning as σ followed by the request's own
//! values `c` (a class label; the terrain model's difficulty) and writes the image in
//! [−1, 1]. One step samples it:
//!
//! ```text
//! text to image:   x = f(σ_max · z, σ_max, c)
//! image variation: x = f(image + σ · z, σ, c),   σ = σ_min · (σ_max / σ_min)^strength
//! ```
//!
//! with `z` the seed's draw 0 ([`u_diffusion::Noise`]). The image becomes `(x + 1) / 2`:
//! 16-bit grey for a one-channel model (a heightfield), RGB for three.

use crate::{
    picture,
    sampler::{Draws, GivenNoise, Outcome, initial_image, within_limit},
};
use abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{
    ImageProgress, ImageRequest, ModelBox, Output, PlaneSpec, Planes, Segment, SeqChunk, SeqExtras,
    UError,
};

/// EDM's (and the terrain model's) largest noise level.
pub const SIGMA_MAX: f32 = 80.0;
/// EDM's smallest noise level.
pub const SIGMA_MIN: f32 = 0.002;

fn invalid(why: String) -> UError {
    UError::invalid(format!("runner-image: {why}"))
}

/// A consistency model and its noise range.
pub struct ConsistencyModel {
    model: ModelBox,
    spec: PlaneSpec,
    family: String,
    /// σ of pure noise.
    pub sigma_max: f32,
    /// σ of a clean image.
    pub sigma_min: f32,
}

impl ConsistencyModel {
    /// `model`, checked to map images to images of the same size and channels (one or three).
    pub fn new(model: ModelBox, sigma_min: f32, sigma_max: f32) -> u_sdk::Result<Self> {
        let config = model.config().into_result()?;
        let spec = config.planes.into_option().ok_or_else(|| {
            invalid(format!(
                "`{}` states no feature maps it reads",
                config.family
            ))
        })?;
        if spec.scale[0] != spec.scale[1]
            || spec.in_channels != spec.out_channels
            || !matches!(spec.in_channels, 1 | 3)
        {
            return Err(invalid(format!(
                "`{}` served without a pipeline must map a one- or three-channel image to one \
                 of its size (a pixel-space consistency model); it maps {} channels to {} at \
                 scale {}/{}",
                config.family, spec.in_channels, spec.out_channels, spec.scale[0], spec.scale[1]
            )));
        }
        if !(sigma_min > 0.0 && sigma_max > sigma_min && sigma_max.is_finite()) {
            return Err(invalid(format!(
                "noise levels σ_min {sigma_min}, σ_max {sigma_max}: want 0 < σ_min < σ_max"
            )));
        }
        Ok(Self {
            model,
            spec,
            family: config.family.to_string(),
            sigma_max,
            sigma_min,
        })
    }

    /// The side it was trained at (its default).
    pub fn default_side(&self) -> u32 {
        self.spec.sample_size
    }

    /// The noise level an image variation of `strength` starts from.
    pub fn sigma_of(&self, strength: f32) -> f32 {
        self.sigma_min * (self.sigma_max / self.sigma_min).powf(strength)
    }

    /// Runs `request` (with the draws of `given` in place of the seed's), telling `progress`
    /// of its one step.
    pub fn generate(
        &self,
        request: &ImageRequest,
        given: Option<&GivenNoise>,
        max_pixels: u64,
        progress: &mut dyn FnMut(ImageProgress) -> bool,
    ) -> u_sdk::Result<Outcome> {
        if request.steps != 1 {
            return Err(invalid(format!(
                "{} steps: the consistency model `{}` samples in one step (ask for 1)",
                request.steps, self.family
            )));
        }
        if !request.prompt.is_empty()
            || !request.negative_prompt.is_empty()
            || !request.handoff_prompt.is_empty()
        {
            return Err(invalid(format!(
                "`{}` reads no text: give its conditioning values instead of a prompt",
                self.family
            )));
        }
        let init = initial_image(request, max_pixels)?;
        let side = |asked: u32, from_image: Option<u32>| match (asked, from_image) {
            (0, Some(s)) => s,
            (0, None) => self.default_side(),
            (s, _) => s,
        };
        let (width, height) = (
            side(request.width, init.as_ref().map(|i| i.width())),
            side(request.height, init.as_ref().map(|i| i.height())),
        );
        if width == 0 || height == 0 {
            return Err(invalid(format!("a {width}×{height} image")));
        }
        within_limit(width, height, max_pixels)?;
        let channels = self.spec.in_channels;
        let len = (channels * width * height) as usize;
        let noise = Draws::new(request.seed, given).draw(0, len)?;
        let (sigma, noisy) = match &init {
            None => (
                self.sigma_max,
                noise
                    .iter()
                    .map(|z| z * self.sigma_max)
                    .collect::<Vec<f32>>(),
            ),
            Some(image) => {
                let sigma = self.sigma_of(request.strength);
                let rgb = picture::normalised(image, (width, height))?;
                let source = match channels {
                    1 => picture::grey(&rgb),
                    _ => rgb,
                };
                let noisy = source
                    .iter()
                    .zip(&noise)
                    .map(|(x, z)| x + sigma * z)
                    .collect();
                (sigma, noisy)
            }
        };
        let mut conditioning = vec![sigma];
        conditioning.extend(request.conditioning.iter().copied());
        let segment = [Segment::Planes(Planes {
            values: RSlice::from_slice(&noisy),
            channels,
            height,
            width,
        })];
        let chunk = SeqChunk {
            seq: 0,
            input: RSlice::from_slice(&segment),
            output: Output::Planes,
            extras: SeqExtras {
                conditioning: RSlice::from_slice(&conditioning),
                ..SeqExtras::default()
            },
        };
        let mut image = vec![0f32; len];
        self.model
            .forward(
                RSlice::from_slice(&[chunk]),
                RSliceMut::from_mut_slice(&mut image),
            )
            .into_result()?;
        for v in &mut image {
            *v = ((*v + 1.0) * 0.5).clamp(0.0, 1.0);
        }
        progress(ImageProgress {
            step: 1,
            steps: 1,
            cached: false,
        });
        Ok(Outcome {
            pixels: image,
            channels,
            width,
            height,
            steps: 1,
            cached_steps: 0,
            approximate: false,
        })
    }
}
