//! LLaVA-style prefix fusion served end to end: `u-runner serve` on the tiny random LLaVA of
//! `tests/fixtures/llava_tiny/` builds its decoder with arch-llama (family `llava`) and its image
//! encoder with arch-vit (`llava.vision`) from the one checkpoint, and runner-text serves images
//! sent by the official clients — OpenAI `image_url` parts and Anthropic `image` blocks, inline
//! as data. The greedy answer about a PNG equals transformers' `LlavaForConditionalGeneration`
//! on the same file, preprocessed by PIL as CLIPImageProcessor does
//! (`gen_llava_serve.py`); the second request with the same image reads the image's positions
//! from the prefix cache (reported as cached tokens) and its rows from the encoder-output cache
//! (`u_image_cache_hits_total`). Corrupt and remote images, images sent to a text model, and
//! text that spells the image marker are refused with a 400, and the server serves on.

use serde_json::Value;
use std::path::{Path, PathBuf};
use u_conformance::{
    plugin, root,
    serving::{Options, PY_CLIENTS, http, post, python_client, start_tiny, start_with},
};

fn fixtures() -> PathBuf {
    root().join("tests/fixtures/llava_tiny")
}

fn expected() -> Value {
    serde_json::from_slice(&std::fs::read(fixtures().join("serve/expected.json")).unwrap()).unwrap()
}

/// The checkpoint and its tokenizer in one folder, served as `llava-tiny`.
fn llava_dir(dir: &Path) -> PathBuf {
    let model = dir.join("llava-tiny");
    std::fs::create_dir_all(&model).unwrap();
    for (from, name) in [
        ("model", "config.json"),
        ("model", "model.safetensors"),
        ("model", "preprocessor_config.json"),
        ("serve", "tokenizer.json"),
        ("serve", "tokenizer_config.json"),
    ] {
        std::fs::copy(fixtures().join(from).join(name), model.join(name)).unwrap();
    }
    model
}

fn data_url(bytes: &[u8]) -> String {
    use base64::Engine as _;
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn chat(image_url: &str, text: &str) -> Vec<u8> {
    serde_json::json!({
        "model": "llava-tiny",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": text},
        ]}],
    })
    .to_string()
    .into_bytes()
}

#[test]
fn official_clients_chat_about_an_image() {
    let dir = tempfile::tempdir().unwrap();
    let model = llava_dir(dir.path());
    let options = Options {
        plugins: format!("[[plugins]]\npath = \"{}\"\n", plugin("arch-vit").display()),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let want = expected();
    let png = fixtures().join("serve/picture.png");
    let script = r#"
import base64, json, os
data = base64.b64encode(open(os.environ["U_PNG"], "rb").read()).decode()
question, n = os.environ["U_QUESTION"], int(os.environ["U_MAX"])
oai = openai_client()
parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
         {"type": "text", "text": question}]
runs = [oai.chat.completions.create(model="llava-tiny", messages=[{"role": "user", "content": parts}],
                                    max_tokens=n, temperature=0) for _ in range(2)]
ant = anthropic_client().messages.create(model="llava-tiny", max_tokens=n, extra_body={"temperature": 0}, messages=[
    {"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": question}]}])
