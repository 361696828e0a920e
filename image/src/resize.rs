//! PIL's `Image.resize` on 8-bit RGB, to the bit.
//!
//! Bilinear and bicubic are Pillow's separable convolution (`libImaging/Resample.c`): for each
//! output column (then row) the filter is centred on the output pixel's centre mapped into the
//! input, its support widened by the downscale factor (so shrinking averages every input pixel
//! it covers: antialiasing), the taps normalised to sum 1 and then rounded to fixed point with
//! 22 fractional bits. Each pass adds the taps to a half in the same fixed point, shifts and
//! clamps to `0..=255`, and the second pass reads the first's 8-bit result. The order is
//! Pillow 13's: vertical first when the height shrinks by more than twice as many pixels as
//! the width does, horizontal first otherwise (Pillow 12 and earlier always went horizontal
//! first, so for those shapes their output can differ from this, and from Pillow 13, by a
//! level here and there); a pass whose size does not change is skipped. Nearest is Pillow's affine scaling
//! (`libImaging/Geometry.c`): the source coordinate of each output pixel starts at half a step
//! and grows by one step (`in / out`, in `f64`, accumulated as Pillow accumulates it), then is
//! truncated.

use std::ops::Range;

use crate::decode::Rgb8Image;
use crate::{ImageError, Result};
use u_sdk::abi::model::Resample;

/// Fractional bits of the fixed-point taps (32 bits less 8 for the value and 2 for headroom).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The triangle filter (PIL's `BILINEAR`), support 1.
fn triangle(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 { 1.0 - x } else { 0.0 }
}

/// Keys' cubic filter with a = −0.5 (PIL's `BICUBIC`), support 2.
fn keys_cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// The taps of one output pixel: the first input index they read and their fixed-point
/// weights.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// The taps of the output pixels `range` along one axis, `input` pixels to `output`.
fn taps(
    input: usize,
    output: usize,
    range: Range<usize>,
    filter: fn(f64) -> f64,
    support: f64,
) -> Vec<Taps> {
    let scale = input as f64 / output as f64;
    let filter_scale = scale.max(1.0);
    let support = support * filter_scale;
    let inverse = 1.0 / filter_scale;
    range
        .map(|out| {
            let centre = (out as f64 + 0.5) * scale;
            // Truncation toward zero of a value that may be negative, as C's `(int)` does.
            let first = ((centre - support + 0.5) as i64).max(0) as usize;
            let end = ((centre + support + 0.5) as i64).min(input as i64).max(0) as usize;
            let raw: Vec<f64> = (first..end)
                .map(|i| filter((i as f64 - centre + 0.5) * inverse))
                .collect();
            let sum: f64 = raw.iter().sum();
            let one = f64::from(1u32 << PRECISION_BITS);
            let weights = raw
                .iter()
                .map(|&w| {
                    let w = if sum != 0.0 { w / sum } else { w };
                    if w < 0.0 {
                        (-0.5 + w * one) as i32
                    } else {
                        (0.5 + w * one) as i32
                    }
                })
                .collect();
            Taps { first, weights }
        })
        .collect()
}

/// A fixed-point sum back to 8 bits: drop the fraction (the half added first rounds), clamp.
fn clip8(sum: i64) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `img` resized to `width × height` as PIL's `Image.resize((width, height), resample)` does
/// on an RGB image (`reducing_gap=None`, no box). The same size returns a copy.
pub fn resize(img: &Rgb8Image, width: u32, height: u32, resample: Resample) -> Result<Rgb8Image> {
    resize_window(img, width, height, 0..width, 0..height, resample)
}

/// The columns `xs` and rows `ys` of [`resize`]'s `width × height` result, computed without the
/// rest (each output pixel depends only on its own taps, so this is the same bytes): a centre
/// crop of a resize costs what the crop holds, however large the resize would be.
pub fn resize_window(
    img: &Rgb8Image,
    width: u32,
    height: u32,
    xs: Range<u32>,
    ys: Range<u32>,
    resample: Resample,
) -> Result<Rgb8Image> {
    if width == 0 || height == 0 {
        return Err(ImageError::ZeroSize { width, height });
    }
    if xs.is_empty() || ys.is_empty() || xs.end > width || ys.end > height {
        return Err(ImageError::Spec(format!(
            "window {xs:?} × {ys:?} of a {width}×{height} resize"
        )));
    }
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    let (out_w, out_h) = (width as usize, height as usize);
    let xs = xs.start as usize..xs.end as usize;
    let ys = ys.start as usize..ys.end as usize;
    let (win_w, win_h) = (xs.len() as u32, ys.len() as u32);
    let pixels = match resample {
        _ if (out_w, out_h) == (in_w, in_h) => {
            let rows = rows_of(img.pixels(), in_w, ys);
            columns_of(&rows, in_w, xs)
        }
        Resample::Nearest => nearest(img, out_w, out_h, xs, ys),
        Resample::Bilinear => convolve(img, out_w, out_h, xs, ys, triangle, 1.0),
        Resample::Bicubic => convolve(img, out_w, out_h, xs, ys, keys_cubic, 2.0),
    };
    Rgb8Image::new(win_w, win_h, pixels)
}

/// Rows `ys` of an RGB image `width` pixels wide.
fn rows_of(src: &[u8], width: usize, ys: Range<usize>) -> Vec<u8> {
    src[ys.start * width * 3..ys.end * width * 3].to_vec()
}

