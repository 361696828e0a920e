//! Who may call: API keys and browser origins (CORS).
//!
//! API keys (`api_keys_file` in the plugin config, a file under its `fs.read` grant): one key
//! a line as `NAME KEY` (whitespace between; `#` starts a comment line). A request carries its
//! key as `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's header); a missing or
//! wrong key is answered 401 in the API's error shape. The key's name is the request's client
//! identity (its fair-queueing key). `GET /health` and CORS preflights need no key.
//!
//! CORS (`cors_allow_origins`, a list of origins such as `https://app.example`, or `*`): a
//! request whose `Origin` is listed (or is the server's own, from `Host`) gets
//! `Access-Control-Allow-Origin`; a preflight `OPTIONS` from it is answered 204 with the
//! allowed methods and headers; any other origin is refused with 403. Without the setting no
//! CORS headers are sent and origins are not checked.

use crate::error::ApiError;
use hyper::{
    HeaderMap, Method,
    header::{self, HeaderValue},
};

/// The API keys, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys(Vec<(String, Vec<u8>)>);

/// Shortest key accepted.
pub const MIN_KEY_BYTES: usize = 16;

impl Keys {
    /// Parses a key file's text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys: Vec<(String, Vec<u8>)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(name), Some(key), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("line {}: expected `NAME KEY`", i + 1));
            };
            if key.len() < MIN_KEY_BYTES {
                return Err(format!(
                    "line {}: the key of `{name}` is {} bytes; at least {MIN_KEY_BYTES} are required",
                    i + 1,
                    key.len()
                ));
            }
            if keys.iter().any(|(n, _)| n == name) {
                return Err(format!("line {}: the name `{name}` is used twice", i + 1));
            }
            keys.push((name.to_string(), key.as_bytes().to_vec()));
        }
        if keys.is_empty() {
            return Err("the file holds no keys".into());
        }
        Ok(Self(keys))
    }

    /// The keys, name and bytes, in the file's order.
    pub fn entries(&self) -> &[(String, Vec<u8>)] {
        &self.0
    }

    /// The keys' names, in the file's order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(name, _)| name.as_str())
    }

    /// The name of the key `headers` carry, or a 401.
    pub fn check(&self, headers: &HeaderMap) -> Result<&str, ApiError> {
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let given = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        let Some(given) = given else {
            return Err(ApiError::unauthorized(
                "an API key is required: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
            ));
        };
        // Every key is compared in full, so timing tells nothing about which one is close.
        let mut found = None;
        for (name, key) in &self.0 {
            if constant_time_eq(key, given.trim().as_bytes()) {
                found = Some(name.as_str());
            }
        }
        found.ok_or_else(|| ApiError::unauthorized("the API key is not valid"))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The CORS allow-list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cors {
    /// Allowed origins (`*`: any).
    pub origins: Vec<String>,
}

/// What CORS says about one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a cross-origin browser request, or CORS is not configured: nothing to add.
    Plain,
    /// An allowed origin: echo it back.
    Allowed(HeaderValue),
}

impl Cors {
    /// Whether an allow-list is configured.
    pub fn enabled(&self) -> bool {
        !self.origins.is_empty()
    }

    /// Checks the request's `Origin`; a listed origin, or the server's own, is allowed, any
    /// other is a 403.
    pub fn check(&self, headers: &HeaderMap) -> Result<Verdict, ApiError> {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(Verdict::Plain);
        };
        if !self.enabled() {
            return Ok(Verdict::Plain);
        }
        let text = origin.to_str().unwrap_or_default();
        let own = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .is_some_and(|host| {
                text.strip_prefix("http://")
                    .or_else(|| text.strip_prefix("https://"))
                    == Some(host)
            });
        if own || self.origins.iter().any(|o| o == "*" || o == text) {
            Ok(Verdict::Allowed(origin.clone()))
        } else {
            Err(ApiError::status(
                403,
                "permission_error",
                format!("the origin `{text}` is not allowed"),
            ))
        }
    }
}

/// Headers a browser may send cross-origin.
pub const ALLOW_HEADERS: &str = "authorization, content-type, x-api-key, anthropic-version, \
    anthropic-beta, x-stainless-arch, x-stainless-lang, x-stainless-os, \
    x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, \
    x-stainless-runtime-version, x-stainless-timeout, openai-organization, openai-project";

/// Adds the allow headers of an allowed origin to `h`; for a preflight also the methods
/// (`allows` and `OPTIONS`), headers and how long to cache the answer.
pub fn allow(h: &mut HeaderMap, origin: HeaderValue, preflight: Option<&[Method]>) {
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if let Some(methods) = preflight {
        let mut list: Vec<&str> = methods.iter().map(Method::as_str).collect();
        list.push("OPTIONS");
        if let Ok(v) = HeaderValue::from_str(&list.join(", ")) {
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, v);
        }
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(ALLOW_HEADERS),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from(600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn key_files_name_their_keys() {
        let keys = Keys::parse(
            "# team keys\nalice sk-alice-0123456789abcdef\n\nbob  sk-bob-0123456789abcdef0\n",
        )
        .unwrap();
        let h = headers(&[("authorization", "Bearer sk-alice-0123456789abcdef")]);
        assert_eq!(keys.check(&h).unwrap(), "alice");
        let h = headers(&[("x-api-key", "sk-bob-0123456789abcdef0")]);
        assert_eq!(keys.check(&h).unwrap(), "bob");
        let h = headers(&[("x-api-key", "sk-bob-0123456789abcdef1")]);
        assert_eq!(keys.check(&h).unwrap_err().status, 401);
        assert_eq!(keys.check(&HeaderMap::new()).unwrap_err().status, 401);
        assert!(Keys::parse("a short").unwrap_err().contains("at least"));
        assert!(
            Keys::parse("a k1234567890123456\na k1234567890123457")
                .unwrap_err()
                .contains("twice")
        );
        assert!(Keys::parse("# none\n").is_err());
        assert!(Keys::parse("a b c").is_err());
    }

    #[test]
    fn origins_are_checked_against_the_list() {
        let cors = Cors {
            origins: vec!["https://app.example".into()],
        };
        let ok = headers(&[("origin", "https://app.example")]);
        assert!(matches!(cors.check(&ok).unwrap(), Verdict::Allowed(_)));
        let own = headers(&[
            ("origin", "http://127.0.0.1:8080"),
            ("host", "127.0.0.1:8080"),
        ]);
        assert!(matches!(cors.check(&own).unwrap(), Verdict::Allowed(_)));
        let bad = headers(&[("origin", "https://evil.example")]);
        assert_eq!(cors.check(&bad).unwrap_err().status, 403);
        assert_eq!(cors.check(&HeaderMap::new()).unwrap(), Verdict::Plain);
        assert_eq!(Cors::default().check(&bad).unwrap(), Verdict::Plain);
    }
}
