// Chunk c of a Q4_0 row: nibbles (low ones are values 0..16) less 8, scale d.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + c * 18u;
    var w: Chunk;
    for (var i = 0u; i < 4u; i++) {
        let q = word_at(b + 2u + 4u * i);
        w.q[i] = q & 0x0f0f0f0fu;
        w.q[i + 4u] = (q >> 4u) & 0x0f0f0f0fu;
    }
    w.offset = 8;
    w.lo = f16_at(b);
    w.hi = w.lo;
    return w;
}
