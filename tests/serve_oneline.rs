//! Issue 15, the one-line start: `u-runner serve --model FILE --port P` builds its deployment in
//! memory from the signed plugins of the build tree, prints the capability proof it runs under
//! (naming what it granted) and serves the default model (SmolLM2) over plain HTTP; a model
//! path that does not exist is a clear error. SGLang's native API over the same server:
//! `/generate` (text or token ids, SGLang's sampling parameter names, streamed as SGLang streams,
//! `return_logprob`), `/get_model_info`, `/flush_cache`, and unsupported fields refused by name.

use serde_json::{Value, json};
use std::{
    io::{BufRead, BufReader, Write},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};
use u_conformance::{
    bin, run,
    serving::{free_port, http, post, smollm2_path},
    text,
};

/// `u-runner serve --model` running; killed when dropped.
struct OneLine {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
    model: PathBuf,
}

impl OneLine {
    /// What it printed on stdout (the proof).
    fn stdout(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout")).unwrap_or_default()
    }

    /// What it logged on stderr.
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }
}

impl Drop for OneLine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `u-runner serve --model <SmolLM2> --port <free>` with `extra` arguments and waits
/// for `/health`.
fn start(dir: tempfile::TempDir, extra: &[&str]) -> OneLine {
    let port = free_port();
    let model = smollm2_path();
    let child = Command::new(bin("u-runner"))
        .args(["serve", "--model"])
        .arg(&model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(extra)
        .env("NO_COLOR", "1")
        .stdout(std::fs::File::create(dir.path().join("stdout")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
        .spawn()
        .expect("start u-runner serve --model");
    let mut server = OneLine {
        child,
        dir,
        port,
        model,
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("u-runner serve exited early ({status}):\n{}", server.log());
        }
        if let Ok((200, _)) = http(
            port,
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ) {
            return server;
        }
        assert!(
            Instant::now() < deadline,
            "not ready after 90 s:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The served name of SmolLM2 (its file name without the extension).
const NAME: &str = "SmolLM2-135M-Instruct.Q4_1";

#[test]
fn one_line_serve_prints_its_proof_and_answers_chat() {
    let server = start(tempfile::tempdir().unwrap(), &[]);
    let proof = server.stdout();
    let model = server.model.display().to_string();
    for needle in [
        "deployment `serve`".to_string(),
        "[VERIFIED] loader-gguf".to_string(),
        format!("grants: fs.read: {model}"),
        format!(
            "grants: fs.read: /dev/null; net.listen: tcp:127.0.0.1:{}",
            server.port
        ),
        "effective capabilities:".to_string(),
        "no component can open an outbound network connection".to_string(),
    ] {
        assert!(proof.contains(&needle), "`{needle}` missing in:\n{proof}");
    }
    assert!(!proof.contains("[REFUSED]"), "{proof}");
    let (status, answer) = post(
        server.port,
        "/v1/chat/completions",
        json!({
            "model": NAME,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 8,
            "temperature": 0,
        })
        .to_string()
        .as_bytes(),
    );
    assert_eq!(status, 200, "{answer}\n{}", server.log());
    assert_eq!(answer["object"], "chat.completion");
    assert!(answer["choices"][0]["message"]["content"].is_string());
    assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
}

#[test]
fn one_line_serve_with_an_api_key_file_wants_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "alice sk-alice-0123456789abcdef\n").unwrap();
    let keys = keys.display().to_string();
    let server = start(dir, &["--api-key-file", &keys]);
    assert!(
        server
            .stdout()
            .contains(&format!("grants: fs.read: {keys}; net.listen")),
        "{}",
        server.stdout()
    );
    let models = |auth: &str| {
        http(
            server.port,
            format!("GET /v1/models HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .unwrap()
        .0
    };
    assert_eq!(models(""), 401);
    assert_eq!(
        models("Authorization: Bearer sk-alice-0123456789abcdef\r\n"),
        200
    );
}

#[test]
fn one_line_serve_without_the_model_is_a_clear_error() {
    let missing = "/nonexistent/model.gguf";
    let out = run(Command::new(bin("u-runner"))
        .args(["serve", "--model", missing, "--port", "1"])
        .stdin(Stdio::null()));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains(&format!("the model {missing} does not exist")),
        "{said}"
    );
    assert!(out.stdout.is_empty(), "nothing served or proven: {said}");
}

/// POSTs `body` to `/generate`: the status and the raw body.
fn generate(port: u16, body: &Value) -> (u16, String) {
    let body = body.to_string();
    http(
        port,
        format!(
            "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .unwrap()
}

#[test]
fn sglang_generate_model_info_and_flush_cache() {
    let server = start(tempfile::tempdir().unwrap(), &[]);
    let port = server.port;
    let params = json!({"temperature": 0, "max_new_tokens": 6, "top_k": -1, "top_p": 1.0});
    let (status, body) = generate(
        port,
        &json!({"text": "The capital of France is", "sampling_params": params}),
    );
    assert_eq!(status, 200, "{body}\n{}", server.log());
    let whole: Value = serde_json::from_str(&body).unwrap();
    let text = whole["text"].as_str().unwrap().to_string();
    assert!(!text.is_empty(), "{whole}");
    let meta = &whole["meta_info"];
    assert_eq!(meta["completion_tokens"], 6, "{whole}");
    assert_eq!(meta["finish_reason"]["type"], "length", "{whole}");
    assert!(meta["prompt_tokens"].as_u64().unwrap() > 1, "{whole}");
    let ids = whole["output_ids"].as_array().unwrap().clone();
    assert_eq!(ids.len(), 6, "{whole}");

    // The same prompt again hits the prefix cache; as token ids it gives the same tokens.
    let (_, again) = generate(
        port,
        &json!({"text": "The capital of France is", "sampling_params": params}),
    );
    let again: Value = serde_json::from_str(&again).unwrap();
    assert!(
        again["meta_info"]["cached_tokens"].as_u64().unwrap() > 0,
        "{again}"
    );
    let (status, prompt) = http(
        port,
        {
            let b = json!({"content": "The capital of France is"}).to_string();
            format!("POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}", b.len())
        }
        .as_bytes(),
    )
    .unwrap();
    assert_eq!(status, 200, "{prompt}");
    let prompt: Value = serde_json::from_str(&prompt).unwrap();
    let (status, by_ids) = generate(
        port,
        &json!({"input_ids": prompt["tokens"], "sampling_params": params}),
    );
    assert_eq!(status, 200, "{by_ids}");
    let by_ids: Value = serde_json::from_str(&by_ids).unwrap();
    assert_eq!(by_ids["output_ids"].as_array().unwrap(), &ids, "{by_ids}");

    // Streamed: `data:` lines with the whole text so far, the last with meta_info, then [DONE].
    let (status, streamed) = generate(
        port,
        &json!({"text": "The capital of France is", "sampling_params": params, "stream": true}),
    );
    assert_eq!(status, 200, "{streamed}");
    let lines: Vec<&str> = streamed
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(lines.last(), Some(&"[DONE]"), "{streamed}");
    let chunks: Vec<Value> = lines[..lines.len() - 1]
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(chunks.len() >= 2, "{streamed}");
    let mut previous = String::new();
    for c in &chunks {
        let t = c["text"].as_str().unwrap();
        assert!(t.starts_with(&previous), "{streamed}");
        previous = t.to_string();
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["text"], text.as_str(), "{streamed}");
    assert_eq!(last["meta_info"]["finish_reason"]["type"], "length");
    assert!(
        chunks[0]["meta_info"]["finish_reason"].is_null(),
        "{streamed}"
    );

    // return_logprob: [logprob, token_id, text] per generated token, top alternatives.
    let (status, scored) = generate(
        port,
        &json!({"text": "The capital of France is", "sampling_params": params,
            "return_logprob": true, "top_logprobs_num": 2, "return_text_in_logprobs": true}),
    );
    assert_eq!(status, 200, "{scored}");
    let scored: Value = serde_json::from_str(&scored).unwrap();
    let lp = scored["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(lp.len(), 6, "{scored}");
    assert!(lp[0][0].as_f64().unwrap() <= 0.0, "{scored}");
    assert_eq!(lp[0][1], ids[0], "{scored}");
    assert!(lp[0][2].is_string(), "{scored}");
    let top = scored["meta_info"]["output_top_logprobs"]
        .as_array()
        .unwrap();
    assert_eq!(top[0].as_array().unwrap().len(), 2, "{scored}");

    // A stop string (the end of the greedy text) ends generation and is named.
    let stop: String = text[text.len() - 3..].to_string();
    let (_, stopped) = generate(
        port,
        &json!({"text": "The capital of France is", "sampling_params":
            {"temperature": 0, "max_new_tokens": 6, "stop": [stop]}}),
    );
    let stopped: Value = serde_json::from_str(&stopped).unwrap();
    let finish = &stopped["meta_info"]["finish_reason"];
    assert_eq!(finish["type"], "stop", "{stopped}");
    assert_eq!(finish["matched"], stop.as_str(), "{stopped}");

    // Unsupported fields are 400s naming them.
    for (body, named) in [
        (json!({"text": "a", "image_data": "x.png"}), "image_data"),
        (json!({"text": ["a", "b"]}), "text"),
        (
            json!({"text": "a", "sampling_params": {"n": 2}}),
            "sampling_params.n",
        ),
        (
            json!({"text": "a", "sampling_params": {"ebnf": "x"}}),
            "sampling_params.ebnf",
        ),
        (
            json!({"text": "a", "return_logprob": true, "logprob_start_len": 0}),
            "logprob_start_len",
        ),
    ] {
        let (status, answer) = generate(port, &body);
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer.contains(named), "{body}: {answer}");
    }

    let (status, info) = http(
        port,
        b"GET /get_model_info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200, "{info}");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["model_path"], NAME);
    assert_eq!(info["is_generation"], true);
    let (status, flushed) = http(
        port,
        b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200, "{flushed}");
    assert!(flushed.starts_with("Cache flushed"), "{flushed}");
    // Flushed: the prompt that hit the cache before starts cold.
    let (_, cold) = generate(
        port,
        &json!({"text": "The capital of France is", "sampling_params": params}),
    );
    let cold: Value = serde_json::from_str(&cold).unwrap();
    assert_eq!(cold["meta_info"]["cached_tokens"], 0, "{cold}");
    assert_eq!(cold["output_ids"], again["output_ids"], "{cold}");
    // While a request streams, the flush is refused (SGLang's 400), and the request goes on.
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let b = json!({"text": "Once upon a time", "stream": true,
                   "sampling_params": {"max_new_tokens": 400, "temperature": 0}})
    .to_string();
    write!(
        stream,
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    let mut lines = BufReader::new(stream).lines();
    assert!(
        lines.any(|l| l.unwrap().starts_with("data: {")),
        "no first chunk"
    );
    let (status, busy) = http(
        port,
        b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 400, "{busy}");
    assert!(busy.contains("not flushed"), "{busy}");
    assert!(
        lines.any(|l| l.unwrap() == "data: [DONE]"),
        "the stream went on"
    );

    // One log line per request: method, path, status, tokens in (cached) and out, time.
    let log = server.log();
    let cached = again["meta_info"]["cached_tokens"].as_u64().unwrap();
    let prompt_tokens = again["meta_info"]["prompt_tokens"].as_u64().unwrap();
    for needle in [
        format!("POST /generate 200 in={prompt_tokens} cached={cached} out=6 "),
        "POST /generate 400 ".to_string(),
        "GET /get_model_info 200 ".to_string(),
    ] {
        assert!(log.contains(&needle), "`{needle}` missing in:\n{log}");
    }
    assert!(
        log.lines().any(|l| l.contains("POST /generate 200")
            && l.contains("ms plugin=\"transport-http\"")),
        "{log}"
    );
}
