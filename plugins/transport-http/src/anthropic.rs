//! The Anthropic Messages API: `POST /v1/messages`, answered as Anthropic does (a `message`
//! object, or the `message_start` … `message_stop` event stream), with prompt caching.
//!
//! Prompt caching: every text block of `system` or of a message may carry
//! `"cache_control": {"type": "ephemeral"}`. Each such block becomes a cache breakpoint
//! ([`CacheBreakpoint`]): the KV of the prompt up to the end of that block is kept, and a later
//! request that starts the same way prefills only what follows. Unlike Anthropic's API, any
//! number of breakpoints is accepted, and a top-level `cache_control` marks the end of the
//! last message. `usage` reports them as Anthropic does:
//! `cache_read_input_tokens` (prompt tokens whose KV came from the cache),
//! `cache_creation_input_tokens` (tokens newly stored at breakpoints) and `input_tokens` (the
//! rest). In a stream the final `message_delta` carries the complete `usage`; the counts in
//! `message_start` are zero because the stream starts before they are known.
//!
//! Structured outputs: `output_format: {"type": "json_schema", "schema": …}` (Anthropic's
//! structured-outputs form) holds the answer to the schema.
//!
//! Tool calling: `tools` and `tool_choice` as [`crate::tools`] describes; `tool_use` and
//! `tool_result` blocks in the history are written into the turns' text, and the answer's calls
//! come back as `tool_use` blocks (streamed as `input_json_delta`s once the answer is complete).

use crate::{
    bridge::Piece,
    error::{ApiError, Dialect},
    images,
    json::{self, Obj, type_name},
    openai,
    reply::{self, Reply, sse},
    tools::{self, Choice, Tools},
};
use serde_json::{Value, json};
use u_chat_template::tools::{Tool, ToolCall, parse_calls, render_call, streamable};
use u_sdk::{
    CacheBreakpoint, ChatImage, ChatTurn, Constraint, FinishReason, GenerateRequest,
    GenerateSummary,
};

/// A parsed `/v1/messages` request.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The engine request.
    pub request: GenerateRequest,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// Tools are declared: the answer's `<tool_call>` blocks become `tool_use` blocks.
    pub tools: bool,
}

/// A `content`: its text, the byte offsets at which blocks with `cache_control` end, and its
/// images, each at the offset of the text before it.
struct Content {
    text: String,
    marks: Vec<u32>,
    images: Vec<ChatImage>,
}

