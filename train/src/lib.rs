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
//!
//! [`optim`] holds SGD (with momentum), Adam and AdamW (decoupled weight decay), as PyTorch
//! defines them, and clipping by the global gradient norm.

pub mod optim;

use std::cell::RefCell;
use u_sdk::{
    Activation, Result, UError,
    nn::{Device, Tensor},
};

/// A value in a [`Graph`]: an index into its tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Var(usize);

/// How a node's inputs get their gradients from its output's.
enum Backward {
    /// A leaf: a parameter or an input.
    Leaf,
    /// `y = x·Wᵀ`.
    MatMulT { x: Var, w: Var },
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
    grad: Option<Tensor>,
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
        let mut nodes = self.nodes.borrow_mut();
        nodes.push(Node {
            value,
            backward,
            grad: None,
        });
        Var(nodes.len() - 1)
    }

    /// A leaf holding `values` of shape `dims`.
    pub fn leaf(&self, values: &[f32], dims: &[u64]) -> Result<Var> {
        Ok(self.push(self.device.from_f32(values, dims)?, Backward::Leaf))
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
            let Some(dy) = self.grad(Var(i)) else {
                continue;
            };
            let step = {
                let nodes = self.nodes.borrow();
                match &nodes[i].backward {
                    Backward::Leaf => Vec::new(),
                    Backward::MatMulT { x, w } => {
                        let (xv, wv) = (nodes[x.0].value.clone(), nodes[w.0].value.clone());
                        vec![
                            (*x, dy.matmul_t(&wv.transpose()?)?),
                            (*w, dy.transpose()?.matmul_t(&xv.transpose()?)?),
                        ]
                    }
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
                self.accumulate(v, g)?;
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
