//! A loaded safetensors model: one or more memory-mapped files, validated headers, tensor names
//! as stored and metadata. Usable without a host through [`StdFs`].

use crate::{
    error::{Error, Result},
    header::{self, RawTensor},
    index,
};
use std::{
    collections::HashMap,
    ops::Range,
    path::{Path, PathBuf},
    sync::Arc,
};
use u_sdk::{
    DType, MetaValue, TensorInfo, TensorView,
    files::{self, FileError, OpenError},
    weights,
};

/// The largest `config.json` accepted (16 MiB).
pub const MAX_CONFIG_LEN: u64 = 16 * 1024 * 1024;
/// File name of a shard index inside a model directory.
pub const INDEX_NAME: &str = "model.safetensors.index.json";
/// File name of a single-file model inside a model directory.
pub const SINGLE_NAME: &str = "model.safetensors";
/// The single file of a diffusers component folder (`unet/`, `vae/`, …), read where a
/// directory has no [`SINGLE_NAME`].
pub const DIFFUSERS_NAME: &str = "diffusion_pytorch_model.safetensors";

pub use u_sdk::files::{FileOpener, StdFs};

/// Bytes a model's tensors point into: a memory map, or a buffer for in-memory use.
pub type Backing = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// One tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Name as stored in the file.
    pub name: String,
    /// Element type as stored.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    shard: usize,
    range: Range<usize>,
}

impl Tensor {
    /// The tensor's description for the ABI.
    pub fn info(&self) -> TensorInfo {
        TensorInfo {
            name: self.name.as_str().into(),
            dtype: self.dtype,
            shape: self.shape.clone().into(),
            byte_len: self.range.len() as u64,
        }
    }
}

struct Shard {
    path: PathBuf,
    data: Backing,
}

/// A loaded safetensors model.
pub struct SafetensorsModel {
    shards: Vec<Shard>,
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    architecture: Option<String>,
}

impl std::fmt::Debug for SafetensorsModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsModel")
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.tensors.len())
            .field("architecture", &self.architecture)
            .finish()
    }
}

impl SafetensorsModel {
    /// Opens a model: a `.safetensors` file, a `*.index.json` shard index, or a directory
    /// holding `model.safetensors.index.json` or `model.safetensors`. A `config.json` in the
    /// same directory, if present and readable, supplies metadata.
    pub fn open(opener: &dyn FileOpener, path: &Path) -> Result<Self> {
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (dir, index_path, single_path) = if file_name.ends_with(".json") {
            (parent(path), Some(path.to_path_buf()), None)
        } else if file_name.ends_with(".safetensors") {
            (parent(path), None, Some(path.to_path_buf()))
        } else {
            let index = path.join(INDEX_NAME);
            match opener.open(&index).map_err(|e| FileError::open(&index, e)) {
                Ok(_) => (path.to_path_buf(), Some(index), None),
                Err(e) if e.is_absent() => {
                    let single = path.join(SINGLE_NAME);
                    let diffusers = path.join(DIFFUSERS_NAME);
                    let pick = match opener.open(&single) {
                        Err(OpenError::NotFound) if opener.open(&diffusers).is_ok() => diffusers,
                        _ => single,
                    };
                    (path.to_path_buf(), None, Some(pick))
                }
                Err(e) => return Err(e.into()),
            }
        };

        let config_path = dir.join("config.json");
        let config = files::read_optional(opener, &config_path, MAX_CONFIG_LEN)?
            .map(|bytes| parse_config(config_path, &bytes))
            .transpose()?;

        let mut shards = Vec::new();
        let mut extra_meta = side_files(opener, &dir)?;
        let weight_map = if let Some(index_path) = index_path {
            let bytes = files::read_limited(opener, &index_path, index::MAX_INDEX_LEN)?;
            let idx = index::parse(&bytes).map_err(|reason| Error::Index {
                path: index_path.clone(),
                reason,
            })?;
            for name in &idx.shards {
                let p = dir.join(name);
                shards.push(Shard {
                    data: map_file(opener, &p)?,
                    path: p,
                });
            }
            for (k, v) in &idx.metadata {
                extra_meta.push((format!("safetensors.index.{k}"), weights::json_to_meta(v)));
            }
            Some((index_path, idx))
        } else if let Some(p) = single_path {
            shards.push(Shard {
                data: map_file(opener, &p)?,
                path: p,
            });
            None
        } else {
            None
        };
        Self::assemble(shards, weight_map, config, extra_meta)
    }

    /// Builds a model from one in-memory safetensors file and an optional `config.json`
    /// document (for tests and fuzzing: no files involved).
    pub fn from_bytes(file: Vec<u8>, config: Option<&[u8]>) -> Result<Self> {
        let config = config
            .map(|c| parse_config(PathBuf::from("config.json"), c))
            .transpose()?;
        let shard = Shard {
            path: PathBuf::from("<memory>"),
            data: Arc::new(file),
        };
        Self::assemble(vec![shard], None, config, Vec::new())
    }

