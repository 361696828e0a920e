//! LLaVA's decoder (family `llava`, issue #18) against transformers on the tiny random-weight
//! checkpoint of `tests/fixtures/llava_tiny/` (its generator, `gen_llava_tiny.py`, beside it):
//! fed the fixture's image features (what the image encoder, arch-vit's `llava.vision`, makes)
//! as embedding rows where the prompt's image tokens stand, the decoder's logits equal
//! `LlavaForConditionalGeneration`'s within [`TOL`]; a prefill split before the first image
//! continues its KV across the rows; the model says what an image is and which token stands for
//! one; pixels are refused.

mod support;

use abi_stable::std_types::RSlice;
use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use support::{build, cache_kv, max_abs_diff, run};
use u_sdk::abi_stable;
use u_sdk::{ImageInput, ModelBox, ModelKind, Output, Resample, Rows, Segment, SeqChunk};

/// Stated tolerance against transformers (f32 both sides; measured 2.2e-6).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llava_tiny")
}

fn model() -> Result<ModelBox> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let m = SafetensorsModel::open(&StdFs, &fixture().join("model"))?;
    build(SafetensorsWeights::new(m).into_box(), cache_kv())
}

/// The fixture's expectations: prompt ids, image features `[image][row·hidden]`, logits.
struct Expected {
    ids: Vec<u32>,
    features: Vec<Vec<f32>>,
    logits: Vec<f32>,
}

fn floats(v: &Value) -> Vec<f32> {
    fn flat(v: &Value, out: &mut Vec<f32>) {
        match v {
            Value::Array(a) => a.iter().for_each(|x| flat(x, out)),
            Value::Number(n) => out.push(n.as_f64().unwrap_or(f64::NAN) as f32),
            _ => {}
        }
    }
    let mut out = Vec::new();
    flat(v, &mut out);
    out
}

fn expected() -> Result<Expected> {
    let e: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    let ids = e["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let features = e["image_features"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    Ok(Expected {
        ids,
        features,
        logits: floats(&e["logits"]),
    })
}

/// The prompt as the runner feeds it: each run of image tokens replaced by the next image's
/// rows.
fn segments<'a>(ids: &'a [u32], features: &'a [Vec<f32>], image_token: u32) -> Vec<Segment<'a>> {
    let mut out = Vec::new();
    let (mut at, mut image) = (0, 0);
    while at < ids.len() {
        let is_image = ids[at] == image_token;
        let len = ids[at..]
            .iter()
            .take_while(|&&t| (t == image_token) == is_image)
            .count();
        out.push(match is_image {
            true => {
                image += 1;
                Segment::Embeddings(RSlice::from_slice(&features[image - 1]))
            }
            false => Segment::Tokens(RSlice::from_slice(&ids[at..at + len])),
        });
        at += len;
    }
    out
}

fn new_seq(model: &ModelBox) -> Result<u64> {
    Ok(model
        .cache()
        .into_result()?
        .into_option()
        .unwrap()
        .create()
        .into_result()?)
}

#[test]
fn the_decoder_says_what_an_image_is_and_which_token_stands_for_one() -> Result<()> {
    let config = model()?.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Decoder);
    assert_eq!(config.family.as_str(), "llava");
    assert_eq!(
        (config.vocab_size, config.hidden, config.layers),
        (300, 64, 2)
    );
    assert_eq!(config.image_token, 257);
    let spec = config.image.into_option().expect("an image spec");
    assert_eq!((spec.channels, spec.height, spec.width), (3, 28, 28));
    // `image_seq_length`: 16 patches, the class row dropped ("default").
    assert_eq!(spec.rows, 16);
    assert_eq!(spec.shortest_edge, 28);
    assert_eq!(spec.resample, Resample::Bicubic);
    assert!((spec.rescale - 1.0 / 255.0).abs() < 1e-9);
    assert_eq!(spec.mean, [0.481_454_66, 0.457_827_5, 0.408_210_73]);
    assert_eq!(spec.std, [0.268_629_54, 0.261_302_6, 0.275_777_1]);
    Ok(())
}

#[test]
fn image_rows_among_tokens_give_transformers_logits() -> Result<()> {
    let e = expected()?;
    let model = model()?;
    let config = model.config().into_result()?;
    let input = segments(&e.ids, &e.features, config.image_token);
    assert_eq!(input.len(), 5, "text, image, text, image, text");
    let chunk = SeqChunk::tokens(new_seq(&model)?, &input, Output::Logits(Rows::All));
    let logits = run(&model, &config, &[chunk])?;
    let diff = max_abs_diff(&logits, &e.logits);
    eprintln!(
        "llava decoder logits: max |diff| {diff:.2e} over {} positions",
        e.ids.len()
    );
    assert!(diff <= TOL, "max |diff| {diff}");
    Ok(())
}

#[test]
fn a_prefill_in_two_chunks_continues_across_the_image_rows() -> Result<()> {
    let e = expected()?;
    let model = model()?;
    let config = model.config().into_result()?;
    let vocab = config.vocab_size as usize;
    let input = segments(&e.ids, &e.features, config.image_token);
    let whole = run(
        &model,
        &config,
        &[SeqChunk::tokens(
            new_seq(&model)?,
            &input,
            Output::Logits(Rows::All),
        )],
    )?;
    // The text before the first image, then the images and the rest.
    let seq = new_seq(&model)?;
    let (head, tail) = input.split_at(1);
    let first = run(
        &model,
        &config,
        &[SeqChunk::tokens(seq, head, Output::Logits(Rows::All))],
    )?;
    let rest = run(
        &model,
        &config,
        &[SeqChunk::tokens(seq, tail, Output::Logits(Rows::All))],
    )?;
    let split: Vec<f32> = first.into_iter().chain(rest).collect();
    assert_eq!(split.len(), e.ids.len() * vocab);
    let diff = max_abs_diff(&split, &whole);
    eprintln!("two chunks vs one: max |diff| {diff:.2e}");
    assert!(diff <= 1e-5, "max |diff| {diff}");
    assert!(max_abs_diff(&split, &e.logits) <= TOL);
    Ok(())
}

