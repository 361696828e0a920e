//! Training on the same kernels that run inference: reverse-mode automatic differentiation over
//! [`u_sdk::nn::Tensor`] operations (every forward and backward step is a compute-interface
//! operation on the model's backend), the losses and optimizers small trainers need.
//!
//! A [`Graph`] records each operation as it runs (a tape). [`Graph::backward`] walks it from a
//! scalar loss back to the leaves, each node turning the gradient of its output into those of
//! its inputs, summed where a value is used twice:
//!
//! | forward | backward |
//! | --- | --- |
//! | `y = x·Wᵀ` | `dx = dy·W`, `dW = dyᵀ·x` (matmuls of transposes) |
//! | `y = x + b` (`b` one row) | `dx = dy`, `db = 1ᵀ·dy` |
//! | `y = relu(x)` | `dx = dy ⊙ step(x)` |
//! | `y = σ(x)` | `dx = dy ⊙ (y − y²)` |
//! | cross-entropy of `softmax(z)` with class targets, mean over rows | `dz = (softmax(z) − onehot) / n` |
//! | mean squared error against targets | `dy = 2·(y − t) / N` |
//! | `y = x·Wᵀ`, `W` frozen ([`Frozen`]) | `dx = dy·W` (from `Wᵀ`, kept) |
//! | `y = a + b`, `y = a ⊙ b`, `y = c·x` | `da = dy`, `db = dy`; `da = dy ⊙ b`, `db = dy ⊙ a`; `dx = c·dy` |
//! | `y = silu(x) = x·σ(x)` | `dx = dy ⊙ (σ + (x − x·σ)·σ)` |
//! | `y = rms_norm(x)·w`, `w` frozen | [`Op::RmsNormBackward`](u_sdk::Op::RmsNormBackward) |
//! | `y = rope(x, p)` (a rotation scaled by the YaRN factor) | `dx = rope(dy, −p)` (its transpose) |
//! | causal attention `softmax(s·QKᵀ + M)·V`, grouped KV heads | see [`attention`] |
//! | rows of `a` then rows of `b` | each its rows of `dy` |
//! | some rows of `x` | `dy` in those rows, zeros elsewhere |
//!
//! Values that take no gradient (frozen weights, token embeddings) are [`Graph::constant`]s:
//! the backward pass computes gradients only toward leaves made with [`Graph::leaf`].
//!
//! [`optim`] holds SGD (with momentum), Adam and AdamW (decoupled weight decay), as PyTorch
//! defines them, and clipping by the global gradient norm.

pub mod attention;
pub mod optim;
pub mod state;

use std::cell::RefCell;
use u_sdk::{
    Activation, DType, Result, RopeParams, UError,
    nn::{Device, Tensor},
};

/// A value in a [`Graph`]: an index into its tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Var(usize);

/// How a node's inputs get their gradients from its output's.
enum Backward {
    /// A leaf: a parameter, an input or a constant.
    Leaf,
    /// `y = x·Wᵀ`.
    MatMulT { x: Var, w: Var },
    /// `y = x·Wᵀ` with `W` frozen; `wt` is `Wᵀ`.
    Frozen { x: Var, wt: Tensor },
    /// `y = a + b`.
    Add { a: Var, b: Var },
    /// `y = a ⊙ b`.
    Mul { a: Var, b: Var },
    /// `y = factor · x`.
    Scale { x: Var, factor: f32 },
    /// `y = x·σ(x)`.
    Silu { x: Var },
    /// `y = rms_norm(x)·weight`.
    RmsNorm { x: Var, weight: Tensor, eps: f32 },
    /// `y = rope(x, positions)`; `back` holds the negated positions.
    Rope {
        x: Var,
        back: Tensor,
        params: RopeParams,
    },
    /// Causal attention; `probs` are each head's attention weights.
    Attention {
        q: Var,
        k: Var,
        v: Var,
        probs: Vec<Tensor>,
        shape: attention::Shape,
    },
    /// `y` = rows of `a`, then rows of `b`.
    Concat { a: Var, b: Var },
    /// `y` = rows `start..` of `x` (as many as `y` has).
    Rows { x: Var, start: usize },
    /// `y = x + b`, `b` one row.
    AddRow { x: Var, b: Var },
    /// `y = relu(x)`.
    Relu { x: Var },
    /// `y = σ(x)`.
    Sigmoid { x: Var },
    /// Mean cross-entropy of `softmax(z)`; `grad` is its gradient with respect to `z`.
    Loss { input: Var, grad: Tensor },
}

