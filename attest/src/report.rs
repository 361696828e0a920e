//! The capability proof of a whole deployment: every plugin verified and inspected, its grants
//! checked against its declaration, and what the deployment as a whole can and cannot do.

use crate::{
    admission,
    deployment::{Deployment, Grants, Isolation, Listener, PathGrant, model_grants},
    signing::{check_abi, verify_bytes},
    surface::{SurfaceReport, inspect_bytes},
};
use serde::Serialize;
use std::collections::BTreeMap;
use u_sdk::manifest::Capability;

/// One plugin's part of the proof.
#[derive(Debug, Serialize)]
pub struct PluginProof {
    /// Plugin file.
    pub path: String,
    /// Manifest name (or the deployment's label when unreadable).
    pub name: String,
    /// Kind from the signed manifest (empty when unverified).
    pub kind: String,
    /// The model families an architecture declares it builds (signed).
    pub families: Vec<String>,
    /// The tasks a runner declares it serves (signed).
    pub tasks: Vec<String>,
    /// Signature, trust and ABI check: `None` when it passed, else why not.
    pub verification_error: Option<String>,
    /// Declared beside observed surface, when the file could be inspected.
    pub surface: Option<SurfaceReport>,
    /// What the deployment grants it, restricted to what it requests.
    pub granted: Vec<String>,
    /// Requested capabilities the deployment does not grant.
    pub ungranted: Vec<String>,
    /// Why the host refuses to load it ([`admission::admit`], `u-runner`'s own checks), if it
    /// does.
    pub refusal: Option<String>,
    /// Whether the host would load it and its observed surface stays within its declaration.
    pub accepted: bool,
}

/// The served model's part of the proof: what the host grants so that it can be read.
#[derive(Debug, Serialize)]
pub struct ModelProof {
    /// `[model] path`.
    pub path: String,
    /// The paths granted for reading (the model, or its folder; a tokenizer beside it).
    pub read: Vec<String>,
    /// The accepted loader and tokenizer plugins given that access at start-up.
    pub read_by: Vec<String>,
    /// Whether a declared `fs.read` grant already covers every one of those paths.
    pub declared: bool,
}

/// A plugin that runs in a worker process of its own, and what that process can and cannot do.
#[derive(Debug, Serialize)]
pub struct WorkerProof {
    /// The plugin's manifest name.
    pub plugin: String,
    /// Everything the worker process is granted (its own grants, and the model it reads).
    pub granted: Vec<String>,
    /// What the worker process cannot do, one statement per capability it is not granted.
    pub guarantees: Vec<String>,
}

/// The proof for a deployment.
#[derive(Debug, Serialize)]
pub struct DeploymentProof {
    /// Deployment name.
    pub deployment: String,
    /// Per plugin.
    pub plugins: Vec<PluginProof>,
    /// The served model, when the deployment names one.
    pub model: Option<ModelProof>,
    /// Every address listened on, with its authentication.
    pub listeners: Vec<Listener>,
    /// What an operator must hear about (an unauthenticated listener other machines reach).
    pub warnings: Vec<String>,
    /// Union of effective grants of accepted plugins, per capability.
    pub effective: BTreeMap<String, Vec<String>>,
    /// Statements that hold for the whole deployment.
    pub guarantees: Vec<String>,
    /// Plugins in worker processes of their own: each process is confined to its own grants.
    pub workers: Vec<WorkerProof>,
    /// True when every plugin verifies, stays within its declaration and is granted what it asks.
    pub ok: bool,
}