#[test]
fn pixels_are_refused() -> Result<()> {
    let model = model()?;
    let config = model.config().into_result()?;
    let spec = config.image.into_option().unwrap();
    let pixels = vec![0.0f32; 3 * 28 * 28];
    let input = [
        Segment::Tokens(RSlice::from_slice(&[1, 5])),
        Segment::Image(ImageInput {
            pixels: RSlice::from_slice(&pixels),
            rows: spec.rows,
        }),
    ];
    let chunk = SeqChunk::tokens(new_seq(&model)?, &input, Output::Logits(Rows::Last));
    let err = run(&model, &config, &[chunk]).expect_err("pixels refused");
    assert!(
        err.to_string()
            .contains("images reach a llava decoder as rows its image encoder made"),
        "{err}"
    );
    Ok(())
}

/// The fixture's weights with tensor names rewritten (`from` prefix → `to`) and metadata
/// entries replaced: other saves and other settings of the same checkpoint.
mod view {
    use abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
    use std::collections::HashMap;
    use std::sync::Arc;
    use u_sdk::{MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

    #[derive(Clone)]
    pub struct View {
        inner: WeightSetBox,
        renames: Arc<Vec<(String, String)>>,
        meta: Arc<HashMap<String, MetaValue>>,
    }

    impl View {
        pub fn new_box(
            inner: WeightSetBox,
            renames: &[(&str, &str)],
            meta: &[(&str, MetaValue)],
        ) -> WeightSetBox {
            WeightSetBox::new(View {
                inner,
                renames: Arc::new(
                    renames
                        .iter()
                        .map(|(a, b)| (a.to_string(), b.to_string()))
                        .collect(),
                ),
                meta: Arc::new(
                    meta.iter()
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect(),
                ),
            })
        }

        fn rename(&self, name: &str, back: bool) -> String {
            for (from, to) in self.renames.iter() {
                let (from, to) = if back { (to, from) } else { (from, to) };
                if let Some(rest) = name.strip_prefix(from.as_str()) {
                    return format!("{to}{rest}");
                }
            }
            name.to_string()
        }
    }

    impl WeightSet for View {
        fn format(&self) -> RResult<RString, UError> {
            self.inner.format()
        }
        fn architecture(&self) -> RResult<ROption<RString>, UError> {
            self.inner.architecture()
        }
        fn metadata_keys(&self) -> RResult<RVec<RString>, UError> {
            self.inner.metadata_keys()
        }
        fn metadata(&self, key: RStr<'_>) -> RResult<ROption<MetaValue>, UError> {
            match self.meta.get(key.as_str()) {
                Some(v) => RResult::ROk(ROption::RSome(v.clone())),
                None => self.inner.metadata(key),
            }
        }
        fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
            self.inner.tensors().map(|ts| {
                ts.into_iter()
                    .map(|mut t| {
                        t.name = self.rename(&t.name, false).into();
                        t
                    })
                    .collect()
            })
        }
        fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
            self.inner.tensor(self.rename(&name, true).as_str().into())
        }
    }
}

/// transformers 5's module tree (`model.language_model.*`, `lm_head.*`) reads as its saves
/// (`language_model.model.*`, `language_model.lm_head.*`) do.
#[test]
fn the_module_tree_names_read_as_the_saved_ones() -> Result<()> {
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    let e = expected()?;
    let m = SafetensorsModel::open(&StdFs, &fixture().join("model"))?;
    let weights = view::View::new_box(
        SafetensorsWeights::new(m).into_box(),
        &[
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower.vision_model."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ],
        &[],
    );
    assert!(
        weights
            .tensors()
            .into_result()?
            .iter()
            .any(|t| t.name.as_str() == "model.language_model.norm.weight")
    );
    let model = build(weights, cache_kv())?;
    let config = model.config().into_result()?;
    let input = segments(&e.ids, &e.features, config.image_token);
    let chunk = SeqChunk::tokens(new_seq(&model)?, &input, Output::Logits(Rows::All));
    let diff = max_abs_diff(&run(&model, &config, &[chunk])?, &e.logits);
    assert!(diff <= TOL, "max |diff| {diff}");
    Ok(())
}

/// A LLaVA checkpoint converts to GGUF as its language model.
#[test]
fn the_gguf_view_is_the_language_models() -> Result<()> {
    use u_arch_llama::LlamaArchitecture;
    use u_loader_safetensors::{SafetensorsModel, SafetensorsWeights, StdFs};
    use u_sdk::Architecture;
    let m = SafetensorsModel::open(&StdFs, &fixture().join("model"))?;
    let view = LlamaArchitecture::default()
        .gguf_view(SafetensorsWeights::new(m).into_box(), "llava".into())
        .into_result()?;
    let names: Vec<String> = view
        .tensors()
        .into_result()?
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    assert!(
        names.contains(&"token_embd.weight".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"output.weight".to_string()));
    assert!(
        names
            .iter()
            .all(|n| !n.contains("vision") && !n.contains("projector"))
    );
    let arch = view.metadata("general.architecture".into()).into_result()?;
    assert_eq!(
        arch.into_option()
            .and_then(|v| v.as_str().map(str::to_string))
            .as_deref(),
        Some("llama")
    );
    Ok(())
}
