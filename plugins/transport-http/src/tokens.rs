//! Endpoints that work on tokens rather than generate: `POST /v1/embeddings`, llama-server's
//! `POST /tokenize` and `POST /detokenize`, and Anthropic's `POST /v1/messages/count_tokens`.
//!
//! Embeddings: `input` is a string, an array of strings, an array of token ids or an array of
//! those, or images (`{"image": "data:…"}` or an `image_url` part) for an image encoder; text
//! is tokenized as the model's embedding reads it and the token counts are the `usage`.
//! `encoding_format` is `float` (default) or `base64` (each vector's little-endian `f32`
//! bytes, base64-encoded, as OpenAI sends them and its Python client asks by default).

use crate::{
    anthropic,
    error::ApiError,
    images,
    json::{self, Obj, type_name},
};
use serde_json::{Value, json};
use u_sdk::{EngineBox, TokenizeRequest, UError};

/// Runs a blocking engine call off the async runtime.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, UError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| ApiError::status(500, "server_error", "the engine stopped"))?
        .map_err(|e| ApiError::from_engine(&e))
}

/// A request's `model`, or the first served one when absent (llama-server's endpoints).
pub(crate) fn model(o: &Obj, models: &[String], required: bool) -> Result<String, ApiError> {
    let model = match (json::string(o, "model")?, required) {
        (Some(m), _) => m,
        (None, true) => json::required_string(o, "model")?,
        (None, false) => models
            .first()
            .cloned()
            .ok_or_else(|| ApiError::status(404, "invalid_request_error", "no model is served"))?,
    };
    match u_sdk::serves(models, &model) {
        true => Ok(model),
        false => Err(ApiError::model_not_found(&model)),
    }
}

/// Refuses fields outside `known`, naming them.
pub(crate) fn only(o: &Obj, known: &[&str]) -> Result<(), ApiError> {
    match o
        .iter()
        .find(|(k, v)| !v.is_null() && !known.contains(&k.as_str()))
    {
        Some((k, _)) => Err(ApiError::param(
            k,
            format!("`{k}` is not supported by this server"),
        )),
        None => Ok(()),
    }
}

/// One embeddings input.
enum Input {
    Text(String),
    Tokens(Vec<u32>),
    /// An image file (for image encoders).
    Image(Vec<u8>),
}

fn ids(list: &[Value]) -> Option<Vec<u32>> {
    list.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

fn inputs(o: &Obj) -> Result<Vec<Input>, ApiError> {
    let bad = || {
        ApiError::param(
            "input",
            "`input` must be a non-empty string, an array of them, an array of token ids, an \
             array of token-id arrays, or an array holding images ({\"image\": \"data:…\"})",
        )
    };
    let list = match o.get("input") {
        Some(Value::String(s)) if !s.is_empty() => return Ok(vec![Input::Text(s.clone())]),
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_number) => {
            return Ok(vec![Input::Tokens(ids(a).ok_or_else(bad)?)]);
        }
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => return Err(bad()),
    };
    list.iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) if !s.is_empty() => Ok(Input::Text(s.clone())),
            Value::Array(a) if !a.is_empty() => ids(a).map(Input::Tokens).ok_or_else(bad),
            Value::Object(o) => image(o, &format!("input[{i}]")).map(Input::Image),
            _ => Err(bad()),
        })
        .collect()
}

/// An image input: `{"image": "data:image/png;base64,…"}` (as Jina's and Cohere's embedding
/// APIs take one) or an OpenAI `image_url` part.
fn image(o: &Obj, at: &str) -> Result<Vec<u8>, ApiError> {
    match (o.get("image"), o.get("type").and_then(Value::as_str)) {
        (Some(Value::String(url)), _) => images::data_url(url, &format!("{at}.image")),
        (_, Some("image_url")) => images::openai_part(&Value::Object(o.clone()), at),
        _ => Err(ApiError::param(
            at,
            format!(
                "`{at}` must be text, token ids, {{\"image\": \"data:…\"}} or an image_url part"
            ),
        )),
    }
}

