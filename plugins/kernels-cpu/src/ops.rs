//! The rest of a transformer layer: norms, RoPE, activations, softmax, embedding rows.
//!
//! These are memory-bound element-wise passes written so LLVM vectorizes them; rows are split
//! across the pool when there are enough of them to pay for it.

use crate::engine::Engine;
use rayon::prelude::*;
use u_sdk::{Activation, DType, Result, RopeParams, RopeStyle, TensorView, UError};

/// Elements below which an op runs on the calling thread.
const PAR_MIN: usize = 1 << 15;

fn check_rows(op: &str, x: usize, y: usize, row: usize) -> Result<()> {
    if row == 0 || !x.is_multiple_of(row) || x != y {
        return Err(UError::invalid(format!(
            "{op}: x has {x} values, y has {y}, rows of {row}: x must be whole rows and y as long as x"
        )));
    }
    Ok(())
}

/// Runs `f(x_row, y_row)` over rows, in parallel for large inputs.
fn rows2(
    eng: &Engine,
    x: &[f32],
    y: &mut [f32],
    row: usize,
    f: impl Fn(&[f32], &mut [f32]) + Sync + Send,
) {
    if x.len() >= PAR_MIN && x.len() > row {
        eng.pool.install(|| {
            y.par_chunks_mut(row)
                .zip(x.par_chunks(row))
                .for_each(|(yr, xr)| f(xr, yr))
        });
    } else {
        y.chunks_mut(row)
            .zip(x.chunks(row))
            .for_each(|(yr, xr)| f(xr, yr));
    }
}

/// `y = x / sqrt(mean(x²) + eps) · w`, row by row.
pub fn rms_norm(eng: &Engine, x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) -> Result<()> {
    check_rows("rms_norm", x.len(), y.len(), w.len())?;
    let vec = eng.vec;
    rows2(eng, x, y, w.len(), |xr, yr| {
        let ss = vec.dot(xr, xr);
        let r = 1.0 / (ss / xr.len() as f32 + eps).sqrt();
        for ((o, &a), &g) in yr.iter_mut().zip(xr).zip(w) {
            *o = a * r * g;
        }
    });
    Ok(())
}

/// `y = (x − mean)/sqrt(var + eps) · w + b`, row by row (two-pass variance).
pub fn layer_norm(
    eng: &Engine,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
    y: &mut [f32],
) -> Result<()> {
    check_rows("layer_norm", x.len(), y.len(), w.len())?;
    if b.len() != w.len() {
        return Err(UError::invalid(format!(
            "layer_norm: weight has {} values but bias has {}",
            w.len(),
            b.len()
        )));
    }
    rows2(eng, x, y, w.len(), |xr, yr| {
        let n = xr.len() as f32;
        let mean = xr.iter().sum::<f32>() / n;
        let var = xr.iter().map(|&a| (a - mean) * (a - mean)).sum::<f32>() / n;
        let r = 1.0 / (var + eps).sqrt();
        for (((o, &a), &g), &bb) in yr.iter_mut().zip(xr).zip(w).zip(b) {
            *o = (a - mean) * r * g + bb;
        }
    });
    Ok(())
}

fn check_rope(x: &[f32], tokens: usize, p: &RopeParams) -> Result<()> {
    let (rd, hd, heads) = (p.rotary_dim as usize, p.head_dim as usize, p.heads as usize);
    let half = rd / 2;
    if rd % 2 != 0 || rd > hd || hd == 0 || p.inv_freq.len() != half {
        return Err(UError::invalid(format!(
            "rope: rotary_dim {rd} must be even and ≤ head_dim {hd}, with rotary_dim/2 = {half} \
             inverse frequencies (got {})",
            p.inv_freq.len()
        )));
    }
    if Some(x.len()) != tokens.checked_mul(heads * hd) {
        return Err(UError::invalid(format!(
            "rope: x has {} values, expected tokens {tokens} × heads {heads} × head_dim {hd}",
            x.len(),
        )));
    }
    Ok(())
}

/// The dimensions pair `i` rotates.
fn pair(style: RopeStyle, i: usize, half: usize) -> (usize, usize) {
    match style {
        RopeStyle::Normal => (2 * i, 2 * i + 1),
        RopeStyle::NeoX => (i, i + half),
    }
}

