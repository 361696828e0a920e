//! The Safebox protocol: HMAC-authenticated requests and the `Protocol.LLM.Local` generation
//! body. The wire format is documented in `docs/safebox-protocol.md`.
//!
//! Authentication applies to every request on this transport once a secret is configured
//! (`hmac_secret_file`, one secret, or `hmac_keys_file`, several named keys, each a client of
//! its own chosen by the `x-safebox-key-id` header): the client signs method, path (with
//! query), timestamp, a nonce and the SHA-256 of the body with HMAC-SHA256; the server checks
//! the signature in constant time, refuses timestamps outside the replay window and refuses a
//! nonce it has already seen inside that window.

use crate::{
    bridge::Piece,
    checkpoints,
    error::{ApiError, Dialect},
    json::{self, type_name},
    reply::{self, Reply, sse},
};
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::{
    collections::{HashMap, VecDeque},
    sync::Mutex,
};
use u_sdk::{CacheBreakpoint, FinishReason, GenerateRequest, GenerateSummary, SamplingParams};

/// The generation endpoint.
pub const PATH: &str = "/v1/safebox/llm";
/// Header with the request time, Unix seconds.
pub const TIMESTAMP: &str = "x-safebox-timestamp";
/// Header with a single-use random string (16–128 of `A–Z a–z 0–9 - _`).
pub const NONCE: &str = "x-safebox-nonce";
/// Header with `v1=` and the lowercase hex HMAC-SHA256.
pub const SIGNATURE: &str = "x-safebox-signature";
/// Header naming the key a request is signed with (`hmac_keys_file`).
pub const KEY_ID: &str = "x-safebox-key-id";
/// Most nonces remembered at once; requests beyond that wait for old ones to expire (503).
const MAX_NONCES: usize = 1 << 20;

/// The string a request's signature covers.
pub fn canonical(method: &str, path: &str, timestamp: &str, nonce: &str, body: &[u8]) -> String {
    format!(
        "{method}\n{path}\n{timestamp}\n{nonce}\n{}",
        hex::encode(Sha256::digest(body))
    )
}

/// `v1=` and the hex HMAC-SHA256 of `canonical` under `secret` (what a client sends).
pub fn sign(secret: &[u8], canonical: &str) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(canonical.as_bytes());
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// Checks request signatures and remembers nonces for the replay window.
pub struct Verifier {
    secrets: Secrets,
    window_s: u64,
    seen: Mutex<Seen>,
}

/// The keys requests may be signed with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Secrets {
    /// One secret (`hmac_secret_file`): its holders are one client.
    One(Vec<u8>),
    /// Named keys (`hmac_keys_file`, `ID KEY` lines): each id is a client, named by the
    /// request's `x-safebox-key-id`.
    Named(Vec<(String, Vec<u8>)>),
}

#[derive(Default)]
struct Seen {
    by_nonce: HashMap<String, u64>,
    order: VecDeque<(u64, String)>,
}

/// The authentication headers of one request.
pub struct Signed<'a> {
    /// `x-safebox-timestamp`.
    pub timestamp: Option<&'a str>,
    /// `x-safebox-nonce`.
    pub nonce: Option<&'a str>,
    /// `x-safebox-signature`.
    pub signature: Option<&'a str>,
    /// `x-safebox-key-id`.
    pub key_id: Option<&'a str>,
}

impl Verifier {
    /// A verifier for `secrets` (each at least 16 bytes) with a replay window of ± `window_s`.
    pub fn new(secrets: Secrets, window_s: u64) -> Result<Self, String> {
        let short = match &secrets {
            Secrets::One(s) => (s.len() < 16).then(|| ("the HMAC secret".to_string(), s.len())),
            Secrets::Named(keys) => keys
                .iter()
                .find(|(_, k)| k.len() < 16)
                .map(|(id, k)| (format!("HMAC key `{id}`"), k.len())),
        };
        if let Some((what, n)) = short {
            return Err(format!("{what} is {n} bytes; at least 16 are required"));
        }
        Ok(Self {
            secrets,
            window_s,
            seen: Mutex::default(),
        })
    }

