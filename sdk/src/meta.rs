//! The `.u.meta` ELF section: a fixed-size record embedded in every plugin (and in `u-runner`).
//!
//! The section is reserved at build time by [`export_plugin!`](crate::export_plugin) with the
//! manifest source and the SDK's ABI identity filled in and the signing fields zeroed.
//! `u-attest sign` later patches the publisher key, code hash and signature *in place*: the file
//! never changes size, so no section has to grow (growing a section with objcopy is known to
//! break unwind tables).
//!
//! Layout (all integers little-endian):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `U.META\0\x01` |
//! | 8 | 4 | layout version (1) |
//! | 12 | 4 | manifest length in bytes |
//! | 16 | 4 | ABI major ([`crate::ABI_MAJOR`]) |
//! | 20 | 32 | ABI hash ([`crate::ABI_HASH`]) |
//! | 52 | 32 | publisher ed25519 public key (zero until signed) |
//! | 84 | 32 | code hash: SHA-256 of the file with code hash and signature zeroed |
//! | 116 | 64 | ed25519 signature (zero until signed) |
//! | 180 | 12 | reserved, zero |
//! | 192 | … | manifest TOML, zero-padded to [`META_SIZE`] |

use std::ops::Range;

/// Total size of the section.
pub const META_SIZE: usize = 4096;
/// Magic bytes at offset 0.
pub const MAGIC: [u8; 8] = *b"U.META\0\x01";
/// Version of this layout.
pub const LAYOUT_VERSION: u32 = 1;
/// Name of the ELF section.
pub const SECTION_NAME: &str = ".u.meta";
/// Prefix of the exported symbol holding a plugin's root-module header; the rest is the crate
/// name, so every plugin's symbol is distinct.
pub const ROOT_SYMBOL_PREFIX: &str = "u_plugin_root_";

/// Byte range of the magic.
pub const MAGIC_RANGE: Range<usize> = 0..8;
/// Byte range of the layout version.
pub const LAYOUT_RANGE: Range<usize> = 8..12;
/// Byte range of the manifest length.
pub const MANIFEST_LEN_RANGE: Range<usize> = 12..16;
/// Byte range of the ABI major version.
pub const ABI_MAJOR_RANGE: Range<usize> = 16..20;
/// Byte range of the ABI hash.
pub const ABI_HASH_RANGE: Range<usize> = 20..52;
/// Byte range of the publisher key.
pub const PUBLISHER_RANGE: Range<usize> = 52..84;
/// Byte range of the code hash.
pub const CODE_HASH_RANGE: Range<usize> = 84..116;
/// Byte range of the signature.
pub const SIGNATURE_RANGE: Range<usize> = 116..180;
/// Offset of the manifest text.
pub const MANIFEST_OFFSET: usize = 192;
/// Longest manifest source that fits.
pub const MANIFEST_CAPACITY: usize = META_SIZE - MANIFEST_OFFSET;

/// The root-module symbol [`export_plugin!`](crate::export_plugin) exports for a crate
/// (`crate_name` with `_`, as `CARGO_CRATE_NAME` spells it).
pub fn root_symbol(crate_name: &str) -> String {
    format!("{ROOT_SYMBOL_PREFIX}{crate_name}")
}

/// Loads the plugin library at `path` (never unloaded) and returns its root module, found under
/// `symbol`, after `abi_stable`'s version and layout checks. The host calls this only on bytes
/// it has verified.
pub fn load_root_module(
    path: &std::path::Path,
    symbol: &str,
) -> Result<crate::PluginModRef, String> {
    use abi_stable::library::{AbiHeaderRef, RawLibrary};
    let library = RawLibrary::load_at(path).map_err(|e| format!("dlopen failed: {e}"))?;
    let mut name = symbol.as_bytes().to_vec();
    name.push(0);
    // SAFETY: the symbol is the `LibHeader` static that export_plugin! defines; the library is
    // never unloaded (it is leaked below), so the 'static header stays valid.
    let header = unsafe {
        let abi_header: AbiHeaderRef = *library
            .get::<AbiHeaderRef>(&name)
            .map_err(|e| format!("root module symbol `{symbol}`: {e}"))?;
        abi_header
            .upgrade()
            .map_err(|e| format!("ABI header: {e}"))?
    };
    std::mem::forget(library);
    header
        .init_root_module::<crate::PluginModRef>()
        .map_err(|e| format!("ABI check after load failed: {e}"))
}

/// Builds the unsigned section at compile time. A manifest that does not fit is a compile error.
pub const fn build_section(manifest: &str) -> [u8; META_SIZE] {
    let text = manifest.as_bytes();
    assert!(
        text.len() <= MANIFEST_CAPACITY,
        "plugin manifest does not fit in the .u.meta section"
    );
    let mut out = [0u8; META_SIZE];
    let mut i = 0;
    while i < 8 {
        out[i] = MAGIC[i];
        i += 1;
    }
    put_u32(&mut out, LAYOUT_RANGE.start, LAYOUT_VERSION);
    put_u32(&mut out, MANIFEST_LEN_RANGE.start, text.len() as u32);
    put_u32(&mut out, ABI_MAJOR_RANGE.start, crate::ABI_MAJOR);
    let mut j = 0;
    while j < 32 {
        out[ABI_HASH_RANGE.start + j] = crate::ABI_HASH[j];
        j += 1;
    }
    let mut k = 0;
    while k < text.len() {
        out[MANIFEST_OFFSET + k] = text[k];
        k += 1;
    }
    out
}

