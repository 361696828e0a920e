//! LLaVA's image encoder (Liu et al. 2023, *Visual Instruction Tuning*, arXiv:2304.08485;
//! LLaVA-1.5, *Improved Baselines with Visual Instruction Tuning*, arXiv:2310.03744): the
//! vision tower of a checkpoint whose `config.json` says `"model_type": "llava"`, and the
//! multi-modal projector that maps its rows to the language model's width.
//!
//! A LLaVA checkpoint is served as two models built from one weight set: this encoder (family
//! `llava.vision`) and the decoder (family `llava`, another plugin's business), which reads the
//! rows made here as embedding rows where the prompt's image tokens stand. As transformers'
//! `LlavaModel.get_image_features`:
//!
//! ```text
//! h = tower(pixels).hidden_states[vision_feature_layer]   # no final norm; -2 by default
//! h = h[1:]                                               # strategy "default": no class row
//! rows = linear_2(act(linear_1(h)))                       # the projector
//! ```
//!
//! `vision_feature_layer` may be a list of layers, whose states are joined along the features
//! before the projector. The tower is [`VisionTransformer`] (CLIP's or SigLIP's, from
//! `config.vision_config`), its tensors under `vision_tower.` (transformers' saves; also
//! `vision_tower.vision_model.`, `model.vision_tower.`, `model.vision_tower.vision_model.`), the
//! projector's under `multi_modal_projector.` (or `model.multi_modal_projector.`).

