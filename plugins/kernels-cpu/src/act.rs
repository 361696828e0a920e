//! On-the-fly int8 quantization of activations for integer dot products.
//!
//! Two internal block formats (never stored, never crossing the ABI):
//! - [`Q8Block`]: 32 values, for weights in 32-value blocks (Q8_0, Q4_0, Q4_1, Q5_0). Its scale
//!   `d` is rounded to f16 exactly as ggml's `block_q8_0`/`block_q8_1` store it, so products
//!   match llama.cpp's; `s` holds `d · Σq` (the `q − 8`/`q − 16` offset term of Q4_0/Q5_0) and
//!   `s1` holds ggml's Q8_1 sum `f16(d_f32 · Σq)` (the minimum term of Q4_1).
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
    /// `f16(d_f32 · Σ qs)` with the unrounded scale, as ggml's `block_q8_1` stores it.
    pub s1: f32,
    /// `Σ qs` (exact; lets a kernel offset signed weights into the unsigned operand).
    pub sum: i32,
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

/// Quantizes `x` (a whole number of 32-value blocks) into `out` (AVX2 where the CPU has it; the
/// same blocks bit for bit either way).
pub fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected just above.
        return unsafe { x86::quantize_q8(x, out) };
    }
    quantize_q8_portable(x, out);
}

/// [`quantize_q8`] in portable Rust: the reference every SIMD form must equal.
pub fn quantize_q8_portable(x: &[f32], out: &mut [Q8Block]) {
    for (xb, ob) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in ob.qs.iter_mut().zip(xb) {
            let r = round_even(v * id) as i32;
            *q = r as i8;
            sum += r;
        }
        finish_q8(ob, amax, sum);
    }
}

/// Sets a block's scale and sums from its `amax` and `Σ qs`.
#[inline(always)]
fn finish_q8(ob: &mut Q8Block, amax: f32, sum: i32) {
    let d = amax / 127.0;
    let d16 = round_to_f16(d);
    ob.d = d16;
    ob.s = d16 * sum as f32;
    ob.s1 = round_to_f16(d * sum as f32);
    ob.sum = sum;
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Q8Block, Q8KBlock, finish_q8};
    use core::arch::x86_64::*;

    /// The sum of the eight i32 lanes of `v`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum_epi32(v: __m256i) -> i32 {
        let t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b0100_1110>(t));
        _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b1011_0001>(t)))
    }

    /// [`super::quantize_q8k`]: `vcvtps2dq` rounds to nearest even as the portable code does.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_q8k(x: &[f32], out: &mut [Q8KBlock]) {
        let sign = _mm256_set1_ps(-0.0);
        for (xb, ob) in x.chunks_exact(256).zip(out.iter_mut()) {
            // SAFETY: 32 loads of 8 values inside the 256-value block.
            let v: [__m256; 32] =
                core::array::from_fn(|i| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * i)) });
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for x in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *x));
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            for c in 0..8 {
                let q: [__m256i; 4] =
                    core::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[4 * c + i], id)));
                ob.bsums[2 * c] = hsum_epi32(_mm256_add_epi32(q[0], q[1])) as i16;
                ob.bsums[2 * c + 1] = hsum_epi32(_mm256_add_epi32(q[2], q[3])) as i16;
                let p = _mm256_packs_epi16(
                    _mm256_packs_epi32(q[0], q[1]),
                    _mm256_packs_epi32(q[2], q[3]),
                );
                let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                // SAFETY: bytes 32c..32c + 32 of the 256 codes.
                unsafe { _mm256_storeu_si256(ob.qs.as_mut_ptr().add(32 * c) as *mut __m256i, p) };
            }
            ob.d = amax / 127.0;
        }
    }

    /// [`super::quantize_q8`] with AVX2: the same operations per value (IEEE multiply, then
    /// round half to even, which `vcvtps2dq` does in the default rounding mode).
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_q8(x: &[f32], out: &mut [Q8Block]) {
        let sign = _mm256_set1_ps(-0.0);
        for (xb, ob) in x.chunks_exact(32).zip(out.iter_mut()) {
            // SAFETY: `xb` holds 32 values.
            let v: [__m256; 4] =
                core::array::from_fn(|i| unsafe { _mm256_loadu_ps(xb.as_ptr().add(8 * i)) });
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let q = v.map(|v| _mm256_cvtps_epi32(_mm256_mul_ps(v, id)));
            let t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b0100_1110>(t));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32::<0b1011_0001>(t)));
            // Packing interleaves the 128-bit lanes; the permute restores value order.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            // SAFETY: `qs` holds 32 bytes.
            unsafe { _mm256_storeu_si256(ob.qs.as_mut_ptr() as *mut __m256i, p) };
            finish_q8(ob, amax, sum);
        }
    }
}

/// Rounds `x` to the nearest f16 value (ties to even, overflow to infinity), as f32.
pub fn round_to_f16(x: f32) -> f32 {
    u_sdk::quant::f16_to_f32(f32_to_f16_bits(x))
}

