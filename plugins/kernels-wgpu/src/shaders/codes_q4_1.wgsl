// Chunk c of a Q4_1 row: nibbles, scale d, minimum m times the activations' s1.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + c * 20u;
    var w: Chunk;
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 4u + 4u * i);
        w.q[i] = q & 0x0f0f0f0fu;
        w.q[i + 4u] = (q >> 4u) & 0x0f0f0f0fu;
    }
    w.lo = f16_at(b);
    w.hi = w.lo;
    w.min_s1 = f16_at(b + 2u);
    return w;
}
