//! Fuzzes image decoding (PNG, JPEG, WebP, GIF, BMP through the `image` crate, EXIF
//! orientation, conversion to RGB) and preprocessing of what decodes (every resampling filter,
//! a shortest-edge resize with a centre crop and a direct resize): any bytes give pixels or
//! an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_image::{Limits, decode, preprocess};
use u_sdk::abi::model::{ImageSpec, Resample};

/// Small enough that every input is quick to decode and resize.
const LIMITS: Limits = Limits {
    max_pixels: 1 << 20,
};

fuzz_target!(|data: &[u8]| {
    // libfuzzer-sys's panic hook aborts on any panic, even one `decode` catches and turns into
    // an error: a silent hook lets the crate's guard work (a panic escaping the target still
    // aborts through libfuzzer-sys's own catch_unwind).
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| std::panic::set_hook(Box::new(|_| {})));

    let Ok(img) = decode(data, &LIMITS) else {
        return;
    };
    // The last byte picks the filter and the shape of the spec.
    let pick = data.last().copied().unwrap_or(0);
    let resample = match pick % 3 {
        0 => Resample::Nearest,
        1 => Resample::Bilinear,
        _ => Resample::Bicubic,
    };
    let spec = ImageSpec {
        channels: 3,
        height: 16 + u32::from(pick >> 4),
        width: 12 + u32::from(pick & 0x0f),
        rows: 0,
        shortest_edge: if pick & 0x08 != 0 { 0 } else { 20 },
        resample,
        rescale: 1.0 / 255.0,
        mean: [0.5; 3],
        std: [0.5; 3],
    };
    if let Ok(values) = preprocess(&img, &spec) {
        assert_eq!(values.len(), 3 * spec.height as usize * spec.width as usize);
        assert!(values.iter().all(|v| v.is_finite()));
    }
});
