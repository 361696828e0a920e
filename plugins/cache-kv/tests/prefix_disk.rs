//! Issue 6, disk tier of the prefix tree: prefixes inserted by one cache are found, bit for bit,
//! by a new cache over the same directory (a restart); segments share pages as in memory;
//! damaged, foreign and orphaned segment files are skipped with a logged reason, not fatal; the
//! budget counts heap pages only; temporary files of dead writers are removed at open. The disk
//! budget (`max_disk_bytes`) deletes least recently used segments, never a pinned one nor one
//! another builds on, and a restart finds exactly the rest.

mod common;

use common::{Rng, contents, host_logged, layout};
use std::{
    collections::BTreeSet,
    path::Path,
    sync::{Arc, Mutex},
};
use u_cache_kv::{Alloc, Config, KvCachePlugin, PAGE_TOKENS, PREFIX_MAGIC};
use u_sdk::DType;

const LAYERS: u32 = 2;
const ROW: usize = 2 * 16;

type Logs = Arc<Mutex<Vec<String>>>;
/// Keys and values of each layer.
type Kv = Vec<(Vec<f32>, Vec<f32>)>;

/// A cache over `dir` (granted `grant`) serving `model`.
fn open(dir: &Path, grant: &Path, model: &str, max_bytes: Option<u64>) -> (KvCachePlugin, Logs) {
    let config = Config {
        dir: Some(dir.to_str().unwrap().to_string()),
        max_bytes,
        // Not the default of 4 × max_bytes: the disk budget has tests of its own below.
        max_disk_bytes: Some(1 << 40),
        ..Config::default()
    };
    let (h, logs) = host_logged(grant, "");
    let c = KvCachePlugin::new(config, Some(h));
    c.store()
        .configure(layout(LAYERS, 2, 16, model), Alloc::Heap)
        .unwrap();
    (c, logs)
}

/// KV as a deterministic function of the token prefix, like a real model's.
fn kv(tokens: &[u32], layer: u32) -> (Vec<f32>, Vec<f32>) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    let mut h = 0x9E37u64;
    for &t in tokens {
        h = Rng(h ^ t as u64).next();
        let mut r = Rng(h ^ layer as u64);
        k.extend(r.vec(ROW));
        v.extend(r.vec(ROW));
    }
    (k, v)
}

/// A sequence holding the KV of `tokens`, int8 from token `int8_from` on, inserted into the
/// tree; returns what it holds (what the tree must give back).
fn insert(c: &KvCachePlugin, tokens: &[u32], int8_from: Option<usize>) -> Kv {
    let s = c.store();
    let seq = s.create().unwrap();
    let split = int8_from.unwrap_or(tokens.len());
    for l in 0..LAYERS {
        let (k, v) = kv(tokens, l);
        s.append(seq, l, &k[..split * ROW], &v[..split * ROW])
            .unwrap();
    }
    if int8_from.is_some() {
        s.set_dtype(seq, DType::I8).unwrap();
        for l in 0..LAYERS {
            let (k, v) = kv(tokens, l);
            s.append(seq, l, &k[split * ROW..], &v[split * ROW..])
                .unwrap();
        }
    }
    s.insert_prefix(tokens, seq).unwrap();
    let held = (0..LAYERS).map(|l| contents(c, seq, l)).collect();
    s.release(seq).unwrap();
    held
}

/// Looks `query` up; checks the match length and that its KV is `want`'s first tokens, bit for
/// bit.
fn found(c: &KvCachePlugin, query: &[u32], matched: usize, want: &Kv) {
    let s = c.store();
    let (seq, m) = s.lookup_prefix(query).unwrap();
    assert_eq!(
        m as usize,
        matched,
        "match length of a {}-token query",
        query.len()
    );
    for l in 0..LAYERS {
        let (k, v) = contents(c, seq, l);
        let (wk, wv) = &want[l as usize];
        assert!(
            k == wk[..matched * ROW] && v == wv[..matched * ROW],
            "layer {l}: restored KV differs from what was inserted"
        );
    }
    s.release(seq).unwrap();
}

