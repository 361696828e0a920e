//! Whether one deployment entry may be loaded: every check `u-runner` makes on a plugin's bytes
//! before any of its code runs. `u-runner` loads with it, and `u-attest verify --deployment`
//! and the capability proof judge with it, so the offline check and the host never disagree.

use crate::{
    PluginEntry, PublicKey, Verified,
    deployment::{Grants, Isolation},
    elf,
    signing::{check_abi, verify_bytes},
    surface,
};
use std::collections::BTreeSet;
use u_sdk::manifest::PluginKind;

/// An entry that passed every check.
pub struct Admitted {
    /// What verification established (manifest, publisher, code hash).
    pub verified: Verified,
    /// Its effective grants: the deployment's, restricted to what the manifest requests.
    pub grants: Grants,
    /// Whether the deployment grants more than the plugin requests (the rest takes no effect).
    pub over_granted: bool,
    /// The exported root-module symbol the host loads it by.
    pub root_symbol: String,
    /// What it can do beyond its declaration — imports ([`surface::observe_imports`]) and raw
    /// system-call instructions ([`surface::count_raw_syscalls`]), each said as a sentence:
    /// refused under [`Policy::Strict`], otherwise loaded and reported loudly.
    pub undeclared: Vec<String>,
}

/// How an observed import surface beyond the declaration is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Loaded, and the excess reported (the host logs it as an error).
    Report,
    /// Refused (`u-runner serve --strict`, `[deployment] strict = true`).
    Strict,
}

/// Checks `entry`'s file `bytes`: signed by a `trusted` key, built against this ABI, the plugin
/// the entry pins (if it pins one), not a host component, not named like one of `taken` (the
/// plugins admitted before it), granted every capability it requests, a sane ELF file, and
/// exporting one root module, and — under [`Policy::Strict`] — neither importing what its
/// manifest does not declare nor making raw system calls. The error is the reason, naming the capability where one is involved.
pub fn admit(
    entry: &PluginEntry,
    bytes: &[u8],
    trusted: &[PublicKey],
    taken: &BTreeSet<String>,
    policy: Policy,
) -> Result<Admitted, String> {
    let verified = verify_bytes(bytes, trusted).map_err(|e| e.to_string())?;
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
    if entry.isolation == Isolation::Worker && manifest.kind != PluginKind::Loader {
        return Err(format!(
            "isolation = \"worker\" is built for loader plugins (their calls and tensors cross \
             the process boundary); `{}` is a {} plugin and runs in the host's process",
            manifest.name, manifest.kind
        ));
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
    elf::check_sanity(bytes).map_err(|e| e.to_string())?;
    let facts = elf::analyse(bytes).map_err(|e| e.to_string())?;
    let root_symbol = root_symbol(&facts)?;
    let mut undeclared = surface::observe_imports(&facts.imports, manifest).violations;
    let raw = surface::count_raw_syscalls(bytes, &facts);
    if raw > 0 {
        undeclared.push(format!(
            "contains {raw} raw system-call instruction(s), which bypass every declared capability"
        ));
    }
    if policy == Policy::Strict && !undeclared.is_empty() {
        return Err(format!(
            "its observed surface exceeds its manifest, and strict mode refuses that: {}",
            undeclared.join("; ")
        ));
    }
    let grants = entry.grants.restricted_to(manifest);
    let over_granted = grants != entry.grants;
    Ok(Admitted {
        verified,
        grants,
        over_granted,
        root_symbol,
        undeclared,
    })
}

/// The exported root-module symbol (`u_plugin_root_<crate>`), which must be unique.
fn root_symbol(facts: &elf::ElfFacts) -> Result<String, String> {
    let mut found = facts
        .exports
        .iter()
        .filter(|s| s.starts_with(u_sdk::meta::ROOT_SYMBOL_PREFIX));
    match (found.next(), found.next()) {
        (Some(symbol), None) => Ok(symbol.clone()),
        (None, _) => Err(format!(
            "exports no `{}*` root module (not built with u_sdk::export_plugin!)",
            u_sdk::meta::ROOT_SYMBOL_PREFIX
        )),
        (Some(a), Some(b)) => Err(format!("exports two root modules (`{a}`, `{b}`)")),
    }
}

/// One entry's admission: the plugin with the bytes it was judged on, or the refusal.
pub type Verdict = Result<(Admitted, Vec<u8>), String>;

/// Admits every entry of `entries` in order, as `u-runner` loads them: each file read once,
/// names taken by earlier admitted plugins refused later. One verdict per entry.
pub fn admit_all<'e>(
    entries: &'e [PluginEntry],
    trusted: &[PublicKey],
    policy: Policy,
) -> Vec<(&'e PluginEntry, Verdict)> {
    let mut taken = BTreeSet::new();
    entries
        .iter()
        .map(|entry| {
            let result = std::fs::read(&entry.path)
                .map_err(|e| format!("cannot read {}: {e}", entry.path.display()))
                .and_then(|bytes| {
                    let admitted = admit(entry, &bytes, trusted, &taken, policy)?;
                    taken.insert(admitted.verified.manifest.name.clone());
                    Ok((admitted, bytes))
                });
            (entry, result)
        })
        .collect()
}
