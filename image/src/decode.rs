//! Image files to 8-bit RGB pixels as transformers' `load_image` leaves them: the file decoded
//! (PNG, JPEG, WebP, GIF's first frame, BMP, through the `image` crate), turned upright by its
//! EXIF orientation (PIL's `ImageOps.exif_transpose`), then converted as PIL's
//! `Image.convert("RGB")` converts: alpha dropped, grey replicated to the three channels, a
//! palette looked up. The image's size is read from its header and checked against
//! [`Limits`] before any pixel buffer is allocated.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader};

use crate::{ImageError, Result};

/// An 8-bit RGB image: `height` rows of `width` pixels, each pixel three bytes (R, G, B),
/// row-major (the layout of the `uint8` array `numpy.asarray(pil_image)` gives, `[h, w, 3]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb8Image {
    pub(crate) width: u32,
    pub(crate) height: u32,
    pub(crate) pixels: Vec<u8>,
}

impl Rgb8Image {
    /// An image from its pixels, `width × height × 3` bytes; an error if the length does not
    /// match or a side is 0.
    pub fn new(width: u32, height: u32, pixels: Vec<u8>) -> Result<Self> {
        if width == 0 || height == 0 {
            return Err(ImageError::ZeroSize { width, height });
        }
        let want = width as u64 * height as u64 * 3;
        if pixels.len() as u64 != want {
            return Err(ImageError::PixelCount {
                width,
                height,
                bytes: pixels.len(),
            });
        }
        Ok(Self {
            width,
            height,
            pixels,
        })
    }

    /// Pixels per row.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Rows.
    pub fn height(&self) -> u32 {
        self.height
    }

    /// The pixels: rows top to bottom, each `width` RGB triples left to right.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// The pixels, owned.
    pub fn into_pixels(self) -> Vec<u8> {
        self.pixels
    }
}

/// What [`decode`] accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most pixels (`width × height`, as the file's header states them) an image may have.
    pub max_pixels: u64,
}

impl Limits {
    /// PIL's default `Image.MAX_IMAGE_PIXELS` (89,478,485: a quarter gigabyte of RGBA), past which
    /// PIL warns of a decompression bomb.
    pub const PIL_MAX_IMAGE_PIXELS: u64 = 89_478_485;
}

impl Default for Limits {
    /// At most [`Limits::PIL_MAX_IMAGE_PIXELS`] pixels.
    fn default() -> Self {
        Self {
            max_pixels: Self::PIL_MAX_IMAGE_PIXELS,
        }
    }
}

/// Bytes per pixel the largest decoded layout takes (16-bit RGBA), for the decoder's own
/// allocation bound.
const MAX_BYTES_PER_PIXEL: u64 = 8;

/// Headroom the decoder may allocate beyond the pixels (palettes, line buffers, metadata).
const DECODER_SLACK: u64 = 16 << 20;

/// Decodes an image file held in `bytes` to 8-bit RGB (see the module documentation). An
/// empty, truncated, corrupt or unsupported file, one with a zero side, or one with more pixels
/// than `limits` allows is an error; so is a panic inside the decoding library.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Rgb8Image> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode_bytes(bytes, limits)))
        .unwrap_or(Err(ImageError::DecoderPanicked))
}

fn decode_bytes(bytes: &[u8], limits: &Limits) -> Result<Rgb8Image> {
    if bytes.is_empty() {
        return Err(ImageError::Empty);
    }
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Corrupt(e.to_string()))?;
    let format = reader.format().ok_or(ImageError::UnknownFormat)?;
    if !matches!(
        format,
        ImageFormat::Png
            | ImageFormat::Jpeg
            | ImageFormat::WebP
            | ImageFormat::Gif
            | ImageFormat::Bmp
    ) {
        return Err(ImageError::UnsupportedFormat(format!("{format:?}")));
    }
    let mut bounds = image::Limits::default();
    bounds.max_alloc = Some(
        limits
            .max_pixels
            .saturating_mul(MAX_BYTES_PER_PIXEL)
            .saturating_add(DECODER_SLACK),
    );
    reader.limits(bounds);
    let mut decoder = reader.into_decoder().map_err(|e| from_image(e, format))?;
    let (width, height) = decoder.dimensions();
    if width == 0 || height == 0 {
        return Err(ImageError::ZeroSize { width, height });
    }
    let pixels = width as u64 * height as u64;
    if pixels > limits.max_pixels {
        return Err(ImageError::TooLarge {
            width,
            height,
            max_pixels: limits.max_pixels,
        });
    }
    // PIL's exif_transpose ignores an orientation it cannot read; so does this.
    let orientation = decoder
        .orientation()
        .unwrap_or(image::metadata::Orientation::NoTransforms);
    let mut decoded = DynamicImage::from_decoder(decoder).map_err(|e| from_image(e, format))?;
    decoded.apply_orientation(orientation);
    to_rgb8(decoded)
}

/// PIL's `convert("RGB")` of the mode PIL opens each layout as: 8-bit layouts drop alpha and
/// replicate grey; 16-bit colour and grey-with-alpha keep the high byte (PIL reads them as
/// `RGB;16B`, `RGBA;16B`, `LA;16B`); 16-bit grey without alpha is PIL's mode `I;16`, whose
/// conversion saturates at 255 instead.
fn to_rgb8(image: DynamicImage) -> Result<Rgb8Image> {
    let (width, height) = (image.width(), image.height());
    let pixels: Vec<u8> = match image {
        DynamicImage::ImageRgb8(b) => b.into_raw(),
        DynamicImage::ImageRgba8(b) => b.pixels().flat_map(|p| [p[0], p[1], p[2]]).collect(),
        DynamicImage::ImageLuma8(b) => b.pixels().flat_map(|p| [p[0]; 3]).collect(),
        DynamicImage::ImageLumaA8(b) => b.pixels().flat_map(|p| [p[0]; 3]).collect(),
        DynamicImage::ImageLuma16(b) => b.pixels().flat_map(|p| [p[0].min(255) as u8; 3]).collect(),
        DynamicImage::ImageLumaA16(b) => b.pixels().flat_map(|p| [(p[0] >> 8) as u8; 3]).collect(),
        DynamicImage::ImageRgb16(b) => b
            .pixels()
            .flat_map(|p| p.0.map(|v| (v >> 8) as u8))
            .collect(),
        DynamicImage::ImageRgba16(b) => b
            .pixels()
            .flat_map(|p| [p[0], p[1], p[2]].map(|v| (v >> 8) as u8))
            .collect(),
        other => other.to_rgb8().into_raw(),
    };
    Rgb8Image::new(width, height, pixels)
}

fn from_image(e: image::ImageError, format: ImageFormat) -> ImageError {
    use image::ImageError as E;
    match e {
        E::Limits(l) => ImageError::Limit(l.to_string()),
        E::Unsupported(u) => ImageError::UnsupportedFormat(format!("{format:?}: {u}")),
        other => ImageError::Corrupt(format!("{format:?}: {other}")),
    }
}
