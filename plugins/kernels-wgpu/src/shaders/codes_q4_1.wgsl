// Chunk c of a Q4_1 row: codes q, scale d, minimum m times the activations' s1.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + c * 20u;
    var w: Chunk;
    for (var i = 0u; i < 16u; i++) {
        let q = byte_at(b + 4u + i);
        w.q[i] = i32(q & 15u);
        w.q[i + 16u] = i32(q >> 4u);
    }
    w.lo = f16_at(b);
    w.hi = w.lo;
    w.min_s1 = f16_at(b + 2u);
    return w;
}
