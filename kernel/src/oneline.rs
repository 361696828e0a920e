//! The one-line serve form, `u-runner serve --model FILE [--host H] [--port P]
//! [--api-key-file F]`: a deployment built in memory, so serving a model needs no TOML.
//!
//! The plugins are the set `manifests/dev.toml` names, plus `transport-http`, found as
//! `plugins/<name>.so` in the folder above the binary's (`target/` in the build tree, where
//! `cargo xtask build` signs them) and trusted through `dev-keys/dev.pub` there. Each is granted
//! only what its work needs: the loaders and the tokenizer read the model (and a
//! `tokenizer.json` beside it), the KV cache reads and writes `kv-cache/` there (as in
//! dev.toml), and the transport listens on `tcp:HOST:PORT` and reads the API-key file when one
//! is given (else only `/dev/null`).

use crate::wiring;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use u_attest::{
    Deployment, Grants, PluginEntry, PublicKey,
    deployment::{NetAddress, PathGrant, Serving, TrustedKey, absolute},
};

/// What each plugin of the deployment is granted.
enum Needs {
    Nothing,
    Model,
    KvCache,
    Transport,
}

/// The plugins of the one-line deployment, by manifest name, in load order.
const PLUGINS: [(&str, Needs); 11] = [
    ("loader-gguf", Needs::Model),
    ("loader-safetensors", Needs::Model),
    ("loader-onnx", Needs::Model),
    ("tokenizer", Needs::Model),
    ("kernels-cpu", Needs::Nothing),
    ("arch-llama", Needs::Nothing),
    ("arch-bert", Needs::Nothing),
    ("cache-kv", Needs::KvCache),
    ("runner-text", Needs::Nothing),
    ("runner-embeddings", Needs::Nothing),
    ("transport-http", Needs::Transport),
];

/// The deployment that serves `model` over HTTP on `host:port`, with the API keys of
/// `api_keys` (transport-http's `api_keys_file`) when given.
pub fn deployment(
    model: &Path,
    host: &str,
    port: u16,
    api_keys: Option<&Path>,
) -> Result<Deployment> {
    let model = absolute(model);
    anyhow::ensure!(
        model.exists(),
        "the model {} does not exist",
        model.display()
    );
    let exe = std::env::current_exe().context("locating the u-runner binary")?;
    let root = exe
        .parent()
        .and_then(Path::parent)
        .context("the u-runner binary has no folder above its own")?;
    let key_file = root.join("dev-keys/dev.pub");
    let key = PublicKey::read(&key_file)
        .with_context(|| format!("reading the trusted key {}", key_file.display()))?;
    let kv = vec![PathGrant {
        path: root.join("kv-cache"),
        recursive: true,
    }];
    let mut transport_config = toml::Table::new();
    let readable = match api_keys {
        Some(file) => {
            let file = absolute(file);
            anyhow::ensure!(
                file.is_file(),
                "the API key file {} does not exist",
                file.display()
            );
            transport_config.insert("api_keys_file".into(), file.display().to_string().into());
            file
        }
        None => PathBuf::from("/dev/null"),
    };
    let plugins = PLUGINS
        .iter()
        .map(|(name, needs)| {
            let mut grants = Grants::default();
            let mut config = toml::Table::new();
            match needs {
                Needs::Nothing => {}
                Needs::Model => grants.fs_read = wiring::model_grants(&model),
                Needs::KvCache => {
                    grants.fs_read = kv.clone();
                    grants.fs_write = kv.clone();
                }
                Needs::Transport => {
                    grants.net_listen = vec![NetAddress::Tcp {
                        host: host.into(),
                        port,
                    }];
                    grants.fs_read = vec![PathGrant {
                        path: readable.clone(),
                        recursive: false,
                    }];
                    config = transport_config.clone();
                }
            }
            PluginEntry {
                name: Some((*name).into()),
                path: root.join("plugins").join(format!("{name}.so")),
                grants,
                config,
                isolation: Default::default(),
            }
        })
        .collect();
    Ok(Deployment {
        path: exe,
        name: "serve".into(),
        threads: None,
        strict: false,
        trust: vec![TrustedKey {
            name: "u-dev".into(),
            key,
        }],
        plugins,
        model: Some(model),
        architecture: None,
        kernels: Vec::new(),
        serving: Serving::default(),
        adapters: Vec::new(),
        control_vectors: Vec::new(),
        soft_prompts: Vec::new(),
        adapter_dirs: Vec::new(),
        draft_model: None,
    })
}
