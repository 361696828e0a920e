//! Plugin manifests: who a plugin is and which capabilities it asks for.
//!
//! The manifest source is a small TOML file next to the plugin's `Cargo.toml`:
//!
//! ```toml
//! name = "loader-gguf"
//! version = "0.1.0"
//! kind = "loader"
//! description = "GGUF v2/v3 weights, kept compressed in a memory map"
//! capabilities = ["fs.read"]
//! ```
//!
//! [`export_plugin!`](crate::export_plugin) embeds it in the plugin's `.u.meta` section, where
//! `u-attest sign` covers it with the publisher's signature.

use serde::Deserialize;
use std::{collections::BTreeSet, fmt};

/// A typed permission from a closed set. Grants in a deployment manifest use the same names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    /// Read files under granted paths.
    FsRead,
    /// Create and write files under granted paths.
    FsWrite,
    /// Accept connections on granted addresses.
    NetListen,
    /// Open outbound connections to granted addresses.
    NetConnect,
    /// Use a GPU device.
    Gpu,
    /// Create processes (fork, exec).
    ProcessFork,
}

impl Capability {
    /// Every capability.
    pub const ALL: [Capability; 6] = [
        Capability::FsRead,
        Capability::FsWrite,
        Capability::NetListen,
        Capability::NetConnect,
        Capability::Gpu,
        Capability::ProcessFork,
    ];

    /// The dotted name used in manifests (`"fs.read"`).
    pub const fn name(self) -> &'static str {
        match self {
            Capability::FsRead => "fs.read",
            Capability::FsWrite => "fs.write",
            Capability::NetListen => "net.listen",
            Capability::NetConnect => "net.connect",
            Capability::Gpu => "gpu",
            Capability::ProcessFork => "process.fork",
        }
    }

    /// Parses a dotted name.
    pub fn from_name(name: &str) -> Option<Capability> {
        Capability::ALL.into_iter().find(|c| c.name() == name)
    }

    /// All names, comma-separated, for error messages.
    pub fn known_names() -> String {
        Capability::ALL.map(Capability::name).join(", ")
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The kinds of component, matching the interfaces in [`crate::abi`]; `host` is `u-runner`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PluginKind {
    /// The `u-runner` binary itself.
    Host,
    /// Turns model files into weight sets.
    Loader,
    /// Compute kernels.
    Kernels,
    /// A model architecture.
    Architecture,
    /// Tokenizers.
    Tokenizer,
    /// KV cache.
    Cache,
    /// Client-facing protocols.
    Transport,
    /// Task runners (text generation, embeddings): scheduling, sampling, templates.
    Runner,
}

impl PluginKind {
    /// Every kind.
    pub const ALL: [PluginKind; 8] = [
        PluginKind::Host,
        PluginKind::Loader,
        PluginKind::Kernels,
        PluginKind::Architecture,
        PluginKind::Tokenizer,
        PluginKind::Cache,
        PluginKind::Transport,
        PluginKind::Runner,
    ];

    /// The name used in manifests.
    pub const fn name(self) -> &'static str {
        match self {
            PluginKind::Host => "host",
            PluginKind::Loader => "loader",
            PluginKind::Kernels => "kernels",
            PluginKind::Architecture => "architecture",
            PluginKind::Tokenizer => "tokenizer",
            PluginKind::Cache => "cache",
            PluginKind::Transport => "transport",
            PluginKind::Runner => "runner",
        }
    }

    /// Parses a kind name.
    pub fn from_name(name: &str) -> Option<PluginKind> {
        PluginKind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// What a runner plugin does with a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Task {
    /// Completions and chat from a decoder.
    TextGeneration,
    /// Sentence embeddings (from an encoder, or pooled from a decoder).
    Embeddings,
    /// Speech to text.
    Transcription,
    /// Images from text or images.
    ImageGeneration,
}

impl Task {
    /// Every task.
    pub const ALL: [Task; 4] = [
        Task::TextGeneration,
        Task::Embeddings,
        Task::Transcription,
        Task::ImageGeneration,
    ];

    /// The name used in manifests.
    pub const fn name(self) -> &'static str {
        match self {
            Task::TextGeneration => "text-generation",
            Task::Embeddings => "embeddings",
            Task::Transcription => "transcription",
            Task::ImageGeneration => "image-generation",
        }
    }

    /// Parses a task name.
    pub fn from_name(name: &str) -> Option<Task> {
        Task::ALL.into_iter().find(|t| t.name() == name)
    }
}

