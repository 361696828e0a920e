//! The stable ABI: everything that crosses the boundary between the host and a plugin.
//!
//! All types here are `#[repr(C)]` and derive [`abi_stable::StableAbi`]. Interfaces are
//! `#[sabi_trait]` objects; each plugin kind has one entry trait, created by the plugin's root
//! module ([`PluginMod`]) from the [`HostBox`] the host hands it.

pub mod backend;
pub mod cache;
pub mod dtype;
pub mod error;
pub mod host;
pub mod loader;
pub mod model;
pub mod root;
pub mod runner;
pub mod tensor;
pub mod tokenizer;
pub mod train;
pub mod transport;

pub use backend::*;
pub use cache::*;
pub use dtype::DType;
pub use error::{ErrorKind, Result, UError, UResult};
pub use host::*;
pub use loader::*;
pub use model::*;
pub use root::*;
pub use runner::*;
pub use tensor::*;
pub use tokenizer::*;
pub use train::*;
pub use transport::*;

/// The ABI major version. Bumped by hand for deliberate breaking changes; [`ABI_HASH`] catches
/// every change, deliberate or not.
pub const ABI_MAJOR: u32 = 2;

/// SHA-256 over the sources of `src/abi/` with comments and layout whitespace removed (the types
/// and signatures, not their documentation), computed when the SDK is built. Two builds of the
/// SDK are ABI-compatible only if their hashes are equal.
pub const ABI_HASH: [u8; 32] = include!(concat!(env!("OUT_DIR"), "/abi_hash.rs"));

/// A short human-readable form of the ABI identity, e.g. `1:3fa94c0e12d7`.
pub fn abi_id(major: u32, hash: &[u8; 32]) -> String {
    let mut s = format!("{major}:");
    for b in &hash[..6] {
        s.push_str(&format!("{b:02x}"));
    }
    s
}
