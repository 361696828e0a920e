//! OpenAI's image variation API, `POST /v1/images/variations`: a `multipart/form-data` body
//! (parsed with `multer`) holding the `image` file to vary, `model`, `n` (1–10 images, image
//! `i` from seed `seed + i`), `size` (`"WxH"` or `"auto"`), `response_format` (`b64_json`
//! only) and `user`; and U's own fields `steps`, `guidance_scale`, `seed` and `strength` (how
//! far a consistency model's variation strays). It is served by a pipeline that varies images
//! (Stable Diffusion's image variations) or a one-step consistency model; the answer is
//! [`crate::generations`]' `{created, data: [{b64_json, seed, …}]}`.

use crate::{error::ApiError, generations};
use base64::Engine as _;
use bytes::Bytes;
use serde_json::{Map, Value};

/// The form fields besides `image`, as OpenAI and U name them.
const FIELDS: &[&str] = &[
    "model",
    "n",
    "size",
    "response_format",
    "user",
    "steps",
    "guidance_scale",
    "seed",
    "strength",
];

/// The fields a form gives as numbers.
const NUMBERS: &[&str] = &["n", "steps", "guidance_scale", "seed", "strength"];

/// Parses the multipart body of a variation request into the generation request it is: no
/// prompt, the uploaded image as the image to vary.
pub async fn parse(
    content_type: Option<&str>,
    body: Bytes,
    models: &[String],
) -> Result<generations::Parsed, ApiError> {
    let content_type = content_type.unwrap_or("");
    let boundary = multer::parse_boundary(content_type).map_err(|_| {
        ApiError::invalid(format!(
            "the body must be multipart/form-data with a boundary (got content type \
             `{content_type}`)"
        ))
    })?;
    let stream = futures_util::stream::once(async move { Ok::<Bytes, std::io::Error>(body) });
    let mut parts = multer::Multipart::new(stream, boundary);
    let bad = |e: multer::Error| ApiError::invalid(format!("malformed multipart body: {e}"));
    let mut image = None;
    let mut fields = Map::new();
    fields.insert("prompt".into(), Value::String(String::new()));
    while let Some(field) = parts.next_field().await.map_err(bad)? {
        let name = field.name().unwrap_or("").to_string();
        if name == "image" {
            if image.is_some() {
                return Err(ApiError::param("image", "more than one `image` part"));
            }
            image = Some(field.bytes().await.map_err(bad)?);
            continue;
        }
        if !FIELDS.contains(&name.as_str()) {
            return Err(ApiError::param(
                &name,
                format!(
                    "unknown form field `{name}` (known: image, {})",
                    FIELDS.join(", ")
                ),
            ));
        }
        if fields.contains_key(&name) {
            return Err(ApiError::param(
                &name,
                format!("more than one `{name}` field"),
            ));
        }
        let text = field.text().await.map_err(bad)?;
        let value = match NUMBERS.contains(&name.as_str()) {
            true => serde_json::from_str::<Value>(text.trim())
                .ok()
                .filter(Value::is_number)
                .ok_or_else(|| {
                    ApiError::param(&name, format!("`{name}` must be a number, got `{text}`"))
                })?,
            false => Value::String(text),
        };
        fields.insert(name, value);
    }
    let image = image.ok_or_else(|| ApiError::param("image", "the form has no `image` part"))?;
    if image.is_empty() {
        return Err(ApiError::param("image", "the uploaded image is empty"));
    }
    let encoded = base64::engine::general_purpose::STANDARD.encode(&image);
    fields.insert("image".into(), Value::String(encoded));
    let json = serde_json::to_vec(&Value::Object(fields))
        .map_err(|e| ApiError::invalid(format!("the form: {e}")))?;
    generations::parse(&json, models)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDARY: &str = "XyZ";

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(f)
    }

    fn form(parts: &[(&str, &[u8])]) -> Bytes {
        let mut body = Vec::new();
        for (name, value) in parts {
            let file = match *name {
                "image" => "; filename=\"a.png\"\r\nContent-Type: image/png",
                _ => "",
            };
            body.extend_from_slice(
                format!(
                    "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"{file}\r\n\r\n"
                )
                .as_bytes(),
            );
            body.extend_from_slice(value);
            body.extend_from_slice(b"\r\n");
        }
        body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
        body.into()
    }

    fn run(parts: &[(&str, &[u8])]) -> Result<generations::Parsed, ApiError> {
        let content = format!("multipart/form-data; boundary={BOUNDARY}");
        let models = vec!["sd".to_string()];
        block_on(parse(Some(&content), form(parts), &models))
    }

    #[test]
    fn a_form_becomes_a_request_to_vary_its_image() {
        let p = run(&[
            ("image", b"\x89PNG bytes"),
            ("model", b"sd"),
            ("n", b"2"),
            ("size", b"64x32"),
            ("steps", b"4"),
            ("seed", b"9"),
            ("guidance_scale", b"3"),
            ("response_format", b"b64_json"),
        ])
        .expect("parsed");
        let r = &p.request;
        assert_eq!(r.init_image.as_slice(), b"\x89PNG bytes");
        assert_eq!((r.prompt.as_str(), r.model.as_str()), ("", "sd"));
        assert_eq!((r.width, r.height, r.steps, r.seed), (64, 32, 4, 9));
        assert_eq!((r.guidance_scale, p.n, p.stream), (3.0, 2, false));
    }

    #[test]
    fn bad_forms_name_their_field() {
        for (parts, field) in [
            (&[("model", &b"sd"[..])][..], "image"),
            (&[("image", &b""[..])][..], "image"),
            (&[("image", &b"x"[..]), ("image", &b"y"[..])][..], "image"),
            (
                &[("image", &b"x"[..]), ("prompt", &b"a cat"[..])][..],
                "prompt",
            ),
            (&[("image", &b"x"[..]), ("n", &b"two"[..])][..], "n"),
            (&[("image", &b"x"[..]), ("n", &b"11"[..])][..], "n"),
            (&[("image", &b"x"[..]), ("size", &b"big"[..])][..], "size"),
            (&[("image", &b"x"[..]), ("steps", &b"0"[..])][..], "steps"),
            (
                &[("image", &b"x"[..]), ("response_format", &b"url"[..])][..],
                "response_format",
            ),
            (
                &[
                    ("image", &b"x"[..]),
                    ("seed", &b"1"[..]),
                    ("seed", &b"2"[..]),
                ][..],
                "seed",
            ),
        ] {
            let e = run(parts).err().expect("refused");
            assert_eq!(e.param.as_deref(), Some(field), "{}", e.message);
        }
        let e = run(&[("image", b"x"), ("model", b"dall-e-2")])
            .err()
            .unwrap();
        assert_eq!(e.status, 404, "{}", e.message);
        let content = Some("application/json");
        let e = block_on(parse(content, Bytes::new(), &[])).err().unwrap();
        assert!(e.message.contains("multipart"), "{}", e.message);
    }
}
