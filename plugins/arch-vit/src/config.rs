//! The typed hyper-parameters of a vision tower, from `config.json` (`config.*` metadata, as
//! the HF-format loaders present it), and the image preprocessing its
//! `preprocessor_config.json` (`preprocessor.*`) states.

use u_sdk::{
    ImageSpec, MetaValue, Resample, Result, UError, WeightSetBox,
    preprocessor::{self, ProcessorDefaults},
};

/// The families this plugin builds, by `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// ViT (Dosovitskiy et al. 2020): class token, learned positions, final norm, tanh pooler.
    Vit,
    /// CLIP's vision tower (Radford et al. 2021): class token, a norm before the blocks, quick
    /// GELU, a norm of the pooled class row only.
    Clip,
    /// SigLIP's vision tower (Zhai et al. 2023): no class token, final norm, an
    /// attention-pooling head.
    Siglip,
    /// DINOv2 (Oquab et al. 2023): ViT with layer scale; the pooled vector is the normed class
    /// row.
    Dinov2,
}

impl Family {
    /// The family of HF `model_type` `name`.
    pub fn of(name: &str) -> Result<Family> {
        Ok(match name {
            "vit" => Family::Vit,
            "clip_vision_model" => Family::Clip,
            "siglip_vision_model" => Family::Siglip,
            "dinov2" => Family::Dinov2,
            other => {
                return Err(UError::unsupported(format!(
                    "arch-vit: model type `{other}` is not one of vit, clip_vision_model, \
                     siglip_vision_model, dinov2"
                )));
            }
        })
    }

    /// The `model_type` naming this family.
    pub fn name(self) -> &'static str {
        match self {
            Family::Vit => "vit",
            Family::Clip => "clip_vision_model",
            Family::Siglip => "siglip_vision_model",
            Family::Dinov2 => "dinov2",
        }
    }

    /// Whether the tower prepends a class token to the patches.
    pub fn has_class_token(self) -> bool {
        self != Family::Siglip
    }
}

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// GELU, exact (erf).
    Gelu,
    /// GELU, tanh approximation.
    GeluTanh,
    /// CLIP's `x · σ(1.702 x)`.
    QuickGelu,
}

impl Act {
    /// The activation transformers names `name` (`ACT2FN`'s keys).
    pub fn of(name: &str) -> Result<Act> {
        match name {
            "gelu" => Ok(Act::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" => Ok(Act::GeluTanh),
            "quick_gelu" => Ok(Act::QuickGelu),
            other => Err(UError::unsupported(format!(
                "arch-vit: activation `{other}` is not implemented (gelu, gelu_pytorch_tanh, \
                 quick_gelu)"
            ))),
        }
    }
}

/// Everything the model needs besides the weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Which tower.
    pub family: Family,
    /// Width of a patch row.
    pub hidden: usize,
    /// Blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Channels of an input image.
    pub channels: usize,
    /// Side of the square image the position table is for.
    pub image_size: usize,
    /// Side of the square image the tower takes: the image processor's (DINOv2 crops 224 from
    /// a table for 518 and interpolates the positions), else `image_size`.
    pub input_size: usize,
    /// Side of a square patch.
    pub patch: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    /// MLP activation.
    pub act: Act,
}

fn get(w: &WeightSetBox, key: &str) -> Option<MetaValue> {
    w.metadata(key.into()).into_result().ok()?.into_option()
}

/// transformers' defaults of the vision configurations (`CLIPVisionConfig`,
/// `SiglipVisionConfig`) for keys a `vision_config` leaves out (older saves keep only what
/// differs from them).
fn vision_default(model_type: &str, key: &str) -> Option<MetaValue> {
    let siglip = model_type == "siglip_vision_model";
    Some(match key {
        "hidden_size" => MetaValue::UInt(768),
        "intermediate_size" => MetaValue::UInt(3072),
        "num_hidden_layers" | "num_attention_heads" => MetaValue::UInt(12),
        "num_channels" => MetaValue::UInt(3),
        "image_size" => MetaValue::UInt(224),
        "patch_size" => MetaValue::UInt(if siglip { 16 } else { 32 }),
        "hidden_act" => MetaValue::Str(
            if siglip {
                "gelu_pytorch_tanh"
            } else {
                "quick_gelu"
            }
            .into(),
        ),
        "layer_norm_eps" => MetaValue::Float(if siglip { 1e-6 } else { 1e-5 }),
        _ => return None,
    })
}

