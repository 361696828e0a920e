//! A loader's parsed model as the ABI's [`WeightSet`], and the loader itself as its [`Loader`].
//!
//! A loader implements [`WeightSource`] (and [`OpenWeights`]) in plain Rust; [`SharedWeights`]
//! and [`FileLoader`] add what every loader would otherwise repeat: the conversions to ABI
//! types, opening files through the host's grants, and (through [`crate::boxed`]) the panic
//! guard on each call. With feature `json`, `config_metadata` presents a `config.json` as
//! metadata. Linked statically, outside the ABI fingerprint.

use crate::{
    abi::{
        error::UError,
        host::HostBox,
        loader::{Loader, LoaderBox, WeightSet, WeightSetBox},
        tensor::{MetaValue, TensorInfo, TensorView},
    },
    files::{FileOpener, HostFiles},
};
use abi_stable::std_types::{ROption, RResult, RResult::ROk, RSlice, RStr, RString, RVec};
use std::{marker::PhantomData, path::Path, sync::Arc};

/// What a loaded model offers, in plain Rust; [`SharedWeights`] serves it over the ABI.
pub trait WeightSource: Send + Sync + 'static {
    /// The file format, e.g. `"gguf"` (also names the loader in error messages).
    const FORMAT: &'static str;
    /// The architecture family as the file names it, if known.
    fn architecture(&self) -> Option<&str>;
    /// All metadata keys, in file order.
    fn metadata_keys(&self) -> Vec<&str>;
    /// One metadata value.
    fn metadata(&self, key: &str) -> Option<MetaValue>;
    /// Every tensor's name, dtype and shape.
    fn tensors(&self) -> Vec<TensorInfo>;
    /// A zero-copy view of one tensor's bytes.
    fn tensor(&self, name: &str) -> crate::Result<TensorView<'_>>;
}

/// A shared [`WeightSource`] as a [`WeightSet`]; cloning shares the source.
pub struct SharedWeights<S>(pub Arc<S>);

impl<S> Clone for SharedWeights<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<S> std::ops::Deref for SharedWeights<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.0
    }
}

impl<S: WeightSource> SharedWeights<S> {
    /// Shares `source`.
    pub fn new(source: S) -> Self {
        Self(Arc::new(source))
    }

    /// This weight set as an ABI object.
    pub fn into_box(self) -> WeightSetBox {
        WeightSetBox::new(self)
    }
}

impl<S: WeightSource> WeightSet for SharedWeights<S> {
    fn format(&self) -> RResult<RString, UError> {
        ROk(S::FORMAT.into())
    }

    fn architecture(&self) -> RResult<ROption<RString>, UError> {
        ROk(self.0.architecture().map(RString::from).into())
    }

    fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
        ROk(self
            .0
            .metadata_keys()
            .into_iter()
            .map(RString::from)
            .collect())
    }

    fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
        ROk(self.0.metadata(key.as_str()).into())
    }

    fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
        ROk(self.0.tensors().into())
    }

    fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
        self.0.tensor(name.as_str()).into()
    }
}

/// A [`WeightSource`] a loader opens from files.
pub trait OpenWeights: WeightSource + Sized {
    /// Whether the file at `path`, whose first bytes (at most 4 KiB) are `head`, is one this
    /// loader reads.
    fn sniff(path: &str, head: &[u8]) -> bool;
    /// Opens the model at `path`, reading every file through `files`.
    fn open(files: &dyn FileOpener, path: &Path) -> crate::Result<Self>;
}

/// The `loader` entry object of a loader whose models are `S`: files are opened through the
/// host (so the deployment's `fs.read` grant applies), models served as [`SharedWeights`].
pub struct FileLoader<S> {
    host: HostBox,
    source: PhantomData<fn() -> S>,
}

impl<S> Clone for FileLoader<S> {
    fn clone(&self) -> Self {
        Self {
            host: self.host.clone(),
            source: PhantomData,
        }
    }
}

impl<S: OpenWeights> FileLoader<S> {
    /// A loader that opens files through `host`.
    pub fn new(host: HostBox) -> Self {
        Self {
            host,
            source: PhantomData,
        }
    }

    /// This loader as an ABI object.
    pub fn into_box(self) -> LoaderBox {
        LoaderBox::new(self)
    }
}

impl<S: OpenWeights> Loader for FileLoader<S> {
    fn formats(&self) -> RResult<RVec<RString>, UError> {
        ROk(RVec::from(vec![RString::from(S::FORMAT)]))
    }

    fn can_open(&self, path: RStr<'_>, head: RSlice<'_, u8>) -> RResult<bool, UError> {
        ROk(S::sniff(path.as_str(), head.as_slice()))
    }

    fn open(&self, path: RStr<'_>) -> RResult<WeightSetBox, UError> {
        S::open(&HostFiles(&self.host), Path::new(path.as_str()))
            .map(|source| SharedWeights::new(source).into_box())
            .into()
    }
}