    fn assemble(
        shards: Vec<Shard>,
        weight_map: Option<(PathBuf, index::ShardIndex)>,
        config: Option<(PathBuf, serde_json::Value)>,
        extra_meta: Vec<(String, MetaValue)>,
    ) -> Result<Self> {
        let mut metadata = Vec::new();
        if let Some((path, cfg)) = &config {
            metadata = weights::config_metadata(cfg).map_err(|reason| Error::Config {
                path: path.clone(),
                reason,
            })?;
        }
        let mut file_meta = Vec::new();
        // transformers names the architecture `model_type`; diffusers, `_class_name`.
        let named = |key: &str| {
            metadata
                .iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.as_str())
                .map(str::to_string)
        };
        let architecture = named("config.model_type").or_else(|| named("config._class_name"));

        let mut raw: Vec<(usize, RawTensor)> = Vec::new();
        let mut shard_of: HashMap<String, usize> = HashMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let h = header::parse((*shard.data).as_ref()).map_err(|source| Error::Header {
                path: shard.path.clone(),
                source,
            })?;
            if i == 0 {
                for (k, v) in &h.metadata {
                    file_meta.push((
                        format!("safetensors.{k}"),
                        MetaValue::Str(v.as_str().into()),
                    ));
                }
            }
            for t in h.tensors {
                if let Some(other) = shard_of.insert(t.name.clone(), i) {
                    return Err(Error::Inconsistent {
                        path: shard.path.clone(),
                        reason: format!(
                            "tensor `{}` is also in {}",
                            t.name,
                            shards[other].path.display()
                        ),
                    });
                }
                raw.push((i, t));
            }
        }
        if let Some((index_path, idx)) = &weight_map {
            for (tensor, file) in &idx.weight_map {
                let holder = shard_of.get(tensor).map(|&i| &shards[i].path);
                if holder.and_then(|p| p.file_name()) != Some(std::ffi::OsStr::new(file)) {
                    return Err(Error::Inconsistent {
                        path: index_path.clone(),
                        reason: format!(
                            "index places `{tensor}` in `{file}`, which does not hold it"
                        ),
                    });
                }
            }
        }

        let mut tensors = Vec::with_capacity(raw.len());
        let mut by_name: HashMap<String, usize> = HashMap::with_capacity(raw.len());
        for (shard, t) in raw {
            by_name.insert(t.name.clone(), tensors.len());
            tensors.push(Tensor {
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                shard,
                range: t.range,
            });
        }
        metadata.extend(file_meta);
        metadata.extend(extra_meta);
        let mut meta_index = HashMap::new();
        metadata.retain(|(k, _)| {
            !meta_index.contains_key(k) && {
                meta_index.insert(k.clone(), meta_index.len());
                true
            }
        });
        Ok(SafetensorsModel {
            shards,
            tensors,
            by_name,
            metadata,
            meta_index,
            architecture,
        })
    }

    /// All tensors, shard by shard, in file order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The stored bytes of a tensor of this model (a slice of the map: no copy).
    pub fn bytes(&self, t: &Tensor) -> &[u8] {
        let data: &[u8] = (*self.shards[t.shard].data).as_ref();
        data.get(t.range.clone()).unwrap_or(&[])
    }

    /// A zero-copy view of a tensor by name.
    pub fn view(&self, name: &str) -> Result<TensorView<'_>> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::NoTensor(name.to_string()))?;
        Ok(TensorView {
            dtype: t.dtype,
            shape: t.shape.clone().into(),
            data: self.bytes(t).into(),
        })
    }

    /// A tensor's values converted to `f32` (a copy; for float and integer dtypes).
    pub fn tensor_f32(&self, name: &str) -> u_sdk::Result<Vec<f32>> {
        self.view(name)?.to_f32()
    }

    /// Metadata, in a stable order: `config.*` from `config.json`, then `safetensors.*` from the
    /// file header and index.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn metadata_value(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The architecture as `config.json`'s `model_type` names it, if known.
    pub fn architecture(&self) -> Option<&str> {
        self.architecture.as_deref()
    }
}

/// Side files of a model folder as metadata: a sentence-transformers model's own
/// `sentence_bert_config.json` (`sentence_transformers.max_seq_length`, …) and its pooling
/// module's `1_Pooling/config.json` (`sentence_transformers.pooling.pooling_mode_mean_tokens`,
/// …), and an image model's processor settings, `preprocessor_config.json` (`preprocessor.*`:
/// sizes, mean, std). Absent files add nothing.
pub fn side_files(opener: &dyn FileOpener, dir: &Path) -> Result<Vec<(String, MetaValue)>> {
    let mut out = Vec::new();
    for (file, prefix) in [
        ("sentence_bert_config.json", "sentence_transformers"),
        ("1_Pooling/config.json", "sentence_transformers.pooling"),
        ("preprocessor_config.json", "preprocessor"),
    ] {
        let path = dir.join(file);
        let Some(bytes) = files::read_optional(opener, &path, MAX_CONFIG_LEN)? else {
            continue;
        };
        let (path, doc) = parse_config(path, &bytes)?;
        out.extend(weights::json_metadata(prefix, &doc).ok_or(Error::Config {
            path,
            reason: "not a JSON object".into(),
        })?);
    }
    Ok(out)
}

fn parse_config(path: PathBuf, bytes: &[u8]) -> Result<(PathBuf, serde_json::Value)> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Ok((path, v)),
        Err(e) => Err(Error::Config {
            path,
            reason: e.to_string(),
        }),
    }
}

fn parent(path: &Path) -> PathBuf {
    path.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Memory-maps a whole regular file.
fn map_file(opener: &dyn FileOpener, path: &Path) -> Result<Backing> {
    Ok(Arc::new(files::map_file(opener, path)?))
}
