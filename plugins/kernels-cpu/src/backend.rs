//! The CPU as a [`Backend`]: host buffers from a reusing pool, imported memory used in place,
//! and every op of a list run at once, in order, on the kernels of the chosen ISA.
//!
//! Buffers are 64-byte aligned host memory. A dropped buffer goes back to the pool (size
//! classes an eighth of a power of two apart, so a forward pass that asks for the same shapes
//! as the last one reuses the same memory) until the pool holds [`POOL_LIMIT`] free bytes.
//! Imported memory (a weight set's map, a mapped KV file) is never copied: the buffer points
//! into it and holds its owner. Any host buffer works as an operand — a cache's own, a test's —
//! through [`Buffer::host_address`].

use crate::{
    attention::{self, KvSpan},
    conv::{self, Conv},
    elementwise::{self, Binary},
    engine::{CpuKernels, Engine},
    grad, matmul, ops, quantize, routing,
};
use abi_stable::std_types::{RResult, RSlice, RSliceMut};
use std::{
    alloc::Layout,
    collections::BTreeMap,
    ptr::NonNull,
    sync::{Arc, Mutex},
};
use u_sdk::{
    AttentionMask, AttentionParams, Backend, BackendBox, BackendInfo, Buffer, BufferBox,
    BufferType, DType, KeepaliveBox, Op, OpCall, OpKind, Result, TensorDesc, TensorView, UError,
};

/// Alignment of every pooled buffer.
pub const ALIGN: usize = 64;
/// Free bytes the pool keeps for reuse; past this, dropped buffers are freed.
pub const POOL_LIMIT: usize = 1 << 30;

/// Free blocks by capacity.
#[derive(Default)]
struct Pool {
    free: Mutex<(BTreeMap<usize, Vec<Block>>, usize)>,
}

/// One aligned heap block.
struct Block {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: a block is plain memory owned by whoever holds it (the pool or one buffer).
unsafe impl Send for Block {}

impl Block {
    fn alloc(cap: usize) -> Result<Block> {
        let layout = Layout::from_size_align(cap, ALIGN)
            .map_err(|e| UError::invalid(format!("kernels-cpu: buffer of {cap} bytes: {e}")))?;
        // SAFETY: `cap > 0` (size classes start at one page).
        let ptr = unsafe { std::alloc::alloc(layout) };
        NonNull::new(ptr)
            .map(|ptr| Block { ptr, cap })
            .ok_or_else(|| {
                UError::new(
                    u_sdk::ErrorKind::ResourceExhausted,
                    format!("kernels-cpu: out of memory allocating {cap} bytes"),
                )
            })
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated in `Block::alloc` with this capacity and alignment.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.cap, ALIGN),
            )
        };
    }
}

/// The capacity class of a request: whole pages, in steps of an eighth of the power of two
/// below it (so past 32 KiB at most 12.5 % is wasted).
fn size_class(bytes: usize) -> usize {
    if bytes <= 4096 {
        return 4096;
    }
    let step = (bytes.next_power_of_two() / 16).max(4096);
    bytes.div_ceil(step) * step
}

impl Pool {
    fn take(&self, bytes: usize) -> Result<Block> {
        let cap = size_class(bytes);
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let (lists, held) = &mut *free;
            if let Some(block) = lists.get_mut(&cap).and_then(Vec::pop) {
                *held -= cap;
                return Ok(block);
            }
        }
        Block::alloc(cap)
    }

    fn give(&self, block: Block) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let (lists, held) = &mut *free;
        if *held + block.cap <= POOL_LIMIT {
            *held += block.cap;
            lists.entry(block.cap).or_default().push(block);
        }
    }
}

