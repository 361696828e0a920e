//! The plugin through its ABI objects, in-process: a test host grants one directory, the loader
//! opens files only through it, and errors come back as `UError`s.

#[path = "../src/test_writer.rs"]
mod test_writer;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RResult, RStr, RString},
};
use std::{
    os::fd::IntoRawFd,
    path::{Path, PathBuf},
};
use test_writer::ModelBinWriter;
use u_sdk::{
    DType, ErrorKind, Host, Host_TO, HostBox, LogLevel, MetaValue, PluginInstance, UError,
    WriteMode,
};

/// Grants reads under `root` only, like the real host's `fs.read` check.
#[derive(Clone)]
struct TestHost {
    root: PathBuf,
}

impl Host for TestHost {
    fn plugin_name(&self) -> RString {
        "loader-ctranslate2".into()
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

fn loader(root: &Path) -> u_sdk::LoaderBox {
    let host: HostBox = Host_TO::from_value(
        TestHost {
            root: root.to_path_buf(),
        },
        TD_Opaque,
    );
    match u_loader_ctranslate2::instantiate(host).unwrap() {
        PluginInstance::Loader(l) => l,
        other => panic!("wrong kind {}", other.kind_name()),
    }
}

/// The error of a failed `open` (weight sets are not `Debug`).
fn open_err(l: &u_sdk::LoaderBox, path: &Path) -> UError {
    match l.open(path.to_str().unwrap().into()) {
        RResult::ROk(_) => panic!("{} opened but should not", path.display()),
        RResult::RErr(e) => e,
    }
}

/// A model directory like a converted one: `model.bin` and `config.json`.
fn model_dir(root: &Path) -> PathBuf {
    let dir = root.join("tiny-ct2");
    std::fs::create_dir_all(&dir).unwrap();
    let bin = ModelBinWriter::new("TransformerSpec", 7)
        .var("encoder/num_heads", &[], 2, &4i16.to_le_bytes())
        .var(
            "encoder/embeddings_0/weight",
            &[4, 2],
            0,
            &(0..8)
                .flat_map(|i| (i as f32).to_le_bytes())
                .collect::<Vec<_>>(),
        )
        .var(
            "decoder/embeddings/weight",
            &[2, 2],
            5,
            &[0, 0x3f, 0, 0x40, 0, 0x40, 0x80, 0x40],
        )
        .alias("decoder/projection/weight", "decoder/embeddings/weight")
        .bytes();
    std::fs::write(dir.join("model.bin"), bin).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"add_source_bos": false, "decoder_start_token": "<s>"}"#,
    )
    .unwrap();
    dir
}

#[test]
fn opens_a_model_directory_through_the_host() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let dir = model_dir(&root);
    let l = loader(&root);
    assert_eq!(
        l.formats().unwrap().as_slice(),
        &[RString::from("ctranslate2")]
    );
    let head = std::fs::read(dir.join("model.bin")).unwrap();
    assert!(
        l.can_open(
            dir.join("model.bin").to_str().unwrap().into(),
            head.as_slice().into()
        )
        .unwrap()
    );
    assert!(
        l.can_open(dir.to_str().unwrap().into(), [].as_slice().into())
            .unwrap(),
        "a directory holding model.bin (the host passes an empty head)"
    );

    for path in [dir.clone(), dir.join("model.bin")] {
        let ws = l.open(path.to_str().unwrap().into()).unwrap();
        assert_eq!(ws.format().unwrap().as_str(), "ctranslate2");
        assert_eq!(
            ws.architecture().unwrap().into_option().unwrap().as_str(),
            "transformer"
        );
        let infos = ws.tensors().unwrap();
        let names: Vec<&str> = infos.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "encoder/embeddings_0/weight",
                "decoder/embeddings/weight",
                "decoder/projection/weight"
            ]
        );
        assert_eq!(infos[1].dtype, DType::BF16);
        assert_eq!(infos[2].shape.as_slice(), &[2, 2]);
        let v = ws.tensor("encoder/embeddings_0/weight".into()).unwrap();
        assert_eq!(v.data.len(), 32);
        assert_eq!(v.data.as_ptr().addr() % 16, 0);
        assert_eq!(
            v.to_f32().unwrap(),
            (0..8).map(|i| i as f32).collect::<Vec<_>>()
        );
        let p = ws.tensor("decoder/projection/weight".into()).unwrap();
        assert_eq!(p.to_f32().unwrap(), [0.5, 2.0, 2.0, 4.0]);
        let meta = |k: &str| ws.metadata(k.into()).unwrap().into_option();
        assert_eq!(
            meta("ctranslate2.encoder/num_heads"),
            Some(MetaValue::Int(4))
        );
        assert_eq!(meta("ctranslate2.revision"), Some(MetaValue::UInt(7)));
        assert_eq!(meta("config.add_source_bos"), Some(MetaValue::Bool(false)));
        assert!(
            ws.metadata_keys()
                .unwrap()
                .iter()
                .any(|k| k.as_str() == "config.decoder_start_token")
        );
        let err = ws.tensor("encoder/num_heads".into()).unwrap_err();
        assert_eq!(err.kind, ErrorKind::NotFound, "scalars are metadata: {err}");
    }
}

