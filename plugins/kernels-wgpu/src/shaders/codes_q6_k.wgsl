// Chunk c % 8 of super-block c / 8 of a Q6_K row (layout as dequant_q6_k.wgsl): 6-bit codes
// less 32, the scales d · scale of its two 16-value halves.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + (c / 8u) * 210u;
    let sub = c % 8u;
    let h = sub / 4u;
    let j = sub % 4u;
    let ql = b + 64u * h + 32u * (j & 1u);
    let qh = b + 128u + 32u * h;
    let lo_shift = 4u * (j >> 1u);
    let hi_shift = 2u * j;
    var w: Chunk;
    for (var i = 0u; i < 8u; i++) {
        let lo = (word_at(ql + 4u * i) >> lo_shift) & 0x0f0f0f0fu;
        let hi = (word_at(qh + 4u * i) >> hi_shift) & 0x03030303u;
        w.q[i] = lo | (hi << 4u);
    }
    w.offset = 32;
    let d = f16_at(b + 208u);
    let scales = b + 192u + 8u * h + 2u * j;
    w.lo = d * f32(i8_at(scales));
    w.hi = d * f32(i8_at(scales + 1u));
    return w;
}
