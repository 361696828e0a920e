//! Images in requests: OpenAI's `image_url` content parts and Anthropic's `image` blocks carry
//! the image inline (a `data:` URL, a base64 `source`). A remote URL is refused with a message
//! saying why: this server opens no outbound connections (its deployment grants no
//! `net.connect`), so it cannot fetch one — and fetching it would leak the prompt's existence.

use crate::error::ApiError;
use base64::Engine as _;
use serde_json::Value;

/// Why a remote image is refused, and what to send instead.
const NO_FETCH: &str = "images are not fetched from URLs: this server makes no outbound \
                        connections. Send the image inline";

/// The bytes of base64 `data` (standard alphabet; whitespace, such as line breaks, ignored).
fn decoded(data: &str, at: &str) -> Result<Vec<u8>, ApiError> {
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .map_err(|e| ApiError::param(at, format!("`{at}` is not valid base64 ({e})")))?;
    if bytes.is_empty() {
        return Err(ApiError::param(at, format!("`{at}` holds an empty image")));
    }
    Ok(bytes)
}

/// The image an OpenAI `image_url` part carries: `{"url": "data:image/png;base64,…"}` (or the
/// URL string itself).
pub fn openai_part(part: &Value, at: &str) -> Result<Vec<u8>, ApiError> {
    let url = match part.get("image_url") {
        Some(Value::String(url)) => url.as_str(),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(url)) => url.as_str(),
            _ => {
                return Err(ApiError::param(
                    at,
                    format!("`{at}.image_url.url` must be a string"),
                ));
            }
        },
        _ => {
            return Err(ApiError::param(
                at,
                format!("`{at}.image_url` must be {{\"url\": \"data:…\"}}"),
            ));
        }
    };
    data_url(url, &format!("{at}.image_url.url"))
}

/// The bytes of a `data:[<media type>];base64,<data>` URL.
pub fn data_url(url: &str, at: &str) -> Result<Vec<u8>, ApiError> {
    let Some(rest) = url.strip_prefix("data:") else {
        let shown: String = url.chars().take(40).collect();
        return Err(ApiError::param(
            at,
            format!("{NO_FETCH} as a data: URL (data:image/png;base64,…), not `{shown}`"),
        ));
    };
    let (head, data) = rest.split_once(',').ok_or_else(|| {
        ApiError::param(
            at,
            format!("`{at}` is a data: URL without a `,` before its data"),
        )
    })?;
    if !head.split(';').any(|p| p == "base64") {
        return Err(ApiError::param(
            at,
            format!("`{at}` must be a base64 data: URL (data:image/png;base64,…)"),
        ));
    }
    decoded(data, at)
}

/// The image an Anthropic `image` block carries:
/// `{"source": {"type": "base64", "media_type": "image/png", "data": "…"}}`.
pub fn anthropic_block(
    block: &serde_json::Map<String, Value>,
    at: &str,
) -> Result<Vec<u8>, ApiError> {
    let source = match block.get("source") {
        Some(Value::Object(s)) => s,
        _ => {
            return Err(ApiError::param(
                at,
                format!("`{at}.source` must be an object"),
            ));
        }
    };
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => match source.get("data") {
            Some(Value::String(data)) => decoded(data, &format!("{at}.source.data")),
            _ => Err(ApiError::param(
                at,
                format!("`{at}.source.data` must be a base64 string"),
            )),
        },
        Some("url") => Err(ApiError::param(
            at,
            format!("{NO_FETCH} as a base64 source ({{\"type\": \"base64\", …}})"),
        )),
        other => Err(ApiError::param(
            at,
            format!(
                "`{at}.source.type` must be `base64`{}",
                other.map(|t| format!(", got `{t}`")).unwrap_or_default()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inline_images_decode_and_remote_ones_are_refused() {
        let part =
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO\nRw0K"}});
        assert_eq!(
            openai_part(&part, "p").unwrap(),
            [0x89, b'P', b'N', b'G', 0x0d, 0x0a]
        );
        let remote =
            json!({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}});
        let e = openai_part(&remote, "p").unwrap_err();
        assert!(
            e.message.contains("no outbound connections"),
            "{}",
            e.message
        );
        for bad in [
            "data:image/png,abc",
            "data:image/png;base64",
            "data:;base64,***",
            "data:;base64,",
        ] {
            assert!(data_url(bad, "u").is_err(), "{bad}");
        }
        let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}});
        assert_eq!(
            anthropic_block(block.as_object().unwrap(), "b")
                .unwrap()
                .len(),
            6
        );
        let url = json!({"type": "image", "source": {"type": "url", "url": "https://x/y.png"}});
        let e = anthropic_block(url.as_object().unwrap(), "b").unwrap_err();
        assert!(
            e.message.contains("no outbound connections"),
            "{}",
            e.message
        );
    }
}