/// Columns `xs` of an RGB image `width` pixels wide.
fn columns_of(src: &[u8], width: usize, xs: Range<usize>) -> Vec<u8> {
    if xs == (0..width) {
        return src.to_vec();
    }
    src.chunks_exact(width * 3)
        .flat_map(|row| &row[xs.start * 3..xs.end * 3])
        .copied()
        .collect()
}

fn nearest(
    img: &Rgb8Image,
    out_w: usize,
    out_h: usize,
    xs: Range<usize>,
    ys: Range<usize>,
) -> Vec<u8> {
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    // Source positions, accumulated step by step in f64 as Pillow's ImagingScaleAffine does
    // (a product `i * step` can round differently); a position outside the image stays black.
    let positions = |input: usize, output: usize, range: Range<usize>| -> Vec<Option<usize>> {
        let step = input as f64 / output as f64;
        let mut at = step * 0.5;
        let mut out = Vec::with_capacity(range.len());
        for i in 0..range.end {
            if i >= range.start {
                let p = if at < 0.0 { None } else { Some(at as usize) };
                out.push(p.filter(|&p| p < input));
            }
            at += step;
        }
        out
    };
    let cols = positions(in_w, out_w, xs);
    let rows = positions(in_h, out_h, ys);
    let src = img.pixels();
    let mut out = vec![0u8; cols.len() * rows.len() * 3];
    for (row, y) in out.chunks_exact_mut(cols.len() * 3).zip(&rows) {
        let Some(y) = *y else { continue };
        for (px, x) in row.chunks_exact_mut(3).zip(&cols) {
            if let Some(x) = *x {
                let at = (y * in_w + x) * 3;
                px.copy_from_slice(&src[at..at + 3]);
            }
        }
    }
    out
}

fn convolve(
    img: &Rgb8Image,
    out_w: usize,
    out_h: usize,
    xs: Range<usize>,
    ys: Range<usize>,
    filter: fn(f64) -> f64,
    support: f64,
) -> Vec<u8> {
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    let src = img.pixels();
    let (need_h, need_v) = (out_w != in_w, out_h != in_h);
    let cols = need_h.then(|| taps(in_w, out_w, xs.clone(), filter, support));
    let mut rows = need_v.then(|| taps(in_h, out_h, ys.clone(), filter, support));
    // Pillow 13's pass order: vertical first when the height shrinks by more than twice what
    // the width shrinks by (earlier Pillow always went horizontal first).
    let (shrink_h, shrink_w) = (in_h as i64 - out_h as i64, in_w as i64 - out_w as i64);
    let vertical_first = shrink_h > 0 && shrink_h > shrink_w * 2;
    if vertical_first {
        let tmp = match &rows {
            Some(rows) => vertical(src, in_w, rows),
            None => rows_of(src, in_w, ys),
        };
        match &cols {
            Some(cols) => horizontal(&tmp, in_w, cols),
            None => columns_of(&tmp, in_w, xs),
        }
    } else {
        // The horizontal pass reads only the rows the vertical taps use.
        let used = match &mut rows {
            Some(rows) => {
                let first = rows.iter().map(|t| t.first).min().unwrap_or(0);
                let end = rows
                    .iter()
                    .map(|t| t.first + t.weights.len())
                    .max()
                    .unwrap_or(first);
                for t in rows.iter_mut() {
                    t.first -= first;
                }
                first..end
            }
            None => ys,
        };
        let band = rows_of(src, in_w, used);
        let (tmp, tmp_w) = match &cols {
            Some(cols) => (horizontal(&band, in_w, cols), cols.len()),
            None => (columns_of(&band, in_w, xs.clone()), xs.len()),
        };
        match &rows {
            Some(rows) => vertical(&tmp, tmp_w, rows),
            None => tmp,
        }
    }
}

/// One horizontal pass: each row of `src` (`in_w` RGB pixels) to the pixels `cols` describe.
fn horizontal(src: &[u8], in_w: usize, cols: &[Taps]) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let rows = src.len() / (in_w * 3).max(1);
    let mut out = vec![0u8; cols.len() * rows * 3];
    for (src, dst) in src
        .chunks_exact(in_w * 3)
        .zip(out.chunks_exact_mut(cols.len() * 3))
    {
        for (px, t) in dst.chunks_exact_mut(3).zip(cols) {
            let mut sums = [half; 3];
            for (k, &w) in t.weights.iter().enumerate() {
                let at = (t.first + k) * 3;
                for (c, s) in sums.iter_mut().enumerate() {
                    *s += i64::from(src[at + c]) * i64::from(w);
                }
            }
            for (c, s) in sums.iter().enumerate() {
                px[c] = clip8(*s);
            }
        }
    }
    out
}

/// One vertical pass: the rows of `src` (each `width` RGB pixels) to the rows `rows` describe.
fn vertical(src: &[u8], width: usize, rows: &[Taps]) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let stride = width * 3;
    let mut out = vec![0u8; stride * rows.len()];
    let mut sums = vec![0i64; stride];
    for (dst, t) in out.chunks_exact_mut(stride).zip(rows) {
        sums.fill(half);
        for (k, &w) in t.weights.iter().enumerate() {
            let at = (t.first + k) * stride;
            for (s, &v) in sums.iter_mut().zip(&src[at..at + stride]) {
                *s += i64::from(v) * i64::from(w);
            }
        }
        for (d, s) in dst.iter_mut().zip(&sums) {
            *d = clip8(*s);
        }
    }
    out
}
