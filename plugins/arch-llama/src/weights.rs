//! The weight set under this architecture's names, and the layers built from it.
//!
//! [`Weights`] reads a loader's weight set in its own format's names and presents them in the
//! names of [`crate::naming`] (GGUF's, unchanged for GGUF files; mapped for HF checkpoints),
//! with HF `config.json` hyper-parameters derived into GGUF-style keys. Large tensors are never
//! copied: [`Linear`] imports its weight into the backend once at load ([`Device::import_weight`]:
//! in place on a host backend) and keeps it; small vectors (norm scales, biases) are imported the
//! same way, so a forward pass neither looks tensors up nor converts them.

use crate::naming::{self, ARCHITECTURE_KEY};
use serde_json::Value;
use std::collections::HashMap;
use u_sdk::{
    DType, MetaValue, Result, TensorView, UError, WeightSetBox,
    nn::{Device, Tensor},
};

/// The weight set in this architecture's names, with typed accessors.
#[derive(Clone)]
pub struct Weights {
    set: WeightSetBox,
    format: String,
    /// Canonical name → name in the file, and the shape.
    tensors: HashMap<String, (String, Vec<u64>)>,
    /// Metadata this architecture derives (HF hyper-parameters under GGUF keys).
    derived: HashMap<String, MetaValue>,
}

impl Weights {
    /// Wraps a weight set, indexing its tensors under canonical names.
    pub fn new(set: WeightSetBox) -> Result<Weights> {
        let format = set.format().into_result()?.into_string();
        let get = |k: &str| set.metadata(k.into()).into_result().ok()?.into_option();
        let mut derived = HashMap::new();
        let hf = format != "gguf";
        let arch = if hf {
            get("config.model_type")
                .and_then(|v| v.as_str().map(|t| naming::hf_architecture(t).into_owned()))
        } else {
            get(ARCHITECTURE_KEY).and_then(|v| v.as_str().map(str::to_string))
        };
        if hf && let Some(arch) = &arch {
            derived.insert(
                ARCHITECTURE_KEY.into(),
                MetaValue::Str(arch.as_str().into()),
            );
            derived.extend(naming::derived_hparams(arch, get));
        }
        let mut tensors = HashMap::new();
        for t in set.tensors().into_result()? {
            let stored = t.name.into_string();
            let canonical = if hf {
                naming::canonical_name(arch.as_deref(), &stored).into_owned()
            } else {
                stored.clone()
            };
            if let Some((first, _)) = tensors.get(&canonical) {
                return Err(UError::invalid(format!(
                    "arch-llama: tensors `{first}` and `{stored}` both mean `{canonical}`"
                )));
            }
            tensors.insert(canonical, (stored, t.shape.into_vec()));
        }
        Ok(Weights {
            set,
            format,
            tensors,
            derived,
        })
    }

    /// The weight set as the loader gave it.
    pub fn set(&self) -> &WeightSetBox {
        &self.set
    }

    /// The file format (`gguf`, `safetensors`, `onnx`).
    pub fn format(&self) -> &str {
        &self.format
    }

    /// One metadata value: derived keys first, then the file's own.
    pub fn meta(&self, key: &str) -> Option<MetaValue> {
        if let Some(v) = self.derived.get(key) {
            return Some(v.clone());
        }
        self.set
            .metadata(key.into())
            .into_result()
            .ok()?
            .into_option()
    }

    /// A metadata value as an unsigned integer.
    pub fn meta_u64(&self, key: &str) -> Option<u64> {
        self.meta(key).and_then(|v| v.as_u64())
    }

    /// A required unsigned integer.
    pub fn required_u64(&self, key: &str) -> Result<u64> {
        self.meta_u64(key)
            .ok_or_else(|| UError::invalid(format!("arch-llama: metadata `{key}` is missing")))
    }

    /// A metadata value as a float.
    pub fn meta_f64(&self, key: &str) -> Option<f64> {
        self.meta(key).and_then(|v| v.as_f64())
    }

    /// A metadata value as a string.
    pub fn meta_str(&self, key: &str) -> Option<String> {
        self.meta(key).and_then(|v| v.as_str().map(str::to_string))
    }

