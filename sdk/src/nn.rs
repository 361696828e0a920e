//! The model author's view of a backend: tensors with methods, so a block's `forward` reads like
//! its math.
//!
//! ```ignore
//! let h = x.add(&self.attn.forward(&self.attn_norm.forward(x)?, pass)?)?;
//! h.add(&self.mlp.forward(&self.ffn_norm.forward(&h)?)?)
//! ```
//!
//! A [`Device`] wraps a [`BackendBox`]; every [`Tensor`] method allocates its result from the
//! backend (which owns scratch memory and reuses it as results drop) and submits one
//! [`OpCall`]. Weights are imported from the loader's map once ([`Device::import_weight`]:
//! zero-copy on a host backend, one upload on a device backend) and stay in their stored dtype.
//! Linked statically into each plugin, outside the ABI fingerprint.

use crate::abi::{
    backend::{
        Activation, AttentionParams, BackendBox, Keepalive, KeepaliveBox, Op, OpCall, RopeParams,
        Shape, TensorDesc,
    },
    dtype::DType,
    error::{Result, UError},
    loader::WeightSetBox,
};
use abi_stable::std_types::{RSlice, RSliceMut, RString};
use std::{ops::Range, sync::Arc};

/// Most sources [`Device::run`] takes (attention over many spans uses [`Device::run_descs`]).
pub const MAX_SOURCES: usize = 4;

/// A backend, as models use it. Cheap to clone: every tensor holds one, so clones share the
/// backend object (a reference count) rather than boxing a copy of it.
#[derive(Clone)]
pub struct Device(Arc<DeviceInner>);

struct DeviceInner {
    backend: BackendBox,
    host: bool,
}

impl Device {
    /// Wraps `backend`, asking it once what its buffers are.
    pub fn new(backend: BackendBox) -> Result<Device> {
        let host = backend.buffer_type().into_result()?.host;
        Ok(Device(Arc::new(DeviceInner { backend, host })))
    }

    /// The backend.
    pub fn backend(&self) -> &BackendBox {
        &self.0.backend
    }

    /// Whether the backend's buffers are host memory.
    pub fn is_host(&self) -> bool {
        self.0.host
    }

    /// A tensor over a buffer region (e.g. a KV page a cache handed out).
    pub fn tensor(&self, desc: TensorDesc) -> Tensor {
        Tensor {
            desc,
            device: self.clone(),
        }
    }

    /// A new tensor of `dtype` and `dims`, contents unspecified.
    pub fn alloc(&self, dtype: DType, dims: &[u64]) -> Result<Tensor> {
        let shape = Shape::new(dims);
        let bytes = dtype
            .bytes_for(shape.row_len())
            .and_then(|r| r.checked_mul(shape.rows()))
            .ok_or_else(|| UError::invalid(format!("{dtype:?} tensor of shape {dims:?}")))?;
        let buffer = self.0.backend.alloc(bytes.max(1)).into_result()?;
        Ok(self.tensor(TensorDesc {
            buffer,
            offset: 0,
            dtype,
            shape,
        }))
    }

    /// A new `F32` tensor holding `data` (`dims` must match its length).
    pub fn from_f32(&self, data: &[f32], dims: &[u64]) -> Result<Tensor> {
        self.upload(DType::F32, as_bytes(data), data.len(), dims)
    }

    /// A new `I32` tensor holding `data` (indices, positions).
    pub fn from_i32(&self, data: &[i32], dims: &[u64]) -> Result<Tensor> {
        self.upload(DType::I32, as_bytes(data), data.len(), dims)
    }

    fn upload(&self, dtype: DType, bytes: &[u8], n: usize, dims: &[u64]) -> Result<Tensor> {
        let t = self.alloc(dtype, dims)?;
        if t.desc.shape.elements() != n as u64 {
            return Err(UError::invalid(format!(
                "{n} values do not fill a tensor of shape {dims:?}"
            )));
        }
        t.desc
            .buffer
            .write(t.desc.offset, RSlice::from_slice(bytes))
            .into_result()?;
        Ok(t)
    }

