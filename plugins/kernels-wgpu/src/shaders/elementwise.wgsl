// One value per invocation: y = a + b, a ⊙ b, a · f, a + f · b, clamp(a), act(a), act(a) ⊙ b.
// `b` may be shorter than `a` (one row repeated). Codes as `Elementwise` in backend.rs.

struct Params {
    code: u32,
    act: u32,
    n: u32,
    b_len: u32,
    a_off: u32,
    b_off: u32,
    y_off: u32,
    grid_x: u32,
    f0: f32,
    f1: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let i = (wg.x + wg.y * p.grid_x) * 256u + t;
    if (i >= p.n) {
        return;
    }
    let av = a[p.a_off + i];
    let bv = b[p.b_off + i % max(p.b_len, 1u)];
    var r: f32;
    switch p.code {
        case 0u: { r = av + bv; }
        case 1u: { r = av * bv; }
        case 2u: { r = av * p.f0; }
        case 3u: { r = av + p.f0 * bv; }
        case 4u: { r = min(max(av, p.f0), p.f1); }
        case 5u: { r = activate(p.act, av); }
        default: { r = activate(p.act, av) * bv; }
    }
    y[p.y_off + i] = r;
}
