//! A plugin's settings: the `[plugins.config]` table its deployment gives it, read through
//! [`Host::config`](crate::abi::host::Host::config) as TOML. Linked statically, outside the ABI.

use crate::abi::{error::UError, host::HostBox};

/// The settings `host` passes to `plugin`, parsed; errors name the plugin.
pub fn table(host: &HostBox, plugin: &str) -> crate::Result<toml::Table> {
    host.config()
        .as_str()
        .parse()
        .map_err(|e| UError::invalid(format!("{plugin} config: {e}")))
}

/// Refuses any setting for a plugin that takes none; `what` is how the error calls it
/// ("plugin", "runner").
pub fn none(host: &HostBox, plugin: &str, what: &str) -> crate::Result<()> {
    match table(host, plugin)?.keys().next() {
        Some(key) => Err(UError::invalid(format!(
            "{plugin} config: unknown key `{key}` (the {what} has no settings)"
        ))),
        None => Ok(()),
    }
}