    /// A metadata boolean.
    pub fn meta_bool(&self, key: &str) -> Option<bool> {
        match self.meta(key)? {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A metadata value holding a nested JSON structure.
    pub fn meta_json(&self, key: &str) -> Option<Value> {
        match self.meta(key)? {
            MetaValue::Json(text) => serde_json::from_str(&text).ok(),
            _ => None,
        }
    }

    /// Every tensor's canonical name and shape (in no particular order).
    pub fn shapes(&self) -> impl Iterator<Item = (&String, &Vec<u64>)> {
        self.tensors.iter().map(|(k, (_, s))| (k, s))
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn entry(&self, name: &str) -> Result<&(String, Vec<u64>)> {
        self.tensors
            .get(name)
            .ok_or_else(|| UError::not_found(format!("arch-llama: tensor `{name}` is missing")))
    }

    /// A tensor's shape, outermost first.
    pub fn shape(&self, name: &str) -> Result<Vec<u64>> {
        Ok(self.entry(name)?.1.clone())
    }

    /// A zero-copy view of a tensor.
    pub fn view(&self, name: &str) -> Result<TensorView<'_>> {
        let stored = &self.entry(name)?.0;
        self.set.tensor(stored.as_str().into()).into_result()
    }

    /// A tensor decoded to `f32` (for small vectors).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let v = self.view(name)?;
        u_sdk::quant::dequantize_view(&v).map_err(|e| UError::invalid(format!("{name}: {e}")))
    }

    /// Tensor `name` in the backend, as stored (no copy on a host backend), viewed as `dims`.
    pub fn import(&self, device: &Device, name: &str, dims: Option<&[u64]>) -> Result<Tensor> {
        let stored = &self.entry(name)?.0;
        device.import_weight(&self.set, stored, dims)
    }

    /// A vector of exactly `len` values, in the backend as `F32`.
    pub fn vector(&self, device: &Device, name: &str, len: usize) -> Result<Tensor> {
        let v = self.f32(name)?;
        if v.len() != len {
            return Err(UError::invalid(format!(
                "arch-llama: {name} has {} values, expected {len}",
                v.len()
            )));
        }
        device.from_f32(&v, &[len as u64])
    }
}

/// `y = x·Wᵀ (+ b)`: a weight of shape `[out, in]` in any dtype the backend takes — or one
/// expert's slice of a stacked `[E, out, in]` tensor (GGUF) — and an optional bias. Quantized
/// weights stay in their blocks: quantization belongs to this layer, not to the model.
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}

impl Linear {
    /// Loads `{name}.weight` (and `{name}.bias` when `bias` is asked for and present), checking
    /// that it maps `inputs` features. A 1-D weight of `inputs` values is one output row.
    pub fn load(
        w: &Weights,
        device: &Device,
        name: &str,
        inputs: usize,
        bias: bool,
    ) -> Result<Linear> {
        let weight = format!("{name}.weight");
        let shape = w.shape(&weight)?;
        let outputs = match shape.as_slice() {
            [o, i] if *i as usize == inputs => *o as usize,
            [i] if *i as usize == inputs => 1,
            _ => {
                return Err(UError::invalid(format!(
                    "arch-llama: {weight} has shape {shape:?}, expected [_, {inputs}]"
                )));
            }
        };
        let bias_name = format!("{name}.bias");
        let bias = if bias && w.has(&bias_name) {
            Some(w.vector(device, &bias_name, outputs)?)
        } else {
            None
        };
        let weight = w.import(device, &weight, Some(&[outputs as u64, inputs as u64]))?;
        Ok(Linear {
            weight,
            bias,
            inputs,
            outputs,
        })
    }

    /// Expert `index` of a stacked `[E, out, in]` weight already in the backend (a view of
    /// it, not a copy), taking `inputs` features.
    pub fn expert(stacked: &Tensor, index: usize, inputs: usize) -> Result<Linear> {
        let dims = stacked.dims();
        match dims {
            [e, o, i] if *i as usize == inputs && index < *e as usize => Ok(Linear {
                weight: stacked.index(index)?,
                bias: None,
                inputs,
                outputs: *o as usize,
            }),
            _ => Err(UError::invalid(format!(
                "arch-llama: stacked experts of shape {dims:?}, expected [>{index}, _, {inputs}]"
            ))),
        }
    }

    /// Asks for the weight's pages ahead of use (see [`Tensor::will_need`]).
    pub fn prefetch(&self) {
        self.weight.will_need();
    }

    /// The weight (`[out, in]`).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The weight's dtype.
    pub fn dtype(&self) -> DType {
        self.weight.dtype()
    }

    /// `x·Wᵀ + b` for `x` `[m, in]`: `[m, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        if let Some(b) = &self.bias {
            y.add_assign(b)?;
        }
        Ok(y)
    }
}

/// Root-mean-square normalisation with a learned scale (Zhang & Sennrich 2019).
pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    /// Loads scale `name` of `len` values.
    pub fn load(w: &Weights, device: &Device, name: &str, len: usize, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: w.vector(device, name, len)?,
            eps,
        })
    }

    /// Normalises each row of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(&self.weight, self.eps)
    }
}