fn segments(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".ukvp"))
        .collect()
}

/// Inserts `tokens` and returns the one segment file that insert wrote.
fn insert_new(
    c: &KvCachePlugin,
    dir: &Path,
    tokens: &[u32],
    int8_from: Option<usize>,
) -> (Kv, String) {
    let before = segments(dir);
    let held = insert(c, tokens, int8_from);
    let new: Vec<String> = segments(dir).difference(&before).cloned().collect();
    assert_eq!(new.len(), 1, "one insert, one new segment file");
    (held, new[0].clone())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn path(n: impl IntoIterator<Item = u32>) -> Vec<u32> {
    n.into_iter().collect()
}

#[test]
fn prefixes_survive_a_restart_bit_for_bit_and_share_pages_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prompt = path((0..300).map(|i| i * 7 % 1000));
    let long = [prompt.clone(), path(2000..2050)].concat();
    let branch = [prompt[..130].to_vec(), path(3000..3090)].concat();
    let int8 = [prompt.clone(), path(4000..4100)].concat();
    let (want_prompt, want_long, want_branch, want_int8, sizes) = {
        let (c, _) = open(d, d, "model-a", None);
        let (wp, fp) = insert_new(&c, d, &prompt, None);
        let (wl, fl) = insert_new(&c, d, &long, None);
        let (wb, fb) = insert_new(&c, d, &branch, None);
        let (wi, fi) = insert_new(&c, d, &int8, Some(320));
        // Re-inserting a path already on disk writes nothing.
        insert(&c, &long[..200], None);
        assert_eq!(segments(d).len(), 4);
        // The tree holds mapped pages, no heap: sequences are released, so no heap is left.
        let st = c.store().stats();
        assert_eq!(st.bytes, 0, "tree nodes on disk should hold no heap pages");
        assert!(c.store().mapped_bytes() > 0);
        let header = |f: &str| {
            let b = std::fs::read(d.join(f)).unwrap();
            assert_eq!(b[..8], PREFIX_MAGIC);
            (u64_at(&b, 64), u64_at(&b, 72), b.len())
        };
        // Each segment stores pages from the one holding its first new token on.
        assert_eq!((header(&fp).0, header(&fp).1), (0, 0));
        assert_eq!((header(&fl).0, header(&fl).1), (300 / 64, 300));
        assert_eq!((header(&fb).0, header(&fb).1), (130 / 64, 130));
        assert_eq!((header(&fi).0, header(&fi).1), (300 / 64, 300));
        let sizes = [fp, fl, fb, fi].map(|f| header(&f).2);
        (wp, wl, wb, wi, sizes)
    };
    println!("segment file sizes (prompt, +50, branch at 130, +100 int8): {sizes:?} bytes");
    assert!(
        sizes[1] < sizes[0] / 2,
        "the extension rewrote the shared prompt"
    );

    // A restart: a new cache over the same directory.
    let (c, logs) = open(d, d, "model-a", None);
    assert!(
        logs.lock().unwrap().iter().all(|l| !l.contains("skipping")),
        "{:?}",
        logs.lock().unwrap()
    );
    assert!(c.store().stats().prefix_nodes >= 4);
    let mut q = long.clone();
    q.push(9);
    found(&c, &q, long.len(), &want_long);
    found(&c, &prompt, prompt.len(), &want_prompt);
    found(
        &c,
        &[prompt[..200].to_vec(), vec![7777]].concat(),
        200,
        &want_prompt,
    );
    found(&c, &branch, branch.len(), &want_branch);
    found(
        &c,
        &[branch[..140].to_vec(), vec![1]].concat(),
        140,
        &want_branch,
    );
    found(&c, &int8, int8.len(), &want_int8);
    found(&c, &[5555, 1], 0, &want_prompt);
    assert_eq!(c.store().stats().bytes, 0, "lookups copied pages");
    // Extending a restored path writes only the new pages.
    let more = [long.clone(), path(6000..6010)].concat();
    let (want_more, fm) = insert_new(&c, d, &more, None);
    let b = std::fs::read(d.join(&fm)).unwrap();
    assert_eq!(u64_at(&b, 64), (long.len() / PAGE_TOKENS) as u64);
    drop(c);
    let (c, _) = open(d, d, "model-a", None);
    found(&c, &more, more.len(), &want_more);
    found(&c, &long, long.len(), &want_long);
}

