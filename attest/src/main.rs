//! `u-attest`: make publisher keys, sign components, verify them, and show what a component or a
//! whole deployment can do.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use u_attest::{
    Deployment, PublicKey, SecretKey, Verified,
    admission::{Policy, admit_all},
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
    /// Verify signatures against trusted keys (from --trust files or a deployment). With a
    /// deployment and no FILES, its plugins are judged as `u-runner` admits them: signature,
    /// ABI, pinned name, grants for every requested capability, ELF sanity.
    Verify {
        /// Trusted public key files.
        #[arg(long)]
        trust: Vec<PathBuf>,
        /// Take trusted keys (and, with no FILES, the plugins) from this deployment.
        #[arg(long)]
        deployment: Option<PathBuf>,
        /// With a deployment: refuse plugins importing more than they declare, as
        /// `u-runner serve --strict` does (the deployment's `strict = true` implies it).
        #[arg(long)]
        strict: bool,
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
        /// Prove the Safebox runner form `u-runner MODEL SOCKET` serving with this deployment
        /// (as its default): the model and socket it adds to it.
        #[arg(long, num_args = 2, value_names = ["MODEL", "SOCKET"])]
        runner_form: Vec<PathBuf>,
        /// With --runner-form: the HMAC secret file it is given (`--secret-file`).
        #[arg(long, requires = "runner_form")]
        secret_file: Option<PathBuf>,
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
            strict,
            files,
        } => {
            let mut keys = trust
                .iter()
                .map(|p| PublicKey::read(p))
                .collect::<Result<Vec<_>, _>>()?;
            let deployment = deployment.map(|d| Deployment::load(&d)).transpose()?;
            if let Some(d) = &deployment {
                keys.extend(d.trusted_keys());
            }
            if keys.is_empty() {
                bail!("no trusted keys: pass --trust KEY.pub or --deployment FILE");
            }
            if let (Some(d), true) = (&deployment, files.is_empty()) {
                // The deployment's plugins, judged exactly as `u-runner` admits them.
                let policy = if strict || d.strict {
                    Policy::Strict
                } else {
                    Policy::Report
                };
                let mut all_ok = true;
                for (entry, admitted) in admit_all(&d.plugins, &d.trusted_keys(), policy) {
                    match admitted {
                        Ok((a, _)) => {
                            print_ok(&entry.path, &a.verified);
                            for excess in &a.undeclared {
                                println!("  warning: {excess}");
                            }
                        }
                        Err(e) => {
                            all_ok = false;
                            println!("REFUSED {}: {e}", entry.path.display());
                        }
                    }
                }
                return Ok(all_ok);
            }
            let mut all_ok = true;
            for file in files {
                let bytes = read(&file)?;
                match verify_bytes(&bytes, &keys)
                    .and_then(|v| check_abi(&v, u_sdk::ABI_MAJOR, &u_sdk::ABI_HASH).map(|_| v))
                {
                    Ok(v) => print_ok(&file, &v),
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
            runner_form,
            secret_file,
        } => {
            let manifest = target.extension().is_some_and(|e| e == "toml");
            if !runner_form.is_empty() && !manifest {
                bail!("--runner-form proves a deployment: give its manifest (.toml)");
            }
            if manifest {
                let mut d = Deployment::load(&target)?;
                if let [model, socket] = runner_form.as_slice() {
                    d = u_attest::runner_form::deployment(
                        d,
                        model,
                        socket,
                        secret_file.as_deref(),
                    )?;
                }
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

/// One verified component's line.
fn print_ok(path: &Path, v: &Verified) {
    println!(
        "OK      {} ({} {} {}, abi {}, publisher {})",
        path.display(),
        v.manifest.name,
        v.manifest.version,
        v.manifest.kind,
        v.abi(),
        v.publisher.short_id()
    );
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
