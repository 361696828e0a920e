//! CLIP served for embeddings (issue #18): the tiny random-weight `CLIPModel` of
//! `tests/fixtures/clip_tiny/` at the workspace root (`gen_clip_tiny.py` beside it) as two
//! models — arch-clip's text side (family `clip`) and arch-vit's image side (`clip.vision`),
//! the image encoder the host passes beside the text model — called as transports call it,
//! through the engine box: texts are tokenized by the checkpoint's `tokenizer.json` (the ids
//! transformers was given, an over-long text cut to 16 with its special tokens kept) and embed
//! as `get_text_features` normalised, the PNG embeds as `get_image_features` of the pixels PIL
//! made from it, normalised, both within [`TOL`]. Without the image encoder the text model
//! refuses images; an image encoder of another width is refused at start.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_runner_embeddings::EmbeddingsRunner;
use u_sdk::{EngineBox, ModelBox, WeightSetBox};

/// Stated tolerance (f32 both sides).
const TOL: f32 = 1e-4;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn clip_dir() -> PathBuf {
    fixture("../../tests/fixtures/clip_tiny")
}

fn weights(dir: &Path) -> WeightSetBox {
    let m = u_loader_safetensors::SafetensorsModel::open(&u_loader_safetensors::StdFs, dir)
        .expect("the fixture");
    u_loader_safetensors::SafetensorsWeights::new(m).into_box()
}

fn backend() -> u_sdk::BackendBox {
    u_kernels_cpu::CpuKernels::new(1)
        .expect("kernels")
        .into_box()
}

/// The text side, the image side and the tokenizer of the fixture.
fn clip() -> (ModelBox, ModelBox, u_sdk::TokenizerBox) {
    let dir = clip_dir().join("model");
    let text = u_arch_clip::ClipArchitecture
        .load(weights(&dir), backend())
        .expect("the text side");
    let image = u_arch_vit::VitArchitecture
        .load(weights(&dir), backend())
        .expect("the image side");
    let json = std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer.json");
    let tokenizer = u_tokenizer::Tok::from_json(&json, None)
        .expect("the tokenizer")
        .into_box();
    (text, image, tokenizer)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn floats(v: &Value) -> Vec<f32> {
    serde_json::from_value(v.clone()).expect("floats")
}

#[test]
fn texts_and_images_embed_as_transformers_through_the_engine_box() {
    let (text, image, tokenizer) = clip();
    let direct = EmbeddingsRunner::default()
        .serve_with_images(("clip", Vec::new()), text, Some(tokenizer), image)
        .expect("served with its image encoder");
    let boxed = EngineBox::new(direct.clone());
    let e: Value =
        serde_json::from_slice(&std::fs::read(clip_dir().join("expected.json")).unwrap()).unwrap();
    let mut worst = 0f32;
    for case in e["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(direct.tokens(text).unwrap(), ids, "{text:?}: ids");
        let got = boxed
            .embed("clip".into(), text.into())
            .into_result()
            .expect("a text embedding");
        assert_eq!(got.len(), 24);
        worst = worst.max(max_diff(&got, &floats(&case["embedding"])));
    }
    let png = std::fs::read(clip_dir().join("picture.png")).unwrap();
    let got = boxed
        .embed_image("clip".into(), png.as_slice().into())
        .into_result()
        .expect("an image embedding");
    let image = max_diff(&got, &floats(&e["picture"]["embedding"]));
    eprintln!("clip embeddings: texts max |diff| {worst:.2e}, the PNG {image:.2e}");
    assert!(worst <= TOL, "texts: max |diff| {worst}");
    assert!(image <= TOL, "the PNG: max |diff| {image}");
    let norm: f32 = got.iter().map(|v| v * v).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "normalised: {norm}");
}

#[test]
fn a_text_model_without_an_image_encoder_refuses_images() {
    let (text, _, tokenizer) = clip();
    let boxed = EngineBox::new(
        EmbeddingsRunner::default()
            .serve("clip-text", text, Some(tokenizer))
            .expect("served"),
    );
    let png = std::fs::read(clip_dir().join("picture.png")).unwrap();
    let e = boxed
        .embed_image("clip-text".into(), png.as_slice().into())
        .into_result()
        .unwrap_err();
    assert!(e.message.contains("does not embed images"), "{}", e.message);
    // Text still embeds.
    let v = boxed
        .embed("clip-text".into(), "a cat".into())
        .into_result();
    assert_eq!(v.expect("text").len(), 24);
}

#[test]
fn an_image_encoder_of_another_width_is_refused() {
    let (text, _, tokenizer) = clip();
    let dino = u_arch_vit::VitArchitecture
        .load(
            weights(&fixture("../arch-vit/tests/fixtures/models/dinov2")),
            backend(),
        )
        .expect("the DINOv2 tower");
    let e = EmbeddingsRunner::default()
        .serve_with_images(("clip", Vec::new()), text, Some(tokenizer), dino)
        .err()
        .expect("refused");
    assert!(
        e.message.contains("of the text model's width 24"),
        "{}",
        e.message
    );
}
