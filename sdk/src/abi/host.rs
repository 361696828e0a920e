//! Services the host offers every plugin, checked against that plugin's grants.
//!
//! A plugin reaches files only through these calls: the host checks the path against the
//! plugin's own `fs.read`/`fs.write` grant and hands back an open file descriptor. The OS sandbox
//! (Landlock, seccomp) additionally confines the whole process to the union of all grants, so a
//! plugin that calls libc directly is still denied what no plugin was granted.

use crate::abi::error::UError;
use abi_stable::{
    StableAbi, sabi_trait,
    std_types::{RBox, RResult, RStr, RString},
};

/// Severity of a log line sent to the host.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Very detailed tracing.
    Trace,
    /// Developer detail.
    Debug,
    /// Normal operation.
    Info,
    /// Something unexpected but handled.
    Warn,
    /// A failure.
    Error,
}

/// How [`Host::open_write`] opens a file.
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// Create a new file; fail if it exists.
    CreateNew,
    /// Create or truncate.
    Truncate,
    /// Create or append.
    Append,
}

/// Host services, one instance per plugin (it knows the plugin's name and grants).
#[sabi_trait]
pub trait Host: Send + Sync + Clone {
    /// The plugin's name as the deployment knows it.
    fn plugin_name(&self) -> RString;

    /// Writes a log line, attributed to this plugin, to the host's log.
    fn log(&self, level: LogLevel, message: RStr<'_>);

    /// Opens `path` for reading if the plugin's `fs.read` grant covers it; returns an owned fd.
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError>;

    /// Opens `path` for writing if the plugin's `fs.write` grant covers it; returns an owned fd.
    fn open_write(&self, path: RStr<'_>, mode: WriteMode) -> RResult<i32, UError>;

    /// Atomically renames `from` to `to` (both under the `fs.write` grant); used for crash-safe
    /// writes (write a temporary file, fsync, rename).
    fn rename(&self, from: RStr<'_>, to: RStr<'_>) -> RResult<(), UError>;

    /// Removes a file under the `fs.write` grant.
    fn remove(&self, path: RStr<'_>) -> RResult<(), UError>;

    /// How many compute threads this plugin may run (size its thread pool to this).
    fn threads(&self) -> u32;

    /// The plugin's `[plugins.config]` table from the deployment manifest, as TOML text.
    fn config(&self) -> RString;

    /// Readies the process for `fork`: every loaded plugin's `before_fork` hook stops its
    /// threads. Refused unless this plugin was granted `process.fork`.
    fn prepare_fork(&self) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported("this host cannot fork plugins"))
    }

    /// Restarts the threads [`Host::prepare_fork`] stopped, in the parent or in the forked
    /// child (`in_child`).
    fn after_fork(&self, _in_child: bool) {}

    /// In a forked child: forbids creating processes from now on (a seccomp filter stacked on
    /// the deployment's: `fork`, `vfork`, `clone` without `CLONE_THREAD`, `execve`), for the
    /// whole process.
    fn forbid_processes(&self) -> RResult<(), UError> {
        RResult::RErr(UError::unsupported(
            "this host cannot restrict a forked child",
        ))
    }
}

/// The host services object a plugin receives at instantiation.
pub type HostBox = Host_TO<'static, RBox<()>>;

impl HostBox {
    /// Logs at [`LogLevel::Info`].
    pub fn info(&self, message: &str) {
        self.log(LogLevel::Info, message.into());
    }

    /// Logs at [`LogLevel::Warn`].
    pub fn warn(&self, message: &str) {
        self.log(LogLevel::Warn, message.into());
    }
}
