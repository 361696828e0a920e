//! KV checkpoint endpoints (internal, for the operator or the Safebox infrastructure):
//!
//! | method and path | body | engine op |
//! | --- | --- | --- |
//! | `GET /v1/checkpoints?model=M` | — | list |
//! | `POST /v1/checkpoints` | `{model, name, prompt \| messages, source?}` | save |
//! | `POST /v1/checkpoints/fork` | `{model, source, name}` | fork |
//! | `POST /v1/checkpoints/graft` | `{model, target, source, name}` | graft |
//! | `DELETE /v1/checkpoints/{name}?model=M` | — | delete |
//!
//! `model` may be left out when the engine serves one model. Answers are
//! `{"object": "list", "data": [{"name", "tokens"}]}` for a list and `{"name", "tokens"}` for
//! what a command wrote. Generation continues from a checkpoint with `resume_from` and saves
//! one with `save_as` on the completion endpoints.

use crate::{
    error::ApiError,
    json::{self, Obj},
    openai,
};
use serde_json::{Value, json};
use u_sdk::{ChatTurn, CheckpointInfo, CheckpointOp, CheckpointRequest};

fn request(op: CheckpointOp, model: String) -> CheckpointRequest {
    CheckpointRequest {
        op,
        model: model.into(),
        name: Default::default(),
        source: Default::default(),
        target: Default::default(),
        prompt: Default::default(),
        messages: Default::default(),
        owner: Default::default(),
        overwrite: false,
        admin: false,
    }
}

/// The model a request names, or else the one served (its name, listed before its aliases).
pub fn model(named: Option<String>, models: &[String]) -> Result<String, ApiError> {
    match (named, models) {
        (Some(m), _) if u_sdk::serves(models, &m) => Ok(m),
        (Some(m), _) => Err(ApiError::model_not_found(&m)),
        (None, [first, ..]) => Ok(first.clone()),
        (None, []) => Err(ApiError::param("model", "this server serves no model")),
    }
}

/// Checkpoint names are file names on the disk tier: letters, digits, `-`, `_`, `.`, not
/// starting with `.`, at most 128 bytes.
fn name(o: &Obj, key: &str) -> Result<String, ApiError> {
    let n = json::required_string(o, key)?;
    check_name(&n).map_err(|m| ApiError::param(key, m))?;
    Ok(n)
}

/// Why `n` is not a valid checkpoint name, if it is not.
pub fn check_name(n: &str) -> Result<(), String> {
    let ok = !n.is_empty()
        && n.len() <= 128
        && !n.starts_with('.')
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "checkpoint name `{n}` must be 1-128 letters, digits, `-`, `_` or `.`, not starting with `.`"
        ))
    }
}

/// Parses the body of `POST /v1/checkpoints[/fork|/graft]`.
pub fn parse(
    op: CheckpointOp,
    body: &[u8],
    models: &[String],
) -> Result<CheckpointRequest, ApiError> {
    let o = json::object(body)?;
    let mut r = request(op, model(json::string(&o, "model")?, models)?);
    r.name = name(&o, "name")?.into();
    r.overwrite = json::boolean(&o, "overwrite")?;
    match op {
        CheckpointOp::Save => {
            if let Some(source) = json::string(&o, "source")? {
                check_name(&source).map_err(|m| ApiError::param("source", m))?;
                r.source = source.into();
            }
            match (o.get("messages"), json::string(&o, "prompt")?) {
                (Some(Value::Array(_)), None) => {
                    let parsed = openai::parse(
                        openai::Endpoint::Chat,
                        &serde_json::to_vec(
                            &json!({"model": r.model.as_str(), "messages": o["messages"]}),
                        )
                        .unwrap_or_default(),
                        models,
                        1,
                    )?;
                    r.messages = parsed.request.messages;
                }
                (None, Some(p)) => r.prompt = p.into(),
                _ => {
                    return Err(ApiError::invalid(
                        "a checkpoint is saved from either `prompt` (a string) or `messages` (an array)",
                    ));
                }
            }
        }
        CheckpointOp::Fork => r.source = name(&o, "source")?.into(),
        CheckpointOp::Graft => {
            r.source = name(&o, "source")?.into();
            r.target = name(&o, "target")?.into();
        }
        CheckpointOp::List | CheckpointOp::Delete => {}
    }
    Ok(r)
}

/// `GET /v1/checkpoints` and `DELETE /v1/checkpoints/{name}` requests.
pub fn simple(
    op: CheckpointOp,
    name: &str,
    model_param: Option<String>,
    models: &[String],
) -> Result<CheckpointRequest, ApiError> {
    let mut r = request(op, model(model_param, models)?);
    if op == CheckpointOp::Delete {
        check_name(name).map_err(|m| ApiError::param("name", m))?;
        r.name = name.into();
    }
    Ok(r)
}

