//! `u-runner`: verify, load and sandbox the plugins of a deployment, then serve.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use serde_json::json;
use std::path::{Path, PathBuf};
use tracing::Level;
use u_attest::deployment::{PathGrant, absolute};
use u_attest::{Deployment, signing::verify_bytes};
use u_runner::{inspect, load_deployment, oneline, open_deployment, sandbox, serve, wiring};

mod bench;
mod image;
mod log;
mod perplexity;
mod quantize;
mod train;
mod transcribe;

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
    about = "The U host: loads signed plugins and serves models",
    override_usage = "u-runner <COMMAND> …\n       u-runner <MODEL> <SOCKET> [--secret-file F] [--deployment D]",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Safebox runner form: serve this model file or directory…
    #[arg(required = true)]
    model: Option<PathBuf>,
    /// …on this Unix socket (mode 0600), every API of transport-http, with the default
    /// deployment's plugins.
    #[arg(required = true)]
    socket: Option<PathBuf>,
    /// Runner form: require HMAC-signed requests, with the secret in this file.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Runner form: the deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
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
    /// Generate text with a model: the deployment's plugins are verified, granted read access to
    /// the model path, locked down and wired (loader, architecture, kernels, cache, tokenizer).
    /// Text streams to stdout; prompt and generation speeds go to stderr.
    Generate(GenerateArgs),
    /// Measure prompt-processing (ppP) and token-generation (tgN) speed of a model like
    /// llama.cpp's `llama-bench`, wired as for `generate`: tokens/s, mean ± stddev over reps.
    Bench(bench::BenchArgs),
    /// Perplexity of a model on a text, computed as llama.cpp's `llama-perplexity` computes it
    /// (chunks of `-c` tokens, the second half of each scored); with `--kl-divergence-base` it
    /// writes, and with `--kl-divergence` reads, llama.cpp's log-probability file and reports
    /// the KL divergence from that base.
    Perplexity(perplexity::PerplexityArgs),
    /// Quantize a GGUF model as llama.cpp's `llama-quantize IN OUT TYPE` does without an
    /// importance matrix (the same tensor types, byte-identical blocks), through the
    /// deployment's loader and kernels plugins; progress on stderr.
    Quantize(quantize::QuantizeArgs),
    /// Train what changes a model's behaviour without touching its weights: a LoRA or a soft
    /// prompt on a text (PEFT's files; progress, checkpoints, `--resume`), or a control vector
    /// from contrasting prompts (llama.cpp's GGUF).
    Train(train::TrainArgs),
    /// Transcribe (or translate) speech with a Whisper-style model, wired as for `generate`:
    /// 30 s windows, timestamps, temperature fallback as openai-whisper does; the text (or
    /// JSON) on stdout, speed on stderr.
    Transcribe(transcribe::TranscribeArgs),
    /// Generate an image from a prompt (or from an image and a prompt) with a diffusion
    /// pipeline (a diffusers folder), wired as for `generate`: a progress bar per step on
    /// stderr, the PNG written to `--out`.
    Image(image::ImageArgs),
    /// Tokenize text with a model's tokenizer (from its GGUF metadata or a tokenizer.json in or
    /// beside it), or with `--decode` turn token ids back into text.
    Tokenize {
        /// The model file (or model directory).
        #[arg(long)]
        model: PathBuf,
        /// The text (with `--decode`: token ids separated by spaces or commas).
        #[arg(long, conflicts_with = "file", required_unless_present = "file")]
        text: Option<String>,
        /// Read the text from this file instead.
        #[arg(long)]
        file: Option<PathBuf>,
        /// Decode token ids to text instead.
        #[arg(long)]
        decode: bool,
        /// Do not add BOS (or other special tokens the model adds) and read special-token text
        /// (`<|im_start|>`) as plain text, as llama.cpp's tokenizer tests do; with `--decode`,
        /// leave special tokens out.
        #[arg(long)]
        no_special: bool,
        /// Tokenize each part of the text between occurrences of this string on its own, one
        /// line of ids (or one JSON object) per part, as llama.cpp's `.inp`/`.out` test vectors
        /// are laid out (`--separator $'\n__ggml_vocab_test__\n'`); a separator at the very
        /// end closes the last part.
        #[arg(long, conflicts_with = "decode")]
        separator: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The deployment [default: as for `inspect`].
        #[arg(long)]
        deployment: Option<PathBuf>,
    },
    /// Load a deployment, lock the process down and run its transports until SIGINT/SIGTERM.
    /// With a `[model]` in the deployment, the model is wired (loader, architecture, kernels,
    /// cache, tokenizer) and served under its file or directory name. Refused plugins are
    /// reported and skipped (exit status 1 at the end), or with `--strict` nothing is served.
    ///
    /// Or in one line, with no manifest: `serve --model FILE` builds the deployment in memory
    /// from the signed plugins in `plugins/` above the binary's folder (the set
    /// manifests/dev.toml names, and transport-http), grants the model to the loaders and the
    /// tokenizer and the address to the transport, prints its capability proof and serves.
    Serve {
        /// The deployment manifest.
        #[arg(required_unless_present = "model", conflicts_with = "model")]
        deployment: Option<PathBuf>,
        /// Refuse to serve if any plugin is refused.
        #[arg(long)]
        strict: bool,
        /// One-line form: serve this model file (or model directory) over HTTP.
        #[arg(long)]
        model: Option<PathBuf>,
        /// One-line form: the address to listen on.
        #[arg(long, default_value = "127.0.0.1", requires = "model")]
        host: String,
        /// One-line form: the TCP port to listen on.
        #[arg(long, default_value_t = 8080, requires = "model")]
        port: u16,
        /// One-line form: require API keys, one `NAME KEY` a line in this file.
        #[arg(long, requires = "model")]
        api_key_file: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// The model file (or model directory).
    #[arg(long)]
    model: PathBuf,
    /// The prompt (with `--chat`, the user's message).
    #[arg(long, short = 'p')]
    prompt: String,
    /// Most tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    max_tokens: u32,
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: u32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Presence penalty (0 = off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty (0 = off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Seed for reproducible sampling [default: random].
    #[arg(long)]
    seed: Option<u64>,
    /// A string that ends generation (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Apply the model's chat template to the prompt as a user message.
    #[arg(long)]
    chat: bool,
    /// A system message for `--chat`.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long)]
    threads: Option<u32>,
    /// Print one JSON object (tokens, text, timings) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Run under a low-rank adapter (repeatable): a PEFT directory, its
    /// `adapter_model.safetensors`, or a llama.cpp GGUF LoRA, with an optional `:SCALE`
    /// (default 1).
    #[arg(long, value_name = "PATH[:SCALE]")]
    lora: Vec<String>,
    /// Run under a control vector (repeatable): llama.cpp's or repeng's GGUF (or the same
    /// `direction.{L}` tensors as safetensors), with an optional `:STRENGTH` (default 1).
    #[arg(long, value_name = "PATH[:STRENGTH]")]
    control_vector: Vec<String>,
    /// Start the prompt with a soft prompt: a PEFT prompt-tuning directory.
    #[arg(long, value_name = "PATH")]
    soft_prompt: Option<PathBuf>,
    /// Draft with this smaller model of the same vocabulary (speculative decoding), as the
    /// deployment's `[model] draft` does.
    #[arg(long, value_name = "PATH")]
    draft_model: Option<PathBuf>,
    /// The deployment [default: $U_DEPLOYMENT, else the build tree's manifests/dev.toml, else
    /// /etc/u/deployment.toml].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// A `--lora PATH[:SCALE]` (or `--control-vector PATH[:STRENGTH]`, `--soft-prompt PATH`): the
/// name (its directory's or file's, as models are named), path and scale.
fn lora_arg(arg: &str) -> Result<(String, PathBuf, f32)> {
    let (path, scale) = match arg.rsplit_once(':') {
        Some((path, scale)) if scale.parse::<f32>().is_ok() => (path, scale.parse::<f32>()?),
        _ => (arg, 1.0),
    };
    if !scale.is_finite() {
        anyhow::bail!("--lora {arg}: the scale must be a finite number");
    }
    let path = absolute(Path::new(path));
    let dir_or_file = match path
        .file_name()
        .is_some_and(|n| n == "adapter_model.safetensors")
    {
        true => path.parent().unwrap_or(&path).to_path_buf(),
        false => path.clone(),
    };
    let name = wiring::served_name(&dir_or_file);
    u_attest::deployment::check_adapter_name(&name)
        .map_err(|why| anyhow::anyhow!("--lora {arg}: {why}"))?;
    Ok((name, path, scale))
}

fn main() {
    let cli = Cli::parse();
    // Generating and tokenizing print results; the host's progress logs would only be noise.
    let quiet = matches!(
        cli.command,
        Some(
            Command::Generate(_)
                | Command::Tokenize { .. }
                | Command::Bench(_)
                | Command::Perplexity(_)
                | Command::Quantize(_)
                | Command::Train(_)
                | Command::Transcribe(_)
                | Command::Image(_)
        )
    );
    // `RUST_LOG` takes `level` or `target=level,...` (no regular expressions: the host stays
    // small); unset or unparsable, the default level applies.
    let default = if quiet { Level::ERROR } else { Level::INFO };
    let spec = std::env::var("RUST_LOG").ok();
    let _ = tracing::subscriber::set_global_default(log::StderrLog::new(default, spec.as_deref()));
    let code = match run(cli) {
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

pub(crate) fn threads(deployment: &Deployment) -> u32 {
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

/// The first lines of `u-runner plugins` and of the one-line serve's proof: the deployment,
/// the host's own verification, the plugin ABI and what the kernel's sandbox offers.
fn print_header(d: &Deployment, support: &sandbox::Support) {
    println!("deployment `{}`", d.name);
    println!("host: {}", host_status(d));
    println!(
        "plugin ABI: {}",
        u_sdk::abi_id(u_sdk::ABI_MAJOR, &u_sdk::ABI_HASH)
    );
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
}

/// One verified plugin: name, version, kind, publisher and ABI, what its signed manifest
/// declares and what the deployment grants it.
fn print_plugin(status: &str, verified: &u_attest::Verified, grants: &u_attest::Grants) {
    let m = &verified.manifest;
    println!(
        "{status} {} {} ({}) publisher {} abi {}",
        m.name,
        m.version,
        m.kind,
        verified.publisher.short_id(),
        verified.abi()
    );
    let or_none = |v: &[&str], sep: &str, none: &str| {
        if v.is_empty() {
            none.to_string()
        } else {
            v.join(sep)
        }
    };
    let declared: Vec<&str> = m.capabilities.iter().map(|c| c.name()).collect();
    let granted = grants.describe();
    let granted: Vec<&str> = granted.iter().map(String::as_str).collect();
    println!("  declares: {}", or_none(&declared, ", ", "(nothing)"));
    println!("  grants: {}", or_none(&granted, "; ", "(none)"));
}

/// The plugins refused, each with its reason.
/// The device a kernels plugin computes on, as its backend reports it (`None` for the rest).
fn device_of(p: &u_runner::loading::LoadedPlugin) -> Option<String> {
    match &p.instance {
        u_sdk::PluginInstance::Kernels(k) => {
            Some(wiring::device_name(k.info().into_result().ok().as_ref()))
        }
        _ => None,
    }
}

fn print_refused(refused: &[u_runner::Refusal]) {
    for r in refused {
        println!(
            "[REFUSED] {} ({}): {}",
            r.plugin,
            r.path.display(),
            r.reason
        );
    }
}

/// The capability proof the one-line serve runs under, printed before lock-down: every plugin
/// as verified with its grants, the effective capabilities of the whole and what nothing can do.
fn print_proof(d: &Deployment, opened: &u_runner::OpenReport) {
    print_header(d, &sandbox::probe_support());
    let mut union = u_attest::Grants::default();
    for p in &opened.opened {
        print_plugin("[VERIFIED]", &p.verified, &p.grants);
        u_attest::report::merge(&mut union, &p.grants);
    }
    print_refused(&opened.refused);
    println!("effective capabilities:");
    for line in union.describe() {
        println!("  {line}");
    }
    println!("guarantees:");
    for g in u_attest::report::guarantees(&union) {
        println!("  - {g}");
    }
}

fn run(cli: Cli) -> Result<i32> {
    let Some(command) = cli.command else {
        let (Some(model), Some(socket)) = (cli.model, cli.socket) else {
            anyhow::bail!("give a command, or a model and a socket path (see --help)");
        };
        let d = u_attest::runner_form::deployment(
            load_default(cli.deployment)?,
            &model,
            &socket,
            cli.secret_file.as_deref(),
        )?;
        return serve_deployment(d, true, false);
    };
    match command {
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
                            "process": if p.in_worker() { "worker" } else { "host" },
                            "device": device_of(p),
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
                print_header(&d, &support);
                for p in &report.loaded {
                    print_plugin("[LOADED] ", &p.verified, &p.grants);
                    let details: Vec<&str> = p.info.details.iter().map(|s| s.as_str()).collect();
                    println!("  answers: {} [{}]", p.info.summary, details.join(", "));
                    if let Some(device) = device_of(p) {
                        println!("  device: {device}");
                    }
                    if p.in_worker() {
                        println!("  runs in: a worker process of its own, under its grants alone");
                    }
                }
                print_refused(&report.refused);
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
        Command::Generate(args) => generate(args),
        Command::Bench(args) => bench::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Train(args) => train::run(args),
        Command::Transcribe(args) => transcribe::run(args),
        Command::Image(args) => image::run(args),
        Command::Tokenize {
            model,
            text,
            file,
            decode,
            no_special,
            separator,
            json,
            deployment,
        } => {
            let input = match (text, file) {
                (Some(t), _) => t,
                (None, Some(f)) => std::fs::read_to_string(&f)
                    .with_context(|| format!("reading {}", f.display()))?,
                (None, None) => anyhow::bail!("give --text or --file"),
            };
            let d = load_default(deployment)?;
            let opened = wiring::open(&d, &model, threads(&d), wiring::Want::Tokenizer)?;
            let tok = opened.tokenizer.with_context(|| {
                format!(
                    "{} has no tokenizer (no GGUF vocabulary, no tokenizer.json)",
                    model.display()
                )
            })?;
            if decode {
                let ids = input
                    .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
                    .filter(|s| !s.is_empty())
                    .map(|s| {
                        s.parse::<u32>()
                            .with_context(|| format!("`{s}` is not a token id"))
                    })
                    .collect::<Result<Vec<u32>>>()?;
                let text = tok
                    .decode(ids.as_slice().into(), no_special)
                    .into_result()
                    .map_err(|e| anyhow::anyhow!("decode: {e}"))?;
                if json {
                    println!("{}", json!({ "text": text.as_str(), "tokens": ids }));
                } else {
                    println!("{text}");
                }
            } else {
                let parts: Vec<&str> = match &separator {
                    // A separator at the very end closes the last part rather than opening one.
                    Some(sep) if !sep.is_empty() => input
                        .strip_suffix(sep.as_str())
                        .unwrap_or(&input)
                        .split(sep.as_str())
                        .collect(),
                    _ => vec![input.as_str()],
                };
                for part in parts {
                    let ids = tok
                        .encode(part.into(), !no_special, !no_special)
                        .into_result()
                        .map_err(|e| anyhow::anyhow!("encode: {e}"))?;
                    if json {
                        let pieces: Vec<String> = ids
                            .iter()
                            .map(|&id| {
                                tok.token_bytes(id)
                                    .into_result()
                                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                                    .unwrap_or_default()
                            })
                            .collect();
                        println!("{}", json!({ "tokens": ids.as_slice(), "pieces": pieces }));
                    } else {
                        let s: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
                        println!("{}", s.join(" "));
                    }
                }
            }
            Ok(0)
        }
        Command::Serve {
            deployment,
            strict,
            model,
            host,
            port,
            api_key_file,
        } => {
            let d = match (deployment, model) {
                (Some(deployment), _) => Deployment::load(&deployment)
                    .with_context(|| format!("loading {}", deployment.display()))?,
                (None, Some(model)) => {
                    let d = oneline::deployment(&model, &host, port, api_key_file.as_deref())?;
                    return serve_deployment(d, strict, true);
                }
                (None, None) => anyhow::bail!("give a deployment manifest or --model"),
            };
            serve_deployment(d, strict, false)
        }
    }
}

/// Verifies, locks down and serves `d` until a signal; with `strict` (or the deployment's own
/// `strict`), a plugin importing more than it declares is refused and any refused plugin stops
/// it before anything is served; with `proof`, the capability proof is printed first.
fn serve_deployment(d: Deployment, strict: bool, proof: bool) -> Result<i32> {
    let strict = strict || d.strict;
    let d = Deployment { strict, ..d };
    tracing::info!(deployment = %d.name, "host: {}", host_status(&d));
    let opened = open_deployment(&d);
    if proof {
        print_proof(&d, &opened);
    }
    if strict && !opened.refused.is_empty() {
        anyhow::bail!(
            "{} plugin(s) refused and --strict is set: not serving",
            opened.refused.len()
        );
    }
    let warnings = d.warnings();
    for w in &warnings {
        tracing::warn!("{w}");
    }
    if strict && let Some(w) = warnings.first() {
        anyhow::bail!("--strict is set: not serving: {w}");
    }
    let (_, refused) = serve::run(opened, threads(&d), &d)?;
    Ok(if refused == 0 { 0 } else { 1 })
}

pub(crate) fn load_default(deployment: Option<PathBuf>) -> Result<Deployment> {
    let path = deployment.unwrap_or_else(default_deployment);
    Deployment::load(&path).with_context(|| format!("loading deployment {}", path.display()))
}

fn generate(args: GenerateArgs) -> Result<i32> {
    use std::io::Write;
    let mut d = load_default(args.deployment)?;
    let adapters = args
        .lora
        .iter()
        .map(|a| lora_arg(a))
        .collect::<Result<Vec<_>>>()?;
    for (name, path, _) in &adapters {
        d.adapters.push((name.clone(), path.clone()));
    }
    let vectors = args
        .control_vector
        .iter()
        .map(|a| lora_arg(a))
        .collect::<Result<Vec<_>>>()?;
    for (name, path, _) in &vectors {
        d.control_vectors.push((name.clone(), path.clone()));
    }
    let soft_prompt = match &args.soft_prompt {
        Some(p) => {
            let (name, path, _) = lora_arg(&p.display().to_string())?;
            d.soft_prompts.push((name.clone(), path));
            name
        }
        None => String::new(),
    };
    if let Some(draft) = &args.draft_model {
        d.draft_model = Some(absolute(draft));
    }
    let threads = args.threads.unwrap_or_else(|| threads(&d)).max(1);
    let opened = wiring::open(&d, &args.model, threads, wiring::Want::Engine)?;
    let (runner, engine) = opened.engine.context("no engine was started")?;
    let name = wiring::served_name(&absolute(&args.model));
    let mut request = u_sdk::GenerateRequest::new(
        &name,
        &args.prompt,
        args.max_tokens,
        u_sdk::SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            repetition_penalty: args.repeat_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            seed: args.seed.into(),
        },
    );
    if args.chat {
        let turn = u_sdk::ChatTurn::text;
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(turn("system", system));
        }
        messages.push(turn("user", &args.prompt));
        request.messages = messages.into();
    }
    request.stop = args.stop.iter().map(|s| s.as_str().into()).collect();
    request.adapters = adapters
        .iter()
        .map(|(name, _, scale)| u_sdk::AdapterUse {
            name: name.as_str().into(),
            scale: *scale,
        })
        .collect();
    request.control_vectors = vectors
        .iter()
        .map(|(name, _, strength)| u_sdk::ControlUse {
            name: name.as_str().into(),
            strength: *strength,
            first_layer: 0,
            last_layer: u32::MAX,
        })
        .collect();
    request.soft_prompt = soft_prompt.into();
    let text = std::sync::Arc::<std::sync::Mutex<String>>::default();
    let sink = u_sdk::TokenSinkBox::new(StdoutSink {
        quiet: args.json,
        text: text.clone(),
    });
    let summary = engine
        .generate(&request, sink)
        .into_result()
        .map_err(|e| anyhow::anyhow!("{runner}: {e}"))?;
    let rate = |n: u32, ms: f64| if ms > 0.0 { n as f64 / (ms / 1e3) } else { 0.0 };
    let finish = match summary.finish {
        u_sdk::FinishReason::Stop => "stop",
        u_sdk::FinishReason::Length => "length",
        u_sdk::FinishReason::Cancelled => "cancelled",
    };
    let (prompt_tps, gen_tps) = (
        rate(summary.prompt_tokens, summary.prompt_ms),
        rate(summary.generated_tokens, summary.generate_ms),
    );
    let device = wiring::device_name(opened.backend.as_ref());
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&json!({
                "tokens": summary.tokens.as_slice(),
                "text": text.lock().map(|t| t.clone()).unwrap_or_default(),
                "finish": finish,
                "timings": {
                    "prompt_tokens": summary.prompt_tokens,
                    "prompt_tokens_per_s": prompt_tps,
                    "generated_tokens": summary.generated_tokens,
                    "generated_tokens_per_s": gen_tps,
                    "prompt_ms": summary.prompt_ms,
                    "generate_ms": summary.generate_ms,
                    "draft_tokens": summary.draft_tokens,
                    "accepted_draft_tokens": summary.accepted_tokens,
                    "device": device,
                },
            }))?
        );
    } else {
        let _ = writeln!(std::io::stdout());
        eprintln!(
            "prompt: {} tokens, {prompt_tps:.1} tokens/s | generated: {} tokens, {gen_tps:.1} tokens/s ({finish}; {threads} threads, {device}, loader {})",
            summary.prompt_tokens, summary.generated_tokens, opened.loader
        );
    }
    Ok(0)
}

/// Streams generated text to stdout (unless `quiet`) and keeps all of it; a closed stdout
/// (e.g. `| head`) ends generation.
struct StdoutSink {
    quiet: bool,
    text: std::sync::Arc<std::sync::Mutex<String>>,
}

impl u_sdk::TokenSink for StdoutSink {
    fn token(&mut self, token: &u_sdk::GeneratedToken<'_>) -> bool {
        use std::io::Write;
        if let Ok(mut t) = self.text.lock() {
            t.push_str(&token.text);
        }
        if self.quiet || token.text.is_empty() {
            return true;
        }
        let mut out = std::io::stdout().lock();
        out.write_all(token.text.as_bytes()).is_ok() && out.flush().is_ok()
    }
}