/// Where a buffer's bytes come from.
enum Memory {
    /// A pool block, returned to the pool on drop.
    Pooled(Option<Block>, Arc<Pool>),
    /// Host memory someone else owns, kept alive by its owner.
    Imported(#[allow(dead_code)] KeepaliveBox),
}

struct Mem {
    ptr: *mut u8,
    len: usize,
    memory: Memory,
}

// SAFETY: the memory is plain bytes; concurrent access is governed by the backend protocol
// (ops write only their destinations, callers order their ops).
unsafe impl Send for Mem {}
// SAFETY: as above.
unsafe impl Sync for Mem {}

impl Drop for Mem {
    fn drop(&mut self) {
        if let Memory::Pooled(block, pool) = &mut self.memory
            && let Some(block) = block.take()
        {
            pool.give(block);
        }
    }
}

/// A CPU buffer.
#[derive(Clone)]
struct CpuBuffer(Arc<Mem>);

impl CpuBuffer {
    fn range(&self, offset: u64, n: usize) -> Result<*mut u8> {
        let end = (offset as usize).checked_add(n);
        match end {
            Some(end) if end <= self.0.len => {
                // SAFETY: in bounds (checked).
                Ok(unsafe { self.0.ptr.add(offset as usize) })
            }
            _ => Err(UError::invalid(format!(
                "kernels-cpu: bytes {offset}..{offset}+{n} of a buffer of {}",
                self.0.len
            ))),
        }
    }
}

impl Buffer for CpuBuffer {
    fn byte_len(&self) -> u64 {
        self.0.len as u64
    }

    fn host_address(&self) -> usize {
        self.0.ptr as usize
    }

    fn read_only(&self) -> bool {
        matches!(self.0.memory, Memory::Imported(_))
    }

    fn write(&self, offset: u64, bytes: RSlice<'_, u8>) -> RResult<(), UError> {
        if self.read_only() {
            return RResult::RErr(UError::denied("kernels-cpu: imported memory is read-only"));
        }
        self.range(offset, bytes.len())
            .map(|dst| {
                // SAFETY: `dst..dst + len` is inside the buffer; `bytes` is the caller's own
                // memory, not this buffer's (a shared `&` borrow of it could not be written).
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) }
            })
            .into()
    }

    fn read(&self, offset: u64, mut out: RSliceMut<'_, u8>) -> RResult<(), UError> {
        let n = out.len();
        self.range(offset, n)
            .map(|src| {
                // SAFETY: `src..src + n` is inside the buffer; `out` is exclusively borrowed.
                unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), n) }
            })
            .into()
    }
}

/// The backend object: the kernels plus the buffer pool. Cheap to clone.
#[derive(Clone)]
pub struct CpuBackend {
    kernels: CpuKernels,
    pool: Arc<Pool>,
}

impl CpuBackend {
    /// A backend over `kernels`.
    pub fn new(kernels: CpuKernels) -> CpuBackend {
        CpuBackend {
            kernels,
            pool: Arc::new(Pool::default()),
        }
    }

    /// The kernels it runs.
    pub fn kernels(&self) -> &CpuKernels {
        &self.kernels
    }

    /// As the ABI object.
    pub fn into_box(self) -> BackendBox {
        BackendBox::new(self)
    }

    fn eng(&self) -> &Engine {
        self.kernels.engine()
    }

