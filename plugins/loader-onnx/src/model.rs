//! A loaded ONNX model's initializers: validated, named as stored, and backed by the memory
//! map of the model file (raw data), of external data files, or by a small owned buffer
//! (typed fields, converted to their stored little-endian layout). Usable without a host
//! through [`StdFs`].

use crate::{
    error::{Error, Result},
    proto::{
        AttributeProto, DATA_LOCATION_EXTERNAL, GraphProto, ModelProto, NodeProto, TensorProto,
        ValueInfoProto, attribute_type, data_type,
    },
};
use bytes::Bytes;
use prost::Message;
use serde_json::Value;
use std::{
    collections::HashMap,
    path::{Component, Path, PathBuf},
};
use u_sdk::{DType, MetaValue, TensorInfo, TensorView, files, weights};

/// The largest `config.json` accepted (16 MiB).
pub const MAX_CONFIG_LEN: u64 = 16 * 1024 * 1024;

pub use u_sdk::files::{FileOpener, StdFs};

/// Where a tensor's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// `raw_data` inside the model file: a slice of its map.
    Raw,
    /// Typed fields (`float_data`, `int32_data`…), converted into an owned buffer.
    Typed,
    /// An external data file: a slice of its map.
    External,
    /// An anonymous `MatMul` constant transposed into PyTorch's `[out, in]` layout (an owned
    /// copy; see [`OnnxModel::open`]).
    Transposed,
}

/// One initializer of the model.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Name as stored in the model.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Where the bytes live.
    pub storage: Storage,
    data: Bytes,
}

impl Tensor {
    /// The tensor's description for the ABI.
    pub fn info(&self) -> TensorInfo {
        TensorInfo {
            name: self.name.as_str().into(),
            dtype: self.dtype,
            shape: self.shape.clone().into(),
            byte_len: self.data.len() as u64,
        }
    }

    /// The stored bytes (little-endian).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

/// A loaded ONNX model (its initializers and metadata).
#[derive(Debug)]
pub struct OnnxModel {
    tensors: Vec<Tensor>,
    by_name: HashMap<String, usize>,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    architecture: Option<String>,
}

/// Resolves external data files relative to the model's directory, mapping each once.
struct Externals<'a> {
    opener: &'a dyn FileOpener,
    dir: PathBuf,
    maps: HashMap<PathBuf, Bytes>,
}

impl OnnxModel {
    /// Opens an `.onnx` file; external data files are resolved relative to its directory, and
    /// a `config.json` there, if present and readable, supplies metadata (`config.*`), as does
    /// an image model's `preprocessor_config.json` (`preprocessor.*`).
    ///
    /// Initializers PyTorch's exporter left anonymous (`onnx::MatMul_1966`: constants it made
    /// or folded) are named after the one node that reads them, whose name is the module's
    /// scope: the right-hand side of a `MatMul` at `/backbone/encoder/layer.0/mlp/fc1/MatMul`
    /// is that linear layer's weight, folded as `weight.T`, so it becomes
    /// `backbone.encoder.layer.0.mlp.fc1.weight` in PyTorch's `[out, in]` layout (transposed
    /// once into an owned buffer); any other becomes `<scope>.<node>.<input index>`
    /// (`backbone.embeddings.Concat_6.0`). The stored name still finds it.
    pub fn open(opener: &dyn FileOpener, path: &Path) -> Result<Self> {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let data = map_file(opener, path)?;
        let config_path = dir.join("config.json");
        let config = files::read_optional(opener, &config_path, MAX_CONFIG_LEN)?
            .map(|bytes| parse_config(&config_path, &bytes))
            .transpose()?;
        let processor_path = dir.join("preprocessor_config.json");
        let processor = files::read_optional(opener, &processor_path, MAX_CONFIG_LEN)?
            .map(|bytes| parse_config(&processor_path, &bytes))
            .transpose()?;
        let mut ext = Externals {
            opener,
            dir,
            maps: HashMap::new(),
        };
        let mut model = Self::parse(data, path, Some(&mut ext), config)?;
        if let Some((path, doc)) = processor {
            let entries =
                weights::json_metadata("preprocessor", &doc).ok_or_else(|| Error::Config {
                    path,
                    reason: "not a JSON object".into(),
                })?;
            for (key, value) in entries {
                if !model.meta_index.contains_key(&key) {
                    model.meta_index.insert(key.clone(), model.metadata.len());
                    model.metadata.push((key, value));
                }
            }
        }
        Ok(model)
    }

