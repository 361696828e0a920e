//! The real Whisper tiny.en as CTranslate2 4.x converts it (binary version 6, `WhisperSpec`
//! revision 3, float16): every variable, scalar and alias read as the file states them, every
//! view 16-byte aligned, values as Python's `struct` decodes them, and the same through the
//! plugin's ABI objects.
//!
//! The model folder (`model.bin`, `config.json`, `tokenizer.json`, `vocabulary.txt`) comes from
//! `$U_WHISPER_TINY_EN_DIR`, else the model cache (`cargo xtask fetch-model whisper-tiny-en`).

use std::path::PathBuf;
use u_loader_ctranslate2::{ALIGN, CTranslate2Model, StdFs};
use u_sdk::{DType, MetaValue};

fn whisper_dir() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = var("U_WHISPER_TINY_EN_DIR").unwrap_or_else(|| {
        var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/u/models")))
            .unwrap_or_default()
            .join("whisper-tiny.en-ct2")
    });
    assert!(
        dir.join("model.bin").is_file(),
        "{} is missing: run `cargo xtask fetch-model whisper-tiny-en`",
        dir.join("model.bin").display()
    );
    dir
}

#[test]
fn whisper_tiny_en_reads_as_stored() {
    let dir = whisper_dir();
    let m = CTranslate2Model::open(&StdFs, &dir).unwrap();
    assert_eq!(m.architecture(), Some("whisper"));
    assert_eq!(
        (m.spec(), m.revision(), m.binary_version()),
        ("WhisperSpec", 3, 6)
    );

    // 148 variables: 9 scalars become metadata, 139 tensors, plus 1 alias.
    let tensors = m.tensors();
    assert_eq!(tensors.len(), 139 + 1);
    assert_eq!(tensors.iter().filter(|t| t.alias_of.is_some()).count(), 1);
    assert!(tensors.iter().all(|t| t.dtype == DType::F16));
    let shape = |name: &str| m.tensor(name).map(|t| t.shape.clone());
    assert_eq!(shape("encoder/conv1/weight"), Some(vec![384, 80, 3]));
    assert_eq!(shape("encoder/conv2/weight"), Some(vec![384, 384, 3]));
    assert_eq!(
        shape("encoder/position_encodings/encodings"),
        Some(vec![1500, 384])
    );
    assert_eq!(shape("decoder/embeddings/weight"), Some(vec![51864, 384]));
    assert_eq!(
        shape("decoder/layer_0/attention/linear_1/weight"),
        Some(vec![768, 384])
    );
    assert_eq!(shape("decoder/layer_norm/gamma"), Some(vec![384]));

    // The tied projection is an alias: same bytes, same place.
    let proj = m.tensor("decoder/projection/weight").unwrap();
    let emb = m.tensor("decoder/embeddings/weight").unwrap();
    assert_eq!(proj.alias_of.as_deref(), Some("decoder/embeddings/weight"));
    assert_eq!(proj.shape, emb.shape);
    assert_eq!(m.bytes(proj).as_ptr(), m.bytes(emb).as_ptr());

    for t in tensors {
        let data = m.bytes(t);
        assert_eq!(data.len() as u64, t.info().byte_len, "{}", t.name);
        assert_eq!(
            data.as_ptr().addr() % ALIGN,
            0,
            "{} is not {ALIGN}-aligned",
            t.name
        );
    }

    // Values as Python's struct.unpack('<e') reads them from the file.
    // (Exact: every f16 is an f64 literal as written.)
    let first_two = |name: &str| -> Vec<f64> {
        m.tensor_f32(name).unwrap()[..2]
            .iter()
            .map(|&v| f64::from(v))
            .collect()
    };
    assert_eq!(
        first_two("encoder/conv1/bias"),
        [0.33935546875, -0.64794921875]
    );
    assert_eq!(
        first_two("decoder/layer_norm/gamma"),
        [16.796875, 8.9296875]
    );

    let meta = |k: &str| m.metadata_value(k).cloned();
    for (key, value) in [
        ("decoder/num_heads", 6),
        ("encoder/num_heads", 6),
        ("decoder/activation", 3),
        ("decoder/alibi", 0),
        ("decoder/alignment_heads", 1),
        ("decoder/alignment_layer", -1),
        ("decoder/pre_norm", 1),
        ("decoder/scale_embeddings", 0),
        ("decoder/start_from_zero_embedding", 0),
    ] {
        assert_eq!(
            meta(&format!("ctranslate2.{key}")),
            Some(MetaValue::Int(value)),
            "{key}"
        );
    }
    assert_eq!(
        meta("ctranslate2.spec"),
        Some(MetaValue::Str("WhisperSpec".into()))
    );
    assert_eq!(meta("ctranslate2.revision"), Some(MetaValue::UInt(3)));
    assert_eq!(meta("ctranslate2.binary_version"), Some(MetaValue::UInt(6)));
    // config.json beside it.
    assert_eq!(
        meta("config.suppress_ids_begin"),
        Some(MetaValue::UIntArray(vec![220, 50256].into()))
    );
    assert!(matches!(
        meta("config.alignment_heads"),
        Some(MetaValue::Json(_))
    ));
    match meta("config.lang_ids") {
        Some(MetaValue::UIntArray(ids)) => assert_eq!(ids.len(), 98),
        other => panic!("config.lang_ids: {other:?}"),
    }

    // The file path itself opens the same model.
    let by_file = CTranslate2Model::open(&StdFs, &dir.join("model.bin")).unwrap();
    assert_eq!(by_file.tensors(), m.tensors());
    assert_eq!(by_file.metadata(), m.metadata());
}

#[test]
fn whisper_tiny_en_through_the_abi() {
    use u_sdk::weights::{OpenWeights, WeightSource};
    let dir = whisper_dir();
    use std::io::Read;
    let file = dir.join("model.bin");
    let mut head = Vec::new();
    std::fs::File::open(&file)
        .unwrap()
        .take(4096)
        .read_to_end(&mut head)
        .unwrap();
    assert!(CTranslate2Model::sniff(file.to_str().unwrap(), &head));
    assert!(CTranslate2Model::sniff(dir.to_str().unwrap(), &[]));
    let m = <CTranslate2Model as OpenWeights>::open(&StdFs, &dir).unwrap();
    assert_eq!(<CTranslate2Model as WeightSource>::FORMAT, "ctranslate2");
    let infos = WeightSource::tensors(&m);
    assert_eq!(infos.len(), 140);
    let conv = infos
        .iter()
        .find(|i| i.name.as_str() == "encoder/conv1/weight")
        .unwrap();
    assert_eq!(conv.byte_len, 384 * 80 * 3 * 2);
    let view = WeightSource::tensor(&m, "decoder/projection/weight").unwrap();
    assert_eq!(view.shape.as_slice(), &[51864, 384]);
    assert_eq!(view.data.as_ptr().addr() % ALIGN, 0);
    assert!(
        WeightSource::metadata_keys(&m).contains(&"ctranslate2.decoder/num_heads"),
        "scalars are metadata"
    );
}
