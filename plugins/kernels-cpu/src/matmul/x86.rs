//! x86-64 dot-product kernels: AVX2 (`vpmaddubsw` + `vpmaddwd`), AVX-512 VNNI (`vpdpbusd` on
//! 256-bit vectors through AVX-512 VL) and 512-bit float kernels.
//!
//! The integer kernels are written once (`int_kernels!`) and stamped out per ISA with a
//! different `u8 × i8 → i32` primitive. Unsigned weight codes (Q4_0, Q4_1, Q5_0, k-quants, TQ2_0)
//! go straight into the unsigned operand; offsets (`q − 8`, `q − 32`, …) and minimums are applied
//! afterwards with the activation sums, as the scalar reference does.
//!
//! # Safety
//! Every `unsafe fn` here requires the CPU features in its `#[target_feature]` attribute and
//! slices of whole blocks (`w.len() == x.len() · block_bytes`); [`super::select`] guarantees both.

#![allow(clippy::missing_safety_doc)]

use crate::act::{Q8Block, Q8KBlock};
use crate::matmul::scalar::{self, half_to_f32, k_min_sum, k_scale_min};
use core::arch::x86_64::*;

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

/// The two f16 values at `p` (4 readable bytes) as f32 in lanes 0 and 1, zeros above. F16C
/// on a register loaded with `vmovd`, which clears the upper lanes, so there is no false
/// dependency (see [`f16c`]); exact, so equal to [`half_to_f32`].
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn half2(p: *const u8) -> __m128 {
    // SAFETY: the caller passes a pointer to four readable bytes.
    _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
        (p as *const i32).read_unaligned()
    }))
}

