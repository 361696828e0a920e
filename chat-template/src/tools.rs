//! Tool calling in the Hermes / Qwen2.5 format: the tools described to the model in a system
//! prompt, calls written by the model as `<tool_call>{"name": …, "arguments": …}</tool_call>`,
//! and a Lark grammar (llguidance's `%json` inside Lark) that lets the model write only such
//! calls, each naming a declared tool with arguments valid against that tool's schema.
//!
//! A template that takes `tools` (Qwen2.5's, Llama 3.1's, Hermes') renders them itself
//! ([`crate::render_chat`]); for one that ignores them, as SmolLM2's does, the tools are
//! described in the system prompt Qwen2.5's template writes ([`system_prompt`]), joined after
//! the conversation's own system message when there is one ([`described_in_system`]).

use serde::Serialize;
use serde_json::{Value, json};

/// One declared tool: a function with a JSON-schema `parameters` object.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Tool {
    /// The function's name.
    pub name: String,
    /// What it does, for the model.
    pub description: String,
    /// The JSON schema its arguments must match.
    pub parameters: Value,
}

/// One call the model wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object.
    pub arguments: Value,
}

/// The opening and closing tags around one call.
pub const OPEN: &str = "<tool_call>";
/// See [`OPEN`].
pub const CLOSE: &str = "</tool_call>";

/// The system prompt that describes `tools` and the call format (Qwen2.5's wording).
pub fn system_prompt(tools: &[Tool]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&as_template_value(t).to_string());
    }
    s.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and \
         arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// A tool in the OpenAI shape chat templates are given (`{"type": "function", "function":
