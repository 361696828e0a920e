//! Opening files for reading, one way for every plugin: through the host's `open_read` (so the
//! plugin's own `fs.read` grant applies) or directly with `std::fs` (tests and tools).

use crate::{ErrorKind, HostBox};
use abi_stable::std_types::RResult;
use std::{fs::File, os::fd::FromRawFd, path::Path};

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
}
