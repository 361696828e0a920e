//! A loaded CTranslate2 model: the memory-mapped `model.bin`, its tensors (with a 16-byte
//! aligned copy of those the file leaves unaligned), and metadata. Usable without a host
//! through [`StdFs`].

use crate::{
    error::{Error, Result},
    model_bin::{self, MODEL_FILE, ModelBin},
};
use std::{
    collections::HashMap,
    ops::Range,
    path::{Path, PathBuf},
    sync::Arc,
};
use u_sdk::{DType, MetaValue, TensorInfo, TensorView, files, weights};

pub use u_sdk::files::{FileOpener, StdFs};

/// The largest `config.json` accepted (16 MiB).
pub const MAX_CONFIG_LEN: u64 = 16 * 1024 * 1024;
/// The side file whose entries become `config.*` metadata.
pub const CONFIG_NAME: &str = "config.json";
/// The alignment, in bytes, of every tensor's data as the loader hands it out.
pub const ALIGN: usize = 16;

/// Bytes a model's tensors point into: a memory map, or a buffer for in-memory use.
pub type Backing = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Where a tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Location {
    /// In the file, at an aligned address.
    File(Range<usize>),
    /// In the model's aligned copy (the file's address was not aligned).
    Copy(Range<usize>),
}

/// One tensor of the model: a variable of rank ≥ 1, or an alias of one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// The name as stored (for an alias, the alias).
    pub name: String,
    /// Element type as stored.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// For an alias, the name of the variable it stands for (whose bytes it shares).
    pub alias_of: Option<String>,
    location: Location,
}

impl Tensor {
    /// The tensor's description for the ABI.
    pub fn info(&self) -> TensorInfo {
        let range = match &self.location {
            Location::File(r) | Location::Copy(r) => r,
        };
        TensorInfo {
            name: self.name.as_str().into(),
            dtype: self.dtype,
            shape: self.shape.clone().into(),
            byte_len: range.len() as u64,
        }
    }

    /// Whether the tensor's bytes are a view of the file (`false`: of the aligned copy made at
    /// open because the file left them unaligned).
    pub fn is_mapped(&self) -> bool {
        matches!(self.location, Location::File(_))
    }
}

/// Owned bytes whose start is aligned to [`ALIGN`].
struct Aligned {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    /// `len` zeroed bytes, aligned.
    fn zeroed(len: usize) -> Self {
        let buf = vec![0u8; len + ALIGN - 1];
        let start = (ALIGN - buf.as_ptr().addr() % ALIGN) % ALIGN;
        Aligned { buf, start, len }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// A loaded CTranslate2 model.
pub struct CTranslate2Model {
    path: PathBuf,
    /// The file; dropped once every tensor lives in the copy.
    file: Option<Backing>,
    copy: Aligned,
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    spec: String,
    revision: u32,
    binary_version: u32,
    architecture: Option<String>,
}

impl std::fmt::Debug for CTranslate2Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CTranslate2Model")
            .field("path", &self.path)
            .field("spec", &self.spec)
            .field("revision", &self.revision)
            .field("tensors", &self.tensors.len())
            .field("copied_bytes", &self.copy.len)
            .finish()
    }
}