    fn run(&self, call: &OpCall<'_>) -> Result<()> {
        let srcs = call.srcs.as_slice();
        let name = call.op.kind();
        let need = |n: usize| -> Result<()> {
            if srcs.len() < n {
                return Err(UError::invalid(format!(
                    "kernels-cpu {name:?}: {} sources, needs {n}",
                    srcs.len()
                )));
            }
            Ok(())
        };
        let dst = Region::of(call.dst)?;
        match &call.op {
            Op::MatMul => {
                need(2)?;
                let (x, w) = (Region::of(srcs[0])?, Region::of(srcs[1])?);
                dst.apart(&[&x, &w])?;
                let k = w.desc.shape.row_len() as usize;
                let n = w.desc.shape.rows() as usize;
                let xs = x.f32()?;
                let m = xs.len() / k.max(1);
                let weight = matmul::Weight {
                    dtype: w.desc.dtype,
                    rows: n as u64,
                    row_len: k as u64,
                    data: w.bytes(),
                };
                matmul::matmul_weight(self.eng(), weight, xs, m, dst.f32_mut()?)
            }
            Op::Add
            | Op::Mul
            | Op::AddScaled(_)
            | Op::Gated(_)
            | Op::Scale(_)
            | Op::Clamp { .. } => {
                let unary = matches!(call.op, Op::Scale(_) | Op::Clamp { .. });
                need(if unary { 1 } else { 2 })?;
                let a = Region::of(srcs[0])?;
                let b = if unary {
                    a.clone()
                } else {
                    Region::of(srcs[1])?
                };
                dst.in_place_or_apart(&[&a, &b])?;
                let op = Binary {
                    a: a.f32()?.as_ptr(),
                    b: b.f32()?.as_ptr(),
                    out: dst.f32_mut_ptr()?,
                    n: a.elements(),
                    b_len: b.elements(),
                };
                if dst.elements() != op.n {
                    return Err(UError::invalid(format!(
                        "kernels-cpu {name:?}: destination of {} values for {}",
                        dst.elements(),
                        op.n
                    )));
                }
                let eng = self.eng();
                // SAFETY: `a`, `b` and `dst` hold `n`, `b_len` and `n` values (checked above by
                // construction of the regions), and `dst` overlaps a source only exactly.
                unsafe {
                    match call.op {
                        Op::Add => elementwise::add(eng, op),
                        Op::Mul => elementwise::mul(eng, op),
                        Op::AddScaled(f) => elementwise::add_scaled(eng, op, f),
                        Op::Gated(act) => elementwise::gated(eng, op, act),
                        Op::Scale(f) => elementwise::scale(eng, op, f),
                        Op::Clamp { min, max } => elementwise::clamp(eng, op, min, max),
                        _ => unreachable!("matched above"),
                    }
                }
            }
            Op::RmsNorm(eps) => {
                need(2)?;
                let (x, w) = (Region::of(srcs[0])?, Region::of(srcs[1])?);
                dst.apart(&[&x, &w])?;
                ops::rms_norm(self.eng(), x.f32()?, w.f32()?, *eps, dst.f32_mut()?)
            }
            Op::RmsNormBackward(eps) => {
                need(3)?;
                let (x, w, dy) = (
                    Region::of(srcs[0])?,
                    Region::of(srcs[1])?,
                    Region::of(srcs[2])?,
                );
                dst.apart(&[&x, &w, &dy])?;
                grad::rms_norm_backward(x.f32()?, w.f32()?, dy.f32()?, *eps, dst.f32_mut()?)
            }
            Op::LayerNorm(eps) => {
                need(3)?;
                let (x, w, b) = (
                    Region::of(srcs[0])?,
                    Region::of(srcs[1])?,
                    Region::of(srcs[2])?,
                );
                dst.apart(&[&x, &w, &b])?;
                ops::layer_norm(
                    self.eng(),
                    x.f32()?,
                    w.f32()?,
                    b.f32()?,
                    *eps,
                    dst.f32_mut()?,
                )
            }
            Op::GroupNorm { groups, eps } => {
                need(3)?;
                let (x, w, b) = (
                    Region::of(srcs[0])?,
                    Region::of(srcs[1])?,
                    Region::of(srcs[2])?,
                );
                dst.apart(&[&x, &w, &b])?;
                let channels = x.desc.shape.dims()[0] as usize;
                conv::group_norm(
                    x.f32()?,
                    channels,
                    *groups as usize,
                    w.f32()?,
                    b.f32()?,
                    *eps,
                    dst.f32_mut()?,
                )
            }
            Op::Rope(params) => {
                need(2)?;
                let (x, pos) = (Region::of(srcs[0])?, Region::of(srcs[1])?);
                dst.in_place_or_apart(&[&x])?;
                dst.apart(&[&pos])?;
                let out = dst.copied_from(&x)?;
                match srcs.get(2) {
                    None => ops::rope(out, pos.i32()?, params),
                    Some(from) => {
                        let from = Region::of(from)?;
                        dst.apart(&[&from])?;
                        ops::rope_move(out, pos.i32()?, from.i32()?, params)
                    }
                }
            }
            Op::Attention(params) => {
                need(1)?;
                let q = Region::of(srcs[0])?;
                let kv: Vec<Region<'_>> = srcs[1..]
                    .iter()
                    .map(|d| Region::of(d))
                    .collect::<Result<_>>()?;
                dst.apart(&[&q])?;
                dst.apart(&kv.iter().collect::<Vec<_>>())?;
                self.attention(&q, &kv, params, dst.f32_mut()?)
            }
            Op::Activation(act) => {
                need(1)?;
                let x = Region::of(srcs[0])?;
                dst.in_place_or_apart(&[&x])?;
                ops::activation(self.eng(), dst.copied_from(&x)?, *act);
                Ok(())
            }
            Op::Softmax => {
                need(1)?;
                let x = Region::of(srcs[0])?;
                dst.in_place_or_apart(&[&x])?;
                let row = x.desc.shape.row_len() as usize;
                ops::softmax(dst.copied_from(&x)?, row)
            }
            Op::SoftmaxBackward => {
                need(2)?;
                let (y, dy) = (Region::of(srcs[0])?, Region::of(srcs[1])?);
                dst.apart(&[&y])?;
                dst.in_place_or_apart(&[&dy])?;
                let row = y.desc.shape.row_len() as usize;
                grad::softmax_backward(y.f32()?, dst.copied_from(&dy)?, row)
            }
            Op::GetRows => {
                need(2)?;
                let (table, ids) = (Region::of(srcs[0])?, Region::of(srcs[1])?);
                dst.apart(&[&table, &ids])?;
                let view = TensorView {
                    dtype: table.desc.dtype,
                    shape: table.desc.shape.dims().to_vec().into(),
                    data: RSlice::from_slice(table.bytes()),
                };
                ops::embedding(self.eng(), &view, ids.u32()?, dst.f32_mut()?)
            }
            Op::ScatterAdd => {
                need(3)?;
                let (rows, ids, w) = (
                    Region::of(srcs[0])?,
                    Region::of(srcs[1])?,
                    Region::of(srcs[2])?,
                );
                dst.apart(&[&rows, &ids, &w])?;
                let row = rows.desc.shape.row_len() as usize;
                routing::scatter_add(rows.f32()?, ids.i32()?, w.f32()?, row, dst.f32_mut()?)
            }
            Op::Transpose => {
                need(1)?;
                let x = Region::of(srcs[0])?;
                dst.apart(&[&x])?;
                let (rows, cols) = match x.desc.shape.dims() {
                    &[r, c] if dst.desc.shape.dims() == [c, r] => (r as usize, c as usize),
                    d => {
                        return Err(UError::invalid(format!(
                            "kernels-cpu transpose: {d:?} into {:?}",
                            dst.desc.shape.dims()
                        )));
                    }
                };
                let (src, out) = (x.f32()?, dst.f32_mut()?);
                for (i, row) in src.chunks_exact(cols).enumerate().take(rows) {
                    for (j, &v) in row.iter().enumerate() {
                        out[j * rows + i] = v;
                    }
                }
                Ok(())
            }
            Op::LowRank => {
                need(4)?;
                let (x, a, bt, table) = (
                    Region::of(srcs[0])?,
                    Region::of(srcs[1])?,
                    Region::of(srcs[2])?,
                    Region::of(srcs[3])?,
                );
                dst.apart(&[&x, &a, &bt, &table])?;
                let inputs = x.desc.shape.row_len() as usize;
                crate::low_rank::low_rank(
                    &self.eng().vec,
                    x.f32()?,
                    a.f32()?,
                    bt.f32()?,
                    table.f32()?,
                    inputs,
                    dst.f32_mut()?,
                )
            }
            Op::TopK(k) => {
                need(1)?;
                let x = Region::of(srcs[0])?;
                dst.apart(&[&x])?;
                let row = x.desc.shape.row_len() as usize;
                routing::top_k(x.f32()?, row, *k as usize, dst.i32_mut()?)
            }
            Op::Conv1d { .. } | Op::Conv2d { .. } => {
                need(2)?;
                let (one_d, stride, [padding, padding_end]) = match &call.op {
                    Op::Conv1d { stride, padding } => (true, *stride, [*padding; 2]),
                    Op::Conv2d { stride, padding } => (false, *stride, *padding),
                    _ => unreachable!("matched above"),
                };
                let (x, w) = (Region::of(srcs[0])?, Region::of(srcs[1])?);
                let b = srcs.get(2).map(|d| Region::of(d)).transpose()?;
                dst.apart(&[&x, &w])?;
                let (xd, wd) = (x.desc.shape.dims(), w.desc.shape.dims());
                let bad = || {
                    UError::invalid(format!(
                        "kernels-cpu {name:?}: input {xd:?} and weight {wd:?}"
                    ))
                };
                let g = match (one_d, xd, wd) {
                    (true, &[c_in, len], &[c_out, wc, k]) if wc == c_in => Conv {
                        c_in: c_in as usize,
                        c_out: c_out as usize,
                        h: 1,
                        w: len as usize,
                        kh: 1,
                        kw: k as usize,
                        stride: stride as usize,
                        padding: padding as usize,
                        padding_end: padding_end as usize,
                        one_d,
                    },
                    (false, &[c_in, h, wi], &[c_out, wc, kh, kw]) if wc == c_in => Conv {
                        c_in: c_in as usize,
                        c_out: c_out as usize,
                        h: h as usize,
                        w: wi as usize,
                        kh: kh as usize,
                        kw: kw as usize,
                        stride: stride as usize,
                        padding: padding as usize,
                        padding_end: padding_end as usize,
                        one_d,
                    },
                    _ => return Err(bad()),
                };
                let weight = w.dequantized()?;
                let bias = match &b {
                    Some(b) => Some(b.f32()?),
                    None => None,
                };
                conv::conv(self.eng(), g, x.f32()?, &weight, bias, dst.f32_mut()?)
            }
            Op::Upsample(factor) => {
                need(1)?;
                let x = Region::of(srcs[0])?;
                dst.apart(&[&x])?;
                let (c, h, w) = match x.desc.shape.dims() {
                    &[c, h, w] => (c as usize, h as usize, w as usize),
                    d => {
                        return Err(UError::invalid(format!(
                            "kernels-cpu Upsample: input {d:?} is not [c, h, w]"
                        )));
                    }
                };
                conv::upsample(x.f32()?, c, h, w, *factor as usize, dst.f32_mut()?)
            }
            Op::Copy => {
                need(1)?;
                let x = Region::of(srcs[0])?;
                dst.apart(&[&x])?;
                match srcs.get(1) {
                    None => convert(self.eng(), &x, &dst),
                    Some(scales) => {
                        let scales = Region::of(scales)?;
                        dst.apart(&[&scales])?;
                        dequantize_kv(&x, &scales, &dst)
                    }
                }
            }
        }
    }