/// The object `key` nested in `w`'s `config.json` (`vision_config`, `perceiver_config`…), as
/// the loaders present it (JSON text under `config.{key}`); `None` where there is none, an
/// error where it is not an object. `source` names the document in errors.
pub fn nested(
    w: &WeightSetBox,
    key: &str,
    source: &str,
) -> Result<Option<serde_json::Map<String, serde_json::Value>>> {
    match get(w, &format!("config.{key}")) {
        None => Ok(None),
        Some(MetaValue::Json(text)) => match serde_json::from_str(&text) {
            Ok(serde_json::Value::Object(map)) => Ok(Some(map)),
            _ => Err(UError::invalid(format!(
                "arch-vit: {source}: `{key}` is not an object"
            ))),
        },
        Some(_) => Err(UError::invalid(format!(
            "arch-vit: {source}: `{key}` is not an object"
        ))),
    }
}

impl Config {
    /// Reads the tower's configuration from `w`'s `config.json`.
    pub fn from_weights(w: &WeightSetBox) -> Result<Config> {
        Config::from_meta(&|k| get(w, &format!("config.{k}")), "config.json")
    }

    /// Reads the configuration of the vision tower nested in a multi-modal checkpoint's
    /// `config.json` (`vision_config`: LLaVA's, a full CLIP's), a key it leaves out taking its
    /// class's default; `source` names the document in errors.
    pub fn from_vision_config(w: &WeightSetBox, source: &str) -> Result<Config> {
        let vision = nested(w, "vision_config", source)?.ok_or_else(|| {
            UError::invalid(format!("arch-vit: {source}: no `vision_config` object"))
        })?;
        let model_type = vision
            .get("model_type")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("clip_vision_model")
            .to_string();
        let value = |k: &str| match (k, vision.get(k)) {
            ("model_type", _) => Some(MetaValue::Str(model_type.as_str().into())),
            (_, None | Some(serde_json::Value::Null)) => vision_default(&model_type, k),
            (_, Some(v)) => Some(u_sdk::weights::json_to_meta(v)),
        };
        Config::from_meta(&value, &format!("{source}: vision_config"))
    }

