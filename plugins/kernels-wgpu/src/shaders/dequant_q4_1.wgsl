// Block `c` of a Q4_1 row: f16 scale `d` and minimum `m`, then 16 bytes of nibbles;
// value = d · q + m.
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    let b = base + c * 20u;
    let d = f16_at(b);
    let m = f16_at(b + 2u);
    for (var i = 0u; i < 16u; i++) {
        let q = byte_at(b + 4u + i);
        (*out)[i] = d * f32(q & 15u) + m;
        (*out)[i + 16u] = d * f32(q >> 4u) + m;
    }
}
