//! IDEFICS's image encoder (family `idefics.vision`, issue #18) against transformers on the two
//! tiny random-weight checkpoints of `tests/fixtures/idefics_tiny/` at the workspace root (its
//! generator, `gen_idefics_tiny.py`, beside them): each image's context rows equal the
//! `image_hidden_states` the decoder reads within [`TOL`] — the CLIP tower's
//! `last_hidden_state` (class row first, no post-norm) in `plain`, the Perceiver resampler's
//! latents made from it in `resampler`; two images in one pass give each its own; a config
//! asking for the resampler of a checkpoint without one, and outputs other than the rows, are
//! refused.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_vit::VitArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{
    ImageInput, MetaValue, ModelBox, ModelKind, NO_IMAGE_TOKEN, Output, Pooling, Resample, Rows,
    Segment, SeqChunk, WeightSetBox,
};

/// Stated tolerance (f32 both sides, the expected values rounded to 7 significant digits;
/// measured 1.9e-6 plain, 9.5e-7 resampled).
const TOL: f32 = 1e-4;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/idefics_tiny")
        .join(case)
}

fn weights(case: &str) -> Result<WeightSetBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &fixture(case).join("model"),
    )?;
    Ok(u_loader_safetensors::SafetensorsWeights::new(m).into_box())
}

fn load(weights: WeightSetBox) -> Result<ModelBox> {
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

/// The fixture's rows per image, width, and each case's pixels and context rows.
#[allow(clippy::type_complexity)]
fn expected(case: &str) -> Result<(u32, u32, Vec<(Vec<f32>, Vec<f32>)>)> {
    let e: Value = serde_json::from_slice(&std::fs::read(fixture(case).join("expected.json"))?)?;
    let cases = e["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| (floats(&c["pixels"]), floats(&c["image_hidden_states"])))
        .collect();
    let count = |k: &str| e[k].as_u64().expect(k) as u32;
    Ok((count("rows_per_image"), count("vision_width"), cases))
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
fn the_encoder_makes_context_rows_of_the_vision_width() -> Result<()> {
    for (case, rows) in [("plain", 17), ("resampler", 5)] {
        let config = load(weights(case)?)?.config().into_result()?;
        let (want_rows, width, _) = expected(case)?;
        assert_eq!(want_rows, rows);
        assert_eq!(config.kind, ModelKind::Encoder);
        assert_eq!(config.family.as_str(), "idefics.vision");
        assert_eq!(
            (config.hidden, config.layers, config.vocab_size),
            (width, 2, 0)
        );
        assert_eq!(config.image_token, NO_IMAGE_TOKEN);
        assert_eq!(config.context_length, rows);
        // No preprocessor_config.json: IDEFICS' processor defaults.
        let spec = config.image.into_option().expect("an image spec");
        assert_eq!(
            (spec.channels, spec.height, spec.width, spec.rows),
            (3, 28, 28, rows)
        );
        assert_eq!((spec.shortest_edge, spec.resample), (0, Resample::Bicubic));
        assert_eq!(spec.mean, [0.481_454_66, 0.457_827_5, 0.408_210_73]);
        assert_eq!(spec.std, [0.268_629_54, 0.261_302_6, 0.275_777_1]);
    }
    Ok(())
}

#[test]
fn image_hidden_states_equal_transformers() -> Result<()> {
    for case in ["plain", "resampler"] {
        let model = load(weights(case)?)?;
        let config = model.config().into_result()?;
        let (rows, _, cases) = expected(case)?;
        let all = Output::Hidden {
            layer: config.layers,
            rows: Rows::All,
        };
        let mut worst = 0f32;
        for (pixels, want) in &cases {
            let got = encode(&model, &[pixels], rows, all)?;
            worst = worst.max(max_diff(&got, want));
        }
        // Both images in one pass: each its own rows, in order.
        let both = encode(&model, &[&cases[0].0, &cases[1].0], rows, all)?;
        let want: Vec<f32> = cases.iter().flat_map(|(_, f)| f.clone()).collect();
        worst = worst.max(max_diff(&both, &want));
        eprintln!("idefics {case} image_hidden_states: max |diff| {worst:.2e}");
        assert!(worst <= TOL, "{case}: max |diff| {worst}");
    }
    Ok(())
}

#[test]
fn a_resampler_without_weights_is_refused() -> Result<()> {
    // The plain checkpoint has no `model.perceiver_resampler.*`.
    let asks = view::View::new_box(
        weights("plain")?,
        &[("config.use_resampler", MetaValue::Bool(true))],
    );
    let e = load(asks).err().expect("refused");
    assert!(
        e.to_string().contains("sets `use_resampler`")
            && e.to_string().contains("no perceiver resampler"),
        "{e}"
    );
    Ok(())
}

#[test]
fn other_outputs_and_wrong_images_are_refused() -> Result<()> {
    let model = load(weights("resampler")?)?;
    let config = model.config().into_result()?;
    let (rows, _, cases) = expected("resampler")?;
    let pixels = &cases[0].0;
    for output in [
        Output::Logits(Rows::All),
        Output::Pooled(Pooling::Mean),
        Output::Hidden {
            layer: 1,
            rows: Rows::All,
        },
        Output::Hidden {
            layer: config.layers,
            rows: Rows::Last,
        },
    ] {
        let e = encode(&model, &[pixels], rows, output).expect_err("refused");
        assert!(e.to_string().contains("one output"), "{output:?}: {e}");
    }
    let all = Output::Hidden {
        layer: config.layers,
        rows: Rows::All,
    };
    let e = encode(&model, &[&pixels[1..]], rows, all).expect_err("a pixel short");
    assert!(e.to_string().contains("3×28×28 = 2352"), "{e}");
    // The tower's 17 rows are not what the decoder reads from a resampled image.
    let e = encode(&model, &[pixels], 17, all).expect_err("17 rows");
    assert!(e.to_string().contains("it is 5"), "{e}");
    Ok(())
}

/// The fixture's weights with metadata entries replaced: other settings of the same
/// checkpoint.
mod view {
    use std::collections::HashMap;
    use std::sync::Arc;
    use u_sdk::abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
    use u_sdk::{MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

    #[derive(Clone)]
    pub struct View {
        inner: WeightSetBox,
        meta: Arc<HashMap<String, MetaValue>>,
    }

    impl View {
        pub fn new_box(inner: WeightSetBox, meta: &[(&str, MetaValue)]) -> WeightSetBox {
            WeightSetBox::new(View {
                inner,
                meta: Arc::new(
                    meta.iter()
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect(),
                ),
            })
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
            self.inner.tensors()
        }
        fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
            self.inner.tensor(name)
        }
    }
}