/// {name, description, parameters}}`, as transformers passes them).
pub fn as_template_value(t: &Tool) -> Value {
    json!({"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters}})
}

/// `tools` in OpenAI's shape (`[{"type": "function", "function": {…}}]`, or the bare
/// function objects), back as [`Tool`]s; `None` for anything else.
pub fn from_values(tools: &[Value]) -> Option<Vec<Tool>> {
    tools
        .iter()
        .map(|v| {
            let f = v.get("function").unwrap_or(v);
            Some(Tool {
                name: f.get("name")?.as_str()?.to_string(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                parameters: f
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            })
        })
        .collect()
}

/// `messages` with `tools` described in the system prompt: joined after the first message when
/// it is a system message, else as a new first message.
pub fn described_in_system(
    messages: &[crate::ChatMessage],
    tools: &[Tool],
) -> Vec<crate::ChatMessage> {
    let prompt = system_prompt(tools);
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{prompt}", first.content);
        }
        _ => out.insert(0, crate::ChatMessage::new("system", prompt)),
    }
    out
}

/// A call as the model writes it, for an assistant turn in the history.
pub fn render_call(call: &ToolCall) -> String {
    let name = Value::from(call.name.as_str());
    format!(
        "{OPEN}\n{{\"name\":{name},\"arguments\":{}}}\n{CLOSE}",
        call.arguments
    )
}

/// A Lark grammar (llguidance's dialect) for one call to `tools` (or one or more, with
/// `parallel`): each `<tool_call>` holds a compact JSON object whose `name` is one tool's and
/// whose `arguments` match that tool's `parameters`.
pub fn grammar(tools: &[Tool], parallel: bool) -> String {
    // Written out by hand so that `name` comes before `arguments`, as the model was taught.
    let any: Vec<String> = tools
        .iter()
        .map(|t| {
            format!(
                "{{\"type\":\"object\",\"properties\":{{\"name\":{{\"const\":{}}},\
                 \"arguments\":{}}},\"required\":[\"name\",\"arguments\"],\
                 \"additionalProperties\":false}}",
                Value::from(t.name.as_str()),
                t.parameters
            )
        })
        .collect();
    let schema = format!(
        "{{\"anyOf\":[{}],\"x-guidance\":{{\"whitespace_flexible\":false}}}}",
        any.join(",")
    );
    let more = if parallel { " (\"\\n\" call)*" } else { "" };
    format!("start: call{more}\ncall: \"{OPEN}\\n\" body \"\\n{CLOSE}\"\nbody: %json {schema}\n")
}

/// How many leading bytes of `text` — the answer so far, or what follows the part already sent
/// (`at_start` false) — can be streamed as plain text now: none of it can belong to a call in
/// a format [`parse_calls`] reads. An answer that may still turn out to be a whole-answer call
/// (it starts with `{`, `[`, `[TOOL_CALLS]` or `<|python_tag|>`) is held entirely; otherwise
/// text is held from a `<tool_call>` on, or from a trailing partial `<tool_call`.
pub fn streamable(text: &str, at_start: bool) -> usize {
    if at_start {
        let t = text.trim_start();
        let whole_call = |m: &str| t.starts_with(m) || m.starts_with(t);
        if t.is_empty()
            || t.starts_with(['{', '['])
            || ["[TOOL_CALLS]", "<|python_tag|>"]
                .iter()
                .any(|m| whole_call(m))
        {
            return 0;
        }
    }
    if let Some(at) = text.find(OPEN) {
        return at;
    }
    let partial = (1..OPEN.len())
        .rev()
        .find(|&n| text.ends_with(&OPEN[..n]))
        .unwrap_or(0);
    text.len() - partial
}

/// The calls in `text`, in whichever of the common formats a model's own template asked for,
/// with the text outside them:
/// - Hermes / Qwen2.5: every `<tool_call>` block whose body is a JSON object with a string
///   `name` and an object `arguments` (a JSON string of an object is taken too); a block that
///   does not parse is left in the text;
/// - Llama 3.1/3.2: the whole answer one JSON call object `{"name": …, "parameters": …}`
///   (optionally after `<|python_tag|>`), or several separated by `;`;
/// - Mistral: `[TOOL_CALLS]` followed by a JSON array of call objects, or (Mistral's later
///   templates) by `name[ARGS]{…}` per call.
///
/// The last two count only when every call names one of the `declared` tools (a JSON answer
/// that happens to have a `name` stays text).
pub fn parse_calls(text: &str, declared: &[String]) -> (String, Vec<ToolCall>) {
    if text.contains(OPEN) {
        return hermes_calls(text);
    }
    let trimmed = text.trim();
    let known = |calls: Vec<ToolCall>| {
        let all_declared = calls.iter().all(|c| declared.contains(&c.name));
        (!calls.is_empty() && all_declared).then_some(calls)
    };
    if let Some(rest) = trimmed.strip_prefix("[TOOL_CALLS]")
        && let Some(calls) = mistral_calls(rest.trim()).and_then(known)
    {
        return (String::new(), calls);
    }
    let body = trimmed
        .strip_prefix("<|python_tag|>")
        .unwrap_or(trimmed)
        .trim();
    if body.starts_with('{') {
        let calls: Option<Vec<ToolCall>> = body.split(';').map(|c| call(c.trim())).collect();
        if let Some(calls) = calls.and_then(known) {
            return (String::new(), calls);
        }
    }
    (trimmed.to_string(), Vec::new())
}

/// Mistral's calls after `[TOOL_CALLS]`: a JSON array of call objects, or `name[ARGS]{…}`
/// (each further call after another `[TOOL_CALLS]`).
fn mistral_calls(rest: &str) -> Option<Vec<ToolCall>> {
    if rest.starts_with('[') {
        let list: Vec<Value> = serde_json::from_str(rest).ok()?;
        return list.iter().map(|v| call(&v.to_string())).collect();
    }
    rest.split("[TOOL_CALLS]")
        .map(|one| {
            let (name, args) = one.trim().split_once("[ARGS]")?;
            let arguments: Value = serde_json::from_str(args.trim())
                .ok()
                .filter(Value::is_object)?;
            (!name.trim().is_empty()).then(|| ToolCall {
                name: name.trim().to_string(),
                arguments,
            })
        })
        .collect()
}

/// The Hermes `<tool_call>` blocks of `text` (see [`parse_calls`]).
fn hermes_calls(text: &str) -> (String, Vec<ToolCall>) {
    let (mut rest, mut calls, mut at) = (String::new(), Vec::new(), 0);
    while let Some(start) = text[at..].find(OPEN).map(|i| at + i) {
        let body_at = start + OPEN.len();
        let Some(end) = text[body_at..].find(CLOSE).map(|i| body_at + i) else {
            break;
        };
        rest.push_str(&text[at..start]);
        match call(text[body_at..end].trim()) {
            Some(c) => calls.push(c),
            None => rest.push_str(&text[start..end + CLOSE.len()]),
        }
        at = end + CLOSE.len();
    }
    rest.push_str(&text[at..]);
    (rest.trim().to_string(), calls)
}

fn call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).ok().filter(Value::is_object)?,
        Some(a @ Value::Object(_)) => a.clone(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tool {
        Tool {
            name: "get_weather".into(),
            description: "Weather in a city".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}),
        }
    }

    #[test]
    fn calls_parse_and_text_outside_stays() {
        let (rest, calls) = parse_calls(
            "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}</tool_call>",
            &[],
        );
        assert_eq!(rest, "Sure.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
        assert_eq!(calls[1].arguments, json!({"a": 1}));
        let (rest, calls) = parse_calls("<tool_call>not json</tool_call> and <tool_call>{", &[]);
        assert!(calls.is_empty());
        assert_eq!(rest, "<tool_call>not json</tool_call> and <tool_call>{");
    }

    /// Llama 3.x's bare JSON calls and Mistral's `[TOOL_CALLS]`, in both of its forms; text
    /// that only looks like them stays text.
    #[test]
    fn text_streams_up_to_where_a_call_could_begin() {
        assert_eq!(streamable("Hello there", true), 11);
        assert_eq!(streamable("Hello <tool_", true), 6);
        assert_eq!(streamable("Hi <tool_call>\n{", true), 3);
        for held in [
            " ",
            "{\"name\"",
            "[TOOL_",
            "[TOOL_CALLS]",
            "<|python",
            "<",
            "[1]",
        ] {
            assert_eq!(streamable(held, true), 0, "{held:?}");
        }
        // After text was sent, only a Hermes block can still start.
        assert_eq!(streamable("{not a call", false), 11);
        assert_eq!(streamable(" more <", false), 6);
    }

    #[test]
    fn llama_and_mistral_call_formats_parse() {
        let declared = vec!["get_weather".to_string(), "f".to_string()];
        let want = |calls: &[ToolCall]| {
            assert_eq!(calls.len(), 2, "{calls:?}");
            assert_eq!(calls[0].name, "get_weather");
            assert_eq!(calls[0].arguments, json!({"city": "Paris"}));
            assert_eq!(calls[1].name, "f");
            assert_eq!(calls[1].arguments, json!({}));
        };
        for text in [
            r#"{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}"#,
            r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}};{"name":"f"}"#,
            r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]"#,
            r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}"#,
        ] {
            let (rest, calls) = parse_calls(text, &declared);
            assert_eq!(rest, "", "{text}");
            want(&calls);
        }
        for text in [
            r#"{"answer": 42}"#,
            r#"{"name": "Alice", "age": 3}"#,
            r#"[TOOL_CALLS] [{"name": "undeclared", "arguments": {}}]"#,
            "The weather {is} nice",
            "[TOOL_CALLS] not json",
            "[TOOL_CALLS]f[ARGS]not json",
        ] {
            let (rest, calls) = parse_calls(text, &declared);
            assert!(calls.is_empty(), "{text}: {calls:?}");
            assert_eq!(rest, text.trim(), "{text}");
        }
    }

    #[test]
    fn a_rendered_call_parses_back_and_the_prompt_names_the_tools() {
        let c = ToolCall {
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo"}),
        };
        assert_eq!(parse_calls(&render_call(&c), &[]).1, vec![c]);
        let p = system_prompt(&[weather()]);
        assert!(p.contains("\"name\":\"get_weather\"") && p.contains("<tool_call>"));
        let g = grammar(&[weather()], true);
        assert!(
            g.contains("%json") && g.contains("\"const\":\"get_weather\""),
            "{g}"
        );
    }
}
