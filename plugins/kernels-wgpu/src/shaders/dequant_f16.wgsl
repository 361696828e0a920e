// Chunk `c` of an f16 row starting at byte `base` (even); values past `k` read as 0.
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    for (var i = 0u; i < 32u; i++) {
        let e = c * 32u + i;
        (*out)[i] = select(0.0, f16_at(base + 2u * e), e < k);
    }
}
