// Nearest-neighbour upsampling by `factor` on both spatial axes, one output value per
// invocation.

struct Params {
    c: u32,
    h: u32,
    w: u32,
    factor: u32,
    x_off: u32,
    y_off: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let id = (wg.x + wg.y * p.grid_x) * 64u + t;
    let wo = p.w * p.factor;
    let plane = p.h * p.factor * wo;
    if (id >= p.c * plane) {
        return;
    }
    let c = id / plane;
    let oy = (id % plane) / wo;
    let ox = id % wo;
    y[p.y_off + id] = x[p.x_off + (c * p.h + oy / p.factor) * p.w + ox / p.factor];
}
