//! Dequantization of ggml block formats to `f32`: shared by loaders (conversions on request) and
//! kernels (embedding rows, reference paths). Not part of the ABI.
//!
//! Written from the block layouts of ggml (`ggml-common.h`) and checked bit for bit against the
//! Python `gguf` package's `gguf.quants.dequantize` (see `tests/fixtures/gen_gguf.py`). To be
//! bit-exact, every value is computed with the same single-precision operations in the same
//! order as the reference: e.g. Q4_K is `(d·sc)·q − (dmin·m)`, never a fused multiply-add.
//!
//! Block layouts (bytes, little-endian; `d`, `m`, `dmin` are f16 unless noted):
//!
//! | type | bytes | layout |
//! | --- | --- | --- |
//! | Q4_0 | 18 | d, qs\[16\] (low nibbles: values 0–15, high: 16–31), value = d·(q−8) |
//! | Q4_1 | 20 | d, m, qs\[16\], value = d·q + m |
//! | Q5_0 | 22 | d, qh u32 (bit i = 5th bit of value i), qs\[16\], value = d·(q−16) |
//! | Q5_1 | 24 | d, m, qh u32, qs\[16\], value = d·q + m |
//! | Q8_0 | 34 | d, qs\[32\] i8, value = q·d |
//! | Q8_1 | 36 | d, s (sum, unused here), qs\[32\] i8, value = d·q |
//! | Q2_K | 84 | scales\[16\] (lo nibble scale, hi nibble min), qs\[64\] 2-bit, d, dmin |
//! | Q3_K | 110 | hmask\[32\], qs\[64\] 2-bit, scales\[12\] (16 × 6-bit), d |
//! | Q4_K | 144 | d, dmin, scales\[12\] (8 × 6-bit scale + min), qs\[128\] 4-bit |
//! | Q5_K | 176 | d, dmin, scales\[12\], qh\[32\], qs\[128\] |
//! | Q6_K | 210 | ql\[128\], qh\[64\], scales\[16\] i8, d |
//! | Q8_K | 292 | d f32, qs\[256\] i8, bsums\[16\] i16 (unused here), value = d·q |
//! | TQ1_0 | 54 | qs\[48\] (5 trits per byte), qh\[4\] (4 trits per byte), d |
//! | TQ2_0 | 66 | qs\[64\] (4 × 2-bit per byte), d, value = d·(q−1) |

use crate::abi::{DType, TensorView, UError};

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The value count is not a whole number of blocks.
    #[error("{values} values of {dtype} are not a whole number of {block}-value blocks")]
    NotWholeBlocks {
        /// The dtype.
        dtype: DType,
        /// Values asked for.
        values: usize,
        /// Values per block.
        block: usize,
    },
    /// The byte count does not match the value count.
    #[error("{values} values of {dtype} need {need} bytes, got {got}")]
    ByteLength {
        /// The dtype.
        dtype: DType,
        /// Values asked for.
        values: usize,
        /// Bytes needed.
        need: u64,
        /// Bytes given.
        got: usize,
    },
}

impl From<Error> for UError {
    fn from(e: Error) -> Self {
        UError::invalid(e.to_string())
    }
}

/// Result of a dequantization.
pub type Result<T> = std::result::Result<T, Error>;

/// Converts IEEE binary16 bits to `f32` exactly (subnormals, infinities and NaN payloads kept).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: normalise the mantissa.
            let mut e = 127 - 15 + 1;
            let mut m = man;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// Converts bfloat16 bits to `f32` (exact: the upper half of an f32).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// Dequantizes `bytes`, holding `out.len()` values of `dtype`, into `out`.
