//! OpenAI's image generation API, `POST /v1/images/generations`: `prompt`, `model`, `n`
//! (1–10 images, image `i` from seed `seed + i`), `size` (`"WxH"` or `"auto"`: the pipeline's
//! own), `response_format` (`b64_json` only: the server keeps no files, so it has no URLs to
//! give), `output_format` (`png`), `user`; and U's own fields: `negative_prompt`, `steps`,
//! `guidance_scale`, `seed` (drawn from the clock when absent, and returned), `image` (a
//! base64 image file to start from) with `strength`, `handoff_prompt` with `handoff_step` (an
//! edited prompt taking over an earlier prompt's kept trajectory at that step: approximate),
//! `conditioning` (values a directly conditioned denoiser reads, such as a terrain model's
//! difficulty) and `stream`.
//!
//! The answer is OpenAI's `{created, data: [{b64_json}]}`, each image also stating its `seed`,
//! `steps`, `cached_steps` and whether it is `approximate` (a handoff's). With `stream`, server-sent events report every denoising step
//! (`image_generation.progress`: `image_index`, `step`, `steps`, `cached`) and each finished
//! image (`image_generation.completed`: `image_index`, `b64_json`, …). A client that goes away
//! cancels its request; the runner keeps the trajectory, so the same request resumes there.

use crate::{
    error::ApiError,
    json::{self, Obj},
};
use base64::Engine as _;
use serde_json::{Value, json};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use u_sdk::{
    EngineBox, GeneratedImage, ImageProgress, ImageRequest, ImageSink, ImageSinkBox, UError,
};

/// The most images one request asks for (OpenAI's limit).
pub const MAX_IMAGES: u32 = 10;

/// The default number of denoising steps.
pub const DEFAULT_STEPS: u32 = 30;

/// A parsed request.
pub struct Parsed {
    /// The first image's request (the others differ in their seed).
    pub request: ImageRequest,
    /// Images asked for.
    pub n: u32,
    /// Whether progress streams as server-sent events.
    pub stream: bool,
}

const KNOWN: &[&str] = &[
    "model",
    "prompt",
    "n",
    "size",
    "response_format",
    "output_format",
    "user",
    "negative_prompt",
    "steps",
    "guidance_scale",
    "seed",
    "image",
    "strength",
    "handoff_prompt",
    "handoff_step",
    "conditioning",
    "stream",
];

/// The most conditioning values a request may give.
const MAX_CONDITIONING: usize = 64;

