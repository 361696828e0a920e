//! Int8 KV: symmetric quantization in groups of [`GROUP`] values with one `f32` scale each.
//!
//! `scale = max|x| / 127`, `q = round(x / scale)`, so `|x − q·scale| ≤ scale / 2 = max|x| / 254`
//! for every value of a group.

/// Values per group (the SDK's [`u_sdk::KV_INT8_GROUP`]).
pub const GROUP: usize = u_sdk::KV_INT8_GROUP as usize;

/// Quantizes one token's row: `q.len() == src.len()`, `scales.len() == ⌈src.len() / GROUP⌉`.
pub fn quantize_row(src: &[f32], q: &mut [i8], scales: &mut [f32]) {
    for ((x, q), s) in src
        .chunks(GROUP)
        .zip(q.chunks_mut(GROUP))
        .zip(scales.iter_mut())
    {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        *s = scale;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        for (d, &v) in q.iter_mut().zip(x) {
            *d = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
}

/// The round trip of `src` through int8 (what an int8 page hands back).
pub fn round_trip(src: &[f32], row: usize) -> Vec<f32> {
    let groups = row.div_ceil(GROUP);
    let tokens = src.len() / row;
    let mut q = vec![0i8; src.len()];
    let mut s = vec![0f32; tokens * groups];
    for t in 0..tokens {
        quantize_row(
            &src[t * row..(t + 1) * row],
            &mut q[t * row..(t + 1) * row],
            &mut s[t * groups..(t + 1) * groups],
        );
    }
    u_sdk::dequantize_i8(&q, &s, tokens as u32)
}
