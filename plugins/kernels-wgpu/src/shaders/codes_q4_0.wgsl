// Chunk c of a Q4_0 row: codes q − 8, scale d.
fn load_chunk(base: u32, c: u32) -> Chunk {
    let b = base + c * 18u;
    var w: Chunk;
    for (var i = 0u; i < 16u; i++) {
        let q = byte_at(b + 2u + i);
        w.q[i] = i32(q & 15u) - 8;
        w.q[i + 16u] = i32(q >> 4u) - 8;
    }
    w.lo = f16_at(b);
    w.hi = w.lo;
    return w;
}
