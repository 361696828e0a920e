//! One backend for a model from two: ops the preferred backend supports run there, the rest
//! on a fallback (a GPU plugin beside the CPU plugin).
//!
//! The host hands an architecture both ([`crate::BuildContext::fallback`]); the architecture
//! computes on [`crate::BuildContext::compute_backend`], which is a [`Split`] when there is a
//! fallback. An op the preferred backend does not support (or answers `Unsupported` for) runs
//! on the fallback with its operands copied to host memory and its result copied back, each
//! kind of op and dtype reported once on stderr.

use crate::abi::{
    backend::{
        Backend, BackendBox, BackendInfo, BufferBox, BufferType, KeepaliveBox, Op, OpCall, OpKind,
        TensorDesc,
    },
    dtype::DType,
    error::{ErrorKind, UError},
};
use abi_stable::std_types::{RResult, RSlice, RSliceMut};
use std::{
    collections::HashSet,
    sync::{Arc, Mutex},
};

/// A backend that runs what `primary` supports on it and the rest on `fallback`.
#[derive(Clone)]
pub struct Split(Arc<SplitInner>);

struct SplitInner {
    primary: BackendBox,
    fallback: BackendBox,
    /// The fallback's name (its [`BackendInfo::name`]), for reports.
    fallback_name: String,
    /// Ops and types already logged as running on the fallback.
    logged: Mutex<HashSet<(OpKind, DType)>>,
}

/// The dtype [`Backend::supports`] is asked about for `call`: the weight of a matmul, the table
/// of a row lookup or convolution, the KV of attention, the destination of a copy, else `F32`.
fn weight_dtype(call: &OpCall<'_>) -> DType {
    let src = |i: usize| call.srcs.get(i).map_or(DType::F32, |t| t.dtype);
    match &call.op {
        Op::MatMul | Op::Conv1d { .. } | Op::Conv2d { .. } => src(1),
        Op::GetRows => src(0),
        Op::Attention(p) => p.kv_dtype,
        Op::Copy if call.dst.dtype == DType::F32 => src(0),
        Op::Copy => call.dst.dtype,
        _ => DType::F32,
    }
}

impl Split {
    /// `primary`, with `fallback` for the ops it lacks.
    pub fn new(primary: BackendBox, fallback: BackendBox) -> Split {
        let fallback_name = fallback
            .info()
            .into_result()
            .map_or_else(|_| "fallback".to_string(), |i| i.name.into_string());
        Split(Arc::new(SplitInner {
            primary,
            fallback,
            fallback_name,
            logged: Mutex::default(),
        }))
    }

    fn on_primary(&self, call: &OpCall<'_>) -> crate::Result<bool> {
        let dtype = weight_dtype(call);
        let mut supported = self
            .0
            .primary
            .supports(call.op.kind(), dtype)
            .into_result()?;
        if let Op::Copy = call.op {
            let from = call.srcs.first().map_or(DType::F32, |t| t.dtype);
            supported &= self.0.primary.supports(OpKind::Copy, from).into_result()?;
        }
        Ok(supported)
    }

    fn note_fallback(&self, call: &OpCall<'_>, why: &str) {
        let key = (call.op.kind(), weight_dtype(call));
        let mut logged = self.0.logged.lock().unwrap_or_else(|p| p.into_inner());
        if logged.insert(key) {
            eprintln!(
                "kernels: {:?} on {:?} runs on the {} backend ({why})",
                key.0, key.1, self.0.fallback_name
            );
        }
    }

    /// A copy of `t` in the fallback's memory (`t` itself when it is host memory already).
    fn to_host(&self, t: &TensorDesc) -> crate::Result<TensorDesc> {
        if t.buffer.host_address() != 0 {
            return Ok(t.clone());
        }
        let bytes = t
            .byte_len()
            .ok_or_else(|| UError::invalid(format!("{t:?} is not whole blocks")))?;
        let mut data = vec![0u8; bytes as usize];
        t.buffer
            .read(t.offset, RSliceMut::from_mut_slice(&mut data))
            .into_result()?;
        let buffer = self.0.fallback.alloc(bytes.max(1)).into_result()?;
        buffer.write(0, RSlice::from_slice(&data)).into_result()?;
        Ok(TensorDesc {
            buffer,
            offset: 0,
            dtype: t.dtype,
            shape: t.shape,
        })
    }

    /// Runs `call` on the fallback: operands copied to host memory, the result copied back.
    fn run_on_fallback(&self, call: &OpCall<'_>) -> crate::Result<()> {
        self.0.primary.synchronize().into_result()?;
        let srcs: Vec<TensorDesc> = call
            .srcs
            .iter()
            .map(|t| self.to_host(t))
            .collect::<crate::Result<_>>()?;
        let dst = self.to_host(call.dst)?;
        let refs: Vec<&TensorDesc> = srcs.iter().collect();
        let moved = OpCall {
            op: call.op.clone(),
            srcs: RSlice::from_slice(&refs),
            dst: &dst,
        };
        self.0
            .fallback
            .compute(RSlice::from_slice(std::slice::from_ref(&moved)))
            .into_result()?;
        self.0.fallback.synchronize().into_result()?;
        if call.dst.buffer.host_address() != 0 {
            return Ok(());
        }
        let bytes = dst.byte_len().unwrap_or(0) as usize;
        let mut data = vec![0u8; bytes];
        dst.buffer
            .read(0, RSliceMut::from_mut_slice(&mut data))
            .into_result()?;
        call.dst
            .buffer
            .write(call.dst.offset, RSlice::from_slice(&data))
            .into_result()
    }

    fn run(&self, call: &OpCall<'_>) -> crate::Result<()> {
        if !self.on_primary(call)? {
            self.note_fallback(call, "the preferred backend lacks it");
            return self.run_on_fallback(call);
        }
        match self
            .0
            .primary
            .compute(RSlice::from_slice(std::slice::from_ref(call)))
            .into_result()
        {
            Err(e) if e.kind == ErrorKind::Unsupported => {
                self.note_fallback(call, &e.message);
                self.run_on_fallback(call)
            }
            other => other,
        }
    }
}

impl Backend for Split {
    fn info(&self) -> RResult<BackendInfo, UError> {
        self.0.primary.info().map(|mut info| {
            info.features
                .push(format!("fallback={}", self.0.fallback_name).into());
            info
        })
    }

    fn buffer_type(&self) -> RResult<BufferType, UError> {
        self.0.primary.buffer_type()
    }

    fn supports(&self, op: OpKind, dtype: DType) -> RResult<bool, UError> {
        let either = || -> crate::Result<bool> {
            Ok(self.0.primary.supports(op, dtype).into_result()?
                || self.0.fallback.supports(op, dtype).into_result()?)
        };
        either().into()
    }

    fn alloc(&self, bytes: u64) -> RResult<BufferBox, UError> {
        self.0.primary.alloc(bytes)
    }

    fn import(&self, bytes: RSlice<'_, u8>, owner: KeepaliveBox) -> RResult<BufferBox, UError> {
        self.0.primary.import(bytes, owner)
    }

    fn compute(&self, ops: RSlice<'_, OpCall<'_>>) -> RResult<(), UError> {
        ops.iter().try_for_each(|call| self.run(call)).into()
    }

    fn synchronize(&self) -> RResult<(), UError> {
        self.0.primary.synchronize()
    }
}
