//! LLaVA's image encoder (family `llava.vision`, issue #18) against transformers on the tiny
//! random-weight checkpoint of `tests/fixtures/llava_tiny/` at the workspace root (its
//! generator, `gen_llava_tiny.py`, beside it): each image's projected rows equal
//! `LlavaForConditionalGeneration.get_image_features` within [`TOL`] (the CLIP tower's
//! `hidden_states[-2]` without the class row, through the projector), two images in one pass
//! give each its own; the spec is the processor's with the rows the decoder reads; other
//! outputs and a wrong pixel count are refused.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_vit::VitArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{
    ImageInput, ModelBox, ModelKind, NO_IMAGE_TOKEN, Output, Pooling, Resample, Rows, Segment,
    SeqChunk,
};

/// Stated tolerance (f32 both sides; measured 1.7e-6).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llava_tiny")
}

fn model() -> Result<ModelBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &fixture().join("model"),
    )?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(VitArchitecture.load(weights, backend)?)
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

/// Each image's pixels and expected features.
fn expected() -> Result<Vec<(Vec<f32>, Vec<f32>)>> {
    let e: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    let pixels = e["pixels"].as_array().unwrap().iter().map(floats);
    let features = e["image_features"].as_array().unwrap().iter().map(floats);
    Ok(pixels.zip(features).collect())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// One chunk per image, each asking for `output`, in one pass.
fn encode(model: &ModelBox, images: &[&[f32]], rows: u32, output: Output) -> Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let inputs: Vec<[Segment<'_>; 1]> = images
        .iter()
        .map(|px| {
            [Segment::Image(ImageInput {
                pixels: RSlice::from_slice(px),
                rows,
            })]
        })
        .collect();
    let chunks: Vec<SeqChunk<'_>> = inputs
        .iter()
        .map(|input| SeqChunk::tokens(0, input, output))
        .collect();
    let floats: usize = chunks
        .iter()
        .map(|c| c.output.floats(rows as usize, &config))
        .sum();
    let mut out = vec![0f32; floats];
    model
        .forward(
            RSlice::from_slice(&chunks),
            RSliceMut::from_mut_slice(&mut out),
        )
        .into_result()?;
    Ok(out)
}

#[test]
fn the_encoder_makes_rows_of_the_decoders_width() -> Result<()> {
    let config = model()?.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Encoder);
    assert_eq!(config.family.as_str(), "llava.vision");
    assert_eq!(
        (config.hidden, config.layers, config.vocab_size),
        (64, 3, 0)
    );
    assert_eq!(config.image_token, NO_IMAGE_TOKEN);
    let spec = config.image.into_option().expect("an image spec");
    assert_eq!(
        (spec.channels, spec.height, spec.width, spec.rows),
        (3, 28, 28, 16)
    );
    assert_eq!(config.context_length, 16);
    assert_eq!((spec.shortest_edge, spec.resample), (28, Resample::Bicubic));
    assert_eq!(spec.mean, [0.481_454_66, 0.457_827_5, 0.408_210_73]);
    Ok(())
}

#[test]
fn image_features_equal_transformers() -> Result<()> {
    let model = model()?;
    let config = model.config().into_result()?;
    let rows = config.image.into_option().unwrap().rows;
    let all = Output::Hidden {
        layer: config.layers,
        rows: Rows::All,
    };
    let cases = expected()?;
    let mut worst = 0f32;
    for (pixels, want) in &cases {
        let got = encode(&model, &[pixels], rows, all)?;
        worst = worst.max(max_diff(&got, want));
    }
    // Both images in one pass: each its own rows, in order.
    let both = encode(&model, &[&cases[0].0, &cases[1].0], rows, all)?;
    let want: Vec<f32> = cases.iter().flat_map(|(_, f)| f.clone()).collect();
    worst = worst.max(max_diff(&both, &want));
    eprintln!("llava image features: max |diff| {worst:.2e}");
    assert!(worst <= TOL, "max |diff| {worst}");
    Ok(())
}

