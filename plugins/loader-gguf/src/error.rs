//! The crate's error type and its conversion to the ABI error.

use u_sdk::{ErrorKind, UError};

/// Everything that can go wrong while parsing a GGUF file or dequantizing its tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version this parser does not read.
    #[error("GGUF version {0} is not supported (this loader reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    /// A big-endian file (GGUF v3 allows them; every file in the wild is little-endian).
    #[error("big-endian GGUF (version {0}) is not supported")]
    BigEndian(u32),
    /// The file ends before a field it declares.
    #[error("file is truncated: {what} needs {need} bytes at offset {offset}, file has {len}")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        need: u64,
        /// The file length.
        len: u64,
    },
    /// A declared count or length that cannot fit in what is left of the file.
    #[error("{what}: count {count} cannot fit in the {remaining} bytes left at offset {offset}")]
    CountTooLarge {
        /// The counted thing.
        what: &'static str,
        /// The declared count.
        count: u64,
        /// Bytes left in the file.
        remaining: u64,
        /// Where the count was read.
        offset: u64,
    },
    /// A metadata value type id outside 0..=12.
    #[error("unknown metadata value type {0}")]
    UnknownValueType(u32),
    /// Arrays nested deeper than [`crate::gguf::MAX_ARRAY_NESTING`].
    #[error("arrays nested deeper than {0} levels")]
    NestingTooDeep(usize),
    /// A bool stored as a byte other than 0 or 1.
    #[error("bool byte {0} is neither 0 nor 1")]
    BadBool(u8),
    /// A key or tensor name that is not UTF-8.
    #[error("{0} is not valid UTF-8")]
    InvalidUtf8(&'static str),
    /// A metadata key that occurs twice.
    #[error("metadata key {0:?} appears twice")]
    DuplicateKey(String),
    /// A tensor name that occurs twice.
    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),
    /// `general.alignment` of the wrong type or not a power of two.
    #[error("general.alignment: {0}")]
    BadAlignment(String),
    /// Context: the error happened inside this metadata entry.
    #[error("metadata entry #{index} ({key:?}): {source}")]
    InMetadata {
        /// Position of the entry.
        index: u64,
        /// Its key, if it was read.
        key: String,
        /// The underlying error.
        source: Box<Error>,
    },
    /// Context: the error happened inside this tensor info.
    #[error("tensor info #{index} ({name:?}): {source}")]
    InTensorInfo {
        /// Position of the tensor info.
        index: u64,
        /// Its name, if it was read.
        name: String,
        /// The underlying error.
        source: Box<Error>,
    },
    /// More dimensions than ggml allows.
    #[error("{n_dims} dimensions, at most {max} are supported")]
    TooManyDims {
        /// Declared dimension count.
        n_dims: u32,
        /// The limit.
        max: usize,
    },
    /// A ggml tensor type this loader does not map to a [`u_sdk::DType`].
    #[error("tensor {name:?}: ggml type {type_id} ({type_name}) is not supported")]
    UnsupportedType {
        /// Tensor name.
        name: String,
        /// The ggml type id.
        type_id: u32,
        /// ggml's name for it, or `"unknown"`.
        type_name: &'static str,
    },
    /// A shape that overflows, or whose rows are not whole blocks.
    #[error("tensor {name:?}: shape {dims:?} (innermost first) {reason}")]
    BadShape {
        /// Tensor name.
        name: String,
        /// Dimensions as stored (innermost first).
        dims: Vec<u64>,
        /// What is wrong.
        reason: String,
    },
    /// A tensor offset that is not a multiple of the alignment.
    #[error("tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned {
        /// Tensor name.
        name: String,
        /// Offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// Tensor data that lies (partly) past the end of the file.
    #[error(
        "tensor {name:?}: data at offset {offset} (+{byte_len} bytes) past the end of the data section ({available} bytes)"
    )]
    OutOfBounds {
        /// Tensor name.
        name: String,
        /// Offset relative to the data section.
        offset: u64,
        /// Bytes the tensor needs.
        byte_len: u64,
        /// Bytes the data section holds.
        available: u64,
    },
    /// The data section starts past the end of the file.
    #[error("data section starts at {start}, past the end of the file ({len} bytes)")]
    DataSectionPastEnd {
        /// Where the data section starts.
        start: u64,
        /// File length.
        len: u64,
    },
    /// A tensor that is not in the file.
    #[error("no tensor named {0:?}")]
    TensorNotFound(String),
    /// A dequantization of the wrong size.
    #[error(transparent)]
    Dequant(#[from] u_sdk::quant::Error),
}

/// Result with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The innermost error, past any context wrappers.
    pub fn root(&self) -> &Error {
        match self {
            Error::InMetadata { source, .. } | Error::InTensorInfo { source, .. } => source.root(),
            other => other,
        }
    }

    /// The ABI error kind this error maps to.
    pub fn kind(&self) -> ErrorKind {
        match self.root() {
            Error::UnsupportedVersion(_) | Error::BigEndian(_) | Error::UnsupportedType { .. } => {
                ErrorKind::Unsupported
            }
            Error::TensorNotFound(_) => ErrorKind::NotFound,
            _ => ErrorKind::InvalidInput,
        }
    }
}

impl From<Error> for UError {
    fn from(e: Error) -> Self {
        UError::new(e.kind(), e.to_string())
    }
}
