// Reading ggml's blocks out of a storage buffer of words (`wq`, declared by the including
// shader). Blocks are 18, 20, 34, 144 or 210 bytes, so they are read byte by byte; every f16
// sits at an even byte offset, inside one word.

fn byte_at(b: u32) -> u32 {
    return (wq[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

fn i8_at(b: u32) -> i32 {
    return (i32(byte_at(b)) << 24u) >> 24u;
}

fn f16_at(b: u32) -> f32 {
    let pair = unpack2x16float(wq[b >> 2u]);
    return select(pair.x, pair.y, (b & 2u) != 0u);
}

// The four bytes from byte `b` on as one word (b even: blocks start at even offsets).
fn word_at(b: u32) -> u32 {
    let i = b >> 2u;
    if ((b & 3u) == 0u) {
        return wq[i];
    }
    return (wq[i] >> 16u) | (wq[i + 1u] << 16u);
}

// The 6-bit scale (x) and minimum (y) of sub-block `sub` of a Q4_K super-block whose 12 bytes
// of packed scales start at byte `s`.
fn q4k_scale_min(s: u32, sub: u32) -> vec2<u32> {
    if (sub < 4u) {
        return vec2<u32>(byte_at(s + sub) & 63u, byte_at(s + sub + 4u) & 63u);
    }
    return vec2<u32>(
        (byte_at(s + sub + 4u) & 15u) | ((byte_at(s + sub - 4u) >> 6u) << 4u),
        (byte_at(s + sub + 4u) >> 4u) | ((byte_at(s + sub) >> 6u) << 4u),
    );
}
