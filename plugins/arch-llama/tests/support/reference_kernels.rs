//! Test-only backends: the CPU backend plugin with `MatMul` replaced (through
//! `u_kernels_cpu::testutil::BackendWith`) — [`DequantMatmul`]: plain f32 on weights
//! dequantized through `u_sdk::quant` (no activation quantization), to check that the
//! architecture hands quantized weights (and slices of them) to the backend correctly,
//! independently of the kernels' int8 activation path; [`RecordMatmul`]: the real matmul,
//! noting which weight bytes each call read.

use abi_stable::std_types::RSliceMut;
use std::{
    ops::Range,
    sync::{Arc, Mutex},
};
use u_kernels_cpu::testutil::BackendWith;
use u_sdk::{BackendBox, OpCall, OpKind, TensorDesc, UError};

/// Reference f32 matmul over dequantized weights; the rest from `inner`.
pub struct DequantMatmul;

impl DequantMatmul {
    /// Wraps `inner`.
    pub fn new_box(inner: BackendBox) -> BackendBox {
        BackendWith::new(inner)
            .replace(OpKind::MatMul, |_, call| dequant_matmul(call).into())
            .into_box()
    }
}

/// A host tensor's stored bytes.
fn bytes(t: &TensorDesc) -> &[u8] {
    let len = t.byte_len().expect("whole blocks") as usize;
    // SAFETY: test backends are host backends; the descriptor keeps its buffer alive for the
    // call and its bytes lie inside it.
    unsafe {
        std::slice::from_raw_parts(
            (t.buffer.host_address() + t.offset as usize) as *const u8,
            len,
        )
    }
}

fn dequant_matmul(call: &OpCall<'_>) -> Result<(), UError> {
    let (x, w) = (call.srcs[0], call.srcs[1]);
    let wv = u_sdk::quant::dequantize_to_vec(w.dtype, bytes(w))
        .map_err(|e| UError::invalid(e.to_string()))?;
    let xv = u_sdk::quant::dequantize_to_vec(x.dtype, bytes(x))
        .map_err(|e| UError::invalid(e.to_string()))?;
    let k = w.shape.row_len() as usize;
    let n = w.shape.rows() as usize;
    let m = xv.len() / k;
    if xv.len() != m * k || call.dst.shape.elements() as usize != m * n || wv.len() != n * k {
        return Err(UError::invalid("reference matmul: shapes"));
    }
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        let xr = &xv[i * k..(i + 1) * k];
        for j in 0..n {
            let wr = &wv[j * k..(j + 1) * k];
            y[i * n + j] = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
        }
    }
    let mut out: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    call.dst
        .buffer
        .write(
            call.dst.offset,
            RSliceMut::from_mut_slice(&mut out).as_slice().into(),
        )
        .into_result()
}

/// The real matmul of `inner`, recording the address range of every weight it was given.
pub struct RecordMatmul;

impl RecordMatmul {
    /// Wraps `inner`; the returned log fills as the backend runs.
    pub fn new_box(inner: BackendBox) -> (BackendBox, Arc<Mutex<Vec<Range<usize>>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&log);
        let backend = BackendWith::new(inner).replace(OpKind::MatMul, move |inner, call| {
            let w = call.srcs[1];
            let start = w.buffer.host_address() + w.offset as usize;
            record
                .lock()
                .unwrap()
                .push(start..start + w.byte_len().unwrap_or(0) as usize);
            inner.compute(std::slice::from_ref(call).into())
        });
        (backend.into_box(), log)
    }
}