impl fmt::Display for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a manifest source was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// Not valid TOML, or a field of the wrong type.
    #[error("plugin manifest is not valid TOML: {0}")]
    Syntax(String),
    /// A required field is absent.
    #[error("plugin manifest lacks the required field `{0}`")]
    MissingField(&'static str),
    /// A capability outside the closed set.
    #[error("plugin manifest requests unknown capability `{name}` (known: {known})")]
    UnknownCapability {
        /// The name found.
        name: String,
        /// The known names.
        known: String,
    },
    /// A kind outside the known kinds.
    #[error(
        "plugin manifest has unknown kind `{0}` (known: host, loader, kernels, architecture, tokenizer, cache, transport, runner)"
    )]
    UnknownKind(String),
    /// A field whose value is not allowed.
    #[error("plugin manifest field `{field}` is invalid: {reason}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

/// A parsed, validated plugin manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginManifest {
    /// Unique plugin name: lowercase letters, digits and `-`.
    pub name: String,
    /// Version, `MAJOR.MINOR.PATCH`.
    pub version: String,
    /// Which interface the plugin implements.
    pub kind: PluginKind,
    /// One line on what it does.
    pub description: String,
    /// Capabilities requested: a deployment that does not grant them all cannot load it.
    pub capabilities: BTreeSet<Capability>,
    /// Capabilities a feature of the plugin uses only when the deployment grants them (e.g. a
    /// runner's fork isolation, `process.fork`); loading needs none of them.
    pub optional: BTreeSet<Capability>,
    /// The model families an architecture builds (GGUF `general.architecture` names, HF
    /// `model_type`s); empty for other kinds.
    pub families: Vec<String>,
    /// The tasks a runner serves; empty for other kinds.
    pub tasks: Vec<Task>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    name: Option<String>,
    version: Option<String>,
    kind: Option<String>,
    description: Option<String>,
    capabilities: Option<Vec<String>>,
    optional_capabilities: Option<Vec<String>>,
    families: Option<Vec<String>>,
    tasks: Option<Vec<String>>,
}

