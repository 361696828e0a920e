//! Sixteen-row tiles on AVX-512 VNNI for Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K: the
//! [`super::tile`] kernels' layout (weight rows in lanes; a 32-value block transposed in
//! registers, a k-quant super-block decoded once into memory, each reused by every activation
//! row of the tile) in 512-bit vectors, so each `vpdpbusd` serves sixteen weight rows instead of
//! eight. On cores with full-width 512-bit units that is close to twice the integer work per
//! instruction in prefill (measured here at 64 activation rows: Q6_K 2.2×, Q4_K 1.9×). The
//! k-quants' integer sums are exact and their float steps per lane those of the scalar kernel,
//! so they equal it bit for bit; the 32-value formats take the eight-row tiles' float steps.
//! As there, a row's result never depends on the other rows of its tile or batch. Decode (one
//! activation row) of the 32-value formats runs the eight-row tiles.
//!
//! # Safety
//! As for [`super::tile`], with `rows` from 1 to 16.

use super::*;
use crate::matmul::TileFn;

/// Weight rows per tile.
pub const HEIGHT: usize = 16;

/// Activation rows per pass over a decoded block (their accumulators stay in registers).
const WIDTH: usize = 8;

/// One 32-value block of sixteen weight rows, rows in lanes.
#[derive(Clone, Copy)]
struct Block16 {
    /// Codes of groups 0–7 (four values each): the unsigned operand of the integer dot.
    q: [__m512i; 8],
    /// Each row's scale.
    d: __m512,
    /// Each row's offset coefficient, times the activation's sum term (`−8·d` for Q4_0, the
    /// minimum for Q4_1, `−16·d` for Q5_0; unused for Q8_0).
    off: __m512,
}

/// One super-block of sixteen weight rows, rows in lanes.
struct SuperBlock16 {
    /// Codes of the 64 four-value groups (Q4_K 0–15, Q6_K 0–63).
    q: [__m512i; 64],
    /// The scale of each sub-block (Q4_K: 8 of 32 values, unsigned; Q6_K: 16 of 16, signed).
    sc: [__m512i; 16],
    /// Q6_K: scales `2g` and `2g + 1` as an i16 pair per lane, for the `−32·Σ sc·Σx` offset;
    /// Q4_K: minimum `g` in both halves, for `Σ mn·Σx` over the sub-block's two 16-value sums.
    pairs: [__m512i; 8],
    /// Super-block scale.
    d: __m512,
    /// Q4_K's scale of the minimums.
    dmin: __m512,
}

thread_local! {
    /// Each thread's [`SuperBlock16`], decoded into by [`q6_k`].
    static DECODED: core::cell::UnsafeCell<SuperBlock16> =
        // SAFETY: all-zero bits are valid vectors.
        const { core::cell::UnsafeCell::new(unsafe { core::mem::zeroed() }) };
}

/// The sixteen row pointers of a tile of `rows` rows (the last row repeated past `rows`).
#[inline(always)]
fn row_pointers(w: &[u8], stride: usize, rows: usize) -> [*const u8; HEIGHT] {
    core::array::from_fn(|r| w.as_ptr().wrapping_add(r.min(rows - 1) * stride))
}

/// The 16 bytes at `p[r] + o` of the sixteen rows, transposed into four vectors: lane `r` of
/// vector `j` = bytes `4j..4j + 4` of row `r`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn transpose16(p: &[*const u8; HEIGHT], o: usize) -> [__m512i; 4] {
    // SAFETY: the caller passes rows with 16 readable bytes at `o`.
    let a: [__m512i; 4] = core::array::from_fn(|r| unsafe {
        let at = |k: usize| _mm_loadu_si128(p[r + 4 * k].add(o) as *const __m128i);
        let v = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(at(0)), at(1));
        _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(v, at(2)), at(3))
    });
    // Per 128-bit lane k, rows 4k..4k + 4: the 4×4 transpose of their dwords.
    let t0 = _mm512_unpacklo_epi32(a[0], a[1]);
    let t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    let t2 = _mm512_unpacklo_epi32(a[2], a[3]);
    let t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// [`transpose16`] of 32 bytes: eight group vectors.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn transpose32(p: &[*const u8; HEIGHT], o: usize) -> [__m512i; 8] {
    // SAFETY: the caller passes rows with 32 readable bytes at `o`.
    let (lo, hi) = unsafe { (transpose16(p, o), transpose16(p, o + 16)) };
    core::array::from_fn(|g| if g < 4 { lo[g] } else { hi[g - 4] })
}

