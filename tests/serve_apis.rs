//! Issue 7 beyond the OpenAI basics: the Anthropic API with the official `anthropic` client,
//! prompt-cache breakpoints, logprobs, KV checkpoint endpoints, `/metrics`, back-pressure
//! (429), and the Safebox protocol with HMAC on a Unix socket — all against `u-runner serve`
//! (and its runner form) with the built, signed plugins.

use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};
use u_conformance::{
    bin,
    serving::{
        MODEL, Options, generate_json, http, model_dir, post, python_client, start_smollm2,
        start_tiny,
    },
};

/// The official Anthropic client, streaming and not, over TCP and over the Unix socket.
const ANTHROPIC: &str = r#"
import json, os
import anthropic
try:
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL, SYSTEM, PROMPT, MAX = os.environ["U_MODEL"], os.environ["U_SYSTEM"], os.environ["U_PROMPT"], int(os.environ["U_MAX"])
def client(kind):
    if kind == "unix":
        http = httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"]), timeout=60)
        return anthropic.Anthropic(base_url="http://localhost", api_key="unused", http_client=http, max_retries=0)
    return anthropic.Anthropic(base_url=os.environ["U_BASE"], api_key="unused", timeout=60, max_retries=0)

out = {}
for kind in ["tcp", "unix"]:
    c = client(kind)
    msgs = [{"role": "user", "content": PROMPT}]
    # Recent clients have no `temperature` argument (the API's default applies); send it raw.
    greedy = {"temperature": 0}
    m = c.messages.create(model=MODEL, system=SYSTEM, messages=msgs, max_tokens=MAX, extra_body=greedy)
    r = {"text": m.content[0].text, "stop": m.stop_reason, "type": m.type, "role": m.role,
         "usage": m.usage.model_dump()}
    events, pieces = [], []
    with c.messages.stream(model=MODEL, system=SYSTEM, messages=msgs, max_tokens=MAX, extra_body=greedy) as s:
        for e in s:
            events.append(e.type)
            if e.type == "text":
                pieces.append(e.text)
        final = s.get_final_message()
    r["stream"] = {"text": "".join(pieces), "final": final.content[0].text, "stop": final.stop_reason,
                   "usage": final.usage.model_dump(), "events": sorted(set(events)), "pieces": len(pieces)}
    try:
        c.messages.create(model="no-such-model", messages=msgs, max_tokens=4)
        r["unknown"] = None
    except anthropic.APIStatusError as e:
        r["unknown"] = [e.status_code, e.body["error"]["type"]]
    out[kind] = r
print(json.dumps(out))
"#;

#[test]
fn anthropic_client_streaming_and_not_matches_generate_over_tcp_and_unix() {
    let server = start_tiny(&Options::default());
    let (system, prompt) = ("Be brief.", "Hello, world");
    let reference = generate_json(
        &server.model,
        &["-n", "12", "--chat", "--system", system, "--prompt", prompt],
    );
    let base = format!("http://127.0.0.1:{}", server.port);
    let socket = server.socket.display().to_string();
    let v = python_client(
        ANTHROPIC,
        &[
            ("U_MODEL", MODEL),
            ("U_SYSTEM", system),
            ("U_PROMPT", prompt),
            ("U_MAX", "12"),
            ("U_BASE", &base),
            ("U_SOCK", &socket),
        ],
        &server,
    );
    eprintln!("client saw {v}\nreference {reference}");
    let want = reference["text"].as_str().unwrap();
    let generated = reference["tokens"].as_array().unwrap().len() as u64;
    let stop = if reference["finish"] == "length" {
        "max_tokens"
    } else {
        "end_turn"
    };
    for kind in ["tcp", "unix"] {
        let r = &v[kind];
        assert_eq!(r["text"], want, "{kind}: {r}");
        assert_eq!(
            (r["type"].as_str(), r["role"].as_str()),
            (Some("message"), Some("assistant"))
        );
        assert_eq!(r["stop"], stop, "{r}");
        let u = &r["usage"];
        assert_eq!(u["output_tokens"].as_u64(), Some(generated), "{u}");
        let prompt_tokens = reference["timings"]["prompt_tokens"].as_u64().unwrap();
        let sum = [
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
        ]
        .iter()
        .map(|k| u[k].as_u64().unwrap())
        .sum::<u64>();
        assert_eq!(sum, prompt_tokens, "usage splits the whole prompt: {u}");
        let s = &r["stream"];
        assert_eq!(s["text"], want, "{kind} streamed: {s}");
        assert_eq!(s["final"], want);
        assert_eq!(s["stop"], stop);
        assert_eq!(s["usage"]["output_tokens"].as_u64(), Some(generated));
        assert!(
            s["usage"]["cache_read_input_tokens"].as_u64() > Some(0),
            "repeat hits the cache: {s}"
        );
        for e in [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
            "text",
        ] {
            assert!(
                s["events"].as_array().unwrap().contains(&json!(e)),
                "{e} missing: {s}"
            );
        }
        assert!(s["pieces"].as_u64() > Some(1), "streamed in pieces: {s}");
        assert_eq!(r["unknown"], json!([404, "not_found_error"]), "{r}");
    }
}

