//! The operators, as ONNX (opset 13–21) defines them, over [`Value`]s (the indexing and
//! masking ones in [`crate::indexing`]). Parsing checks every
//! attribute once at build: what a graph asks for and this file does not implement (a
//! grouped convolution, a linear `Resize`…) is an error naming it then, never a wrong
//! result later. `Conv`, `Gemm`, `MatMul` and `Einsum` compute through the backend
//! (`u_sdk::nn`), their constant operands uploaded once; the elementwise and reshaping
//! operators run here.

use crate::indexing;
use crate::value::{Array, Value, axis, permute, zip_broadcast, zip_broadcast_into};
use serde_json::{Map, Value as Json};
use std::sync::Arc;
use u_sdk::{
    AttentionMask, AttentionParams, DType, Result, UError,
    nn::{Device, Tensor},
};

/// An elementwise operator of two operands.
#[derive(Clone, Copy, Debug)]
pub enum Binary {
    /// `a + b`
    Add,
    /// `a − b`
    Sub,
    /// `a · b`
    Mul,
    /// `a / b` (integers: truncated)
    Div,
    /// `a ^ b`
    Pow,
}

/// An elementwise operator of one float operand.
#[derive(Clone, Copy, Debug)]
pub enum Unary {
    /// `1 / (1 + e^−x)`
    Sigmoid,
    /// `x · sigmoid(x)` (`Sigmoid` and the `Mul` of its input fused: SiLU)
    Silu,
    /// `1 / x`
    Reciprocal,
    /// `√x`
    Sqrt,
    /// `ln x`
    Log,
    /// `eˣ`
    Exp,
    /// `cos x`
    Cos,
    /// `sin x`
    Sin,
    /// `tanh x`
    Tanh,
    /// `max(x, 0)`
    Relu,
    /// `−x`
    Neg,
    /// The error function `erf x` (GELU's exact form)
    Erf,
}

/// A batched product `out[b, m, n] = Σₖ lhs·rhs`, as an `Einsum` equation of two rank-3
/// operands with one batch letter and one summed letter says it.
#[derive(Clone, Debug)]
pub struct Contraction {
    /// The lhs axes in `[b, m, k]` order.
    lhs: [usize; 3],
    /// The rhs axes in `[b, n, k]` order.
    rhs: [usize; 3],
    /// The output's axes as positions in `[b, m, n]`.
    out: [usize; 3],
}

/// One operator with its attributes checked.
pub enum Op {
    /// Elementwise of two, broadcast.
    Binary(Binary),
    /// Elementwise of one.
    Unary(Unary),
    /// Its input unchanged.
    Identity,
    /// Values limited to `[min, max]` (optional inputs 1 and 2).
    Clip,
    /// The input's dimensions `start..end`, as integers.
    Shape {
        /// First axis (may count from the end).
        start: i64,
        /// One past the last (may count from the end); `None`: to the end.
        end: Option<i64>,
    },
    /// Size-1 axes removed (input 1: which; absent: all).
    Squeeze,
    /// Size-1 axes inserted (input 1: where, in the output's numbering).
    Unsqueeze,
    /// New dimensions from input 1 (`0`: kept unless `allowzero`, `−1`: inferred).
    Reshape {
        /// Whether a `0` means a zero-sized axis rather than "keep".
        allow_zero: bool,
    },
    /// Axes reordered.
    Transpose {
        /// Output axis `i` is input axis `perm[i]`; empty: reversed.
        perm: Vec<usize>,
    },
    /// Inputs joined along an axis.
    Concat {
        /// The axis.
        axis: i64,
    },
    /// The input cut along an axis into parts (input 1: their sizes; else `parts` equal ones).
    Split {
        /// The axis.
        axis: i64,
        /// Parts when no sizes are given.
        parts: usize,
    },
    /// Elements converted to floats or integers.
    Cast {
        /// Whether to integers (INT64/INT32) rather than floats.
        to_int: bool,
    },
    /// `alpha · A′ · B′ + beta · C`, B′ a constant uploaded as `[n, k]`.
    Gemm {
        /// Factor of the product.
        alpha: f32,
        /// Factor of C.
        beta: f32,
        /// Whether A is given `[k, m]`.
        trans_a: bool,
        /// B′ as `[n, k]`.
        weight: Tensor,
        /// `n`.
        n: usize,
    },
    /// `A · B` for a constant matrix B (uploaded as `[n, k]`) and A of any rank.
    MatMul {
        /// B as `[n, k]`.
        weight: Tensor,
        /// `n`.
        n: usize,
    },
    /// A 2-D convolution of an `[n, c, h, w]` input with a constant weight.
    Conv {
        /// Weight `[c_out, c_in, kh, kw]`.
        weight: Tensor,
        /// Bias `[c_out]`.
        bias: Option<Tensor>,
        /// Stride, both axes.
        stride: u32,
        /// Zeros before and after, both axes.
        padding: [u32; 2],
    },
    /// A batched product of two computed operands.
    Einsum(Contraction),
    /// `Einsum(bct,bcs→bts)`, `Softmax(−1)`, `Einsum(bts,bcs→bct)` fused (guided diffusion's
    /// `QKVAttentionLegacy`, scales already applied): inputs q, k `[b, c, t]`, v `[b, c, s]`,
    /// out `[b, c, t]`, one head per batch entry, through the backend's attention.
    Attention,
    /// Each `[n, c]` plane normalised to zero mean and unit variance, then scaled and shifted
    /// per channel.
    InstanceNorm {
        /// Added to the variance.
        epsilon: f32,
    },
    /// Mean over `k × k` windows at stride `k` of an `[n, c, h, w]` input.
    AveragePool {
        /// Window side and stride.
        k: usize,
    },
    /// `exp` normalised along an axis.
    Softmax {
        /// The axis.
        axis: i64,
    },
    /// Nearest-neighbour resize of the last two axes, `asymmetric` coordinates, `floor`.
    ResizeNearest,
    /// Slices along an axis picked by the integer indices of input 1.
    Gather {
        /// The axis.
        axis: i64,
    },
    /// A strided window (inputs 1–4: starts, ends, axes, steps).
    Slice,
    /// The mean over axes (the attribute, else input 1; none: every axis).
    ReduceMean {
        /// The axes, when given as an attribute.
        axes: Option<Vec<i64>>,
        /// Whether the reduced axes stay, as size 1.
        keep: bool,
    },
    /// 1 where the operands are equal, else 0, broadcast.
    Equal,
    /// Input 1 where input 0 is non-zero, else input 2, broadcast.
    Where,
    /// Input 0 broadcast to the shape input 1 gives.
    Expand,
    /// A value of the shape input 0 gives, every element `fill`.
    ConstantOfShape {
        /// The element (a float 0 unless the node says).
        fill: Value,
    },
    /// The lower or upper triangle of the last two axes (input 1: the diagonal's offset).
    Trilu {
        /// Whether the upper triangle is kept.
        upper: bool,
    },
    /// `start, start + delta, …` below `limit` (inputs 0–2).
    Range,
    /// The index of the largest element along an axis.
    ArgMax {
        /// The axis.
        axis: i64,
        /// Whether the axis stays, as size 1.
        keep: bool,
        /// Whether the last of equal maxima is picked rather than the first.
        last: bool,
    },
    /// Reshaped to a matrix at an axis.
    Flatten {
        /// The first axis of the columns.
        axis: i64,
    },
    /// NumPy's `matmul` of two computed operands, leading axes broadcast.
    BatchedMatMul,
    /// `MatMul(q, kᵀ)`, `Softmax`, `MatMul(·, v)` fused (an exported scaled-dot-product
    /// attention, scales already applied): inputs q `[…, n, d]`, kᵀ `[…, d, m]`, v `[…, m, d]`,
    /// through the backend's attention, one head per leading index.
    MatMulAttention {
        /// The softmax's axis, which must be the last for the fused path.
        axis: i64,
    },
}

