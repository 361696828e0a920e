//! The deployment manifest: which publishers are trusted, which plugins run, what each may do.
//!
//! ```toml
//! [deployment]
//! name = "safebox-llm"
//! threads = 2              # compute threads per plugin pool (default: all cores)
//! strict = true            # refuse a plugin that imports more than its manifest declares or
//!                          # makes raw system calls (default: load it, report it as an error)
//!
//! [[trust]]
//! name = "u-dev"
//! key_file = "keys/dev.pub"   # or: key = "ed25519:<hex>"
//!
//! [[plugins]]
//! path = "plugins/loader-gguf.so"
//! isolation = "worker"     # run it in its own sandboxed process (loaders; default "in-process")
//! [plugins.grants]
//! fs.read = ["/srv/models/**"]
//!
//! [[plugins]]
//! path = "plugins/transport-http.so"
//! [plugins.grants]
//! net.listen = ["unix:/run/safebox/services/u-llm.sock", "tcp:127.0.0.1:8080"]
//! [plugins.config]          # handed to the plugin as TOML
//! max_body_bytes = 1048576
//!
//! [model]
//! path = "/srv/models/smollm2.gguf"   # what `serve` serves (optional: without it, the table
//!                          # only sets how models given on the command line are built)
//! architecture = "arch-llama"  # which architecture plugin builds it, when several declare its
//!                          # family (otherwise the one that declares it)
//! kernels = ["kernels-wgpu", "kernels-cpu"]  # the compute plugins it runs on, preferred first:
//!                          # ops the first lacks run on the next, and a plugin that failed to
//!                          # load (no GPU) is passed over (default: the first kernels plugin)
//! max_running = 16         # requests batched into one forward pass (default 16)
//! max_queued = 64          # requests that may wait; past that, 429 (default 64)
//! step_tokens = 512        # tokens per forward pass, decodes first, prefill chunks share the rest
//! aliases = ["gpt-4o-mini", "local/smollm2"]  # other names clients may ask for it by ("*": any)
//! draft = "/srv/models/smollm2-q4.gguf"  # a smaller model of the same vocabulary that drafts
//!                          # tokens for speculative decoding (read-granted as the model is)
//! ```
//!
//! Grants use the capability names of [`u_sdk::manifest::Capability`]: `fs.read`/`fs.write`
//! take absolute paths (a trailing `/**` grants a whole directory tree), `net.listen` takes
//! `unix:/path` or `tcp:HOST:PORT`, `net.connect` takes `tcp:HOST:PORT`, `gpu` and
//! `process.fork` take `true`/`false`. Relative paths are relative to the manifest's folder.

use crate::keys::PublicKey;
use serde::Deserialize;
use std::{
    collections::BTreeMap,
    fmt,
    path::{Component, Path, PathBuf},
};
use u_sdk::manifest::{Capability, PluginManifest};

/// Why a deployment manifest was rejected.
#[derive(Debug, thiserror::Error)]
pub enum DeploymentError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Malformed TOML or a missing/unknown field.
    #[error("{path}: {message}")]
    Syntax {
        /// The file.
        path: String,
        /// The parser's explanation, with line and column.
        message: String,
    },
    /// A value that is well-formed TOML but not allowed.
    #[error("{path}: {message}")]
    Invalid {
        /// The file.
        path: String,
        /// What is wrong, naming the plugin and capability.
        message: String,
    },
}

/// A trusted publisher key.
#[derive(Debug, Clone)]
pub struct TrustedKey {
    /// The publisher's name, for messages.
    pub name: String,
    /// The key.
    pub key: PublicKey,
}

/// A file-system grant: one path, or a whole tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathGrant {
    /// Absolute, lexically normalised path.
    pub path: PathBuf,
    /// Whether everything beneath `path` is included (`/**`).
    pub recursive: bool,
}

impl PathGrant {
    /// Whether the grant covers `target` (absolute, normalised).
    pub fn covers(&self, target: &Path) -> bool {
        if self.recursive {
            target.starts_with(&self.path)
        } else {
            target == self.path
        }
    }
}

impl fmt::Display for PathGrant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.recursive {
            write!(f, "{}/**", self.path.display())
        } else {
            write!(f, "{}", self.path.display())
        }
    }
}