    /// Weight `name` of `weights`, in its stored dtype, without a copy on a host backend (the
    /// buffer keeps the weight set alive). `dims` reshapes it (same element count).
    pub fn import_weight(
        &self,
        weights: &WeightSetBox,
        name: &str,
        dims: Option<&[u64]>,
    ) -> Result<Tensor> {
        let view = weights.tensor(name.into()).into_result()?;
        let stored: Vec<u64> = view.shape.to_vec();
        let dims = dims.map(<[u64]>::to_vec).unwrap_or(stored.clone());
        if dims.iter().product::<u64>() != stored.iter().product::<u64>() || dims.len() > 4 {
            return Err(UError::invalid(format!(
                "{name}: shape {stored:?} cannot be viewed as {dims:?}"
            )));
        }
        let owner = KeepaliveBox::new(WeightsAlive(weights.clone(), name.into()));
        let buffer = self.0.backend.import(view.data, owner).into_result()?;
        Ok(self.tensor(TensorDesc {
            buffer,
            offset: 0,
            dtype: view.dtype,
            shape: Shape::new(&dims),
        }))
    }

    /// Runs one op of `srcs` (at most [`MAX_SOURCES`]) into `dst`.
    pub fn run(&self, op: Op<'_>, srcs: &[&Tensor], dst: &Tensor) -> Result<()> {
        if srcs.len() > MAX_SOURCES {
            return Err(UError::invalid(format!(
                "{:?}: {} sources, at most {MAX_SOURCES}",
                op.kind(),
                srcs.len()
            )));
        }
        let mut descs = [&dst.desc; MAX_SOURCES];
        for (d, s) in descs.iter_mut().zip(srcs) {
            *d = &s.desc;
        }
        self.run_descs(op, &descs[..srcs.len()], dst)
    }

    /// Runs an op over raw descriptors (attention over KV pages, whose count varies).
    pub fn run_descs(&self, op: Op<'_>, srcs: &[&TensorDesc], dst: &Tensor) -> Result<()> {
        let call = OpCall {
            op,
            srcs: RSlice::from_slice(srcs),
            dst: &dst.desc,
        };
        self.0
            .backend
            .compute(RSlice::from_slice(std::slice::from_ref(&call)))
            .into_result()
    }

    /// A new tensor of `dims` computed by `op` from `srcs`.
    pub fn compute(
        &self,
        op: Op<'_>,
        srcs: &[&Tensor],
        dtype: DType,
        dims: &[u64],
    ) -> Result<Tensor> {
        let dst = self.alloc(dtype, dims)?;
        self.run(op, srcs, &dst)?;
        Ok(dst)
    }
}

/// Keeps a weight set alive for the buffers imported from its map.
struct WeightsAlive(#[allow(dead_code)] WeightSetBox, String);

impl Keepalive for WeightsAlive {
    fn describe(&self) -> RString {
        format!("weight {}", self.1).into()
    }
}

fn as_bytes<T: Copy>(data: &[T]) -> &[u8] {
    // SAFETY: plain number types (f32, i32) are bytes with no padding; same memory, same length
    // in bytes, alignment 1.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) }
}

/// A tensor in a backend buffer, with the operations models are written in. Cloning shares the
/// buffer.
#[derive(Clone)]
pub struct Tensor {
    desc: TensorDesc,
    device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.desc.fmt(f)
    }
}

impl Tensor {
    /// The descriptor as the ABI passes it.
    pub fn desc(&self) -> &TensorDesc {
        &self.desc
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.desc.dtype
    }

    /// Dimensions, outermost first.
    pub fn dims(&self) -> &[u64] {
        self.desc.shape.dims()
    }

    /// Number of rows (all but the innermost dimension).
    pub fn rows(&self) -> usize {
        self.desc.shape.rows() as usize
    }