fn int_attr(attrs: &Map<String, Json>, key: &str, default: i64) -> Result<i64> {
    match attrs.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_i64()
            .ok_or_else(|| UError::invalid(format!("attribute `{key}` is not an integer: {v}"))),
    }
}

fn float_attr(attrs: &Map<String, Json>, key: &str, default: f32) -> Result<f32> {
    match attrs.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| UError::invalid(format!("attribute `{key}` is not a number: {v}"))),
    }
}

fn ints_attr(attrs: &Map<String, Json>, key: &str) -> Result<Option<Vec<i64>>> {
    attrs
        .get(key)
        .map(|v| {
            v.as_array()
                .and_then(|a| a.iter().map(Json::as_i64).collect::<Option<Vec<_>>>())
                .ok_or_else(|| UError::invalid(format!("attribute `{key}` is not integers: {v}")))
        })
        .transpose()
}

fn str_attr<'a>(attrs: &'a Map<String, Json>, key: &str, default: &'a str) -> &'a str {
    attrs.get(key).and_then(Json::as_str).unwrap_or(default)
}

/// Refuses attributes the operator's implementation ignores.
fn only(attrs: &Map<String, Json>, known: &[&str]) -> Result<()> {
    match attrs.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(UError::unsupported(format!(
            "the attribute `{k}` is not implemented"
        ))),
        None => Ok(()),
    }
}

/// A constant float operand, or an error naming which.
fn constant<'a>(
    operands: &'a [Option<Arc<Value>>],
    slot: usize,
    what: &str,
) -> Result<&'a Array<f32>> {
    match operands.get(slot).and_then(Option::as_deref) {
        Some(v) => v.floats(what),
        None => Err(UError::unsupported(format!(
            "{what} must be an initializer (a computed one is not implemented)"
        ))),
    }
}

fn upload(device: &Device, data: &[f32], dims: &[usize]) -> Result<Tensor> {
    let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    device.from_f32(data, &dims)
}

/// A constant matrix `[k, n]` (or `[n, k]` when `transposed`) uploaded as `[n, k]`.
fn weight_nk(device: &Device, b: &Array<f32>, transposed: bool) -> Result<(Tensor, usize)> {
    let &[rows, cols] = b.dims.as_slice() else {
        return Err(UError::unsupported(format!(
            "a constant operand of shape {:?}; a matrix is implemented",
            b.dims
        )));
    };
    if transposed {
        Ok((upload(device, &b.data, &[rows, cols])?, rows))
    } else {
        let t = permute(b, &[1, 0])?;
        Ok((upload(device, &t.data, &[cols, rows])?, cols))
    }
}

impl Contraction {
    /// Whether this is `bct,bcs->bts` (the scores of a channels-first attention).
    pub fn is_scores(&self) -> bool {
        (self.lhs, self.rhs, self.out) == ([0, 2, 1], [0, 2, 1], [0, 1, 2])
    }

    /// Whether this is `bts,bcs->bct` (the scores applied to channels-first values).
    pub fn is_mix(&self) -> bool {
        (self.lhs, self.rhs, self.out) == ([0, 1, 2], [0, 1, 2], [0, 2, 1])
    }

    /// Parses `"bct,bcs->bts"`-shaped equations.
    fn parse(equation: &str) -> Result<Contraction> {
        let bad = || {
            UError::unsupported(format!(
                "the Einsum `{equation}`: a batched product of two rank-3 operands (one batch \
                 letter first in all three, one summed letter) is implemented"
            ))
        };
        let compact: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
        let (operands, out) = compact.split_once("->").ok_or_else(bad)?;
        let (l, r) = operands.split_once(',').ok_or_else(bad)?;
        let [l, r, o]: [Vec<char>; 3] = [l, r, out].map(|s| s.chars().collect());
        if [&l, &r, &o].iter().any(|v| v.len() != 3) {
            return Err(bad());
        }
        let batch = l[0];
        if r[0] != batch || !o.contains(&batch) {
            return Err(bad());
        }
        let summed: Vec<char> = l[1..]
            .iter()
            .filter(|c| r.contains(c) && !o.contains(c))
            .copied()
            .collect();
        let [k] = summed[..] else { return Err(bad()) };
        let m = *l[1..].iter().find(|&&c| c != k).ok_or_else(bad)?;
        let n = *r[1..].iter().find(|&&c| c != k).ok_or_else(bad)?;
        if m == n || !o.contains(&m) || !o.contains(&n) {
            return Err(bad());
        }
        let pos = |v: &[char], c: char| v.iter().position(|&x| x == c).ok_or_else(bad);
        let order = [batch, m, n];
        Ok(Contraction {
            lhs: [pos(&l, batch)?, pos(&l, m)?, pos(&l, k)?],
            rhs: [pos(&r, batch)?, pos(&r, n)?, pos(&r, k)?],
            out: [pos(&order, o[0])?, pos(&order, o[1])?, pos(&order, o[2])?],
        })
    }

    fn run(&self, device: &Device, lhs: &Array<f32>, rhs: &Array<f32>) -> Result<Array<f32>> {
        if lhs.dims.len() != 3 || rhs.dims.len() != 3 {
            return Err(UError::invalid(format!(
                "Einsum of {:?} and {:?}: rank-3 operands",
                lhs.dims, rhs.dims
            )));
        }
        let a = permute(lhs, &self.lhs)?;
        let b = permute(rhs, &self.rhs)?;
        let ([batch, m, k], [batch_b, n, k_b]) = (
            [a.dims[0], a.dims[1], a.dims[2]],
            [b.dims[0], b.dims[1], b.dims[2]],
        );
        if batch != batch_b || k != k_b {
            return Err(UError::invalid(format!(
                "Einsum of {:?} and {:?}: the batch and summed axes differ",
                lhs.dims, rhs.dims
            )));
        }
        let mut data = Vec::with_capacity(batch * m * n);
        for i in 0..batch {
            let x = upload(device, &a.data[i * m * k..(i + 1) * m * k], &[m, k])?;
            let w = upload(device, &b.data[i * n * k..(i + 1) * n * k], &[n, k])?;
            data.extend(x.matmul_t(&w)?.to_vec()?);
        }
        let product = Array::new(vec![batch, m, n], data)?;
        permute(&product, &self.out)
    }
}

