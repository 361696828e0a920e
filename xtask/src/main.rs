//! `cargo xtask <command>` — the project's build-and-sign step and its two README commands.
//!
//! - `build`: `cargo build --release` of the workspace, then every component that carries a
//!   `.u.meta` section is signed with the development key (made on first use under
//!   `target/dev-keys/`): plugins are copied to `target/plugins/<name>.so` and signed there, and
//!   `target/release/u-runner` is signed in place.
//! - `test`: `build`, then the whole test suite (`cargo test --release --workspace`).
//! - `run`: `build`, then the main job on the development deployment `manifests/dev.toml`.
//! - `fuzz [SECONDS]`: a short `cargo fuzz` run (default 30 s) of every parser target under
//!   `plugins/*/fuzz`, seeded with the plugin's fixtures. Needs `cargo-fuzz` (installed on first
//!   use) and uses `RUSTC_BOOTSTRAP=1` because only the stable toolchain is available.

use anyhow::{Context, Result, bail};
use std::{
    path::{Path, PathBuf},
    process::Command,
};
use u_attest::{SecretKey, signing::sign_bytes};
use u_sdk::{manifest::PluginManifest, meta::MetaRecord};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    match args.first().map(String::as_str) {
        Some("build") => build(&root),
        Some("test") => {
            build(&root)?;
            cargo(&root, &["test", "--release", "--workspace"])
        }
        Some("run") => {
            build(&root)?;
            run_main_job(&root, &args[1..])
        }
        Some("fuzz") => {
            let seconds = match args.get(1) {
                Some(s) => s.parse().context("fuzz SECONDS must be a whole number")?,
                None => 30,
            };
            fuzz(&root, seconds)
        }
        _ => bail!("usage: cargo xtask <build | test | run | fuzz [SECONDS]>"),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Builds everything in release mode and signs every component with the development key.
fn build(root: &Path) -> Result<()> {
    cargo(root, &["build", "--release", "--workspace"])?;
    let key = dev_key(&root.join("target/dev-keys"))?;
    let release = root.join("target/release");
    let plugins = root.join("target/plugins");
    std::fs::create_dir_all(&plugins)?;
    let mut signed = 0;
    for entry in std::fs::read_dir(&release)? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "so") {
            continue;
        }
        let mut bytes = std::fs::read(&path)?;
        let Some(name) = component_name(&bytes) else {
            continue;
        };
        sign_bytes(&mut bytes, &key).with_context(|| format!("signing {}", path.display()))?;
        let out = plugins.join(format!("{name}.so"));
        write_atomically(&out, &bytes)?;
        signed += 1;
    }
    let host = release.join("u-runner");
    let mut bytes = std::fs::read(&host).with_context(|| format!("reading {}", host.display()))?;
    sign_bytes(&mut bytes, &key).with_context(|| format!("signing {}", host.display()))?;
    write_atomically(&host, &bytes)?;
    signed += 1;
    eprintln!(
        "xtask: signed {signed} components with {} (key {})",
        root.join("target/dev-keys/dev.key").display(),
        key.public().short_id()
    );
    Ok(())
}

/// The manifest name of a U component, or `None` for other shared objects.
fn component_name(bytes: &[u8]) -> Option<String> {
    let facts = u_attest::elf::analyse(bytes).ok()?;
    let record = MetaRecord::parse(&bytes[facts.meta]).ok()?;
    Some(PluginManifest::parse(&record.manifest).ok()?.name)
}

/// Loads the development key, creating it on first use.
fn dev_key(dir: &Path) -> Result<SecretKey> {
    let key_path = dir.join("dev.key");
    if !key_path.exists() {
        std::fs::create_dir_all(dir)?;
        SecretKey::generate()?.write_pair(&dir.join("dev"))?;
    }
    Ok(SecretKey::read(&key_path)?)
}

/// Replaces `path` by a new file (so a running process keeps its old mapping), keeping the mode.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let tmp = path.with_extension("signing");
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn run_main_job(root: &Path, extra: &[String]) -> Result<()> {
    let deployment = root.join("manifests/dev.toml");
    let attest = root.join("target/release/u-attest");
    let runner = root.join("target/release/u-runner");
    let status = Command::new(&attest)
        .arg("inspect")
        .arg(&deployment)
        .status()?;
    if !status.success() {
        bail!("the capability proof of {} failed", deployment.display());
    }
    let status = Command::new(&runner)
        .arg("plugins")
        .arg(&deployment)
        .args(extra)
        .status()?;
    if !status.success() {
        bail!("u-runner refused plugins of {}", deployment.display());
    }
    Ok(())
}

/// Runs every fuzz target for `seconds`, seeded with the fixtures of its plugin's format.
fn fuzz(root: &Path, seconds: u32) -> Result<()> {
    let has_cargo_fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cargo_fuzz {
        cargo(root, &["install", "cargo-fuzz", "--locked"])?;
    }
    let mut failures = Vec::new();
    for plugin in std::fs::read_dir(root.join("plugins"))? {
        let plugin = plugin?.path();
        let targets = plugin.join("fuzz/fuzz_targets");
        let Ok(entries) = std::fs::read_dir(&targets) else {
            continue;
        };
        let format = plugin
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("loader-"))
            .unwrap_or("");
        let seeds = root.join("tests/fixtures").join(format);
        for entry in entries {
            let target = entry?.path();
            let Some(name) = target.file_stem().and_then(|n| n.to_str()) else {
                continue;
            };
            let corpus = plugin.join("fuzz/corpus").join(name);
            std::fs::create_dir_all(&corpus)?;
            eprintln!(
                "xtask: fuzzing {} / {name} for {seconds} s",
                plugin.display()
            );
            let mut cmd = Command::new("cargo");
            cmd.current_dir(plugin.join("fuzz"))
                .env("RUSTC_BOOTSTRAP", "1")
                .args(["fuzz", "run", "--target-dir"])
                .arg(root.join("target/fuzz"))
                .arg(name)
                .arg(&corpus);
            if seeds.is_dir() {
                cmd.arg(&seeds);
            }
            cmd.arg("--")
                .arg(format!("-max_total_time={seconds}"))
                .arg("-rss_limit_mb=2048");
            if !cmd.status()?.success() {
                failures.push(format!("{}/{name}", plugin.display()));
            }
        }
    }
    if !failures.is_empty() {
        bail!("fuzz targets found crashes: {}", failures.join(", "));
    }
    Ok(())
}
