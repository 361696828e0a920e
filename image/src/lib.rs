//! # u-image — the image front end of vision models
//!
//! Turns image file bytes into the `pixel_values` a vision tower takes (the input
//! [`u_sdk::abi::model::ImageInput`] carries), exactly as Hugging Face transformers' slow
//! (PIL and numpy) image processors compute them: `CLIPImageProcessor`,
//! `BitImageProcessor` (DINOv2), `ViTImageProcessor` and `SiglipImageProcessor`. What a model
//! takes is its [`ImageSpec`], made from the checkpoint's `preprocessor_config.json`.
//!
//! 1. [`decode()`]: the file to 8-bit RGB as transformers' `load_image` leaves it (PIL opens
//!    it, `ImageOps.exif_transpose`, `convert("RGB")`), PNG, JPEG, WebP, GIF (first frame) and
//!    BMP, its size checked against [`Limits`] before pixels are allocated.
//! 2. [`preprocess`], in the processors' order (`convert_rgb`, `resize`, `center_crop`,
//!    `rescale`, `normalize`, channels first):
//!    - resize ([`resize()`]): PIL's `Image.resize` with `BICUBIC`, `BILINEAR` or `NEAREST`
//!      on 8-bit RGB, reimplemented from Pillow's algorithm (`libImaging/Resample.c`,
//!      `Geometry.c`) so the result is the same bytes. It follows Pillow 13, which runs the
//!      vertical pass first for images whose height shrinks much more than their width
//!      (Pillow 12 and earlier differ there by a level in some pixels; see the [`resize`](mod@resize)
//!      module). It is written here rather than taken from a general-purpose resizer such as
//!      `fast_image_resize`: being bit-exact with Pillow depends on details (the fixed-point
//!      rounding of the taps, the pass order, which Pillow 13 changed) that such a crate does
//!      not promise to follow.
//!      With `shortest_edge > 0` the short side becomes `shortest_edge` and the long side
//!      `int(shortest_edge * long / short)` (transformers' `get_resize_output_image_size`
//!      with `default_to_square=False`: truncated); with `shortest_edge == 0` the image is
//!      resized to `height × width` directly (ViT, SigLIP);
//!    - centre crop ([`center_crop`]) to `height × width` with transformers' `center_crop`
//!      arithmetic (`top = (h - crop_h) // 2`), zero padding a side shorter than the crop as
//!      it does. Only the part of the resize the crop keeps is computed
//!      ([`resize_window`]: the same bytes), so an extreme aspect ratio, whose resize would be
//!      huge, costs no more than the crop;
//!    - `x * rescale` computed in `f64` and rounded to `f32` (transformers' `rescale` upcasts
//!      to float64 then casts to float32), then `(x - mean[c]) / std[c]` in `f32` (its
//!      `normalize`, with `mean` and `std` as float32 arrays).
//!
//! The result is `[3, height, width]` `f32`, channels first.
//!
//! ## How exact, and how it is tested
//!
//! `tests/fixtures/gen_preprocess.py` writes small test images with Pillow and reimplements
//! the processors' steps with PIL and numpy (transformers itself is not needed); the tests
//! compare against what it wrote:
//! - decoding of PNG (8- and 16-bit, grey, grey with alpha, RGBA, palette, EXIF
//!   orientations), GIF, BMP and WebP (lossless, and the lossy file tested): the same bytes
//!   as PIL;
//! - JPEG: the `image` crate decodes with zune-jpeg, PIL with libjpeg-turbo; their IDCT and
//!   chroma upsampling differ, so JPEG pixels are compared within a tolerance (measured: at
//!   most 4 levels, mean 0.42; resizing is compared from identical 8-bit input);
//! - the resized (and cropped) 8-bit image: the same bytes as PIL (Pillow 13.0.0) for the 20
//!   processor cases and 288 plain resizes (shrinking, growing, mixed, sides of 1, every
//!   filter);
//! - `pixel_values`: asserted within 1e-5 of the reference; measured equal to the last bit
//!   (the float operations are the same ones, in the same order).
//!
//! Not matched, and not tested: CMYK and YCCK JPEGs (PIL converts CMYK to RGB its own way),
//! GIFs whose first frame does not cover the whole canvas, and colour profiles (neither side
//! applies them).

#![deny(missing_docs)]

pub mod decode;
pub mod resize;

pub use decode::{Limits, Rgb8Image, decode};
pub use resize::{resize, resize_window};
use u_sdk::abi::model::ImageSpec;

