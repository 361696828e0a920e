//! The subset of ONNX's protobuf schema (`onnx.proto3`) the loader needs, written by hand with
//! `prost` derives so the build needs no `protoc`. Field numbers follow `onnx/onnx.proto`; every
//! other field (value infos of intermediate values, doc strings, subgraphs…) is skipped by the
//! decoder as unknown.
//!
//! `raw_data` is a [`Bytes`]: decoding from a `Bytes` buffer that owns the memory map makes it a
//! slice of the map, not a copy.

use bytes::Bytes;

/// `ModelProto`: the top-level message of an `.onnx` file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelProto {
    /// IR version of the file format.
    #[prost(int64, tag = "1")]
    pub ir_version: i64,
    /// Operator sets the graph uses.
    #[prost(message, repeated, tag = "8")]
    pub opset_import: Vec<OperatorSetIdProto>,
    /// Tool that wrote the file (e.g. `pytorch`).
    #[prost(string, tag = "2")]
    pub producer_name: String,
    /// Version of that tool.
    #[prost(string, tag = "3")]
    pub producer_version: String,
    /// Reverse-DNS namespace of the model.
    #[prost(string, tag = "4")]
    pub domain: String,
    /// Version of the model.
    #[prost(int64, tag = "5")]
    pub model_version: i64,
    /// The graph, holding the initializers (weights).
    #[prost(message, optional, tag = "7")]
    pub graph: Option<GraphProto>,
    /// Free-form string properties.
    #[prost(message, repeated, tag = "14")]
    pub metadata_props: Vec<StringStringEntryProto>,
}

/// `OperatorSetIdProto`: one operator set import.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OperatorSetIdProto {
    /// Domain (empty for the default `ai.onnx`).
    #[prost(string, tag = "1")]
    pub domain: String,
    /// Operator set version.
    #[prost(int64, tag = "2")]
    pub version: i64,
}

/// `GraphProto`: the name, the nodes, the initializers and the graph's inputs and outputs are
/// read.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GraphProto {
    /// The computation, in topological order.
    #[prost(message, repeated, tag = "1")]
    pub node: Vec<NodeProto>,
    /// Graph name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// Constant tensors: the model's weights.
    #[prost(message, repeated, tag = "5")]
    pub initializer: Vec<TensorProto>,
    /// The values a caller feeds (and, in old files, the initializers again).
    #[prost(message, repeated, tag = "11")]
    pub input: Vec<ValueInfoProto>,
    /// The values the graph produces.
    #[prost(message, repeated, tag = "12")]
    pub output: Vec<ValueInfoProto>,
}

/// `ValueInfoProto`: a named value and its type.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueInfoProto {
    /// The value's name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its type (only tensor types are read).
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
}

/// `TypeProto`: of its variants only `tensor_type` is read.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TypeProto {
    /// A tensor's element type and shape.
    #[prost(message, optional, tag = "1")]
    pub tensor_type: Option<TensorTypeProto>,
}

/// `TypeProto.Tensor`: element type and shape.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorTypeProto {
    /// Element type (`TensorProto.DataType`).
    #[prost(int32, tag = "1")]
    pub elem_type: i32,
    /// Shape, when known.
    #[prost(message, optional, tag = "2")]
    pub shape: Option<TensorShapeProto>,
}

/// `TensorShapeProto`: dimensions, outermost first.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    /// The dimensions.
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<Dimension>,
}

/// `TensorShapeProto.Dimension`: a fixed size or a named (symbolic) one.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Dimension {
    /// A fixed size.
    #[prost(int64, optional, tag = "1")]
    pub dim_value: Option<i64>,
    /// A symbol (`batch`).
    #[prost(string, optional, tag = "2")]
    pub dim_param: Option<String>,
}

/// `AttributeProto`: one named operator attribute.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AttributeProto {
    /// Attribute name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// A float value.
    #[prost(float, tag = "2")]
    pub f: f32,
    /// An integer value.
    #[prost(int64, tag = "3")]
    pub i: i64,
    /// A string value (bytes).
    #[prost(bytes = "vec", tag = "4")]
    pub s: Vec<u8>,
    /// A tensor value (a `Constant`'s).
    #[prost(message, optional, tag = "5")]
    pub t: Option<TensorProto>,
    /// Float values.
    #[prost(float, repeated, tag = "7")]
    pub floats: Vec<f32>,
    /// Integer values.
    #[prost(int64, repeated, tag = "8")]
    pub ints: Vec<i64>,
    /// String values.
    #[prost(bytes = "vec", repeated, tag = "9")]
    pub strings: Vec<Vec<u8>>,
    /// Which of the fields holds the value (`AttributeProto.AttributeType`).
    #[prost(int32, tag = "20")]
    pub r#type: i32,
}

