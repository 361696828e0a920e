//! The networks as models of the ABI: each chunk of a batch is one feature map
//! ([`Segment::Planes`]) asking for the network's output map ([`Output::Planes`]); the UNet
//! also takes its timestep as the chunk's conditioning (one value) and the text encoder's rows
//! as its cross-attention context ([`u_sdk::CrossContext`]); the DiT its timestep and class
//! label as the conditioning (two values).
//!
//! The UNet keeps the keys and values its cross-attentions read from a context under the
//! context's `kv` sequence, for the [`CROSS_CONTEXTS`] most recent ones (a guided sample uses
//! two): every step of a sample reuses them instead of projecting the same rows again. A
//! context given again is compared bit for bit with the one kept (a different one replaces
//! it); a context sent empty uses the one kept. Nothing else is kept between passes.

use crate::{
    config::{UnetConfig, VaeConfig},
    dit::Dit,
    flux::Flux,
    mmdit::Sd3Transformer,
    unet::{CrossKeysValues, Unet2dCondition},
    vae::{VaeDecoder, VaeEncoder},
};
use abi_stable::std_types::ROption;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use u_sdk::{
    AttentionMask, ModelConfig, ModelKind, Output, PlaneSpec, Planes, Pooling, Result, Segment,
    SeqChunk, SeqId, UError,
    nn::{Device, Tensor},
};

/// The largest output map a pass writes, in pixels (4096 × 4096): a bound on the memory one
/// request can ask for, far above what the networks were trained at.
pub const MAX_PIXELS: u64 = 4096 * 4096;

/// The latent side FLUX.1 was trained at (1024-pixel images); its configuration states none.
const FLUX_SAMPLE_SIZE: u32 = 128;

/// Contexts whose cross-attention keys and values the UNet keeps.
pub const CROSS_CONTEXTS: usize = 4;

/// A context's cross-attention keys and values, and the context itself (its bits).
struct KeptContext {
    kv: SeqId,
    bits: Vec<u32>,
    keys_values: Arc<CrossKeysValues>,
}

/// Which network a model runs.
pub enum Network {
    /// `AutoencoderKL`'s decoder: latents to pixels.
    Decoder(VaeDecoder),
    /// `AutoencoderKL`'s encoder: pixels to the latent's mean and log variance.
    Encoder(VaeEncoder),
    /// `UNet2DConditionModel`: noisy latents to the prediction.
    Unet(Unet2dCondition),
    /// `DiTTransformer2DModel`: noisy latents and a class to the prediction.
    Dit(Dit),
    /// `SD3Transformer2DModel`: noisy latents, the pooled text and the text rows to the
    /// prediction.
    Sd3(Sd3Transformer),
    /// `FluxTransformer2DModel`: as SD3's, with a guidance scale.
    Flux(Flux),
}

/// A network built on a device.
pub struct DiffusionModel {
    network: Network,
    family: String,
    device: Device,
    /// The UNet's kept contexts, most recent last.
    contexts: Mutex<VecDeque<KeptContext>>,
}

/// What one chunk asks for, checked.
struct Job<'a> {
    planes: Planes<'a>,
    out_size: (u32, u32),
    wanted: bool,
    timestep: f32,
    label: usize,
    guidance: f32,
    pooled: &'a [f32],
    context: &'a [f32],
    kv: SeqId,
}

impl DiffusionModel {
    /// `network`, known as `family`, computing on `device`.
    pub fn new(network: Network, family: &str, device: Device) -> Self {
        Self {
            network,
            family: family.to_string(),
            device,
            contexts: Mutex::new(VecDeque::new()),
        }
    }

