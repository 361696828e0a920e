//! Test-only kernels: the CPU kernels plugin with `matmul` replaced (through
//! `u_kernels_cpu::testutil::KernelsWith`) — [`DequantMatmul`]: plain f32 on weights
//! dequantized through `u_sdk::quant` (no activation quantization), to check that the
//! architecture hands quantized weights (and slices of them) to the kernels correctly,
//! independently of the kernels' int8 activation path; [`RecordMatmul`]: the real matmul,
//! noting which weight bytes each call read.

use abi_stable::std_types::{RResult, RSlice, RSliceMut};
use std::{
    ops::Range,
    sync::{Arc, Mutex},
};
use u_kernels_cpu::testutil::KernelsWith;
use u_sdk::{KernelsBox, TensorView, UError};

/// Reference f32 matmul over dequantized weights; the rest from `inner`.
pub struct DequantMatmul;

impl DequantMatmul {
    /// Wraps `inner`.
    pub fn new_box(inner: KernelsBox) -> KernelsBox {
        KernelsWith::new(inner).matmul(dequant_matmul).into_box()
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
        let kernels = KernelsWith::new(inner).matmul(move |inner, w, x, m, y| {
            let start = w.data.as_ptr() as usize;
            record.lock().unwrap().push(start..start + w.data.len());
            inner.matmul(w, x, m, y)
        });
        (kernels.into_box(), log)
    }
}
