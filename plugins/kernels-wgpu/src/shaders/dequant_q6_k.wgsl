// Chunk `c % 8` of super-block `c / 8` of a Q6_K row (210 bytes: 128 bytes of low nibbles,
// 64 bytes of high bit pairs, 16 signed 8-bit scales, f16 `d`). Chunk `4h + j` of half `h`
// takes its low nibbles from bytes 64h + 32(j & 1) + l (high nibble when j ≥ 2) and its high
// bits from pair j of byte 32h + l; value = d · scale · (q − 32).
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 210u;
    let sub = c % 8u;
    let h = sub / 4u;
    let j = sub % 4u;
    let d = f16_at(b + 208u);
    let ql = b + 64u * h + 32u * (j & 1u);
    let qh = b + 128u + 32u * h;
    let lo_shift = 4u * (j >> 1u);
    let hi_shift = 2u * j;
    let scales = b + 192u + 8u * h + 2u * j;
    for (var l = 0u; l < 32u; l++) {
        let lo = (byte_at(ql + l) >> lo_shift) & 15u;
        let hi = (byte_at(qh + l) >> hi_shift) & 3u;
        let q = i32(lo | (hi << 4u)) - 32;
        (*out)[l] = d * f32(i8_at(scales + l / 16u)) * f32(q);
    }
}
