//! Opening one model through a deployment, for `u-runner generate`, `tokenize` and `bench`:
//! the model path is granted to the loader and tokenizer plugins for this command, the process
//! is locked down to the union of the grants, and only then are the plugins instantiated and
//! wired — loader → weight set → architecture (with kernels and cache) → model, and the
//! tokenizer from `tokenizer.json` or the weight set's metadata.

use crate::{LoadReport, OpenReport, inspect, instantiate, open_deployment, sandbox};
use abi_stable::std_types::RResult;
use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};
use u_attest::{
    Deployment,
    deployment::{PathGrant, absolute},
};
use u_engine::Generator;
use u_sdk::{
    ArchitectureBox, KernelsBox, KvCacheBox, ModelBox, PluginInstance, TokenizerBox,
    TokenizerFactoryBox, WeightSetBox, manifest::PluginKind,
};

/// What to build from the model.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Only the tokenizer (for `tokenize`).
    Tokenizer,
    /// Model and tokenizer (for `generate`).
    Generator,
    /// The model unwrapped, and the tokenizer (for `bench`, which calls `Model::forward`).
    Model,
}

/// A model opened through the deployment's plugins, inside the sandbox.
pub struct Opened {
    /// The weights as the loader mapped them.
    pub weights: WeightSetBox,
    /// The loader plugin that opened them.
    pub loader: String,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<TokenizerBox>,
    /// The wired generator (for [`Want::Generator`]).
    pub generator: Option<Generator>,
    /// The built model alone (for [`Want::Model`]).
    pub model: Option<ModelBox>,
    /// What the sandbox achieved.
    pub sandbox: sandbox::Status,
}

