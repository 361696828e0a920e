//! SGLang's native API, so clients written for SGLang's runtime work unchanged:
//! `POST /generate`, `GET /get_model_info` and `POST /flush_cache` (the engine's
//! `flush_cache`: cached prompt prefixes forgotten, refused while requests are in flight).
//!
//! `/generate` takes `text` (a prompt, used as is: no chat template) or `input_ids`, and
//! `sampling_params` with SGLang's names: `max_new_tokens` (default 128, as SGLang), `stop`,
//! `temperature`, `top_p`, `top_k` (-1 = off), `min_p`, `frequency_penalty`,
//! `presence_penalty`, `repetition_penalty`, `ignore_eos`, `regex` and `json_schema` (the
//! generated text is constrained to them); the parameters SGLang gives a neutral default are
//! accepted at that default (`n: 1`, `min_new_tokens: 0`, …). `return_logprob` (with
//! `top_logprobs_num` and `return_text_in_logprobs`) reports each generated token as SGLang's
//! `[logprob, token_id, text]` triples; prompt log-probabilities (`logprob_start_len` other than
//! -1) are not offered. Any other field, batched prompts and a parameter set to what the engine
//! cannot do are a 400 naming it. The answer is `{text, output_ids, meta_info}`; streamed, each
//! `data:` line carries the whole text so far (as SGLang streams it), the last one `meta_info`
//! with the finish reason and token counts, then `data: [DONE]`.

use crate::{
    bridge::Piece,
    checkpoints,
    error::{ApiError, Dialect},
    json::{self, Obj, type_name},
    reply::{self, Reply, sse},
};
use abi_stable::std_types::ROption;
use serde_json::{Value, json};
use std::time::Instant;
use u_sdk::{Constraint, FinishReason, GenerateRequest, GenerateSummary, SamplingParams};

/// SGLang's default `max_new_tokens`.
const DEFAULT_MAX_NEW_TOKENS: u32 = 128;

/// Request fields of `/generate` this server reads.
const FIELDS: [&str; 9] = [
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
];

/// `sampling_params` this server applies.
const SAMPLING: [&str; 12] = [
    "max_new_tokens",
    "ignore_eos",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "regex",
    "json_schema",
];

/// `sampling_params` accepted only at SGLang's default, which is what this engine does.
const AT_DEFAULT: [&str; 6] = [
    "n",
    "min_new_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stop_token_ids",
];

/// Whether `v` is SGLang's default for the [`AT_DEFAULT`] parameter `key`.
fn is_default(key: &str, v: &Value) -> bool {
    match key {
        "n" => v.as_u64() == Some(1),
        "min_new_tokens" => v.as_u64() == Some(0),
        "stop_token_ids" => v.as_array().is_some_and(|a| a.is_empty()),
        "no_stop_trim" => v == &Value::Bool(false),
        _ => v == &Value::Bool(true),
    }
}

/// A parsed `/generate` request.
pub struct Parsed {
    /// What the engine runs.
    pub request: GenerateRequest,
    /// Streamed as `data:` lines.
    pub stream: bool,
    /// The reply's shape.
    pub reply: Generated,
}

