// Row-wise softmax in place, one workgroup per row.

struct Params {
    rows: u32,
    len: u32,
    y_off: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wg.x + wg.y * p.grid_x;
    if (row >= p.rows) {
        return;
    }
    let b = p.y_off + row * p.len;
    var m = -3.4028235e38;
    for (var i = t; i < p.len; i += 64u) {
        m = max(m, y[b + i]);
    }
    red[t] = m;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half >>= 1u) {
        if (t < half) {
            red[t] = max(red[t], red[t + half]);
        }
        workgroupBarrier();
    }
    m = red[0];
    workgroupBarrier();
    var s = 0.0;
    for (var i = t; i < p.len; i += 64u) {
        let e = exp(y[b + i] - m);
        y[b + i] = e;
        s += e;
    }
    red[t] = s;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half >>= 1u) {
        if (t < half) {
            red[t] += red[t + half];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / red[0];
    for (var i = t; i < p.len; i += 64u) {
        y[b + i] *= inv;
    }
}
