//! The OpenAI wire format: parsing `/v1/chat/completions` and `/v1/completions` bodies into
//! [`GenerateRequest`]s and answering as OpenAI does (objects, stream chunks, logprobs, usage).
//!
//! Extensions (OpenAI clients send them with `extra_body`): `top_k`, `min_p`,
//! `repetition_penalty`, and `resume_from` / `save_as` to continue from and save KV
//! checkpoints. Structured outputs: `response_format` `json_object` and `json_schema`
//! (OpenAI's nested `json_schema: {name, schema, strict}`, or llama.cpp's top-level `schema`),
//! and the extensions `{"type": "regex", "regex": …}` and `{"type": "grammar", "grammar": …}`
//! (Lark, as llguidance takes it).

use crate::{
    bridge::Piece,
    error::{ApiError, Dialect},
    images,
    json::{self, Obj, type_name},
    reply::{self, Reply, sse},
    tools,
};
use serde_json::{Map, Value, json};
use u_chat_template::tools::{ToolCall, parse_calls, render_call, streamable};
use u_sdk::{
    ChatImage, ChatTurn, Constraint, FinishReason, GenerateRequest, GenerateSummary, LogitBias,
    SamplingParams, TokenLogprob,
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
    /// `/v1/completions`' prompts (empty for chat).
    pub prompts: Vec<PromptInput>,
    /// Choices returned per prompt.
    pub n: u32,
    /// Candidates generated per prompt, of which the `n` most likely are returned.
    pub best_of: u32,
    /// Completions: answer with the prompt before the completion.
    pub echo: bool,
    /// Tools are declared: the answer's `<tool_call>` blocks become `tool_calls`.
    pub tools: bool,
}

/// Text of a message's `content`: a string, `null`, or an array of `{"type": "text"}` parts.
/// A message's `content`: a string, or parts — text, and images (`image_url` with a data URL),
/// each image standing at the byte offset of the text before it.
fn content(v: Option<&Value>, at: &str) -> Result<(String, Vec<ChatImage>), ApiError> {
    match v {
        None | Some(Value::Null) => Ok((String::new(), Vec::new())),
        Some(Value::String(s)) => Ok((s.clone(), Vec::new())),
        Some(Value::Array(parts)) => {
            let (mut out, mut images) = (String::new(), Vec::new());
            for (i, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push_str(t),
                    (Some("image_url"), _) => {
                        let data = images::openai_part(part, &format!("{at}[{i}]"))?;
                        let offset = u32::try_from(out.len()).map_err(|_| {
                            ApiError::param(at, "an image stands past 4 GiB of text")
                        })?;
                        images.push(ChatImage {
                            data: data.into(),
                            offset,
                        });
                    }
                    (Some(t), _) if t != "text" => {
                        return Err(ApiError::param(
                            at,
                            format!(
                                "content parts of type `{t}` are not supported (text and \
                                 image_url are)"
                            ),
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
            Ok((out, images))
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
        let (mut text, images) = content(m.get("content"), &format!("{at}.content"))?;
        if !images.is_empty() && role != "user" {
            return Err(ApiError::param(
                &at,
                format!("images are read in user messages, not in a `{role}` message"),
            ));
        }
        if role == "tool" {
            turns.push(tools::response_turn(&text));
            continue;
        }
        if role == "assistant" {
            for call in history_calls(m.get("tool_calls"), &at)? {
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&render_call(&call));
            }
        }
        // OpenAI's newer name for the system role; templates know `system`.
        let role = if role == "developer" { "system" } else { role };
        turns.push(ChatTurn {
            role: role.into(),
            content: text.into(),
            images: images.into(),
        });
    }
    Ok(turns)
}

/// An assistant message's earlier `tool_calls` (`arguments` a JSON string of an object).
fn history_calls(v: Option<&Value>, at: &str) -> Result<Vec<ToolCall>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::param(
                at,
                format!("`{at}.tool_calls` must be an array"),
            ));
        }
    };
    list.iter()
        .enumerate()
        .map(|(i, c)| {
            let at = format!("{at}.tool_calls[{i}].function");
            let f = c.get("function");
            let name = tools::name(f.and_then(|f| f.get("name")), &format!("{at}.name"))?;
            let arguments = match f.and_then(|f| f.get("arguments")) {
                Some(Value::String(s)) => serde_json::from_str(s).ok().filter(Value::is_object),
                _ => None,
            }
            .ok_or_else(|| {
                ApiError::param(
                    &at,
                    format!("`{at}.arguments` must be a JSON object, as a string"),
                )
            })?;
            Ok(ToolCall { name, arguments })
        })
        .collect()
}