/// Parses a `/generate` body for the served `models`.
pub fn parse(body: &[u8], models: &[String]) -> Result<Parsed, ApiError> {
    let o = json::object(body)?;
    refuse_unknown(&o, &FIELDS, "")?;
    let model = checkpoints::model(None, models)?;
    let present = |k: &str| o.get(k).filter(|v| !v.is_null());
    let (prompt, tokens) = match (present("text"), present("input_ids")) {
        (Some(Value::String(t)), None) => (t.clone(), Vec::new()),
        (None, Some(Value::Array(ids))) => (String::new(), token_ids(ids)?),
        (Some(Value::Array(_)), None) => {
            return Err(ApiError::param(
                "text",
                "batched `text` (a list of prompts) is not supported: send one prompt per request",
            ));
        }
        (Some(t), None) => {
            return Err(ApiError::param(
                "text",
                format!("`text` must be a string, got {}", type_name(t)),
            ));
        }
        (None, Some(other)) => {
            return Err(ApiError::param(
                "input_ids",
                format!(
                    "`input_ids` must be an array of token ids, got {}",
                    type_name(other)
                ),
            ));
        }
        (None, None) => {
            return Err(ApiError::param(
                "text",
                "you must provide `text` or `input_ids`",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::param(
                "input_ids",
                "give either `text` or `input_ids`, not both",
            ));
        }
    };
    let empty = Obj::new();
    let p = json::nested(&o, "sampling_params")?.unwrap_or(&empty);
    let known: Vec<&str> = SAMPLING.iter().copied().chain(AT_DEFAULT).collect();
    refuse_unknown(p, &known, "sampling_params.")?;
    for key in AT_DEFAULT {
        if let Some(v) = p.get(key).filter(|v| !v.is_null() && !is_default(key, v)) {
            return Err(ApiError::param(
                &format!("sampling_params.{key}"),
                format!("`sampling_params.{key}` = {v} is not supported (only its default)"),
            ));
        }
    }
    let max_new_tokens = json::max_tokens(p, &["max_new_tokens"], Some(DEFAULT_MAX_NEW_TOKENS))?;
    let top_k = match json::integer(p, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ApiError::param(
                "sampling_params.top_k",
                format!("`top_k` must be -1 (off) or at least 1, got {k}"),
            ));
        }
    };
    let sampling = SamplingParams {
        temperature: json::number(p, "temperature", 0.0, 100.0)?.unwrap_or(1.0) as f32,
        top_p: json::number(p, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k,
        min_p: json::number(p, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        repetition_penalty: json::number(p, "repetition_penalty", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        presence_penalty: json::number(p, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: json::number(p, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        seed: ROption::RNone,
    };
    let mut request = GenerateRequest::new(&model, &prompt, max_new_tokens, sampling);
    request.prompt_tokens = tokens.into();
    request.ignore_eos = json::boolean(p, "ignore_eos")?;
    request.stop = json::strings(p, "stop")?
        .into_iter()
        .map(Into::into)
        .collect();
    // SGLang ignores `regex` when `json_schema` is given.
    request.constraint = match (json::string(p, "json_schema")?, json::string(p, "regex")?) {
        (Some(schema), _) => Constraint::JsonSchema(schema.into()),
        (None, Some(regex)) => Constraint::Regex(regex.into()),
        (None, None) => Constraint::None,
    };
    let logprobs = json::boolean(&o, "return_logprob")?;
    if let Some(start) = json::integer(&o, "logprob_start_len")?
        && start != -1
    {
        return Err(ApiError::param(
            "logprob_start_len",
            "prompt log-probabilities are not offered: `logprob_start_len` must be -1",
        ));
    }
    let top = json::integer_in(&o, "top_logprobs_num", 0, 20)?.unwrap_or(0);
    if logprobs {
        request.top_logprobs = ROption::RSome(top);
    }
    let id = match json::string(&o, "rid")? {
        Some(rid) => rid,
        None => reply::response_id("").0,
    };
    Ok(Parsed {
        request,
        stream: json::boolean(&o, "stream")?,
        reply: Generated {
            id,
            logprobs,
            top,
            with_text: json::boolean(&o, "return_text_in_logprobs")?,
            text: String::new(),
            started: Instant::now(),
            emitted: Vec::new(),
        },
    })
}

/// A 400 naming the first field of `o` not in `known` (a null counts as absent).
fn refuse_unknown(o: &Obj, known: &[&str], prefix: &str) -> Result<(), ApiError> {
    match o
        .iter()
        .find(|(k, v)| !v.is_null() && !known.contains(&k.as_str()))
    {
        Some((k, _)) => Err(ApiError::param(
            &format!("{prefix}{k}"),
            format!("`{prefix}{k}` is not supported by this server"),
        )),
        None => Ok(()),
    }
}

fn token_ids(ids: &[Value]) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::param(
            "input_ids",
            "`input_ids` must not be empty",
        ));
    }
    ids.iter()
        .map(|v| match v {
            Value::Array(_) => Err(ApiError::param(
                "input_ids",
                "batched `input_ids` (a list of lists) is not supported: send one prompt per request",
            )),
            v => v
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ApiError::param("input_ids", format!("`input_ids` holds {v}, not a token id"))
                }),
        })
        .collect()
}

/// The answer to one `/generate` request, whole or streamed.
pub struct Generated {
    id: String,
    logprobs: bool,
    top: u32,
    with_text: bool,
    text: String,
    started: Instant,
    emitted: Vec<Piece>,
}

impl Generated {
    /// SGLang's `[logprob, token_id, text]` (text `null` unless asked for).
    fn triple(&self, t: &u_sdk::TokenLogprob) -> Value {
        let text = self
            .with_text
            .then(|| String::from_utf8_lossy(&t.bytes).into_owned());
        json!([t.logprob, t.id, text])
    }

    fn meta(&self, pieces: &[Piece], summary: Option<&GenerateSummary>) -> Value {
        let mut meta = json!({
            "id": self.id,
            "finish_reason": summary.map(finish_reason),
            "e2e_latency": self.started.elapsed().as_secs_f64(),
        });
        if let Some(s) = summary {
            meta["prompt_tokens"] = s.prompt_tokens.into();
            meta["completion_tokens"] = s.generated_tokens.into();
            meta["cached_tokens"] = s.cached_tokens.into();
        }
        if self.logprobs {
            let scored = pieces.iter().filter(|p| p.logprob.is_some());
            meta["output_token_logprobs"] = scored
                .clone()
                .filter_map(|p| p.logprob.as_ref().map(|t| self.triple(t)))
                .collect();
            if self.top > 0 {
                meta["output_top_logprobs"] = scored
                    .map(|p| p.top.iter().map(|t| self.triple(t)).collect::<Value>())
                    .collect();
            }
        }
        meta
    }
}

