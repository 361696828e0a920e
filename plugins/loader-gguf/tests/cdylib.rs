//! Loads the built plugin (`libu_loader_gguf.so`) the way the host does and checks its embedded
//! manifest and its root module.

use std::path::PathBuf;
use u_sdk::{
    manifest::PluginManifest,
    meta::{MetaRecord, load_root_module, root_symbol},
};

fn cdylib() -> PathBuf {
    // Integration tests run from target/<profile>/deps, next to the freshly built cdylib.
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().join("libu_loader_gguf.so");
    assert!(path.exists(), "{} was not built", path.display());
    path
}

#[test]
fn the_cdylib_exports_its_manifest_and_root_module() {
    let module = load_root_module(&cdylib(), &root_symbol("u_loader_gguf"))
        .expect("load the plugin; root module layout matches the SDK");
    let record = MetaRecord::parse(&(module.meta_section())()).unwrap();
    assert_eq!(record.abi_hash, u_sdk::ABI_HASH);
    assert!(!record.is_signed());
    let manifest = PluginManifest::parse(&record.manifest).unwrap();
    assert_eq!(manifest.name, "loader-gguf");
    assert_eq!(manifest.kind, u_sdk::manifest::PluginKind::Loader);
    assert!(manifest.requests(u_sdk::manifest::Capability::FsRead));
    assert_eq!(manifest.capabilities.len(), 1);
    let info = (module.describe())();
    assert!(info.summary.contains("GGUF"), "{}", info.summary);
}
