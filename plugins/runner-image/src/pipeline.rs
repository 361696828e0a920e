//! The models of a latent diffusion pipeline and the three things the sampling loop asks of
//! them, as diffusers' `StableDiffusionPipeline`, `StableDiffusionImageVariationPipeline` and
//! `DiTPipeline` do them: what conditions the denoiser (a prompt's text-encoder rows,
//! `encode_prompt`; an image's CLIP embedding, `encode_condition_image`; or a class label,
//! `class_of`),
//! one guided denoising prediction (`denoise`), and the decoding of the final latents into
//! pixels (`decode`); plus the encoding of an initial image (img2img).

use crate::text::{Embedded, Prompting, TextEncoder};
use abi_stable::std_types::{ROption, RSlice, RSliceMut};
use serde_json::Value;
use std::sync::Arc;
use u_sdk::{
    CrossContext, ImageInput, ImageSpec, ModelBox, ModelKind, Output, PipelineParts, PlaneSpec,
    Planes, Pooling, Segment, SeqChunk, SeqExtras, SeqId, TokenizerBox, UError,
};

/// The `_class_name` of Stable Diffusion 3's transformer.
const SD3: &str = "SD3Transformer2DModel";

/// T5's positions in Stable Diffusion 3's prompts (diffusers' `max_sequence_length`).
pub const SD3_T5_POSITIONS: usize = 256;

/// The `_class_name` of FLUX.1's transformer.
const FLUX: &str = "FluxTransformer2DModel";

/// T5's positions in FLUX's prompts (diffusers' `max_sequence_length`).
pub const FLUX_T5_POSITIONS: usize = 512;

/// A pipeline's models, checked to fit together.
pub struct Pipeline {
    unet: ModelBox,
    unet_spec: PlaneSpec,
    conditioner: Conditioner,
    decoder: ModelBox,
    decoder_spec: PlaneSpec,
    encoder: Option<(ModelBox, PlaneSpec)>,
    scheduler_config: String,
    latents: LatentScale,
    /// For a guidance-distilled denoiser (FLUX): whether it reads the guidance scale
    /// (`guidance_embeds`); `None` for classifier-free guidance.
    distilled: Option<bool>,
}

/// How requests condition a pipeline's denoiser.
enum Conditioner {
    /// A prompt, whose text-encoder rows the denoiser cross-attends to (Stable Diffusion).
    Text(Prompting),
    /// An image's embedding (CLIP's, projected), the one row the denoiser cross-attends to
    /// (Stable Diffusion's image variations); the unguided pass attends to zeros.
    Image {
        encoder: ModelBox,
        /// What the encoder takes, with the pipeline's `feature_extractor` resizing.
        spec: ImageSpec,
        /// Width of the embedding (the denoiser's context width).
        width: usize,
    },
    /// A class label the denoiser embeds itself (DiT).
    Class {
        /// Labels are `0..classes`; `classes` itself is the null label of the unguided pass.
        classes: u32,
        /// The names of the labels (`model_index.json`'s `id2label`, split at commas).
        names: Vec<(String, u32)>,
    },
}

