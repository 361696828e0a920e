// Rotary embedding in place, one invocation per (token, pair): the angle pos · inv_freq[i] is
// formed in f32 as on the CPU, reduced into [−π, π] with 2π split in three parts (so GPUs'
// short-range sin and cos stay exact to f32 at positions in the hundred thousands), and the
// rotation applied to every head. Style 0 pairs (2i, 2i+1), style 1 (i, i + rotary_dim/2).

struct Params {
    tokens: u32,
    heads: u32,
    head_dim: u32,
    half: u32,
    style: u32,
    y_off: u32,
    pos_off: u32,
    grid_x: u32,
    attn_factor: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> positions: array<i32>;
@group(0) @binding(2) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

fn reduce_angle(theta: f32) -> f32 {
    let k = round(theta * 0.15915494);
    return ((theta - k * 6.28125) - k * 0.0019378662109375) - k * -2.559031372584286e-06;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let id = (wg.x + wg.y * p.grid_x) * 64u + t;
    if (id >= p.tokens * p.half) {
        return;
    }
    let token = id / p.half;
    let i = id % p.half;
    let theta = f32(positions[p.pos_off + token]) * inv_freq[i];
    let r = reduce_angle(theta);
    let c = cos(r) * p.attn_factor;
    let s = sin(r) * p.attn_factor;
    var a = 2u * i;
    var b = 2u * i + 1u;
    if (p.style == 1u) {
        a = i;
        b = i + p.half;
    }
    for (var h = 0u; h < p.heads; h++) {
        let base = p.y_off + (token * p.heads + h) * p.head_dim;
        let x0 = y[base + a];
        let x1 = y[base + b];
        y[base + a] = x0 * c - x1 * s;
        y[base + b] = x0 * s + x1 * c;
    }
}
