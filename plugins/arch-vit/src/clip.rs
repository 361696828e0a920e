//! CLIP's image embedding (Radford et al. 2021, *Learning Transferable Visual Models From
//! Natural Language Supervision*, arXiv:2103.00020): the vision tower of a full CLIP checkpoint
//! (`config.json`'s `model_type` `clip`, transformers' `CLIPModel`) and its `visual_projection`
//! into the space the text side (family `clip`, another plugin's business) embeds texts in; or
//! the same from a tower saved alone with its projection (`clip_vision_model` with a
//! `visual_projection`, transformers' `CLIPVisionModelWithProjection`, the image encoder of
//! Stable Diffusion's image variations). As transformers' `CLIPModel.get_image_features`
//! (`CLIPVisionModelWithProjection`'s `image_embeds`):
//!
//! ```text
//! h = tower(pixels).last_hidden_state
//! features = visual_projection(post_layernorm(h[0]))     # no bias
//! ```
//!
//! The tower is [`VisionTransformer`] (from `config.vision_config`, its tensors under
//! `vision_model.`), whose pooled output ([`Pooling::Head`]) is `post_layernorm` of the class
//! row; this encoder (family `clip.vision`) answers that pooled vector projected, of width
//! `projection_dim` — the text side's width, as the host checks.

use crate::{
    config::{self, Config, Family},
    model::{Dense, VisionTransformer},
    naming::Names,
};
use abi_stable::std_types::ROption;
use u_sdk::{
    AttentionMask, ImageSpec, MetaValue, ModelConfig, ModelKind, NO_IMAGE_TOKEN, Output, Pooling,
    Result, SeqChunk, UError, WeightSetBox, nn::Device,
};

/// The family this module builds: the image encoder of HF `model_type` `clip`.
pub const FAMILY: &str = "clip.vision";

/// The `model_type` of the checkpoints it reads.
pub const CHECKPOINT: &str = "clip";

/// The tower's prefix in a CLIP checkpoint.
const TOWER: [&str; 1] = ["vision_model."];

/// The projection into the joint space (no bias), at the checkpoint's top level.
const PROJECTION: &str = "visual_projection";

fn meta(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

/// Whether `w` is a full CLIP checkpoint (`config.model_type` is `clip`).
pub fn is_clip(w: &WeightSetBox) -> bool {
    meta(w, "config.model_type").is_some_and(|v| v.as_str() == Some(CHECKPOINT))
}

/// Whether `w` is a CLIP vision tower saved with its projection
/// (`CLIPVisionModelWithProjection`: `model_type` `clip_vision_model` and a
/// `visual_projection`).
pub fn is_projected_tower(w: &WeightSetBox) -> bool {
    let weight = format!("{PROJECTION}.weight");
    meta(w, "config.model_type").is_some_and(|v| v.as_str() == Some(Family::Clip.name()))
        && w.tensors()
            .into_result()
            .is_ok_and(|ts| ts.iter().any(|t| t.name.as_str() == weight))
}

/// CLIP's image encoder: the vision tower's pooled vector, projected into the joint space.
pub struct ClipVision {
    /// What an image must be.
    pub spec: ImageSpec,
    tower: VisionTransformer,
    /// `visual_projection`: the tower's width to the joint space's.
    projection: Dense,
    /// Width of the joint space (`projection_dim`).
    width: usize,
    device: Device,
}

impl ClipVision {
    /// Builds the image side of the CLIP checkpoint `w` (a full CLIP, or a projected tower)
    /// on `device`.
    pub fn load(w: &WeightSetBox, device: Device) -> Result<ClipVision> {
        let cfg = match is_clip(w) {
            true => Config::from_vision_config(w, "clip config.json")?,
            false => Config::from_weights(w)?,
        };
        if cfg.family != Family::Clip {
            return Err(UError::invalid(format!(
                "arch-vit: a CLIP checkpoint's vision tower of type `{}` (expected \
                 clip_vision_model)",
                cfg.family.name()
            )));
        }
        let spec = config::image_spec(w, &cfg)?;
        let names = Names::under(w, Family::Clip, device, &TOWER)?;
        let top = names.beside("");
        let weight = format!("{PROJECTION}.weight");
        if !top.has(&weight) {
            return Err(UError::invalid(format!(
                "arch-vit: the CLIP checkpoint has no `{weight}`: a CLIP image embedding is the \
                 tower's pooled row projected into the joint space"
            )));
        }
        let stated = meta(w, "config.projection_dim").and_then(|v| v.as_u64());
        let width = match top.tensor(&weight)?.dims() {
            [p, h] if *h == cfg.hidden as u64 && *p > 0 && stated.is_none_or(|s| s == *p) => {
                *p as usize
            }
            dims => {
                return Err(UError::invalid(format!(
                    "arch-vit: {weight} has shape {dims:?}, expected [{}, {}] (projection_dim, \
                     the tower's width)",
                    stated.map_or("_".into(), |s| s.to_string()),
                    cfg.hidden
                )));
            }
        };
        let projection = Dense::load_with(&top, PROJECTION, cfg.hidden, width, false)?;
        let device = names.device().clone();
        let tower = VisionTransformer::load(&names, cfg, spec)?;
        Ok(ClipVision {
            spec,
            tower,
            projection,
            width,
            device,
        })
    }

    /// What the model is, as the ABI says it: an encoder of images into the joint space
    /// ([`ModelConfig::hidden`] is `projection_dim`), its one output the projected pooled
    /// vector ([`Pooling::Head`]); `layers` is the tower's.
    pub fn model_config(&self) -> ModelConfig {
        ModelConfig {
            kind: ModelKind::Encoder,
            family: FAMILY.into(),
            vocab_size: 0,
            hidden: self.width as u32,
            layers: self.tower.cfg.layers as u32,
            context_length: self.spec.rows,
            experts: 0,
            attention: AttentionMask::Bidirectional,
            pooling: Pooling::Head,
            context_shape: [0, 0],
            image: ROption::RSome(self.spec),
            image_token: NO_IMAGE_TOKEN,
            planes: abi_stable::std_types::ROption::RNone,
        }
    }

    /// Encodes every chunk of `batch` (one image each) and writes the embeddings of those that
    /// ask for them (`Output::Pooled(Pooling::Head)`) into `out`, in batch order (see
    /// [`u_sdk::Model::forward`]).
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let rows = self.spec.rows as usize;
        let mut wanted = Vec::with_capacity(batch.len());
        for chunk in batch {
            self.tower.pixels(chunk, rows)?;
            match chunk.output {
                Output::Nothing => {}
                Output::Pooled(Pooling::Head) => wanted.push(*chunk),
                other => {
                    return Err(UError::unsupported(format!(
                        "arch-vit: a CLIP image encoder gives one output, the image's embedding \
                         in the joint space (`Output::Pooled(Pooling::Head)`), not {other:?}"
                    )));
                }
            }
        }
        if out.len() != wanted.len() * self.width {
            return Err(UError::invalid(format!(
                "arch-vit: the output buffer holds {} floats, the batch asks for {}",
                out.len(),
                wanted.len() * self.width
            )));
        }
        if wanted.is_empty() {
            return Ok(());
        }
        let hidden = self.tower.cfg.hidden;
        let mut pooled = vec![0f32; wanted.len() * hidden];
        self.tower.forward(&wanted, &mut pooled)?;
        let pooled = self
            .device
            .from_f32(&pooled, &[wanted.len() as u64, hidden as u64])?;
        self.projection.forward(&pooled)?.read_into(out)
    }
}
