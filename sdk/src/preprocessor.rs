//! A Hugging Face image processor's `preprocessor_config.json`, as the loaders present it
//! (`preprocessor.*` metadata beside the weights), read once for every vision architecture:
//! the per-channel normalisation, the rescale factor, the resampling filter, the shortest-edge
//! resize and the side of the images the processor makes. Each architecture gives the defaults
//! of its family (what its processor class assumes when the file leaves a field out) and checks
//! the side against its own tower.

use crate::{MetaValue, Resample, Result, UError, WeightSetBox};
use serde_json::{Value, json};

/// What a processor assumes when its file leaves a field out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProcessorDefaults {
    /// Per-channel mean.
    pub mean: [f32; 3],
    /// Per-channel standard deviation.
    pub std: [f32; 3],
    /// Resampling filter.
    pub resample: Resample,
}

/// What the processor does to an image, as its file says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Processor {
    /// Per-channel mean subtracted after rescaling (0 without `do_normalize`).
    pub mean: [f32; 3],
    /// Per-channel standard deviation divided by (1 without `do_normalize`).
    pub std: [f32; 3],
    /// Factor taking 8-bit values to the model's range (1 without `do_rescale`).
    pub rescale: f32,
    /// The resize's filter.
    pub resample: Resample,
    /// Resize the shorter edge to this many pixels, then centre crop; 0: resize to the side.
    pub shortest_edge: u32,
    /// Height and width of the images it makes (the crop after a shortest-edge resize, else the
    /// resize), when the file states them.
    pub side: Option<(u64, u64)>,
}