/// Read grants covering `model`: the directory, or the file and a `tokenizer.json` /
/// `tokenizer_config.json` beside it.
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
        for name in ["tokenizer.json", "tokenizer_config.json"] {
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

/// Grants read access to `model` to the loader and tokenizer plugins of `opened`; returns the
/// grants, which the host's own sandbox plan needs too (it reads the model's first bytes to pick
/// a loader). `model` must be absolute.
pub fn grant_model(opened: &mut OpenReport, model: &Path) -> Vec<PathGrant> {
    let grants = model_grants(model);
    for p in &mut opened.opened {
        if matches!(
            p.verified.manifest.kind,
            PluginKind::Loader | PluginKind::Tokenizer
        ) {
            p.grants.fs_read.extend(grants.iter().cloned());
        }
    }
    grants
}

/// Verifies the deployment, grants `model` to its loaders and tokenizers, locks the process
/// down, instantiates the plugins and opens the model.
pub fn open(deployment: &Deployment, model: &Path, threads: u32, want: Want) -> Result<Opened> {
    let model = absolute(model);
    if !model.exists() {
        bail!("model {} does not exist", model.display());
    }
    let mut opened = open_deployment(deployment);
    let grants = grant_model(&mut opened, &model);
    let mut plan = sandbox::Plan::default();
    for p in &opened.opened {
        plan.add(&p.grants);
    }
    plan.read.extend(grants);
    let status = sandbox::lock_down(&plan);
    let report = instantiate(opened, threads);
    for r in &report.refused {
        eprintln!("u-runner: plugin {} refused: {}", r.plugin, r.reason);
    }
    build(&report, &model, want, status)
}

/// Opens `model` with the loaded plugins of `report` and, for [`Want::Generator`] and
/// [`Want::Model`], wires loader → weight set → architecture (with kernels and cache) → model,
/// with its tokenizer. `status` is what the caller's lock-down achieved.
pub fn build(
    report: &LoadReport,
    model: &Path,
    want: Want,
    status: sandbox::Status,
) -> Result<Opened> {
    let mut archs: Vec<(String, ArchitectureBox)> = Vec::new();
    let mut kernels: Option<KernelsBox> = None;
    let mut cache: Option<KvCacheBox> = None;
    let mut factory: Option<TokenizerFactoryBox> = None;
    for p in &report.loaded {
        let name = p.verified.manifest.name.clone();
        match &p.instance {
            PluginInstance::Architecture(a) => archs.push((name, a.clone())),
            PluginInstance::Kernels(k) if kernels.is_none() => kernels = Some(k.clone()),
            PluginInstance::Cache(c) if cache.is_none() => cache = Some(c.clone()),
            PluginInstance::Tokenizer(t) if factory.is_none() => factory = Some(t.clone()),
            _ => {}
        }
    }

    let (loader, weights) = open_weights(model, &inspect::loaders(report))?;
    let tokenizer = match &factory {
        Some(f) => build_tokenizer(f, model, &weights)?,
        None => None,
    };
    let model_box = if want != Want::Tokenizer {
        let arch = weights.architecture().into_option().map(|a| a.to_string());
        let (arch_name, architecture) = match &arch {
            Some(a) => archs
                .iter()
                .find(|(_, x)| x.families().iter().any(|f| f.as_str() == a)),
            None => archs.first(),
        }
        .ok_or_else(|| {
            anyhow!(
                "no architecture plugin in the deployment builds `{}` (loaded: {})",
                arch.as_deref().unwrap_or("(unnamed architecture)"),
                if archs.is_empty() {
                    "none".to_string()
                } else {
                    archs
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            )
        })?;
        let kernels = kernels.context("the deployment loads no kernels plugin")?;
        let cache = cache.context("the deployment loads no cache plugin")?;
        let model_box = match architecture.build(weights.clone(), kernels, cache) {
            RResult::ROk(m) => m,
            RResult::RErr(e) => bail!("{arch_name}: cannot build the model: {e}"),
        };
        Some(model_box)
    } else {
        None
    };
    let (generator, model_box) = match want {
        Want::Generator => (
            model_box.map(|m| Generator::new(m, tokenizer.clone())),
            None,
        ),
        _ => (None, model_box),
    };
    Ok(Opened {
        weights,
        loader,
        tokenizer,
        generator,
        model: model_box,
        sandbox: status,
    })
}

fn open_weights(
    model: &Path,
    loaders: &[(String, u_sdk::LoaderBox)],
) -> Result<(String, WeightSetBox)> {
    let file = inspect::model_entry_file(model);
    let path = file.display().to_string();
    let head = read_head(&file);
    let (name, loader) = loaders
        .iter()
        .find(|(_, l)| l.can_open(path.as_str().into(), head.as_slice().into()))
        .ok_or_else(|| {
            anyhow!(
                "no loader in the deployment recognises {path} (loaded: {})",
                loaders
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
    match loader.open(path.as_str().into()) {
        RResult::ROk(w) => Ok((name.clone(), w)),
        RResult::RErr(e) => bail!("{name}: {e}"),
    }
}

fn read_head(file: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut head = Vec::new();
    if let Ok(f) = std::fs::File::open(file) {
        let _ = f.take(4096).read_to_end(&mut head);
    }
    head
}

/// A GGUF file's own vocabulary first; otherwise a `tokenizer.json` in (or beside) the model.
fn build_tokenizer(
    factory: &TokenizerFactoryBox,
    model: &Path,
    weights: &WeightSetBox,
) -> Result<Option<TokenizerBox>> {
    let json: PathBuf = if model.is_dir() {
        model.join("tokenizer.json")
    } else {
        model.with_file_name("tokenizer.json")
    };
    let has_vocab = weights
        .metadata("tokenizer.ggml.model".into())
        .into_option()
        .is_some();
    if has_vocab {
        return match factory.build_from_weights(weights.clone()) {
            RResult::ROk(t) => Ok(Some(t)),
            RResult::RErr(e) => bail!("tokenizer from the model's metadata: {e}"),
        };
    }
    if json.is_file() {
        return match factory.build_from_file(json.display().to_string().as_str().into()) {
            RResult::ROk(t) => Ok(Some(t)),
            RResult::RErr(e) => bail!("tokenizer {}: {e}", json.display()),
        };
    }
    Ok(None)
}
