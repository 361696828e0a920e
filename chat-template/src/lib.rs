//! # u-chat-template — a model's chat template rendered as `transformers` renders it
//!
//! The template text comes from the model (GGUF `tokenizer.chat_template`, or
//! `tokenizer_config.json`) through the SDK's `Tokenizer::chat_template`; the engine renders it
//! with this crate, so the host never runs a plugin's code for it, and the conformance tests
//! (`tests/transformers.rs`, cases rendered by transformers itself) check this one renderer.
//!
//! The environment matches transformers': `trim_blocks` and `lstrip_blocks` on, loop controls,
//! Python string/dict methods (`.strip()`, `.startswith()`, `.items()` through
//! `minijinja-contrib`'s pycompat), `raise_exception(msg)`, `strftime_now(fmt)`, and a
//! `tojson` that writes what Python's `json.dumps(ensure_ascii=False)` writes.

#![deny(missing_docs)]

use minijinja::{Environment, Error, ErrorKind, Value, value::Kwargs};
use serde::Serialize;

pub mod tools;

/// Why a template could not be rendered; the message names the template's own error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template is not valid Jinja.
    #[error("chat template does not parse: {0}")]
    Syntax(String),
    /// Rendering failed (`raise_exception`, a missing variable used as a function…).
    #[error("chat template failed: {0}")]
    Render(String),
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`…
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders `template` for `messages`, with `bos_token`/`eos_token` as the template sees them.
/// As in transformers, `tools` and `documents` are defined and `none`.
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TemplateError> {
    let ctx = serde_json::json!({
        "messages": messages,
        "tools": null,
        "documents": null,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    });
    render_with(template, &ctx)
}

/// Whether `template` renders a `tools` variable (its text names one), so declared tools are
/// given to it rather than described in the system prompt.
pub fn takes_tools(template: &str) -> bool {
    template.contains("tools")
}

/// Renders `messages` with declared `tools` (OpenAI's shape; none: as [`render`]): given to a
/// template that [takes them](takes_tools), as transformers' `apply_chat_template(tools=…)`
/// does, otherwise described in the system prompt ([`tools::described_in_system`]).
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    tools: &[serde_json::Value],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, TemplateError> {
    if tools.is_empty() {
        return render(
            template,
            messages,
            add_generation_prompt,
            bos_token,
            eos_token,
        );
    }
    if takes_tools(template) {
        let ctx = serde_json::json!({
            "messages": messages,
            "tools": tools,
            "documents": null,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        });
        return render_with(template, &ctx);
    }
    let declared = tools::from_values(tools)
        .ok_or_else(|| TemplateError::Render("a declared tool has no function name".into()))?;
    let described = tools::described_in_system(messages, &declared);
    render(
        template,
        &described,
        add_generation_prompt,
        bos_token,
        eos_token,
    )
}

/// Renders `template` with an arbitrary context (messages with tool calls, `tools`,
/// `date_string`, …).
pub fn render_with(template: &str, context: &impl Serialize) -> Result<String, TemplateError> {
    let env = environment();
    let tmpl = env
        .template_from_str(template)
        .map_err(|e| TemplateError::Syntax(describe(&e)))?;
    tmpl.render(context)
        .map_err(|e| TemplateError::Render(describe(&e)))
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(&format!(": {inner}"));
        src = inner.source();
    }
    s
}

/// Instructions one render may run: far beyond what a chat template needs for a long
/// conversation, so a template (which comes with the model file) cannot loop for ever.
pub const FUEL: u64 = 50_000_000;

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| strftime(&fmt, now_utc()));
    env.add_filter("tojson", tojson);
    env
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    py_dumps(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` layout: `", "` and `": "` separators, or newlines with `indent`.
fn py_dumps(
    v: &serde_json::Value,
    indent: Option<usize>,
    sort: bool,
    depth: usize,
    out: &mut String,
) {
    use serde_json::Value as J;
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                py_dumps(x, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(m) if !m.is_empty() => {
            out.push('{');
            let mut entries: Vec<_> = m.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                py_dumps(x, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Seconds since the Unix epoch, UTC.
fn now_utc() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A small `strftime` over UTC: `%Y %m %d %e %H %M %S %y %b %B %a %A %j %p %I %%`.
pub fn strftime(fmt: &str, unix: i64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    let wd = DAYS[days.rem_euclid(7) as usize];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hh + 11) % 12 + 1)),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&wd[..3]),
            Some('A') => out.push_str(wd),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 00:00:00 UTC, a Friday.
        let t = 1_721_952_000;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %j %H:%M:%S", t).unwrap(),
            "Friday July 208 00:00:00"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400).unwrap(), "2000-02-29");
        assert!(strftime("%Q", 0).is_err());
    }
}
