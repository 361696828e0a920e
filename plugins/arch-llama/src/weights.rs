//! Access to the weight set: typed metadata, tensor shapes, and the linear layer.
//!
//! Large tensors are never copied: a [`Linear`] takes one zero-copy view of its weight at load
//! and keeps it, with a handle on the weight set that keeps the view's bytes alive, so a forward
//! pass neither looks tensors up nor allocates. Small vectors (norm scales, biases) are decoded
//! to `f32` once at load.

use abi_stable::std_types::{RSlice, RSliceMut};
use serde_json::Value;
use u_sdk::{DType, KernelsBox, MetaValue, Result, TensorView, UError, WeightSetBox};

/// The weight set with typed accessors.
#[derive(Clone)]
pub struct Weights {
    set: WeightSetBox,
    shapes: std::collections::HashMap<String, Vec<u64>>,
}

impl Weights {
    /// Wraps a weight set, indexing its tensor shapes.
    pub fn new(set: WeightSetBox) -> Weights {
        let shapes = set
            .tensors()
            .into_iter()
            .map(|t| (t.name.into_string(), t.shape.into_vec()))
            .collect();
        Weights { set, shapes }
    }

    /// One metadata value.
    pub fn meta(&self, key: &str) -> Option<MetaValue> {
        self.set.metadata(key.into()).into_option()
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

    /// Every tensor's name and shape (in no particular order).
    pub fn shapes(&self) -> impl Iterator<Item = (&String, &Vec<u64>)> {
        self.shapes.iter()
    }

    /// Whether a tensor exists.
    pub fn has(&self, name: &str) -> bool {
        self.shapes.contains_key(name)
    }

    /// A tensor's shape, outermost first.
    pub fn shape(&self, name: &str) -> Result<Vec<u64>> {
        self.shapes
            .get(name)
            .cloned()
            .ok_or_else(|| UError::not_found(format!("arch-llama: tensor `{name}` is missing")))
    }

    /// A zero-copy view of a tensor.
    pub fn view(&self, name: &str) -> Result<TensorView<'_>> {
        self.set.tensor(name.into()).into_result()
    }

    /// A tensor decoded to `f32` (for small vectors).
    pub fn f32(&self, name: &str) -> Result<Vec<f32>> {
        let v = self.view(name)?;
        u_sdk::quant::dequantize_view(&v).map_err(|e| UError::invalid(format!("{name}: {e}")))
    }

    /// A vector of exactly `len` values.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let v = self.f32(name)?;
        if v.len() != len {
            return Err(UError::invalid(format!(
                "arch-llama: {name} has {} values, expected {len}",
                v.len()
            )));
        }
        Ok(v)
    }
}

/// `y = x·Wᵀ (+ b)`: a weight of shape `[out, in]` in any dtype the kernels take — or one
/// expert's slice of a stacked `[E, out, in]` tensor (GGUF) — and an optional f32 bias.
pub struct Linear {
    bias: Option<Vec<f32>>,
    /// The weight as the kernels take it, `[out, in]`. Its bytes borrow `set` (declared after
    /// it, so dropped after it).
    view: TensorView<'static>,
    /// The weight set `view` was taken from, kept alive with it.
    _set: WeightSetBox,
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
}

impl Linear {
    /// Loads `{name}.weight` (and `{name}.bias` when `bias` is asked for and present), checking
    /// that it maps `inputs` features. A 1-D weight of `inputs` values is one output row.
    pub fn load(w: &Weights, name: &str, inputs: usize, bias: bool) -> Result<Linear> {
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
            Some(w.vector(&bias_name, outputs)?)
        } else {
            None
        };
        let (view, set) = bind(w, &weight, None, outputs, inputs)?;
        Ok(Linear {
            bias,
            view,
            _set: set,
            inputs,
            outputs,
        })
    }

    /// Expert `index` of a stacked `[E, out, in]` tensor `name`.
    pub fn stacked(w: &Weights, name: &str, index: usize, inputs: usize) -> Result<Linear> {
        let shape = w.shape(name)?;
        let bad = || {
            UError::invalid(format!(
                "arch-llama: {name} has shape {shape:?}, expected [>{index}, _, {inputs}]"
            ))
        };
        let (experts, outputs) = match shape.as_slice() {
            [e, o, i] if *i as usize == inputs => (*e as usize, *o as usize),
            _ => return Err(bad()),
        };
        if index >= experts {
            return Err(bad());
        }
        let dtype = w.view(name)?.dtype;
        let per = dtype
            .bytes_for(outputs as u64 * inputs as u64)
            .ok_or_else(bad)? as usize;
        let bytes = index * per..(index + 1) * per;
        let (view, set) = bind(w, name, Some(&bytes), outputs, inputs)?;
        Ok(Linear {
            bias: None,
            view,
            _set: set,
            inputs,
            outputs,
        })
    }

    /// Asks the kernel to read this weight's pages ahead (`madvise(MADV_WILLNEED)` on the mapped
    /// bytes), so a page fault does not stall the matmul that follows. Advice only: failures
    /// (e.g. weights that are not file-mapped) are ignored.
    pub fn prefetch(&self) {
        will_need(self.view.data.as_slice());
    }

    /// The weight as the kernels take it (`[out, in]`).
    pub fn view(&self) -> &TensorView<'_> {
        &self.view
    }

    /// The weight's dtype.
    pub fn dtype(&self) -> DType {
        self.view.dtype
    }

    /// `y[m × out] = x[m × in]·Wᵀ + b`.
    pub fn forward(&self, k: &KernelsBox, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        let y = &mut y[..m * self.outputs];
        k.matmul(
            &self.view,
            RSlice::from_slice(&x[..m * self.inputs]),
            m as u32,
            RSliceMut::from_mut_slice(y),
        )
        .into_result()?;
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.outputs) {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            }
        }
        Ok(())
    }
}

/// `madvise(MADV_WILLNEED)` over the pages holding `bytes`.
fn will_need(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // SAFETY: sysconf has no preconditions.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => 4096,
    };
    let start = bytes.as_ptr() as usize & !(page - 1);
    let end = bytes.as_ptr() as usize + bytes.len();
    // SAFETY: MADV_WILLNEED only schedules reads of pages of this process's own mappings; it
    // changes no contents, and a range that is not mapped just makes the call fail.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_WILLNEED);
    }
}

/// A view of `name` (its byte range `bytes`, if given) as an `[outputs, inputs]` weight, and the
/// handle on the weight set that keeps its bytes alive.
fn bind(
    w: &Weights,
    name: &str,
    bytes: Option<&std::ops::Range<usize>>,
    outputs: usize,
    inputs: usize,
) -> Result<(TensorView<'static>, WeightSetBox)> {
    let set = w.set.clone();
    let full = set.tensor(name.into()).into_result()?;
    let all = full.data.as_slice();
    let data = match bytes {
        None => all,
        Some(r) => all.get(r.clone()).ok_or_else(|| {
            UError::invalid(format!("arch-llama: {name} is shorter than its shape"))
        })?,
    };
    let view = TensorView {
        dtype: full.dtype,
        shape: vec![outputs as u64, inputs as u64].into(),
        data: RSlice::from_slice(data),
    };
    // SAFETY: the bytes live in the weight set's memory map (a heap object behind `set`, which
    // moving the handle does not move) and the set's API is immutable, so they stay valid and
    // unchanged while `set` lives; `Linear` keeps `set` and drops the view first.
    let view = unsafe { std::mem::transmute::<TensorView<'_>, TensorView<'static>>(view) };
    Ok((view, set))
}
