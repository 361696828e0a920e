//! Test-only kernels: the CPU kernels plugin with `matmul` replaced by a test's own function —
//! [`DequantMatmul`]: plain f32 on weights dequantized through `u_sdk::quant` (no activation
//! quantization), to check that the architecture hands quantized weights (and slices of them)
//! to the kernels correctly, independently of the kernels' int8 activation path;
//! [`RecordMatmul`]: the real matmul, noting which weight bytes each call read.

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RSlice, RSliceMut},
};
use std::{
    ops::Range,
    sync::{Arc, Mutex},
};
use u_sdk::{
    Activation, AttentionParams, BackendInfo, DType, Kernels, Kernels_TO, KernelsBox, KvSpan, Op,
    RopeParams, TensorView, UError,
};

/// `matmul(inner, weight, x, m, y)`: a replacement for the kernels' matmul.
pub trait MatmulFn:
    Fn(
        &KernelsBox,
        &TensorView<'_>,
        RSlice<'_, f32>,
        u32,
        RSliceMut<'_, f32>,
    ) -> RResult<(), UError>
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<F> MatmulFn for F where
    F: Fn(
            &KernelsBox,
            &TensorView<'_>,
            RSlice<'_, f32>,
            u32,
            RSliceMut<'_, f32>,
        ) -> RResult<(), UError>
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// `inner` with its matmul replaced by `matmul`; every other op delegated.
#[derive(Clone)]
struct MatmulWith<F> {
    inner: KernelsBox,
    matmul: F,
}

/// Reference f32 matmul over dequantized weights; the rest from `inner`.
pub struct DequantMatmul;

impl DequantMatmul {
    /// Wraps `inner`.
    pub fn new_box(inner: KernelsBox) -> KernelsBox {
        Kernels_TO::from_value(
            MatmulWith {
                inner,
                matmul: dequant_matmul,
            },
            TD_Opaque,
        )
    }
}

fn dequant_matmul(
    _inner: &KernelsBox,
    weight: &TensorView<'_>,
    x: RSlice<'_, f32>,
    m: u32,
    mut y: RSliceMut<'_, f32>,
) -> RResult<(), UError> {
    let w = match u_sdk::quant::dequantize_view(weight) {
        Ok(w) => w,
        Err(e) => return RResult::RErr(e.into()),
    };
    let k = weight.row_len() as usize;
    let n = weight.rows() as usize;
    let m = m as usize;
    if x.len() != m * k || y.len() != m * n || w.len() != n * k {
        return RResult::RErr(UError::invalid("reference matmul: shapes"));
    }
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &w[j * k..(j + 1) * k];
            y[i * n + j] = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
        }
    }
    RResult::ROk(())
}

/// The real matmul of `inner`, recording the address range of every weight it was given.
pub struct RecordMatmul;

impl RecordMatmul {
    /// Wraps `inner`; the returned log fills as the kernels run.
    pub fn new_box(inner: KernelsBox) -> (KernelsBox, Arc<Mutex<Vec<Range<usize>>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&log);
        let matmul = move |inner: &KernelsBox,
                           w: &TensorView<'_>,
                           x: RSlice<'_, f32>,
                           m: u32,
                           y: RSliceMut<'_, f32>| {
            let start = w.data.as_ptr() as usize;
            record.lock().unwrap().push(start..start + w.data.len());
            inner.matmul(w, x, m, y)
        };
        (
            Kernels_TO::from_value(MatmulWith { inner, matmul }, TD_Opaque),
            log,
        )
    }
}

impl<F: MatmulFn> Kernels for MatmulWith<F> {
    fn info(&self) -> BackendInfo {
        self.inner.info()
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        self.inner.supports(op, dtype)
    }

    fn matmul(
        &self,
        weight: &TensorView<'_>,
        x: RSlice<'_, f32>,
        m: u32,
        y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        (self.matmul)(&self.inner, weight, x, m, y)
    }

    fn rms_norm(
        &self,
        x: RSlice<'_, f32>,
        weight: RSlice<'_, f32>,
        eps: f32,
        y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        self.inner.rms_norm(x, weight, eps, y)
    }

    fn layer_norm(
        &self,
        x: RSlice<'_, f32>,
        weight: RSlice<'_, f32>,
        bias: RSlice<'_, f32>,
        eps: f32,
        y: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        self.inner.layer_norm(x, weight, bias, eps, y)
    }

    fn rope(
        &self,
        x: RSliceMut<'_, f32>,
        positions: RSlice<'_, u32>,
        params: &RopeParams,
    ) -> RResult<(), UError> {
        self.inner.rope(x, positions, params)
    }

    fn attention(
        &self,
        q: RSlice<'_, f32>,
        kv: RSlice<'_, KvSpan<'_>>,
        params: &AttentionParams,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        self.inner.attention(q, kv, params, out)
    }

    fn activation(&self, x: RSliceMut<'_, f32>, act: Activation) -> RResult<(), UError> {
        self.inner.activation(x, act)
    }

    fn softmax(&self, x: RSliceMut<'_, f32>, row_len: u32) -> RResult<(), UError> {
        self.inner.softmax(x, row_len)
    }

    fn embedding(
        &self,
        table: &TensorView<'_>,
        ids: RSlice<'_, u32>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), UError> {
        self.inner.embedding(table, ids, out)
    }
}
