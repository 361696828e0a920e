//! `2^x` by range reduction and a polynomial, in scalar, AVX2 and AVX-512 lanes: the softmax
//! exponentials of [`crate::attention`] (scores are pre-scaled by `log2 e`, so
//! `e^s = 2^(s·log2 e)`) and the sigmoid of the SiLU activation ([`crate::ops::silu`]).
//!
//! `x = n + f` with `n = round(x)` and `f ∈ [−½, ½]`; `2^f` is a degree-6 polynomial (a minimax
//! fit of relative error 1.9e-9 on that interval, below half an f32 ulp) evaluated by Horner's
//! rule, and `2^n` is built in the exponent field. Over `x ∈ [−126, 127]` the result is within
//! 1.2 ulp of the exact value (see the tests: every path is compared with `f64::exp2` on a dense
//! sweep). Inputs below −126 (including −∞) give 0, where the exact result would be subnormal:
//! the largest value dropped is 2⁻¹²⁶ ≈ 1.2e-38, against softmax weights whose maximum is 1.
//! Inputs above 127 are clamped to 127. NaN gives 0 (masked scores never hold NaN).

/// Polynomial coefficients of `2^f` on `[−½, ½]`, constant term first (the fitted linear term
/// rounds to `ln 2`).
const C: [f32; 7] = [
    1.0,
    std::f32::consts::LN_2,
    0.240_226_47,
    0.055_503_29,
    0.009_618_489,
    0.001_339_993_1,
    0.000_153_458_12,
];

/// Adding and subtracting `1.5·2²³` rounds an f32 of magnitude < 2²² to the nearest integer.
const ROUND: f32 = 12_582_912.0;

/// `2^x` (see the module docs for the error bound and the clamping). Branch-free, so loops over
/// it vectorise.
#[inline(always)]
pub(crate) fn exp2(x: f32) -> f32 {
    // False for NaN too.
    let keep = x >= -126.0;
    let x = x.clamp(-126.0, 127.0);
    // `t`'s low mantissa bits hold round(x) in two's complement.
    let t = x + ROUND;
    let n = t - ROUND;
    let f = x - n;
    let mut p = C[6];
    for &c in C[..6].iter().rev() {
        p = p * f + c;
    }
    let e = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23;
    if keep { p * f32::from_bits(e) } else { 0.0 }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::C;
    use core::arch::x86_64::*;

    /// `2^x` in 8 lanes (see the module docs).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn exp2_avx2(x: __m256) -> __m256 {
        let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-126.0));
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-126.0)),
            _mm256_set1_ps(127.0),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm256_sub_ps(x, n);
        let mut p = _mm256_set1_ps(C[6]);
        for &c in C[..6].iter().rev() {
            p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
        }
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep)
    }

    /// `2^x` in 16 lanes (see the module docs).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(crate) fn exp2_avx512(x: __m512) -> __m512 {
        let keep = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(-126.0));
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-126.0)),
            _mm512_set1_ps(127.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut p = _mm512_set1_ps(C[6]);
        for &c in C[..6].iter().rev() {
            p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Error of `got` against `2^x` in units of the f32 spacing at the exact value.
    fn ulps(x: f32, got: f32) -> f64 {
        let exact = f64::from(x).exp2();
        let spacing = f64::from((exact as f32).next_up()) - f64::from(exact as f32);
        (f64::from(got) - exact).abs() / spacing
    }

    fn sweep() -> impl Iterator<Item = f32> {
        (0..=4_000_000).map(|i| -126.0 + 253.0 * i as f32 / 4_000_000.0)
    }

    fn check(name: &str, f: impl Fn(&[f32; 16]) -> [f32; 16]) {
        let xs: Vec<f32> = sweep().collect();
        let mut worst = 0f64;
        for chunk in xs.chunks(16) {
            let mut a = [0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let y = f(&a);
            for (&x, &v) in chunk.iter().zip(&y) {
                worst = worst.max(ulps(x, v));
            }
        }
        assert!(worst <= 1.5, "{name}: worst error {worst} ulp");
        let edge = f(&[
            f32::NEG_INFINITY,
            -1000.0,
            -126.5,
            f32::NAN,
            0.0,
            -0.0,
            -0.5,
            0.5,
            1.0,
            127.0,
            300.0,
            -125.9,
            -1.0,
            -2.0,
            -3.0,
            -64.0,
        ]);
        assert_eq!(&edge[..4], &[0.0; 4], "{name}");
        assert_eq!(&edge[4..6], &[1.0, 1.0], "{name}");
        assert_eq!(edge[8], 2.0, "{name}");
        assert_eq!(edge[10], edge[9], "{name}: clamped at 127");
        assert_eq!(&edge[12..], &[0.5, 0.25, 0.125, 2f32.powi(-64)], "{name}");
    }

    #[test]
    fn scalar_exp2_is_within_1_5_ulp() {
        check("scalar", |a| a.map(exp2));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_exp2_is_within_1_5_ulp() {
        use core::arch::x86_64::*;
        if crate::Isa::Avx2.is_available() {
            check("avx2", |a| {
                let mut out = [0f32; 16];
                // SAFETY: AVX2 and FMA are available; loads and stores stay inside the arrays.
                unsafe {
                    for h in 0..2 {
                        let y = x86::exp2_avx2(_mm256_loadu_ps(a.as_ptr().add(8 * h)));
                        _mm256_storeu_ps(out.as_mut_ptr().add(8 * h), y);
                    }
                }
                out
            });
        }
        if crate::Isa::Avx512.is_available() {
            check("avx512", |a| {
                let mut out = [0f32; 16];
                // SAFETY: AVX-512F is available; 16 lanes fit the arrays.
                unsafe {
                    let y = x86::exp2_avx512(_mm512_loadu_ps(a.as_ptr()));
                    _mm512_storeu_ps(out.as_mut_ptr(), y);
                }
                out
            });
        }
    }
}
