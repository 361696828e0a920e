//! Structured outputs (issue 15) through the engine's ABI: a request's `constraint` — a JSON
//! schema, a regex or a Lark grammar compiled by llguidance — holds the output of the random-
//! weight llama fixture (character-level tiny tokenizer) to its grammar, generation ends when
//! the grammar is complete, constrained and free requests share passes without changing the
//! free ones' output, and a grammar that does not compile is an invalid request naming it.

mod common;

use abi_stable::{sabi_trait::TD_Opaque, std_types::RSome};
use anyhow::Result;
use serde_json::Value;
use std::{
    sync::{Arc, Barrier, Mutex},
    thread,
};
use u_runner_text::{EngineHandle, Limits, sampler};
use u_sdk::{
    Constraint, EngineBox, ErrorKind, FinishReason, GenerateRequest, GenerateSummary,
    GeneratedToken, TokenSink, TokenSink_TO,
};

struct Collect(Arc<Mutex<String>>);

impl TokenSink for Collect {
    fn token(&mut self, t: &GeneratedToken<'_>) -> bool {
        self.0.lock().unwrap().push_str(t.text.as_str());
        true
    }
}

fn ask(engine: &EngineBox, request: &GenerateRequest) -> Result<(GenerateSummary, String)> {
    let text = Arc::new(Mutex::new(String::new()));
    let sink = TokenSink_TO::from_value(Collect(text.clone()), TD_Opaque);
    let summary = engine.generate(request, sink).into_result()?;
    let text = text.lock().unwrap().clone();
    Ok((summary, text))
}

fn engine() -> Result<EngineBox> {
    let (g, _) = common::generator(common::safetensors("llama")?)?;
    Ok(EngineHandle::with_limits("tiny", g, Limits::default()).into_box())
}

fn request(prompt: &str, max_tokens: u32, constraint: Constraint, seed: u64) -> GenerateRequest {
    let mut sampling = sampler::greedy();
    if seed > 0 {
        sampling.temperature = 1.0;
        sampling.seed = RSome(seed);
    }
    GenerateRequest {
        constraint,
        ..GenerateRequest::new("tiny", prompt, max_tokens, sampling)
    }
}

const SCHEMA: &str = r#"{"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "maxItems": 3}},
  "required": ["name", "kind", "tags"], "additionalProperties": false}"#;

#[test]
fn outputs_follow_their_json_schema_regex_and_lark_grammar() -> Result<()> {
    let e = engine()?;
    for seed in [0, 1, 2, 3] {
        let (s, text) = ask(
            &e,
            &request("A pet: ", 80, Constraint::JsonSchema(SCHEMA.into()), seed),
        )?;
        let v: Value =
            serde_json::from_str(&text).map_err(|err| anyhow::anyhow!("{err}: {text}"))?;
        assert!(
            v["name"].as_str().is_some_and(|n| n.chars().count() <= 6),
            "{text}"
        );
        assert!(
            ["cat", "dog"].contains(&v["kind"].as_str().unwrap()),
            "{text}"
        );
        let tags = v["tags"].as_array().unwrap();
        assert!(tags.len() <= 3 && tags.iter().all(|t| t.as_u64().is_some_and(|t| t <= 9)));
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        // The grammar ends at the closing brace: a stop, not the token budget.
        assert_eq!(s.finish, FinishReason::Stop, "{text}");

        let (s, text) = ask(
            &e,
            &request(
                "Code: ",
                20,
                Constraint::Regex("[a-c]{3}-[0-9]{2}".into()),
                seed,
            ),
        )?;
        let b = text.as_bytes();
        assert_eq!(b.len(), 6, "{text}");
        assert!(
            b[..3].iter().all(|c| (b'a'..=b'c').contains(c)) && b[3] == b'-',
            "{text}"
        );
        assert!(b[4..].iter().all(u8::is_ascii_digit), "{text}");
        assert_eq!((s.finish, s.generated_tokens), (FinishReason::Stop, 6));

        let lark = r#"start: answer "!"
answer: "yes" | "no" | "maybe""#;
        let (_, text) = ask(
            &e,
            &request("Well? ", 20, Constraint::Lark(lark.into()), seed),
        )?;
        assert!(["yes!", "no!", "maybe!"].contains(&text.as_str()), "{text}");
    }
    // `{"type":"object"}` (OpenAI's json_object) is any JSON object.
    let (_, text) = ask(
        &e,
        &request(
            "{",
            40,
            Constraint::JsonSchema(r#"{"type":"object"}"#.into()),
            0,
        ),
    )?;
    if text.ends_with('}') {
        assert!(serde_json::from_str::<Value>(&text)?.is_object(), "{text}");
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
    Ok(())
}

#[test]
fn constrained_and_free_requests_share_a_batch_and_free_ones_are_unchanged() -> Result<()> {
    let e = engine()?;
    let free: Vec<GenerateRequest> = (0..3)
        .map(|i| request(&format!("Free request {i}: "), 16, Constraint::None, 0))
        .collect();
    let alone: Vec<String> = free
        .iter()
        .map(|r| Ok(ask(&e, r)?.1))
        .collect::<Result<_>>()?;
    let mut all = free.clone();
    for i in 0..3 {
        all.push(request(
            &format!("Pet {i}: "),
            80,
            Constraint::JsonSchema(SCHEMA.into()),
            0,
        ));
    }
    let gate = Arc::new(Barrier::new(all.len()));
    let out: Vec<String> = thread::scope(|s| {
        let handles: Vec<_> = all
            .iter()
            .map(|r| {
                let (e, gate) = (e.clone(), gate.clone());
                s.spawn(move || {
                    gate.wait();
                    ask(&e, r).map(|x| x.1)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Result<_>>()
    })?;
    assert_eq!(out[..3], alone[..]);
    for text in &out[3..] {
        let v: Value = serde_json::from_str(text)?;
        assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
    }
    Ok(())
}

#[test]
fn a_grammar_that_does_not_compile_is_an_invalid_request_naming_it() -> Result<()> {
    let e = engine()?;
    for (constraint, what) in [
        (Constraint::JsonSchema("{not json".into()), "JSON schema"),
        (
            Constraint::JsonSchema(r#"{"type": "no-such-type"}"#.into()),
            "JSON schema",
        ),
        (Constraint::Regex("[a-".into()), "regex"),
        (Constraint::Lark("start: undefined_rule".into()), "grammar"),
    ] {
        let err = ask(&e, &request("x", 4, constraint.clone(), 0))
            .err()
            .and_then(|e| e.downcast::<u_sdk::UError>().ok())
            .unwrap_or_else(|| panic!("{constraint:?} was accepted"));
        assert_eq!(err.kind, ErrorKind::InvalidInput, "{err:?}");
        assert!(
            err.message.contains(what),
            "{constraint:?}: {}",
            err.message
        );
    }
    // The engine serves on.
    let (s, _) = ask(&e, &request("x", 3, Constraint::None, 0))?;
    assert_eq!(s.generated_tokens, 3);
    Ok(())
}
