//! An image encoder (arch-vit's tiny random DINOv2 fixture) served by runner-embeddings and
//! called as transports call it, through the engine box: the image is decoded and preprocessed
//! as the model's processor says, embedded with the model's own pooling and normalised; the
//! answer through the box equals the direct one (a wrapper once answered with a default
//! instead); text, a corrupt file and an image past the pixel limit are refused.

use u_runner_embeddings::EmbeddingsRunner;
use u_sdk::{EngineBox, ErrorKind};

fn fixture(rel: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn engine(max_pixels: u64) -> (u_runner_embeddings::Embedder, EngineBox) {
    let dir = fixture("../arch-vit/tests/fixtures/models/dinov2");
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, &dir)
        .expect("the fixture");
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(1)
        .expect("kernels")
        .into_box();
    let model = u_arch_vit::VitArchitecture
        .load(weights, backend)
        .expect("the tower");
    let runner = EmbeddingsRunner {
        images: u_image::Limits { max_pixels },
    };
    let e = runner
        .serve("dino", model, None)
        .expect("served without a tokenizer");
    (e.clone(), EngineBox::new(e))
}

#[test]
fn images_embed_through_the_engine_box() {
    let png = std::fs::read(fixture("../../tests/fixtures/vision/dinov2_image.png")).unwrap();
    let (direct, boxed) = engine(u_image::Limits::default().max_pixels);
    let want = direct.embed_image(&png).expect("direct");
    let got = boxed
        .embed_image("dino".into(), png.as_slice().into())
        .into_result()
        .expect("through the box");
    assert_eq!(got.as_slice(), want.as_slice());
    let norm: f32 = got.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "normalised: {norm}");

    let text = boxed.embed("dino".into(), "a cat".into()).into_result();
    assert!(text.unwrap_err().message.contains("reads no text"));
    let cut = boxed
        .embed_image("dino".into(), png[..png.len() / 3].into())
        .into_result()
        .unwrap_err();
    assert_eq!(cut.kind, ErrorKind::InvalidInput, "{}", cut.message);
    let (_, small) = engine(1000);
    let big = small
        .embed_image("dino".into(), png.as_slice().into())
        .into_result()
        .unwrap_err();
    assert!(big.message.contains("pixels"), "{}", big.message);
}
