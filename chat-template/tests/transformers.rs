//! Chat templates against `transformers`' own rendering (`tests/fixtures/chat_templates.json`,
//! made by `tests/fixtures/make_chat_fixtures.py`).

use serde_json::{Value, json};
use u_chat_template::{ChatMessage, TemplateError, render, render_chat, takes_tools};

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
        // Every case through `render_chat`: with tools, the templates here take them, so they
        // are given to the template as transformers gives them.
        let messages: Vec<ChatMessage> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let tools = c["tools"].as_array().cloned().unwrap_or_default();
        assert_eq!(
            !tools.is_empty(),
            takes_tools(template) && !c["tools"].is_null(),
            "{name}"
        );
        let got = render_chat(
            template,
            &messages,
            &tools,
            c["add_generation_prompt"].as_bool().unwrap(),
            c["bos_token"].as_str().unwrap(),
            c["eos_token"].as_str().unwrap(),
        );
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

/// A template comes with the model file, so a hostile one must not hang a request: nested loops
/// of 10^15 steps stop at the fuel limit with a render error, quickly.
#[test]
fn a_template_that_would_run_for_ever_runs_out_of_fuel() {
    let start = std::time::Instant::now();
    let e = render(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}",
        &[],
        false,
        "",
        "",
    )
    .unwrap_err();
    assert!(
        matches!(&e, TemplateError::Render(m) if m.contains("fuel")),
        "{e}"
    );
    assert!(start.elapsed().as_secs() < 30, "took {:?}", start.elapsed());
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

/// Tools given to a template that ignores them (SmolLM2's) are described in the system prompt
/// instead, after the conversation's own system message or as a new first one.
#[test]
fn tools_for_a_template_without_them_go_into_the_system_prompt() {
    let smollm2 = fixtures()
        .into_iter()
        .find(|c| c["name"] == "smollm2")
        .unwrap()["template"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(!takes_tools(&smollm2));
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather", "parameters": {"type": "object", "properties": {}}}}),
    ];
    for (messages, system) in [
        (
            vec![
                ChatMessage::new("system", "Be brief."),
                ChatMessage::new("user", "Hi"),
            ],
            "Be brief.\n\n# Tools",
        ),
        (vec![ChatMessage::new("user", "Hi")], "# Tools"),
    ] {
        let got = render_chat(&smollm2, &messages, &tools, true, "", "").unwrap();
        let want = u_chat_template::tools::described_in_system(
            &messages,
            &u_chat_template::tools::from_values(&tools).unwrap(),
        );
        assert!(want[0].content.starts_with(system), "{:?}", want[0]);
        assert_eq!(got, render(&smollm2, &want, true, "", "").unwrap());
        assert!(got.contains("\"name\":\"get_weather\""), "{got}");
    }
    let e = render_chat(
        &smollm2,
        &[ChatMessage::new("user", "Hi")],
        &[json!({"type": "function"})],
        true,
        "",
        "",
    );
    assert!(matches!(e, Err(TemplateError::Render(m)) if m.contains("no function name")));
}
