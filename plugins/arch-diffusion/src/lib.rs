//! # u-arch-diffusion — the networks of latent diffusion as a U architecture plugin
//!
//! Latent diffusion (Rombach et al. 2022, *High-Resolution Image Synthesis with Latent
//! Diffusion Models*, arXiv:2112.10752) denoises in the latent space of an autoencoder. This
//! plugin builds its networks from diffusers component folders (`config.json` +
//! `diffusion_pytorch_model.safetensors`, read by loader-safetensors):
//!
//! - `AutoencoderKL` ([`vae`]): family `AutoencoderKL` is its **decoder** (a latent map in,
//!   pixels out, as `vae.decode(z).sample`), family `AutoencoderKL.encoder` its **encoder**
//!   (pixels in, the latent's mean and log variance out, as `quant_conv(encoder(x))`, for
//!   img2img). Both are [`u_sdk::ModelKind::Autoencoder`] models.
//! - `UNet2DConditionModel` ([`unet`]): noisy latents, the timestep (the chunk's conditioning,
//!   one value) and the text encoder's rows (its cross-attention context) in, the prediction
//!   out, as `unet(x, t, context).sample`. A [`u_sdk::ModelKind::Denoiser`].
//! - `DiTTransformer2DModel` ([`dit`]): noisy latents, the timestep and a class label (the
//!   chunk's conditioning, two values) in, the prediction out. A denoiser too.
//! - `SD3Transformer2DModel` ([`mmdit`], Stable Diffusion 3's MMDiT): noisy latents, the
//!   timestep and the pooled text (the conditioning: the timestep, then the pooled values) and
//!   the text rows (the cross-attention context) in, the prediction out. A denoiser.
//! - `FluxTransformer2DModel` ([`flux`], FLUX.1): as SD3's, with the guidance scale after the
//!   timestep in the conditioning of a guidance-distilled model; it packs the latent's 2×2
//!   patches into rows itself. A denoiser.
//!
//! The UNet and the autoencoder are also read from a single-file checkpoint in Stable
//! Diffusion's original layout ([`ldm`]), given the component's `config.json` beside it.
//!
//! Maps travel as [`u_sdk::Segment::Planes`] and come back as [`u_sdk::Output::Planes`],
//! channels first, sized as [`u_sdk::ModelConfig::planes`] says. The schedulers and the
//! sampling loop are not the networks' business: they live in the `u-diffusion` crate.
//!
//! Reference implementation: Hugging Face `diffusers` (`autoencoder_kl.py`, `vae.py`,
//! `unet_2d_condition.py`, `unet_2d_blocks.py`, `resnet.py`, `transformer_2d.py`,
//! `attention.py`), against which `tests/` checks tiny random-weight components
//! (`tests/fixtures/diffusion_tiny/` at the workspace root).
//!
//! Layout: [`config`] (hyper-parameters), [`layers`] (convolution, linear, norms),
//! [`ldm`] (single-file names), [`blocks`] (`ResnetBlock2D`, the resamplers, attention, `Transformer2D`), [`vae`],
//! [`unet`], [`dit`], [`mmdit`], [`flux`], [`model`] (the ABI's view: chunks checked, maps in and out), and the plugin glue
//! below. Compute goes through the backend interface (`u_sdk::nn` tensors).
#![deny(missing_docs)]

pub mod blocks;
pub mod config;
pub mod dit;
pub mod flux;
pub mod layers;
pub mod ldm;
pub mod mmdit;
pub mod model;
pub mod unet;
pub mod vae;

pub use config::{DitConfig, FluxConfig, Sd3Config, UnetConfig, VaeConfig};
pub use model::{DiffusionModel, Network};

use abi_stable::std_types::{RResult, RString, RVec};
use layers::Weights;
use ldm::Renamed;
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, ModelBox, ModelConfig,
    PluginInfo, PluginInstance, SeqChunk, UError, WeightSetBox,
    encoder::{Encoder, EncoderModel},
    nn::Device,
};

/// The family of an `AutoencoderKL`'s decoder (diffusers' class name).
pub const VAE_DECODER: &str = "AutoencoderKL";
/// The family of an `AutoencoderKL`'s encoder.
pub const VAE_ENCODER: &str = "AutoencoderKL.encoder";
/// The family of a `UNet2DConditionModel`.
pub const UNET: &str = "UNet2DConditionModel";
/// The family of a class-conditioned `DiTTransformer2DModel`.
pub const DIT: &str = "DiTTransformer2DModel";
/// The family of Stable Diffusion 3's `SD3Transformer2DModel` (MMDiT).
pub const SD3: &str = "SD3Transformer2DModel";
/// The family of FLUX.1's `FluxTransformer2DModel`.
pub const FLUX: &str = "FluxTransformer2DModel";

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "Latent diffusion networks: AutoencoderKL (decoder and encoder) and \
                  UNet2DConditionModel"
            .into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-diffusion", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        DiffusionArchitecture,
    )))
}

/// The exported root module and embedded manifest.
mod export {
    u_sdk::export_plugin! {
        manifest: "plugin.toml",
        describe: super::describe,
        instantiate: super::instantiate,
    }
}

/// The `architecture` entry object.
#[derive(Clone, Copy, Debug, Default)]
pub struct DiffusionArchitecture;

impl DiffusionArchitecture {
    /// Builds the network of `family` from the component `weights` on `backend` (what
    /// [`Architecture::build`] does, for Rust callers such as tests).
    pub fn load(
        &self,
        weights: WeightSetBox,
        backend: BackendBox,
        family: &str,
    ) -> u_sdk::Result<ModelBox> {
        let device = Device::new(backend)?;
        let w = Weights::new(&weights, device.clone());
        let network = match family {
            VAE_DECODER | VAE_ENCODER => {
                let cfg = VaeConfig::from_weights(&weights)?;
                let w = w.renamed(Renamed::vae(&weights, &cfg)?);
                match family {
                    VAE_DECODER => Network::Decoder(vae::VaeDecoder::load(&w, &cfg)?),
                    _ => Network::Encoder(vae::VaeEncoder::load(&w, &cfg)?),
                }
            }
            UNET => {
                let cfg = UnetConfig::from_weights(&weights)?;
                let w = w.renamed(Renamed::unet(&weights, &cfg)?);
                Network::Unet(unet::Unet2dCondition::load(&w, &cfg)?)
            }
            DIT => Network::Dit(dit::Dit::load(&w, &DitConfig::from_weights(&weights)?)?),
            SD3 => Network::Sd3(mmdit::Sd3Transformer::load(
                &w,
                &Sd3Config::from_weights(&weights)?,
            )?),
            FLUX => Network::Flux(flux::Flux::load(&w, &FluxConfig::from_weights(&weights)?)?),
            other => {
                return Err(UError::unsupported(format!(
                    "arch-diffusion builds {VAE_DECODER}, {VAE_ENCODER}, {UNET}, {DIT}, {SD3} \
                     and {FLUX}, not `{other}`"
                )));
            }
        };
        Ok(EncoderModel::boxed(DiffusionModel::new(
            network, family, device,
        )))
    }
}

impl Architecture for DiffusionArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        self.load(context.weights, backend, &context.family).into()
    }

    fn gguf_view(&self, _weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError> {
        RResult::RErr(UError::unsupported(format!(
            "arch-diffusion: llama.cpp has no GGUF layout for a {family}"
        )))
    }
}

impl Encoder for DiffusionModel {
    const PLUGIN: &'static str = "arch-diffusion";

    fn model_config(&self) -> ModelConfig {
        DiffusionModel::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        DiffusionModel::forward(self, batch, out)
    }
}
