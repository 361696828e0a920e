//! Decode kernels for the 256-value k-quants on AVX-512 VNNI: with one activation row there is
//! nothing for the [`super::tile`] kernels' decoded super-blocks to be reused by, so their
//! transposes and stores cost more than the arithmetic. Here each weight row's super-block is
//! read straight into 512-bit vectors (64 values a vector, in the activation's order), dotted
//! with `vpdpbusd`, and each four-value sum — which fits in i16 — is scaled by its sub-block's
//! scale with one `vpdpwssd` per vector. The integer sum of a super-block is exact and the float
//! steps are the scalar kernel's, so every result equals the scalar and tile kernels' bit for
//! bit; with several activation rows the sixteen-row tiles run ([`super::tile16`]).
//!
//! # Safety
//! As for [`super::tile`]: the CPU features of each `#[target_feature]`, `w` holding `rows` rows
//! of `stride` bytes of whole super-blocks, `x` `m` rows of `stride / block_bytes` blocks, `y`
//! writable at `c·ldy + r`.

use super::*;

/// The i32 lane indexes that spread per-sub-block values over the 16 four-value sums of 64-value
/// chunk `c`: lane `i` reads sub-block `first + i / per` where `first = c·64 / (4·per)`.
#[inline(always)]
fn spread(c: usize, per: usize) -> __m512i {
    let lanes: [i32; 16] = core::array::from_fn(|i| ((64 * c / (4 * per)) + i / per) as i32);
    // SAFETY (features): only called from functions with AVX-512F enabled.
    unsafe { _mm512_loadu_si512(lanes.as_ptr() as *const __m512i) }
}

/// `Σ_g sc_g·(Σ q·x − 32·Σx)` over Q6_K super-block `b` (210 bytes: 128 of low nibbles, 64 of
/// high bit pairs, 16 signed scales, f16 d) against `x`: the scalar kernel's integer sum.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_k_sum(b: *const u8, x: &Q8KBlock) -> i32 {
    // SAFETY: `b` points at a whole 210-byte block, `x` is a whole activation block.
    unsafe {
        let (m4, m30) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
        let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        // The offset first: −32·sc fits in i16, so Σ sc·(−32)·Σx is one pair-dot.
        let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
        let off = _mm256_madd_epi16(_mm256_mullo_epi16(sc, _mm256_set1_epi16(-32)), bsums);
        let mut acc = _mm512_zextsi256_si512(off);
        // Scales zero-extended from i16, so `vpdpwssd` multiplies each sum's low half alone.
        let sc = _mm512_cvtepu16_epi32(sc);
        for half in 0..2 {
            // Values 128·half + i: low nibble of ql[64·half + i], high pair from
            // qh[32·half + i % 32] shifted by 2·(i / 32); the next 64 take the high nibbles and
            // the pairs 4 higher.
            let ql = _mm512_loadu_si512(b.add(64 * half) as *const __m512i);
            let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
            let qh =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<2>(qh));
            let chunks = [
                _mm512_or_si512(
                    _mm512_and_si512(ql, m4),
                    _mm512_and_si512(_mm512_slli_epi16::<4>(qh), m30),
                ),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                    _mm512_and_si512(qh, m30),
                ),
            ];
            for (h, q) in chunks.into_iter().enumerate() {
                let c = 2 * half + h;
                let xv = _mm512_loadu_si512(x.qs.as_ptr().add(64 * c) as *const __m512i);
                // Four codes ≤ 63 against |x| ≤ 128: every lane fits in i16.
                let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv);
                acc = _mm512_dpwssd_epi32(acc, sums, _mm512_permutexvar_epi32(spread(c, 4), sc));
            }
        }
        _mm512_reduce_add_epi32(acc)
    }
}