impl Op {
    /// Whether [`Op::run_over`] can write its result over its first input: elementwise
    /// operators whose result has the first input's shape.
    pub fn can_overwrite(&self) -> bool {
        matches!(
            self,
            Op::Unary(_) | Op::Binary(Binary::Add | Binary::Sub | Binary::Mul | Binary::Div)
        )
    }

    /// Runs an operator [`Op::can_overwrite`] allows over `first`, its first input, which no
    /// later node reads (its buffer becomes the result's); `rest` are the other inputs.
    pub fn run_over(&self, mut first: Array<f32>, rest: &[Option<&Value>]) -> Result<Value> {
        match self {
            Op::Unary(op) => {
                unary_in_place(*op, Arc::make_mut(&mut first.data).as_mut_slice());
                Ok(Value::F32(first))
            }
            Op::Binary(op) => {
                let other = rest
                    .first()
                    .copied()
                    .flatten()
                    .ok_or_else(|| UError::invalid("input 1 is missing"))?;
                let b = other.floats("the second operand")?;
                if crate::value::broadcast_dims(&first.dims, &b.dims)? != first.dims {
                    return binary(*op, &Value::F32(first), other);
                }
                match op {
                    Binary::Add => zip_broadcast_into(&mut first, b, |x, y| x + y)?,
                    Binary::Sub => zip_broadcast_into(&mut first, b, |x, y| x - y)?,
                    Binary::Mul => zip_broadcast_into(&mut first, b, |x, y| x * y)?,
                    Binary::Div => zip_broadcast_into(&mut first, b, |x, y| x / y)?,
                    Binary::Pow => zip_broadcast_into(&mut first, b, f32::powf)?,
                }
                Ok(Value::F32(first))
            }
            _ => Err(UError::invalid(
                "an operator that cannot write over its input",
            )),
        }
    }

