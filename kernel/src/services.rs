//! Host services bound to one plugin's grants.
//!
//! Every file a plugin opens through the host is checked against that plugin's own grant, after
//! resolving symbolic links, so one plugin cannot use another's grant. (The OS sandbox confines
//! the process to the union of grants; this layer keeps plugins apart within it.)

use abi_stable::std_types::{RResult, RStr, RString};
use std::{
    fs::OpenOptions,
    os::{fd::IntoRawFd, unix::fs::OpenOptionsExt},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use u_attest::deployment::{Grants, PathGrant, normalize};
use u_sdk::{Host, HostBox, LogLevel, UError, WriteMode};

/// Every loaded plugin's fork hooks (`before_fork`, `after_fork`), in load order.
type ForkHooks = (extern "C" fn(), extern "C" fn(bool));
static FORK_HOOKS: Mutex<Vec<ForkHooks>> = Mutex::new(Vec::new());

/// Records a loaded plugin's fork hooks (absent in plugins built before they existed: such a
/// plugin is taken to start no threads).
pub fn register_fork_hooks(before: Option<extern "C" fn()>, after: Option<extern "C" fn(bool)>) {
    if let (Some(b), Some(a)) = (before, after) {
        FORK_HOOKS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((b, a));
    }
}

fn fork_hooks() -> Vec<ForkHooks> {
    FORK_HOOKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// The host-services object handed to one plugin.
#[derive(Clone)]
pub struct PluginServices {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    grants: Grants,
    config: String,
    threads: u32,
}

impl PluginServices {
    /// Services for plugin `name` with effective `grants` (already restricted to its request).
    pub fn new(name: &str, grants: Grants, config: String, threads: u32) -> Self {
        Self {
            inner: Arc::new(Inner {
                name: name.to_string(),
                grants,
                config,
                threads,
            }),
        }
    }

    /// Wraps the services as the ABI object a plugin receives.
    pub fn into_box(self) -> HostBox {
        HostBox::from_value(self, abi_stable::sabi_trait::TD_Opaque)
    }

    fn check(&self, path: &str, grants: &[PathGrant], cap: &str) -> Result<PathBuf, UError> {
        let resolved = resolve_for_check(Path::new(path))
            .map_err(|e| UError::io(format!("plugin `{}`: {path}", self.inner.name), e))?;
        if grants.iter().any(|g| g.covers(&resolved)) {
            Ok(resolved)
        } else {
            let granted: Vec<String> = grants.iter().map(|g| g.to_string()).collect();
            Err(UError::denied(format!(
                "plugin `{}` may not access {}: outside its `{cap}` grant ({})",
                self.inner.name,
                resolved.display(),
                if granted.is_empty() {
                    "nothing granted".into()
                } else {
                    granted.join(", ")
                }
            )))
        }
    }
}

/// Resolves `path` for a grant check: absolute, with symlinks resolved for the longest existing
/// prefix (so a link cannot point a granted name at an ungranted file).
fn resolve_for_check(path: &Path) -> std::io::Result<PathBuf> {
    if !path.is_absolute() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "paths given to host services must be absolute",
        ));
    }
    let path = normalize(path);
    if let Ok(real) = path.canonicalize() {
        return Ok(real);
    }
    // The file does not exist yet (a write): resolve its parent and re-attach the name.
    match (path.parent(), path.file_name()) {
        (Some(parent), Some(name)) => Ok(resolve_for_check(parent)?.join(name)),
        _ => Ok(path),
    }
}

fn fd_result(context: String, r: std::io::Result<std::fs::File>) -> RResult<i32, UError> {
    match r {
        Ok(f) => RResult::ROk(f.into_raw_fd()),
        Err(e) => RResult::RErr(UError::io(context, e)),
    }
}

impl Host for PluginServices {
    fn plugin_name(&self) -> RString {
        self.inner.name.as_str().into()
    }