/// Concatenates a `content` (a string or blocks: text, images, tool uses and results).
fn blocks(v: &Value, at: &str) -> Result<Content, ApiError> {
    match v {
        Value::String(s) => Ok(Content {
            text: s.clone(),
            marks: Vec::new(),
            images: Vec::new(),
        }),
        Value::Array(list) => {
            let (mut text, mut marks, mut images) = (String::new(), Vec::new(), Vec::new());
            for (i, b) in list.iter().enumerate() {
                let at = format!("{at}[{i}]");
                let Value::Object(b) = b else {
                    return Err(ApiError::param(&at, format!("`{at}` must be an object")));
                };
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {}
                    Some("image") => {
                        let data = images::anthropic_block(b, &at)?;
                        let offset = u32::try_from(text.len()).map_err(|_| {
                            ApiError::param(&at, "an image stands past 4 GiB of text")
                        })?;
                        images.push(ChatImage {
                            data: data.into(),
                            offset,
                        });
                        continue;
                    }
                    Some("tool_use") => {
                        let call = ToolCall {
                            name: tools::name(b.get("name"), &format!("{at}.name"))?,
                            arguments: match b.get("input") {
                                Some(i @ Value::Object(_)) => i.clone(),
                                _ => {
                                    return Err(ApiError::param(
                                        &at,
                                        format!("`{at}.input` must be an object"),
                                    ));
                                }
                            },
                        };
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(&render_call(&call));
                        continue;
                    }
                    Some("tool_result") => {
                        let result = match b.get("content") {
                            None | Some(Value::Null) => String::new(),
                            Some(c) => {
                                let c = blocks(c, &format!("{at}.content"))?;
                                if !c.images.is_empty() {
                                    return Err(ApiError::param(
                                        &at,
                                        "images in a tool result are not supported",
                                    ));
                                }
                                c.text
                            }
                        };
                        if !text.is_empty() {
                            text.push('\n');
                        }
                        text.push_str(tools::response_turn(&result).content.as_str());
                        continue;
                    }
                    Some(other) => {
                        return Err(ApiError::param(
                            &at,
                            format!("content blocks of type `{other}` are not supported"),
                        ));
                    }
                    None => {
                        return Err(ApiError::param(&at, format!("`{at}.type` is required")));
                    }
                }
                text.push_str(&json::required_string(b, "text").map_err(|e| ApiError {
                    param: Some(format!("{at}.text")),
                    ..e
                })?);
                match b.get("cache_control") {
                    None | Some(Value::Null) => {}
                    Some(Value::Object(c)) if c.get("type") == Some(&json!("ephemeral")) => {
                        let offset = u32::try_from(text.len()).map_err(|_| {
                            ApiError::param(&at, "a cached block ends past 4 GiB of text")
                        })?;
                        marks.push(offset);
                    }
                    Some(_) => {
                        return Err(ApiError::param(
                            &format!("{at}.cache_control"),
                            "`cache_control` must be {\"type\": \"ephemeral\"}",
                        ));
                    }
                }
            }
            Ok(Content {
                text,
                marks,
                images,
            })
        }
        other => Err(ApiError::param(
            at,
            format!(
                "`{at}` must be a string or an array of content blocks, got {}",
                type_name(other)
            ),
        )),
    }
}

/// The fields `/v1/messages` takes: Anthropic's that this server implements, its top-level
/// `cache_control`, and the sampling extensions OpenAI-style servers accept.
const SUPPORTED: [&str; 22] = [
    "model",
    "lora",
    "control_vectors",
    "soft_prompt",
    "tools",
    "tool_choice",
    "output_format",
    "messages",
    "max_tokens",
    "metadata",
    "stop_sequences",
    "stream",
    "system",
    "temperature",
    "top_k",
    "top_p",
    "cache_control",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
];

/// Refuses every field this server does not implement (`thinking`,
/// `mcp_servers`, `container`, …), naming it; values that change nothing (`thinking`
/// disabled, `service_tier` `auto`) and `null`s are accepted.
fn refuse_unsupported(o: &Obj, supported: &[&str]) -> Result<(), ApiError> {
    for (key, v) in o {
        let harmless = match key.as_str() {
            "thinking" => v.get("type") == Some(&json!("disabled")),
            "service_tier" => matches!(v.as_str(), Some("auto" | "standard_only")),
            _ => false,
        };
        if v.is_null() || harmless || supported.contains(&key.as_str()) {
            continue;
        }
        return Err(ApiError::param(
            key,
            format!("`{key}` is not supported by this server"),
        ));
    }
    Ok(())
}

/// A parsed `/v1/messages/count_tokens` body.
#[derive(Debug, Clone)]
pub struct Count {
    /// The model name.
    pub model: String,
    /// The conversation, as a generation would render it.
    pub messages: Vec<ChatTurn>,
    /// Whether the last message is an assistant prefill (continued, not a new turn).
    pub continue_final: bool,
}

/// Parses a `/v1/messages/count_tokens` body: a messages request without `max_tokens`.
pub fn parse_count(body: &[u8], models: &[String]) -> Result<Count, ApiError> {
    let o: Obj = json::object(body)?;
    refuse_unsupported(&o, &["model", "messages", "system", "cache_control"])?;
    let model = json::required_string(&o, "model")?;
    let (turns, _) = conversation(&o)?;
    if !u_sdk::serves(models, &model) {
        return Err(ApiError::model_not_found(&model));
    }
    Ok(Count {
        model,
        continue_final: prefilled(&turns),
        messages: turns,
    })
}

