//! The GPU as a [`Backend`]: device buffers, weights uploaded once at import, and every op of a
//! list recorded as compute dispatches that run when their results are needed.
//!
//! Operands are bound as sub-ranges of their buffers (so weight buffers larger than one binding
//! may still be used tensor by tensor). An operand in host memory (a cache's KV page, a
//! buffer of the CPU backend) is copied to the device for the op. A source in the destination's
//! own buffer (an op run in place) is copied aside first, since one dispatch may not both read
//! and write a buffer through different bindings.

use crate::{
    buffer::{self, GpuBuffer},
    gpu::Gpu,
    shaders::{BLOCK_FORMATS, Kernel, QUANTIZED_FORMATS},
};
use abi_stable::std_types::{RResult, RSlice, RVec};
use std::sync::Arc;
use u_sdk::{
    Activation, AttentionMask, AttentionParams, Backend, BackendInfo, BufferBox, BufferType, DType,
    KeepaliveBox, Op, OpCall, OpKind, Result, RopeStyle, TensorDesc, UError,
};
use wgpu::util::DeviceExt;

/// Weight rows one matmul workgroup computes (`WEIGHT_ROWS` of the matmul shaders).
const MATMUL_WEIGHT_ROWS: u64 = 8;

/// Words per 32-value chunk of quantized activations (scale, s1, Σq, Σ of the first 16, 32
/// codes).
const ACTIVATION_WORDS: u64 = 12;

/// Largest head dimension the attention kernel holds (8 output dimensions per invocation).
pub const MAX_HEAD_DIM: u32 = 512;

/// The backend object. Cheap to clone.
#[derive(Clone)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
}

/// An operand bound for one dispatch: `size` bytes of `buffer` from `start` (aligned as
/// bindings must be), the tensor's first byte `shift` bytes in.
#[derive(Clone)]
struct Operand {
    buffer: wgpu::Buffer,
    owner: Option<GpuBuffer>,
    start: u64,
    size: u64,
    shift: u64,
}

impl Operand {
    /// The tensor's first element as an index into a binding of 4-byte values.
    fn word(&self) -> Result<u32> {
        if !self.shift.is_multiple_of(4) {
            return Err(UError::unsupported(format!(
                "kernels-wgpu: an f32 operand at byte {} of its binding (not a whole word)",
                self.shift
            )));
        }
        Ok((self.shift / 4) as u32)
    }

    fn binding(&self) -> wgpu::BufferBinding<'_> {
        wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: self.start,
            size: std::num::NonZeroU64::new(self.size),
        }
    }
}

fn bad(op: OpKind, why: impl std::fmt::Display) -> UError {
    UError::invalid(format!("kernels-wgpu {op:?}: {why}"))
}

fn unsupported(op: OpKind, why: impl std::fmt::Display) -> UError {
    UError::unsupported(format!("kernels-wgpu {op:?}: {why}"))
}

/// Workgroups `count` spread over x and y (each at most 65 535): `(x, y)`.
fn grid(count: u64) -> Result<(u32, u32)> {
    const MAX: u64 = 65_535;
    let x = count.clamp(1, MAX);
    let y = count.div_ceil(x).max(1);
    if y > MAX {
        return Err(UError::unsupported(format!(
            "kernels-wgpu: {count} workgroups in one dispatch"
        )));
    }
    Ok((x as u32, y as u32))
}

fn u32_of(op: OpKind, what: &str, v: u64) -> Result<u32> {
    u32::try_from(v).map_err(|_| unsupported(op, format!("{what} {v} does not fit 32 bits")))
}

/// The byte alignment the block readers need: whole words for f32, halves for the rest (every
/// f16 of a block sits at an even offset).
fn block_alignment(dtype: DType) -> u64 {
    if dtype == DType::F32 { 4 } else { 2 }
}

fn activation_code(act: Activation) -> u32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::GeluErf => 2,
        Activation::Sigmoid => 3,
        Activation::Relu => 4,
        Activation::Tanh => 5,
        Activation::Step => 6,
    }
}

/// The elementwise kernel's operation codes.
#[derive(Clone, Copy)]
enum Elementwise {
    Add = 0,
    Mul = 1,
    Scale = 2,
    AddScaled = 3,
    Clamp = 4,
    Activation = 5,
    Gated = 6,
}

impl WgpuBackend {
    /// A backend on `gpu`.
    pub fn new(gpu: Arc<Gpu>) -> WgpuBackend {
        WgpuBackend { gpu }
    }

    /// The device it runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// `bytes` bytes of `t` as a source operand.
    fn source(&self, op: OpKind, t: &TensorDesc, bytes: u64) -> Result<Operand> {
        if let Some(own) = t.buffer.downcast::<GpuBuffer>() {
            return self.bind(op, own, t.offset, bytes);
        }
        let address = t.buffer.host_address();
        if address == 0 {
            return Err(unsupported(
                op,
                "an operand in another device's memory (only this device's buffers and host memory)",
            ));
        }
        if t.offset
            .checked_add(bytes)
            .is_none_or(|end| end > t.buffer.byte_len())
        {
            return Err(bad(op, format!("{t:?} runs past its buffer")));
        }
        // SAFETY: in bounds (checked); host memory the caller keeps alive and unchanged while
        // the op is being set up (the ABI's promise for operands).
        let host = unsafe {
            std::slice::from_raw_parts((address + t.offset as usize) as *const u8, bytes as usize)
        };
        Ok(self.host_operand(host))
    }

