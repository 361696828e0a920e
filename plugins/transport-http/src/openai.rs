//! The OpenAI wire format: parsing `/v1/chat/completions` and `/v1/completions` bodies into
//! [`GenerateRequest`]s and answering as OpenAI does (objects, stream chunks, logprobs, usage).
//!
//! Extensions (OpenAI clients send them with `extra_body`): `top_k`, `min_p`,
//! `repetition_penalty`, and `resume_from` / `save_as` to continue from and save KV
//! checkpoints.

use crate::{
    bridge::Piece,
    error::{ApiError, Dialect},
    json::{self, Obj, type_name},
    reply::{self, Reply, sse},
};
use serde_json::{Map, Value, json};
use u_sdk::{
    ChatTurn, FinishReason, GenerateRequest, GenerateSummary, SamplingParams, TokenLogprob,
};

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
    /// Whether to answer with logprobs.
    pub logprobs: bool,
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

fn messages(o: &Obj) -> Result<Vec<ChatTurn>, ApiError> {
    let list = json::nonempty_array(o, "messages")?;
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
    Ok(turns)
}

fn prompt(o: &Obj) -> Result<String, ApiError> {
    match o.get("prompt") {
        Some(Value::String(p)) => Ok(p.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(a[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(_)) => Err(ApiError::param(
            "prompt",
            "only a single prompt string is supported (not batches or token ids)",
        )),
        None | Some(Value::Null) => Err(ApiError::param("prompt", "you must provide a `prompt`")),
        Some(other) => Err(ApiError::param(
            "prompt",
            format!("`prompt` must be a string, got {}", type_name(other)),
        )),
    }
}

/// The sampling fields OpenAI, vLLM and llama.cpp servers accept, with `temperature_max` as
/// the largest temperature allowed.
pub fn sampling(o: &Obj, temperature_max: f64) -> Result<SamplingParams, ApiError> {
    let top_k = json::integer(o, "top_k")?.unwrap_or(0);
    Ok(SamplingParams {
        temperature: json::number(o, "temperature", 0.0, temperature_max)?.unwrap_or(1.0) as f32,
        top_p: json::number(o, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: u32::try_from(top_k)
            .map_err(|_| ApiError::param("top_k", "`top_k` must be a non-negative integer"))?,
        min_p: json::number(o, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        repetition_penalty: json::number(o, "repetition_penalty", 0.0, 10.0)?.unwrap_or(1.0) as f32,
        presence_penalty: json::number(o, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: json::number(o, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        seed: json::integer(o, "seed")?.map(|s| s as u64).into(),
    })
}

/// Parses a request body for `endpoint`. `models` are the names the engine serves.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    models: &[String],
    default_max_tokens: u32,
) -> Result<Parsed, ApiError> {
    let o = json::object(body)?;
    let model = json::required_string(&o, "model")?;
    let (prompt, messages) = match endpoint {
        Endpoint::Chat => (String::new(), messages(&o)?),
        Endpoint::Completions => (prompt(&o)?, Vec::new()),
    };
    if let Some(n) = json::integer(&o, "n")?
        && n != 1
    {
        return Err(ApiError::param("n", "only `n` = 1 is supported"));
    }
    // Chat: `logprobs: bool` + `top_logprobs: 0..=20`; completions: `logprobs: 0..=5`.
    let top_logprobs = match endpoint {
        Endpoint::Chat => {
            let wanted = json::boolean(&o, "logprobs")?;
            let top = json::integer_in(&o, "top_logprobs", 0, 20)?;
            if top.is_some() && !wanted {
                return Err(ApiError::param(
                    "top_logprobs",
                    "`top_logprobs` needs `logprobs` set to true",
                ));
            }
            wanted.then_some(top.unwrap_or(0))
        }
        Endpoint::Completions => json::integer_in(&o, "logprobs", 0, 5)?,
    };
    let max_tokens = json::max_tokens(
        &o,
        &["max_completion_tokens", "max_tokens"],
        Some(default_max_tokens),
    )?;
    let sampling = sampling(&o, 2.0)?;
    let stop = json::strings(&o, "stop")?;
    let stream = json::boolean(&o, "stream")?;
    let include_usage = match json::nested(&o, "stream_options")? {
        Some(so) => json::boolean(so, "include_usage")?,
        None => false,
    };
    let resume_from = json::string(&o, "resume_from")?;
    let save_as = json::string(&o, "save_as")?;
    // OpenAI's end-user id: the fair-queueing key when given (else the connection's peer).
    let user = json::string(&o, "user")?;
    if !models.contains(&model) {
        return Err(ApiError::model_not_found(&model));
    }
    let mut request = GenerateRequest::new(&model, &prompt, max_tokens, sampling);
    request.messages = messages.into();
    request.stop = stop.into_iter().map(Into::into).collect();
    request.top_logprobs = top_logprobs.into();
    request.resume_from = resume_from.map(Into::into).into();
    request.save_as = save_as.map(Into::into).into();
    request.client = user.map(|u| format!("user:{u}")).unwrap_or_default().into();
    Ok(Parsed {
        logprobs: top_logprobs.is_some(),
        request,
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

fn token_string(t: &TokenLogprob) -> String {
    String::from_utf8_lossy(&t.bytes).into_owned()
}

/// A chat `logprobs.content` entry.
fn chat_logprob(p: &Piece) -> Option<Value> {
    let t = p.logprob.as_ref()?;
    let top: Vec<Value> = p
        .top
        .iter()
        .map(|a| json!({"token": token_string(a), "logprob": a.logprob, "bytes": a.bytes.to_vec()}))
        .collect();
    Some(json!({
        "token": token_string(t),
        "logprob": t.logprob,
        "bytes": t.bytes.to_vec(),
        "top_logprobs": top,
    }))
}

/// A completions `logprobs` object for `pieces`, whose text starts at byte `offset`.
fn completion_logprobs(pieces: &[Piece], mut offset: usize) -> Value {
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for p in pieces {
        if let Some(t) = &p.logprob {
            tokens.push(Value::from(token_string(t)));
            lps.push(Value::from(t.logprob));
            let top: Map<String, Value> = p
                .top
                .iter()
                .map(|a| (token_string(a), Value::from(a.logprob)))
                .collect();
            tops.push(Value::Object(top));
            offsets.push(Value::from(offset));
        }
        offset += p.text.len();
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// One response: its identity and the options that shape its chunks.
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
    /// Send a usage chunk at the end of a stream (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Answer with logprobs.
    pub logprobs: bool,
    /// Bytes of text streamed so far (completions' `text_offset`).
    streamed: usize,
}

impl Meta {
    /// A fresh identity for a response to `parsed`.
    pub fn new(endpoint: Endpoint, parsed: &Parsed) -> Self {
        let (id, created) = reply::response_id(match endpoint {
            Endpoint::Chat => "chatcmpl-",
            Endpoint::Completions => "cmpl-",
        });
        Self {
            id,
            created,
            model: parsed.request.model.to_string(),
            endpoint,
            include_usage: parsed.include_usage,
            logprobs: parsed.logprobs,
            streamed: 0,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
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
        logprobs: Value,
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
                json!([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
            }
            Endpoint::Completions => json!([{
                "index": 0, "text": text.unwrap_or(""), "logprobs": logprobs,
                "finish_reason": finish,
            }]),
        };
        let is_usage_chunk = usage.as_ref().is_some_and(|u| !u.is_null());
        if is_usage_chunk {
            choices = json!([]);
        }
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
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

    fn usage_null(&self) -> Option<Value> {
        self.include_usage.then_some(Value::Null)
    }
}

impl Reply for Meta {
    fn dialect(&self) -> Dialect {
        Dialect::OpenAi
    }

    fn opening(&mut self) -> Vec<String> {
        match self.endpoint {
            Endpoint::Chat => vec![sse(
                None,
                &self.chunk(Some(""), true, None, self.usage_null(), Value::Null),
            )],
            Endpoint::Completions => Vec::new(),
        }
    }

    fn piece(&mut self, piece: &Piece) -> Vec<String> {
        let logprobs = match (self.logprobs, self.endpoint) {
            (false, _) => Value::Null,
            (true, Endpoint::Chat) => {
                json!({"content": chat_logprob(piece).into_iter().collect::<Vec<_>>(), "refusal": null})
            }
            (true, Endpoint::Completions) => {
                completion_logprobs(std::slice::from_ref(piece), self.streamed)
            }
        };
        self.streamed += piece.text.len();
        if piece.text.is_empty() && logprobs.is_null() {
            return Vec::new();
        }
        vec![sse(
            None,
            &self.chunk(Some(&piece.text), false, None, self.usage_null(), logprobs),
        )]
    }

    fn closing(&mut self, summary: &GenerateSummary) -> Vec<String> {
        let text = (self.endpoint == Endpoint::Completions).then_some("");
        let mut frames = vec![sse(
            None,
            &self.chunk(
                text,
                false,
                Some(summary.finish),
                self.usage_null(),
                Value::Null,
            ),
        )];
        if self.include_usage {
            frames.push(sse(
                None,
                &self.chunk(None, false, None, Some(usage(summary)), Value::Null),
            ));
        }
        frames.push(SSE_DONE.to_string());
        frames
    }

    fn whole(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value {
        let finish = finish_reason(summary.finish);
        let text = reply::text(pieces);
        let logprobs = match (self.logprobs, self.endpoint) {
            (false, _) => Value::Null,
            (true, Endpoint::Chat) => json!({
                "content": pieces.iter().filter_map(chat_logprob).collect::<Vec<_>>(),
                "refusal": null,
            }),
            (true, Endpoint::Completions) => completion_logprobs(pieces, 0),
        };
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [choice],
            "usage": usage(summary),
        })
    }
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
                "stream":true,"stream_options":{"include_usage":true},
                "logprobs":true,"top_logprobs":3,"resume_from":"doc","save_as":"doc2"}"#,
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
        assert_eq!(r.top_logprobs.into_option(), Some(3));
        assert_eq!(
            r.resume_from.as_ref().map(|s| s.as_str()).into_option(),
            Some("doc")
        );
        assert_eq!(
            r.save_as.as_ref().map(|s| s.as_str()).into_option(),
            Some("doc2")
        );
        assert!(p.stream && p.include_usage && p.logprobs);
    }

    #[test]
    fn completions_take_one_prompt_and_default_max_tokens() {
        let p = parse(
            Endpoint::Completions,
            br#"{"model":"tiny","prompt":["Hello"],"logprobs":2}"#,
            &models(),
            16,
        )
        .unwrap();
        assert_eq!(p.request.prompt.as_str(), "Hello");
        assert_eq!(p.request.max_tokens, 16);
        assert!(p.request.messages.is_empty());
        assert_eq!(p.request.sampling.temperature, 1.0);
        assert_eq!(p.request.top_logprobs.into_option(), Some(2));
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
        let e = err(
            Endpoint::Chat,
            r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
        );
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = err(
            Endpoint::Completions,
            r#"{"model":"tiny","prompt":"x","logprobs":6}"#,
        );
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let e = err(Endpoint::Completions, r#"{"model":"big","prompt":"x"}"#);
        assert_eq!((e.status, e.code), (404, Some("model_not_found")));
        let e = err(
            Endpoint::Completions,
            r#"{"model":"tiny","prompt":"x","max_tokens":0}"#,
        );
        assert_eq!(e.status, 400);
        assert_eq!(err(Endpoint::Completions, "[1]").status, 400);
        let body = e.body(Dialect::OpenAi);
        assert!(body["error"]["message"].is_string() && body["error"]["type"].is_string());
    }

    #[test]
    fn the_user_field_is_the_fair_queueing_key() {
        let p = parsed(
            r#"{"model":"tiny","prompt":"x","user":"alice"}"#,
            Endpoint::Completions,
        );
        assert_eq!(p.request.client.as_str(), "user:alice");
        let p = parsed(r#"{"model":"tiny","prompt":"x"}"#, Endpoint::Completions);
        assert!(
            p.request.client.is_empty(),
            "left for the connection's peer"
        );
        let e = err(
            Endpoint::Completions,
            r#"{"model":"tiny","prompt":"x","user":7}"#,
        );
        assert_eq!((e.status, e.param.as_deref()), (400, Some("user")));
    }

    fn parsed(body: &str, endpoint: Endpoint) -> Parsed {
        parse(endpoint, body.as_bytes(), &models(), 16).unwrap()
    }

    fn summary() -> GenerateSummary {
        GenerateSummary {
            prompt_tokens: 3,
            cached_tokens: 1,
            cache_written_tokens: 0,
            generated_tokens: 2,
            tokens: vec![7, 8].into(),
            finish: FinishReason::Length,
            stop_sequence: Default::default(),
            prompt_ms: 1.0,
            generate_ms: 2.0,
        }
    }

    fn lp(id: u32, text: &str, logprob: f32) -> TokenLogprob {
        TokenLogprob {
            id,
            bytes: text.as_bytes().to_vec().into(),
            logprob,
        }
    }

    #[test]
    fn chunks_are_formatted_like_openai() {
        let p = parsed(
            r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"stream":true,
                "stream_options":{"include_usage":true}}"#,
            Endpoint::Chat,
        );
        let mut m = Meta::new(Endpoint::Chat, &p);
        let first = m.opening();
        assert_eq!(first.len(), 1);
        let v: Value = serde_json::from_str(first[0].trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert!(v["choices"][0]["finish_reason"].is_null());
        let closing = m.closing(&summary());
        assert_eq!(closing.len(), 3);
        assert_eq!(closing[2], SSE_DONE);
        let last: Value =
            serde_json::from_str(closing[0].trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(last["choices"][0]["delta"], json!({}));
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(last["usage"].is_null() && last.get("usage").is_some());
        let u: Value =
            serde_json::from_str(closing[1].trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 5);
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
    }

    #[test]
    fn logprobs_are_formatted_per_endpoint() {
        let pieces = vec![
            Piece {
                text: "Hi".into(),
                logprob: Some(lp(5, "Hi", -0.5)),
                top: vec![lp(5, "Hi", -0.5), lp(6, "Ho", -1.5)],
            },
            Piece {
                text: "!".into(),
                logprob: Some(lp(7, "!", -0.25)),
                top: vec![lp(7, "!", -0.25), lp(8, "?", -2.0)],
            },
        ];
        let chat = parsed(
            r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":2}"#,
            Endpoint::Chat,
        );
        let v = Meta::new(Endpoint::Chat, &chat).whole(&pieces, &summary());
        let content = &v["choices"][0]["logprobs"]["content"];
        assert_eq!(content[0]["token"], "Hi");
        assert_eq!(content[1]["logprob"], -0.25);
        assert_eq!(content[0]["top_logprobs"][1]["token"], "Ho");
        assert_eq!(content[1]["bytes"], json!([33]));
        let comp = parsed(
            r#"{"model":"tiny","prompt":"x","logprobs":2}"#,
            Endpoint::Completions,
        );
        let v = Meta::new(Endpoint::Completions, &comp).whole(&pieces, &summary());
        let l = &v["choices"][0]["logprobs"];
        assert_eq!(l["tokens"], json!(["Hi", "!"]));
        assert_eq!(l["text_offset"], json!([0, 2]));
        assert_eq!(l["top_logprobs"][1]["?"], -2.0);
        let mut streaming = Meta::new(Endpoint::Completions, &comp);
        streaming.piece(&pieces[0]);
        let frame = streaming.piece(&pieces[1]);
        let c: Value = serde_json::from_str(frame[0].trim_start_matches("data: ").trim()).unwrap();
        assert_eq!(c["choices"][0]["logprobs"]["text_offset"], json!([2]));
    }
}
