// Group normalisation, one workgroup per group of channels: mean, then variance about it (two
// passes), then y = (x − mean) / sqrt(var + eps) · w[c] + b[c].

struct Params {
    groups: u32,
    channels: u32,
    spatial: u32,
    x_off: u32,
    w_off: u32,
    b_off: u32,
    y_off: u32,
    eps: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let g = wg.x;
    let per_group = p.channels / p.groups;
    let n = per_group * p.spatial;
    let base = g * n;
    var s = 0.0;
    for (var i = t; i < n; i += 64u) {
        s += x[p.x_off + base + i];
    }
    let mean = workgroup_sum(t, s) / f32(n);
    var ss = 0.0;
    for (var i = t; i < n; i += 64u) {
        let d = x[p.x_off + base + i] - mean;
        ss += d * d;
    }
    let r = 1.0 / sqrt(workgroup_sum(t, ss) / f32(n) + p.eps);
    for (var i = t; i < n; i += 64u) {
        let c = g * per_group + i / p.spatial;
        y[p.y_off + base + i] = (x[p.x_off + base + i] - mean) * r * w[p.w_off + c] + bias[p.b_off + c];
    }
}
