//! # transport-http — OpenAI, Anthropic and Safebox APIs over HTTP/1.1 with SSE streaming
//!
//! The transport serves every listening socket the host opened for its `net.listen` grant
//! (TCP and Unix sockets alike); it never creates a socket itself, which the sandbox would
//! refuse after lock-down anyway. HTTP runs on `hyper` over a `tokio` runtime that lives inside
//! this plugin only.
//!
//! Endpoints:
//! - OpenAI: `POST /v1/chat/completions`, `POST /v1/completions` (streaming or not, logprobs,
//!   stop sequences, `logit_bias`, usage with cached prompt tokens; `n`, `best_of`, batched
//!   prompts and `echo` in [`choices`]), `POST /v1/embeddings` ([`tokens`]),
//!   `GET /v1/models[/{id}]` ([`openai`]), `POST /v1/audio/transcriptions` and
//!   `POST /v1/audio/translations` (multipart uploads; [`audio`]),
//!   `POST /v1/images/generations` ([`generations`]) and `POST /v1/images/variations`
//!   (multipart uploads; [`variations`]); options not implemented are refused by name;
//! - Anthropic: `POST /v1/messages` with prompt-caching breakpoints and assistant prefill,
//!   `POST /v1/messages/count_tokens` ([`anthropic`]);
//! - llama-server's `POST /tokenize` and `POST /detokenize` ([`tokens`]);
//! - SGLang: `POST /generate`, `GET /get_model_info`, `POST /flush_cache` ([`sglang`]);
//! - Safebox: `POST /v1/safebox/llm`, and HMAC authentication of every request once a secret
//!   is configured ([`safebox`]; wire format in `docs/safebox-protocol.md`);
//! - KV checkpoints: `/v1/checkpoints…` ([`checkpoints`]); `GET /health`; `GET /metrics`
//!   (Prometheus text, [`metrics`]).
//!
//! Chat messages travel to the engine as messages (`GenerateRequest::messages`): the engine
//! renders them with the model's own chat template, so this plugin holds no model-specific
//! logic.
//!
//! Limits and settings (plugin config, TOML): `max_body_bytes` (default 1 MiB; larger bodies
//! get 413), `max_audio_bytes` (default 25 MiB, as OpenAI's: the audio endpoints' bodies), `header_read_timeout_ms` (default 10 s; a client that drips its headers slower is
//! cut off), `body_read_timeout_ms` (default 30 s; 408), `default_max_tokens` (default 256),
//! `shutdown_grace_ms` (default 60 s: how long in-flight streams may run after the shutdown
//! signal before the connections are dropped), `hmac_secret_file` (a file under the plugin's
//! `fs.read` grant; when set, every request must be signed) or `hmac_keys_file` (several named
//! HMAC keys, `ID KEY` a line, each a client of its own), `hmac_window_s` (default 300: the
//! replay window), `api_keys_file` and `cors_allow_origins` ([`access`]), `admin_clients`
//! (clients in the admin scope, who list and manage every client's checkpoints: `key:NAME`
//! for an API key, `hmac:ID` for an HMAC key, `unix:uid=N` for a Unix peer).
//!
//! Every request is logged through the host at info level on one line when it ends: method,
//! path, status, for a generation its prompt, cached and generated tokens, and milliseconds.
//!
//! The engine's calls block, so each request runs on `spawn_blocking` and its tokens stream
//! back through a channel; a client that goes away drops the channel, which cancels the
//! generation at the next token. A full engine queue is answered 429 with `Retry-After`.
#![deny(missing_docs)]

pub mod access;
pub mod anthropic;
pub mod audio;
mod bridge;
pub mod checkpoints;
pub mod choices;
pub mod error;
pub mod generations;
pub mod images;
pub mod json;
pub mod metrics;
pub mod openai;
pub mod reply;
pub mod safebox;
mod server;
pub mod sglang;
pub mod tokens;
pub mod tools;
pub mod variations;

use u_sdk::{HostBox, PluginInfo, PluginInstance, Result, TransportBox, UError};

u_sdk::export_plugin! {
    manifest: "plugin.toml",
    describe: describe,
    instantiate: instantiate,
}