/// Rotates pairs by `pos · inv_freq[i]`: adjacent pairs (Normal) or halves of the rotary part
/// (NeoX); dimensions past `rotary_dim` are left as they are.
pub fn rope(x: &mut [f32], positions: &[i32], p: &RopeParams) -> Result<()> {
    check_rope(x, positions.len(), p)?;
    let (hd, heads, half) = (
        p.head_dim as usize,
        p.heads as usize,
        p.rotary_dim as usize / 2,
    );
    // cos/sin once per (token, pair), applied to every head: no allocation.
    for (tok, &pos) in x.chunks_exact_mut(heads * hd).zip(positions) {
        for (i, &f) in p.inv_freq.iter().enumerate() {
            let theta = pos as f32 * f;
            let (c, s) = (theta.cos() * p.attn_factor, theta.sin() * p.attn_factor);
            let (a, b) = pair(p.style, i, half);
            for head in tok.chunks_exact_mut(hd) {
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
    Ok(())
}

/// Moves rows rotated at positions `from` to positions `to` (a graft): one more rotation by
/// `θ_i(to) − θ_i(from)`, since rotations compose. The angles are formed as [`rope`] forms them
/// (`(pos as f32) × inv_freq[i]` in f32), the difference, its cosine and sine and the rotation
/// in f64, so the result matches rows rotated directly at `to` to f32 rounding. The YaRN
/// `attn_factor`, applied once at `from`, is not applied again.
pub fn rope_move(x: &mut [f32], to: &[i32], from: &[i32], p: &RopeParams) -> Result<()> {
    check_rope(x, to.len(), p)?;
    if from.len() != to.len() {
        return Err(UError::invalid(format!(
            "rope: {} target positions for {} source positions",
            to.len(),
            from.len()
        )));
    }
    let (hd, heads, half) = (
        p.head_dim as usize,
        p.heads as usize,
        p.rotary_dim as usize / 2,
    );
    for ((tok, &q), &r) in x.chunks_exact_mut(heads * hd).zip(to).zip(from) {
        if q == r {
            continue;
        }
        for (i, &f) in p.inv_freq.iter().enumerate() {
            let d = (q as f32 * f) as f64 - (r as f32 * f) as f64;
            let (c, s) = (d.cos(), d.sin());
            let (a, b) = pair(p.style, i, half);
            for head in tok.chunks_exact_mut(hd) {
                let (x0, x1) = (head[a] as f64, head[b] as f64);
                head[a] = (x0 * c - x1 * s) as f32;
                head[b] = (x0 * s + x1 * c) as f32;
            }
        }
    }
    Ok(())
}

/// `erf` with |error| < 1.2e-7 (Numerical Recipes' Chebyshev `erfc`), evaluated in f64.
pub fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 { 1.0 - erfc } else { erfc - 1.0 }
}

/// `x · sigmoid(x)`, with the polynomial [`crate::exp::exp2`] (branch-free, so the loops over
/// it vectorise; the C library's `exp` was the costliest part of a gated feed-forward).
#[inline]
pub fn silu(v: f32) -> f32 {
    v * sigmoid(v)
}

/// GELU, tanh approximation: `½·x·(1 + tanh(u))` with `u = √(2/π)·(x + 0.044715·x³)`,
/// computed as `x · sigmoid(2u)` (the same value, since `1 + tanh(u) = 2·sigmoid(2u)`) with the
/// branch-free [`sigmoid`], so the loops over it vectorise (the C library's `tanhf` was a fifth
/// of a FLUX step).
#[inline]
pub fn gelu_tanh(v: f32) -> f32 {
    const TWO_C: f32 = 2.0 * 0.797_884_6; // 2·sqrt(2/π)
    v * sigmoid(TWO_C * (v + 0.044_715 * v * v * v))
}

/// GELU, exact (erf, in f64).
#[inline]
pub fn gelu_erf(v: f32) -> f32 {
    (0.5 * f64::from(v) * (1.0 + erf(f64::from(v) / std::f64::consts::SQRT_2))) as f32
}

/// `1 / (1 + e^−x)`, as `1 / (1 + 2^(−x·log2 e))`.
#[inline]
pub fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + crate::exp::exp2(-v * std::f32::consts::LOG2_E))
}