/// Byte `i` (0–3) of every i32 lane, zero-extended.
#[inline(always)]
fn byte_of(v: __m512i, i: usize) -> __m512i {
    // SAFETY (features): only called from functions with AVX-512F enabled.
    unsafe {
        _mm512_and_si512(
            _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * i as i32)),
            _mm512_set1_epi32(0xff),
        )
    }
}

/// Both i16 halves of each lane set to the lane's value (below 2¹⁵).
#[inline(always)]
fn doubled(v: __m512i) -> __m512i {
    // SAFETY (features): only called from functions with AVX-512F enabled.
    unsafe { _mm512_or_si512(v, _mm512_slli_epi32::<16>(v)) }
}

/// The f16 at `p[r] + o` of the sixteen rows as f32, lane `r` from row `r`.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn halves(p: &[*const u8; HEIGHT], o: usize) -> __m512 {
    // SAFETY: the caller passes rows with two readable bytes at `o`.
    let h: [u16; HEIGHT] =
        core::array::from_fn(|r| unsafe { (p[r].add(o) as *const u16).read_unaligned() });
    // SAFETY: 32 readable bytes.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr() as *const __m256i)) }
}

/// The f16 pairs at `p[r] + o` of the sixteen rows: (first halves, second halves) as f32, lane
/// `r` from row `r`.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn pairs_of_halves(p: &[*const u8; HEIGHT], o: usize) -> (__m512, __m512) {
    // SAFETY: the caller passes rows with four readable bytes at `o`.
    let v: [i32; HEIGHT] =
        core::array::from_fn(|r| unsafe { (p[r].add(o) as *const i32).read_unaligned() });
    let v = _mm512_setr_epi32(
        v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13],
        v[14], v[15],
    );
    (
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v))),
    )
}

/// 16 bytes of packed nibbles (byte `j`: value `j` low, value `j + 16` high) of the sixteen rows
/// as the eight group vectors of codes 0–15.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn nibble_groups(p: &[*const u8; HEIGHT], o: usize) -> [__m512i; 8] {
    // SAFETY: as for `transpose16`.
    let t = unsafe { transpose16(p, o) };
    let m4 = _mm512_set1_epi8(0x0f);
    core::array::from_fn(|g| {
        if g < 4 {
            _mm512_and_si512(t[g], m4)
        } else {
            _mm512_and_si512(_mm512_srli_epi16::<4>(t[g - 4]), m4)
        }
    })
}

/// Adds Q5_0's fifth bits to `q`: lane `r` of `qh` holds row `r`'s 32 high bits (bit `v` for
/// value `v`), which become 16 in byte `i` of group `g` where bit `4g + i` is set.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn add_high_bits(q: &mut [__m512i; 8], qh: __m512i) {
    // Byte j of each 128-bit lane reads byte 4·(j / 4) of it: the first byte of its own i32.
    let base = _mm512_broadcast_i32x4(_mm_setr_epi8(
        0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
    ));
    for (g, v) in q.iter_mut().enumerate() {
        // Byte g/2 of each lane's bits into all four bytes of the lane, then one bit a byte.
        let at = _mm512_add_epi8(base, _mm512_set1_epi8(g as i8 / 2));
        let spread = _mm512_shuffle_epi8(qh, at);
        let mask = _mm512_set1_epi32(if g % 2 == 0 {
            0x0804_0201
        } else {
            0x8040_2010u32 as i32
        });
        let set = _mm512_test_epi8_mask(spread, mask);
        *v = _mm512_or_si512(*v, _mm512_maskz_mov_epi8(set, _mm512_set1_epi8(0x10)));
    }
}

/// The eight-row kernels' block sum in 512 bits: `Σ_g q_g·x_g` per lane for unsigned codes; for
/// Q8_0's signed codes (`SIGNED`) offset by 128 into the unsigned operand, the `128·Σx` taken
/// back in the start value.
#[inline(always)]
unsafe fn block_sum<const SIGNED: bool>(w: &Block16, xb: &Q8Block) -> __m512i {
    // SAFETY: the caller has AVX-512 VNNI; groups 0–7 of a 32-value block.
    unsafe {
        let x =
            |g: usize| _mm512_set1_epi32((xb.qs.as_ptr() as *const i32).add(g).read_unaligned());
        let mut s = if SIGNED {
            [_mm512_set1_epi32(-128 * xb.sum), _mm512_setzero_si512()]
        } else {
            [_mm512_setzero_si512(); 2]
        };
        for g in 0..8 {
            let u = if SIGNED {
                _mm512_xor_si512(w.q[g], _mm512_set1_epi8(-128))
            } else {
                w.q[g]
            };
            s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], u, x(g));
        }
        _mm512_add_epi32(s[0], s[1])
    }
}