    /// Length of a row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.desc.shape.row_len() as usize
    }

    fn row_bytes(&self) -> Result<u64> {
        self.desc
            .dtype
            .bytes_for(self.desc.shape.row_len())
            .ok_or_else(|| {
                UError::invalid(format!("{:?} rows of {}", self.dtype(), self.row_len()))
            })
    }

    /// Rows `range` of a tensor viewed as `[rows, row_len]`, sharing its buffer.
    pub fn rows_range(&self, range: Range<usize>) -> Result<Tensor> {
        if range.start > range.end || range.end > self.rows() {
            return Err(UError::invalid(format!(
                "rows {range:?} of a tensor of {} rows",
                self.rows()
            )));
        }
        let row = self.row_bytes()?;
        Ok(Tensor {
            desc: TensorDesc {
                buffer: self.desc.buffer.clone(),
                offset: self.desc.offset + range.start as u64 * row,
                dtype: self.desc.dtype,
                shape: Shape::new(&[range.len() as u64, self.row_len() as u64]),
            },
            device: self.device.clone(),
        })
    }

    /// Entry `index` of the outermost dimension (e.g. one expert of a stacked `[E, out, in]`
    /// weight), sharing the buffer.
    pub fn index(&self, index: usize) -> Result<Tensor> {
        let dims = self.dims();
        if dims.len() < 2 || index as u64 >= dims[0] {
            return Err(UError::invalid(format!(
                "entry {index} of a tensor of shape {dims:?}"
            )));
        }
        let inner = Shape::new(&dims[1..]);
        let bytes = self
            .dtype()
            .bytes_for(inner.row_len())
            .map(|r| r * inner.rows())
            .ok_or_else(|| UError::invalid(format!("{:?} tensor {dims:?}", self.dtype())))?;
        Ok(Tensor {
            desc: TensorDesc {
                buffer: self.desc.buffer.clone(),
                offset: self.desc.offset + index as u64 * bytes,
                dtype: self.desc.dtype,
                shape: inner,
            },
            device: self.device.clone(),
        })
    }

    /// The same elements viewed with other dimensions.
    pub fn reshape(&self, dims: &[u64]) -> Result<Tensor> {
        let shape = Shape::new(dims);
        if shape.elements() != self.desc.shape.elements() || dims.len() > 4 {
            return Err(UError::invalid(format!(
                "shape {:?} cannot be viewed as {dims:?}",
                self.dims()
            )));
        }
        Ok(Tensor {
            desc: TensorDesc {
                shape,
                ..self.desc.clone()
            },
            device: self.device.clone(),
        })
    }

    fn unary(&self, op: Op<'_>) -> Result<Tensor> {
        self.device.compute(op, &[self], DType::F32, self.dims())
    }

    fn binary(&self, op: Op<'_>, other: &Tensor) -> Result<Tensor> {
        self.device
            .compute(op, &[self, other], DType::F32, self.dims())
    }

    /// `self · wᵀ` for `self` `[m, k]` and a weight `w` `[n, k]` in any dtype: `[m, n]`.
    pub fn matmul_t(&self, w: &Tensor) -> Result<Tensor> {
        let n = w.rows() as u64;
        self.device
            .compute(Op::MatMul, &[self, w], DType::F32, &[self.rows() as u64, n])
    }

    /// `self + other` (`other` may be one row, added to every row).
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(Op::Add, other)
    }

    /// `self += other`, in place.
    pub fn add_assign(&self, other: &Tensor) -> Result<()> {
        self.device.run(Op::Add, &[self, other], self)
    }

    /// `self += factor · other` (`other` may be one row), in place.
    pub fn add_scaled_assign(&self, other: &Tensor, factor: f32) -> Result<()> {
        self.device.run(Op::AddScaled(factor), &[self, other], self)
    }

    /// Clamps every value to `[min, max]`, in place.
    pub fn clamp_assign(&self, min: f32, max: f32) -> Result<()> {
        self.device.run(Op::Clamp { min, max }, &[self], self)
    }

    /// `self ⊙ other` (`other` may be one row).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(Op::Mul, other)
    }

    /// `self · factor`.
    pub fn scale(&self, factor: f32) -> Result<Tensor> {
        self.unary(Op::Scale(factor))
    }

    /// `self · factor`, in place.
    pub fn scale_assign(&self, factor: f32) -> Result<()> {
        self.device.run(Op::Scale(factor), &[self], self)
    }

    /// Row-wise RMS normalisation with scale `weight`.
    pub fn rms_norm(&self, weight: &Tensor, eps: f32) -> Result<Tensor> {
        self.binary(Op::RmsNorm(eps), weight)
    }

    /// The gradient of [`Tensor::rms_norm`] with respect to `self` (its input), given the
    /// output's gradient `dy`.
    pub fn rms_norm_backward(&self, weight: &Tensor, dy: &Tensor, eps: f32) -> Result<Tensor> {
        self.device.compute(
            Op::RmsNormBackward(eps),
            &[self, weight, dy],
            DType::F32,
            self.dims(),
        )
    }

    /// Row-wise layer normalisation with scale `weight` and shift `bias`.
    pub fn layer_norm(&self, weight: &Tensor, bias: &Tensor, eps: f32) -> Result<Tensor> {
        self.device.compute(
            Op::LayerNorm(eps),
            &[self, weight, bias],
            DType::F32,
            self.dims(),
        )
    }

    /// Group normalisation of `self` `[channels, …]` in `groups` groups of channels, with scale
    /// `weight` and shift `bias` per channel.
    pub fn group_norm(
        &self,
        weight: &Tensor,
        bias: &Tensor,
        groups: u32,
        eps: f32,
    ) -> Result<Tensor> {
        self.device.compute(
            Op::GroupNorm { groups, eps },
            &[self, weight, bias],
            DType::F32,
            self.dims(),
        )
    }

    /// 2-D convolution of `self` `[c_in, h, w]` with `weight` `[c_out, c_in, kh, kw]` and an
    /// optional `bias` `[c_out]`, zeros `padding` `[before, after]` on both axes:
    /// `[c_out, h_out, w_out]`.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: u32,
        padding: [u32; 2],
    ) -> Result<Tensor> {
        let (x, w) = (self.dims(), weight.dims());
        let (&[_, h, wi], &[c_out, _, kh, kw]) = (x, w) else {
            return Err(UError::invalid(format!(
                "conv2d of {x:?} with a weight {w:?}: want [c_in, h, w] and [c_out, c_in, kh, kw]"
            )));
        };
        let side = |n: u64, k: u64| {
            (n + u64::from(padding[0]) + u64::from(padding[1]))
                .checked_sub(k)
                .filter(|_| stride > 0)
                .map(|v| v / u64::from(stride) + 1)
                .ok_or_else(|| {
                    UError::invalid(format!(
                        "conv2d: a {kh}×{kw} kernel is larger than the padded {h}×{wi} input"
                    ))
                })
        };
        let dims = [c_out, side(h, kh)?, side(wi, kw)?];
        let op = Op::Conv2d { stride, padding };
        match bias {
            Some(b) => self
                .device
                .compute(op, &[self, weight, b], DType::F32, &dims),
            None => self.device.compute(op, &[self, weight], DType::F32, &dims),
        }
    }

    /// Nearest-neighbour upsampling of `self` `[c, h, w]` by `factor` on both spatial axes.
    pub fn upsample(&self, factor: u32) -> Result<Tensor> {
        let &[c, h, w] = self.dims() else {
            return Err(UError::invalid(format!(
                "upsampling a {:?} tensor: want [c, h, w]",
                self.dims()
            )));
        };
        let f = u64::from(factor);
        self.device.compute(
            Op::Upsample(factor),
            &[self],
            DType::F32,
            &[c, h * f, w * f],
        )
    }

    /// `F32` tensors of the same inner dimensions stacked along the outermost one (PyTorch's
    /// `cat(dim=0)`; for channels-first maps, a channel concatenation).
    pub fn concat(parts: &[&Tensor]) -> Result<Tensor> {
        let first = parts
            .first()
            .ok_or_else(|| UError::invalid("concatenating no tensors"))?;
        let inner = &first.dims()[1..];
        if parts.iter().any(|p| &p.dims()[1..] != inner) {
            return Err(UError::invalid(format!(
                "concatenating tensors of shapes {:?}",
                parts.iter().map(|p| p.dims().to_vec()).collect::<Vec<_>>()
            )));
        }
        let outer: u64 = parts.iter().map(|p| p.dims()[0]).sum();
        let mut dims = vec![outer];
        dims.extend_from_slice(inner);
        let out = first.device.alloc(DType::F32, &dims)?;
        let width: u64 = inner.iter().product();
        let flat = out.reshape(&[outer, width])?;
        let mut at = 0;
        for part in parts {
            let n = part.dims()[0] as usize;
            part.reshape(&[n as u64, width])?
                .copy_into(None, &flat.rows_range(at..at + n)?)?;
            at += n;
        }
        Ok(out)
    }

    /// Rotary embedding at `positions` (`I32`, one per row), in place.
    pub fn rope_assign(&self, positions: &Tensor, params: &RopeParams) -> Result<()> {
        self.device.run(Op::Rope(params), &[self, positions], self)
    }

    /// Rows rotated at positions `from` moved to positions `to` (both `I32`), in place.
    pub fn rope_move_assign(&self, to: &Tensor, from: &Tensor, params: &RopeParams) -> Result<()> {
        self.device.run(Op::Rope(params), &[self, to, from], self)
    }

    /// `self` converted to `dst`'s dtype (an `I8` tensor with its group `scales` to `F32`), into
    /// `dst`: `F32`, `F16`, `BF16` or a block format the backend writes (see [`Op::Copy`]).
    pub fn copy_into(&self, scales: Option<&Tensor>, dst: &Tensor) -> Result<()> {
        match scales {
            Some(s) => self.device.run(Op::Copy, &[self, s], dst),
            None => self.device.run(Op::Copy, &[self], dst),
        }
    }

    /// `act(self)`.
    pub fn activation(&self, act: Activation) -> Result<Tensor> {
        self.unary(Op::Activation(act))
    }

    /// `act(self)`, in place.
    pub fn activation_assign(&self, act: Activation) -> Result<()> {
        self.device.run(Op::Activation(act), &[self], self)
    }

    /// `act(self) ⊙ up` (SwiGLU, GeGLU).
    pub fn gated(&self, act: Activation, up: &Tensor) -> Result<Tensor> {
        self.binary(Op::Gated(act), up)
    }

    /// Row-wise softmax, in place.
    pub fn softmax_assign(&self) -> Result<()> {
        self.device.run(Op::Softmax, &[self], self)
    }

    /// The gradient of a row-wise softmax with respect to its input, from its output `self`
    /// and the output's gradient `dy`.
    pub fn softmax_backward(&self, dy: &Tensor) -> Result<Tensor> {
        self.binary(Op::SoftmaxBackward, dy)
    }

    /// Rows `ids` (`I32`) of this table, dequantized to `F32`: `[ids, row_len]`.
    pub fn get_rows(&self, ids: &Tensor) -> Result<Tensor> {
        self.device.compute(
            Op::GetRows,
            &[self, ids],
            DType::F32,
            &[ids.desc.shape.elements(), self.row_len() as u64],
        )
    }

    /// `self[ids[i]] += weights[i] · rows[i]`, in place.
    pub fn scatter_add_assign(&self, rows: &Tensor, ids: &Tensor, weights: &Tensor) -> Result<()> {
        self.device.run(Op::ScatterAdd, &[rows, ids, weights], self)
    }

    /// `selfᵀ` (2-D `F32`).
    pub fn transpose(&self) -> Result<Tensor> {
        let d = self.dims();
        if d.len() != 2 {
            return Err(UError::invalid(format!(
                "transpose of a {}-D tensor",
                d.len()
            )));
        }
        let out = self.device.alloc(DType::F32, &[d[1], d[0]])?;
        self.device.run(Op::Transpose, &[self], &out)?;
        Ok(out)
    }

    /// `self[i] += Σ sₑ·Bᵀ[c..c+r]ᵀ·(A[c..c+r]·x[i])` over row `i`'s entries of `table`, in
    /// place: adapters' low-rank deltas (see [`Op::LowRank`]).
    pub fn low_rank_assign(
        &self,
        x: &Tensor,
        a: &Tensor,
        bt: &Tensor,
        table: &Tensor,
    ) -> Result<()> {
        self.device.run(Op::LowRank, &[x, a, bt, table], self)
    }

    /// Indices of the `k` largest values of each row, largest first (`I32` `[rows, k]`).
    pub fn top_k(&self, k: usize) -> Result<Tensor> {
        self.device.compute(
            Op::TopK(k as u32),
            &[self],
            DType::I32,
            &[self.rows() as u64, k as u64],
        )
    }

    /// Flash attention of these queries over key/value spans (`kv`: keys, values and, for int8
    /// spans, their scales, per span).
    pub fn attention(&self, kv: &[&TensorDesc], params: &AttentionParams) -> Result<Tensor> {
        let out = self.device.alloc(DType::F32, self.dims())?;
        self.attention_into(kv, params, &out)?;
        Ok(out)
    }

    /// [`Tensor::attention`] into `out` (e.g. this sequence's rows of the batch's output).
    pub fn attention_into(
        &self,
        kv: &[&TensorDesc],
        params: &AttentionParams,
        out: &Tensor,
    ) -> Result<()> {
        let mut srcs = Vec::with_capacity(kv.len() + 1);
        srcs.push(&self.desc);
        srcs.extend_from_slice(kv);
        self.device.run_descs(Op::Attention(params), &srcs, out)
    }

    /// The elements as `f32` (reading device memory back when it is not host memory).
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.desc.shape.elements() as usize];
        self.read_into(&mut out)?;
        Ok(out)
    }

    /// Copies the `F32` elements into `out` (exactly as many).
    pub fn read_into(&self, out: &mut [f32]) -> Result<()> {
        if self.dtype() != DType::F32 || out.len() as u64 != self.desc.shape.elements() {
            return Err(UError::invalid(format!(
                "reading a {:?} tensor of shape {:?} into {} floats",
                self.dtype(),
                self.dims(),
                out.len()
            )));
        }
        // SAFETY: f32 is plain bytes; same memory and length in bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(out))
        };
        self.desc
            .buffer
            .read(self.desc.offset, RSliceMut::from_mut_slice(bytes))
            .into_result()
    }

    /// The elements as `i32` (e.g. top-k indices).
    pub fn to_vec_i32(&self) -> Result<Vec<i32>> {
        if self.dtype() != DType::I32 {
            return Err(UError::invalid(format!(
                "reading a {:?} tensor as i32",
                self.dtype()
            )));
        }
        let mut out = vec![0i32; self.desc.shape.elements() as usize];
        // SAFETY: i32 is plain bytes; same memory and length in bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, out.len() * 4) };
        self.desc
            .buffer
            .read(self.desc.offset, RSliceMut::from_mut_slice(bytes))
            .into_result()?;
        Ok(out)
    }

    /// Writes `data` (all `F32` elements).
    pub fn write(&self, data: &[f32]) -> Result<()> {
        if self.dtype() != DType::F32 || data.len() as u64 != self.desc.shape.elements() {
            return Err(UError::invalid(format!(
                "writing {} floats into a {:?} tensor of shape {:?}",
                data.len(),
                self.dtype(),
                self.dims()
            )));
        }
        self.desc
            .buffer
            .write(self.desc.offset, RSlice::from_slice(as_bytes(data)))
            .into_result()
    }

    /// The host memory holding this tensor's bytes (address, length), when it lives in host
    /// memory (e.g. weights mapped from a file).
    pub fn host_range(&self) -> Option<(usize, usize)> {
        let base = self.desc.buffer.host_address();
        let len = self.desc.byte_len()?;
        (base != 0 && len != 0).then(|| (base + self.desc.offset as usize, len as usize))
    }

    /// Asks the OS to read this tensor's pages ahead (`madvise(MADV_WILLNEED)`) when it lives
    /// in host memory, e.g. weights mapped from a file; advice only.
    pub fn will_need(&self) {
        if let Some((addr, len)) = self.host_range() {
            crate::pages::will_need(addr, len);
        }
    }

    /// Gives this tensor's pages back to the OS (`madvise(MADV_PAGEOUT)`): weights mapped from
    /// a file leave memory and are read from the file again when next touched. The bytes do
    /// not change. For tensors of other memory (computed, device) it does nothing.
    pub fn page_out(&self) {
        if let Some((addr, len)) = self.host_range() {
            crate::pages::page_out(addr, len);
        }
    }

    /// Keeps this tensor's pages in memory (`mlock`) until [`Tensor::unlock_pages`]; an error
    /// where the OS refuses (the memlock limit) or the tensor is not in host memory.
    pub fn lock_pages(&self) -> Result<()> {
        let (addr, len) = self
            .host_range()
            .ok_or_else(|| UError::unsupported("locking a tensor outside host memory"))?;
        crate::pages::lock(addr, len)
    }

    /// Lets the OS page this tensor out again after [`Tensor::lock_pages`].
    pub fn unlock_pages(&self) {
        if let Some((addr, len)) = self.host_range() {
            crate::pages::unlock(addr, len);
        }
    }
}
