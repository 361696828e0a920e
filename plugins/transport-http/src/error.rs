//! Errors answered to clients, in the error shape of the API the client speaks.

use serde_json::{Value, json};
use u_sdk::ErrorKind;

/// Which wire format a request speaks; decides the shape of error bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI: `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// Anthropic: `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
    /// Safebox: `{"error": {"code", "message"}}`.
    Safebox,
}

/// An error answered to the client: HTTP status, message and the fields OpenAI adds.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// The message.
    pub message: String,
    /// OpenAI's error `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A machine-readable code, e.g. `model_not_found`.
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (sent as `Retry-After`).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// A 400 about field `param`.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    /// Another status with the same shape.
    pub fn status(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            ..Self::invalid(message)
        }
    }

    /// 401: missing or wrong request authentication.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            code: Some("unauthorized"),
            ..Self::status(401, "authentication_error", message)
        }
    }

    /// 404 for a model that is not served.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: 404,
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..Self::invalid(format!(
                "The model `{model}` does not exist or you do not have access to it."
            ))
        }
    }

    /// The engine's error as an HTTP answer; a full queue becomes 429 with `Retry-After`.
    pub fn from_engine(e: &u_sdk::UError) -> Self {
        let (status, kind) = match e.kind {
            ErrorKind::NotFound => (404, "invalid_request_error"),
            ErrorKind::AlreadyExists => (409, "invalid_request_error"),
            // What the deployment does not allow (an adapter outside its directories).
            ErrorKind::PermissionDenied => (403, "permission_error"),
            ErrorKind::InvalidInput | ErrorKind::Unsupported | ErrorKind::ResourceExhausted => {
                (400, "invalid_request_error")
            }
            ErrorKind::Busy => {
                return Self {
                    code: Some("rate_limit_exceeded"),
                    retry_after: Some(1),
                    ..Self::status(429, "rate_limit_error", e.message.to_string())
                };
            }
            // The server's own trouble: the client learns what failed, not where on its disks.
            _ => return Self::status(500, "server_error", without_paths(&e.message)),
        };
        Self::status(status, kind, e.message.to_string())
    }

    /// The JSON body in `dialect`'s shape.
    pub fn body(&self, dialect: Dialect) -> Value {
        match dialect {
            Dialect::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }}),
            Dialect::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.message},
            }),
            Dialect::Safebox => json!({"error": {
                "code": self.code.unwrap_or(self.kind),
                "message": self.message,
            }}),
        }
    }

    /// Anthropic's error type for this status.
    fn anthropic_type(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }
}

/// `message` with every absolute file path (a word starting with `/` that has another `/`)
/// replaced by `<path>`, so 500-class answers do not tell clients the server's file layout.
pub fn without_paths(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find('/') {
        let starts_word = rest[..at]
            .chars()
            .next_back()
            .is_none_or(|c| c.is_whitespace() || "\"'(`[{=:".contains(c));
        let end = rest[at..]
            .find(|c: char| c.is_whitespace() || "\"'`)]},;".contains(c))
            .map_or(rest.len(), |e| at + e);
        let word = rest[at..end].trim_end_matches([':', '.']);
        out.push_str(&rest[..at]);
        if starts_word && word[1..].contains('/') {
            out.push_str("<path>");
            rest = &rest[at + word.len()..];
        } else {
            out.push('/');
            rest = &rest[at + 1..];
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_do_not_show_server_paths() {
        let e = u_sdk::UError::new(
            ErrorKind::Io,
            "cache-kv: mmap /srv/kv/o-9463fd1432e88892.private.ukv: Input/output error (read /srv/x/y: denied)",
        );
        let a = ApiError::from_engine(&e);
        assert_eq!(a.status, 500);
        assert_eq!(
            a.message,
            "cache-kv: mmap <path>: Input/output error (read <path>: denied)"
        );
        assert_eq!(
            without_paths("top_p / temperature and a/b"),
            "top_p / temperature and a/b"
        );
        assert_eq!(without_paths("at /tmp/k, then"), "at <path>, then");
        let not_found = u_sdk::UError::not_found("no checkpoint named \"a/b\"");
        assert_eq!(
            ApiError::from_engine(&not_found).message,
            "no checkpoint named \"a/b\""
        );
    }

    #[test]
    fn each_dialect_has_its_error_shape() {
        let e = ApiError::param("max_tokens", "too small");
        let o = e.body(Dialect::OpenAi);
        assert_eq!(o["error"]["param"], "max_tokens");
        assert_eq!(o["error"]["type"], "invalid_request_error");
        let a = ApiError::model_not_found("x").body(Dialect::Anthropic);
        assert_eq!(a["type"], "error");
        assert_eq!(a["error"]["type"], "not_found_error");
        let s = ApiError::unauthorized("bad signature").body(Dialect::Safebox);
        assert_eq!(s["error"]["code"], "unauthorized");
        let busy = ApiError::from_engine(&u_sdk::UError::new(ErrorKind::Busy, "queue full"));
        assert_eq!((busy.status, busy.retry_after), (429, Some(1)));
        assert_eq!(
            busy.body(Dialect::Anthropic)["error"]["type"],
            "rate_limit_error"
        );
    }
}