fn flip(p: &Path, at: usize) {
    let mut b = std::fs::read(p).unwrap();
    b[at] ^= 0x04;
    std::fs::write(p, b).unwrap();
}

#[test]
fn damaged_foreign_and_orphaned_segments_are_skipped_and_logged() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = path(0..200);
    let child = [base.clone(), path(500..560)].concat();
    let flipped = path(1000..1100);
    let good = path(2000..2070);
    let (want_good, files) = {
        let (c, _) = open(d, d, "model-a", None);
        let (_, fbase) = insert_new(&c, d, &base, None);
        let (_, fchild) = insert_new(&c, d, &child, None);
        let (_, fflip) = insert_new(&c, d, &flipped, None);
        let (wg, _) = insert_new(&c, d, &good, None);
        (wg, [fbase, fchild, fflip])
    };
    {
        let (other, _) = open(d, d, "model-b", None);
        insert_new(&other, d, &path(0..80), None);
    }
    let [fbase, fchild, fflip] = &files;
    let len = std::fs::metadata(d.join(fbase)).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join(fbase))
        .unwrap()
        .set_len(len - 64)
        .unwrap();
    flip(&d.join(fflip), 5000);
    std::fs::write(d.join("p-junk.ukvp"), [b'x'; 200]).unwrap();

    let (c, logs) = open(d, d, "model-a", None);
    let logs = logs.lock().unwrap().clone();
    for l in &logs {
        println!("{l}");
    }
    let has = |what: &str, file: &str| {
        assert!(
            logs.iter()
                .any(|l| l.starts_with("Warn") && l.contains(what) && l.contains(file)),
            "no warning about {what} for {file}: {logs:?}"
        )
    };
    has("truncated", fbase);
    has("checksum mismatch", fflip);
    has("on no other prefix segment", fchild);
    has("bad magic", "p-junk.ukvp");
    has("made by model \"model-b\"", ".ukvp");
    found(&c, &good, good.len(), &want_good);
    for refused in [&base, &child, &flipped] {
        let (seq, m) = c.store().lookup_prefix(refused).unwrap();
        assert_eq!(m, 0, "a refused segment was used");
        c.store().release(seq).unwrap();
    }
    // The other model's cache finds its own prefix and refuses this one's.
    let (b, logs) = open(d, d, "model-b", None);
    let (seq, m) = b.store().lookup_prefix(&path(0..80)).unwrap();
    assert_eq!(m, 80);
    b.store().release(seq).unwrap();
    assert!(
        logs.lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("\"model-a\""))
    );
}

#[test]
fn the_budget_counts_heap_pages_and_spares_prefixes_on_disk() {
    let page = (2 * PAGE_TOKENS * ROW * 4) as u64;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| path(i * 1000..i * 1000 + 128)).collect();
    let (c, _) = open(d, d, "m", Some(3 * page));
    let wants: Vec<_> = prompts.iter().map(|p| insert(&c, p, None)).collect();
    let st = c.store().stats();
    assert_eq!((st.bytes, st.evictions), (0, 0), "{st:?}");
    assert_eq!(
        c.store().mapped_bytes(),
        8 * LAYERS as u64 * 2 * page,
        "each prompt's two pages per layer, mapped once"
    );
    for (p, w) in prompts.iter().zip(&wants) {
        found(&c, p, p.len(), w);
    }
    // Memory only (persistence off): the same inserts must evict.
    assert!(Config::parse("dir = \"/kv\"").unwrap().persist_prefixes);
    let text = format!(
        "dir = {:?}\nmax_bytes = {}\npersist_prefixes = false",
        d.to_str().unwrap(),
        3 * page
    );
    let config = Config::parse(&text).unwrap();
    let m = KvCachePlugin::new(config, Some(host_logged(d, "").0));
    m.store()
        .configure(layout(LAYERS, 2, 16, "m2"), Alloc::Heap)
        .unwrap();
    for p in &prompts {
        insert(&m, p, None);
    }
    assert!(m.store().stats().evictions > 0);
    assert!(m.store().stats().bytes <= 3 * page);
    assert_eq!(
        segments(d).len(),
        8,
        "persist_prefixes = false wrote segments"
    );
}

