//! `u-runner inspect`: what a model file holds, read through the deployment's loader plugins.
//!
//! The file is opened by whichever verified loader recognises it, through the same host services
//! and grants as when serving, so inspecting a file proves the loader can read it in production.

use abi_stable::std_types::{ROption, RResult};
use serde::Serialize;
use serde_json::{Value, json};
use std::{
    io::Read,
    path::{Path, PathBuf},
};
use u_sdk::{LoaderBox, MetaValue, PluginInstance};

/// Arrays longer than this are summarised (length and first elements) in the report.
const ARRAY_PREVIEW: usize = 8;

/// One tensor's row in the report.
#[derive(Debug, Serialize)]
pub struct TensorRow {
    /// Canonical name.
    pub name: String,
    /// Stored dtype.
    pub dtype: String,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Stored bytes.
    pub bytes: u64,
}

/// What `inspect` reports about a model file.
#[derive(Debug, Serialize)]
pub struct ModelReport {
    /// The file or directory inspected.
    pub path: String,
    /// The format, as the loader names it.
    pub format: String,
    /// The loader plugin that opened it.
    pub loader: String,
    /// The architecture family, if the file names one.
    pub architecture: Option<String>,
    /// Hyper-parameters: the `<architecture>.*` metadata keys.
    pub hyper_parameters: serde_json::Map<String, Value>,
    /// All metadata (long arrays summarised).
    pub metadata: serde_json::Map<String, Value>,
    /// Every tensor.
    pub tensors: Vec<TensorRow>,
    /// Sum of tensor bytes.
    pub total_bytes: u64,
}

/// For a model directory, the file that stands for the model (a sharded index, a single
/// safetensors file, an ONNX graph, or its only GGUF file); any other path is returned as is.
pub fn model_entry_file(model: &Path) -> PathBuf {
    if !model.is_dir() {
        return model.to_path_buf();
    }
    for name in [
        "model.safetensors.index.json",
        "model.safetensors",
        "diffusion_pytorch_model.safetensors",
        "model.onnx",
    ] {
        if model.join(name).is_file() {
            return model.join(name);
        }
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(model)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => one.clone(),
        _ => model.to_path_buf(),
    }
}

/// Opens `model` with the first loader that recognises it and describes it.
pub fn inspect(model: &Path, loaders: &[(String, LoaderBox)]) -> Result<ModelReport, String> {
    let model = &model_entry_file(model);
    let path = model.display().to_string();
    let head = read_head(model);
    let (loader_name, loader) = loaders
        .iter()
        .find(|(_, l)| {
            l.can_open(path.as_str().into(), head.as_slice().into())
                .into_result()
                .unwrap_or(false)
        })
        .ok_or_else(|| {
            let names: Vec<&str> = loaders.iter().map(|(n, _)| n.as_str()).collect();
            format!(
                "no loader in the deployment recognises {path} (tried: {})",
                if names.is_empty() {
                    "none loaded".into()
                } else {
                    names.join(", ")
                }
            )
        })?;
    let weights = match loader.open(path.as_str().into()) {
        RResult::ROk(w) => w,
        RResult::RErr(e) => return Err(format!("{loader_name}: {e}")),
    };
    let fail = |e: u_sdk::UError| format!("{loader_name}: {e}");
    let architecture = match weights.architecture().into_result().map_err(fail)? {
        ROption::RSome(a) => Some(a.to_string()),
        ROption::RNone => None,
    };
    let mut metadata = serde_json::Map::new();
    let mut hyper_parameters = serde_json::Map::new();
    for key in weights.metadata_keys().into_result().map_err(fail)? {
        let ROption::RSome(value) = weights
            .metadata(key.as_str().into())
            .into_result()
            .map_err(fail)?
        else {
            continue;
        };
        let v = to_json(&value);
        if let Some(arch) = &architecture
            && (key.starts_with(&format!("{arch}.")) || key.starts_with("config."))
        {
            hyper_parameters.insert(key.to_string(), v.clone());
        }
        metadata.insert(key.to_string(), v);
    }
    let tensors: Vec<TensorRow> = weights
        .tensors()
        .into_result()
        .map_err(fail)?
        .into_iter()
        .map(|t| TensorRow {
            name: t.name.to_string(),
            dtype: t.dtype.name().to_string(),
            shape: t.shape.to_vec(),
            bytes: t.byte_len,
        })
        .collect();
    Ok(ModelReport {
        path,
        format: weights.format().into_result().map_err(fail)?.to_string(),
        loader: loader_name.clone(),
        architecture,
        hyper_parameters,
        metadata,
        total_bytes: tensors.iter().map(|t| t.bytes).sum(),
        tensors,
    })
}

/// The loaders among the loaded plugins, by name.
pub fn loaders(report: &crate::LoadReport) -> Vec<(String, LoaderBox)> {
    report
        .loaded
        .iter()
        .filter_map(|p| match &p.instance {
            PluginInstance::Loader(l) => Some((p.verified.manifest.name.clone(), l.clone())),
            _ => None,
        })
        .collect()
}

fn read_head(model: &Path) -> Vec<u8> {
    let mut head = Vec::new();
    if let Ok(f) = std::fs::File::open(model) {
        let _ = f.take(4096).read_to_end(&mut head);
    }
    head
}

fn preview<T: Serialize>(items: &[T]) -> Value {
    if items.len() <= ARRAY_PREVIEW {
        json!(items)
    } else {
        json!({ "len": items.len(), "head": &items[..ARRAY_PREVIEW] })
    }
}

fn to_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::Bool(b) => json!(b),
        MetaValue::Int(i) => json!(i),
        MetaValue::UInt(u) => json!(u),
        MetaValue::Float(f) => json!(f),
        MetaValue::Str(s) => json!(s.as_str()),
        MetaValue::IntArray(a) => preview(a.as_slice()),
        MetaValue::UIntArray(a) => preview(a.as_slice()),
        MetaValue::FloatArray(a) => preview(a.as_slice()),
        MetaValue::BoolArray(a) => preview(a.as_slice()),
        MetaValue::StrArray(a) => {
            let items: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
            preview(&items)
        }
        MetaValue::Json(s) => serde_json::from_str(s).unwrap_or_else(|_| json!(s.as_str())),
    }
}

impl ModelReport {
    /// Renders the report as text for people.
    pub fn render(&self) -> String {
        let mut out = format!(
            "model: {}\nformat: {} (loader {})\narchitecture: {}\n",
            self.path,
            self.format,
            self.loader,
            self.architecture.as_deref().unwrap_or("(not stated)")
        );
        out.push_str("hyper-parameters:\n");
        if self.hyper_parameters.is_empty() {
            out.push_str("  (none)\n");
        }
        for (k, v) in &self.hyper_parameters {
            out.push_str(&format!("  {k} = {v}\n"));
        }
        out.push_str(&format!("metadata: {} keys\n", self.metadata.len()));
        for (k, v) in &self.metadata {
            if !self.hyper_parameters.contains_key(k) {
                out.push_str(&format!("  {k} = {v}\n"));
            }
        }
        let width = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        out.push_str(&format!(
            "tensors: {} ({} bytes)\n  {:<width$}  {:<6}  {:<20}  {:>12}\n",
            self.tensors.len(),
            self.total_bytes,
            "name",
            "dtype",
            "shape",
            "bytes"
        ));
        for t in &self.tensors {
            let shape = format!("{:?}", t.shape);
            out.push_str(&format!(
                "  {:<width$}  {:<6}  {:<20}  {:>12}\n",
                t.name, t.dtype, shape, t.bytes
            ));
        }
        out
    }
}
