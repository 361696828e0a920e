//! x86-64 dot-product kernels: AVX2 (`vpmaddubsw` + `vpmaddwd`), AVX-512 VNNI (`vpdpbusd` on
//! 256-bit vectors through AVX-512 VL), and float tiles ([`float`]).
//!
//! Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K run as eight-row tiles ([`tile`]); on VNNI every one of them
//! runs as sixteen-row tiles in 512-bit vectors with several activation rows ([`tile16`]), and
//! Q4_K and Q6_K decode (one activation row) reads whole super-blocks into 512-bit vectors
//! ([`row`]). Q5_K and TQ2_0 are
//! written once (`int_kernels!`) and stamped out per ISA with a different `u8 × i8 → i32`
//! primitive: unsigned weight codes go straight into the unsigned operand; offsets and minimums
//! are applied afterwards with the activation sums, as the scalar reference does.
//!
//! # Safety
//! Every `unsafe fn` here requires the CPU features in its `#[target_feature]` attribute and
//! slices of whole blocks (`w.len() == x.len() · block_bytes`); [`super::select`] guarantees both.

#![allow(clippy::missing_safety_doc)]

use crate::act::{Q8Block, Q8KBlock};
use crate::matmul::scalar::{self, half_to_f32, k_min_sum, k_scale_min};
use core::arch::x86_64::*;

pub mod float;
pub mod row;
pub mod tile;
pub mod tile16;

/// The f16 at `p` as f32, converted in general-purpose registers ([`half_to_f32`]). F16C is
/// avoided on purpose here: for one value LLVM lowers the load to `vpinsrw` into whatever vector
/// register is free, often a live accumulator, and that false dependency serialised the whole
/// block loop (Q4_0 ran 2–3× slower).
#[inline(always)]
unsafe fn f16c(p: *const u8) -> f32 {
    // SAFETY: the caller passes a pointer to two readable bytes.
    half_to_f32(unsafe { (p as *const u16).read_unaligned() })
}

/// [`f16c`] for an f16 in the last two bytes of a block (same thing; kept for call-site clarity).
#[inline(always)]
unsafe fn f16c_tail(p: *const u8) -> f32 {
    // SAFETY: as for `f16c`.
    unsafe { f16c(p) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum_ps(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2")]
fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b0100_1110>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b1011_0001>(s));
    _mm_cvtsi128_si32(s)
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const u8) -> __m256i {
    // SAFETY: the caller passes a pointer to 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_i8(p: *const i8) -> __m256i {
    // SAFETY: the caller passes a pointer to 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// `acc + Σ pairs(u·s)` in eight i32 lanes, AVX2 (`u` ≤ 255 unsigned, `s` signed; the pair sums
/// stay below 2¹⁵ for every caller: weight codes ≤ 63 or |w| ≤ 128 against |x| ≤ 127).
#[inline]
#[target_feature(enable = "avx2")]
fn dot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
    )
}

/// Scale vector for [`dots_avx2`]: `lo` for values 0–15, `hi` for 16–31 (i16 lanes).
#[inline]
#[target_feature(enable = "avx2")]
fn scales_avx2(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// As [`dot_avx2`], each value's product scaled by its lane of `sc` ([`scales_avx2`]).
#[inline]
#[target_feature(enable = "avx2")]
fn dots_avx2(acc: __m256i, u: __m256i, s: __m256i, sc: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc))
}

/// `acc + Σ quads(u·s)` through `vpdpbusd`.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
fn dot_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

/// `acc + Σ pairs(a·b)` of i16 pairs into i32 lanes (`vpmaddwd` + add).
#[inline]
#[target_feature(enable = "avx2")]
fn dotw_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
}

/// A per-lane integer scale in the two forms the ISAs use: i32 lanes, and the same value in
/// both i16 halves of each lane (for `vpmaddwd`).
#[derive(Clone, Copy)]
struct Scale {
    /// The scale in i32 lanes.
    wide: __m256i,
    /// The scale in both i16 halves of each i32 lane.
    pair: __m256i,
}

impl Scale {
    /// Both forms of `wide` (values within i16).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn new(wide: __m256i) -> Scale {
        let lo = _mm256_and_si256(wide, _mm256_set1_epi32(0xffff));
        Scale {
            wide,
            pair: _mm256_or_si256(lo, _mm256_slli_epi32::<16>(wide)),
        }
    }
}

/// `Σ_g u(g)·s(g)` (four-byte dots per i32 lane) over `N` groups, times `scale` per lane when
/// given; VNNI: `vpdpbusd` in two chains (`K` unused: no intermediate can overflow).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
unsafe fn groups_vnni<const N: usize, const K: usize>(
    u: impl Fn(usize) -> __m256i,
    s: impl Fn(usize) -> __m256i,
    scale: Option<&Scale>,
) -> __m256i {
    let mut acc = [_mm256_setzero_si256(); 2];
    for g in 0..N {
        acc[g % 2] = _mm256_dpbusd_epi32(acc[g % 2], u(g), s(g));
    }
    let t = _mm256_add_epi32(acc[0], acc[1]);
    scale.map_or(t, |sc| _mm256_mullo_epi32(t, sc.wide))
}