/// Whether the conversation ends with an assistant message, which the model continues.
fn prefilled(turns: &[ChatTurn]) -> bool {
    turns.last().is_some_and(|t| t.role.as_str() == "assistant")
}

/// Parses a `/v1/messages` body. `models` are the names the engine serves.
pub fn parse(body: &[u8], models: &[String]) -> Result<Parsed, ApiError> {
    let o: Obj = json::object(body)?;
    refuse_unsupported(&o, &SUPPORTED)?;
    let model = json::required_string(&o, "model")?;
    let max_tokens = json::max_tokens(&o, &["max_tokens"], None)?;
    let (turns, breakpoints) = conversation(&o)?;
    let sampling = openai::sampling(&o, 1.0)?;
    let stop = json::strings(&o, "stop_sequences")?;
    let stream = json::boolean(&o, "stream")?;
    // Anthropic's `metadata.user_id`: the fair-queueing key when given.
    let user = match json::nested(&o, "metadata")? {
        Some(m) => json::string(m, "user_id")?,
        None => None,
    };
    if !u_sdk::serves(models, &model) {
        return Err(ApiError::model_not_found(&model));
    }
    let mut request = GenerateRequest::new(&model, "", max_tokens, sampling);
    request.continue_final = prefilled(&turns);
    request.messages = turns.into();
    request.stop = stop.into_iter().map(Into::into).collect();
    request.cache_breakpoints = breakpoints.into();
    request.client = user.map(|u| format!("user:{u}")).unwrap_or_default().into();
    request.clamp_max_tokens = false;
    request.constraint = output_format(&o)?;
    request.adapters = json::adapters(&o, "lora")?.into();
    request.control_vectors = json::control_vectors(&o, "control_vectors")?.into();
    request.soft_prompt = json::string(&o, "soft_prompt")?.unwrap_or_default().into();
    let tools = anthropic_tools(&o)?;
    if let Some(t) = &tools {
        t.apply(&mut request)?;
    }
    Ok(Parsed {
        request,
        stream,
        tools: tools.is_some(),
    })
}

/// Anthropic's `tools` (`name`, `description`, `input_schema`) and `tool_choice` (`auto`,
/// `any`, `tool` with a `name`, `none`; `disable_parallel_tool_use`).
fn anthropic_tools(o: &Obj) -> Result<Option<Tools>, ApiError> {
    let list = match o.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(ApiError::param(
                "tools",
                format!("`tools` must be an array, got {}", type_name(other)),
            ));
        }
    };
    let mut declared = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let at = format!("tools[{i}]");
        if let Some(kind) = t.get("type").and_then(Value::as_str)
            && kind != "custom"
        {
            return Err(ApiError::param(
                &at,
                format!("server tools of type `{kind}` are not supported by this server"),
            ));
        }
        let description = match t.get("description") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(d)) => d.clone(),
            Some(_) => {
                return Err(ApiError::param(
                    &at,
                    format!("`{at}.description` must be a string"),
                ));
            }
        };
        if t.get("input_schema").is_none_or(Value::is_null) {
            return Err(ApiError::param(
                &at,
                format!("`{at}.input_schema` is required"),
            ));
        }
        declared.push(Tool {
            name: tools::name(t.get("name"), &format!("{at}.name"))?,
            description,
            parameters: tools::parameters(t.get("input_schema"), &format!("{at}.input_schema"))?,
        });
    }
    let tc = json::nested(o, "tool_choice")?;
    let parallel = match tc {
        Some(c) => !json::boolean(c, "disable_parallel_tool_use")?,
        None => true,
    };
    let choice = match tc.map(|c| (c.get("type").and_then(Value::as_str), c)) {
        None | Some((Some("auto"), _)) => Choice::Auto,
        Some((Some("none"), _)) => return Ok(None),
        Some((Some("any"), _)) => Choice::Required,
        Some((Some("tool"), c)) => Choice::Named(tools::name(c.get("name"), "tool_choice.name")?),
        Some(_) => {
            return Err(ApiError::param(
                "tool_choice",
                "`tool_choice.type` must be `auto`, `any`, `tool` or `none`",
            ));
        }
    };
    if declared.is_empty() {
        return match choice {
            Choice::Auto => Ok(None),
            _ => Err(ApiError::param(
                "tool_choice",
                "`tool_choice` asks for a tool call, but `tools` declares none",
            )),
        };
    }
    tools::check_named(&declared, &choice)?;
    Ok(Some(Tools {
        tools: declared,
        choice,
        parallel,
    }))
}