    /// Accepts or refuses a request arriving at `now` (Unix seconds); accepted, the id of the
    /// key it was signed with (`None` for the one secret).
    pub fn check<'s>(
        &'s self,
        method: &str,
        path: &str,
        headers: &Signed<'_>,
        body: &[u8],
        now: u64,
    ) -> Result<Option<&'s str>, ApiError> {
        let (Some(ts), Some(nonce), Some(sig)) =
            (headers.timestamp, headers.nonce, headers.signature)
        else {
            return Err(ApiError::unauthorized(format!(
                "this server requires Safebox authentication: {TIMESTAMP}, {NONCE} and {SIGNATURE} headers"
            )));
        };
        let t: u64 = ts
            .parse()
            .map_err(|_| ApiError::unauthorized(format!("{TIMESTAMP} must be Unix seconds")))?;
        if t.abs_diff(now) > self.window_s {
            return Err(ApiError::unauthorized(format!(
                "the request timestamp is {}s away from the server's clock; the window is ±{}s",
                t.abs_diff(now),
                self.window_s
            )));
        }
        let nonce_ok = (16..=128).contains(&nonce.len())
            && nonce
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !nonce_ok {
            return Err(ApiError::unauthorized(format!(
                "{NONCE} must be 16-128 characters of A-Z a-z 0-9 - _"
            )));
        }
        let given = sig
            .strip_prefix("v1=")
            .and_then(|h| hex::decode(h).ok())
            .ok_or_else(|| ApiError::unauthorized(format!("{SIGNATURE} must be `v1=` and hex")))?;
        let (id, secret) = match (&self.secrets, headers.key_id) {
            (Secrets::One(secret), None) => (None, secret),
            (Secrets::One(_), Some(_)) => {
                return Err(ApiError::unauthorized(format!(
                    "this server has one HMAC secret: send no {KEY_ID}"
                )));
            }
            (Secrets::Named(_), None) => {
                return Err(ApiError::unauthorized(format!(
                    "this server has several HMAC keys: name yours in {KEY_ID}"
                )));
            }
            (Secrets::Named(keys), Some(wanted)) => keys
                .iter()
                .find(|(id, _)| id == wanted)
                .map(|(id, secret)| (Some(id.as_str()), secret))
                .ok_or_else(|| ApiError::unauthorized(format!("no HMAC key `{wanted}`")))?,
        };
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
        mac.update(canonical(method, path, ts, nonce, body).as_bytes());
        mac.verify_slice(&given)
            .map_err(|_| ApiError::unauthorized("the request signature does not match"))?;
        self.remember(nonce, t, now)?;
        Ok(id)
    }

    fn remember(&self, nonce: &str, t: u64, now: u64) -> Result<(), ApiError> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let horizon = now.saturating_sub(2 * self.window_s);
        while let Some((at, _)) = seen.order.front() {
            if *at >= horizon {
                break;
            }
            if let Some((_, old)) = seen.order.pop_front() {
                seen.by_nonce.remove(&old);
            }
        }
        if seen.by_nonce.contains_key(nonce) {
            return Err(ApiError::unauthorized(
                "this nonce was already used: the request is a replay",
            ));
        }
        if seen.by_nonce.len() >= MAX_NONCES {
            return Err(ApiError {
                retry_after: Some(1),
                ..ApiError::status(
                    503,
                    "server_error",
                    "too many recent requests to track nonces",
                )
            });
        }
        seen.by_nonce.insert(nonce.to_string(), t);
        seen.order.push_back((now, nonce.to_string()));
        Ok(())
    }
}

/// A parsed Safebox generation request.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The engine request.
    pub request: GenerateRequest,
    /// Stream the answer as server-sent events.
    pub stream: bool,
}

