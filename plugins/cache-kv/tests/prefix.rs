//! The radix prefix cache: compressed edges, deepest match, pins, LRU eviction under a budget,
//! and the memory of many sessions sharing one long prompt.

mod common;

use common::{Rng, backend, cache, contents, host, layout, tensor};
use u_cache_kv::{Config, PAGE_TOKENS};
use u_sdk::PluginInstance;

fn fill(c: &u_cache_kv::KvCachePlugin, id: u64, layers: u32, row: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed);
    for l in 0..layers {
        let k = rng.vec(n * row);
        c.store().append(id, l, &k, &k).unwrap();
    }
}

#[test]
fn a_long_shared_prefix_is_one_edge_and_lookup_is_deepest() {
    let c = cache(Config::default(), None, layout(1, 1, 32, "m"));
    let s = c.store();
    let prompt: Vec<u32> = (0..2000).collect();
    let a = s.create().unwrap();
    fill(&c, a, 1, 32, 2000, 1);
    s.insert_prefix(&prompt, a).unwrap();
    assert_eq!(s.prefix_edges(&prompt), 1);
    assert_eq!(s.stats().prefix_nodes, 1);
    // A second prompt diverging at 1500 splits the edge there.
    let mut other = prompt[..1500].to_vec();
    other.extend(5000..5100);
    let b = s.fork(a).unwrap();
    s.truncate(b, 1500).unwrap();
    fill(&c, b, 1, 32, 100, 2);
    s.insert_prefix(&other, b).unwrap();
    assert_eq!(s.prefix_edges(&prompt), 2);
    assert_eq!(s.stats().prefix_nodes, 3);
    // Deepest match, inside an edge too.
    let mut q = prompt[..1800].to_vec();
    q.push(99_999);
    let (m, matched) = s.lookup_prefix(&q).unwrap();
    assert_eq!(matched, 1800);
    assert_eq!(contents(&c, m, 0).0, contents(&c, a, 0).0[..1800 * 32]);
    let (m2, matched) = s.lookup_prefix(&other).unwrap();
    assert_eq!(matched, 1600);
    assert_eq!(contents(&c, m2, 0), contents(&c, b, 0));
    let (_, matched) = s.lookup_prefix(&[7, 7, 7]).unwrap();
    assert_eq!(matched, 0);
    // Evicting the other branch folds the split back into one edge.
    for seq in [a, b, m2] {
        s.release(seq).unwrap();
    }
    s.evict_all(); // `m` still pins the prompt's node
    assert_eq!(s.prefix_edges(&prompt), 1);
    assert_eq!(s.stats().prefix_nodes, 1);
    let (m3, matched) = s.lookup_prefix(&prompt).unwrap();
    assert_eq!(matched, 2000);
    assert_eq!(contents(&c, m3, 0).0[..1800 * 32], contents(&c, m, 0).0[..]);
    for seq in [m, m3] {
        s.release(seq).unwrap();
    }
    s.evict_all();
    assert_eq!(s.stats().prefix_nodes, 0);
}