/// The eight 6-bit scales and minimums of a Q4_K block's 12 scale bytes `s`, as bytes of two
/// u64s (ggml's `get_scale_min_k4` for all eight at once, in 32-bit words).
#[inline(always)]
fn q4_k_scales(s: [u8; 12]) -> (u64, u64) {
    let u = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (u(0), u(1), u(2));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (u2 & low4) | (((u0 >> 6) & top2) << 4);
    let mn_hi = ((u2 >> 4) & low4) | (((u1 >> 6) & top2) << 4);
    let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    (join(u0 & low6, sc_hi), join(u1 & low6, mn_hi))
}

/// Q4_K super-block `b` (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums,
/// 128 of nibbles) against `x`: `(Σ_j sc_j·Σ q·x, Σ_j mn_j·Σx_j)`, the scalar kernel's two
/// integer sums.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_k_sums(b: *const u8, x: &Q8KBlock) -> (i32, i32) {
    // SAFETY: `b` points at a whole 144-byte block, `x` is a whole activation block.
    unsafe {
        let (sc, mn) = q4_k_scales((b.add(4) as *const [u8; 12]).read_unaligned());
        // Each minimum twice (i16), against the sub-block's two 16-value activation sums.
        let mn = _mm_cvtsi64_si128(mn as i64);
        let mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));
        let bsums = _mm256_loadu_si256(x.bsums.as_ptr() as *const __m256i);
        let min_sum = hsum_epi32(_mm256_madd_epi16(mn, bsums));
        let sc = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
        let m4 = _mm512_set1_epi8(0x0f);
        let mut acc = _mm512_setzero_si512();
        for c in 0..4 {
            // Values 64·c + i: low nibbles of the 32 bytes, then their high nibbles.
            let q = _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i);
            let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q), _mm256_srli_epi16::<4>(q));
            let xv = _mm512_loadu_si512(x.qs.as_ptr().add(64 * c) as *const __m512i);
            // Four codes ≤ 15 against |x| ≤ 128: every lane fits in i16.
            let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q, m4), xv);
            acc = _mm512_dpwssd_epi32(acc, sums, _mm512_permutexvar_epi32(spread(c, 8), sc));
        }
        (_mm512_reduce_add_epi32(acc), min_sum)
    }
}

/// Each of the `rows` weight rows (`stride` bytes of `bb`-byte super-blocks) against the one
/// activation row `x`, into `y[r]`: `add(block, x_block, acc)` adds a super-block's share.
#[inline(always)]
unsafe fn each_row(
    (w, stride, rows): (&[u8], usize, usize),
    bb: usize,
    x: &[Q8KBlock],
    y: *mut f32,
    add: impl Fn(*const u8, &Q8KBlock, f32) -> f32,
) {
    for r in 0..rows {
        let row = &w[r * stride..(r + 1) * stride];
        let acc = row
            .chunks_exact(bb)
            .zip(x)
            .fold(0f32, |acc, (b, xb)| add(b.as_ptr(), xb, acc));
        // SAFETY: the caller passes `y` writable at `r < rows`.
        unsafe { *y.add(r) = acc };
    }
}

/// Q6_K: one activation row here, several through the tile kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q6_k(
    w: &[u8],
    stride: usize,
    rows: usize,
    x: &[Q8KBlock],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: see the module docs; each block is whole.
    unsafe {
        if m != 1 {
            return super::tile16::q6_k(w, stride, rows, x, m, y, ldy);
        }
        each_row((w, stride, rows), 210, x, y, |b, xb, acc| {
            acc + (f16c(b.add(208)) * xb.d) * q6_k_sum(b, xb) as f32
        });
    }
}

/// Q4_K: one activation row here, several through the tile kernel.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q4_k(
    w: &[u8],
    stride: usize,
    rows: usize,
    x: &[Q8KBlock],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    // SAFETY: see the module docs; each block is whole.
    unsafe {
        if m != 1 {
            return super::tile16::q4_k(w, stride, rows, x, m, y, ldy);
        }
        each_row((w, stride, rows), 144, x, y, |b, xb, acc| {
            let (d, dmin) = (f16c(b), f16c(b.add(2)));
            let (isum, summ) = q4_k_sums(b, xb);
            acc + xb.d * (d * isum as f32 - dmin * summ as f32)
        });
    }
}
