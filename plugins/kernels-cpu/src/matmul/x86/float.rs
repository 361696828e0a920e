//! Tile kernels for float weights (f32, f16, bf16) against f32 activations: five (AVX-512) or
//! four (AVX2) weight rows against up to five (AVX-512) or two (AVX2) activation rows, one
//! vector accumulator per pair, lanes along `k`; a call takes up to [`HEIGHT`] rows, a group at
//! a time over each block of `k`.
//!
//! Why: a one-row dot product loads a weight vector and an activation vector for every FMA; in
//! a 5 × 5 tile each loaded (and converted) weight vector serves five activation rows and each
//! activation vector five weight rows, so prefill runs on FMAs instead of loads and f16
//! conversions (the loads set the pace here: 2 × 12 tiles ran at 0.6× of 4 × 6, 5 × 5 at about
//! 1.1×, and widening f16 rows to f32 once per call, fewer conversions but twice the bytes,
//! at 0.65×); blocking `k` keeps the activations in L1 while the weights stream past them.
//! Decode (one activation row) runs the same kernel with a chain per weight row.
//!
//! Every output is one accumulator over `k` in vector steps, reduced, plus the scalar tail of
//! the last `k mod lanes` values, whatever the tile shape, so a row's result never depends on
//! its batch neighbours.
//!
//! # Safety
//! As for [`super::tile`]: the features of the `#[target_feature]` attribute, `w` holding
//! `rows` (1–[`HEIGHT`]) rows of `stride` bytes (`k` values each), `x` holding `m` rows of `k` values,
//! `y` writable at `c·ldy + r` for `c < m`, `r < rows`.

use super::*;

/// Weight rows per call (the tile height [`crate::matmul`] hands out; a multiple of both
/// tile heights).
pub const HEIGHT: usize = 40;

/// Values of `k` per block: five activation rows' block of f32 (20 KiB) stays in L1.
const K_BLOCK: usize = 1024;

