//! Issue 15, the one-line start: `u-runner serve --model FILE --port P` builds its deployment in
//! memory from the signed plugins of the build tree, prints the capability proof it runs under
//! (naming what it granted) and serves the default model (SmolLM2) over plain HTTP; a model
//! path that does not exist is a clear error.

use serde_json::json;
use std::{
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