/// `output_format`: a JSON schema the answer must follow.
fn output_format(o: &Obj) -> Result<Constraint, ApiError> {
    let Some(f) = json::nested(o, "output_format")? else {
        return Ok(Constraint::None);
    };
    match (f.get("type").and_then(Value::as_str), f.get("schema")) {
        (Some("json_schema"), Some(s @ (Value::Object(_) | Value::Bool(_)))) => {
            Ok(Constraint::JsonSchema(s.to_string().into()))
        }
        _ => Err(ApiError::param(
            "output_format",
            "`output_format` must be `{\"type\": \"json_schema\", \"schema\": {…}}`",
        )),
    }
}

/// `system` and `messages` as chat turns, with the cache breakpoints their blocks mark.
fn conversation(o: &Obj) -> Result<(Vec<ChatTurn>, Vec<CacheBreakpoint>), ApiError> {
    let mut turns = Vec::new();
    let mut breakpoints = Vec::new();
    if let Some(system) = o.get("system").filter(|v| !v.is_null()) {
        let Content {
            text,
            marks,
            images,
        } = blocks(system, "system")?;
        if !images.is_empty() {
            return Err(ApiError::param(
                "system",
                "images are read in user messages, not in the system prompt",
            ));
        }
        breakpoints.extend(
            marks
                .into_iter()
                .map(|offset| CacheBreakpoint { turn: 0, offset }),
        );
        turns.push(ChatTurn::text("system", &text));
    }
    let list = json::nonempty_array(o, "messages")?;
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(ApiError::param(&at, format!("`{at}` must be an object")));
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            _ => {
                return Err(ApiError::param(
                    &at,
                    format!("`{at}.role` must be `user` or `assistant`"),
                ));
            }
        };
        let content = m
            .get("content")
            .ok_or_else(|| ApiError::param(&at, format!("`{at}.content` is required")))?;
        let Content {
            text,
            marks,
            images,
        } = blocks(content, &format!("{at}.content"))?;
        if !images.is_empty() && role != "user" {
            return Err(ApiError::param(
                &at,
                "images are read in user messages, not in an assistant message",
            ));
        }
        let turn = turns.len() as u32;
        breakpoints.extend(
            marks
                .into_iter()
                .map(|offset| CacheBreakpoint { turn, offset }),
        );
        turns.push(ChatTurn {
            role: role.into(),
            content: text.into(),
            images: images.into(),
        });
    }
    // A top-level `cache_control` caches the whole conversation as sent.
    match o.get("cache_control") {
        None | Some(Value::Null) => {}
        Some(Value::Object(c)) if c.get("type") == Some(&json!("ephemeral")) => {
            if let Some(last) = turns.last() {
                breakpoints.push(CacheBreakpoint {
                    turn: turns.len() as u32 - 1,
                    offset: last.content.len() as u32,
                });
            }
        }
        Some(_) => {
            return Err(ApiError::param(
                "cache_control",
                "`cache_control` must be {\"type\": \"ephemeral\"}",
            ));
        }
    }
    Ok((turns, breakpoints))
}

