//! The error type that crosses the plugin boundary.

use abi_stable::{
    StableAbi,
    std_types::{RResult, RString},
};

/// What went wrong, coarsely; the message says the rest.
#[repr(u8)]
#[derive(
    StableAbi, serde::Serialize, serde::Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash,
)]
pub enum ErrorKind {
    /// The caller passed something malformed (a bad file, request or argument).
    InvalidInput,
    /// A named thing (file, tensor, checkpoint, model) does not exist.
    NotFound,
    /// A named thing already exists and the caller did not ask to replace it (a checkpoint
    /// saved over without `overwrite`).
    AlreadyExists,
    /// A capability check failed, in the host services or in the OS sandbox.
    PermissionDenied,
    /// The operation or dtype is not implemented by this plugin.
    Unsupported,
    /// An I/O error from the operating system.
    Io,
    /// A memory or size budget would be exceeded.
    ResourceExhausted,
    /// The work was cancelled (client went away, shutdown).
    Cancelled,
    /// The server is at capacity (its request queue is full); retry later.
    Busy,
    /// A bug: an invariant did not hold.
    Internal,
    /// Plugin code panicked; the panic was caught at the boundary.
    Panicked,
}

impl ErrorKind {
    /// Every kind, in declaration order (a kind's position is its `u8` value).
    pub const ALL: [ErrorKind; 11] = [
        ErrorKind::InvalidInput,
        ErrorKind::NotFound,
        ErrorKind::AlreadyExists,
        ErrorKind::PermissionDenied,
        ErrorKind::Unsupported,
        ErrorKind::Io,
        ErrorKind::ResourceExhausted,
        ErrorKind::Cancelled,
        ErrorKind::Busy,
        ErrorKind::Internal,
        ErrorKind::Panicked,
    ];
}

/// An error with a kind and a human-readable message naming what failed and why.
#[repr(C)]
#[derive(StableAbi, serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct UError {
    /// The coarse category.
    pub kind: ErrorKind,
    /// The full explanation (e.g. `"tensor blk.0.attn_q.weight: offset 96 past end of file"`).
    pub message: RString,
}

impl UError {
    /// Creates an error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: RString::from(message.into()),
        }
    }

    /// Shorthand for [`ErrorKind::InvalidInput`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, message)
    }

    /// Shorthand for [`ErrorKind::NotFound`].
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }

    /// Shorthand for [`ErrorKind::AlreadyExists`].
    pub fn already_exists(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::AlreadyExists, message)
    }

    /// Shorthand for [`ErrorKind::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }

    /// Shorthand for [`ErrorKind::PermissionDenied`].
    pub fn denied(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PermissionDenied, message)
    }

    /// An [`ErrorKind::Io`] error with context, e.g. `UError::io("open /x", err)`.
    pub fn io(context: impl std::fmt::Display, err: std::io::Error) -> Self {
        let kind = match err.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            _ => ErrorKind::Io,
        };
        Self::new(kind, format!("{context}: {err}"))
    }
}

impl std::fmt::Display for UError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for UError {}

/// The result type returned across the ABI.
pub type UResult<T> = RResult<T, UError>;

/// The result type for Rust code on either side of the ABI.
pub type Result<T> = std::result::Result<T, UError>;