/// `config.json` as metadata, in document order: every top-level entry verbatim as
/// `config.<key>` (scalars and arrays of one scalar type keep their type, nested objects and
/// mixed arrays become [`MetaValue::Json`], `null` is skipped). This is the format's own
/// content; what the keys mean is for the architecture to say. Fails only if the document is
/// not a JSON object.
#[cfg(feature = "json")]
pub fn config_metadata(config: &serde_json::Value) -> Result<Vec<(String, MetaValue)>, String> {
    json_metadata("config", config).ok_or_else(|| "config.json is not a JSON object".to_string())
}

/// A JSON object's top-level entries as metadata `{prefix}.<key>` (the rules of
/// [`config_metadata`]), or `None` if it is not an object: side files of a checkpoint folder,
/// such as sentence-transformers' `sentence_bert_config.json`.
#[cfg(feature = "json")]
pub fn json_metadata(prefix: &str, doc: &serde_json::Value) -> Option<Vec<(String, MetaValue)>> {
    Some(
        doc.as_object()?
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| (format!("{prefix}.{k}"), json_to_meta(v)))
            .collect(),
    )
}

/// Converts one JSON value to a metadata value (see [`config_metadata`] for the rules).
#[cfg(feature = "json")]
pub fn json_to_meta(v: &serde_json::Value) -> MetaValue {
    use serde_json::Value;
    let json = || MetaValue::Json(v.to_string().into());
    match v {
        Value::Bool(b) => MetaValue::Bool(*b),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                MetaValue::UInt(u)
            } else if let Some(i) = n.as_i64() {
                MetaValue::Int(i)
            } else {
                MetaValue::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Value::String(s) => MetaValue::Str(s.as_str().into()),
        Value::Array(items) if items.is_empty() => json(),
        Value::Array(items) => {
            if let Some(b) = items.iter().map(Value::as_bool).collect::<Option<Vec<_>>>() {
                MetaValue::BoolArray(b.into())
            } else if let Some(s) = items.iter().map(Value::as_str).collect::<Option<Vec<_>>>() {
                MetaValue::StrArray(s.into_iter().map(Into::into).collect())
            } else if let Some(u) = items.iter().map(Value::as_u64).collect::<Option<Vec<_>>>() {
                MetaValue::UIntArray(u.into())
            } else if let Some(i) = items.iter().map(Value::as_i64).collect::<Option<Vec<_>>>() {
                MetaValue::IntArray(i.into())
            } else if let Some(f) = items.iter().map(Value::as_f64).collect::<Option<Vec<_>>>() {
                MetaValue::FloatArray(f.into())
            } else {
                json()
            }
        }
        Value::Object(_) | Value::Null => json(),
    }
}

#[cfg(all(test, feature = "json"))]
mod tests {
    use super::*;

    #[test]
    fn config_json_becomes_config_keys_verbatim() {
        let cfg: serde_json::Value = serde_json::from_str(
            r#"{"model_type":"mixtral","hidden_size":64,"rms_norm_eps":1e-5,"eos_token_id":[1,2],
                "rope_scaling":{"type":"linear","factor":2.0},"torch_dtype":"bfloat16",
                "bos_token_id":null,"tie_word_embeddings":false}"#,
        )
        .unwrap();
        let meta = config_metadata(&cfg).unwrap();
        let get = |k: &str| {
            meta.iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(
            get("config.model_type"),
            Some(MetaValue::Str("mixtral".into()))
        );
        assert_eq!(get("config.hidden_size"), Some(MetaValue::UInt(64)));
        assert_eq!(get("config.rms_norm_eps"), Some(MetaValue::Float(1e-5)));
        assert_eq!(
            get("config.eos_token_id"),
            Some(MetaValue::UIntArray(vec![1, 2].into()))
        );
        assert_eq!(
            get("config.tie_word_embeddings"),
            Some(MetaValue::Bool(false))
        );
        assert!(matches!(
            get("config.rope_scaling"),
            Some(MetaValue::Json(_))
        ));
        assert_eq!(get("config.bos_token_id"), None);
        assert_eq!(
            get("general.architecture"),
            None,
            "the format names no model"
        );
        assert!(config_metadata(&serde_json::json!([1])).is_err());
    }
}

/// [`crate::Architecture::gguf_view`] for an architecture that converts no other format: GGUF
/// weights as they are, anything else an error naming `plugin`.
pub fn gguf_as_is(plugin: &str, weights: WeightSetBox) -> RResult<WeightSetBox, UError> {
    match weights.format() {
        ROk(f) if f.as_str() == "gguf" => ROk(weights),
        ROk(f) => RResult::RErr(UError::unsupported(format!(
            "{plugin}: writing GGUF from {f} weights is not supported"
        ))),
        RResult::RErr(e) => RResult::RErr(e),
    }
}