/// A network address in a grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetAddress {
    /// A Unix socket path.
    Unix(PathBuf),
    /// A TCP host and port.
    Tcp {
        /// Host name or IP literal (IPv6 in brackets).
        host: String,
        /// Port.
        port: u16,
    },
}

impl fmt::Display for NetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetAddress::Unix(p) => write!(f, "unix:{}", p.display()),
            NetAddress::Tcp { host, port } => write!(f, "tcp:{host}:{port}"),
        }
    }
}

/// What the deployment grants one plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// Readable paths.
    pub fs_read: Vec<PathGrant>,
    /// Writable paths.
    pub fs_write: Vec<PathGrant>,
    /// Addresses to listen on.
    pub net_listen: Vec<NetAddress>,
    /// Addresses to connect to.
    pub net_connect: Vec<NetAddress>,
    /// GPU access.
    pub gpu: bool,
    /// Process creation.
    pub process_fork: bool,
}

impl Grants {
    /// Whether `cap` is granted at all.
    pub fn grants(&self, cap: Capability) -> bool {
        match cap {
            Capability::FsRead => !self.fs_read.is_empty(),
            Capability::FsWrite => !self.fs_write.is_empty(),
            Capability::NetListen => !self.net_listen.is_empty(),
            Capability::NetConnect => !self.net_connect.is_empty(),
            Capability::Gpu => self.gpu,
            Capability::ProcessFork => self.process_fork,
        }
    }

    /// Capabilities `manifest` requests that these grants do not give.
    pub fn missing_for(&self, manifest: &PluginManifest) -> Vec<Capability> {
        manifest
            .capabilities
            .iter()
            .copied()
            .filter(|&c| !self.grants(c))
            .collect()
    }

    /// The grants restricted to what `manifest` requests (a plugin never gets more than it
    /// asked for, whatever the deployment says).
    pub fn restricted_to(&self, manifest: &PluginManifest) -> Grants {
        let keep = |c| manifest.requests(c);
        Grants {
            fs_read: if keep(Capability::FsRead) {
                self.fs_read.clone()
            } else {
                vec![]
            },
            fs_write: if keep(Capability::FsWrite) {
                self.fs_write.clone()
            } else {
                vec![]
            },
            net_listen: if keep(Capability::NetListen) {
                self.net_listen.clone()
            } else {
                vec![]
            },
            net_connect: if keep(Capability::NetConnect) {
                self.net_connect.clone()
            } else {
                vec![]
            },
            gpu: self.gpu && keep(Capability::Gpu),
            process_fork: self.process_fork && keep(Capability::ProcessFork),
        }
    }

    /// A one-line summary per granted capability.
    pub fn describe(&self) -> Vec<String> {
        let list = |v: &[String]| v.join(", ");
        let mut out = Vec::new();
        let paths = |g: &[PathGrant]| g.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        let addrs = |g: &[NetAddress]| g.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        if !self.fs_read.is_empty() {
            out.push(format!("fs.read: {}", list(&paths(&self.fs_read))));
        }
        if !self.fs_write.is_empty() {
            out.push(format!("fs.write: {}", list(&paths(&self.fs_write))));
        }
        if !self.net_listen.is_empty() {
            out.push(format!("net.listen: {}", list(&addrs(&self.net_listen))));
        }
        if !self.net_connect.is_empty() {
            out.push(format!("net.connect: {}", list(&addrs(&self.net_connect))));
        }
        if self.gpu {
            out.push("gpu: true".into());
        }
        if self.process_fork {
            out.push("process.fork: true".into());
        }
        out
    }
}

/// One plugin of the deployment.
#[derive(Debug, Clone)]
pub struct PluginEntry {
    /// The expected manifest name, if the deployment pins it.
    pub name: Option<String>,
    /// Absolute path of the plugin file.
    pub path: PathBuf,
    /// What it is granted.
    pub grants: Grants,
    /// Its configuration table.
    pub config: toml::Table,
    /// Which process runs it.
    pub isolation: Isolation,
}

/// Which process runs a plugin. Seccomp and Landlock confine a whole process, so plugins that
/// share the host's process share the union of their grants; a plugin in a worker process holds
/// its own grants alone, and the host's process holds none of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Isolation {
    /// In the host's process (the default).
    #[default]
    InProcess,
    /// In a worker process of its own, under a sandbox built from its grants alone; its calls
    /// and tensors cross the process boundary (loader plugins).
    Worker,
}

