//! The convolutional side of vision, audio and diffusion models: 1-D and 2-D convolution,
//! group normalisation and nearest-neighbour upsampling, all on `[channels, …]` f32 tensors.
//!
//! Convolution is im2col and a register-blocked matrix product (positions tiled so the column
//! buffer stays small): checked against the direct sum in the unit tests below, and against
//! PyTorch through arch-whisper's and arch-diffusion's conformance tests.

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

/// Output positions one product block covers.
const POSITIONS: usize = 64;

/// Filters one product block covers.
const FILTERS: usize = 4;

/// `out[co, y, x] = bias[co] + Σ input[ci, y·s + i − p, x·s + j − p] · weight[co, ci, i, j]`.
///
/// im2col, tap-major, a block of [`POSITIONS`] output positions at a time (in cache, one block
/// per task): each kernel tap `(ci, i, j)` becomes one row of the block (runs of the input row,
/// zeros where the kernel overhangs the padded border), so the convolution is the product
/// `weight [c_out, k] · columns [k, positions]`, computed [`FILTERS`] filters at a time whose
/// sums stay in registers while the taps stream past, each filter value broadcast over a row of
/// positions and fused-multiply-added (no rounded product: tiny activations, such as SiLU's
/// of very negative inputs, never make a denormal product and its slow microcode assist).
/// Every output is summed tap by tap in the same order on every instruction set, so the
/// scalar, AVX2, AVX-512 and NEON builds agree bit for bit.
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
    let k = g.c_in * g.kh * g.kw;
    let positions = oh * ow;
    let kernel = block_kernel(eng);
    let blocks_p = positions.div_ceil(POSITIONS);
    let blocks_c = g.c_out.div_ceil(FILTERS);
    // Each block of positions writes its own columns of `out`; shared through a raw pointer.
    let out_ptr = SendPtr(out.as_mut_ptr());
    eng.pool.install(|| {
        (0..blocks_p).into_par_iter().for_each_init(
            || vec![0f32; k * POSITIONS],
            |block, pb| {
                let p0 = pb * POSITIONS;
                let width = POSITIONS.min(positions - p0);
                im2col_block(&g, input, ow, p0, width, block);
                for cb in 0..blocks_c {
                    let c0 = cb * FILTERS;
                    let filters = FILTERS.min(g.c_out - c0);
                    let acc = kernel(&weight[c0 * k..(c0 + filters) * k], filters, k, block);
                    for (r, sums) in acc.iter().take(filters).enumerate() {
                        let co = c0 + r;
                        let b = bias.map_or(0.0, |b| b[co]);
                        // SAFETY: each block of positions writes only positions p0..p0 + width
                        // of each filter's plane, disjoint from every other block's; `out`
                        // outlives the parallel loop.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                out_ptr.get().add(co * positions + p0),
                                width,
                            )
                        };
                        for (d, &v) in dst.iter_mut().zip(sums) {
                            *d = v + b;
                        }
                    }
                }
            },
        )
    });
    Ok(())
}

/// A pointer the parallel product's blocks write through (each its own region).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the blocks that share it write disjoint regions (see `conv`).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// The columns of `count` output positions from `first` (row-major over the output): for each
/// tap `(ci, i, j)`, `block[tap][p]` is the input under it for position `first + p` (zero
/// outside the input); positions past `count` stay zero.
fn im2col_block(g: &Conv, input: &[f32], ow: usize, first: usize, count: usize, block: &mut [f32]) {
    let (ph, pw) = (g.pad_h().0 as isize, g.padding as isize);
    for (tap, dst) in block.chunks_exact_mut(POSITIONS).enumerate() {
        let (ci, i, j) = (tap / (g.kh * g.kw), tap / g.kw % g.kh, tap % g.kw);
        let plane = &input[ci * g.h * g.w..][..g.h * g.w];
        let shift = j as isize - pw;
        let mut p = 0;
        while p < count {
            let (y, x0) = ((first + p) / ow, (first + p) % ow);
            let run = (count - p).min(ow - x0);
            let out = &mut dst[p..p + run];
            let iy = (y * g.stride) as isize + i as isize - ph;
            if iy < 0 || iy >= g.h as isize {
                out.fill(0.0);
            } else {
                let line = &plane[iy as usize * g.w..][..g.w];
                if g.stride == 1 {
                    // Output x reads input x + shift: one run of the row, zeros either side.
                    let x0 = x0 as isize;
                    let lo = (-shift - x0).clamp(0, run as isize) as usize;
                    let hi = (g.w as isize - shift - x0).clamp(lo as isize, run as isize) as usize;
                    out[..lo].fill(0.0);
                    let from = (x0 + lo as isize + shift) as usize;
                    out[lo..hi].copy_from_slice(&line[from..from + hi - lo]);
                    out[hi..].fill(0.0);
                } else {
                    for (x, d) in (x0..).zip(out.iter_mut()) {
                        let ix = (x * g.stride) as isize + shift;
                        *d = if ix >= 0 && ix < g.w as isize {
                            line[ix as usize]
                        } else {
                            0.0
                        };
                    }
                }
            }
            p += run;
        }
        dst[count..].fill(0.0);
    }
}

