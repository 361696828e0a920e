//! Grafts: KV computed at positions p0.. attached to another sequence at q0, keys re-rotated.

mod common;

use common::{Rng, cache, contents, layout};
use u_cache_kv::Config;
use u_sdk::{RopeParams, RopeStyle};

/// Rotary embedding exactly as the CPU kernel applies it (f32 angle `pos × inv_freq`).
fn rope(x: &mut [f32], positions: &[u32], p: &RopeParams) {
    let (rd, hd) = (p.rotary_dim as usize, p.head_dim as usize);
    let half = rd / 2;
    for (tok, &pos) in x.chunks_exact_mut(p.heads as usize * hd).zip(positions) {
        let cs: Vec<(f32, f32)> = p
            .inv_freq
            .iter()
            .map(|&f| {
                let t = pos as f32 * f;
                (t.cos() * p.attn_factor, t.sin() * p.attn_factor)
            })
            .collect();
        for head in tok.chunks_exact_mut(hd) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match p.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::NeoX => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

fn params(style: RopeStyle, rotary_dim: u32, head_dim: u32, heads: u32) -> RopeParams {
    let inv_freq: Vec<f32> = (0..rotary_dim / 2)
        .map(|i| 10000f32.powf(-(2.0 * i as f32) / rotary_dim as f32))
        .collect();
    RopeParams {
        style,
        rotary_dim,
        head_dim,
        heads,
        inv_freq: inv_freq.into(),
        attn_factor: 1.0,
    }
}

fn graft_case(style: RopeStyle, rotary_dim: u32, p0: usize, q0: usize) -> f32 {
    let (heads, hd, layers) = (2u32, 64u32, 2u32);
    let row = (heads * hd) as usize;
    let rp = params(style, rotary_dim, hd, heads);
    let c = cache(Config::default(), None, layout(layers, heads, hd, "m"));
    let s = c.store();
    let mut rng = Rng(p0 as u64 * 31 + q0 as u64);
    let n = 100;
    let raw = rng.vec(n * row); // the document's un-rotated keys
    let vals = rng.vec(n * row);
    // The document as computed at p0.. inside `src` (after p0 filler tokens).
    let src = s.create().unwrap();
    let dst = s.create().unwrap();
    for l in 0..layers {
        let fill = rng.vec(p0 * row);
        s.append(src, l, &fill, &fill).unwrap();
        let mut k = raw.clone();
        rope(
            &mut k,
            &(p0..p0 + n).map(|p| p as u32).collect::<Vec<_>>(),
            &rp,
        );
        s.append(src, l, &k, &vals).unwrap();
        let fill = rng.vec(q0 * row);
        s.append(dst, l, &fill, &fill).unwrap();
    }
    s.graft(dst, src, p0 as u64, n as u64, &rp).unwrap();
    assert_eq!(s.len(dst).unwrap() as usize, q0 + n);
    // The document computed directly at q0..
    let mut want = raw.clone();
    rope(
        &mut want,
        &(q0..q0 + n).map(|p| p as u32).collect::<Vec<_>>(),
        &rp,
    );
    let mut worst = 0f32;
    for l in 0..layers {
        let (k, v) = contents(&c, dst, l);
        assert_eq!(v[q0 * row..], vals[..], "values must be copied unchanged");
        for (got, want) in k[q0 * row..].chunks(row).zip(want.chunks(row)) {
            let norm = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (a, b) in got.iter().zip(want) {
                worst = worst.max((a - b).abs() / norm);
            }
        }
    }
    assert!(
        worst <= 1e-5,
        "{style:?} rotary {rotary_dim}: graft {p0} → {q0}: relative error {worst:e}"
    );
    worst
}

#[test]
fn grafted_keys_equal_keys_rotated_at_the_new_position() {
    for style in [RopeStyle::Normal, RopeStyle::NeoX] {
        for rotary_dim in [64, 32] {
            for (p0, q0) in [(0, 37), (150, 3), (5, 4000), (700, 700)] {
                let w = graft_case(style, rotary_dim, p0, q0);
                println!(
                    "{style:?} rotary {rotary_dim}: graft {p0} → {q0}: max rel. error {w:.2e}"
                );
            }
        }
    }
}

#[test]
fn a_graft_at_its_own_position_is_bit_exact() {
    let rp = params(RopeStyle::NeoX, 32, 32, 1);
    let c = cache(Config::default(), None, layout(1, 1, 32, "m"));
    let s = c.store();
    let mut rng = Rng(9);
    let src = s.create().unwrap();
    let k = rng.vec(80 * 32);
    s.append(src, 0, &k, &k).unwrap();
    let dst = s.create().unwrap();
    s.append(dst, 0, &k[..10 * 32], &k[..10 * 32]).unwrap();
    s.graft(dst, src, 10, 70, &rp).unwrap();
    assert_eq!(contents(&c, dst, 0).0, k);
    let bad = params(RopeStyle::NeoX, 40, 32, 1);
    assert!(s.graft(dst, src, 0, 1, &bad).is_err());
    assert!(s.graft(dst, src, 70, 20, &rp).is_err());
}
