//! Resize, centre crop, rescale and normalisation against transformers' slow image
//! processors, as `fixtures/gen_preprocess.py` reimplements them with PIL and numpy.
//!
//! Every case starts from an 8-bit PNG, whose decoding equals PIL's (tests/decode.rs), so the
//! resize sees the same bytes PIL did. The resized and cropped 8-bit image must equal PIL's
//! exactly (no tolerance); `pixel_values` must be within [`TOLERANCE`] of numpy's float32
//! values (they are equal to the bit in practice: the same operations in the same order).

mod common;

use common::{cases, f32s, read, spec};
use u_image::{Limits, decode, preprocess, resize_and_crop};

/// Largest difference of one `pixel_values` float from the reference.
const TOLERANCE: f32 = 1e-5;

#[test]
fn pixel_values_match_transformers() {
    let cases = cases();
    let mut worst = 0f32;
    let mut count = 0;
    for case in cases["cases"].as_array().expect("cases") {
        let image = case["image"].as_str().expect("image");
        let spec_name = case["spec"].as_str().expect("spec");
        let spec = spec(&cases["specs"][spec_name]);
        let what = format!("{image} with {spec_name}");
        let img = decode(&read(&format!("images/{image}")), &Limits::default())
            .unwrap_or_else(|e| panic!("{what}: {e}"));

        let crop = resize_and_crop(&img, &spec).unwrap_or_else(|e| panic!("{what}: {e}"));
        let want = decode(
            &read(case["crop"].as_str().expect("crop")),
            &Limits::default(),
        )
        .expect("expected crop");
        assert_eq!(
            (crop.width(), crop.height()),
            (spec.width, spec.height),
            "{what}: size"
        );
        let off: Vec<usize> = (0..want.pixels().len())
            .filter(|&i| crop.pixels()[i] != want.pixels()[i])
            .collect();
        assert!(
            off.is_empty(),
            "{what}: {} of {} resized values differ from PIL's, first at {} ({} vs {})",
            off.len(),
            want.pixels().len(),
            off[0],
            crop.pixels()[off[0]],
            want.pixels()[off[0]]
        );

        let values = preprocess(&img, &spec).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(values.len(), 3 * spec.height as usize * spec.width as usize);
        let stride = case["stride"].as_u64().expect("stride") as usize;
        let expected = f32s(&read(case["pixel_values"].as_str().expect("values")));
        assert_eq!(expected.len(), values.len().div_ceil(stride), "{what}");
        for (i, want) in expected.iter().enumerate() {
            let got = values[i * stride];
            let diff = (got - want).abs();
            worst = worst.max(diff);
            assert!(
                diff <= TOLERANCE,
                "{what}: value {} is {got}, not {want}",
                i * stride
            );
        }
        count += 1;
    }
    eprintln!("{count} cases, largest pixel_values difference {worst:e}");
    assert!(count >= 20, "{count} cases");
}

#[test]
fn resize_equals_pils_for_many_sizes() {
    let cases = cases();
    let mut sources = std::collections::HashMap::new();
    let mut count = 0;
    for case in cases["resize_sweep"].as_array().expect("resize_sweep") {
        let image = case["image"].as_str().expect("image");
        let img = sources.entry(image.to_owned()).or_insert_with(|| {
            decode(&read(&format!("images/{image}")), &Limits::default()).expect("source")
        });
        let (w, h) = (
            case["width"].as_u64().expect("width") as u32,
            case["height"].as_u64().expect("height") as u32,
        );
        let filter = case["resample"].as_str().expect("resample");
        let resample = match filter {
            "nearest" => u_sdk::abi::model::Resample::Nearest,
            "bilinear" => u_sdk::abi::model::Resample::Bilinear,
            _ => u_sdk::abi::model::Resample::Bicubic,
        };
        let out = u_image::resize(img, w, h, resample).expect("resize");
        assert_eq!(
            common::fnv1a64(out.pixels()),
            case["fnv1a64"].as_str().expect("hash"),
            "{image} to {w}×{h} with {filter}: not PIL's bytes"
        );
        count += 1;
    }
    assert!(count >= 200, "{count} resizes");
}
