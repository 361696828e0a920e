//! The convolutional side of vision, audio and diffusion models: 1-D and 2-D convolution,
//! group normalisation and nearest-neighbour upsampling, all on `[channels, …]` f32 tensors.
//!
//! Convolution is im2col and a matrix product on the GEMM kernels (positions tiled so the
//! column buffer stays small): checked against the direct sum in the unit tests below, and
//! against PyTorch through arch-whisper's conformance tests (its two audio convolutions).

use crate::{
    engine::Engine,
    matmul::{Weight, matmul_weight},
};
use rayon::prelude::*;
use u_sdk::DType;
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
    /// Zeros added before each axis (top, left; none vertically for 1-D).
    pub padding: usize,
    /// Zeros added after each axis (bottom, right; none vertically for 1-D).
    pub padding_end: usize,
    /// Whether this is a 1-D convolution (no vertical padding).
    pub one_d: bool,
}

impl Conv {
    fn pad_h(&self) -> (usize, usize) {
        if self.one_d {
            (0, 0)
        } else {
            (self.padding, self.padding_end)
        }
    }

    /// Output height and width.
    pub fn out_dims(&self) -> Result<(usize, usize)> {
        let out = |n: usize, k: usize, (before, after): (usize, usize)| {
            (n + before + after)
                .checked_sub(k)
                .map(|v| v / self.stride.max(1) + 1)
        };
        match (
            out(self.h, self.kh, self.pad_h()),
            out(self.w, self.kw, (self.padding, self.padding_end)),
        ) {
            (Some(h), Some(w)) if self.stride > 0 => Ok((h, w)),
            _ => Err(UError::invalid(format!(
                "conv: kernel larger than its padded input ({self:?})"
            ))),
        }
    }
}

/// Floats of im2col rows built at once (16 MiB).
const COLUMN_FLOATS: usize = 4 << 20;

