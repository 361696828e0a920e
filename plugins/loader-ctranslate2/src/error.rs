//! Errors of the CTranslate2 loader.

use std::path::PathBuf;
use u_sdk::{DType, ErrorKind, UError, files::FileError};

/// Why the bytes of a `model.bin` were refused. Offsets are from the start of the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// A field runs past the end of the file.
    #[error("{what} at offset {offset} needs {needed} bytes, but only {available} remain")]
    Truncated {
        /// The field being read (e.g. "name of variable 3", "data of `encoder/conv1/weight`").
        what: String,
        /// Where the field starts.
        offset: u64,
        /// Bytes the field needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },
    /// A binary version this loader does not read.
    #[error(
        "binary version {version} is not supported (this loader reads versions 5 and 6, as \
         CTranslate2 3.x and 4.x write them)"
    )]
    UnsupportedVersion {
        /// The version the file declares.
        version: u32,
    },
    /// A string whose length is 0 or whose last byte is not the NUL terminator.
    #[error("{what} at offset {offset} is not NUL-terminated")]
    MissingNul {
        /// The string being read.
        what: String,
        /// Where its length prefix starts.
        offset: u64,
    },
    /// A string with a NUL byte before its terminator.
    #[error("{what} at offset {offset} holds a NUL byte before its end")]
    EmbeddedNul {
        /// The string being read.
        what: String,
        /// Where its length prefix starts.
        offset: u64,
    },
    /// A string that is not UTF-8.
    #[error("{what} at offset {offset} is not UTF-8")]
    NotUtf8 {
        /// The string being read.
        what: String,
        /// Where its length prefix starts.
        offset: u64,
    },
    /// A variable or alias with an empty name.
    #[error("{what} at offset {offset} is empty")]
    EmptyName {
        /// The name being read.
        what: String,
        /// Where its length prefix starts.
        offset: u64,
    },
    /// A variable with more dimensions than the loader accepts.
    #[error("variable `{name}` has rank {rank}, more than the limit of {limit}")]
    RankTooLarge {
        /// Variable name.
        name: String,
        /// Declared rank.
        rank: u8,
        /// The limit ([`crate::model_bin::MAX_RANK`]).
        limit: usize,
    },
    /// A dtype id outside CTranslate2's set (0 float32 … 5 bfloat16).
    #[error(
        "variable `{name}` has dtype id {id}, which is not one of CTranslate2's (0 float32, \
         1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16)"
    )]
    UnknownDtype {
        /// Variable name.
        name: String,
        /// The id found.
        id: u8,
    },
    /// The element count or byte size of a shape overflows 64 bits.
    #[error("variable `{name}`: shape {shape:?} overflows")]
    ShapeOverflow {
        /// Variable name.
        name: String,
        /// The shape.
        shape: Vec<u64>,
    },
    /// A byte count that is not the shape's element count times the dtype's size.
    #[error(
        "variable `{name}`: {dtype} {shape:?} needs {expected} bytes, but the file declares {nbytes}"
    )]
    SizeMismatch {
        /// Variable name.
        name: String,
        /// Element type.
        dtype: DType,
        /// The shape.
        shape: Vec<u64>,
        /// The byte count in the file.
        nbytes: u64,
        /// `elements × dtype size`.
        expected: u64,
    },
    /// Two variables, two aliases, or an alias and a variable share a name.
    #[error("the name `{name}` is defined twice")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// An alias whose target is not a variable of the file.
    #[error("alias `{alias}` refers to `{target}`, which is not a variable of the file")]
    AliasTarget {
        /// The alias.
        alias: String,
        /// The name it refers to.
        target: String,
    },
    /// Bytes after the alias table.
    #[error("{extra} bytes of trailing data after the alias table (at offset {offset})")]
    TrailingBytes {
        /// Where the trailing data starts.
        offset: u64,
        /// How many bytes follow.
        extra: u64,
    },
}

/// An error of the CTranslate2 loader.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A malformed `model.bin`.
    #[error("{path}: {source}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: FormatError,
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
            Error::Format { source, .. } => match source {
                FormatError::UnsupportedVersion { .. } | FormatError::UnknownDtype { .. } => {
                    ErrorKind::Unsupported
                }
                _ => ErrorKind::InvalidInput,
            },
            Error::Config { .. } => ErrorKind::InvalidInput,
            Error::NoTensor(_) => ErrorKind::NotFound,
            Error::File(f) => f.kind(),
        };
        UError::new(kind, format!("loader-ctranslate2: {e}"))
    }
}

/// The loader's result type.
pub type Result<T> = std::result::Result<T, Error>;