/// `C` activation rows (from `x`, `nb` blocks each) against the sixteen weight rows whose block
/// `b` is `load(b)`: per row pair and block `acc ← fma(f32(Σq·x), d·d_x, acc)`, then
/// `acc ← fma(off, sum_x, acc)` where the format has an offset term; stores the `rows` lanes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const C: usize, const SIGNED: bool>(
    (nb, bb, next): (usize, usize, *const u8),
    x: *const Q8Block,
    load: impl Fn(usize) -> Block16,
    off_sum: Option<fn(&Q8Block) -> f32>,
    y: *mut f32,
    ldy: usize,
    rows: usize,
) {
    // SAFETY: see the module docs; `x` holds C rows of `nb` blocks.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); C];
        for b in 0..nb {
            // The next tile's share of this block, so its reads stay one tile ahead.
            let ahead = next.wrapping_add(HEIGHT * bb * b);
            for off in (0..HEIGHT * bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off) as *const i8);
            }
            let w = load(b);
            for (c, a) in acc.iter_mut().enumerate() {
                let xb = &*x.add(c * nb + b);
                let s = block_sum::<SIGNED>(&w, xb);
                let dd = _mm512_mul_ps(w.d, _mm512_set1_ps(xb.d));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, *a);
                if let Some(o) = off_sum {
                    *a = _mm512_fmadd_ps(w.off, _mm512_set1_ps(o(xb)), *a);
                }
            }
        }
        let keep = ((1u32 << rows) - 1) as u16;
        for (c, a) in acc.into_iter().enumerate() {
            _mm512_mask_storeu_ps(y.add(c * ldy), keep, a);
        }
    }
}

/// Every activation row through [`tile`], `WIDTH` at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep<const SIGNED: bool>(
    (w, stride, bb): (&[u8], usize, usize),
    rows: usize,
    x: &[Q8Block],
    m: usize,
    y: *mut f32,
    ldy: usize,
    load: impl Fn(usize) -> Block16 + Copy,
    off_sum: Option<fn(&Q8Block) -> f32>,
) {
    let nb = stride / bb;
    let next = w.as_ptr().wrapping_add(HEIGHT * stride);
    // SAFETY: see the module docs.
    unsafe {
        let mut c0 = 0;
        while c0 < m {
            let cw = (m - c0).min(WIDTH);
            let (xc, yc) = (x.as_ptr().add(c0 * nb), y.add(c0 * ldy));
            macro_rules! go {
                ($c:literal) => {
                    tile::<$c, SIGNED>((nb, bb, next), xc, load, off_sum, yc, ldy, rows)
                };
            }
            match cw {
                1 => go!(1),
                2 => go!(2),
                3 => go!(3),
                4 => go!(4),
                5 => go!(5),
                6 => go!(6),
                7 => go!(7),
                _ => go!(8),
            }
            c0 += cw;
        }
    }
}

/// One activation row against up to sixteen weight rows through the eight-row kernel `eight`,
/// eight rows at a time: with one activation row the sixteen-row transposes cost more than they
/// save (decode ran 4–9% slower through them), and both compute each row alike, bit for bit.
#[inline(always)]
unsafe fn decode(
    eight: TileFn<Q8Block>,
    (w, stride, rows): (&[u8], usize, usize),
    x: &[Q8Block],
    y: *mut f32,
) {
    for r0 in (0..rows).step_by(8) {
        let n = (rows - r0).min(8);
        // SAFETY: see the module docs; rows r0..r0 + n of the tile and their outputs.
        unsafe {
            eight(
                &w[r0 * stride..(r0 + n) * stride],
                stride,
                n,
                x,
                1,
                y.add(r0),
                1,
            )
        };
    }
}

/// Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles; value = d·(q − 8)).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q4_0(
    w: &[u8],
    stride: usize,
    rows: usize,
    x: &[Q8Block],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    if m == 1 {
        // SAFETY: see the module docs.
        return unsafe { decode(super::tile::vnni::q4_0, (w, stride, rows), x, y) };
    }
    let p = row_pointers(w, stride, rows);
    let load = |b: usize| {
        // SAFETY: block b of each row: d at 0, nibbles at 2..18.
        unsafe {
            let (d, _) = pairs_of_halves(&p, 18 * b);
            let off = _mm512_mul_ps(d, _mm512_set1_ps(-8.0));
            Block16 {
                q: nibble_groups(&p, 18 * b + 2),
                d,
                off,
            }
        }
    };
    // SAFETY: see the module docs.
    unsafe { sweep::<false>((w, stride, 18), rows, x, m, y, ldy, load, Some(|b| b.s)) }
}

