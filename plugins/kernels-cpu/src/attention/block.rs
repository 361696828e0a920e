//! The inner step of [`super`]: [`R`] query rows against one key/value tile, in scalar, AVX2 or
//! AVX-512 lanes.
//!
//! For rows `r` with visible tile columns `[a_r, b_r)`:
//!
//! 1. scores `s[r][j] = q_r · k_j` from the transposed key tile (`kᵀ[c][j]`): each step
//!    broadcasts one query element and multiplies it into a run of key columns, so every key
//!    vector loaded serves all `R` rows and no horizontal sums are needed; with a soft cap,
//!    `s ← c · tanh(s / c)` over each row's visible columns;
//! 2. online softmax per row, in base 2 (queries are pre-scaled by `scale·log2 e`):
//!    `m' = max(m, max_j s)`, `c = 2^(m−m')`, `p_j = 2^(s_j−m')` over the row's columns (0
//!    outside them), `l' = c·l + Σ p`;
//! 3. `o_r ← c_r·o_r + Σ_j p[r][j]·v_j`, again one value vector loaded per key for all rows.
//!
//! The same source is expanded once per instruction set by `block_kernel!`, over a handful of
//! lane operations (`load`, `fmadd`, `exp2`, …) each module defines for its vector type.

use super::K_TILE as KT;
use crate::isa::Isa;

/// Query rows per block.
pub(super) const R: usize = 4;

/// One block's operands. `o` and `q` hold [`R`] rows even when the task has fewer (padding rows
/// have empty ranges and are left as they are).
pub(super) struct Block<'a> {
    /// `R` query rows of `d` values, pre-scaled by `scale·log2 e`.
    pub q: &'a [f32],
    /// Head dimension.
    pub d: usize,
    /// Transposed key tile: `kt[c·K_TILE + j]` is element `c` of the tile's key `j`.
    pub kt: &'a [f32],
    /// Value rows: key `j` of the tile starts at `v[j·v_stride]` and has `dp` readable values.
    pub v: &'a [f32],
    /// Distance between value rows.
    pub v_stride: usize,
    /// Row length of `o` (and of the values read): `d` rounded up to [`Kernel::pad`].
    pub dp: usize,
    /// Visible tile columns `[a, b)` per row (empty when `a ≥ b`).
    pub ranges: [(usize, usize); R],
    /// Soft cap of the (base-2) scores, `s ← c · tanh(s / c)`; 0 = none.
    pub softcap: f32,
    /// Running maximum per row (base-2 scores).
    pub m: &'a mut [f32],
    /// Running normaliser per row.
    pub l: &'a mut [f32],
    /// Unnormalised output rows, `R × dp`.
    pub o: &'a mut [f32],
}

impl Block<'_> {
    /// Checks every bound the kernels index by and returns the union `[lo, hi)` of the rows'
    /// ranges (`lo ≥ hi` when all are empty).
    fn check(&self, pad: usize) -> (usize, usize) {
        let (mut lo, mut hi) = (KT, 0);
        for &(a, b) in &self.ranges {
            if a < b {
                assert!(b <= KT, "attention block: range past the tile");
                lo = lo.min(a);
                hi = hi.max(b);
            }
        }
        assert!(
            self.q.len() >= R * self.d
                && self.kt.len() >= self.d * KT
                && self.o.len() >= R * self.dp
                && self.m.len() >= R
                && self.l.len() >= R
                && self.dp.is_multiple_of(pad)
                && self.dp >= self.d,
            "attention block: operands too short"
        );
        if lo < hi {
            assert!(
                (hi - 1) * self.v_stride + self.dp <= self.v.len(),
                "attention block: value rows too short"
            );
        }
        (lo, hi)
    }
}