/// One prompt of a `/v1/completions` request: text, or token ids used as they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptInput {
    /// Text, encoded by the engine (with BOS as the model wants).
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// Most sequences one request may ask for (prompts × `best_of`, or `n`).
pub const MAX_SEQUENCES: usize = 128;

/// Token ids from a JSON array of non-negative integers.
fn token_ids(list: &[Value], at: &str) -> Result<Vec<u32>, ApiError> {
    list.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    ApiError::param(at, format!("`{at}` must hold token ids (integers)"))
                })
        })
        .collect()
}

/// `prompt`: a string, an array of strings, an array of token ids, or an array of those.
fn prompts(o: &Obj) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::param(
            "prompt",
            "`prompt` must be a string, an array of strings, an array of token ids or an \
             array of token-id arrays",
        )
    };
    let list = match o.get("prompt") {
        Some(Value::String(p)) => return Ok(vec![PromptInput::Text(p.clone())]),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::param("prompt", "`prompt` must not be empty"));
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            return Ok(vec![PromptInput::Tokens(token_ids(a, "prompt")?)]);
        }
        Some(Value::Array(a)) => a,
        None | Some(Value::Null) => {
            return Err(ApiError::param("prompt", "you must provide a `prompt`"));
        }
        Some(_) => return Err(bad()),
    };
    list.iter()
        .enumerate()
        .map(|(i, p)| match p {
            Value::String(s) => Ok(PromptInput::Text(s.clone())),
            Value::Array(ids) if !ids.is_empty() => Ok(PromptInput::Tokens(token_ids(
                ids,
                &format!("prompt[{i}]"),
            )?)),
            _ => Err(bad()),
        })
        .collect()
}

/// `logit_bias`: token ids (as strings) to a bias in `-100..=100`.
fn logit_bias(o: &Obj) -> Result<Vec<LogitBias>, ApiError> {
    let Some(map) = json::nested(o, "logit_bias")? else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(id, bias)| {
            let id = id.parse::<u32>().map_err(|_| {
                ApiError::param(
                    "logit_bias",
                    format!("`logit_bias` keys must be token ids, got `{id}`"),
                )
            })?;
            match bias.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok(LogitBias { id, bias: b as f32 }),
                _ => Err(ApiError::param(
                    "logit_bias",
                    "`logit_bias` values must be numbers between -100 and 100",
                )),
            }
        })
        .collect()
}

/// `response_format`: what the output must follow (see the module docs); `text` is free text.
fn response_format(o: &Obj) -> Result<Constraint, ApiError> {
    let Some(rf) = json::nested(o, "response_format")? else {
        return Ok(Constraint::None);
    };
    let bad = |msg: String| ApiError::param("response_format", msg);
    let schema = |v: Option<&Value>, at: &str| match v {
        Some(s @ (Value::Object(_) | Value::Bool(_))) => Ok(s.to_string()),
        Some(other) => Err(bad(format!(
            "`{at}` must be a JSON schema (an object), got {}",
            type_name(other)
        ))),
        None => Err(bad(format!("`{at}` is required"))),
    };
    let text = |key: &str| match rf.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(bad(format!("`response_format.{key}` must be a string"))),
    };
    Ok(match rf.get("type").and_then(Value::as_str) {
        Some("text") => Constraint::None,
        Some("json_object") => match rf.get("schema").filter(|v| !v.is_null()) {
            Some(s) => Constraint::JsonSchema(schema(Some(s), "response_format.schema")?.into()),
            None => Constraint::JsonSchema(r#"{"type":"object"}"#.into()),
        },
        Some("json_schema") => match json::nested(rf, "json_schema")? {
            Some(js) => {
                json::string(js, "name")?;
                json::boolean(js, "strict")?;
                let at = "response_format.json_schema.schema";
                Constraint::JsonSchema(schema(js.get("schema"), at)?.into())
            }
            None => Constraint::JsonSchema(
                schema(rf.get("schema"), "response_format.json_schema")?.into(),
            ),
        },
        Some("regex") => Constraint::Regex(text("regex")?.into()),
        Some("grammar") => Constraint::Lark(text("grammar")?.into()),
        _ => {
            return Err(bad(format!(
                "`response_format.type` must be `text`, `json_object`, `json_schema`, `regex` \
                 or `grammar`, got {}",
                rf.get("type").map_or("nothing".into(), Value::to_string)
            )));
        }
    })
}