impl PluginEntry {
    /// A label for messages: the pinned name, else the file name.
    pub fn label(&self) -> String {
        self.name.clone().unwrap_or_else(|| {
            self.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| self.path.display().to_string())
        })
    }
}

/// A parsed, validated deployment manifest.
#[derive(Debug, Clone)]
pub struct Deployment {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its name.
    pub name: String,
    /// Threads per plugin pool, if set.
    pub threads: Option<u32>,
    /// Refuse a plugin whose observed surface (imports, raw system calls) exceeds its manifest
    /// (`strict = true`), as
    /// `u-runner serve --strict` does; otherwise it is loaded and reported as an error.
    pub strict: bool,
    /// Trusted publishers.
    pub trust: Vec<TrustedKey>,
    /// Plugins, in load order.
    pub plugins: Vec<PluginEntry>,
    /// The model to serve, if any.
    pub model: Option<PathBuf>,
    /// The architecture plugin (by name) that builds the deployment's models, when more than one
    /// loaded plugin declares their family (`[model] architecture`).
    pub architecture: Option<String>,
    /// The kernels plugins (by name) the model runs on, preferred first (`[model] kernels`):
    /// the first that loaded computes, and ops it lacks run on the next. Empty: the first
    /// kernels plugin loaded.
    pub kernels: Vec<String>,
    /// How the model is served (batching and queueing), from the `[model]` table.
    pub serving: Serving,
    /// Low-rank adapters loaded with the model (`[model.adapters]`: name = path), which
    /// requests choose by name; their paths are read-granted as the model's are.
    pub adapters: Vec<(String, PathBuf)>,
    /// Control vectors requests may run under (`[model.control_vectors]`: name = path).
    pub control_vectors: Vec<(String, PathBuf)>,
    /// Soft prompts requests may start with (`[model.soft_prompts]`: name = path).
    pub soft_prompts: Vec<(String, PathBuf)>,
    /// Directories adapters may be loaded from at run time (`[model] adapter_dirs`; none: no
    /// loading at run time).
    pub adapter_dirs: Vec<PathBuf>,
    /// The draft model of speculative decoding (`[model] draft`), built beside the model.
    pub draft_model: Option<PathBuf>,
}

impl Deployment {
    /// Every file loaded beside the model — adapters, control vectors, soft prompts, the draft
    /// model — and the directories of adapters loaded at run time, whose paths are read-granted
    /// as the model's are.
    pub fn model_extras(&self) -> impl Iterator<Item = &Path> {
        self.adapters
            .iter()
            .chain(&self.control_vectors)
            .chain(&self.soft_prompts)
            .map(|(_, p)| p.as_path())
            .chain(self.adapter_dirs.iter().map(PathBuf::as_path))
            .chain(self.draft_model.as_deref())
    }
}