impl CTranslate2Model {
    /// Opens a model: a CTranslate2 model directory (its `model.bin` is read) or the path of a
    /// `.bin` file itself. A `config.json` beside it, if present and granted, supplies `config.*`
    /// metadata.
    pub fn open(opener: &dyn FileOpener, path: &Path) -> Result<Self> {
        let is_file = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(".bin"));
        let (dir, file) = if is_file {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            (dir, path.to_path_buf())
        } else {
            (path.to_path_buf(), path.join(MODEL_FILE))
        };
        let data: Backing = Arc::new(files::map_file(opener, &file)?);
        let config_path = dir.join(CONFIG_NAME);
        let config = files::read_optional(opener, &config_path, MAX_CONFIG_LEN)?
            .map(|bytes| parse_config(config_path, &bytes))
            .transpose()?;
        Self::assemble(file, data, config)
    }

    /// Builds a model from an in-memory `model.bin` and an optional `config.json` document (for
    /// tests and fuzzing: no files involved).
    pub fn from_bytes(file: Vec<u8>, config: Option<&[u8]>) -> Result<Self> {
        let config = config
            .map(|c| parse_config(PathBuf::from(CONFIG_NAME), c))
            .transpose()?;
        Self::assemble(PathBuf::from("<memory>"), Arc::new(file), config)
    }

    fn assemble(
        path: PathBuf,
        data: Backing,
        config: Option<(PathBuf, serde_json::Value)>,
    ) -> Result<Self> {
        let bytes: &[u8] = (*data).as_ref();
        let bin = model_bin::parse(bytes).map_err(|source| Error::Format {
            path: path.clone(),
            source,
        })?;
        let ModelBin {
            binary_version,
            spec,
            revision,
            variables,
            aliases,
        } = bin;

        let mut metadata = vec![
            (
                "ctranslate2.binary_version".to_string(),
                MetaValue::UInt(binary_version.into()),
            ),
            (
                "ctranslate2.spec".to_string(),
                MetaValue::Str(spec.as_str().into()),
            ),
            (
                "ctranslate2.revision".to_string(),
                MetaValue::UInt(revision.into()),
            ),
        ];

        // Lay out the copy: every tensor whose bytes are not at an aligned address, each at an
        // aligned offset. Its total is bounded by the file's length plus ALIGN per tensor.
        let aligned = |r: &Range<usize>| bytes[r.clone()].as_ptr().addr().is_multiple_of(ALIGN);
        let mut copy_len = 0usize;
        let mut places: Vec<Option<Location>> = Vec::with_capacity(variables.len());
        for v in &variables {
            places.push(if v.is_scalar() {
                None
            } else if aligned(&v.range) {
                Some(Location::File(v.range.clone()))
            } else {
                let start = copy_len.next_multiple_of(ALIGN);
                copy_len = start + v.range.len();
                Some(Location::Copy(start..copy_len))
            });
        }
        let mut copy = Aligned::zeroed(copy_len);
        for (v, place) in variables.iter().zip(&places) {
            if let Some(Location::Copy(r)) = place {
                copy.bytes_mut()[r.clone()].copy_from_slice(&bytes[v.range.clone()]);
            }
        }

        let mut tensors = Vec::with_capacity(variables.len() + aliases.len());
        for (v, place) in variables.iter().zip(&places) {
            match place {
                Some(location) => tensors.push(Tensor {
                    name: v.name.clone(),
                    dtype: v.dtype,
                    shape: v.shape.clone(),
                    alias_of: None,
                    location: location.clone(),
                }),
                None => {
                    if let Some(value) = model_bin::scalar_value(v.dtype, &bytes[v.range.clone()]) {
                        metadata.push((format!("ctranslate2.{}", v.name), value));
                    }
                }
            }
        }
        for a in &aliases {
            let v = &variables[a.variable];
            match &places[a.variable] {
                Some(location) => tensors.push(Tensor {
                    name: a.name.clone(),
                    dtype: v.dtype,
                    shape: v.shape.clone(),
                    alias_of: Some(a.target.clone()),
                    location: location.clone(),
                }),
                None => {
                    if let Some(value) = model_bin::scalar_value(v.dtype, &bytes[v.range.clone()]) {
                        metadata.push((format!("ctranslate2.{}", a.name), value));
                    }
                }
            }
        }

        if let Some((path, cfg)) = &config {
            metadata.extend(
                weights::config_metadata(cfg).map_err(|reason| Error::Config {
                    path: path.clone(),
                    reason,
                })?,
            );
        }
        // The first of two equal keys wins (the file's own before config.json's).
        let mut meta_index = HashMap::with_capacity(metadata.len());
        metadata.retain(|(k, _)| {
            !meta_index.contains_key(k) && {
                meta_index.insert(k.clone(), meta_index.len());
                true
            }
        });
        let by_name = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let keep_file = tensors.iter().any(Tensor::is_mapped);
        Ok(CTranslate2Model {
            path,
            file: keep_file.then_some(data),
            copy,
            tensors,
            by_name,
            metadata,
            meta_index,
            architecture: model_bin::architecture(&spec),
            spec,
            revision,
            binary_version,
        })
    }

    /// All tensors: variables of rank ≥ 1 in file order, then aliases in file order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// A tensor by name (an alias's name included).
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor of this model, aligned to [`ALIGN`]: a slice of the map, or of the
    /// copy made at open.
    pub fn bytes(&self, t: &Tensor) -> &[u8] {
        match &t.location {
            Location::File(r) => self
                .file
                .as_ref()
                .and_then(|f| (**f).as_ref().get(r.clone()))
                .unwrap_or(&[]),
            Location::Copy(r) => self.copy.bytes().get(r.clone()).unwrap_or(&[]),
        }
    }

    /// A view of a tensor by name (no copy).
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

    /// A tensor's values converted to `f32` (a copy).
    pub fn tensor_f32(&self, name: &str) -> u_sdk::Result<Vec<f32>> {
        self.view(name)?.to_f32()
    }

    /// Metadata, in a stable order: `ctranslate2.binary_version`, `.spec`, `.revision`, the
    /// scalar variables (and aliases of them) as `ctranslate2.<name>` in file order, then
    /// `config.*` from `config.json`.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn metadata_value(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The architecture the spec names (`WhisperSpec` → `whisper`).
    pub fn architecture(&self) -> Option<&str> {
        self.architecture.as_deref()
    }

    /// The spec's class name as stored, e.g. `WhisperSpec`.
    pub fn spec(&self) -> &str {
        &self.spec
    }

    /// The spec's revision.
    pub fn revision(&self) -> u32 {
        self.revision
    }

    /// The container's binary version.
    pub fn binary_version(&self) -> u32 {
        self.binary_version
    }

    /// Bytes copied at open to align tensors the file left unaligned.
    pub fn copied_bytes(&self) -> usize {
        self.copy.len
    }

    /// The `model.bin` the model was read from (`<memory>` for [`Self::from_bytes`]).
    pub fn path(&self) -> &Path {
        &self.path
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_writer::ModelBinWriter;

    /// Tensors at deliberately odd offsets, scalars, an alias, an empty tensor.
    fn model_bytes() -> Vec<u8> {
        ModelBinWriter::new("WhisperSpec", 3)
            .var("decoder/num_heads", &[], 2, &6i16.to_le_bytes())
            .var(
                "a",
                &[3],
                0,
                &[1.0f32, 2.0, 3.0].map(f32::to_le_bytes).concat(),
            )
            .var(
                "bb",
                &[2, 2],
                4,
                &[0x00, 0x3c, 0x00, 0x40, 0x00, 0x42, 0x00, 0x44],
            )
            .var("decoder/activation", &[], 1, &[3])
            .var("ccc", &[1], 3, &7i32.to_le_bytes())
            .var("empty", &[0], 5, &[])
            .var("eps", &[], 0, &1e-5f32.to_le_bytes())
            .alias("a_alias", "a")
            .alias("heads_alias", "decoder/num_heads")
            .bytes()
    }

    #[test]
    fn tensors_metadata_and_aliases() {
        let config = br#"{"suppress_ids": [1, 2], "lang_ids": null, "spec": "not the header's"}"#;
        let m = CTranslate2Model::from_bytes(model_bytes(), Some(config)).unwrap();
        let names: Vec<&str> = m.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "bb", "ccc", "empty", "a_alias"]);
        assert_eq!(m.architecture(), Some("whisper"));
        assert_eq!(
            (m.spec(), m.revision(), m.binary_version()),
            ("WhisperSpec", 3, 6)
        );
        assert_eq!(m.tensor_f32("a").unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(m.tensor_f32("a_alias").unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(m.tensor_f32("bb").unwrap(), [1.0, 2.0, 3.0, 4.0]);
        let alias = m.tensor("a_alias").unwrap();
        assert_eq!(alias.alias_of.as_deref(), Some("a"));
        assert_eq!(
            m.bytes(alias).as_ptr(),
            m.bytes(m.tensor("a").unwrap()).as_ptr(),
            "an alias shares its target's bytes"
        );
        let v = m.view("ccc").unwrap();
        assert_eq!(
            (v.dtype, v.shape.as_slice(), v.data.as_slice()),
            (DType::I32, &[1][..], &7i32.to_le_bytes()[..])
        );
        assert_eq!(m.view("empty").unwrap().data.len(), 0);
        assert!(matches!(
            m.view("decoder/num_heads"),
            Err(Error::NoTensor(_))
        ));
        assert!(matches!(m.view("nope"), Err(Error::NoTensor(_))));

        // The file's own keys in file order, then config.json's (whose order is serde_json's:
        // sorted, or the file's when another crate turns on `preserve_order`).
        let keys: Vec<&str> = m.metadata().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys[..7],
            [
                "ctranslate2.binary_version",
                "ctranslate2.spec",
                "ctranslate2.revision",
                "ctranslate2.decoder/num_heads",
                "ctranslate2.decoder/activation",
                "ctranslate2.eps",
                "ctranslate2.heads_alias",
            ]
        );
        let mut config = keys[7..].to_vec();
        config.sort_unstable();
        assert_eq!(config, ["config.spec", "config.suppress_ids"]);
        let meta = |k: &str| m.metadata_value(k).cloned();
        assert_eq!(
            meta("ctranslate2.decoder/num_heads"),
            Some(MetaValue::Int(6))
        );
        assert_eq!(meta("ctranslate2.heads_alias"), Some(MetaValue::Int(6)));
        assert_eq!(
            meta("ctranslate2.decoder/activation"),
            Some(MetaValue::Int(3))
        );
        assert_eq!(
            meta("ctranslate2.eps"),
            Some(MetaValue::Float(f64::from(1e-5f32)))
        );
        assert_eq!(
            meta("ctranslate2.spec"),
            Some(MetaValue::Str("WhisperSpec".into()))
        );
        assert_eq!(meta("ctranslate2.revision"), Some(MetaValue::UInt(3)));
        assert_eq!(meta("ctranslate2.binary_version"), Some(MetaValue::UInt(6)));
        assert_eq!(
            meta("config.suppress_ids"),
            Some(MetaValue::UIntArray(vec![1, 2].into()))
        );
    }

    #[test]
    fn every_view_is_aligned_whatever_the_offsets() {
        // Shift the whole file through every offset modulo ALIGN by padding the spec name.
        for pad in 0..ALIGN {
            let spec = format!("{}Spec", "X".repeat(pad + 1));
            let bytes = ModelBinWriter::new(&spec, 1)
                .var("a", &[3], 0, &[0; 12])
                .var("b", &[5], 1, &[1, 2, 3, 4, 5])
                .var("c", &[0], 4, &[])
                .var("d", &[2], 4, &[9, 8, 7, 6])
                .bytes();
            let m = CTranslate2Model::from_bytes(bytes.clone(), None).unwrap();
            let parsed = model_bin::parse(&bytes).unwrap();
            for (t, v) in m.tensors().iter().zip(&parsed.variables) {
                let data = m.bytes(t);
                assert_eq!(data.as_ptr().addr() % ALIGN, 0, "{spec}: {}", t.name);
                assert_eq!(data, &bytes[v.range.clone()], "{spec}: {}", t.name);
                assert_eq!(data.len() as u64, t.info().byte_len);
            }
        }
    }

    #[test]
    fn aligned_tensors_stay_in_the_file() {
        // A file whose only tensor starts 16-aligned (relative to a 16-aligned buffer) is not
        // copied; `from_bytes` keeps the Vec, so check against its actual address.
        for pad in 0..ALIGN {
            let spec = format!("{}Spec", "X".repeat(pad + 1));
            let bytes = ModelBinWriter::new(&spec, 1)
                .var("a", &[4], 0, &[0; 16])
                .bytes();
            let m = CTranslate2Model::from_bytes(bytes, None).unwrap();
            let t = &m.tensors()[0];
            assert_eq!(m.copied_bytes() == 0, t.is_mapped());
            assert_eq!(
                m.file.is_some(),
                t.is_mapped(),
                "the file is dropped once unused"
            );
        }
    }

    #[test]
    fn bad_config_is_an_error() {
        let err = CTranslate2Model::from_bytes(model_bytes(), Some(b"{nope")).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{err}");
        let err = CTranslate2Model::from_bytes(model_bytes(), Some(b"[1]")).unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{err}");
    }

    #[test]
    fn malformed_files_name_the_path() {
        let err = CTranslate2Model::from_bytes(vec![6, 0, 0], None).unwrap_err();
        assert!(err.to_string().starts_with("<memory>: "), "{err}");
        let u: u_sdk::UError = err.into();
        assert_eq!(u.kind, u_sdk::ErrorKind::InvalidInput);
        assert!(u.message.starts_with("loader-ctranslate2: "), "{u}");
        let err = CTranslate2Model::from_bytes(4u32.to_le_bytes().to_vec(), None).unwrap_err();
        assert_eq!(u_sdk::UError::from(err).kind, u_sdk::ErrorKind::Unsupported);
    }
}