/// What one denoising pass is conditioned on.
#[derive(Clone, Debug, PartialEq)]
pub enum Condition {
    /// Context rows (a prompt's, an image's embedding) and the pooled text where the denoiser
    /// reads one.
    Text(Arc<Embedded>),
    /// A class label (the pipeline's class count: none).
    Class(u32),
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
pub(crate) fn forward(
    model: &ModelBox,
    chunks: &[SeqChunk<'_>],
    floats: usize,
) -> u_sdk::Result<Vec<f32>> {
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

/// A denoiser's chunk: the map `input` with `conditioning` (the timestep, then a class label
/// where there is one), cross-attending to context `kv`'s rows where there are any.
fn denoiser_chunk<'a>(
    input: &'a [Segment<'a>],
    conditioning: &'a [f32],
    (kv, condition): (SeqId, &'a Condition),
) -> SeqChunk<'a> {
    SeqChunk {
        seq: 0,
        input: RSlice::from_slice(input),
        output: Output::Planes,
        extras: SeqExtras {
            conditioning: RSlice::from_slice(conditioning),
            cross: match condition {
                Condition::Text(e) => ROption::RSome(CrossContext {
                    kv,
                    rows: RSlice::from_slice(&e.rows),
                }),
                Condition::Class(_) => ROption::RNone,
            },
            ..SeqExtras::default()
        },
    }
}

/// A chunk's conditioning values: the timestep `t`, then the pooled text of a text condition
/// (Stable Diffusion 3's; none for the rest) or the class label of a class condition.
fn conditioning(t: f32, condition: &Condition) -> Vec<f32> {
    match condition {
        Condition::Text(e) => std::iter::once(t).chain(e.pooled.iter().copied()).collect(),
        Condition::Class(label) => vec![t, *label as f32],
    }
}

/// The text side of a pipeline whose `text_encoder` is `first`, the other encoders taken with
/// `take`, their tokenizers with `tokenizer`: Stable Diffusion 3's three encoders when the
/// denoiser is an `SD3Transformer2DModel`, else one CLIP.
fn prompting(
    first: ModelBox,
    take: &mut dyn FnMut(&str) -> Option<ModelBox>,
    tokenizer: &mut dyn FnMut(&str) -> Option<TokenizerBox>,
    (denoiser, config): (&Value, &u_sdk::ModelConfig),
    max_length: Option<usize>,
) -> u_sdk::Result<Prompting> {
    let context = config.context_shape[1] as usize;
    let unstated = |model: &ModelBox| -> u_sdk::Result<Option<usize>> {
        let length = model.config().into_result()?.context_length;
        match (length, max_length) {
            (0, None) => Err(invalid(
                "the text encoder fixes no prompt length and the tokenizer states no \
                 `model_max_length`"
                    .into(),
            )),
            (0, given) => Ok(given),
            _ => Ok(None),
        }
    };
    let mut encoder = |model: ModelBox, n: &str, positions| {
        let name = format!("tokenizer{n}");
        let t = tokenizer(&name).ok_or_else(|| {
            invalid(format!(
                "the pipeline has `text_encoder{n}` but no tokenizer (`{name}/`)"
            ))
        })?;
        TextEncoder::new(model, t, positions)
    };
    let class = denoiser["_class_name"].as_str();
    if class == Some(FLUX) {
        let t5 = take("text_encoder_2")
            .ok_or_else(|| invalid("a FLUX pipeline needs `text_encoder_2` (T5)".into()))?;
        let (clip, t5) = (
            encoder(first, "", None)?,
            encoder(t5, "_2", Some(FLUX_T5_POSITIONS))?,
        );
        let pooled = denoiser["pooled_projection_dim"].as_u64().unwrap_or(0) as usize;
        if clip.width() != pooled || t5.width() != context {
            return Err(invalid(format!(
                "the CLIP pools {} values and T5 gives rows of {}; the transformer reads a \
                 pooled text of {pooled} and rows of {context}",
                clip.width(),
                t5.width()
            )));
        }
        return Ok(Prompting::Flux { clip, t5 });
    }
    if class != Some(SD3) {
        let positions = unstated(&first)?;
        let clip = encoder(first, "", positions)?;
        if clip.width() != context {
            return Err(invalid(format!(
                "the text encoder gives rows of {}; the denoiser cross-attends to rows of \
                 {context}",
                clip.width()
            )));
        }
        return Ok(Prompting::Clip(clip));
    }
    let second = take("text_encoder_2").ok_or_else(|| {
        invalid("a Stable Diffusion 3 pipeline needs `text_encoder_2` (CLIP-G)".into())
    })?;
    let clips = Box::new([encoder(first, "", None)?, encoder(second, "_2", None)?]);
    let t5 = match take("text_encoder_3") {
        Some(t5) => Some(encoder(t5, "_3", Some(SD3_T5_POSITIONS))?),
        None => None,
    };
    let clip_width = clips[0].width() + clips[1].width();
    let pooled = denoiser["pooled_projection_dim"].as_u64().unwrap_or(0) as usize;
    if clip_width > context
        || clips[0].positions() != clips[1].positions()
        || pooled != clip_width
        || t5.as_ref().is_some_and(|t| t.width() != context)
    {
        return Err(invalid(format!(
            "the CLIP encoders give rows of {} and {} (pooled {clip_width}) and T5 rows of {:?}; \
             the transformer reads rows of {context} and a pooled text of {pooled}",
            clips[0].width(),
            clips[1].width(),
            t5.as_ref().map(TextEncoder::width)
        )));
    }
    Ok(Prompting::Sd3 {
        clips,
        t5,
        joint: context,
        t5_positions: SD3_T5_POSITIONS,
    })
}

/// `spec` with the resizing of the pipeline's `feature_extractor` (`preprocessor_config.json`:
/// its `size.shortest_edge`), whose crop must be the encoder's input.
fn resized_as(spec: ImageSpec, processor: Option<&Value>) -> u_sdk::Result<ImageSpec> {
    let Some(p) = processor else {
        return Ok(spec);
    };
    let side = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
    let crop = &p["crop_size"];
    let crop = [&crop["height"], &crop["width"]].map(side);
    if crop.iter().any(|c| c.is_some_and(|c| c != spec.height)) {
        return Err(invalid(format!(
            "the feature extractor crops to {crop:?}; the image encoder takes {}×{}",
            spec.height, spec.width
        )));
    }
    Ok(match side(&p["size"]["shortest_edge"]) {
        Some(edge) if edge >= spec.height => ImageSpec {
            shortest_edge: edge,
            ..spec
        },
        Some(edge) => {
            return Err(invalid(format!(
                "the feature extractor resizes to a {edge}-pixel shortest edge, below its {}-pixel \
                 crop",
                spec.height
            )));
        }
        None => spec,
    })
}

/// The labels `id2label` names (`{"3": "tiger shark, Galeocerdo cuvieri"}`), each name of a
/// comma-separated list trimmed, as diffusers' `DiTPipeline` reads them; none without it.
fn label_names(index: Option<&Value>, classes: u32) -> u_sdk::Result<Vec<(String, u32)>> {
    let Some(map) = index.and_then(|i| i["id2label"].as_object()) else {
        return Ok(Vec::new());
    };
    let mut names = Vec::new();
    for (key, value) in map {
        let label = key
            .parse::<u32>()
            .ok()
            .filter(|l| *l < classes)
            .zip(value.as_str())
            .ok_or_else(|| {
                invalid(format!(
                    "`id2label` maps `{key}` to {value}: not a class below {classes} to a name"
                ))
            })?;
        for name in label.1.split(',') {
            names.push((name.trim().to_string(), label.0));
        }
    }
    Ok(names)
}

impl Pipeline {
    /// The pipeline of denoiser `unet` (a UNet or a transformer), the other `parts` the host
    /// built and `tokenizer`: conditioned on text when it has a `text_encoder`, on an image
    /// when it has an `image_encoder`, else on a class label when the denoiser's configuration
    /// states classes (`num_embeds_ada_norm`).
    pub fn new(
        unet: ModelBox,
        parts: PipelineParts,
        tokenizer: Option<TokenizerBox>,
    ) -> u_sdk::Result<Pipeline> {
        let mut components = parts.components.into_vec();
        let mut tokenizers = parts.tokenizers.into_vec();
        let mut context_tokenizer = tokenizer;
        let mut tokenizer =
            |name: &str| match tokenizers.iter().position(|t| t.name.as_str() == name) {
                Some(i) => Some(tokenizers.swap_remove(i).tokenizer),
                None if name == "tokenizer" => context_tokenizer.take(),
                None => None,
            };
        let mut take = |name: &str| {
            components
                .iter()
                .position(|c| c.name.as_str() == name)
                .map(|i| components.swap_remove(i).model)
        };
        let text_encoder = take("text_encoder");
        let image_encoder = take("image_encoder");
        // A diffusers ONNX pipeline's decoder is its `vae_decoder`.
        let decoder = take("vae")
            .or_else(|| take("vae_decoder"))
            .ok_or_else(|| invalid("the pipeline has no `vae`".into()))?;
        let encoder = take("vae.encoder");
        let given = |component: &str| -> u_sdk::Result<Option<Value>> {
            let Some(c) = parts
                .configs
                .iter()
                .find(|c| c.component.as_str() == component)
            else {
                return Ok(None);
            };
            serde_json::from_str(&c.json)
                .map(Some)
                .map_err(|e| invalid(format!("the `{component}` configuration: {e}")))
        };
        let config = |component: &str| -> u_sdk::Result<Value> {
            given(component)?
                .ok_or_else(|| invalid(format!("no configuration of the `{component}`")))
        };
        let scheduler_config = config("scheduler")?.to_string();
        // Without a configuration (a diffusers ONNX pipeline), Stable Diffusion's scaling, as
        // `OnnxStableDiffusionPipeline` fixes it.
        let vae = given("vae")?.unwrap_or_default();
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
        let unet_config = unet.config().into_result()?;
        let denoiser = match (given("unet")?, given("transformer")?) {
            (Some(c), _) | (None, Some(c)) => c,
            (None, None) => Value::Null,
        };
        // A text encoder that fixes no length (an exported graph) reads prompts padded to the
        // tokenizer's `model_max_length`, as diffusers pads them.
        let max_length = given("tokenizer")?
            .and_then(|t| t["model_max_length"].as_u64())
            .filter(|&n| (2..=1 << 20).contains(&n))
            .map(|n| n as usize);
        let conditioner = match (text_encoder, image_encoder) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "the pipeline has both a text and an image encoder; one conditions it".into(),
                ));
            }
            (None, Some(encoder)) => {
                let config = encoder.config().into_result()?;
                let width = config.hidden as usize;
                let spec = match (config.kind, config.image.into_option()) {
                    (ModelKind::Encoder, Some(spec)) => spec,
                    _ => {
                        return Err(invalid(format!(
                            "the pipeline's image_encoder is a {:?} model (`{}`), not an image \
                             encoder",
                            config.kind, config.family
                        )));
                    }
                };
                if width != unet_config.context_shape[1] as usize {
                    return Err(invalid(format!(
                        "the image encoder embeds into {width} values; the denoiser \
                         cross-attends to rows of {}",
                        unet_config.context_shape[1]
                    )));
                }
                let spec = resized_as(spec, given("feature_extractor")?.as_ref())?;
                Conditioner::Image {
                    encoder,
                    spec,
                    width,
                }
            }
            (Some(encoder), None) => Conditioner::Text(prompting(
                encoder,
                &mut take,
                &mut tokenizer,
                (&denoiser, &unet_config),
                max_length,
            )?),
            (None, None) => {
                let classes = denoiser["num_embeds_ada_norm"]
                    .as_u64()
                    .filter(|n| (1..u64::from(u32::MAX)).contains(n))
                    .ok_or_else(|| {
                        invalid(
                            "the pipeline has no `text_encoder`, and its denoiser takes no \
                             class labels (its configuration states no `num_embeds_ada_norm`)"
                                .into(),
                        )
                    })? as u32;
                if unet_config.context_shape[1] != 0 {
                    return Err(invalid(format!(
                        "the pipeline has no `text_encoder`, but its denoiser cross-attends to \
                         rows of {}",
                        unet_config.context_shape[1]
                    )));
                }
                let names = label_names(given("model_index")?.as_ref(), classes)?;
                Conditioner::Class { classes, names }
            }
        };
        // A denoiser that also predicts its variance (DiT's learned sigma) writes twice the
        // channels: the prediction first.
        let (c, out) = (unet_spec.in_channels, unet_spec.out_channels);
        if decoder_spec.in_channels != c || (out != c && out != 2 * c) {
            return Err(invalid(format!(
                "the denoiser maps {c} to {out} channels; the vae decodes {}",
                decoder_spec.in_channels
            )));
        }
        let distilled = (denoiser["_class_name"].as_str() == Some(FLUX))
            .then(|| denoiser["guidance_embeds"].as_bool().unwrap_or(false));
        Ok(Pipeline {
            unet,
            unet_spec,
            conditioner,
            decoder,
            decoder_spec,
            encoder,
            scheduler_config,
            latents,
            distilled,
        })
    }

    /// Whether guidance is distilled into the denoiser (FLUX): one pass a step, no negative
    /// prompt, the scale read by the denoiser where it embeds one.
    pub fn guidance_distilled(&self) -> bool {
        self.distilled.is_some()
    }

    /// The scheduler of a `steps`-step run over latents of `size` (height, width): the μ of
    /// dynamic shifting from the latent tokens after patching, and for FLUX the σs its
    /// pipelines give, `linspace(1, 1/steps, steps)`.
    pub fn scheduler(
        &self,
        steps: u32,
        (h, w): (u32, u32),
    ) -> u_sdk::Result<Box<dyn u_diffusion::Scheduler>> {
        let bad = |e: u_diffusion::Error| invalid(e.to_string());
        let patch = self.unet_spec.multiple.max(1);
        let tokens = ((h / patch) * (w / patch)) as usize;
        let mu = u_diffusion::dynamic_mu(&self.scheduler_config, tokens).map_err(bad)?;
        let schedule = match self.distilled {
            Some(_) => {
                let n = steps as usize;
                let step = (1.0 / n as f64 - 1.0) / (n.max(2) - 1) as f64;
                let sigmas = (0..n)
                    .map(|i| match i + 1 == n && n > 1 {
                        true => 1.0 / n as f64,
                        false => 1.0 + i as f64 * step,
                    })
                    .collect();
                u_diffusion::Schedule::Sigmas(sigmas)
            }
            None => u_diffusion::Schedule::Steps(steps as usize),
        };
        u_diffusion::from_config_with(&self.scheduler_config, schedule, mu).map_err(bad)
    }

    /// Whether requests condition it on an image (an image-variation pipeline).
    pub fn varies_images(&self) -> bool {
        matches!(self.conditioner, Conditioner::Image { .. })
    }

    /// An image-variation pipeline's conditions for the image `bytes`: its embedding (one
    /// context row), and zeros for the unguided pass, as diffusers' pipeline makes them.
    pub fn encode_condition_image(
        &self,
        bytes: &[u8],
        max_pixels: u64,
    ) -> u_sdk::Result<(Condition, Condition)> {
        let Conditioner::Image {
            encoder,
            spec,
            width,
        } = &self.conditioner
        else {
            return Err(invalid("this pipeline is not conditioned on images".into()));
        };
        let image = crate::picture::decode(bytes, max_pixels)?;
        let pixels = u_image::preprocess(&image, spec)
            .map_err(|e| invalid(format!("the image to vary: {e}")))?;
        let input = [Segment::Image(ImageInput {
            pixels: RSlice::from_slice(&pixels),
            rows: spec.rows,
        })];
        let chunk = SeqChunk::tokens(0, &input, Output::Pooled(Pooling::Head));
        let embedding = forward(encoder, &[chunk], *width)?;
        let rows = |rows| {
            Condition::Text(Arc::new(Embedded {
                rows,
                pooled: Vec::new(),
            }))
        };
        Ok((rows(embedding), rows(vec![0.0; *width])))
    }

    /// For a class-conditioned pipeline, its class count (also its null label); `None` for a
    /// text-conditioned one.
    pub fn classes(&self) -> Option<u32> {
        match &self.conditioner {
            Conditioner::Class { classes, .. } => Some(*classes),
            Conditioner::Text { .. } | Conditioner::Image { .. } => None,
        }
    }

    /// The class a request of a class-conditioned pipeline asks for: its one `conditioning`
    /// value, or the label its `prompt` names (`id2label`), not both.
    pub fn class_of(&self, prompt: &str, conditioning: &[f32]) -> u_sdk::Result<u32> {
        let Conditioner::Class { classes, names } = &self.conditioner else {
            return Err(invalid(
                "this pipeline is not conditioned on classes".into(),
            ));
        };
        match (prompt.trim(), conditioning) {
            ("", [label]) if label.fract() == 0.0 && (0.0..*classes as f32).contains(label) => {
                Ok(*label as u32)
            }
            ("", []) => Err(invalid(format!(
                "a class-conditioned pipeline needs a class: one conditioning value in \
                 0..{classes}, or a prompt naming a label"
            ))),
            ("", other) => Err(invalid(format!(
                "the conditioning is one class label in 0..{classes}; given {other:?}"
            ))),
            (name, []) => names
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, label)| *label)
                .ok_or_else(|| {
                    invalid(format!(
                        "no class is named {name:?} (`id2label` names {} labels)",
                        names.len()
                    ))
                }),
            (_, _) => Err(invalid(
                "give a class either as the conditioning or as the prompt, not both".into(),
            )),
        }
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

    /// The image side the pipeline was trained at (its default; 512, diffusers' ONNX
    /// pipelines' default, for a denoiser that states none).
    pub fn default_side(&self) -> u32 {
        match self.unet_spec.sample_size {
            0 => 512,
            side => side * self.vae_scale(),
        }
    }

    /// Whether it can start from an image (it has the autoencoder's encoder).
    pub fn encodes_images(&self) -> bool {
        self.encoder.is_some()
    }

    /// The scale between the autoencoder's latents and the denoiser's.
    pub fn latent_scale(&self) -> LatentScale {
        self.latents
    }

    /// The pipeline's prompting, or why it has none.
    fn prompting(&self) -> u_sdk::Result<&Prompting> {
        match &self.conditioner {
            Conditioner::Text(p) => Ok(p),
            Conditioner::Class { .. } | Conditioner::Image { .. } => Err(UError::unsupported(
                "runner-image: this pipeline is conditioned on class labels or images; it has no \
                 text encoder or tokenizer",
            )),
        }
    }

    /// The token ids of `prompt` as the pipeline feeds them to its (first) text encoder: with
    /// its special tokens, cut to the encoder's positions (keeping the end token), padded to
    /// them.
    pub fn tokens(&self, prompt: &str) -> u_sdk::Result<Vec<u32>> {
        self.prompting()?.first().tokens(prompt)
    }

    /// What `prompt` conditions the denoiser on: the text encoders' rows (and the pooled text
    /// where the denoiser reads one).
    pub fn encode_prompt(&self, prompt: &str) -> u_sdk::Result<Embedded> {
        self.prompting()?.embed(prompt)
    }

    /// The guided prediction at timestep `t` for `latents` (`[channels, h, w]`, scaled for the
    /// step): the denoiser on condition `cond` and, when guided, on `uncond` in the same pass
    /// (uncond first, as diffusers' text pipelines batch them), `uncond + g · (cond − uncond)`.
    /// Text contexts go under the sequence ids `contexts` (prompt, negative prompt), where the
    /// UNet keeps their cross-attention keys and values for the next step. A learned variance
    /// (DiT's second half of the channels) is dropped, as `DiTPipeline` drops it. A
    /// guidance-distilled denoiser (FLUX) runs once, reading the scale itself.
    pub fn denoise(
        &self,
        latents: &[f32],
        size: (u32, u32),
        t: f32,
        (cond, uncond): (&Condition, Option<&Condition>),
        guidance: f32,
        contexts: [SeqId; 2],
    ) -> u_sdk::Result<Vec<f32>> {
        let c = self.channels();
        let input = [Segment::Planes(planes(latents, c, size))];
        let n = latents.len();
        let written = n / c as usize * self.unet_spec.out_channels as usize;
        let values = match (self.distilled, cond) {
            // FLUX reads σ (the timestep over 1000), the guidance scale where it embeds one,
            // then the pooled text.
            (Some(embeds), Condition::Text(e)) => std::iter::once(t / 1000.0)
                .chain(embeds.then_some(guidance))
                .chain(e.pooled.iter().copied())
                .collect(),
            _ => conditioning(t, cond),
        };
        match uncond {
            None => {
                let chunk = denoiser_chunk(&input, &values, (contexts[0], cond));
                let mut out = forward(&self.unet, &[chunk], written)?;
                out.truncate(n);
                Ok(out)
            }
            Some(uncond) => {
                let null = conditioning(t, uncond);
                let pair = [
                    denoiser_chunk(&input, &null, (contexts[1], uncond)),
                    denoiser_chunk(&input, &values, (contexts[0], cond)),
                ];
                let both = forward(&self.unet, &pair, 2 * written)?;
                let (u, p) = (&both[..n], &both[written..written + n]);
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