/// Builds the proof for `deployment`.
pub fn prove(deployment: &Deployment) -> DeploymentProof {
    let trusted = deployment.trusted_keys();
    let mut plugins = Vec::new();
    let mut union = Grants::default();
    let mut readers = Vec::new();
    let mut taken = std::collections::BTreeSet::new();
    let mut workers = Vec::new();
    for entry in &deployment.plugins {
        let path = entry.path.display().to_string();
        let bytes = match std::fs::read(&entry.path) {
            Ok(b) => b,
            Err(e) => {
                plugins.push(PluginProof {
                    path: path.clone(),
                    name: entry.label(),
                    kind: String::new(),
                    families: vec![],
                    tasks: vec![],
                    verification_error: Some(format!("{path}: {e}")),
                    surface: None,
                    granted: vec![],
                    ungranted: vec![],
                    refusal: Some(format!("cannot read {path}: {e}")),
                    accepted: false,
                });
                continue;
            }
        };
        let verified = verify_bytes(&bytes, &trusted)
            .and_then(|v| check_abi(&v, u_sdk::ABI_MAJOR, &u_sdk::ABI_HASH).map(|_| v));
        let surface = inspect_bytes(&bytes).ok();
        let (granted, ungranted, name_error) = match &verified {
            Ok(v) => {
                let eff = entry.grants.restricted_to(&v.manifest);
                let missing: Vec<String> = entry
                    .grants
                    .missing_for(&v.manifest)
                    .iter()
                    .map(|c| c.name().to_string())
                    .collect();
                let name_error = entry
                    .name
                    .as_ref()
                    .filter(|n| **n != v.manifest.name)
                    .map(|n| {
                        format!(
                            "deployment expects plugin `{n}` but the file is `{}`",
                            v.manifest.name
                        )
                    });
                (eff.describe(), missing, name_error)
            }
            Err(_) => (vec![], vec![], None),
        };
        let verification_error = verified
            .as_ref()
            .err()
            .map(|e| e.to_string())
            .or(name_error);
        let refusal = admission::admit(entry, &bytes, &trusted, &taken, admission::Policy::Report)
            .map_or_else(Some, |a| {
                taken.insert(a.verified.manifest.name);
                None
            });
        let accepted = refusal.is_none() && surface.as_ref().is_some_and(|s| s.ok);
        if accepted && let Ok(v) = &verified {
            let mut own = entry.grants.restricted_to(&v.manifest);
            if let Some(model) = &deployment.model
                && matches!(
                    v.manifest.kind,
                    u_sdk::manifest::PluginKind::Loader | u_sdk::manifest::PluginKind::Tokenizer
                )
            {
                readers.push(v.manifest.name.clone());
                let adapters = deployment.model_extras().flat_map(model_grants);
                let read = Grants {
                    fs_read: model_grants(model).into_iter().chain(adapters).collect(),
                    ..Grants::default()
                };
                merge(&mut own, &read);
            }
            merge(&mut union, &own);
            if entry.isolation == Isolation::Worker {
                workers.push(WorkerProof {
                    plugin: v.manifest.name.clone(),
                    granted: own.describe(),
                    guarantees: guarantees(&own),
                });
            }
        }
        plugins.push(PluginProof {
            path,
            name: verified
                .as_ref()
                .map(|v| v.manifest.name.clone())
                .unwrap_or_else(|_| entry.label()),
            kind: verified
                .as_ref()
                .map(|v| v.manifest.kind.name().to_string())
                .unwrap_or_default(),
            families: verified
                .as_ref()
                .map(|v| v.manifest.families.clone())
                .unwrap_or_default(),
            tasks: verified
                .as_ref()
                .map(|v| {
                    v.manifest
                        .tasks
                        .iter()
                        .map(|t| t.name().to_string())
                        .collect()
                })
                .unwrap_or_default(),
            verification_error,
            surface,
            granted,
            ungranted,
            refusal,
            accepted,
        });
    }
    let ok = plugins.iter().all(|p| p.accepted);
    let mut effective = BTreeMap::new();
    for line in union.describe() {
        if let Some((cap, rest)) = line.split_once(": ") {
            let mut values: Vec<String> = rest.split(", ").map(str::to_string).collect();
            values.sort();
            values.dedup();
            effective.insert(cap.to_string(), values);
        }
    }
    let model = deployment.model.as_ref().map(|m| {
        let read = model_grants(m);
        let declared_reads: Vec<&PathGrant> = deployment
            .plugins
            .iter()
            .flat_map(|p| &p.grants.fs_read)
            .collect();
        ModelProof {
            path: m.display().to_string(),
            declared: read
                .iter()
                .all(|g| declared_reads.iter().any(|d| covers(d, g))),
            read: read.iter().map(|g| g.to_string()).collect(),
            read_by: readers,
        }
    });
    DeploymentProof {
        deployment: deployment.name.clone(),
        plugins,
        model,
        listeners: deployment.listeners(),
        warnings: deployment.warnings(),
        effective,
        guarantees: guarantees(&union),
        workers,
        ok,
    }
}

/// Whether grant `outer` gives read access to everything `inner` does.
fn covers(outer: &PathGrant, inner: &PathGrant) -> bool {
    if outer.recursive {
        inner.path.starts_with(&outer.path)
    } else {
        !inner.recursive && inner.path == outer.path
    }
}

/// Adds the grants `g` to `into` (their union; each path or address once).
pub fn merge(into: &mut Grants, g: &Grants) {
    fn add<T: PartialEq + Clone>(into: &mut Vec<T>, from: &[T]) {
        for x in from {
            if !into.contains(x) {
                into.push(x.clone());
            }
        }
    }
    add(&mut into.fs_read, &g.fs_read);
    add(&mut into.fs_write, &g.fs_write);
    add(&mut into.net_listen, &g.net_listen);
    add(&mut into.net_connect, &g.net_connect);
    into.gpu |= g.gpu;
    into.process_fork |= g.process_fork;
}

