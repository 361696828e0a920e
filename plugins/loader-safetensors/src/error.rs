//! Errors of the safetensors loader.

use std::path::PathBuf;
use u_sdk::{ErrorKind, UError, files::FileError};

/// Why a safetensors header (the length prefix and JSON that start every file) was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// Fewer than 8 bytes: not even the header length is there.
    #[error("file is {len} bytes, too short for the 8-byte header length")]
    TooShort {
        /// File length.
        len: u64,
    },
    /// The header length exceeds the loader's limit.
    #[error("header length {len} exceeds the limit of {limit} bytes")]
    HeaderTooLarge {
        /// Declared header length.
        len: u64,
        /// The limit ([`crate::header::MAX_HEADER_LEN`]).
        limit: u64,
    },
    /// The header length runs past the end of the file.
    #[error(
        "header length {len} runs past the end of the file ({available} bytes after the length)"
    )]
    HeaderPastEnd {
        /// Declared header length.
        len: u64,
        /// Bytes available after the 8-byte length.
        available: u64,
    },
    /// The header is not valid JSON (or not an object of the expected shape).
    #[error("header is not valid JSON: {0}")]
    Json(String),
    /// A tensor entry lacks a field or has one of the wrong type.
    #[error("tensor `{name}`: {reason}")]
    BadEntry {
        /// Tensor name as stored.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A dtype string this loader does not know or cannot represent.
    #[error(
        "tensor `{name}`: dtype `{dtype}` is not supported (supported: F16, BF16, F32, F64, I8, U8, I16, I32, I64)"
    )]
    UnsupportedDtype {
        /// Tensor name as stored.
        name: String,
        /// The dtype string found.
        dtype: String,
    },
    /// The element count or byte size of a shape overflows 64 bits.
    #[error("tensor `{name}`: shape {shape:?} overflows")]
    ShapeOverflow {
        /// Tensor name as stored.
        name: String,
        /// The shape.
        shape: Vec<u64>,
    },
    /// Offsets that do not describe `shape × dtype` bytes inside the data region.
    #[error(
        "tensor `{name}`: data_offsets [{begin}, {end}] {reason} (data region is {data_len} bytes)"
    )]
    BadOffsets {
        /// Tensor name as stored.
        name: String,
        /// Begin offset, relative to the data region.
        begin: u64,
        /// End offset, relative to the data region.
        end: u64,
        /// Data region length.
        data_len: u64,
        /// What is wrong.
        reason: String,
    },
    /// Two tensors' byte ranges overlap.
    #[error("tensors `{first}` and `{second}` overlap in the data region")]
    Overlap {
        /// One tensor.
        first: String,
        /// The other.
        second: String,
    },
}

/// An error of the safetensors loader.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A malformed file header.
    #[error("{path}: {source}")]
    Header {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: HeaderError,
    },
    /// A malformed `model.safetensors.index.json`.
    #[error("{path}: bad shard index: {reason}")]
    Index {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A malformed `config.json`.
    #[error("{path}: bad config.json: {reason}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The index names a tensor its shard does not hold, or two shards hold the same tensor.
    #[error("{path}: {reason}")]
    Inconsistent {
        /// The index or shard involved.
        path: PathBuf,
        /// What is inconsistent.
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
            Error::Header { source, .. } => match source {
                HeaderError::UnsupportedDtype { .. } => ErrorKind::Unsupported,
                HeaderError::HeaderTooLarge { .. } => ErrorKind::ResourceExhausted,
                _ => ErrorKind::InvalidInput,
            },
            Error::Index { .. } | Error::Config { .. } | Error::Inconsistent { .. } => {
                ErrorKind::InvalidInput
            }
            Error::NoTensor(_) => ErrorKind::NotFound,
            Error::File(f) => f.kind(),
        };
        UError::new(kind, format!("loader-safetensors: {e}"))
    }
}

/// The loader's result type.
pub type Result<T> = std::result::Result<T, Error>;