/// Fields both endpoints take, OpenAI's and this server's extensions (`top_k`, `min_p`,
/// `repetition_penalty`, `ignore_eos` as vLLM and llama-server take them, `resume_from`,
/// `save_as`, `overwrite`).
const COMMON: [&str; 24] = [
    "model",
    "lora",
    "control_vectors",
    "soft_prompt",
    "response_format",
    "frequency_penalty",
    "logit_bias",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "resume_from",
    "save_as",
    "overwrite",
];

/// Fields only `/v1/chat/completions` takes.
const CHAT: [&str; 10] = [
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "metadata",
    "prompt_cache_key",
    "safety_identifier",
];

/// Fields only `/v1/completions` takes.
const COMPLETIONS: [&str; 5] = ["prompt", "logprobs", "echo", "suffix", "best_of"];

/// Fields whose value here changes nothing (their defaults), accepted as such; any other value
/// is an option this server does not implement.
fn harmless(key: &str, v: &Value) -> bool {
    match key {
        "modalities" => v == &json!(["text"]),
        "store" => v == &json!(false),
        "service_tier" => matches!(v.as_str(), Some("auto" | "default")),
        _ => false,
    }
}

/// Refuses every field of `o` this endpoint does not implement, naming it (a `null` is the
/// same as leaving the field out).
pub fn refuse_unsupported(endpoint: Endpoint, o: &Obj) -> Result<(), ApiError> {
    let own: &[&str] = match endpoint {
        Endpoint::Chat => &CHAT,
        Endpoint::Completions => &COMPLETIONS,
    };
    for (key, v) in o {
        if v.is_null()
            || COMMON.contains(&key.as_str())
            || own.contains(&key.as_str())
            || harmless(key, v)
        {
            continue;
        }
        return Err(ApiError::param(
            key,
            format!("`{key}` is not supported by this server"),
        ));
    }
    Ok(())
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
    refuse_unsupported(endpoint, &o)?;
    let model = json::required_string(&o, "model")?;
    let (prompts, messages) = match endpoint {
        Endpoint::Chat => (Vec::new(), messages(&o)?),
        Endpoint::Completions => (prompts(&o)?, Vec::new()),
    };
    let n = json::integer_in(&o, "n", 1, MAX_SEQUENCES as i64)?.unwrap_or(1);
    let best_of = json::integer_in(&o, "best_of", 1, MAX_SEQUENCES as i64)?.unwrap_or(n);
    if best_of < n {
        return Err(ApiError::param(
            "best_of",
            format!("`best_of` ({best_of}) must be at least `n` ({n})"),
        ));
    }
    if prompts.len().max(1) * best_of as usize > MAX_SEQUENCES {
        return Err(ApiError::param(
            "prompt",
            format!(
                "{} prompts × {best_of} sequences each is more than the {MAX_SEQUENCES} \
                 sequences one request may ask for",
                prompts.len()
            ),
        ));
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
    let echo = json::boolean(&o, "echo")?;
    if echo && top_logprobs.is_some() {
        return Err(ApiError::param(
            "echo",
            "`echo` with `logprobs` (the prompt's logprobs) is not supported by this server",
        ));
    }
    let suffix = json::string(&o, "suffix")?;
    let keys = ["max_completion_tokens", "max_tokens"];
    let asked = keys.iter().any(|k| o.get(*k).is_some_and(|v| !v.is_null()));
    let max_tokens = json::max_tokens(&o, &keys, Some(default_max_tokens))?;
    let sampling = sampling(&o, 2.0)?;
    let stop = json::strings(&o, "stop")?;
    let stream = json::boolean(&o, "stream")?;
    if stream && best_of > n {
        return Err(ApiError::param(
            "best_of",
            "`best_of` larger than `n` cannot be streamed",
        ));
    }
    let include_usage = match json::nested(&o, "stream_options")? {
        Some(so) => json::boolean(so, "include_usage")?,
        None => false,
    };
    let resume_from = json::string(&o, "resume_from")?;
    let save_as = json::string(&o, "save_as")?;
    if save_as.is_some() && prompts.len().max(1) * best_of as usize > 1 {
        return Err(ApiError::param(
            "save_as",
            "`save_as` saves one sequence; this request asks for several",
        ));
    }
    // OpenAI's end-user id: the fair-queueing key when given (else the connection's peer).
    let user = match json::string(&o, "user")? {
        Some(u) => Some(u),
        None => json::string(&o, "safety_identifier")?,
    };
    json::nested(&o, "metadata")?;
    json::string(&o, "prompt_cache_key")?;
    if !u_sdk::serves(models, &model) {
        return Err(ApiError::model_not_found(&model));
    }
    let mut request = GenerateRequest::new(&model, "", max_tokens, sampling);
    request.messages = messages.into();
    request.stop = stop.into_iter().map(Into::into).collect();
    request.top_logprobs = top_logprobs.into();
    request.resume_from = resume_from.map(Into::into).into();
    request.save_as = save_as.map(Into::into).into();
    request.overwrite = json::boolean(&o, "overwrite")?;
    request.ignore_eos = json::boolean(&o, "ignore_eos")?;
    request.client = user.map(|u| format!("user:{u}")).unwrap_or_default().into();
    request.logit_bias = logit_bias(&o)?.into();
    request.adapters = json::adapters(&o, "lora")?.into();
    request.control_vectors = json::control_vectors(&o, "control_vectors")?.into();
    request.soft_prompt = json::string(&o, "soft_prompt")?.unwrap_or_default().into();
    request.constraint = response_format(&o)?;
    request.suffix = suffix.map(Into::into).into();
    request.clamp_max_tokens = !asked;
    let tools = match endpoint {
        Endpoint::Chat => tools::openai(&o)?,
        Endpoint::Completions => None,
    };
    if let Some(t) = &tools {
        if best_of > 1 {
            return Err(ApiError::param(
                "tools",
                "`tools` with several choices (`n` or `best_of` above 1) is not supported by \
                 this server",
            ));
        }
        t.apply(&mut request)?;
    }
    if let Some(first) = prompts.first() {
        set_prompt(&mut request, first);
    }
    Ok(Parsed {
        tools: tools.is_some(),
        logprobs: top_logprobs.is_some(),
        request,
        prompts,
        n,
        best_of,
        echo,
        stream,
        include_usage,
    })
}

/// Makes `prompt` the request's prompt.
pub fn set_prompt(request: &mut GenerateRequest, prompt: &PromptInput) {
    match prompt {
        PromptInput::Text(t) => {
            request.prompt = t.as_str().into();
            request.prompt_tokens = Default::default();
        }
        PromptInput::Tokens(ids) => {
            request.prompt = Default::default();
            request.prompt_tokens = ids.clone().into();
        }
    }
}

impl Parsed {
    /// Whether the request is one sequence answered as it runs (no echo, batch or ranking).
    pub fn is_single(&self) -> bool {
        self.prompts.len() <= 1 && self.best_of == 1 && !self.echo
    }

    /// The engine requests, by prompt: `best_of` candidates each (logprobs asked for when
    /// candidates are ranked).
    pub fn groups(&self) -> Vec<Vec<GenerateRequest>> {
        let one = [None];
        let prompts: Vec<Option<&PromptInput>> = match self.prompts.is_empty() {
            true => one.to_vec(),
            false => self.prompts.iter().map(Some).collect(),
        };
        prompts
            .into_iter()
            .map(|p| {
                let mut r = self.request.clone();
                if let Some(p) = p {
                    set_prompt(&mut r, p);
                }
                if self.best_of > self.n && r.top_logprobs.is_none() {
                    r.top_logprobs = Some(0).into();
                }
                vec![r; self.best_of as usize]
            })
            .collect()
    }
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
    /// The choice's index.
    pub index: u32,
    /// Completions' `echo`: the prompt's text, sent before the completion.
    pub echo: Option<String>,
    /// The declared tools' names. With some, the answer is parsed for calls to them: a stream
    /// sends text as soon as it cannot belong to a call ([`streamable`]) and holds the rest
    /// (`held`) until the end, when it is sent as content or as `tool_calls` deltas; none: the
    /// answer is only text.
    pub tools: Vec<String>,
    held: String,
    /// Whether some of the answer was already streamed as text (a whole-answer call is then
    /// no longer possible).
    sent_text: bool,
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
            index: 0,
            echo: None,
            tools: if parsed.tools {
                crate::tools::declared_names(&parsed.request)
            } else {
                Vec::new()
            },
            held: String::new(),
            sent_text: false,
        }
    }

    /// The same response's choice `index`, echoing `echo` first.
    pub fn choice_meta(&self, index: u32, echo: Option<String>) -> Self {
        Self {
            index,
            echo,
            streamed: 0,
            held: String::new(),
            sent_text: false,
            ..self.clone()
        }
    }

    /// The chunk that ends this choice.
    pub fn finish_frame(&self, summary: &GenerateSummary) -> String {
        let text = (self.endpoint == Endpoint::Completions).then_some("");
        sse(
            None,
            &self.chunk(
                text,
                false,
                Some(summary.finish),
                self.usage_null(),
                Value::Null,
            ),
        )
    }

    /// The frames that end the stream: the usage chunk (when asked for) and `[DONE]`.
    pub fn end_frames(&self, usage: Value) -> Vec<String> {
        let mut frames = Vec::new();
        if self.include_usage {
            frames.push(sse(
                None,
                &self.chunk(None, false, None, Some(usage), Value::Null),
            ));
        }
        frames.push(SSE_DONE.to_string());
        frames
    }

    /// This choice as a whole response's `choices` entry.
    pub fn choice(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value {
        let finish = finish_reason(summary.finish);
        let text = self.echo.clone().unwrap_or_default() + &reply::text(pieces);
        let logprobs = match (self.logprobs, self.endpoint) {
            (false, _) => Value::Null,
            (true, Endpoint::Chat) => json!({
                "content": pieces.iter().filter_map(chat_logprob).collect::<Vec<_>>(),
                "refusal": null,
            }),
            (true, Endpoint::Completions) => completion_logprobs(pieces, 0),
        };
        match self.endpoint {
            Endpoint::Chat => {
                let (content, calls) = self.calls(text);
                let mut message = json!({"role": "assistant", "content": content, "refusal": null});
                let finish = match calls.is_empty() {
                    true => finish,
                    false => {
                        message["tool_calls"] = Value::Array(calls);
                        "tool_calls"
                    }
                };
                json!({
                    "index": self.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
            Endpoint::Completions => json!({
                "index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
        }
    }

    /// The answer's content (`null` when it is only calls) and its calls as OpenAI's
    /// `tool_calls` entries, when tools are declared.
    fn calls(&self, text: String) -> (Value, Vec<Value>) {
        if self.tools.is_empty() {
            return (text.into(), Vec::new());
        }
        let (rest, calls) = parse_calls(&text, &self.tools);
        if calls.is_empty() {
            return (text.into(), Vec::new());
        }
        let calls = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "index": i,
                    "id": format!("call_{}_{i}", self.id),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_string()},
                })
            })
            .collect();
        let content = if rest.is_empty() {
            Value::Null
        } else {
            rest.into()
        };
        (content, calls)
    }

    /// The whole response around `choices`.
    pub fn envelope(&self, choices: Vec<Value>, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
            "usage": usage,
        })
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
                json!([{"index": self.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish}])
            }
            Endpoint::Completions => json!([{
                "index": self.index, "text": text.unwrap_or(""), "logprobs": logprobs,
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
        match (self.endpoint, &self.echo) {
            (Endpoint::Chat, _) => vec![sse(
                None,
                &self.chunk(Some(""), true, None, self.usage_null(), Value::Null),
            )],
            (Endpoint::Completions, Some(echo)) => vec![sse(
                None,
                &self.chunk(Some(echo), false, None, self.usage_null(), Value::Null),
            )],
            (Endpoint::Completions, None) => Vec::new(),
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
        if !self.tools.is_empty() {
            self.held.push_str(&piece.text);
            let ready = streamable(&self.held, !self.sent_text);
            if ready == 0 {
                return Vec::new();
            }
            let text: String = self.held.drain(..ready).collect();
            self.sent_text = true;
            let chunk = self.chunk(Some(&text), false, None, self.usage_null(), Value::Null);
            return vec![sse(None, &chunk)];
        }
        if piece.text.is_empty() && logprobs.is_null() {
            return Vec::new();
        }
        vec![sse(
            None,
            &self.chunk(Some(&piece.text), false, None, self.usage_null(), logprobs),
        )]
    }

    fn closing(&mut self, summary: &GenerateSummary) -> Vec<String> {
        let mut frames = Vec::new();
        if !self.tools.is_empty() {
            let held = std::mem::take(&mut self.held);
            let (content, calls) = self.calls(held);
            if let Value::String(t) = &content {
                let chunk = self.chunk(Some(t), false, None, self.usage_null(), Value::Null);
                frames.push(sse(None, &chunk));
            }
            if !calls.is_empty() {
                let mut chunk = self.chunk(None, false, None, self.usage_null(), Value::Null);
                chunk["choices"][0]["delta"]["tool_calls"] = Value::Array(calls);
                chunk["choices"][0]["finish_reason"] = "tool_calls".into();
                frames.push(sse(None, &chunk));
                frames.extend(self.end_frames(usage(summary)));
                return frames;
            }
        }
        frames.push(self.finish_frame(summary));
        frames.extend(self.end_frames(usage(summary)));
        frames
    }

    fn whole(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value {
        self.envelope(vec![self.choice(pieces, summary)], usage(summary))
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

    /// `response_format` in OpenAI's forms, llama.cpp's top-level `schema`, and the `regex` and
    /// `grammar` extensions, on both endpoints; malformed ones are a 400 naming the field.
    #[test]
    fn response_formats_become_constraints() {
        let chat =
            r#"{"model":"tiny","messages":[{"role":"user","content":"x"}],"response_format":"#;
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for (rf, want) in [
            (json!({"type": "text"}), Constraint::None),
            (
                json!({"type": "json_object"}),
                Constraint::JsonSchema(r#"{"type":"object"}"#.into()),
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}}),
                Constraint::JsonSchema(schema.to_string().into()),
            ),
            (
                json!({"type": "json_schema", "schema": schema}),
                Constraint::JsonSchema(schema.to_string().into()),
            ),
            (
                json!({"type": "json_object", "schema": schema}),
                Constraint::JsonSchema(schema.to_string().into()),
            ),
            (
                json!({"type": "regex", "regex": "[0-9]+"}),
                Constraint::Regex("[0-9]+".into()),
            ),
            (
                json!({"type": "grammar", "grammar": "start: \"a\""}),
                Constraint::Lark("start: \"a\"".into()),
            ),
        ] {
            let p = parsed(&format!("{chat}{rf}}}"), Endpoint::Chat);
            assert_eq!(p.request.constraint, want, "{rf}");
            let body = format!(r#"{{"model":"tiny","prompt":"x","response_format":{rf}}}"#);
            assert_eq!(
                parsed(&body, Endpoint::Completions).request.constraint,
                want
            );
        }
        for rf in [
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"name": "n"}}),
            json!({"type": "json_schema", "json_schema": {"schema": "not a schema"}}),
            json!({"type": "regex"}),
            json!({"type": "grammar", "grammar": 7}),
            json!({"type": "xml"}),
            json!("json_object"),
        ] {
            let e = err(Endpoint::Chat, &format!("{chat}{rf}}}"));
            assert_eq!(e.status, 400, "{rf}");
            assert!(e.message.contains("response_format"), "{rf}: {e:?}");
        }
    }

    /// OpenAI's chat and completions parameters that this server does not implement, each with
    /// a value that would change the answer: refused with a 400 naming the field.
    #[test]
    fn unsupported_parameters_are_refused_by_name() {
        let chat = r#"{"model":"tiny","messages":[{"role":"user","content":"x"}]"#;
        for (key, value) in [
            ("audio", r#"{"voice":"alloy","format":"wav"}"#),
            ("function_call", r#""auto""#),
            ("functions", r#"[{"name":"f"}]"#),
            ("modalities", r#"["text","audio"]"#),
            ("prediction", r#"{"type":"content","content":"x"}"#),
            ("reasoning_effort", r#""low""#),
            ("response_format", r#"{"type":"xml"}"#),
            ("service_tier", r#""flex""#),
            ("store", "true"),
            ("verbosity", r#""low""#),
            ("web_search_options", "{}"),
            ("echo", "true"),
            ("best_of", "2"),
            ("suffix", r#""x""#),
            ("no_such_option", "1"),
        ] {
            let body = format!(r#"{chat},"{key}":{value}}}"#);
            let e = err(Endpoint::Chat, &body);
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(key)),
                "{key}: {e:?}"
            );
            assert!(e.message.contains(key), "{e:?}");
        }
        for (key, value) in [("messages", "[]"), ("top_logprobs", "2"), ("tools", "[]")] {
            let body = format!(r#"{{"model":"tiny","prompt":"x","{key}":{value}}}"#);
            let e = err(Endpoint::Completions, &body);
            assert_eq!((e.status, e.param.as_deref()), (400, Some(key)), "{e:?}");
        }
        // Defaults and nulls change nothing and are accepted.
        parsed(
            &format!(
                r#"{chat},"response_format":{{"type":"text"}},"store":false,"service_tier":"auto",
                "tool_choice":"none","modalities":["text"],"tools":null,"metadata":{{"a":"b"}}}}"#
            ),
            Endpoint::Chat,
        );
    }

    #[test]
    fn tools_render_into_the_prompt_constrain_calls_and_parse_back() {
        let base = r#"{"model":"tiny","messages":[{"role":"system","content":"Be brief."},
            {"role":"user","content":"Weather?"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
              "function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"sunny"}],
            "tools":[{"type":"function","function":{"name":"get_weather","parameters":"#;
        let good = r#"{"type":"object","properties":{"city":{"type":"string"}}}}}]"#;
        let p = parsed(
            &format!(r#"{base}{good},"tool_choice":"required"}}"#),
            Endpoint::Chat,
        );
        let m = &p.request.messages;
        assert!(m[0].content == "Be brief." && m.len() == 4);
        let declared: Value = serde_json::from_str(&p.request.tools).unwrap();
        assert_eq!(declared[0]["type"], "function");
        assert_eq!(declared[0]["function"]["name"], "get_weather");
        assert_eq!(
            declared[0]["function"]["parameters"]["properties"]["city"]["type"],
            "string"
        );
        assert!(
            m[2].content
                .contains(r#"{"name":"get_weather","arguments":{"city":"Oslo"}}"#)
        );
        assert_eq!(m[3].role.as_str(), "user");
        assert!(matches!(&p.request.constraint, Constraint::Lark(g) if g.contains("%json")));
        let auto = parsed(&format!("{base}{good}}}"), Endpoint::Chat);
        assert_eq!(auto.request.constraint, Constraint::None);
        let none = parsed(
            &format!(r#"{base}{good},"tool_choice":"none"}}"#),
            Endpoint::Chat,
        );
        assert!(!none.tools && none.request.tools.is_empty());
        for (schema, extra) in [
            (r#""object"}}]"#, ""),
            (r#"{"type":"array"}}}]"#, ""),
            (r#"{"required":"city"}}}]"#, ""),
            (
                good,
                r#","tool_choice":{"type":"function","function":{"name":"nope"}}"#,
            ),
            (good, r#","tool_choice":"sometimes""#),
            (good, r#","n":2"#),
        ] {
            let e = err(Endpoint::Chat, &format!("{base}{schema}{extra}}}"));
            assert_eq!(e.status, 400, "{schema}{extra}: {e:?}");
        }
        let meta = Meta::new(Endpoint::Chat, &p);
        let text = "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\"}}\n</tool_call>";
        let (content, calls) = meta.calls(text.into());
        assert_eq!(content, Value::Null);
        assert_eq!(calls[0]["function"]["arguments"], r#"{"city":"Rome"}"#);
    }

    #[test]
    fn completions_take_batches_token_ids_n_best_of_echo_and_logit_bias() {
        let p = parsed(
            r#"{"model":"tiny","prompt":["a",[1,2,3]],"n":2,"best_of":3,"echo":true,
                "logit_bias":{"5":-100,"7":2.5},"max_tokens":4}"#,
            Endpoint::Completions,
        );
        assert_eq!(
            p.prompts,
            [
                PromptInput::Text("a".into()),
                PromptInput::Tokens(vec![1, 2, 3])
            ]
        );
        assert!(!p.is_single() && p.echo && (p.n, p.best_of) == (2, 3));
        assert!(!p.request.clamp_max_tokens);
        let groups = p.groups();
        assert_eq!((groups.len(), groups[0].len()), (2, 3));
        assert_eq!(groups[1][0].prompt_tokens.as_slice(), [1, 2, 3]);
        assert_eq!(groups[0][0].top_logprobs.into_option(), Some(0), "ranked");
        let bias: Vec<(u32, f32)> = p
            .request
            .logit_bias
            .iter()
            .map(|b| (b.id, b.bias))
            .collect();
        assert_eq!(bias, [(5, -100.0), (7, 2.5)]);
        assert!(!p.request.ignore_eos);
        let p = parsed(
            r#"{"model":"tiny","prompt":"a","ignore_eos":true}"#,
            Endpoint::Completions,
        );
        assert!(p.request.ignore_eos, "vLLM's and llama-server's ignore_eos");
        let p = parsed(r#"{"model":"tiny","prompt":[7,8]}"#, Endpoint::Completions);
        assert!(p.is_single() && p.request.clamp_max_tokens);
        assert_eq!(p.request.prompt_tokens.as_slice(), [7, 8]);
        for (body, param) in [
            (
                r#"{"model":"tiny","prompt":"x","n":2,"best_of":1}"#,
                "best_of",
            ),
            (
                r#"{"model":"tiny","prompt":"x","best_of":2,"stream":true}"#,
                "best_of",
            ),
            (
                r#"{"model":"tiny","prompt":"x","echo":true,"logprobs":1}"#,
                "echo",
            ),
            (
                r#"{"model":"tiny","prompt":"x","logit_bias":{"a":1}}"#,
                "logit_bias",
            ),
            (
                r#"{"model":"tiny","prompt":"x","logit_bias":{"1":101}}"#,
                "logit_bias",
            ),
            (r#"{"model":"tiny","prompt":[[1],"x",3]}"#, "prompt"),
            (r#"{"model":"tiny","prompt":[-1]}"#, "prompt"),
            (r#"{"model":"tiny","prompt":"x","n":129}"#, "n"),
            (
                r#"{"model":"tiny","prompt":["x","y"],"save_as":"c"}"#,
                "save_as",
            ),
        ] {
            let e = err(Endpoint::Completions, body);
            assert_eq!(
                (e.status, e.param.as_deref()),
                (400, Some(param)),
                "{body}: {e:?}"
            );
        }
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
            draft_tokens: 0,
            accepted_tokens: 0,
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