    /// Reads the tower's configuration from `config.json`-style entries: `value(key)` is the
    /// entry `key` (`hidden_size`…), `source` names the document in errors.
    pub fn from_meta(value: &dyn Fn(&str) -> Option<MetaValue>, source: &str) -> Result<Config> {
        let bad = |why: String| UError::invalid(format!("arch-vit: {source}: {why}"));
        let model_type = value("model_type")
            .and_then(|v| v.as_str().map(str::to_string))
            .ok_or_else(|| bad("no `model_type`".into()))?;
        let family = Family::of(&model_type)?;
        let int = |k: &str| value(k).and_then(|v| v.as_u64());
        let need = |k: &str| {
            int(k)
                .map(|v| v as usize)
                .filter(|&v| v > 0)
                .ok_or_else(|| bad(format!("lacks a positive `{k}`")))
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        if !hidden.is_multiple_of(heads) {
            return Err(bad(format!(
                "hidden size {hidden} does not split into {heads} heads"
            )));
        }
        let intermediate = match family {
            // DINOv2 states the MLP width as a ratio of the hidden size.
            Family::Dinov2 => {
                let ratio = value("mlp_ratio").and_then(|v| v.as_f64()).unwrap_or(4.0);
                let width = hidden as f64 * ratio;
                if !(width >= 1.0 && width.fract() == 0.0 && width < 1e7) {
                    return Err(bad(format!("mlp_ratio {ratio} gives no whole MLP width")));
                }
                width as usize
            }
            _ => need("intermediate_size")?,
        };
        if family == Family::Dinov2
            && value("use_swiglu_ffn").is_some_and(|v| matches!(v, MetaValue::Bool(true)))
        {
            return Err(UError::unsupported(
                "arch-vit: DINOv2 with a SwiGLU MLP (the giant model) is not implemented",
            ));
        }
        let act = match value("hidden_act").and_then(|v| v.as_str().map(str::to_string)) {
            None => Act::Gelu,
            Some(name) => Act::of(&name)?,
        };
        let default_eps = match family {
            Family::Vit => 1e-12,
            _ => 1e-6,
        };
        let eps = value("layer_norm_eps")
            .and_then(|v| v.as_f64())
            .unwrap_or(default_eps) as f32;
        let cfg = Config {
            family,
            hidden,
            layers: need("num_hidden_layers")?,
            heads,
            intermediate,
            channels: int("num_channels").map_or(3, |v| v as usize),
            image_size: need("image_size")?,
            input_size: need("image_size")?,
            patch: need("patch_size")?,
            eps,
            act,
        };
        if cfg.channels != 3 {
            return Err(UError::unsupported(format!(
                "arch-vit: {} image channels (RGB, 3, is implemented)",
                cfg.channels
            )));
        }
        if !cfg.image_size.is_multiple_of(cfg.patch) || cfg.image_size > 8192 {
            return Err(bad(format!(
                "image size {} is not a whole number of {}-pixel patches (or is past 8192)",
                cfg.image_size, cfg.patch
            )));
        }
        Ok(cfg)
    }

    /// Patches along one side of the position table.
    pub fn table_grid(&self) -> usize {
        self.image_size / self.patch
    }

    /// Patches along one side of an input image.
    pub fn grid(&self) -> usize {
        self.input_size / self.patch
    }

    /// Rows an image becomes: its patches, and the class token where the family has one.
    pub fn rows(&self) -> usize {
        self.grid() * self.grid() + usize::from(self.family.has_class_token())
    }

    /// Floats of one preprocessed image.
    pub fn pixels(&self) -> usize {
        self.channels * self.input_size * self.input_size
    }
}

/// The preprocessing `w`'s `preprocessor_config.json` states for a tower of `cfg` (each
/// family's image processor defaults where the file is silent or absent), as the ABI's
/// [`ImageSpec`].
pub fn image_spec(w: &WeightSetBox, cfg: &Config) -> Result<ImageSpec> {
    let bad = |why: String| UError::invalid(format!("arch-vit: preprocessor_config.json: {why}"));
    // ImageNet's statistics (DINOv2's processor), OpenAI CLIP's, and the [-1, 1] of ViT and
    // SigLIP.
    let (mean, std, resample) = match cfg.family {
        Family::Dinov2 => (
            [0.485, 0.456, 0.406],
            [0.229, 0.224, 0.225],
            Resample::Bicubic,
        ),
        Family::Clip => (
            [0.481_454_66, 0.457_827_5, 0.408_210_73],
            [0.268_629_54, 0.261_302_6, 0.275_777_1],
            Resample::Bicubic,
        ),
        Family::Vit => ([0.5; 3], [0.5; 3], Resample::Bilinear),
        Family::Siglip => ([0.5; 3], [0.5; 3], Resample::Bicubic),
    };
    let p = preprocessor::read(
        w,
        "arch-vit",
        ProcessorDefaults {
            mean,
            std,
            resample,
        },
    )?;
    let table = cfg.image_size as u32;
    let side = match p.side {
        Some((h, wd)) if h != wd => {
            return Err(UError::unsupported(format!(
                "arch-vit: the processor makes {h}×{wd} images; square inputs are implemented"
            )));
        }
        Some((h, _)) => u32::try_from(h).map_err(|_| bad(format!("a {h}-pixel side")))?,
        None => table,
    };
    if side != table && cfg.family != Family::Dinov2 {
        return Err(UError::unsupported(format!(
            "arch-vit: the processor makes {side}×{side} images but the {} position table is for \
             {table}×{table} (DINOv2 interpolates its positions; this family's checkpoints are \
             used at their own size)",
            cfg.family.name()
        )));
    }
    if side == 0 || side % cfg.patch as u32 != 0 || side > 8192 {
        return Err(bad(format!(
            "a {side}-pixel image is not a whole number of {}-pixel patches (or is past 8192)",
            cfg.patch
        )));
    }
    if p.shortest_edge != 0 && p.shortest_edge < side {
        return Err(bad(format!(
            "shortest edge {} is smaller than the {side}-pixel crop",
            p.shortest_edge
        )));
    }
    let input = Config {
        input_size: side as usize,
        ..cfg.clone()
    };
    Ok(ImageSpec {
        channels: cfg.channels as u32,
        height: side,
        width: side,
        rows: input.rows() as u32,
        shortest_edge: p.shortest_edge,
        resample: p.resample,
        rescale: p.rescale,
        mean: p.mean,
        std: p.std,
    })
}
