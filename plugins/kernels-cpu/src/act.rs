//! On-the-fly int8 quantization of activations for integer dot products.
//!
//! Two internal block formats (never stored, never crossing the ABI, so both keep an exact `f32`
//! scale rather than ggml's f16):
//! - [`Q8Block`]: 32 values, for weights in 32-value blocks (Q8_0, Q4_0, Q4_1, Q5_0). `s` holds
//!   `d · Σq`, so offset formats (`q − 8`, `d·q + m`) cost one multiply per block.
//! - [`Q8KBlock`]: 256 values with the sum of every 16 values (`bsums`), for k-quants and TQ2_0,
//!   whose minimums and offsets are then applied per sub-block with integer sums.
//!
//! Values are quantized symmetrically to `[-127, 127]` (never −128, so sign tricks and
//! `vpmaddubsw` cannot saturate): `d = amax / 127`, `q = round_half_even(x · 127 / amax)`. Every
//! ISA produces bit-identical blocks (the rounding is the same IEEE operation everywhere).

/// 32 int8 activations with their scale and scaled sum.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Q8Block {
    /// Scale: value ≈ `d · q`.
    pub d: f32,
    /// `d · Σ qs`.
    pub s: f32,
    /// Quantized values.
    pub qs: [i8; 32],
}

/// 256 int8 activations with their scale and the sums of each run of 16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Q8KBlock {
    /// Scale: value ≈ `d · q`.
    pub d: f32,
    /// Quantized values.
    pub qs: [i8; 256],
    /// `Σ qs[16·i .. 16·i + 16]`.
    pub bsums: [i16; 16],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Q8KBlock {
            d: 0.0,
            qs: [0; 256],
            bsums: [0; 16],
        }
    }
}

/// Rounds half to even for |v| < 2²², identically to `vroundps` with the default mode.
#[inline(always)]
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³
    (v + MAGIC) - MAGIC
}

/// Quantizes `x` (a whole number of 32-value blocks) into `out`.
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            let r = round_even(v * id) as i32;
            *q = r as i8;
            sum += r;
        }
        ob.d = d;
        ob.s = d * sum as f32;
    }
}

/// Quantizes `x` (a whole number of 256-value blocks) into `out`.
pub fn quantize_q8k(x: &[f32], out: &mut [Q8KBlock]) {
    for (xb, ob) in x.chunks_exact(256).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            *q = round_even(v * id) as i8;
        }
        for (s, g) in ob.bsums.iter_mut().zip(ob.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| i16::from(q)).sum();
        }
        ob.d = amax / 127.0;
    }
}

/// Dequantizes activation blocks back to `f32` (the exact values the integer kernels see).
pub fn dequantize_q8(blocks: &[Q8Block]) -> Vec<f32> {
    blocks
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| b.d * f32::from(q)))
        .collect()
}

/// Dequantizes 256-value activation blocks back to `f32`.
pub fn dequantize_q8k(blocks: &[Q8KBlock]) -> Vec<f32> {
    blocks
        .iter()
        .flat_map(|b| b.qs.iter().map(move |&q| b.d * f32::from(q)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantization_error_is_at_most_half_a_step_and_never_minus_128() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 13.0)
            .collect();
        let mut b = vec![Q8Block::default(); 16];
        quantize_q8(&x, &mut b);
        for (v, q) in x.iter().zip(dequantize_q8(&b)) {
            assert!((v - q).abs() <= 0.5001 * b[0].d.max(b[15].d).max(1.0));
        }
        for blk in &b {
            assert!(blk.qs.iter().all(|&q| q != -128));
            let s: i32 = blk.qs.iter().map(|&q| i32::from(q)).sum();
            assert_eq!(blk.s, blk.d * s as f32);
        }
        let mut k = vec![Q8KBlock::default(); 2];
        quantize_q8k(&x, &mut k);
        for (blk, xb) in k.iter().zip(x.chunks(256)) {
            for (&q, &v) in blk.qs.iter().zip(xb) {
                assert!((v - blk.d * f32::from(q)).abs() <= 0.5001 * blk.d);
                assert_ne!(q, -128);
            }
            for (g, &s) in blk.bsums.iter().enumerate() {
                let want: i16 = blk.qs[16 * g..16 * g + 16]
                    .iter()
                    .map(|&q| i16::from(q))
                    .sum();
                assert_eq!(s, want);
            }
        }
        // All zeros: scale 0, codes 0, no NaN.
        let mut z = vec![Q8Block::default(); 1];
        quantize_q8(&[0.0; 32], &mut z);
        assert_eq!((z[0].d, z[0].s), (0.0, 0.0));
    }
}