    /// What the maps it reads and writes are.
    pub fn spec(&self) -> PlaneSpec {
        let spec = |vae: &VaeConfig, decode: bool| {
            let s = vae.scale();
            match decode {
                true => PlaneSpec {
                    in_channels: vae.latent_channels as u32,
                    out_channels: vae.out_channels as u32,
                    scale: [s, 1],
                    multiple: 1,
                    sample_size: vae.sample_size as u32 / s,
                },
                false => PlaneSpec {
                    in_channels: vae.in_channels as u32,
                    out_channels: 2 * vae.latent_channels as u32,
                    scale: [1, s],
                    multiple: s,
                    sample_size: vae.sample_size as u32,
                },
            }
        };
        match &self.network {
            Network::Decoder(d) => spec(d.config(), true),
            Network::Encoder(e) => spec(e.config(), false),
            Network::Unet(u) => PlaneSpec {
                in_channels: u.config().in_channels as u32,
                out_channels: u.config().out_channels as u32,
                scale: [1, 1],
                multiple: u.config().multiple(),
                sample_size: u.config().sample_size as u32,
            },
            Network::Dit(d) => PlaneSpec {
                in_channels: d.config().in_channels as u32,
                out_channels: d.config().out_channels as u32,
                scale: [1, 1],
                multiple: d.config().patch as u32,
                sample_size: d.config().sample_size as u32,
            },
            Network::Sd3(s) => PlaneSpec {
                in_channels: s.config().in_channels as u32,
                out_channels: s.config().out_channels as u32,
                scale: [1, 1],
                multiple: s.config().patch as u32,
                sample_size: s.config().sample_size as u32,
            },
            Network::Flux(f) => PlaneSpec {
                in_channels: f.config().in_channels as u32 / 4,
                out_channels: f.config().out_channels as u32 / 4,
                scale: [1, 1],
                multiple: 2,
                sample_size: FLUX_SAMPLE_SIZE,
            },
        }
    }

    fn unet_config(&self) -> Option<&UnetConfig> {
        match &self.network {
            Network::Unet(u) => Some(u.config()),
            _ => None,
        }
    }

    /// What the ABI says of it.
    pub fn model_config(&self) -> ModelConfig {
        let spec = self.spec();
        let (kind, layers, context) = match &self.network {
            Network::Decoder(d) => (
                ModelKind::Autoencoder,
                d.config().block_out_channels.len(),
                0,
            ),
            Network::Encoder(e) => (
                ModelKind::Autoencoder,
                e.config().block_out_channels.len(),
                0,
            ),
            Network::Unet(u) => (
                ModelKind::Denoiser,
                u.config().down.len(),
                u.config().cross_attention_dim,
            ),
            Network::Dit(d) => (ModelKind::Denoiser, d.config().layers, 0),
            Network::Sd3(s) => (
                ModelKind::Denoiser,
                s.config().layers,
                s.config().context_width,
            ),
            Network::Flux(f) => (
                ModelKind::Denoiser,
                f.config().layers + f.config().single_layers,
                f.config().context_width,
            ),
        };
        ModelConfig {
            kind,
            family: self.family.as_str().into(),
            vocab_size: 0,
            hidden: spec.in_channels,
            layers: layers as u32,
            context_length: 0,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Mean,
            context_shape: [0, context as u32],
            image: ROption::RNone,
            image_token: u_sdk::NO_IMAGE_TOKEN,
            planes: ROption::RSome(spec),
        }
    }

