//! Moving rotated keys to new positions (a graft's re-rotation, `Op::Rope` with the rows'
//! current positions): keys rotated at p0.. and moved to q0.. equal keys rotated at q0..
//! directly, for both pairings and partial rotary dimensions.

use u_kernels_cpu::{ops, testutil::Rng};
use u_sdk::{RopeParams, RopeStyle};

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

fn positions(from: usize, n: usize) -> Vec<i32> {
    (from..from + n).map(|p| p as i32).collect()
}

fn move_case(style: RopeStyle, rotary_dim: u32, p0: usize, q0: usize) -> f32 {
    let (heads, hd) = (2u32, 64u32);
    let row = (heads * hd) as usize;
    let rp = params(style, rotary_dim, hd, heads);
    let mut rng = Rng::new(p0 as u64 * 31 + q0 as u64);
    let n = 100;
    let raw = rng.vec(n * row, 1.0);
    let mut moved = raw.clone();
    ops::rope(&mut moved, &positions(p0, n), &rp).unwrap();
    ops::rope_move(&mut moved, &positions(q0, n), &positions(p0, n), &rp).unwrap();
    let mut want = raw;
    ops::rope(&mut want, &positions(q0, n), &rp).unwrap();
    let mut worst = 0f32;
    for (got, want) in moved.chunks(row).zip(want.chunks(row)) {
        let norm = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (a, b) in got.iter().zip(want) {
            worst = worst.max((a - b).abs() / norm);
        }
    }
    assert!(
        worst <= 1e-5,
        "{style:?} rotary {rotary_dim}: {p0} → {q0}: relative error {worst:e}"
    );
    worst
}

#[test]
fn moved_keys_equal_keys_rotated_at_the_new_position() {
    for style in [RopeStyle::Normal, RopeStyle::NeoX] {
        for rotary_dim in [64, 32] {
            for (p0, q0) in [(0, 37), (150, 3), (5, 4000), (700, 700)] {
                let w = move_case(style, rotary_dim, p0, q0);
                println!("{style:?} rotary {rotary_dim}: {p0} → {q0}: max rel. error {w:.2e}");
            }
        }
    }
}

#[test]
fn a_move_to_the_same_position_is_bit_exact_and_bad_shapes_are_refused() {
    let rp = params(RopeStyle::NeoX, 32, 32, 1);
    let mut rng = Rng::new(9);
    let k = rng.vec(80 * 32, 1.0);
    let mut same = k.clone();
    ops::rope_move(&mut same, &positions(10, 80), &positions(10, 80), &rp).unwrap();
    assert_eq!(same, k);
    let bad = params(RopeStyle::NeoX, 40, 32, 1);
    assert!(ops::rope_move(&mut same, &positions(0, 80), &positions(0, 80), &bad).is_err());
    assert!(ops::rope_move(&mut same, &positions(0, 80), &positions(0, 79), &rp).is_err());
}
