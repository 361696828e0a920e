//! Verifying and loading the plugins of a deployment.
//!
//! Every check that can refuse a plugin runs on the bytes read once from disk, **before** any of
//! the plugin's code runs: signature, trusted publisher, ABI fingerprint, grants, ELF sanity.
//! The same bytes are then written to a sealed memfd and loaded from there, so nothing can swap
//! the file between the check and the `dlopen`. A refused plugin is reported and skipped; the
//! host keeps going with the rest.

use crate::services::PluginServices;
use nix::{
    fcntl::{FcntlArg, SealFlag, fcntl},
    sys::memfd::{MFdFlags, memfd_create},
};
use std::{
    ffi::CString,
    io::Write,
    os::fd::{IntoRawFd, OwnedFd},
    path::PathBuf,
};
use u_attest::{
    Deployment, PluginEntry, Verified, admission,
    deployment::{Grants, Isolation},
};
use u_sdk::{PluginInfo, PluginInstance, PluginModRef};

/// A plugin whose file passed every check and whose code is mapped, not yet instantiated.
pub struct OpenedPlugin {
    /// What verification established (manifest, publisher, code hash).
    pub verified: Verified,
    /// The file it came from.
    pub path: PathBuf,
    /// Its effective grants (the deployment's grant restricted to what it requested).
    pub grants: Grants,
    code: Code,
    config: String,
}

/// Where an opened plugin's code is.
enum Code {
    /// Verified bytes in a sealed memfd, not mapped yet ([`start_workers`] maps them, or has a
    /// worker process map them when `in_worker`).
    Sealed {
        memfd: OwnedFd,
        symbol: String,
        in_worker: bool,
    },
    /// Mapped into the host's process.
    InProcess(PluginModRef),
    /// Loaded and instantiated in a worker process; the host's process never maps it.
    Worker(crate::worker::Worker),
}

impl OpenedPlugin {
    /// Whether it runs in a worker process of its own (its grants are not the host process's).
    pub fn in_worker(&self) -> bool {
        matches!(
            self.code,
            Code::Worker(_)
                | Code::Sealed {
                    in_worker: true,
                    ..
                }
        )
    }
}

/// A plugin that passed every check and was instantiated.
pub struct LoadedPlugin {
    /// What verification established (manifest, publisher, code hash).
    pub verified: Verified,
    /// The file it came from.
    pub path: PathBuf,
    /// Its effective grants (the deployment's grant restricted to what it requested).
    pub grants: Grants,
    /// Its self-description, answered across the ABI.
    pub info: PluginInfo,
    /// Its entry object.
    pub instance: PluginInstance,
    /// Its root module, when it runs in the host's process.
    module: Option<PluginModRef>,
    config: String,
    threads: u32,
}

impl LoadedPlugin {
    /// Whether it runs in a worker process of its own.
    pub fn in_worker(&self) -> bool {
        self.module.is_none()
    }

    /// A second, independent entry object of the same plugin, with the same grants, settings
    /// and threads: a KV cache for a second model (a draft model), whose layout differs from
    /// the first one's.
    pub fn another_instance(&self) -> Result<PluginInstance, String> {
        let module = self.module.ok_or_else(|| {
            format!(
                "{} runs in a worker process: it has one instance",
                self.verified.manifest.name
            )
        })?;
        let services = PluginServices::new(
            &self.verified.manifest.name,
            self.grants.clone(),
            self.config.clone(),
            self.threads,
        );
        (module.instantiate())(services.into_box())
            .into_result()
            .map_err(|e| format!("{}: instantiate failed: {e}", self.verified.manifest.name))
    }
}

/// A plugin the host would not load, and why.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Refusal {
    /// The deployment's label for it (pinned name or file name).
    pub plugin: String,
    /// The file.
    pub path: PathBuf,
    /// The reason, naming the capability where one is involved.
    pub reason: String,
}

/// Plugins verified and mapped (phase one of loading).
#[derive(Default)]
pub struct OpenReport {
    /// Plugins mapped, in deployment order.
    pub opened: Vec<OpenedPlugin>,
    /// Plugins refused.
    pub refused: Vec<Refusal>,
}

/// The outcome of loading a deployment.
#[derive(Default)]
pub struct LoadReport {
    /// Plugins loaded, in deployment order.
    pub loaded: Vec<LoadedPlugin>,
    /// Plugins refused.
    pub refused: Vec<Refusal>,
}