#[test]
fn other_outputs_and_wrong_images_are_refused() -> Result<()> {
    let model = model()?;
    let config = model.config().into_result()?;
    let rows = config.image.into_option().unwrap().rows;
    let cases = expected()?;
    let pixels = &cases[0].0;
    for (output, says) in [
        (Output::Logits(Rows::All), "one output"),
        (Output::Pooled(Pooling::Mean), "one output"),
        (
            Output::Hidden {
                layer: 1,
                rows: Rows::All,
            },
            "one output",
        ),
        (
            Output::Hidden {
                layer: config.layers,
                rows: Rows::Last,
            },
            "one output",
        ),
    ] {
        let e = encode(&model, &[pixels], rows, output).expect_err("refused");
        assert!(e.to_string().contains(says), "{output:?}: {e}");
    }
    let all = Output::Hidden {
        layer: config.layers,
        rows: Rows::All,
    };
    let e = encode(&model, &[&pixels[1..]], rows, all).expect_err("a pixel short");
    assert!(e.to_string().contains("3×28×28 = 2352"), "{e}");
    // The rows the tower makes before selection (with the class row) are not the image's.
    let e = encode(&model, &[pixels], rows + 1, all).expect_err("17 rows");
    assert!(e.to_string().contains("it is 16"), "{e}");
    Ok(())
}

/// The fixture's weights with tensor names rewritten (`from` prefix → `to`) and metadata
/// entries replaced: other saves and other settings of the same checkpoint.
mod view {
    use std::collections::HashMap;
    use std::sync::Arc;
    use u_sdk::abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
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

fn model_of(renames: &[(&str, &str)], meta: &[(&str, u_sdk::MetaValue)]) -> Result<ModelBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &fixture().join("model"),
    )?;
    let weights = u_loader_safetensors::SafetensorsWeights::new(m).into_box();
    let backend = u_kernels_cpu::CpuKernels::new(2)?.into_box();
    Ok(VitArchitecture.load(view::View::new_box(weights, renames, meta), backend)?)
}

/// transformers 5's module tree (`model.vision_tower.vision_model.*`,
/// `model.multi_modal_projector.*`) reads as its saves do.
#[test]
fn the_module_tree_names_read_as_the_saved_ones() -> Result<()> {
    let model = model_of(
        &[
            ("vision_tower.", "model.vision_tower.vision_model."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ],
        &[],
    )?;
    let config = model.config().into_result()?;
    let all = Output::Hidden {
        layer: config.layers,
        rows: Rows::All,
    };
    let cases = expected()?;
    let got = encode(&model, &[&cases[0].0], 16, all)?;
    assert!(max_diff(&got, &cases[0].1) <= TOL);
    Ok(())
}

/// `vision_feature_select_strategy = "full"` keeps the class row; `vision_feature_layer = -1`
/// reads the last block's state: each as transformers does on the same weights.
#[test]
fn the_strategy_and_the_feature_layer_are_read_as_transformers_reads_them() -> Result<()> {
    use u_sdk::MetaValue;
    let e: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    let pixels = floats(&e["pixels"][0]);
    for (key, value, rows, want) in [
        (
            "config.vision_feature_select_strategy",
            MetaValue::Str("full".into()),
            17,
            "image_features_full",
        ),
        (
            "config.vision_feature_layer",
            MetaValue::Int(-1),
            16,
            "image_features_last_layer",
        ),
    ] {
        let model = model_of(&[], &[(key, value)])?;
        let config = model.config().into_result()?;
        assert_eq!(config.image.into_option().unwrap().rows, rows, "{want}");
        let all = Output::Hidden {
            layer: config.layers,
            rows: Rows::All,
        };
        let got = encode(&model, &[&pixels], rows, all)?;
        let diff = max_diff(&got, &floats(&e[want]));
        eprintln!("{want}: max |diff| {diff:.2e}");
        assert!(diff <= TOL, "{want}: max |diff| {diff}");
    }
    // Past the tower's blocks, and a list of layers whose join the projector does not take.
    for (value, says) in [
        (
            MetaValue::Int(4),
            "vision_feature_layer 4 of a tower of 3 blocks",
        ),
        (MetaValue::Int(-5), "vision_feature_layer -5"),
        (
            MetaValue::IntArray(vec![-2i64, -1].into()),
            "expected [_, 64] (the tower's width 32 times 2 feature layers)",
        ),
    ] {
        let e = model_of(&[], &[("config.vision_feature_layer", value)])
            .err()
            .expect("refused");
        assert!(e.to_string().contains(says), "{e}");
    }
    Ok(())
}