    fn attention(
        &self,
        q: &Region<'_>,
        kv: &[Region<'_>],
        p: &AttentionParams,
        out: &mut [f32],
    ) -> Result<()> {
        let per_span = if p.kv_dtype == DType::I8 { 4 } else { 2 };
        if !kv.len().is_multiple_of(per_span) {
            return Err(UError::invalid(format!(
                "kernels-cpu attention: {} KV tensors are not whole spans of {per_span}",
                kv.len()
            )));
        }
        let spans = kv
            .chunks_exact(per_span)
            .map(|s| {
                let tokens = s[0].desc.shape.rows() as u32;
                Ok(match s {
                    [k, v] => KvSpan::bytes(tokens, k.bytes(), v.bytes()),
                    [k, v, ks, vs] => KvSpan {
                        tokens,
                        keys: k.bytes(),
                        values: v.bytes(),
                        key_scales: ks.f32()?,
                        value_scales: vs.f32()?,
                    },
                    _ => unreachable!("chunks of per_span"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let kv_len: u32 = spans.iter().map(|s| s.tokens).sum();
        let width = (p.heads * p.head_dim) as u64;
        let queries = q.desc.shape.elements().checked_div(width).unwrap_or(0) as u32;
        let params = attention::Params {
            heads: p.heads,
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            queries,
            kv_len,
            first_query_pos: match p.mask {
                AttentionMask::Causal => p.first_query_pos,
                AttentionMask::Bidirectional => kv_len.saturating_sub(1),
            },
            window: match p.mask {
                AttentionMask::Causal => p.window,
                AttentionMask::Bidirectional => 0,
            },
            scale: p.scale,
            softcap: p.softcap,
            kv_dtype: p.kv_dtype,
        };
        attention::attention(self.eng(), q.f32()?, &spans, &params, out)
    }
}

/// A tensor's bytes in host memory.
#[derive(Clone)]
struct Region<'a> {
    desc: &'a TensorDesc,
    ptr: *mut u8,
    len: usize,
    read_only: bool,
}

impl<'a> Region<'a> {
    fn of(desc: &'a TensorDesc) -> Result<Region<'a>> {
        let base = desc.buffer.host_address();
        if base == 0 {
            return Err(UError::unsupported(
                "kernels-cpu computes on host memory only: a tensor lives in a device buffer",
            ));
        }
        let len = desc.byte_len().ok_or_else(|| {
            UError::invalid(format!("kernels-cpu: {desc:?} is not whole blocks per row"))
        })? as usize;
        let end = (desc.offset as usize).checked_add(len);
        if end.is_none_or(|e| e as u64 > desc.buffer.byte_len()) {
            return Err(UError::invalid(format!(
                "kernels-cpu: {desc:?} ({len} bytes) runs past its buffer of {} bytes",
                desc.buffer.byte_len()
            )));
        }
        Ok(Region {
            desc,
            ptr: (base + desc.offset as usize) as *mut u8,
            len,
            read_only: desc.buffer.read_only(),
        })
    }

    fn elements(&self) -> usize {
        self.desc.shape.elements() as usize
    }

    fn bytes(&self) -> &'a [u8] {
        // SAFETY: `ptr..ptr + len` is inside the buffer (checked in `of`), which the descriptor
        // keeps alive for `'a`; ops read sources only.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn typed<T>(&self, dtype: DType) -> Result<&'a [T]> {
        if self.desc.dtype != dtype || !(self.ptr as usize).is_multiple_of(align_of::<T>()) {
            return Err(UError::invalid(format!(
                "kernels-cpu: {:?} (at an address aligned to {}) where {dtype:?} is needed",
                self.desc,
                1usize << (self.ptr as usize).trailing_zeros().min(12)
            )));
        }
        // SAFETY: in bounds, aligned (checked), plain number type valid for any bits.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len / size_of::<T>()) })
    }

    fn f32(&self) -> Result<&'a [f32]> {
        self.typed(DType::F32)
    }

    fn i32(&self) -> Result<&'a [i32]> {
        self.typed(DType::I32)
    }

    fn u32(&self) -> Result<&'a [u32]> {
        let ids = self.i32()?;
        // SAFETY: i32 and u32 have the same layout; negative ids become huge and are refused
        // by the range checks of the kernels that take them.
        Ok(unsafe { std::slice::from_raw_parts(ids.as_ptr() as *const u32, ids.len()) })
    }

    /// The weights as f32 (dequantized when stored otherwise).
    fn dequantized(&self) -> Result<Vec<f32>> {
        match self.desc.dtype {
            DType::F32 => Ok(self.f32()?.to_vec()),
            dt => u_sdk::quant::dequantize_to_vec(dt, self.bytes())
                .map_err(|e| UError::invalid(format!("kernels-cpu: {:?}: {e}", self.desc))),
        }
    }

    fn writable(&self) -> Result<()> {
        if self.read_only {
            return Err(UError::denied(format!(
                "kernels-cpu: the destination {:?} is read-only memory",
                self.desc
            )));
        }
        Ok(())
    }

    fn f32_mut_ptr(&self) -> Result<*mut f32> {
        self.writable()?;
        Ok(self.f32()?.as_ptr() as *mut f32)
    }

    fn f32_mut(&self) -> Result<&'a mut [f32]> {
        let p = self.f32_mut_ptr()?;
        // SAFETY: writable, in bounds, aligned; `apart`/`in_place_or_apart` checked that no
        // source overlaps it, so this is the only reference to these bytes during the op.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, self.len / 4) })
    }

    fn i32_mut(&self) -> Result<&'a mut [i32]> {
        self.writable()?;
        let p = self.i32()?.as_ptr() as *mut i32;
        // SAFETY: as for `f32_mut`.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, self.len / 4) })
    }

