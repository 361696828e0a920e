// Convolution (2-D, and 1-D as a 2-D of height 1), one output value per invocation:
// y[co, oy, ox] = bias[co] + Σ x[ci, oy·stride + ky − pad_v, ox·stride + kx − pad_h] ·
// w[co, ci, ky, kx], zeros outside the input. Weights f32 (w_f16 = 0) or f16 (1).

struct Params {
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    stride: u32,
    pad_v: u32,
    pad_h: u32,
    h_out: u32,
    w_out: u32,
    has_bias: u32,
    w_f16: u32,
    x_off: u32,
    w_off: u32,
    b_off: u32,
    y_off: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> wt: array<u32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

fn weight(e: u32) -> f32 {
    if (p.w_f16 == 1u) {
        let pair = unpack2x16float(wt[e >> 1u]);
        return select(pair.x, pair.y, (e & 1u) != 0u);
    }
    return bitcast<f32>(wt[e]);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let id = (wg.x + wg.y * p.grid_x) * 64u + t;
    let plane = p.h_out * p.w_out;
    if (id >= p.c_out * plane) {
        return;
    }
    let co = id / plane;
    let oy = (id % plane) / p.w_out;
    let ox = id % p.w_out;
    var s = 0.0;
    if (p.has_bias == 1u) {
        s = bias[p.b_off + co];
    }
    for (var ci = 0u; ci < p.c_in; ci++) {
        for (var ky = 0u; ky < p.kh; ky++) {
            let iy = i32(oy * p.stride + ky) - i32(p.pad_v);
            if (iy < 0 || iy >= i32(p.h)) {
                continue;
            }
            for (var kx = 0u; kx < p.kw; kx++) {
                let ix = i32(ox * p.stride + kx) - i32(p.pad_h);
                if (ix < 0 || ix >= i32(p.w)) {
                    continue;
                }
                let xv = x[p.x_off + (ci * p.h + u32(iy)) * p.w + u32(ix)];
                s += xv * weight(p.w_off + ((co * p.c_in + ci) * p.kh + ky) * p.kw + kx);
            }
        }
    }
    y[p.y_off + id] = s;
}
