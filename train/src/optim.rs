//! Optimizers and gradient clipping, as PyTorch defines them (`torch.optim.SGD`, `Adam`,
//! `AdamW`, `torch.nn.utils.clip_grad_norm_`), so that a run here and there takes the same
//! steps. The updates are element-wise host arithmetic on the parameters' values.

use crate::Param;
use u_sdk::{Result, UError};

/// Scales every gradient so that their global L2 norm is at most `max_norm`, as
/// `clip_grad_norm_` does (factor `max_norm / (norm + 1e-6)` when below 1); returns the norm
/// before clipping.
pub fn clip_grad_norm(grads: &mut [Vec<f32>], max_norm: f32) -> f32 {
    let norm = grads
        .iter()
        .flatten()
        .map(|g| f64::from(*g) * f64::from(*g))
        .sum::<f64>()
        .sqrt() as f32;
    let factor = max_norm / (norm + 1e-6);
    if factor < 1.0 {
        grads.iter_mut().flatten().for_each(|g| *g *= factor);
    }
    norm
}

fn check(params: &[Param], grads: &[Vec<f32>]) -> Result<()> {
    if params.len() != grads.len()
        || params
            .iter()
            .zip(grads)
            .any(|(p, g)| p.values.len() != g.len())
    {
        return Err(UError::invalid(
            "optimizer: gradients do not match the parameters",
        ));
    }
    Ok(())
}

/// Stochastic gradient descent with momentum (`buf = μ·buf + g`, the first step `buf = g`;
/// `p -= lr·buf`).
pub struct Sgd {
    lr: f32,
    momentum: f32,
    velocity: Vec<Vec<f32>>,
}

impl Sgd {
    /// SGD at learning rate `lr` with `momentum` (0: plain).
    pub fn new(lr: f32, momentum: f32) -> Sgd {
        Sgd {
            lr,
            momentum,
            velocity: Vec::new(),
        }
    }

    /// One step of every parameter along its gradient.
    pub fn step(&mut self, params: &mut [Param], grads: &[Vec<f32>]) -> Result<()> {
        check(params, grads)?;
        let first = self.velocity.is_empty();
        if first {
            self.velocity = grads.to_vec();
        }
        for ((p, g), buf) in params.iter_mut().zip(grads).zip(&mut self.velocity) {
            for ((w, g), b) in p.values.iter_mut().zip(g).zip(buf.iter_mut()) {
                if !first {
                    *b = self.momentum * *b + g;
                }
                *w -= self.lr * if self.momentum == 0.0 { *g } else { *b };
            }
        }
        Ok(())
    }
}

/// Adam (Kingma & Ba 2015) with bias correction; with `decoupled` weight decay it is AdamW
/// (Loshchilov & Hutter 2019: `p *= 1 − lr·λ` before the step), otherwise the decay is added to
/// the gradient (`g += λ·p`).
pub struct Adam {
    lr: f32,
    betas: (f32, f32),
    eps: f32,
    weight_decay: f32,
    decoupled: bool,
    t: i32,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Adam {
    /// Adam at `lr` (β = 0.9, 0.999; ε = 1e-8), no weight decay.
    pub fn new(lr: f32) -> Adam {
        Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            t: 0,
            m: Vec::new(),
            v: Vec::new(),
        }
    }

    /// AdamW at `lr` with decoupled `weight_decay` (PyTorch's default is 0.01).
    pub fn adamw(lr: f32, weight_decay: f32) -> Adam {
        Adam {
            weight_decay,
            decoupled: true,
            ..Adam::new(lr)
        }
    }

    /// Sets the learning rate of the steps to come (a schedule).
    pub fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    /// The steps taken and the first and second moments of each parameter (empty before the
    /// first step), for a checkpoint.
    pub fn moments(&self) -> (i32, &[Vec<f32>], &[Vec<f32>]) {
        (self.t, &self.m, &self.v)
    }

    /// Resumes from what [`Adam::moments`] gave.
    pub fn set_moments(&mut self, steps: i32, m: Vec<Vec<f32>>, v: Vec<Vec<f32>>) {
        self.t = steps;
        self.m = m;
        self.v = v;
    }

    /// One step of every parameter.
    pub fn step(&mut self, params: &mut [Param], grads: &[Vec<f32>]) -> Result<()> {
        check(params, grads)?;
        if self.m.is_empty() {
            self.m = grads.iter().map(|g| vec![0.0; g.len()]).collect();
            self.v = self.m.clone();
        }
        self.t += 1;
        let (b1, b2) = self.betas;
        let correct1 = 1.0 - b1.powi(self.t);
        let correct2_sqrt = (1.0 - b2.powi(self.t)).sqrt();
        let step_size = self.lr / correct1;
        for (((p, g), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(&mut self.m)
            .zip(&mut self.v)
        {
            for (((w, &g), m), v) in p
                .values
                .iter_mut()
                .zip(g)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                let g = if self.decoupled {
                    *w *= 1.0 - self.lr * self.weight_decay;
                    g
                } else {
                    g + self.weight_decay * *w
                };
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let denom = v.sqrt() / correct2_sqrt + self.eps;
                *w -= step_size * *m / denom;
            }
        }
        Ok(())
    }
}
