//! Fuzzes the chat-template renderer, whose templates come with model files: the input's first
//! line is the template, the rest a JSON list of `{role, content}` messages (or plain text, one
//! user message) and the optional tools. Any input must render or give a `TemplateError` —
//! never a panic, and never a render that runs on (fuel bounds every render).
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_chat_template::{ChatMessage, render_chat};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (template, rest) = text.split_once('\n').unwrap_or((&text, ""));
    let parsed: Option<(Vec<ChatMessage>, Vec<serde_json::Value>)> =
        serde_json::from_str::<serde_json::Value>(rest).ok().map(|v| {
            let messages = v["messages"]
                .as_array()
                .map(|m| {
                    m.iter()
                        .map(|m| {
                            ChatMessage::new(
                                m["role"].as_str().unwrap_or("user"),
                                m["content"].as_str().unwrap_or_default(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            let tools = v["tools"].as_array().cloned().unwrap_or_default();
            (messages, tools)
        });
    let (messages, tools) = parsed.unwrap_or_else(|| (vec![ChatMessage::new("user", rest)], vec![]));
    let _ = render_chat(template, &messages, &tools, true, "<s>", "</s>");
});