/// Anthropic's `stop_reason`.
fn stop_reason(s: &GenerateSummary) -> &'static str {
    match (s.finish, s.stop_sequence.is_some()) {
        (FinishReason::Length, _) => "max_tokens",
        (FinishReason::Stop, true) => "stop_sequence",
        (FinishReason::Stop | FinishReason::Cancelled, _) => "end_turn",
    }
}

/// Anthropic's `usage`: uncached input, cache writes and cache reads add up to the prompt.
pub fn usage(s: &GenerateSummary) -> Value {
    let input = s
        .prompt_tokens
        .saturating_sub(s.cached_tokens)
        .saturating_sub(s.cache_written_tokens);
    json!({
        "input_tokens": input,
        "output_tokens": s.generated_tokens,
        "cache_creation_input_tokens": s.cache_written_tokens,
        "cache_read_input_tokens": s.cached_tokens,
    })
}

/// One `/v1/messages` response.
#[derive(Debug, Clone)]
pub struct Message {
    id: String,
    model: String,
    /// The declared tools' names; none: the answer is only text. With some, a stream sends
    /// text as soon as it cannot belong to a call ([`streamable`]) and holds the rest.
    tools: Vec<String>,
    held: String,
    /// Whether the stream has opened its text block (with tools declared, at the first text
    /// that is sent).
    text_open: bool,
}

impl Message {
    /// A fresh message identity for `model`.
    pub fn new(model: &str) -> Self {
        Self {
            id: reply::response_id("msg_").0,
            model: model.to_string(),
            tools: Vec::new(),
            held: String::new(),
            text_open: false,
        }
    }

    /// The same, answering a request that declares `tools` (their names): its calls become
    /// `tool_use` blocks, and a stream holds back what may be a call until the end.
    pub fn with_tools(self, tools: Vec<String>) -> Self {
        Self { tools, ..self }
    }

    /// The answer's text and its calls as `tool_use` blocks (none without tools).
    fn content(&self, text: String) -> (String, Vec<Value>) {
        if self.tools.is_empty() {
            return (text, Vec::new());
        }
        let (rest, calls) = parse_calls(&text, &self.tools);
        if calls.is_empty() {
            return (text, Vec::new());
        }
        let uses = calls
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"type": "tool_use", "id": format!("toolu_{}_{i}", self.id),
                    "name": c.name, "input": c.arguments})
            })
            .collect();
        (rest, uses)
    }

    fn object(&self, content: Value, summary: Option<&GenerateSummary>) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": summary.map(stop_reason),
            "stop_sequence": summary.and_then(|s| s.stop_sequence.as_ref().map(|s| s.to_string()).into_option()),
            "usage": match summary {
                Some(s) => usage(s),
                None => json!({"input_tokens": 0, "output_tokens": 0,
                    "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}),
            },
        })
    }
}

impl Reply for Message {
    fn dialect(&self) -> Dialect {
        Dialect::Anthropic
    }

    fn opening(&mut self) -> Vec<String> {
        let start = sse(
            Some("message_start"),
            &json!({"type": "message_start", "message": self.object(json!([]), None)}),
        );
        let ping = sse(Some("ping"), &json!({"type": "ping"}));
        if !self.tools.is_empty() {
            return vec![start, ping];
        }
        vec![start, text_start(), ping]
    }

