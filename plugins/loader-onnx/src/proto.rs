//! The subset of ONNX's protobuf schema (`onnx.proto3`) the loader needs, written by hand with
//! `prost` derives so the build needs no `protoc`. Field numbers follow `onnx/onnx.proto`; every
//! other field (node attributes, value infos, doc strings…) is skipped by the decoder as
//! unknown.
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

/// `GraphProto`: the name, the nodes (how they are wired, to name the initializers an
/// exporter left anonymous) and the initializers are read.
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
}

/// `NodeProto`: one operator call. Only its wiring, name and operator are read (attributes,
/// such as a `Constant`'s value, are skipped).
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
