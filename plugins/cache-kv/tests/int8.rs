//! Int8 KV, opted into per sequence: group 32, one f32 scale per group, bounded error.

mod common;

use common::{Rng, cache, contents, layout};
use u_cache_kv::{Config, PAGE_TOKENS};
use u_sdk::DType;

#[test]
fn int8_error_is_within_half_a_step_of_each_group() {
    let (kv_heads, head_dim) = (3u32, 24u32); // row 72: groups of 32, 32, 8
    let row = 72;
    let c = cache(Config::default(), None, layout(1, kv_heads, head_dim, "m"));
    let s = c.store();
    let a = s.create().unwrap();
    s.set_dtype(a, DType::I8).unwrap();
    let mut rng = Rng(7);
    let n = 150;
    // Magnitudes spread over six orders, so groups have very different scales.
    let keys: Vec<f32> = (0..n * row)
        .map(|i| rng.f32() * 10f32.powi((i / 7 % 6) as i32 - 3))
        .collect();
    let values: Vec<f32> = keys.iter().map(|x| x * -3.0).collect();
    s.append(a, 0, &keys, &values).unwrap();
    let pages = c.pages_of(a, 0).unwrap();
    assert!(
        pages
            .iter()
            .all(|p| p.dtype == DType::I8 && p.keys.dtype == DType::I8)
    );
    let scales = pages[0].key_scales.as_ref().unwrap();
    assert_eq!(scales.shape.elements() as usize, PAGE_TOKENS * 3);
    let (k, v) = contents(&c, a, 0);
    let mut worst = 0f32;
    for (src, got) in [(&keys, &k), (&values, &v)] {
        for (t, (sr, gr)) in src.chunks(row).zip(got.chunks(row)).enumerate() {
            for (g, (sg, gg)) in sr.chunks(32).zip(gr.chunks(32)).enumerate() {
                let amax = sg.iter().fold(0f32, |m, x| m.max(x.abs()));
                let bound = amax / 254.0 * (1.0 + 1e-6);
                for (x, y) in sg.iter().zip(gg) {
                    let e = (x - y).abs();
                    assert!(e <= bound, "token {t} group {g}: error {e} > bound {bound}");
                    if amax > 0.0 {
                        worst = worst.max(e / amax);
                    }
                }
            }
        }
    }
    println!("int8 KV: worst error {worst:.3e} of the group's max (bound 1/254 = 3.94e-3)");
    let f32_page = (2 * PAGE_TOKENS * row * 4) as f64;
    let bytes_per_page = s.stats().bytes as f64 / s.stats().pages as f64;
    println!(
        "int8 page {bytes_per_page} bytes vs f32 {f32_page} bytes ({:.2}×)",
        f32_page / bytes_per_page
    );
    assert!(bytes_per_page * 3.0 < f32_page);
}

#[test]
fn an_int8_sequence_can_fork_an_f32_prefix() {
    let c = cache(Config::default(), None, layout(1, 1, 32, "m"));
    let s = c.store();
    let mut rng = Rng(8);
    let a = s.create().unwrap();
    let k = rng.vec(100 * 32);
    s.append(a, 0, &k, &k).unwrap();
    let b = s.fork(a).unwrap();
    s.set_dtype(b, DType::I8).unwrap();
    let k2 = rng.vec(100 * 32);
    s.append(b, 0, &k2, &k2).unwrap();
    let kinds: Vec<DType> = c.pages_of(b, 0).unwrap().iter().map(|p| p.dtype).collect();
    // Page 0 shared (f32); page 1 copied on write keeps f32; pages 2.. are new int8 pages.
    assert_eq!(kinds, [DType::F32, DType::F32, DType::I8, DType::I8]);
    let (got, _) = contents(&c, b, 0);
    assert_eq!(
        got[..128 * 32],
        [k.clone(), k2[..28 * 32].to_vec()].concat()[..]
    );
    assert_eq!(contents(&c, a, 0).0, k);
    assert!(s.set_dtype(b, DType::F16).is_err());
}
