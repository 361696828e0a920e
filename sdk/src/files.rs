//! Opening files for reading, one way for every plugin: through the host's `open_read` (so the
//! plugin's own `fs.read` grant applies) or directly with `std::fs` (tests and tools); mapping
//! and size-limited reading on top, with [`FileError`] naming the file.

use crate::{ErrorKind, HostBox};
use abi_stable::std_types::RResult;
use memmap2::Mmap;
use std::{
    fs::File,
    io::Read,
    os::fd::FromRawFd,
    path::{Path, PathBuf},
};

/// Why a file could not be opened, for a plugin to phrase in its own errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// No such file.
    NotFound,
    /// Refused: outside the grant, or by the operating system.
    Denied(String),
    /// Any other failure.
    Io(String),
}

impl OpenError {
    /// The error of `std::fs` as an [`OpenError`].
    pub fn from_io(e: &std::io::Error) -> Self {
        match e.kind() {
            std::io::ErrorKind::NotFound => OpenError::NotFound,
            std::io::ErrorKind::PermissionDenied => OpenError::Denied(e.to_string()),
            _ => OpenError::Io(e.to_string()),
        }
    }
}

/// Opens files for reading.
pub trait FileOpener {
    /// Opens `path` for reading.
    fn open(&self, path: &Path) -> Result<File, OpenError>;
}

/// Opens files directly with `std::fs` (no capability checks: for tests and tools).
pub struct StdFs;

impl FileOpener for StdFs {
    fn open(&self, path: &Path) -> Result<File, OpenError> {
        File::open(path).map_err(|e| OpenError::from_io(&e))
    }
}

/// Opens files through the host, which checks the plugin's `fs.read` grant.
pub struct HostFiles<'h>(pub &'h HostBox);

impl FileOpener for HostFiles<'_> {
    fn open(&self, path: &Path) -> Result<File, OpenError> {
        let text = path
            .to_str()
            .ok_or_else(|| OpenError::Io("path is not UTF-8".to_string()))?;
        match self.0.open_read(text.into()) {
            RResult::ROk(fd) if fd >= 0 => {
                // SAFETY: the host hands over ownership of a fresh, open descriptor.
                Ok(unsafe { File::from_raw_fd(fd) })
            }
            RResult::ROk(fd) => Err(OpenError::Io(format!(
                "host returned invalid descriptor {fd}"
            ))),
            RResult::RErr(e) => Err(match e.kind {
                ErrorKind::NotFound => OpenError::NotFound,
                ErrorKind::PermissionDenied => OpenError::Denied(e.message.into()),
                _ => OpenError::Io(e.message.into()),
            }),
        }
    }
}

/// A file that could not be read, with its path: the file errors every loader reports alike.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    /// The file does not exist.
    #[error("{path}: not found")]
    NotFound {
        /// The file.
        path: PathBuf,
    },
    /// The host (or the OS) refused access.
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
    /// A file bigger than the reader accepts.
    #[error("{path}: {reason}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

impl FileError {
    /// A failure to open `path`.
    pub fn open(path: impl Into<PathBuf>, err: OpenError) -> Self {
        let path = path.into();
        match err {
            OpenError::NotFound => FileError::NotFound { path },
            OpenError::Denied(reason) => FileError::Denied { path, reason },
            OpenError::Io(reason) => FileError::Io { path, reason },
        }
    }

    /// An `std::io::Error` on `path`.
    pub fn io(path: impl Into<PathBuf>, err: &std::io::Error) -> Self {
        Self::open(path, OpenError::from_io(err))
    }

    /// Whether the file is simply absent or not granted (optional files are then skipped).
    pub fn is_absent(&self) -> bool {
        matches!(self, FileError::NotFound { .. } | FileError::Denied { .. })
    }

    /// The ABI error kind this failure is reported as.
    pub fn kind(&self) -> ErrorKind {
        match self {
            FileError::NotFound { .. } => ErrorKind::NotFound,
            FileError::Denied { .. } => ErrorKind::PermissionDenied,
            FileError::Io { .. } => ErrorKind::Io,
            FileError::TooLarge { .. } => ErrorKind::ResourceExhausted,
        }
    }
}

impl From<FileError> for crate::UError {
    fn from(e: FileError) -> Self {
        crate::UError::new(e.kind(), e.to_string())
    }
}

/// Memory-maps a whole regular file, read-only.
///
/// Like every mmap-based loader, this assumes nobody truncates or rewrites the file while it is
/// mapped; the host grants plugins read access only.
pub fn map_file(opener: &dyn FileOpener, path: &Path) -> Result<Mmap, FileError> {
    let file = opener.open(path).map_err(|e| FileError::open(path, e))?;
    let meta = file.metadata().map_err(|e| FileError::io(path, &e))?;
    if !meta.is_file() {
        return Err(FileError::Io {
            path: path.to_path_buf(),
            reason: "not a regular file".to_string(),
        });
    }
    // SAFETY: a read-only map of a file that is not modified while mapped (see above).
    unsafe { Mmap::map(&file) }.map_err(|e| FileError::io(path, &e))
}

/// Reads a whole small file, refusing one larger than `limit` bytes (without reading past it).
pub fn read_limited(
    opener: &dyn FileOpener,
    path: &Path,
    limit: u64,
) -> Result<Vec<u8>, FileError> {
    let file = opener.open(path).map_err(|e| FileError::open(path, e))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| FileError::io(path, &e))?;
    if bytes.len() as u64 > limit {
        return Err(FileError::TooLarge {
            path: path.to_path_buf(),
            reason: format!("larger than the {limit}-byte limit"),
        });
    }
    Ok(bytes)
}

/// [`read_limited`] for an optional file: absent or not granted is `None`.
pub fn read_optional(
    opener: &dyn FileOpener,
    path: &Path,
    limit: u64,
) -> Result<Option<Vec<u8>>, FileError> {
    match read_limited(opener, path, limit) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.is_absent() => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn std_fs_reports_absent_files_as_not_found() {
        assert_eq!(
            StdFs
                .open(Path::new("/nonexistent/u-files-test"))
                .unwrap_err(),
            OpenError::NotFound
        );
        assert!(StdFs.open(Path::new("/proc/self/status")).is_ok());
    }

    #[test]
    fn reads_are_limited_and_optional_files_may_be_absent() {
        let dir = std::env::temp_dir().join(format!("u-files-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ten");
        std::fs::write(&file, b"0123456789").unwrap();
        assert_eq!(read_limited(&StdFs, &file, 10).unwrap(), b"0123456789");
        let err = read_limited(&StdFs, &file, 9).unwrap_err();
        assert!(matches!(err, FileError::TooLarge { .. }), "{err}");
        assert_eq!(err.kind(), ErrorKind::ResourceExhausted);
        assert_eq!(read_optional(&StdFs, &dir.join("absent"), 9).unwrap(), None);
        assert_eq!(&map_file(&StdFs, &file).unwrap()[..], b"0123456789");
        let err = map_file(&StdFs, &dir).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: not a regular file", dir.display())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