/// IEEE binary16 bits of `x`, rounded to nearest even (what F16C's `vcvtps2ph` produces).
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let f = x.to_bits();
    let sign = ((f >> 16) & 0x8000) as u16;
    let a = f & 0x7fff_ffff;
    if a >= 0x7f80_0000 {
        // Infinity stays infinity; NaN becomes a quiet NaN.
        return sign | if a > 0x7f80_0000 { 0x7e00 } else { 0x7c00 };
    }
    if a >= 0x477f_f000 {
        // 65520 and above round to infinity.
        return sign | 0x7c00;
    }
    if a < 0x3880_0000 {
        // Below 2⁻¹⁴: an f16 subnormal (or zero) counting units of 2⁻²⁴. Scaling by 2²⁴ is
        // exact, and rounding to an integer is the f16 rounding; 1024 encodes the smallest
        // normal, as it should.
        let units = round_even(f32::from_bits(a) * 16_777_216.0) as u16;
        return sign | units;
    }
    // Normal: round the 13 dropped mantissa bits to nearest even, then rebias 127 → 15.
    let rounded = a + 0x0fff + ((a >> 13) & 1);
    sign | ((rounded - 0x3800_0000) >> 13) as u16
}

/// Quantizes `x` (a whole number of 256-value blocks) into `out` (AVX2 where the CPU has it:
/// the same blocks bit for bit).
pub fn quantize_q8k(x: &[f32], out: &mut [Q8KBlock]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { x86::quantize_q8k(x, out) };
    }
    quantize_q8k_portable(x, out);
}

/// [`quantize_q8k`] in portable code.
pub fn quantize_q8k_portable(x: &[f32], out: &mut [Q8KBlock]) {
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
    #[cfg(target_arch = "x86_64")]
    fn f16_rounding_matches_the_hardware_conversion() {
        if !std::is_x86_feature_detected!("f16c") {
            return;
        }
        #[target_feature(enable = "f16c")]
        unsafe fn hw(x: f32) -> u16 {
            use std::arch::x86_64::*;
            _mm_extract_epi16::<0>(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set1_ps(x))) as u16
        }
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            65504.0,
            65519.0,
            65520.0,
            1e-8,
            5.96e-8,
            2.98e-8,
            6.1e-5,
            6.103_515_6e-5,
            f32::INFINITY,
            f32::MIN_POSITIVE,
            1e30,
        ];
        let randoms = (0..200_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f32::from_bits(state as u32 & 0xbfff_ffff)
        });
        for x in specials.into_iter().chain(randoms).filter(|x| !x.is_nan()) {
            // SAFETY: F16C was detected above.
            let want = unsafe { hw(x) };
            assert_eq!(f32_to_f16_bits(x), want, "{x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn simd_quantization_equals_the_portable_one_bit_for_bit() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut x: Vec<f32> = (0..32 * 64)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let v = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                v * [1e-3, 1.0, 37.0, 1e4][i / 32 % 4]
            })
            .collect();
        x[64..96].fill(0.0);
        x[96] = 1e-30;
        // Values that land exactly on .5 steps: round half to even must agree.
        for (i, v) in x[128..160].iter_mut().enumerate() {
            *v = i as f32 - 15.5;
        }
        let (mut a, mut b) = (vec![Q8Block::default(); 64], vec![Q8Block::default(); 64]);
        quantize_q8(&x, &mut a);
        quantize_q8_portable(&x, &mut b);
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(a.qs, b.qs, "block {i}");
            assert_eq!(
                (a.d.to_bits(), a.s.to_bits(), a.s1.to_bits(), a.sum),
                (b.d.to_bits(), b.s.to_bits(), b.s1.to_bits(), b.sum),
                "block {i}"
            );
        }
    }

    #[test]
    fn simd_k_quantization_equals_the_portable_one_bit_for_bit() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut x: Vec<f32> = (0..256 * 8)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let v = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                v * [1e-3, 1.0, 37.0, 1e4][i / 256 % 4]
            })
            .collect();
        x[256..512].fill(0.0);
        x[512] = 1e-30;
        // 127 · v / 127 lands on whole and half steps: round half to even must agree.
        for (i, v) in x[1024..1280].iter_mut().enumerate() {
            *v = (i as f32 - 127.0) / 2.0;
        }
        let (mut a, mut b) = (vec![Q8KBlock::default(); 8], vec![Q8KBlock::default(); 8]);
        quantize_q8k(&x, &mut a);
        quantize_q8k_portable(&x, &mut b);
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(a.qs, b.qs, "block {i}");
            assert_eq!(a.bsums, b.bsums, "block {i}");
            assert_eq!(a.d.to_bits(), b.d.to_bits(), "block {i}");
        }
    }

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
            assert_eq!(round_to_f16(blk.d), blk.d, "scale is an f16 value");
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
