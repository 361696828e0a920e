//! Fingerprints the ABI: hashes the tokens of every source file under `src/abi/` (comments and
//! layout whitespace removed, see `abi_fingerprint.rs`), so that any change to an interface, a
//! `#[repr(C)]` type or a dtype yields a new `ABI_HASH` while documentation can be reworded
//! freely. Plugins embed the hash they were built with; the host compares it before `dlopen`.

use sha2::{Digest, Sha256};
use std::{env, fs, path::Path};

include!("abi_fingerprint.rs");

fn main() {
    let abi_dir = Path::new("src/abi");
    println!("cargo:rerun-if-changed=src/abi");
    println!("cargo:rerun-if-changed=abi_fingerprint.rs");
    let mut files: Vec<_> = fs::read_dir(abi_dir)
        .expect("src/abi exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    files.sort();
    let mut hasher = Sha256::new();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
        let name = file.file_name().expect("file name").to_string_lossy();
        hasher.update(name.as_bytes());
        hasher.update([0]);
        let text = fs::read_to_string(file).expect("readable source");
        hasher.update(abi_tokens(&text).as_bytes());
        hasher.update([0]);
    }
    let digest = hasher.finalize();
    let bytes: Vec<String> = digest.iter().map(|b| format!("{b:#04x}")).collect();
    let out = Path::new(&env::var("OUT_DIR").expect("OUT_DIR")).join("abi_hash.rs");
    fs::write(out, format!("[{}]", bytes.join(", "))).expect("write abi_hash.rs");
}
