//! Element types of tensors, including llama.cpp's block-quantized formats.
//!
//! Quantized types are stored in blocks: `block_size` consecutive values packed into
//! `block_bytes` bytes. Byte layouts follow ggml exactly so GGUF data is used in place.

use abi_stable::StableAbi;

/// The type of a tensor's elements.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16: the upper half of an f32.
    BF16,
    /// IEEE 754 binary64.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// 4-bit, 32 per block, one f16 scale.
    Q4_0,
    /// 4-bit, 32 per block, f16 scale and minimum.
    Q4_1,
    /// 5-bit, 32 per block, one f16 scale.
    Q5_0,
    /// 5-bit, 32 per block, f16 scale and minimum.
    Q5_1,
    /// 8-bit, 32 per block, one f16 scale.
    Q8_0,
    /// 8-bit, 32 per block, f16 scale and f16 sum (activation format).
    Q8_1,
    /// 2-bit k-quant, 256 per super-block.
    Q2_K,
    /// 3-bit k-quant, 256 per super-block.
    Q3_K,
    /// 4-bit k-quant, 256 per super-block.
    Q4_K,
    /// 5-bit k-quant, 256 per super-block.
    Q5_K,
    /// 6-bit k-quant, 256 per super-block.
    Q6_K,
    /// 8-bit k-quant, 256 per super-block, f32 scale (activation format).
    Q8_K,
    /// Ternary (BitNet b1.58), 1.6 bits per value, 256 per block.
    TQ1_0,
    /// Ternary (BitNet b1.58), 2 bits per value, 256 per block.
    TQ2_0,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 23] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q8_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q8_K,
        DType::TQ1_0,
        DType::TQ2_0,
    ];

    /// Number of values in one block (1 for plain types).
    pub const fn block_size(self) -> usize {
        use DType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | U8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | TQ1_0 | TQ2_0 => 256,
        }
    }

    /// Number of bytes one block occupies.
    pub const fn block_bytes(self) -> usize {
        use DType::*;
        match self {
            I8 | U8 => 1,
            F16 | BF16 | I16 => 2,
            F32 | I32 => 4,
            F64 | I64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            TQ1_0 => 54,
            TQ2_0 => 66,
        }
    }

    /// Whether values are packed in multi-value blocks.
    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes needed for `n` values, or `None` if `n` is not a whole number of blocks or the
    /// size overflows.
    pub const fn bytes_for(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.block_bytes() as u64)
    }

    /// The canonical lowercase-insensitive name, as llama.cpp spells it (`"Q4_K"`, `"F16"`).
    pub const fn name(self) -> &'static str {
        use DType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            BF16 => "BF16",
            F64 => "F64",
            I8 => "I8",
            U8 => "U8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
        }
    }

    /// Parses a name as produced by [`DType::name`], ignoring ASCII case.
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()), Some(d));
            assert_eq!(DType::from_name(&d.name().to_lowercase()), Some(d));
        }
        assert_eq!(DType::from_name("Q7_Z"), None);
    }

    #[test]
    fn byte_sizes_follow_ggml() {
        // 4096 Q4_0 values: 128 blocks × 18 bytes.
        assert_eq!(DType::Q4_0.bytes_for(4096), Some(128 * 18));
        assert_eq!(DType::Q6_K.bytes_for(256), Some(210));
        assert_eq!(DType::Q4_K.bytes_for(255), None);
        assert_eq!(DType::F16.bytes_for(3), Some(6));
        assert_eq!(DType::F32.bytes_for(u64::MAX / 2), None);
    }
}
