//! Verifying and loading the plugins of a deployment.
//!
//! Every check that can refuse a plugin runs on the bytes read once from disk, **before** any of
//! the plugin's code runs: signature, trusted publisher, ABI fingerprint, grants, ELF sanity.
//! The same bytes are then written to a sealed memfd and loaded from there, so nothing can swap
//! the file between the check and the `dlopen`. A refused plugin is reported and skipped; the
//! host keeps going with the rest.

use crate::services::PluginServices;
use std::{collections::BTreeSet, ffi::CString, io::Write, os::fd::FromRawFd, path::PathBuf};
use u_attest::{
    Deployment, PluginEntry, Verified,
    deployment::Grants,
    elf,
    signing::{check_abi, verify_bytes},
};
use u_sdk::{PluginInfo, PluginInstance, PluginModRef, manifest::PluginKind};

/// A plugin whose file passed every check and whose code is mapped, not yet instantiated.
pub struct OpenedPlugin {
    /// What verification established (manifest, publisher, code hash).
    pub verified: Verified,
    /// The file it came from.
    pub path: PathBuf,
    /// Its effective grants (the deployment's grant restricted to what it requested).
    pub grants: Grants,
    module: PluginModRef,
    config: String,
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
/// [`open_deployment`] then [`instantiate`].
pub fn load_deployment(deployment: &Deployment, threads: u32) -> LoadReport {
    instantiate(open_deployment(deployment), threads)
}

/// Phase one: verifies every plugin of `deployment` and maps the verified bytes. No plugin object
/// exists yet, so the host can lock the process down before any plugin starts threads.
pub fn open_deployment(deployment: &Deployment) -> OpenReport {
    let trusted = deployment.trusted_keys();
    let mut report = OpenReport::default();
    let mut names = BTreeSet::new();
    for entry in &deployment.plugins {
        match open_one(entry, &trusted, &names) {
            Ok(plugin) => {
                names.insert(plugin.verified.manifest.name.clone());
                report.opened.push(plugin);
            }
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

fn open_one(
    entry: &PluginEntry,
    trusted: &[u_attest::PublicKey],
    taken: &BTreeSet<String>,
) -> Result<OpenedPlugin, String> {
    let bytes = std::fs::read(&entry.path)
        .map_err(|e| format!("cannot read {}: {e}", entry.path.display()))?;
    let verified = verify_bytes(&bytes, trusted).map_err(|e| e.to_string())?;
    check_abi(&verified, u_sdk::ABI_MAJOR, &u_sdk::ABI_HASH).map_err(|e| e.to_string())?;
    let manifest = &verified.manifest;
    if let Some(expected) = &entry.name
        && expected != &manifest.name
    {
        return Err(format!(
            "the deployment expects plugin `{expected}` but the file's signed manifest names `{}`",
            manifest.name
        ));
    }
    if manifest.kind == PluginKind::Host {
        return Err("a host component cannot be loaded as a plugin".into());
    }
    if taken.contains(&manifest.name) {
        return Err(format!(
            "a plugin named `{}` is already loaded",
            manifest.name
        ));
    }
    let missing = entry.grants.missing_for(manifest);
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|c| c.name()).collect();
        return Err(format!(
            "plugin `{}` requests `{}`, which the deployment does not grant it",
            manifest.name,
            names.join("`, `")
        ));
    }
    elf::check_sanity(&bytes).map_err(|e| e.to_string())?;
    let grants = entry.grants.restricted_to(manifest);
    if grants != entry.grants {
        tracing::warn!(
            plugin = %manifest.name,
            "the deployment grants more than the plugin requests; only {:?} take effect",
            grants.describe()
        );
    }
    let config = toml::to_string(&entry.config).map_err(|e| format!("plugin config: {e}"))?;
    let symbol = root_symbol(&bytes)?;
    let module = load_sealed(&bytes, &manifest.name, &symbol)?;
    Ok(OpenedPlugin {
        verified,
        path: entry.path.clone(),
        grants,
        module,
        config,
    })
}

fn instantiate_one(plugin: OpenedPlugin, threads: u32) -> Result<LoadedPlugin, String> {
    let manifest = &plugin.verified.manifest;
    let services = PluginServices::new(
        &manifest.name,
        plugin.grants.clone(),
        plugin.config,
        threads,
    );
    let info = (plugin.module.describe())();
    let instance = (plugin.module.instantiate())(services.into_box())
        .into_result()
        .map_err(|e| format!("instantiate failed: {e}"))?;
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
    })
}
/// The exported root-module symbol (`u_plugin_root_<crate>`), which must be unique.
fn root_symbol(bytes: &[u8]) -> Result<String, String> {
    let facts = elf::analyse(bytes).map_err(|e| e.to_string())?;
    let mut found = facts
        .exports
        .into_iter()
        .filter(|s| s.starts_with(u_sdk::meta::ROOT_SYMBOL_PREFIX));
    match (found.next(), found.next()) {
        (Some(symbol), None) => Ok(symbol),
        (None, _) => Err(format!(
            "exports no `{}*` root module (not built with u_sdk::export_plugin!)",
            u_sdk::meta::ROOT_SYMBOL_PREFIX
        )),
        (Some(a), Some(b)) => Err(format!("exports two root modules (`{a}`, `{b}`)")),
    }
}

/// Copies verified bytes into a sealed memfd and loads the plugin's root module from it.
fn load_sealed(bytes: &[u8], name: &str, symbol: &str) -> Result<PluginModRef, String> {
    let fd = sealed_memfd(bytes, name).map_err(|e| format!("memfd for {name}: {e}"))?;
    // The memfd stays open for the life of the process: the mapping is the plugin's code.
    let path = format!("/proc/self/fd/{fd}");
    u_sdk::meta::load_root_module(std::path::Path::new(&path), symbol)
}

fn sealed_memfd(bytes: &[u8], name: &str) -> std::io::Result<i32> {
    const MFD_EXEC: libc::c_uint = 0x10;
    let cname = CString::new(format!("u-plugin:{name}")).map_err(std::io::Error::other)?;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: valid NUL-terminated name; flags are plain integers.
    let mut fd = unsafe { libc::memfd_create(cname.as_ptr(), flags | MFD_EXEC) };
    if fd < 0 {
        // Kernels before 6.3 do not know MFD_EXEC; their memfds are executable anyway.
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    }
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own; ManuallyDrop keeps it open after writing.
    let mut file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    file.write_all(bytes)?;
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on our own descriptor.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}
