//! Chat templates against `transformers`' own rendering (`tests/fixtures/chat_templates.json`,
//! made by `tests/fixtures/make_chat_fixtures.py`).

use serde_json::{Value, json};
use u_chat_template::{ChatMessage, TemplateError, render, render_with};

fn fixtures() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/chat_templates.json"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

#[test]
fn templates_render_as_transformers_does() {
    let cases = fixtures();
    assert!(cases.len() >= 8);
    for c in &cases {
        let name = c["name"].as_str().unwrap();
        let template = c["template"].as_str().unwrap();
        let want = c["expected"].as_str().unwrap();
        let got = if c["tools"].is_null() {
            let messages: Vec<ChatMessage> = c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| {
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())
                })
                .collect();
            render(
                template,
                &messages,
                c["add_generation_prompt"].as_bool().unwrap(),
                c["bos_token"].as_str().unwrap(),
                c["eos_token"].as_str().unwrap(),
            )
        } else {
            let ctx = json!({
                "messages": c["messages"],
                "tools": c["tools"],
                "documents": null,
                "add_generation_prompt": c["add_generation_prompt"],
                "bos_token": c["bos_token"],
                "eos_token": c["eos_token"],
            });
            render_with(template, &ctx)
        };
        let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn raise_exception_and_syntax_errors_are_errors() {
    let e = render(
        "{{ raise_exception('only user and assistant roles') }}",
        &[],
        false,
        "",
        "",
    )
    .unwrap_err();
    assert!(
        matches!(&e, TemplateError::Render(m) if m.contains("only user and assistant roles")),
        "{e}"
    );
    let e = render("{% for x in %}", &[], false, "", "").unwrap_err();
    assert!(matches!(e, TemplateError::Syntax(_)), "{e}");
    assert!(
        e.to_string().starts_with("chat template does not parse"),
        "{e}"
    );
}

#[test]
fn strftime_now_gives_a_date() {
    let out = render("{{ strftime_now('%d %b %Y') }}", &[], false, "", "").unwrap();
    assert_eq!(out.len(), 11, "{out}");
    assert!(out[7..].parse::<u32>().unwrap() >= 2024);
}

#[test]
fn tools_and_documents_are_defined_and_none() {
    let t = "{% if tools is defined and tools is none %}T{% endif %}{% if documents is none %}D{% endif %}";
    assert_eq!(render(t, &[], false, "", "").unwrap(), "TD");
}
