//! Element conversion helpers (not part of the ABI): decode stored tensor bytes to `f32`.
//!
//! Loaders hand out tensors as stored; a consumer that wants plain floats (tests, reference
//! paths, small tensors such as norms) converts with [`to_f32`] or [`TensorView::to_f32`]. Bytes
//! are little-endian, as every supported file format stores them. Block-quantized dtypes are
//! the kernels' business and are refused here.

use crate::abi::{dtype::DType, error::UError, tensor::TensorView};

/// Decodes an IEEE 754 binary16 bit pattern.
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = (u32::from(bits) & 0x8000) << 16;
    let exp = u32::from(bits >> 10) & 0x1f;
    let mant = u32::from(bits) & 0x3ff;
    let out = match (exp, mant) {
        (0, 0) => sign,
        // Subnormal: value = mant × 2^-24, exactly representable as an f32.
        (0, m) => {
            let v = m as f32 * f32::from_bits(0x3380_0000); // 2^-24
            return if sign != 0 { -v } else { v };
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(out)
}

/// Decodes a bfloat16 bit pattern (the upper half of an f32).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Decodes `bytes` holding values of `dtype` to `f32` (64-bit values are rounded).
///
/// Fails if the dtype is block-quantized or `bytes` is not a whole number of elements.
pub fn to_f32(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>, UError> {
    if dtype.is_quantized() {
        return Err(UError::unsupported(format!(
            "to_f32: {dtype} is block-quantized; dequantize it with a kernel"
        )));
    }
    let width = dtype.block_bytes();
    if !bytes.len().is_multiple_of(width) {
        return Err(UError::invalid(format!(
            "to_f32: {} bytes is not a whole number of {dtype} values",
            bytes.len()
        )));
    }
    let chunks = bytes.chunks_exact(width);
    let out = match dtype {
        DType::F32 => chunks.map(|c| f32::from_le_bytes(arr(c))).collect(),
        DType::F16 => chunks
            .map(|c| f16_to_f32(u16::from_le_bytes(arr(c))))
            .collect(),
        DType::BF16 => chunks
            .map(|c| bf16_to_f32(u16::from_le_bytes(arr(c))))
            .collect(),
        DType::F64 => chunks.map(|c| f64::from_le_bytes(arr(c)) as f32).collect(),
        DType::I8 => chunks.map(|c| f32::from(c[0] as i8)).collect(),
        DType::U8 => chunks.map(|c| f32::from(c[0])).collect(),
        DType::I16 => chunks
            .map(|c| f32::from(i16::from_le_bytes(arr(c))))
            .collect(),
        DType::I32 => chunks.map(|c| i32::from_le_bytes(arr(c)) as f32).collect(),
        DType::I64 => chunks.map(|c| i64::from_le_bytes(arr(c)) as f32).collect(),
        _ => {
            return Err(UError::unsupported(format!(
                "to_f32: {dtype} is not supported"
            )));
        }
    };
    Ok(out)
}

fn arr<const N: usize>(c: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(c);
    a
}

impl TensorView<'_> {
    /// The view's values decoded to `f32` (a copy); see [`to_f32`].
    pub fn to_f32(&self) -> Result<Vec<f32>, UError> {
        to_f32(self.dtype, &self.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_decodes_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x8001), -(2f32.powi(-24)));
        assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
    }

    #[test]
    fn bytes_decode_per_dtype() {
        assert_eq!(to_f32(DType::I8, &[0xff, 2]).unwrap(), vec![-1.0, 2.0]);
        assert_eq!(
            to_f32(DType::F32, &1.5f32.to_le_bytes()).unwrap(),
            vec![1.5]
        );
        assert_eq!(
            to_f32(DType::I64, &(-7i64).to_le_bytes()).unwrap(),
            vec![-7.0]
        );
        assert!(to_f32(DType::F32, &[0, 0, 0]).is_err());
        assert!(to_f32(DType::Q4_0, &[0; 18]).is_err());
    }
}