struct Node {
    value: Tensor,
    backward: Backward,
    /// Whether a [`Graph::leaf`] depends on it (only those nodes get gradients).
    needs_grad: bool,
    grad: Option<Tensor>,
}

/// A frozen weight `W` `[out, in]` (any dtype) with `Wᵀ` in `F32`, which the backward pass
/// of `x·Wᵀ` needs (`dx = dy·W`).
pub struct Frozen {
    /// `W`, as the model holds it.
    pub weight: Tensor,
    /// `Wᵀ` `[in, out]`, dequantized.
    pub transposed: Tensor,
}

impl Frozen {
    /// `weight` and its transpose (dequantizing a block-quantized weight).
    pub fn new(weight: &Tensor) -> Result<Frozen> {
        let dev = weight.device();
        let rows = weight.rows();
        let ids: Vec<i32> = (0..rows as i32).collect();
        let ids = dev.from_i32(&ids, &[rows as u64])?;
        let dense = match weight.dtype() {
            DType::F32 => weight.clone(),
            _ => weight.get_rows(&ids)?,
        };
        Ok(Frozen {
            weight: weight.clone(),
            transposed: dense.transpose()?,
        })
    }
}

/// A tape of operations on one device, from leaves to a loss.
pub struct Graph {
    device: Device,
    nodes: RefCell<Vec<Node>>,
}

impl Graph {
    /// An empty tape computing on `device`.
    pub fn new(device: Device) -> Graph {
        Graph {
            device,
            nodes: RefCell::new(Vec::new()),
        }
    }

