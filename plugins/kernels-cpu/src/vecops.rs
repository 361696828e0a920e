//! Small f32 vector helpers (dot, axpy, f16 → f32) used by attention and the dequantizing
//! matmul fallback, selected once per [`Isa`].

use crate::isa::Isa;
use u_sdk::quant::f16_to_f32;

/// Function pointers for one ISA. Calling them is safe: [`VecOps::new`] only hands out paths the
/// CPU supports, and each function checks nothing else.
#[derive(Clone, Copy, Debug)]
pub struct VecOps {
    dot: unsafe fn(&[f32], &[f32]) -> f32,
    axpy: unsafe fn(&mut [f32], f32, &[f32]),
    f16: unsafe fn(&[u8], &mut [f32]),
}

impl VecOps {
    /// The helpers for `isa` (which must be available on this CPU).
    pub fn new(isa: Isa) -> VecOps {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => VecOps {
                dot: x86::dot_avx2,
                axpy: x86::axpy_avx2,
                f16: x86::f16_avx2,
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Vnni => VecOps {
                dot: x86::dot_avx512,
                axpy: x86::axpy_avx512,
                f16: x86::f16_avx2,
            },
            // NEON is the aarch64 baseline, so the portable dot and axpy already compile to it.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon | Isa::NeonDot => VecOps {
                dot: dot_scalar,
                axpy: axpy_scalar,
                f16: crate::matmul::neon::float::f16_to_f32,
            },
            _ => VecOps {
                dot: dot_scalar,
                axpy: axpy_scalar,
                f16: f16_scalar,
            },
        }
    }

    /// `Σ a·b` over the shorter length.
    #[inline]
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        // SAFETY: the pointer was chosen for a supported ISA.
        unsafe { (self.dot)(a, b) }
    }

    /// `y += a·x` over the shorter length.
    #[inline]
    pub fn axpy(&self, y: &mut [f32], a: f32, x: &[f32]) {
        // SAFETY: as for `dot`.
        unsafe { (self.axpy)(y, a, x) }
    }

    /// Converts little-endian f16 values (`2·out.len()` bytes of `src`) to f32.
    #[inline]
    pub fn f16_to_f32(&self, src: &[u8], out: &mut [f32]) {
        // SAFETY: as for `dot`.
        unsafe { (self.f16)(src, out) }
    }
}

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn axpy_body(y: &mut [f32], a: f32, x: &[f32]) {
    for (v, &u) in y.iter_mut().zip(x) {
        *v += a * u;
    }
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

fn axpy_scalar(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_body(y, a, x)
}

fn f16_scalar(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        super::dot_body(a, b)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
        super::axpy_body(y, a, x)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        super::dot_body(a, b)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn axpy_avx512(y: &mut [f32], a: f32, x: &[f32]) {
        super::axpy_body(y, a, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_avx2(src: &[u8], out: &mut [f32]) {
        let n = out.len().min(src.len() / 2);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: 16 bytes at 2·i are inside `src`, 8 floats at i inside `out`.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        super::f16_scalar(&src[2 * i..2 * n], &mut out[i..n]);
    }
}