/// `conditioning`: a list of finite numbers (a class label, a terrain model's difficulty).
fn conditioning(o: &Obj) -> Result<Vec<f32>, ApiError> {
    let bad = || {
        ApiError::param(
            "conditioning",
            format!("`conditioning` must be a list of at most {MAX_CONDITIONING} finite numbers"),
        )
    };
    match o.get("conditioning") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(values)) if values.len() <= MAX_CONDITIONING => values
            .iter()
            .map(|v| {
                v.as_f64()
                    .map(|f| f as f32)
                    .filter(|f| f.is_finite())
                    .ok_or_else(bad)
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// `"WxH"` as (width, height); `"auto"` as (0, 0).
fn size(text: &str) -> Result<(u32, u32), ApiError> {
    if text == "auto" {
        return Ok((0, 0));
    }
    let side = |s: &str| s.parse::<u32>().ok().filter(|&v| (1..=16384).contains(&v));
    match text.split_once('x').map(|(w, h)| (side(w), side(h))) {
        Some((Some(w), Some(h))) => Ok((w, h)),
        _ => Err(ApiError::param(
            "size",
            format!("`size` must be `WIDTHxHEIGHT` (e.g. `512x512`) or `auto`, got `{text}`"),
        )),
    }
}

/// A request body, checked.
pub fn parse(body: &[u8], models: &[String]) -> Result<Parsed, ApiError> {
    let o: Obj = json::object(body)?;
    crate::tokens::only(&o, KNOWN)?;
    let model = crate::tokens::model(&o, models, false)?;
    let prompt = json::required_string(&o, "prompt")?;
    for (key, only) in [("response_format", "b64_json"), ("output_format", "png")] {
        match json::string(&o, key)?.as_deref() {
            None => {}
            Some(v) if v == only => {}
            Some(other) => {
                return Err(ApiError::param(
                    key,
                    format!(
                        "`{key}` `{other}` is not served: images come back as `{only}` (this \
                         server keeps no files to link to)"
                    ),
                ));
            }
        }
    }
    json::string(&o, "user")?;
    let (width, height) = match json::string(&o, "size")? {
        Some(s) => size(&s)?,
        None => (0, 0),
    };
    let init_image = match json::string(&o, "image")? {
        Some(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .map_err(|e| ApiError::param("image", format!("`image` is not base64 ({e})")))?,
        None => Vec::new(),
    };
    let strength = json::number(&o, "strength", 0.0, 1.0)?;
    if strength.is_some() && init_image.is_empty() {
        return Err(ApiError::param(
            "strength",
            "`strength` applies to an `image` to start from, and none is given",
        ));
    }
    let handoff = json::string(&o, "handoff_prompt")?;
    if handoff.is_none() && o.get("handoff_step").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::param(
            "handoff_step",
            "`handoff_step` applies to a `handoff_prompt`, and none is given",
        ));
    }
    let seed = match o.get("seed") {
        None | Some(Value::Null) => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| ApiError::param("seed", "`seed` must be a non-negative integer"))?,
    };
    Ok(Parsed {
        request: ImageRequest {
            model: model.into(),
            prompt: prompt.into(),
            negative_prompt: json::string(&o, "negative_prompt")?
                .unwrap_or_default()
                .into(),
            width,
            height,
            steps: json::integer_in(&o, "steps", 1, 1000)?.unwrap_or(DEFAULT_STEPS),
            guidance_scale: json::number(&o, "guidance_scale", 0.0, 100.0)?.unwrap_or(7.5) as f32,
            seed,
            init_image: init_image.into(),
            strength: strength.unwrap_or(0.8) as f32,
            handoff_prompt: handoff.clone().unwrap_or_default().into(),
            handoff_step: match handoff {
                Some(_) => json::integer_in(&o, "handoff_step", 0, 1000)?.ok_or_else(|| {
                    ApiError::param("handoff_step", "`handoff_prompt` needs a `handoff_step`")
                })?,
                None => 0,
            },
            conditioning: conditioning(&o)?.into(),
            client: "".into(),
        },
        n: json::integer_in(&o, "n", 1, i64::from(MAX_IMAGES))?.unwrap_or(1),
        stream: json::boolean(&o, "stream")?,
    })
}

/// What the engine's thread reports.
pub enum Update {
    /// Image `index` took a step.
    Step(u32, ImageProgress),
    /// Image `index` is done.
    Image(u32, GeneratedImage),
    /// The request failed.
    Failed(UError),
}

/// Passes each step on; a closed channel (the client left) cancels the request.
struct Steps {
    tx: mpsc::Sender<Update>,
    index: u32,
}

impl ImageSink for Steps {
    fn step(&mut self, progress: &ImageProgress) -> bool {
        self.tx
            .blocking_send(Update::Step(self.index, *progress))
            .is_ok()
    }
}