/// Batching and queueing limits of the served model (`None` keeps the engine's default) and the
/// other names it answers to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Serving {
    /// Requests decoded together in one forward pass.
    pub max_running: Option<u32>,
    /// Requests that may wait for a slot before new ones are refused (429).
    pub max_queued: Option<u32>,
    /// Tokens per forward pass.
    pub step_tokens: Option<u32>,
    /// Other names clients may ask for the model by; `*` accepts any name.
    pub aliases: Vec<String>,
    /// Bytes the adapters loaded at run time may take (`adapter_budget_mb`; `None`: no
    /// limit).
    pub adapter_budget_bytes: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeployment {
    deployment: RawHeader,
    #[serde(default)]
    trust: Vec<RawTrust>,
    #[serde(default)]
    plugins: Vec<RawPlugin>,
    model: Option<RawModel>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeader {
    name: String,
    threads: Option<u32>,
    #[serde(default)]
    strict: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrust {
    name: String,
    key: Option<String>,
    key_file: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlugin {
    path: String,
    name: Option<String>,
    #[serde(default)]
    grants: toml::Table,
    #[serde(default)]
    config: toml::Table,
    #[serde(default)]
    isolation: Isolation,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    path: Option<String>,
    architecture: Option<String>,
    #[serde(default)]
    kernels: Vec<String>,
    max_running: Option<u32>,
    max_queued: Option<u32>,
    step_tokens: Option<u32>,
    #[serde(default)]
    aliases: Vec<String>,
    #[serde(default)]
    adapters: BTreeMap<String, String>,
    #[serde(default)]
    adapter_dirs: Vec<String>,
    adapter_budget_mb: Option<f64>,
    #[serde(default)]
    control_vectors: BTreeMap<String, String>,
    #[serde(default)]
    soft_prompts: BTreeMap<String, String>,
    draft: Option<String>,
}

impl Deployment {
    /// Reads and validates a deployment manifest file.
    pub fn load(path: &Path) -> Result<Self, DeploymentError> {
        let text = std::fs::read_to_string(path).map_err(|source| DeploymentError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let abs = absolute(path);
        Self::parse(&text, &abs)
    }

    /// Parses manifest `text` as if read from `path` (relative paths resolve against its folder).
    pub fn parse(text: &str, path: &Path) -> Result<Self, DeploymentError> {
        let shown = path.display().to_string();
        let raw: RawDeployment = toml::from_str(text).map_err(|e| DeploymentError::Syntax {
            path: shown.clone(),
            message: e.to_string().trim_end().replace('\n', " "),
        })?;
        let dir = path.parent().unwrap_or(Path::new("/")).to_path_buf();
        let invalid = |message: String| DeploymentError::Invalid {
            path: shown.clone(),
            message,
        };
        let named_paths = |table: Option<&BTreeMap<String, String>>, key: &str| {
            table
                .into_iter()
                .flatten()
                .map(|(name, path)| {
                    check_adapter_name(name)
                        .map_err(|why| invalid(format!("model.{key}: {why}")))?;
                    Ok((name.clone(), resolve(&dir, path)))
                })
                .collect::<Result<Vec<_>, DeploymentError>>()
        };
        if raw.deployment.threads == Some(0) {
            return Err(invalid("deployment.threads must be at least 1".into()));
        }
        let mut trust = Vec::new();
        for t in raw.trust {
            let key = match (t.key, t.key_file) {
                (Some(k), None) => PublicKey::parse(&k),
                (None, Some(f)) => PublicKey::read(&resolve(&dir, &f)),
                _ => {
                    return Err(invalid(format!(
                        "trusted publisher `{}` needs exactly one of `key` or `key_file`",
                        t.name
                    )));
                }
            }
            .map_err(|e| invalid(format!("trusted publisher `{}`: {e}", t.name)))?;
            trust.push(TrustedKey { name: t.name, key });
        }
        let mut plugins = Vec::new();
        for p in raw.plugins {
            let entry_label = p.name.clone().unwrap_or_else(|| p.path.clone());
            let grants = parse_grants(&p.grants, &dir)
                .map_err(|m| invalid(format!("plugin `{entry_label}`: {m}")))?;
            plugins.push(PluginEntry {
                name: p.name,
                path: resolve(&dir, &p.path),
                grants,
                config: p.config,
                isolation: p.isolation,
            });
        }
        Ok(Deployment {
            path: path.to_path_buf(),
            name: raw.deployment.name,
            threads: raw.deployment.threads,
            strict: raw.deployment.strict,
            trust,
            plugins,
            serving: match &raw.model {
                Some(m) => {
                    if m.adapter_budget_mb
                        .is_some_and(|mb| !(mb > 0.0 && mb.is_finite()))
                    {
                        return Err(invalid(
                            "model.adapter_budget_mb must be a positive number".into(),
                        ));
                    }
                    for (key, v) in [
                        ("max_running", m.max_running),
                        ("max_queued", m.max_queued),
                        ("step_tokens", m.step_tokens),
                    ] {
                        if v == Some(0) {
                            return Err(invalid(format!("model.{key} must be at least 1")));
                        }
                    }
                    let mut seen = std::collections::HashSet::new();
                    for a in &m.aliases {
                        if a.trim().is_empty() || a.chars().any(char::is_control) {
                            return Err(invalid(format!(
                                "model.aliases: {a:?} is not a model name"
                            )));
                        }
                        if !seen.insert(a) {
                            return Err(invalid(format!("model.aliases: {a:?} is listed twice")));
                        }
                    }
                    Serving {
                        max_running: m.max_running,
                        max_queued: m.max_queued,
                        step_tokens: m.step_tokens,
                        aliases: m.aliases.clone(),
                        adapter_budget_bytes: m.adapter_budget_mb.map(|mb| (mb * 1048576.0) as u64),
                    }
                }
                None => Serving::default(),
            },
            adapters: named_paths(raw.model.as_ref().map(|m| &m.adapters), "adapters")?,
            control_vectors: named_paths(
                raw.model.as_ref().map(|m| &m.control_vectors),
                "control_vectors",
            )?,
            soft_prompts: named_paths(raw.model.as_ref().map(|m| &m.soft_prompts), "soft_prompts")?,
            adapter_dirs: raw
                .model
                .as_ref()
                .map(|m| m.adapter_dirs.iter().map(|d| resolve(&dir, d)).collect())
                .unwrap_or_default(),
            architecture: raw.model.as_ref().and_then(|m| m.architecture.clone()),
            kernels: raw
                .model
                .as_ref()
                .map(|m| m.kernels.clone())
                .unwrap_or_default(),
            draft_model: raw
                .model
                .as_ref()
                .and_then(|m| m.draft.as_deref())
                .map(|p| resolve(&dir, p)),
            model: raw.model.and_then(|m| m.path).map(|p| resolve(&dir, &p)),
        })
    }

    /// The trusted keys.
    pub fn trusted_keys(&self) -> Vec<PublicKey> {
        self.trust.iter().map(|t| t.key).collect()
    }
}

fn parse_grants(table: &toml::Table, dir: &Path) -> Result<Grants, String> {
    let mut flat = Vec::new();
    flatten("", table, &mut flat);
    let mut grants = Grants::default();
    for (name, value) in flat {
        let cap = Capability::from_name(&name).ok_or_else(|| {
            format!(
                "unknown capability `{name}` in grants (known: {})",
                Capability::known_names()
            )
        })?;
        match cap {
            Capability::FsRead | Capability::FsWrite => {
                let paths = strings(&name, value)?
                    .iter()
                    .map(|s| path_grant(&name, s, dir))
                    .collect::<Result<Vec<_>, _>>()?;
                if cap == Capability::FsRead {
                    grants.fs_read = paths;
                } else {
                    grants.fs_write = paths;
                }
            }
            Capability::NetListen | Capability::NetConnect => {
                let addrs = strings(&name, value)?
                    .iter()
                    .map(|s| net_address(&name, s, dir))
                    .collect::<Result<Vec<_>, _>>()?;
                if cap == Capability::NetListen {
                    grants.net_listen = addrs;
                } else {
                    if addrs.iter().any(|a| matches!(a, NetAddress::Unix(_))) {
                        return Err("`net.connect` takes tcp:HOST:PORT addresses only".into());
                    }
                    grants.net_connect = addrs;
                }
            }
            Capability::Gpu | Capability::ProcessFork => {
                let flag = value
                    .as_bool()
                    .ok_or_else(|| format!("`{name}` must be true or false"))?;
                if cap == Capability::Gpu {
                    grants.gpu = flag;
                } else {
                    grants.process_fork = flag;
                }
            }
        }
    }
    Ok(grants)
}

/// Flattens `fs = { read = [...] }` and `"fs.read" = [...]` alike into dotted names.
fn flatten<'a>(prefix: &str, table: &'a toml::Table, out: &mut Vec<(String, &'a toml::Value)>) {
    for (key, value) in table {
        let name = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            toml::Value::Table(inner) => flatten(&name, inner, out),
            other => out.push((name, other)),
        }
    }
}

fn strings(name: &str, value: &toml::Value) -> Result<Vec<String>, String> {
    let err = || format!("`{name}` must be a list of strings");
    value
        .as_array()
        .ok_or_else(err)?
        .iter()
        .map(|v| v.as_str().map(str::to_string).ok_or_else(err))
        .collect()
}

fn path_grant(name: &str, text: &str, dir: &Path) -> Result<PathGrant, String> {
    let (base, recursive) = match text.strip_suffix("/**") {
        Some(b) => (if b.is_empty() { "/" } else { b }, true),
        None => (text, false),
    };
    if base.is_empty() || base.contains(['*', '?', '[']) {
        return Err(format!(
            "`{name}` path `{text}`: only plain paths and `DIR/**` are supported"
        ));
    }
    Ok(PathGrant {
        path: resolve(dir, base),
        recursive,
    })
}

fn net_address(name: &str, text: &str, dir: &Path) -> Result<NetAddress, String> {
    if let Some(p) = text.strip_prefix("unix:") {
        if p.is_empty() {
            return Err(format!("`{name}` address `{text}` has an empty path"));
        }
        return Ok(NetAddress::Unix(resolve(dir, p)));
    }
    if let Some(hp) = text.strip_prefix("tcp:") {
        let (host, port) = hp
            .rsplit_once(':')
            .ok_or_else(|| format!("`{name}` address `{text}` must be tcp:HOST:PORT"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("`{name}` address `{text}` has an invalid port"))?;
        if host.is_empty() {
            return Err(format!("`{name}` address `{text}` has an empty host"));
        }
        return Ok(NetAddress::Tcp {
            host: host.to_string(),
            port,
        });
    }
    Err(format!(
        "`{name}` address `{text}` must start with unix: or tcp:"
    ))
}

/// Resolves `p` against `dir` and normalises it lexically.
pub fn resolve(dir: &Path, p: &str) -> PathBuf {
    normalize(&dir.join(p))
}

/// Makes `p` absolute against the current directory and normalises it lexically.
pub fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        normalize(p)
    } else {
        normalize(
            &std::env::current_dir()
                .unwrap_or_else(|_| PathBuf::from("/"))
                .join(p),
        )
    }
}

/// Removes `.` and resolves `..` without touching the file system.
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// Checks the name of an adapter (`[model.adapters]`, `--lora`): requests name it in `model` as
/// `base:name`, so it has no `:`, no control characters and is not empty.
pub fn check_adapter_name(name: &str) -> Result<(), String> {
    if name.trim().is_empty() || name.contains(':') || name.chars().any(char::is_control) {
        return Err(format!(
            "{name:?} is not an adapter name (not empty, no `:` or control characters)"
        ));
    }
    Ok(())
}

/// Read grants covering a served `model`: the directory, or the file and a `tokenizer.json`,
/// `tokenizer_config.json`, `config.json` or `preprocessor_config.json` beside it. The host adds them to the loader and tokenizer plugins
/// at start-up; the proof lists them (one function, so the two never disagree).
pub fn model_grants(model: &Path) -> Vec<PathGrant> {
    if model.is_dir() {
        return vec![PathGrant {
            path: model.to_path_buf(),
            recursive: true,
        }];
    }
    let mut grants = vec![PathGrant {
        path: model.to_path_buf(),
        recursive: false,
    }];
    if let Some(dir) = model.parent() {
        // A single file's side files: its tokenizer, and the configuration an ONNX export
        // does not carry (config.json, an image model's preprocessor_config.json).
        for name in [
            "tokenizer.json",
            "tokenizer_config.json",
            "config.json",
            "preprocessor_config.json",
        ] {
            let p = dir.join(name);
            if p.is_file() {
                grants.push(PathGrant {
                    path: p,
                    recursive: false,
                });
            }
        }
    }
    grants
}

/// How a listener's requests are authenticated, from its plugin's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ListenerAuth {
    /// Every request is HMAC-signed (`hmac_secret_file` or `hmac_keys_file`).
    Hmac,
    /// Requests carry an API key (`api_keys_file`).
    ApiKeys,
    /// None: anyone who reaches the address is served.
    None,
}

/// One address a plugin listens on, with how it authenticates.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Listener {
    /// The plugin's label.
    pub plugin: String,
    /// The address.
    pub address: String,
    /// Its authentication.
    pub auth: ListenerAuth,
    /// Whether other machines can reach it: TCP on an address that is not loopback.
    pub public: bool,
}

