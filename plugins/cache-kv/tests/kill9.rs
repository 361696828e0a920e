//! Issue 6, faults: `kill -9` during a save leaves the previous checkpoint usable.
//!
//! The test re-runs its own binary as a child that saves the same checkpoint over and over, each
//! version filled with one constant value, and kills it with SIGKILL at varying moments. After
//! every kill, a fresh cache on the same directory must load a checkpoint whose every value is
//! the same version: never a mixture, never a refusal. The same holds for the prefix tree's
//! segment files, and the temporary file the killed writer left is removed when the fresh cache
//! opens the directory.

mod common;

use common::{cache, host, layout};
use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};
use u_cache_kv::{Config, KvCachePlugin};

const TOKENS: usize = 4000;
const ROW: usize = 2 * 16;
const CHILD_DIR: &str = "U_KILL9_CHECKPOINT_DIR";
const PREFIX_CHILD_DIR: &str = "U_KILL9_PREFIX_DIR";

fn disk_cache(dir: &Path) -> KvCachePlugin {
    let config = Config {
        dir: Some(dir.to_str().unwrap().to_string()),
        ..Config::default()
    };
    cache(config, Some(host(dir, "")), layout(2, 2, 16, "kill9-model"))
}

fn save_version(c: &KvCachePlugin, version: u32) {
    let s = c.store();
    let seq = s.create().unwrap();
    let fill = vec![version as f32; TOKENS * ROW];
    for l in 0..2 {
        s.append(seq, l, &fill, &fill).unwrap();
    }
    s.save_checkpoint("chat", seq).unwrap();
    s.release(seq).unwrap();
}

fn prompt() -> Vec<u32> {
    (0..TOKENS as u32).collect()
}

/// Inserts the prompt with KV of one constant value; forgets the tree first so that the insert
/// writes the whole segment again.
fn insert_version(c: &KvCachePlugin, version: u32) {
    let s = c.store();
    s.evict_all();
    let seq = s.create().unwrap();
    let fill = vec![version as f32; TOKENS * ROW];
    for l in 0..2 {
        s.append(seq, l, &fill, &fill).unwrap();
    }
    s.insert_prefix(&prompt(), seq).unwrap();
    s.release(seq).unwrap();
}

/// The child's body: only active when the parent sets the directory.
#[test]
fn saving_child_process() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let c = disk_cache(Path::new(&dir));
    for version in 1.. {
        save_version(&c, version);
        println!("saved {version}");
    }
}

/// The prefix child's body: only active when the parent sets the directory.
#[test]
fn inserting_child_process() {
    let Ok(dir) = std::env::var(PREFIX_CHILD_DIR) else {
        return;
    };
    let c = disk_cache(Path::new(&dir));
    for version in 1.. {
        insert_version(&c, version);
        println!("saved {version}");
    }
}

/// Runs `child` (a test of this binary) with `var` set to `dir` until it has saved a few
/// versions, then kills it with SIGKILL, a little later each `round`.
fn kill_child_after_saves(child: &str, var: &str, dir: &Path, round: u64) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--nocapture", "--test-threads=1"])
        .env(var, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut saved = 0;
    while saved < 2 + round {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("saved ") => saved += 1,
            Some(_) => {}
            None => panic!("child exited early"),
        }
    }
    std::thread::sleep(Duration::from_micros(700 * round));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

#[test]
fn kill_minus_nine_during_a_prefix_write_leaves_the_previous_segment_usable() {
    let dir = tempfile::tempdir().unwrap();
    insert_version(&disk_cache(dir.path()), 0);
    let mut seen_versions = Vec::new();
    let mut temps_removed = 0;
    for round in 0..6u64 {
        kill_child_after_saves(
            "inserting_child_process",
            PREFIX_CHILD_DIR,
            dir.path(),
            round,
        );
        let temps = || {
            std::fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| {
                    let name = e.as_ref().unwrap().file_name();
                    name.to_string_lossy().contains(".tmp.")
                })
                .count()
        };
        let before = temps();
        let c = disk_cache(dir.path());
        assert_eq!(
            temps(),
            0,
            "round {round}: the killed writer's temporary file stayed"
        );
        temps_removed += before;
        let (seq, matched) = c.store().lookup_prefix(&prompt()).unwrap();
        assert_eq!(
            matched as usize, TOKENS,
            "round {round}: the prefix is gone"
        );
        let (k, v) = common::contents(&c, seq, 1);
        let version = k[0];
        assert!(
            k.iter().chain(&v).all(|&x| x == version),
            "round {round}: a torn segment mixes versions"
        );
        seen_versions.push(version);
    }
    println!(
        "versions restored after each kill: {seen_versions:?}; {temps_removed} temporary files \
         of killed writers removed at open"
    );
    assert!(
        seen_versions.iter().any(|&v| v > 0.0),
        "the child never completed a write"
    );
}

#[test]
fn kill_minus_nine_during_save_leaves_the_previous_checkpoint_usable() {
    let dir = tempfile::tempdir().unwrap();
    save_version(&disk_cache(dir.path()), 0);
    let mut seen_versions = Vec::new();
    for round in 0..6u64 {
        kill_child_after_saves("saving_child_process", CHILD_DIR, dir.path(), round);
        let c = disk_cache(dir.path());
        let listed = c.store().checkpoints().unwrap();
        assert_eq!(listed.len(), 1, "round {round}: {listed:?}");
        assert_eq!(listed[0].0, "chat", "round {round}");
        let seq = c
            .store()
            .load_checkpoint("chat")
            .unwrap_or_else(|e| panic!("round {round}: previous checkpoint unusable: {e}"));
        assert_eq!(c.store().len(seq).unwrap() as usize, TOKENS);
        let (k, v) = common::contents(&c, seq, 1);
        let version = k[0];
        assert!(
            k.iter().chain(&v).all(|&x| x == version),
            "round {round}: a torn checkpoint mixes versions"
        );
        seen_versions.push(version);
    }
    println!("versions restored after each kill: {seen_versions:?}");
    assert!(
        seen_versions.iter().any(|&v| v > 0.0),
        "the child never completed a save"
    );
}
