//! Errors of the ONNX loader.

use std::path::PathBuf;
use u_sdk::{ErrorKind, UError};

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
    /// Two initializers with one name, or two names with one canonical name.
    #[error("initializers `{first}` and `{second}` both map to the name `{canonical}`")]
    NameClash {
        /// One stored name.
        first: String,
        /// The other.
        second: String,
        /// The shared (canonical) name.
        canonical: String,
    },
    /// A malformed `config.json`.
    #[error("{path}: bad config.json: {reason}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file does not exist.
    #[error("{path}: not found")]
    NotFound {
        /// The file.
        path: PathBuf,
    },
    /// The host (or OS) refused access to a file.
    #[error("{path}: access denied: {reason}")]
    Denied {
        /// The file.
        path: PathBuf,
        /// The host's explanation.
        reason: String,
    },
    /// Any other I/O failure.
    #[error("{path}: {reason}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        reason: String,
    },
    /// A file bigger than the loader accepts.
    #[error("{path}: {reason}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A tensor name that is not in the weight set.
    #[error("no tensor named `{0}`")]
    NoTensor(String),
}

impl Error {
    /// Whether the file is simply absent or not granted (optional files are then skipped).
    pub fn is_absent(&self) -> bool {
        matches!(self, Error::NotFound { .. } | Error::Denied { .. })
    }
    /// A failure to open `path`, from [`u_sdk::files::FileOpener`].
    pub fn open(path: impl Into<PathBuf>, err: u_sdk::files::OpenError) -> Self {
        use u_sdk::files::OpenError;
        let path = path.into();
        match err {
            OpenError::NotFound => Error::NotFound { path },
            OpenError::Denied(reason) => Error::Denied { path, reason },
            OpenError::Io(reason) => Error::Io { path, reason },
        }
    }

    /// Builds an error from an `std::io::Error` on `path`.
    pub fn io(path: impl Into<PathBuf>, err: std::io::Error) -> Self {
        let path = path.into();
        match err.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound { path },
            std::io::ErrorKind::PermissionDenied => Error::Denied {
                path,
                reason: err.to_string(),
            },
            _ => Error::Io {
                path,
                reason: err.to_string(),
            },
        }
    }
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
            Error::NotFound { .. } | Error::NoTensor(_) => ErrorKind::NotFound,
            Error::Denied { .. } => ErrorKind::PermissionDenied,
            Error::Io { .. } => ErrorKind::Io,
            Error::TooLarge { .. } => ErrorKind::ResourceExhausted,
        };
        UError::new(kind, format!("loader-onnx: {e}"))
    }
}

/// The loader's result type.
pub type Result<T> = std::result::Result<T, Error>;