#[test]
fn a_failed_segment_write_keeps_the_prefix_in_memory_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let grant = tempfile::tempdir().unwrap();
    let (c, logs) = open(dir.path(), grant.path(), "m", None);
    let p = path(0..100);
    let want = insert(&c, &p, None);
    found(&c, &p, 100, &want);
    assert!(segments(dir.path()).is_empty());
    assert!(
        logs.lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("kept in memory only") && l.contains("outside the fs.write grant")),
        "{:?}",
        logs.lock().unwrap()
    );
}

#[test]
fn stale_temporary_files_of_dead_writers_are_removed_at_open() {
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A pid that is certainly gone: a child that has exited and been reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let ours = std::process::id();
    let stale = [
        format!(".p-0123.ukvp.tmp.{dead}.0"),
        format!(".chat.ukv.tmp.{dead}.7"),
        // This process's pid, unlocked: an earlier process with the same pid (a restart in a
        // container) died mid-save just before this one started.
        format!(".chat.ukv.tmp.{ours}.4"),
        // A live pid (1), unlocked and long untouched: a pid reused by an unrelated process.
        ".chat.ukv.tmp.1.1".to_string(),
    ];
    let kept = [
        format!(".chat.ukv.tmp.{ours}.3"), // a save in progress in this process (locked)
        ".chat.ukv.tmp.1.0".to_string(),   // pid 1 is alive and the file is new
        format!(".notes.tmp.{dead}.0"),    // not ours
        format!(".chat.ukv.tmp.{dead}.x"), // not a temporary file name of ours
    ];
    for n in stale.iter().chain(&kept) {
        std::fs::write(d.join(n), b"partial").unwrap();
    }
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(d.join(".chat.ukv.tmp.1.1"))
        .unwrap()
        .set_modified(long_ago)
        .unwrap();
    let in_progress = std::fs::File::open(d.join(format!(".chat.ukv.tmp.{ours}.3"))).unwrap();
    // SAFETY: flock on a descriptor the file owns.
    assert_eq!(
        unsafe { libc::flock(in_progress.as_raw_fd(), libc::LOCK_EX) },
        0
    );
    let (_c, logs) = open(d, d, "m", None);
    for n in &stale {
        assert!(!d.join(n).exists(), "{n} should be removed");
        assert!(
            logs.lock().unwrap().iter().any(|l| l.contains(n.as_str())),
            "removal of {n} not logged"
        );
    }
    for n in &kept {
        assert!(d.join(n).exists(), "{n} should be kept");
    }
    drop(in_progress);
}

// ---- The disk budget (`max_disk_bytes`) ----

/// A cache over `dir` (granted) with a disk budget of `max_disk_bytes`.
fn open_budget(dir: &Path, max_disk_bytes: u64) -> (KvCachePlugin, Logs) {
    let config = Config {
        dir: Some(dir.to_str().unwrap().to_string()),
        max_disk_bytes: Some(max_disk_bytes),
        ..Config::default()
    };
    let (h, logs) = host_logged(dir, "");
    let c = KvCachePlugin::new(config, Some(h));
    c.store()
        .configure(layout(LAYERS, 2, 16, "m"), Alloc::Heap)
        .unwrap();
    (c, logs)
}