/// The value of query parameter `key` in `query`, percent-decoding not needed for the
/// characters names and model names may hold.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.to_string())
}

/// The answer to a command.
pub fn answer(op: CheckpointOp, infos: &[CheckpointInfo]) -> Value {
    let item = |i: &CheckpointInfo| json!({"name": i.name.as_str(), "tokens": i.tokens});
    match op {
        CheckpointOp::List => {
            json!({"object": "list", "data": infos.iter().map(item).collect::<Vec<_>>()})
        }
        CheckpointOp::Delete => json!({"deleted": true}),
        _ => infos.first().map(item).unwrap_or(Value::Null),
    }
}

/// The answer to an admin's command: names as stored, and each listed checkpoint's `owner`,
/// the client of `clients` whose namespace holds it, its namespace (`o-<16 hex>`) when no
/// configured key names that client (a Unix peer), or null in the shared namespace.
pub fn answer_for_admin(op: CheckpointOp, infos: &[CheckpointInfo], clients: &[String]) -> Value {
    let mut v = answer(op, infos);
    if let Some(items) = v["data"].as_array_mut() {
        for item in items {
            let name = item["name"].as_str().unwrap_or_default();
            let known = clients.iter().find(|c| {
                let ns = u_sdk::checkpoint_namespace(c);
                name.starts_with(&ns)
            });
            let owner = match (known, name.split_once('.')) {
                (Some(c), _) => json!(c),
                (None, Some((ns, _))) if name.starts_with("o-") && ns.len() == 18 => json!(ns),
                _ => Value::Null,
            };
            item["owner"] = owner;
        }
    }
    v
}

/// A chat turn from parts (for tests and the Safebox mapping).
pub fn turn(role: &str, content: &str) -> ChatTurn {
    ChatTurn::text(role, content)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admin_list_says_whose_each_checkpoint_is() {
        let info = |name: &str| CheckpointInfo {
            name: name.into(),
            tokens: 3,
        };
        let alice = format!("{}private", u_sdk::checkpoint_namespace("key:alice"));
        let uid = format!("{}notes", u_sdk::checkpoint_namespace("unix:uid=1000"));
        let clients = ["key:bob".to_string(), "key:alice".to_string()];
        let v = answer_for_admin(
            CheckpointOp::List,
            &[info(&alice), info(&uid), info("shared")],
            &clients,
        );
        let owners: Vec<&Value> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| &i["owner"])
            .collect();
        assert_eq!(owners[0], "key:alice");
        assert_eq!(owners[1].as_str(), uid.split_once('.').map(|(ns, _)| ns));
        assert_eq!(owners[2], &Value::Null);
        assert_eq!(v["data"][0]["name"], alice.as_str());
    }

    fn models() -> Vec<String> {
        vec!["tiny".into()]
    }

    #[test]
    fn commands_parse_and_names_are_checked() {
        let r = parse(
            CheckpointOp::Save,
            br#"{"name":"sys-1","prompt":"You are kind."}"#,
            &models(),
        )
        .unwrap();
        assert_eq!(
            (r.model.as_str(), r.name.as_str(), r.prompt.as_str()),
            ("tiny", "sys-1", "You are kind.")
        );
        let r = parse(
            CheckpointOp::Save,
            br#"{"model":"tiny","name":"c","messages":[{"role":"user","content":"hi"}]}"#,
            &models(),
        )
        .unwrap();
        assert_eq!(r.messages[0].content.as_str(), "hi");
        let r = parse(
            CheckpointOp::Graft,
            br#"{"name":"g","source":"doc","target":"chat"}"#,
            &models(),
        )
        .unwrap();
        assert_eq!((r.source.as_str(), r.target.as_str()), ("doc", "chat"));
        for bad in [
            r#"{"name":"../x","prompt":"p"}"#,
            r#"{"name":".hidden","prompt":"p"}"#,
            r#"{"name":"a b","prompt":"p"}"#,
            r#"{"name":"ok"}"#,
            r#"{"name":"ok","prompt":"p","model":"other"}"#,
        ] {
            assert!(
                parse(CheckpointOp::Save, bad.as_bytes(), &models()).is_err(),
                "{bad}"
            );
        }
        assert!(parse(CheckpointOp::Fork, br#"{"name":"a"}"#, &models()).is_err());
        assert_eq!(
            query_param(Some("a=1&model=tiny"), "model").as_deref(),
            Some("tiny")
        );
        assert!(simple(CheckpointOp::Delete, "x/y", None, &models()).is_err());
    }
}