    fn piece(&mut self, piece: &Piece) -> Vec<String> {
        if !self.tools.is_empty() {
            self.held.push_str(&piece.text);
            let ready = streamable(&self.held, !self.text_open);
            if ready == 0 {
                return Vec::new();
            }
            let text: String = self.held.drain(..ready).collect();
            let mut frames = Vec::new();
            if !self.text_open {
                frames.push(text_start());
                self.text_open = true;
            }
            frames.push(sse(
                Some("content_block_delta"),
                &json!({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}}),
            ));
            return frames;
        }
        if piece.text.is_empty() {
            return Vec::new();
        }
        vec![sse(
            Some("content_block_delta"),
            &json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": piece.text}}),
        )]
    }

    fn closing(&mut self, summary: &GenerateSummary) -> Vec<String> {
        let mut frames = Vec::new();
        let mut stop = stop_reason(summary);
        if !self.tools.is_empty() {
            let held = std::mem::take(&mut self.held);
            let (text, uses) = self.content(held);
            let mut index = 0;
            if self.text_open || !text.is_empty() || uses.is_empty() {
                if !self.text_open {
                    frames.push(text_start());
                }
                frames.push(sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": 0,
                        "delta": {"type": "text_delta", "text": text}}),
                ));
                frames.push(block_stop(0));
                index = 1;
            }
            for u in &uses {
                let mut block = u.clone();
                block["input"] = json!({});
                frames.push(sse(
                    Some("content_block_start"),
                    &json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                frames.push(sse(
                    Some("content_block_delta"),
                    &json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": u["input"].to_string()}}),
                ));
                frames.push(block_stop(index));
                index += 1;
            }
            if !uses.is_empty() {
                stop = "tool_use";
            }
        } else {
            frames.push(block_stop(0));
        }
        frames.extend([
            sse(
                Some("message_delta"),
                &json!({"type": "message_delta",
                    "delta": {"stop_reason": stop,
                        "stop_sequence": summary.stop_sequence.as_ref().map(|s| s.to_string()).into_option()},
                    "usage": usage(summary)}),
            ),
            sse(Some("message_stop"), &json!({"type": "message_stop"})),
        ]);
        frames
    }

    fn error(&self, e: &ApiError) -> String {
        sse(Some("error"), &e.body(Dialect::Anthropic))
    }

    fn whole(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value {
        let (text, uses) = self.content(reply::text(pieces));
        let mut content = Vec::new();
        if !text.is_empty() || uses.is_empty() {
            content.push(json!({"type": "text", "text": text}));
        }
        let used = !uses.is_empty();
        content.extend(uses);
        let mut v = self.object(Value::Array(content), Some(summary));
        if used {
            v["stop_reason"] = "tool_use".into();
        }
        v
    }
}

/// The start of a stream's text block, index 0.
fn text_start() -> String {
    sse(
        Some("content_block_start"),
        &json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}}),
    )
}