/// Q4_1 (20-byte blocks: f16 d, f16 m, 16 bytes of nibbles; value = d·q + m).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q4_1(
    w: &[u8],
    stride: usize,
    rows: usize,
    x: &[Q8Block],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    if m == 1 {
        // SAFETY: see the module docs.
        return unsafe { decode(super::tile::vnni::q4_1, (w, stride, rows), x, y) };
    }
    let p = row_pointers(w, stride, rows);
    let load = |b: usize| {
        // SAFETY: block b of each row: d at 0, m at 2, nibbles at 4..20.
        unsafe {
            let (d, off) = pairs_of_halves(&p, 20 * b);
            Block16 {
                q: nibble_groups(&p, 20 * b + 4),
                d,
                off,
            }
        }
    };
    // SAFETY: see the module docs.
    unsafe { sweep::<false>((w, stride, 20), rows, x, m, y, ldy, load, Some(|b| b.s1)) }
}

/// Q5_0 (22-byte blocks: f16 d, 32 fifth bits, 16 bytes of nibbles; value = d·(q − 16)).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q5_0(
    w: &[u8],
    stride: usize,
    rows: usize,
    x: &[Q8Block],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    if m == 1 {
        // SAFETY: see the module docs.
        return unsafe { decode(super::tile::vnni::q5_0, (w, stride, rows), x, y) };
    }
    let p = row_pointers(w, stride, rows);
    let load = |b: usize| {
        // SAFETY: block b of each row: d at 0, qh at 2..6, nibbles at 6..22.
        unsafe {
            let (d, _) = pairs_of_halves(&p, 22 * b);
            let qh: [i32; HEIGHT] =
                core::array::from_fn(|r| (p[r].add(22 * b + 2) as *const i32).read_unaligned());
            let qh = _mm512_loadu_si512(qh.as_ptr() as *const __m512i);
            let mut q = nibble_groups(&p, 22 * b + 6);
            add_high_bits(&mut q, qh);
            let off = _mm512_mul_ps(d, _mm512_set1_ps(-16.0));
            Block16 { q, d, off }
        }
    };
    // SAFETY: see the module docs.
    unsafe { sweep::<false>((w, stride, 22), rows, x, m, y, ldy, load, Some(|b| b.s)) }
}

/// Q8_0 (34-byte blocks: f16 d, 32 signed bytes; value = d·q).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn q8_0(
    w: &[u8],
    stride: usize,
    rows: usize,
    x: &[Q8Block],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    if m == 1 {
        // SAFETY: see the module docs.
        return unsafe { decode(super::tile::vnni::q8_0, (w, stride, rows), x, y) };
    }
    let p = row_pointers(w, stride, rows);
    let load = |b: usize| {
        // SAFETY: block b of each row: d at 0, codes at 2..34.
        unsafe {
            let (d, _) = pairs_of_halves(&p, 34 * b);
            Block16 {
                q: transpose32(&p, 34 * b + 2),
                d,
                off: d,
            }
        }
    };
    // SAFETY: see the module docs.
    unsafe { sweep::<true>((w, stride, 34), rows, x, m, y, ldy, load, None) }
}

/// Decodes Q4_K super-block `b` (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and
/// minimums, 128 of nibbles; value = d·sc·q − dmin·mn) of the sixteen rows.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
unsafe fn decode_q4_k(p: &[*const u8; HEIGHT], b: usize, out: &mut SuperBlock16) {
    let at = 144 * b;
    // SAFETY: every read lies inside block b of its row (the 16-byte scale read ends inside
    // the nibbles).
    unsafe {
        (out.d, out.dmin) = pairs_of_halves(p, at);
        let t = transpose16(p, at + 4);
        let s = |i: usize| byte_of(t[i / 4], i % 4);
        let (m63, m15) = (_mm512_set1_epi32(63), _mm512_set1_epi32(15));
        let top = |v: __m512i| _mm512_slli_epi32::<4>(_mm512_srli_epi32::<6>(v));
        for j in 0..8 {
            let (sc, mn) = if j < 4 {
                (_mm512_and_si512(s(j), m63), _mm512_and_si512(s(j + 4), m63))
            } else {
                (
                    _mm512_or_si512(_mm512_and_si512(s(j + 4), m15), top(s(j - 4))),
                    _mm512_or_si512(_mm512_srli_epi32::<4>(s(j + 4)), top(s(j))),
                )
            };
            out.sc[j] = sc;
            out.pairs[j] = doubled(mn);
        }
        let m4 = _mm512_set1_epi8(0x0f);
        for c in 0..4 {
            // Chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
            let raw = transpose32(p, at + 16 + 32 * c);
            for (g, &v) in raw.iter().enumerate() {
                out.q[16 * c + g] = _mm512_and_si512(v, m4);
                out.q[16 * c + 8 + g] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
            }
        }
    }
}

