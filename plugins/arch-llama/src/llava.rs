//! LLaVA's language model (Liu et al. 2023, *Visual Instruction Tuning*, arXiv:2304.08485;
//! LLaVA-1.5, *Improved Baselines with Visual Instruction Tuning*, arXiv:2310.03744), the
//! decoder half of a checkpoint whose `config.json` says `"model_type": "llava"`.
//!
//! A LLaVA checkpoint is served as two models built from one weight set: the image encoder
//! (the vision tower and the multi-modal projector, family `llava.vision`, another plugin's
//! business) and this decoder (family `llava`). An image reaches the decoder as the rows the
//! encoder made, one per image token, passed as [`u_sdk::Segment::Embeddings`] where the prompt's
//! `<image>` token stands, each row taking a position as a token would
//! (transformers' `LlavaModel.forward` writes the projected features over the image tokens'
//! embeddings, `masked_scatter`, and runs the language model on the result).
//!
//! The decoder is the causal LM of `text_config` (Llama; Mistral, Qwen2 and the rest of this
//! plugin's families read the same way), seen through [`LlavaText`]: a view of the weight set
//! in which the language model's tensors carry the names of a bare causal LM and
//! `config.text_config.<key>` reads as `config.<key>`, so the rest of the plugin reads it like
//! any HF checkpoint.
//!
//! | LLaVA checkpoint | seen as |
//! | --- | --- |
//! | `language_model.model.*` (transformers 4, and 5's saves) | `model.*` |
//! | `language_model.lm_head.*` | `lm_head.*` |
//! | `model.language_model.*` (transformers 5's module tree) | `model.*` |
//! | `lm_head.*` | `lm_head.*` |
//! | `vision_tower.*`, `multi_modal_projector.*` (and under `model.`) | left out |
//! | `config.text_config` (a nested object) | `config.<key>` for each of its keys |
//! | `config.<key>` of the LLaVA config itself | left out (read by [`image_input`]) |
//! | any other metadata (`preprocessor.*`…) | as it is |

use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
use serde_json::{Map, Value};
use std::{collections::HashMap, sync::Arc};
use u_sdk::{
    ImageSpec, MetaValue, Resample, Result, TensorInfo, TensorView, UError, WeightSet,
    WeightSetBox,
    preprocessor::{self, ProcessorDefaults},
};

/// The family this module builds (HF `model_type`).
pub const FAMILY: &str = "llava";

/// Name prefixes of the language model inside a LLaVA checkpoint, and the bare causal LM's
/// prefix each stands for.
const RENAMES: [(&str, &str); 4] = [
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
];

/// `transformers`' defaults (`LlamaConfig`, `MistralConfig`) for the keys of `text_config`
/// that this plugin needs and has no default of its own for, where a `config.json` leaves them
/// out (older saves keep only what differs from the defaults: llava-1.5's `text_config` lacks
/// `num_hidden_layers`, `num_attention_heads`…). RoPE's base, the norm's epsilon and the
/// widths come from the plugin's own defaults and the tensors' shapes.
fn text_default(model_type: &str, key: &str) -> Option<Value> {
    Some(Value::from(match (model_type, key) {
        ("llama" | "mistral", "num_hidden_layers" | "num_attention_heads") => 32,
        ("llama", "max_position_embeddings") => 2048,
        ("mistral", "max_position_embeddings") => 32_768,
        ("mistral", "num_key_value_heads") => 8,
        ("mistral", "sliding_window") => 4096,
        _ => return None,
    }))
}

/// Whether `set` is a LLaVA checkpoint (`config.model_type` is `llava`).
pub fn is_llava(set: &WeightSetBox) -> bool {
    meta(set, "config.model_type").is_some_and(|v| v.as_str() == Some(FAMILY))
}

fn meta(set: &WeightSetBox, key: &str) -> Option<MetaValue> {
    set.metadata(key.into()).into_result().ok()?.into_option()
}

