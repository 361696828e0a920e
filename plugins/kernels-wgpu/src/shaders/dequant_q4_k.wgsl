// Sub-block `c % 8` of super-block `c / 8` of a Q4_K row (144 bytes: f16 `d` and `dmin`, 12
// bytes of packed 6-bit scales and minimums, 128 bytes of nibbles; sub-blocks 2j and 2j+1 are
// the low and high nibbles of bytes 32j..32j+32); value = d · scale · q − dmin · min.
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    let b = base + (c / 8u) * 144u;
    let sub = c % 8u;
    let d = f16_at(b);
    let dmin = f16_at(b + 2u);
    let sm = q4k_scale_min(b + 4u, sub);
    let scale = d * f32(sm.x);
    let offset = dmin * f32(sm.y);
    let qs = b + 16u + 32u * (sub / 2u);
    let shift = 4u * (sub % 2u);
    for (var i = 0u; i < 32u; i++) {
        (*out)[i] = scale * f32((byte_at(qs + i) >> shift) & 15u) - offset;
    }
}
