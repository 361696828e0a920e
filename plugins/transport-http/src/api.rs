//! The OpenAI wire format: parsing request bodies into [`GenerateRequest`]s and formatting
//! responses, stream chunks and errors as OpenAI does.

use serde_json::{Map, Value, json};
use u_sdk::{ChatTurn, ErrorKind, FinishReason, GenerateRequest, GenerateSummary, SamplingParams};

/// An error answered to the client: HTTP status and OpenAI's `{"error": {…}}` body.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// The message.
    pub message: String,
    /// OpenAI's error `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A 400 about field `param`.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// Another status with the same shape.
    pub fn status(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            ..Self::invalid(message)
        }
    }

    /// 404 for a model that is not served.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: 404,
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..Self::invalid(format!(
                "The model `{model}` does not exist or you do not have access to it."
            ))
        }
    }

    /// The engine's error as an HTTP answer.
    pub fn from_engine(e: &u_sdk::UError) -> Self {
        let (status, kind) = match e.kind {
            ErrorKind::NotFound => (404, "invalid_request_error"),
            ErrorKind::InvalidInput | ErrorKind::Unsupported | ErrorKind::ResourceExhausted => {
                (400, "invalid_request_error")
            }
            _ => (500, "server_error"),
        };
        Self::status(status, kind, e.message.to_string())
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
}

/// A parsed request: what to ask the engine and how to answer.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The engine request.
    pub request: GenerateRequest,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

type Obj = Map<String, Value>;

fn number(o: &Obj, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if (lo..=hi).contains(&v) {
                Ok(Some(v))
            } else {
                Err(ApiError::param(
                    key,
                    format!("`{key}` must be between {lo} and {hi}, got {v}"),
                ))
            }
        }
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be a number, got {}", type_name(other)),
        )),
    }
}

fn integer(o: &Obj, key: &str) -> Result<Option<i64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
            Ok(Some(n.as_i64().unwrap_or(i64::MAX)))
        }
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be an integer, got {}", type_name(other)),
        )),
    }
}

fn boolean(o: &Obj, key: &str) -> Result<bool, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::param(
            key,
            format!("`{key}` must be a boolean, got {}", type_name(other)),
        )),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Text of a message's `content`: a string, `null`, or an array of `{"type": "text"}` parts.
fn content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (Some(t), _) if t != "text" => {
                        return Err(ApiError::param(
                            at,
                            format!("content parts of type `{t}` are not supported"),
                        ));
                    }
                    _ => {
                        return Err(ApiError::param(
                            at,
                            "a content part must be {\"type\": \"text\", \"text\": string}",
                        ));
                    }
                }
            }
            Ok(out)
        }
        Some(other) => Err(ApiError::param(
            at,
            format!(
                "`content` must be a string or an array, got {}",
                type_name(other)
            ),
        )),
    }
}