use crate::{
    config::{self, Act, Config, Family},
    model::{Dense, Span, VisionTransformer, activate},
    naming::Names,
};
use u_sdk::{
    DType, ImageSpec, MetaValue, ModelConfig, Result, SeqChunk, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// The family this module builds: the image encoder of HF `model_type` `llava`.
pub const FAMILY: &str = "llava.vision";

/// The `model_type` of the checkpoints it reads.
pub const CHECKPOINT: &str = "llava";

/// Prefixes of the vision tower in a LLaVA checkpoint.
const TOWER: [&str; 4] = [
    "vision_tower.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "model.vision_tower.vision_model.",
];

/// Prefixes of the projector in a LLaVA checkpoint.
const PROJECTOR: [&str; 2] = ["multi_modal_projector.", "model.multi_modal_projector."];

fn meta(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

/// Whether `w` is a LLaVA checkpoint (`config.model_type` is `llava`).
pub fn is_llava(w: &WeightSetBox) -> bool {
    meta(w, "config.model_type").is_some_and(|v| v.as_str() == Some(CHECKPOINT))
}

/// What the encoder is, besides its weights.
#[derive(Debug, Clone, PartialEq)]
pub struct LlavaConfig {
    /// The vision tower (`vision_config`).
    pub tower: Config,
    /// The tower states read (`hidden_states` indexes, `0..=layers`), joined in this order.
    pub feature_layers: Vec<usize>,
    /// Whether the class row is kept (`vision_feature_select_strategy` `full`) or the first
    /// row dropped (`default`).
    pub full: bool,
    /// The projector's activation (`projector_hidden_act`).
    pub act: Act,
    /// Whether the projector's layers have biases (`multimodal_projector_bias`).
    pub bias: bool,
}

impl LlavaConfig {
    /// Reads the configuration of the LLaVA checkpoint `w`.
    pub fn from_weights(w: &WeightSetBox) -> Result<LlavaConfig> {
        let bad = |why: String| UError::invalid(format!("arch-vit: llava config.json: {why}"));
        let top = |k: &str| meta(w, &format!("config.{k}"));
        let tower = Config::from_vision_config(w, "llava config.json")?;
        if !matches!(tower.family, Family::Clip | Family::Siglip) {
            return Err(UError::unsupported(format!(
                "arch-vit: a LLaVA vision tower of type `{}` (CLIP's and SigLIP's are \
                 implemented)",
                tower.family.name()
            )));
        }
        let layers = tower.layers as i64;
        let index = |l: i64| -> Result<usize> {
            let i = if l < 0 { layers + 1 + l } else { l };
            match (0..=layers).contains(&i) {
                true => Ok(i as usize),
                false => Err(bad(format!(
                    "vision_feature_layer {l} of a tower of {layers} blocks"
                ))),
            }
        };
        let feature_layers = match top("vision_feature_layer") {
            None => vec![index(-2)?],
            Some(MetaValue::Int(l)) => vec![index(l)?],
            Some(MetaValue::UInt(l)) => vec![index(l.min(i64::MAX as u64) as i64)?],
            Some(MetaValue::IntArray(ls)) if !ls.is_empty() => {
                ls.iter().map(|&l| index(l)).collect::<Result<_>>()?
            }
            Some(MetaValue::UIntArray(ls)) if !ls.is_empty() => ls
                .iter()
                .map(|&l| index(l.min(i64::MAX as u64) as i64))
                .collect::<Result<_>>()?,
            Some(other) => {
                return Err(bad(format!(
                    "vision_feature_layer {other:?} is not a layer or a list of layers"
                )));
            }
        };
        let full = match top("vision_feature_select_strategy")
            .as_ref()
            .map(|v| v.as_str())
        {
            None | Some(Some("default")) => false,
            Some(Some("full")) => true,
            Some(other) => {
                return Err(bad(format!(
                    "vision_feature_select_strategy {other:?} is neither `default` nor `full`"
                )));
            }
        };
        let act = match top("projector_hidden_act") {
            None => Act::Gelu,
            Some(v) => Act::of(
                v.as_str()
                    .ok_or_else(|| bad("`projector_hidden_act` is not a name".into()))?,
            )?,
        };
        let bias = !matches!(
            top("multimodal_projector_bias"),
            Some(MetaValue::Bool(false))
        );
        Ok(LlavaConfig {
            tower,
            feature_layers,
            full,
            act,
            bias,
        })
    }

    /// Rows one image becomes: the tower's rows, less the first under the `default` strategy.
    pub fn rows(&self) -> usize {
        self.tower.rows() - usize::from(!self.full)
    }
}

/// LLaVA's multi-modal projector: `linear_2(act(linear_1(x)))`, from the tower's width (times
/// the feature layers joined) to the language model's.
struct Projector {
    linear_1: Dense,
    act: Act,
    linear_2: Dense,
    /// Output width: the language model's hidden size.
    width: usize,
}

impl Projector {
    fn load(n: &Names<'_>, cfg: &LlavaConfig) -> Result<Projector> {
        let inputs = cfg.tower.hidden * cfg.feature_layers.len();
        let stored = n.tensor("linear_1.weight")?;
        let width = match stored.dims() {
            [w, i] if *i == inputs as u64 && *w > 0 => *w as usize,
            dims => {
                return Err(UError::invalid(format!(
                    "arch-vit: {} has shape {dims:?}, expected [_, {inputs}] (the tower's width \
                     {} times {} feature layers)",
                    n.stored("linear_1.weight"),
                    cfg.tower.hidden,
                    cfg.feature_layers.len()
                )));
            }
        };
        Ok(Projector {
            linear_1: Dense::load_with(n, "linear_1", inputs, width, cfg.bias)?,
            act: cfg.act,
            linear_2: Dense::load_with(n, "linear_2", width, width, cfg.bias)?,
            width,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_2
            .forward(&activate(&self.linear_1.forward(x)?, self.act)?)
    }
}

/// LLaVA's image encoder: the vision tower's chosen states, selected and projected.
pub struct LlavaVision {
    /// Hyper-parameters.
    pub cfg: LlavaConfig,
    /// What an image must be; [`ImageSpec::rows`] is the rows it becomes after selection.
    pub spec: ImageSpec,
    tower: VisionTransformer,
    projector: Projector,
}

impl LlavaVision {
    /// Builds the encoder of the LLaVA checkpoint `w` on `device`.
    pub fn load(w: &WeightSetBox, device: Device) -> Result<LlavaVision> {
        let cfg = LlavaConfig::from_weights(w)?;
        let tower_spec = config::image_spec(w, &cfg.tower)?;
        let names = Names::under(w, cfg.tower.family, device, &TOWER)?;
        let tower = VisionTransformer::load(&names, cfg.tower.clone(), tower_spec)?;
        let projector = PROJECTOR
            .iter()
            .map(|p| names.beside(p))
            .find(|n| n.has("linear_1.weight"))
            .ok_or_else(|| {
                UError::invalid(format!(
                    "arch-vit: no LLaVA projector (`linear_1.weight` under {PROJECTOR:?}) in \
                     the checkpoint"
                ))
            })?;
        let projector = Projector::load(&projector, &cfg)?;
        let spec = ImageSpec {
            rows: cfg.rows() as u32,
            ..tower_spec
        };
        Ok(LlavaVision {
            cfg,
            spec,
            tower,
            projector,
        })
    }

    /// What the model is, as the ABI says it: an encoder of images into rows of the language
    /// model's width ([`ModelConfig::hidden`]); `layers` is the tower's.
    pub fn model_config(&self) -> ModelConfig {
        VisionTransformer::row_encoder_config(
            FAMILY,
            self.projector.width,
            self.cfg.tower.layers,
            self.spec,
        )
    }

    /// Encodes every chunk of `batch` (one image each) and writes the projected rows of those
    /// that ask for them into `out`, in batch order: `[rows, hidden]` per image (see
    /// [`u_sdk::Model::forward`]).
    pub fn forward(&self, batch: &[SeqChunk<'_>], out: &mut [f32]) -> Result<()> {
        let images = self.tower.row_images(
            batch,
            (&self.spec, self.projector.width),
            out.len(),
            "a LLaVA image encoder gives one output, the projected rows of an image",
        )?;
        if images.is_empty() {
            return Ok(());
        }
        let last = self.cfg.feature_layers.iter().copied().max().unwrap_or(0);
        let (states, spans) = self.tower.states(&images, last)?;
        let features = self.select(&states, &spans)?;
        self.projector.forward(&features)?.read_into(out)
    }

    /// The projector's input: each image's rows of the feature layers' states, the first row
    /// dropped under the `default` strategy, layers joined along the features.
    fn select(&self, states: &[Tensor], spans: &[Span]) -> Result<Tensor> {
        let (rows, hidden) = (self.spec.rows as usize, self.cfg.tower.hidden);
        let skip = usize::from(!self.cfg.full);
        let picked = |s: &Span| s.offset + skip..s.offset + s.len;
        let dev = states[0].device();
        if let [layer] = self.cfg.feature_layers[..] {
            let x = dev.alloc(DType::F32, &[(rows * spans.len()) as u64, hidden as u64])?;
            for (i, span) in spans.iter().enumerate() {
                states[layer]
                    .rows_range(picked(span))?
                    .copy_into(None, &x.rows_range(i * rows..(i + 1) * rows)?)?;
            }
            return Ok(x);
        }
        let read: Vec<Vec<f32>> = self
            .cfg
            .feature_layers
            .iter()
            .map(|&l| states[l].to_vec())
            .collect::<Result<_>>()?;
        let width = hidden * read.len();
        let mut joined = Vec::with_capacity(rows * spans.len() * width);
        for span in spans {
            for row in picked(span) {
                for state in &read {
                    joined.extend_from_slice(&state[row * hidden..(row + 1) * hidden]);
                }
            }
        }
        dev.from_f32(&joined, &[(rows * spans.len()) as u64, width as u64])
    }
}
