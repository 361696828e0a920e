//! Fuzzes everything the host and `u-attest` read from a component file before trusting it:
//! the ELF facts and sanity checks, the `.u.meta` record, the signed manifest, the surface
//! inspection and signature verification. Any bytes must give `Ok` or an error, never a panic,
//! and the manifest and meta parsers are also fed the raw input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use u_attest::{PublicKey, SecretKey, elf, inspect_bytes, verify_bytes};
use u_sdk::{manifest::PluginManifest, meta::MetaRecord};

fuzz_target!(|data: &[u8]| {
    if let Ok(facts) = elf::analyse(data) {
        let _ = MetaRecord::parse(&data[facts.meta.clone()]);
    }
    let _ = elf::check_sanity(data);
    let _ = inspect_bytes(data);
    static KEY: OnceLock<PublicKey> = OnceLock::new();
    let key = KEY.get_or_init(|| SecretKey::generate().expect("a key").public());
    let _ = verify_bytes(data, std::slice::from_ref(key));
    let _ = MetaRecord::parse(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = PluginManifest::parse(text);
    }
});
