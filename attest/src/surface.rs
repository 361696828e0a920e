//! The observed capability surface of a component, compared with its declaration.
//!
//! Two observations: the dynamic symbols a component imports (`socket`, `connect`, `fork`,
//! `execve`, `open`…), each mapped to the capability it needs, and the raw system-call
//! instructions in its executable sections, found by decoding the code instruction by
//! instruction ([`syscalls`]: x86-64 lengths checked against iced-x86's; on aarch64 every
//! `svc` word). Raw system calls bypass the import surface
//! entirely, so any is a failure.
//!
//! This is a strong lint, not a proof: `dlsym("socket")` or libc's generic `syscall()` evade
//! import scanning, so those escape hatches are reported as *indirect*. Likewise every Rust
//! cdylib imports a few read-only file functions for std's panic backtraces (it reads its own
//! executable): that [`STD_FS_BASELINE`] is reported as *baseline* rather than as a use of
//! `fs.read`; any other file function still needs a declaration. The guarantee comes from the
//! runtime layers (host services that check grants, Landlock and seccomp).

use crate::{
    elf::{self, ElfError, Machine},
    syscalls,
};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use u_sdk::{
    manifest::{Capability, ManifestError, PluginManifest},
    meta::{MetaError, MetaRecord},
};

/// Read-only file functions that std links into every Rust cdylib (panic backtraces read the
/// executable): present without any intent to read files, so they need no `fs.read`.
pub const STD_FS_BASELINE: [&str; 5] = ["open64", "readlink", "realpath", "stat64", "statx"];

/// What an imported symbol needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// Exactly this capability.
    One(Capability),
    /// A socket: either network capability justifies it.
    Socket,
    /// An escape hatch that import scanning cannot see through.
    Indirect,
}

/// Maps an imported symbol to what it needs, or `None` for symbols that grant nothing.
fn need_of(symbol: &str) -> Option<Need> {
    use Capability::*;
    let need = match symbol {
        "connect" => Need::One(NetConnect),
        "bind" | "listen" | "accept" | "accept4" => Need::One(NetListen),
        "socket" => Need::Socket,
        // A connected pair without an address reaches nothing outside the process, only
        // a child it forks: it needs what forking needs.
        "socketpair" | "fork" | "vfork" | "clone" | "clone3" | "posix_spawn" | "posix_spawnp"
        | "execve" | "execveat" | "fexecve" | "execv" | "execvp" | "execvpe" | "execl"
        | "execlp" | "execle" | "system" | "popen" | "daemon" | "pidfd_spawn" | "pidfd_spawnp" => {
            Need::One(ProcessFork)
        }
        "open" | "open64" | "openat" | "openat64" | "__open_2" | "__open64_2" | "fopen"
        | "fopen64" | "opendir" | "fdopendir" | "statx" | "stat" | "stat64" | "lstat"
        | "lstat64" | "readlink" | "realpath" => Need::One(FsRead),
        "creat" | "creat64" | "mkdir" | "mkdirat" | "rename" | "renameat" | "renameat2"
        | "unlink" | "unlinkat" | "rmdir" | "truncate" | "truncate64" | "link" | "linkat"
        | "symlink" | "symlinkat" | "chmod" | "fchmodat" | "chown" | "lchown" | "fchownat"
        | "mkfifo" | "mknod" => Need::One(FsWrite),
        "syscall" | "dlsym" | "dlvsym" | "dlopen" | "dlmopen" => Need::Indirect,
        _ => return None,
    };
    Some(need)
}

