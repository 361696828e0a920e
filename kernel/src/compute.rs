//! Which compute backend a model runs on.
//!
//! A deployment names its kernels plugins in order of preference (`[model] kernels`, e.g.
//! `["kernels-wgpu", "kernels-cpu"]`). The first that loaded computes; one that was refused
//! (no GPU adapter, a lost device at start) is passed over with a warning. The next that loaded
//! is the fallback: the architecture runs the ops the first lacks on it (the SDK's
//! `u_sdk::split`), and the host builds the model on it alone when building on the first fails.

use crate::loading::{LoadReport, LoadedPlugin};
use anyhow::{Context, Result};
use u_attest::deployment::Deployment;
use u_sdk::{BackendBox, PluginInstance};

/// The compute backends chosen for a deployment's model.
pub struct Chosen {
    /// The preferred plugin's name.
    pub name: String,
    /// Its backend.
    pub backend: BackendBox,
    /// The next plugin named that loaded: for the ops `backend` lacks, and what the model is
    /// built on instead when building it on `backend` fails (device memory too small).
    pub fallback: Option<(String, BackendBox)>,
}

/// The backend the deployment's model runs on: the first of `[model] kernels` that loaded (a
/// kernels plugin refused at load — its reason already reported — is passed over with a
/// warning), the next one that loaded as the fallback; without `[model] kernels`, the first
/// kernels plugin loaded.
pub fn backend_for(report: &LoadReport, deployment: &Deployment) -> Result<Chosen> {
    let kernels = |p: &&LoadedPlugin| matches!(p.instance, PluginInstance::Kernels(_));
    let mut picked = report
        .loaded
        .iter()
        .filter(kernels)
        .take(1)
        .collect::<Vec<_>>();
    if !deployment.kernels.is_empty() {
        picked.clear();
        for name in &deployment.kernels {
            match report
                .loaded
                .iter()
                .filter(kernels)
                .find(|p| p.verified.manifest.name == *name)
            {
                Some(p) => picked.push(p),
                None => eprintln!("u-runner: kernels {name} passed over: it did not load"),
            }
        }
    }
    let entry = |p: &LoadedPlugin| match &p.instance {
        PluginInstance::Kernels(k) => (p.verified.manifest.name.clone(), k.clone()),
        _ => unreachable!("filtered to kernels plugins"),
    };
    let (name, backend) = entry(
        picked
            .first()
            .context("none of the deployment's kernels plugins loaded")?,
    );
    Ok(Chosen {
        name,
        backend,
        fallback: picked.get(1).map(|p| entry(p)),
    })
}
