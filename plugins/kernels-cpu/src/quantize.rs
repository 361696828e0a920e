//! Quantization of `f32` values into ggml's stored block formats, as ggml's reference
//! quantizers (`quantize_row_*_ref`, what `llama-quantize` uses without an importance matrix)
//! compute them, operation for operation, so the blocks are byte-identical to theirs.
//!
//! - 32-value blocks: Q8_0 (`d = amax/127`, codes rounded half away from zero), Q4_0 and Q5_0
//!   (`d = max/−8` or `max/−16` from the value of largest magnitude, codes truncated after
//!   adding 8.5 or 16.5), Q4_1 and Q5_1 (scale and minimum from the range).
//! - k-quants in 256-value super-blocks: Q4_K and Q5_K fit a scale and minimum to each 32-value
//!   sub-block by a weighted least-squares search over candidate scales (weights `rms + |x|`),
//!   then store both as 6-bit multiples of two f16 super-block scales; Q6_K fits a signed scale
//!   to each 16-value sub-block (weights `x²`, 19 candidate scales) stored as int8 multiples of
//!   one f16 scale.
//! - Ternary TQ1_0 (five trits per byte as a fixed-point fraction of 3⁵) and TQ2_0 (two bits per
//!   value), scale `amax`.
//!
//! Every sum runs in the reference's order in `f32` and no product is fused, since the
//! reference is compiled without FMA contraction; `nearest_int` is round half to even (the
//! reference's magic-number trick), `round` is half away from zero (`roundf`, `lroundf`).

use crate::act::f32_to_f16_bits;
use u_sdk::{DType, quant::f16_to_f32};

/// The formats [`quantize`] writes.
pub const QUANTIZABLE: [DType; 10] = [
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::TQ1_0,
    DType::TQ2_0,
];

/// Quantizes `x` (a whole number of `dtype` blocks) into `out` (exactly their bytes); `None`
/// when `dtype` is not one of [`QUANTIZABLE`] or the lengths do not match.
pub fn quantize(dtype: DType, x: &[f32], out: &mut [u8]) -> Option<()> {
    let (bs, bb) = (dtype.block_size(), dtype.block_bytes());
    if !x.len().is_multiple_of(bs) || out.len() != x.len() / bs * bb {
        return None;
    }
    let block: fn(&[f32], &mut [u8]) = match dtype {
        DType::Q4_0 => |x, o| q4_0_or_q5_0(x, o, 4),
        DType::Q5_0 => |x, o| q4_0_or_q5_0(x, o, 5),
        DType::Q4_1 => |x, o| q4_1_or_q5_1(x, o, 4),
        DType::Q5_1 => |x, o| q4_1_or_q5_1(x, o, 5),
        DType::Q8_0 => q8_0,
        DType::Q4_K => |x, o| q4_k_or_q5_k(x, o, 4),
        DType::Q5_K => |x, o| q4_k_or_q5_k(x, o, 5),
        DType::Q6_K => q6_k,
        DType::TQ1_0 => tq1_0,
        DType::TQ2_0 => tq2_0,
        _ => return None,
    };
    for (xb, ob) in x.chunks_exact(bs).zip(out.chunks_exact_mut(bb)) {
        block(xb, ob);
    }
    Some(())
}

fn put_f16(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f32_to_f16_bits(v).to_le_bytes());
}

/// `v` rounded to f16 and back.
fn via_f16(v: f32) -> f32 {
    f16_to_f32(f32_to_f16_bits(v))
}

/// Round half to even by adding 1.5·2²³ and reading the low mantissa bits (|v| < 2²²).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// The value of largest magnitude (the first of equal magnitudes) and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