const fn put_u32(out: &mut [u8; META_SIZE], at: usize, v: u32) {
    let b = v.to_le_bytes();
    out[at] = b[0];
    out[at + 1] = b[1];
    out[at + 2] = b[2];
    out[at + 3] = b[3];
}

/// Reads a section static without letting the compiler fold it to its compile-time value
/// (signing patches the bytes after the build).
/// Byte by byte: one volatile read of the whole array would be unrolled into kilobytes of code.
pub fn read_section(section: &'static [u8; META_SIZE]) -> Vec<u8> {
    section
        .iter()
        // SAFETY: each element of a valid, initialised static is readable; volatile reads of
        // it are sound.
        .map(|b| unsafe { std::ptr::read_volatile(b) })
        .collect()
}

/// Why section bytes could not be read as a `.u.meta` record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetaError {
    /// Fewer bytes than the layout needs.
    #[error(".u.meta section is truncated: {found} bytes, need {META_SIZE}")]
    Truncated {
        /// Bytes present.
        found: usize,
    },
    /// Wrong magic.
    #[error(".u.meta section has a bad magic (not a U plugin manifest)")]
    BadMagic,
    /// Unknown layout version.
    #[error(
        ".u.meta layout version {0} is not supported (this build reads version {LAYOUT_VERSION})"
    )]
    Layout(u32),
    /// Manifest length past the section.
    #[error(".u.meta manifest length {0} exceeds the section capacity {MANIFEST_CAPACITY}")]
    ManifestLength(u32),
    /// Manifest bytes are not UTF-8.
    #[error(".u.meta manifest is not UTF-8")]
    NotUtf8,
}

/// A parsed view of a `.u.meta` record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRecord {
    /// ABI major the plugin was built with.
    pub abi_major: u32,
    /// ABI hash the plugin was built with.
    pub abi_hash: [u8; 32],
    /// Publisher key, or `None` if unsigned.
    pub publisher: Option<[u8; 32]>,
    /// Code hash, or `None` if unsigned.
    pub code_hash: Option<[u8; 32]>,
    /// Signature, or `None` if unsigned.
    pub signature: Option<[u8; 64]>,
    /// The manifest source text.
    pub manifest: String,
}

impl MetaRecord {
    /// Parses section bytes (exactly [`META_SIZE`] expected; extra bytes are ignored).
    pub fn parse(bytes: &[u8]) -> Result<Self, MetaError> {
        if bytes.len() < META_SIZE {
            return Err(MetaError::Truncated { found: bytes.len() });
        }
        if bytes[MAGIC_RANGE] != MAGIC {
            return Err(MetaError::BadMagic);
        }
        let layout = read_u32(bytes, LAYOUT_RANGE);
        if layout != LAYOUT_VERSION {
            return Err(MetaError::Layout(layout));
        }
        let len = read_u32(bytes, MANIFEST_LEN_RANGE);
        if len as usize > MANIFEST_CAPACITY {
            return Err(MetaError::ManifestLength(len));
        }
        let manifest = std::str::from_utf8(&bytes[MANIFEST_OFFSET..MANIFEST_OFFSET + len as usize])
            .map_err(|_| MetaError::NotUtf8)?
            .to_string();
        Ok(MetaRecord {
            abi_major: read_u32(bytes, ABI_MAJOR_RANGE),
            abi_hash: array(&bytes[ABI_HASH_RANGE]),
            publisher: nonzero(array(&bytes[PUBLISHER_RANGE])),
            code_hash: nonzero(array(&bytes[CODE_HASH_RANGE])),
            signature: nonzero(array(&bytes[SIGNATURE_RANGE])),
            manifest,
        })
    }

    /// Whether all three signing fields are present.
    pub fn is_signed(&self) -> bool {
        self.publisher.is_some() && self.code_hash.is_some() && self.signature.is_some()
    }
}

fn read_u32(bytes: &[u8], r: Range<usize>) -> u32 {
    u32::from_le_bytes(array(&bytes[r]))
}

fn array<const N: usize>(s: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(s);
    a
}

fn nonzero<const N: usize>(a: [u8; N]) -> Option<[u8; N]> {
    a.iter().any(|&b| b != 0).then_some(a)
}

/// The `before_fork` hook of a plugin that starts no threads.
pub fn no_threads() {}

/// The `after_fork` hook of a plugin that starts no threads.
pub fn no_threads_after_fork(_in_child: bool) {}