/// Verifies and loads every plugin of `deployment`, each with `threads` compute threads:
/// [`open_deployment`], [`start_workers`], then [`instantiate`] (without locking down).
pub fn load_deployment(deployment: &Deployment, threads: u32) -> LoadReport {
    let mut opened = open_deployment(deployment);
    start_workers(&mut opened, threads);
    instantiate(opened, threads)
}

/// Phase one and a half: starts a worker process for every opened plugin the deployment
/// isolates (`isolation = "worker"`) — it loads the plugin, locks itself down to that plugin's
/// grants alone and instantiates it — then maps the other plugins' code into the host's
/// process, so no worker inherits a mapping of another plugin. Call after the plugins' grants
/// are final and before the host locks its own process down. A plugin whose worker fails to
/// start, or whose code fails to map, is refused.
pub fn start_workers(opened: &mut OpenReport, threads: u32) {
    let mut kept = Vec::with_capacity(opened.opened.len());
    for mut plugin in std::mem::take(&mut opened.opened) {
        if let Code::Sealed {
            memfd,
            symbol,
            in_worker: true,
        } = plugin.code
        {
            let name = plugin.verified.manifest.name.clone();
            let started = crate::worker::Worker::start(
                &name,
                memfd,
                &symbol,
                &plugin.grants,
                &plugin.config,
                threads,
            );
            match started {
                Ok(worker) => plugin.code = Code::Worker(worker),
                Err(reason) => {
                    let refusal = refuse(name, plugin.path, format!("worker process: {reason}"));
                    opened.refused.push(refusal);
                    continue;
                }
            }
        }
        kept.push(plugin);
    }
    for mut plugin in std::mem::take(&mut kept) {
        if let Code::Sealed { memfd, symbol, .. } = plugin.code {
            match load_sealed(memfd, &symbol) {
                Ok(module) => {
                    crate::services::register_fork_hooks(module.before_fork(), module.after_fork());
                    plugin.code = Code::InProcess(module);
                }
                Err(reason) => {
                    let name = plugin.verified.manifest.name.clone();
                    opened.refused.push(refuse(name, plugin.path, reason));
                    continue;
                }
            }
        }
        kept.push(plugin);
    }
    opened.opened = kept;
}

/// Phase one: verifies every plugin of `deployment` ([`u_attest::admission`], the checks
/// `u-attest verify` makes too) and seals the verified bytes in memfds ([`start_workers`] maps
/// them). No plugin object exists yet, so the host can lock the process down before any plugin
/// starts threads.
pub fn open_deployment(deployment: &Deployment) -> OpenReport {
    let trusted = deployment.trusted_keys();
    let mut report = OpenReport::default();
    let policy = if deployment.strict {
        admission::Policy::Strict
    } else {
        admission::Policy::Report
    };
    for (entry, admitted) in admission::admit_all(&deployment.plugins, &trusted, policy) {
        match admitted.and_then(|(admitted, bytes)| open_one(entry, admitted, &bytes)) {
            Ok(plugin) => report.opened.push(plugin),
            Err(reason) => report
                .refused
                .push(refuse(entry.label(), entry.path.clone(), reason)),
        }
    }
    report
}

/// Phase two: creates each opened plugin's entry object with host services bound to its grants.
pub fn instantiate(opened: OpenReport, threads: u32) -> LoadReport {
    let mut report = LoadReport {
        loaded: Vec::new(),
        refused: opened.refused,
    };
    for plugin in opened.opened {
        let name = plugin.verified.manifest.name.clone();
        let path = plugin.path.clone();
        match instantiate_one(plugin, threads) {
            Ok(loaded) => {
                tracing::info!(
                    plugin = %loaded.verified.manifest.name,
                    kind = %loaded.verified.manifest.kind,
                    publisher = %loaded.verified.publisher.short_id(),
                    abi = %loaded.verified.abi(),
                    "loaded"
                );
                report.loaded.push(loaded);
            }
            Err(reason) => report.refused.push(refuse(name, path, reason)),
        }
    }
    report
}

fn refuse(plugin: String, path: PathBuf, reason: String) -> Refusal {
    let refusal = Refusal {
        plugin,
        path,
        reason,
    };
    tracing::error!(plugin = %refusal.plugin, path = %refusal.path.display(), "refused: {}", refusal.reason);
    refusal
}

