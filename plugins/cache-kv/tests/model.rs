//! Randomized sequences of cache operations (fixed seeds, thousands of operations) against a
//! copy-everything model: after every check, each sequence's KV equals the model's exactly.

mod common;

use common::{Rng, cache, contents, host, host_logged, layout};
use std::collections::HashMap;
use u_cache_kv::{Config, KvCachePlugin, PAGE_TOKENS, quant};
use u_sdk::{DType, KvPage};

const LAYERS: u32 = 3;
const ROW: usize = 40; // 2 heads × 20: int8 groups of 32 + 8

#[derive(Clone)]
struct MSeq {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Whether each page (by index) is int8, fixed when the page was started.
    page_int8: Vec<bool>,
    int8: bool,
}

impl MSeq {
    fn new() -> Self {
        Self {
            keys: vec![Vec::new(); LAYERS as usize],
            values: vec![Vec::new(); LAYERS as usize],
            page_int8: Vec::new(),
            int8: false,
        }
    }
    fn len(&self) -> usize {
        self.keys[0].len() / ROW
    }
}

fn check(c: &KvCachePlugin, id: u64, m: &MSeq) {
    assert_eq!(c.store().len(id).unwrap() as usize, m.len());
    for l in 0..LAYERS as usize {
        let (k, v) = contents(c, id, l as u32);
        assert!(
            k == m.keys[l],
            "seq {id} layer {l}: keys differ from the model"
        );
        assert!(
            v == m.values[l],
            "seq {id} layer {l}: values differ from the model"
        );
    }
}

fn run_ops(seed: u64, ops: usize) {
    let dir = tempfile::tempdir().unwrap();
    let config = Config {
        dir: Some(dir.path().to_str().unwrap().to_string()),
        ..Config::default()
    };
    let c = cache(
        config,
        Some(host(dir.path(), "")),
        layout(LAYERS, 2, 20, "m"),
    );
    let s = c.store();
    let mut saved: HashMap<String, MSeq> = HashMap::new();
    let reader = c.clone();
    let mut leases: Vec<(KvPage, Vec<f32>, Vec<f32>)> = Vec::new();
    let mut rng = Rng(seed);
    let mut model: HashMap<u64, MSeq> = HashMap::new();
    let mut ids: Vec<u64> = Vec::new();
    let mut counts = [0usize; 9];
    for _ in 0..ops {
        let op = if ids.is_empty() { 0 } else { rng.below(9) };
        counts[op] += 1;
        match op {
            0 => {
                let id = s.create().unwrap();
                model.insert(id, MSeq::new());
                ids.push(id);
            }
            1 => {
                let src = ids[rng.below(ids.len())];
                let id = s.fork(src).unwrap();
                model.insert(id, model[&src].clone());
                ids.push(id);
            }
            2 | 3 => {
                let id = ids[rng.below(ids.len())];
                let cap = if rng.below(4) == 0 { 150 } else { 8 };
                let n = 1 + rng.below(cap);
                let m = model.get_mut(&id).unwrap();
                let start = m.len();
                for pos in start..start + n {
                    if pos % PAGE_TOKENS == 0 {
                        m.page_int8.push(m.int8);
                    }
                }
                for l in 0..LAYERS as usize {
                    let (k, v) = (rng.vec(n * ROW), rng.vec(n * ROW));
                    s.append(id, l as u32, &k, &v).unwrap();
                    for i in 0..n {
                        let int8 = m.page_int8[(start + i) / PAGE_TOKENS];
                        for (src, dst) in [(&k, &mut m.keys[l]), (&v, &mut m.values[l])] {
                            let r = &src[i * ROW..(i + 1) * ROW];
                            if int8 {
                                dst.extend(quant::round_trip(r, ROW));
                            } else {
                                dst.extend_from_slice(r);
                            }
                        }
                    }
                }
            }
            4 => {
                let id = ids[rng.below(ids.len())];
                let m = model.get_mut(&id).unwrap();
                let t = rng.below(m.len() + 1);
                s.truncate(id, t as u64).unwrap();
                for l in 0..LAYERS as usize {
                    m.keys[l].truncate(t * ROW);
                    m.values[l].truncate(t * ROW);
                }
                m.page_int8.truncate(t.div_ceil(PAGE_TOKENS));
            }
            5 => {
                let i = rng.below(ids.len());
                let id = ids.swap_remove(i);
                s.release(id).unwrap();
                model.remove(&id);
            }
            6 => {
                let id = ids[rng.below(ids.len())];
                let int8 = rng.below(3) == 0;
                s.set_dtype(id, if int8 { DType::I8 } else { DType::F32 })
                    .unwrap();
                model.get_mut(&id).unwrap().int8 = int8;
            }
            7 => {
                // Checkpoints on the disk tier: save, or load (from the file when forgotten in
                // memory, so the sequence continues on mapped, read-only pages).
                let name = format!("ck{}", rng.below(6));
                if rng.below(2) == 0 {
                    let id = ids[rng.below(ids.len())];
                    s.save_checkpoint(&name, id).unwrap();
                    saved.insert(name, model[&id].clone());
                } else if let Some(m) = saved.get(&name) {
                    if rng.below(2) == 0 {
                        s.forget_checkpoint(&name);
                    }
                    let id = s.load_checkpoint(&name).unwrap();
                    let mut m = m.clone();
                    m.int8 = false;
                    model.insert(id, m);
                    ids.push(id);
                }
            }
            _ => {
                let id = ids[rng.below(ids.len())];
                check(&c, id, &model[&id]);
                if leases.len() < 200 {
                    let layer = rng.below(LAYERS as usize) as u32;
                    for p in reader.pages_of(id, layer).unwrap() {
                        let (k, v) = common::page_f32(&p);
                        leases.push((p, k, v));
                    }
                }
            }
        }
    }
    for id in &ids {
        check(&c, *id, &model[id]);
    }
    // Lent pages never changed, whatever happened to their sequences since.
    for (p, k, v) in &leases {
        assert_eq!(common::page_f32(p).0, *k);
        assert_eq!(common::page_f32(p).1, *v);
    }
    eprintln!("seed {seed}: ops by kind {counts:?}, live {}", ids.len());
    drop(leases);
    drop(reader);
    for id in ids {
        s.release(id).unwrap();
    }
    for name in saved.keys() {
        s.forget_checkpoint(name);
    }
    let st = s.stats();
    assert_eq!((st.bytes, st.pages), (0, 0), "pages leaked");
}