/// Parses a request body for `endpoint`. `models` are the names the engine serves.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    models: &[String],
    default_max_tokens: u32,
) -> Result<Parsed, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid UTF-8 ({e})")))?;
    let value: Value = serde_json::from_str(text)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))?;
    let Value::Object(o) = value else {
        return Err(ApiError::invalid(format!(
            "the request body must be a JSON object, got {}",
            type_name(&value)
        )));
    };
    let model = match o.get("model") {
        Some(Value::String(m)) => m.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::param("model", "you must provide a `model`"));
        }
        Some(other) => {
            return Err(ApiError::param(
                "model",
                format!("`model` must be a string, got {}", type_name(other)),
            ));
        }
    };

    let (prompt, messages) = match endpoint {
        Endpoint::Chat => {
            let list = match o.get("messages") {
                Some(Value::Array(list)) if !list.is_empty() => list,
                Some(Value::Array(_)) => {
                    return Err(ApiError::param("messages", "`messages` must not be empty"));
                }
                None | Some(Value::Null) => {
                    return Err(ApiError::param("messages", "you must provide `messages`"));
                }
                Some(other) => {
                    return Err(ApiError::param(
                        "messages",
                        format!("`messages` must be an array, got {}", type_name(other)),
                    ));
                }
            };
            let mut turns = Vec::with_capacity(list.len());
            for (i, m) in list.iter().enumerate() {
                let at = format!("messages[{i}]");
                let Value::Object(m) = m else {
                    return Err(ApiError::param(&at, format!("`{at}` must be an object")));
                };
                let role = match m.get("role") {
                    Some(Value::String(r)) => r.as_str(),
                    _ => {
                        return Err(ApiError::param(
                            &at,
                            format!("`{at}.role` must be a string"),
                        ));
                    }
                };
                if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
                    return Err(ApiError::param(
                        &at,
                        format!(
                            "`{at}.role` `{role}` is not one of system, developer, user, assistant, tool"
                        ),
                    ));
                }
                // OpenAI's newer name for the system role; templates know `system`.
                let role = if role == "developer" { "system" } else { role };
                turns.push(ChatTurn {
                    role: role.into(),
                    content: content(m.get("content"), &format!("{at}.content"))?.into(),
                });
            }
            (String::new(), turns)
        }
        Endpoint::Completions => {
            let prompt = match o.get("prompt") {
                Some(Value::String(p)) => p.clone(),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default().to_string()
                }
                Some(Value::Array(_)) => {
                    return Err(ApiError::param(
                        "prompt",
                        "only a single prompt string is supported (not batches or token ids)",
                    ));
                }
                None | Some(Value::Null) => {
                    return Err(ApiError::param("prompt", "you must provide a `prompt`"));
                }
                Some(other) => {
                    return Err(ApiError::param(
                        "prompt",
                        format!("`prompt` must be a string, got {}", type_name(other)),
                    ));
                }
            };
            (prompt, Vec::new())
        }
    };

    if let Some(n) = integer(&o, "n")?
        && n != 1
    {
        return Err(ApiError::param("n", "only `n` = 1 is supported"));
    }
    if boolean(&o, "logprobs")? || o.get("top_logprobs").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::param(
            "logprobs",
            "`logprobs` are not supported by this server",
        ));
    }
    let max_tokens = match (
        integer(&o, "max_completion_tokens")?,
        integer(&o, "max_tokens")?,
    ) {
        (Some(n), _) | (None, Some(n)) => u32::try_from(n)
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| ApiError::param("max_tokens", "`max_tokens` must be at least 1"))?,
        (None, None) => default_max_tokens,
    };
    let temperature = number(&o, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = number(&o, "top_p", 0.0, 1.0)?.unwrap_or(1.0);
    let top_k = integer(&o, "top_k")?.unwrap_or(0);
    let top_k = u32::try_from(top_k)
        .map_err(|_| ApiError::param("top_k", "`top_k` must be a non-negative integer"))?;
    let min_p = number(&o, "min_p", 0.0, 1.0)?.unwrap_or(0.0);
    let presence = number(&o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let frequency = number(&o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0);
    let repetition = number(&o, "repetition_penalty", 0.0, 10.0)?.unwrap_or(1.0);
    let seed = integer(&o, "seed")?.map(|s| s as u64);
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::param("stop", "`stop` must be a string or an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::param(
                "stop",
                format!(
                    "`stop` must be a string or an array of strings, got {}",
                    type_name(other)
                ),
            ));
        }
    };
    let stream = boolean(&o, "stream")?;
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")?,
        Some(other) => {
            return Err(ApiError::param(
                "stream_options",
                format!(
                    "`stream_options` must be an object, got {}",
                    type_name(other)
                ),
            ));
        }
    };
    if !models.contains(&model) {
        return Err(ApiError::model_not_found(&model));
    }
    Ok(Parsed {
        request: GenerateRequest {
            model: model.into(),
            prompt: prompt.into(),
            messages: messages.into(),
            max_tokens,
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k,
                min_p: min_p as f32,
                repetition_penalty: repetition as f32,
                presence_penalty: presence as f32,
                frequency_penalty: frequency as f32,
                seed: seed.into(),
            },
            stop: stop
                .into_iter()
                .map(Into::into)
                .collect::<Vec<abi_stable::std_types::RString>>()
                .into(),
            cache_breakpoints: Default::default(),
            top_logprobs: Default::default(),
            resume_from: Default::default(),
            save_as: Default::default(),
        },
        stream,
        include_usage,
    })
}