    /// Checks one chunk against the model.
    fn job<'a>(&self, chunk: &SeqChunk<'a>, spec: &PlaneSpec) -> Result<Job<'a>> {
        let bad = |why: String| {
            UError::invalid(format!(
                "arch-diffusion: {} (sequence {}): {why}",
                self.family, chunk.seq
            ))
        };
        let [Segment::Planes(planes)] = chunk.input.as_slice() else {
            return Err(bad(
                "a chunk is one feature map (`Segment::Planes`), nothing else".into(),
            ));
        };
        let wanted = match chunk.output {
            Output::Planes => true,
            Output::Nothing => false,
            other => {
                return Err(UError::unsupported(format!(
                    "arch-diffusion: {} writes feature maps (`Output::Planes`), not {other:?}",
                    self.family
                )));
            }
        };
        let out_size = planes.check(spec).map_err(|e| bad(e.message.to_string()))?;
        if u64::from(out_size.0) * u64::from(out_size.1) > MAX_PIXELS {
            return Err(bad(format!(
                "a {}×{} output is larger than {MAX_PIXELS} pixels",
                out_size.0, out_size.1
            )));
        }
        let x = &chunk.extras;
        if !x.adapters.is_empty() || !x.steering.is_empty() {
            return Err(UError::unsupported(
                "arch-diffusion: adapters and steering vectors are not applied to these networks",
            ));
        }
        let (mut label, mut timestep, mut pooled, mut guidance) = (0, 0.0, &[][..], 0.0);
        let (context, kv) = match (&self.network, self.unet_config()) {
            (Network::Flux(f), _) => {
                let cfg = f.config();
                let c = x.conditioning.as_slice();
                if c.len() != cfg.conditioning() || c.iter().any(|v| !v.is_finite()) {
                    return Err(bad(format!(
                        "the conditioning is the timestep, {}then the pooled text ({} values): \
                         {} finite values; given {}",
                        if cfg.guidance {
                            "the guidance scale, "
                        } else {
                            ""
                        },
                        cfg.pooled_width,
                        cfg.conditioning(),
                        c.len()
                    )));
                }
                let head = 1 + usize::from(cfg.guidance);
                (timestep, guidance, pooled) = (c[0], c[head - 1], &c[head..]);
                match x.cross.as_ref() {
                    ROption::RSome(ctx)
                        if !ctx.rows.is_empty()
                            && ctx.rows.len().is_multiple_of(cfg.context_width) =>
                    {
                        (ctx.rows.as_slice(), ctx.kv)
                    }
                    _ => {
                        return Err(bad(format!(
                            "the context is the text rows, each {} values; none or a partial \
                             row given",
                            cfg.context_width
                        )));
                    }
                }
            }
            (Network::Sd3(s), _) => {
                let cfg = s.config();
                (timestep, pooled) = match x.conditioning.as_slice().split_first() {
                    Some((t, p)) if t.is_finite() && p.len() == cfg.pooled_width => (*t, p),
                    _ => {
                        return Err(bad(format!(
                            "the conditioning is the timestep, then the pooled text ({} values); \
                             given {} values",
                            cfg.pooled_width,
                            x.conditioning.len()
                        )));
                    }
                };
                match x.cross.as_ref() {
                    ROption::RSome(c)
                        if !c.rows.is_empty() && c.rows.len().is_multiple_of(cfg.context_width) =>
                    {
                        (c.rows.as_slice(), c.kv)
                    }
                    _ => {
                        return Err(bad(format!(
                            "the context is the text rows, each {} values; none or a partial \
                             row given",
                            cfg.context_width
                        )));
                    }
                }
            }
            (Network::Dit(dit), _) => {
                let classes = dit.config().classes;
                (timestep, label) = match x.conditioning.as_slice() {
                    [t, y]
                        if t.is_finite()
                            && y.fract() == 0.0
                            && (0.0..=classes as f32).contains(y) =>
                    {
                        (*t, *y as usize)
                    }
                    other => {
                        return Err(bad(format!(
                            "the conditioning is the timestep and a class label in 0..={classes} \
                             ({classes}: none), given {other:?}"
                        )));
                    }
                };
                if x.cross.is_some() {
                    return Err(bad("a DiT takes no cross-attention context".into()));
                }
                (&[][..], 0)
            }
            (_, None) if x.conditioning.is_empty() && x.cross.is_none() => (&[][..], 0),
            (_, None) => {
                return Err(UError::unsupported(format!(
                    "arch-diffusion: {} takes no conditioning or context",
                    self.family
                )));
            }
            (_, Some(cfg)) => {
                let width = cfg.cross_attention_dim;
                timestep = match x.conditioning.as_slice() {
                    [t] if t.is_finite() => *t,
                    other => {
                        return Err(bad(format!(
                            "the conditioning is the timestep, one finite value (given {} values)",
                            other.len()
                        )));
                    }
                };
                let (context, kv) = match x.cross.as_ref() {
                    ROption::RSome(c) if c.rows.len().is_multiple_of(width) => {
                        (c.rows.as_slice(), c.kv)
                    }
                    ROption::RSome(c) => {
                        return Err(bad(format!(
                            "the context is rows of {width} (the text encoder's output), not {} \
                             values",
                            c.rows.len()
                        )));
                    }
                    ROption::RNone => {
                        return Err(bad(
                            "the UNet cross-attends to a context (the text encoder's rows); \
                             none given"
                                .into(),
                        ));
                    }
                };
                (context, kv)
            }
        };
        Ok(Job {
            planes: *planes,
            out_size,
            wanted,
            timestep,
            label,
            guidance,
            pooled,
            context,
            kv,
        })
    }

    /// The cross-attention keys and values of context `kv` with `rows` (empty: the kept
    /// one's), kept for later steps.
    fn cross(
        &self,
        unet: &Unet2dCondition,
        kv: SeqId,
        rows: &[f32],
    ) -> Result<Arc<CrossKeysValues>> {
        let bits: Vec<u32> = rows.iter().map(|v| v.to_bits()).collect();
        let mut kept = self.contexts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = kept.iter().position(|c| c.kv == kv) {
            if rows.is_empty() || kept[i].bits == bits {
                let hit = kept.remove(i).expect("position is in range");
                let keys_values = hit.keys_values.clone();
                kept.push_back(hit);
                return Ok(keys_values);
            }
            kept.remove(i);
        }
        if rows.is_empty() {
            return Err(UError::invalid(format!(
                "arch-diffusion: context {kv} holds no keys and values: send its rows"
            )));
        }
        let width = unet.config().cross_attention_dim;
        let context = self
            .device
            .from_f32(rows, &[(rows.len() / width) as u64, width as u64])?;
        let keys_values = Arc::new(unet.cross_keys_values(&context)?);
        kept.push_back(KeptContext {
            kv,
            bits,
            keys_values: keys_values.clone(),
        });
        while kept.len() > CROSS_CONTEXTS {
            kept.pop_front();
        }
        Ok(keys_values)
    }

    fn run(&self, job: &Job<'_>) -> Result<Tensor> {
        let p = &job.planes;
        let x = self.device.from_f32(
            &p.values,
            &[p.channels.into(), p.height.into(), p.width.into()],
        )?;
        match &self.network {
            Network::Decoder(d) => d.forward(&x),
            Network::Encoder(e) => e.forward(&x),
            Network::Unet(u) => {
                let cross = self.cross(u, job.kv, job.context)?;
                u.forward(&x, job.timestep, &cross)
            }
            Network::Dit(d) => d.forward(&x, job.timestep, job.label),
            Network::Sd3(s) => {
                let width = s.config().context_width;
                let rows = (job.context.len() / width) as u64;
                let context = self.device.from_f32(job.context, &[rows, width as u64])?;
                s.forward(&x, job.timestep, job.pooled, &context)
            }
            Network::Flux(f) => {
                let width = f.config().context_width;
                let rows = (job.context.len() / width) as u64;
                let context = self.device.from_f32(job.context, &[rows, width as u64])?;
                f.forward(&x, (job.timestep, job.guidance), job.pooled, &context)
            }
        }
    }

    /// Runs every chunk of `batch`, writing the maps they ask for into `out` in batch order
    /// (see [`u_sdk::Model::forward`]); every chunk is checked before any runs.
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let spec = self.spec();
        let jobs = batch
            .iter()
            .map(|c| self.job(c, &spec))
            .collect::<Result<Vec<_>>>()?;
        let floats = |j: &Job<'_>| {
            usize::from(j.wanted)
                * spec.out_channels as usize
                * j.out_size.0 as usize
                * j.out_size.1 as usize
        };
        let total: usize = jobs.iter().map(floats).sum();
        if out.len() != total {
            return Err(UError::invalid(format!(
                "arch-diffusion: the batch writes {total} floats into a buffer of {}",
                out.len()
            )));
        }
        let mut at = 0;
        for job in jobs.iter().filter(|j| j.wanted) {
            let n = floats(job);
            let y = self.run(job)?;
            let want = [
                u64::from(spec.out_channels),
                u64::from(job.out_size.0),
                u64::from(job.out_size.1),
            ];
            if y.dims() != want {
                return Err(UError::invalid(format!(
                    "arch-diffusion: {} made a {:?} map where {want:?} was due",
                    self.family,
                    y.dims()
                )));
            }
            y.read_into(&mut out[at..at + n])?;
            at += n;
        }
        Ok(())
    }
}