/// What a deployment whose plugins together hold `union` cannot do, one statement per
/// capability nobody is granted.
pub fn guarantees(union: &Grants) -> Vec<String> {
    let mut out = Vec::new();
    for cap in Capability::ALL {
        if union.grants(cap) {
            continue;
        }
        out.push(
            match cap {
                Capability::NetConnect => "no component can open an outbound network connection: prompts cannot leak over the network (seccomp denies socket() and connect())",
                Capability::NetListen => "no component listens on the network (seccomp denies socket(), bind() and listen())",
                Capability::FsWrite => "no component can create or modify files (Landlock grants no write access)",
                Capability::FsRead => "no component can read files after start-up (Landlock grants no read access beyond the runtime's own needs)",
                Capability::Gpu => "no component is granted a GPU",
                Capability::ProcessFork => "no component can start processes (seccomp denies fork, clone without CLONE_THREAD, and execve)",
            }
            .to_string(),
        );
    }
    out
}

impl DeploymentProof {
    /// Renders the proof for people.
    pub fn render(&self) -> String {
        let mut out = format!("deployment `{}`\n\n", self.deployment);
        for p in &self.plugins {
            let status = if p.accepted { "ACCEPTED" } else { "REFUSED" };
            out.push_str(&format!("[{status}] {} ({})\n", p.name, p.path));
            if !p.families.is_empty() {
                out.push_str(&format!("  builds families: {}\n", p.families.join(", ")));
            }
            if !p.tasks.is_empty() {
                out.push_str(&format!("  serves tasks: {}\n", p.tasks.join(", ")));
            }
            if let Some(e) = &p.verification_error {
                out.push_str(&format!("  verification: {e}\n"));
            } else {
                out.push_str("  verification: signature valid, publisher trusted, ABI matches\n");
            }
            for u in &p.ungranted {
                out.push_str(&format!(
                    "  requests `{u}`, which the deployment does not grant\n"
                ));
            }
            if let Some(r) = &p.refusal {
                out.push_str(&format!("  u-runner refuses it: {r}\n"));
            }
            if !p.granted.is_empty() {
                out.push_str(&format!("  granted: {}\n", p.granted.join("; ")));
            }
            if let Some(s) = &p.surface {
                for line in s.render().lines().skip(1) {
                    out.push_str(line);
                    out.push('\n');
                }
            }
            out.push('\n');
        }
        if let Some(m) = &self.model {
            let readers = if m.read_by.is_empty() {
                "no accepted plugin".to_string()
            } else {
                m.read_by.join(", ")
            };
            let covered = if m.declared {
                "; a declared fs.read covers it too"
            } else {
                "; outside every declared fs.read"
            };
            out.push_str(&format!(
                "model {}: read {} by {readers} (granted at start-up by the host{covered})\n",
                m.path,
                m.read.join(", "),
            ));
        }
        if !self.listeners.is_empty() {
            out.push_str("listeners:\n");
            for l in &self.listeners {
                let auth = match l.auth {
                    crate::deployment::ListenerAuth::Hmac => "HMAC-signed requests",
                    crate::deployment::ListenerAuth::ApiKeys => "API keys",
                    crate::deployment::ListenerAuth::None => "no authentication",
                };
                let reach = if l.public {
                    "other machines"
                } else {
                    "this machine only"
                };
                out.push_str(&format!(
                    "  {} ({}): {auth}, reachable from {reach}\n",
                    l.address, l.plugin
                ));
            }
        }
        out.push_str("effective capabilities of the deployment:\n");
        if self.effective.is_empty() {
            out.push_str("  (none)\n");
        }
        for (cap, v) in &self.effective {
            out.push_str(&format!("  {cap}: {}\n", v.join(", ")));
        }
        out.push_str("guarantees:\n");
        for g in &self.guarantees {
            out.push_str(&format!("  - {g}\n"));
        }
        for w in &self.workers {
            out.push_str(&format!(
                "worker process of {} (its own sandbox; the host's process holds none of its \
                 grants but the model's):\n  granted: {}\n",
                w.plugin,
                if w.granted.is_empty() {
                    "(nothing)".to_string()
                } else {
                    w.granted.join("; ")
                }
            ));
            for g in &w.guarantees {
                out.push_str(&format!("  - {g}\n"));
            }
        }
        for w in &self.warnings {
            out.push_str(&format!("warning: {w}\n"));
        }
        out.push_str(if self.ok {
            "verdict: OK\n"
        } else {
            "verdict: FAIL\n"
        });
        out
    }
}