/// Generates the `n` images of `parsed` one after another on a blocking thread.
pub fn start(engine: EngineBox, parsed: &Parsed) -> mpsc::Receiver<Update> {
    let (tx, rx) = mpsc::channel(64);
    let (first, n) = (parsed.request.clone(), parsed.n);
    tokio::task::spawn_blocking(move || {
        for index in 0..n {
            let request = ImageRequest {
                seed: first.seed.wrapping_add(u64::from(index)),
                ..first.clone()
            };
            let sink = ImageSinkBox::new(Steps {
                tx: tx.clone(),
                index,
            });
            let update = match engine.generate_image(&request, sink).into_result() {
                Ok(image) => Update::Image(index, image),
                Err(e) => Update::Failed(e),
            };
            let failed = matches!(update, Update::Failed(_));
            if tx.blocking_send(update).is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// An image as the API shows it.
pub fn image_json(image: &GeneratedImage) -> Value {
    json!({
        "b64_json": base64::engine::general_purpose::STANDARD.encode(image.png.as_slice()),
        "revised_prompt": Value::Null,
        "seed": image.seed,
        "steps": image.steps,
        "cached_steps": image.cached_steps,
        "approximate": image.approximate,
        "width": image.width,
        "height": image.height,
    })
}

/// The answer's `created`.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Collects every image into the whole answer.
pub async fn whole(mut updates: mpsc::Receiver<Update>) -> Result<Value, ApiError> {
    let mut data = Vec::new();
    while let Some(u) = updates.recv().await {
        match u {
            Update::Step(..) => {}
            Update::Image(_, image) => data.push(image_json(&image)),
            Update::Failed(e) => return Err(ApiError::from_engine(&e)),
        }
    }
    if data.is_empty() {
        return Err(ApiError::status(500, "server_error", "the engine stopped"));
    }
    Ok(json!({"created": now(), "data": data}))
}

/// The server-sent event of `update`.
pub fn event(update: &Update) -> String {
    let (kind, data) = match update {
        Update::Step(index, p) => (
            "image_generation.progress",
            json!({
                "type": "image_generation.progress", "image_index": index,
                "step": p.step, "steps": p.steps, "cached": p.cached,
            }),
        ),
        Update::Image(index, image) => {
            let mut v = image_json(image);
            v["type"] = json!("image_generation.completed");
            v["image_index"] = json!(index);
            v["created_at"] = json!(now());
            ("image_generation.completed", v)
        }
        Update::Failed(e) => {
            let e = ApiError::from_engine(e);
            (
                "error",
                json!({"type": "error", "error": {"message": e.message, "type": e.kind}}),
            )
        }
    };
    format!("event: {kind}\ndata: {data}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["sd".into()]
    }

    #[test]
    fn requests_parse_with_openai_and_u_fields() {
        let p = parse(
            br#"{"prompt":"a cat","size":"64x32","n":2,"steps":4,"seed":9,
                 "guidance_scale":3,"negative_prompt":"dogs","response_format":"b64_json"}"#,
            &models(),
        )
        .unwrap();
        let r = &p.request;
        assert_eq!((r.model.as_str(), r.prompt.as_str()), ("sd", "a cat"));
        assert_eq!((r.width, r.height, r.steps, r.seed), (64, 32, 4, 9));
        assert_eq!(
            (r.guidance_scale, r.negative_prompt.as_str()),
            (3.0, "dogs")
        );
        assert_eq!((p.n, p.stream, r.init_image.len()), (2, false, 0));
        let auto = parse(br#"{"prompt":"x","size":"auto"}"#, &models()).unwrap();
        assert_eq!((auto.request.width, auto.request.steps), (0, DEFAULT_STEPS));
    }

    #[test]
    fn bad_requests_name_their_field() {
        for (body, field) in [
            (&br#"{"size":"1x1"}"#[..], "prompt"),
            (br#"{"prompt":"x","size":"big"}"#, "size"),
            (br#"{"prompt":"x","size":"0x512"}"#, "size"),
            (br#"{"prompt":"x","n":11}"#, "n"),
            (br#"{"prompt":"x","steps":0}"#, "steps"),
            (
                br#"{"prompt":"x","response_format":"url"}"#,
                "response_format",
            ),
            (br#"{"prompt":"x","strength":0.5}"#, "strength"),
            (br#"{"prompt":"x","image":"%%%"}"#, "image"),
            (br#"{"prompt":"x","seed":-1}"#, "seed"),
            (br#"{"prompt":"x","quality":"hd"}"#, "quality"),
            (br#"{"prompt":"x","handoff_step":2}"#, "handoff_step"),
            (br#"{"prompt":"x","handoff_prompt":"y"}"#, "handoff_step"),
            (br#"{"prompt":"x","conditioning":"y"}"#, "conditioning"),
            (br#"{"prompt":"x","conditioning":[null]}"#, "conditioning"),
        ] {
            let e = parse(body, &models()).err().expect("refused");
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
        }
        let e = parse(br#"{"prompt":"x","model":"gpt-image-1"}"#, &models())
            .err()
            .unwrap();
        assert_eq!(e.status, 404, "{}", e.message);
    }
}
