//! Issue 7: `u-runner serve` with the transport-http plugin, as an operator runs it — the built,
//! signed host and plugins serving the tiny Llama fixture (with the engine's 128-token
//! character tokenizer) on a Unix socket and on 127.0.0.1, driven by the official `openai`
//! Python client (streaming and not) and by raw sockets for bad input. Greedy output must equal
//! `u-runner generate --json` on the same prompt.
//!
//! Needs `python3` with the packages of `tests/requirements.txt` (`cargo xtask test` installs
//! them); nothing is installed here.

use serde_json::Value;
use std::{
    io::{Read, Write},
    net::TcpStream,
    process::Command,
    time::{Duration, Instant},
};
use u_conformance::{
    serving::{MODEL, Options, Server, generate_json, http, post, start, start_smollm2},
    text,
};

/// The official client, streaming and not, over TCP and over the Unix socket.
const CLIENT: &str = r#"
import json, os
from openai import OpenAI
try:  # the HTTP library the installed client is built on (httpx2 in newer releases)
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = os.environ["U_MODEL"]
PROMPT = os.environ["U_PROMPT"]
COMPLETION_PROMPT = os.environ["U_COMPLETION_PROMPT"]
SYSTEM = os.environ.get("U_SYSTEM")
MAX = int(os.environ["U_MAX"])
def client(kind):
    if kind == "unix":
        http = httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"]), timeout=60)
        return OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
    return OpenAI(base_url=os.environ["U_URL"], api_key="unused", timeout=60, max_retries=0)

def collect(stream, chat):
    pieces, finish, usage, roles, objects = [], None, None, [], set()
    for ch in stream:
        objects.add(ch.object)
        if ch.usage:
            usage = ch.usage.model_dump()
        for c in ch.choices:
            if chat:
                if c.delta.role:
                    roles.append(c.delta.role)
                if c.delta.content:
                    pieces.append(c.delta.content)
            elif c.text:
                pieces.append(c.text)
            if c.finish_reason:
                finish = c.finish_reason
    return {"text": "".join(pieces), "finish": finish, "usage": usage, "roles": roles,
            "objects": sorted(objects), "chunks": len(pieces)}