fn describe() -> PluginInfo {
    PluginInfo {
        summary: "OpenAI, Anthropic and Safebox APIs over HTTP/1.1 + SSE".into(),
        details: vec![
            "GET /health".into(),
            "GET /metrics".into(),
            "GET /v1/models".into(),
            "POST /v1/completions".into(),
            "POST /v1/chat/completions".into(),
            "POST /v1/embeddings".into(),
            "POST /v1/audio/transcriptions, POST /v1/audio/translations".into(),
            "POST /v1/images/generations, POST /v1/images/variations".into(),
            "POST /v1/messages".into(),
            "POST /v1/messages/count_tokens".into(),
            "POST /tokenize".into(),
            "POST /detokenize".into(),
            "POST /generate, GET /get_model_info, POST /flush_cache (SGLang)".into(),
            "POST /v1/safebox/llm".into(),
            "GET|POST /v1/checkpoints, POST /v1/checkpoints/{fork,graft}, DELETE /v1/checkpoints/{name}".into(),
        ]
        .into(),
    }
}

/// The transport's settings, from the deployment's `[plugins.config]` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Largest body of the audio endpoints (an uploaded recording).
    pub max_audio_bytes: usize,
    /// Time a client has to send a request's headers.
    pub header_read_timeout_ms: u64,
    /// Time a client has to send a request's body.
    pub body_read_timeout_ms: u64,
    /// `max_tokens` when a request does not say.
    pub default_max_tokens: u32,
    /// How long in-flight requests may run after shutdown is requested.
    pub shutdown_grace_ms: u64,
    /// A file holding the HMAC secret; when set, every request must be signed.
    pub hmac_secret_file: Option<String>,
    /// A file of named HMAC keys (`ID KEY` a line); when set, every request must be signed
    /// with one, named in `x-safebox-key-id`.
    pub hmac_keys_file: Option<String>,
    /// Largest allowed distance, seconds, between a signed request's timestamp and the clock.
    pub hmac_window_s: u64,
    /// A file of named API keys ([`access`]); when set, every request but `GET /health` needs
    /// one.
    pub api_keys_file: Option<String>,
    /// Origins browsers may call from (CORS, [`access`]); empty: no CORS.
    pub cors_allow_origins: Vec<String>,
    /// Clients in the admin scope: `key:NAME`, `hmac:ID` or `unix:uid=N`.
    pub admin_clients: Vec<String>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_body_bytes: 1 << 20,
            max_audio_bytes: 25 << 20,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            default_max_tokens: 256,
            shutdown_grace_ms: 60_000,
            hmac_secret_file: None,
            hmac_keys_file: None,
            hmac_window_s: 300,
            api_keys_file: None,
            cors_allow_origins: Vec::new(),
            admin_clients: Vec::new(),
        }
    }
}

impl Config {
    /// Parses the plugin's TOML configuration; unknown keys and bad values are errors.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let table: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut c = Config::default();
        for (key, value) in &table {
            let int = || {
                value
                    .as_integer()
                    .filter(|v| *v > 0)
                    .ok_or_else(|| format!("`{key}` must be a positive integer"))
            };
            match key.as_str() {
                "max_body_bytes" => c.max_body_bytes = int()? as usize,
                "max_audio_bytes" => c.max_audio_bytes = int()? as usize,
                "header_read_timeout_ms" => c.header_read_timeout_ms = int()? as u64,
                "body_read_timeout_ms" => c.body_read_timeout_ms = int()? as u64,
                "default_max_tokens" => {
                    c.default_max_tokens =
                        u32::try_from(int()?).map_err(|_| format!("`{key}` is too large"))?
                }
                "shutdown_grace_ms" => c.shutdown_grace_ms = int()? as u64,
                "hmac_window_s" => c.hmac_window_s = int()? as u64,
                "hmac_secret_file" | "hmac_keys_file" | "api_keys_file" => {
                    let path = value
                        .as_str()
                        .filter(|s| !s.is_empty())
                        .ok_or_else(|| format!("`{key}` must be a path"))?
                        .to_string();
                    match key.as_str() {
                        "hmac_secret_file" => c.hmac_secret_file = Some(path),
                        "hmac_keys_file" => c.hmac_keys_file = Some(path),
                        _ => c.api_keys_file = Some(path),
                    }
                }
                "cors_allow_origins" | "admin_clients" => {
                    let list = value
                        .as_array()
                        .and_then(|a| {
                            a.iter()
                                .map(|o| o.as_str().filter(|o| !o.is_empty()).map(str::to_string))
                                .collect::<Option<Vec<_>>>()
                        })
                        .ok_or_else(|| format!("`{key}` must be an array of non-empty strings"))?;
                    if key == "admin_clients" {
                        c.admin_clients = list;
                    } else {
                        c.cors_allow_origins = list;
                    }
                }
                other => {
                    return Err(format!(
                        "unknown key `{other}` (known: max_body_bytes, max_audio_bytes, header_read_timeout_ms, \
                         body_read_timeout_ms, default_max_tokens, shutdown_grace_ms, \
                         hmac_secret_file, hmac_keys_file, hmac_window_s, api_keys_file, \
                         cors_allow_origins, admin_clients)"
                    ));
                }
            }
        }
        if c.hmac_secret_file.is_some() && c.hmac_keys_file.is_some() {
            return Err("set one of `hmac_secret_file` and `hmac_keys_file`, not both".into());
        }
        Ok(c)
    }
}

