//! Paged KV: forks share pages, writes copy only the page they touch, lent slices never change.

mod common;

use common::{Rng, cache, contents, layout};
use u_cache_kv::{Config, PAGE_TOKENS};

const LAYERS: u32 = 2;
const ROW: usize = 2 * 8;

fn append_all(c: &u_cache_kv::KvCachePlugin, seq: u64, rng: &mut Rng, n: usize) -> Vec<Vec<f32>> {
    (0..LAYERS)
        .map(|l| {
            let k = rng.vec(n * ROW);
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            c.store().append(seq, l, &k, &v).unwrap();
            k
        })
        .collect()
}

fn page_bytes() -> u64 {
    (2 * PAGE_TOKENS * ROW * 4) as u64
}

fn new_cache() -> u_cache_kv::KvCachePlugin {
    cache(Config::default(), None, layout(LAYERS, 2, 8, "m"))
}

#[test]
fn fork_shares_every_page_and_copies_nothing() {
    let c = new_cache();
    let s = c.store();
    let mut rng = Rng(1);
    let a = s.create().unwrap();
    append_all(&c, a, &mut rng, 200);
    let before = s.stats();
    assert_eq!(before.pages, 4 * LAYERS as u64);
    let b = s.fork(a).unwrap();
    assert_eq!(s.stats().bytes, before.bytes, "fork allocated");
    for l in 0..LAYERS {
        let pa = c.pages_of(a, l).unwrap();
        let pb = c.pages_of(b, l).unwrap();
        assert_eq!(pa.len(), pb.len());
        for (x, y) in pa.iter().zip(&pb) {
            assert_eq!(
                common::addr(&x.keys),
                common::addr(&y.keys),
                "fork copied a page"
            );
            assert_eq!(x.tokens, y.tokens);
        }
    }
    assert_eq!(s.len(b).unwrap(), 200);
}

#[test]
fn writing_a_shared_page_copies_only_that_page() {
    let c = new_cache();
    let s = c.store();
    let mut rng = Rng(2);
    let a = s.create().unwrap();
    let ka = append_all(&c, a, &mut rng, 200);
    let b = s.fork(a).unwrap();
    let base = s.stats().bytes;
    // `a` owns the frontier of the shared last page: it appends in place.
    let ka2 = append_all(&c, a, &mut rng, 3);
    assert_eq!(s.stats().bytes, base, "frontier append copied");
    // `b` writes past its view of that page, which `a` already extended: one page per layer.
    let kb2 = append_all(&c, b, &mut rng, 5);
    assert_eq!(s.stats().bytes, base + LAYERS as u64 * page_bytes());
    for l in 0..LAYERS as usize {
        let (k, _) = contents(&c, a, l as u32);
        assert_eq!(k, [ka[l].clone(), ka2[l].clone()].concat());
        let (k, v) = contents(&c, b, l as u32);
        assert_eq!(k, [ka[l].clone(), kb2[l].clone()].concat());
        assert_eq!(v, k.iter().map(|x| -x).collect::<Vec<_>>());
    }
    // Pages before the last stay shared.
    let pa = c.pages_of(a, 0).unwrap();
    let pb = c.pages_of(b, 0).unwrap();
    for i in 0..3 {
        assert_eq!(common::addr(&pa[i].keys), common::addr(&pb[i].keys));
    }
    assert_ne!(common::addr(&pa[3].keys), common::addr(&pb[3].keys));
}

#[test]
fn truncate_then_append_copies_one_page_and_spares_the_fork() {
    let c = new_cache();
    let s = c.store();
    let mut rng = Rng(3);
    let a = s.create().unwrap();
    let ka = append_all(&c, a, &mut rng, 150);
    let b = s.fork(a).unwrap();
    s.truncate(a, 100).unwrap();
    assert_eq!(s.len(a).unwrap(), 100);
    let base = s.stats().bytes;
    let ka2 = append_all(&c, a, &mut rng, 10);
    assert_eq!(s.stats().bytes, base + LAYERS as u64 * page_bytes());
    let (k, _) = contents(&c, b, 0);
    assert_eq!(k, ka[0], "the fork saw the rollback");
    let (k, _) = contents(&c, a, 0);
    assert_eq!(k, [ka[0][..100 * ROW].to_vec(), ka2[0].clone()].concat());
    // Alone (no fork, no lease), a sequence rewinds its own page in place.
    s.release(b).unwrap();
    let before = s.stats();
    s.truncate(a, 70).unwrap();
    append_all(&c, a, &mut rng, 20);
    assert_eq!(s.stats().bytes, before.bytes);
}

#[test]
fn lent_slices_survive_release_truncate_and_rewrite() {
    let c = new_cache();
    let s = c.store();
    let mut rng = Rng(4);
    let a = s.create().unwrap();
    append_all(&c, a, &mut rng, 100);
    let reader = c.clone();
    let pages = reader.pages_of(a, 0).unwrap();
    let copy: Vec<Vec<f32>> = pages.iter().map(|p| common::f32s(&p.keys)).collect();
    // Rewrite the same positions, then drop the sequence entirely.
    s.truncate(a, 10).unwrap();
    append_all(&c, a, &mut rng, 90);
    s.release(a).unwrap();
    for _ in 0..20 {
        let x = s.create().unwrap();
        append_all(&c, x, &mut rng, 64);
    }
    for (p, k) in pages.iter().zip(&copy) {
        assert_eq!(common::f32s(&p.keys), *k);
    }
    assert_eq!(reader.leased(), 2);
    drop(pages);
    let held = s.stats().bytes;
    drop(reader);
    assert_eq!(
        s.stats().bytes,
        held - 2 * page_bytes(),
        "leases not returned"
    );
}

#[test]
fn abi_object_round_trip() {
    let c = new_cache().into_box();
    let a = c.create().unwrap();
    let k: Vec<f32> = (0..3 * ROW).map(|i| i as f32).collect();
    let b = common::backend();
    let kt = common::tensor(&b, &k, ROW);
    for l in 0..LAYERS {
        c.append(a, l, &kt, &kt).unwrap();
    }
    assert_eq!(c.len(a).unwrap(), 3);
    let pages = c.pages(a, 1).unwrap();
    assert_eq!(pages.len(), 1);
    assert_eq!(pages[0].tokens, 3);
    assert_eq!(common::f32s(&pages[0].keys), k);
    let err = c.append(a, 9, &kt, &kt).unwrap_err();
    assert!(err.message.contains("layer 9"), "{}", err.message);
    let short = common::tensor(&b, &k[..5], 5);
    let err = c.append(a, 0, &short, &short).unwrap_err();
    assert!(err.message.contains("whole number"), "{}", err.message);
    assert_eq!(c.stats().unwrap().page_tokens, 64);
}

#[test]
fn concurrent_forks_and_appends_stay_exact() {
    let c = new_cache();
    let mut rng = Rng(5);
    let root = c.store().create().unwrap();
    let base = append_all(&c, root, &mut rng, 100);
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let c = c.clone();
            let base = &base;
            sc.spawn(move || {
                let mut rng = Rng(100 + t);
                for _ in 0..50 {
                    let s = c.store();
                    let f = s.fork(root).unwrap();
                    let n = 1 + rng.below(80);
                    let own = append_all(&c, f, &mut rng, n);
                    for l in 0..LAYERS as usize {
                        let (k, _) = contents(&c, f, l as u32);
                        assert_eq!(k, [base[l].clone(), own[l].clone()].concat());
                    }
                    s.release(f).unwrap();
                }
            });
        }
    });
    let (k, _) = contents(&c, root, 0);
    assert_eq!(k, base[0]);
}