/// The kernels for one vector width: `$v` the vector type, `$lanes` its f32 lanes, `$rows`
/// weight rows and `$width` activation rows per tile, `$fma`/`$loadx`/`$zero` its FMA, f32 load and zero, `$sum` its
/// horizontal sum.
macro_rules! float_tiles {
    ($feat:literal, $v:ty, $lanes:literal, $rows:literal, $width:literal, $fma:ident, $loadx:ident, $zero:ident,
     $sum:expr, $f16:expr, $bf16:expr) => {
        use super::*;

        /// `C` activation rows from `x` (row stride `k`) against the weight rows `p` (up to
        /// [`HEIGHT`], the last one repeated past `rows`), each loaded by `ld`, in groups of
        /// `$rows`; stores the `rows × C` results. `k` is walked in blocks of [`K_BLOCK`] values,
        /// every group of rows in turn over each block, so the activations' block stays in L1
        /// while the weights stream past it (the accumulators wait in memory between blocks:
        /// each still adds its products in the order of `k`).
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile<const C: usize>(
            p: &[*const u8; HEIGHT],
            esize: usize,
            k: usize,
            x: *const f32,
            y: *mut f32,
            ldy: usize,
            rows: usize,
            ld: impl Fn(*const u8) -> $v,
            tail: fn(&[u8], &[f32]) -> f32,
        ) {
            // SAFETY: see the module docs; vector loads only for whole groups of `$lanes`.
            unsafe {
                let groups = rows.div_ceil($rows);
                let mut acc = [[[$zero(); C]; $rows]; HEIGHT / $rows];
                let kv = k - k % $lanes;
                let mut k0 = 0;
                while k0 < kv {
                    let k1 = (k0 + K_BLOCK).min(kv);
                    for (g, acc) in acc.iter_mut().enumerate().take(groups) {
                        let pg = &p[$rows * g..$rows * (g + 1)];
                        // The rows read after these: the next group's, or the first group's
                        // next block.
                        let (after, skip) = if g + 1 < groups {
                            (&p[$rows * (g + 1)..$rows * (g + 2)], 0)
                        } else {
                            (&p[..$rows], K_BLOCK)
                        };
                        let mut a = *acc;
                        let mut i = k0;
                        while i < k1 {
                            if (i * esize).is_multiple_of(64) {
                                for &row in after {
                                    let ahead = row.wrapping_add((i + skip) * esize);
                                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                                }
                            }
                            let w: [$v; $rows] = core::array::from_fn(|r| ld(pg[r].add(i * esize)));
                            for c in 0..C {
                                let xv = $loadx(x.add(c * k + i));
                                for r in 0..$rows {
                                    a[r][c] = $fma(w[r], xv, a[r][c]);
                                }
                            }
                            i += $lanes;
                        }
                        *acc = a;
                    }
                    k0 = k1;
                }
                for r in 0..rows {
                    let wt = core::slice::from_raw_parts(p[r].add(kv * esize), (k - kv) * esize);
                    for c in 0..C {
                        let xt = core::slice::from_raw_parts(x.add(c * k + kv), k - kv);
                        *y.add(c * ldy + r) = $sum(acc[r / $rows][r % $rows][c]) + tail(wt, xt);
                    }
                }
            }
        }

        /// Every activation row through [`tile`], `$width` at a time.
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn sweep(
            (w, stride, esize): (&[u8], usize, usize),
            rows: usize,
            x: &[f32],
            m: usize,
            y: *mut f32,
            ldy: usize,
            ld: impl Fn(*const u8) -> $v + Copy,
            tail: fn(&[u8], &[f32]) -> f32,
        ) {
            let k = stride / esize;
            let p: [*const u8; HEIGHT] =
                core::array::from_fn(|r| w.as_ptr().wrapping_add(r.min(rows - 1) * stride));
            // SAFETY: see the module docs.
            unsafe {
                let mut c0 = 0;
                while c0 < m {
                    let cw = (m - c0).min($width);
                    let (xc, yc) = (x.as_ptr().add(c0 * k), y.add(c0 * ldy));
                    macro_rules! go {
                        ($c:literal) => {
                            tile::<$c>(&p, esize, k, xc, yc, ldy, rows, ld, tail)
                        };
                    }
                    match cw {
                        1 => go!(1),
                        2 => go!(2),
                        3 if $width > 2 => go!(3),
                        4 if $width > 2 => go!(4),
                        5 if $width > 4 => go!(5),
                        _ => unreachable!("tile width {cw} > {}", $width),
                    }
                    c0 += cw;
                }
            }
        }

        /// f32 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn f32(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[f32],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let ld = |p: *const u8| {
                // SAFETY: `$lanes` f32 values inside the row.
                unsafe { $loadx(p as *const f32) }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 4), rows, x, m, y, ldy, ld, scalar::f32_row) }
        }

        /// f16 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn f16(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[f32],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let ld = |p: *const u8| {
                // SAFETY: `$lanes` f16 values inside the row.
                unsafe { $f16(p) }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 2), rows, x, m, y, ldy, ld, scalar::f16_row) }
        }

        /// bf16 weights.
        #[target_feature(enable = $feat)]
        pub unsafe fn bf16(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[f32],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let ld = |p: *const u8| {
                // SAFETY: `$lanes` bf16 values inside the row.
                unsafe { $bf16(p) }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 2), rows, x, m, y, ldy, ld, scalar::bf16_row) }
        }
    };
}

/// AVX2 float tiles (eight lanes; 4 × 2 accumulators fit the 16 vector registers).
pub mod avx2 {
    float_tiles!(
        "avx2,fma,f16c",
        __m256,
        8,
        4,
        2,
        _mm256_fmadd_ps,
        _mm256_loadu_ps,
        _mm256_setzero_ps,
        hsum_ps,
        |p: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        |p: *const u8| {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    );
}

/// AVX-512 float tiles (sixteen lanes; 5 × 5 accumulators of the 32 vector registers).
pub mod avx512 {
    float_tiles!(
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl",
        __m512,
        16,
        5,
        5,
        _mm512_fmadd_ps,
        _mm512_loadu_ps,
        _mm512_setzero_ps,
        _mm512_reduce_add_ps,
        |p: *const u8| _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
        |p: *const u8| {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        }
    );
}