/// ONNX `AttributeProto.AttributeType` codes.
pub mod attribute_type {
    /// `f`
    pub const FLOAT: i32 = 1;
    /// `i`
    pub const INT: i32 = 2;
    /// `s`
    pub const STRING: i32 = 3;
    /// `t`
    pub const TENSOR: i32 = 4;
    /// `floats`
    pub const FLOATS: i32 = 6;
    /// `ints`
    pub const INTS: i32 = 7;
    /// `strings`
    pub const STRINGS: i32 = 8;
}

/// `NodeProto`: one operator call: its wiring, name, operator and attributes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeProto {
    /// Names of the values it reads (an empty name: an optional input left out).
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    /// Names of the values it writes.
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    /// Node name; PyTorch's exporter writes the module scope and the operator
    /// (`/backbone/encoder/layer.0/attention/attention/query/MatMul`).
    #[prost(string, tag = "3")]
    pub name: String,
    /// Operator (`MatMul`, `Concat`…).
    #[prost(string, tag = "4")]
    pub op_type: String,
    /// The operator's attributes.
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
    /// The operator set's domain (empty: `ai.onnx`).
    #[prost(string, tag = "7")]
    pub domain: String,
}

/// `TensorProto`: one tensor, its data inline (raw or typed) or in an external file.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    /// Dimensions, outermost first.
    #[prost(int64, repeated, tag = "1")]
    pub dims: Vec<i64>,
    /// Element type (`TensorProto.DataType`).
    #[prost(int32, tag = "2")]
    pub data_type: i32,
    /// FLOAT (and COMPLEX64) values.
    #[prost(float, repeated, tag = "4")]
    pub float_data: Vec<f32>,
    /// INT32, INT16, INT8, UINT16, UINT8, BOOL, FLOAT16 and BFLOAT16 (bit patterns) values.
    #[prost(int32, repeated, tag = "5")]
    pub int32_data: Vec<i32>,
    /// INT64 values.
    #[prost(int64, repeated, tag = "7")]
    pub int64_data: Vec<i64>,
    /// Tensor name.
    #[prost(string, tag = "8")]
    pub name: String,
    /// Little-endian packed values of any fixed-size type.
    #[prost(bytes = "bytes", tag = "9")]
    pub raw_data: Bytes,
    /// DOUBLE (and COMPLEX128) values.
    #[prost(double, repeated, tag = "10")]
    pub double_data: Vec<f64>,
    /// UINT32 and UINT64 values.
    #[prost(uint64, repeated, tag = "11")]
    pub uint64_data: Vec<u64>,
    /// `location`, `offset`, `length`, `checksum` of external data.
    #[prost(message, repeated, tag = "13")]
    pub external_data: Vec<StringStringEntryProto>,
    /// 0 = DEFAULT (inline), 1 = EXTERNAL.
    #[prost(int32, tag = "14")]
    pub data_location: i32,
}

/// `StringStringEntryProto`: a key/value pair.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StringStringEntryProto {
    /// Key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// Value.
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `TensorProto.DataLocation.EXTERNAL`.
pub const DATA_LOCATION_EXTERNAL: i32 = 1;

/// ONNX `TensorProto.DataType` codes.
pub mod data_type {
    /// float32
    pub const FLOAT: i32 = 1;
    /// uint8
    pub const UINT8: i32 = 2;
    /// int8
    pub const INT8: i32 = 3;
    /// uint16
    pub const UINT16: i32 = 4;
    /// int16
    pub const INT16: i32 = 5;
    /// int32
    pub const INT32: i32 = 6;
    /// int64
    pub const INT64: i32 = 7;
    /// string
    pub const STRING: i32 = 8;
    /// bool
    pub const BOOL: i32 = 9;
    /// float16
    pub const FLOAT16: i32 = 10;
    /// float64
    pub const DOUBLE: i32 = 11;
    /// uint32
    pub const UINT32: i32 = 12;
    /// uint64
    pub const UINT64: i32 = 13;
    /// bfloat16
    pub const BFLOAT16: i32 = 16;

    /// The ONNX spelling of a data type code, for error messages.
    pub fn name(code: i32) -> &'static str {
        match code {
            0 => "UNDEFINED",
            FLOAT => "FLOAT",
            UINT8 => "UINT8",
            INT8 => "INT8",
            UINT16 => "UINT16",
            INT16 => "INT16",
            INT32 => "INT32",
            INT64 => "INT64",
            STRING => "STRING",
            BOOL => "BOOL",
            FLOAT16 => "FLOAT16",
            DOUBLE => "DOUBLE",
            UINT32 => "UINT32",
            UINT64 => "UINT64",
            14 => "COMPLEX64",
            15 => "COMPLEX128",
            BFLOAT16 => "BFLOAT16",
            17..=20 => "FLOAT8",
            21 => "UINT4",
            22 => "INT4",
            23 => "FLOAT4E2M1",
            _ => "unknown",
        }
    }
}