    /// Parses a node of `op_type` with its `attributes`; `operands` holds the constant inputs
    /// (initializers) the node reads, `None` for computed ones.
    pub fn parse(
        op_type: &str,
        attrs: &Map<String, Json>,
        operands: &[Option<Arc<Value>>],
        device: &Device,
    ) -> Result<Op> {
        let plain = |op: Op| only(attrs, &[]).map(|()| op);
        match op_type {
            "Add" => plain(Op::Binary(Binary::Add)),
            "Sub" => plain(Op::Binary(Binary::Sub)),
            "Mul" => plain(Op::Binary(Binary::Mul)),
            "Div" => plain(Op::Binary(Binary::Div)),
            "Pow" => plain(Op::Binary(Binary::Pow)),
            "Sigmoid" => plain(Op::Unary(Unary::Sigmoid)),
            "Reciprocal" => plain(Op::Unary(Unary::Reciprocal)),
            "Sqrt" => plain(Op::Unary(Unary::Sqrt)),
            "Log" => plain(Op::Unary(Unary::Log)),
            "Exp" => plain(Op::Unary(Unary::Exp)),
            "Cos" => plain(Op::Unary(Unary::Cos)),
            "Sin" => plain(Op::Unary(Unary::Sin)),
            "Tanh" => plain(Op::Unary(Unary::Tanh)),
            "Relu" => plain(Op::Unary(Unary::Relu)),
            "Neg" => plain(Op::Unary(Unary::Neg)),
            "Erf" => plain(Op::Unary(Unary::Erf)),
            "Slice" => plain(Op::Slice),
            "Equal" => plain(Op::Equal),
            "Where" => plain(Op::Where),
            "Expand" => plain(Op::Expand),
            "Range" => plain(Op::Range),
            "Gather" => {
                only(attrs, &["axis"])?;
                Ok(Op::Gather {
                    axis: int_attr(attrs, "axis", 0)?,
                })
            }
            "ReduceMean" => {
                only(attrs, &["axes", "keepdims", "noop_with_empty_axes"])?;
                if int_attr(attrs, "noop_with_empty_axes", 0)? != 0 {
                    return Err(UError::unsupported(
                        "ReduceMean's `noop_with_empty_axes` is not implemented",
                    ));
                }
                Ok(Op::ReduceMean {
                    axes: ints_attr(attrs, "axes")?,
                    keep: int_attr(attrs, "keepdims", 1)? != 0,
                })
            }
            "ConstantOfShape" => {
                only(attrs, &["value"])?;
                Ok(Op::ConstantOfShape {
                    fill: match attrs.get("value") {
                        Some(v) => crate::graph::tensor_attribute(v)?,
                        None => Value::F32(Array::new(vec![1], vec![0.0])?),
                    },
                })
            }
            "Trilu" => {
                only(attrs, &["upper"])?;
                Ok(Op::Trilu {
                    upper: int_attr(attrs, "upper", 1)? != 0,
                })
            }
            "ArgMax" => {
                only(attrs, &["axis", "keepdims", "select_last_index"])?;
                Ok(Op::ArgMax {
                    axis: int_attr(attrs, "axis", 0)?,
                    keep: int_attr(attrs, "keepdims", 1)? != 0,
                    last: int_attr(attrs, "select_last_index", 0)? != 0,
                })
            }
            "Flatten" => {
                only(attrs, &["axis"])?;
                Ok(Op::Flatten {
                    axis: int_attr(attrs, "axis", 1)?,
                })
            }
            "Identity" => plain(Op::Identity),
            "Clip" => plain(Op::Clip),
            "Squeeze" => plain(Op::Squeeze),
            "Unsqueeze" => plain(Op::Unsqueeze),
            // A `Constant` becomes a constant of the graph; its node never runs.
            "Constant" => Ok(Op::Identity),
            "Shape" => {
                only(attrs, &["start", "end"])?;
                Ok(Op::Shape {
                    start: int_attr(attrs, "start", 0)?,
                    end: attrs
                        .get("end")
                        .map(|_| int_attr(attrs, "end", 0))
                        .transpose()?,
                })
            }
            "Reshape" => {
                only(attrs, &["allowzero"])?;
                Ok(Op::Reshape {
                    allow_zero: int_attr(attrs, "allowzero", 0)? != 0,
                })
            }
            "Transpose" => {
                only(attrs, &["perm"])?;
                let perm = ints_attr(attrs, "perm")?.unwrap_or_default();
                Ok(Op::Transpose {
                    perm: perm.iter().map(|&p| p.max(0) as usize).collect(),
                })
            }
            "Concat" => {
                only(attrs, &["axis"])?;
                Ok(Op::Concat {
                    axis: int_attr(attrs, "axis", 0)?,
                })
            }
            "Split" => {
                only(attrs, &["axis", "num_outputs"])?;
                Ok(Op::Split {
                    axis: int_attr(attrs, "axis", 0)?,
                    parts: int_attr(attrs, "num_outputs", 0)?.max(0) as usize,
                })
            }
            "Cast" => {
                only(attrs, &["to", "saturate"])?;
                match int_attr(attrs, "to", 0)? {
                    1 | 10 | 11 | 16 => Ok(Op::Cast { to_int: false }),
                    6 | 7 => Ok(Op::Cast { to_int: true }),
                    other => Err(UError::unsupported(format!(
                        "a cast to the data type {other} is not implemented"
                    ))),
                }
            }
            "Gemm" => {
                only(attrs, &["alpha", "beta", "transA", "transB"])?;
                let b = constant(operands, 1, "Gemm's B")?;
                let (weight, n) = weight_nk(device, b, int_attr(attrs, "transB", 0)? != 0)?;
                Ok(Op::Gemm {
                    alpha: float_attr(attrs, "alpha", 1.0)?,
                    beta: float_attr(attrs, "beta", 1.0)?,
                    trans_a: int_attr(attrs, "transA", 0)? != 0,
                    weight,
                    n,
                })
            }
            "MatMul" => {
                plain(Op::Identity)?;
                if operands.get(1).is_some_and(Option::is_none) {
                    return Ok(Op::BatchedMatMul);
                }
                let b = constant(operands, 1, "MatMul's B")?;
                let (weight, n) = weight_nk(device, b, false)?;
                Ok(Op::MatMul { weight, n })
            }
            "Conv" => {
                only(
                    attrs,
                    &[
                        "auto_pad",
                        "dilations",
                        "group",
                        "kernel_shape",
                        "pads",
                        "strides",
                    ],
                )?;
                if str_attr(attrs, "auto_pad", "NOTSET") != "NOTSET" {
                    return Err(UError::unsupported("Conv's `auto_pad` is not implemented"));
                }
                if int_attr(attrs, "group", 1)? != 1 {
                    return Err(UError::unsupported("a grouped Conv is not implemented"));
                }
                if ints_attr(attrs, "dilations")?.is_some_and(|d| d.iter().any(|&d| d != 1)) {
                    return Err(UError::unsupported("a dilated Conv is not implemented"));
                }
                let strides = ints_attr(attrs, "strides")?.unwrap_or(vec![1, 1]);
                let pads = ints_attr(attrs, "pads")?.unwrap_or(vec![0; 4]);
                let (stride, padding) = match (strides.as_slice(), pads.as_slice()) {
                    (&[s, t], &[top, left, bottom, right])
                        if s == t
                            && s > 0
                            && top == left
                            && bottom == right
                            && top >= 0
                            && bottom >= 0 =>
                    {
                        (s as u32, [top as u32, bottom as u32])
                    }
                    _ => {
                        return Err(UError::unsupported(format!(
                            "a 2-D Conv with equal strides and the same padding on both axes is \
                             implemented, not strides {strides:?} and pads {pads:?}"
                        )));
                    }
                };
                let w = constant(operands, 1, "Conv's weight")?;
                if w.dims.len() != 4 {
                    return Err(UError::unsupported(format!(
                        "a Conv weight of shape {:?}; a 2-D one is implemented",
                        w.dims
                    )));
                }
                let weight = upload(device, &w.data, &w.dims)?;
                let bias = match operands.get(2) {
                    Some(_) => {
                        let b = constant(operands, 2, "Conv's bias")?;
                        Some(upload(device, &b.data, &[b.data.len()])?)
                    }
                    None => None,
                };
                Ok(Op::Conv {
                    weight,
                    bias,
                    stride,
                    padding,
                })
            }
            "Einsum" => {
                only(attrs, &["equation"])?;
                Ok(Op::Einsum(Contraction::parse(str_attr(
                    attrs, "equation", "",
                ))?))
            }
            "InstanceNormalization" => {
                only(attrs, &["epsilon"])?;
                Ok(Op::InstanceNorm {
                    epsilon: float_attr(attrs, "epsilon", 1e-5)?,
                })
            }
            "AveragePool" => {
                only(
                    attrs,
                    &[
                        "auto_pad",
                        "ceil_mode",
                        "count_include_pad",
                        "kernel_shape",
                        "pads",
                        "strides",
                        "dilations",
                    ],
                )?;
                let kernel = ints_attr(attrs, "kernel_shape")?.unwrap_or_default();
                let strides = ints_attr(attrs, "strides")?.unwrap_or(vec![1, 1]);
                let pads = ints_attr(attrs, "pads")?.unwrap_or(vec![0; 4]);
                match (kernel.as_slice(), strides.as_slice()) {
                    (&[a, b], &[s, t])
                        if a == b
                            && s == t
                            && a == s
                            && a > 0
                            && pads.iter().all(|&p| p == 0)
                            && str_attr(attrs, "auto_pad", "NOTSET") == "NOTSET"
                            && int_attr(attrs, "ceil_mode", 0)? == 0 =>
                    {
                        Ok(Op::AveragePool { k: a as usize })
                    }
                    _ => Err(UError::unsupported(format!(
                        "an AveragePool of square windows at their own stride without padding \
                         is implemented, not kernel {kernel:?} strides {strides:?} pads {pads:?}"
                    ))),
                }
            }
            "Softmax" => {
                only(attrs, &["axis"])?;
                Ok(Op::Softmax {
                    axis: int_attr(attrs, "axis", -1)?,
                })
            }
            "Resize" => {
                let mode = str_attr(attrs, "mode", "nearest");
                let coordinates = str_attr(attrs, "coordinate_transformation_mode", "half_pixel");
                let nearest = str_attr(attrs, "nearest_mode", "round_prefer_floor");
                if mode != "nearest" || coordinates != "asymmetric" || nearest != "floor" {
                    return Err(UError::unsupported(format!(
                        "a Resize in mode `{mode}`, coordinates `{coordinates}`, nearest \
                         `{nearest}`: nearest/asymmetric/floor (PyTorch's `interpolate(mode=\
                         \"nearest\")`) is implemented"
                    )));
                }
                if int_attr(attrs, "antialias", 0)? != 0 || attrs.contains_key("axes") {
                    return Err(UError::unsupported(
                        "Resize's `antialias` and `axes` are not implemented",
                    ));
                }
                Ok(Op::ResizeNearest)
            }
            other => Err(UError::unsupported(format!(
                "the ONNX operator `{other}` is not implemented"
            ))),
        }
    }

