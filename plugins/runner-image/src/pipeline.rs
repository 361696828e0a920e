//! The models of a latent diffusion pipeline and the three things the sampling loop asks of
//! them, as diffusers' `StableDiffusionPipeline` does them: a prompt's text-encoder rows
//! (`encode_prompt`), one guided denoising prediction (`denoise`), and the decoding of the final
//! latents into pixels (`decode`); plus the encoding of an initial image (img2img).

use abi_stable::std_types::{ROption, RSlice, RSliceMut};
use serde_json::Value;
use u_sdk::{
    CrossContext, ModelBox, ModelKind, Output, PipelineParts, PlaneSpec, Planes, Rows, Segment,
    SeqChunk, SeqExtras, SeqId, TokenizerBox, UError,
};

/// A pipeline's models, checked to fit together.
pub struct Pipeline {
    unet: ModelBox,
    unet_spec: PlaneSpec,
    text_encoder: ModelBox,
    text: TextSpec,
    decoder: ModelBox,
    decoder_spec: PlaneSpec,
    encoder: Option<(ModelBox, PlaneSpec)>,
    tokenizer: TokenizerBox,
    scheduler_config: String,
    latents: LatentScale,
}

/// What the text encoder takes and gives.
#[derive(Clone, Copy, Debug)]
struct TextSpec {
    /// Its blocks (the rows after the last, final-normed, are the UNet's context).
    layers: u32,
    /// Width of a row.
    width: usize,
    /// Positions every prompt is padded or cut to (CLIP's 77).
    positions: usize,
    /// The id prompts are padded with.
    pad: Option<u32>,
}

/// How the autoencoder's latents relate to the denoiser's: `z_unet = (z_vae − shift) · scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentScale {
    /// `scaling_factor` (0.18215 for Stable Diffusion 1 and 2).
    pub scale: f32,
    /// `shift_factor` (0 unless the VAE states one).
    pub shift: f32,
}

fn invalid(why: String) -> UError {
    UError::invalid(format!("runner-image: {why}"))
}

fn spec_of(model: &ModelBox, what: &str, kind: ModelKind) -> u_sdk::Result<PlaneSpec> {
    let config = model.config().into_result()?;
    match (config.kind == kind, config.planes.into_option()) {
        (true, Some(spec)) => Ok(spec),
        _ => Err(invalid(format!(
            "the pipeline's {what} is a {:?} model (`{}`), not a {kind:?} of feature maps",
            config.kind, config.family
        ))),
    }
}

