//! The convolutional side of vision, audio and diffusion models: 1-D and 2-D convolution,
//! group normalisation and nearest-neighbour upsampling, all on `[channels, …]` f32 tensors.
//!
//! Direct loops (output channels split over the pool): correct for every shape, measured
//! against PyTorch in `tests/conv.rs`; the fast paths for large images come with the models
//! that need them.

use crate::engine::Engine;
use rayon::prelude::*;
use u_sdk::{Result, UError};

/// The geometry of a 2-D convolution (a 1-D one has `h = kh = 1`).
#[derive(Clone, Copy, Debug)]
pub struct Conv {
    /// Input channels.
    pub c_in: usize,
    /// Output channels.
    pub c_out: usize,
    /// Input height and width.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Step between output positions (both axes).
    pub stride: usize,
    /// Zeros added at each border (both axes; none vertically for 1-D).
    pub padding: usize,
    /// Whether this is a 1-D convolution (no vertical padding).
    pub one_d: bool,
}

impl Conv {
    fn pad_h(&self) -> usize {
        if self.one_d { 0 } else { self.padding }
    }

    /// Output height and width.
    pub fn out_dims(&self) -> Result<(usize, usize)> {
        let out = |n: usize, k: usize, pad: usize| {
            (n + 2 * pad)
                .checked_sub(k)
                .map(|v| v / self.stride.max(1) + 1)
        };
        match (
            out(self.h, self.kh, self.pad_h()),
            out(self.w, self.kw, self.padding),
        ) {
            (Some(h), Some(w)) if self.stride > 0 => Ok((h, w)),
            _ => Err(UError::invalid(format!(
                "conv: kernel larger than its padded input ({self:?})"
            ))),
        }
    }
}

/// `out[co, y, x] = bias[co] + Σ input[ci, y·s + i − p, x·s + j − p] · weight[co, ci, i, j]`.
pub fn conv(
    eng: &Engine,
    g: Conv,
    input: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) -> Result<()> {
    let (oh, ow) = g.out_dims()?;
    let bad = |why: &str| UError::invalid(format!("conv {g:?}: {why}"));
    if input.len() != g.c_in * g.h * g.w {
        return Err(bad("input must be [c_in, h, w]"));
    }
    if weight.len() != g.c_out * g.c_in * g.kh * g.kw {
        return Err(bad("weight must be [c_out, c_in, kh, kw]"));
    }
    if bias.is_some_and(|b| b.len() != g.c_out) {
        return Err(bad("bias must hold c_out values"));
    }
    if out.len() != g.c_out * oh * ow {
        return Err(bad("out must be [c_out, h_out, w_out]"));
    }
    let (ph, pw) = (g.pad_h() as isize, g.padding as isize);
    let one = |co: usize, o: &mut [f32]| {
        let b = bias.map_or(0.0, |b| b[co]);
        for y in 0..oh {
            for x in 0..ow {
                let mut acc = b;
                for ci in 0..g.c_in {
                    let wk = &weight[(co * g.c_in + ci) * g.kh * g.kw..][..g.kh * g.kw];
                    let plane = &input[ci * g.h * g.w..][..g.h * g.w];
                    for i in 0..g.kh {
                        let iy = (y * g.stride) as isize + i as isize - ph;
                        if iy < 0 || iy >= g.h as isize {
                            continue;
                        }
                        for j in 0..g.kw {
                            let ix = (x * g.stride) as isize + j as isize - pw;
                            if ix >= 0 && ix < g.w as isize {
                                acc += plane[iy as usize * g.w + ix as usize] * wk[i * g.kw + j];
                            }
                        }
                    }
                }
                o[y * ow + x] = acc;
            }
        }
    };
    eng.pool.install(|| {
        out.par_chunks_mut(oh * ow)
            .enumerate()
            .for_each(|(co, o)| one(co, o))
    });
    Ok(())
}

/// Group normalisation of `x` `[channels, spatial]`: each of `groups` groups of channels is
/// normalised over its values (population variance), then scaled and shifted per channel.
#[allow(clippy::too_many_arguments)]
pub fn group_norm(
    x: &[f32],
    channels: usize,
    groups: usize,
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<()> {
    if channels == 0
        || groups == 0
        || !channels.is_multiple_of(groups)
        || !x.len().is_multiple_of(channels)
        || weight.len() != channels
        || bias.len() != channels
        || out.len() != x.len()
    {
        return Err(UError::invalid(format!(
            "group_norm: {} values of {channels} channels in {groups} groups, weight {} and bias \
             {} values, out {}",
            x.len(),
            weight.len(),
            bias.len(),
            out.len()
        )));
    }
    let spatial = x.len() / channels;
    let per = channels / groups * spatial;
    for g in 0..groups {
        let xs = &x[g * per..(g + 1) * per];
        let n = per as f64;
        let mean = xs.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = xs
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        let r = 1.0 / (var + f64::from(eps)).sqrt();
        for (c, (xr, or)) in xs
            .chunks_exact(spatial)
            .zip(out[g * per..(g + 1) * per].chunks_exact_mut(spatial))
            .enumerate()
        {
            let ch = g * (channels / groups) + c;
            for (o, &v) in or.iter_mut().zip(xr) {
                *o = ((f64::from(v) - mean) * r) as f32 * weight[ch] + bias[ch];
            }
        }
    }
    Ok(())
}

/// Nearest-neighbour upsampling of `x` `[c, h, w]` by `factor` on both axes into
/// `[c, h·factor, w·factor]`.
pub fn upsample(
    x: &[f32],
    c: usize,
    h: usize,
    w: usize,
    factor: usize,
    out: &mut [f32],
) -> Result<()> {
    if factor == 0 || x.len() != c * h * w || out.len() != x.len() * factor * factor {
        return Err(UError::invalid(format!(
            "upsample: {} values as [{c}, {h}, {w}] by {factor} into {}",
            x.len(),
            out.len()
        )));
    }
    let (oh, ow) = (h * factor, w * factor);
    for ch in 0..c {
        for y in 0..oh {
            let src = &x[(ch * h + y / factor) * w..][..w];
            let dst = &mut out[(ch * oh + y) * ow..][..ow];
            for (xo, d) in dst.iter_mut().enumerate() {
                *d = src[xo / factor];
            }
        }
    }
    Ok(())
}
