// Sub-block c % 8 of super-block c / 8 of a Q4_K row: codes q, scale d · scale, minimum
// −dmin · min times the activations' d · Σq.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + (c / 8u) * 144u;
    let sub = c % 8u;
    let sm = q4k_scale_min(b + 4u, sub);
    let qs = b + 16u + 32u * (sub / 2u);
    let shift = 4u * (sub % 2u);
    var w: Chunk;
    for (var i = 0u; i < 8u; i++) {
        w.q[i] = (word_at(qs + 4u * i) >> shift) & 0x0f0f0f0fu;
    }
    w.lo = f16_at(b) * f32(sm.x);
    w.hi = w.lo;
    w.min_sum = -f16_at(b + 2u) * f32(sm.y);
    return w;
}