/// A nested object of `config.json` (`config.text_config`), parsed.
fn nested(set: &WeightSetBox, key: &str) -> Result<Map<String, Value>> {
    let bad = |why: &str| UError::invalid(format!("arch-llama: llava config.json: `{key}` {why}"));
    match meta(set, &format!("config.{key}")) {
        Some(MetaValue::Json(text)) => match serde_json::from_str(&text) {
            Ok(Value::Object(map)) => Ok(map),
            _ => Err(bad("is not an object")),
        },
        Some(_) => Err(bad("is not an object")),
        None => Err(bad("is missing")),
    }
}

/// A LLaVA checkpoint's language model, seen as a bare causal LM (see the module
/// documentation).
#[derive(Clone)]
pub struct LlavaText {
    inner: WeightSetBox,
    /// `config.text_config`.
    text: Arc<Map<String, Value>>,
    /// Its `model_type` (`llama` when unstated: `LlavaConfig`'s default).
    model_type: Arc<str>,
    /// The language model's tensors under their bare names.
    tensors: Arc<Vec<TensorInfo>>,
    /// Bare name → name in the checkpoint.
    stored: Arc<HashMap<String, String>>,
}

impl LlavaText {
    /// The language model of the LLaVA checkpoint `inner`.
    pub fn new(inner: WeightSetBox) -> Result<LlavaText> {
        let text = nested(&inner, "text_config")?;
        let model_type: Arc<str> = text
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama")
            .into();
        let (mut tensors, mut stored) = (Vec::new(), HashMap::new());
        for mut info in inner.tensors().into_result()? {
            let name = info.name.to_string();
            let Some(bare) = RENAMES
                .iter()
                .find_map(|(from, to)| name.strip_prefix(from).map(|rest| format!("{to}{rest}")))
            else {
                continue;
            };
            if let Some(first) = stored.insert(bare.clone(), name.clone()) {
                return Err(UError::invalid(format!(
                    "arch-llama: llava tensors `{first}` and `{name}` both are the language \
                     model's `{bare}`"
                )));
            }
            info.name = bare.into();
            tensors.push(info);
        }
        if tensors.is_empty() {
            return Err(UError::invalid(
                "arch-llama: the llava checkpoint holds no language model tensors \
                 (`language_model.model.*` or `model.language_model.*`)",
            ));
        }
        Ok(LlavaText {
            inner,
            text: Arc::new(text),
            model_type,
            tensors: Arc::new(tensors),
            stored: Arc::new(stored),
        })
    }

    /// This view as an ABI weight set.
    pub fn into_box(self) -> WeightSetBox {
        WeightSetBox::new(self)
    }

    /// `config.text_config`'s `key`, or its model type's default.
    fn text_value(&self, key: &str) -> Option<Value> {
        match (key, self.text.get(key)) {
            ("model_type", _) => Some(Value::from(&*self.model_type)),
            (_, Some(Value::Null)) | (_, None) => text_default(&self.model_type, key),
            (_, Some(v)) => Some(v.clone()),
        }
    }
}

impl WeightSet for LlavaText {
    fn format(&self) -> RResult<RString, UError> {
        self.inner.format()
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        RResult::ROk(ROption::RSome((*self.model_type).into()))
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        let inner = match self.inner.metadata_keys().into_result() {
            Ok(keys) => keys,
            Err(e) => return RResult::RErr(e),
        };
        let mut keys: Vec<RString> = self
            .text
            .keys()
            .map(|k| format!("config.{k}").into())
            .collect();
        if !self.text.contains_key("model_type") {
            keys.push("config.model_type".into());
        }
        keys.extend(inner.into_iter().filter(|k| !k.starts_with("config.")));
        RResult::ROk(keys.into())
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        match key.as_str().strip_prefix("config.") {
            Some(k) => RResult::ROk(
                self.text_value(k)
                    .map(|v| u_sdk::weights::json_to_meta(&v))
                    .into(),
            ),
            None => self.inner.metadata(key),
        }
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        RResult::ROk(self.tensors.iter().cloned().collect())
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        match self.stored.get(name.as_str()) {
            Some(stored) => self.inner.tensor(stored.as_str().into()),
            None => RResult::RErr(UError::not_found(format!(
                "arch-llama: the llava language model has no tensor `{name}`"
            ))),
        }
    }
}

