//! Load time of GGUF files of very different sizes: with memory mapping it depends on the header,
//! not on the data. Prints the time to open a 128 MiB and a 2 GiB file (same tensor count) and
//! their ratio.
//!
//! Run: `cargo bench -p u-loader-gguf --bench load`

#[path = "../tests/support/sparse_gguf.rs"]
mod sparse_gguf;

use std::time::{Duration, Instant};
use u_sdk::WeightSet;

fn median_open(path: &std::path::Path, runs: usize) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            let w = u_loader_gguf::open_path(path).expect("open");
            let first = &w.tensors().unwrap()[0];
            let view = w.tensor(first.name.as_str().into()).expect("tensor");
            std::hint::black_box(view.data.len());
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let small = dir.path().join("small.gguf");
    let large = dir.path().join("large.gguf");
    // Same header (32 tensors), 16× the data: any difference in time is the data's doing.
    let small_size = sparse_gguf::write(&small, 32, 1024, 1024).expect("write small");
    let large_size = sparse_gguf::write(&large, 32, 4096, 4096).expect("write large");
    let runs = 51;
    let ts = median_open(&small, runs);
    let tl = median_open(&large, runs);
    let before = sparse_gguf::resident_bytes();
    let kept = u_loader_gguf::open_path(&large).expect("open");
    let grown = sparse_gguf::resident_bytes().saturating_sub(before);
    drop(kept);
    println!("open+first tensor view, median of {runs}:");
    println!("  {:>5} MiB file: {:>9.1?}", small_size >> 20, ts);
    println!("  {:>5} MiB file: {:>9.1?}", large_size >> 20, tl);
    println!(
        "  ratio large/small: {:.2} (file size ratio {:.0}); resident growth on open: {} KiB",
        tl.as_secs_f64() / ts.as_secs_f64(),
        large_size as f64 / small_size as f64,
        grown >> 10
    );
}
