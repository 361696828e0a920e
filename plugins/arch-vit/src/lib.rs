//! # u-arch-vit — Vision Transformer encoders as a U architecture plugin
//!
//! The Vision Transformer (Dosovitskiy et al. 2020, *An Image is Worth 16x16 Words*,
//! arXiv:2010.11929) and the towers built on it: CLIP's (Radford et al. 2021, arXiv:2103.00020),
//! SigLIP's (Zhai et al. 2023, arXiv:2303.15343) and DINOv2 (Oquab et al. 2023,
//! arXiv:2304.07193). An image is cut into square patches, each projected to a row; a class
//! token (not SigLIP's) is prepended and learned positions added; pre-norm blocks of
//! bidirectional multi-head self-attention and an MLP follow (DINOv2 scales each branch per
//! channel). A model of the **encoder** kind: each chunk is one image ([`u_sdk::Segment::Image`],
//! preprocessed as the model's [`u_sdk::ImageSpec`] says), answered as hidden states after any
//! block, or pooled — the family's own head ([`u_sdk::Pooling::Head`]: ViT's tanh pooler, CLIP's
//! normed class row, SigLIP's attention pooling, DINOv2's normed class row), the class row or
//! the mean.
//!
//! It also builds LLaVA's image encoder ([`llava`], family `llava.vision`): from a checkpoint
//! whose `model_type` is `llava`, the CLIP or SigLIP tower of its `vision_config` and the
//! multi-modal projector, giving each image as rows of the language model's width for the
//! decoder (family `llava`, built by another plugin from the same weights) to read where its
//! image tokens stand.
//!
//! And CLIP's image embedding ([`clip`], family `clip.vision`): from a full CLIP checkpoint
//! (`model_type` `clip`), the tower of its `vision_config` and `visual_projection`, giving each
//! image's vector in the joint image-text space whose text side (family `clip`) another plugin
//! builds from the same weights. A CLIP tower saved alone with its projection
//! (`CLIPVisionModelWithProjection`, family `clip_vision_model` with a `visual_projection`)
//! gives the same projected vector.
//!
//! And IDEFICS's image encoder ([`idefics`], family `idefics.vision`): from a checkpoint whose
//! `model_type` is `idefics` (Flamingo's open reproduction), the CLIP tower of its
//! `vision_config` and, where `use_resampler` is set, the Perceiver resampler, giving each image
//! as the context rows the cross-attention decoder (family `idefics`, built by another plugin
//! from the same weights) reads.
//!
//! Reference implementation: Hugging Face `transformers` (`modeling_vit.py`,
//! `modeling_clip.py`, `modeling_siglip.py`, `modeling_dinov2.py`, `modeling_llava.py`, IDEFICS' `vision.py` and `perceiver.py`),
//! against which `tests/` checks tiny random-weight towers of every family, a tiny LLaVA and a
//! tiny CLIP and two tiny IDEFICS.
//!
//! Layout: [`config`] (hyper-parameters and the image processor's settings), [`naming`] (each
//! family's tensor names), [`model`] (`PatchEmbedding`, `SelfAttention`, `Mlp`, `Block`,
//! `AttentionPool`, `VisionTransformer`), [`llava`] (`Projector`, `LlavaVision`), [`clip`]
//! (`ClipVision`), [`idefics`] (`PerceiverAttention`, `PerceiverMlp`, `PerceiverBlock`,
//! `Resampler`, `IdeficsVision`), and the plugin glue below. Compute goes through the backend interface (`u_sdk::nn` tensors).
#![deny(missing_docs)]

pub mod clip;
pub mod config;
pub mod idefics;
pub mod interpolate;
pub mod llava;
pub mod model;
pub mod naming;

pub use clip::ClipVision;
pub use config::{Config, Family};
pub use idefics::IdeficsVision;
pub use llava::LlavaVision;
pub use model::VisionTransformer;

use abi_stable::std_types::{RResult, RString, RVec};
use u_sdk::{
    Architecture, ArchitectureBox, BackendBox, BuildContext, HostBox, ModelBox, ModelConfig,
    PluginInfo, PluginInstance, SeqChunk, UError, WeightSetBox,
    encoder::{Encoder, EncoderModel},
    nn::Device,
};

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "Vision Transformer encoders: ViT, CLIP and SigLIP vision towers, DINOv2".into(),
        details: RVec::new(),
    }
}