    /// The device it computes on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn push(&self, value: Tensor, backward: Backward) -> Var {
        let inputs: Vec<Var> = match &backward {
            Backward::Leaf => Vec::new(),
            Backward::MatMulT { x, w } => vec![*x, *w],
            Backward::Frozen { x, .. }
            | Backward::Scale { x, .. }
            | Backward::Silu { x }
            | Backward::RmsNorm { x, .. }
            | Backward::Rope { x, .. }
            | Backward::Rows { x, .. }
            | Backward::Relu { x }
            | Backward::Sigmoid { x } => vec![*x],
            Backward::Loss { input, .. } => vec![*input],
            Backward::AddRow { x, b } => vec![*x, *b],
            Backward::Add { a, b } | Backward::Mul { a, b } | Backward::Concat { a, b } => {
                vec![*a, *b]
            }
            Backward::Attention { q, k, v, .. } => vec![*q, *k, *v],
        };
        let mut nodes = self.nodes.borrow_mut();
        let needs_grad = inputs.iter().any(|v| nodes[v.0].needs_grad);
        nodes.push(Node {
            value,
            backward,
            needs_grad,
            grad: None,
        });
        Var(nodes.len() - 1)
    }

    /// A leaf holding `values` of shape `dims`: a value gradients are computed for.
    pub fn leaf(&self, values: &[f32], dims: &[u64]) -> Result<Var> {
        let v = self.push(self.device.from_f32(values, dims)?, Backward::Leaf);
        self.nodes.borrow_mut()[v.0].needs_grad = true;
        Ok(v)
    }

    /// A value that takes no gradient (an input, a frozen weight).
    pub fn constant(&self, value: Tensor) -> Var {
        self.push(value, Backward::Leaf)
    }

    /// The value of `v`.
    pub fn value(&self, v: Var) -> Tensor {
        self.nodes.borrow()[v.0].value.clone()
    }

    /// The gradient of the last [`Graph::backward`]'s loss with respect to `v`, if it reached it.
    pub fn grad(&self, v: Var) -> Option<Tensor> {
        self.nodes.borrow()[v.0].grad.clone()
    }

    /// `x·Wᵀ`: `x` `[n, in]`, `w` `[out, in]`.
    pub fn matmul_t(&self, x: Var, w: Var) -> Result<Var> {
        let y = self.value(x).matmul_t(&self.value(w))?;
        Ok(self.push(y, Backward::MatMulT { x, w }))
    }

    /// `x + b` with `b` one row added to every row.
    pub fn add_row(&self, x: Var, b: Var) -> Result<Var> {
        let y = self.value(x).add(&self.value(b))?;
        Ok(self.push(y, Backward::AddRow { x, b }))
    }

    /// `x·Wᵀ + b`: a linear layer (`w` `[out, in]`, `b` `[out]`), as `torch.nn.Linear`.
    pub fn linear(&self, x: Var, w: Var, b: Var) -> Result<Var> {
        let y = self.matmul_t(x, w)?;
        self.add_row(y, b)
    }

    /// `x·Wᵀ` with `W` frozen: no gradient toward the weight.
    pub fn frozen_matmul_t(&self, x: Var, w: &Frozen) -> Result<Var> {
        let y = self.value(x).matmul_t(&w.weight)?;
        Ok(self.push(
            y,
            Backward::Frozen {
                x,
                wt: w.transposed.clone(),
            },
        ))
    }

    /// `a + b` (same shapes).
    pub fn add(&self, a: Var, b: Var) -> Result<Var> {
        let y = self.value(a).add(&self.value(b))?;
        Ok(self.push(y, Backward::Add { a, b }))
    }

    /// `a ⊙ b` (same shapes).
    pub fn mul(&self, a: Var, b: Var) -> Result<Var> {
        let y = self.value(a).mul(&self.value(b))?;
        Ok(self.push(y, Backward::Mul { a, b }))
    }

    /// `factor · x`.
    pub fn scale(&self, x: Var, factor: f32) -> Result<Var> {
        let y = self.value(x).scale(factor)?;
        Ok(self.push(y, Backward::Scale { x, factor }))
    }

    /// `x·σ(x)` (SiLU, the gate of SwiGLU).
    pub fn silu(&self, x: Var) -> Result<Var> {
        let y = self.value(x).activation(Activation::Silu)?;
        Ok(self.push(y, Backward::Silu { x }))
    }

    /// `x / sqrt(mean(x²) + eps) · weight` row by row, `weight` frozen.
    pub fn rms_norm(&self, x: Var, weight: &Tensor, eps: f32) -> Result<Var> {
        let y = self.value(x).rms_norm(weight, eps)?;
        Ok(self.push(
            y,
            Backward::RmsNorm {
                x,
                weight: weight.clone(),
                eps,
            },
        ))
    }

    /// Rotary embedding of `x` `[tokens, heads × head_dim]` at `positions` (one per row).
    pub fn rope(&self, x: Var, positions: &[i32], params: &RopeParams) -> Result<Var> {
        let n = positions.len() as u64;
        let y = self.value(x).scale(1.0)?;
        y.rope_assign(&self.device.from_i32(positions, &[n])?, params)?;
        let back: Vec<i32> = positions.iter().map(|p| -p).collect();
        let back = self.device.from_i32(&back, &[n])?;
        Ok(self.push(
            y,
            Backward::Rope {
                x,
                back,
                params: params.clone(),
            },
        ))
    }

    /// Causal self-attention of `q` over `k`, `v` (see [`attention`]).
    pub fn attention(&self, q: Var, k: Var, v: Var, shape: attention::Shape) -> Result<Var> {
        let (y, probs) =
            attention::forward(&self.value(q), &self.value(k), &self.value(v), &shape)?;
        Ok(self.push(
            y,
            Backward::Attention {
                q,
                k,
                v,
                probs,
                shape,
            },
        ))
    }

    /// The rows of `a` followed by those of `b` (same row length).
    pub fn concat_rows(&self, a: Var, b: Var) -> Result<Var> {
        let (av, bv) = (self.value(a), self.value(b));
        if av.row_len() != bv.row_len() {
            return Err(UError::invalid(format!(
                "concat_rows: rows of {} and of {}",
                av.row_len(),
                bv.row_len()
            )));
        }
        let (n, m) = (av.rows(), bv.rows());
        let y = self
            .device
            .alloc(DType::F32, &[(n + m) as u64, av.row_len() as u64])?;
        av.copy_into(None, &y.rows_range(0..n)?)?;
        bv.copy_into(None, &y.rows_range(n..n + m)?)?;
        Ok(self.push(y, Backward::Concat { a, b }))
    }

    /// Rows `range` of `x`.
    pub fn rows(&self, x: Var, range: std::ops::Range<usize>) -> Result<Var> {
        let start = range.start;
        let y = self.value(x).rows_range(range)?.scale(1.0)?;
        Ok(self.push(y, Backward::Rows { x, start }))
    }

    /// `max(x, 0)`.
    pub fn relu(&self, x: Var) -> Result<Var> {
        let y = self.value(x).activation(Activation::Relu)?;
        Ok(self.push(y, Backward::Relu { x }))
    }

    /// `1 / (1 + e^−x)`.
    pub fn sigmoid(&self, x: Var) -> Result<Var> {
        let y = self.value(x).activation(Activation::Sigmoid)?;
        Ok(self.push(y, Backward::Sigmoid { x }))
    }

    /// The mean over rows of the cross-entropy of `softmax(logits)` (`[n, classes]`) with the
    /// class `targets` (as `torch.nn.functional.cross_entropy`); returns the loss node and its
    /// value.
    pub fn cross_entropy(&self, logits: Var, targets: &[u32]) -> Result<(Var, f32)> {
        let z = self.value(logits);
        let (n, classes) = (z.rows(), z.row_len());
        if targets.len() != n || targets.iter().any(|&t| t as usize >= classes) {
            return Err(UError::invalid(format!(
                "cross_entropy: {} targets for {n} rows of {classes} classes",
                targets.len()
            )));
        }
        let p = z.scale(1.0)?;
        p.softmax_assign()?;
        let probs = p.to_vec()?;
        let loss = -targets
            .iter()
            .enumerate()
            .map(|(i, &t)| f64::from(probs[i * classes + t as usize].max(f32::MIN_POSITIVE)).ln())
            .sum::<f64>()
            / n as f64;
        let mut onehot = vec![0f32; n * classes];
        for (i, &t) in targets.iter().enumerate() {
            onehot[i * classes + t as usize] = 1.0;
        }
        let onehot = self.device.from_f32(&onehot, z.dims())?;
        p.add_scaled_assign(&onehot, -1.0)?;
        let grad = p.scale(1.0 / n as f32)?;
        let value = self.device.from_f32(&[loss as f32], &[1])?;
        Ok((
            self.push(
                value,
                Backward::Loss {
                    input: logits,
                    grad,
                },
            ),
            loss as f32,
        ))
    }

    /// The mean squared error of `y` against `targets` (same shape, as
    /// `torch.mean((y − t)²)`); returns the loss node and its value.
    pub fn mse(&self, y: Var, targets: &[f32]) -> Result<(Var, f32)> {
        let y = (y, self.value(y));
        let t = self.device.from_f32(targets, y.1.dims())?;
        let diff = y.1.scale(1.0)?;
        diff.add_scaled_assign(&t, -1.0)?;
        let d = diff.to_vec()?;
        let count = d.len().max(1);
        let loss = d.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / count as f64;
        let grad = diff.scale(2.0 / count as f32)?;
        let value = self.device.from_f32(&[loss as f32], &[1])?;
        Ok((
            self.push(value, Backward::Loss { input: y.0, grad }),
            loss as f32,
        ))
    }

    /// Adds `g` to the gradient of `v`.
    fn accumulate(&self, v: Var, g: Tensor) -> Result<()> {
        let mut nodes = self.nodes.borrow_mut();
        let slot = &mut nodes[v.0].grad;
        *slot = Some(match slot.take() {
            Some(sum) => sum.add(&g)?,
            None => g,
        });
        Ok(())
    }

    /// Back-propagates from `loss` (a node [`Graph::cross_entropy`] or [`Graph::mse`] made):
    /// afterwards [`Graph::grad`] gives d loss / d v for every `v` it depends on.
    pub fn backward(&self, loss: Var) -> Result<()> {
        for n in self.nodes.borrow_mut().iter_mut() {
            n.grad = None;
        }
        let one = self.device.from_f32(&[1.0], &[1])?;
        self.accumulate(loss, one)?;
        for i in (0..=loss.0).rev() {
            if !self.nodes.borrow()[i].needs_grad {
                continue;
            }
            let Some(dy) = self.grad(Var(i)) else {
                continue;
            };
            let step = {
                let nodes = self.nodes.borrow();
                let needs = |v: &Var| nodes[v.0].needs_grad;
                match &nodes[i].backward {
                    Backward::Leaf => Vec::new(),
                    Backward::MatMulT { x, w } => {
                        let (xv, wv) = (nodes[x.0].value.clone(), nodes[w.0].value.clone());
                        let mut out = Vec::new();
                        if needs(x) {
                            out.push((*x, dy.matmul_t(&wv.transpose()?)?));
                        }
                        if needs(w) {
                            out.push((*w, dy.transpose()?.matmul_t(&xv.transpose()?)?));
                        }
                        out
                    }
                    Backward::Frozen { x, wt } => vec![(*x, dy.matmul_t(wt)?)],
                    Backward::Add { a, b } => vec![(*a, dy.clone()), (*b, dy.clone())],
                    Backward::Mul { a, b } => {
                        let (av, bv) = (&nodes[a.0].value, &nodes[b.0].value);
                        let mut out = Vec::new();
                        if needs(a) {
                            out.push((*a, dy.mul(bv)?));
                        }
                        if needs(b) {
                            out.push((*b, dy.mul(av)?));
                        }
                        out
                    }
                    Backward::Scale { x, factor } => vec![(*x, dy.scale(*factor)?)],
                    Backward::Silu { x } => {
                        let xv = &nodes[x.0].value;
                        let s = xv.activation(Activation::Sigmoid)?;
                        // σ + (x − x·σ)·σ
                        let t = xv.scale(1.0)?;
                        t.add_scaled_assign(&xv.mul(&s)?, -1.0)?;
                        let slope = s.add(&t.mul(&s)?)?;
                        vec![(*x, dy.mul(&slope)?)]
                    }
                    Backward::RmsNorm { x, weight, eps } => {
                        vec![(*x, nodes[x.0].value.rms_norm_backward(weight, &dy, *eps)?)]
                    }
                    Backward::Rope { x, back, params } => {
                        let dx = dy.scale(1.0)?;
                        dx.rope_assign(back, params)?;
                        vec![(*x, dx)]
                    }
                    Backward::Attention {
                        q,
                        k,
                        v,
                        probs,
                        shape,
                    } => {
                        let [dq, dk, dv] = attention::backward(
                            &nodes[q.0].value,
                            &nodes[k.0].value,
                            &nodes[v.0].value,
                            probs,
                            &dy,
                            shape,
                        )?;
                        vec![(*q, dq), (*k, dk), (*v, dv)]
                    }
                    Backward::Rows { x, start } => {
                        let xv = &nodes[x.0].value;
                        let dx = self
                            .device
                            .from_f32(&vec![0.0; xv.desc().shape.elements() as usize], xv.dims())?;
                        dy.copy_into(None, &dx.rows_range(*start..*start + dy.rows())?)?;
                        vec![(*x, dx)]
                    }
                    Backward::Concat { a, b } => {
                        let n = nodes[a.0].value.rows();
                        let rows = dy.rows();
                        vec![
                            (*a, dy.rows_range(0..n)?.scale(1.0)?),
                            (*b, dy.rows_range(n..rows)?.scale(1.0)?),
                        ]
                    }
                    Backward::AddRow { x, b } if !needs(b) => vec![(*x, dy.clone())],
                    Backward::AddRow { x, b } => {
                        let ones = self
                            .device
                            .from_f32(&vec![1.0; dy.rows()], &[1, dy.rows() as u64])?;
                        let db = ones.matmul_t(&dy.transpose()?)?;
                        vec![(*x, dy.clone()), (*b, db.reshape(nodes[b.0].value.dims())?)]
                    }
                    Backward::Relu { x } => {
                        let step = nodes[x.0].value.activation(Activation::Step)?;
                        vec![(*x, dy.mul(&step)?)]
                    }
                    Backward::Sigmoid { x } => {
                        let y = &nodes[i].value;
                        let slope = y.scale(1.0)?;
                        slope.add_scaled_assign(&y.mul(y)?, -1.0)?;
                        vec![(*x, dy.mul(&slope)?)]
                    }
                    Backward::Loss { input, grad } => {
                        // `dy` is the loss's own gradient, one value.
                        let scale = dy.to_vec()?[0];
                        vec![(*input, grad.scale(scale)?)]
                    }
                }
            };
            for (v, g) in step {
                if self.nodes.borrow()[v.0].needs_grad {
                    self.accumulate(v, g)?;
                }
            }
        }
        Ok(())
    }
}

/// A trainable tensor kept between steps (as host values: a new [`Graph`] is recorded per
/// step).
pub struct Param {
    /// Current values.
    pub values: Vec<f32>,
    /// Shape.
    pub dims: Vec<u64>,
}

impl Param {
    /// A parameter of `dims` with `values`.
    pub fn new(values: Vec<f32>, dims: &[u64]) -> Result<Param> {
        let n: u64 = dims.iter().product();
        if n as usize != values.len() {
            return Err(UError::invalid(format!(
                "a parameter of shape {dims:?} needs {n} values, got {}",
                values.len()
            )));
        }
        Ok(Param {
            values,
            dims: dims.to_vec(),
        })
    }

    /// The parameter as a leaf of `graph`.
    pub fn leaf(&self, graph: &Graph) -> Result<Var> {
        graph.leaf(&self.values, &self.dims)
    }
}

/// The gradient of `v` as host values (zeros when the loss does not depend on it).
pub fn grad_values(graph: &Graph, v: Var) -> Result<Vec<f32>> {
    match graph.grad(v) {
        Some(g) => g.to_vec(),
        None => {
            let n = graph.value(v).desc().shape.elements() as usize;
            Ok(vec![0.0; n])
        }
    }
}
