//! Tool calling over the OpenAI and Anthropic APIs, in the Hermes / Qwen2.5 format of
//! [`u_chat_template::tools`]: the declared tools go to the engine in the request
//! (`GenerateRequest::tools`), which renders them with the model's own chat template (or, for
//! a template without tools, in the system prompt); earlier calls are written back into
//! assistant turns as `<tool_call>` blocks and tool results sent as user turns in
//! `<tool_response>` tags, and the answer's `<tool_call>` blocks become the API's tool calls.
//!
//! `tool_choice` `required` or a named tool constrains generation to a Lark grammar of calls
//! whose arguments match the tool's schema, so they always parse; `auto` generates freely and
//! parses whatever calls the answer holds (a block that does not parse stays text); `none`
//! leaves the tools out of the prompt.

use crate::{
    error::ApiError,
    json::{Obj, type_name},
};
use serde_json::Value;
use u_chat_template::tools::{self, Tool};
use u_sdk::{ChatTurn, Constraint, GenerateRequest};

/// Which calls the request allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The model decides: text, calls or both.
    Auto,
    /// At least one call, to any tool.
    Required,
    /// A call to this tool.
    Named(String),
}

/// A request's tools and how they may be called.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The declared tools.
    pub tools: Vec<Tool>,
    /// `tool_choice`.
    pub choice: Choice,
    /// Several calls in one answer allowed (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// A tool's `parameters` checked for the shape of a JSON schema of an object (`type` object
/// when given, `properties` an object of schemas, `required` a list of names); a missing one is
/// an object with no properties.
pub fn parameters(v: Option<&Value>, at: &str) -> Result<Value, ApiError> {
    let bad = |msg: String| Err(ApiError::param(at, format!("`{at}` {msg}")));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(serde_json::json!({"type": "object", "properties": {}}));
    };
    let Value::Object(o) = v else {
        return bad(format!(
            "must be a JSON schema object, got {}",
            type_name(v)
        ));
    };
    if let Some(t) = o.get("type")
        && t != "object"
    {
        return bad(format!("must be a schema of `type` \"object\", got {t}"));
    }
    match o.get("properties") {
        None => {}
        Some(Value::Object(p)) => {
            if let Some((k, _)) = p.iter().find(|(_, s)| !(s.is_object() || s.is_boolean())) {
                return bad(format!("property `{k}` must be a schema (an object)"));
            }
        }
        Some(other) => {
            return bad(format!(
                "`properties` must be an object, got {}",
                type_name(other)
            ));
        }
    }
    match o.get("required") {
        None => {}
        Some(Value::Array(r)) if r.iter().all(Value::is_string) => {}
        Some(_) => return bad("`required` must be an array of property names".into()),
    }
    Ok(v.clone())
}

/// A tool name as OpenAI and Anthropic allow it: 1 to 64 of `a-zA-Z0-9_-`.
pub fn name(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v.and_then(Value::as_str) {
        Some(n)
            if (1..=64).contains(&n.len())
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
        {
            Ok(n.to_string())
        }
        _ => Err(ApiError::param(
            at,
            format!("`{at}` must be a name of 1 to 64 letters, digits, `_` or `-`"),
        )),
    }
}

/// OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`; `None` without tools or with
/// `tool_choice` `none`.
pub fn openai(o: &Obj) -> Result<Option<Tools>, ApiError> {
    let list = match o.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(a),
        Some(other) => {
            return Err(ApiError::param(
                "tools",
                format!("`tools` must be an array, got {}", type_name(other)),
            ));
        }
    };
    let mut declared = Vec::new();
    for (i, t) in list.into_iter().flatten().enumerate() {
        let at = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::param(
                &at,
                format!("`{at}.type` must be \"function\""),
            ));
        }
        let Some(Value::Object(f)) = t.get("function") else {
            return Err(ApiError::param(
                &at,
                format!("`{at}.function` must be an object"),
            ));
        };
        let description = match f.get("description") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(d)) => d.clone(),
            Some(_) => {
                return Err(ApiError::param(
                    &at,
                    format!("`{at}.function.description` must be a string"),
                ));
            }
        };
        declared.push(Tool {
            name: name(f.get("name"), &format!("{at}.function.name"))?,
            description,
            parameters: parameters(f.get("parameters"), &format!("{at}.function.parameters"))?,
        });
    }
    let parallel = match o.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::param(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ));
        }
    };
    let bad_choice = || {
        ApiError::param(
            "tool_choice",
            "`tool_choice` must be \"none\", \"auto\", \"required\" or \
             {\"type\": \"function\", \"function\": {\"name\": …}}",
        )
    };
    let choice = match o.get("tool_choice") {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            _ => return Err(bad_choice()),
        },
        Some(Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            let f = c.get("function").ok_or_else(bad_choice)?;
            Choice::Named(name(f.get("name"), "tool_choice.function.name")?)
        }
        Some(_) => return Err(bad_choice()),
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
    check_named(&declared, &choice)?;
    Ok(Some(Tools {
        tools: declared,
        choice,
        parallel,
    }))
}

/// Refuses a named choice that names no declared tool.
pub fn check_named(declared: &[Tool], choice: &Choice) -> Result<(), ApiError> {
    match choice {
        Choice::Named(n) if !declared.iter().any(|t| &t.name == n) => Err(ApiError::param(
            "tool_choice",
            format!("`tool_choice` names `{n}`, which `tools` does not declare"),
        )),
        _ => Ok(()),
    }
}

impl Tools {
    /// Declares the tools to the engine (which renders them with the model's chat template,
    /// or in the system prompt of one that ignores them) and, for `required` or a named tool,
    /// constrains the answer to calls; refused beside another constraint.
    pub fn apply(&self, request: &mut GenerateRequest) -> Result<(), ApiError> {
        let declared: Vec<Value> = self.tools.iter().map(tools::as_template_value).collect();
        request.tools = Value::from(declared).to_string().into();
        let callable: Vec<Tool> = match &self.choice {
            Choice::Auto => return Ok(()),
            Choice::Required => self.tools.clone(),
            Choice::Named(n) => self
                .tools
                .iter()
                .filter(|t| &t.name == n)
                .cloned()
                .collect(),
        };
        if request.constraint != Constraint::None {
            return Err(ApiError::param(
                "tool_choice",
                "a required or named `tool_choice` cannot be combined with another output \
                 constraint",
            ));
        }
        let parallel = self.parallel && self.choice == Choice::Required;
        request.constraint = Constraint::Lark(tools::grammar(&callable, parallel).into());
        Ok(())
    }
}

/// The names of the tools `request` declares (none when it declares none), so that an answer's
/// bare JSON or `[TOOL_CALLS]` calls count only when they name one of them.
pub fn declared_names(request: &GenerateRequest) -> Vec<String> {
    let declared: Vec<Value> = serde_json::from_str(&request.tools).unwrap_or_default();
    tools::from_values(&declared)
        .unwrap_or_default()
        .into_iter()
        .map(|t| t.name)
        .collect()
}

/// A tool result as the user turn the model reads it in.
pub fn response_turn(content: &str) -> ChatTurn {
    ChatTurn::text(
        "user",
        &format!("<tool_response>\n{content}\n</tool_response>"),
    )
}
