// y[i] = table[ids[i]] dequantized (`dequant_chunk`, included before); with `identity` set,
// row i of the table itself (a dequantizing copy). An id outside the table yields zeros.

struct Params {
    rows: u32,
    k: u32,
    ids_off: u32,
    w_off: u32,
    y_off: u32,
    row_bytes: u32,
    table_rows: u32,
    identity: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<i32>;
@group(0) @binding(2) var<storage, read> wq: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let i = wg.x + wg.y * p.grid_x;
    if (i >= p.rows) {
        return;
    }
    var id = i32(i);
    if (p.identity == 0u) {
        id = ids[p.ids_off + i];
    }
    let valid = id >= 0 && u32(id) < p.table_rows;
    let chunks = (p.k + 31u) / 32u;
    let base = p.w_off + u32(max(id, 0)) * p.row_bytes;
    for (var c = t; c < chunks; c += 64u) {
        var v: array<f32, 32>;
        if (valid) {
            dequant_chunk(base, c, p.k, &v);
        }
        let width = min(32u, p.k - c * 32u);
        for (var j = 0u; j < width; j++) {
            y[p.y_off + i * p.k + c * 32u + j] = v[j];
        }
    }
}
