// Chunk c % 8 of super-block c / 8 of a Q6_K row (layout as dequant_q6_k.wgsl): codes q − 32,
// the scales d · scale of its two 16-value halves.
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
    for (var l = 0u; l < 32u; l++) {
        let lo = (byte_at(ql + l) >> lo_shift) & 15u;
        let hi = (byte_at(qh + l) >> hi_shift) & 3u;
        w.q[l] = i32(lo | (hi << 4u)) - 32;
    }
    let d = f16_at(b + 208u);
    let scales = b + 192u + 8u * h + 2u * j;
    w.lo = d * f32(i8_at(scales));
    w.hi = d * f32(i8_at(scales + 1u));
    return w;
}