/// Prefetches into L1 the bytes of the next four rows after the four at `w` that block `bi` of
/// a rows kernel will need (`4·bb` bytes per block), one group ahead: the rows are consecutive,
/// so this runs one group ahead of the reads, whether this task or another takes those rows.
#[inline(always)]
fn prefetch_next(w: &[u8], stride: usize, bi: usize, bb: usize) {
    let next = w.as_ptr().wrapping_add(4 * stride + bi * 4 * bb);
    for off in (0..4 * bb).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address (computed with wrapping
        // arithmetic, so it may point past the weight without undefined behaviour).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off) as *const i8) };
    }
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

/// Byte `i` = 0xFF where bit `i` of `bits` is set (ggml's `bytes_from_bits_32`).
#[inline]
#[target_feature(enable = "avx2")]
fn bytes_from_bits_32(bits: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
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

/// The integer kernels, generic over `R` activation rows: each weight block is decoded once and
/// dotted with the same block of every row (prefill reuses the decode work; decode uses `R = 1`).
/// Per row the operations are those of the one-row kernel, so results do not depend on `R`.
macro_rules! int_kernels {
    ($feat:literal, $dot:ident, $dots:ident, $scales:ident) => {
        use super::*;

        /// Q8_0 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q8_0<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: see the module docs; every load stays inside its 34-byte block, and each
            // activation row holds one block per weight block.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                let nb = w.len() / 34;
                // Two blocks per step into two accumulator sets (the `h` loop unrolls, so the
                // indices are constants and everything stays in registers; a closure called per
                // block was not inlined and spilled the accumulators).
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let p = w.as_ptr().add((bi + h) * 34);
                            let wq = load(p.add(2));
                            let aw = _mm256_sign_epi8(wq, wq);
                            let d = f16c(p);
                            for r in 0..R {
                                let xb = xs[r].get_unchecked(bi + h);
                                let xq = _mm256_sign_epi8(load_i8(xb.qs.as_ptr()), wq);
                                let s = $dot(_mm256_setzero_si256(), aw, xq);
                                acc[r][h] = _mm256_fmadd_ps(
                                    _mm256_set1_ps(d * xb.d),
                                    _mm256_cvtepi32_ps(s),
                                    acc[r][h],
                                );
                            }
                        }
                    }
                    bi += 2;
                }
                core::array::from_fn(|r| hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])))
            }
        }

        /// Unpacks the 32 nibbles of 16 bytes: low nibbles → values 0–15, high → 16–31.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn nibbles(p: *const u8) -> __m256i {
            // SAFETY: the caller passes a pointer to 16 readable bytes.
            let raw = unsafe { _mm_loadu_si128(p as *const __m128i) };
            _mm256_and_si256(
                _mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw),
                _mm256_set1_epi8(0x0f),
            )
        }

        /// Shared loop of Q4_0/Q4_1/Q5_0: `Σ d_w·d_x·Σq·x` over blocks, plus `Σ off(b)·s_x`.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q32<const R: usize>(
            w: &[u8],
            xs: &[&[Q8Block]; R],
            bb: usize,
            codes: impl Fn(*const u8) -> __m256i,
            off: impl Fn(*const u8) -> f32,
            offset_sum: fn(&Q8Block) -> f32,
        ) -> [f32; R] {
            // SAFETY: see the module docs; `codes`/`off` read inside the block.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                let mut corr = [[0f32; 2]; R];
                let nb = w.len() / bb;
                // As in `q8_0`: two blocks per step, constant accumulator indices.
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let p = w.as_ptr().add((bi + h) * bb);
                            let q = codes(p);
                            let d = f16c(p);
                            let o = off(p);
                            for r in 0..R {
                                let xb = xs[r].get_unchecked(bi + h);
                                let s = $dot(_mm256_setzero_si256(), q, load_i8(xb.qs.as_ptr()));
                                acc[r][h] = _mm256_fmadd_ps(
                                    _mm256_set1_ps(d * xb.d),
                                    _mm256_cvtepi32_ps(s),
                                    acc[r][h],
                                );
                                corr[r][h] += o * offset_sum(xb);
                            }
                        }
                    }
                    bi += 2;
                }
                core::array::from_fn(|r| {
                    hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])) + (corr[r][0] + corr[r][1])
                })
            }
        }

        /// [`q32`] with four activation rows, per row and per lane the same operations in the
        /// same order (so the same result bit for bit as `R = 1`), with less work per row: the
        /// block scales come as one vector (`[d, off]` from `scales`, as in [`q32_rows`]), the
        /// four products `off·s_x` are one vector multiply over the four rows, and each row's
        /// `d·d_x` is a vector multiply by a broadcast load (no scalar multiply and shuffle).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q32_x4(
            w: &[u8],
            xs: &[&[Q8Block]; 4],
            bb: usize,
            codes: impl Fn(*const u8) -> __m256i,
            scales: impl Fn(*const u8) -> __m128,
            offset_sum: fn(&Q8Block) -> f32,
        ) -> [f32; 4] {
            // SAFETY: see the module docs; `codes`/`scales` read inside the block, and each
            // activation row holds one block per weight block.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                // Lane r: row r's `Σ off·s_x` for blocks of parity h.
                let mut corr = [_mm_setzero_ps(); 2];
                let nb = w.len() / bb;
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let b = bi + h;
                            let p = w.as_ptr().add(b * bb);
                            let q = codes(p);
                            let sc = scales(p);
                            let xb: [&Q8Block; 4] =
                                core::array::from_fn(|r| xs[r].get_unchecked(b));
                            let os = _mm_setr_ps(
                                offset_sum(xb[0]),
                                offset_sum(xb[1]),
                                offset_sum(xb[2]),
                                offset_sum(xb[3]),
                            );
                            // Lane r: off·s_x of row r, the one-row kernel's product.
                            let oo = _mm_mul_ps(_mm_permute_ps::<0b01_01_01_01>(sc), os);
                            corr[h] = _mm_add_ps(corr[h], oo);
                            let mut d = _mm256_broadcastss_ps(sc);
                            // Hide that `d` is a splat, or LLVM turns `d · splat(d_x)` back into
                            // a scalar multiply and a register broadcast per row instead of one
                            // multiply by a broadcast load.
                            core::arch::asm!(
                                "/* {0} */",
                                inout(ymm_reg) d,
                                options(pure, nomem, nostack, preserves_flags)
                            );
                            for r in 0..4 {
                                let xq = load_i8(xb[r].qs.as_ptr());
                                let s = $dot(_mm256_setzero_si256(), q, xq);
                                // d·d_x in every lane (a broadcast load, no shuffle).
                                let dr = _mm256_mul_ps(d, _mm256_set1_ps(xb[r].d));
                                acc[r][h] = _mm256_fmadd_ps(dr, _mm256_cvtepi32_ps(s), acc[r][h]);
                            }
                        }
                    }
                    bi += 2;
                }
                let c = _mm_add_ps(corr[0], corr[1]);
                let mut cs = [0f32; 4];
                _mm_storeu_ps(cs.as_mut_ptr(), c);
                core::array::from_fn(|r| hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])) + cs[r])
            }
        }

        /// Four weight rows (`stride` bytes apart from `w`) against one activation row:
        /// per row the operations of [`q32`] with `R = 1` (so the same result bit for bit), with
        /// the activation block loaded once for the four rows and the two block scales of a row
        /// (`[d, off]` from `scales`) converted and multiplied in one vector.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q32_rows(
            w: &[u8],
            stride: usize,
            x: &[Q8Block],
            bb: usize,
            codes: impl Fn(*const u8) -> __m256i,
            scales: impl Fn(*const u8) -> __m128,
            offset_sum: fn(&Q8Block) -> f32,
        ) -> [f32; 4] {
            // SAFETY: see the module docs; `w` holds four rows of `stride` bytes, each a whole
            // number of `bb`-byte blocks, and `x` one block per weight block.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                let mut corr = [[_mm_setzero_ps(); 2]; 4];
                let nb = stride / bb;
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let xb = x.get_unchecked(bi + h);
                            let xq = load_i8(xb.qs.as_ptr());
                            let xs = _mm_setr_ps(xb.d, offset_sum(xb), 0.0, 0.0);
                            prefetch_next(w, stride, bi + h, bb);
                            for r in 0..4 {
                                let p = w.as_ptr().add(r * stride + (bi + h) * bb);
                                // [d·d_x, off·s_x]: the two products of the one-row kernel.
                                let ds = _mm_mul_ps(scales(p), xs);
                                let s = $dot(_mm256_setzero_si256(), codes(p), xq);
                                acc[r][h] = _mm256_fmadd_ps(
                                    _mm256_broadcastss_ps(ds),
                                    _mm256_cvtepi32_ps(s),
                                    acc[r][h],
                                );
                                corr[r][h] = _mm_add_ps(corr[r][h], ds);
                            }
                        }
                    }
                    bi += 2;
                }
                core::array::from_fn(|r| {
                    let c = _mm_add_ps(corr[r][0], corr[r][1]);
                    hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])) + _mm_cvtss_f32(_mm_movehdup_ps(c))
                })
            }
        }

        /// Q8_0, four weight rows `stride` bytes apart against one activation row (the
        /// operations of [`q8_0`] with `R = 1` per row, so the same result bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q8_0_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: see the module docs and `q32_rows`.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                let nb = stride / 34;
                let mut bi = 0;
                while bi < nb {
                    for h in 0..2 {
                        if bi + h < nb {
                            let xb = x.get_unchecked(bi + h);
                            let xq = load_i8(xb.qs.as_ptr());
                            let xd = _mm_set_ss(xb.d);
                            prefetch_next(w, stride, bi + h, 34);
                            for r in 0..4 {
                                let p = w.as_ptr().add(r * stride + (bi + h) * 34);
                                let wq = load(p.add(2));
                                let aw = _mm256_sign_epi8(wq, wq);
                                let s = $dot(_mm256_setzero_si256(), aw, _mm256_sign_epi8(xq, wq));
                                let dd = _mm_mul_ss(half2(p), xd);
                                acc[r][h] = _mm256_fmadd_ps(
                                    _mm256_broadcastss_ps(dd),
                                    _mm256_cvtepi32_ps(s),
                                    acc[r][h],
                                );
                            }
                        }
                    }
                    bi += 2;
                }
                core::array::from_fn(|r| hsum_ps(_mm256_add_ps(acc[r][0], acc[r][1])))
            }
        }

        /// Q4_0, four weight rows (see `q32_rows`).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_0_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: 18-byte blocks: d at 0, nibbles at 2..18.
            unsafe {
                q32_rows(
                    w,
                    stride,
                    x,
                    18,
                    |p| nibbles(p.add(2)),
                    |p| {
                        let d = half2(p);
                        _mm_unpacklo_ps(d, _mm_mul_ss(_mm_set_ss(-8.0), d))
                    },
                    |b| b.s,
                )
            }
        }

        /// Q4_1, four weight rows (see `q32_rows`).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_1_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: 20-byte blocks: d at 0, m at 2 (converted together), nibbles at 4..20.
            unsafe {
                q32_rows(
                    w,
                    stride,
                    x,
                    20,
                    |p| nibbles(p.add(4)),
                    |p| half2(p),
                    |b| b.s1,
                )
            }
        }

        /// Q5_0, four weight rows (see `q32_rows`).
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_0_rows(w: &[u8], stride: usize, x: &[Q8Block]) -> [f32; 4] {
            // SAFETY: 22-byte blocks: d at 0, qh at 2..6, nibbles at 6..22.
            unsafe {
                q32_rows(
                    w,
                    stride,
                    x,
                    22,
                    |p| {
                        let qh = (p.add(2) as *const u32).read_unaligned();
                        let hi = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
                        _mm256_or_si256(nibbles(p.add(6)), hi)
                    },
                    |p| {
                        let d = half2(p);
                        _mm_unpacklo_ps(d, _mm_mul_ss(_mm_set_ss(-16.0), d))
                    },
                    |b| b.s,
                )
            }
        }

        /// Q4_0 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_0<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 18-byte blocks: d at 0, nibbles at 2..18.
            unsafe {
                if R == 4 {
                    let v = q32_x4(
                        w,
                        &core::array::from_fn(|r| xs[r]),
                        18,
                        |p| nibbles(p.add(2)),
                        |p| {
                            let d = half2(p);
                            _mm_unpacklo_ps(d, _mm_mul_ss(_mm_set_ss(-8.0), d))
                        },
                        |b| b.s,
                    );
                    return core::array::from_fn(|r| v[r]);
                }
                q32(
                    w,
                    xs,
                    18,
                    |p| nibbles(p.add(2)),
                    |p| -8.0 * f16c(p),
                    |b| b.s,
                )
            }
        }

        /// Q4_1 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_1<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 20-byte blocks: d at 0, m at 2, nibbles at 4..20.
            unsafe {
                if R == 4 {
                    let v = q32_x4(
                        w,
                        &core::array::from_fn(|r| xs[r]),
                        20,
                        |p| nibbles(p.add(4)),
                        |p| half2(p),
                        |b| b.s1,
                    );
                    return core::array::from_fn(|r| v[r]);
                }
                q32(
                    w,
                    xs,
                    20,
                    |p| nibbles(p.add(4)),
                    |p| f16c(p.add(2)),
                    |b| b.s1,
                )
            }
        }

        /// Q5_0 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_0<const R: usize>(w: &[u8], xs: &[&[Q8Block]; R]) -> [f32; R] {
            // SAFETY: 22-byte blocks: d at 0, qh at 2..6, nibbles at 6..22.
            unsafe {
                if R == 4 {
                    let v = q32_x4(
                        w,
                        &core::array::from_fn(|r| xs[r]),
                        22,
                        |p| {
                            let qh = (p.add(2) as *const u32).read_unaligned();
                            let hi =
                                _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
                            _mm256_or_si256(nibbles(p.add(6)), hi)
                        },
                        |p| {
                            let d = half2(p);
                            _mm_unpacklo_ps(d, _mm_mul_ss(_mm_set_ss(-16.0), d))
                        },
                        |b| b.s,
                    );
                    return core::array::from_fn(|r| v[r]);
                }
                q32(
                    w,
                    xs,
                    22,
                    |p| {
                        let qh = (p.add(2) as *const u32).read_unaligned();
                        let hi = _mm256_and_si256(bytes_from_bits_32(qh), _mm256_set1_epi8(0x10));
                        _mm256_or_si256(nibbles(p.add(6)), hi)
                    },
                    |p| -16.0 * f16c(p),
                    |b| b.s,
                )
            }
        }

        /// Q4_K weights (integer sums exact, so equal to the scalar kernel bit for bit).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_k<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 144-byte blocks: d, dmin, scales[12], qs[128].
            unsafe {
                let m4 = _mm256_set1_epi8(0x0f);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(144).enumerate() {
                    let p = b.as_ptr();
                    let (sc, mn) = k_scale_min(&b[4..16]);
                    let mut sumi = [_mm256_setzero_si256(); R];
                    for j in 0..4 {
                        let raw = load(p.add(16 + 32 * j));
                        let lo = _mm256_and_si256(raw, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
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

        /// Q6_K weights (bit-exact with the scalar kernel).
        #[target_feature(enable = $feat)]
        pub unsafe fn q6_k<const R: usize>(w: &[u8], xs: &[&[Q8KBlock]; R]) -> [f32; R] {
            // SAFETY: 210-byte blocks: ql[128], qh[64], scales[16], d.
            unsafe {
                let m4 = _mm256_set1_epi8(0x0f);
                let m2 = _mm256_set1_epi8(3);
                let mut acc = [0f32; R];
                for (bi, b) in w.chunks_exact(210).enumerate() {
                    let p = b.as_ptr();
                    let sc = &b[192..208];
                    let s = |g: usize| i32::from(sc[g] as i8);
                    let mut sumi = [_mm256_setzero_si256(); R];
                    for j in 0..2 {
                        let ql0 = load(p.add(64 * j));
                        let ql1 = load(p.add(64 * j + 32));
                        let qh = load(p.add(128 + 32 * j));
                        let lows = [
                            _mm256_and_si256(ql0, m4),
                            _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                        ];
                        let highs = [
                            _mm256_and_si256(qh, m2),
                            _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2),
                            _mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2),
                            _mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2),
                        ];
                        for g in 0..4 {
                            let q = _mm256_or_si256(lows[g], _mm256_slli_epi16::<4>(highs[g]));
                            let k = 8 * j + 2 * g;
                            let v = $scales(s(k), s(k + 1));
                            for r in 0..R {
                                let xq = xs[r].get_unchecked(bi).qs.as_ptr();
                                sumi[r] = $dots(sumi[r], q, load_i8(xq.add(128 * j + 32 * g)), v);
                            }
                        }
                    }
                    let d = f16c_tail(p.add(208));
                    for r in 0..R {
                        let xb = xs[r].get_unchecked(bi);
                        let sumb: i32 = (0..16).map(|g| s(g) * i32::from(xb.bsums[g])).sum();
                        let total = hsum_epi32(sumi[r]) - 32 * sumb;
                        acc[r] += (d * xb.d) * total as f32;
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

    /// f32 weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f32_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: `w` holds `x.len()` f32 values; loads stay below `x.len()`.
        unsafe {
            float_row(
                w,
                x,
                4,
                |p| _mm256_loadu_ps(p as *const f32),
                scalar::f32_row,
            )
        }
    }

    /// f16 weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as `f32_row`, two bytes per value.
        unsafe {
            float_row(
                w,
                x,
                2,
                |p| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                scalar::f16_row,
            )
        }
    }

    /// bf16 weights.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn bf16_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as `f32_row`, two bytes per value.
        unsafe {
            float_row(
                w,
                x,
                2,
                |p| {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                },
                scalar::bf16_row,
            )
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn float_row(
        w: &[u8],
        x: &[f32],
        esize: usize,
        ld: impl Fn(*const u8) -> __m256,
        tail: fn(&[u8], &[f32]) -> f32,
    ) -> f32 {
        // SAFETY: `w.len() == x.len() · esize`; vector loads only for full groups of 8.
        unsafe {
            let k = x.len();
            let wp = w.as_ptr();
            let xp = x.as_ptr();
            let mut a = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= k {
                for (u, acc) in a.iter_mut().enumerate() {
                    let o = i + 8 * u;
                    *acc = _mm256_fmadd_ps(ld(wp.add(o * esize)), _mm256_loadu_ps(xp.add(o)), *acc);
                }
                i += 32;
            }
            while i + 8 <= k {
                a[0] = _mm256_fmadd_ps(ld(wp.add(i * esize)), _mm256_loadu_ps(xp.add(i)), a[0]);
                i += 8;
            }
            let mut s = hsum_ps(_mm256_add_ps(
                _mm256_add_ps(a[0], a[1]),
                _mm256_add_ps(a[2], a[3]),
            ));
            s += tail(&w[i * esize..], &x[i..]);
            s
        }
    }
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

/// 512-bit float kernels.
pub mod avx512 {
    use super::*;

    /// f32 weights.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn f32_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: `w` holds `x.len()` f32 values.
        unsafe {
            float_row(
                w,
                x,
                4,
                |p| _mm512_loadu_ps(p as *const f32),
                scalar::f32_row,
            )
        }
    }

    /// f16 weights.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn f16_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as `f32_row`, two bytes per value.
        unsafe {
            float_row(
                w,
                x,
                2,
                |p| _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                scalar::f16_row,
            )
        }
    }

    /// bf16 weights.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub unsafe fn bf16_row(w: &[u8], x: &[f32]) -> f32 {
        // SAFETY: as `f32_row`, two bytes per value.
        unsafe {
            float_row(
                w,
                x,
                2,
                |p| {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
                },
                scalar::bf16_row,
            )
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    unsafe fn float_row(
        w: &[u8],
        x: &[f32],
        esize: usize,
        ld: impl Fn(*const u8) -> __m512,
        tail: fn(&[u8], &[f32]) -> f32,
    ) -> f32 {
        // SAFETY: `w.len() == x.len() · esize`; vector loads only for full groups of 16.
        unsafe {
            let k = x.len();
            let wp = w.as_ptr();
            let xp = x.as_ptr();
            let mut a = [_mm512_setzero_ps(); 4];
            let mut i = 0;
            while i + 64 <= k {
                for (u, acc) in a.iter_mut().enumerate() {
                    let o = i + 16 * u;
                    *acc = _mm512_fmadd_ps(ld(wp.add(o * esize)), _mm512_loadu_ps(xp.add(o)), *acc);
                }
                i += 64;
            }
            while i + 16 <= k {
                a[0] = _mm512_fmadd_ps(ld(wp.add(i * esize)), _mm512_loadu_ps(xp.add(i)), a[0]);
                i += 16;
            }
            let s = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
            _mm512_reduce_add_ps(s) + tail(&w[i * esize..], &x[i..])
        }
    }
}