/// Total bytes of the `.ukvp` files in `dir`, measured on disk.
fn tier_bytes(dir: &Path) -> u64 {
    segments(dir)
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).unwrap().len())
        .sum()
}

fn size(dir: &Path, file: &str) -> u64 {
    std::fs::metadata(dir.join(file)).unwrap().len()
}

fn warnings(logs: &Logs) -> Vec<String> {
    let logs = logs.lock().unwrap();
    logs.iter()
        .filter(|l| l.starts_with("Warn"))
        .cloned()
        .collect()
}

/// A copy of `dir` in a new directory: a restart that leaves the running cache alone.
fn copy_of(dir: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for f in segments(dir) {
        std::fs::copy(dir.join(&f), to.path().join(&f)).unwrap();
    }
    to
}

#[test]
fn the_disk_budget_deletes_least_recently_used_prefixes_and_a_restart_finds_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let prompts: Vec<Vec<u32>> = (0..20).map(|i| path(i * 1000..i * 1000 + 100)).collect();
    // Every segment has the same size (100 tokens, 2 pages per layer): learn it once.
    let seg = {
        let probe = tempfile::tempdir().unwrap();
        let (c, _) = open_budget(probe.path(), u64::MAX);
        let (_, f) = insert_new(&c, probe.path(), &prompts[0], None);
        size(probe.path(), &f)
    };
    let budget = seg * 9 / 2; // room for 4 segments
    let (c, logs) = open_budget(d, budget);
    let mut files = Vec::new();
    let mut wants = Vec::new();
    for p in &prompts {
        let (w, f) = insert_new(&c, d, p, None);
        wants.push(w);
        files.push(f);
        let on_disk = tier_bytes(d);
        assert!(
            on_disk <= budget,
            "{on_disk} bytes on disk > budget {budget}"
        );
        let st = c.store().segment_stats();
        assert_eq!(
            (st.bytes, st.segments),
            (on_disk, segments(d).len() as u64),
            "the counted tier differs from the directory"
        );
        // Prompt 0 is in constant use.
        found(&c, &prompts[0], 100, &wants[0]);
    }
    let st = c.store().segment_stats();
    println!(
        "segment {seg} bytes, budget {budget}: {st:?}, {} bytes on disk",
        tier_bytes(d)
    );
    assert_eq!(
        (st.deleted, st.not_written, st.budget),
        (16, 0, Some(budget))
    );
    let survivors = [0, 17, 18, 19];
    let expect: BTreeSet<String> = survivors.iter().map(|&i| files[i].clone()).collect();
    assert_eq!(
        segments(d),
        expect,
        "the recently used prefixes are the ones kept"
    );
    // The tree no longer claims the deleted ones; the rest are whole.
    for (i, p) in prompts.iter().enumerate() {
        let n = if survivors.contains(&i) { 100 } else { 0 };
        found(&c, p, n, &wants[i]);
    }
    assert!(warnings(&logs).is_empty(), "{:?}", warnings(&logs));
    drop(c);

    let (c, logs) = open_budget(d, budget);
    assert!(warnings(&logs).is_empty(), "restart: {:?}", warnings(&logs));
    assert_eq!(c.store().stats().prefix_nodes, 4);
    assert_eq!(c.store().segment_stats().bytes, tier_bytes(d));
    for (i, p) in prompts.iter().enumerate() {
        let n = if survivors.contains(&i) { 100 } else { 0 };
        found(&c, p, n, &wants[i]);
    }
    // A smaller budget applies when the directory is opened.
    drop(c);
    let (c, logs) = open_budget(d, seg * 5 / 2);
    assert!(warnings(&logs).is_empty(), "{:?}", warnings(&logs));
    assert_eq!(segments(d).len(), 2);
    assert_eq!(c.store().segment_stats().deleted, 2);
}