/// OpenAI's name for a finish reason.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// The `usage` object.
pub fn usage(s: &GenerateSummary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

/// Identity of one response: id, creation time and model, shared by all its chunks.
#[derive(Debug, Clone)]
pub struct Meta {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model name.
    pub model: String,
    /// Which endpoint.
    pub endpoint: Endpoint,
}

impl Meta {
    /// A fresh identity for a response of `endpoint`.
    pub fn new(endpoint: Endpoint, model: &str) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        Self {
            id: format!("{prefix}-{:x}{:06x}", now.as_nanos() & 0xffff_ffff_ffff, n),
            created: now.as_secs(),
            model: model.to_string(),
            endpoint,
        }
    }

    /// The whole (non-streamed) response.
    pub fn response(&self, text: &str, summary: &GenerateSummary) -> Value {
        let finish = finish_reason(summary.finish);
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Chat => "chat.completion",
                Endpoint::Completions => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [choice],
            "usage": usage(summary),
        })
    }

    /// One stream chunk. `role` marks a chat stream's first chunk; `finish` its last choice
    /// chunk; `usage` (with `include_usage`) is `Some(Value::Null)` on every chunk but the
    /// usage chunk, which has no choices.
    pub fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        finish: Option<FinishReason>,
        usage: Option<Value>,
    ) -> Value {
        let finish = finish.map(finish_reason);
        let mut choices = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
            }
            Endpoint::Completions => json!([{
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }]),
        };
        let is_usage_chunk = usage.as_ref().is_some_and(|u| !u.is_null());
        if is_usage_chunk {
            choices = json!([]);
        }
        let mut v = json!({
            "id": self.id,
            "object": match self.endpoint {
                Endpoint::Chat => "chat.completion.chunk",
                Endpoint::Completions => "text_completion",
            },
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

/// One server-sent event carrying `value`.
pub fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// The stream's terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["tiny".into()]
    }

    fn err(endpoint: Endpoint, body: &str) -> ApiError {
        parse(endpoint, body.as_bytes(), &models(), 16).unwrap_err()
    }

    #[test]
    fn chat_requests_map_to_messages_and_sampling() {
        let p = parse(
            Endpoint::Chat,
            br#"{"model":"tiny","messages":[{"role":"developer","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"Hi"},{"type":"text","text":"!"}]}],
                "temperature":0,"top_p":0.5,"seed":7,"max_tokens":9,"stop":"\n",
                "stream":true,"stream_options":{"include_usage":true}}"#,
            &models(),
            16,
        )
        .unwrap();
        let r = &p.request;
        assert_eq!(r.messages.len(), 2);
        assert_eq!(r.messages[0].role.as_str(), "system");
        assert_eq!(r.messages[1].content.as_str(), "Hi!");
        assert_eq!(r.max_tokens, 9);
        assert_eq!(r.sampling.temperature, 0.0);
        assert_eq!(r.sampling.top_p, 0.5);
        assert_eq!(r.sampling.seed.into_option(), Some(7));
        assert_eq!(r.stop.len(), 1);
        assert!(p.stream && p.include_usage);
    }

    #[test]
    fn completions_take_one_prompt_and_default_max_tokens() {
        let p = parse(
            Endpoint::Completions,
            br#"{"model":"tiny","prompt":["Hello"]}"#,
            &models(),
            16,
        )
        .unwrap();
        assert_eq!(p.request.prompt.as_str(), "Hello");
        assert_eq!(p.request.max_tokens, 16);
        assert!(p.request.messages.is_empty());
        assert_eq!(p.request.sampling.temperature, 1.0);
    }

    #[test]
    fn bad_requests_are_4xx_with_a_reason() {
        let e = err(Endpoint::Chat, "{");
        assert_eq!(e.status, 400);
        assert!(e.message.contains("not valid JSON"), "{e:?}");
        let e = parse(Endpoint::Chat, b"{\"model\":\"\xff\"}", &models(), 1).unwrap_err();
        assert!(e.message.contains("UTF-8"), "{e:?}");
        let e = err(Endpoint::Chat, r#"{"model":"tiny","messages":"hi"}"#);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = err(
            Endpoint::Chat,
            r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
        );
        assert!(e.message.contains("must be a number"), "{e:?}");
        let e = err(Endpoint::Completions, r#"{"model":"big","prompt":"x"}"#);
        assert_eq!((e.status, e.code), (404, Some("model_not_found")));
        let e = err(
            Endpoint::Completions,
            r#"{"model":"tiny","prompt":"x","max_tokens":0}"#,
        );
        assert_eq!(e.status, 400);
        assert_eq!(err(Endpoint::Completions, "[1]").status, 400);
        let body = e.body();
        assert!(body["error"]["message"].is_string() && body["error"]["type"].is_string());
    }

    #[test]
    fn chunks_are_formatted_like_openai() {
        let m = Meta::new(Endpoint::Chat, "tiny");
        let first = m.chunk(Some(""), true, None, None);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert!(first["choices"][0]["finish_reason"].is_null());
        let last = m.chunk(None, false, Some(FinishReason::Length), Some(Value::Null));
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last["usage"].is_null() && last.get("usage").is_some());
        let s = GenerateSummary {
            prompt_tokens: 3,
            cached_tokens: 1,
            cache_written_tokens: 0,
            generated_tokens: 2,
            finish: FinishReason::Stop,
            stop_sequence: Default::default(),
        };
        let u = m.chunk(None, false, None, Some(usage(&s)));
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 5);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        assert!(sse(&u).starts_with("data: {") && sse(&u).ends_with("}\n\n"));
    }
}
