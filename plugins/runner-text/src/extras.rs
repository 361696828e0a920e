//! Control vectors and soft prompts the deployment loaded ([`u_sdk::RunnerExtra`]), read once
//! when the engine starts, and what a request's `control_vectors` and `soft_prompt` resolve to.
//!
//! A control vector is llama.cpp's and repeng's `direction.{L}` tensors (GGUF with
//! `general.architecture = controlvector`, or the same names in safetensors), each added,
//! times the request's strength, to the output of block `L` (0-based, as llama.cpp applies
//! them; `direction.0` does not exist there and is refused here). A soft prompt is PEFT prompt
//! tuning's `prompt_embeddings` `[virtual tokens, hidden]`, whose rows stand before the
//! prompt's own embeddings.

use crate::{Error, Result};
use std::{collections::HashMap, sync::Arc};
use u_sdk::{ControlUse, ExtraKind, ModelConfig, RunnerExtra, WeightSetBox};

/// One block's vector of a control vector.
pub type LayerVector = (u32, Arc<[f32]>);

/// A request's steering: per block, the vector and its strength.
#[derive(Clone, Debug, Default)]
pub struct Steer {
    /// `(block, strength, vector)`, in the order the request named them.
    pub entries: Vec<(u32, f32, Arc<[f32]>)>,
}

/// What the deployment loaded, by name.
#[derive(Default)]
pub struct Extras {
    vectors: HashMap<String, Vec<LayerVector>>,
    prompts: HashMap<String, Arc<[f32]>>,
}

fn invalid(name: &str, why: String) -> Error {
    Error::InvalidRequest(format!("`{name}`: {why}"))
}

/// A tensor's values as `f32`, checked finite.
fn values(weights: &WeightSetBox, name: &str, tensor: &str) -> Result<Vec<f32>> {
    let view = weights
        .tensor(tensor.into())
        .into_result()
        .map_err(|e| invalid(name, e.to_string()))?;
    let v = u_sdk::quant::dequantize_view(&view)
        .map_err(|e| invalid(name, format!("{tensor}: {e}")))?;
    if v.iter().any(|x| !x.is_finite()) {
        return Err(invalid(
            name,
            format!("{tensor} holds NaN or infinite values"),
        ));
    }
    Ok(v)
}

/// The vectors of a control vector file, checked against the model.
fn control_vector(
    name: &str,
    weights: &WeightSetBox,
    config: &ModelConfig,
) -> Result<Vec<LayerVector>> {
    let meta = |k: &str| weights.metadata(k.into()).into_result().ok()?.into_option();
    let format = weights
        .format()
        .into_result()
        .map(|f| f.into_string())
        .unwrap_or_default();
    if format == "gguf"
        && meta("general.architecture")
            .and_then(|v| v.as_str().map(str::to_string))
            .as_deref()
            != Some("controlvector")
    {
        return Err(invalid(
            name,
            "this GGUF file is not a control vector (general.architecture = controlvector)".into(),
        ));
    }
    let tensors = weights
        .tensors()
        .into_result()
        .map_err(|e| invalid(name, e.to_string()))?;
    let mut layers = Vec::new();
    for t in tensors.iter() {
        let Some(layer) = t
            .name
            .strip_prefix("direction.")
            .and_then(|l| l.parse::<u32>().ok())
        else {
            return Err(invalid(
                name,
                format!(
                    "tensor `{}` is not a `direction.{{L}}` of a control vector",
                    t.name
                ),
            ));
        };
        if layer == 0 || layer >= config.layers {
            return Err(invalid(
                name,
                format!(
                    "direction.{layer}: blocks 1..{} of this model take a vector (block 0 never does, as in llama.cpp)",
                    config.layers
                ),
            ));
        }
        let v = values(weights, name, &t.name)?;
        if v.len() != config.hidden as usize {
            return Err(invalid(
                name,
                format!(
                    "direction.{layer} has {} values; the model's width is {}",
                    v.len(),
                    config.hidden
                ),
            ));
        }
        layers.push((layer, Arc::from(v)));
    }
    if layers.is_empty() {
        return Err(invalid(
            name,
            "the file holds no direction.{L} tensors".into(),
        ));
    }
    layers.sort_by_key(|(l, _)| *l);
    Ok(layers)
}