impl Deployment {
    /// Every address the deployment listens on, with its authentication (the `net.listen`
    /// grants of each plugin and the `hmac_secret_file` / `hmac_keys_file` / `api_keys_file`
    /// of its config).
    pub fn listeners(&self) -> Vec<Listener> {
        let mut out = Vec::new();
        for p in &self.plugins {
            let hmac = ["hmac_secret_file", "hmac_keys_file"];
            let auth = if hmac.iter().any(|k| p.config.contains_key(*k)) {
                ListenerAuth::Hmac
            } else if p.config.contains_key("api_keys_file") {
                ListenerAuth::ApiKeys
            } else {
                ListenerAuth::None
            };
            // The pinned name, else the file's name without its extension.
            let plugin = p.name.clone().unwrap_or_else(|| {
                p.path
                    .file_stem()
                    .map_or_else(|| p.label(), |s| s.to_string_lossy().into_owned())
            });
            for a in &p.grants.net_listen {
                let public = match a {
                    NetAddress::Unix(_) => false,
                    NetAddress::Tcp { host, .. } => !is_loopback(host),
                };
                out.push(Listener {
                    plugin: plugin.clone(),
                    address: a.to_string(),
                    auth,
                    public,
                });
            }
        }
        out
    }

    /// Problems an operator must hear about: a listener other machines can reach that
    /// authenticates no one. `u-attest inspect` prints them and `u-runner serve --strict`
    /// refuses to serve with any.
    pub fn warnings(&self) -> Vec<String> {
        self.listeners()
            .iter()
            .filter(|l| l.public && l.auth == ListenerAuth::None)
            .map(|l| {
                format!(
                    "{} listens on {}, reachable from other machines, without authentication \
                     (set api_keys_file or hmac_secret_file, or listen on loopback)",
                    l.plugin, l.address
                )
            })
            .collect()
    }
}