#[test]
fn a_pinned_prefix_is_never_deleted_for_the_disk_budget() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pinned = path(0..100);
    let (want, file) = {
        let probe = tempfile::tempdir().unwrap();
        let (c, _) = open_budget(probe.path(), u64::MAX);
        let (_, f) = insert_new(&c, probe.path(), &pinned, None);
        (size(probe.path(), &f), f)
    };
    let (c, logs) = open_budget(d, want * 5 / 2); // room for 2 segments
    let (wp, fp) = insert_new(&c, d, &pinned, None);
    assert_eq!(fp, file);
    let (held, m) = c.store().lookup_prefix(&pinned).unwrap();
    assert_eq!(m, 100);
    let mut last = String::new();
    for i in 1..12 {
        let (_, f) = insert_new(&c, d, &path(i * 1000..i * 1000 + 100), None);
        assert!(d.join(&fp).exists(), "insert {i} deleted the pinned prefix");
        assert!(tier_bytes(d) <= want * 5 / 2);
        last = f;
    }
    assert_eq!(segments(d), BTreeSet::from([fp.clone(), last.clone()]));
    // The pinned sequence reads the same KV all along.
    for l in 0..LAYERS {
        let (k, v) = contents(&c, held, l);
        assert!(k == wp[l as usize].0 && v == wp[l as usize].1);
    }
    c.store().release(held).unwrap();
    // Released, it is the least recently used: the next insert deletes it.
    let (_, f) = insert_new(&c, d, &path(50_000..50_100), None);
    assert_eq!(segments(d), BTreeSet::from([last, f]));
    found(&c, &pinned, 0, &wp);
    assert!(warnings(&logs).is_empty(), "{:?}", warnings(&logs));
}

#[test]
fn an_ancestor_segment_outlives_the_segments_built_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let a = path(0..200);
    let b = [a.clone(), path(500..600)].concat(); // pages 3.. on disk, 0..3 from a
    let br = [a[..130].to_vec(), path(700..800)].concat(); // pages 2.., 0..2 from a
    let unrelated: Vec<Vec<u32>> = (0..8)
        .map(|i| path(10_000 * (i + 1)..10_000 * (i + 1) + 100))
        .collect();
    let (c, logs) = {
        // Sizes first, in a scratch directory.
        let probe = tempfile::tempdir().unwrap();
        let p = probe.path();
        let (c, _) = open_budget(p, u64::MAX);
        let sizes: Vec<u64> = [&a, &b, &br, &unrelated[0]]
            .iter()
            .map(|t| size(p, &insert_new(&c, p, t, None).1))
            .collect();
        println!("segment sizes (a, b on a, branch on a, unrelated): {sizes:?}");
        assert!(sizes[1] < sizes[0] && sizes[2] < sizes[0]);
        // Room for a, b, the branch and one unrelated segment and a half.
        open_budget(d, sizes[0] + sizes[1] + sizes[2] + sizes[3] * 3 / 2)
    };
    let (wa, fa) = insert_new(&c, d, &a, None);
    let (wb, fb) = insert_new(&c, d, &b, None);
    let (wbr, fbr) = insert_new(&c, d, &br, None);
    let mut gone = Vec::new();
    let mut mid_restart = None;
    for (i, u) in unrelated.iter().enumerate() {
        insert_new(&c, d, u, None);
        let has = |f: &str| d.join(f).exists();
        for f in [&fa, &fb, &fbr] {
            if !has(f) && !gone.contains(f) {
                gone.push(f.clone());
            }
        }
        assert!(
            has(&fa) || (!has(&fb) && !has(&fbr)),
            "after unrelated insert {i}: a was deleted before a segment built on it"
        );
        if !has(&fb) && has(&fbr) && mid_restart.is_none() {
            // b's pages past a are gone from the tree; a's are still there.
            found(&c, &b, a.len(), &wb);
            found(&c, &br, br.len(), &wbr);
            mid_restart = Some(copy_of(d));
        }
    }
    // Least recently used first, but a (the oldest) only after b and the branch.
    assert_eq!(gone, [fb.clone(), fbr.clone(), fa.clone()]);
    assert!(warnings(&logs).is_empty(), "{:?}", warnings(&logs));
    // A restart between the deletions of b and of the branch restores a and the branch whole.
    let copy = mid_restart.expect("a state with b deleted and the branch kept");
    let (r, logs) = open_budget(copy.path(), u64::MAX);
    assert!(warnings(&logs).is_empty(), "{:?}", warnings(&logs));
    found(&r, &a, a.len(), &wa);
    found(&r, &br, br.len(), &wbr);
    found(&r, &b, a.len(), &wb);
}

