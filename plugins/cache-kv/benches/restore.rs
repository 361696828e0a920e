//! Restoring a cached 2,000-token prefix (a radix-tree lookup that forks its pages) versus
//! copying the same KV into a fresh sequence, run side by side and reported as a ratio.
//!
//! A second line does the same for the disk tier: a fresh cache (as after a restart) maps and
//! verifies the prefix's checkpoint file, versus copying the KV.
//!
//! `cargo bench -p u-cache-kv --bench restore`

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString},
};
use std::{
    os::fd::IntoRawFd,
    time::{Duration, Instant},
};
use u_cache_kv::{Alloc, Config, KvCachePlugin};
use u_sdk::{DType, Host, Host_TO, KvLayout, LogLevel, UError, WriteMode};

/// A host that grants everything (the benchmark measures the cache, not the checks).
#[derive(Clone)]
struct OpenHost;

fn fd(r: std::io::Result<std::fs::File>) -> RResult<i32, UError> {
    r.map(|f| f.into_raw_fd())
        .map_err(|e| UError::io("bench host", e))
        .into()
}

impl Host for OpenHost {
    fn plugin_name(&self) -> RString {
        "cache-kv".into()
    }
    fn log(&self, _: LogLevel, _: RStr<'_>) {}
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        fd(std::fs::File::open(path.as_str()))
    }
    fn open_write(&self, path: RStr<'_>, _: WriteMode) -> RResult<i32, UError> {
        fd(std::fs::File::create_new(path.as_str()))
    }
    fn rename(&self, from: RStr<'_>, to: RStr<'_>) -> RResult<(), UError> {
        std::fs::rename(from.as_str(), to.as_str())
            .map_err(|e| UError::io("rename", e))
            .into()
    }
    fn remove(&self, path: RStr<'_>) -> RResult<(), UError> {
        std::fs::remove_file(path.as_str())
            .map_err(|e| UError::io("remove", e))
            .into()
    }
    fn threads(&self) -> u32 {
        1
    }
    fn config(&self) -> RString {
        RString::new()
    }
}

const PREFIX: usize = 2000;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    let (layers, kv_heads, head_dim) = (16u32, 8u32, 64u32);
    let row = (kv_heads * head_dim) as usize;
    let layout = KvLayout {
        layers,
        kv_heads,
        head_dim,
        dtype: DType::F32,
        model_id: "bench".into(),
    };
    let dir = std::env::temp_dir().join(format!("u-cache-kv-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = Config {
        dir: Some(dir.to_str().unwrap().to_string()),
        ..Config::default()
    };
    let host = || Some(Host_TO::from_value(OpenHost, TD_Opaque));
    let c = KvCachePlugin::new(config.clone(), host());
    let s = c.store();
    s.configure(layout.clone(), Alloc::Heap).unwrap();
    let tokens: Vec<u32> = (0..PREFIX as u32).collect();
    let data: Vec<Vec<f32>> = (0..layers)
        .map(|l| {
            (0..PREFIX * row)
                .map(|i| ((i + l as usize) % 997) as f32 * 1e-3)
                .collect()
        })
        .collect();
    let warm = s.create().unwrap();
    for (l, d) in data.iter().enumerate() {
        s.append(warm, l as u32, d, d).unwrap();
    }
    s.insert_prefix(&tokens, warm).unwrap();
    let bytes = s.stats().bytes;
    let rounds = 30;
    let (mut restore, mut copy) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        let (seq, matched) = s.lookup_prefix(&tokens).unwrap();
        restore.push(t.elapsed());
        assert_eq!(matched as usize, PREFIX);
        s.release(seq).unwrap();

        let t = Instant::now();
        let seq = s.create().unwrap();
        for l in 0..layers {
            let (mut k, mut v) = (
                Vec::with_capacity(PREFIX * row),
                Vec::with_capacity(PREFIX * row),
            );
            for p in c.clone().pages_of(warm, l).unwrap() {
                k.extend_from_slice(host_f32(&p.keys));
                v.extend_from_slice(host_f32(&p.values));
            }
            s.append(seq, l, &k, &v).unwrap();
        }
        copy.push(t.elapsed());
        s.release(seq).unwrap();
    }
    s.save_checkpoint("prefix", warm).unwrap();
    let mut disk = Vec::new();
    for _ in 0..5 {
        let fresh = KvCachePlugin::new(config.clone(), host());
        fresh
            .store()
            .configure(layout.clone(), Alloc::Heap)
            .unwrap();
        let t = Instant::now();
        let seq = fresh.store().load_checkpoint("prefix").unwrap();
        disk.push(t.elapsed());
        assert_eq!(fresh.store().len(seq).unwrap() as usize, PREFIX);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let (r, cp, d) = (median(restore), median(copy), median(disk));
    println!(
        "restore a {PREFIX}-token prefix ({layers} layers × {kv_heads} kv_heads × {head_dim}, \
         {:.1} MiB of KV): fork from the radix tree {r:?} vs copy {cp:?} (median of {rounds}): \
         restore is {:.0}× faster",
        bytes as f64 / 1048576.0,
        cp.as_secs_f64() / r.as_secs_f64()
    );
    println!(
        "after a restart: map + verify (XXH3-128) the prefix's checkpoint file {d:?} vs copy \
         {cp:?}: {:.2}× (file in the page cache)",
        cp.as_secs_f64() / d.as_secs_f64()
    );
}

/// An f32 page tensor's values, where they lie in host memory.
fn host_f32(t: &u_sdk::TensorDesc) -> &[f32] {
    // SAFETY: the cache's pages are aligned host memory, kept alive by the descriptor's buffer;
    // the tensor lies inside it.
    unsafe {
        std::slice::from_raw_parts(
            (t.buffer.host_address() + t.offset as usize) as *const f32,
            t.shape.elements() as usize,
        )
    }
}