/// Whether `host` (a name or IP literal, IPv6 possibly in brackets) is this machine only.
fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost")
        || bare
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Deployment, DeploymentError> {
        Deployment::parse(text, Path::new("/etc/u/deploy.toml"))
    }

    const KEY: &str = "ed25519:3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c";

    #[test]
    fn parses_grants_in_both_spellings() {
        let d = parse(&format!(
            r#"
[deployment]
name = "t"
[[trust]]
name = "dev"
key = "{KEY}"
[[plugins]]
path = "p/a.so"
[plugins.grants]
fs.read = ["/srv/models/**", "cfg.toml"]
"net.listen" = ["unix:/run/u.sock", "tcp:127.0.0.1:8080"]
process.fork = false
"#
        ))
        .unwrap();
        let g = &d.plugins[0].grants;
        assert_eq!(d.plugins[0].path, Path::new("/etc/u/p/a.so"));
        assert!(g.fs_read[0].covers(Path::new("/srv/models/x/y.gguf")));
        assert!(!g.fs_read[0].covers(Path::new("/srv/modelsX")));
        assert!(g.fs_read[1].covers(Path::new("/etc/u/cfg.toml")));
        assert_eq!(
            g.net_listen[1],
            NetAddress::Tcp {
                host: "127.0.0.1".into(),
                port: 8080
            }
        );
        assert!(g.grants(Capability::NetListen));
        assert!(!g.grants(Capability::NetConnect));
        assert!(!g.grants(Capability::ProcessFork));
    }

    /// A deployment need not grant an optional capability; when it does, the grant holds.
    #[test]
    fn an_optional_capability_takes_effect_only_when_granted() {
        let manifest = PluginManifest::parse(
            "name = \"r\"\nversion = \"0.1.0\"\nkind = \"runner\"\ncapabilities = []\n\
             optional_capabilities = [\"process.fork\"]\ntasks = [\"text-generation\"]\n",
        )
        .unwrap();
        let none = Grants::default();
        assert!(none.missing_for(&manifest).is_empty());
        let fork = Grants {
            process_fork: true,
            ..Grants::default()
        };
        assert!(fork.missing_for(&manifest).is_empty());
        assert!(fork.restricted_to(&manifest).process_fork);
    }

    #[test]
    fn each_defect_gets_one_clear_error() {
        let unknown = parse(
            "[deployment]\nname='t'\n[[plugins]]\npath='a.so'\n[plugins.grants]\nnet.raw=['x']\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            unknown.contains("unknown capability `net.raw`"),
            "{unknown}"
        );
        assert!(unknown.contains("plugin `a.so`"), "{unknown}");

        let syntax = parse("[deployment\nname='t'").unwrap_err();
        assert!(matches!(syntax, DeploymentError::Syntax { .. }), "{syntax}");

        let missing = parse("[[plugins]]\npath='a.so'\n").unwrap_err().to_string();
        assert!(missing.contains("missing field `deployment`"), "{missing}");

        let no_path = parse("[deployment]\nname='t'\n[[plugins]]\nname='a'\n")
            .unwrap_err()
            .to_string();
        assert!(no_path.contains("missing field `path`"), "{no_path}");

        let typo = parse("[deployment]\nname='t'\n[[plugin]]\npath='a.so'\n")
            .unwrap_err()
            .to_string();
        assert!(typo.contains("unknown field `plugin`"), "{typo}");

        let glob = parse(
            "[deployment]\nname='t'\n[[plugins]]\npath='a.so'\n[plugins.grants]\nfs.read=['/srv/*.gguf']\n",
        )
        .unwrap_err()
        .to_string();
        assert!(glob.contains("only plain paths"), "{glob}");

        let port = parse(
            "[deployment]\nname='t'\n[[plugins]]\npath='a.so'\n[plugins.grants]\nnet.listen=['tcp:h:99999']\n",
        )
        .unwrap_err()
        .to_string();
        assert!(port.contains("invalid port"), "{port}");

        let bad_key = parse("[deployment]\nname='t'\n[[trust]]\nname='x'\nkey='ed25519:00'\n")
            .unwrap_err()
            .to_string();
        assert!(bad_key.contains("trusted publisher `x`"), "{bad_key}");

        let flag = parse(
            "[deployment]\nname='t'\n[[plugins]]\npath='a.so'\n[plugins.grants]\ngpu='yes'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(flag.contains("`gpu` must be true or false"), "{flag}");

        for (aliases, says) in [("['a', 'a']", "listed twice"), ("['']", "not a model name")] {
            let e = parse(&format!(
                "[deployment]\nname='t'\n[model]\naliases={aliases}\n"
            ))
            .unwrap_err()
            .to_string();
            assert!(e.contains(says), "{aliases}: {e}");
        }
    }

    #[test]
    fn the_model_names_its_kernels_in_order_of_preference() {
        let d = parse("[deployment]\nname='t'\n[model]\nkernels=['kernels-wgpu','kernels-cpu']\n")
            .unwrap();
        assert_eq!(d.kernels, ["kernels-wgpu", "kernels-cpu"]);
        assert!(
            parse("[deployment]\nname='t'\n")
                .unwrap()
                .kernels
                .is_empty()
        );
        let e = parse("[deployment]\nname='t'\n[model]\nkernels='kernels-cpu'\n").unwrap_err();
        assert!(e.to_string().contains("kernels"), "{e}");
    }

    #[test]
    fn a_draft_model_is_read_granted_beside_the_model() {
        let d = parse("[deployment]\nname='t'\n[model]\npath='m.gguf'\ndraft='d/small.gguf'\n")
            .unwrap();
        assert_eq!(
            d.draft_model.as_deref(),
            Some(Path::new("/etc/u/d/small.gguf"))
        );
        assert!(
            d.model_extras()
                .any(|p| p == Path::new("/etc/u/d/small.gguf"))
        );
        assert_eq!(parse("[deployment]\nname='t'\n").unwrap().draft_model, None);
    }

    #[test]
    fn the_model_table_sets_limits_and_aliases() {
        let d = parse(
            "[deployment]\nname='t'\n[model]\nmax_running=4\naliases=['gpt-4o-mini', 'local/m']\n",
        )
        .unwrap();
        assert_eq!(d.serving.max_running, Some(4));
        assert_eq!(d.serving.aliases, ["gpt-4o-mini", "local/m"]);
        assert!(
            parse("[deployment]\nname='t'\n")
                .unwrap()
                .serving
                .aliases
                .is_empty()
        );
    }

    #[test]
    fn grants_never_exceed_the_request() {
        let manifest = PluginManifest::parse(
            "name='a'\nversion='0.1.0'\nkind='loader'\ncapabilities=['fs.read']\n",
        )
        .unwrap();
        let grants = Grants {
            fs_read: vec![PathGrant {
                path: "/m".into(),
                recursive: true,
            }],
            net_connect: vec![NetAddress::Tcp {
                host: "h".into(),
                port: 1,
            }],
            ..Grants::default()
        };
        assert!(grants.missing_for(&manifest).is_empty());
        let eff = grants.restricted_to(&manifest);
        assert!(eff.net_connect.is_empty());
        assert_eq!(eff.fs_read.len(), 1);
        let none = Grants::default();
        assert_eq!(none.missing_for(&manifest), vec![Capability::FsRead]);
    }
}
