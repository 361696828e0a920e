// Chunk `c` (values 32c..32c+32) of an f32 row starting at byte `base` (a multiple of 4);
// values past `k` read as 0.
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    for (var i = 0u; i < 32u; i++) {
        let e = c * 32u + i;
        (*out)[i] = select(0.0, bitcast<f32>(wq[(base >> 2u) + e]), e < k);
    }
}