/// Expands `$body` once per activation with `$f` bound to its scalar function (a distinct fn
/// item each time), so the loop in `$body` is compiled per activation with the function inlined
/// rather than called through a pointer per element.
macro_rules! with_activation {
    ($act:expr, |$f:ident| $body:expr) => {
        match $act {
            u_sdk::Activation::Silu => {
                let $f = $crate::ops::silu;
                $body
            }
            u_sdk::Activation::GeluTanh => {
                let $f = $crate::ops::gelu_tanh;
                $body
            }
            u_sdk::Activation::GeluErf => {
                let $f = $crate::ops::gelu_erf;
                $body
            }
            u_sdk::Activation::Sigmoid => {
                let $f = $crate::ops::sigmoid;
                $body
            }
            u_sdk::Activation::Relu => {
                let $f = |v: f32| v.max(0.0);
                $body
            }
            u_sdk::Activation::Tanh => {
                let $f = f32::tanh;
                $body
            }
            u_sdk::Activation::Step => {
                let $f = |v: f32| if v > 0.0 { 1.0 } else { 0.0 };
                $body
            }
        }
    };
}
pub(crate) use with_activation;

/// Applies `act` in place.
pub fn activation(eng: &Engine, x: &mut [f32], act: Activation) {
    with_activation!(act, |f| {
        if x.len() >= PAR_MIN {
            eng.pool.install(|| {
                x.par_chunks_mut(4096)
                    .for_each(|c| c.iter_mut().for_each(|v| *v = f(*v)))
            });
        } else {
            x.iter_mut().for_each(|v| *v = f(*v));
        }
    })
}

/// Softmax over each row of `row_len` values, in place.
pub fn softmax(x: &mut [f32], row_len: usize) -> Result<()> {
    if row_len == 0 || !x.len().is_multiple_of(row_len) {
        return Err(UError::invalid(format!(
            "softmax: {} values are not whole rows of {row_len}",
            x.len()
        )));
    }
    for r in x.chunks_exact_mut(row_len) {
        let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut s = 0f32;
        for v in r.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        let inv = 1.0 / s;
        r.iter_mut().for_each(|v| *v *= inv);
    }
    Ok(())
}

/// Gathers rows `ids` of `table` ([vocab, dim], any dtype) into `out`, dequantizing.
pub fn embedding(eng: &Engine, table: &TensorView<'_>, ids: &[u32], out: &mut [f32]) -> Result<()> {
    let shape: Vec<u64> = table.shape.to_vec();
    let out_len = out.len();
    let bad = |why: String| {
        UError::invalid(format!(
            "embedding: table {:?} {shape:?} ({} bytes), {} ids, out {} values: {why}",
            table.dtype,
            table.data.len(),
            ids.len(),
            out_len
        ))
    };
    let dim = usize::try_from(table.row_len()).map_err(|_| bad("row too long".into()))?;
    let vocab = usize::try_from(table.rows()).map_err(|_| bad("too many rows".into()))?;
    let rb = table
        .dtype
        .bytes_for(dim as u64)
        .ok_or_else(|| bad("row is not a whole number of blocks".into()))? as usize;
    if rb.checked_mul(vocab) != Some(table.data.len()) {
        return Err(bad(format!("table needs {vocab}·{rb} bytes")));
    }
    if ids.len().checked_mul(dim) != Some(out.len()) {
        return Err(bad("out must hold ids·dim values".into()));
    }
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(bad(format!("id {id} is past the vocabulary of {vocab}")));
    }
    if dim == 0 {
        return Ok(());
    }
    let data = table.data.as_slice();
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(dim)) {
        let row = &data[id as usize * rb..][..rb];
        match table.dtype {
            DType::F32 => {
                for (v, c) in o.iter_mut().zip(row.chunks_exact(4)) {
                    *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            DType::F16 => eng.vec.f16_to_f32(row, o),
            dt => u_sdk::quant::dequantize(dt, row, o).map_err(|e| bad(e.to_string()))?,
        }
    }
    Ok(())
}
