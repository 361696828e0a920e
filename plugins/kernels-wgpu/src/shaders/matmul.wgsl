// y[m, n] = Σₖ x[m, k] · w[n, k], w in its stored blocks (`dequant_chunk`, included before).
// A workgroup takes WEIGHT_ROWS weight rows and a tile of ROWS rows of x; LANES invocations
// share each weight row, each dequantizing every LANES-th chunk of 32 weights once and
// multiplying it with every x row of the tile; a three-step tree sum over the lanes finishes.

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

const LANES: u32 = 8u;
const WEIGHT_ROWS: u32 = 8u;
const ROWS: u32 = 8u;

var<workgroup> partial: array<f32, 512>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let lane = t % LANES;
    let slot = t / LANES;
    let row = (wg.x + wg.y * p.grid_x) * WEIGHT_ROWS + slot;
    let m0 = wg.z * ROWS;
    let rows_here = min(ROWS, p.m - m0);
    var acc: array<f32, 8>;
    if (row < p.n) {
        let chunks = (p.k + 31u) / 32u;
        let base = p.w_off + row * p.row_bytes;
        for (var c = lane; c < chunks; c += LANES) {
            var v: array<f32, 32>;
            dequant_chunk(base, c, p.k, &v);
            let width = min(32u, p.k - c * 32u);
            for (var r = 0u; r < rows_here; r++) {
                let xb = p.x_off + (m0 + r) * p.k + c * 32u;
                var s = 0.0;
                for (var i = 0u; i < width; i++) {
                    s += v[i] * x[xb + i];
                }
                acc[r] += s;
            }
        }
    }
    write_sums(acc, lane, slot, row, m0, rows_here);
}