/// Reads the processor of `w` (metadata `preprocessor.*`), `defaults` where the file is silent;
/// errors name `plugin`. A shortest-edge resize without a centre crop (images of varying size)
/// is refused: the towers take images of one size.
pub fn read(w: &WeightSetBox, plugin: &str, defaults: ProcessorDefaults) -> Result<Processor> {
    let bad = |why: String| UError::invalid(format!("{plugin}: preprocessor_config.json: {why}"));
    let key = |k: &str| -> Option<MetaValue> {
        w.metadata(format!("preprocessor.{k}").as_str().into())
            .into_result()
            .ok()?
            .into_option()
    };
    let flag = |k: &str| !matches!(key(k), Some(MetaValue::Bool(false)));
    let triple = |k: &str, default: [f32; 3]| -> Result<[f32; 3]> {
        let values: Vec<f64> = match key(k) {
            None => return Ok(default),
            Some(MetaValue::FloatArray(v)) => v.to_vec(),
            Some(MetaValue::UIntArray(v)) => v.iter().map(|&x| x as f64).collect(),
            Some(MetaValue::IntArray(v)) => v.iter().map(|&x| x as f64).collect(),
            Some(v) => match v.as_f64() {
                Some(x) => vec![x; 3],
                None => return Err(bad(format!("`{k}` is not a number or three numbers"))),
            },
        };
        match values.as_slice() {
            &[a, b, c] if values.iter().all(|v| v.is_finite()) => {
                Ok([a as f32, b as f32, c as f32])
            }
            _ => Err(bad(format!("`{k}` is not three finite numbers"))),
        }
    };
    let (mean, std) = match flag("do_normalize") {
        true => (
            triple("image_mean", defaults.mean)?,
            triple("image_std", defaults.std)?,
        ),
        false => ([0.0; 3], [1.0; 3]),
    };
    if std.contains(&0.0) {
        return Err(bad("an `image_std` of 0".into()));
    }
    let rescale = match flag("do_rescale") {
        true => key("rescale_factor")
            .and_then(|v| v.as_f64())
            .unwrap_or(1.0 / 255.0) as f32,
        false => 1.0,
    };
    let resample = match key("resample").map(|v| v.as_u64()) {
        None => defaults.resample,
        Some(Some(0)) => Resample::Nearest,
        Some(Some(2)) => Resample::Bilinear,
        Some(Some(3)) => Resample::Bicubic,
        Some(other) => {
            return Err(UError::unsupported(format!(
                "{plugin}: resampling filter {other:?} is not implemented (PIL's 0 nearest, \
                 2 bilinear, 3 bicubic)"
            )));
        }
    };
    // `size` is `{"height", "width"}` (resize to it) or `{"shortest_edge"}` (resize the shorter
    // side, then centre crop); a bare number is a shortest edge. `crop_size` is the crop, a
    // bare number a square.
    let object = |k: &str, number: fn(u64) -> Value| -> Result<Value> {
        match key(k) {
            Some(MetaValue::Json(s)) => {
                serde_json::from_str(&s).map_err(|e| bad(format!("{k}: {e}")))
            }
            Some(v) => match v.as_u64() {
                Some(n) => Ok(number(n)),
                None => Err(bad(format!("`{k}` is not an object or a number"))),
            },
            None => Ok(Value::Null),
        }
    };
    let size = object("size", |n| json!({ "shortest_edge": n }))?;
    let shortest_edge = match flag("do_resize") {
        true => {
            let edge = size
                .get("shortest_edge")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            u32::try_from(edge).map_err(|_| bad(format!("a shortest edge of {edge} pixels")))?
        }
        false => 0,
    };
    if shortest_edge != 0 && !flag("do_center_crop") {
        return Err(UError::unsupported(format!(
            "{plugin}: a shortest-edge resize without a centre crop gives images of varying \
             size, which the model's vision tower does not take"
        )));
    }
    let stated = match shortest_edge {
        0 => size,
        _ => object("crop_size", |n| json!({ "height": n, "width": n }))?,
    };
    let side = match [stated.get("height"), stated.get("width")].map(|d| d.and_then(Value::as_u64))
    {
        [Some(h), Some(w)] => Some((h, w)),
        _ => None,
    };
    Ok(Processor {
        mean,
        std,
        rescale,
        resample,
        shortest_edge,
        side,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        TensorInfo, TensorView,
        weights::{SharedWeights, WeightSource, json_metadata},
    };

    /// Nothing but a `preprocessor_config.json`.
    struct Processor(Vec<(String, MetaValue)>);

    impl WeightSource for Processor {
        const FORMAT: &'static str = "test";
        fn architecture(&self) -> Option<&str> {
            None
        }
        fn metadata_keys(&self) -> Vec<&str> {
            self.0.iter().map(|(k, _)| k.as_str()).collect()
        }
        fn metadata(&self, key: &str) -> Option<MetaValue> {
            self.0
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        }
        fn tensors(&self) -> Vec<TensorInfo> {
            Vec::new()
        }
        fn tensor(&self, name: &str) -> crate::Result<TensorView<'_>> {
            Err(UError::not_found(name))
        }
    }

    const DEFAULTS: ProcessorDefaults = ProcessorDefaults {
        mean: [0.5; 3],
        std: [0.5; 3],
        resample: Resample::Bilinear,
    };

    fn read_json(doc: serde_json::Value) -> Result<super::Processor> {
        let meta = json_metadata("preprocessor", &doc).expect("an object");
        read(
            &SharedWeights::new(Processor(meta)).into_box(),
            "arch-test",
            DEFAULTS,
        )
    }

    #[test]
    fn a_clip_processor_and_the_defaults() {
        let p = read_json(json!({
            "do_resize": true, "size": {"shortest_edge": 256}, "resample": 3,
            "do_center_crop": true, "crop_size": 224, "do_rescale": true,
            "rescale_factor": 0.00392156862745098, "do_normalize": true,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": 0.25}))
        .unwrap();
        assert_eq!(p.shortest_edge, 256);
        assert_eq!(p.side, Some((224, 224)));
        assert_eq!(p.resample, Resample::Bicubic);
        assert_eq!((p.mean[0], p.std), (0.481_454_66, [0.25; 3]));
        let p = read_json(json!({})).unwrap();
        assert_eq!(
            (p.mean, p.std, p.resample),
            (DEFAULTS.mean, DEFAULTS.std, DEFAULTS.resample)
        );
        assert_eq!((p.shortest_edge, p.side, p.rescale), (0, None, 1.0 / 255.0));
        let p = read_json(json!({"do_normalize": false, "do_rescale": false,
                                 "size": {"height": 384, "width": 384}}))
        .unwrap();
        assert_eq!((p.mean, p.std, p.rescale), ([0.0; 3], [1.0; 3], 1.0));
        assert_eq!((p.shortest_edge, p.side), (0, Some((384, 384))));
    }

    #[test]
    fn what_cannot_be_done_is_refused_by_name() {
        for (doc, says) in [
            (json!({"image_std": [0.5, 0.0, 0.5]}), "an `image_std` of 0"),
            (
                json!({"image_mean": [0.5, 0.5]}),
                "`image_mean` is not three finite numbers",
            ),
            (
                json!({"image_mean": "grey"}),
                "`image_mean` is not a number",
            ),
            (json!({"resample": 5}), "resampling filter"),
            (
                json!({"size": {"shortest_edge": 224}, "do_center_crop": false}),
                "varying size",
            ),
            (
                json!({"size": "big"}),
                "`size` is not an object or a number",
            ),
        ] {
            let e = read_json(doc.clone()).unwrap_err().to_string();
            assert!(e.contains("arch-test") && e.contains(says), "{doc}: {e}");
        }
    }
}