#[test]
fn a_segment_larger_than_the_disk_budget_stays_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (c, logs) = open_budget(d, 4096);
    let p = path(0..100);
    let want = insert(&c, &p, None);
    insert(&c, &path(1000..1100), None);
    assert!(segments(d).is_empty());
    found(&c, &p, 100, &want);
    let st = c.store().segment_stats();
    assert_eq!((st.segments, st.bytes, st.not_written), (0, 0, 2));
    let w = warnings(&logs);
    assert!(
        w.len() == 1 && w[0].contains("does not fit in the disk budget"),
        "{w:?}"
    );
    assert!(c.store().stats().bytes > 0, "heap pages in the tree");
}

#[test]
fn the_disk_budget_defaults_to_four_times_the_heap_budget() {
    let c = |t: &str| Config::parse(t).unwrap().disk_budget();
    assert_eq!(c("max_bytes = 1000"), Some(4000));
    assert_eq!(c("max_bytes = 1000\nmax_disk_bytes = 7"), Some(7));
    let default = Config::default();
    assert_eq!(
        default.disk_budget(),
        default.max_bytes.map(|b| 4 * b),
        "bounded by default"
    );
    assert!(default.disk_budget().is_some());
}

#[test]
fn concurrent_inserts_stay_within_the_disk_budget_and_restart_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let system = path(0..150);
    let budget = 1 << 20; // about 20 of the 60-token segments, beside the system prompt's
    let (c, logs) = open_budget(d, budget);
    let want_system = insert(&c, &system, None);
    let prompts: Vec<Vec<Vec<u32>>> = (0..4u32)
        .map(|t| {
            (0..40u32)
                .map(|i| {
                    let at = 100_000 * (t + 1) + 100 * i;
                    [system.clone(), path(at..at + 60)].concat()
                })
                .collect()
        })
        .collect();
    let wants: Vec<Vec<Kv>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|mine| {
                let (c, system) = (c.clone(), &system);
                s.spawn(move || {
                    let mut wants = Vec::new();
                    for (i, p) in mine.iter().enumerate() {
                        wants.push(insert(&c, p, None));
                        // Lookups pin nodes while other threads write and delete.
                        let (seq, m) = c.store().lookup_prefix(&mine[i / 2]).unwrap();
                        assert!(m as usize >= system.len());
                        c.store().release(seq).unwrap();
                    }
                    wants
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let st = c.store().segment_stats();
    println!("{st:?}, {} bytes on disk", tier_bytes(d));
    assert!(tier_bytes(d) <= budget);
    assert_eq!(st.bytes, tier_bytes(d));
    assert!(st.deleted > 0);
    assert!(warnings(&logs).is_empty(), "{:?}", warnings(&logs));
    drop(c);
    let (c, logs) = open_budget(d, budget);
    assert!(warnings(&logs).is_empty(), "restart: {:?}", warnings(&logs));
    found(&c, &system, system.len(), &want_system);
    let mut whole = 0;
    for (mine, wants) in prompts.iter().zip(&wants) {
        for (p, w) in mine.iter().zip(wants) {
            let (seq, m) = c.store().lookup_prefix(p).unwrap();
            c.store().release(seq).unwrap();
            assert!(m as usize == p.len() || m as usize == system.len());
            whole += (m as usize == p.len()) as usize;
            found(&c, p, m as usize, w);
        }
    }
    assert_eq!(whole as u64 + 1, c.store().segment_stats().segments);
}