/// Runs `chunks` in one pass into a buffer of `floats`.
fn forward(model: &ModelBox, chunks: &[SeqChunk<'_>], floats: usize) -> u_sdk::Result<Vec<f32>> {
    let mut out = vec![0f32; floats];
    model
        .forward(
            RSlice::from_slice(chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

fn planes(values: &[f32], channels: u32, (h, w): (u32, u32)) -> Planes<'_> {
    Planes {
        values: RSlice::from_slice(values),
        channels,
        height: h,
        width: w,
    }
}

/// A denoiser's chunk: the map `input` at `timestep`, cross-attending to context `kv`'s
/// `rows`.
fn denoiser_chunk<'a>(
    input: &'a [Segment<'a>],
    timestep: &'a [f32],
    (kv, rows): (SeqId, &'a [f32]),
) -> SeqChunk<'a> {
    SeqChunk {
        seq: 0,
        input: RSlice::from_slice(input),
        output: Output::Planes,
        extras: SeqExtras {
            conditioning: RSlice::from_slice(timestep),
            cross: ROption::RSome(CrossContext {
                kv,
                rows: RSlice::from_slice(rows),
            }),
            ..SeqExtras::default()
        },
    }
}

impl Pipeline {
    /// The pipeline of denoiser `unet`, the other `parts` the host built and `tokenizer`.
    pub fn new(
        unet: ModelBox,
        parts: PipelineParts,
        tokenizer: Option<TokenizerBox>,
    ) -> u_sdk::Result<Pipeline> {
        let tokenizer = tokenizer
            .ok_or_else(|| invalid("the pipeline has no tokenizer (`tokenizer/`)".into()))?;
        let mut components = parts.components.into_vec();
        let mut take = |name: &str| {
            components
                .iter()
                .position(|c| c.name.as_str() == name)
                .map(|i| components.swap_remove(i).model)
        };
        let text_encoder = take("text_encoder")
            .ok_or_else(|| invalid("the pipeline has no `text_encoder`".into()))?;
        let decoder = take("vae").ok_or_else(|| invalid("the pipeline has no `vae`".into()))?;
        let encoder = take("vae.encoder");
        let config = |component: &str| -> u_sdk::Result<Value> {
            let text = parts
                .configs
                .iter()
                .find(|c| c.component.as_str() == component)
                .map(|c| c.json.to_string())
                .ok_or_else(|| invalid(format!("no configuration of the `{component}`")))?;
            serde_json::from_str(&text)
                .map_err(|e| invalid(format!("the `{component}` configuration: {e}")))
        };
        let scheduler_config = config("scheduler")?.to_string();
        let vae = config("vae")?;
        let factor = |key: &str, default: f64| match &vae[key] {
            Value::Null => Ok(default as f32),
            v => v
                .as_f64()
                .filter(|x| x.is_finite() && *x != 0.0)
                .map(|x| x as f32)
                .ok_or_else(|| invalid(format!("the vae's `{key}` is not a number"))),
        };
        let latents = LatentScale {
            scale: factor("scaling_factor", 0.18215)?,
            shift: match vae["shift_factor"] {
                Value::Null => 0.0,
                _ => factor("shift_factor", 0.0)?,
            },
        };
        let unet_spec = spec_of(&unet, "unet", ModelKind::Denoiser)?;
        let decoder_spec = spec_of(&decoder, "vae", ModelKind::Autoencoder)?;
        let encoder = match encoder {
            Some(e) => {
                let spec = spec_of(&e, "vae encoder", ModelKind::Autoencoder)?;
                Some((e, spec))
            }
            None => None,
        };
        let text_config = text_encoder.config().into_result()?;
        let unet_config = unet.config().into_result()?;
        let text = TextSpec {
            layers: text_config.layers,
            width: text_config.hidden as usize,
            positions: text_config.context_length as usize,
            pad: tokenizer.special_tokens().into_result()?.pad.into_option(),
        };
        if text.width != unet_config.context_shape[1] as usize || text.positions < 2 {
            return Err(invalid(format!(
                "the text encoder gives rows of {} over {} positions; the unet cross-attends to \
                 rows of {}",
                text.width, text.positions, unet_config.context_shape[1]
            )));
        }
        if decoder_spec.in_channels != unet_spec.out_channels
            || unet_spec.in_channels != unet_spec.out_channels
        {
            return Err(invalid(format!(
                "the unet maps {} to {} channels; the vae decodes {}",
                unet_spec.in_channels, unet_spec.out_channels, decoder_spec.in_channels
            )));
        }
        Ok(Pipeline {
            unet,
            unet_spec,
            text_encoder,
            text,
            decoder,
            decoder_spec,
            encoder,
            tokenizer,
            scheduler_config,
            latents,
        })
    }

    /// The scheduler's configuration (`scheduler_config.json`).
    pub fn scheduler_config(&self) -> &str {
        &self.scheduler_config
    }

    /// Latent channels.
    pub fn channels(&self) -> u32 {
        self.unet_spec.in_channels
    }

    /// Pixels per latent along each side (the autoencoder's scale, 8 for Stable Diffusion).
    pub fn vae_scale(&self) -> u32 {
        self.decoder_spec.scale[0] / self.decoder_spec.scale[1].max(1)
    }

    /// Image sides must be multiples of this.
    pub fn multiple(&self) -> u32 {
        self.vae_scale() * self.unet_spec.multiple.max(1)
    }

    /// The image side the pipeline was trained at (its default).
    pub fn default_side(&self) -> u32 {
        self.unet_spec.sample_size * self.vae_scale()
    }

    /// Whether it can start from an image (it has the autoencoder's encoder).
    pub fn encodes_images(&self) -> bool {
        self.encoder.is_some()
    }

    /// The scale between the autoencoder's latents and the denoiser's.
    pub fn latent_scale(&self) -> LatentScale {
        self.latents
    }

    /// The token ids of `prompt` as the pipeline feeds them to the text encoder: with its
    /// special tokens, cut to the encoder's positions (keeping the end token), padded to them.
    pub fn tokens(&self, prompt: &str) -> u_sdk::Result<Vec<u32>> {
        let mut ids = self
            .tokenizer
            .encode(prompt.into(), true, false)
            .into_result()?
            .into_vec();
        let n = self.text.positions;
        let last = *ids
            .last()
            .ok_or_else(|| invalid("the tokenizer gave no ids".into()))?;
        if ids.len() > n {
            ids.truncate(n - 1);
            ids.push(last);
        }
        ids.resize(n, self.text.pad.unwrap_or(last));
        Ok(ids)
    }

    /// The text encoder's final rows for `prompt`: `[positions, width]`.
    pub fn encode_prompt(&self, prompt: &str) -> u_sdk::Result<Vec<f32>> {
        let ids = self.tokens(prompt)?;
        let input = [Segment::Tokens(RSlice::from_slice(&ids))];
        let output = Output::Hidden {
            layer: self.text.layers,
            rows: Rows::All,
        };
        let chunk = SeqChunk::tokens(0, &input, output);
        forward(
            &self.text_encoder,
            &[chunk],
            self.text.positions * self.text.width,
        )
    }

    /// The guided prediction at timestep `t` for `latents` (`[channels, h, w]`, scaled for the
    /// step): the unet on the prompt's rows `cond` and, when guided, on `uncond` in the same
    /// pass (uncond first, as diffusers batches them), `uncond + g · (cond − uncond)`. The two
    /// contexts go under the sequence ids `contexts` (prompt, negative prompt), where the unet
    /// keeps their cross-attention keys and values for the next step.
    pub fn denoise(
        &self,
        latents: &[f32],
        size: (u32, u32),
        t: f32,
        (cond, uncond): (&[f32], Option<&[f32]>),
        guidance: f32,
        contexts: [SeqId; 2],
    ) -> u_sdk::Result<Vec<f32>> {
        let c = self.channels();
        let input = [Segment::Planes(planes(latents, c, size))];
        let timestep = [t];
        let n = latents.len();
        match uncond {
            None => forward(
                &self.unet,
                &[denoiser_chunk(&input, &timestep, (contexts[0], cond))],
                n,
            ),
            Some(uncond) => {
                let pair = [
                    denoiser_chunk(&input, &timestep, (contexts[1], uncond)),
                    denoiser_chunk(&input, &timestep, (contexts[0], cond)),
                ];
                let both = forward(&self.unet, &pair, 2 * n)?;
                let (u, p) = both.split_at(n);
                Ok(u.iter()
                    .zip(p)
                    .map(|(u, p)| u + guidance * (p - u))
                    .collect())
            }
        }
    }

    /// Pixels `[3, H, W]` in [0, 1] from the denoiser's final `latents` `[channels, h, w]`:
    /// `decode(z / scale + shift)`, then `(x / 2 + 0.5)` clamped, as diffusers' image
    /// processor denormalises.
    pub fn decode(&self, latents: &[f32], size: (u32, u32)) -> u_sdk::Result<Vec<f32>> {
        let LatentScale { scale, shift } = self.latents;
        let z: Vec<f32> = latents.iter().map(|v| v / scale + shift).collect();
        let input = [Segment::Planes(planes(&z, self.channels(), size))];
        let chunk = SeqChunk {
            seq: 0,
            input: RSlice::from_slice(&input),
            output: Output::Planes,
            extras: SeqExtras::default(),
        };
        let s = self.vae_scale() as usize;
        let floats = self.decoder_spec.out_channels as usize * latents.len()
            / self.channels() as usize
            * s
            * s;
        let image = forward(&self.decoder, &[chunk], floats)?;
        Ok(image
            .into_iter()
            .map(|x| (x * 0.5 + 0.5).clamp(0.0, 1.0))
            .collect())
    }

    /// The mean and standard deviation of the latent distribution of `pixels` (`[3, H, W]` in
    /// [−1, 1]), each `[channels, H/s, W/s]`: the encoder's moments, the log variance clamped
    /// to [−30, 20] as diffusers' `DiagonalGaussianDistribution` does.
    pub fn encode_image(
        &self,
        pixels: &[f32],
        size: (u32, u32),
    ) -> u_sdk::Result<(Vec<f32>, Vec<f32>)> {
        let (encoder, spec) = self.encoder.as_ref().ok_or_else(|| {
            UError::unsupported(
                "runner-image: this pipeline cannot start from an image (no architecture builds \
                 its autoencoder's encoder)",
            )
        })?;
        let input = [Segment::Planes(planes(pixels, spec.in_channels, size))];
        let chunk = SeqChunk {
            seq: 0,
            input: RSlice::from_slice(&input),
            output: Output::Planes,
            extras: SeqExtras::default(),
        };
        let (oh, ow) = spec.out_size(size.0, size.1)?;
        let moments = forward(encoder, &[chunk], (spec.out_channels * oh * ow) as usize)?;
        let (mean, logvar) = moments.split_at(moments.len() / 2);
        let std = logvar
            .iter()
            .map(|v| (0.5 * v.clamp(-30.0, 20.0)).exp())
            .collect();
        Ok((mean.to_vec(), std))
    }
}