/// The end of content block `index`.
fn block_stop(index: usize) -> String {
    sse(
        Some("content_block_stop"),
        &json!({"type": "content_block_stop", "index": index}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["tiny".into()]
    }

    fn err(body: &str) -> ApiError {
        parse(body.as_bytes(), &models()).unwrap_err()
    }

    #[test]
    fn cache_control_blocks_become_breakpoints() {
        let p = parse(
            br#"{"model":"tiny","max_tokens":8,
                "system":[{"type":"text","text":"You are terse.","cache_control":{"type":"ephemeral"}}],
                "messages":[
                  {"role":"user","content":[
                    {"type":"text","text":"Doc A. ","cache_control":{"type":"ephemeral"}},
                    {"type":"text","text":"Doc B. ","cache_control":{"type":"ephemeral","ttl":"1h"}},
                    {"type":"text","text":"Question?"}]},
                  {"role":"assistant","content":"Answer."},
                  {"role":"user","content":"More?"}],
                "stop_sequences":["\n\n"],"temperature":0.5,"top_k":4,"stream":true,
                "cache_control":{"type":"ephemeral"}}"#,
            &models(),
        )
        .unwrap();
        let r = &p.request;
        assert!(p.stream);
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.messages[1].content.as_str(), "Doc A. Doc B. Question?");
        let b: Vec<(u32, u32)> = r
            .cache_breakpoints
            .iter()
            .map(|b| (b.turn, b.offset))
            .collect();
        assert_eq!(b, vec![(0, 14), (1, 7), (1, 14), (3, 5)]);
        assert_eq!(r.sampling.top_k, 4);
        assert_eq!(r.stop[0].as_str(), "\n\n");
    }

    #[test]
    fn metadata_user_id_is_the_fair_queueing_key() {
        let body = br#"{"model":"tiny","max_tokens":8,"metadata":{"user_id":"u1"},
            "messages":[{"role":"user","content":"x"}]}"#;
        let p = parse(body, &["tiny".to_string()]).unwrap();
        assert_eq!(p.request.client.as_str(), "user:u1");
        let e = err(r#"{"model":"tiny","max_tokens":8,"metadata":"u1",
            "messages":[{"role":"user","content":"x"}]}"#);
        assert_eq!((e.status, e.param.as_deref()), (400, Some("metadata")));
    }

    #[test]
    fn bad_requests_are_refused_with_anthropic_errors() {
        let e = err(r#"{"model":"tiny","messages":[{"role":"user","content":"x"}]}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e =
            err(r#"{"model":"tiny","max_tokens":4,"messages":[{"role":"system","content":"x"}]}"#);
        assert!(e.message.contains("user"), "{e:?}");
        let e = err(
            r#"{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":[{"type":"image"}]}]}"#,
        );
        assert!(
            e.message.contains("source"),
            "an image block without its data: {e:?}"
        );
        let e = err(
            r#"{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":[{"type":"document"}]}]}"#,
        );
        assert!(e.message.contains("`document` are not supported"), "{e:?}");
        let e = err(
            r#"{"model":"tiny","max_tokens":4,"temperature":1.5,"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = err(
            r#"{"model":"tiny","max_tokens":4,"tools":[{}],"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!(e.param.as_deref(), Some("tools[0]"));
        let e =
            err(r#"{"model":"nope","max_tokens":4,"messages":[{"role":"user","content":"x"}]}"#);
        assert_eq!(
            e.body(Dialect::Anthropic)["error"]["type"],
            "not_found_error"
        );
        let e = err(
            r#"{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":[{"type":"text","text":"x","cache_control":{"type":"forever"}}]}]}"#,
        );
        assert!(e.message.contains("ephemeral"), "{e:?}");
    }

    /// Anthropic's Messages parameters this server does not implement: a 400 naming each.
    #[test]
    fn unsupported_parameters_are_refused_by_name() {
        for (key, value) in [
            ("container", r#""c""#),
            ("context_management", "{}"),
            ("mcp_servers", "[]"),
            ("service_tier", r#""priority""#),
            ("thinking", r#"{"type":"enabled","budget_tokens":1024}"#),
            ("no_such_option", "1"),
        ] {
            let e = err(&format!(
                r#"{{"model":"tiny","max_tokens":4,"messages":[{{"role":"user","content":"x"}}],"{key}":{value}}}"#
            ));
            assert_eq!((e.status, e.param.as_deref()), (400, Some(key)), "{e:?}");
            assert_eq!(
                e.body(Dialect::Anthropic)["error"]["type"],
                "invalid_request_error"
            );
        }
        let ok = br#"{"model":"tiny","max_tokens":4,"thinking":{"type":"disabled"},
            "service_tier":"auto","tools":null,"messages":[{"role":"user","content":"x"}]}"#;
        parse(ok, &["tiny".to_string()]).unwrap();
    }

    #[test]
    fn tools_describe_themselves_constrain_calls_and_come_back_as_tool_use() {
        let base = r#"{"model":"tiny","max_tokens":4,"messages":[
            {"role":"user","content":"Weather?"},
            {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"get_weather","input":{"city":"Oslo"}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"sunny"}]}],
            "tools":[{"name":"get_weather","description":"Weather","input_schema":"#;
        let good = r#"{"type":"object","properties":{"city":{"type":"string"}}}}]"#;
        let p = parse(
            format!(r#"{base}{good},"tool_choice":{{"type":"tool","name":"get_weather"}}}}"#)
                .as_bytes(),
            &models(),
        )
        .unwrap();
        assert!(p.tools);
        let m = &p.request.messages;
        let declared: Value = serde_json::from_str(&p.request.tools).unwrap();
        assert_eq!(declared[0]["function"]["name"], "get_weather");
        assert_eq!(declared[0]["function"]["description"], "Weather");
        assert!(
            m[1].content
                .contains(r#"{"name":"get_weather","arguments":{"city":"Oslo"}}"#)
        );
        assert!(
            m[2].content
                .contains("<tool_response>\nsunny\n</tool_response>")
        );
        assert!(matches!(&p.request.constraint, Constraint::Lark(g) if g.contains("%json")));
        for (schema, choice) in [
            (r#""string"}]"#, "null"),
            (r#"{"type":"string"}}]"#, "null"),
            (r#"{"properties":[1]}}]"#, "null"),
            (good, r#"{"type":"tool","name":"other"}"#),
        ] {
            let e = err(&format!(r#"{base}{schema},"tool_choice":{choice}}}"#));
            assert_eq!(e.status, 400, "{schema} {choice}: {e:?}");
        }
        let reply = Message::new("tiny").with_tools(vec!["get_weather".into()]);
        let text = "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\"}}\n</tool_call>";
        let (rest, uses) = reply.content(text.into());
        assert_eq!(rest, "");
        assert_eq!(uses[0]["input"], json!({"city": "Rome"}));
        assert_eq!(uses[0]["type"], "tool_use");
    }

    #[test]
    fn output_format_is_a_json_schema_constraint() {
        let base = r#"{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"x"}],"output_format":"#;
        let p = parse(
            format!(r#"{base}{{"type":"json_schema","schema":{{"type":"object"}}}}}}"#).as_bytes(),
            &["tiny".to_string()],
        )
        .unwrap();
        assert_eq!(
            p.request.constraint,
            Constraint::JsonSchema(r#"{"type":"object"}"#.into())
        );
        for bad in [
            r#"{"type":"json_schema"}"#,
            r#"{"type":"xml","schema":{}}"#,
            "7",
        ] {
            let e = err(&format!("{base}{bad}}}"));
            assert_eq!((e.status, e.param.as_deref()), (400, Some("output_format")));
        }
    }

    #[test]
    fn a_final_assistant_message_is_continued() {
        let body = br#"{"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"x"},
            {"role":"assistant","content":"The answer is"}]}"#;
        let p = parse(body, &["tiny".to_string()]).unwrap();
        assert!(p.request.continue_final && !p.request.clamp_max_tokens);
        let c = parse_count(
            br#"{"model":"tiny","messages":[{"role":"user","content":"x"}]}"#,
            &["tiny".to_string()],
        )
        .unwrap();
        assert!(!c.continue_final && c.messages.len() == 1);
    }

    #[test]
    fn usage_splits_the_prompt_like_anthropic() {
        let s = GenerateSummary {
            prompt_tokens: 100,
            cached_tokens: 60,
            cache_written_tokens: 30,
            generated_tokens: 5,
            tokens: vec![1, 2, 3, 4, 5].into(),
            finish: FinishReason::Stop,
            stop_sequence: abi_stable::std_types::ROption::RSome("END".into()),
            prompt_ms: 1.0,
            generate_ms: 2.0,
            draft_tokens: 0,
            accepted_tokens: 0,
        };
        let u = usage(&s);
        assert_eq!(u["input_tokens"], 10);
        assert_eq!(u["cache_read_input_tokens"], 60);
        assert_eq!(u["cache_creation_input_tokens"], 30);
        let m = Message::new("tiny");
        let whole = m.whole(
            &[Piece {
                text: "ok".into(),
                ..Default::default()
            }],
            &s,
        );
        assert_eq!(whole["stop_reason"], "stop_sequence");
        assert_eq!(whole["stop_sequence"], "END");
        assert_eq!(whole["content"][0]["text"], "ok");
        let mut stream = Message::new("tiny");
        let open = stream.opening();
        assert!(open[0].starts_with("event: message_start\ndata: {"));
        let close = stream.closing(&s);
        assert!(close[2].starts_with("event: message_stop"));
    }
}
