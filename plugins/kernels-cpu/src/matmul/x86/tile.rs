//! Tile kernels for Q4_0, Q4_1, Q5_0, Q8_0 (32-value blocks) and Q4_K, Q6_K (256-value
//! super-blocks): eight weight rows against any number of activation rows, the eight weight rows
//! in the eight i32/f32 lanes.
//!
//! Why this shape: dotting one weight row with one activation row leaves a block's integer sum
//! spread over eight lanes, and scaling it then costs a convert, a multiply and an FMA per row
//! pair and block. Here each block of eight rows is transposed in registers once (lane `r` of
//! vector `g` = the four codes of group `g`, values `4g..4g + 4`, of row `r`), the activation's
//! matching four bytes are broadcast, and `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd` on AVX2)
//! leaves every row's block sum in its own lane. The float work per block and activation row is
//! then one convert, one multiply and two FMAs for all eight weight rows, and the transpose is
//! shared by every activation row of the tile. The block scales of the eight rows come in with
//! eight scalar loads. The k-quant super-blocks are decoded once into memory (codes, and the
//! integer sub-block scales and minimums, rows in lanes), then every activation row of the
//! chunk runs over them; their integer sums are exact and the float steps those of the scalar
//! kernel, so they equal it bit for bit.
//!
//! Every output is computed by the same operations in the same order whatever the number of
//! activation rows, the tile width, or where its row falls in a tile (rows past the end of the
//! matrix repeat the last row and are not stored), so a row's result never depends on its batch
//! neighbours: decode, prefill and batched decode agree bit for bit.
//!
//! # Safety
//! Every `unsafe fn` needs the CPU features of its `#[target_feature]` attribute, `w` holding
//! `rows` (1–8) rows of `stride` bytes of whole blocks, `x` holding `m` rows of
//! `stride / block_bytes` blocks, and `y` writable at `c·ldy + r` for `c < m`, `r < rows`;
//! [`crate::matmul`] guarantees all of it.

use super::*;

/// One block of eight weight rows, rows in lanes.
#[derive(Clone, Copy)]
struct Block8 {
    /// Codes of groups 0–7 (four values each): the unsigned operand of the integer dot.
    q: [__m256i; 8],
    /// Each row's scale.
    d: __m256,
    /// Each row's offset coefficient, multiplied by the activation's sum term (`−8·d` for
    /// Q4_0, the minimum for Q4_1, `−16·d` for Q5_0; unused for Q8_0).
    off: __m256,
}

/// The eight row pointers of a tile of `rows` rows (the last row repeated past `rows`).
#[inline(always)]
fn row_pointers(w: &[u8], stride: usize, rows: usize) -> [*const u8; 8] {
    core::array::from_fn(|r| w.as_ptr().wrapping_add(r.min(rows - 1) * stride))
}

/// The f16 pairs at `p[r] + o` of the eight rows: (first halves, second halves) as f32, lane
/// `r` from row `r`. Built from eight scalar loads (`vpgatherdd` was slower here).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn halves(p: &[*const u8; 8], o: usize) -> (__m256, __m256) {
    // SAFETY: the caller passes rows with four readable bytes at `o`.
    let v: [i32; 8] =
        core::array::from_fn(|r| unsafe { (p[r].add(o) as *const i32).read_unaligned() });
    let g = _mm256_setr_epi32(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    // Per 128-bit lane: first halves into bytes 0–7, second halves into 8–15.
    let split = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
        10, 11, 14, 15,
    );
    let v = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(g, split));
    (
        _mm256_cvtph_ps(_mm256_castsi256_si128(v)),
        _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(v)),
    )
}