#[test]
fn thousand_sessions_share_one_copy_of_a_2000_token_prompt() {
    let (layers, kv_heads, head_dim) = (4u32, 2u32, 32u32);
    let row = (kv_heads * head_dim) as usize;
    let c = cache(
        Config::default(),
        None,
        layout(layers, kv_heads, head_dim, "m"),
    );
    let s = c.store();
    let page = (2 * PAGE_TOKENS * row * 4) as u64;
    let prompt: Vec<u32> = (0..2000).map(|i| i * 7 % 32000).collect();
    let warm = s.create().unwrap();
    fill(&c, warm, layers, row, 2000, 1);
    s.insert_prefix(&prompt, warm).unwrap();
    s.release(warm).unwrap();
    let prefix_pages = 2000usize.div_ceil(PAGE_TOKENS) as u64 * layers as u64;
    assert_eq!(s.stats().bytes, prefix_pages * page);
    let own = 20;
    let mut sessions = Vec::new();
    for i in 0..1000u64 {
        let mut q = prompt.clone();
        q.extend([40_000 + i as u32; 3]);
        let (seq, matched) = s.lookup_prefix(&q).unwrap();
        assert_eq!(matched, 2000);
        fill(&c, seq, layers, row, own, 100 + i);
        sessions.push(seq);
    }
    let st = s.stats();
    // Each session's own tokens land in one page per layer (the prompt's partly filled last
    // page, copied on write); the first session owns that page's frontier and appends in place.
    let expected = (prefix_pages + 999 * layers as u64) * page;
    let copy_all = 1000 * (2000 + own).div_ceil(PAGE_TOKENS) as u64 * layers as u64 * page;
    println!(
        "1000 sessions × (2000 shared + {own} own tokens), {layers} layers × {kv_heads} kv_heads × \
         {head_dim}: {} bytes held ({:.1} MiB; prompt once = {:.1} MiB, own pages = {:.1} MiB) vs \
         {:.1} MiB copying everything: {:.1}× less",
        st.bytes,
        st.bytes as f64 / 1048576.0,
        (prefix_pages * page) as f64 / 1048576.0,
        (999 * layers as u64 * page) as f64 / 1048576.0,
        copy_all as f64 / 1048576.0,
        copy_all as f64 / st.bytes as f64
    );
    assert_eq!(st.bytes, expected);
    for &seq in sessions.iter().step_by(97) {
        let (k, _) = contents(&c, seq, 3);
        assert_eq!(k.len(), 2020 * row);
        let mut rng = Rng(1);
        let mut want = Vec::new();
        for _ in 0..4 {
            want = rng.vec(2000 * row);
        }
        assert_eq!(k[..2000 * row], want[..]);
    }
}

#[test]
fn pinned_prefixes_survive_eviction_and_lru_goes_first() {
    let row = 32;
    let page = (2 * PAGE_TOKENS * row * 4) as u64;
    let config = Config {
        max_bytes: Some(6 * page),
        ..Config::default()
    };
    let c = cache(config, None, layout(1, 1, 32, "m"));
    let s = c.store();
    let insert = |base: u32, seed: u64| {
        let t: Vec<u32> = (base..base + 128).collect();
        let a = s.create().unwrap();
        fill(&c, a, 1, row, 128, seed);
        s.insert_prefix(&t, a).unwrap();
        s.release(a).unwrap();
        t
    };
    let p1 = insert(0, 1); // 2 pages each
    let p2 = insert(1000, 2);
    let (user, m) = s.lookup_prefix(&p1).unwrap(); // pins p1 and makes it recent
    assert_eq!(m, 128);
    let _p3 = insert(2000, 3); // 6 pages: at the budget
    let _p4 = insert(3000, 4); // 8 pages: evicts the least recently used unpinned entry, p2
    assert_eq!(s.stats().evictions, 1);
    assert!(s.stats().bytes <= 6 * page);
    let (_, m) = s.lookup_prefix(&p2).unwrap();
    assert_eq!(m, 0, "p2 should have been evicted");
    let _p5 = insert(4000, 5);
    let _p6 = insert(5000, 6);
    let (_, m) = s.lookup_prefix(&p1).unwrap();
    assert_eq!(m, 128, "a pinned prefix was evicted");
    s.release(user).unwrap();
}

#[test]
fn budget_comes_from_the_plugin_config() {
    let dir = tempfile::tempdir().unwrap();
    let h = host(dir.path(), "max_bytes = 100000\n");
    let PluginInstance::Cache(c) = u_cache_kv::instantiate(h).unwrap() else {
        panic!("not a cache")
    };
    let b = backend();
    c.configure(layout(1, 1, 32, "m"), b.clone()).unwrap();
    for i in 0..10u32 {
        let t: Vec<u32> = (i * 1000..i * 1000 + 64).collect();
        let a = c.create().unwrap();
        let k = vec![i as f32; 64 * 32];
        let k = tensor(&b, &k, 32);
        c.append(a, 0, &k, &k).unwrap();
        c.insert_prefix(t.as_slice().into(), a).unwrap();
        c.release(a).unwrap();
    }
    let st = c.stats().unwrap();
    assert!(st.bytes <= 100_000, "{st:?}");
    assert!(st.evictions > 0);
    let default = u_cache_kv::Config::parse("").unwrap().max_bytes;
    assert!(
        default.is_some_and(|b| b > 0),
        "a bounded default budget: {default:?}"
    );
    let h = host(dir.path(), "max_bytes = \"lots\"\n");
    let Err(e) = u_cache_kv::instantiate(h) else {
        panic!("bad config accepted")
    };
    assert!(e.message.contains("cache-kv config"), "{}", e.message);
}