/// Standard base64 (RFC 4648, padded): the `base64` encoding of embeddings.
pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `POST /v1/embeddings`.
pub async fn embeddings(
    engine: EngineBox,
    body: &[u8],
    models: &[String],
) -> Result<Value, ApiError> {
    let o = json::object(body)?;
    only(&o, &["model", "input", "encoding_format", "user"])?;
    let model = model(&o, models, true)?;
    let inputs = inputs(&o)?;
    let base64_format = match json::string(&o, "encoding_format")?.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::param(
                "encoding_format",
                format!("`encoding_format` must be `float` or `base64`, got `{other}`"),
            ));
        }
    };
    json::string(&o, "user")?;
    let m = model.clone();
    let (vectors, tokens) = blocking(move || {
        let mut vectors = Vec::with_capacity(inputs.len());
        let mut tokens = 0usize;
        for input in inputs {
            let ids = match input {
                Input::Image(bytes) => {
                    vectors.push(
                        engine
                            .embed_image(m.as_str().into(), bytes.as_slice().into())
                            .into_result()?,
                    );
                    continue;
                }
                Input::Tokens(ids) => ids,
                Input::Text(text) => engine
                    .tokenize(&TokenizeRequest {
                        model: m.as_str().into(),
                        prompt: text.into(),
                        messages: Default::default(),
                        continue_final: false,
                        add_special: true,
                    })
                    .into_result()?
                    .into_vec(),
            };
            tokens += ids.len();
            vectors.push(
                engine
                    .embed_tokens(m.as_str().into(), ids.as_slice().into())
                    .into_result()?,
            );
        }
        Ok((vectors, tokens))
    })
    .await?;
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = match base64_format {
                true => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Value::from(base64(&bytes))
                }
                false => json!(v.as_slice()),
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(json!({"object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
}

/// `POST /tokenize` (llama-server's shape): `content`, `add_special` (default false),
/// `with_pieces` → `{"tokens": [id…]}` or `{"tokens": [{"id", "piece"}…]}` (a piece that is not
/// valid UTF-8 on its own is its byte values).
pub async fn tokenize(
    engine: EngineBox,
    body: &[u8],
    models: &[String],
) -> Result<Value, ApiError> {
    let o = json::object(body)?;
    only(
        &o,
        &[
            "model",
            "content",
            "add_special",
            "with_pieces",
            "parse_special",
        ],
    )?;
    if o.get("parse_special") == Some(&Value::Bool(false)) {
        return Err(ApiError::param(
            "parse_special",
            "`parse_special: false` is not supported by this server",
        ));
    }
    let model = model(&o, models, false)?;
    let content = match o.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(ApiError::param(
                "content",
                format!("`content` must be a string, got {}", type_name(other)),
            ));
        }
        None => return Err(ApiError::param("content", "you must provide `content`")),
    };
    let add_special = json::boolean(&o, "add_special")?;
    let with_pieces = json::boolean(&o, "with_pieces")?;
    blocking(move || {
        let tokens = engine
            .tokenize(&TokenizeRequest {
                model: model.as_str().into(),
                prompt: content.into(),
                messages: Default::default(),
                continue_final: false,
                add_special,
            })
            .into_result()?;
        if !with_pieces {
            return Ok(json!({"tokens": tokens.as_slice()}));
        }
        let mut out = Vec::with_capacity(tokens.len());
        for &id in tokens.iter() {
            let bytes = engine
                .detokenize(model.as_str().into(), [id].as_slice().into())
                .into_result()?;
            let piece = match std::str::from_utf8(&bytes) {
                Ok(s) => Value::from(s),
                Err(_) => json!(bytes.as_slice()),
            };
            out.push(json!({"id": id, "piece": piece}));
        }
        Ok(json!({"tokens": out}))
    })
    .await
}

/// `POST /detokenize` (llama-server's shape): `tokens` → `{"content": text}`.
pub async fn detokenize(
    engine: EngineBox,
    body: &[u8],
    models: &[String],
) -> Result<Value, ApiError> {
    let o = json::object(body)?;
    only(&o, &["model", "tokens"])?;
    let model = model(&o, models, false)?;
    let tokens = match o.get("tokens") {
        Some(Value::Array(a)) => ids(a)
            .ok_or_else(|| ApiError::param("tokens", "`tokens` must be an array of token ids"))?,
        _ => {
            return Err(ApiError::param(
                "tokens",
                "you must provide `tokens`, an array of ids",
            ));
        }
    };
    blocking(move || {
        let bytes = engine
            .detokenize(model.as_str().into(), tokens.as_slice().into())
            .into_result()?;
        Ok(json!({"content": String::from_utf8_lossy(&bytes)}))
    })
    .await
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`, the prompt a `/v1/messages`
/// request with the same conversation would run.
pub async fn count_tokens(
    engine: EngineBox,
    body: &[u8],
    models: &[String],
) -> Result<Value, ApiError> {
    let c = anthropic::parse_count(body, models)?;
    blocking(move || {
        let tokens = engine
            .tokenize(&TokenizeRequest {
                model: c.model.as_str().into(),
                prompt: Default::default(),
                messages: c.messages.into(),
                continue_final: c.continue_final,
                add_special: true,
            })
            .into_result()?;
        Ok(json!({"input_tokens": tokens.len()}))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_rfc_4648() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64(&[0xff, 0xfe, 0x00, 0x01]), "//4AAQ==");
    }
}