/// One product block: `acc[r][p] = Σ_t weight[r, t] · block[t, p]` for the block's filters
/// (`weight` holds `filters` rows of `k`; `block` is `[k][POSITIONS]`), taps summed in order.
type BlockKernel = fn(&[f32], usize, usize, &[f32]) -> [[f32; POSITIONS]; FILTERS];

#[inline(always)]
fn block_body(
    weight: &[f32],
    filters: usize,
    k: usize,
    cols: &[f32],
) -> [[f32; POSITIONS]; FILTERS] {
    // The sums live in registers: a local array, nothing else can see it mid-loop.
    let mut acc = [[0f32; POSITIONS]; FILTERS];
    let rows: [&[f32]; FILTERS] = std::array::from_fn(|r| &weight[r.min(filters - 1) * k..][..k]);
    for t in 0..k {
        let col: &[f32; POSITIONS] = cols[t * POSITIONS..][..POSITIONS]
            .try_into()
            .expect("a block");
        for (sums, row) in acc.iter_mut().zip(&rows) {
            let w = row[t];
            for (s, &c) in sums.iter_mut().zip(col) {
                *s = w.mul_add(c, *s);
            }
        }
    }
    acc
}

fn block_portable(
    weight: &[f32],
    filters: usize,
    k: usize,
    cols: &[f32],
) -> [[f32; POSITIONS]; FILTERS] {
    block_body(weight, filters, k, cols)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{FILTERS, POSITIONS, block_body};

    #[target_feature(enable = "avx2,fma")]
    fn avx2(weight: &[f32], filters: usize, k: usize, cols: &[f32]) -> [[f32; POSITIONS]; FILTERS] {
        block_body(weight, filters, k, cols)
    }

    #[target_feature(enable = "avx512f,fma")]
    fn avx512(
        weight: &[f32],
        filters: usize,
        k: usize,
        cols: &[f32],
    ) -> [[f32; POSITIONS]; FILTERS] {
        block_body(weight, filters, k, cols)
    }

    /// The block at AVX2's width (only chosen where the CPU has it).
    pub fn block_avx2(
        weight: &[f32],
        filters: usize,
        k: usize,
        cols: &[f32],
    ) -> [[f32; POSITIONS]; FILTERS] {
        // SAFETY: `block_kernel` picks this only when the engine's ISA includes AVX2.
        unsafe { avx2(weight, filters, k, cols) }
    }

    /// The block at AVX-512's width (only chosen where the CPU has it).
    pub fn block_avx512(
        weight: &[f32],
        filters: usize,
        k: usize,
        cols: &[f32],
    ) -> [[f32; POSITIONS]; FILTERS] {
        // SAFETY: `block_kernel` picks this only when the engine's ISA includes AVX-512 F.
        unsafe { avx512(weight, filters, k, cols) }
    }
}

/// The product block compiled for the engine's instruction set (the same sums everywhere).
fn block_kernel(eng: &Engine) -> BlockKernel {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::Isa;
        match eng.isa {
            Isa::Avx512 | Isa::Avx512Vnni => return x86::block_avx512,
            Isa::Avx2 => return x86::block_avx2,
            _ => {}
        }
    }
    let _ = eng;
    block_portable
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
    fn blocks_of_positions_cover_every_output() {
        // Many blocks of positions, the last one partial, and fewer filters than one block.
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
        assert!(7100 % POSITIONS != 0 && g.c_out < FILTERS);
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

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        for stride in [1, 2] {
            let g = Conv {
                c_in: 5,
                c_out: 6,
                h: 9,
                w: 70,
                kh: 3,
                kw: 3,
                stride,
                padding: 1,
                padding_end: 1,
                one_d: false,
            };
            let (oh, ow) = g.out_dims().unwrap();
            let input = values(g.c_in * g.h * g.w, 7);
            let weight = values(g.c_out * g.c_in * 9, 8);
            let bias = values(g.c_out, 9);
            let run = |isa| {
                let kernels = crate::CpuKernels::with_isa(isa, 2).unwrap();
                let mut out = vec![0f32; g.c_out * oh * ow];
                conv(kernels.engine(), g, &input, &weight, Some(&bias), &mut out).unwrap();
                out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            let scalar = run(crate::isa::Isa::Scalar);
            for isa in crate::isa::Isa::available() {
                assert!(
                    run(isa) == scalar,
                    "{isa:?}, stride {stride}: not the scalar bits"
                );
            }
        }
    }
}
