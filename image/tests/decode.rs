//! Decoding against PIL (`load_image`: open, `exif_transpose`, `convert("RGB")`), from the
//! references `fixtures/gen_preprocess.py` wrote, and the refusals of bad input.
//!
//! Lossless formats (PNG of every colour type and depth written, GIF, BMP, lossless WebP, EXIF
//! orientations) must give PIL's bytes exactly (compared by an FNV-1a hash of the RGB bytes).
//! Lossy formats are decoded by different libraries (JPEG: zune-jpeg here, libjpeg-turbo in
//! PIL; lossy WebP: image-webp here, libwebp in PIL), whose IDCT, chroma upsampling and
//! YUV→RGB rounding differ: their pixels are compared within [`LOSSY_MAX`] levels each and a
//! mean absolute difference under [`LOSSY_MEAN`] (measured with Pillow 13.0.0: JPEG at most 4
//! levels off, mean 0.42, 70–98% of values equal; lossy WebP equal).

mod common;

use common::{cases, fnv1a64, read};
use u_image::{ImageError, Limits, decode};

/// Largest difference of one lossy-decoded value from PIL's, in 8-bit levels.
const LOSSY_MAX: u8 = 5;
/// Largest mean absolute difference of a lossy-decoded image from PIL's, in levels.
const LOSSY_MEAN: f64 = 0.6;

#[test]
fn lossless_formats_decode_to_pils_bytes() {
    let cases = cases();
    let refs = cases["decode"].as_object().expect("decode");
    let mut checked = 0;
    for (name, want) in refs {
        if want.get("rgb").is_some() {
            continue;
        }
        let img = decode(&read(&format!("images/{name}")), &Limits::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            (img.width() as u64, img.height() as u64),
            (
                want["width"].as_u64().expect("width"),
                want["height"].as_u64().expect("height")
            ),
            "{name}: size"
        );
        assert_eq!(
            fnv1a64(img.pixels()),
            want["fnv1a64"].as_str().expect("hash"),
            "{name}: pixels differ from PIL's"
        );
        checked += 1;
    }
    assert!(checked >= 15, "{checked} lossless files checked");
}

#[test]
fn lossy_formats_decode_close_to_pil() {
    let cases = cases();
    let refs = cases["decode"].as_object().expect("decode");
    let mut checked = 0;
    for (name, want) in refs {
        let Some(rgb) = want.get("rgb") else { continue };
        let expected = read(rgb.as_str().expect("path"));
        let img = decode(&read(&format!("images/{name}")), &Limits::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            (img.width() as u64, img.height() as u64),
            (
                want["width"].as_u64().expect("width"),
                want["height"].as_u64().expect("height")
            ),
            "{name}: size (orientation applied?)"
        );
        let diffs: Vec<u8> = img
            .pixels()
            .iter()
            .zip(&expected)
            .map(|(a, b)| a.abs_diff(*b))
            .collect();
        let max = diffs.iter().copied().max().unwrap_or(0);
        let mean = diffs.iter().map(|&d| f64::from(d)).sum::<f64>() / diffs.len() as f64;
        let exact = diffs.iter().filter(|&&d| d == 0).count() as f64 / diffs.len() as f64;
        eprintln!(
            "{name}: max {max}, mean {mean:.3}, {:.1}% exact",
            exact * 100.0
        );
        assert!(
            max <= LOSSY_MAX && mean < LOSSY_MEAN,
            "{name}: max {max}, mean {mean}"
        );
        checked += 1;
    }
    assert!(checked >= 4, "{checked} lossy files checked");
}

/// CRC-32 (PNG's), to write chunks by hand.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(kind: &[u8; 4], data: &[u8]) -> Vec<u8> {
    let mut out = (data.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let mut covered = kind.to_vec();
    covered.extend_from_slice(data);
    out.extend_from_slice(&crc32(&covered).to_be_bytes());
    out
}

/// A PNG whose header states `width × height` 8-bit RGB, with `idat` as its only data.
fn png_claiming(width: u32, height: u32, idat: &[u8]) -> Vec<u8> {
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IDAT", idat));
    png.extend(chunk(b"IEND", &[]));
    png
}

#[test]
fn empty_input_is_refused() {
    assert_eq!(decode(&[], &Limits::default()), Err(ImageError::Empty));
}

#[test]
fn random_bytes_are_not_an_image() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    assert_eq!(
        decode(&bytes, &Limits::default()),
        Err(ImageError::UnknownFormat)
    );
}

#[test]
fn truncated_files_are_errors() {
    for name in [
        "rgb_50x37.png",
        "rgb_50x37.jpg",
        "palette_30x20.gif",
        "rgb_20x10.bmp",
        "rgb_32x24_lossless.webp",
    ] {
        let bytes = read(&format!("images/{name}"));
        for keep in [8, bytes.len() / 3, bytes.len() / 2, bytes.len() - 20] {
            let got = decode(&bytes[..keep], &Limits::default());
            // A JPEG cut short may still decode what it holds (as libjpeg does, padding the
            // rest); every other format must say the file is damaged.
            if name.ends_with(".jpg") && got.is_ok() {
                continue;
            }
            let err = got.expect_err(&format!("{name} cut to {keep} bytes decoded"));
            assert!(
                matches!(
                    err,
                    ImageError::Corrupt(_)
                        | ImageError::UnknownFormat
                        | ImageError::DecoderPanicked
                ),
                "{name} cut to {keep}: {err}"
            );
        }
    }
}

#[test]
fn huge_header_is_refused_before_decoding() {
    // 10^10 pixels claimed by a 60-byte file: refused from the header, nothing allocated.
    let png = png_claiming(
        100_000,
        100_000,
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    );
    let err = decode(&png, &Limits::default()).expect_err("decoded 10^10 pixels");
    assert!(
        matches!(
            err,
            ImageError::TooLarge {
                width: 100_000,
                height: 100_000,
                ..
            } | ImageError::Limit(_)
        ),
        "{err}"
    );
}

#[test]
fn pixel_limit_is_configurable() {
    let bytes = read("images/rgb_50x37.png");
    let exact = Limits {
        max_pixels: 50 * 37,
    };
    assert!(decode(&bytes, &exact).is_ok());
    let under = Limits {
        max_pixels: 50 * 37 - 1,
    };
    assert_eq!(
        decode(&bytes, &under),
        Err(ImageError::TooLarge {
            width: 50,
            height: 37,
            max_pixels: 50 * 37 - 1
        })
    );
}

#[test]
fn zero_size_is_refused() {
    for (w, h) in [(0, 10), (10, 0), (0, 0)] {
        let png = png_claiming(w, h, &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
        let err = decode(&png, &Limits::default()).expect_err("zero-size image decoded");
        assert!(
            matches!(err, ImageError::ZeroSize { .. } | ImageError::Corrupt(_)),
            "{w}×{h}: {err}"
        );
    }
    // A BMP header stating a width of 0.
    let mut bmp = read("images/rgb_20x10.bmp");
    bmp[18..22].copy_from_slice(&0u32.to_le_bytes());
    assert!(decode(&bmp, &Limits::default()).is_err());
}

#[test]
fn unsupported_format_is_named() {
    // A TIFF header: recognised by its magic bytes, not decoded here.
    let tiff = b"II*\0\x08\0\0\0\0\0";
    assert!(matches!(
        decode(tiff, &Limits::default()),
        Err(ImageError::UnsupportedFormat(_))
    ));
}
