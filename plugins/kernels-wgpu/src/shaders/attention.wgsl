// Flash attention, one workgroup per (query, head): keys in tiles of 64, one score per
// invocation, the running maximum and sum carried across tiles (online softmax), each
// invocation accumulating head_dim / 64 output dimensions. K and V are contiguous
// [kv_len, kv_heads · head_dim] in f32 (kv_f16 = 0) or f16 pairs (kv_f16 = 1).

struct Params {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    queries: u32,
    kv_len: u32,
    first: u32,
    window: u32,
    kv_f16: u32,
    k_off: u32,
    v_off: u32,
    q_off: u32,
    y_off: u32,
    grid_x: u32,
    scale: f32,
    softcap: f32,
}

@group(0) @binding(0) var<storage, read> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kw: array<u32>;
@group(0) @binding(3) var<storage, read> vw: array<u32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const TILE: u32 = 64u;
const MAX_DIM: u32 = 512u;
const PER_THREAD: u32 = 8u;

var<workgroup> qv: array<f32, 512>;
var<workgroup> probs: array<f32, 64>;
var<workgroup> red: array<f32, 64>;

fn k_at(i: u32) -> f32 {
    let e = p.k_off + i;
    if (p.kv_f16 == 1u) {
        let pair = unpack2x16float(kw[e >> 1u]);
        return select(pair.x, pair.y, (e & 1u) != 0u);
    }
    return bitcast<f32>(kw[e]);
}

fn v_at(i: u32) -> f32 {
    let e = p.v_off + i;
    if (p.kv_f16 == 1u) {
        let pair = unpack2x16float(vw[e >> 1u]);
        return select(pair.x, pair.y, (e & 1u) != 0u);
    }
    return bitcast<f32>(vw[e]);
}

fn tile_reduce(t: u32, v: f32, is_max: bool) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var half = 32u; half > 0u; half >>= 1u) {
        if (t < half) {
            if (is_max) {
                red[t] = max(red[t], red[t + half]);
            } else {
                red[t] += red[t + half];
            }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let item = wg.x + wg.y * p.grid_x;
    if (item >= p.queries * p.heads) {
        return;
    }
    let qi = item / p.heads;
    let h = item % p.heads;
    let kvh = h / (p.heads / p.kv_heads);
    let d = p.head_dim;
    let qb = p.q_off + (qi * p.heads + h) * d;
    for (var i = t; i < d; i += TILE) {
        qv[i] = q[qb + i];
    }
    workgroupBarrier();
    let pos = p.first + qi;
    let hi = min(pos + 1u, p.kv_len);
    var lo = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        lo = pos + 1u - p.window;
    }
    let row = p.kv_heads * d;
    var m = -3.4028235e38;
    var l = 0.0;
    var acc: array<f32, 8>;
    for (var start = lo; start < hi; start += TILE) {
        let j = start + t;
        var s = -3.4028235e38;
        if (j < hi) {
            let kb = j * row + kvh * d;
            var dot = 0.0;
            for (var i = 0u; i < d; i++) {
                dot += qv[i] * k_at(kb + i);
            }
            s = dot * p.scale;
            if (p.softcap > 0.0) {
                s = p.softcap * tanh(s / p.softcap);
            }
        }
        let new_m = max(m, tile_reduce(t, s, true));
        var e = 0.0;
        if (j < hi) {
            e = exp(s - new_m);
        }
        probs[t] = e;
        let alpha = exp(m - new_m);
        l = l * alpha + tile_reduce(t, e, false);
        let count = min(TILE, hi - start);
        for (var r = 0u; r < PER_THREAD; r++) {
            let dim = t + r * TILE;
            if (dim < d) {
                var sum = acc[r] * alpha;
                for (var u = 0u; u < count; u++) {
                    sum += probs[u] * v_at((start + u) * row + kvh * d + dim);
                }
                acc[r] = sum;
            }
        }
        m = new_m;
        workgroupBarrier();
    }
    let yb = p.y_off + (qi * p.heads + h) * d;
    for (var r = 0u; r < PER_THREAD; r++) {
        let dim = t + r * TILE;
        if (dim < d) {
            y[yb + dim] = select(0.0, acc[r] / l, l > 0.0);
        }
    }
}