///
/// `out.len()` must be a whole number of blocks and `bytes` exactly their size.
pub fn dequantize(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let values = out.len();
    let bs = dtype.block_size();
    let bb = dtype.block_bytes();
    if !values.is_multiple_of(bs) {
        return Err(Error::NotWholeBlocks {
            dtype,
            values,
            block: bs,
        });
    }
    let need = (values / bs) as u64 * bb as u64;
    if bytes.len() as u64 != need {
        return Err(Error::ByteLength {
            dtype,
            values,
            need,
            got: bytes.len(),
        });
    }
    let blocks = bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bs));
    let each = |f: fn(&[u8], &mut [f32])| blocks.for_each(|(b, o)| f(b, o));
    match dtype {
        DType::F32 => each(|b, o| o[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => each(|b, o| o[0] = f16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        DType::BF16 => each(|b, o| o[0] = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))),
        DType::F64 => each(|b, o| o[0] = f64::from_le_bytes(arr(b)) as f32),
        DType::I8 => each(|b, o| o[0] = f32::from(b[0] as i8)),
        DType::U8 => each(|b, o| o[0] = f32::from(b[0])),
        DType::I16 => each(|b, o| o[0] = f32::from(i16::from_le_bytes([b[0], b[1]]))),
        DType::I32 => each(|b, o| o[0] = i32::from_le_bytes(arr(b)) as f32),
        DType::I64 => each(|b, o| o[0] = i64::from_le_bytes(arr(b)) as f32),
        DType::Q4_0 => each(q4_0),
        DType::Q4_1 => each(q4_1),
        DType::Q5_0 => each(q5_0),
        DType::Q5_1 => each(q5_1),
        DType::Q8_0 => each(q8_0),
        DType::Q8_1 => each(q8_1),
        DType::Q2_K => each(q2_k),
        DType::Q3_K => each(q3_k),
        DType::Q4_K => each(q4_k),
        DType::Q5_K => each(q5_k),
        DType::Q6_K => each(q6_k),
        DType::Q8_K => each(q8_k),
        DType::TQ1_0 => each(tq1_0),
        DType::TQ2_0 => each(tq2_0),
    }
    Ok(())
}

/// Dequantizes a whole buffer of `dtype` blocks into a new vector.
pub fn dequantize_to_vec(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>> {
    let bb = dtype.block_bytes();
    let values = bytes.len() / bb * dtype.block_size();
    if !bytes.len().is_multiple_of(bb) {
        return Err(Error::ByteLength {
            dtype,
            values,
            need: (values / dtype.block_size()) as u64 * bb as u64,
            got: bytes.len(),
        });
    }
    let mut out = vec![0f32; values];
    dequantize(dtype, bytes, &mut out)?;
    Ok(out)
}

/// Dequantizes a tensor view (e.g. from [`crate::WeightSet::tensor`]) into a new vector.
pub fn dequantize_view(view: &TensorView<'_>) -> Result<Vec<f32>> {
    let values = usize::try_from(view.elements()).unwrap_or(usize::MAX);
    let need = view.dtype.bytes_for(view.elements());
    if need != Some(view.data.len() as u64) {
        return Err(Error::ByteLength {
            dtype: view.dtype,
            values,
            need: need.unwrap_or(u64::MAX),
            got: view.data.len(),
        });
    }
    let mut out = vec![0f32; values];
    dequantize(view.dtype, view.data.as_slice(), &mut out)?;
    Ok(out)
}

fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

fn q4_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for l in 0..16 {
        o[l] = d * f32::from((qs[l] & 0xf) as i8 - 8);
        o[l + 16] = d * f32::from((qs[l] >> 4) as i8 - 8);
    }
}

fn q4_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for l in 0..16 {
        o[l] = d * f32::from(qs[l] & 0xf) + m;
        o[l + 16] = d * f32::from(qs[l] >> 4) + m;
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block from its `qh` word and `qs` nibbles.
fn q5_values(qh: u32, qs: &[u8]) -> impl Iterator<Item = u8> + '_ {
    (0..32).map(move |i| {
        let lo = if i < 16 { qs[i] & 0xf } else { qs[i - 16] >> 4 };
        let hi = (((qh >> i) & 1) as u8) << 4;
        lo | hi
    })
}