    /// The destination, holding `src`'s values first unless it is `src` (an in-place op).
    fn copied_from(&self, src: &Region<'_>) -> Result<&'a mut [f32]> {
        let out = self.f32_mut()?;
        if self.ptr != src.ptr {
            let s = src.f32()?;
            if s.len() != out.len() {
                return Err(UError::invalid(format!(
                    "kernels-cpu: destination of {} values for a source of {}",
                    out.len(),
                    s.len()
                )));
            }
            out.copy_from_slice(s);
        }
        Ok(out)
    }

    fn overlaps(&self, other: &Region<'_>) -> bool {
        let (a, b) = (self.ptr as usize, other.ptr as usize);
        a < b + other.len && b < a + self.len
    }

    /// Refuses a destination that overlaps any source.
    fn apart(&self, srcs: &[&Region<'_>]) -> Result<()> {
        match srcs.iter().find(|s| self.overlaps(s)) {
            Some(s) => Err(UError::invalid(format!(
                "kernels-cpu: the destination {:?} overlaps the source {:?} of an op that cannot \
                 run in place",
                self.desc, s.desc
            ))),
            None => Ok(()),
        }
    }

    /// Refuses a destination that overlaps a source other than exactly.
    fn in_place_or_apart(&self, srcs: &[&Region<'_>]) -> Result<()> {
        match srcs
            .iter()
            .find(|s| self.overlaps(s) && !(s.ptr == self.ptr && s.len == self.len))
        {
            Some(s) => Err(UError::invalid(format!(
                "kernels-cpu: the destination {:?} partly overlaps the source {:?}",
                self.desc, s.desc
            ))),
            None => Ok(()),
        }
    }
}

/// `dst = q × scale` for int8 KV rows `q` (`[tokens, row]`) with their group scales.
fn dequantize_kv(q: &Region<'_>, scales: &Region<'_>, dst: &Region<'_>) -> Result<()> {
    let bytes = q.bytes();
    if q.desc.dtype != DType::I8 || q.elements() != dst.elements() {
        return Err(UError::invalid(format!(
            "kernels-cpu Copy: int8 KV {:?} with scales into {:?}",
            q.desc, dst.desc
        )));
    }
    // SAFETY: i8 and u8 have the same layout.
    let q8 = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const i8, bytes.len()) };
    let tokens = q.desc.shape.rows() as u32;
    let groups = (q.desc.shape.row_len() as usize).div_ceil(u_sdk::KV_INT8_GROUP as usize);
    let s = scales.f32()?;
    if s.len() != tokens as usize * groups {
        return Err(UError::invalid(format!(
            "kernels-cpu Copy: {} scales for {tokens} int8 rows of {groups} groups",
            s.len()
        )));
    }
    dst.f32_mut()?
        .copy_from_slice(&u_sdk::dequantize_i8(q8, s, tokens));
    Ok(())
}

/// `dst = src` converted: from any dtype (dequantized) to `F32`, `F16`, `BF16` or one of the
/// block formats of [`crate::quantize::QUANTIZABLE`] (quantized as ggml's reference
/// quantizers do, rows in parallel).
fn convert(eng: &Engine, src: &Region<'_>, dst: &Region<'_>) -> Result<()> {
    let bad = || {
        UError::invalid(format!(
            "kernels-cpu Copy: {:?} into {:?}",
            src.desc, dst.desc
        ))
    };
    if src.elements() != dst.elements() {
        return Err(bad());
    }
    dst.writable()?;
    let to = dst.desc.dtype;
    if !matches!(to, DType::F32 | DType::F16 | DType::BF16) && !quantize::QUANTIZABLE.contains(&to)
    {
        return Err(UError::unsupported(format!(
            "kernels-cpu Copy: to {to:?} (it writes F32, F16, BF16, {})",
            quantize::QUANTIZABLE.map(|d| d.name()).join(", ")
        )));
    }
    let values: Vec<f32> = match src.desc.dtype {
        DType::F32 => src.f32()?.to_vec(),
        dt => u_sdk::quant::dequantize_to_vec(dt, src.bytes())
            .map_err(|e| UError::invalid(format!("kernels-cpu Copy: {e}")))?,
    };
    // SAFETY: writable (checked), in bounds, apart from the source (checked by the caller).
    let out = unsafe { std::slice::from_raw_parts_mut(dst.ptr, dst.len) };
    match to {
        DType::F32 => out
            .chunks_exact_mut(4)
            .zip(&values)
            .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        DType::F16 => out
            .chunks_exact_mut(2)
            .zip(&values)
            .for_each(|(o, &v)| o.copy_from_slice(&crate::act::f32_to_f16_bits(v).to_le_bytes())),
        DType::BF16 => out.chunks_exact_mut(2).zip(&values).for_each(|(o, &v)| {
            let bits = v.to_bits();
            let rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
            o.copy_from_slice(&(rounded as u16).to_le_bytes())
        }),
        _ => {
            use rayon::prelude::*;
            let row = dst.desc.shape.row_len() as usize;
            if src.desc.shape.row_len() as usize != row {
                return Err(bad());
            }
            let row_bytes = to.bytes_for(row as u64).ok_or_else(bad)? as usize;
            // Rows in groups of at least 64 Ki values, so each task is worth a thread.
            let rows = (65_536 / row.max(1)).max(1);
            let failed = eng.pool.install(|| {
                out.par_chunks_mut(rows * row_bytes)
                    .zip(values.par_chunks(rows * row))
                    .any(|(o, x)| quantize::quantize(to, x, o).is_none())
            });
            if failed {
                return Err(bad());
            }
        }
    }
    Ok(())
}

impl Backend for CpuBackend {
    fn info(&self) -> RResult<BackendInfo, UError> {
        RResult::ROk(self.kernels.backend_info())
    }

