//! CLIP's text side (family `clip`, issue #18) against transformers on the tiny random-weight
//! `CLIPModel` of `tests/fixtures/clip_tiny/` at the workspace root (its generator,
//! `gen_clip_tiny.py`, beside it): each text's pooled vector equals
//! `CLIPModel.get_text_features` — the final-normed row at the first `<|endoftext|>`, through
//! `text_projection` — within [`TOL`], before and after L2 normalisation, whether the texts run
//! alone or together in one pass (texts of 5 to 16 tokens: the causal mask and each text's own
//! positions show); the other outputs are the projected final rows; bad input is refused.

use anyhow::Result;
use serde_json::Value;
use std::path::{Path, PathBuf};
use u_arch_clip::ClipArchitecture;
use u_sdk::abi_stable::std_types::{RSlice, RSliceMut};
use u_sdk::{
    AttentionMask, MetaValue, ModelBox, ModelKind, Output, Pooling, Rows, Segment, SeqChunk,
    WeightSetBox,
};

/// Stated tolerance (f32 both sides).
const TOL: f32 = 1e-4;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/clip_tiny")
}

fn weights() -> Result<WeightSetBox> {
    let m = u_loader_safetensors::SafetensorsModel::open(
        &u_loader_safetensors::StdFs,
        &fixture().join("model"),
    )?;
    Ok(u_loader_safetensors::SafetensorsWeights::new(m).into_box())
}

fn load(weights: WeightSetBox) -> u_sdk::Result<ModelBox> {
    let backend = u_kernels_cpu::CpuKernels::new(2)
        .map_err(|e| u_sdk::UError::invalid(e.to_string()))?
        .into_box();
    ClipArchitecture.load(weights, backend)
}

fn model() -> Result<ModelBox> {
    Ok(load(weights()?)?)
}

struct Text {
    ids: Vec<u32>,
    features: Vec<f32>,
    embedding: Vec<f32>,
}