/// The rows of a PEFT prompt-tuning adapter, checked against the model.
fn soft_prompt(
    name: &str,
    weights: &WeightSetBox,
    config_text: &str,
    config: &ModelConfig,
) -> Result<Arc<[f32]>> {
    let c: serde_json::Value = serde_json::from_str(config_text)
        .map_err(|e| invalid(name, format!("adapter_config.json is not JSON: {e}")))?;
    match c.get("peft_type").and_then(|t| t.as_str()) {
        Some("PROMPT_TUNING") => {}
        other => {
            return Err(invalid(
                name,
                format!(
                    "adapter_config.json is a {} adapter, not PROMPT_TUNING",
                    other.unwrap_or("typeless")
                ),
            ));
        }
    }
    let virtual_tokens = c
        .get("num_virtual_tokens")
        .and_then(|n| n.as_u64())
        .unwrap_or(0) as usize;
    let rows = values(weights, name, "prompt_embeddings")?;
    let hidden = config.hidden as usize;
    if virtual_tokens == 0 || rows.len() != virtual_tokens * hidden {
        return Err(invalid(
            name,
            format!(
                "prompt_embeddings holds {} values, not {virtual_tokens} virtual tokens × the model's width {hidden}",
                rows.len()
            ),
        ));
    }
    Ok(Arc::from(rows))
}

impl Extras {
    /// Reads every extra for a model of `config`; one that does not fit is an error naming it.
    pub fn read(list: Vec<RunnerExtra>, config: &ModelConfig) -> Result<Extras> {
        let mut extras = Extras::default();
        for e in list {
            let name = e.name.to_string();
            match e.kind {
                ExtraKind::ControlVector => {
                    let v = control_vector(&name, &e.weights, config)?;
                    extras.vectors.insert(name, v);
                }
                ExtraKind::SoftPrompt => {
                    let p = soft_prompt(&name, &e.weights, &e.config, config)?;
                    extras.prompts.insert(name, p);
                }
            }
        }
        Ok(extras)
    }

    /// The steering `uses` ask for (each vector's blocks within its layer range, times its
    /// strength; strength 0 adds nothing).
    pub fn steer(&self, uses: &[ControlUse]) -> Result<Steer> {
        let mut steer = Steer::default();
        for u in uses {
            let Some(vector) = self.vectors.get(u.name.as_str()) else {
                return Err(Error::NotFound(format!(
                    "control vector `{}` is not loaded (loaded: {})",
                    u.name,
                    names(self.vectors.keys())
                )));
            };
            if !u.strength.is_finite() || u.first_layer > u.last_layer {
                return Err(Error::InvalidRequest(format!(
                    "control vector `{}`: strength {} over blocks {}..={}",
                    u.name, u.strength, u.first_layer, u.last_layer
                )));
            }
            if u.strength == 0.0 {
                continue;
            }
            for (layer, v) in vector {
                if (u.first_layer..=u.last_layer).contains(layer) {
                    steer.entries.push((*layer, u.strength, v.clone()));
                }
            }
        }
        Ok(steer)
    }

    /// The rows of soft prompt `name` (empty: none).
    pub fn soft_prompt(&self, name: &str) -> Result<Option<Arc<[f32]>>> {
        if name.is_empty() {
            return Ok(None);
        }
        self.prompts.get(name).cloned().map(Some).ok_or_else(|| {
            Error::NotFound(format!(
                "soft prompt `{name}` is not loaded (loaded: {})",
                names(self.prompts.keys())
            ))
        })
    }
}

fn names<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let mut all: Vec<&str> = keys.map(String::as_str).collect();
    all.sort_unstable();
    if all.is_empty() {
        "none".into()
    } else {
        all.join(", ")
    }
}