/// Decodes Q6_K super-block `b` (210 bytes: 128 of low nibbles, 64 of high bit pairs, 16 signed
/// scales, f16 d; value = d·sc·(q − 32)) of the sixteen rows.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
unsafe fn decode_q6_k(p: &[*const u8; HEIGHT], b: usize, out: &mut SuperBlock16) {
    let at = 210 * b;
    // SAFETY: every read lies inside block b of its row.
    unsafe {
        out.d = halves(p, at + 208);
        let t = transpose16(p, at + 192);
        for g in 0..16 {
            // Byte g % 4 of each lane, sign-extended.
            let left = _mm512_set1_epi32(8 * (3 - g as i32 % 4));
            out.sc[g] = _mm512_srai_epi32::<24>(_mm512_sllv_epi32(t[g / 4], left));
        }
        for g in 0..8 {
            let lo = _mm512_and_si512(out.sc[2 * g], _mm512_set1_epi32(0xffff));
            out.pairs[g] = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(out.sc[2 * g + 1]));
        }
        let (m4, m2) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(3));
        let hi = |v: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(v, m2));
        for j in 0..2 {
            let ql0 = transpose32(p, at + 64 * j);
            let ql1 = transpose32(p, at + 64 * j + 32);
            let qh = transpose32(p, at + 128 + 32 * j);
            for g in 0..8 {
                let h = qh[g];
                let base = 32 * j;
                out.q[base + g] = _mm512_or_si512(_mm512_and_si512(ql0[g], m4), hi(h));
                out.q[base + 8 + g] =
                    _mm512_or_si512(_mm512_and_si512(ql1[g], m4), hi(_mm512_srli_epi16::<2>(h)));
                out.q[base + 16 + g] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql0[g]), m4),
                    hi(_mm512_srli_epi16::<4>(h)),
                );
                out.q[base + 24 + g] = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql1[g]), m4),
                    hi(_mm512_srli_epi16::<6>(h)),
                );
            }
        }
    }
}

/// The exact integer sums of the decoded super-block against `C` activation blocks — Q6_K
/// `Σ_j sc_j·Σ (q − 32)·x` over 16-value sub-blocks, Q4_K `Σ_j sc_j·Σ q·x` over 32-value ones
/// and its minimums' `Σ_j mn_j·Σx_j` — each sub-block's codes loaded once for the `C` rows.
#[inline(always)]
unsafe fn sums<const C: usize, const Q6: bool>(
    k: &SuperBlock16,
    xb: &[&Q8KBlock; C],
) -> ([__m512i; C], [__m512i; C]) {
    // SAFETY: the caller has AVX-512 VNNI; groups 0–63 of 256-value blocks.
    unsafe {
        let mut total = [_mm512_setzero_si512(); C];
        let mut mins = [_mm512_setzero_si512(); C];
        for (c, m) in mins.iter_mut().enumerate() {
            // Q6_K: Σ_j sc_j·Σx_j, two sub-blocks per pair-dot; Q4_K: Σ_j mn_j·Σx_j, one
            // 32-value sub-block (two 16-value sums) per pair-dot.
            for (g, &pair) in k.pairs.iter().enumerate() {
                let s = (xb[c].bsums.as_ptr() as *const i32).add(g).read_unaligned();
                *m = _mm512_dpwssd_epi32(*m, pair, _mm512_set1_epi32(s));
            }
        }
        if Q6 {
            for (t, m) in total.iter_mut().zip(&mins) {
                *t = _mm512_sub_epi32(*t, _mm512_slli_epi32::<5>(*m));
            }
        }
        let (subs, per) = if Q6 { (16, 4) } else { (8, 8) };
        for j in 0..subs {
            let q = &k.q[per * j..per * (j + 1)];
            for c in 0..C {
                let x = |g: usize| {
                    let at = (xb[c].qs.as_ptr() as *const i32).add(per * j + g);
                    _mm512_set1_epi32(at.read_unaligned())
                };
                let mut s = [_mm512_setzero_si512(); 2];
                for (g, &qg) in q.iter().enumerate() {
                    s[g % 2] = _mm512_dpbusd_epi32(s[g % 2], qg, x(g));
                }
                let s = _mm512_mullo_epi32(_mm512_add_epi32(s[0], s[1]), k.sc[j]);
                total[c] = _mm512_add_epi32(total[c], s);
            }
        }
        (total, mins)
    }
}