/// [`groups_vnni`] on AVX2: `K` groups' `vpmaddubsw` pair sums are added as i16 (callers keep
/// `K·2·max_code·127 < 2¹⁵`: `K` = 8 for 4-bit codes, 4 for 5-bit, 2 for 6-bit) and widened
/// once by `vpmaddwd` — with ones, or with the scale's i16 pair, which also applies it —
/// instead of a widening per group.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn groups_avx2<const N: usize, const K: usize>(
    u: impl Fn(usize) -> __m256i,
    s: impl Fn(usize) -> __m256i,
    scale: Option<&Scale>,
) -> __m256i {
    let w = scale.map_or(_mm256_set1_epi16(1), |sc| sc.pair);
    let mut acc = _mm256_setzero_si256();
    for g0 in (0..N).step_by(K) {
        let mut t = _mm256_maddubs_epi16(u(g0), s(g0));
        for g in g0 + 1..g0 + K {
            t = _mm256_add_epi16(t, _mm256_maddubs_epi16(u(g), s(g)));
        }
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(t, w));
    }
    acc
}

/// Scale vector for [`dots_vnni`] (i32 lanes: lanes 0–3 cover values 0–15).
#[inline]
#[target_feature(enable = "avx2")]
fn scales_vnni(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi32(hi), _mm_set1_epi32(lo))
}

/// As [`dot_vnni`], scaled per lane by `sc` ([`scales_vnni`]).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
fn dots_vnni(acc: __m256i, u: __m256i, s: __m256i, sc: __m256i) -> __m256i {
    let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
    _mm256_add_epi32(acc, _mm256_mullo_epi32(p, sc))
}

/// The 256-value block kernels, generic over `R` activation rows: each weight block is decoded
/// once and dotted with the same block of every row (prefill reuses the decode work; decode uses
/// `R = 1`).
/// Per row the operations are those of the one-row kernel, so results do not depend on `R`.
macro_rules! int_kernels {
    ($feat:literal, $dot:ident, $dots:ident, $scales:ident) => {
        use super::*;

        /// Q5_K weights (bit-exact with the scalar kernel).
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_k<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 176-byte blocks: d, dmin, scales[12], qh[32], qs[128].
            unsafe {
                let m4 = _mm256_set1_epi8(0x0f);
                let one = _mm256_set1_epi8(1);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(176).enumerate() {
                    let p = b.as_ptr();
                    let (sc, mn) = k_scale_min(&b[4..16]);
                    let mut qh = load(p.add(16));
                    let mut sumi = [_mm256_setzero_si256(); R];
                    for j in 0..4 {
                        let raw = load(p.add(48 + 32 * j));
                        let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, one));
                        qh = _mm256_srli_epi16::<1>(qh);
                        let h1 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, one));
                        qh = _mm256_srli_epi16::<1>(qh);
                        let lo = _mm256_or_si256(_mm256_and_si256(raw, m4), h0);
                        let hi =
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4), h1);
                        let (s0, s1) = (i32::from(sc[2 * j]), i32::from(sc[2 * j + 1]));
                        let (v0, v1) = ($scales(s0, s0), $scales(s1, s1));
                        for r in 0..R {
                            let xq = xs[r].get_unchecked(bi).qs.as_ptr();
                            sumi[r] = $dots(sumi[r], lo, load_i8(xq.add(64 * j)), v0);
                            sumi[r] = $dots(sumi[r], hi, load_i8(xq.add(64 * j + 32)), v1);
                        }
                    }
                    let (d, dmin) = (f16c(p), f16c(p.add(2)));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let summ = k_min_sum(&mn, &xb.bsums);
                        acc[r] += xb.d * (d * hsum_epi32(sumi[r]) as f32 - dmin * summ as f32);
                    }
                }
                acc
            }
        }

        /// TQ2_0 weights (bit-exact with the scalar kernel).
        #[target_feature(enable = $feat)]
        pub unsafe fn tq2_0<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 66-byte blocks: qs[64], d.
            unsafe {
                let m2 = _mm256_set1_epi8(3);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(66).enumerate() {
                    let p = b.as_ptr();
                    let mut sumi = [_mm256_setzero_si256(); R];
                    for j in 0..2 {
                        let raw = load(p.add(32 * j));
                        let qs = [
                            _mm256_and_si256(raw, m2),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(raw), m2),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m2),
                            _mm256_and_si256(_mm256_srli_epi16::<6>(raw), m2),
                        ];
                        for (s, q) in qs.into_iter().enumerate() {
                            for r in 0..R {
                                let xq = xs[r].get_unchecked(bi).qs.as_ptr();
                                sumi[r] = $dot(sumi[r], q, load_i8(xq.add(128 * j + 32 * s)));
                            }
                        }
                    }
                    let d = f16c_tail(p.add(64));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let sumx: i32 = xb.bsums.iter().map(|&v| i32::from(v)).sum();
                        acc[r] += (d * xb.d) * (hsum_epi32(sumi[r]) - sumx) as f32;
                    }
                }
                acc
            }
        }
    };
}

/// AVX2 + FMA + F16C integer kernels.
pub mod avx2 {
    int_kernels!("avx2,fma,f16c", dot_avx2, dots_avx2, scales_avx2);
}

/// AVX-512 VNNI integer kernels (256-bit `vpdpbusd` via AVX-512 VL).
pub mod vnni {
    int_kernels!(
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        dot_vnni,
        dots_vnni,
        scales_vnni
    );
}
