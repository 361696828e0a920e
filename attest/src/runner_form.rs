//! The Safebox runner form, `u-runner <model> <socket>`: the default deployment, serving
//! `model` on one Unix socket (mode 0600) through its `transport-http` plugin.
//!
//! The deployment is the one `u-runner generate` uses (`$U_DEPLOYMENT`, else the build tree's
//! `manifests/dev.toml`, else `/etc/u/deployment.toml`). Its transport-http entry (or, when it
//! has none, `transport-http.so` beside its other plugins, verified like them) is granted
//! exactly `net.listen = ["unix:<socket>"]`, and `fs.read` on the secret file when one is given,
//! which turns on HMAC authentication of every request. Without a secret the transport's
//! `fs.read` grant is the socket path itself: nothing readable. The model answers to any name
//! (Safebox clients send names like `local/nemotron-nano`).
//!
//! It lives here, beside the deployment, so that `u-attest inspect --runner-form` proves the
//! very deployment `u-runner` serves in this form.

use crate::{
    Deployment,
    deployment::{NetAddress, PathGrant, PluginEntry, absolute},
};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// The file name of the transport plugin the runner form serves with.
const TRANSPORT: &str = "transport-http.so";

/// `base` adjusted to serve `model` on `socket`, authenticated with `secret` when given.
pub fn deployment(
    mut base: Deployment,
    model: &Path,
    socket: &Path,
    secret: Option<&Path>,
) -> Result<Deployment> {
    anyhow::ensure!(
        model.exists(),
        "the model {} does not exist",
        model.display()
    );
    let socket = absolute(socket);
    base.model = Some(absolute(model));
    // Safebox clients name models their own way (`local/nemotron-nano`): any name is served.
    base.serving.aliases = vec![u_sdk::ANY_MODEL.to_string()];
    let is_transport = |p: &PluginEntry| {
        p.name.as_deref() == Some("transport-http")
            || p.path.file_name().is_some_and(|n| n == TRANSPORT)
    };
    if !base.plugins.iter().any(is_transport) {
        let dir = base
            .plugins
            .first()
            .and_then(|p| p.path.parent())
            .map(Path::to_path_buf)
            .context("the default deployment lists no plugins to find transport-http beside")?;
        base.plugins.push(PluginEntry {
            name: Some("transport-http".into()),
            path: dir.join(TRANSPORT),
            grants: Default::default(),
            config: Default::default(),
            isolation: Default::default(),
        });
    }
    let entry = base
        .plugins
        .iter_mut()
        .find(|p| is_transport(p))
        .context("transport-http entry")?;
    entry.grants.net_listen = vec![NetAddress::Unix(socket.clone())];
    let readable: PathBuf = match secret {
        Some(secret) => {
            let secret = absolute(secret);
            anyhow::ensure!(
                secret.is_file(),
                "the secret file {} does not exist",
                secret.display()
            );
            entry.config.insert(
                "hmac_secret_file".into(),
                secret.display().to_string().into(),
            );
            secret
        }
        None => socket,
    };
    entry.grants.fs_read = vec![PathGrant {
        path: readable,
        recursive: false,
    }];
    Ok(base)
}
