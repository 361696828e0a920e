//! Portable dot products of one weight row with one activation row: the semantic reference for
//! every SIMD path (same per-block formulas; k-quant integer sums are exact, so the SIMD k-quant
//! kernels reproduce these results bit for bit).

use crate::act::{Q8Block, Q8KBlock};
use u_sdk::quant::{bf16_to_f32, f16_to_f32};

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    half_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Exact IEEE binary16 → f32 with integer operations and one rarely taken branch (subnormals,
/// infinities, NaN); equal to [`u_sdk::quant::f16_to_f32`] for every input (tested).
#[inline(always)]
pub fn half_to_f32(h: u16) -> f32 {
    let o = u32::from(h & 0x7fff) << 13;
    let exp = o & (0x7c00 << 13);
    let sign = u32::from(h & 0x8000) << 16;
    let bits = if exp == 0 || exp == 0x7c00 << 13 {
        return f16_to_f32(h);
    } else {
        o + ((127 - 15) << 23)
    };
    f32::from_bits(bits | sign)
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`).
#[inline(always)]
pub(crate) fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        if j < 4 {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
            mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
    }
    (sc, mn)
}

/// `Σ m_j · (bsums[2j] + bsums[2j+1])`: the minimum's share of a Q4_K/Q5_K super-block.
#[inline(always)]
pub(crate) fn k_min_sum(mn: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| i32::from(mn[j]) * (i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1])))
        .sum()
}

/// f32 weights.
pub fn f32_row(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(4)
        .zip(x)
        .map(|(b, &v)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * v)
        .sum()
}

/// f16 weights.
pub fn f16_row(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2)
        .zip(x)
        .map(|(b, &v)| f16_to_f32(u16::from_le_bytes([b[0], b[1]])) * v)
        .sum()
}

/// bf16 weights.
pub fn bf16_row(w: &[u8], x: &[f32]) -> f32 {
    w.chunks_exact(2)
        .zip(x)
        .map(|(b, &v)| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])) * v)
        .sum()
}

/// Q8_0: `d·q`.
pub fn q8_0(w: &[u8], x: &[Q8Block]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(34).zip(x) {
        let d = f16_at(b, 0);
        let sumi: i32 = b[2..34]
            .iter()
            .zip(&xb.qs)
            .map(|(&q, &v)| i32::from(q as i8) * i32::from(v))
            .sum();
        acc += d * (xb.d * sumi as f32);
    }
    acc
}

/// Sum of `q_u8 · x` for the 32 unsigned values of a Q4_0/Q4_1 block.
#[inline(always)]
fn nib_dot(qs: &[u8], x: &[i8; 32]) -> i32 {
    let mut s = 0i32;
    for l in 0..16 {
        s += i32::from(qs[l] & 15) * i32::from(x[l]) + i32::from(qs[l] >> 4) * i32::from(x[l + 16]);
    }
    s
}

/// Q4_0: `d·(q − 8)`.
pub fn q4_0(w: &[u8], x: &[Q8Block]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(18).zip(x) {
        let d = f16_at(b, 0);
        let sumi = nib_dot(&b[2..18], &xb.qs);
        acc += d * (xb.d * sumi as f32) - 8.0 * (d * xb.s);
    }
    acc
}

/// Q4_1: `d·q + m`.
pub fn q4_1(w: &[u8], x: &[Q8Block]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(20).zip(x) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let sumi = nib_dot(&b[4..20], &xb.qs);
        acc += d * (xb.d * sumi as f32) + m * xb.s1;
    }
    acc
}

/// Q5_0: `d·(q − 16)`, the fifth bit of value `i` in bit `i` of `qh`.
pub fn q5_0(w: &[u8], x: &[Q8Block]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(22).zip(x) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        let mut sumi = 0i32;
        for (l, &q) in qs.iter().enumerate() {
            let lo = (q & 15) | ((((qh >> l) & 1) as u8) << 4);
            let hi = (q >> 4) | ((((qh >> (l + 16)) & 1) as u8) << 4);
            sumi += i32::from(lo) * i32::from(xb.qs[l]) + i32::from(hi) * i32::from(xb.qs[l + 16]);
        }
        acc += d * (xb.d * sumi as f32) - 16.0 * (d * xb.s);
    }
    acc
}

/// Q4_K: `(d·sc)·q − dmin·m` per 32-value sub-block.
pub fn q4_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(144).zip(x) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, mn) = k_scale_min(&b[4..16]);
        let qs = &b[16..144];
        let mut sumi = 0i32;
        for j in 0..4 {
            let (mut s0, mut s1) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[32 * j + l];
                s0 += i32::from(q & 15) * i32::from(xb.qs[64 * j + l]);
                s1 += i32::from(q >> 4) * i32::from(xb.qs[64 * j + 32 + l]);
            }
            sumi += i32::from(sc[2 * j]) * s0 + i32::from(sc[2 * j + 1]) * s1;
        }
        let summ = k_min_sum(&mn, &xb.bsums);
        acc += xb.d * (d * sumi as f32 - dmin * summ as f32);
    }
    acc
}

/// Q5_K: as Q4_K with a fifth bit from `qh`.
pub fn q5_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(176).zip(x) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let (sc, mn) = k_scale_min(&b[4..16]);
        let qh = &b[16..48];
        let qs = &b[48..176];
        let mut sumi = 0i32;
        for j in 0..4 {
            let (mut s0, mut s1) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[32 * j + l];
                let h0 = ((qh[l] >> (2 * j)) & 1) << 4;
                let h1 = ((qh[l] >> (2 * j + 1)) & 1) << 4;
                s0 += i32::from((q & 15) | h0) * i32::from(xb.qs[64 * j + l]);
                s1 += i32::from((q >> 4) | h1) * i32::from(xb.qs[64 * j + 32 + l]);
            }
            sumi += i32::from(sc[2 * j]) * s0 + i32::from(sc[2 * j + 1]) * s1;
        }
        let summ = k_min_sum(&mn, &xb.bsums);
        acc += xb.d * (d * sumi as f32 - dmin * summ as f32);
    }
    acc
}

/// Q6_K: `d·sc·(q − 32)` with an int8 scale per 16 values.
pub fn q6_k(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(210).zip(x) {
        let ql = &b[0..128];
        let qh = &b[128..192];
        let sc = &b[192..208];
        let d = f16_at(b, 208);
        let mut sumi = 0i32;
        for (g, &s) in sc.iter().enumerate() {
            let mut sg = 0i32;
            for e in 0..16 {
                let i = 16 * g + e;
                let (j, r) = (i / 128, i % 128);
                let lo = (ql[j * 64 + r % 64] >> (4 * (r / 64))) & 0xf;
                let hi = (qh[j * 32 + r % 32] >> (2 * (r / 32))) & 3;
                sg += i32::from(lo | (hi << 4)) * i32::from(xb.qs[i]);
            }
            sumi += i32::from(s as i8) * (sg - 32 * i32::from(xb.bsums[g]));
        }
        acc += (d * xb.d) * sumi as f32;
    }
    acc
}

/// TQ2_0: `d·(q − 1)`, q ∈ {0, 1, 2} in 2-bit fields.
pub fn tq2_0(w: &[u8], x: &[Q8KBlock]) -> f32 {
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(66).zip(x) {
        let d = f16_at(b, 64);
        let mut sumi = 0i32;
        for j in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let q = (b[32 * j + l] >> (2 * s)) & 3;
                    sumi += i32::from(q) * i32::from(xb.qs[128 * j + 32 * s + l]);
                }
            }
        }
        let sumx: i32 = xb.bsums.iter().map(|&v| i32::from(v)).sum();
        acc += (d * xb.d) * (sumi - sumx) as f32;
    }
    acc
}

/// TQ1_0: `d·(t − 1)`, trits t ∈ {0, 1, 2} packed five (the last four) to a byte as a base-3
/// fraction; multiplying a byte by 3ⁿ (mod 256) brings trit n to the top, `(byte·3) >> 8` reads
/// it. The integer sum is exact, so only the per-block scaling order is float.
pub fn tq1_0(w: &[u8], x: &[Q8KBlock]) -> f32 {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let mut acc = 0f32;
    for (b, xb) in w.chunks_exact(54).zip(x) {
        let d = f16_at(b, 52);
        let mut sumi = 0i32;
        // (packed bytes, trits per byte, first value): 32 bytes × 5, 16 × 5, then qh 4 × 4.
        for (at, len, trits, first) in [(0, 32, 5, 0), (32, 16, 5, 160), (48, 4, 4, 240)] {
            for (n, &pow) in POW3[..trits].iter().enumerate() {
                for m in 0..len {
                    let t = (u16::from(b[at + m].wrapping_mul(pow)) * 3) >> 8;
                    sumi += i32::from(t) * i32::from(xb.qs[first + n * len + m]);
                }
            }
        }
        let sumx: i32 = xb.bsums.iter().map(|&v| i32::from(v)).sum();
        acc += (d * xb.d) * (sumi - sumx) as f32;
    }
    acc
}

/// Multi-row forms of the one-row kernels (`R` activation rows against one weight row), with
/// the signature of the SIMD kernels.
macro_rules! rows {
    ($($name:ident = $one:ident($b:ty);)*) => {$(
        #[doc = concat!("[`", stringify!($one), "`] for `R` activation rows.")]
        pub fn $name<const R: usize>(w: &[u8], xs: &[&[$b]; R]) -> [f32; R] {
            core::array::from_fn(|r| $one(w, xs[r]))
        }
    )*};
}

rows! {
    q8_0_n = q8_0(Q8Block);
    q4_0_n = q4_0(Q8Block);
    q4_1_n = q4_1(Q8Block);
    q5_0_n = q5_0(Q8Block);
    q4_k_n = q4_k(Q8KBlock);
    q5_k_n = q5_k(Q8KBlock);
    q6_k_n = q6_k(Q8KBlock);
    tq1_0_n = tq1_0(Q8KBlock);
    tq2_0_n = tq2_0(Q8KBlock);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_conversion_equals_the_sdk_for_every_input() {
        for h in 0..=u16::MAX {
            let (a, b) = (half_to_f32(h), f16_to_f32(h));
            assert_eq!(a.to_bits(), b.to_bits(), "{h:#06x}");
        }
    }
}
