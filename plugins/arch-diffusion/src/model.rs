//! The networks as models of the ABI: each chunk of a batch is one feature map
//! ([`Segment::Planes`]) asking for the network's output map ([`Output::Planes`]); the UNet
//! also takes its timestep as the chunk's conditioning (one value) and the text encoder's rows
//! as its cross-attention context. Nothing is kept between passes.

use crate::{
    config::{UnetConfig, VaeConfig},
    unet::Unet2dCondition,
    vae::{VaeDecoder, VaeEncoder},
};
use abi_stable::std_types::ROption;
use u_sdk::{
    AttentionMask, ModelConfig, ModelKind, Output, PlaneSpec, Planes, Pooling, Result, Segment,
    SeqChunk, UError,
    nn::{Device, Tensor},
};

/// The largest output map a pass writes, in pixels (4096 × 4096): a bound on the memory one
/// request can ask for, far above what the networks were trained at.
pub const MAX_PIXELS: u64 = 4096 * 4096;

/// Which network a model runs.
pub enum Network {
    /// `AutoencoderKL`'s decoder: latents to pixels.
    Decoder(VaeDecoder),
    /// `AutoencoderKL`'s encoder: pixels to the latent's mean and log variance.
    Encoder(VaeEncoder),
    /// `UNet2DConditionModel`: noisy latents to the prediction.
    Unet(Unet2dCondition),
}

/// A network built on a device.
pub struct DiffusionModel {
    network: Network,
    family: String,
    device: Device,
}

/// What one chunk asks for, checked.
struct Job<'a> {
    planes: Planes<'a>,
    out_size: (u32, u32),
    wanted: bool,
    timestep: f32,
    context: &'a [f32],
}

impl DiffusionModel {
    /// `network`, known as `family`, computing on `device`.
    pub fn new(network: Network, family: &str, device: Device) -> Self {
        Self {
            network,
            family: family.to_string(),
            device,
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
        let (timestep, context) = match self.unet_config() {
            None if x.conditioning.is_empty() && x.cross.is_none() => (0.0, &[][..]),
            None => {
                return Err(UError::unsupported(format!(
                    "arch-diffusion: {} takes no conditioning or context",
                    self.family
                )));
            }
            Some(cfg) => {
                let width = cfg.cross_attention_dim;
                let timestep = match x.conditioning.as_slice() {
                    [t] if t.is_finite() => *t,
                    other => {
                        return Err(bad(format!(
                            "the conditioning is the timestep, one finite value (given {} values)",
                            other.len()
                        )));
                    }
                };
                let context = match x.cross.as_ref() {
                    ROption::RSome(c)
                        if !c.rows.is_empty() && c.rows.len().is_multiple_of(width) =>
                    {
                        c.rows.as_slice()
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
                (timestep, context)
            }
        };
        Ok(Job {
            planes: *planes,
            out_size,
            wanted,
            timestep,
            context,
        })
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
                let width = u.config().cross_attention_dim;
                let rows = (job.context.len() / width) as u64;
                let context = self.device.from_f32(job.context, &[rows, width as u64])?;
                u.forward(&x, job.timestep, &context)
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