/// Adds one super-block's share to `acc` with the scalar kernel's float operations (Q4_K:
/// `d_x·(d·isum − dmin·Σ mn_j·Σx_j)`; Q6_K: `(d·d_x)·isum`).
#[inline(always)]
unsafe fn finish<const Q6: bool>(
    k: &SuperBlock16,
    xb: &Q8KBlock,
    (isum, mins): (__m512i, __m512i),
    acc: __m512,
) -> __m512 {
    // SAFETY: plain vector arithmetic (the caller has AVX-512F).
    unsafe {
        if Q6 {
            let dd = _mm512_mul_ps(k.d, _mm512_set1_ps(xb.d));
            return _mm512_add_ps(acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum)));
        }
        let t = _mm512_sub_ps(
            _mm512_mul_ps(k.d, _mm512_cvtepi32_ps(isum)),
            _mm512_mul_ps(k.dmin, _mm512_cvtepi32_ps(mins)),
        );
        _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(xb.d), t))
    }
}

/// The `m` activation rows (a chunk of at most [`crate::matmul::M_CHUNK`]) against up to
/// sixteen weight rows: for each super-block the rows are decoded once and the activation rows
/// run over it `WIDTH` at a time, the float accumulators in memory across super-blocks.
#[inline(always)]
unsafe fn sweep_k<const Q6: bool>(
    (w, stride): (&[u8], usize),
    rows: usize,
    x: &[Q8KBlock],
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    let bb = if Q6 { 210 } else { 144 };
    let nb = stride / bb;
    let p = row_pointers(w, stride, rows);
    let next = w.as_ptr().wrapping_add(HEIGHT * stride);
    let blk = DECODED.with(|b| b.get());
    // SAFETY: see the module docs; `blk` is this thread's, and nothing else borrows it while
    // this runs (the kernels do not call each other).
    unsafe {
        let blk = &mut *blk;
        let mut acc = [_mm512_setzero_ps(); crate::matmul::M_CHUNK];
        for b in 0..nb {
            // The next tile's share of this block, so its reads stay one tile ahead.
            let ahead = next.wrapping_add(HEIGHT * bb * b);
            for off in (0..HEIGHT * bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(off) as *const i8);
            }
            if Q6 {
                decode_q6_k(&p, b, blk);
            } else {
                decode_q4_k(&p, b, blk);
            }
            let mut c0 = 0;
            while c0 < m {
                let cw = (m - c0).min(WIDTH);
                macro_rules! go {
                    ($c:literal) => {{
                        let xb: [&Q8KBlock; $c] =
                            core::array::from_fn(|c| x.get_unchecked((c0 + c) * nb + b));
                        let (t, mn) = sums::<$c, Q6>(blk, &xb);
                        for c in 0..$c {
                            acc[c0 + c] = finish::<Q6>(blk, xb[c], (t[c], mn[c]), acc[c0 + c]);
                        }
                    }};
                }
                match cw {
                    1 => go!(1),
                    2 => go!(2),
                    3 => go!(3),
                    4 => go!(4),
                    5 => go!(5),
                    6 => go!(6),
                    7 => go!(7),
                    _ => go!(8),
                }
                c0 += cw;
            }
        }
        let keep = ((1u32 << rows) - 1) as u16;
        for (c, a) in acc.iter().enumerate().take(m) {
            _mm512_mask_storeu_ps(y.add(c * ldy), keep, *a);
        }
    }
}

/// Q4_K.
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
    // SAFETY: see the module docs.
    unsafe { sweep_k::<false>((w, stride), rows, x, m, y, ldy) }
}

/// Q6_K.
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
    // SAFETY: see the module docs.
    unsafe { sweep_k::<true>((w, stride), rows, x, m, y, ldy) }
}