/// The 16 bytes at `p[r] + o` of the eight rows, transposed into four vectors: lane `r` of
/// vector `j` = bytes `4j..4j + 4` of row `r`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose16(p: &[*const u8; 8], o: usize) -> [__m256i; 4] {
    // SAFETY: the caller passes rows with 16 readable bytes at `o`.
    let a: [__m256i; 4] = core::array::from_fn(|r| unsafe {
        let lo = _mm_loadu_si128(p[r].add(o) as *const __m128i);
        let hi = _mm_loadu_si128(p[r + 4].add(o) as *const __m128i);
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi)
    });
    let t0 = _mm256_unpacklo_epi32(a[0], a[1]);
    let t1 = _mm256_unpackhi_epi32(a[0], a[1]);
    let t2 = _mm256_unpacklo_epi32(a[2], a[3]);
    let t3 = _mm256_unpackhi_epi32(a[2], a[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// 16 bytes of packed nibbles (byte `j`: value `j` low, value `j + 16` high) of eight rows as
/// the eight group vectors of codes 0–15.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibble_groups(p: &[*const u8; 8], o: usize) -> [__m256i; 8] {
    // SAFETY: as for `transpose16`.
    let t = unsafe { transpose16(p, o) };
    let m4 = _mm256_set1_epi8(0x0f);
    core::array::from_fn(|g| {
        if g < 4 {
            _mm256_and_si256(t[g], m4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(t[g - 4]), m4)
        }
    })
}

/// Adds Q5_0's fifth bits to `q`: lane `r` of `qh` holds row `r`'s 32 high bits (bit `v` for
/// value `v`), which become 16 in byte `i` of group `g` where bit `4g + i` is set.
#[inline]
#[target_feature(enable = "avx2")]
fn add_high_bits(q: &mut [__m256i; 8], qh: __m256i) {
    let base = _mm256_setr_epi8(
        0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12,
        12, 12, 12,
    );
    let bits = [
        _mm256_set1_epi32(0x0804_0201),
        _mm256_set1_epi32(0x8040_2010u32 as i32),
    ];
    for (g, v) in q.iter_mut().enumerate() {
        // Byte g/2 of each row's bits into all four bytes of its lane, then one bit per byte.
        let spread = _mm256_shuffle_epi8(qh, _mm256_add_epi8(base, _mm256_set1_epi8(g as i8 / 2)));
        let mask = bits[g % 2];
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
        *v = _mm256_or_si256(*v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
}

/// The 32 bytes at `p[r] + o` of the eight rows as eight group vectors (lane `r` of vector `g`
/// = bytes `4g..4g + 4` of row `r`).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose32(p: &[*const u8; 8], o: usize) -> [__m256i; 8] {
    // SAFETY: the caller passes rows with 32 readable bytes at `o`.
    let (lo, hi) = unsafe { (transpose16(p, o), transpose16(p, o + 16)) };
    core::array::from_fn(|g| if g < 4 { lo[g] } else { hi[g - 4] })
}

/// Byte `i` (0–3) of every i32 lane, zero-extended.
#[inline(always)]
fn byte_of(v: __m256i, i: u32) -> __m256i {
    // SAFETY (features): only called from functions with AVX2 enabled.
    unsafe {
        _mm256_and_si256(
            _mm256_srlv_epi32(v, _mm256_set1_epi32(8 * i as i32)),
            _mm256_set1_epi32(0xff),
        )
    }
}

/// Byte `i` (0–3) of every i32 lane, sign-extended.
#[inline(always)]
fn signed_byte_of(v: __m256i, i: u32) -> __m256i {
    // SAFETY (features): only called from functions with AVX2 enabled.
    unsafe { _mm256_srai_epi32::<24>(_mm256_sllv_epi32(v, _mm256_set1_epi32(8 * (3 - i) as i32))) }
}

/// One 256-value super-block of eight weight rows, rows in lanes (decoded into memory once and
/// reused by every activation row of the tile).
struct SuperBlock8 {
    /// Codes of the 64 four-value groups.
    q: [__m256i; 64],
    /// Integer scale of each sub-block (8 of 32 values for Q4_K, 16 of 16 for Q6_K).
    sc: [Scale; 16],
    /// Q6_K's scales in i16 pairs (lane `r`: scales `2g` and `2g + 1` of row `r`), for the
    /// `−32·Σ sc·Σx` offset term in one pair-dot per two sub-blocks.
    sc_pairs: [__m256i; 8],
    /// Q4_K's minimum of each 32-value sub-block.
    mn: [__m256i; 8],
    /// Super-block scale.
    d: __m256,
    /// Q4_K's scale of the minimums.
    dmin: __m256,
}

thread_local! {
    /// Each thread's [`SuperBlock8`], decoded into by the k-quant kernels.
    static DECODED: core::cell::UnsafeCell<SuperBlock8> =
        // SAFETY: all-zero bits are valid vectors.
        const { core::cell::UnsafeCell::new(unsafe { core::mem::zeroed() }) };
}

/// The four activation bytes of group `g` of `b` in every lane.
#[inline(always)]
unsafe fn group(b: &Q8Block, g: usize) -> __m256i {
    // SAFETY: g < 8, so the four bytes lie inside `qs`.
    unsafe { _mm256_set1_epi32((b.qs.as_ptr() as *const i32).add(g).read_unaligned()) }
}

/// Prefetches into L1 the share of block `b` of the next eight-row group (`8·bb` bytes a block):
/// the groups lie back to back from `next`, so spreading the next group's bytes over this
/// group's blocks keeps the reads one group ahead, whichever task takes that group.
#[inline(always)]
fn prefetch_next(next: *const u8, b: usize, bb: usize) {
    let at = next.wrapping_add(8 * bb * b);
    for off in (0..8 * bb).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address (computed with wrapping
        // arithmetic, so it may point past the weight without undefined behaviour).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(off) as *const i8) };
    }
}

/// The four activation bytes of group `g` (0–63) of a 256-value block in every lane.
#[inline(always)]
unsafe fn group_k(b: &Q8KBlock, g: usize) -> __m256i {
    // SAFETY: g < 64, so the four bytes lie inside `qs`.
    unsafe { _mm256_set1_epi32((b.qs.as_ptr() as *const i32).add(g).read_unaligned()) }
}

/// Decodes Q4_K super-block `b` (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and
/// minimums, 128 bytes of nibbles; value = d·sc·q − dmin·mn) of the eight rows.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode_q4_k(p: &[*const u8; 8], b: usize, out: &mut SuperBlock8) {
    let at = 144 * b;
    // SAFETY: every read lies inside block b of its row.
    unsafe {
        (out.d, out.dmin) = halves(p, at);
        // Scale bytes 0–11 (the 16-byte read ends inside the nibbles).
        let t = transpose16(p, at + 4);
        let s = |i: usize| byte_of(t[i / 4], (i % 4) as u32);
        let (m63, m15) = (_mm256_set1_epi32(63), _mm256_set1_epi32(15));
        for j in 0..8 {
            if j < 4 {
                out.sc[j] = Scale::new(_mm256_and_si256(s(j), m63));
                out.mn[j] = _mm256_and_si256(s(j + 4), m63);
            } else {
                let top = |v: __m256i| _mm256_slli_epi32::<4>(_mm256_srli_epi32::<6>(v));
                out.sc[j] = Scale::new(_mm256_or_si256(
                    _mm256_and_si256(s(j + 4), m15),
                    top(s(j - 4)),
                ));
                out.mn[j] = _mm256_or_si256(_mm256_srli_epi32::<4>(s(j + 4)), top(s(j)));
            }
        }
        let m4 = _mm256_set1_epi8(0x0f);
        for c in 0..4 {
            // Chunk c: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
            let raw = transpose32(p, at + 16 + 32 * c);
            for (g, &v) in raw.iter().enumerate() {
                out.q[16 * c + g] = _mm256_and_si256(v, m4);
                out.q[16 * c + 8 + g] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
            }
        }
    }
}

/// Decodes Q6_K super-block `b` (210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16
/// signed scales, f16 d; value = d·sc·(q − 32)) of the eight rows.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode_q6_k(p: &[*const u8; 8], b: usize, out: &mut SuperBlock8) {
    let at = 210 * b;
    // SAFETY: every read lies inside block b of its row (d is the high half at 206..210).
    unsafe {
        out.d = halves(p, at + 206).1;
        let t = transpose16(p, at + 192);
        for g in 0..16 {
            out.sc[g] = Scale::new(signed_byte_of(t[g / 4], (g % 4) as u32));
        }
        for g in 0..8 {
            let lo = _mm256_and_si256(out.sc[2 * g].wide, _mm256_set1_epi32(0xffff));
            out.sc_pairs[g] = _mm256_or_si256(lo, _mm256_slli_epi32::<16>(out.sc[2 * g + 1].wide));
        }
        let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(3));
        for j in 0..2 {
            let ql0 = transpose32(p, at + 64 * j);
            let ql1 = transpose32(p, at + 64 * j + 32);
            let qh = transpose32(p, at + 128 + 32 * j);
            for g in 0..8 {
                let h = qh[g];
                let hi = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, m2));
                let base = 32 * j;
                out.q[base + g] = _mm256_or_si256(_mm256_and_si256(ql0[g], m4), hi(h));
                out.q[base + 8 + g] =
                    _mm256_or_si256(_mm256_and_si256(ql1[g], m4), hi(_mm256_srli_epi16::<2>(h)));
                out.q[base + 16 + g] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql0[g]), m4),
                    hi(_mm256_srli_epi16::<4>(h)),
                );
                out.q[base + 24 + g] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(ql1[g]), m4),
                    hi(_mm256_srli_epi16::<6>(h)),
                );
            }
        }
    }
}