/// Seals an admitted plugin's verified `bytes` in a memfd.
fn open_one(
    entry: &PluginEntry,
    admitted: admission::Admitted,
    bytes: &[u8],
) -> Result<OpenedPlugin, String> {
    let admission::Admitted {
        verified,
        grants,
        over_granted,
        root_symbol,
        undeclared,
    } = admitted;
    let manifest = &verified.manifest;
    for excess in &undeclared {
        tracing::error!(
            plugin = %manifest.name,
            "{excess}: loaded because the deployment is not strict; the sandbox still denies \
             what was not granted (serve --strict or [deployment] strict = true refuses it)"
        );
    }
    if over_granted {
        tracing::warn!(
            plugin = %manifest.name,
            "the deployment grants more than the plugin requests; only {:?} take effect",
            grants.describe()
        );
    }
    let config = toml::to_string(&entry.config).map_err(|e| format!("plugin config: {e}"))?;
    let memfd = sealed_memfd(bytes, &manifest.name)
        .map_err(|e| format!("memfd for {}: {e}", manifest.name))?;
    Ok(OpenedPlugin {
        verified,
        path: entry.path.clone(),
        grants,
        code: Code::Sealed {
            memfd,
            symbol: root_symbol,
            in_worker: entry.isolation == Isolation::Worker,
        },
        config,
    })
}

fn instantiate_one(plugin: OpenedPlugin, threads: u32) -> Result<LoadedPlugin, String> {
    let manifest = &plugin.verified.manifest;
    let (info, instance, module) = match plugin.code {
        Code::InProcess(module) => {
            let (info, instance) = instantiate_module(
                module,
                &manifest.name,
                &plugin.grants,
                &plugin.config,
                threads,
            )?;
            (info, instance, Some(module))
        }
        Code::Worker(worker) => {
            let (info, instance) = worker.into_instance();
            (info, instance, None)
        }
        Code::Sealed { .. } => {
            return Err("its code was never mapped (start_workers)".into());
        }
    };
    if instance.kind_name() != manifest.kind.name() {
        return Err(format!(
            "manifest says kind `{}` but the plugin created a `{}`",
            manifest.kind,
            instance.kind_name()
        ));
    }
    Ok(LoadedPlugin {
        verified: plugin.verified,
        path: plugin.path,
        grants: plugin.grants,
        info,
        instance,
        module,
        config: plugin.config,
        threads,
    })
}

/// Describes and instantiates a loaded root module with host services bound to `grants`.
pub(crate) fn instantiate_module(
    module: PluginModRef,
    name: &str,
    grants: &Grants,
    config: &str,
    threads: u32,
) -> Result<(u_sdk::PluginInfo, PluginInstance), String> {
    let services = PluginServices::new(name, grants.clone(), config.to_string(), threads);
    let info = (module.describe())();
    let instance = (module.instantiate())(services.into_box())
        .into_result()
        .map_err(|e| format!("instantiate failed: {e}"))?;
    Ok((info, instance))
}

/// Loads a plugin's root module from the sealed memfd holding its verified bytes.
pub(crate) fn load_sealed(memfd: OwnedFd, symbol: &str) -> Result<PluginModRef, String> {
    // The memfd stays open for the life of the process: the mapping is the plugin's code.
    let fd = memfd.into_raw_fd();
    let path = format!("/proc/self/fd/{fd}");
    u_sdk::meta::load_root_module(std::path::Path::new(&path), symbol)
}

fn sealed_memfd(bytes: &[u8], name: &str) -> std::io::Result<OwnedFd> {
    // MFD_EXEC (Linux 6.3) is not among nix's flags; the kernel's value.
    const MFD_EXEC: MFdFlags = MFdFlags::from_bits_retain(0x10);
    let cname = CString::new(format!("u-plugin:{name}")).map_err(std::io::Error::other)?;
    let flags = MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING;
    // Kernels before 6.3 do not know MFD_EXEC; their memfds are executable anyway.
    let fd = memfd_create(cname.as_c_str(), flags | MFD_EXEC)
        .or_else(|_| memfd_create(cname.as_c_str(), flags))?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)?;
    seal(&file)?;
    Ok(file.into())
}

/// Seals a written memfd for good: no write, no resize, no change to the seals.
pub(crate) fn seal(file: &std::fs::File) -> std::io::Result<()> {
    let seals = SealFlag::F_SEAL_SEAL
        | SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_WRITE;
    fcntl(file, FcntlArg::F_ADD_SEALS(seals))?;
    Ok(())
}