/// A block kernel and the padding of `dp` it needs.
#[derive(Clone, Copy)]
pub(super) struct Kernel {
    run: unsafe fn(&mut Block<'_>),
    transpose: unsafe fn(&[f32], usize, usize, usize, &mut [f32]),
    /// `dp` must be a multiple of this (the lanes of one P·V column run).
    pub pad: usize,
}

impl Kernel {
    /// The kernel for `isa` (which must be available on this CPU).
    pub fn new(isa: Isa) -> Kernel {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Kernel {
                run: avx2::block,
                transpose: x86::transpose_avx2,
                pad: avx2::PAD,
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Vnni => Kernel {
                run: avx512::block,
                transpose: x86::transpose_avx2,
                pad: avx512::PAD,
            },
            _ => Kernel {
                run: scalar::block,
                transpose: transpose_scalar,
                pad: scalar::PAD,
            },
        }
    }

    /// Runs the block step (see the module docs).
    #[inline]
    pub fn run(&self, b: &mut Block<'_>) {
        // SAFETY: `new` picks a kernel only for an ISA this CPU has (`Isa` values come from
        // detection or `CpuKernels::with_isa`, which checks); bounds are checked inside.
        unsafe { (self.run)(b) }
    }

    /// Writes keys `j < n` (row `j` at `src[j·stride..][..d]`) transposed into `kt`:
    /// `kt[c·K_TILE + j] = src[j·stride + c]`.
    #[inline]
    pub fn transpose(&self, src: &[f32], stride: usize, n: usize, d: usize, kt: &mut [f32]) {
        assert!(
            n <= KT && kt.len() >= d * KT && (n == 0 || (n - 1) * stride + d <= src.len()),
            "attention transpose: operands too short"
        );
        // SAFETY: as for `run`; the bounds the kernels index by are checked above.
        unsafe { (self.transpose)(src, stride, n, d, kt) }
    }
}

/// The portable [`Kernel::transpose`] (bounds checked there): groups of 8 keys, so each
/// transposed row is written 8 values at a time.
fn transpose_scalar(src: &[f32], stride: usize, n: usize, d: usize, kt: &mut [f32]) {
    let j8 = n / 8 * 8;
    for j0 in (0..j8).step_by(8) {
        let rows: [&[f32]; 8] = std::array::from_fn(|i| &src[(j0 + i) * stride..][..d]);
        for (c, dst) in kt.chunks_exact_mut(KT).take(d).enumerate() {
            for (i, y) in dst[j0..j0 + 8].iter_mut().enumerate() {
                *y = rows[i][c];
            }
        }
    }
    transpose_rest(src, stride, n, d, kt, j8, d);
}

/// The part of [`Kernel::transpose`] outside the first `j0` keys × `c0` dims.
fn transpose_rest(
    src: &[f32],
    stride: usize,
    n: usize,
    d: usize,
    kt: &mut [f32],
    j0: usize,
    c0: usize,
) {
    if j0 >= n && c0 >= d {
        return;
    }
    for j in 0..n {
        let row = &src[j * stride..][..d];
        let from = if j < j0 { c0 } else { 0 };
        for (c, &x) in row.iter().enumerate().skip(from) {
            kt[c * KT + j] = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::KT;
    use core::arch::x86_64::*;

    /// [`super::Kernel::transpose`] in 8 × 8 blocks (24 shuffles each), the rest scalar.
    ///
    /// # Safety
    /// AVX2 must be available; the bounds of `Kernel::transpose` must hold.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn transpose_avx2(
        src: &[f32],
        stride: usize,
        n: usize,
        d: usize,
        kt: &mut [f32],
    ) {
        let (j8, c8) = (n / 8 * 8, d / 8 * 8);
        let (s, t) = (src.as_ptr(), kt.as_mut_ptr());
        for j0 in (0..j8).step_by(8) {
            for c0 in (0..c8).step_by(8) {
                // SAFETY: rows j0..j0+8 < n and columns c0..c0+8 ≤ d are inside `src`; rows
                // c0..c0+8 < d of `kt` hold KT ≥ j0 + 8 values (bounds checked by the caller).
                unsafe {
                    let r: [__m256; 8] =
                        std::array::from_fn(|i| _mm256_loadu_ps(s.add((j0 + i) * stride + c0)));
                    let a0 = _mm256_unpacklo_ps(r[0], r[1]);
                    let a1 = _mm256_unpackhi_ps(r[0], r[1]);
                    let a2 = _mm256_unpacklo_ps(r[2], r[3]);
                    let a3 = _mm256_unpackhi_ps(r[2], r[3]);
                    let a4 = _mm256_unpacklo_ps(r[4], r[5]);
                    let a5 = _mm256_unpackhi_ps(r[4], r[5]);
                    let a6 = _mm256_unpacklo_ps(r[6], r[7]);
                    let a7 = _mm256_unpackhi_ps(r[6], r[7]);
                    let b0 = _mm256_shuffle_ps::<0x44>(a0, a2);
                    let b1 = _mm256_shuffle_ps::<0xee>(a0, a2);
                    let b2 = _mm256_shuffle_ps::<0x44>(a1, a3);
                    let b3 = _mm256_shuffle_ps::<0xee>(a1, a3);
                    let b4 = _mm256_shuffle_ps::<0x44>(a4, a6);
                    let b5 = _mm256_shuffle_ps::<0xee>(a4, a6);
                    let b6 = _mm256_shuffle_ps::<0x44>(a5, a7);
                    let b7 = _mm256_shuffle_ps::<0xee>(a5, a7);
                    let cols = [
                        _mm256_permute2f128_ps::<0x20>(b0, b4),
                        _mm256_permute2f128_ps::<0x20>(b1, b5),
                        _mm256_permute2f128_ps::<0x20>(b2, b6),
                        _mm256_permute2f128_ps::<0x20>(b3, b7),
                        _mm256_permute2f128_ps::<0x31>(b0, b4),
                        _mm256_permute2f128_ps::<0x31>(b1, b5),
                        _mm256_permute2f128_ps::<0x31>(b2, b6),
                        _mm256_permute2f128_ps::<0x31>(b3, b7),
                    ];
                    for (i, &col) in cols.iter().enumerate() {
                        _mm256_storeu_ps(t.add((c0 + i) * KT + j0), col);
                    }
                }
            }
        }
        // Keys j8..n (all dims) and dims c8..d of keys 0..j8.
        super::transpose_rest(src, stride, n, d, kt, j8, c8);
    }
}

/// Expands `block` for a module defining `V` (a vector of `L` f32 lanes), `W` (key vectors per
/// score run), `PW` (value vectors per output run) and the lane operations.
macro_rules! block_kernel {
    ($(#[$attr:meta])*) => {
        /// `dp` padding: one output run.
        pub(super) const PAD: usize = PW * L;

        // Score runs tile the key tile exactly (the bounds argument in `block` relies on it).
        const _: () = assert!(KT.is_multiple_of(W * L));

        /// The block step for this instruction set (see the module docs).
        ///
        /// # Safety
        /// The CPU must support the features this function is compiled for.
        $(#[$attr])*
        #[allow(clippy::needless_range_loop)]
        pub(super) unsafe fn block(b: &mut Block<'_>) {
            let (lo, hi) = b.check(PAD);
            if lo >= hi {
                return;
            }
            let (d, dp, vs) = (b.d, b.dp, b.v_stride);
            let (q, kt, v) = (b.q.as_ptr(), b.kt.as_ptr(), b.v.as_ptr());
            let mut s = [[0f32; KT]; R];
            // 1. Scores, in runs of W·L key columns covering [lo, hi) (KT is a multiple of W·L).
            let mut c0 = lo / (W * L) * (W * L);
            while c0 < hi {
                let mut acc = [[zero(); W]; R];
                for c in 0..d {
                    // SAFETY: c < d and c0 + W·L ≤ KT, inside `kt` (d·KT, checked); r < R,
                    // inside `q` (R·d, checked).
                    unsafe {
                        let kr = kt.add(c * KT + c0);
                        let mut kv = [zero(); W];
                        for w in 0..W {
                            kv[w] = load(kr.add(w * L));
                        }
                        for r in 0..R {
                            let qv = splat(*q.add(r * d + c));
                            for w in 0..W {
                                acc[r][w] = fmadd(qv, kv[w], acc[r][w]);
                            }
                        }
                    }
                }
                for r in 0..R {
                    for w in 0..W {
                        // SAFETY: c0 + W·L ≤ KT, the row length of `s`.
                        unsafe { store(s[r].as_mut_ptr().add(c0 + w * L), acc[r][w]) };
                    }
                }
                c0 += W * L;
            }
            // 1b. Soft cap (Gemma 2), on the visible columns only; rare, so scalar.
            if b.softcap > 0.0 {
                let c = b.softcap;
                for r in 0..R {
                    let (a, e) = b.ranges[r];
                    if a < e {
                        for x in &mut s[r][a..e] {
                            *x = c * (*x / c).tanh();
                        }
                    }
                }
            }
            // 2. Online softmax over the lane-aligned span [lo_v, hi_v) ⊆ [0, KT).
            let (lo_v, hi_v) = (lo / L * L, hi.div_ceil(L) * L);
            let mut corr = [1f32; R];
            for r in 0..R {
                let (a, e) = b.ranges[r];
                let row = &mut s[r];
                if a >= e {
                    row[lo_v..hi_v].fill(0.0);
                    continue;
                }
                row[lo_v..a].fill(f32::NEG_INFINITY);
                row[e..hi_v].fill(f32::NEG_INFINITY);
                let p = row.as_mut_ptr();
                let mut mx = splat(f32::NEG_INFINITY);
                for j in (lo_v..hi_v).step_by(L) {
                    // SAFETY: j + L ≤ hi_v ≤ KT.
                    mx = max(mx, unsafe { load(p.add(j)) });
                }
                let m_new = b.m[r].max(hmax(mx));
                corr[r] = crate::exp::exp2(b.m[r] - m_new);
                let mv = splat(m_new);
                let mut sum = zero();
                for j in (lo_v..hi_v).step_by(L) {
                    // SAFETY: as above.
                    unsafe {
                        let x = exp2(sub(load(p.add(j)), mv));
                        store(p.add(j), x);
                        sum = add(sum, x);
                    }
                }
                b.l[r] = b.l[r] * corr[r] + hsum(sum);
                b.m[r] = m_new;
            }
            // 3. o ← c·o + p·v, in runs of PW·L output columns (dp is a multiple of PW·L).
            let (o, sp) = (b.o.as_mut_ptr(), s.as_ptr() as *const f32);
            for c0 in (0..dp).step_by(PW * L) {
                // SAFETY: r·dp + c0 + PW·L ≤ R·dp, inside `o` (checked); value rows j < hi
                // have dp readable values from j·vs (checked); r·KT + j < R·KT, inside `s`.
                unsafe {
                    let mut acc = [[zero(); PW]; R];
                    for r in 0..R {
                        let cv = splat(corr[r]);
                        for w in 0..PW {
                            acc[r][w] = mul(load(o.add(r * dp + c0 + w * L)), cv);
                        }
                    }
                    for j in lo..hi {
                        let vr = v.add(j * vs + c0);
                        let mut vv = [zero(); PW];
                        for w in 0..PW {
                            vv[w] = load(vr.add(w * L));
                        }
                        for r in 0..R {
                            let pv = splat(*sp.add(r * KT + j));
                            for w in 0..PW {
                                acc[r][w] = fmadd(pv, vv[w], acc[r][w]);
                            }
                        }
                    }
                    for r in 0..R {
                        for w in 0..PW {
                            store(o.add(r * dp + c0 + w * L), acc[r][w]);
                        }
                    }
                }
            }
        }
    };
}

/// Portable lanes: arrays of 8 f32 with element-wise loops, which the compiler turns into
/// whatever vectors the baseline target has (SSE2, NEON) — the reference path.
mod scalar {
    use super::{Block, KT, R};

    type V = [f32; L];
    const L: usize = 8;
    const W: usize = 1;
    const PW: usize = 1;

    #[inline(always)]
    fn zero() -> V {
        [0.0; L]
    }
    #[inline(always)]
    fn splat(x: f32) -> V {
        [x; L]
    }
    /// # Safety
    /// `L` floats at `p` must be readable.
    #[inline(always)]
    unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller's contract; `read_unaligned` needs no alignment.
        unsafe { (p as *const V).read_unaligned() }
    }
    /// # Safety
    /// `L` floats at `p` must be writable.
    #[inline(always)]
    unsafe fn store(p: *mut f32, x: V) {
        // SAFETY: the caller's contract.
        unsafe { (p as *mut V).write_unaligned(x) }
    }
    #[inline(always)]
    fn zip(a: V, b: V, f: impl Fn(f32, f32) -> f32) -> V {
        std::array::from_fn(|i| f(a[i], b[i]))
    }
    #[inline(always)]
    fn fmadd(a: V, b: V, c: V) -> V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn mul(a: V, b: V) -> V {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn add(a: V, b: V) -> V {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(a: V, b: V) -> V {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn max(a: V, b: V) -> V {
        zip(a, b, f32::max)
    }
    #[inline(always)]
    fn hmax(a: V) -> f32 {
        a.into_iter().fold(f32::NEG_INFINITY, f32::max)
    }
    #[inline(always)]
    fn hsum(a: V) -> f32 {
        a.into_iter().sum()
    }
    #[inline(always)]
    fn exp2(a: V) -> V {
        std::array::from_fn(|i| crate::exp::exp2(a[i]))
    }

    block_kernel!();
}

/// 8 lanes of AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Block, KT, R};
    use core::arch::x86_64::*;

    type V = __m256;
    const L: usize = 8;
    const W: usize = 2;
    const PW: usize = 2;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn zero() -> V {
        _mm256_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn splat(x: f32) -> V {
        _mm256_set1_ps(x)
    }
    /// # Safety
    /// 8 floats at `p` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
    /// # Safety
    /// 8 floats at `p` must be writable.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store(p: *mut f32, x: V) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_ps(p, x) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn fmadd(a: V, b: V, c: V) -> V {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mul(a: V, b: V) -> V {
        _mm256_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn add(a: V, b: V) -> V {
        _mm256_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn sub(a: V, b: V) -> V {
        _mm256_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn max(a: V, b: V) -> V {
        _mm256_max_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hmax(a: V) -> f32 {
        let x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(a: V) -> f32 {
        let x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp2(a: V) -> V {
        crate::exp::x86::exp2_avx2(a)
    }

    block_kernel!(#[target_feature(enable = "avx2,fma")]);
}

/// 16 lanes of AVX-512F.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Block, KT, R};
    use core::arch::x86_64::*;

    type V = __m512;
    const L: usize = 16;
    const W: usize = 4;
    const PW: usize = 4;

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn zero() -> V {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn splat(x: f32) -> V {
        _mm512_set1_ps(x)
    }
    /// # Safety
    /// 16 floats at `p` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load(p: *const f32) -> V {
        // SAFETY: the caller's contract.
        unsafe { _mm512_loadu_ps(p) }
    }
    /// # Safety
    /// 16 floats at `p` must be writable.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store(p: *mut f32, x: V) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_ps(p, x) }
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fmadd(a: V, b: V, c: V) -> V {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn mul(a: V, b: V) -> V {
        _mm512_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn add(a: V, b: V) -> V {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sub(a: V, b: V) -> V {
        _mm512_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn max(a: V, b: V) -> V {
        _mm512_max_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hmax(a: V) -> f32 {
        _mm512_reduce_max_ps(a)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn hsum(a: V) -> f32 {
        _mm512_reduce_add_ps(a)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn exp2(a: V) -> V {
        crate::exp::x86::exp2_avx512(a)
    }

    block_kernel!(#[target_feature(enable = "avx512f,avx2,fma")]);
}
