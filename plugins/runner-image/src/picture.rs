//! Pictures in and out: an initial image decoded and normalised to [−1, 1] as diffusers'
//! `VaeImageProcessor.preprocess` does, and the generated pixels written as a PNG file, rounded
//! to 8 bits as `numpy_to_pil` rounds them.

use image::ImageEncoder;
use u_image::{Limits, Rgb8Image};
use u_sdk::{Resample, UError};

fn invalid(why: String) -> UError {
    UError::invalid(format!("runner-image: {why}"))
}

/// An image file (PNG, JPEG, WebP, GIF, BMP) of at most `max_pixels` pixels, decoded.
pub fn decode(bytes: &[u8], max_pixels: u64) -> u_sdk::Result<Rgb8Image> {
    u_image::decode(bytes, &Limits { max_pixels })
        .map_err(|e| invalid(format!("the initial image: {e}")))
}

/// `image` as `[3, height, width]` values in [−1, 1] (`2 · v/255 − 1`), resized to
/// `width × height` first when it is another size (bicubic; diffusers resizes with Lanczos).
pub fn normalised(image: &Rgb8Image, (width, height): (u32, u32)) -> u_sdk::Result<Vec<f32>> {
    let resized;
    let image = match (image.width(), image.height()) == (width, height) {
        true => image,
        false => {
            resized = u_image::resize(image, width, height, Resample::Bicubic)
                .map_err(|e| invalid(format!("resizing the initial image: {e}")))?;
            &resized
        }
    };
    let plane = (width * height) as usize;
    let mut out = vec![0f32; 3 * plane];
    for (i, rgb) in image.pixels().chunks_exact(3).enumerate() {
        for (c, &v) in rgb.iter().enumerate() {
            out[c * plane + i] = f32::from(v) / 255.0 * 2.0 - 1.0;
        }
    }
    Ok(out)
}

/// 8-bit RGB of `pixels` (`[3, height, width]` in [0, 1]): `round(v · 255)`, ties to even.
pub fn to_rgb8(pixels: &[f32], (width, height): (u32, u32)) -> Vec<u8> {
    let plane = (width * height) as usize;
    let mut rgb = vec![0u8; 3 * plane];
    for (i, px) in rgb.chunks_exact_mut(3).enumerate() {
        for (c, v) in px.iter_mut().enumerate() {
            *v = (pixels[c * plane + i] * 255.0)
                .round_ties_even()
                .clamp(0.0, 255.0) as u8;
        }
    }
    rgb
}

/// The grey level of `rgb` (`[3, height, width]`): the channels' mean.
pub fn grey(rgb: &[f32]) -> Vec<f32> {
    let plane = rgb.len() / 3;
    (0..plane)
        .map(|i| (rgb[i] + rgb[plane + i] + rgb[2 * plane + i]) / 3.0)
        .collect()
}

/// 16-bit grey of `pixels` (`[height, width]` in [0, 1]): `round(v · 65535)`, ties to even,
/// in the machine's byte order (the PNG encoder's input).
pub fn to_grey16(pixels: &[f32]) -> Vec<u8> {
    pixels
        .iter()
        .flat_map(|v| ((v * 65535.0).round_ties_even().clamp(0.0, 65535.0) as u16).to_ne_bytes())
        .collect()
}

/// `pixels` (`[channels, height, width]` in [0, 1]; 3 channels: 8-bit RGB, 1: 16-bit grey)
/// as a PNG file.
pub fn png(pixels: &[f32], channels: u32, (width, height): (u32, u32)) -> u_sdk::Result<Vec<u8>> {
    let (bytes, color) = match channels {
        1 => (to_grey16(pixels), image::ExtendedColorType::L16),
        _ => (
            to_rgb8(pixels, (width, height)),
            image::ExtendedColorType::Rgb8,
        ),
    };
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&bytes, width, height, color)
        .map_err(|e| UError::new(u_sdk::ErrorKind::Internal, format!("writing a PNG: {e}")))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_png_decodes_to_the_pixels_it_was_made_from() {
        let (w, h) = (5, 3);
        let pixels: Vec<f32> = (0..3 * w * h).map(|i| i as f32 / 44.0).collect();
        let file = png(&pixels, 3, (w as u32, h as u32)).unwrap();
        let back = decode(&file, 1 << 20).unwrap();
        assert_eq!((back.width(), back.height()), (5, 3));
        assert_eq!(back.pixels(), to_rgb8(&pixels, (5, 3)).as_slice());
        // 0.5 · 255 = 127.5 rounds to even, as NumPy rounds.
        assert_eq!(to_rgb8(&[0.5, 0.5, 0.5], (1, 1)), [128, 128, 128]);
        assert_eq!(to_rgb8(&[1.5 / 255.0; 3], (1, 1)), [2, 2, 2]);
        let norm = normalised(&back, (5, 3)).unwrap();
        assert_eq!(norm[0], f32::from(back.pixels()[0]) / 255.0 * 2.0 - 1.0);
        assert!(
            decode(&file, 14).is_err(),
            "15 pixels are over a limit of 14"
        );
    }

    #[test]
    fn a_grey_png_keeps_sixteen_bits() {
        let pixels = [0.0, 0.5, 1.0, 1.0 / 65535.0, 0.25, 2.0];
        let file = png(&pixels, 1, (3, 2)).unwrap();
        let back = image::load_from_memory(&file).unwrap();
        assert_eq!(back.color(), image::ColorType::L16);
        let levels: Vec<u16> = back.to_luma16().into_raw();
        assert_eq!(levels, [0, 32768, 65535, 1, 16384, 65535]);
        assert_eq!(grey(&[0.0, 1.0, 0.3, 0.6, 0.6, 0.9]), [0.3, 2.5 / 3.0]);
    }
}