    /// Runs the operator on its inputs (`None`: an optional input left out).
    pub fn run(&self, device: &Device, inputs: &[Option<&Value>]) -> Result<Vec<Value>> {
        let input = |i: usize| -> Result<&Value> {
            inputs
                .get(i)
                .copied()
                .flatten()
                .ok_or_else(|| UError::invalid(format!("input {i} is missing")))
        };
        let floats = |i: usize| input(i)?.floats("the input");
        let one = |v: Value| Ok(vec![v]);
        match self {
            Op::Binary(op) => one(binary(*op, input(0)?, input(1)?)?),
            Op::Unary(op) => {
                let a = floats(0)?;
                one(Value::F32(Array::new(a.dims.clone(), unary(*op, &a.data))?))
            }
            Op::Identity => one(input(0)?.clone()),
            Op::Clip => {
                let bound = |i: usize, default: f32| -> Result<f32> {
                    match inputs.get(i).copied().flatten() {
                        Some(v) => v
                            .floats("Clip's bound")?
                            .data
                            .first()
                            .copied()
                            .ok_or_else(|| UError::invalid("an empty Clip bound")),
                        None => Ok(default),
                    }
                };
                let (lo, hi) = (bound(1, f32::NEG_INFINITY)?, bound(2, f32::INFINITY)?);
                let a = floats(0)?;
                one(Value::F32(Array::new(
                    a.dims.clone(),
                    a.data.iter().map(|&x| x.max(lo).min(hi)).collect(),
                )?))
            }
            Op::Shape { start, end } => {
                let dims = input(0)?.dims();
                let rank = dims.len() as i64;
                let clampi = |v: i64| (if v < 0 { v + rank } else { v }).clamp(0, rank) as usize;
                let (s, e) = (clampi(*start), clampi(end.unwrap_or(rank)));
                let part: Vec<i64> = dims[s..e.max(s)].iter().map(|&d| d as i64).collect();
                one(Value::I64(Array::new(vec![part.len()], part)?))
            }
            Op::Squeeze => {
                let v = input(0)?;
                let dims = v.dims().to_vec();
                let axes: Vec<usize> = match inputs.get(1).copied().flatten() {
                    Some(a) => a
                        .ints("Squeeze's axes")?
                        .data
                        .iter()
                        .map(|&x| axis(x, dims.len()))
                        .collect::<Result<_>>()?,
                    None => (0..dims.len()).filter(|&i| dims[i] == 1).collect(),
                };
                if axes.iter().any(|&a| dims[a] != 1) {
                    return Err(UError::invalid(format!(
                        "squeezing axes {axes:?} of {dims:?}"
                    )));
                }
                let kept = dims
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !axes.contains(i))
                    .map(|(_, &d)| d)
                    .collect();
                one(v.clone().reshaped(kept)?)
            }
            Op::Unsqueeze => {
                let v = input(0)?;
                let given = &input(1)?.ints("Unsqueeze's axes")?.data;
                let rank = v.dims().len() + given.len();
                let mut axes: Vec<usize> = given
                    .iter()
                    .map(|&a| axis(a, rank))
                    .collect::<Result<_>>()?;
                axes.sort_unstable();
                let mut dims = v.dims().to_vec();
                for a in axes {
                    dims.insert(a, 1);
                }
                one(v.clone().reshaped(dims)?)
            }
            Op::Reshape { allow_zero } => {
                let v = input(0)?;
                let shape = &input(1)?.ints("Reshape's shape")?.data;
                one(v
                    .clone()
                    .reshaped(reshape_dims(v.dims(), shape, *allow_zero)?)?)
            }
            Op::Transpose { perm } => {
                let rank = input(0)?.dims().len();
                let perm: Vec<usize> = if perm.is_empty() {
                    (0..rank).rev().collect()
                } else {
                    perm.clone()
                };
                one(match input(0)? {
                    Value::F32(a) => Value::F32(permute(a, &perm)?),
                    Value::I64(a) => Value::I64(permute(a, &perm)?),
                })
            }
            Op::Concat { axis: at } => {
                let parts: Vec<&Value> = inputs.iter().copied().flatten().collect();
                match parts.first() {
                    Some(Value::I64(_)) => {
                        let arrays = parts
                            .iter()
                            .map(|p| p.ints("Concat"))
                            .collect::<Result<Vec<_>>>()?;
                        one(Value::I64(concat(&arrays, *at)?))
                    }
                    Some(Value::F32(_)) => {
                        let arrays = parts
                            .iter()
                            .map(|p| p.floats("Concat"))
                            .collect::<Result<Vec<_>>>()?;
                        one(Value::F32(concat(&arrays, *at)?))
                    }
                    None => Err(UError::invalid("Concat of nothing")),
                }
            }
            Op::Split { axis: at, parts } => {
                let a = floats(0)?;
                let at = axis(*at, a.dims.len())?;
                let total = a.dims[at];
                let sizes: Vec<usize> = match inputs.get(1).copied().flatten() {
                    Some(s) => s
                        .ints("Split's sizes")?
                        .data
                        .iter()
                        .map(|&x| x.max(0) as usize)
                        .collect(),
                    None if *parts > 0 => {
                        let each = total.div_ceil(*parts);
                        (0..*parts)
                            .map(|i| each.min(total.saturating_sub(i * each)))
                            .collect()
                    }
                    None => return Err(UError::invalid("Split without sizes or `num_outputs`")),
                };
                if sizes.iter().sum::<usize>() != total {
                    return Err(UError::invalid(format!("Split of {total} into {sizes:?}")));
                }
                let (outer, _, inner) = a.around(at);
                let mut out = Vec::with_capacity(sizes.len());
                let mut offset = 0;
                for size in sizes {
                    let mut data = Vec::with_capacity(outer * size * inner);
                    for o in 0..outer {
                        let base = (o * total + offset) * inner;
                        data.extend_from_slice(&a.data[base..base + size * inner]);
                    }
                    let mut dims = a.dims.clone();
                    dims[at] = size;
                    out.push(Value::F32(Array::new(dims, data)?));
                    offset += size;
                }
                Ok(out)
            }
            Op::Cast { to_int } => one(match (input(0)?, to_int) {
                (Value::F32(a), true) => Value::I64(Array::new(
                    a.dims.clone(),
                    a.data.iter().map(|&x| x as i64).collect(),
                )?),
                (Value::I64(a), false) => Value::F32(Array::new(
                    a.dims.clone(),
                    a.data.iter().map(|&x| x as f32).collect(),
                )?),
                (v, _) => v.clone(),
            }),
            Op::Gemm {
                alpha,
                beta,
                trans_a,
                weight,
                n,
            } => {
                let a = floats(0)?;
                let a = if *trans_a {
                    permute(a, &[1, 0])?
                } else {
                    a.clone()
                };
                let &[m, k] = a.dims.as_slice() else {
                    return Err(UError::invalid(format!("Gemm's A of shape {:?}", a.dims)));
                };
                let mut y = upload(device, &a.data, &[m, k])?
                    .matmul_t(weight)?
                    .to_vec()?;
                if *alpha != 1.0 {
                    y.iter_mut().for_each(|v| *v *= alpha);
                }
                let y = Array::new(vec![m, *n], y)?;
                one(Value::F32(match inputs.get(2).copied().flatten() {
                    Some(c) => zip_broadcast(&y, c.floats("Gemm's C")?, |p, c| p + beta * c)?,
                    None => y,
                }))
            }
            Op::MatMul { weight, n } => {
                let a = floats(0)?;
                let k = *a
                    .dims
                    .last()
                    .ok_or_else(|| UError::invalid("MatMul of a scalar"))?;
                let rows = a.data.len() / k.max(1);
                let y = upload(device, &a.data, &[rows, k])?
                    .matmul_t(weight)?
                    .to_vec()?;
                let mut dims = a.dims.clone();
                *dims.last_mut().expect("rank ≥ 1") = *n;
                one(Value::F32(Array::new(dims, y)?))
            }
            Op::Conv {
                weight,
                bias,
                stride,
                padding,
            } => {
                let x = floats(0)?;
                let &[batch, c, h, w] = x.dims.as_slice() else {
                    return Err(UError::invalid(format!(
                        "Conv of a {:?} input; [n, c, h, w] is read",
                        x.dims
                    )));
                };
                let mut data = Vec::new();
                let mut out_dims = vec![batch];
                for b in 0..batch {
                    let plane = upload(
                        device,
                        &x.data[b * c * h * w..(b + 1) * c * h * w],
                        &[c, h, w],
                    )?;
                    let y = plane.conv2d(weight, bias.as_ref(), *stride, *padding)?;
                    if b == 0 {
                        out_dims.extend(y.dims().iter().map(|&d| d as usize));
                    }
                    data.extend(y.to_vec()?);
                }
                one(Value::F32(Array::new(out_dims, data)?))
            }
            Op::Einsum(c) => one(Value::F32(c.run(device, floats(0)?, floats(1)?)?)),
            Op::Attention => one(Value::F32(attention(
                device,
                floats(0)?,
                floats(1)?,
                floats(2)?,
            )?)),
            Op::InstanceNorm { epsilon } => {
                let (x, scale, shift) = (floats(0)?, floats(1)?, floats(2)?);
                if x.dims.len() < 3
                    || scale.data.len() != x.dims[1]
                    || shift.data.len() != x.dims[1]
                {
                    return Err(UError::invalid(format!(
                        "InstanceNormalization of {:?} with {} scales and {} biases",
                        x.dims,
                        scale.data.len(),
                        shift.data.len()
                    )));
                }
                let channels = x.dims[1];
                let inner: usize = x.dims[2..].iter().product();
                let mut data = Vec::with_capacity(x.data.len());
                for (i, plane) in x.data.chunks(inner.max(1)).enumerate() {
                    let c = i % channels;
                    let mean = plane.iter().map(|&v| f64::from(v)).sum::<f64>() / inner as f64;
                    let var = plane
                        .iter()
                        .map(|&v| (f64::from(v) - mean).powi(2))
                        .sum::<f64>()
                        / inner as f64;
                    let inv = 1.0 / (var + f64::from(*epsilon)).sqrt();
                    let (g, b) = (f64::from(scale.data[c]), f64::from(shift.data[c]));
                    data.extend(
                        plane
                            .iter()
                            .map(|&v| ((f64::from(v) - mean) * inv * g + b) as f32),
                    );
                }
                one(Value::F32(Array::new(x.dims.clone(), data)?))
            }
            Op::AveragePool { k } => {
                let x = floats(0)?;
                let &[batch, c, h, w] = x.dims.as_slice() else {
                    return Err(UError::invalid(format!(
                        "AveragePool of a {:?} input",
                        x.dims
                    )));
                };
                let (oh, ow) = (h / k, w / k);
                let area = (k * k) as f32;
                let mut data = Vec::with_capacity(batch * c * oh * ow);
                for plane in x.data.chunks((h * w).max(1)) {
                    for y in 0..oh {
                        for xo in 0..ow {
                            let mut sum = 0.0f32;
                            for dy in 0..*k {
                                let row = &plane[(y * k + dy) * w + xo * k..][..*k];
                                sum += row.iter().sum::<f32>();
                            }
                            data.push(sum / area);
                        }
                    }
                }
                one(Value::F32(Array::new(vec![batch, c, oh, ow], data)?))
            }
            Op::Softmax { axis: at } => {
                let a = floats(0)?;
                let at = axis(*at, a.dims.len())?;
                let (outer, n, inner) = a.around(at);
                let mut data = a.data.to_vec();
                if inner == 1 {
                    for row in data.chunks_mut(n.max(1)) {
                        softmax_row(row);
                    }
                } else {
                    let mut row = vec![0f32; n];
                    for o in 0..outer {
                        for i in 0..inner {
                            let at = |j: usize| (o * n + j) * inner + i;
                            (0..n).for_each(|j| row[j] = data[at(j)]);
                            softmax_row(&mut row);
                            (0..n).for_each(|j| data[at(j)] = row[j]);
                        }
                    }
                }
                one(Value::F32(Array::new(a.dims.clone(), data)?))
            }
            Op::Gather { axis: at } => one(indexing::gather(
                input(0)?,
                input(1)?.ints("Gather's indices")?,
                *at,
            )?),
            Op::Slice => {
                let ints = |i: usize| -> Result<Option<&[i64]>> {
                    match inputs.get(i).copied().flatten() {
                        Some(v) => Ok(Some(v.ints("Slice's bounds")?.data.as_slice())),
                        None => Ok(None),
                    }
                };
                let (starts, ends) = (ints(1)?, ints(2)?);
                let (Some(starts), Some(ends)) = (starts, ends) else {
                    return Err(UError::invalid("Slice without starts and ends"));
                };
                one(indexing::slice(
                    input(0)?,
                    starts,
                    ends,
                    ints(3)?,
                    ints(4)?,
                )?)
            }
            Op::ReduceMean { axes, keep } => {
                let axes = match (axes, inputs.get(1).copied().flatten()) {
                    (Some(a), _) => a.clone(),
                    (None, Some(v)) => v.ints("ReduceMean's axes")?.data.to_vec(),
                    (None, None) => Vec::new(),
                };
                one(Value::F32(indexing::reduce_mean(floats(0)?, &axes, *keep)?))
            }
            Op::Equal => one(indexing::equal(input(0)?, input(1)?)?),
            Op::Where => one(indexing::where_(
                input(0)?.ints("Where's condition")?,
                input(1)?,
                input(2)?,
            )?),
            Op::Expand => one(indexing::expand_to(
                input(0)?,
                &input(1)?.ints("Expand's shape")?.data,
            )?),
            Op::ConstantOfShape { fill } => one(indexing::constant_of_shape(
                &input(0)?.ints("ConstantOfShape's shape")?.data,
                fill,
            )?),
            Op::Trilu { upper } => {
                let k = match inputs.get(1).copied().flatten() {
                    Some(v) => *v
                        .ints("Trilu's k")?
                        .data
                        .first()
                        .ok_or_else(|| UError::invalid("an empty Trilu k"))?,
                    None => 0,
                };
                one(indexing::trilu(input(0)?, k, *upper)?)
            }
            Op::Range => one(indexing::range(input(0)?, input(1)?, input(2)?)?),
            Op::ArgMax {
                axis: at,
                keep,
                last,
            } => one(indexing::arg_max(input(0)?, *at, *keep, *last)?),
            Op::Flatten { axis: at } => one(indexing::flatten(input(0)?, *at)?),
            Op::BatchedMatMul => one(Value::F32(indexing::batched_matmul(
                device,
                floats(0)?,
                floats(1)?,
            )?)),
            Op::MatMulAttention { axis: at } => one(Value::F32(matmul_attention(
                device,
                [floats(0)?, floats(1)?, floats(2)?],
                *at,
            )?)),
            Op::ResizeNearest => {
                let x = floats(0)?;
                let &[batch, c, h, w] = x.dims.as_slice() else {
                    return Err(UError::invalid(format!(
                        "Resize of a {:?} input; [n, c, h, w] is implemented",
                        x.dims
                    )));
                };
                // Output sizes and the scale each axis's source coordinate divides by.
                let ((oh, sh), (ow, sw)) = match (
                    inputs.get(2).copied().flatten(),
                    inputs.get(3).copied().flatten(),
                ) {
                    (Some(s), _) if !s.dims().contains(&0) => {
                        let s = &s.floats("Resize's scales")?.data;
                        let fine = |v: f32| v.is_finite() && v > 0.0;
                        if s.len() != 4 || s[0] != 1.0 || s[1] != 1.0 || !fine(s[2]) || !fine(s[3])
                        {
                            return Err(UError::unsupported(format!(
                                "Resize scales {s:?}: positive scales of the last two axes only"
                            )));
                        }
                        let out =
                            |n: usize, scale: f32| ((n as f32 * scale).floor() as usize, scale);
                        (out(h, s[2]), out(w, s[3]))
                    }
                    (_, Some(sizes)) => match sizes.ints("Resize's sizes")?.data.as_slice() {
                        &[n, ch, oh, ow]
                            if n as usize == batch && ch as usize == c && oh > 0 && ow > 0 =>
                        {
                            let scale = |o: i64, n: usize| o as f32 / n.max(1) as f32;
                            ((oh as usize, scale(oh, h)), (ow as usize, scale(ow, w)))
                        }
                        other => {
                            return Err(UError::unsupported(format!("Resize sizes {other:?}")));
                        }
                    },
                    _ => return Err(UError::invalid("Resize without scales or sizes")),
                };
                if h == 0 || w == 0 || oh.saturating_mul(ow) > crate::model::MAX_PIXELS as usize {
                    return Err(UError::invalid(format!(
                        "Resize of {h}×{w} maps to {oh}×{ow}: empty or over {} pixels",
                        crate::model::MAX_PIXELS
                    )));
                }
                // `asymmetric` coordinates, `floor`: output o reads input ⌊o / scale⌋.
                let source =
                    |o: usize, scale: f32, n: usize| ((o as f32 / scale) as usize).min(n - 1);
                let mut data = Vec::with_capacity(batch * c * oh * ow);
                for plane in x.data.chunks(h * w) {
                    for y in 0..oh {
                        let row = &plane[source(y, sh, h) * w..][..w];
                        data.extend((0..ow).map(|xo| row[source(xo, sw, w)]));
                    }
                }
                one(Value::F32(Array::new(vec![batch, c, oh, ow], data)?))
            }
        }
    }
}