    fn bind(&self, op: OpKind, own: &GpuBuffer, offset: u64, bytes: u64) -> Result<Operand> {
        use u_sdk::Buffer;
        if offset
            .checked_add(bytes)
            .is_none_or(|end| end > own.byte_len())
        {
            return Err(bad(
                op,
                format!("bytes {offset}..+{bytes} of a buffer of {}", own.byte_len()),
            ));
        }
        let align = u64::from(self.gpu.limits.min_storage_buffer_offset_alignment);
        let start = offset - offset % align;
        let shift = offset - start;
        let size = buffer::words(shift + bytes).min(own.raw().size() - start);
        if size > self.gpu.limits.max_storage_buffer_binding_size {
            return Err(UError::new(
                u_sdk::ErrorKind::ResourceExhausted,
                format!(
                    "kernels-wgpu {op:?}: an operand of {bytes} bytes is larger than the device \
                     binds at once ({} bytes)",
                    self.gpu.limits.max_storage_buffer_binding_size
                ),
            ));
        }
        Ok(Operand {
            buffer: own.raw().clone(),
            owner: Some(own.clone()),
            start,
            size,
            shift,
        })
    }

    /// The destination: `bytes` bytes of a writable buffer of this device.
    fn destination(&self, op: OpKind, t: &TensorDesc, bytes: u64) -> Result<Operand> {
        use u_sdk::Buffer;
        let own = t
            .buffer
            .downcast::<GpuBuffer>()
            .ok_or_else(|| unsupported(op, "a destination outside this device's buffers"))?;
        if own.read_only() {
            return Err(UError::denied(format!(
                "kernels-wgpu {op:?}: the destination is read-only"
            )));
        }
        self.bind(op, own, t.offset, bytes)
    }

