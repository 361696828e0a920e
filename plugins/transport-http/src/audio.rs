//! OpenAI's audio endpoints: `POST /v1/audio/transcriptions` and `POST /v1/audio/translations`.
//!
//! The body is `multipart/form-data` (parsed with `multer`): a `file` part with the audio and
//! text fields `model`, `language` (transcriptions only), `prompt`, `response_format` (`json`,
//! `text`, `srt`, `verbose_json`, `vtt`), `temperature` and `timestamp_granularities[]`
//! (`segment`; word timestamps are refused), and U's `beam_size` (openai-whisper's beam search;
//! greedy by default). The audio goes to the engine as uploaded; decoding
//! it is the runner's job, so a corrupt or unsupported file is the engine's clear 400.

use crate::error::ApiError;
use bytes::Bytes;
use serde_json::{Value, json};
use u_sdk::{EngineBox, TranscribeRequest, Transcript};

/// What the client asked for, parsed from the form.
pub struct Form {
    /// The engine request (audio, language, prompt, temperature).
    pub request: TranscribeRequest,
    /// The response format.
    pub format: Format,
}

/// The response formats of OpenAI's audio endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `{"text"}` (the default).
    Json,
    /// The text alone.
    Text,
    /// SubRip subtitles.
    Srt,
    /// WebVTT subtitles.
    Vtt,
    /// The text with language, duration and segments.
    VerboseJson,
}

impl Format {
    fn parse(s: &str) -> Result<Format, ApiError> {
        Ok(match s {
            "json" => Format::Json,
            "text" => Format::Text,
            "srt" => Format::Srt,
            "vtt" => Format::Vtt,
            "verbose_json" => Format::VerboseJson,
            other => {
                return Err(ApiError::param(
                    "response_format",
                    format!(
                        "`response_format` must be json, text, srt, verbose_json or vtt, got \
                         `{other}`"
                    ),
                ));
            }
        })
    }
}

/// Parses the multipart body of a transcription (`translate == false`) or translation request.
pub async fn parse(
    content_type: Option<&str>,
    body: Bytes,
    models: &[String],
    translate: bool,
) -> Result<Form, ApiError> {
    let content_type = content_type.unwrap_or("");
    let boundary = multer::parse_boundary(content_type).map_err(|_| {
        ApiError::invalid(format!(
            "the body must be multipart/form-data with a boundary (got content type \
             `{content_type}`)"
        ))
    })?;
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::io::Error>(body) });
    let mut parts = multer::Multipart::new(stream, boundary);
    let bad = |e: multer::Error| ApiError::invalid(format!("malformed multipart body: {e}"));
    let (mut audio, mut model, mut format) = (None, None, Format::Json);
    let mut request = TranscribeRequest {
        model: "".into(),
        audio: Default::default(),
        language: "".into(),
        translate,
        prompt: "".into(),
        temperature: 0.0,
        timestamps: true,
        condition_on_previous: true,
        beam_size: 1,
        client: "".into(),
    };
    while let Some(field) = parts.next_field().await.map_err(bad)? {
        let name = field.name().unwrap_or("").to_string();
        if name == "file" {
            if audio.is_some() {
                return Err(ApiError::param("file", "more than one `file` part"));
            }
            audio = Some(field.bytes().await.map_err(bad)?);
            continue;
        }
        let value = field.text().await.map_err(bad)?;
        match name.as_str() {
            "model" => model = Some(value),
            "language" if !translate => request.language = value.trim().into(),
            "prompt" => request.prompt = value.into(),
            "response_format" => format = Format::parse(value.trim())?,
            "temperature" => {
                request.temperature = value
                    .trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|t| (0.0..=1.0).contains(t))
                    .ok_or_else(|| {
                        ApiError::param(
                            "temperature",
                            format!("`temperature` must be a number from 0 to 1, got `{value}`"),
                        )
                    })?;
            }
            "timestamp_granularities[]" | "timestamp_granularities" => match value.trim() {
                "segment" => {}
                other => {
                    return Err(ApiError::param(
                        "timestamp_granularities",
                        format!("only `segment` timestamps are available, not `{other}`"),
                    ));
                }
            },
            "beam_size" => {
                request.beam_size = value.trim().parse().map_err(|_| {
                    ApiError::param(
                        "beam_size",
                        format!("`beam_size` must be a count, got `{value}`"),
                    )
                })?;
            }
            "stream" if value.trim() == "false" => {}
            "stream" => {
                return Err(ApiError::param(
                    "stream",
                    "streamed transcriptions are not supported; omit `stream`",
                ));
            }
            other => {
                return Err(ApiError::invalid(format!(
                    "unknown form field `{other}` (known: file, model, {}prompt, \
                     response_format, temperature, timestamp_granularities[], beam_size)",
                    if translate { "" } else { "language, " }
                )));
            }
        }
    }
    let audio = audio.ok_or_else(|| ApiError::param("file", "the form has no `file` part"))?;
    if audio.is_empty() {
        return Err(ApiError::param("file", "the uploaded file is empty"));
    }
    let model = model.ok_or_else(|| ApiError::param("model", "the form has no `model` field"))?;
    if !u_sdk::serves(models, &model) {
        return Err(ApiError::model_not_found(&model));
    }
    request.model = model.as_str().into();
    request.audio = audio.to_vec().into();
    Ok(Form { request, format })
}

/// Runs the request on a blocking thread.
pub async fn run(engine: EngineBox, request: TranscribeRequest) -> Result<Transcript, ApiError> {
    tokio::task::spawn_blocking(move || engine.transcribe(&request).into_result())
        .await
        .map_err(|_| ApiError::status(500, "server_error", "the engine stopped"))?
        .map_err(|e| ApiError::from_engine(&e))
}

/// A response body: JSON, or text of a content type.
pub enum Reply {
    /// A JSON document.
    Json(Value),
    /// Text (`text`, `srt`, `vtt`).
    Text {
        /// The body.
        body: String,
        /// Its content type.
        content_type: &'static str,
    },
}

/// The response to `t` in `format`.
pub fn reply(t: &Transcript, format: Format, translate: bool) -> Reply {
    let text = |body: String, content_type| Reply::Text { body, content_type };
    let usage = json!({"type": "duration", "seconds": t.duration.ceil() as u64});
    match format {
        Format::Json => Reply::Json(json!({"text": t.text.as_str(), "usage": usage})),
        Format::VerboseJson => {
            let segments: Vec<Value> = t
                .segments
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    json!({
                        "id": i, "seek": s.seek, "start": s.start, "end": s.end,
                        "text": s.text.as_str(), "tokens": s.tokens.as_slice(),
                        "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                        "compression_ratio": s.compression_ratio,
                        "no_speech_prob": s.no_speech_prob,
                    })
                })
                .collect();
            Reply::Json(json!({
                "task": if translate { "translate" } else { "transcribe" },
                "language": t.language.as_str(), "duration": t.duration,
                "text": t.text.as_str(), "segments": segments, "usage": usage,
            }))
        }
        Format::Text => text(format!("{}\n", t.text), "text/plain; charset=utf-8"),
        Format::Srt => text(u_sdk::subtitles::srt(t), "text/plain; charset=utf-8"),
        Format::Vtt => text(u_sdk::subtitles::vtt(t), "text/vtt; charset=utf-8"),
    }
}
