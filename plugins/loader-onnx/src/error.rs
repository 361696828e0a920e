//! Errors of the ONNX loader.

use std::path::PathBuf;
use u_sdk::{ErrorKind, UError, files::FileError};

/// An error of the ONNX loader.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file is not a decodable `ModelProto`.
    #[error("{path}: not a valid ONNX model (protobuf): {reason}")]
    Protobuf {
        /// The model file.
        path: PathBuf,
        /// The decoder's explanation.
        reason: String,
    },
    /// The model has no graph.
    #[error("{path}: the model has no graph")]
    NoGraph {
        /// The model file.
        path: PathBuf,
    },
    /// An initializer that is malformed.
    #[error("initializer `{name}`: {reason}")]
    Tensor {
        /// Initializer name as stored.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// An initializer of a type this loader cannot represent.
    #[error(
        "initializer `{name}`: data type {data_type} ({code}) is not supported (supported: FLOAT, FLOAT16, BFLOAT16, DOUBLE, INT8, UINT8, INT16, INT32, INT64)"
    )]
    UnsupportedType {
        /// Initializer name as stored.
        name: String,
        /// ONNX type name.
        data_type: &'static str,
        /// ONNX type code.
        code: i32,
    },
    /// An external-data reference that is malformed or points outside what is allowed.
    #[error("initializer `{name}`: external data: {reason}")]
    External {
        /// Initializer name as stored.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// Two initializers with one name.
    #[error("two initializers are named `{name}`")]
    NameClash {
        /// The name.
        name: String,
    },
    /// A malformed `config.json`.
    #[error("{path}: bad config.json: {reason}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file that could not be read.
    #[error(transparent)]
    File(#[from] FileError),
    /// A tensor name that is not in the weight set.
    #[error("no tensor named `{0}`")]
    NoTensor(String),
}

impl From<Error> for UError {
    fn from(e: Error) -> Self {
        let kind = match &e {
            Error::Protobuf { .. }
            | Error::NoGraph { .. }
            | Error::Tensor { .. }
            | Error::External { .. }
            | Error::NameClash { .. }
            | Error::Config { .. } => ErrorKind::InvalidInput,
            Error::UnsupportedType { .. } => ErrorKind::Unsupported,
            Error::NoTensor(_) => ErrorKind::NotFound,
            Error::File(f) => f.kind(),
        };
        UError::new(kind, format!("loader-onnx: {e}"))
    }
}

/// The loader's result type.
pub type Result<T> = std::result::Result<T, Error>;