/// SGLang's finish reason: `{"type": "length", "length": n}` or `{"type": "stop", "matched": …}`
/// (the stop string, or `null` for the end-of-sequence token).
fn finish_reason(s: &GenerateSummary) -> Value {
    match s.finish {
        FinishReason::Length => json!({"type": "length", "length": s.generated_tokens}),
        FinishReason::Stop => json!({
            "type": "stop",
            "matched": s.stop_sequence.as_ref().map(|m| m.to_string()).into_option(),
        }),
        FinishReason::Cancelled => json!({"type": "abort", "message": "cancelled"}),
    }
}

impl Reply for Generated {
    fn dialect(&self) -> Dialect {
        Dialect::OpenAi
    }

    fn opening(&mut self) -> Vec<String> {
        Vec::new()
    }

    fn piece(&mut self, piece: &Piece) -> Vec<String> {
        self.emitted.push(piece.clone());
        if piece.text.is_empty() {
            return Vec::new();
        }
        self.text.push_str(&piece.text);
        let meta = self.meta(&self.emitted, None);
        vec![sse(None, &json!({"text": self.text, "meta_info": meta}))]
    }

    fn closing(&mut self, summary: &GenerateSummary) -> Vec<String> {
        let meta = self.meta(&self.emitted, Some(summary));
        vec![
            sse(
                None,
                &json!({"text": self.text, "output_ids": summary.tokens.as_slice(), "meta_info": meta}),
            ),
            "data: [DONE]\n\n".into(),
        ]
    }

    fn whole(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value {
        json!({
            "text": reply::text(pieces),
            "output_ids": summary.tokens.as_slice(),
            "meta_info": self.meta(pieces, Some(summary)),
        })
    }
}

/// `GET /get_model_info`: the served model (its served name as the path) as SGLang describes it.
pub fn model_info(models: &[String]) -> Result<Value, ApiError> {
    let model = checkpoints::model(None, models)?;
    Ok(json!({
        "model_path": model,
        "tokenizer_path": model,
        "is_generation": true,
        "preferred_sampling_params": null,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn models() -> Vec<String> {
        vec!["m".into()]
    }

    fn err(body: Value) -> ApiError {
        match parse(body.to_string().as_bytes(), &models()) {
            Err(e) => e,
            Ok(_) => panic!("{body} was accepted"),
        }
    }

    #[test]
    fn sglang_fields_map_onto_the_request() {
        let p = parse(
            json!({"text": "Hi", "stream": true, "return_logprob": true, "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "top_k": -1,
                "top_p": 0.5, "stop": "x", "n": 1, "ignore_eos": false, "regex": "[ab]+"}})
            .to_string()
            .as_bytes(),
            &models(),
        )
        .unwrap();
        let r = &p.request;
        assert!(p.stream);
        assert_eq!((r.prompt.as_str(), r.max_tokens), ("Hi", 5));
        assert_eq!((r.sampling.temperature, r.sampling.top_k), (0.0, 0));
        assert_eq!(r.sampling.top_p, 0.5);
        assert_eq!(r.stop.len(), 1);
        assert_eq!(r.top_logprobs, ROption::RSome(2));
        assert_eq!(r.constraint, Constraint::Regex("[ab]+".into()));
        assert!(!r.ignore_eos);
        let p = parse(
            br#"{"text": "Hi", "sampling_params": {"ignore_eos": true}}"#,
            &models(),
        )
        .unwrap();
        assert!(p.request.ignore_eos);
        let p = parse(br#"{"input_ids": [1, 2, 3]}"#, &models()).unwrap();
        assert_eq!(p.request.prompt_tokens.as_slice(), [1, 2, 3]);
        assert_eq!(p.request.max_tokens, DEFAULT_MAX_NEW_TOKENS);
    }

    #[test]
    fn unsupported_fields_are_named() {
        for (body, param) in [
            (json!({"text": "a", "image_data": "x.png"}), "image_data"),
            (json!({"text": "a", "lora_path": "l"}), "lora_path"),
            (json!({"text": ["a", "b"]}), "text"),
            (json!({"input_ids": [[1], [2]]}), "input_ids"),
            (json!({}), "text"),
            (
                json!({"text": "a", "logprob_start_len": 0}),
                "logprob_start_len",
            ),
            (
                json!({"text": "a", "sampling_params": {"n": 2}}),
                "sampling_params.n",
            ),
            (
                json!({"text": "a", "sampling_params": {"ignore_eos": 1}}),
                "ignore_eos",
            ),
            (
                json!({"text": "a", "sampling_params": {"ebnf": "root ::= \"a\""}}),
                "sampling_params.ebnf",
            ),
            (
                json!({"text": "a", "sampling_params": {"stop_token_ids": [2]}}),
                "sampling_params.stop_token_ids",
            ),
        ] {
            let e = err(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        // Null fields are absent, defaults accepted.
        assert!(
            parse(
                br#"{"text": "a", "image_data": null, "sampling_params": {"stop_token_ids": [], "min_new_tokens": 0}}"#,
                &models()
            )
            .is_ok()
        );
    }
}