fn q8_0(x: &[f32], o: &mut [u8]) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, d);
    for (q, &v) in o[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// Q4_0 (`bits` 4) or Q5_0 (5): `d = max / −2^(bits−1)`, codes `trunc(x/d + offset + ½)`.
fn q4_0_or_q5_0(x: &[f32], o: &mut [u8], bits: u32) {
    let half = (1u32 << (bits - 1)) as f32;
    let top = (1i32 << bits) - 1;
    let (max, _) = signed_max(x);
    let d = max / -half;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, d);
    let code = |v: f32| top.min(i32::from((v * id + (half + 0.5)) as i8)) as u8;
    let qs = if bits == 5 { 6 } else { 2 };
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (code(x[j]), code(x[j + 16]));
        o[qs + j] = (a & 0xf) | ((b & 0xf) << 4);
        qh |= u32::from(a >> 4) << j | u32::from(b >> 4) << (j + 16);
    }
    if bits == 5 {
        o[2..6].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Q4_1 (`bits` 4) or Q5_1 (5): `d = (max − min) / (2^bits − 1)`, codes `trunc((x−min)/d + ½)`.
fn q4_1_or_q5_1(x: &[f32], o: &mut [u8], bits: u32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        min = min.min(v);
        max = max.max(v);
    }
    let d = (max - min) / ((1u32 << bits) - 1) as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(o, d);
    put_f16(&mut o[2..], min);
    let code = |v: f32| {
        let c = (v - min) * id + 0.5;
        if bits == 4 {
            15.min(i32::from(c as i8)) as u8
        } else {
            c as u8
        }
    };
    let qs = if bits == 5 { 8 } else { 4 };
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (code(x[j]), code(x[j + 16]));
        o[qs + j] = (a & 0xf) | ((b & 0xf) << 4);
        qh |= u32::from(a >> 4) << j | u32::from(b >> 4) << (j + 16);
    }
    if bits == 5 {
        o[4..8].copy_from_slice(&qh.to_le_bytes());
    }
}