/// Creates the architecture object (the root module's `instantiate`); it takes no settings.
pub fn instantiate(host: HostBox) -> u_sdk::Result<PluginInstance> {
    u_sdk::settings::none(&host, "arch-vit", "plugin")?;
    Ok(PluginInstance::Architecture(ArchitectureBox::new(
        VitArchitecture,
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
pub struct VitArchitecture;

impl VitArchitecture {
    /// Builds the tower in `weights` on `backend` (what [`Architecture::build`] does, for Rust
    /// callers such as tests).
    pub fn load(&self, weights: WeightSetBox, backend: BackendBox) -> u_sdk::Result<ModelBox> {
        if clip::is_clip(&weights) || clip::is_projected_tower(&weights) {
            return Ok(EncoderModel::boxed(ClipVision::load(
                &weights,
                Device::new(backend)?,
            )?));
        }
        if idefics::is_idefics(&weights) {
            return Ok(EncoderModel::boxed(IdeficsVision::load(
                &weights,
                Device::new(backend)?,
            )?));
        }
        if llava::is_llava(&weights) {
            return Ok(EncoderModel::boxed(LlavaVision::load(
                &weights,
                Device::new(backend)?,
            )?));
        }
        let cfg = Config::from_weights(&weights)?;
        let spec = config::image_spec(&weights, &cfg)?;
        let cfg = Config {
            input_size: spec.height as usize,
            ..cfg
        };
        let names = naming::Names::new(&weights, cfg.family, Device::new(backend)?)?;
        Ok(EncoderModel::boxed(VisionTransformer::load(
            &names, cfg, spec,
        )?))
    }
}

impl Architecture for VitArchitecture {
    fn build(&self, context: BuildContext) -> RResult<ModelBox, UError> {
        let backend = context.compute_backend();
        if context.family.as_str() == llava::FAMILY && !llava::is_llava(&context.weights) {
            return RResult::RErr(UError::invalid(format!(
                "arch-vit: family {} is the image encoder of a checkpoint whose model_type is \
                 `{}`; this one's is not",
                llava::FAMILY,
                llava::CHECKPOINT
            )));
        }
        if context.family.as_str() == clip::FAMILY && !clip::is_clip(&context.weights) {
            return RResult::RErr(UError::invalid(format!(
                "arch-vit: family {} is the image encoder of a checkpoint whose model_type is \
                 `{}`; this one's is not",
                clip::FAMILY,
                clip::CHECKPOINT
            )));
        }
        if context.family.as_str() == idefics::FAMILY && !idefics::is_idefics(&context.weights) {
            return RResult::RErr(UError::invalid(format!(
                "arch-vit: family {} is the image encoder of a checkpoint whose model_type is \
                 `{}`; this one's is not",
                idefics::FAMILY,
                idefics::CHECKPOINT
            )));
        }
        self.load(context.weights, backend).into()
    }

    fn gguf_view(&self, _weights: WeightSetBox, family: RString) -> RResult<WeightSetBox, UError> {
        RResult::RErr(UError::unsupported(format!(
            "arch-vit: llama.cpp has no GGUF layout for a {family} vision tower"
        )))
    }
}

impl Encoder for LlavaVision {
    const PLUGIN: &'static str = "arch-vit";

    fn model_config(&self) -> ModelConfig {
        LlavaVision::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        LlavaVision::forward(self, batch, out)
    }
}

impl Encoder for IdeficsVision {
    const PLUGIN: &'static str = "arch-vit";

    fn model_config(&self) -> ModelConfig {
        IdeficsVision::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        IdeficsVision::forward(self, batch, out)
    }
}

impl Encoder for ClipVision {
    const PLUGIN: &'static str = "arch-vit";

    fn model_config(&self) -> ModelConfig {
        ClipVision::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        ClipVision::forward(self, batch, out)
    }
}

impl Encoder for VisionTransformer {
    const PLUGIN: &'static str = "arch-vit";

    fn model_config(&self) -> ModelConfig {
        VisionTransformer::model_config(self)
    }

    fn encode(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> u_sdk::Result<()> {
        VisionTransformer::forward(self, batch, out)
    }
}
