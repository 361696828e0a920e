//! `u-runner`: verify, load and sandbox the plugins of a deployment, then serve.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use u_attest::deployment::{PathGrant, absolute};
use u_attest::{Deployment, signing::verify_bytes};
use u_runner::{inspect, load_deployment, open_deployment, sandbox, serve};

// The host carries a signed manifest like every plugin, so `u-attest inspect` can prove its
// surface too.
#[used]
#[unsafe(link_section = ".u.meta")]
static U_META: [u8; u_sdk::meta::META_SIZE] =
    u_sdk::meta::build_section(include_str!("../u-runner.toml"));

#[derive(Parser)]
#[command(
    name = "u-runner",
    version,
    about = "The U host: loads signed plugins and serves models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Verify and load every plugin of a deployment; list them with capabilities, verification
    /// status and what each answers across the ABI. Exits 1 if any plugin is refused.
    Plugins {
        /// The deployment manifest.
        deployment: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Describe a model file or directory: format, architecture, hyper-parameters and a tensor
    /// table, read through the deployment's loader plugins (which are granted read access to
    /// the named path for this command).
    Inspect {
        /// The model file (or model directory).
        model: PathBuf,
        /// The deployment whose loaders to use [default: $U_DEPLOYMENT, else the development
        /// deployment manifests/dev.toml of the build tree, else /etc/u/deployment.toml].
        #[arg(long)]
        deployment: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Load a deployment, lock the process down and run its transports until SIGINT/SIGTERM.
    /// Refused plugins are reported and skipped (exit status 1 at the end), or with `--strict`
    /// nothing is served.
    Serve {
        /// The deployment manifest.
        deployment: PathBuf,
        /// Refuse to serve if any plugin is refused.
        #[arg(long)]
        strict: bool,
    },
}

fn main() {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let code = match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("u-runner: error: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

/// `$U_DEPLOYMENT`, else `manifests/dev.toml` of the build tree this binary sits in
/// (`target/release/u-runner`), else `/etc/u/deployment.toml`.
fn default_deployment() -> PathBuf {
    if let Some(p) = std::env::var_os("U_DEPLOYMENT") {
        return PathBuf::from(p);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            let dev = exe.parent()?.parent()?.parent()?.join("manifests/dev.toml");
            dev.exists().then_some(dev)
        })
        .unwrap_or_else(|| PathBuf::from("/etc/u/deployment.toml"))
}

fn threads(deployment: &Deployment) -> u32 {
    deployment.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1)
    })
}

/// Verifies this executable's own `.u.meta` against the deployment's trusted keys.
fn host_status(deployment: &Deployment) -> String {
    let own = u_sdk::meta::read_section(&U_META);
    let declared = u_sdk::meta::MetaRecord::parse(&own)
        .ok()
        .and_then(|r| u_sdk::manifest::PluginManifest::parse(&r.manifest).ok())
        .map(|m| {
            let caps: Vec<&str> = m.capabilities.iter().map(|c| c.name()).collect();
            format!("{} {} declares {}", m.name, m.version, caps.join(", "))
        })
        .unwrap_or_else(|| "u-runner (manifest unreadable)".into());
    let verdict = match std::fs::read("/proc/self/exe") {
        Ok(bytes) => match verify_bytes(&bytes, &deployment.trusted_keys()) {
            Ok(v) => format!("signed by trusted key {}", v.publisher.short_id()),
            Err(e) => format!("NOT VERIFIED: {e}"),
        },
        Err(e) => format!("NOT VERIFIED: cannot read own executable: {e}"),
    };
    format!("{declared}; {verdict}")
}

fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Plugins { deployment, json } => {
            let d = Deployment::load(&deployment)?;
            let support = sandbox::probe_support();
            let report = load_deployment(&d, threads(&d));
            let abi = u_sdk::abi_id(u_sdk::ABI_MAJOR, &u_sdk::ABI_HASH);
            if json {
                let loaded: Vec<_> = report
                    .loaded
                    .iter()
                    .map(|p| {
                        json!({
                            "name": p.verified.manifest.name,
                            "version": p.verified.manifest.version,
                            "kind": p.verified.manifest.kind.name(),
                            "path": p.path,
                            "publisher": p.verified.publisher.to_string(),
                            "code_hash": hex::encode(p.verified.code_hash),
                            "abi": p.verified.abi(),
                            "capabilities": p.verified.manifest.capabilities.iter().map(|c| c.name()).collect::<Vec<_>>(),
                            "grants": p.grants.describe(),
                            "summary": p.info.summary.as_str(),
                            "details": p.info.details.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                let out = json!({
                    "deployment": d.name,
                    "host": host_status(&d),
                    "abi": abi,
                    "sandbox_support": support,
                    "loaded": loaded,
                    "refused": report.refused,
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!("deployment `{}`", d.name);
                println!("host: {}", host_status(&d));
                println!("plugin ABI: {abi}");
                println!(
                    "sandbox: Landlock {}, seccomp {}",
                    support
                        .landlock_abi
                        .map(|v| format!("available (ABI {v})"))
                        .unwrap_or_else(|| "NOT AVAILABLE on this kernel".into()),
                    if support.seccomp {
                        "available"
                    } else {
                        "NOT AVAILABLE on this kernel"
                    }
                );
                for p in &report.loaded {
                    let m = &p.verified.manifest;
                    println!(
                        "[LOADED]  {} {} ({}) publisher {} abi {}",
                        m.name,
                        m.version,
                        m.kind,
                        p.verified.publisher.short_id(),
                        p.verified.abi()
                    );
                    let granted = p.grants.describe();
                    let declared: Vec<&str> = m.capabilities.iter().map(|c| c.name()).collect();
                    println!(
                        "  declares: {}",
                        if declared.is_empty() {
                            "(nothing)".into()
                        } else {
                            declared.join(", ")
                        }
                    );
                    println!(
                        "  grants: {}",
                        if granted.is_empty() {
                            "(none)".into()
                        } else {
                            granted.join("; ")
                        }
                    );
                    let details: Vec<&str> = p.info.details.iter().map(|s| s.as_str()).collect();
                    println!("  answers: {} [{}]", p.info.summary, details.join(", "));
                }
                for r in &report.refused {
                    println!(
                        "[REFUSED] {} ({}): {}",
                        r.plugin,
                        r.path.display(),
                        r.reason
                    );
                }
            }
            Ok(if report.refused.is_empty() { 0 } else { 1 })
        }
        Command::Inspect {
            model,
            deployment,
            json,
        } => {
            let path = deployment.unwrap_or_else(default_deployment);
            let mut d = Deployment::load(&path)
                .with_context(|| format!("loading deployment {}", path.display()))?;
            let model = absolute(&model);
            for entry in &mut d.plugins {
                entry.grants.fs_read.push(PathGrant {
                    path: model.clone(),
                    recursive: model.is_dir(),
                });
            }
            let report = load_deployment(&d, threads(&d));
            let model_report = inspect::inspect(&model, &inspect::loaders(&report))
                .map_err(|e| anyhow::anyhow!(e))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&model_report)?);
            } else {
                print!("{}", model_report.render());
            }
            Ok(0)
        }
        Command::Serve { deployment, strict } => {
            let d = Deployment::load(&deployment)
                .with_context(|| format!("loading {}", deployment.display()))?;
            tracing::info!(deployment = %d.name, "host: {}", host_status(&d));
            let opened = open_deployment(&d);
            if strict && !opened.refused.is_empty() {
                anyhow::bail!(
                    "{} plugin(s) refused and --strict is set: not serving",
                    opened.refused.len()
                );
            }
            let (_, refused) = serve::run(opened, threads(&d))?;
            Ok(if refused == 0 { 0 } else { 1 })
        }
    }
}
