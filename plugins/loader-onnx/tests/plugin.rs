//! The plugin through its ABI objects, in-process: a test host grants chosen paths, the loader
//! opens the model and its external data only through it, and errors come back as `UError`s.

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString},
};
use std::{os::fd::IntoRawFd, path::PathBuf};
use u_sdk::{
    DType, ErrorKind, Host, Host_TO, HostBox, LoaderBox, LogLevel, MetaValue, PluginInstance,
    UError, WriteMode,
};

/// Grants reads of the listed paths (and everything under them) only.
#[derive(Clone)]
struct TestHost {
    grants: Vec<PathBuf>,
}

impl Host for TestHost {
    fn plugin_name(&self) -> RString {
        "loader-onnx".into()
    }
    fn log(&self, _level: LogLevel, _message: RStr<'_>) {}
    fn open_read(&self, path: RStr<'_>) -> RResult<i32, UError> {
        let p = PathBuf::from(path.as_str());
        if !self.grants.iter().any(|g| p.starts_with(g)) {
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

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/onnx")
        .canonicalize()
        .unwrap()
}

fn loader(grants: Vec<PathBuf>) -> LoaderBox {
    let host: HostBox = Host_TO::from_value(TestHost { grants }, TD_Opaque);
    match u_loader_onnx::instantiate(host).unwrap() {
        PluginInstance::Loader(l) => l,
        other => panic!("wrong kind {}", other.kind_name()),
    }
}

fn open_err(l: &LoaderBox, path: &std::path::Path) -> UError {
    match l.open(path.to_str().unwrap().into()) {
        RResult::ROk(_) => panic!("{} opened but should not", path.display()),
        RResult::RErr(e) => e,
    }
}

#[test]
fn opens_external_model_through_the_host() {
    let model = fixtures().join("external/model.onnx");
    let l = loader(vec![fixtures()]);
    assert_eq!(l.formats().unwrap().as_slice(), &[RString::from("onnx")]);
    assert!(
        l.can_open(model.to_str().unwrap().into(), [].as_slice().into())
            .unwrap()
    );
    let ws = l.open(model.to_str().unwrap().into()).unwrap();
    assert_eq!(ws.format().unwrap().as_str(), "onnx");
    assert_eq!(
        ws.architecture().unwrap().into_option().unwrap().as_str(),
        "llama"
    );
    let infos = ws.tensors().unwrap();
    assert_eq!(infos.len(), 14);
    let q = infos
        .iter()
        .find(|i| i.name.as_str() == "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(
        (q.dtype, q.shape.as_slice(), q.byte_len),
        (DType::F32, &[8u64, 8][..], 256)
    );
    let v = ws
        .tensor("model.layers.0.self_attn.q_proj.weight".into())
        .unwrap();
    assert_eq!(v.data.len(), 256);
    assert_eq!(
        ws.metadata("config.model_type".into())
            .unwrap()
            .into_option(),
        Some(MetaValue::Str("llama".into()))
    );
    let err = ws.tensor("nope".into()).unwrap_err();
    assert_eq!(err.kind, ErrorKind::NotFound);
}

#[test]
fn external_data_outside_the_grant_is_denied() {
    // Only the model file (and its config) is granted, not weights.bin.
    let dir = fixtures().join("external");
    let l = loader(vec![dir.join("model.onnx"), dir.join("config.json")]);
    let err = open_err(&l, &dir.join("model.onnx"));
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.message.contains("weights.bin"), "{err}");
}

#[test]
fn garbage_comes_back_as_invalid_input() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    let bad = root.join("bad.onnx");
    std::fs::write(&bad, [0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f]).unwrap();
    let err = open_err(&loader(vec![root.clone()]), &bad);
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("bad.onnx"), "{err}");
}

#[test]
fn sniffing() {
    assert!(u_loader_onnx::sniff("m.onnx", &[]));
    let head = std::fs::read(fixtures().join("tiny_llama.onnx")).unwrap();
    assert!(u_loader_onnx::sniff("blob", &head[..64]));
    assert!(!u_loader_onnx::sniff("blob", b"GGUF\x03\0\0\0"));
    assert!(!u_loader_onnx::sniff("blob", b"\x08\0\0\0{"));
}

#[test]
fn manifest_is_valid_and_asks_only_for_fs_read() {
    use u_sdk::manifest::{Capability, PluginKind, PluginManifest};
    let m = PluginManifest::parse(include_str!("../plugin.toml")).unwrap();
    assert_eq!(m.name, "loader-onnx");
    assert_eq!(m.kind, PluginKind::Loader);
    assert_eq!(
        m.capabilities.into_iter().collect::<Vec<_>>(),
        [Capability::FsRead]
    );
}