fn bytemuck_f32(v: &[f32]) -> &[u8] {
    // SAFETY: f32 is plain bytes with no padding; same memory, length in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
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
    if g.c_in * g.kh * g.kw == 0 || g.c_out == 0 {
        return Err(bad("no input channels, kernel taps or output channels"));
    }
    let (ph, pw) = (g.pad_h().0 as isize, g.padding as isize);
    let k = g.c_in * g.kh * g.kw;
    let positions = oh * ow;
    // im2col: each output position's receptive field as one row of `k` values (zeros where
    // the kernel overhangs the padded border), so the convolution is one matrix product on
    // the GEMM kernels, a tile of positions at a time. The columns stand as the product's
    // "weight" and the filters `[c_out, k]` as its activation rows: the filters stay in cache
    // while each column is read once, and the result comes out channels first.
    let tile = (COLUMN_FLOATS / k).clamp(1, positions);
    let mut cols = vec![0f32; tile * k];
    let mut prod = vec![0f32; tile * g.c_out];
    for first in (0..positions).step_by(tile) {
        let n = tile.min(positions - first);
        let cols = &mut cols[..n * k];
        eng.pool.install(|| {
            cols.par_chunks_mut(k).enumerate().for_each(|(r, row)| {
                let p = first + r;
                let (y, x) = (p / ow, p % ow);
                for ci in 0..g.c_in {
                    let plane = &input[ci * g.h * g.w..][..g.h * g.w];
                    for i in 0..g.kh {
                        let iy = (y * g.stride) as isize + i as isize - ph;
                        let dst = &mut row[(ci * g.kh + i) * g.kw..][..g.kw];
                        if iy < 0 || iy >= g.h as isize {
                            dst.fill(0.0);
                            continue;
                        }
                        let line = &plane[iy as usize * g.w..][..g.w];
                        let x0 = (x * g.stride) as isize - pw;
                        if x0 >= 0 && x0 as usize + g.kw <= g.w {
                            // Inside the border: the taps are a run of the input row.
                            dst.copy_from_slice(&line[x0 as usize..][..g.kw]);
                            continue;
                        }
                        for (j, d) in dst.iter_mut().enumerate() {
                            let ix = x0 + j as isize;
                            *d = if ix >= 0 && ix < g.w as isize {
                                line[ix as usize]
                            } else {
                                0.0
                            };
                        }
                    }
                }
            })
        });
        let prod = &mut prod[..n * g.c_out];
        let columns = Weight {
            dtype: DType::F32,
            rows: n as u64,
            row_len: k as u64,
            data: bytemuck_f32(cols),
        };
        matmul_weight(eng, columns, weight, g.c_out, prod)?;
        for (co, row) in prod.chunks_exact(n).enumerate() {
            let b = bias.map_or(0.0, |b| b[co]);
            let dst = &mut out[co * positions + first..][..n];
            for (d, &v) in dst.iter_mut().zip(row) {
                *d = v + b;
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition: the direct sum over every input channel and kernel tap.
    fn direct(g: Conv, input: &[f32], weight: &[f32], bias: &[f32]) -> Vec<f32> {
        let (oh, ow) = g.out_dims().unwrap();
        let (ph, pw) = (g.pad_h().0 as isize, g.padding as isize);
        let mut out = vec![0f32; g.c_out * oh * ow];
        for co in 0..g.c_out {
            for y in 0..oh {
                for x in 0..ow {
                    let mut acc = f64::from(bias[co]);
                    for ci in 0..g.c_in {
                        for i in 0..g.kh {
                            for j in 0..g.kw {
                                let iy = (y * g.stride) as isize + i as isize - ph;
                                let ix = (x * g.stride) as isize + j as isize - pw;
                                if iy >= 0 && ix >= 0 && (iy as usize) < g.h && (ix as usize) < g.w
                                {
                                    let v = input[(ci * g.h + iy as usize) * g.w + ix as usize];
                                    let k = weight[((co * g.c_in + ci) * g.kh + i) * g.kw + j];
                                    acc += f64::from(v) * f64::from(k);
                                }
                            }
                        }
                    }
                    out[(co * oh + y) * ow + x] = acc as f32;
                }
            }
        }
        out
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                    / (1 << 24) as f32
                    - 0.5
            })
            .collect()
    }

    #[test]
    fn im2col_equals_the_direct_sum() {
        let kernels = crate::CpuKernels::new(2).unwrap();
        let eng = kernels.engine();
        let cases = [
            // Whisper's convolutions, shrunk: kernel 3, padding 1, strides 1 and 2.
            (Conv {
                c_in: 8,
                c_out: 6,
                h: 1,
                w: 50,
                kh: 1,
                kw: 3,
                stride: 1,
                padding: 1,
                padding_end: 1,
                one_d: true,
            }),
            (Conv {
                c_in: 6,
                c_out: 5,
                h: 1,
                w: 51,
                kh: 1,
                kw: 3,
                stride: 2,
                padding: 1,
                padding_end: 1,
                one_d: true,
            }),
            // 2-D: a UNet's 3×3, a downsampling 3×3 stride 2, a 1×1 and an unpadded 4×4.
            (Conv {
                c_in: 4,
                c_out: 7,
                h: 9,
                w: 11,
                kh: 3,
                kw: 3,
                stride: 1,
                padding: 1,
                padding_end: 1,
                one_d: false,
            }),
            (Conv {
                c_in: 3,
                c_out: 4,
                h: 10,
                w: 9,
                kh: 3,
                kw: 3,
                stride: 2,
                padding: 1,
                padding_end: 1,
                one_d: false,
            }),
            (Conv {
                c_in: 5,
                c_out: 3,
                h: 6,
                w: 7,
                kh: 1,
                kw: 1,
                stride: 1,
                padding: 0,
                padding_end: 0,
                one_d: false,
            }),
            // The VAE encoder's downsampling: zeros after (bottom, right) only, stride 2.
            (Conv {
                c_in: 3,
                c_out: 2,
                h: 8,
                w: 6,
                kh: 3,
                kw: 3,
                stride: 2,
                padding: 0,
                padding_end: 1,
                one_d: false,
            }),
            (Conv {
                c_in: 2,
                c_out: 3,
                h: 8,
                w: 8,
                kh: 4,
                kw: 4,
                stride: 4,
                padding: 0,
                padding_end: 0,
                one_d: false,
            }),
        ];
        for g in cases {
            let input = values(g.c_in * g.h * g.w, 1);
            let weight = values(g.c_out * g.c_in * g.kh * g.kw, 2);
            let bias = values(g.c_out, 3);
            let (oh, ow) = g.out_dims().unwrap();
            let mut out = vec![0f32; g.c_out * oh * ow];
            conv(eng, g, &input, &weight, Some(&bias), &mut out).unwrap();
            let want = direct(g, &input, &weight, &bias);
            let d = out
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-5, "{g:?}: max |Δ| {d}");
        }
    }

    #[test]
    fn tiles_of_positions_cover_every_output() {
        // More positions than one tile of columns holds.
        let kernels = crate::CpuKernels::new(2).unwrap();
        let eng = kernels.engine();
        let g = Conv {
            c_in: 600,
            c_out: 2,
            h: 1,
            w: 7100,
            kh: 1,
            kw: 3,
            stride: 1,
            padding: 1,
            padding_end: 1,
            one_d: true,
        };
        assert!(COLUMN_FLOATS / (g.c_in * 3) < 7100);
        let input = values(g.c_in * g.w, 4);
        let weight = values(2 * g.c_in * 3, 5);
        let mut out = vec![0f32; 2 * 7100];
        conv(eng, g, &input, &weight, None, &mut out).unwrap();
        let want = direct(g, &input, &weight, &[0.0, 0.0]);
        let d = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-4, "max |Δ| {d}");
    }
}