/// Why a component could not be inspected.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// Not a well-formed component.
    #[error(transparent)]
    Elf(#[from] ElfError),
    /// Malformed `.u.meta`.
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// Invalid manifest.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

/// The raw observations.
#[derive(Debug, Clone, Serialize)]
pub struct Surface {
    /// Target CPU.
    pub machine: Machine,
    /// Imported symbols that bear on capabilities, with what they need.
    pub relevant_imports: BTreeMap<String, String>,
    /// Escape-hatch imports (`syscall`, `dlsym`…).
    pub indirect: Vec<String>,
    /// std's read-only file imports present in an undeclared component ([`STD_FS_BASELINE`]).
    pub baseline: Vec<String>,
    /// Raw system-call instructions in executable sections.
    pub raw_syscalls: usize,
    /// Total imported symbols.
    pub import_count: usize,
}

/// Declared capabilities beside observed ones, with a verdict.
#[derive(Debug, Clone, Serialize)]
pub struct SurfaceReport {
    /// Component name from its manifest.
    pub name: String,
    /// Component kind.
    pub kind: String,
    /// Version.
    pub version: String,
    /// Whether `.u.meta` is signed (not whether the signature is trusted; see `verify`).
    pub signed: bool,
    /// Capabilities the manifest declares.
    pub declared: Vec<String>,
    /// Capabilities the import surface shows, each with its evidence.
    pub observed: BTreeMap<String, Vec<String>>,
    /// The raw observations.
    pub surface: Surface,
    /// Every way the observation exceeds the declaration.
    pub violations: Vec<String>,
    /// True when nothing observed exceeds what is declared.
    pub ok: bool,
}

/// What a component's imports reach, against what `manifest` declares.
#[derive(Debug, Default)]
pub struct Imports {
    /// Imports that need a capability, each with the capability's name.
    pub relevant: BTreeMap<String, String>,
    /// Per capability (or `net.*` for sockets), the imports that use it.
    pub observed: BTreeMap<String, Vec<String>>,
    /// Escape hatches import scanning cannot see through.
    pub indirect: Vec<String>,
    /// std's read-only file functions ([`STD_FS_BASELINE`]) where `fs.read` is not declared.
    pub baseline: Vec<String>,
    /// Each import beyond the declaration, said as a sentence naming it and what it needs.
    pub violations: Vec<String>,
}

/// Maps every import of `imports` to what it needs and compares that with `manifest`. The host
/// runs this on every plugin it loads (`u-runner serve --strict` refuses one with violations).
pub fn observe_imports(imports: &BTreeSet<String>, manifest: &PluginManifest) -> Imports {
    let mut out = Imports::default();
    for symbol in imports {
        let Some(need) = need_of(symbol) else {
            continue;
        };
        match need {
            Need::One(Capability::FsRead)
                if !manifest.requests(Capability::FsRead)
                    && STD_FS_BASELINE.contains(&symbol.as_str()) =>
            {
                out.baseline.push(symbol.clone());
            }
            Need::One(cap) => {
                out.relevant.insert(symbol.clone(), cap.name().to_string());
                out.observed
                    .entry(cap.name().into())
                    .or_default()
                    .push(symbol.clone());
                if !manifest.requests(cap) {
                    out.violations.push(format!(
                        "imports `{symbol}`, which needs `{cap}`, but the manifest does not declare it"
                    ));
                }
            }
            Need::Socket => {
                out.relevant
                    .insert(symbol.clone(), "net.listen|net.connect".into());
                out.observed
                    .entry("net.*".into())
                    .or_default()
                    .push(symbol.clone());
                if !manifest.requests(Capability::NetListen)
                    && !manifest.requests(Capability::NetConnect)
                {
                    out.violations.push(format!(
                        "imports `{symbol}`, which needs `net.listen` or `net.connect`, but the manifest declares neither"
                    ));
                }
            }
            Need::Indirect => out.indirect.push(symbol.clone()),
        }
    }
    out
}

/// Inspects the component in `bytes`.
pub fn inspect_bytes(bytes: &[u8]) -> Result<SurfaceReport, InspectError> {
    let facts = elf::analyse(bytes)?;
    let record = MetaRecord::parse(&bytes[facts.meta.clone()])?;
    let manifest = PluginManifest::parse(&record.manifest)?;
    let Imports {
        relevant,
        observed,
        indirect,
        baseline,
        mut violations,
    } = observe_imports(&facts.imports, &manifest);
    let raw_syscalls = count_raw_syscalls(bytes, &facts);
    if raw_syscalls > 0 {
        violations.push(format!(
            "contains {raw_syscalls} raw system-call instruction(s), which bypass every declared capability"
        ));
    }
    Ok(SurfaceReport {
        name: manifest.name.clone(),
        kind: manifest.kind.name().into(),
        version: manifest.version.clone(),
        signed: record.is_signed(),
        declared: manifest
            .capabilities
            .iter()
            .map(|c| c.name().to_string())
            .chain(manifest.optional.iter().map(|c| format!("{c} (optional)")))
            .collect(),
        observed,
        surface: Surface {
            machine: facts.machine,
            relevant_imports: relevant,
            indirect,
            baseline,
            raw_syscalls,
            import_count: facts.imports.len(),
        },
        ok: violations.is_empty(),
        violations,
    })
}

/// Counts system-call instructions in every executable section ([`syscalls`]).
pub fn count_raw_syscalls(bytes: &[u8], facts: &elf::ElfFacts) -> usize {
    facts
        .code
        .iter()
        .map(|(_, range)| {
            let code = &bytes[range.clone()];
            match facts.machine {
                Machine::X86_64 => syscalls::count_x86_64(code),
                Machine::Aarch64 => syscalls::count_aarch64(code),
            }
        })
        .sum()
}

impl SurfaceReport {
    /// Renders the report for people.
    pub fn render(&self) -> String {
        let mut out = format!(
            "{} {} ({}){}\n  declared: {}\n",
            self.name,
            self.version,
            self.kind,
            if self.signed { "" } else { " [unsigned]" },
            if self.declared.is_empty() {
                "(none)".into()
            } else {
                self.declared.join(", ")
            }
        );
        if self.observed.is_empty() {
            out.push_str("  observed: (no capability-bearing imports)\n");
        } else {
            out.push_str("  observed:\n");
            for (cap, evidence) in &self.observed {
                out.push_str(&format!("    {cap:<12} via {}\n", evidence.join(", ")));
            }
        }
        if !self.surface.indirect.is_empty() {
            out.push_str(&format!(
                "  indirect:  {} (not provable by import scanning; enforced at run time)\n",
                self.surface.indirect.join(", ")
            ));
        }
        if !self.surface.baseline.is_empty() {
            out.push_str(&format!(
                "  baseline:  {} (std's panic backtraces; not file access by intent; confined by Landlock)\n",
                self.surface.baseline.join(", ")
            ));
        }
        out.push_str(&format!(
            "  raw syscall instructions: {}\n",
            self.surface.raw_syscalls
        ));
        let names: BTreeSet<_> = self.violations.iter().collect();
        if names.is_empty() {
            out.push_str("  verdict: OK — observed surface within declaration\n");
        } else {
            out.push_str("  verdict: FAIL\n");
            for v in names {
                out.push_str(&format!("    - {v}\n"));
            }
        }
        out
    }
}
