//! Backward kernels: the gradients of operations whose backward is not itself a forward
//! operation (training, see `u-train`). Sums run in f64: gradients are compared with PyTorch's
//! to 1e-5.

use u_sdk::{Result, UError};

fn check(op: &str, lens: &[usize], row: usize) -> Result<()> {
    if row == 0 || !lens[0].is_multiple_of(row) || lens.iter().any(|&l| l != lens[0]) {
        return Err(UError::invalid(format!(
            "{op}: tensors of {lens:?} values, rows of {row}: all must be the same whole rows"
        )));
    }
    Ok(())
}

/// `dx = r·g − x·r³·mean(g ⊙ x)` per row, with `r = 1/sqrt(mean(x²) + eps)` and `g = dy ⊙ w`:
/// the gradient of `y = x·r·w` with respect to `x`.
pub fn rms_norm_backward(x: &[f32], w: &[f32], dy: &[f32], eps: f32, dx: &mut [f32]) -> Result<()> {
    let row = w.len();
    check("rms_norm_backward", &[x.len(), dy.len(), dx.len()], row)?;
    for ((xr, dyr), dxr) in x
        .chunks_exact(row)
        .zip(dy.chunks_exact(row))
        .zip(dx.chunks_exact_mut(row))
    {
        let n = row as f64;
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let r = 1.0 / (ss / n + f64::from(eps)).sqrt();
        let gx: f64 = xr
            .iter()
            .zip(dyr)
            .zip(w)
            .map(|((&a, &d), &s)| f64::from(a) * f64::from(d) * f64::from(s))
            .sum();
        let c = r * r * r * gx / n;
        for (((o, &a), &d), &s) in dxr.iter_mut().zip(xr).zip(dyr).zip(w) {
            *o = (r * f64::from(d) * f64::from(s) - f64::from(a) * c) as f32;
        }
    }
    Ok(())
}

/// `dx = y ⊙ (dy − Σ dy ⊙ y)` per row: the gradient of `y = softmax(x)` with respect to `x`,
/// from the softmax's output `y`. `dx` may be `dy`'s memory (the caller copies `dy` there).
pub fn softmax_backward(y: &[f32], dx: &mut [f32], row: usize) -> Result<()> {
    check("softmax_backward", &[y.len(), dx.len()], row)?;
    for (yr, g) in y.chunks_exact(row).zip(dx.chunks_exact_mut(row)) {
        let dot: f64 = yr
            .iter()
            .zip(g.iter())
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        for (o, &p) in g.iter_mut().zip(yr) {
            *o = (f64::from(p) * (f64::from(*o) - dot)) as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Central differences of `f` at `x` along each coordinate, dotted with `dy`.
    fn numeric(f: impl Fn(&[f32]) -> Vec<f32>, x: &[f32], dy: &[f32]) -> Vec<f32> {
        let h = 1e-3f32;
        (0..x.len())
            .map(|i| {
                let (mut a, mut b) = (x.to_vec(), x.to_vec());
                a[i] += h;
                b[i] -= h;
                let (fa, fb) = (f(&a), f(&b));
                fa.iter()
                    .zip(&fb)
                    .zip(dy)
                    .map(|((p, q), d)| (p - q) / (2.0 * h) * d)
                    .sum()
            })
            .collect()
    }

    #[test]
    fn rms_norm_backward_matches_finite_differences() {
        let x = [0.3f32, -1.2, 0.7, 2.0, -0.1, 0.4, 0.9, -0.8];
        let w = [1.5f32, -0.5, 0.25, 2.0];
        let dy = [0.1f32, 0.2, -0.3, 0.4, -1.0, 0.5, 0.0, 0.7];
        let forward = |x: &[f32]| -> Vec<f32> {
            x.chunks(4)
                .flat_map(|r| {
                    let s = (r.iter().map(|v| v * v).sum::<f32>() / 4.0 + 1e-5).sqrt();
                    r.iter()
                        .zip(&w)
                        .map(move |(a, g)| a / s * g)
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let mut dx = [0f32; 8];
        rms_norm_backward(&x, &w, &dy, 1e-5, &mut dx).unwrap();
        for (a, b) in dx.iter().zip(numeric(forward, &x, &dy)) {
            assert!((a - b).abs() < 2e-3, "{dx:?}");
        }
    }

    #[test]
    fn softmax_backward_matches_finite_differences() {
        let x = [0.3f32, -1.2, 0.7, 2.0, -0.1, 0.4];
        let dy = [0.1f32, 0.2, -0.3, -1.0, 0.5, 0.0];
        let forward = |x: &[f32]| -> Vec<f32> {
            x.chunks(3)
                .flat_map(|r| {
                    let m = r.iter().fold(f32::MIN, |a, &b| a.max(b));
                    let e: Vec<f32> = r.iter().map(|v| (v - m).exp()).collect();
                    let s: f32 = e.iter().sum();
                    e.into_iter().map(move |v| v / s)
                })
                .collect()
        };
        let y = forward(&x);
        let mut dx = dy;
        softmax_backward(&y, &mut dx, 3).unwrap();
        for (a, b) in dx.iter().zip(numeric(forward, &x, &dy)) {
            assert!((a - b).abs() < 2e-3, "{dx:?}");
        }
    }

    #[test]
    fn mismatched_lengths_are_refused() {
        let mut dx = [0f32; 3];
        assert!(rms_norm_backward(&[0.0; 4], &[1.0; 2], &[0.0; 4], 1e-5, &mut dx).is_err());
        assert!(softmax_backward(&[0.0; 4], &mut dx, 2).is_err());
    }
}