    fn log(&self, level: LogLevel, message: RStr<'_>) {
        let plugin = self.inner.name.as_str();
        let message = message.as_str();
        match level {
            LogLevel::Trace => tracing::trace!(plugin, "{message}"),
            LogLevel::Debug => tracing::debug!(plugin, "{message}"),
            LogLevel::Info => tracing::info!(plugin, "{message}"),
            LogLevel::Warn => tracing::warn!(plugin, "{message}"),
            LogLevel::Error => tracing::error!(plugin, "{message}"),
        }
    }

    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        let g = &self.inner.grants;
        let grants: Vec<PathGrant> = g.fs_read.iter().chain(&g.fs_write).cloned().collect();
        match self.check(path.as_str(), &grants, "fs.read") {
            Ok(p) => fd_result(
                format!("open {}", p.display()),
                OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_CLOEXEC)
                    .open(&p),
            ),
            Err(e) => RResult::RErr(e),
        }
    }

    fn open_write(&self, path: RStr<'_>, mode: WriteMode) -> RResult<i32, UError> {
        match self.check(path.as_str(), &self.inner.grants.fs_write, "fs.write") {
            Ok(p) => {
                let mut o = OpenOptions::new();
                o.write(true).custom_flags(libc::O_CLOEXEC).mode(0o600);
                match mode {
                    WriteMode::CreateNew => o.create_new(true),
                    WriteMode::Truncate => o.create(true).truncate(true),
                    WriteMode::Append => o.create(true).append(true),
                };
                fd_result(format!("open {} for writing", p.display()), o.open(&p))
            }
            Err(e) => RResult::RErr(e),
        }
    }

    fn rename(&self, from: RStr<'_>, to: RStr<'_>) -> RResult<(), UError> {
        let grants = &self.inner.grants.fs_write;
        let checked = self
            .check(from.as_str(), grants, "fs.write")
            .and_then(|f| Ok((f, self.check(to.as_str(), grants, "fs.write")?)));
        match checked {
            Ok((f, t)) => std::fs::rename(&f, &t)
                .map_err(|e| UError::io(format!("rename {} → {}", f.display(), t.display()), e))
                .into(),
            Err(e) => RResult::RErr(e),
        }
    }

    fn remove(&self, path: RStr<'_>) -> RResult<(), UError> {
        match self.check(path.as_str(), &self.inner.grants.fs_write, "fs.write") {
            Ok(p) => std::fs::remove_file(&p)
                .map_err(|e| UError::io(format!("remove {}", p.display()), e))
                .into(),
            Err(e) => RResult::RErr(e),
        }
    }

    fn threads(&self) -> u32 {
        self.inner.threads
    }

    fn config(&self) -> RString {
        self.inner.config.as_str().into()
    }

    fn prepare_fork(&self) -> RResult<(), UError> {
        if !self.inner.grants.process_fork {
            return RResult::RErr(UError::denied(format!(
                "plugin `{}` may not fork: the deployment does not grant it `process.fork`",
                self.inner.name
            )));
        }
        // Stopped in reverse load order: a plugin's threads may call those loaded before it.
        fork_hooks().iter().rev().for_each(|(before, _)| before());
        RResult::ROk(())
    }

    fn after_fork(&self, in_child: bool) {
        fork_hooks().iter().for_each(|(_, after)| after(in_child));
    }

    fn forbid_processes(&self) -> RResult<(), UError> {
        crate::sandbox::forbid_processes()
            .map_err(|e| {
                UError::new(
                    u_sdk::ErrorKind::Internal,
                    format!("cannot forbid processes: {e}"),
                )
            })
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn services(dir: &Path) -> PluginServices {
        let grants = Grants {
            fs_read: vec![PathGrant {
                path: dir.join("models"),
                recursive: true,
            }],
            fs_write: vec![PathGrant {
                path: dir.join("cache"),
                recursive: true,
            }],
            ..Grants::default()
        };
        PluginServices::new("t", grants, String::new(), 1)
    }

    #[test]
    fn grants_are_checked_after_resolving_links() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().canonicalize().unwrap();
        std::fs::create_dir_all(dir.join("models")).unwrap();
        std::fs::create_dir_all(dir.join("cache")).unwrap();
        std::fs::write(dir.join("models/m.bin"), b"w").unwrap();
        std::fs::write(dir.join("secret"), b"s").unwrap();
        std::os::unix::fs::symlink(dir.join("secret"), dir.join("models/link")).unwrap();
        let s = services(&dir);
        let path = |p: &str| dir.join(p).display().to_string();
        assert!(s.open_read(path("models/m.bin").as_str().into()).is_ok());
        let denied = s.open_read(path("secret").as_str().into()).unwrap_err();
        assert_eq!(denied.kind, u_sdk::ErrorKind::PermissionDenied);
        assert!(
            denied.message.contains("outside its `fs.read` grant"),
            "{}",
            denied.message
        );
        // A symlink inside the grant that points outside it is refused.
        assert!(s.open_read(path("models/link").as_str().into()).is_err());
        // `..` cannot climb out of the grant.
        assert!(
            s.open_read(path("models/../secret").as_str().into())
                .is_err()
        );
        // Writes only under fs.write; reads also allowed there.
        assert!(
            s.open_write(path("cache/new").as_str().into(), WriteMode::CreateNew)
                .is_ok()
        );
        assert!(
            s.open_write(path("models/new").as_str().into(), WriteMode::CreateNew)
                .is_err()
        );
        assert!(s.open_read(path("cache/new").as_str().into()).is_ok());
        assert!(
            s.rename(
                path("cache/new").as_str().into(),
                path("cache/renamed").as_str().into()
            )
            .is_ok()
        );
        assert!(
            s.rename(
                path("cache/renamed").as_str().into(),
                path("secret2").as_str().into()
            )
            .is_err()
        );
        assert!(s.open_read("relative/path".into()).is_err());
    }
}