    /// `src` itself, or (when it lives in `dst`'s buffer) a copy of it made on the device first.
    fn apart(
        &self,
        src: Operand,
        dst: &Operand,
        copies: &mut Vec<(Operand, wgpu::Buffer)>,
    ) -> Operand {
        let shared = matches!((&src.owner, &dst.owner), (Some(a), Some(b)) if a.same(b));
        if !shared {
            return src;
        }
        let aside = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("in-place source"),
            size: src.size,
            usage: buffer::USAGE,
            mapped_at_creation: false,
        });
        copies.push((src.clone(), aside.clone()));
        Operand {
            buffer: aside,
            owner: None,
            start: 0,
            size: src.size,
            shift: src.shift,
        }
    }

    /// Records one dispatch of `kernel` over `groups` workgroups: `params` as binding 0, then
    /// `operands` in order (the destination last), after the device-side `copies`.
    fn dispatch(
        &self,
        kernel: Kernel,
        params: &[u32],
        operands: &[&Operand],
        copies: &[(Operand, wgpu::Buffer)],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        let pipeline = self.gpu.pipeline(kernel)?;
        let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
        let params = self
            .gpu
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("params"),
                contents: &bytes,
                usage: wgpu::BufferUsages::STORAGE,
            });
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: params.as_entire_binding(),
        }];
        for (i, o) in operands.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(o.binding()),
            });
        }
        let group = self
            .gpu
            .scoped(&format!("binding the {kernel:?} operands"), || {
                self.gpu
                    .device
                    .create_bind_group(&wgpu::BindGroupDescriptor {
                        label: None,
                        layout: &pipeline.get_bind_group_layout(0),
                        entries: &entries,
                    })
            })?;
        self.gpu.record(1, |encoder| {
            for (from, to) in copies {
                encoder.copy_buffer_to_buffer(&from.buffer, from.start, to, 0, from.size);
            }
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        });
        Ok(())
    }

    /// Copies `bytes` bytes from `src` to `dst` on the device (whole words).
    fn copy(&self, src: &Operand, dst: &Operand, bytes: u64) -> Result<()> {
        if !src.shift.is_multiple_of(4) || !dst.shift.is_multiple_of(4) || !bytes.is_multiple_of(4)
        {
            return Err(UError::unsupported(
                "kernels-wgpu: a copy between operands not on whole words",
            ));
        }
        self.gpu.record(0, |encoder| {
            encoder.copy_buffer_to_buffer(
                &src.buffer,
                src.start + src.shift,
                &dst.buffer,
                dst.start + dst.shift,
                bytes,
            );
        });
        Ok(())
    }

    fn run(&self, call: &OpCall<'_>) -> Result<()> {
        let srcs = call.srcs.as_slice();
        let kind = call.op.kind();
        let need = |n: usize| -> Result<()> {
            if srcs.len() < n {
                return Err(bad(kind, format!("{} sources, needs {n}", srcs.len())));
            }
            Ok(())
        };
        let f32s = |t: &TensorDesc| -> Result<u64> {
            if t.dtype != DType::F32 {
                return Err(unsupported(
                    kind,
                    format!("{:?} where F32 is needed", t.dtype),
                ));
            }
            Ok(t.shape.elements())
        };
        let dst = call.dst;
        match &call.op {
            Op::MatMul => {
                need(2)?;
                self.matmul(kind, srcs[0], srcs[1], dst)
            }
            Op::GetRows => {
                need(2)?;
                let (table, ids) = (srcs[0], srcs[1]);
                if ids.dtype != DType::I32 {
                    return Err(bad(kind, format!("ids in {:?}, not I32", ids.dtype)));
                }
                self.rows(kind, table, Some(ids), dst)
            }
            Op::Copy => {
                need(1)?;
                let x = srcs[0];
                if srcs.len() > 1 {
                    return Err(unsupported(kind, "int8 KV with scales"));
                }
                match (x.dtype, dst.dtype) {
                    (_, DType::F32) => self.rows(kind, x, None, dst),
                    (DType::F32, DType::F16) => self.to_f16(kind, x, dst),
                    (from, to) => Err(unsupported(kind, format!("{from:?} to {to:?}"))),
                }
            }
            Op::Add | Op::Mul | Op::AddScaled(_) | Op::Gated(_) => {
                need(2)?;
                let (code, act, f0) = match &call.op {
                    Op::Add => (Elementwise::Add, 0, 0.0),
                    Op::Mul => (Elementwise::Mul, 0, 0.0),
                    Op::AddScaled(f) => (Elementwise::AddScaled, 0, *f),
                    Op::Gated(a) => (Elementwise::Gated, activation_code(*a), 0.0),
                    _ => unreachable!("matched above"),
                };
                self.elementwise(kind, code, act, [f0, 0.0], srcs[0], Some(srcs[1]), dst)
            }
            Op::Scale(f) => {
                need(1)?;
                self.elementwise(kind, Elementwise::Scale, 0, [*f, 0.0], srcs[0], None, dst)
            }
            Op::Clamp { min, max } => {
                need(1)?;
                let range = [*min, *max];
                self.elementwise(kind, Elementwise::Clamp, 0, range, srcs[0], None, dst)
            }
            Op::Activation(act) => {
                need(1)?;
                let code = activation_code(*act);
                self.elementwise(
                    kind,
                    Elementwise::Activation,
                    code,
                    [0.0; 2],
                    srcs[0],
                    None,
                    dst,
                )
            }
            Op::RmsNorm(eps) => {
                need(2)?;
                self.norm(kind, 0, *eps, srcs[0], srcs[1], srcs[1], dst)
            }
            Op::LayerNorm(eps) => {
                need(3)?;
                self.norm(kind, 1, *eps, srcs[0], srcs[1], srcs[2], dst)
            }
            Op::Softmax => {
                need(1)?;
                let n = f32s(srcs[0])?;
                let len = srcs[0].shape.row_len();
                if f32s(dst)? != n || len == 0 {
                    return Err(bad(kind, format!("{:?} into {dst:?}", srcs[0])));
                }
                let y = self.copied_into(kind, srcs[0], dst, 4 * n)?;
                let rows = n / len;
                let (gx, gy) = grid(rows)?;
                let params = [
                    u32_of(kind, "rows", rows)?,
                    u32_of(kind, "row", len)?,
                    y.word()?,
                    gx,
                ];
                self.dispatch(Kernel::Softmax, &params, &[&y], &[], (gx, gy, 1))
            }
            Op::Rope(p) => {
                need(2)?;
                if srcs.len() > 2 {
                    return Err(unsupported(
                        kind,
                        "moving rotated rows to new positions (needs f64 angles)",
                    ));
                }
                let (x, pos) = (srcs[0], srcs[1]);
                let n = f32s(x)?;
                let half = u64::from(p.rotary_dim / 2);
                let width = u64::from(p.heads) * u64::from(p.head_dim);
                let tokens = pos.shape.elements();
                if pos.dtype != DType::I32
                    || f32s(dst)? != n
                    || p.rotary_dim % 2 != 0
                    || p.rotary_dim > p.head_dim
                    || p.inv_freq.len() as u64 != half
                    || Some(n) != tokens.checked_mul(width)
                {
                    return Err(bad(kind, format!("x {x:?}, positions {pos:?}, {p:?}")));
                }
                if half == 0 || tokens == 0 {
                    return self.copied_into(kind, x, dst, 4 * n).map(drop);
                }
                let y = self.copied_into(kind, x, dst, 4 * n)?;
                let po = self.source(kind, pos, 4 * tokens)?;
                let freq_bytes: Vec<u8> = p.inv_freq.iter().flat_map(|f| f.to_le_bytes()).collect();
                let freq = self.host_operand(&freq_bytes);
                let (gx, gy) = grid((tokens * half).div_ceil(64))?;
                let params = [
                    u32_of(kind, "tokens", tokens)?,
                    p.heads,
                    p.head_dim,
                    half as u32,
                    match p.style {
                        RopeStyle::Normal => 0,
                        RopeStyle::NeoX => 1,
                    },
                    y.word()?,
                    po.word()?,
                    gx,
                    p.attn_factor.to_bits(),
                ];
                self.dispatch(Kernel::Rope, &params, &[&po, &freq, &y], &[], (gx, gy, 1))
            }
            Op::Attention(p) => {
                need(1)?;
                self.attention(kind, srcs[0], &srcs[1..], p, dst)
            }
            Op::Conv1d { .. } | Op::Conv2d { .. } => {
                need(2)?;
                self.conv(kind, &call.op, srcs, dst)
            }
            Op::GroupNorm { groups, eps } => {
                need(3)?;
                let (x, w, b) = (srcs[0], srcs[1], srcs[2]);
                let n = f32s(x)?;
                let channels = x.shape.dims()[0];
                let groups = u64::from(*groups);
                if channels == 0
                    || groups == 0
                    || !channels.is_multiple_of(groups)
                    || f32s(w)? != channels
                    || f32s(b)? != channels
                    || f32s(dst)? != n
                {
                    return Err(bad(kind, format!("x {x:?} in {groups} groups")));
                }
                let y = self.destination(kind, dst, 4 * n)?;
                let mut copies = Vec::new();
                let xo = self.apart(self.source(kind, x, 4 * n)?, &y, &mut copies);
                let wo = self.apart(self.source(kind, w, 4 * channels)?, &y, &mut copies);
                let bo = self.apart(self.source(kind, b, 4 * channels)?, &y, &mut copies);
                let params = [
                    groups as u32,
                    u32_of(kind, "channels", channels)?,
                    u32_of(kind, "spatial", n / channels)?,
                    xo.word()?,
                    wo.word()?,
                    bo.word()?,
                    y.word()?,
                    eps.to_bits(),
                ];
                let g = u32_of(kind, "groups", groups)?;
                self.dispatch(
                    Kernel::GroupNorm,
                    &params,
                    &[&xo, &wo, &bo, &y],
                    &copies,
                    (g, 1, 1),
                )
            }
            Op::Upsample(factor) => {
                need(1)?;
                let x = srcs[0];
                let (c, h, w) = match x.shape.dims() {
                    &[c, h, w] => (c, h, w),
                    d => return Err(bad(kind, format!("input {d:?} is not [c, h, w]"))),
                };
                let f = u64::from(*factor);
                let out = c * h * f * w * f;
                if f == 0 || f32s(x)? != c * h * w || f32s(dst)? != out {
                    return Err(bad(kind, format!("{x:?} by {f} into {dst:?}")));
                }
                let y = self.destination(kind, dst, 4 * out)?;
                let mut copies = Vec::new();
                let xo = self.apart(self.source(kind, x, 4 * c * h * w)?, &y, &mut copies);
                let (gx, gy) = grid(out.div_ceil(64))?;
                let params = [
                    u32_of(kind, "channels", c)?,
                    u32_of(kind, "height", h)?,
                    u32_of(kind, "width", w)?,
                    *factor,
                    xo.word()?,
                    y.word()?,
                    gx,
                ];
                self.dispatch(Kernel::Upsample, &params, &[&xo, &y], &copies, (gx, gy, 1))
            }
            Op::RmsNormBackward(_)
            | Op::SoftmaxBackward
            | Op::ScatterAdd
            | Op::TopK(_)
            | Op::Transpose
            | Op::LowRank => Err(unsupported(kind, "not implemented on the GPU")),
        }
    }

    /// `dst = x · wᵀ`: float weights multiplied in f32; block formats against activations
    /// quantized to int8 first, as the CPU kernels do.
    fn matmul(&self, op: OpKind, x: &TensorDesc, w: &TensorDesc, dst: &TensorDesc) -> Result<()> {
        if !BLOCK_FORMATS.contains(&w.dtype) {
            return Err(unsupported(op, format!("weights in {:?}", w.dtype)));
        }
        let (k, n) = (w.shape.row_len(), w.shape.rows());
        let f32s = |t: &TensorDesc| (t.dtype == DType::F32).then(|| t.shape.elements());
        let xs = f32s(x).unwrap_or(u64::MAX);
        if k == 0 || !xs.is_multiple_of(k) || f32s(dst) != Some(xs / k * n) {
            return Err(bad(op, format!("x {x:?}, w {w:?}, y {dst:?}")));
        }
        let m = xs / k;
        let row_bytes = w
            .dtype
            .bytes_for(k)
            .ok_or_else(|| bad(op, format!("rows of {k} {:?} values", w.dtype)))?;
        let y = self.destination(op, dst, 4 * m * n)?;
        let mut copies = Vec::new();
        let xo = self.apart(self.source(op, x, 4 * xs)?, &y, &mut copies);
        let wo = self.source(op, w, row_bytes * n)?;
        if !wo.shift.is_multiple_of(block_alignment(w.dtype)) {
            return Err(unsupported(op, "weights at an odd byte offset"));
        }
        let (gx, gy) = grid(n.div_ceil(MATMUL_WEIGHT_ROWS))?;
        let tiles = u32_of(op, "row tiles", m.div_ceil(8))?.max(1);
        if !QUANTIZED_FORMATS.contains(&w.dtype) {
            let params = [
                u32_of(op, "m", m)?,
                u32_of(op, "n", n)?,
                u32_of(op, "k", k)?,
                xo.word()?,
                u32_of(op, "weight offset", wo.shift)?,
                y.word()?,
                u32_of(op, "row bytes", row_bytes)?,
                gx,
            ];
            let kernel = Kernel::MatMul(w.dtype);
            return self.dispatch(kernel, &params, &[&xo, &wo, &y], &copies, (gx, gy, tiles));
        }
        let super_blocks = matches!(w.dtype, DType::Q4_K | DType::Q6_K);
        let span = if super_blocks { 256 } else { 32 };
        let act_bytes = m * (k / 32) * ACTIVATION_WORDS * 4;
        let act = self.scratch(act_bytes)?;
        let (qx, qy) = grid((m * k / span).div_ceil(64))?;
        let params = [
            u32_of(op, "m", m)?,
            u32_of(op, "k", k)?,
            u32::from(super_blocks),
            xo.word()?,
            qx,
        ];
        let quantize = Kernel::QuantizeActivations;
        self.dispatch(quantize, &params, &[&xo, &act], &copies, (qx, qy, 1))?;
        let params = [
            u32_of(op, "m", m)?,
            u32_of(op, "n", n)?,
            u32_of(op, "k", k)?,
            y.word()?,
            u32_of(op, "weight offset", wo.shift)?,
            u32_of(op, "row bytes", row_bytes)?,
            gx,
        ];
        let kernel = Kernel::MatMulQuantized(w.dtype);
        self.dispatch(kernel, &params, &[&act, &wo, &y], &[], (gx, gy, tiles))
    }

    /// A device buffer of `bytes` bytes for one op's intermediate values.
    fn scratch(&self, bytes: u64) -> Result<Operand> {
        let size = buffer::words(bytes);
        let buffer = self
            .gpu
            .scoped(&format!("allocating {bytes} scratch bytes"), || {
                self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("scratch"),
                    size,
                    usage: buffer::USAGE,
                    mapped_at_creation: false,
                })
            })?;
        Ok(Operand {
            buffer,
            owner: None,
            start: 0,
            size,
            shift: 0,
        })
    }

    /// A device buffer holding a copy of `bytes` for one op (parameters, frequencies, host
    /// memory an op reads), padded to whole words only where it is not already.
    fn host_operand(&self, bytes: &[u8]) -> Operand {
        let padded;
        let contents = if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
            bytes
        } else {
            let mut words = bytes.to_vec();
            words.resize(buffer::words(bytes.len() as u64) as usize, 0);
            padded = words;
            &padded
        };
        let buffer = self
            .gpu
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("host operand"),
                contents,
                usage: buffer::USAGE,
            });
        Operand {
            size: contents.len() as u64,
            buffer,
            owner: None,
            start: 0,
            shift: 0,
        }
    }

    /// The destination of an in-place kernel, holding a copy of `x` (nothing to copy when the
    /// op already runs in place).
    fn copied_into(
        &self,
        op: OpKind,
        x: &TensorDesc,
        dst: &TensorDesc,
        bytes: u64,
    ) -> Result<Operand> {
        let y = self.destination(op, dst, bytes)?;
        let xo = self.source(op, x, bytes)?;
        let same = matches!((&xo.owner, &y.owner), (Some(a), Some(b)) if a.same(b))
            && xo.start + xo.shift == y.start + y.shift;
        if !same {
            self.copy(&xo, &y, bytes)?;
        }
        Ok(y)
    }

    /// Rows `ids` of `table` (or all of them, in order, without ids), dequantized to f32.
    fn rows(
        &self,
        op: OpKind,
        table: &TensorDesc,
        ids: Option<&TensorDesc>,
        dst: &TensorDesc,
    ) -> Result<()> {
        if !BLOCK_FORMATS.contains(&table.dtype) {
            return Err(unsupported(op, format!("rows in {:?}", table.dtype)));
        }
        let k = table.shape.row_len();
        let table_rows = table.shape.rows();
        let rows = ids.map_or(table_rows, |i| i.shape.elements());
        let row_bytes = table
            .dtype
            .bytes_for(k)
            .ok_or_else(|| bad(op, format!("rows of {k} {:?} values", table.dtype)))?;
        if dst.dtype != DType::F32 || dst.shape.elements() != rows * k {
            return Err(bad(op, format!("{rows} rows of {k} into {dst:?}")));
        }
        if rows == 0 || k == 0 {
            return Ok(());
        }
        let y = self.destination(op, dst, 4 * rows * k)?;
        let wo = self.source(op, table, row_bytes * table_rows)?;
        if !wo.shift.is_multiple_of(block_alignment(table.dtype)) {
            return Err(unsupported(op, "a table at an odd byte offset"));
        }
        let io = match ids {
            Some(ids) => self.source(op, ids, 4 * rows)?,
            None => wo.clone(),
        };
        let (gx, gy) = grid(rows)?;
        let params = [
            u32_of(op, "rows", rows)?,
            u32_of(op, "row", k)?,
            if ids.is_some() { io.word()? } else { 0 },
            u32_of(op, "table offset", wo.shift)?,
            y.word()?,
            u32_of(op, "row bytes", row_bytes)?,
            u32_of(op, "table rows", table_rows)?,
            u32::from(ids.is_none()),
            gx,
        ];
        self.dispatch(
            Kernel::GetRows(table.dtype),
            &params,
            &[&io, &wo, &y],
            &[],
            (gx, gy, 1),
        )
    }

    fn to_f16(&self, op: OpKind, x: &TensorDesc, dst: &TensorDesc) -> Result<()> {
        let n = x.shape.elements();
        if dst.shape.elements() != n || !n.is_multiple_of(2) {
            return Err(unsupported(
                op,
                format!("{x:?} to {dst:?} (an even count is needed)"),
            ));
        }
        let y = self.destination(op, dst, 2 * n)?;
        let xo = self.source(op, x, 4 * n)?;
        let (gx, gy) = grid((n / 2).div_ceil(64))?;
        let params = [u32_of(op, "pairs", n / 2)?, xo.word()?, y.word()?, gx];
        self.dispatch(Kernel::ToF16, &params, &[&xo, &y], &[], (gx, gy, 1))
    }

    #[allow(clippy::too_many_arguments)]
    fn elementwise(
        &self,
        op: OpKind,
        code: Elementwise,
        act: u32,
        factors: [f32; 2],
        a: &TensorDesc,
        b: Option<&TensorDesc>,
        dst: &TensorDesc,
    ) -> Result<()> {
        let check = |t: &TensorDesc| {
            if t.dtype == DType::F32 {
                Ok(t.shape.elements())
            } else {
                Err(unsupported(op, format!("{:?} operands", t.dtype)))
            }
        };
        let n = check(a)?;
        let b_len = b.map(check).transpose()?.unwrap_or(n);
        if check(dst)? != n || (n > 0 && (b_len == 0 || !n.is_multiple_of(b_len))) {
            return Err(bad(op, format!("{a:?} with {b:?} into {dst:?}")));
        }
        if n == 0 {
            return Ok(());
        }
        let y = self.destination(op, dst, 4 * n)?;
        let mut copies = Vec::new();
        let ao = self.apart(self.source(op, a, 4 * n)?, &y, &mut copies);
        let bo = match b {
            Some(b) => self.apart(self.source(op, b, 4 * b_len)?, &y, &mut copies),
            None => ao.clone(),
        };
        let (gx, gy) = grid(n.div_ceil(256))?;
        let params = [
            code as u32,
            act,
            u32_of(op, "values", n)?,
            u32_of(op, "values", b_len)?,
            ao.word()?,
            bo.word()?,
            y.word()?,
            gx,
            factors[0].to_bits(),
            factors[1].to_bits(),
        ];
        self.dispatch(
            Kernel::Elementwise,
            &params,
            &[&ao, &bo, &y],
            &copies,
            (gx, gy, 1),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn norm(
        &self,
        op: OpKind,
        mode: u32,
        eps: f32,
        x: &TensorDesc,
        w: &TensorDesc,
        b: &TensorDesc,
        dst: &TensorDesc,
    ) -> Result<()> {
        let len = w.shape.elements();
        let n = x.shape.elements();
        let all_f32 = [x, w, b, dst].iter().all(|t| t.dtype == DType::F32);
        if !all_f32
            || len == 0
            || !n.is_multiple_of(len)
            || b.shape.elements() != len
            || dst.shape.elements() != n
        {
            return Err(bad(
                op,
                format!("x {x:?}, weight {w:?}, bias {b:?}, y {dst:?}"),
            ));
        }
        let y = self.destination(op, dst, 4 * n)?;
        let mut copies = Vec::new();
        let xo = self.apart(self.source(op, x, 4 * n)?, &y, &mut copies);
        let wo = self.apart(self.source(op, w, 4 * len)?, &y, &mut copies);
        let bo = self.apart(self.source(op, b, 4 * len)?, &y, &mut copies);
        let rows = n / len;
        let (gx, gy) = grid(rows)?;
        let params = [
            u32_of(op, "rows", rows)?,
            u32_of(op, "row", len)?,
            mode,
            xo.word()?,
            wo.word()?,
            bo.word()?,
            y.word()?,
            gx,
            eps.to_bits(),
        ];
        self.dispatch(
            Kernel::Norm,
            &params,
            &[&xo, &wo, &bo, &y],
            &copies,
            (gx, gy, 1),
        )
    }

    fn attention(
        &self,
        op: OpKind,
        q: &TensorDesc,
        kv: &[&TensorDesc],
        p: &AttentionParams,
        dst: &TensorDesc,
    ) -> Result<()> {
        let element = match p.kv_dtype {
            DType::F32 => 4,
            DType::F16 => 2,
            other => return Err(unsupported(op, format!("KV in {other:?}"))),
        };
        if p.heads == 0
            || p.kv_heads == 0
            || !p.heads.is_multiple_of(p.kv_heads)
            || p.head_dim == 0
            || p.head_dim > MAX_HEAD_DIM
        {
            return Err(unsupported(
                op,
                format!(
                    "{} heads over {} KV heads of dimension {} (at most {MAX_HEAD_DIM})",
                    p.heads, p.kv_heads, p.head_dim
                ),
            ));
        }
        if !kv.len().is_multiple_of(2) {
            return Err(bad(
                op,
                format!("{} KV tensors are not whole spans of 2", kv.len()),
            ));
        }
        let width = u64::from(p.heads * p.head_dim);
        let row = u64::from(p.kv_heads * p.head_dim);
        let n = q.shape.elements();
        if q.dtype != DType::F32
            || !n.is_multiple_of(width)
            || dst.dtype != DType::F32
            || dst.shape.elements() != n
        {
            return Err(bad(op, format!("queries {q:?} into {dst:?}")));
        }
        let queries = n / width;
        let row_bytes = row * element;
        let mut kv_len = 0u64;
        for t in kv {
            if t.dtype != p.kv_dtype || t.shape.elements() % row != 0 {
                return Err(bad(
                    op,
                    format!("a KV span {t:?} of rows of {row} {:?}", p.kv_dtype),
                ));
            }
        }
        let spans: Vec<(&TensorDesc, &TensorDesc)> =
            kv.chunks_exact(2).map(|s| (s[0], s[1])).collect();
        for (k, v) in &spans {
            if k.shape.elements() != v.shape.elements() {
                return Err(bad(
                    op,
                    format!("keys {k:?} and values {v:?} differ in length"),
                ));
            }
            kv_len += k.shape.elements() / row;
        }
        let y = self.destination(op, dst, 4 * n)?;
        if queries == 0 {
            return Ok(());
        }
        let (keys, values) = if kv_len == 0 {
            let empty = self.host_operand(&[0; 4]);
            (empty.clone(), empty)
        } else if let [(k, v)] = spans[..] {
            (
                self.source(op, k, kv_len * row_bytes)?,
                self.source(op, v, kv_len * row_bytes)?,
            )
        } else {
            (
                self.gather(op, spans.iter().map(|s| s.0), row, row_bytes, kv_len)?,
                self.gather(op, spans.iter().map(|s| s.1), row, row_bytes, kv_len)?,
            )
        };
        if !keys.shift.is_multiple_of(element) || !values.shift.is_multiple_of(element) {
            return Err(unsupported(op, "KV spans off their element alignment"));
        }
        let mut copies = Vec::new();
        let qo = self.apart(self.source(op, q, 4 * n)?, &y, &mut copies);
        let (first, window) = match p.mask {
            AttentionMask::Causal => (p.first_query_pos, p.window),
            AttentionMask::Bidirectional => (u32_of(op, "keys", kv_len.saturating_sub(1))?, 0),
        };
        let (gx, gy) = grid(queries * u64::from(p.heads))?;
        let params = [
            p.heads,
            p.kv_heads,
            p.head_dim,
            u32_of(op, "queries", queries)?,
            u32_of(op, "keys", kv_len)?,
            first,
            window,
            u32::from(element == 2),
            u32_of(op, "key offset", keys.shift / element)?,
            u32_of(op, "value offset", values.shift / element)?,
            qo.word()?,
            y.word()?,
            gx,
            p.scale.to_bits(),
            p.softcap.to_bits(),
        ];
        self.dispatch(
            Kernel::Attention,
            &params,
            &[&qo, &keys, &values, &y],
            &copies,
            (gx, gy, 1),
        )
    }

    /// The spans' rows, one after another, in one new device buffer.
    fn gather<'a>(
        &self,
        op: OpKind,
        spans: impl Iterator<Item = &'a TensorDesc>,
        row: u64,
        row_bytes: u64,
        total: u64,
    ) -> Result<Operand> {
        let joined = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("gathered KV"),
            size: buffer::words(total * row_bytes),
            usage: buffer::USAGE,
            mapped_at_creation: false,
        });
        let whole = Operand {
            buffer: joined,
            owner: None,
            start: 0,
            size: buffer::words(total * row_bytes),
            shift: 0,
        };
        let mut at = 0;
        for t in spans {
            let bytes = t.shape.elements() / row * row_bytes;
            if bytes == 0 {
                continue;
            }
            let from = self.source(op, t, bytes)?;
            let mut to = whole.clone();
            to.shift = at;
            self.copy(&from, &to, bytes)?;
            at += bytes;
        }
        Ok(whole)
    }

    fn conv(
        &self,
        op: OpKind,
        which: &Op<'_>,
        srcs: &[&TensorDesc],
        dst: &TensorDesc,
    ) -> Result<()> {
        let (x, w) = (srcs[0], srcs[1]);
        let b = srcs.get(2).copied();
        let (xd, wd) = (x.shape.dims(), w.shape.dims());
        let shape_error = || bad(op, format!("input {xd:?} and weight {wd:?}"));
        // (c_in, h, w, c_out, kh, kw, stride, pad_v, pad_h)
        let g = match (which, xd, wd) {
            (Op::Conv1d { stride, padding }, &[c_in, len], &[c_out, wc, k]) if wc == c_in => (
                c_in,
                1,
                len,
                c_out,
                1,
                k,
                u64::from(*stride),
                [0, 0],
                [u64::from(*padding); 2],
            ),
            (Op::Conv2d { stride, padding }, &[c_in, h, wi], &[c_out, wc, kh, kw])
                if wc == c_in =>
            {
                let pad = [u64::from(padding[0]), u64::from(padding[1])];
                (c_in, h, wi, c_out, kh, kw, u64::from(*stride), pad, pad)
            }
            _ => return Err(shape_error()),
        };
        let (c_in, h, wi, c_out, kh, kw, stride, pad_v, pad_h) = g;
        if stride == 0 || h + pad_v[0] + pad_v[1] < kh || wi + pad_h[0] + pad_h[1] < kw {
            return Err(shape_error());
        }
        let h_out = (h + pad_v[0] + pad_v[1] - kh) / stride + 1;
        let w_out = (wi + pad_h[0] + pad_h[1] - kw) / stride + 1;
        let out = c_out * h_out * w_out;
        let w_element = match w.dtype {
            DType::F32 => 4,
            DType::F16 => 2,
            other => return Err(unsupported(op, format!("weights in {other:?}"))),
        };
        if x.dtype != DType::F32
            || x.shape.elements() != c_in * h * wi
            || dst.dtype != DType::F32
            || dst.shape.elements() != out
        {
            return Err(bad(
                op,
                format!("{x:?} into {dst:?} ({c_out}×{h_out}×{w_out})"),
            ));
        }
        if let Some(b) = b
            && (b.dtype != DType::F32 || b.shape.elements() != c_out)
        {
            return Err(bad(op, format!("bias {b:?} for {c_out} channels")));
        }
        let y = self.destination(op, dst, 4 * out)?;
        let mut copies = Vec::new();
        let xo = self.apart(self.source(op, x, 4 * x.shape.elements())?, &y, &mut copies);
        let wo = self.apart(
            self.source(op, w, w_element * w.shape.elements())?,
            &y,
            &mut copies,
        );
        let bo = match b {
            Some(b) => self.apart(self.source(op, b, 4 * c_out)?, &y, &mut copies),
            None => xo.clone(),
        };
        if !wo.shift.is_multiple_of(w_element) {
            return Err(unsupported(op, "weights off their element alignment"));
        }
        let (gx, gy) = grid(out.div_ceil(64))?;
        let params = [
            u32_of(op, "input channels", c_in)?,
            u32_of(op, "height", h)?,
            u32_of(op, "width", wi)?,
            u32_of(op, "output channels", c_out)?,
            u32_of(op, "kernel height", kh)?,
            u32_of(op, "kernel width", kw)?,
            stride as u32,
            pad_v[0] as u32,
            pad_h[0] as u32,
            u32_of(op, "output height", h_out)?,
            u32_of(op, "output width", w_out)?,
            u32::from(b.is_some()),
            u32::from(w_element == 2),
            xo.word()?,
            (wo.shift / w_element) as u32,
            if b.is_some() { bo.word()? } else { 0 },
            y.word()?,
            gx,
        ];
        self.dispatch(
            Kernel::Conv,
            &params,
            &[&xo, &wo, &bo, &y],
            &copies,
            (gx, gy, 1),
        )
    }
}