/// Parses `{model, system, userInput, blocks, max_tokens, temperature, top_p, stream,
/// adapters, control_vectors, soft_prompt}` (`adapters` as llama.cpp's `lora`: `[{"id",
/// "scale"}]`; `control_vectors` `[{"name", "strength", "layers"}]`; `soft_prompt` a name). The system prompt and
/// every block (unless `"cache": false`) end in a cache breakpoint.
pub fn parse(body: &[u8], models: &[String], default_max_tokens: u32) -> Result<Parsed, ApiError> {
    let o = json::object(body)?;
    let model = checkpoints::model(json::string(&o, "model")?, models)?;
    let system = json::string(&o, "system")?;
    let user = json::required_string(&o, "userInput")?;
    let mut context = String::new();
    let mut marks = Vec::new();
    match o.get("blocks") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            for (i, b) in list.iter().enumerate() {
                let at = format!("blocks[{i}]");
                let (text, cache) = match b {
                    Value::String(s) => (s.clone(), true),
                    Value::Object(b) => (
                        json::required_string(b, "text").map_err(|e| ApiError {
                            param: Some(format!("{at}.text")),
                            ..e
                        })?,
                        match b.get("cache") {
                            None | Some(Value::Null) => true,
                            Some(Value::Bool(c)) => *c,
                            Some(_) => {
                                return Err(ApiError::param(
                                    &at,
                                    format!("`{at}.cache` must be a boolean"),
                                ));
                            }
                        },
                    ),
                    other => {
                        return Err(ApiError::param(
                            &at,
                            format!(
                                "`{at}` must be a string or {{\"text\", \"cache\"}}, got {}",
                                type_name(other)
                            ),
                        ));
                    }
                };
                context.push_str(&text);
                context.push_str("\n\n");
                if cache {
                    marks.push(context.len() as u32);
                }
            }
        }
        Some(other) => {
            return Err(ApiError::param(
                "blocks",
                format!("`blocks` must be an array, got {}", type_name(other)),
            ));
        }
    }
    context.push_str(&user);
    let max_tokens = json::max_tokens(&o, &["max_tokens"], Some(default_max_tokens))?;
    let sampling = SamplingParams {
        temperature: json::number(&o, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_p: json::number(&o, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: 0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: json::integer(&o, "seed")?.map(|s| s as u64).into(),
    };
    let stream = json::boolean(&o, "stream")?;
    let mut turns = Vec::new();
    let mut breakpoints = Vec::new();
    if let Some(system) = system.filter(|s| !s.is_empty()) {
        breakpoints.push(CacheBreakpoint {
            turn: 0,
            offset: system.len() as u32,
        });
        turns.push(checkpoints::turn("system", &system));
    }
    let turn = turns.len() as u32;
    breakpoints.extend(
        marks
            .into_iter()
            .map(|offset| CacheBreakpoint { turn, offset }),
    );
    turns.push(checkpoints::turn("user", &context));
    let mut request = GenerateRequest::new(&model, "", max_tokens, sampling);
    request.messages = turns.into();
    request.cache_breakpoints = breakpoints.into();
    request.adapters = json::adapters(&o, "adapters")?.into();
    request.control_vectors = json::control_vectors(&o, "control_vectors")?.into();
    request.soft_prompt = json::string(&o, "soft_prompt")?.unwrap_or_default().into();
    Ok(Parsed { request, stream })
}

fn stop_reason(s: &GenerateSummary) -> &'static str {
    match s.finish {
        FinishReason::Length => "length",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

fn usage(s: &GenerateSummary) -> Value {
    json!({
        "input_tokens": s.prompt_tokens,
        "output_tokens": s.generated_tokens,
        "cached_tokens": s.cached_tokens,
    })
}

/// One Safebox answer.
pub struct Answer {
    id: String,
    model: String,
}

impl Answer {
    /// A fresh answer identity for `model`.
    pub fn new(model: &str) -> Self {
        Self {
            id: reply::response_id("sbx-").0,
            model: model.to_string(),
        }
    }
}

impl Reply for Answer {
    fn dialect(&self) -> Dialect {
        Dialect::Safebox
    }

    fn opening(&mut self) -> Vec<String> {
        vec![sse(
            Some("start"),
            &json!({"id": self.id, "model": self.model}),
        )]
    }

    fn piece(&mut self, piece: &Piece) -> Vec<String> {
        if piece.text.is_empty() {
            return Vec::new();
        }
        vec![sse(Some("token"), &json!({"text": piece.text}))]
    }

    fn closing(&mut self, summary: &GenerateSummary) -> Vec<String> {
        vec![sse(
            Some("done"),
            &json!({"stop_reason": stop_reason(summary), "usage": usage(summary)}),
        )]
    }

    fn error(&self, e: &ApiError) -> String {
        sse(Some("error"), &e.body(Dialect::Safebox))
    }

    fn whole(&self, pieces: &[Piece], summary: &GenerateSummary) -> Value {
        json!({
            "id": self.id,
            "model": self.model,
            "text": reply::text(pieces),
            "stop_reason": stop_reason(summary),
            "usage": usage(summary),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"0123456789abcdef-secret";

    fn headers<'a>(ts: &'a str, nonce: &'a str, sig: &'a str) -> Signed<'a> {
        Signed {
            timestamp: Some(ts),
            nonce: Some(nonce),
            signature: Some(sig),
            key_id: None,
        }
    }

    #[test]
    fn signatures_windows_and_nonces_are_enforced() {
        let v = Verifier::new(Secrets::One(SECRET.to_vec()), 300).unwrap();
        let body = br#"{"userInput":"hi"}"#;
        let nonce = "nonce-0000000000000001";
        let sig = sign(SECRET, &canonical("POST", PATH, "1000", nonce, body));
        let h = headers("1000", nonce, &sig);
        assert_eq!(v.check("POST", PATH, &h, body, 1010).unwrap(), None);
        let replay = v.check("POST", PATH, &h, body, 1011).unwrap_err();
        assert!(replay.message.contains("replay"), "{replay:?}");
        // A changed body, path, method or secret breaks the signature.
        let n2 = "nonce-0000000000000002";
        let sig2 = sign(SECRET, &canonical("POST", PATH, "1000", n2, body));
        for (m, p, b) in [
            ("POST", PATH, &br#"{"userInput":"ho"}"#[..]),
            ("POST", "/v1/messages", &body[..]),
            ("GET", PATH, &body[..]),
        ] {
            let e = v
                .check(m, p, &headers("1000", n2, &sig2), b, 1000)
                .unwrap_err();
            assert_eq!(e.status, 401);
            assert!(e.message.contains("does not match"), "{e:?}");
        }
        let other = sign(
            b"another-secret-of-16+",
            &canonical("POST", PATH, "1000", n2, body),
        );
        assert!(
            v.check("POST", PATH, &headers("1000", n2, &other), body, 1000)
                .is_err()
        );
        // Outside the window.
        let e = v
            .check("POST", PATH, &headers("1000", n2, &sig2), body, 1400)
            .unwrap_err();
        assert!(e.message.contains("window"), "{e:?}");
        // Missing headers, malformed nonce.
        let none = Signed {
            timestamp: None,
            nonce: None,
            signature: None,
            key_id: None,
        };
        assert_eq!(
            v.check("POST", PATH, &none, body, 1000).unwrap_err().status,
            401
        );
        let short = sign(SECRET, &canonical("POST", PATH, "1000", "short", body));
        assert!(
            v.check("POST", PATH, &headers("1000", "short", &short), body, 1000)
                .is_err()
        );
        // The refused attempts did not burn the nonce: the right request still passes once.
        v.check("POST", PATH, &headers("1000", n2, &sig2), body, 1000)
            .unwrap();
        assert!(Verifier::new(Secrets::One(b"short".to_vec()), 300).is_err());
        let named = |id| Signed {
            key_id: Some(id),
            ..headers("1000", "nonce-0000000000000003", &sig2)
        };
        assert!(v.check("POST", PATH, &named("ops"), body, 1000).is_err());
    }

    #[test]
    fn named_keys_tell_their_clients_apart() {
        let (ops, app) = (b"ops-secret-0123456789".to_vec(), SECRET.to_vec());
        let v = Verifier::new(
            Secrets::Named(vec![
                ("ops".into(), ops.clone()),
                ("app".into(), app.clone()),
            ]),
            300,
        )
        .unwrap();
        let body = b"{}";
        let signed = |key: &[u8], nonce: &str| {
            sign(key, &canonical("GET", "/v1/models", "1000", nonce, body))
        };
        let request = |id, nonce: &'static str, sig: &str| {
            let h = Signed {
                key_id: id,
                ..headers("1000", nonce, sig)
            };
            v.check("GET", "/v1/models", &h, body, 1000)
                .map(|id| id.map(str::to_string))
        };
        let (n1, n2, n3) = (
            "nonce-named-000000001",
            "nonce-named-000000002",
            "nonce-named-000000003",
        );
        assert_eq!(
            request(Some("app"), n1, &signed(&app, n1))
                .unwrap()
                .as_deref(),
            Some("app")
        );
        assert_eq!(
            request(Some("ops"), n2, &signed(&ops, n2))
                .unwrap()
                .as_deref(),
            Some("ops")
        );
        // One key's signature under another's id, an unknown id, or no id: 401.
        let e = request(Some("ops"), n3, &signed(&app, n3)).unwrap_err();
        assert!(e.message.contains("does not match"), "{e:?}");
        let e = request(Some("nobody"), n3, &signed(&app, n3)).unwrap_err();
        assert!(e.message.contains("no HMAC key `nobody`"), "{e:?}");
        let e = request(None, n3, &signed(&app, n3)).unwrap_err();
        assert!(e.message.contains(KEY_ID), "{e:?}");
        let short = Secrets::Named(vec![("a".into(), b"short".to_vec())]);
        let e = Verifier::new(short, 300).err().unwrap();
        assert!(e.contains("`a`"), "{e}");
    }

    #[test]
    fn bodies_map_to_a_chat_with_cached_blocks() {
        let models = vec!["tiny".to_string()];
        let p = parse(
            br#"{"system":"Be exact.","blocks":["Doc one.",{"text":"Doc two.","cache":false}],
                "userInput":"Sum up.","max_tokens":5,"temperature":0,"stream":true}"#,
            &models,
            64,
        )
        .unwrap();
        let r = &p.request;
        assert!(p.stream);
        assert_eq!(r.model.as_str(), "tiny");
        assert_eq!(r.messages[0].content.as_str(), "Be exact.");
        assert_eq!(
            r.messages[1].content.as_str(),
            "Doc one.\n\nDoc two.\n\nSum up."
        );
        let b: Vec<(u32, u32)> = r
            .cache_breakpoints
            .iter()
            .map(|b| (b.turn, b.offset))
            .collect();
        assert_eq!(b, vec![(0, 9), (1, 10)]);
        assert_eq!(r.max_tokens, 5);
        for bad in [
            r#"{"system":"x"}"#,
            r#"{"userInput":3}"#,
            r#"{"userInput":"x","blocks":"doc"}"#,
            r#"{"userInput":"x","model":"other"}"#,
            r#"{"userInput":"x","blocks":[{"text":"d","cache":"yes"}]}"#,
        ] {
            assert!(parse(bad.as_bytes(), &models, 8).is_err(), "{bad}");
        }
    }
}
