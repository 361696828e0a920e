//! A memory-mapped GGUF file as a weight source, and the loader that opens it.

use crate::gguf::{Array, Gguf, MAGIC, Value};
use memmap2::Mmap;
use std::{fs::File, path::Path};
use u_sdk::{
    MetaValue, TensorInfo, TensorView, UError,
    files::{FileError, FileOpener},
    weights::{FileLoader, OpenWeights, SharedWeights, WeightSource},
};

/// A memory-mapped, parsed GGUF file.
pub struct GgufFile {
    map: Mmap,
    gguf: Gguf,
}

/// The weight set handed to the host: a shared [`GgufFile`] (cloning shares the map).
pub type GgufWeights = SharedWeights<GgufFile>;

/// The loader: opens files through the host's `open_read`, so the `fs.read` grant applies.
pub type GgufLoader = FileLoader<GgufFile>;

impl OpenWeights for GgufFile {
    fn sniff(_path: &str, head: &[u8]) -> bool {
        head.starts_with(&MAGIC)
    }

    fn open(files: &dyn FileOpener, path: &Path) -> u_sdk::Result<Self> {
        let file = files.open(path).map_err(|e| FileError::open(path, e))?;
        GgufFile::from_file(&file, &path.display().to_string())
    }
}

/// Opens a file directly, without a host (tests and tools).
pub fn open_path(path: &Path) -> u_sdk::Result<GgufWeights> {
    let label = path.display().to_string();
    let file = File::open(path).map_err(|e| UError::io(format!("open {label}"), e))?;
    Ok(SharedWeights::new(GgufFile::from_file(&file, &label)?))
}

impl GgufFile {
    /// Maps and parses an open file; `label` names it in errors.
    ///
    /// The file must not be modified while mapped (the usual contract of model files).
    pub fn from_file(file: &File, label: &str) -> u_sdk::Result<Self> {
        // SAFETY: read-only private mapping; model files are not modified while served.
        let map = unsafe { Mmap::map(file) }.map_err(|e| UError::io(format!("mmap {label}"), e))?;
        let gguf = Gguf::parse(&map).map_err(|e| {
            let e = UError::from(e);
            UError::new(e.kind, format!("{label}: {}", e.message))
        })?;
        Ok(Self { map, gguf })
    }

    /// The parsed file.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// The mapped bytes of the whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }
}

impl WeightSource for GgufFile {
    const FORMAT: &'static str = "gguf";

    fn architecture(&self) -> Option<&str> {
        self.gguf.architecture()
    }

    fn metadata_keys(&self) -> Vec<&str> {
        self.gguf.metadata.iter().map(|(k, _)| k.as_str()).collect()
    }

    fn metadata(&self, key: &str) -> Option<MetaValue> {
        self.gguf.get(key).map(meta_value)
    }

    fn tensors(&self) -> Vec<TensorInfo> {
        self.gguf
            .tensors
            .iter()
            .map(|t| TensorInfo {
                name: t.name.as_str().into(),
                dtype: t.dtype,
                shape: t.shape().into(),
                byte_len: t.byte_len,
            })
            .collect()
    }

    fn tensor(&self, name: &str) -> u_sdk::Result<TensorView<'_>> {
        let data = self.gguf.tensor_data(self.bytes(), name)?;
        // `tensor_data` succeeded, so the info exists.
        let info = self
            .gguf
            .tensor_info(name)
            .ok_or_else(|| UError::not_found(format!("no tensor named {name:?}")))?;
        Ok(TensorView {
            dtype: info.dtype,
            shape: info.shape().into(),
            data: data.into(),
        })
    }
}

/// Converts a GGUF value to the ABI's metadata value; arrays of arrays become JSON.
pub fn meta_value(v: &Value) -> MetaValue {
    match v {
        Value::U8(x) => MetaValue::UInt((*x).into()),
        Value::U16(x) => MetaValue::UInt((*x).into()),
        Value::U32(x) => MetaValue::UInt((*x).into()),
        Value::U64(x) => MetaValue::UInt(*x),
        Value::I8(x) => MetaValue::Int((*x).into()),
        Value::I16(x) => MetaValue::Int((*x).into()),
        Value::I32(x) => MetaValue::Int((*x).into()),
        Value::I64(x) => MetaValue::Int(*x),
        Value::F32(x) => MetaValue::Float((*x).into()),
        Value::F64(x) => MetaValue::Float(*x),
        Value::Bool(x) => MetaValue::Bool(*x),
        Value::Str(s) => MetaValue::Str(s.as_str().into()),
        Value::Array(a) => match a {
            Array::U8(v) => MetaValue::UIntArray(v.iter().map(|&x| x.into()).collect()),
            Array::U16(v) => MetaValue::UIntArray(v.iter().map(|&x| x.into()).collect()),
            Array::U32(v) => MetaValue::UIntArray(v.iter().map(|&x| x.into()).collect()),
            Array::U64(v) => MetaValue::UIntArray(v.iter().copied().collect()),
            Array::I8(v) => MetaValue::IntArray(v.iter().map(|&x| x.into()).collect()),
            Array::I16(v) => MetaValue::IntArray(v.iter().map(|&x| x.into()).collect()),
            Array::I32(v) => MetaValue::IntArray(v.iter().map(|&x| x.into()).collect()),
            Array::I64(v) => MetaValue::IntArray(v.iter().copied().collect()),
            Array::F32(v) => MetaValue::FloatArray(v.iter().map(|&x| x.into()).collect()),
            Array::F64(v) => MetaValue::FloatArray(v.iter().copied().collect()),
            Array::Bool(v) => MetaValue::BoolArray(v.iter().copied().collect()),
            Array::Str(v) => MetaValue::StrArray(v.iter().map(|s| s.as_str().into()).collect()),
            Array::Array(_) => MetaValue::Json(array_json(a).to_string().into()),
        },
    }
}

/// An array as JSON; non-finite floats become `null` (JSON has no NaN or infinity).
pub fn array_json(a: &Array) -> serde_json::Value {
    use serde_json::Value as J;
    fn list<T: Copy>(v: &[T], f: impl Fn(T) -> J) -> J {
        J::Array(v.iter().map(|&x| f(x)).collect())
    }
    let float = |x: f64| serde_json::Number::from_f64(x).map_or(J::Null, J::Number);
    match a {
        Array::U8(v) => list(v, J::from),
        Array::I8(v) => list(v, J::from),
        Array::U16(v) => list(v, J::from),
        Array::I16(v) => list(v, J::from),
        Array::U32(v) => list(v, J::from),
        Array::I32(v) => list(v, J::from),
        Array::U64(v) => list(v, J::from),
        Array::I64(v) => list(v, J::from),
        Array::F32(v) => list(v, |x| float(x.into())),
        Array::F64(v) => list(v, float),
        Array::Bool(v) => list(v, J::Bool),
        Array::Str(v) => J::Array(v.iter().map(|s| J::String(s.clone())).collect()),
        Array::Array(v) => J::Array(v.iter().map(array_json).collect()),
    }
}