impl Backend for WgpuBackend {
    fn info(&self) -> RResult<BackendInfo, UError> {
        let a = &self.gpu.adapter;
        RResult::ROk(BackendInfo {
            name: "wgpu".into(),
            device: format!(
                "{} ({:?}, {:?}, {})",
                a.name, a.device_type, a.backend, a.driver
            )
            .into(),
            isa: "wgsl".into(),
            features: RVec::from(vec![
                format!("backend={:?}", a.backend).into(),
                format!("device_type={:?}", a.device_type).into(),
                format!("driver_info={}", a.driver_info).into(),
                format!("max_buffer_size={}", self.gpu.limits.max_buffer_size).into(),
            ]),
            threads: 1,
        })
    }

    fn buffer_type(&self) -> RResult<BufferType, UError> {
        RResult::ROk(BufferType {
            name: "wgpu:storage".into(),
            alignment: self.gpu.limits.min_storage_buffer_offset_alignment,
            host: false,
        })
    }

    fn supports(&self, op: OpKind, dtype: DType) -> RResult<bool, UError> {
        let floats = matches!(dtype, DType::F32 | DType::F16);
        RResult::ROk(match op {
            OpKind::MatMul | OpKind::GetRows => BLOCK_FORMATS.contains(&dtype),
            OpKind::Attention | OpKind::Copy | OpKind::Conv1d | OpKind::Conv2d => floats,
            OpKind::RmsNormBackward
            | OpKind::SoftmaxBackward
            | OpKind::ScatterAdd
            | OpKind::TopK
            | OpKind::Transpose
            | OpKind::LowRank => false,
            _ => dtype == DType::F32,
        })
    }

    fn alloc(&self, bytes: u64) -> RResult<BufferBox, UError> {
        GpuBuffer::alloc(&self.gpu, bytes)
            .map(BufferBox::new_recognisable)
            .into()
    }

    fn import(&self, bytes: RSlice<'_, u8>, owner: KeepaliveBox) -> RResult<BufferBox, UError> {
        let uploaded = GpuBuffer::upload(&self.gpu, bytes.as_slice());
        drop(owner);
        uploaded.map(BufferBox::new_recognisable).into()
    }

    fn compute(&self, ops: RSlice<'_, OpCall<'_>>) -> RResult<(), UError> {
        let run = || -> Result<()> {
            self.gpu.check()?;
            for call in ops.iter() {
                self.run(call)?;
            }
            Ok(())
        };
        run().into()
    }

    fn synchronize(&self) -> RResult<(), UError> {
        self.gpu.wait().into()
    }
}
