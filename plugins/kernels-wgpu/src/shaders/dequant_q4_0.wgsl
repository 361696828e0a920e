// Block `c` of a Q4_0 row: an f16 scale `d`, then 16 bytes of nibbles (low nibbles are values
// 0..16, high nibbles 16..32); value = d · (q − 8).
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    let b = base + c * 18u;
    let d = f16_at(b);
    for (var i = 0u; i < 16u; i++) {
        let q = byte_at(b + 2u + i);
        (*out)[i] = d * (f32(q & 15u) - 8.0);
        (*out)[i + 16u] = d * (f32(q >> 4u) - 8.0);
    }
}