/// Why an image could not be read or preprocessed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// No bytes at all.
    #[error("empty image file")]
    Empty,
    /// The bytes start like no image format known here.
    #[error("not an image file (not PNG, JPEG, WebP, GIF or BMP)")]
    UnknownFormat,
    /// A recognised format that is not supported (or a feature of one that is not).
    #[error("unsupported image format: {0}")]
    UnsupportedFormat(String),
    /// The file is damaged or cut short.
    #[error("corrupt image file ({0})")]
    Corrupt(String),
    /// The decoding library panicked on the file (caught).
    #[error("corrupt image file (the decoder gave up on it)")]
    DecoderPanicked,
    /// The file states a width or height of 0.
    #[error("image of {width}×{height} pixels: a side of 0")]
    ZeroSize {
        /// Stated width.
        width: u32,
        /// Stated height.
        height: u32,
    },
    /// More pixels than [`Limits::max_pixels`] (refused before decoding).
    #[error("image of {width}×{height} pixels: over the limit of {max_pixels}")]
    TooLarge {
        /// Stated width.
        width: u32,
        /// Stated height.
        height: u32,
        /// The limit.
        max_pixels: u64,
    },
    /// The decoder's own allocation bound refused the file.
    #[error("image refused by the decoder's memory limit ({0})")]
    Limit(String),
    /// A pixel buffer whose length is not `width × height × 3`.
    #[error("{bytes} bytes for an RGB image of {width}×{height}")]
    PixelCount {
        /// Width.
        width: u32,
        /// Height.
        height: u32,
        /// Bytes given.
        bytes: usize,
    },
    /// The [`ImageSpec`] cannot be applied.
    #[error("image spec: {0}")]
    Spec(String),
}

/// This crate's results.
pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// The size the resize step gives, `(width, height)`: with `spec.shortest_edge > 0` the short
/// side becomes `shortest_edge` and the long side `int(shortest_edge * long / short)`
/// (transformers' `get_resize_output_image_size(..., default_to_square=False)`, a float
/// division truncated); otherwise `(spec.width, spec.height)`.
pub fn resize_size(width: u32, height: u32, spec: &ImageSpec) -> Result<(u32, u32)> {
    if width == 0 || height == 0 {
        return Err(ImageError::ZeroSize { width, height });
    }
    let edge = spec.shortest_edge;
    if edge == 0 {
        return Ok((spec.width, spec.height));
    }
    let (short, long) = if width <= height {
        (width, height)
    } else {
        (height, width)
    };
    // Python: int(size * long / short), the product exact, the division a correctly rounded
    // double, the conversion truncating.
    let new_long = (f64::from(edge) * f64::from(long) / f64::from(short)) as u64;
    let new_long = u32::try_from(new_long)
        .map_err(|_| ImageError::Spec(format!("a resized side of {new_long} pixels")))?;
    if new_long == 0 {
        return Err(ImageError::Spec(format!(
            "resizing {width}×{height} to a short side of {edge} leaves a side of 0"
        )));
    }
    Ok(if width <= height {
        (edge, new_long)
    } else {
        (new_long, edge)
    })
}

/// One axis of transformers' `center_crop` of `n` pixels to `crop`: the source range kept and
/// where it lands in the output (the rest of the output is zero padding). A crop that fits
/// starts at `(n - crop) // 2`; one larger than the image pads it with zeros, the image placed
/// at `ceil((crop - n) / 2)` (transformers pads both axes when either is short, but an axis
/// that fits gets no padding and the same window, so the axes are independent).
fn crop_axis(n: u32, crop: u32) -> (std::ops::Range<u32>, u32) {
    if n >= crop {
        let start = (n - crop) / 2;
        (start..start + crop, 0)
    } else {
        (0..n, (crop - n).div_ceil(2))
    }
}

/// `img` cropped to `width × height` about its centre as transformers' `center_crop` does:
/// `top = (h - height) // 2`, `left = (w - width) // 2`; a side shorter than the crop is
/// padded with zeros, the image placed at `ceil((new - old) / 2)`.
pub fn center_crop(img: &Rgb8Image, width: u32, height: u32) -> Result<Rgb8Image> {
    let (w, h) = (img.width(), img.height());
    let (xs, x_at) = crop_axis(w, width);
    let (ys, y_at) = crop_axis(h, height);
    let window = resize::resize_window(img, w, h, xs, ys, u_sdk::abi::model::Resample::Nearest)?;
    place(&window, width, height, x_at, y_at)
}

/// `window` placed at (`x`, `y`) on a black `width × height` canvas.
fn place(window: &Rgb8Image, width: u32, height: u32, x: u32, y: u32) -> Result<Rgb8Image> {
    if (width, height) == (window.width(), window.height()) {
        return Ok(window.clone());
    }
    let (ww, wh) = (window.width() as usize, window.height() as usize);
    let (cw, x, y) = (width as usize, x as usize, y as usize);
    let mut out = vec![0u8; cw * height as usize * 3];
    for (row, src) in window.pixels().chunks_exact(ww * 3).enumerate().take(wh) {
        let at = ((y + row) * cw + x) * 3;
        out[at..at + ww * 3].copy_from_slice(src);
    }
    Rgb8Image::new(width, height, out)
}

/// The 8-bit image the resize and centre crop of `spec` give (the processors' `resize` then
/// `center_crop`), `spec.width × spec.height`. Only the part of the resize the crop keeps is
/// computed.
pub fn resize_and_crop(img: &Rgb8Image, spec: &ImageSpec) -> Result<Rgb8Image> {
    check_spec(spec)?;
    let (rw, rh) = resize_size(img.width(), img.height(), spec)?;
    let (xs, x_at) = crop_axis(rw, spec.width);
    let (ys, y_at) = crop_axis(rh, spec.height);
    let window = resize::resize_window(img, rw, rh, xs, ys, spec.resample)?;
    place(&window, spec.width, spec.height, x_at, y_at)
}

