//! Verifying and loading the plugins of a deployment.
//!
//! Every check that can refuse a plugin runs on the bytes read once from disk, **before** any of
//! the plugin's code runs: signature, trusted publisher, ABI fingerprint, grants, ELF sanity.
//! The same bytes are then written to a sealed memfd and loaded from there, so nothing can swap
//! the file between the check and the `dlopen`. A refused plugin is reported and skipped; the
//! host keeps going with the rest.

use crate::services::PluginServices;
use abi_stable::library::lib_header_from_path;
use std::{collections::BTreeSet, ffi::CString, io::Write, os::fd::FromRawFd, path::PathBuf};
use u_attest::{
    Deployment, PluginEntry, Verified,
    deployment::Grants,
    elf,
    signing::{check_abi, verify_bytes},
};
use u_sdk::{PluginInfo, PluginInstance, PluginModRef, manifest::PluginKind};

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

/// The outcome of loading a deployment.
#[derive(Default)]
pub struct LoadReport {
    /// Plugins loaded, in deployment order.
    pub loaded: Vec<LoadedPlugin>,
    /// Plugins refused.
    pub refused: Vec<Refusal>,
}

/// Verifies and loads every plugin of `deployment`, each with `threads` compute threads.
pub fn load_deployment(deployment: &Deployment, threads: u32) -> LoadReport {
    let trusted = deployment.trusted_keys();
    let mut report = LoadReport::default();
    let mut names = BTreeSet::new();
    for entry in &deployment.plugins {
        let refuse = |reason: String| Refusal {
            plugin: entry.label(),
            path: entry.path.clone(),
            reason,
        };
        match load_one(entry, &trusted, threads, &names) {
            Ok(plugin) => {
                tracing::info!(
                    plugin = %plugin.verified.manifest.name,
                    kind = %plugin.verified.manifest.kind,
                    publisher = %plugin.verified.publisher.short_id(),
                    abi = %plugin.verified.abi(),
                    "loaded"
                );
                names.insert(plugin.verified.manifest.name.clone());
                report.loaded.push(plugin);
            }
            Err(reason) => {
                let refusal = refuse(reason);
                tracing::error!(plugin = %refusal.plugin, path = %refusal.path.display(), "refused: {}", refusal.reason);
                report.refused.push(refusal);
            }
        }
    }
    report
}

fn load_one(
    entry: &PluginEntry,
    trusted: &[u_attest::PublicKey],
    threads: u32,
    taken: &BTreeSet<String>,
) -> Result<LoadedPlugin, String> {
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

    let module = load_sealed(&bytes, &manifest.name)?;
    let grants = entry.grants.restricted_to(manifest);
    if grants != entry.grants {
        tracing::warn!(
            plugin = %manifest.name,
            "the deployment grants more than the plugin requests; only {:?} take effect",
            grants.describe()
        );
    }
    let config = toml::to_string(&entry.config).map_err(|e| format!("plugin config: {e}"))?;
    let services = PluginServices::new(&manifest.name, grants.clone(), config, threads);
    let info = (module.describe())();
    let instance = (module.instantiate())(services.into_box())
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
        verified,
        path: entry.path.clone(),
        grants,
        info,
        instance,
    })
}

/// Copies verified bytes into a sealed memfd and loads the plugin's root module from it.
fn load_sealed(bytes: &[u8], name: &str) -> Result<PluginModRef, String> {
    let fd = sealed_memfd(bytes, name).map_err(|e| format!("memfd for {name}: {e}"))?;
    // The memfd stays open for the life of the process: the mapping is the plugin's code.
    let path = format!("/proc/self/fd/{fd}");
    let header = lib_header_from_path(std::path::Path::new(&path))
        .map_err(|e| format!("dlopen failed: {e}"))?;
    header
        .init_root_module::<PluginModRef>()
        .map_err(|e| format!("ABI check after load failed: {e}"))
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
