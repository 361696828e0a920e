//! The GGML container on small files the fuzz seeds hold (`fuzz/seeds/`: an F32 and an F16
//! tensor; two Q8_0 rows): hyper-parameters, mel filters and vocabulary as metadata, shapes
//! outermost first, aligned views with the stored bytes; every truncation and a bad magic or
//! type are errors that say what is wrong.

use std::sync::Arc;
use u_loader_ggml::{Error, GgmlModel, model::ALIGN};
use u_sdk::{DType, MetaValue};

fn seed(name: &str) -> Vec<u8> {
    std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/seeds")
            .join(name),
    )
    .expect("the seed")
}

fn parse(bytes: &[u8]) -> Result<GgmlModel, Error> {
    GgmlModel::parse(Arc::new(bytes.to_vec()))
}

#[test]
fn tensors_metadata_and_views() {
    let m = parse(&seed("tiny.bin")).expect("parses");
    let meta = |k: &str| {
        m.metadata()
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(meta("whisper.n_audio_state"), Some(MetaValue::Int(8)));
    assert_eq!(meta("whisper.ftype"), Some(MetaValue::Int(1)));
    assert_eq!(
        meta("whisper.mel_filters_shape"),
        Some(MetaValue::IntArray(vec![2, 3].into()))
    );
    match meta("whisper.vocab") {
        Some(MetaValue::StrArray(v)) => assert_eq!(v.len(), 3),
        other => panic!("{other:?}"),
    }
    let conv = m.tensor("encoder.conv1.weight").expect("the conv");
    assert_eq!(
        (conv.dtype, conv.shape.as_slice()),
        (DType::F16, &[8, 2, 3][..])
    );
    for t in m.tensors() {
        let v = m.view(&t.name).expect("a view");
        assert!(v.data.as_ptr().addr().is_multiple_of(ALIGN));
        let ones = u_sdk::quant::dequantize_view(&v).expect("converts");
        assert!(ones.iter().all(|&x| x == 1.0), "{}", t.name);
    }
    let q = parse(&seed("q8.bin")).expect("parses");
    let t = q
        .tensor("decoder.token_embedding.weight")
        .expect("the table");
    assert_eq!((t.dtype, t.shape.as_slice()), (DType::Q8_0, &[2, 32][..]));
    let values = u_sdk::quant::dequantize_view(&q.view(&t.name).unwrap()).unwrap();
    assert_eq!(values[0], -8.0);
    assert_eq!(values[63], 30.0);
}

#[test]
fn bad_files_are_clear_errors() {
    let file = seed("tiny.bin");
    for len in 0..file.len() {
        match parse(&file[..len]) {
            Ok(m) => assert!(
                m.tensors().len() < 2,
                "a cut at {len} between tensors keeps fewer"
            ),
            Err(e) => assert!(matches!(e, Error::Truncated { .. }), "a cut at {len}: {e}"),
        }
    }
    let mut bad = file.clone();
    bad[0] ^= 1;
    assert!(
        parse(&bad)
            .unwrap_err()
            .to_string()
            .contains("not a whisper.cpp GGML file")
    );
    // The last tensor's type (F16 = 1) becomes 99.
    let name = b"encoder.conv1.weight";
    let at = file.windows(name.len()).position(|w| w == name).unwrap();
    let type_at = at - 3 * 4 - 4;
    let mut bad = file.clone();
    bad[type_at] = 99;
    let e = parse(&bad).unwrap_err().to_string();
    assert!(e.contains("ggml type 99"), "{e}");
}