fn check_spec(spec: &ImageSpec) -> Result<()> {
    if spec.channels != 3 {
        return Err(ImageError::Spec(format!(
            "{} channels: only RGB (3) is made",
            spec.channels
        )));
    }
    if spec.width == 0 || spec.height == 0 {
        return Err(ImageError::Spec(format!(
            "a model input of {}×{} pixels",
            spec.width, spec.height
        )));
    }
    Ok(())
}

/// The rescale factor as transformers applies it, in `f64`: the spec holds the config's
/// `rescale_factor` as `f32`; when that is the `f32` nearest 1/255 (every processor named
/// above), the double transformers multiplies by is 1/255 itself.
fn rescale_factor(rescale: f32) -> f64 {
    if rescale == (1.0f64 / 255.0) as f32 {
        1.0 / 255.0
    } else {
        f64::from(rescale)
    }
}

/// `pixel_values` of `img` for a model taking `spec`: `[3, spec.height, spec.width]` floats,
/// channels first (see the crate documentation for the steps).
pub fn preprocess(img: &Rgb8Image, spec: &ImageSpec) -> Result<Vec<f32>> {
    let cropped = resize_and_crop(img, spec)?;
    Ok(normalize(&cropped, spec))
}

/// The rescale and normalisation of an image already `spec.width × spec.height`, channels
/// first.
pub fn normalize(img: &Rgb8Image, spec: &ImageSpec) -> Vec<f32> {
    let plane = img.width() as usize * img.height() as usize;
    let scale = rescale_factor(spec.rescale);
    let mut out = vec![0f32; plane * 3];
    for (c, dst) in out.chunks_exact_mut(plane.max(1)).enumerate().take(3) {
        let (mean, std) = (spec.mean[c], spec.std[c]);
        for (d, px) in dst.iter_mut().zip(img.pixels().chunks_exact(3)) {
            let x = (f64::from(px[c]) * scale) as f32;
            *d = (x - mean) / std;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use u_sdk::abi::model::Resample;

    fn spec(height: u32, width: u32, shortest_edge: u32) -> ImageSpec {
        ImageSpec {
            channels: 3,
            height,
            width,
            rows: 0,
            shortest_edge,
            resample: Resample::Bicubic,
            rescale: 1.0 / 255.0,
            mean: [0.5; 3],
            std: [0.5; 3],
        }
    }

    #[test]
    fn shortest_edge_truncates_the_long_side() {
        let s = spec(224, 224, 224);
        // int(224 * 640 / 480) = int(298.67) = 298.
        assert_eq!(resize_size(640, 480, &s), Ok((298, 224)));
        assert_eq!(resize_size(480, 640, &s), Ok((224, 298)));
        assert_eq!(resize_size(300, 300, &s), Ok((224, 224)));
        assert_eq!(resize_size(17, 240, &spec(32, 32, 32)), Ok((32, 451)));
        assert_eq!(resize_size(640, 480, &spec(224, 200, 0)), Ok((200, 224)));
    }

    #[test]
    fn extreme_aspect_ratio_is_an_error_not_a_panic() {
        // 1×4e9 would resize to a long side past u32.
        let s = spec(224, 224, 224);
        assert!(resize_size(1, u32::MAX, &s).is_err());
    }

    #[test]
    fn center_crop_pads_with_zeros_like_transformers() {
        // 3×2 all 200, cropped to 5×4: top = (2 - 4) // 2 = -1, top_pad = 1, left_pad = 1.
        let img = Rgb8Image::new(3, 2, vec![200; 18]).expect("image");
        let out = center_crop(&img, 5, 4).expect("crop");
        let at = |x: usize, y: usize| out.pixels()[(y * 5 + x) * 3];
        assert_eq!((out.width(), out.height()), (5, 4));
        for y in 0..4 {
            for x in 0..5 {
                let inside = (1..4).contains(&x) && (1..3).contains(&y);
                assert_eq!(at(x, y), if inside { 200 } else { 0 }, "({x}, {y})");
            }
        }
    }

    #[test]
    fn only_rgb_specs_are_made() {
        let img = Rgb8Image::new(2, 2, vec![0; 12]).expect("image");
        let mut s = spec(2, 2, 0);
        s.channels = 1;
        assert!(matches!(preprocess(&img, &s), Err(ImageError::Spec(_))));
        let s = spec(0, 2, 0);
        assert!(matches!(preprocess(&img, &s), Err(ImageError::Spec(_))));
    }

    #[test]
    fn rescale_uses_the_double_one_255th() {
        // The f32 of 1/255 stands for the config's double 1/255, as transformers multiplies.
        assert_eq!(rescale_factor(1.0 / 255.0), 1.0 / 255.0);
        assert_eq!(rescale_factor(0.5), 0.5);
    }
}
