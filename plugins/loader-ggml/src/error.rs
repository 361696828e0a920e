//! Errors of the GGML loader.

use u_sdk::{ErrorKind, UError, files::FileError};

/// An error of the GGML loader.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file ends inside a field.
    #[error("the file ends inside {what} (at byte {offset}): truncated")]
    Truncated {
        /// The field.
        what: String,
        /// Where it starts.
        offset: u64,
    },
    /// A field with a value the format does not allow.
    #[error("at byte {offset}: {reason}")]
    Format {
        /// Where the field starts.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A tensor that is malformed or of a type not read.
    #[error("tensor `{name}`: {reason}")]
    Tensor {
        /// Its name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A file that could not be read.
    #[error(transparent)]
    File(#[from] FileError),
    /// A tensor name that is not in the file.
    #[error("no tensor named `{0}`")]
    NoTensor(String),
}

impl From<Error> for UError {
    fn from(e: Error) -> Self {
        let kind = match &e {
            Error::Truncated { .. } | Error::Format { .. } | Error::Tensor { .. } => {
                ErrorKind::InvalidInput
            }
            Error::NoTensor(_) => ErrorKind::NotFound,
            Error::File(f) => f.kind(),
        };
        UError::new(kind, format!("loader-ggml: {e}"))
    }
}

/// The loader's result type.
pub type Result<T> = std::result::Result<T, Error>;