#[test]
fn reads_outside_the_grant_are_denied() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let dir = model_dir(&root);
    let granted = root.join("elsewhere");
    std::fs::create_dir_all(&granted).unwrap();
    let err = open_err(&loader(&granted), &dir);
    assert_eq!(err.kind, ErrorKind::PermissionDenied, "{err}");
    assert!(err.message.contains("loader-ctranslate2"), "{err}");
}

#[test]
fn a_config_json_outside_the_grant_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let dir = model_dir(&root);
    // Grant the model file only: config.json is optional and simply not read.
    let host: HostBox = Host_TO::from_value(
        TestHost {
            root: dir.join("model.bin"),
        },
        TD_Opaque,
    );
    let PluginInstance::Loader(l) = u_loader_ctranslate2::instantiate(host).unwrap() else {
        panic!("not a loader")
    };
    let ws = l.open(dir.to_str().unwrap().into()).unwrap();
    assert_eq!(
        ws.metadata("config.add_source_bos".into())
            .unwrap()
            .into_option(),
        None
    );
}

#[test]
fn malformed_files_come_back_as_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let l = loader(&root);

    let bad = root.join("bad/model.bin");
    std::fs::create_dir_all(bad.parent().unwrap()).unwrap();
    let mut bytes = ModelBinWriter::new("WhisperSpec", 3)
        .var("w", &[4], 0, &[0; 16])
        .bytes();
    bytes.truncate(bytes.len() - 6);
    std::fs::write(&bad, &bytes).unwrap();
    let err = open_err(&l, &bad);
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("bad/model.bin"), "{err}");
    assert!(err.message.contains("data of `w`"), "{err}");

    let old = root.join("old/model.bin");
    std::fs::create_dir_all(old.parent().unwrap()).unwrap();
    std::fs::write(
        &old,
        ModelBinWriter::new("TransformerSpec", 1).version(4).bytes(),
    )
    .unwrap();
    let head = std::fs::read(&old).unwrap();
    assert!(
        l.can_open(old.to_str().unwrap().into(), head.as_slice().into())
            .unwrap(),
        "recognised, so that opening names the version"
    );
    let err = open_err(&l, &old);
    assert_eq!(err.kind, ErrorKind::Unsupported, "{err}");
    assert!(err.message.contains("binary version 4"), "{err}");

    let bad_config = root.join("bad_config");
    std::fs::create_dir_all(&bad_config).unwrap();
    std::fs::write(
        bad_config.join("model.bin"),
        ModelBinWriter::new("WhisperSpec", 3).bytes(),
    )
    .unwrap();
    std::fs::write(bad_config.join("config.json"), "{").unwrap();
    let err = open_err(&l, &bad_config);
    assert_eq!(err.kind, ErrorKind::InvalidInput, "{err}");
    assert!(err.message.contains("config.json"), "{err}");

    let err = open_err(&l, &root.join("missing"));
    assert_eq!(err.kind, ErrorKind::NotFound, "{err}");
    assert!(err.message.contains("missing/model.bin"), "{err}");
}

#[test]
fn sniffing() {
    use u_loader_ctranslate2::sniff;
    let head = ModelBinWriter::new("WhisperSpec", 3).bytes();
    assert!(sniff("anything", &head));
    assert!(sniff("/models/x/model.bin", &[]), "no head: by name");
    assert!(
        !sniff("/models/x/model.bin", b"PK\x03\x04 a zip"),
        "a head decides"
    );
    assert!(!sniff("/models/x/pytorch_model.bin", &[]));
    assert!(!sniff("x.safetensors", &[]));
    assert!(!sniff("blob", b"GGUF\x03\0\0\0\0\0\0\0"));
    let tmp = tempfile::tempdir().unwrap();
    assert!(!sniff(tmp.path().to_str().unwrap(), &[]));
    std::fs::write(tmp.path().join("model.bin"), &head).unwrap();
    assert!(sniff(tmp.path().to_str().unwrap(), &[]));
}

#[test]
fn manifest_is_valid_and_asks_only_for_fs_read() {
    use u_sdk::manifest::{Capability, PluginKind, PluginManifest};
    let m = PluginManifest::parse(include_str!("../plugin.toml")).unwrap();
    assert_eq!(m.name, "loader-ctranslate2");
    assert_eq!(m.kind, PluginKind::Loader);
    assert_eq!(
        m.capabilities.into_iter().collect::<Vec<_>>(),
        [Capability::FsRead]
    );
}
