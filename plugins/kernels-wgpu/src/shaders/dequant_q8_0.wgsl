// Block `c` of a Q8_0 row: an f16 scale `d`, then 32 signed bytes; value = d · q.
fn dequant_chunk(base: u32, c: u32, k: u32, out: ptr<function, array<f32, 32>>) {
    let b = base + c * 34u;
    let d = f16_at(b);
    for (var i = 0u; i < 32u; i++) {
        (*out)[i] = d * f32(i8_at(b + 2u + i));
    }
}