out = {}
for kind in ["tcp", "unix"]:
    c = client(kind)
    r = {"models": [m.id for m in c.models.list()]}
    msgs = ([{"role": "system", "content": SYSTEM}] if SYSTEM else []) + [{"role": "user", "content": PROMPT}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=MAX)
    r["chat"] = {"text": chat.choices[0].message.content, "finish": chat.choices[0].finish_reason,
                 "usage": chat.usage.model_dump(), "object": chat.object}
    r["chat_stream"] = collect(c.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
        max_tokens=MAX, stream=True, stream_options={"include_usage": True}), True)
    comp = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0, max_tokens=MAX)
    r["completion"] = {"text": comp.choices[0].text, "finish": comp.choices[0].finish_reason,
                       "usage": comp.usage.model_dump(), "object": comp.object}
    r["completion_stream"] = collect(c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT,
        temperature=0, max_tokens=MAX, stream=True), False)
    text = comp.choices[0].text
    if len(text) >= 8:
        stop = text[len(text) // 2:len(text) // 2 + 3]
        s = c.completions.create(model=MODEL, prompt=COMPLETION_PROMPT, temperature=0, max_tokens=MAX, stop=["@@never@@", stop])
        r["stop"] = {"stop": stop, "text": s.choices[0].text, "finish": s.choices[0].finish_reason}
    try:
        c.chat.completions.create(model="no-such-model", messages=msgs)
        r["unknown_model"] = None
    except Exception as e:
        r["unknown_model"] = getattr(e, "status_code", str(e))
    out[kind] = r
print(json.dumps(out))
"#;

/// Runs the official client against `server` (serving the model as `name`) and checks every
/// answer against `u-runner generate --json` on the same prompt, greedy.
fn client_matches_generate(
    server: &Server,
    name: &str,
    system: Option<&str>,
    (prompt, completion_prompt): (&str, &str),
    max: u32,
) {
    let n = max.to_string();
    let mut chat_args = vec!["-n", &n, "--chat", "--prompt", prompt];
    if let Some(system) = system {
        chat_args.extend(["--system", system]);
    }
    let chat_ref = generate_json(&server.model, &chat_args);
    let plain_ref = generate_json(&server.model, &["-n", &n, "--prompt", completion_prompt]);
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(CLIENT)
        .env("U_MODEL", name)
        .env("U_PROMPT", prompt)
        .env("U_COMPLETION_PROMPT", completion_prompt)
        .env("U_MAX", &n);
    if let Some(system) = system {
        cmd.env("U_SYSTEM", system);
    }
    let out = cmd
        .env("U_URL", server.url())
        .env("U_SOCK", &server.socket)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the openai client failed (is `pip install -r tests/requirements.txt` done?):\n{}\nserver log:\n{}",
        text(&out),
        server.log()
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    eprintln!("client saw: {v}\nreferences: {chat_ref}\n{plain_ref}");
    let tokens = |r: &Value| r["tokens"].as_array().unwrap().len() as u64;
    for kind in ["tcp", "unix"] {
        let r = &v[kind];
        assert_eq!(r["models"], serde_json::json!([name]), "{r}");
        for (key, reference, object) in [
            ("chat", &chat_ref, "chat.completion"),
            ("completion", &plain_ref, "text_completion"),
        ] {
            let got = &r[key];
            assert_eq!(
                got["text"], reference["text"],
                "{kind} {key}: {got} vs {reference}"
            );
            assert_eq!(got["object"], object);
            assert_eq!(got["finish"], reference["finish"], "{kind} {key}");
            let u = &got["usage"];
            assert_eq!(
                u["prompt_tokens"], reference["timings"]["prompt_tokens"],
                "{u}"
            );
            assert_eq!(
                u["completion_tokens"].as_u64(),
                Some(tokens(reference)),
                "{u}"
            );
            assert_eq!(
                u["total_tokens"].as_u64(),
                Some(u["prompt_tokens"].as_u64().unwrap() + tokens(reference))
            );
            assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64(), "{u}");
            let s = &r[format!("{key}_stream")];
            assert_eq!(s["text"], reference["text"], "{kind} {key} streamed: {s}");
            assert_eq!(s["finish"], reference["finish"], "{s}");
            if tokens(reference) > 1 {
                assert!(s["chunks"].as_u64().unwrap() > 1, "streamed in pieces: {s}");
            }
        }
        let cs = &r["chat_stream"];
        assert_eq!(cs["roles"], serde_json::json!(["assistant"]), "{cs}");
        assert_eq!(cs["objects"], serde_json::json!(["chat.completion.chunk"]));
        // The same prompt again: the usage matches, but its KV now comes from the cache.
        for key in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(
                cs["usage"][key], r["chat"]["usage"][key],
                "include_usage: {cs}"
            );
        }
        assert!(
            cs["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() > Some(0),
            "the repeated prompt's KV came from the cache: {cs}"
        );
        let full = plain_ref["text"].as_str().unwrap();
        assert_eq!(r.get("stop").is_some(), full.len() >= 8, "{r}");
        if let Some(stop) = r.get("stop") {
            let cut = full.find(stop["stop"].as_str().unwrap()).unwrap();
            assert_eq!(stop["text"].as_str().unwrap(), &full[..cut], "{stop}");
            assert_eq!(stop["finish"], "stop");
        }
        assert_eq!(r["unknown_model"], 404, "{r}");
    }
}

#[test]
fn openai_client_streaming_and_not_matches_generate_over_tcp_and_unix() {
    let mut server = start();
    client_matches_generate(&server, MODEL, None, ("Hello, world", "Hello, world"), 16);
    let status = server.stop().expect("server exits after SIGTERM");
    assert!(status.success(), "{status}:\n{}", server.log());
}

#[test]
fn smollm2_chat_with_a_system_message_matches_generate() {
    let mut server = start_smollm2(&Options::default());
    client_matches_generate(
        &server,
        "SmolLM2-135M-Instruct.Q4_1",
        Some("You are a concise assistant."),
        (
            "What is the capital of France?",
            "The three largest cities of France are",
        ),
        24,
    );
    // Graceful shutdown: SIGTERM while a stream is mid-way (this model makes tokens slowly
    // enough) lets the stream run to its end before the process exits.
    let body = br#"{"model":"SmolLM2-135M-Instruct.Q4_1","prompt":"Once upon a time","max_tokens":32,"temperature":0,"stream":true}"#;
    let mut raw = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(&raw).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\"text\":") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "stream ended early: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let status = server.stop();
    s.read_to_end(&mut seen).unwrap();
    let events = String::from_utf8_lossy(&seen).replace("\r\n", "\n");
    assert!(events.contains("\"finish_reason\":\"length\""), "{events}");
    assert!(events.contains("data: [DONE]\n\n"), "{events}");
    let status = status.expect("server exits after SIGTERM");
    assert!(status.success(), "{status}:\n{}", server.log());
    assert!(
        server.log().contains("letting 1 open connection(s) finish"),
        "{}",
        server.log()
    );
}

