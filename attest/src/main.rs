//! `u-attest`: make publisher keys, sign components, verify them, and show what a component or a
//! whole deployment can do.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use u_attest::{
    Deployment, PublicKey, SecretKey,
    report::prove,
    signing::{check_abi, sign_bytes, verify_bytes},
    surface::inspect_bytes,
};

#[derive(Parser)]
#[command(
    name = "u-attest",
    version,
    about = "Sign, verify and inspect U components"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate an ed25519 publisher key pair: OUT.key (mode 0600) and OUT.pub.
    Keygen {
        /// Path stem of the key files.
        #[arg(long)]
        out: PathBuf,
    },
    /// Sign components in place (writes publisher key, code hash and signature into .u.meta).
    Sign {
        /// The secret key file.
        #[arg(long)]
        key: PathBuf,
        /// Components to sign.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Verify signatures against trusted keys (from --trust files or a deployment).
    Verify {
        /// Trusted public key files.
        #[arg(long)]
        trust: Vec<PathBuf>,
        /// Take trusted keys (and, with no FILES, the plugins) from this deployment.
        #[arg(long)]
        deployment: Option<PathBuf>,
        /// Components to verify.
        files: Vec<PathBuf>,
    },
    /// Show declared capabilities beside the observed surface, for a component or a deployment
    /// (`.toml`); fails when the observation exceeds the declaration.
    Inspect {
        /// A component file or a deployment manifest.
        target: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Fail on warnings too (an unauthenticated listener other machines can reach), as
        /// `u-runner serve --strict` refuses to serve with one.
        #[arg(long)]
        strict: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    match run(cli) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("u-attest: error: {e:#}");
            std::process::exit(2);
        }
    }
}

/// Runs a command; `Ok(false)` means the check ran and failed.
fn run(cli: Cli) -> Result<bool> {
    match cli.command {
        Command::Keygen { out } => {
            let key = SecretKey::generate()?;
            key.write_pair(&out)?;
            println!("{}", key.public());
            Ok(true)
        }
        Command::Sign { key, files } => {
            let key = SecretKey::read(&key)?;
            for file in files {
                let mut bytes = read(&file)?;
                let hash = sign_bytes(&mut bytes, &key)
                    .with_context(|| format!("signing {}", file.display()))?;
                write_in_place(&file, &bytes)?;
                println!("signed {} code-hash {}", file.display(), hex::encode(hash));
            }
            Ok(true)
        }
        Command::Verify {
            trust,
            deployment,
            mut files,
        } => {
            let mut keys = trust
                .iter()
                .map(|p| PublicKey::read(p))
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(d) = deployment {
                let d = Deployment::load(&d)?;
                keys.extend(d.trusted_keys());
                if files.is_empty() {
                    files = d.plugins.iter().map(|p| p.path.clone()).collect();
                }
            }
            if keys.is_empty() {
                bail!("no trusted keys: pass --trust KEY.pub or --deployment FILE");
            }
            let mut all_ok = true;
            for file in files {
                let bytes = read(&file)?;
                match verify_bytes(&bytes, &keys)
                    .and_then(|v| check_abi(&v, u_sdk::ABI_MAJOR, &u_sdk::ABI_HASH).map(|_| v))
                {
                    Ok(v) => println!(
                        "OK      {} ({} {} {}, abi {}, publisher {})",
                        file.display(),
                        v.manifest.name,
                        v.manifest.version,
                        v.manifest.kind,
                        v.abi(),
                        v.publisher.short_id()
                    ),
                    Err(e) => {
                        all_ok = false;
                        println!("REFUSED {}: {e}", file.display());
                    }
                }
            }
            Ok(all_ok)
        }
        Command::Inspect {
            target,
            json,
            strict,
        } => {
            if target.extension().is_some_and(|e| e == "toml") {
                let d = Deployment::load(&target)?;
                let proof = prove(&d);
                if json {
                    println!("{}", serde_json::to_string_pretty(&proof)?);
                } else {
                    print!("{}", proof.render());
                }
                Ok(proof.ok && (!strict || proof.warnings.is_empty()))
            } else {
                let bytes = read(&target)?;
                let report = inspect_bytes(&bytes)
                    .with_context(|| format!("inspecting {}", target.display()))?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    print!("{}", report.render());
                }
                Ok(report.ok)
            }
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// Rewrites the file's bytes without replacing the inode (keeps permissions and hard links).
fn write_in_place(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(false)
        .open(path)
        .with_context(|| format!("opening {} for writing", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
