// Chunk c of a Q8_0 row: the signed codes as stored, scale d.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + c * 34u;
    var w: Chunk;
    for (var i = 0u; i < 8u; i++) {
        w.q[i] = word_at(b + 2u + 4u * i);
    }
    w.lo = f16_at(b);
    w.hi = w.lo;
    return w;
}