#[test]
fn bad_requests_get_the_right_4xx_and_nothing_crashes() {
    let mut server = start();
    let port = server.port;
    let chat = "/v1/chat/completions";
    let expect = |status: u16, body: &Value, code: u16, what: &str| {
        assert_eq!(status, code, "{what}: {body}");
        assert!(body["error"]["message"].is_string(), "{what}: {body}");
        assert!(body["error"]["type"].is_string(), "{what}: {body}");
    };
    let (s, b) = post(port, chat, b"{\"model\": \"tiny-llama\", \"messages\": [");
    expect(s, &b, 400, "malformed JSON");
    let (s, b) = post(
        port,
        chat,
        br#"{"model":"tiny-llama","messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#,
    );
    expect(s, &b, 400, "wrong type");
    let (s, b) = post(
        port,
        chat,
        br#"{"model":"tiny-llama","messages":{"role":"user"}}"#,
    );
    expect(s, &b, 400, "messages not an array");
    let (s, b) = post(
        port,
        "/v1/completions",
        br#"{"model":"other","prompt":"hi"}"#,
    );
    expect(s, &b, 404, "unknown model");
    assert_eq!(b["error"]["code"], "model_not_found");
    let (s, b) = post(
        port,
        "/v1/completions",
        b"{\"model\":\"tiny-llama\",\"prompt\":\"\xff\xfe\"}",
    );
    expect(s, &b, 400, "invalid UTF-8");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("UTF-8"),
        "{b}"
    );
    let (s, b) = post(port, "/v1/completions", &vec![b' '; 100_000]);
    expect(s, &b, 413, "oversized body");
    // A 100 MB body announced: refused from the headers, without reading it.
    let (s, body) = http(
        port,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\nConnection: close\r\n\r\n{",
    )
    .unwrap();
    assert_eq!(s, 413, "{body}");
    // Oversized and chunked (no Content-Length).
    let mut raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    for _ in 0..20 {
        raw.extend_from_slice(format!("{:x}\r\n{}\r\n", 4096, " ".repeat(4096)).as_bytes());
    }
    raw.extend_from_slice(b"0\r\n\r\n");
    let (s, body) = http(port, &raw).unwrap();
    assert_eq!(s, 413, "{body}");
    let (s, body) = http(
        port,
        b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 404, "{body}");
    let (s, body) = http(
        port,
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 405, "{body}");

    // Slow-drip headers: the connection is cut after the header timeout (1.5 s here), while
    // other clients are served meanwhile.
    let mut slow = TcpStream::connect(("127.0.0.1", port)).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHo").unwrap();
    let started = Instant::now();
    let (s, _) = http(
        port,
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 200);
    let mut buf = Vec::new();
    let _ = slow.read_to_end(&mut buf);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(10) && waited >= Duration::from_millis(1000),
        "slow client cut after {waited:?}"
    );
    let answer = String::from_utf8_lossy(&buf);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );

    // Concurrent requests run side by side and each gets the same greedy answer.
    let body = br#"{"model":"tiny-llama","prompt":"Hello, world","max_tokens":16,"temperature":0}"#;
    let answers: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| scope.spawn(|| post(port, "/v1/completions", body)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (status, answer) in &answers {
        assert_eq!(*status, 200, "{answer}");
        assert_eq!(
            answer["choices"][0]["text"], answers[0].1["choices"][0]["text"],
            "{answer}"
        );
        assert_eq!(answer["usage"]["completion_tokens"], 16, "{answer}");
    }

    // Keep-alive: two requests on one connection, both answered.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    assert_eq!(all.matches("HTTP/1.1 200 OK").count(), 2, "{all}");
    assert!(all.contains("\"object\":\"list\""), "{all}");

    // Still serving after all that; a streaming request survives SIGTERM and ends with [DONE].
    let body =
        br#"{"model":"tiny-llama","prompt":"Hello","max_tokens":64,"temperature":0,"stream":true}"#;
    let mut raw = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&raw).unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let status = server.stop();
    let mut rest = String::new();
    let _ = s.read_to_string(&mut rest);
    assert!(
        rest.contains("text/event-stream")
            || String::from_utf8_lossy(&first[..n]).contains("text/event-stream")
    );
    // The body is chunk-framed; the last event is the terminator.
    let events = rest.replace("\r\n", "\n");
    assert!(events.contains("data: [DONE]\n\n"), "{rest}");
    assert!(
        !events[events.find("data: [DONE]").unwrap()..].contains("data: {"),
        "{rest}"
    );
    let status = status.expect("server exits after SIGTERM");
    assert!(status.success(), "{status}:\n{}", server.log());
}