/// Channels-first single-head attention of `q` `[b, c, t]` over `k`, `v` `[b, c, s]` (scores
/// unscaled: the graph scaled q and k), as `[b, c, t]`.
fn attention(
    device: &Device,
    q: &Array<f32>,
    k: &Array<f32>,
    v: &Array<f32>,
) -> Result<Array<f32>> {
    let (&[b, c, t], &[bk, ck, s], true) = (q.dims.as_slice(), k.dims.as_slice(), k.dims == v.dims)
    else {
        return Err(UError::invalid(format!(
            "attention of q {:?}, k {:?}, v {:?}: [b, c, t] and two [b, c, s]",
            q.dims, k.dims, v.dims
        )));
    };
    if (bk, ck) != (b, c) {
        return Err(UError::invalid(format!(
            "attention of q {:?} over k {:?}: batch and channels differ",
            q.dims, k.dims
        )));
    }
    let rows = |a: &Array<f32>, n: usize| -> Result<Array<f32>> {
        permute(a, &[0, 2, 1])?.reshaped(vec![b * n, c])
    };
    let (q, k, v) = (rows(q, t)?, rows(k, s)?, rows(v, s)?);
    let params = one_head(c);
    let mut out = Vec::with_capacity(b * t * c);
    for i in 0..b {
        let qi = upload(device, &q.data[i * t * c..(i + 1) * t * c], &[t, c])?;
        let ki = upload(device, &k.data[i * s * c..(i + 1) * s * c], &[s, c])?;
        let vi = upload(device, &v.data[i * s * c..(i + 1) * s * c], &[s, c])?;
        out.extend(qi.attention(&[ki.desc(), vi.desc()], &params)?.to_vec()?);
    }
    permute(&Array::new(vec![b, t, c], out)?, &[0, 2, 1])
}

