//! Fingerprints the ABI: hashes the tokens of every source file under `src/abi/` (comments and
//! layout whitespace removed, see `abi_fingerprint.rs`), so that any change to an interface, a
//! `#[repr(C)]` type or a dtype yields a new `ABI_HASH` while documentation can be reworded
//! freely. Plugins embed the hash they were built with; the host compares it before `dlopen`.

use std::{env, fs, path::Path};

include!("abi_fingerprint.rs");

fn main() {
    let abi_dir = Path::new("src/abi");
    println!("cargo:rerun-if-changed=src/abi");
    println!("cargo:rerun-if-changed=abi_fingerprint.rs");
    let mut paths: Vec<_> = fs::read_dir(abi_dir)
        .expect("src/abi exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    paths.sort();
    let files: Vec<(String, String)> = paths
        .iter()
        .map(|path| {
            println!("cargo:rerun-if-changed={}", path.display());
            let name = path
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            (name, fs::read_to_string(path).expect("readable source"))
        })
        .collect();
    let bytes: Vec<String> = fingerprint(&files)
        .iter()
        .map(|b| format!("{b:#04x}"))
        .collect();
    let out = Path::new(&env::var("OUT_DIR").expect("OUT_DIR")).join("abi_hash.rs");
    fs::write(out, format!("[{}]", bytes.join(", "))).expect("write abi_hash.rs");
}