/// ggml's `make_qkx2_quants`: codes `l ∈ [0, nmax]` and `(scale, −min)` minimising the
/// weighted squared error of `scale·l + min`, trying `nstep + 1` scales around `nmax/range`.
fn fit_affine(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    l: &mut [u8],
) -> (f32, f32) {
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..x.len() {
        min = if x[i] < min { x[i] } else { min };
        max = if x[i] > max { x[i] } else { max };
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..x.len() {
        l[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        let diff = scale * f32::from(l[i]) + min - x[i];
        best += w[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..x.len() {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let q = q as f32;
            sum_l += w[i] * q;
            sum_l2 += w[i] * q * q;
            sum_xl += w[i] * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut err = 0f32;
            for i in 0..x.len() {
                let diff = this_scale * f32::from(aux[i]) + this_min - x[i];
                err += w[i] * (diff * diff);
            }
            if err < best {
                l[..x.len()].copy_from_slice(&aux[..x.len()]);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The 6-bit scale and minimum of sub-block `j` from a Q4_K/Q5_K block's 12 scale bytes.
fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K (`bits` 4) or Q5_K (5): d, dmin, 12 scale bytes, (Q5_K: 32 high-bit bytes), 128 nibbles.
fn q4_k_or_q5_k(x: &[f32], o: &mut [u8], bits: u32) {
    let nmax = (1i32 << bits) - 1;
    let (rmin, nstep) = if bits == 4 { (-1.0, 20) } else { (-0.5, 15) };
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let (s, m) = fit_affine(xs, &w, nmax, rmin, 0.1, nstep, &mut l[32 * j..32 * j + 32]);
        (scales[j], mins[j]) = (s, m);
        max_scale = if s > max_scale { s } else { max_scale };
        max_min = if m > max_min { m } else { max_min };
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut o[4..16];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xf) | ((lm & 0xf) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    put_f16(o, max_scale / 63.0);
    put_f16(&mut o[2..], max_min / 63.0);
    let (d, dmin) = (via_f16(max_scale / 63.0), via_f16(max_min / 63.0));
    for j in 0..8 {
        let (s, m) = scale_min(j, &o[4..16]);
        let dl = d * f32::from(s);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(m);
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + ml) / dl).clamp(0, nmax) as u8;
        }
    }
    let qs = if bits == 5 { 48 } else { 16 };
    if bits == 5 {
        o[16..48].fill(0);
    }
    for (g, chunk) in l.chunks_exact(64).enumerate() {
        for i in 0..32 {
            let (a, b) = (chunk[i], chunk[i + 32]);
            o[qs + 32 * g + i] = (a & 0xf) | ((b & 0xf) << 4);
            if bits == 5 {
                o[16 + i] |= ((a >> 4) << (2 * g)) | ((b >> 4) << (2 * g + 1));
            }
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1 (weights `x²`): a signed scale for 16 values and
/// their codes `l + nmax`, trying 19 scales around `−nmax/max`.
fn fit_signed(x: &[f32], nmax: i32, l: &mut [i8]) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = code(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let iscale = -nmaxf / max;
    for (q, &v) in l.iter_mut().zip(x) {
        *q = (code(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmaxf + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (q, &v) in l.iter_mut().zip(x) {
                *q = (code(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K: 128 low-nibble bytes, 64 high-crumb bytes, 16 int8 scales, d.
fn q6_k(x: &[f32], o: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for (ib, s) in scales.iter_mut().enumerate() {
        *s = fit_signed(&x[16 * ib..16 * ib + 16], 32, &mut l[16 * ib..16 * ib + 16]);
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = *s;
        }
    }
    if max_abs < 1e-15 {
        o.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    put_f16(&mut o[208..], 1.0 / iscale);
    let d = via_f16(1.0 / iscale);
    for (ib, &s) in scales.iter().enumerate() {
        o[192 + ib] = 127.min(nearest_int(iscale * s)) as i8 as u8;
    }
    for j in 0..16 {
        let dl = d * f32::from(o[192 + j] as i8);
        if dl == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / dl).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, rest) = o.split_at_mut(128);
    let qh = &mut rest[..64];
    for (h, chunk) in l.chunks_exact(128).enumerate() {
        for i in 0..32 {
            let q = [0, 32, 64, 96].map(|k| chunk[i + k] as u8);
            ql[64 * h + i] = (q[0] & 0xf) | ((q[2] & 0xf) << 4);
            ql[64 * h + i + 32] = (q[1] & 0xf) | ((q[3] & 0xf) << 4);
            qh[32 * h + i] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}

/// The scale `amax` of a ternary block (stored as f16) and the trit `round(x/amax) + 1` of a value.
fn ternary(x: &[f32], o: &mut [u8]) -> impl Fn(f32) -> u8 + use<> {
    let d = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let at = o.len() - 2;
    put_f16(&mut o[at..], d);
    move |v: f32| ((v * id).round() as i32 + 1) as u8
}

/// TQ1_0: 48 bytes of five trits, 4 bytes of four, d. A byte holds its trits as the fraction
/// `⌈t·256/243⌉` of the base-3 number `t` they spell, first trit most significant.
fn tq1_0(x: &[f32], o: &mut [u8]) {
    let trit = ternary(x, o);
    let pack = |values: &mut dyn Iterator<Item = u8>, pad: bool| {
        let mut q = values.fold(0u16, |q, t| q * 3 + u16::from(t));
        if pad {
            q *= 3;
        }
        (q * 256).div_ceil(243) as u8
    };
    // (first value, bytes, trits per byte): 32 bytes × 5, 16 × 5, then 4 × 4.
    for (first, bytes, n) in [(0usize, 32usize, 5usize), (160, 16, 5), (240, 4, 4)] {
        let at = if first == 240 { 48 } else { first / 5 };
        for m in 0..bytes {
            let mut trits = (0..n).map(|k| trit(x[first + m + k * bytes]));
            o[at + m] = pack(&mut trits, n == 4);
        }
    }
}

/// TQ2_0: 64 bytes of four 2-bit codes (value `m + 32·k` of each 128 in bits `2k`), d.
fn tq2_0(x: &[f32], o: &mut [u8]) {
    let trit = ternary(x, o);
    for (j, xs) in x.chunks_exact(128).enumerate() {
        for m in 0..32 {
            o[32 * j + m] = (0..4).fold(0u8, |q, k| q | ((trit(xs[m + 32 * k]) & 3) << (2 * k)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use u_sdk::quant::dequantize;

    /// Values like a weight matrix's: mostly small, a few outliers, some zero runs.
    fn weights(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                match i % 97 {
                    0 => u * 40.0,
                    1..=3 if i % 1024 < 300 => 0.0,
                    _ => u * 0.1 * (1.0 + (i / 256 % 5) as f32),
                }
            })
            .collect()
    }

    /// The largest error of a round trip, relative to the block's largest magnitude.
    fn worst_error(dtype: DType, x: &[f32]) -> f32 {
        let bytes = dtype.bytes_for(x.len() as u64).unwrap() as usize;
        let mut q = vec![0xa5u8; bytes];
        quantize(dtype, x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize(dtype, &q, &mut y).unwrap();
        x.chunks(dtype.block_size())
            .zip(y.chunks(dtype.block_size()))
            .map(|(a, b)| {
                let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
                let err = a.iter().zip(b).fold(0f32, |m, (u, v)| m.max((u - v).abs()));
                if amax > 0.0 { err / amax } else { err }
            })
            .fold(0f32, f32::max)
    }

    #[test]
    fn round_trips_stay_within_each_formats_step() {
        let x = weights(256 * 24, 7);
        // Half a step plus the f16 scale's rounding; a whole step for Q4_0/Q5_0, whose codes
        // reach one step less on the side opposite the largest value; for the k-quants, whose
        // sub-block scales are 6-bit multiples of the super-block's, a few steps.
        for (dtype, bound) in [
            (DType::Q8_0, 0.5 / 127.0 + 2e-3),
            (DType::Q4_0, 1.0 / 8.0 + 2e-3),
            (DType::Q5_0, 1.0 / 16.0 + 2e-3),
            (DType::Q4_1, 1.0 / 15.0 + 4e-3),
            (DType::Q5_1, 1.0 / 31.0 + 4e-3),
            (DType::Q4_K, 0.05),
            (DType::Q5_K, 0.025),
            (DType::Q6_K, 0.025),
        ] {
            let e = worst_error(dtype, &x);
            assert!(
                e <= bound,
                "{dtype}: worst error {e} of the block's amax > {bound}"
            );
        }
    }

    #[test]
    fn ternary_values_round_trip_exactly() {
        let levels = [-0.75f32, 0.0, 0.75];
        let x: Vec<f32> = (0..512).map(|i| levels[(i * 7 + i / 3) % 3]).collect();
        for dtype in [DType::TQ1_0, DType::TQ2_0] {
            assert_eq!(worst_error(dtype, &x), 0.0, "{dtype}");
            // Off-level values go to the nearest of −d, 0, d.
            let y: Vec<f32> = x.iter().map(|v| v * 0.9 + 0.05).collect();
            assert!(worst_error(dtype, &y) <= 0.5 + 1e-3, "{dtype}");
        }
    }

    #[test]
    fn known_blocks_match_ggml() {
        // 0..31: Q8_0 d = 31/127, codes round(x·127/31) half away from zero.
        let x: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let mut q = [0u8; 34];
        quantize(DType::Q8_0, &x, &mut q).unwrap();
        assert_eq!(
            u16::from_le_bytes([q[0], q[1]]),
            f32_to_f16_bits(31.0 / 127.0)
        );
        assert_eq!(q[2..6], [0, 4, 8, 12]);
        assert_eq!(q[33], 127);
        // Q4_0: d = 31/−8; the largest value gets code 0, zero gets code 8.
        let mut q = [0u8; 18];
        quantize(DType::Q4_0, &x, &mut q).unwrap();
        assert_eq!(q[2] & 0xf, 8);
        assert_eq!(q[17] >> 4, 0);
        // All zeros: zero scales and codes, never NaN.
        for dtype in QUANTIZABLE {
            let z = vec![0f32; 256];
            let mut q = vec![0xffu8; dtype.bytes_for(256).unwrap() as usize];
            quantize(dtype, &z, &mut q).unwrap();
            let mut y = vec![1f32; 256];
            dequantize(dtype, &q, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{dtype}");
        }
    }

    #[test]
    fn wrong_lengths_and_formats_are_refused() {
        let x = [0f32; 48];
        assert!(quantize(DType::Q8_0, &x, &mut [0; 34]).is_none());
        assert!(quantize(DType::Q8_0, &x[..32], &mut [0; 33]).is_none());
        assert!(quantize(DType::Q4_K, &x[..32], &mut [0; 144]).is_none());
        assert!(quantize(DType::F16, &x[..32], &mut [0; 64]).is_none());
        assert!(quantize(DType::Q2_K, &[0f32; 256], &mut [0; 84]).is_none());
    }
}