fn q5_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes(arr(&b[2..6]));
    for (x, q) in o.iter_mut().zip(q5_values(qh, &b[6..22])) {
        *x = d * f32::from(q as i8 - 16);
    }
}

fn q5_1(b: &[u8], o: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes(arr(&b[4..8]));
    for (x, q) in o.iter_mut().zip(q5_values(qh, &b[8..24])) {
        *x = d * f32::from(q) + m;
    }
}

fn q8_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for (x, &q) in o.iter_mut().zip(&b[2..34]) {
        *x = f32::from(q as i8) * d;
    }
}

fn q8_1(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 0);
    for (x, &q) in o.iter_mut().zip(&b[4..36]) {
        *x = d * f32::from(q as i8);
    }
}

/// For k-quants whose 2-bit fields pack 4 groups of 32 values into 32 bytes: the byte index and
/// shift of value `i` (0..256) in a 64-byte array.
fn crumb(i: usize) -> (usize, usize) {
    let (j, s, l) = (i / 128, (i % 128) / 32, i % 32);
    (j * 32 + l, 2 * s)
}

fn q2_k(b: &[u8], o: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, x) in o.iter_mut().enumerate() {
        let (at, shift) = crumb(i);
        let q = (qs[at] >> shift) & 3;
        let sc = scales[i / 16];
        let dl = d * f32::from(sc & 0xf);
        let ml = dmin * f32::from(sc >> 4);
        *x = dl * f32::from(q) - ml;
    }
}

fn q3_k(b: &[u8], o: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = f16_at(b, 108);
    let mut dl = [0f32; 16];
    for (k, v) in dl.iter_mut().enumerate() {
        let low = (sc[k % 8] >> (4 * (k / 8))) & 0xf;
        let high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
        *v = d * f32::from((low | (high << 4)) as i8 - 32);
    }
    for (i, x) in o.iter_mut().enumerate() {
        let (at, shift) = crumb(i);
        let low = ((qs[at] >> shift) & 3) as i8;
        let hbit = (hmask[i % 32] >> (i / 32)) & 1;
        let q = low - (((hbit ^ 1) << 2) as i8);
        *x = dl[i / 16] * f32::from(q);
    }
}

/// The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block.
fn k_scale_min(s: &[u8]) -> [(u8, u8); 8] {
    let mut out = [(0, 0); 8];
    for (j, v) in out.iter_mut().enumerate() {
        *v = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
                (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
            )
        };
    }
    out
}

/// Shared tail of Q4_K and Q5_K: `(d·sc)·q − (dmin·m)` per 32-value sub-block.
fn k_affine(b: &[u8], o: &mut [f32], q: impl Fn(usize) -> u8) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let sm = k_scale_min(&b[4..16]);
    for (sb, chunk) in o.chunks_exact_mut(32).enumerate() {
        let (sc, m) = sm[sb];
        let dl = d * f32::from(sc);
        let ml = dmin * f32::from(m);
        for (l, x) in chunk.iter_mut().enumerate() {
            *x = dl * f32::from(q(sb * 32 + l)) - ml;
        }
    }
}

/// The 4-bit value `i` of a 128-byte Q4_K/Q5_K nibble array.
fn k_nibble(qs: &[u8], i: usize) -> u8 {
    let (j, s, l) = (i / 64, (i % 64) / 32, i % 32);
    (qs[j * 32 + l] >> (4 * s)) & 0xf
}

fn q4_k(b: &[u8], o: &mut [f32]) {
    let qs = &b[16..144];
    k_affine(b, o, |i| k_nibble(qs, i));
}

fn q5_k(b: &[u8], o: &mut [f32]) {
    let qh = &b[16..48];
    let qs = &b[48..176];
    k_affine(b, o, |i| {
        k_nibble(qs, i) | (((qh[i % 32] >> (i / 32)) & 1) << 4)
    });
}

