// Row normalisation, one workgroup per row: RMSNorm (mode 0), y = x / sqrt(mean(x²) + eps) · w;
// LayerNorm (mode 1), y = (x − mean) / sqrt(var + eps) · w + b with a two-pass variance.

struct Params {
    rows: u32,
    len: u32,
    mode: u32,
    x_off: u32,
    w_off: u32,
    b_off: u32,
    y_off: u32,
    grid_x: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wg.x + wg.y * p.grid_x;
    if (row >= p.rows) {
        return;
    }
    let xb = p.x_off + row * p.len;
    let n = f32(p.len);
    var mean = 0.0;
    if (p.mode == 1u) {
        var s = 0.0;
        for (var i = t; i < p.len; i += 64u) {
            s += x[xb + i];
        }
        mean = workgroup_sum(t, s) / n;
    }
    var ss = 0.0;
    for (var i = t; i < p.len; i += 64u) {
        let d = x[xb + i] - mean;
        ss += d * d;
    }
    let r = 1.0 / sqrt(workgroup_sum(t, ss) / n + p.eps);
    let yb = p.y_off + row * p.len;
    for (var i = t; i < p.len; i += 64u) {
        var v = (x[xb + i] - mean) * r * w[p.w_off + i];
        if (p.mode == 1u) {
            v += bias[p.b_off + i];
        }
        y[yb + i] = v;
    }
}
