//! A pipeline's single-file checkpoint (Stable Diffusion's original layout: one `.safetensors`
//! holding the UNet, the autoencoder and the text encoder), seen as its components.
//!
//! As diffusers' `from_single_file(checkpoint, config=folder)` reads one, the checkpoint comes
//! with a diffusers folder that holds the configuration: `model_index.json`, `scheduler/`,
//! `tokenizer/`, and component folders with only their `config.json`. U reads the checkpoint
//! placed in that folder, beside `model_index.json`. Each component folder without weights of
//! its own is the checkpoint, with that folder's `config.json` as its metadata; the checkpoint's
//! tensors keep their stored names, and the architecture that builds the component finds its
//! own among them. A component folder that holds weights (a replacement autoencoder) is read
//! as it is.

use crate::{inspect, wiring};
use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{ROption, RResult, RStr, RString, RVec},
};
use anyhow::{Context, Result, bail};
use std::{path::Path, sync::Arc};
use u_sdk::{LoaderBox, MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

/// The checkpoint as one component: its tensors, the component's configuration as metadata.
#[derive(Clone)]
struct Component {
    checkpoint: WeightSetBox,
    metadata: Arc<Vec<(String, MetaValue)>>,
    architecture: Option<String>,
}

impl WeightSet for Component {
    fn format(&self) -> RResult<RString, UError> {
        self.checkpoint.format()
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        RResult::ROk(self.architecture.as_deref().map(RString::from).into())
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        RResult::ROk(
            self.metadata
                .iter()
                .map(|(k, _)| k.as_str().into())
                .collect(),
        )
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        let value = self.metadata.iter().find(|(k, _)| k == key.as_str());
        RResult::ROk(value.map(|(_, v)| v.clone()).into())
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        self.checkpoint.tensors()
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        self.checkpoint.tensor(name)
    }
}

/// A pipeline folder's components, opened from their own folders or its single-file checkpoint.
pub struct Components<'a> {
    dir: &'a Path,
    loaders: &'a [(String, LoaderBox)],
    checkpoint: Option<(String, WeightSetBox)>,
}

impl<'a> Components<'a> {
    /// The components of the pipeline folder `dir`, opened with `loaders`.
    pub fn new(dir: &'a Path, loaders: &'a [(String, LoaderBox)]) -> Self {
        Self {
            dir,
            loaders,
            checkpoint: None,
        }
    }

    /// The weights of `component` and the loader that opened them: its folder's own, or the
    /// checkpoint's (opened once) with the folder's `config.json` as metadata.
    pub fn open(&mut self, component: &str) -> Result<(String, WeightSetBox)> {
        let folder = self.dir.join(component);
        if inspect::model_entry_file(&folder) != folder {
            return wiring::open_weights(&folder, self.loaders);
        }
        let (loader, checkpoint) = match &self.checkpoint {
            Some(opened) => opened.clone(),
            None => {
                let opened = wiring::open_weights(&self.checkpoint_file(component)?, self.loaders)?;
                self.checkpoint.insert(opened).clone()
            }
        };
        let path = folder.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let metadata = u_sdk::weights::config_metadata(&config)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let architecture = ["config.model_type", "config._class_name"]
            .iter()
            .find_map(|key| metadata.iter().find(|(k, _)| k == key))
            .and_then(|(_, v)| v.as_str().map(str::to_string));
        let part = Component {
            checkpoint,
            metadata: Arc::new(metadata),
            architecture,
        };
        Ok((loader, WeightSetBox::from_value(part, TD_Opaque)))
    }

    /// The one `.safetensors` file beside `model_index.json`.
    fn checkpoint_file(&self, component: &str) -> Result<std::path::PathBuf> {
        let files: Vec<_> = std::fs::read_dir(self.dir)
            .with_context(|| format!("reading {}", self.dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        match files.as_slice() {
            [one] => Ok(one.clone()),
            found => bail!(
                "{}: `{component}/` holds no weights, and the folder holds {} single-file \
                 checkpoints (`.safetensors` files beside `model_index.json`) where it would \
                 need exactly one to read the component from",
                self.dir.display(),
                found.len()
            ),
        }
    }
}