/// The backend's attention over one head of `head_dim` values, unmasked and unscaled (the
/// graphs apply their scales themselves).
fn one_head(head_dim: usize) -> AttentionParams {
    AttentionParams {
        heads: 1,
        kv_heads: 1,
        head_dim: head_dim as u32,
        first_query_pos: 0,
        window: 0,
        scale: 1.0,
        softcap: 0.0,
        mask: AttentionMask::Bidirectional,
        kv_dtype: DType::F32,
    }
}

/// `softmax(q · kᵀ) · v` as [`Op::MatMulAttention`] computes it: through the backend's
/// attention per leading index where the operands are `[…, n, d]`, `[…, d, m]`, `[…, m, d]`
/// with the same leading axes and the softmax is over the last; as the three unfused operators
/// otherwise.
fn matmul_attention(device: &Device, [q, kt, v]: [&Array<f32>; 3], at: i64) -> Result<Array<f32>> {
    let r = q.dims.len();
    let fused = r >= 2
        && kt.dims.len() == r
        && v.dims.len() == r
        && q.dims[..r - 2] == kt.dims[..r - 2]
        && q.dims[..r - 2] == v.dims[..r - 2]
        && kt.dims[r - 2] == q.dims[r - 1]
        && v.dims[r - 2] == kt.dims[r - 1]
        && v.dims[r - 1] == q.dims[r - 1]
        && axis(at, r).ok() == Some(r - 1);
    if !fused {
        let scores = Value::F32(indexing::batched_matmul(device, q, kt)?);
        let weights = Op::Softmax { axis: at }.run(device, &[Some(&scores)])?;
        let weights = weights[0].floats("the attention weights")?;
        return indexing::batched_matmul(device, weights, v);
    }
    let (n, d, m) = (q.dims[r - 2], q.dims[r - 1], kt.dims[r - 1]);
    let heads: usize = q.dims[..r - 2].iter().product();
    let params = one_head(d);
    let mut out = Vec::with_capacity(heads * n * d);
    for h in 0..heads {
        let k = permute(
            &Array::new(vec![d, m], kt.data[h * d * m..][..d * m].to_vec())?,
            &[1, 0],
        )?;
        let qh = upload(device, &q.data[h * n * d..][..n * d], &[n, d])?;
        let kh = upload(device, &k.data, &[m, d])?;
        let vh = upload(device, &v.data[h * m * d..][..m * d], &[m, d])?;
        out.extend(qh.attention(&[kh.desc(), vh.desc()], &params)?.to_vec()?);
    }
    Array::new(q.dims.clone(), out)
}

/// `eˣ` within a few ulp over f32's normal range, without a libm call, so that loops over it
/// vectorise: `x = n ln 2 + r` (ln 2 split in two parts so `r` stays exact, Cody and Waite),
/// `eˣ = 2ⁿ · eʳ` with `eʳ` a degree-7 Taylor polynomial (|r| ≤ 0.35). Saturates outside
/// [−87, 88].
fn fast_exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest by the 1.5·2²³ trick (no libm call: the loop stays vectorisable).
    const SHIFTER: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `row` ← `exp(row − max) / Σ exp(row − max)`.
fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// `op` of every element (each arm its own loop, so the compiler can vectorise it).
fn unary(op: Unary, data: &[f32]) -> Vec<f32> {
    let mut out = data.to_vec();
    unary_in_place(op, &mut out);
    out
}

/// `op` of every element, written over it (each arm its own loop, so the compiler can
/// vectorise it).
fn unary_in_place(op: Unary, data: &mut [f32]) {
    fn each(data: &mut [f32], f: impl Fn(f32) -> f32) {
        data.iter_mut().for_each(|x| *x = f(*x));
    }
    match op {
        Unary::Sigmoid => each(data, |x| 1.0 / (1.0 + fast_exp(-x))),
        Unary::Silu => each(data, |x| x / (1.0 + fast_exp(-x))),
        Unary::Reciprocal => each(data, |x| 1.0 / x),
        Unary::Sqrt => each(data, f32::sqrt),
        Unary::Log => each(data, f32::ln),
        Unary::Exp => each(data, f32::exp),
        Unary::Cos => each(data, f32::cos),
        Unary::Sin => each(data, f32::sin),
        Unary::Tanh => each(data, f32::tanh),
        Unary::Relu => each(data, |x| x.max(0.0)),
        Unary::Neg => each(data, |x| -x),
        Unary::Erf => each(data, libm::erff),
    }
}

fn binary(op: Binary, a: &Value, b: &Value) -> Result<Value> {
    Ok(match (a, b) {
        (Value::F32(a), Value::F32(b)) => Value::F32(match op {
            Binary::Add => zip_broadcast(a, b, |x, y| x + y)?,
            Binary::Sub => zip_broadcast(a, b, |x, y| x - y)?,
            Binary::Mul => zip_broadcast(a, b, |x, y| x * y)?,
            Binary::Div => zip_broadcast(a, b, |x, y| x / y)?,
            Binary::Pow => zip_broadcast(a, b, f32::powf)?,
        }),
        (Value::I64(a), Value::I64(b)) => Value::I64(match op {
            Binary::Add => zip_broadcast(a, b, i64::wrapping_add)?,
            Binary::Sub => zip_broadcast(a, b, i64::wrapping_sub)?,
            Binary::Mul => zip_broadcast(a, b, i64::wrapping_mul)?,
            Binary::Div => zip_broadcast(a, b, |x, y| if y == 0 { 0 } else { x.wrapping_div(y) })?,
            Binary::Pow => zip_broadcast(a, b, |x, y| (x as f64).powf(y as f64) as i64)?,
        }),
        _ => {
            return Err(UError::invalid(format!(
                "{op:?} of a float and an integer value"
            )));
        }
    })
}

/// The dimensions `shape` (a `Reshape`'s second input) gives an input of `dims`.
fn reshape_dims(dims: &[usize], shape: &[i64], allow_zero: bool) -> Result<Vec<usize>> {
    let total: usize = dims.iter().product();
    let mut out = Vec::with_capacity(shape.len());
    let mut infer = None;
    for (i, &s) in shape.iter().enumerate() {
        out.push(match s {
            -1 if infer.is_none() => {
                infer = Some(i);
                1
            }
            0 if !allow_zero => *dims.get(i).ok_or_else(|| {
                UError::invalid(format!("Reshape {shape:?} keeps an axis {dims:?} lacks"))
            })?,
            s if s >= 0 => s as usize,
            _ => return Err(UError::invalid(format!("Reshape to {shape:?}"))),
        });
    }
    if let Some(i) = infer {
        let known: usize = out.iter().product();
        if known == 0 || !total.is_multiple_of(known) {
            return Err(UError::invalid(format!("Reshape of {dims:?} to {shape:?}")));
        }
        out[i] = total / known;
    }
    if out.iter().product::<usize>() != total {
        return Err(UError::invalid(format!("Reshape of {dims:?} to {shape:?}")));
    }
    Ok(out)
}

/// Arrays joined along `at`.
fn concat<T: Copy>(parts: &[&Array<T>], at: i64) -> Result<Array<T>> {
    let first = parts[0];
    let at = axis(at, first.dims.len())?;
    for p in parts {
        let same = p.dims.len() == first.dims.len()
            && p.dims
                .iter()
                .zip(&first.dims)
                .enumerate()
                .all(|(i, (a, b))| i == at || a == b);
        if !same {
            return Err(UError::invalid(format!(
                "Concat of {:?} and {:?} along axis {at}",
                first.dims, p.dims
            )));
        }
    }
    let outer: usize = first.dims[..at].iter().product();
    let inner: usize = first.dims[at + 1..].iter().product();
    let mut data = Vec::new();
    for o in 0..outer {
        for p in parts {
            let width = p.dims[at] * inner;
            data.extend_from_slice(&p.data[o * width..(o + 1) * width]);
        }
    }
    let mut dims = first.dims.clone();
    dims[at] = parts.iter().map(|p| p.dims[at]).sum();
    Array::new(dims, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn einsum_equations_map_to_batched_products() {
        let c = Contraction::parse("bct,bcs->bts").unwrap();
        assert_eq!((c.lhs, c.rhs, c.out), ([0, 2, 1], [0, 2, 1], [0, 1, 2]));
        let c = Contraction::parse("bts,bcs->bct").unwrap();
        assert_eq!((c.lhs, c.rhs, c.out), ([0, 1, 2], [0, 1, 2], [0, 2, 1]));
        assert!(Contraction::parse("ij,jk->ik").is_err());
        assert!(Contraction::parse("bij,bjk->bik").is_ok());
    }

    #[test]
    fn fast_exp_follows_exp() {
        for i in -1990..=2000 {
            let x = i as f32 * 0.0437;
            let (fast, exact) = (fast_exp(x), x.exp());
            assert!(
                (fast - exact).abs() <= exact * 4e-7,
                "exp({x}) = {exact}, fast {fast}"
            );
        }
        assert!(fast_exp(-200.0) < 1e-37);
        assert!(fast_exp(200.0) > 1e38);
    }

    #[test]
    fn reshape_keeps_and_infers() {
        assert_eq!(reshape_dims(&[2, 3, 4], &[0, -1], false).unwrap(), [2, 12]);
        assert!(reshape_dims(&[2, 3, 4], &[5, -1], false).is_err());
        assert!(reshape_dims(&[2, 3, 4], &[-1, -1], false).is_err());
    }

    #[test]
    fn concat_and_split_shapes() {
        let a = Array::new(vec![2, 1], vec![1, 2]).unwrap();
        let b = Array::new(vec![2, 2], vec![3, 4, 5, 6]).unwrap();
        let c = concat(&[&a, &b], 1).unwrap();
        assert_eq!(
            (c.dims, c.data.to_vec()),
            (vec![2, 3], vec![1, 3, 4, 2, 5, 6])
        );
    }
}