/// Stores the first `rows` lanes of each tile column `c` at `y + c·ldy`.
#[inline]
#[target_feature(enable = "avx")]
unsafe fn store<const C: usize>(acc: [__m256; C], y: *mut f32, ldy: usize, rows: usize) {
    for (c, a) in acc.into_iter().enumerate() {
        // SAFETY: the caller passes `y` writable at `c·ldy + r` for r < rows.
        unsafe {
            if rows == 8 {
                _mm256_storeu_ps(y.add(c * ldy), a);
            } else {
                let mut t = [0f32; 8];
                _mm256_storeu_ps(t.as_mut_ptr(), a);
                core::ptr::copy_nonoverlapping(t.as_ptr(), y.add(c * ldy), rows);
            }
        }
    }
}

/// The tile kernels for one ISA: `$dot(acc, u, s)` adds the four-byte dot products of unsigned
/// `u` and signed `s` to the i32 lanes of `acc`, `$groups` sums (and optionally scales) several
/// groups' dots ([`super::groups_vnni`], [`super::groups_avx2`]); `$vnni` says whether the dot
/// is `vpdpbusd` (no saturation, so Q8_0's signed weights can be offset by 128 instead of
/// sign-swapped).
macro_rules! tile_kernels {
    ($feat:literal, $dot:ident, $groups:ident, $vnni:literal, $width:literal) => {
        use super::*;

        /// Activation rows per tile (float accumulators kept in registers).
        const WIDTH: usize = $width;

        /// `Σ_g dot(q_g, x_g)` for one block of unsigned codes below 2^`BITS` (4 or 5).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn block_sum<const BITS: u32>(w: &Block8, xb: &Q8Block) -> __m256i {
            // SAFETY: groups 0–7 of a 32-byte block.
            unsafe {
                let x = |g: usize| group(xb, g);
                if BITS == 4 {
                    $groups::<8, 8>(|g| w.q[g], x, None)
                } else {
                    $groups::<8, 4>(|g| w.q[g], x, None)
                }
            }
        }

        /// Q8_0's block sum: the weights are signed, so either offset by 128 (`vpdpbusd`, the
        /// 128·Σx taken back exactly in the integer start value) or sign-swapped onto the
        /// activations (`vpmaddubsw` would saturate on 255·127 pairs).
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn block_sum_signed(w: &Block8, xb: &Q8Block) -> __m256i {
            // SAFETY: groups 0–7 of a 32-byte block.
            unsafe {
                if $vnni {
                    let flip = _mm256_set1_epi8(-128);
                    let mut s = [_mm256_set1_epi32(-128 * xb.sum), _mm256_setzero_si256()];
                    for g in 0..8 {
                        let u = _mm256_xor_si256(w.q[g], flip);
                        s[g % 2] = $dot(s[g % 2], u, group(xb, g));
                    }
                    _mm256_add_epi32(s[0], s[1])
                } else {
                    let mut s = [_mm256_setzero_si256(); 2];
                    for g in 0..8 {
                        let u = _mm256_sign_epi8(w.q[g], w.q[g]);
                        let x = _mm256_sign_epi8(group(xb, g), w.q[g]);
                        s[g % 2] = $dot(s[g % 2], u, x);
                    }
                    _mm256_add_epi32(s[0], s[1])
                }
            }
        }

        /// `C` activation rows (`x` from row 0 of the tile, `nb` blocks each) against the
        /// eight weight rows whose block `b` is `load(b)` (codes of `bits` bits: 4 or 5
        /// unsigned, 8 signed): per row pair and block,
        /// `acc ← fma(f32(Σq·x), d·d_x, acc)`, then `acc ← fma(off, sum_x, acc)` when the
        /// format has an offset term.
        #[inline(always)]
        unsafe fn tile<const C: usize>(
            (nb, bb, next): (usize, usize, *const u8),
            x: *const Q8Block,
            load: impl Fn(usize) -> Block8,
            bits: u32,
            off_sum: Option<fn(&Q8Block) -> f32>,
        ) -> [__m256; C] {
            // SAFETY: see the module docs; `x` holds C rows of `nb` blocks.
            unsafe {
                let mut acc = [_mm256_setzero_ps(); C];
                for b in 0..nb {
                    prefetch_next(next, b, bb);
                    let w = load(b);
                    for (c, a) in acc.iter_mut().enumerate() {
                        let xb = &*x.add(c * nb + b);
                        let s = match bits {
                            4 => block_sum::<4>(&w, xb),
                            5 => block_sum::<5>(&w, xb),
                            _ => block_sum_signed(&w, xb),
                        };
                        let dd = _mm256_mul_ps(w.d, _mm256_set1_ps(xb.d));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, *a);
                        if let Some(o) = off_sum {
                            *a = _mm256_fmadd_ps(w.off, _mm256_set1_ps(o(xb)), *a);
                        }
                    }
                }
                acc
            }
        }

        /// Every activation row through [`tile`], `WIDTH` at a time (the last tile narrower).
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn sweep(
            (w, stride, bb): (&[u8], usize, usize),
            rows: usize,
            x: &[Q8Block],
            m: usize,
            y: *mut f32,
            ldy: usize,
            load: impl Fn(usize) -> Block8 + Copy,
            bits: u32,
            off_sum: Option<fn(&Q8Block) -> f32>,
        ) {
            let nb = stride / bb;
            let next = w.as_ptr().wrapping_add(8 * stride);
            // SAFETY: see the module docs.
            unsafe {
                let mut c0 = 0;
                while c0 < m {
                    let cw = (m - c0).min(WIDTH);
                    let (xc, yc) = (x.as_ptr().add(c0 * nb), y.add(c0 * ldy));
                    macro_rules! go {
                        ($c:literal) => {
                            store(
                                tile::<$c>((nb, bb, next), xc, load, bits, off_sum),
                                yc,
                                ldy,
                                rows,
                            )
                        };
                    }
                    match cw {
                        1 => go!(1),
                        2 => go!(2),
                        3 => go!(3),
                        4 => go!(4),
                        5 if WIDTH > 4 => go!(5),
                        6 if WIDTH > 4 => go!(6),
                        7 if WIDTH > 4 => go!(7),
                        8 if WIDTH > 4 => go!(8),
                        _ => unreachable!("tile width {cw} > {WIDTH}"),
                    }
                    c0 += cw;
                }
            }
        }

        /// Q4_0 (18-byte blocks: f16 d, 16 bytes of nibbles; value = d·(q − 8)).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_0(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[Q8Block],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let p = row_pointers(w, stride, rows);
            let load = |b: usize| {
                // SAFETY: block b of each row: d at 0, nibbles at 2..18.
                unsafe {
                    let (d, _) = halves(&p, 18 * b);
                    let off = _mm256_mul_ps(d, _mm256_set1_ps(-8.0));
                    Block8 {
                        q: nibble_groups(&p, 18 * b + 2),
                        d,
                        off,
                    }
                }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 18), rows, x, m, y, ldy, load, 4, Some(|b| b.s)) }
        }

        /// Q4_1 (20-byte blocks: f16 d, f16 m, 16 bytes of nibbles; value = d·q + m).
        #[target_feature(enable = $feat)]
        pub unsafe fn q4_1(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[Q8Block],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let p = row_pointers(w, stride, rows);
            let load = |b: usize| {
                // SAFETY: block b of each row: d at 0, m at 2, nibbles at 4..20.
                unsafe {
                    let (d, off) = halves(&p, 20 * b);
                    Block8 {
                        q: nibble_groups(&p, 20 * b + 4),
                        d,
                        off,
                    }
                }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 20), rows, x, m, y, ldy, load, 4, Some(|b| b.s1)) }
        }

        /// Q5_0 (22-byte blocks: f16 d, 32 fifth bits, 16 bytes of nibbles; value =
        /// d·(q − 16)).
        #[target_feature(enable = $feat)]
        pub unsafe fn q5_0(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[Q8Block],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let p = row_pointers(w, stride, rows);
            let load = |b: usize| {
                // SAFETY: block b of each row: d at 0, qh at 2..6, nibbles at 6..22.
                unsafe {
                    let (d, _) = halves(&p, 22 * b);
                    let qh: [i32; 8] = core::array::from_fn(|r| {
                        (p[r].add(22 * b + 2) as *const i32).read_unaligned()
                    });
                    let qh = _mm256_loadu_si256(qh.as_ptr() as *const __m256i);
                    let mut q = nibble_groups(&p, 22 * b + 6);
                    add_high_bits(&mut q, qh);
                    let off = _mm256_mul_ps(d, _mm256_set1_ps(-16.0));
                    Block8 { q, d, off }
                }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 22), rows, x, m, y, ldy, load, 5, Some(|b| b.s)) }
        }

        /// Q8_0 (34-byte blocks: f16 d, 32 signed bytes; value = d·q).
        #[target_feature(enable = $feat)]
        pub unsafe fn q8_0(
            w: &[u8],
            stride: usize,
            rows: usize,
            x: &[Q8Block],
            m: usize,
            y: *mut f32,
            ldy: usize,
        ) {
            let p = row_pointers(w, stride, rows);
            let load = |b: usize| {
                // SAFETY: block b of each row: d at 0, codes at 2..34.
                unsafe {
                    let (d, _) = halves(&p, 34 * b);
                    let q = transpose32(&p, 34 * b + 2);
                    Block8 { q, d, off: d }
                }
            };
            // SAFETY: see the module docs.
            unsafe { sweep((w, stride, 34), rows, x, m, y, ldy, load, 8, None) }
        }
    };
}