/// Exports a plugin: embeds its manifest in `.u.meta` and exports the root module.
///
/// ```ignore
/// u_sdk::export_plugin! {
///     manifest: "plugin.toml",          // relative to the crate's Cargo.toml
///     describe: describe,               // fn() -> u_sdk::PluginInfo
///     instantiate: instantiate,         // fn(u_sdk::HostBox) -> u_sdk::Result<u_sdk::PluginInstance>
///     before_fork: stop_threads,        // optional: fn(), joins the plugin's threads
///     after_fork: start_threads,        // optional: fn(in_child: bool), restarts them
/// }
/// ```
///
/// Every function runs under [`guard`](crate::guard): a panic becomes an error (or, for the
/// fork hooks, nothing), never an abort. A plugin that starts threads gives the fork hooks
/// (see [`PluginMod::before_fork`](crate::PluginMod)); the others get [`no_threads`].
/// The root module is exported as `u_plugin_root_<crate name>`.
#[macro_export]
macro_rules! export_plugin {
    (manifest: $manifest:literal, describe: $describe:path, instantiate: $instantiate:path $(,)?) => {
        $crate::export_plugin! {
            manifest: $manifest,
            describe: $describe,
            instantiate: $instantiate,
            before_fork: $crate::meta::no_threads,
            after_fork: $crate::meta::no_threads_after_fork,
        }
    };
    (manifest: $manifest:literal, describe: $describe:path, instantiate: $instantiate:path,
     before_fork: $before:path, after_fork: $after:path $(,)?) => {
        #[used]
        #[unsafe(link_section = ".u.meta")]
        static U_META: [u8; $crate::meta::META_SIZE] = $crate::meta::build_section(include_str!(
            concat!(env!("CARGO_MANIFEST_DIR"), "/", $manifest)
        ));

        extern "C" fn __u_meta_section() -> $crate::abi_stable::std_types::RVec<u8> {
            $crate::guard_infallible(
                || $crate::meta::read_section(&U_META).into(),
                $crate::abi_stable::std_types::RVec::new,
            )
        }

        extern "C" fn __u_describe() -> $crate::PluginInfo {
            $crate::guard_infallible($describe, || $crate::PluginInfo {
                summary: "describe() panicked".into(),
                details: $crate::abi_stable::std_types::RVec::new(),
            })
        }

        extern "C" fn __u_instantiate(
            host: $crate::HostBox,
        ) -> $crate::abi_stable::std_types::RResult<$crate::PluginInstance, $crate::UError> {
            $crate::guard("instantiate", move || $instantiate(host))
        }

        extern "C" fn __u_before_fork() {
            $crate::guard_infallible($before, || ())
        }

        extern "C" fn __u_after_fork(in_child: bool) {
            $crate::guard_infallible(move || $after(in_child), || ())
        }

        fn __u_root_module() -> $crate::PluginModRef {
            use $crate::abi_stable::prefix_type::PrefixTypeTrait;
            $crate::PluginMod {
                meta_section: __u_meta_section,
                describe: __u_describe,
                instantiate: __u_instantiate,
                before_fork: __u_before_fork,
                after_fork: __u_after_fork,
            }
            .leak_into_prefix()
        }

        // The library header `abi_stable` checks, exported under a per-crate name (see
        // [`ROOT_SYMBOL_PREFIX`](crate::meta::ROOT_SYMBOL_PREFIX)) so that several plugins'
        // rlibs can link into one test binary.
        #[unsafe(export_name = concat!("u_plugin_root_", env!("CARGO_CRATE_NAME")))]
        #[doc(hidden)]
        pub static __U_ROOT_MODULE: $crate::abi_stable::library::LibHeader = {
            extern "C" fn erased() -> $crate::abi_stable::library::RootModuleResult {
                $crate::abi_stable::library::__call_root_module_loader(__u_root_module)
            }
            // SAFETY: `erased` returns the root module of type `PluginModRef`, as declared.
            unsafe {
                $crate::abi_stable::library::LibHeader::from_constructor::<$crate::PluginModRef>(
                    erased,
                    $crate::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_section_parses_back() {
        let section = build_section("name = \"x\"");
        let rec = MetaRecord::parse(&section).unwrap();
        assert_eq!(rec.manifest, "name = \"x\"");
        assert_eq!(rec.abi_major, crate::ABI_MAJOR);
        assert_eq!(rec.abi_hash, crate::ABI_HASH);
        assert!(!rec.is_signed());
    }

    #[test]
    fn malformed_sections_are_refused() {
        let section = build_section("x");
        assert_eq!(
            MetaRecord::parse(&section[..100]),
            Err(MetaError::Truncated { found: 100 })
        );
        let mut bad = section;
        bad[0] = b'X';
        assert_eq!(MetaRecord::parse(&bad), Err(MetaError::BadMagic));
        let mut bad = section;
        bad[MANIFEST_LEN_RANGE].copy_from_slice(&9999u32.to_le_bytes());
        assert_eq!(
            MetaRecord::parse(&bad),
            Err(MetaError::ManifestLength(9999))
        );
        let mut bad = section;
        bad[MANIFEST_OFFSET] = 0xff;
        assert_eq!(MetaRecord::parse(&bad), Err(MetaError::NotUtf8));
        let mut bad = section;
        bad[LAYOUT_RANGE].copy_from_slice(&7u32.to_le_bytes());
        assert_eq!(MetaRecord::parse(&bad), Err(MetaError::Layout(7)));
    }
}