fn q6_k(b: &[u8], o: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = f16_at(b, 208);
    for (i, x) in o.iter_mut().enumerate() {
        let (j, r) = (i / 128, i % 128);
        let lo = (ql[j * 64 + r % 64] >> (4 * (r / 64))) & 0xf;
        let hi = (qh[j * 32 + r % 32] >> (2 * (r / 32))) & 3;
        let q = (lo | (hi << 4)) as i8 - 32;
        let dl = d * f32::from(scales[i / 16] as i8);
        *x = dl * f32::from(q);
    }
}

fn q8_k(b: &[u8], o: &mut [f32]) {
    let d = f32::from_le_bytes(arr(&b[0..4]));
    for (x, &q) in o.iter_mut().zip(&b[4..260]) {
        *x = d * f32::from(q as i8);
    }
}

fn tq1_0(b: &[u8], o: &mut [f32]) {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let d = f16_at(b, 52);
    // Each byte holds trits as a fixed-point fraction; multiplying by 3^n (mod 256) brings trit
    // n to the top, and (byte·3) >> 8 reads it.
    let trit = |byte: u8, n: usize| ((u16::from(byte.wrapping_mul(POW3[n])) * 3) >> 8) as i8 - 1;
    // (packed bytes, trits per byte, first output index): 32 bytes × 5, 16 × 5, then qh 4 × 4.
    for (src, trits, first) in [
        (&b[0..32], 5, 0),
        (&b[32..48], 5, 160),
        (&b[48..52], 4, 240),
    ] {
        for n in 0..trits {
            let out = &mut o[first + n * src.len()..first + (n + 1) * src.len()];
            for (x, &byte) in out.iter_mut().zip(src) {
                *x = d * f32::from(trit(byte, n));
            }
        }
    }
}

fn tq2_0(b: &[u8], o: &mut [f32]) {
    let d = f16_at(b, 64);
    for (i, x) in o.iter_mut().enumerate() {
        let (at, shift) = crumb(i);
        let q = ((b[at] >> shift) & 3) as i8 - 1;
        *x = d * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert_eq!(f16_to_f32(0x7e00).to_bits(), 0x7fc0_0000);
        // Every finite half round-trips through f64 arithmetic.
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            let exp = (h >> 10) & 0x1f;
            if exp == 0x1f {
                continue;
            }
            let man = f64::from(h & 0x3ff);
            let mag = if exp == 0 {
                man * 2f64.powi(-24)
            } else {
                (1.0 + man / 1024.0) * 2f64.powi(i32::from(exp) - 15)
            };
            let want = if h & 0x8000 != 0 { -mag } else { mag };
            assert_eq!(f64::from(f), want, "{h:#06x}");
        }
    }

    #[test]
    fn q8_1_and_q4_0_by_hand() {
        let mut b = vec![0u8; 36];
        b[0..2].copy_from_slice(&0x4000u16.to_le_bytes()); // d = 2
        for i in 0..32 {
            b[4 + i] = (i as i8 - 16) as u8;
        }
        let v = dequantize_to_vec(DType::Q8_1, &b).unwrap();
        assert_eq!(v[0], -32.0);
        assert_eq!(v[31], 30.0);
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
        b[2] = 0xf0; // value 0: 0 − 8, value 16: 15 − 8
        let v = dequantize_to_vec(DType::Q4_0, &b).unwrap();
        assert_eq!((v[0], v[16], v[1]), (-8.0, 7.0, -8.0));
    }

    #[test]
    fn length_mismatches_are_errors() {
        let mut out = [0f32; 31];
        assert!(matches!(
            dequantize(DType::Q4_0, &[0; 18], &mut out),
            Err(Error::NotWholeBlocks { .. })
        ));
        let mut out = [0f32; 32];
        assert!(matches!(
            dequantize(DType::Q4_0, &[0; 17], &mut out),
            Err(Error::ByteLength { .. })
        ));
        assert!(dequantize_to_vec(DType::Q6_K, &[0; 211]).is_err());
        assert_eq!(
            dequantize_to_vec(DType::Q6_K, &[]).unwrap(),
            Vec::<f32>::new()
        );
    }
}
