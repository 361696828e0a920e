//! Helpers for the conformance tests: where the built components are, and ways to make bad
//! copies of them (unsigned, tampered, foreign key, other ABI).
//!
//! The tests run what `cargo xtask build` produced (release binaries, signed plugins under
//! `target/plugins/`, the development key under `target/dev-keys/`); a missing artifact fails the
//! test with the command to run, never skips it.

pub mod serving;

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};
use u_attest::{SecretKey, elf, signing::sign_bytes};
use u_sdk::meta::{ABI_HASH_RANGE, MANIFEST_OFFSET};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace root")
        .to_path_buf()
}

/// A model directory for `u-runner`: an arch-llama fixture's weights and config (`arch`:
/// `llama`, `mixtral`, …) with the engine's 128-token character tokenizer beside them.
pub fn fixture_model_dir(arch: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let weights = root()
        .join("plugins/arch-llama/tests/fixtures/models")
        .join(arch);
    let tokenizer = root().join("plugins/runner-text/tests/fixtures/tiny-tokenizer");
    for (from, name) in [
        (&weights, "config.json"),
        (&weights, "model.safetensors"),
        (&tokenizer, "tokenizer.json"),
        (&tokenizer, "tokenizer_config.json"),
    ] {
        std::fs::copy(from.join(name), dir.path().join(name)).unwrap();
    }
    dir
}

fn built(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask build` (or `cargo xtask test`) first",
        path.display()
    );
    path
}

/// A release binary (`u-runner`, `u-attest`).
pub fn bin(name: &str) -> PathBuf {
    built(root().join("target/release").join(name))
}

/// A signed plugin by manifest name.
pub fn plugin(name: &str) -> PathBuf {
    built(root().join("target/plugins").join(format!("{name}.so")))
}

/// The unsigned build output of a plugin crate (e.g. `libu_loader_gguf.so`).
pub fn unsigned_plugin(file: &str) -> PathBuf {
    built(root().join("target/release").join(file))
}

/// The development public key file.
pub fn dev_pub() -> PathBuf {
    built(root().join("target/dev-keys/dev.pub"))
}

/// The development secret key.
pub fn dev_key() -> SecretKey {
    SecretKey::read(&built(root().join("target/dev-keys/dev.key"))).expect("dev key readable")
}

/// Runs a command and returns its output (never panics on a non-zero exit).
pub fn run(cmd: &mut Command) -> Output {
    cmd.env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// stdout and stderr together, as text.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Flips one byte in the middle of the file's `.text` section.
pub fn flip_code_byte(bytes: &mut [u8]) {
    let facts = elf::analyse(bytes).expect("a component");
    let (_, text) = facts
        .code
        .iter()
        .find(|(name, _)| name == ".text")
        .expect("a .text section");
    bytes[text.start + text.len() / 2] ^= 0x01;
}

/// Changes the ABI hash recorded in `.u.meta` (as if built against another SDK), then re-signs
/// with `key` so only the ABI differs.
pub fn rewrite_abi_and_sign(bytes: &mut [u8], key: &SecretKey) {
    let facts = elf::analyse(bytes).expect("a component");
    bytes[facts.meta.start + ABI_HASH_RANGE.start] ^= 0xff;
    sign_bytes(bytes, key).expect("re-sign");
}

/// Replaces text inside the embedded manifest (same length), without re-signing.
pub fn patch_manifest(bytes: &mut [u8], from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    let facts = elf::analyse(bytes).expect("a component");
    let start = facts.meta.start + MANIFEST_OFFSET;
    let section = &mut bytes[start..facts.meta.end];
    let at = section
        .windows(from.len())
        .position(|w| w == from.as_bytes())
        .expect("text present in manifest");
    section[at..at + to.len()].copy_from_slice(to.as_bytes());
}

/// Writes a deployment manifest with the development key trusted, given `[[plugins]]` blocks.
pub fn deployment(dir: &Path, name: &str, plugins: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    let text = format!(
        "[deployment]\nname = \"{name}\"\nthreads = 1\n\n[[trust]]\nname = \"u-dev\"\nkey_file = \"{}\"\n\n{plugins}",
        dev_pub().display()
    );
    std::fs::write(&path, text).expect("write deployment");
    path
}