#[test]
fn concurrent_lookups_inserts_and_evictions_stay_exact() {
    let row = 32;
    let page = (2 * PAGE_TOKENS * row * 4) as u64;
    let config = Config {
        max_bytes: Some(40 * page),
        ..Config::default()
    };
    let c = cache(config, None, layout(1, 1, 32, "m"));
    // KV of token t at position i is a function of (t, i), so any cached prefix must match.
    let kv = |tokens: &[u32], from: usize| -> Vec<f32> {
        tokens[from..]
            .iter()
            .enumerate()
            .flat_map(|(i, &t)| {
                (0..row).map(move |j| (t * 1000 + (from + i) as u32 + j as u32) as f32)
            })
            .collect()
    };
    std::thread::scope(|sc| {
        for th in 0..4u64 {
            let c = c.clone();
            sc.spawn(move || {
                let s = c.store();
                let mut rng = Rng(th);
                for _ in 0..150 {
                    let p = rng.below(6) as u32;
                    let mut q: Vec<u32> = (0..100 + 20 * p).map(|i| p * 100 + i % 7).collect();
                    q.extend((0..rng.below(50)).map(|_| rng.below(9) as u32));
                    let (seq, matched) = s.lookup_prefix(&q).unwrap();
                    let k = kv(&q, matched as usize);
                    s.append(seq, 0, &k, &k).unwrap();
                    let (got, _) = contents(&c, seq, 0);
                    assert_eq!(got, kv(&q, 0), "thread {th}: cached prefix differs");
                    s.insert_prefix(&q, seq).unwrap();
                    s.release(seq).unwrap();
                }
            });
        }
    });
    let st = c.store().stats();
    println!("concurrent prefix use: {st:?}");
    assert!(st.bytes <= 40 * page);
    assert!(st.evictions > 0);
}

/// `flush_prefixes` (SGLang's `flush_cache`) forgets every prefix no sequence pins, and returns
/// how many entries went; a pinned one, and checkpoints, stay.
#[test]
fn a_flush_forgets_unpinned_prefixes_and_keeps_pinned_ones() {
    use u_sdk::KvCache;
    let c = cache(Config::default(), None, layout(1, 1, 32, "m"));
    let s = c.store();
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| (i * 1000..i * 1000 + 64).collect())
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        let a = s.create().unwrap();
        fill(&c, a, 1, 32, 64, i as u64);
        s.insert_prefix(p, a).unwrap();
        if i == 0 {
            s.save_checkpoint("kept", a).unwrap();
        }
        s.release(a).unwrap();
    }
    let (user, m) = s.lookup_prefix(&prompts[0]).unwrap(); // pins prompt 0
    assert_eq!(m, 64);
    assert_eq!(c.flush_prefixes().unwrap(), 2);
    let matched = |p: &[u32]| {
        let (seq, n) = s.lookup_prefix(p).unwrap();
        s.release(seq).unwrap();
        n
    };
    for (p, want) in prompts.iter().zip([64, 0, 0]) {
        assert_eq!(matched(p), want);
    }
    s.release(user).unwrap();
    assert_eq!(c.flush_prefixes().unwrap(), 1);
    assert_eq!(matched(&prompts[0]), 0);
    assert_eq!(s.stats().prefix_nodes, 0);
    let names: Vec<String> = s
        .checkpoints()
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names, ["kept"]);
}
