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
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
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
    /// Canonical names of the tensors read so far (see [`Weights::unread_layer_tensors`]).
    read: Arc<Mutex<HashSet<String>>>,
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
            read: Arc::default(),
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

    /// The metadata keys this architecture derives (HF hyper-parameters under GGUF keys; none
    /// for GGUF files).
    pub fn derived_keys(&self) -> impl Iterator<Item = &str> {
        self.derived.keys().map(String::as_str)
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

    /// Whether tensor `name` is stored as `[in, out]` rather than `[out, in]` (HF Conv1D
    /// layers; see [`naming::hf_stored_transposed`]).
    pub fn stored_transposed(&self, name: &str) -> bool {
        self.format != "gguf"
            && self
                .meta_str(ARCHITECTURE_KEY)
                .is_some_and(|arch| naming::hf_stored_transposed(&arch, name))
    }

    /// For each row of tensor `name` (`rows` rows), the stored row it is, when the checkpoint
    /// orders them otherwise (HF GPT-NeoX's and Falcon's grouped Q/K/V; see
    /// [`naming::hf_row_order`]).
    pub fn row_order(&self, name: &str, rows: usize) -> Option<Vec<usize>> {
        if self.format == "gguf" {
            return None;
        }
        let arch = self.meta_str(ARCHITECTURE_KEY)?;
        let heads = self.meta_u64(&format!("{arch}.attention.head_count"))? as usize;
        let kv_heads = self
            .meta_u64(&format!("{arch}.attention.head_count_kv"))
            .map_or(heads, |k| k as usize);
        naming::hf_row_order(&arch, name, rows, heads, kv_heads)
    }

    /// The input features of linear layer `{name}.weight` (its innermost stored dimension, or
    /// the outermost one when [stored transposed](Weights::stored_transposed)).
    pub fn inputs(&self, name: &str) -> Result<usize> {
        let weight = format!("{name}.weight");
        let shape = self.shape(&weight)?;
        match (shape.as_slice(), self.stored_transposed(&weight)) {
            ([_, i], false) | ([i, _], true) => Ok(*i as usize),
            _ => Err(UError::invalid(format!(
                "arch-llama: {weight} has shape {shape:?}, expected two dimensions"
            ))),
        }
    }

    /// A tensor's shape, outermost first.
    pub fn shape(&self, name: &str) -> Result<Vec<u64>> {
        Ok(self.entry(name)?.1.clone())
    }

    /// A zero-copy view of a tensor.
    pub fn view(&self, name: &str) -> Result<TensorView<'_>> {
        let stored = &self.entry(name)?.0;
        self.mark_read(name);
        self.set.tensor(stored.as_str().into()).into_result()
    }

    fn mark_read(&self, name: &str) {
        let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        read.insert(name.to_string());
    }

    /// The layer tensors (canonical `blk.*` names, and HF layer names [`naming`] does not map)
    /// that nothing has read, sorted: after a model is built, parts of a variant it does not
    /// implement (StableLM's per-head Q/K norms, a bias on an RMSNorm…), which would otherwise
    /// be silently ignored.
    pub fn unread_layer_tensors(&self) -> Vec<String> {
        let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let mut unread: Vec<String> = self
            .tensors
            .iter()
            .filter(|(canonical, (stored, _))| {
                !read.contains(*canonical)
                    && (canonical.starts_with("blk.")
                        || stored.starts_with("model.layers.")
                        || stored.starts_with("transformer.h."))
            })
            .map(|(_, (stored, _))| stored.clone())
            .collect();
        unread.sort();
        unread
    }

    /// A tensor decoded to `f32` (for small vectors).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let v = self.view(name)?;
        u_sdk::quant::dequantize_view(&v).map_err(|e| UError::invalid(format!("{name}: {e}")))
    }

    /// Tensor `name` in the backend, as stored (no copy on a host backend), viewed as `dims`.
    pub fn import(&self, device: &Device, name: &str, dims: Option<&[u64]>) -> Result<Tensor> {
        let stored = &self.entry(name)?.0;
        self.mark_read(name);
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

/// `y = s·(x·Wᵀ) (+ b)`: a weight of shape `[out, in]` in any dtype the backend takes — or one
/// expert's slice of a stacked `[E, out, in]` tensor (GGUF), or a block of rows of a fused
/// projection — an optional per-tensor scale `s` (BitNet b1.58's ternary weights, `{name}.scale`
/// in llama.cpp's files) and an optional bias. Quantized weights stay in their blocks:
/// quantization belongs to this layer, not to the model.
pub struct Linear {
    pub(crate) weight: Tensor,
    /// The output scale, where the weight has one.
    pub(crate) scale: Option<f32>,
    pub(crate) bias: Option<Tensor>,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}

impl Linear {
    /// Loads `{name}.weight` (and `{name}.bias` when `bias` is asked for and present, and the
    /// one-value `{name}.scale` when present), checking that it maps `inputs` features. A 1-D
    /// weight of `inputs` values is one output row.
    pub fn load(
        w: &Weights,
        device: &Device,
        name: &str,
        inputs: usize,
        bias: bool,
    ) -> Result<Linear> {
        let weight = format!("{name}.weight");
        let shape = w.shape(&weight)?;
        let transposed = w.stored_transposed(&weight);
        let outputs = match (shape.as_slice(), transposed) {
            ([o, i], false) | ([i, o], true) if *i as usize == inputs => *o as usize,
            ([i], _) if *i as usize == inputs => 1,
            _ => {
                let want = match transposed {
                    true => format!("[{inputs}, _] (stored transposed)"),
                    false => format!("[_, {inputs}]"),
                };
                return Err(UError::invalid(format!(
                    "arch-llama: {weight} has shape {shape:?}, expected {want}"
                )));
            }
        };
        let order = w.row_order(&weight, outputs);
        let stored_row = |r: usize| order.as_ref().map_or(r, |o| o[r]);
        let bias_name = format!("{name}.bias");
        let bias = if bias && w.has(&bias_name) {
            let b = w.f32(&bias_name)?;
            if b.len() != outputs {
                return Err(UError::invalid(format!(
                    "arch-llama: {bias_name} has {} values, expected {outputs}",
                    b.len()
                )));
            }
            let b: Vec<f32> = (0..outputs).map(|r| b[stored_row(r)]).collect();
            Some(device.from_f32(&b, &[outputs as u64])?)
        } else {
            None
        };
        let scale_name = format!("{name}.scale");
        let scale = match w.has(&scale_name) {
            true => match w.f32(&scale_name)?[..] {
                [s] => Some(s),
                ref v => {
                    return Err(UError::invalid(format!(
                        "arch-llama: {scale_name} has {} values, expected one",
                        v.len()
                    )));
                }
            },
            false => None,
        };
        let dims = [outputs as u64, inputs as u64];
        let weight = match (transposed, &order) {
            (false, None) => w.import(device, &weight, Some(&dims))?,
            // HF Conv1D weights (GPT-2) are `[in, out]`, GPT-NeoX's Q/K/V rows interleaved per
            // head: rewritten once at load, as llama.cpp's converter does.
            _ => {
                let stored = w.f32(&weight)?;
                let at = |r: usize, c: usize| match transposed {
                    true => stored[c * outputs + r],
                    false => stored[r * inputs + c],
                };
                let t: Vec<f32> = (0..outputs * inputs)
                    .map(|k| at(stored_row(k / inputs), k % inputs))
                    .collect();
                device.from_f32(&t, &dims)?
            }
        };
        Ok(Linear {
            weight,
            scale,
            bias,
            inputs,
            outputs,
        })
    }

    /// Splits a fused projection (Q/K/V, gate/up) into consecutive blocks of `outputs` rows
    /// each, views of the same weight (and bias) without a copy.
    pub fn split<const N: usize>(&self, outputs: [usize; N]) -> Result<[Linear; N]> {
        if outputs.iter().sum::<usize>() != self.outputs {
            return Err(UError::invalid(format!(
                "arch-llama: a fused projection of {} outputs does not split into {outputs:?}",
                self.outputs
            )));
        }
        let mut at = 0;
        let parts = outputs
            .iter()
            .map(|&n| {
                let rows = at..at + n;
                at += n;
                let bias = match &self.bias {
                    Some(b) => Some(
                        b.reshape(&[self.outputs as u64, 1])?
                            .rows_range(rows.clone())?
                            .reshape(&[n as u64])?,
                    ),
                    None => None,
                };
                Ok(Linear {
                    weight: self.weight.rows_range(rows)?,
                    scale: self.scale,
                    bias,
                    inputs: self.inputs,
                    outputs: n,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        parts
            .try_into()
            .map_err(|_| UError::invalid("arch-llama: a projection split into the wrong count"))
    }

    /// Expert `index` of a stacked `[E, out, in]` weight already in the backend (a view of
    /// it, not a copy), taking `inputs` features.
    pub fn expert(stacked: &Tensor, index: usize, inputs: usize) -> Result<Linear> {
        let dims = stacked.dims();
        match dims {
            [e, o, i] if *i as usize == inputs && index < *e as usize => Ok(Linear {
                weight: stacked.index(index)?,
                scale: None,
                bias: None,
                inputs,
                outputs: *o as usize,
            }),
            _ => Err(UError::invalid(format!(
                "arch-llama: stacked experts of shape {dims:?}, expected [>{index}, _, {inputs}]"
            ))),
        }
    }

    /// The weight (`[out, in]`).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The weight's dtype.
    pub fn dtype(&self) -> DType {
        self.weight.dtype()
    }

    /// `s·(x·Wᵀ) + b` for `x` `[m, in]`: `[m, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.matmul_t(&self.weight)?;
        if let Some(s) = self.scale {
            y.scale_assign(s)?;
        }
        if let Some(b) = &self.bias {
            y.add_assign(b)?;
        }
        Ok(y)
    }
}

/// Which normalisation a model's norms compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Root-mean-square normalisation (Zhang & Sennrich 2019): `x / rms(x) · γ`.
    Rms,
    /// Layer normalisation (Ba et al. 2016): `(x − mean) / std · γ + β`, `β = 0` when the
    /// checkpoint has none (Cohere).
    Layer,
}

/// A normalisation layer of [`NormKind`] with its learned scale (and shift).
pub struct Norm {
    pub(crate) weight: Tensor,
    /// The shift of a layer normalisation; `None` for RMS normalisation.
    pub(crate) bias: Option<Tensor>,
    pub(crate) eps: f32,
}

impl Norm {
    /// Loads `{name}.weight` (and `{name}.bias`, for layer normalisation, when present) of `len`
    /// values. `shift` is added to the stored scale: checkpoints of Gemma and Nemotron store
    /// `γ − 1` (their norms compute `x̂ · (1 + γ)`).
    pub fn load(
        w: &Weights,
        device: &Device,
        name: &str,
        len: usize,
        kind: NormKind,
        eps: f32,
        shift: f32,
    ) -> Result<Norm> {
        let scale = format!("{name}.weight");
        let mut gamma = w.f32(&scale)?;
        if gamma.len() != len {
            return Err(UError::invalid(format!(
                "arch-llama: {scale} has {} values, expected {len}",
                gamma.len()
            )));
        }
        gamma.iter_mut().for_each(|g| *g += shift);
        let bias = match kind {
            NormKind::Layer => {
                let bias = format!("{name}.bias");
                Some(match w.has(&bias) {
                    true => w.vector(device, &bias, len)?,
                    false => device.from_f32(&vec![0.0; len], &[len as u64])?,
                })
            }
            NormKind::Rms => None,
        };
        Ok(Norm {
            weight: device.from_f32(&gamma, &[len as u64])?,
            bias,
            eps,
        })
    }

    /// A norm of `len` values with unit scale (and zero shift): normalisation only.
    pub fn unit(device: &Device, len: usize, kind: NormKind, eps: f32) -> Result<Norm> {
        let bias = match kind {
            NormKind::Layer => Some(device.from_f32(&vec![0.0; len], &[len as u64])?),
            NormKind::Rms => None,
        };
        Ok(Norm {
            weight: device.from_f32(&vec![1.0; len], &[len as u64])?,
            bias,
            eps,
        })
    }

    /// Normalises each row of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => x.layer_norm(&self.weight, b, self.eps),
            None => x.rms_norm(&self.weight, self.eps),
        }
    }
}