print(json.dumps({
    "openai": [r.choices[0].message.content for r in runs],
    "usage": [r.usage.model_dump() for r in runs],
    "anthropic": ant.content[0].text,
    "anthropic_usage": ant.usage.model_dump(),
}))
"#;
    let env = [
        ("U_KIND", "tcp"),
        ("U_SOCK", &*server.socket.display().to_string()),
        ("U_BASE", &*server.url()),
        ("U_PNG", &*png.display().to_string()),
        ("U_QUESTION", want["question"].as_str().unwrap()),
        ("U_MAX", &*want["max_tokens"].to_string()),
    ];
    let got = python_client(&format!("{PY_CLIENTS}\n{script}"), &env, &server);
    let text = want["text"].as_str().unwrap();
    assert_eq!(got["openai"][0], text, "{got}\n{}", server.log());
    assert_eq!(got["openai"][1], text, "{got}");
    assert_eq!(got["anthropic"], text, "{got}");
    let prompt = want["prompt_tokens"].as_u64().unwrap();
    let rows = want["image_rows"].as_u64().unwrap();
    assert_eq!(got["usage"][0]["prompt_tokens"], prompt, "{got}");
    assert_eq!(
        got["usage"][0]["prompt_tokens_details"]["cached_tokens"], 0,
        "{got}"
    );
    // Everything but the last prompt token (which always runs) comes from the cache, the
    // image's positions with it.
    let cached = got["usage"][1]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, prompt - 1, "{got}");
    assert!(cached > rows);
    assert!(
        got["anthropic_usage"]["cache_read_input_tokens"]
            .as_u64()
            .unwrap()
            > rows,
        "{got}"
    );
    let (_, metrics) = http(
        server.port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let hits = metrics
        .lines()
        .find_map(|l| l.strip_prefix("u_image_cache_hits_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .expect("u_image_cache_hits_total in /metrics");
    assert_eq!(hits, 2, "the second and third requests encode nothing");

    // Another image at the same place shares only the text before it.
    let other = std::fs::read(root().join("tests/fixtures/vision/dinov2_image.png")).unwrap();
    let (s, v) = post(
        server.port,
        "/v1/chat/completions",
        &chat(&data_url(&other), want["question"].as_str().unwrap()),
    );
    assert_eq!(s, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached < 8, "a different image reuses no image KV: {v}");

    let bytes = std::fs::read(&png).unwrap();
    for (body, says) in [
        (chat(&data_url(&bytes[..bytes.len() / 2]), "?"), "image"),
        (
            chat("https://example.com/cat.png", "?"),
            "no outbound connections",
        ),
        (
            serde_json::json!({"model": "llava-tiny", "max_tokens": 2, "messages": [
                {"role": "user", "content": "Look: <image> here"}]})
            .to_string()
            .into_bytes(),
            "image markers",
        ),
    ] {
        let (s, v) = post(server.port, "/v1/chat/completions", &body);
        assert_eq!(s, 400, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{message}");
    }
    let (s, v) = post(
        server.port,
        "/v1/chat/completions",
        &chat(&data_url(&bytes), "?"),
    );
    assert_eq!(s, 200, "serves on: {v}");
}

#[test]
fn a_text_model_refuses_images() {
    let server = start_tiny(&Options::default());
    let bytes = std::fs::read(fixtures().join("serve/picture.png")).unwrap();
    let mut body: Value = serde_json::from_slice(&chat(&data_url(&bytes), "?")).unwrap();
    body["model"] = "tiny-llama".into();
    let (s, v) = post(
        server.port,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("reads no images"), "{message}");
}

/// Flamingo-style fusion served: the tiny random IDEFICS of `tests/fixtures/idefics_tiny/plain`
/// (arch-llama builds its text side as a cross-decoder, arch-vit its vision tower as
/// `idefics.vision`; the host hands such a pair to runner-text). The chat template puts
/// IDEFICS' fake tokens around the image's `<image>`, the image's rows become the sequence's
/// cross-attention context, and the greedy answer about a PNG equals
/// `IdeficsForVisionText2Text`'s on the same file (`gen_idefics_serve.py`). Text alone and two
/// images are refused with a 400.
#[test]
fn a_flamingo_style_model_answers_about_an_image() {
    let fixtures = root().join("tests/fixtures/idefics_tiny");
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("idefics-tiny");
    std::fs::create_dir_all(&model).unwrap();
    for (from, name) in [
        ("plain/model", "config.json"),
        ("plain/model", "model.safetensors"),
        ("serve", "tokenizer.json"),
        ("serve", "tokenizer_config.json"),
    ] {
        std::fs::copy(fixtures.join(from).join(name), model.join(name)).unwrap();
    }
    let options = Options {
        plugins: format!("[[plugins]]\npath = \"{}\"\n", plugin("arch-vit").display()),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let want: Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("serve/expected.json")).unwrap())
            .unwrap();
    let png = std::fs::read(fixtures.join("serve/picture.png")).unwrap();
    let mut body: Value =
        serde_json::from_slice(&chat(&data_url(&png), want["question"].as_str().unwrap())).unwrap();
    body["model"] = "idefics-tiny".into();
    body["max_tokens"] = want["max_tokens"].clone();
    let (s, v) = post(
        server.port,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 200, "{v}\n{}", server.log());
    assert_eq!(v["choices"][0]["message"]["content"], want["text"], "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], want["prompt_tokens"], "{v}");

    let text = serde_json::json!({"model": "idefics-tiny", "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hello"}]});
    let mut two = body.clone();
    two["messages"][0]["content"]
        .as_array_mut()
        .unwrap()
        .insert(
            0,
            serde_json::json!({"type": "image_url", "image_url": {"url": data_url(&png)}}),
        );
    for (body, says) in [
        (text, "reads an image with every prompt"),
        (two, "2 images"),
    ] {
        let (s, v) = post(
            server.port,
            "/v1/chat/completions",
            body.to_string().as_bytes(),
        );
        assert_eq!(s, 400, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{message}");
    }
    let (s, v) = post(
        server.port,
        "/v1/chat/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 200, "serves on: {v}");
    assert_eq!(v["choices"][0]["message"]["content"], want["text"], "{v}");
}
