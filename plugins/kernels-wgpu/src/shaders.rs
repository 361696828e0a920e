//! The WGSL sources, one compute kernel each, assembled from the files under `shaders/` (WGSL
//! has no includes): a kernel over weights in a ggml block format is its body, the block
//! readers and that format's `dequant_chunk` or `load_chunk`; shared pieces (the matmuls' lane
//! sums, a workgroup sum, the activation functions) are appended where used.

use u_sdk::DType;

/// A compiled kernel: one pipeline each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// `y = x · wᵀ` with `w` in the given float format (F32, F16).
    MatMul(DType),
    /// `y = x · wᵀ` with `w` in the given block format, against int8 activations.
    MatMulQuantized(DType),
    /// Activations quantized to int8 chunks for [`Kernel::MatMulQuantized`].
    QuantizeActivations,
    /// Rows of a table in the given format, dequantized (embedding lookup, dequantizing copy).
    GetRows(DType),
    /// Add, multiply, scale, clamp, activations, gated activations.
    Elementwise,
    /// RMSNorm and LayerNorm.
    Norm,
    /// Row softmax in place.
    Softmax,
    /// Rotary embedding in place.
    Rope,
    /// Flash attention over contiguous K and V.
    Attention,
    /// 1-D and 2-D convolution.
    Conv,
    /// Group normalisation.
    GroupNorm,
    /// Nearest-neighbour upsampling.
    Upsample,
    /// f32 to f16.
    ToF16,
}

/// The block formats matmul reads against int8 activations (the rest of [`BLOCK_FORMATS`] are
/// floats, multiplied in f32).
pub const QUANTIZED_FORMATS: [DType; 5] = [
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4_K,
    DType::Q6_K,
];

/// The weight formats the matmul and row kernels read in place.
pub const BLOCK_FORMATS: [DType; 7] = [
    DType::F32,
    DType::F16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4_K,
    DType::Q6_K,
];

const BLOCKS: &str = include_str!("shaders/blocks.wgsl");
const ACTIVATION: &str = include_str!("shaders/activation.wgsl");
const MATMUL_SUMS: &str = include_str!("shaders/matmul_sums.wgsl");
const WORKGROUP_SUM: &str = include_str!("shaders/workgroup_sum.wgsl");

fn dequant(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => include_str!("shaders/dequant_f32.wgsl"),
        DType::F16 => include_str!("shaders/dequant_f16.wgsl"),
        DType::Q8_0 => include_str!("shaders/dequant_q8_0.wgsl"),
        DType::Q4_0 => include_str!("shaders/dequant_q4_0.wgsl"),
        DType::Q4_1 => include_str!("shaders/dequant_q4_1.wgsl"),
        DType::Q4_K => include_str!("shaders/dequant_q4_k.wgsl"),
        DType::Q6_K => include_str!("shaders/dequant_q6_k.wgsl"),
        other => unreachable!("{other:?} is not among BLOCK_FORMATS; callers check first"),
    }
}

fn codes(dtype: DType) -> &'static str {
    match dtype {
        DType::Q8_0 => include_str!("shaders/codes_q8_0.wgsl"),
        DType::Q4_0 => include_str!("shaders/codes_q4_0.wgsl"),
        DType::Q4_1 => include_str!("shaders/codes_q4_1.wgsl"),
        DType::Q4_K => include_str!("shaders/codes_q4_k.wgsl"),
        DType::Q6_K => include_str!("shaders/codes_q6_k.wgsl"),
        other => unreachable!("{other:?} is not among QUANTIZED_FORMATS; callers check first"),
    }
}

/// The full WGSL source of `kernel`.
pub fn source(kernel: Kernel) -> String {
    match kernel {
        Kernel::MatMul(dtype) => [
            include_str!("shaders/matmul.wgsl"),
            MATMUL_SUMS,
            BLOCKS,
            dequant(dtype),
        ]
        .join("\n"),
        Kernel::MatMulQuantized(dtype) => [
            include_str!("shaders/matmul_q.wgsl"),
            MATMUL_SUMS,
            BLOCKS,
            codes(dtype),
        ]
        .join("\n"),
        Kernel::QuantizeActivations => include_str!("shaders/quantize_act.wgsl").into(),
        Kernel::GetRows(dtype) => [
            include_str!("shaders/get_rows.wgsl"),
            BLOCKS,
            dequant(dtype),
        ]
        .join("\n"),
        Kernel::Elementwise => [include_str!("shaders/elementwise.wgsl"), ACTIVATION].join("\n"),
        Kernel::Norm => [include_str!("shaders/norm.wgsl"), WORKGROUP_SUM].join("\n"),
        Kernel::Softmax => include_str!("shaders/softmax.wgsl").into(),
        Kernel::Rope => include_str!("shaders/rope.wgsl").into(),
        Kernel::Attention => include_str!("shaders/attention.wgsl").into(),
        Kernel::Conv => include_str!("shaders/conv.wgsl").into(),
        Kernel::GroupNorm => [include_str!("shaders/group_norm.wgsl"), WORKGROUP_SUM].join("\n"),
        Kernel::Upsample => include_str!("shaders/upsample.wgsl").into(),
        Kernel::ToF16 => include_str!("shaders/to_f16.wgsl").into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel's source parses and validates (naga, no device needed).
    #[test]
    fn every_kernel_is_valid_wgsl() {
        let mut kernels = vec![
            Kernel::Elementwise,
            Kernel::Norm,
            Kernel::Softmax,
            Kernel::Rope,
            Kernel::Attention,
            Kernel::Conv,
            Kernel::GroupNorm,
            Kernel::Upsample,
            Kernel::ToF16,
            Kernel::QuantizeActivations,
        ];
        for dtype in QUANTIZED_FORMATS {
            kernels.push(Kernel::MatMulQuantized(dtype));
        }
        for dtype in BLOCK_FORMATS {
            kernels.push(Kernel::MatMul(dtype));
            kernels.push(Kernel::GetRows(dtype));
        }
        for kernel in kernels {
            let source = source(kernel);
            let module = wgpu::naga::front::wgsl::parse_str(&source)
                .unwrap_or_else(|e| panic!("{kernel:?}: {}", e.emit_to_string(&source)));
            wgpu::naga::valid::Validator::new(
                wgpu::naga::valid::ValidationFlags::all(),
                wgpu::naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32,
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{kernel:?}: {e:?}"));
        }
    }
}
