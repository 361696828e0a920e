//! The fuzz target's seeds (`fuzz/seeds`) are small valid `model.bin` files that must stay
//! readable as the loader changes; set `U_WRITE_FUZZ_SEEDS=1` to write them anew.

#[path = "../src/test_writer.rs"]
mod test_writer;

use std::path::Path;
use test_writer::ModelBinWriter;
use u_loader_ctranslate2::CTranslate2Model;

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let f16 = |n: usize| {
        (0..n)
            .flat_map(|i| (0x3c00u16 + i as u16).to_le_bytes())
            .collect::<Vec<_>>()
    };
    vec![
        (
            "whisper_like.bin",
            ModelBinWriter::new("WhisperSpec", 3)
                .var("decoder/activation", &[], 1, &[3])
                .var("decoder/alignment_layer", &[], 2, &(-1i16).to_le_bytes())
                .var("decoder/embeddings/weight", &[4, 3], 4, &f16(12))
                .var("decoder/num_heads", &[], 2, &2i16.to_le_bytes())
                .var("encoder/conv1/weight", &[3, 2, 3], 4, &f16(18))
                .var("encoder/num_heads", &[], 2, &2i16.to_le_bytes())
                .alias("decoder/projection/weight", "decoder/embeddings/weight")
                .bytes(),
        ),
        (
            "all_dtypes_v5.bin",
            ModelBinWriter::new("TransformerSpec", 7)
                .version(5)
                .var(
                    "f32",
                    &[2],
                    0,
                    &[1.5f32, -2.0].map(f32::to_le_bytes).concat(),
                )
                .var("i8", &[3], 1, &[1, 0xff, 7])
                .var("i16", &[1, 2], 2, &[1, 0, 0xff, 0xff])
                .var("i32", &[1], 3, &(-5i32).to_le_bytes())
                .var("f16", &[2, 1], 4, &f16(2))
                .var("bf16", &[2], 5, &[0x80, 0x3f, 0, 0x40])
                .var("scale", &[], 0, &0.5f32.to_le_bytes())
                .var("empty", &[0, 3], 4, &[])
                .alias("f32_alias", "f32")
                .alias("scale_alias", "scale")
                .bytes(),
        ),
    ]
}

#[test]
fn seeds_are_valid_model_bins() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    for (name, bytes) in seeds() {
        let path = dir.join(name);
        if std::env::var_os("U_WRITE_FUZZ_SEEDS").is_some() {
            std::fs::write(&path, &bytes).unwrap();
        }
        let kept = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(
            kept,
            bytes,
            "{} is stale: rerun with U_WRITE_FUZZ_SEEDS=1",
            path.display()
        );
        let m = CTranslate2Model::from_bytes(kept, None)
            .unwrap_or_else(|e| panic!("seed {}: {e}", path.display()));
        assert!(!m.tensors().is_empty());
        for t in m.tensors() {
            m.tensor_f32(&t.name).unwrap();
        }
    }
}
