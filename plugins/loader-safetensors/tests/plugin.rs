//! The plugin through its ABI objects, in-process: a test host grants one directory, the loader
//! opens files only through it, and errors come back as `UError`s.

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString},
};
use std::{os::fd::IntoRawFd, path::PathBuf};
use u_sdk::{
    ErrorKind, Host, Host_TO, HostBox, LogLevel, MetaValue, PluginInstance, UError, WriteMode,
};

/// Grants reads under `root` only, like the real host's `fs.read` check.
#[derive(Clone)]
struct TestHost {
    root: PathBuf,
}

impl Host for TestHost {
    fn plugin_name(&self) -> RString {
        "loader-safetensors".into()
    }
    fn log(&self, _level: LogLevel, _message: RStr<'_>) {}
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        let p = PathBuf::from(path.as_str());
        if !p.starts_with(&self.root) {
            return RResult::RErr(UError::denied(format!(
                "{} is outside the grant",
                p.display()
            )));
        }
        match std::fs::File::open(&p) {
            Ok(f) => RResult::ROk(f.into_raw_fd()),
            Err(e) => RResult::RErr(UError::io(p.display(), e)),
        }
    }
    fn open_write(&self, _: RStr<'_>, _: WriteMode) -> RResult<i32, UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn rename(&self, _: RStr<'_>, _: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn remove(&self, _: RStr<'_>) -> RResult<(), UError> {
        RResult::RErr(UError::denied("no fs.write"))
    }
    fn threads(&self) -> u32 {
        1
    }
    fn config(&self) -> RString {
        RString::new()
    }
}

/// The error of a failed `open` (weight sets are not `Debug`).
fn open_err(l: &u_sdk::LoaderBox, path: &std::path::Path) -> UError {
    match l.open(path.to_str().unwrap().into()) {
        RResult::ROk(_) => panic!("{} opened but should not", path.display()),
        RResult::RErr(e) => e,
    }
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/safetensors")
        .canonicalize()
        .unwrap()
}

fn loader(root: PathBuf) -> u_sdk::LoaderBox {
    let host: HostBox = Host_TO::from_value(TestHost { root }, TD_Opaque);
    match u_loader_safetensors::instantiate(host).unwrap() {
        PluginInstance::Loader(l) => l,
        other => panic!("wrong kind {}", other.kind_name()),
    }
}

#[test]
fn opens_sharded_model_through_the_host() {
    let dir = fixtures().join("llama_sharded");
    let l = loader(fixtures());
    assert_eq!(
        l.formats().unwrap().as_slice(),
        &[RString::from("safetensors")]
    );
    assert!(
        l.can_open(
            dir.join("model.safetensors.index.json")
                .to_str()
                .unwrap()
                .into(),
            [].as_slice().into()
        )
        .unwrap()
    );
    let ws = l.open(dir.to_str().unwrap().into()).unwrap();
    assert_eq!(ws.format().unwrap().as_str(), "safetensors");
    assert_eq!(
        ws.architecture().unwrap().into_option().unwrap().as_str(),
        "llama"
    );
    let infos = ws.tensors().unwrap();
    assert_eq!(infos.len(), 1 + 2 * 9 + 2);
    let q = infos
        .iter()
        .find(|i| i.name.as_str() == "model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.dtype, u_sdk::DType::F16);
    assert_eq!(q.shape.as_slice(), &[8, 8]);
    assert_eq!(q.byte_len, 128);
    let view = ws
        .tensor("model.layers.1.self_attn.q_proj.weight".into())
        .unwrap();
    assert_eq!(view.data.len(), 128);
    assert!(
        ws.metadata_keys()
            .unwrap()
            .iter()
            .any(|k| k.as_str() == "config.num_hidden_layers")
    );
    assert_eq!(
        ws.metadata("config.num_hidden_layers".into())
            .unwrap()
            .into_option(),
        Some(MetaValue::UInt(2))
    );
    let err = ws.tensor("blk.1.attn_q.weight".into()).unwrap_err();
    assert_eq!(
        err.kind,
        ErrorKind::NotFound,
        "names are the file's own, not an architecture's: {err}"
    );
}

#[test]
fn reads_outside_the_grant_are_denied() {
    let l = loader(fixtures().join("llama_sharded"));
    let err = open_err(&l, &fixtures().join("all_dtypes.safetensors"));
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.message.contains("loader-safetensors"), "{err}");
}

#[test]
fn malformed_files_come_back_as_errors() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let bad = root.join("bad.safetensors");
    std::fs::write(&bad, [8, 0, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
    let err = open_err(&loader(root.clone()), &bad);
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("bad.safetensors"), "{err}");
    let missing = root.join("missing.safetensors");
    let err = open_err(&loader(root), &missing);
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
}

#[test]
fn sniffing() {
    assert!(u_loader_safetensors::sniff("x.safetensors", &[]));
    let mut head = 10u64.to_le_bytes().to_vec();
    head.push(b'{');
    assert!(u_loader_safetensors::sniff("blob", &head));
    assert!(!u_loader_safetensors::sniff("blob", b"GGUF\x03\0\0\0\0"));
}

#[test]
fn manifest_is_valid_and_asks_only_for_fs_read() {
    use u_sdk::manifest::{Capability, PluginKind, PluginManifest};
    let m = PluginManifest::parse(include_str!("../plugin.toml")).unwrap();
    assert_eq!(m.name, "loader-safetensors");
    assert_eq!(m.kind, PluginKind::Loader);
    assert_eq!(
        m.capabilities.into_iter().collect::<Vec<_>>(),
        [Capability::FsRead]
    );
}