    fn buffer_type(&self) -> RResult<BufferType, UError> {
        RResult::ROk(BufferType {
            name: "cpu".into(),
            alignment: ALIGN as u32,
            host: true,
        })
    }

    fn supports(&self, op: OpKind, dtype: DType) -> RResult<bool, UError> {
        RResult::ROk(match op {
            // Every dtype: dedicated kernels, or per-row dequantization for the rest.
            OpKind::MatMul | OpKind::GetRows => true,
            OpKind::Attention => matches!(dtype, DType::F32 | DType::F16 | DType::I8),
            // From any dtype (dequantized); to F32, F16, BF16 and the block formats it writes.
            OpKind::Copy => {
                matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
                    || quantize::QUANTIZABLE.contains(&dtype)
            }
            // Weights of any dtype, dequantized once per call.
            OpKind::Conv1d | OpKind::Conv2d => true,
            _ => dtype == DType::F32,
        })
    }

    fn alloc(&self, bytes: u64) -> RResult<BufferBox, UError> {
        let len = bytes as usize;
        self.pool
            .take(len)
            .map(|block| {
                BufferBox::new(CpuBuffer(Arc::new(Mem {
                    ptr: block.ptr.as_ptr(),
                    len,
                    memory: Memory::Pooled(Some(block), self.pool.clone()),
                })))
            })
            .into()
    }

    fn import(&self, bytes: RSlice<'_, u8>, owner: KeepaliveBox) -> RResult<BufferBox, UError> {
        RResult::ROk(BufferBox::new(CpuBuffer(Arc::new(Mem {
            ptr: bytes.as_ptr() as *mut u8,
            len: bytes.len(),
            memory: Memory::Imported(owner),
        }))))
    }

    fn compute(&self, ops: RSlice<'_, OpCall<'_>>) -> RResult<(), UError> {
        ops.iter().try_for_each(|call| self.run(call)).into()
    }

    fn synchronize(&self) -> RResult<(), UError> {
        RResult::ROk(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_waste_at_most_an_eighth() {
        for bytes in [1, 4096, 4097, 10_000, 1 << 20, (1 << 20) + 1, 3_000_000] {
            let c = size_class(bytes);
            assert!(c >= bytes, "{bytes} → {c}");
            assert!(
                bytes <= 1 << 15 || (c - bytes) * 8 <= bytes,
                "{bytes} → {c}"
            );
        }
        assert_eq!(size_class(4097), size_class(8000));
    }
}
