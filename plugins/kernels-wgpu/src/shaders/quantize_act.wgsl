// Activations quantized to int8 as the CPU kernels quantize them for integer dot products, so
// quantized matmul here agrees with theirs to f32 rounding: per chunk of 32 values, 12 words —
// the scale d, s1 = f16(d_f32 · Σq), Σq, the sum of the first 16 codes, then the 32 codes
// packed four to a word. Mode 0 (for
// Q8_0, Q4_0, Q4_1) scales each chunk by its own amax / 127 rounded to f16; mode 1 (k-quants)
// scales a 256-value super-block by its amax / 127, unrounded, shared by its eight chunks.
// q = round_half_even(x · 127 / amax).

struct Params {
    rows: u32,
    k: u32,
    mode: u32,
    x_off: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<u32>;

const WORDS: u32 = 12u;

// IEEE binary16 rounding (nearest, ties to even) of a finite non-negative scale, back as f32.
fn round_to_f16(v: f32) -> f32 {
    let a = bitcast<u32>(v) & 0x7fffffffu;
    var h: u32;
    if (a >= 0x477ff000u) {
        h = 0x7c00u;
    } else if (a < 0x38800000u) {
        h = u32(round(bitcast<f32>(a) * 16777216.0));
    } else {
        h = (a + 0x0fffu + ((a >> 13u) & 1u) - 0x38000000u) >> 13u;
    }
    return unpack2x16float(h).x;
}

// Quantizes the 32 values from `xb` with multiplier `id` into chunk `chunk`, scale `d`
// (unrounded `d_raw` for s1).
fn store_chunk(xb: u32, chunk: u32, id: f32, d: f32, d_raw: f32) {
    let base = chunk * WORDS;
    var sum = 0i;
    var first_half = 0i;
    for (var w = 0u; w < 8u; w++) {
        var packed = 0u;
        for (var j = 0u; j < 4u; j++) {
            let q = i32(round(x[xb + 4u * w + j] * id));
            sum += q;
            packed |= (u32(q) & 0xffu) << (8u * j);
        }
        act[base + 4u + w] = packed;
        if (w == 3u) {
            first_half = sum;
        }
    }
    act[base + 3u] = bitcast<u32>(first_half);
    act[base] = bitcast<u32>(d);
    act[base + 1u] = bitcast<u32>(round_to_f16(abs(d_raw * f32(sum))) * sign(d_raw * f32(sum)));
    act[base + 2u] = bitcast<u32>(sum);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let group = (wg.x + wg.y * p.grid_x) * 64u + t;
    let span = select(32u, 256u, p.mode == 1u);
    let per_row = p.k / span;
    if (group >= p.rows * per_row) {
        return;
    }
    let xb = p.x_off + group * span;
    var amax = 0.0;
    for (var i = 0u; i < span; i++) {
        amax = max(amax, abs(x[xb + i]));
    }
    let id = select(0.0, 127.0 / amax, amax > 0.0);
    let d_raw = amax / 127.0;
    let chunks = span / 32u;
    let d = select(round_to_f16(d_raw), d_raw, p.mode == 1u);
    for (var c = 0u; c < chunks; c++) {
        store_chunk(xb + 32u * c, group * chunks + c, id, d, d_raw);
    }
}