impl PluginManifest {
    /// Parses and validates a manifest source.
    pub fn parse(text: &str) -> Result<Self, ManifestError> {
        let raw: RawManifest =
            toml::from_str(text).map_err(|e| ManifestError::Syntax(e.message().to_string()))?;
        let name = raw.name.ok_or(ManifestError::MissingField("name"))?;
        let version = raw.version.ok_or(ManifestError::MissingField("version"))?;
        let kind_name = raw.kind.ok_or(ManifestError::MissingField("kind"))?;
        let capabilities = raw
            .capabilities
            .ok_or(ManifestError::MissingField("capabilities"))?;

        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(ManifestError::Invalid {
                field: "name",
                reason: format!("`{name}` must be 1–64 of a-z, 0-9 and -"),
            });
        }
        let parts: Vec<&str> = version.split('.').collect();
        if parts.len() != 3 || parts.iter().any(|p| p.parse::<u32>().is_err()) {
            return Err(ManifestError::Invalid {
                field: "version",
                reason: format!("`{version}` is not MAJOR.MINOR.PATCH"),
            });
        }
        let kind =
            PluginKind::from_name(&kind_name).ok_or(ManifestError::UnknownKind(kind_name))?;
        let mut caps = BTreeSet::new();
        let mut optional = BTreeSet::new();
        let listed = capabilities.iter().map(|c| (c, false));
        let optional_listed = raw
            .optional_capabilities
            .iter()
            .flatten()
            .map(|c| (c, true));
        for (cap, is_optional) in listed.chain(optional_listed) {
            let c = Capability::from_name(cap).ok_or_else(|| ManifestError::UnknownCapability {
                name: cap.clone(),
                known: Capability::known_names(),
            })?;
            if caps.contains(&c)
                || !(if is_optional {
                    &mut optional
                } else {
                    &mut caps
                })
                .insert(c)
            {
                return Err(ManifestError::Invalid {
                    field: "capabilities",
                    reason: format!("`{cap}` is listed twice"),
                });
            }
        }
        let families = raw.families.unwrap_or_default();
        match (kind, families.is_empty()) {
            (PluginKind::Architecture, true) => {
                return Err(ManifestError::MissingField("families"));
            }
            (PluginKind::Architecture, false) => {}
            (_, false) => {
                return Err(ManifestError::Invalid {
                    field: "families",
                    reason: format!("only an architecture declares families, not a {kind}"),
                });
            }
            (_, true) => {}
        }
        if let Some(f) = families.iter().find(|f| {
            f.is_empty()
                || f.len() > 64
                || !f
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        }) {
            return Err(ManifestError::Invalid {
                field: "families",
                reason: format!("`{f}` must be 1–64 of A-Z, a-z, 0-9, _, - and ."),
            });
        }
        let tasks = raw
            .tasks
            .unwrap_or_default()
            .iter()
            .map(|t| {
                Task::from_name(t).ok_or_else(|| ManifestError::Invalid {
                    field: "tasks",
                    reason: format!(
                        "unknown task `{t}` (known: {})",
                        Task::ALL.map(Task::name).join(", ")
                    ),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        match (kind, tasks.is_empty()) {
            (PluginKind::Runner, true) => return Err(ManifestError::MissingField("tasks")),
            (PluginKind::Runner, false) | (_, true) => {}
            (_, false) => {
                return Err(ManifestError::Invalid {
                    field: "tasks",
                    reason: format!("only a runner declares tasks, not a {kind}"),
                });
            }
        }
        Ok(PluginManifest {
            name,
            version,
            kind,
            description: raw.description.unwrap_or_default(),
            capabilities: caps,
            optional,
            families,
            tasks,
        })
    }

    /// Whether the manifest requests `cap`, required or optional.
    pub fn requests(&self, cap: Capability) -> bool {
        self.capabilities.contains(&cap) || self.optional.contains(&cap)
    }

    /// Whether an architecture declares `family`.
    pub fn builds(&self, family: &str) -> bool {
        self.families.iter().any(|f| f == family)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "loader-gguf"
version = "0.1.0"
kind = "loader"
description = "GGUF"
capabilities = ["fs.read"]
"#;

    #[test]
    fn parses_a_valid_manifest() {
        let m = PluginManifest::parse(GOOD).unwrap();
        assert_eq!(m.name, "loader-gguf");
        assert_eq!(m.kind, PluginKind::Loader);
        assert!(m.requests(Capability::FsRead));
        assert!(!m.requests(Capability::NetConnect));
    }

    /// An optional capability is requested (a grant of it takes effect) but not required; it
    /// may not also be required, nor listed twice.
    #[test]
    fn optional_capabilities_are_requested_not_required() {
        let m = PluginManifest::parse(&format!(
            "{GOOD}optional_capabilities = [\"process.fork\"]\n"
        ))
        .unwrap();
        assert!(m.requests(Capability::ProcessFork));
        assert!(!m.capabilities.contains(&Capability::ProcessFork));
        for bad in ["[\"fs.read\"]", "[\"process.fork\", \"process.fork\"]"] {
            let e = PluginManifest::parse(&format!("{GOOD}optional_capabilities = {bad}\n"))
                .unwrap_err();
            assert!(e.to_string().contains("listed twice"), "{e}");
        }
    }

    #[test]
    fn each_defect_gets_its_own_error() {
        let missing = GOOD.replace("kind = \"loader\"\n", "");
        assert_eq!(
            PluginManifest::parse(&missing),
            Err(ManifestError::MissingField("kind"))
        );
        let unknown = GOOD.replace("fs.read", "net.raw");
        let err = PluginManifest::parse(&unknown).unwrap_err();
        assert!(
            err.to_string().contains("unknown capability `net.raw`"),
            "{err}"
        );
        let bad_kind = GOOD.replace("\"loader\"", "\"miner\"");
        assert_eq!(
            PluginManifest::parse(&bad_kind),
            Err(ManifestError::UnknownKind("miner".into()))
        );
        let syntax = PluginManifest::parse("name = \"x").unwrap_err();
        assert!(matches!(syntax, ManifestError::Syntax(_)), "{syntax}");
        let extra = format!("{GOOD}\nsecret_backdoor = true\n");
        assert!(matches!(
            PluginManifest::parse(&extra),
            Err(ManifestError::Syntax(_))
        ));
        let version = GOOD.replace("0.1.0", "one");
        assert!(matches!(
            PluginManifest::parse(&version),
            Err(ManifestError::Invalid {
                field: "version",
                ..
            })
        ));
        let arch = GOOD.replace("\"loader\"", "\"architecture\"");
        assert_eq!(
            PluginManifest::parse(&arch),
            Err(ManifestError::MissingField("families"))
        );
        let arch = format!("{arch}families = [\"llama\", \"qwen2_moe\"]\n");
        assert!(PluginManifest::parse(&arch).unwrap().builds("qwen2_moe"));
        let loader_families = format!("{GOOD}families = [\"llama\"]\n");
        assert!(matches!(
            PluginManifest::parse(&loader_families),
            Err(ManifestError::Invalid {
                field: "families",
                ..
            })
        ));
        let runner = GOOD.replace("\"loader\"", "\"runner\"");
        assert_eq!(
            PluginManifest::parse(&runner),
            Err(ManifestError::MissingField("tasks"))
        );
        let runner = format!("{runner}tasks = [\"embeddings\"]\n");
        assert_eq!(
            PluginManifest::parse(&runner).unwrap().tasks,
            vec![Task::Embeddings]
        );
        let bad_task = runner.replace("embeddings", "mining");
        assert!(
            PluginManifest::parse(&bad_task)
                .unwrap_err()
                .to_string()
                .contains("unknown task `mining`")
        );
        let dup = GOOD.replace("[\"fs.read\"]", "[\"fs.read\", \"fs.read\"]");
        assert!(matches!(
            PluginManifest::parse(&dup),
            Err(ManifestError::Invalid {
                field: "capabilities",
                ..
            })
        ));
    }
}
