//! A test-only [`WeightSet`] that presents another weight set with every tensor dequantized to
//! F32 (through `u_sdk::quant`), to compare quantized weights used in place with the same
//! values in f32.

use abi_stable::std_types::{ROption, RResult, RSlice, RStr, RString, RVec};
use std::{collections::HashMap, sync::Arc};
use u_sdk::{DType, MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

/// A tensor's shape and F32 bytes.
type F32Tensor = (Vec<u64>, Vec<u8>);

/// `inner` with all tensors as F32 copies.
#[derive(Clone)]
pub struct Dequantized {
    inner: WeightSetBox,
    tensors: Arc<HashMap<String, F32Tensor>>,
}

impl Dequantized {
    /// Dequantizes every tensor of `inner`.
    pub fn new_box(inner: WeightSetBox) -> anyhow::Result<WeightSetBox> {
        Self::without(inner, &[])
    }

    /// Dequantizes every tensor of `inner` but those named in `left_out`, which it lacks.
    pub fn without(inner: WeightSetBox, left_out: &[&str]) -> anyhow::Result<WeightSetBox> {
        let mut tensors = HashMap::new();
        for info in inner.tensors().into_result()? {
            if left_out.contains(&info.name.as_str()) {
                continue;
            }
            let view = inner.tensor(info.name.as_str().into()).into_result()?;
            let values = u_sdk::quant::dequantize_view(&view)?;
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.insert(info.name.into_string(), (info.shape.into_vec(), bytes));
        }
        Ok(WeightSetBox::new(Dequantized {
            inner,
            tensors: Arc::new(tensors),
        }))
    }
}

impl WeightSet for Dequantized {
    fn format(&self) -> RResult<RString, UError> {
        self.inner.format()
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        self.inner.architecture()
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        self.inner.metadata_keys()
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        self.inner.metadata(key)
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        RResult::ROk(
            self.tensors
                .iter()
                .map(|(name, (shape, bytes))| TensorInfo {
                    name: name.as_str().into(),
                    dtype: DType::F32,
                    shape: shape.clone().into(),
                    byte_len: bytes.len() as u64,
                })
                .collect(),
        )
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        match self.tensors.get(name.as_str()) {
            Some((shape, bytes)) => RResult::ROk(TensorView {
                dtype: DType::F32,
                shape: shape.clone().into(),
                data: RSlice::from_slice(bytes),
            }),
            None => RResult::RErr(UError::not_found(format!("no tensor {name}"))),
        }
    }
}
