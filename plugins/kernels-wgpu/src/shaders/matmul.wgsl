// y[m, n] = Σₖ x[m, k] · w[n, k], w in its stored blocks (`dequant_chunk`, included before).
// One workgroup per weight row and tile of ROWS rows of x: each invocation dequantizes chunks
// of 32 weights once and multiplies them with every x row of the tile; a tree sum finishes.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    x_off: u32,
    w_off: u32,
    y_off: u32,
    row_bytes: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> wq: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const THREADS: u32 = 64u;
const ROWS: u32 = 8u;

var<workgroup> partial: array<f32, 512>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wg.x + wg.y * p.grid_x;
    let m0 = wg.z * ROWS;
    let live = row < p.n;
    var acc: array<f32, 8>;
    if (live) {
        let chunks = (p.k + 31u) / 32u;
        let base = p.w_off + row * p.row_bytes;
        for (var c = t; c < chunks; c += THREADS) {
            var v: array<f32, 32>;
            dequant_chunk(base, c, p.k, &v);
            let width = min(32u, p.k - c * 32u);
            for (var r = 0u; r < ROWS; r++) {
                if (m0 + r < p.m) {
                    let xb = p.x_off + (m0 + r) * p.k + c * 32u;
                    var s = 0.0;
                    for (var i = 0u; i < width; i++) {
                        s += v[i] * x[xb + i];
                    }
                    acc[r] += s;
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