fn texts() -> Result<Vec<Text>> {
    let e: Value = serde_json::from_slice(&std::fs::read(fixture().join("expected.json"))?)?;
    let list = e["texts"].as_array().expect("texts");
    Ok(list
        .iter()
        .map(|t| Text {
            ids: serde_json::from_value(t["ids"].clone()).expect("ids"),
            features: serde_json::from_value(t["features"].clone()).expect("features"),
            embedding: serde_json::from_value(t["embedding"].clone()).expect("embedding"),
        })
        .collect())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn normalised(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.iter().map(|x| x / norm).collect()
}

/// One chunk per text, each asking for `output`, in one pass.
fn encode(model: &ModelBox, texts: &[&[u32]], output: Output) -> u_sdk::Result<Vec<f32>> {
    let config = model.config().into_result()?;
    let inputs: Vec<[Segment<'_>; 1]> = texts
        .iter()
        .map(|ids| [Segment::Tokens(RSlice::from_slice(ids))])
        .collect();
    let chunks: Vec<SeqChunk<'_>> = inputs
        .iter()
        .map(|input| SeqChunk::tokens(0, input, output))
        .collect();
    let floats: usize = chunks
        .iter()
        .zip(texts)
        .map(|(c, t)| c.output.floats(t.len(), &config))
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
fn the_model_is_an_encoder_into_the_joint_space() -> Result<()> {
    let config = model()?.config().into_result()?;
    assert_eq!(config.kind, ModelKind::Encoder);
    assert_eq!(config.family.as_str(), "clip");
    assert_eq!(
        (
            config.vocab_size,
            config.hidden,
            config.layers,
            config.context_length
        ),
        (130, 24, 2, 16)
    );
    assert_eq!(config.pooling, Pooling::Head);
    assert_eq!(config.attention, AttentionMask::Causal);
    assert!(config.image.is_none());
    Ok(())
}

#[test]
fn text_features_equal_transformers() -> Result<()> {
    let model = model()?;
    let texts = texts()?;
    let head = Output::Pooled(Pooling::Head);
    let (mut worst, mut worst_normed) = (0f32, 0f32);
    for t in &texts {
        let got = encode(&model, &[&t.ids], head)?;
        worst = worst.max(max_diff(&got, &t.features));
        worst_normed = worst_normed.max(max_diff(&normalised(&got), &t.embedding));
    }
    // All texts in one pass, of different lengths: each attends causally to its own rows.
    let ids: Vec<&[u32]> = texts.iter().map(|t| t.ids.as_slice()).collect();
    let all = encode(&model, &ids, head)?;
    for (got, t) in all.chunks_exact(24).zip(&texts) {
        worst = worst.max(max_diff(got, &t.features));
        worst_normed = worst_normed.max(max_diff(&normalised(got), &t.embedding));
    }
    eprintln!("clip text features: max |diff| {worst:.2e}, normalised {worst_normed:.2e}");
    assert!(worst <= TOL, "features: max |diff| {worst}");
    assert!(worst_normed <= TOL, "embeddings: max |diff| {worst_normed}");
    Ok(())
}

#[test]
fn other_outputs_are_the_projected_final_rows() -> Result<()> {
    let model = model()?;
    let t = &texts()?[0];
    let n = t.ids.len();
    let rows = encode(
        &model,
        &[&t.ids],
        Output::Hidden {
            layer: 2,
            rows: Rows::All,
        },
    )?;
    assert_eq!(rows.len(), n * 24);
    // The end-of-text token is the text's last: the last row is the pooled one.
    let last = &rows[(n - 1) * 24..];
    assert!(max_diff(last, &t.features) <= TOL);
    let first = encode(&model, &[&t.ids], Output::Pooled(Pooling::First))?;
    assert_eq!(first.as_slice(), &rows[..24]);
    let mean = encode(&model, &[&t.ids], Output::Pooled(Pooling::Mean))?;
    for (j, m) in mean.iter().enumerate() {
        let want = (0..n).map(|i| rows[i * 24 + j]).sum::<f32>() / n as f32;
        assert!((m - want).abs() <= 1e-5);
    }
    Ok(())
}

#[test]
fn bad_input_is_refused() -> Result<()> {
    let model = model()?;
    let t = &texts()?[0];
    let head = Output::Pooled(Pooling::Head);
    for (ids, output, says) in [
        (vec![128, 130, 129], head, "outside the vocabulary of 130"),
        (vec![1; 17], head, "longer than the encoder's 16"),
        (t.ids.clone(), Output::Logits(Rows::All), "not logits"),
        (
            t.ids.clone(),
            Output::Hidden {
                layer: 1,
                rows: Rows::All,
            },
            "tower's own width",
        ),
        (vec![], head, "no input"),
    ] {
        let e = encode(&model, &[&ids], output).expect_err("refused");
        assert!(e.message.contains(says), "{output:?}: {e}");
    }
    // A CLIPModel without the projection, and a checkpoint that is no CLIP text tower.
    let e = load(hidden::Hide::new_box(
        weights()?,
        "text_projection.weight",
        None,
    ))
    .err()
    .expect("no projection");
    assert!(e.message.contains("no `text_projection.weight`"), "{e}");
    let e = load(hidden::Hide::new_box(
        weights()?,
        "",
        Some((
            "config.model_type",
            MetaValue::Str("clip_vision_model".into()),
        )),
    ))
    .err()
    .expect("not a CLIP text checkpoint");
    assert!(e.message.contains("`model_type` is neither `clip`"), "{e}");
    Ok(())
}

/// The fixture's weights with one tensor hidden and one metadata entry replaced.
mod hidden {
    use u_sdk::abi_stable::std_types::{ROption, RResult, RStr, RString, RVec};
    use u_sdk::{MetaValue, TensorInfo, TensorView, UError, WeightSet, WeightSetBox};

    #[derive(Clone)]
    pub struct Hide {
        inner: WeightSetBox,
        tensor: String,
        meta: Option<(String, MetaValue)>,
    }

    impl Hide {
        pub fn new_box(
            inner: WeightSetBox,
            tensor: &str,
            meta: Option<(&str, MetaValue)>,
        ) -> WeightSetBox {
            WeightSetBox::new(Hide {
                inner,
                tensor: tensor.into(),
                meta: meta.map(|(k, v)| (k.into(), v)),
            })
        }
    }

    impl WeightSet for Hide {
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
            match &self.meta {
                Some((k, v)) if k == key.as_str() => RResult::ROk(ROption::RSome(v.clone())),
                _ => self.inner.metadata(key),
            }
        }
        fn tensors(&self) -> RResult<RVec<TensorInfo>, UError> {
            self.inner
                .tensors()
                .map(|ts| ts.into_iter().filter(|t| t.name != self.tensor).collect())
        }
        fn tensor<'a>(&'a self, name: RStr<'_>) -> RResult<TensorView<'a>, UError> {
            if name.as_str() == self.tensor {
                return RResult::RErr(UError::not_found(format!("no tensor `{name}`")));
            }
            self.inner.tensor(name)
        }
    }
}