/// Reads a file through the host (so the `fs.read` grant applies).
fn read_file(host: &HostBox, path: &str) -> Result<Vec<u8>> {
    use std::{io::Read, os::fd::FromRawFd};
    let fd = host.open_read(path.into()).into_result()?;
    // SAFETY: the host hands over a freshly opened descriptor that we now own.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| UError::io(format!("transport-http: reading {path}"), e))?;
    Ok(bytes)
}

/// Reads the HMAC secret; surrounding whitespace is not part of it.
fn read_secret(host: &HostBox, path: &str) -> Result<Vec<u8>> {
    let secret = read_file(host, path)?;
    let trimmed = secret.trim_ascii().to_vec();
    if trimmed.len() < 16 {
        return Err(UError::invalid(format!(
            "transport-http: the HMAC secret in {path} is {} bytes; at least 16 are required",
            trimmed.len()
        )));
    }
    Ok(trimmed)
}

fn instantiate(host: HostBox) -> Result<PluginInstance> {
    let config = Config::parse(host.config().as_str())
        .map_err(|e| UError::invalid(format!("transport-http config: {e}")))?;
    let key_file = |path: &String| -> Result<access::Keys> {
        let text = String::from_utf8(read_file(&host, path)?)
            .map_err(|_| UError::invalid(format!("transport-http: {path} is not UTF-8 text")))?;
        access::Keys::parse(&text)
            .map_err(|e| UError::invalid(format!("transport-http: {path}: {e}")))
    };
    let secrets = match (&config.hmac_secret_file, &config.hmac_keys_file) {
        (Some(path), _) => Some(safebox::Secrets::One(read_secret(&host, path)?)),
        (None, Some(path)) => Some(safebox::Secrets::Named(key_file(path)?.entries().to_vec())),
        (None, None) => None,
    };
    let keys = config.api_keys_file.as_ref().map(key_file).transpose()?;
    let http = server::Http {
        host,
        config,
        secrets,
        keys,
    };
    let clients = http.clients();
    for admin in &http.config.admin_clients {
        let known = clients.contains(admin)
            || admin
                .strip_prefix("unix:uid=")
                .is_some_and(|uid| uid.parse::<u32>().is_ok());
        if !known {
            return Err(UError::invalid(format!(
                "transport-http config: admin_clients: `{admin}` is no configured client \
                 (key:NAME of api_keys_file, hmac:ID of hmac_keys_file, or unix:uid=N)"
            )));
        }
    }
    Ok(PluginInstance::Transport(TransportBox::new(http)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_overrides() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
        let c = Config::parse("max_body_bytes = 10\ndefault_max_tokens = 3").unwrap();
        assert_eq!((c.max_body_bytes, c.default_max_tokens), (10, 3));
        assert!(Config::parse("max_body_bytes = -1").is_err());
        let c =
            Config::parse("api_keys_file = \"/k\"\ncors_allow_origins = [\"https://a.example\"]")
                .unwrap();
        assert_eq!(c.api_keys_file.as_deref(), Some("/k"));
        assert_eq!(c.cors_allow_origins, ["https://a.example"]);
        assert!(Config::parse("cors_allow_origins = \"*\"").is_err());
        let c = Config::parse("hmac_keys_file = \"/h\"\nadmin_clients = [\"hmac:ops\"]").unwrap();
        assert_eq!(c.hmac_keys_file.as_deref(), Some("/h"));
        assert_eq!(c.admin_clients, ["hmac:ops"]);
        assert!(
            Config::parse("hmac_keys_file = \"/h\"\nhmac_secret_file = \"/s\"")
                .unwrap_err()
                .contains("not both")
        );
        assert!(Config::parse("admin_clients = [\"\"]").is_err());
        assert!(
            Config::parse("max_body = 1")
                .unwrap_err()
                .contains("unknown key")
        );
    }
}
