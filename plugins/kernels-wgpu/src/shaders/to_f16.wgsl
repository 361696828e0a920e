// f32 to f16, two values per invocation (one word of the destination).

struct Params {
    pairs: u32,
    x_off: u32,
    y_off: u32,
    grid_x: u32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let i = (wg.x + wg.y * p.grid_x) * 64u + t;
    if (i >= p.pairs) {
        return;
    }
    y[p.y_off + i] = pack2x16float(vec2<f32>(x[p.x_off + 2u * i], x[p.x_off + 2u * i + 1u]));
}
