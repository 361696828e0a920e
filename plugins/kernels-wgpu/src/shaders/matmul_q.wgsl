// y[m, n] = Σ w[n, ·] · x[m, ·] for weights in 32-value blocks against activations quantized by
// quantize_act.wgsl: per chunk an exact integer dot of the codes, then the scales, as the CPU
// kernels compute it. `load_chunk` (included after) decodes chunk c of a weight row into
// integer codes and the scales of its two 16-value halves, plus the terms of its minimum:
// dot = d_x · (lo · Σ₀..₁₆ qw·qx + hi · Σ₁₆..₃₂ qw·qx) + min_s1 · s1 + min_sum · d_x · Σqx.
// One workgroup per weight row and tile of ROWS rows of x; a tree sum finishes.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    y_off: u32,
    w_off: u32,
    row_bytes: u32,
    grid_x: u32,
}

struct Chunk {
    q: array<i32, 32>,
    lo: f32,
    hi: f32,
    min_s1: f32,
    min_sum: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> act: array<u32>;
@group(0) @binding(2) var<storage, read> wq: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const THREADS: u32 = 64u;
const ROWS: u32 = 8u;
const WORDS: u32 = 11u;

var<workgroup> partial: array<f32, 512>;

fn code(word: u32, j: u32) -> i32 {
    return (i32(word << (24u - 8u * j))) >> 24u;
}

fn chunk_dot(w: ptr<function, Chunk>, a: u32) -> f32 {
    var lo = 0i;
    var hi = 0i;
    for (var i = 0u; i < 4u; i++) {
        let word = act[a + 3u + i];
        let word_hi = act[a + 7u + i];
        for (var j = 0u; j < 4u; j++) {
            lo += (*w).q[4u * i + j] * code(word, j);
            hi += (*w).q[16u + 4u * i + j] * code(word_hi, j);
        }
    }
    let d = bitcast<f32>(act[a]);
    let s1 = bitcast<f32>(act[a + 1u]);
    let sum = bitcast<i32>(act[a + 2u]);
    return d * ((*w).lo * f32(lo) + (*w).hi * f32(hi)) + (*w).min_s1 * s1
        + (*w).min_sum * d * f32(sum);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let m0 = wg.z * ROWS;
    let live = row < p.n;
    var acc: array<f32, 8>;
    if (live) {
        let chunks = p.k / 32u;
        let base = p.w_off + row * p.row_bytes;
        for (var c = t; c < chunks; c += THREADS) {
            var w = load_chunk(base, c);
            for (var r = 0u; r < ROWS; r++) {
                if (m0 + r < p.m) {
                    acc[r] += chunk_dot(&w, ((m0 + r) * chunks + c) * WORDS);
                }
            }
        }
    }
    for (var r = 0u; r < ROWS; r++) {
        partial[r * THREADS + t] = acc[r];
    }
    workgroupBarrier();
    for (var half = THREADS / 2u; half > 0u; half >>= 1u) {
        if (t < half) {
            for (var r = 0u; r < ROWS; r++) {
                partial[r * THREADS + t] += partial[r * THREADS + t + half];
            }
        }
        workgroupBarrier();
    }
    if (live && t < ROWS && m0 + t < p.m) {
        y[p.y_off + (m0 + t) * p.n + row] = partial[t * THREADS];
    }
}