#[test]
fn random_fork_append_truncate_release_against_the_model() {
    for seed in [1, 2, 3, 4] {
        run_ops(seed, 3000);
    }
}

/// KV as a deterministic function of the token prefix, like a real model's.
fn kv(tokens: &[u32], layer: u32) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    let mut h = 0x1234_5678u64;
    for &t in tokens {
        h = Rng(h ^ t as u64).next();
        let mut r = Rng(h ^ layer as u64);
        k.extend(r.vec(ROW));
        v.extend(r.vec(ROW));
    }
    (k, v)
}

fn fill(c: &KvCachePlugin, id: u64, tokens: &[u32], from: usize) {
    for l in 0..LAYERS {
        let (k, v) = kv(tokens, l);
        c.store()
            .append(id, l, &k[from * ROW..], &v[from * ROW..])
            .unwrap();
    }
}

fn check_tokens(c: &KvCachePlugin, id: u64, tokens: &[u32]) {
    assert_eq!(c.store().len(id).unwrap() as usize, tokens.len());
    for l in 0..LAYERS {
        let (k, v) = contents(c, id, l);
        let (ek, ev) = kv(tokens, l);
        assert!(
            k == ek && v == ev,
            "seq {id} layer {l} differs from the model"
        );
    }
}

/// Bytes of the prefix segment files in `dir`.
fn tier_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_str().unwrap().ends_with(".ukvp"))
        .map(|e| e.metadata().unwrap().len())
        .sum()
}