/// The k-quant tile kernels (Q4_K, Q6_K) for one ISA, beside [`tile_kernels`]' items: `$dotw`
/// the i16 pair-dot, `$feat` and `$groups` as there. On VNNI the sixteen-row tiles of [`super::tile16`]
/// take their place.
macro_rules! k_tile_kernels {
    ($feat:literal, $dotw:ident, $groups:ident) => {
        /// The exact integer sums of super-block `k` against `C` activation blocks: Q4_K
        /// `Σ_j sc_j·Σ q·x` over 32-value sub-blocks, Q6_K `Σ_j sc_j·Σ (q − 32)·x` over
        /// 16-value ones. Each sub-block's codes are loaded once for the `C` rows.
        #[inline(always)]
        unsafe fn k_sums<const C: usize, const Q6: bool>(
            k: &SuperBlock8,
            xb: &[&Q8KBlock; C],
        ) -> [__m256i; C] {
            // SAFETY: groups 0–63 of 256-value blocks.
            unsafe {
                let mut total = [_mm256_setzero_si256(); C];
                if Q6 {
                    // The offset: −32·Σ_j sc_j·Σx_j, two sub-blocks per pair-dot (the bsums
                    // of sub-blocks 2g and 2g + 1 are one broadcast i16 pair).
                    for (c, t) in total.iter_mut().enumerate() {
                        let mut off = _mm256_setzero_si256();
                        for (g, &pair) in k.sc_pairs.iter().enumerate() {
                            let sums = (xb[c].bsums.as_ptr() as *const i32).add(g).read_unaligned();
                            off = $dotw(off, pair, _mm256_set1_epi32(sums));
                        }
                        *t = _mm256_sub_epi32(*t, _mm256_slli_epi32::<5>(off));
                    }
                }
                let (subs, per) = if Q6 { (16, 4) } else { (8, 8) };
                for j in 0..subs {
                    let q = &k.q[per * j..per * (j + 1)];
                    for c in 0..C {
                        let x = |g: usize| group_k(xb[c], per * j + g);
                        // The scaled sum in one step: 4-bit codes, 8 groups; 6-bit, 4.
                        let s = if Q6 {
                            $groups::<4, 2>(|g| q[g], x, Some(&k.sc[j]))
                        } else {
                            $groups::<8, 8>(|g| q[g], x, Some(&k.sc[j]))
                        };
                        total[c] = _mm256_add_epi32(total[c], s);
                    }
                }
                total
            }
        }

        /// Adds one super-block's share to `acc` with the scalar kernel's float operations
        /// (Q4_K: `d_x·(d·isum − dmin·Σ mn_j·Σx_j)`; Q6_K: `(d·d_x)·isum`).
        #[inline(always)]
        unsafe fn k_finish<const Q6: bool>(
            k: &SuperBlock8,
            xb: &Q8KBlock,
            isum: __m256i,
            acc: __m256,
        ) -> __m256 {
            // SAFETY: plain vector arithmetic (the caller has the features).
            unsafe {
                if Q6 {
                    let dd = _mm256_mul_ps(k.d, _mm256_set1_ps(xb.d));
                    return _mm256_add_ps(acc, _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
                }
                let mut summ = _mm256_setzero_si256();
                for j in 0..8 {
                    let pair = i32::from(xb.bsums[2 * j]) + i32::from(xb.bsums[2 * j + 1]);
                    let p = _mm256_mullo_epi32(k.mn[j], _mm256_set1_epi32(pair));
                    summ = _mm256_add_epi32(summ, p);
                }
                let t = _mm256_sub_ps(
                    _mm256_mul_ps(k.d, _mm256_cvtepi32_ps(isum)),
                    _mm256_mul_ps(k.dmin, _mm256_cvtepi32_ps(summ)),
                );
                _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(xb.d), t))
            }
        }

        /// The 256-value formats (Q6_K, or Q4_K): for each super-block the eight rows are
        /// decoded once into memory, and the activation rows (up to
        /// [`crate::matmul::M_CHUNK`]) run over it `WIDTH` at a time; the float accumulators
        /// live in memory across super-blocks.
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
            let next = w.as_ptr().wrapping_add(8 * stride);
            // The thread's decoded super-block: every field a kernel reads, the decoder
            // writes first, so it is not cleared per call (3.6 KB a call was 5% of a Q6_K
            // prefill).
            let blk = DECODED.with(|b| b.get());
            // SAFETY: see the module docs; m ≤ M_CHUNK activation rows of `nb` blocks. `blk`
            // is this thread's, and no other borrow of it lives while this runs (the kernels
            // do not call each other).
            unsafe {
                let blk = &mut *blk;
                let mut acc = [_mm256_setzero_ps(); crate::matmul::M_CHUNK];
                for b in 0..nb {
                    prefetch_next(next, b, bb);
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
                                let sums = k_sums::<$c, Q6>(blk, &xb);
                                for c in 0..$c {
                                    acc[c0 + c] = k_finish::<Q6>(blk, xb[c], sums[c], acc[c0 + c]);
                                }
                            }};
                        }
                        match cw {
                            1 => go!(1),
                            2 => go!(2),
                            3 => go!(3),
                            4 => go!(4),
                            5 if WIDTH > 4 => go!(5),
                            6 if WIDTH > 4 => go!(6),
                            7 if WIDTH > 4 => go!(7),
                            8 if WIDTH > 4 => go!(8),
                            _ => unreachable!("tile width {cw} > {WIDTH}"),
                        }
                        c0 += cw;
                    }
                }
                for (c, a) in acc.iter().enumerate().take(m) {
                    store([*a], y.add(c * ldy), ldy, rows);
                }
            }
        }

        /// Q4_K.
        #[target_feature(enable = $feat)]
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
        #[target_feature(enable = $feat)]
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
    };
}

/// AVX2 tile kernels (`vpmaddubsw` + `vpmaddwd`; 16 vector registers, so four activation rows
/// per tile).
pub mod avx2 {
    tile_kernels!("avx2,fma,f16c", dot_avx2, groups_avx2, false, 4);
    k_tile_kernels!("avx2,fma,f16c", dotw_avx2, groups_avx2);
}

/// AVX-512 VNNI tile kernels (`vpdpbusd` on 256-bit vectors): the 32-value formats' decode
/// (one activation row); with several, [`super::tile16`] runs sixteen weight rows wide.
pub mod vnni {
    tile_kernels!(
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        dot_vnni,
        groups_vnni,
        true,
        8
    );
}