/// POSTs `body` to `/v1/messages` over TCP.
fn messages(port: u16, body: &Value) -> (u16, Value) {
    post(port, "/v1/messages", body.to_string().as_bytes())
}

fn metric(port: u16, name: &str) -> f64 {
    let (status, text) = http(
        port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    let text = text.replace("\r\n", "\n");
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

/// A multi-turn conversation on SmolLM2 with a long cached system prompt: the second call of
/// the same conversation reads the prefix from the cache, prefills only the suffix (counted by
/// the engine and timed), and answers exactly as the uncached first call did.
#[test]
fn cache_breakpoints_make_the_second_call_prefill_only_the_suffix() {
    let server = start_smollm2(&Options::default());
    let name = "SmolLM2-135M-Instruct.Q4_1";
    let facts: String = (1..=60)
        .map(|i| {
            format!(
                "Fact {i}: the code word for room {i} is 'amber-{}'. ",
                i * 7
            )
        })
        .collect();
    let system = format!("You are a careful assistant. {facts}");
    let cached_system =
        json!([{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]);
    let turn1 = json!({"model": name, "max_tokens": 12, "temperature": 0, "system": cached_system,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the code word for room 3?",
            "cache_control": {"type": "ephemeral"}}]}]});
    let t = Instant::now();
    let (s1, a1) = messages(server.port, &turn1);
    let uncached = t.elapsed();
    assert_eq!(s1, 200, "{a1}");
    let u1 = &a1["usage"];
    assert_eq!(u1["cache_read_input_tokens"], 0, "{u1}");
    let written = u1["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(
        written > 600,
        "the system prompt and the user block were stored: {u1}"
    );
    let prompt_before = metric(server.port, "u_prompt_tokens_total");
    let hits_before = metric(server.port, "u_cache_hit_tokens_total");

    // The same call again: everything up to the last breakpoint is read from the cache.
    let t = Instant::now();
    let (s2, a2) = messages(server.port, &turn1);
    let cached = t.elapsed();
    assert_eq!(s2, 200, "{a2}");
    assert_eq!(
        a2["content"], a1["content"],
        "identical to the uncached answer"
    );
    let u2 = &a2["usage"];
    assert!(
        u2["cache_read_input_tokens"].as_u64().unwrap() >= written,
        "{u2}"
    );
    let prompt_tokens = metric(server.port, "u_prompt_tokens_total") - prompt_before;
    let hits = metric(server.port, "u_cache_hit_tokens_total") - hits_before;
    let computed = prompt_tokens - hits;
    eprintln!(
        "uncached call {uncached:?}, cached call {cached:?} (ratio {:.2}); second call: {prompt_tokens} prompt tokens, {hits} from the cache, {computed} prefilled",
        uncached.as_secs_f64() / cached.as_secs_f64()
    );
    assert!(
        computed <= prompt_tokens - written as f64,
        "only the suffix was prefilled"
    );
    assert!(
        cached < uncached,
        "the cached call was not faster: {cached:?} vs {uncached:?}"
    );

    // The next turn of the conversation: the first turn's prefix is reused.
    let answer = a1["content"][0]["text"].as_str().unwrap();
    let turn2 = json!({"model": name, "max_tokens": 8, "temperature": 0, "system": cached_system,
        "messages": [
            {"role": "user", "content": "What is the code word for room 3?"},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": [{"type": "text", "text": "And for room 5?", "cache_control": {"type": "ephemeral"}}]}]});
    let (s3, a3) = messages(server.port, &turn2);
    assert_eq!(s3, 200, "{a3}");
    let u3 = &a3["usage"];
    assert!(
        u3["cache_read_input_tokens"].as_u64().unwrap() > 600,
        "{u3}"
    );
    assert!(u3["input_tokens"].as_u64().unwrap() < 60, "{u3}");

    // A client that disconnects mid-stream cancels its request: the engine stops generating
    // for it at the next step.
    let generated_before = metric(server.port, "u_generated_tokens_total");
    {
        let body = br#"{"model":"SmolLM2-135M-Instruct.Q4_1","prompt":"Hello","max_tokens":100,"temperature":0,"stream":true}"#;
        let mut raw = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(body);
        let mut s = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        s.write_all(&raw).unwrap();
        let mut first = [0u8; 512];
        let n = s.read(&mut first).unwrap();
        assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(server.port, "u_engine_running") > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the abandoned request kept running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let spent = metric(server.port, "u_generated_tokens_total") - generated_before;
    assert!(spent < 100.0, "cancelled after {spent} of 100 tokens");
}

#[test]
fn logprobs_checkpoints_metrics_and_back_pressure() {
    let server = start_tiny(&Options {
        model_config: "max_running = 2\nmax_queued = 2".into(),
        ..Options::default()
    });
    let port = server.port;

    // Logprobs: greedy picks the most likely token, and the pieces spell the text.
    let (s, v) = post(
        port,
        "/v1/chat/completions",
        br#"{"model":"tiny-llama","messages":[{"role":"user","content":"Hello"}],"max_tokens":6,"temperature":0,"logprobs":true,"top_logprobs":3}"#,
    );
    assert_eq!(s, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "{v}");
    let mut spelled = Vec::new();
    for c in content {
        let lp = c["logprob"].as_f64().unwrap();
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{c}");
        assert!(
            lp <= 0.0 && (lp - top[0]["logprob"].as_f64().unwrap()).abs() < 1e-6,
            "{c}"
        );
        assert!(
            top.windows(2)
                .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64())
        );
        spelled.extend(
            c["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&spelled),
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // Embeddings: one L2-normalised vector of the model's hidden size per input.
    let (s, v) = post(
        port,
        "/v1/embeddings",
        br#"{"model":"tiny-llama","input":["Hello, world","Hello, world","Goodbye"]}"#,
    );
    assert_eq!(s, 200, "{v}");
    let vectors: Vec<Vec<f64>> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| serde_json::from_value(d["embedding"].clone()).unwrap())
        .collect();
    assert_eq!(vectors.len(), 3);
    assert_eq!(vectors[0].len(), 32, "hidden size of the fixture");
    let norm: f64 = vectors[0].iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    assert_eq!(vectors[0], vectors[1], "same input, same vector");
    assert_ne!(vectors[0], vectors[2]);
    let (s, v) = post(
        port,
        "/v1/embeddings",
        br#"{"model":"tiny-llama","input":""}"#,
    );
    assert_eq!(s, 400, "{v}");

    // Checkpoints: save a prefix, continue from it, fork, list, delete.
    let (s, v) = post(
        port,
        "/v1/checkpoints",
        br#"{"name":"intro","prompt":"Hello, wor"}"#,
    );
    assert_eq!(s, 201, "{v}");
    assert!(v["tokens"].as_u64() > Some(0), "{v}");
    // Saving over it needs `overwrite` (#16), else 409 and the checkpoint stays.
    let (s, v) = post(
        port,
        "/v1/checkpoints",
        br#"{"name":"intro","prompt":"Something else"}"#,
    );
    assert_eq!(s, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("overwrite"),
        "{v}"
    );
    let (s, v) = post(
        port,
        "/v1/checkpoints",
        br#"{"name":"intro","prompt":"Hello, wor","overwrite":true}"#,
    );
    assert_eq!(s, 201, "{v}");
    let full = post(
        port,
        "/v1/completions",
        br#"{"model":"tiny-llama","prompt":"Hello, world","max_tokens":8,"temperature":0}"#,
    );
    let resumed = post(
        port,
        "/v1/completions",
        br#"{"model":"tiny-llama","prompt":"ld","resume_from":"intro","max_tokens":8,"temperature":0,"save_as":"intro-after"}"#,
    );
    assert_eq!(resumed.0, 200, "{}", resumed.1);
    assert_eq!(
        resumed.1["choices"][0]["text"], full.1["choices"][0]["text"],
        "{resumed:?} vs {full:?}"
    );
    let again = br#"{"model":"tiny-llama","prompt":"ld","resume_from":"intro","max_tokens":8,"temperature":0,"save_as":"intro-after"}"#;
    assert_eq!(
        post(port, "/v1/completions", again).0,
        409,
        "save_as over a checkpoint"
    );
    let replace = br#"{"model":"tiny-llama","prompt":"ld","resume_from":"intro","max_tokens":8,"temperature":0,"save_as":"intro-after","overwrite":true}"#;
    assert_eq!(post(port, "/v1/completions", replace).0, 200);
    let (s, v) = post(
        port,
        "/v1/checkpoints/fork",
        br#"{"source":"intro","name":"intro-copy"}"#,
    );
    assert_eq!(s, 201, "{v}");
    let (s, v) = http(
        port,
        b"GET /v1/checkpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 200, "{v}");
    let list: Value = serde_json::from_str(&v).unwrap();
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for n in ["intro", "intro-after", "intro-copy"] {
        assert!(names.contains(&n), "{n} in {names:?}");
    }
    let (s, v) = http(
        port,
        b"DELETE /v1/checkpoints/intro-copy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 200, "{v}");
    let (s, v) = post(
        port,
        "/v1/checkpoints/fork",
        br#"{"source":"intro-copy","name":"again"}"#,
    );
    assert_eq!(s, 404, "a deleted checkpoint is gone: {v}");
    let (s, v) = post(
        port,
        "/v1/checkpoints",
        br#"{"name":"../escape","prompt":"x"}"#,
    );
    assert_eq!(s, 400, "{v}");

    // Back-pressure: 2 running + 2 queued; the rest are refused with 429 and Retry-After while
    // the accepted ones finish normally. The tiny model answers in milliseconds, so a burst may
    // slip through unrefused: bursts are repeated (bounded) until one is refused.
    let body = br#"{"model":"tiny-llama","prompt":"Hello","max_tokens":200,"temperature":0}"#;
    let raw = {
        let mut r = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    };
    let (mut ok, mut busy) = (0, 0);
    for _ in 0..5 {
        let answers: Vec<(u16, String)> = std::thread::scope(|scope| {
            let hs: Vec<_> = (0..24)
                .map(|_| scope.spawn(|| http(port, &raw).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (status, answer) in &answers {
            match status {
                200 => ok += 1,
                429 => {
                    busy += 1;
                    assert!(answer.contains("rate_limit"), "{answer}");
                }
                other => panic!("status {other}: {answer}"),
            }
        }
        if busy > 0 {
            break;
        }
    }
    assert!(ok >= 4 && busy >= 1, "{ok} served, {busy} refused");
    let (s, v) = post(port, "/v1/completions", body);
    assert_eq!(s, 200, "served again once the queue drained: {v}");

    // Metrics in Prometheus text.
    assert!(metric(port, "u_engine_rejected_total") >= busy as f64);
    assert!(metric(port, "u_generated_tokens_total") > 0.0);
    assert_eq!(metric(port, "u_engine_running"), 0.0);
    // The tiny model repeats itself: prompt-lookup drafts were proposed, and some kept.
    let (drafted, kept) = (
        metric(port, "u_draft_tokens_total"),
        metric(port, "u_draft_accepted_tokens_total"),
    );
    assert!(
        drafted > 0.0 && kept > 0.0 && kept <= drafted,
        "{kept} of {drafted}"
    );
    let (_, all) = http(
        port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert!(
        all.contains("u_http_requests_total{route=\"/v1/completions\",status=\"429\"}"),
        "{all}"
    );
    assert!(
        all.contains(
            "u_time_to_first_token_seconds_bucket{route=\"/v1/chat/completions\",le=\"+Inf\"} 1"
        ),
        "{all}"
    );

    // Anthropic-shaped errors on /v1/messages.
    let (s, v) = post(port, "/v1/messages", b"{\"model\": ");
    assert_eq!(s, 400);
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("invalid_request_error")),
        "{v}"
    );
}

const SECRET: &str = "safebox-test-secret-0123456789";

/// Sends one HTTP request on the Unix socket; signs it when `sign` is given (timestamp, nonce).
fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    body: &[u8],
    sign: Option<(u64, &str)>,
    key: &[u8],
) -> (u16, String) {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: u\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some((ts, nonce)) = sign {
        let canonical = format!(
            "{method}\n{path}\n{ts}\n{nonce}\n{}",
            hex::encode(Sha256::digest(body))
        );
        let mut mac = Hmac::<Sha256>::new_from_slice(key).unwrap();
        mac.update(canonical.as_bytes());
        head.push_str(&format!(
            "X-Safebox-Timestamp: {ts}\r\nX-Safebox-Nonce: {nonce}\r\nX-Safebox-Signature: v1={}\r\n",
            hex::encode(mac.finalize().into_bytes())
        ));
    }
    head.push_str("\r\n");
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `u-runner <model> <socket> --secret-file F`: every API on one 0600 Unix socket, HMAC
/// required; a Safebox request answers like `u-runner generate --chat`; forged, stale and
/// replayed requests get 401 while signed ones keep working.
#[test]
fn safebox_runner_form_serves_hmac_signed_requests_on_a_unix_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let socket = dir.path().join("u-llm.sock");
    let secret = dir.path().join("secret.key");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let log = std::fs::File::create(dir.path().join("runner.log")).unwrap();
    let mut child = Command::new(bin("u-runner"))
        .arg(&model)
        .arg(&socket)
        .arg("--secret-file")
        .arg(&secret)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let read_log = || std::fs::read_to_string(dir.path().join("runner.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !socket.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("runner exited early ({status}):\n{}", read_log());
        }
        assert!(
            Instant::now() < deadline,
            "no socket after 60 s:\n{}",
            read_log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let key = SECRET.as_bytes();
    let body =
        br#"{"system":"Be brief.","userInput":"Hello, world","max_tokens":10,"temperature":0}"#;
    let reference = generate_json(
        &model,
        &[
            "-n",
            "10",
            "--chat",
            "--system",
            "Be brief.",
            "--prompt",
            "Hello, world",
        ],
    );

    let (s, v) = unix_request(
        &socket,
        "POST",
        "/v1/safebox/llm",
        body,
        Some((now(), "nonce-aaaaaaaaaaaaaaaa")),
        key,
    );
    assert_eq!(s, 200, "{v}\n{}", read_log());
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["text"], reference["text"], "{v} vs {reference}");
    assert_eq!(
        v["usage"]["output_tokens"].as_u64(),
        Some(reference["tokens"].as_array().unwrap().len() as u64)
    );

    // Replayed (same nonce), forged (wrong key), stale, unsigned: 401, with a reason.
    for (sign, k, why) in [
        (Some((now(), "nonce-aaaaaaaaaaaaaaaa")), key, "replay"),
        (
            Some((now(), "nonce-bbbbbbbbbbbbbbbb")),
            &b"not-the-secret-at-all!"[..],
            "does not match",
        ),
        (
            Some((now() - 3600, "nonce-cccccccccccccccc")),
            key,
            "window",
        ),
        (None, key, "requires Safebox authentication"),
    ] {
        let (s, v) = unix_request(&socket, "POST", "/v1/safebox/llm", body, sign, k);
        assert_eq!(s, 401, "{why}: {v}");
        assert!(v.contains(why), "{why}: {v}");
    }
    let (s, _) = unix_request(&socket, "GET", "/v1/models", b"", None, key);
    assert_eq!(s, 401, "every endpoint needs a signature");
    let (s, v) = unix_request(
        &socket,
        "GET",
        "/v1/models",
        b"",
        Some((now(), "nonce-dddddddddddddddd")),
        key,
    );
    assert_eq!(s, 200, "{v}");
    assert!(v.contains("tiny-llama"), "{v}");
    assert!(
        !v.contains("\"*\""),
        "the any-name alias is not listed: {v}"
    );
    // The runner form answers to any model name (Safebox clients name models their own way).
    let named = br#"{"model":"local/nemotron-nano","system":"Be brief.","userInput":"Hello, world","max_tokens":10,"temperature":0}"#;
    let (s, v) = unix_request(
        &socket,
        "POST",
        "/v1/safebox/llm",
        named,
        Some((now(), "nonce-any-model-name-0001")),
        key,
    );
    assert_eq!(s, 200, "{v}");
    let v: Value = serde_json::from_str(&v).unwrap();
    assert_eq!(v["text"], reference["text"], "{v}");

    // Streaming: start, tokens, done — the same text.
    let stream = br#"{"system":"Be brief.","userInput":"Hello, world","max_tokens":10,"temperature":0,"stream":true}"#;
    let (s, events) = unix_request(
        &socket,
        "POST",
        "/v1/safebox/llm",
        stream,
        Some((now(), "nonce-eeeeeeeeeeeeeeee")),
        key,
    );
    assert_eq!(s, 200, "{events}");
    let mut text = String::new();
    for line in events.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if let Ok(v) = serde_json::from_str::<Value>(line)
            && let Some(t) = v["text"].as_str()
        {
            text.push_str(t);
        }
    }
    assert!(
        events.contains("event: start") && events.contains("event: done"),
        "{events}"
    );
    assert_eq!(text, reference["text"].as_str().unwrap());
    let (s, v) = unix_request(
        &socket,
        "POST",
        "/v1/safebox/llm",
        br#"{"userInput": 5}"#,
        Some((now(), "nonce-ffffffffffffffff")),
        key,
    );
    assert_eq!(s, 400, "{v}");

    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            assert!(status.success(), "{status}:\n{}", read_log());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "runner did not stop:\n{}",
            read_log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
