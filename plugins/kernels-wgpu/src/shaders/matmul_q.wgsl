// y[m, n] = Σ w[n, ·] · x[m, ·] for weights in 32-value blocks against activations quantized by
// quantize_act.wgsl: per chunk an exact integer dot of the codes (four bytes at a time with
// dot4I8Packed), then the scales, as the CPU kernels compute it. `load_chunk` (included after)
// decodes chunk c of a weight row into its codes as non-negative bytes packed four to a word,
// the offset to subtract from each, the scales of its two 16-value halves, and the terms of
// its minimum: with qw = code − offset,
// dot = d_x · (lo · Σ₀..₁₆ qw·qx + hi · Σ₁₆..₃₂ qw·qx) + min_s1 · s1 + min_sum · d_x · Σqx.
// A workgroup takes WEIGHT_ROWS weight rows and a tile of ROWS rows of x; LANES invocations
// share each weight row (every LANES-th chunk each); a three-step tree sum over the lanes
// finishes.

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
    q: array<u32, 8>,
    offset: i32,
    lo: f32,
    hi: f32,
    min_s1: f32,
    min_sum: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> act: array<u32>;
@group(0) @binding(2) var<storage, read> wq: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const LANES: u32 = 8u;
const WEIGHT_ROWS: u32 = 8u;
const ROWS: u32 = 8u;
const WORDS: u32 = 12u;

var<workgroup> partial: array<f32, 512>;

fn chunk_dot(w: ptr<function, Chunk>, a: u32) -> f32 {
    var lo = 0i;
    var hi = 0i;
    for (var i = 0u; i < 4u; i++) {
        lo += dot4I8Packed((*w).q[i], act[a + 4u + i]);
        hi += dot4I8Packed((*w).q[4u + i], act[a + 8u + i]);
    }
    let d = bitcast<f32>(act[a]);
    let s1 = bitcast<f32>(act[a + 1u]);
    let sum = bitcast<i32>(act[a + 2u]);
    let sum_lo = bitcast<i32>(act[a + 3u]);
    lo -= (*w).offset * sum_lo;
    hi -= (*w).offset * (sum - sum_lo);
    return d * ((*w).lo * f32(lo) + (*w).hi * f32(hi)) + (*w).min_s1 * s1
        + (*w).min_sum * d * f32(sum);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let lane = t % LANES;
    let slot = t / LANES;
    let row = (wg.x + wg.y * p.grid_x) * WEIGHT_ROWS + slot;
    let m0 = wg.z * ROWS;
    let rows_here = min(ROWS, p.m - m0);
    var acc: array<f32, 8>;
    if (row < p.n) {
        let chunks = p.k / 32u;
        let base = p.w_off + row * p.row_bytes;
        for (var c = lane; c < chunks; c += LANES) {
            var w = load_chunk(base, c);
            for (var r = 0u; r < rows_here; r++) {
                acc[r] += chunk_dot(&w, ((m0 + r) * chunks + c) * WORDS);
            }
        }
    }
    write_sums(acc, lane, slot, row, m0, rows_here);
}