    /// Parses a model held in memory, with an optional `config.json` document. External data
    /// cannot be resolved (there is no directory): such initializers are an error. For tests
    /// and fuzzing.
    pub fn from_bytes(bytes: Vec<u8>, config: Option<&[u8]>) -> Result<Self> {
        let config = config
            .map(|c| parse_config(Path::new("config.json"), c))
            .transpose()?;
        Self::parse(Bytes::from(bytes), Path::new("<memory>"), None, config)
    }

    fn parse(
        data: Bytes,
        path: &Path,
        mut ext: Option<&mut Externals<'_>>,
        config: Option<(PathBuf, serde_json::Value)>,
    ) -> Result<Self> {
        let model = ModelProto::decode(data).map_err(|e| Error::Protobuf {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let graph = model.graph.as_ref().ok_or_else(|| Error::NoGraph {
            path: path.to_path_buf(),
        })?;

        let mut metadata = Vec::new();
        if let Some((cpath, cfg)) = &config {
            metadata = weights::config_metadata(cfg).map_err(|reason| Error::Config {
                path: cpath.clone(),
                reason,
            })?;
        }
        let architecture = metadata
            .iter()
            .find(|(k, _)| k == "config.model_type")
            .and_then(|(_, v)| v.as_str())
            .map(str::to_string);

        let mut tensors: Vec<Tensor> = Vec::with_capacity(graph.initializer.len());
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for t in &graph.initializer {
            if by_name.contains_key(&t.name) {
                return Err(Error::NameClash {
                    name: t.name.clone(),
                });
            }
            let (dtype, shape, storage, data) = resolve(t, ext.as_deref_mut())?;
            by_name.insert(t.name.clone(), tensors.len());
            tensors.push(Tensor {
                name: t.name.clone(),
                dtype,
                shape,
                storage,
                data,
            });
        }

        let mut renamed = serde_json::Map::new();
        for (i, name, transpose) in scope_names(graph, &tensors) {
            let t = &mut tensors[i];
            renamed.insert(
                t.name.clone(),
                serde_json::json!({ "name": name, "transposed": transpose }),
            );
            if transpose {
                let (rows, cols) = (t.shape[0], t.shape[1]);
                t.data = Bytes::from(transposed(&t.data, rows as usize, cols as usize));
                t.shape = vec![cols, rows];
                t.storage = Storage::Transposed;
            }
            by_name.insert(name.clone(), i);
            t.name = name;
        }

        metadata.extend(onnx_metadata(&model));
        metadata.push((
            GRAPH_KEY.to_string(),
            MetaValue::Json(graph_json(graph, renamed).to_string().into()),
        ));
        let architecture =
            architecture.or_else(|| (!graph.node.is_empty()).then(|| GRAPH_FAMILY.to_string()));
        let mut meta_index = HashMap::new();
        metadata.retain(|(k, _)| {
            !meta_index.contains_key(k) && {
                meta_index.insert(k.clone(), meta_index.len());
                true
            }
        });
        Ok(OnnxModel {
            tensors,
            by_name,
            metadata,
            meta_index,
            architecture,
        })
    }

    /// All initializers, in graph order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// An initializer by name.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A view of an initializer by name (no copy).
    pub fn view(&self, name: &str) -> Result<TensorView<'_>> {
        let t = self
            .tensor(name)
            .ok_or_else(|| Error::NoTensor(name.to_string()))?;
        Ok(TensorView {
            dtype: t.dtype,
            shape: t.shape.clone().into(),
            data: t.bytes().into(),
        })
    }

    /// An initializer's values converted to `f32` (a copy).
    pub fn tensor_f32(&self, name: &str) -> u_sdk::Result<Vec<f32>> {
        self.view(name)?.to_f32()
    }

    /// Metadata, in a stable order: `config.*` from `config.json`, then `onnx.*` from the model,
    /// then `preprocessor.*` from `preprocessor_config.json`.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// One metadata value.
    pub fn metadata_value(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// The architecture as `config.json`'s `model_type` names it; without one, a graph that has
    /// nodes is [`GRAPH_FAMILY`], for an architecture that runs the graph itself.
    pub fn architecture(&self) -> Option<&str> {
        self.architecture.as_deref()
    }
}

/// The family of an ONNX file that no `config.json` names: its graph is the architecture.
pub const GRAPH_FAMILY: &str = "onnx_graph";

/// The metadata key holding the graph as JSON (see [`graph_json`]).
pub const GRAPH_KEY: &str = "onnx.graph";

/// The graph an architecture needs to run it, as JSON:
///
/// - `inputs`, `outputs`: `{name, elem_type, shape}`, a dimension a number or a symbol;
/// - `nodes`: `{op, domain, name, inputs, outputs, attributes}` in graph order, an attribute
///   a number, a string, a list, or a tensor `{dims, values}` (infinities and NaN as the
///   strings `inf`, `-inf`, `nan`; `{error}` where its data cannot be read);
/// - `renamed`: the initializers the loader named after their readers, `{name, transposed}`
///   by the graph's name of them (a transposed one is stored `[cols, rows]`).
pub fn graph_json(graph: &GraphProto, renamed: serde_json::Map<String, Value>) -> Value {
    let value_info = |v: &ValueInfoProto| {
        let tensor = v.r#type.as_ref().and_then(|t| t.tensor_type.as_ref());
        let shape: Option<Vec<Value>> = tensor.and_then(|t| t.shape.as_ref()).map(|s| {
            s.dim
                .iter()
                .map(|d| match (&d.dim_value, &d.dim_param) {
                    (Some(n), _) => Value::from(*n),
                    (None, Some(p)) => Value::from(p.as_str()),
                    (None, None) => Value::Null,
                })
                .collect()
        });
        serde_json::json!({
            "name": v.name,
            "elem_type": tensor.map_or(0, |t| t.elem_type),
            "shape": shape,
        })
    };
    let initialized: std::collections::HashSet<&str> =
        graph.initializer.iter().map(|t| t.name.as_str()).collect();
    let nodes: Vec<Value> = graph
        .node
        .iter()
        .map(|n| {
            let attributes: serde_json::Map<String, Value> = n
                .attribute
                .iter()
                .map(|a| (a.name.clone(), attribute_json(a)))
                .collect();
            serde_json::json!({
                "op": n.op_type,
                "domain": n.domain,
                "name": n.name,
                "inputs": n.input,
                "outputs": n.output,
                "attributes": attributes,
            })
        })
        .collect();
    serde_json::json!({
        "inputs": graph
            .input
            .iter()
            .filter(|v| !initialized.contains(v.name.as_str()))
            .map(value_info)
            .collect::<Vec<_>>(),
        "outputs": graph.output.iter().map(value_info).collect::<Vec<_>>(),
        "nodes": nodes,
        "renamed": renamed,
    })
}

/// One attribute's value as JSON.
fn attribute_json(a: &AttributeProto) -> Value {
    let text = |b: &[u8]| Value::from(String::from_utf8_lossy(b).into_owned());
    match a.r#type {
        attribute_type::FLOAT => Value::from(f64::from(a.f)),
        attribute_type::INT => Value::from(a.i),
        attribute_type::STRING => text(&a.s),
        attribute_type::FLOATS => a.floats.iter().map(|&f| f64::from(f)).collect(),
        attribute_type::INTS => a.ints.iter().copied().collect(),
        attribute_type::STRINGS => a.strings.iter().map(|s| text(s)).collect(),
        attribute_type::TENSOR => match a.t.as_ref().map(tensor_json) {
            Some(Ok(v)) => v,
            Some(Err(e)) => serde_json::json!({ "error": e.to_string() }),
            None => serde_json::json!({ "error": "no tensor" }),
        },
        other => serde_json::json!({ "error": format!("attribute type {other} is not read") }),
    }
}

/// A tensor attribute's dims and values (numbers) as JSON.
fn tensor_json(t: &TensorProto) -> Result<Value> {
    let (dtype, shape, _, data) = resolve(t, None)?;
    // JSON has no infinities or NaN: those are the strings `inf`, `-inf` and `nan`.
    let float = |v: f64| match v {
        v if v.is_finite() => Value::from(v),
        v if v.is_nan() => Value::from("nan"),
        v if v > 0.0 => Value::from("inf"),
        _ => Value::from("-inf"),
    };
    let values: Vec<Value> = match dtype {
        DType::F32 => data
            .chunks_exact(4)
            .map(|c| float(f64::from(f32::from_le_bytes(c.try_into().unwrap()))))
            .collect(),
        DType::F64 => data
            .chunks_exact(8)
            .map(|c| float(f64::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        DType::I64 => data
            .chunks_exact(8)
            .map(|c| Value::from(i64::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        DType::I32 => data
            .chunks_exact(4)
            .map(|c| Value::from(i32::from_le_bytes(c.try_into().unwrap())))
            .collect(),
        other => {
            return Err(Error::Tensor {
                name: t.name.clone(),
                reason: format!("a {other} tensor attribute is not read"),
            });
        }
    };
    Ok(
        serde_json::json!({ "dims": shape, "values": values, "integer": matches!(dtype, DType::I64 | DType::I32) }),
    )
}

fn onnx_metadata(model: &ModelProto) -> Vec<(String, MetaValue)> {
    let s = |v: &str| MetaValue::Str(v.into());
    let mut out = vec![(
        "onnx.ir_version".to_string(),
        MetaValue::Int(model.ir_version),
    )];
    for (key, value) in [
        ("onnx.producer_name", &model.producer_name),
        ("onnx.producer_version", &model.producer_version),
        ("onnx.domain", &model.domain),
    ] {
        if !value.is_empty() {
            out.push((key.to_string(), s(value)));
        }
    }
    if model.model_version != 0 {
        out.push((
            "onnx.model_version".to_string(),
            MetaValue::Int(model.model_version),
        ));
    }
    if let Some(g) = model.graph.as_ref().filter(|g| !g.name.is_empty()) {
        out.push(("onnx.graph_name".to_string(), s(&g.name)));
    }
    for op in &model.opset_import {
        let domain = if op.domain.is_empty() {
            "ai.onnx"
        } else {
            &op.domain
        };
        out.push((format!("onnx.opset.{domain}"), MetaValue::Int(op.version)));
    }
    for p in &model.metadata_props {
        out.push((format!("onnx.meta.{}", p.key), s(&p.value)));
    }
    out
}

/// Maps an ONNX data type code to a dtype.
pub fn dtype_of(code: i32) -> Option<DType> {
    Some(match code {
        data_type::FLOAT => DType::F32,
        data_type::FLOAT16 => DType::F16,
        data_type::BFLOAT16 => DType::BF16,
        data_type::DOUBLE => DType::F64,
        data_type::INT8 => DType::I8,
        data_type::UINT8 => DType::U8,
        data_type::INT16 => DType::I16,
        data_type::INT32 => DType::I32,
        data_type::INT64 => DType::I64,
        _ => return None,
    })
}

/// The prefix PyTorch's exporter gives the constants it makes or folds: a name that says
/// nothing of the module the tensor belongs to.
const ANONYMOUS: &str = "onnx::";

/// Module-scope names for the anonymous initializers among `tensors` (see [`OnnxModel::open`]):
/// `(index, name, transpose)` for each that exactly one node reads, that node named by a scope
/// (`/a/b/Op`), the name clashing with no other.
fn scope_names(graph: &GraphProto, tensors: &[Tensor]) -> Vec<(usize, String, bool)> {
    let index: HashMap<&str, usize> = tensors
        .iter()
        .enumerate()
        .filter(|(_, t)| t.name.starts_with(ANONYMOUS))
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut readers: HashMap<usize, Vec<(&NodeProto, usize)>> = HashMap::new();
    for node in &graph.node {
        for (slot, input) in node.input.iter().enumerate() {
            if let Some(&i) = index.get(input.as_str()) {
                readers.entry(i).or_default().push((node, slot));
            }
        }
    }
    let mut named: Vec<(usize, String, bool)> = readers
        .into_iter()
        .filter_map(|(i, uses)| {
            let [(node, slot)] = uses[..] else {
                return None;
            };
            let path = node.name.strip_prefix('/')?;
            let (scope, op) = path.rsplit_once('/')?;
            if scope.is_empty() || op.is_empty() {
                return None;
            }
            let scope = scope.replace('/', ".");
            let transpose = node.op_type == "MatMul" && slot == 1 && tensors[i].shape.len() == 2;
            Some(if transpose {
                (i, format!("{scope}.weight"), true)
            } else {
                (i, format!("{scope}.{op}.{slot}"), false)
            })
        })
        .collect();
    let mut count: HashMap<String, usize> = HashMap::new();
    for (_, name, _) in &named {
        *count.entry(name.clone()).or_default() += 1;
    }
    let stored: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    named.retain(|(_, name, _)| count[name] == 1 && !stored.contains(name.as_str()));
    named.sort_by_key(|(i, _, _)| *i);
    named
}

/// A row-major `rows × cols` matrix of `bytes` (elements of `bytes.len() / (rows · cols)`
/// bytes) transposed to `cols × rows`.
fn transposed(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let size = bytes.len() / (rows * cols).max(1);
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let from = (r * cols + c) * size;
            let to = (c * rows + r) * size;
            out[to..to + size].copy_from_slice(&bytes[from..from + size]);
        }
    }
    out
}

/// Validates one initializer and finds its bytes.
fn resolve(
    t: &TensorProto,
    ext: Option<&mut Externals<'_>>,
) -> Result<(DType, Vec<u64>, Storage, Bytes)> {
    let bad = |reason: String| Error::Tensor {
        name: t.name.clone(),
        reason,
    };
    let dtype = dtype_of(t.data_type).ok_or_else(|| Error::UnsupportedType {
        name: t.name.clone(),
        data_type: data_type::name(t.data_type),
        code: t.data_type,
    })?;
    let shape = t
        .dims
        .iter()
        .map(|&d| u64::try_from(d))
        .collect::<std::result::Result<Vec<u64>, _>>()
        .map_err(|_| bad(format!("negative dimension in {:?}", t.dims)))?;
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let need = dtype
        .bytes_for(elements)
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;

    if t.data_location == DATA_LOCATION_EXTERNAL {
        let ext = ext.ok_or_else(|| Error::External {
            name: t.name.clone(),
            reason: "the model was not loaded from a file, so external data cannot be resolved"
                .to_string(),
        })?;
        let data = ext.slice(t, need)?;
        return Ok((dtype, shape, Storage::External, data));
    }
    if t.data_location != 0 {
        return Err(bad(format!("unknown data_location {}", t.data_location)));
    }
    if !t.raw_data.is_empty() || need == 0 {
        if t.raw_data.len() as u64 != need {
            return Err(bad(format!(
                "raw_data holds {} bytes but {dtype} {shape:?} needs {need}",
                t.raw_data.len()
            )));
        }
        return Ok((dtype, shape, Storage::Raw, t.raw_data.clone()));
    }
    let data = typed_bytes(t, dtype, elements).map_err(bad)?;
    Ok((dtype, shape, Storage::Typed, Bytes::from(data)))
}

/// Converts typed fields to the stored little-endian layout of `dtype`, checking the count and
/// each value's range.
fn typed_bytes(
    t: &TensorProto,
    dtype: DType,
    elements: u64,
) -> std::result::Result<Vec<u8>, String> {
    let count = |n: usize, field: &str| {
        if n as u64 == elements {
            Ok(())
        } else {
            Err(format!(
                "{field} holds {n} values but the shape has {elements} (and raw_data is empty)"
            ))
        }
    };
    let narrow = |lo: i32, hi: i32| -> std::result::Result<(), String> {
        count(t.int32_data.len(), "int32_data")?;
        match t.int32_data.iter().find(|&&v| v < lo || v > hi) {
            Some(v) => Err(format!("int32_data value {v} does not fit {dtype}")),
            None => Ok(()),
        }
    };
    Ok(match dtype {
        DType::F32 => {
            count(t.float_data.len(), "float_data")?;
            t.float_data.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        DType::F64 => {
            count(t.double_data.len(), "double_data")?;
            t.double_data.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        DType::I64 => {
            count(t.int64_data.len(), "int64_data")?;
            t.int64_data.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        DType::I32 => {
            count(t.int32_data.len(), "int32_data")?;
            t.int32_data.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        DType::I16 => {
            narrow(i16::MIN.into(), i16::MAX.into())?;
            t.int32_data
                .iter()
                .flat_map(|&v| (v as i16).to_le_bytes())
                .collect()
        }
        // 16-bit float bit patterns, written by ONNX as unsigned (accept sign-extended too).
        DType::F16 | DType::BF16 => {
            narrow(i16::MIN.into(), u16::MAX.into())?;
            t.int32_data
                .iter()
                .flat_map(|&v| (v as u16).to_le_bytes())
                .collect()
        }
        DType::I8 => {
            narrow(i8::MIN.into(), i8::MAX.into())?;
            t.int32_data.iter().map(|&v| v as i8 as u8).collect()
        }
        DType::U8 => {
            narrow(0, u8::MAX.into())?;
            t.int32_data.iter().map(|&v| v as u8).collect()
        }
        other => return Err(format!("typed fields of {other} are not supported")),
    })
}

impl Externals<'_> {
    /// The bytes of an external-data initializer: validated `location`, `offset`, `length`.
    fn slice(&mut self, t: &TensorProto, need: u64) -> Result<Bytes> {
        let err = |reason: String| Error::External {
            name: t.name.clone(),
            reason,
        };
        let (mut location, mut offset, mut length) = (None, 0u64, None);
        for kv in &t.external_data {
            match kv.key.as_str() {
                "location" => location = Some(kv.value.as_str()),
                "offset" => {
                    offset = kv
                        .value
                        .parse()
                        .map_err(|_| err(format!("offset `{}` is not a number", kv.value)))?
                }
                "length" => {
                    length = Some(
                        kv.value
                            .parse::<u64>()
                            .map_err(|_| err(format!("length `{}` is not a number", kv.value)))?,
                    )
                }
                _ => {} // checksum and future keys
            }
        }
        let location = location.ok_or_else(|| err("no `location` key".to_string()))?;
        let rel = Path::new(location);
        if location.is_empty()
            || location.contains('\0')
            || !rel.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(err(format!(
                "location `{location}` must be a relative path inside the model's directory"
            )));
        }
        let path = self.dir.join(rel);
        let data = match self.maps.get(&path) {
            Some(d) => d.clone(),
            None => {
                let d = map_file(self.opener, &path)?;
                self.maps.insert(path.clone(), d.clone());
                d
            }
        };
        let file_len = data.len() as u64;
        let length = length.unwrap_or(need);
        if length != need {
            return Err(err(format!(
                "length {length} but the tensor needs {need} bytes"
            )));
        }
        let end = offset
            .checked_add(length)
            .filter(|&e| e <= file_len)
            .ok_or_else(|| {
                err(format!(
                    "bytes {offset}..+{length} run past the end of {} ({file_len} bytes)",
                    path.display()
                ))
            })?;
        // Both bounds are ≤ the mapped length, so they fit in usize.
        Ok(data.slice(offset as usize..end as usize))
    }
}

fn parse_config(path: &Path, bytes: &[u8]) -> Result<(PathBuf, serde_json::Value)> {
    serde_json::from_slice(bytes)
        .map(|v| (path.to_path_buf(), v))
        .map_err(|e| Error::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// Memory-maps a whole regular file into a [`Bytes`] that owns the map.
fn map_file(opener: &dyn FileOpener, path: &Path) -> Result<Bytes> {
    Ok(Bytes::from_owner(files::map_file(opener, path)?))
}