/// With `disk`, the tree is written through to that directory, and at the end a new cache over
/// it (a restart) must find every path ever inserted, whole and exact — or, with a disk budget
/// `max_disk`, each path's KV exact as far as it is still found, the tier within the budget
/// all along, and nothing logged.
fn run_prefix_ops(
    seed: u64,
    ops: usize,
    max_bytes: Option<u64>,
    disk: Option<&std::path::Path>,
    max_disk: Option<u64>,
) {
    let config = Config {
        max_bytes,
        dir: disk.map(|d| d.to_str().unwrap().to_string()),
        max_disk_bytes: max_disk,
        ..Config::default()
    };
    let h = disk.map(|d| host(d, ""));
    let c = cache(config.clone(), h, layout(LAYERS, 2, 20, "m"));
    let mut ever: Vec<Vec<u32>> = Vec::new();
    let s = c.store();
    let mut rng = Rng(seed);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            (0..rng.below(300) + 1)
                .map(|_| rng.below(50) as u32)
                .collect()
        })
        .collect();
    let mut model: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut ids: Vec<u64> = Vec::new();
    let mut inserted: Vec<Vec<u32>> = Vec::new();
    let mut hits = 0;
    for _ in 0..ops {
        let op = if ids.is_empty() { 0 } else { rng.below(7) };
        match op {
            0 => {
                let mut t = prompts[rng.below(prompts.len())].clone();
                t.truncate(rng.below(t.len()) + 1);
                t.extend((0..rng.below(40)).map(|_| rng.below(50) as u32));
                let id = s.create().unwrap();
                fill(&c, id, &t, 0);
                model.insert(id, t);
                ids.push(id);
            }
            1 => {
                let id = ids[rng.below(ids.len())];
                let t = model.get_mut(&id).unwrap();
                let from = t.len();
                t.extend((0..1 + rng.below(70)).map(|_| rng.below(50) as u32));
                fill(&c, id, t, from);
            }
            2 => {
                let id = ids[rng.below(ids.len())];
                let t = model.get_mut(&id).unwrap();
                let n = rng.below(t.len() + 1);
                t.truncate(n);
                s.truncate(id, n as u64).unwrap();
            }
            3 => {
                let id = ids[rng.below(ids.len())];
                let t = &model[&id];
                let p = t[..rng.below(t.len() + 1)].to_vec();
                s.insert_prefix(&p, id).unwrap();
                if let (Some(d), Some(max)) = (disk, max_disk) {
                    let on_disk = tier_bytes(d);
                    assert!(on_disk <= max, "{on_disk} bytes on disk > budget {max}");
                    assert_eq!(s.segment_stats().bytes, on_disk);
                }
                ever.push(p.clone());
                inserted.push(p);
            }
            4 => {
                let mut q = model[&ids[rng.below(ids.len())]].clone();
                q.truncate(rng.below(q.len() + 1));
                q.extend((0..rng.below(20)).map(|_| rng.below(50) as u32));
                let (id, matched) = s.lookup_prefix(&q).unwrap();
                let matched = matched as usize;
                if max_bytes.is_none() && max_disk.is_none() {
                    let floor = inserted
                        .iter()
                        .filter(|p| q.starts_with(p))
                        .map(|p| p.len())
                        .max()
                        .unwrap_or(0);
                    assert!(
                        matched >= floor,
                        "lookup matched {matched} < inserted {floor}"
                    );
                }
                hits += (matched > 0) as usize;
                q.truncate(matched);
                check_tokens(&c, id, &q);
                model.insert(id, q);
                ids.push(id);
            }
            5 => {
                let id = ids.swap_remove(rng.below(ids.len()));
                s.release(id).unwrap();
                model.remove(&id);
            }
            _ => {
                if rng.below(10) == 0 {
                    s.evict_all();
                    inserted.clear();
                } else {
                    let id = ids[rng.below(ids.len())];
                    check_tokens(&c, id, &model[&id]);
                }
            }
        }
    }
    for id in &ids {
        check_tokens(&c, *id, &model[id]);
    }
    let st = s.stats();
    eprintln!(
        "seed {seed} budget {max_bytes:?}: hits {hits}, nodes {}, evictions {}",
        st.prefix_nodes, st.evictions
    );
    if max_bytes.is_some() {
        assert!(st.evictions > 0, "the budget never evicted");
    }
    for id in ids {
        s.release(id).unwrap();
    }
    s.evict_all();
    let st = s.stats();
    assert_eq!((st.bytes, st.prefix_nodes), (0, 0), "pages or nodes leaked");
    assert_eq!(s.mapped_bytes(), 0, "mapped pages leaked");
    let Some(d) = disk else { return };
    let st = s.segment_stats();
    drop(c);
    let (h, logs) = host_logged(d, "");
    let c = cache(config, Some(h), layout(LAYERS, 2, 20, "m"));
    let s = c.store();
    assert!(
        logs.lock().unwrap().is_empty(),
        "restart: {:?}",
        logs.lock().unwrap()
    );
    let mut whole = 0;
    for p in ever.iter().filter(|p| !p.is_empty()) {
        let (id, matched) = s.lookup_prefix(p).unwrap();
        let matched = matched as usize;
        if max_disk.is_none() {
            assert_eq!(matched, p.len(), "after a restart: a prefix is missing");
        }
        whole += (matched == p.len()) as usize;
        check_tokens(&c, id, &p[..matched]);
        s.release(id).unwrap();
    }
    eprintln!(
        "seed {seed} disk budget {max_disk:?}: {} paths inserted, {whole} found whole after a \
         restart; before it {st:?}",
        ever.iter().filter(|p| !p.is_empty()).count()
    );
    if let Some(max) = max_disk {
        assert!(st.deleted > 0, "the disk budget never deleted");
        assert!(tier_bytes(d) <= max);
        assert!(whole > 0);
    }
}

#[test]
fn random_prefix_insert_lookup_evict_against_the_model() {
    for seed in [11, 12, 13] {
        run_prefix_ops(seed, 2000, None, None, None);
    }
    for seed in [21, 22] {
        run_prefix_ops(seed, 2000, Some(2 << 20), None, None);
    }
}

#[test]
fn random_prefix_ops_on_the_disk_tier_then_a_restart_against_the_model() {
    for seed in [31, 32, 33] {
        let dir = tempfile::tempdir().unwrap();
        run_prefix_ops(seed, 2000, None, Some(dir.path()), None);
    }
}

#[test]
fn random_prefix_ops_on_the_disk_tier_within_a_small_disk_budget_then_a_restart() {
    // About 6 paths of 300 tokens (5 pages × 3 layers × 20 KiB each).
    for seed in [41, 42, 43] {
        let dir = tempfile::tempdir().unwrap();
        run_prefix_ops(seed, 2000, None, Some(dir.path()), Some(2 << 20));
    }
}