/// How images reach a LLaVA decoder: what one image is (the processor's preprocessing, and
/// the rows it becomes) and the token that stands for it in prompts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageSlots {
    /// The image the encoder takes, and [`ImageSpec::rows`]: the embedding rows (image tokens)
    /// one image becomes.
    pub spec: ImageSpec,
    /// The `<image>` token id (`image_token_index`).
    pub token: u32,
}

/// The image input of the LLaVA checkpoint `set`: `image_token_index` (or `image_token_id`),
/// `image_seq_length` rows per image (checked against what the vision tower makes of its
/// image: `(image_size / patch_size)²` patches, plus the class row under the `full` strategy,
/// less the first row under `default`), and the preprocessing `preprocessor_config.json`
/// states (CLIP's and SigLIP's processors' defaults where it is silent).
pub fn image_input(set: &WeightSetBox, vocab: usize) -> Result<ImageSlots> {
    let bad = |why: String| UError::invalid(format!("arch-llama: llava config.json: {why}"));
    let top = |k: &str| meta(set, &format!("config.{k}"));
    let token = top("image_token_index")
        .or_else(|| top("image_token_id"))
        .map_or(Some(32_000), |v| v.as_u64())
        .ok_or_else(|| bad("`image_token_index` is not a token id".into()))?;
    if token as usize >= vocab {
        return Err(bad(format!(
            "image token {token} is outside the vocabulary of {vocab}"
        )));
    }
    let vision = nested(set, "vision_config")?;
    let vision_int = |k: &str| vision.get(k).and_then(Value::as_u64);
    let vision_type = vision
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("clip_vision_model");
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
    let class = usize::from(vision_type != "siglip_vision_model");
    let tower_rows = match (vision_int("image_size"), vision_int("patch_size")) {
        (Some(side), Some(patch)) if patch > 0 && side.is_multiple_of(patch) => {
            let grid = (side / patch) as usize;
            Some((grid * grid + class).checked_sub(usize::from(!full)))
        }
        _ => None,
    }
    .flatten();
    let rows = match (top("image_seq_length").and_then(|v| v.as_u64()), tower_rows) {
        (Some(stated), Some(made)) if stated as usize != made => {
            return Err(bad(format!(
                "image_seq_length {stated} but the vision tower makes {made} rows of an image"
            )));
        }
        (Some(stated), _) => stated as usize,
        (None, Some(made)) => made,
        (None, None) => 576,
    };
    if rows == 0 || rows > 1 << 20 {
        return Err(bad(format!("{rows} rows per image")));
    }
    let side = vision_int("image_size").unwrap_or(336) as u32;
    let spec = processor_spec(set, vision_type, side, rows as u32)?;
    Ok(ImageSlots {
        spec,
        token: token as u32,
    })
}

/// The preprocessing of `preprocessor_config.json` (`preprocessor.*`) for a tower of type
/// `vision_type` taking `side × side` images: resize (to `size`, or its shortest edge then a
/// centre crop to `crop_size`), rescale, normalise.
fn processor_spec(
    set: &WeightSetBox,
    vision_type: &str,
    side: u32,
    rows: u32,
) -> Result<ImageSpec> {
    // OpenAI CLIP's statistics (LLaVA's CLIP towers), SigLIP's [-1, 1].
    let (mean, std) = match vision_type {
        "siglip_vision_model" => ([0.5; 3], [0.5; 3]),
        _ => (
            [0.481_454_66, 0.457_827_5, 0.408_210_73],
            [0.268_629_54, 0.261_302_6, 0.275_777_1],
        ),
    };
    let p = preprocessor::read(
        set,
        "arch-llama",
        ProcessorDefaults {
            mean,
            std,
            resample: Resample::Bicubic,
        },
    )?;
    match p.side {
        Some((h, w)) if (h, w) != (u64::from(side), u64::from(side)) => {
            Err(UError::unsupported(format!(
                "arch-llama: the llava processor makes {h}×{w} images for a vision tower of \
                 {side}×{side}"
            )))
        }
        _ => Ok(ImageSpec {
            channels: 3,
            height: side,
            width: side,
            rows,
            shortest_edge: p.shortest_edge,
            resample: p.resample,
            rescale: p.rescale,
            mean: p.mean,
            std: p.std,
        }),
    }
}
