//! Issue 15, the options people send and the access controls: every OpenAI and Anthropic
//! option the server does not implement is a 400 naming it; `logit_bias`, `echo`, batched and
//! token-id prompts, `n > 1` (children share the prompt's KV through the prefix cache),
//! `best_of`, `suffix` (400 without FIM tokens), `max_tokens` beyond the context (400 like
//! vLLM); embeddings in base64 (the official client's default), from token ids, with real
//! usage; Anthropic assistant prefill and `count_tokens`; `/tokenize` and `/detokenize`; API
//! keys and CORS. With the official `openai` and `anthropic` clients, over TCP and the Unix
//! socket, against `u-runner serve` with the built, signed plugins.

use serde_json::{Value, json};
use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};
use u_conformance::serving::{
    MODEL, Options, Server, http, model_dir, post, python_client, start_tiny, start_with,
};

fn env(server: &Server) -> Vec<(&'static str, String)> {
    vec![
        ("U_MODEL", MODEL.to_string()),
        ("U_BASE", server.url()),
        ("U_ROOT", format!("http://127.0.0.1:{}", server.port)),
        ("U_SOCK", server.socket.display().to_string()),
    ]
}

fn run(script: &str, server: &Server, extra: &[(&str, &str)]) -> Value {
    let owned = env(server);
    let mut all: Vec<(&str, &str)> = owned.iter().map(|(k, v)| (*k, v.as_str())).collect();
    all.extend_from_slice(extra);
    python_client(script, &all, server)
}

fn metric(port: u16, name: &str) -> f64 {
    let (status, text) = http(
        port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200, "{text}");
    text.replace("\r\n", "\n")
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in:\n{text}"))
}

/// The whole raw answer (status line, headers, body) to `raw` on a new TCP connection.
fn raw(port: u16, raw: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(raw.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

const OPENAI: &str = r#"
import json, os
import openai
try:
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = os.environ["U_MODEL"]
def client(kind):
    if kind == "unix":
        http = httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"]), timeout=60)
        return openai.OpenAI(base_url="http://localhost/v1", api_key="unused", http_client=http, max_retries=0)
    return openai.OpenAI(base_url=os.environ["U_BASE"], api_key="unused", timeout=60, max_retries=0)

def refused(f):
    try:
        f()
        return None
    except openai.APIStatusError as e:
        return [e.status_code, e.body.get("param"), e.body.get("message")]

P1, P2 = "Hello, world", "The quick brown fox"
out = {}
for kind in ["tcp", "unix"]:
    c = client(kind)
    r = {}
    g = dict(model=MODEL, max_tokens=8, temperature=0)
    one = c.completions.create(prompt=P1, logprobs=1, **g)
    r["p1"] = one.choices[0].text
    r["p1_tokens"] = one.choices[0].logprobs.tokens
    r["p2"] = c.completions.create(prompt=P2, **g).choices[0].text
    batch = c.completions.create(prompt=[P1, P2], **g)
    r["batch"] = [(ch.index, ch.text) for ch in batch.choices]
    r["batch_usage"] = batch.usage.model_dump()
    r["echo"] = c.completions.create(prompt=P1, echo=True, **g).choices[0].text
    r["ids"] = os.environ["U_IDS"] and c.completions.create(prompt=json.loads(os.environ["U_IDS"]), **g).choices[0].text
    r["bias"] = c.completions.create(prompt=P1, logit_bias={os.environ["U_BAN"]: -100}, logprobs=1, **g).choices[0].logprobs.tokens
    n3 = c.completions.create(prompt=P1, n=3, **g)
    r["n3"] = sorted((ch.index, ch.text) for ch in n3.choices)
    r["n3_usage"] = n3.usage.model_dump()
    chat = [{"role": "user", "content": P1}]
    nchat = c.chat.completions.create(model=MODEL, messages=chat, n=2, max_tokens=8, temperature=0)
    r["chat_n2"] = sorted((ch.index, ch.message.content) for ch in nchat.choices)
    streamed = {}
    for chunk in c.chat.completions.create(model=MODEL, messages=chat, n=2, max_tokens=8, temperature=0, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    r["chat_n2_stream"] = sorted(streamed.items())
    best = c.completions.create(prompt=P1, best_of=3, n=1, model=MODEL, max_tokens=8, temperature=1, seed=5)
    r["best"] = [len(best.choices), best.usage.completion_tokens]
    r["suffix"] = refused(lambda: c.completions.create(prompt=P1, suffix="end", **g))
    r["too_long"] = refused(lambda: c.completions.create(prompt=P1, model=MODEL, max_tokens=300))
    r["tools"] = refused(lambda: c.chat.completions.create(model=MODEL, messages=chat, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]))
    r["response_format"] = refused(lambda: c.chat.completions.create(model=MODEL, messages=chat, response_format={"type": "xml"}))
    r["unknown"] = refused(lambda: c.chat.completions.create(model=MODEL, messages=chat, extra_body={"mirostat": 2}))
    r["default_max"] = c.completions.create(prompt=P1, model=MODEL).usage.completion_tokens
    e64 = c.embeddings.create(model=MODEL, input=[P1, P2])
    ef = c.embeddings.create(model=MODEL, input=[P1, P2], encoding_format="float")
    r["emb"] = [[list(d.embedding) for d in e64.data], [d.embedding for d in ef.data], e64.usage.model_dump()]
    r["emb_ids"] = c.embeddings.create(model=MODEL, input=[json.loads(os.environ["U_IDS"])], encoding_format="float").data[0].embedding
    out[kind] = r
print(json.dumps(out))
"#;

#[test]
fn openai_options_people_send_work_or_are_refused_by_name() {
    let server = start_tiny(&Options::default());
    let port = server.port;
    let (s, tok) = post(
        port,
        "/tokenize",
        br#"{"content":"Hello, world","add_special":true}"#,
    );
    assert_eq!(s, 200, "{tok}");
    let ids = tok["tokens"].clone();
    let prompt_len = ids.as_array().unwrap().len();
    // The token greedy picks first, found through the same server.
    let (s, first) = post(
        port,
        "/v1/completions",
        br#"{"model":"tiny-llama","prompt":"Hello, world","max_tokens":1,"temperature":0,"logprobs":0}"#,
    );
    assert_eq!(s, 200, "{first}");
    let first_text = first["choices"][0]["text"].as_str().unwrap().to_string();
    let (_, pieces) = post(
        port,
        "/tokenize",
        json!({"content": first_text, "with_pieces": true})
            .to_string()
            .as_bytes(),
    );
    let ban = pieces["tokens"][0]["id"].to_string();
    let cached_before = metric(port, "u_cache_hit_tokens_total");
    let v = run(
        OPENAI,
        &server,
        &[("U_IDS", &ids.to_string()), ("U_BAN", &ban)],
    );
    eprintln!("client saw {v}");
    let cached = metric(port, "u_cache_hit_tokens_total") - cached_before;
    for kind in ["tcp", "unix"] {
        let r = &v[kind];
        let (p1, p2) = (r["p1"].as_str().unwrap(), r["p2"].as_str().unwrap());
        assert_eq!(r["batch"], json!([[0, p1], [1, p2]]), "{kind}");
        assert!(r["batch_usage"]["completion_tokens"].as_u64().unwrap() >= 2);
        assert_eq!(r["echo"], format!("Hello, world{p1}"), "{kind}");
        assert_eq!(r["ids"], p1, "token-id prompt = its text: {kind}");
        // logit_bias -100 removes the token greedy would pick.
        assert_eq!(r["p1_tokens"][0], first_text.as_str());
        assert_ne!(r["bias"][0], first_text.as_str(), "{kind}: {r}");
        assert_eq!(r["n3"], json!([[0, p1], [1, p1], [2, p1]]), "{kind}");
        assert_eq!(r["n3_usage"]["prompt_tokens"], prompt_len, "{kind}");
        assert_eq!(r["chat_n2"][0][1], r["chat_n2"][1][1]);
        assert_eq!(r["chat_n2_stream"], r["chat_n2"], "{kind}");
        assert_eq!(r["best"][0], 1);
        assert!(
            r["best"][1].as_u64().unwrap() > 8,
            "best_of=3 runs 3 candidates: {r}"
        );
        let (status, param, message) = (&r["suffix"][0], &r["suffix"][1], &r["suffix"][2]);
        assert_eq!(status, 400);
        assert!(
            param == "suffix" || message.as_str().unwrap().contains("suffix"),
            "{r}"
        );
        assert_eq!(r["too_long"][0], 400);
        assert!(
            r["too_long"][2]
                .as_str()
                .unwrap()
                .contains("maximum context length is 256 tokens"),
            "{r}"
        );
        assert_eq!(
            r["tools"],
            json!([
                400,
                "tools[0].function.parameters",
                "`tools[0].function.parameters` must be a schema of `type` \"object\", got \"string\""
            ])
        );
        assert_eq!(r["response_format"][1], "response_format");
        assert_eq!(r["unknown"][1], "mirostat");
        assert_eq!(
            r["default_max"], 16,
            "an unset max_tokens is the default, not an error"
        );
        let (b64, float, usage) = (&r["emb"][0], &r["emb"][1], &r["emb"][2]);
        for (a, b) in b64
            .as_array()
            .unwrap()
            .iter()
            .zip(float.as_array().unwrap())
        {
            let (a, b) = (a.as_array().unwrap(), b.as_array().unwrap());
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert!((x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-6);
            }
        }
        assert!(usage["prompt_tokens"].as_u64().unwrap() > prompt_len as u64);
        assert_eq!(r["emb_ids"], float[0], "token ids embed as their text");
    }
    // Each n=3 request's children read the prompt from the cache (all but its last token).
    assert!(
        cached >= 2.0 * 2.0 * (prompt_len - 1) as f64,
        "cache hits {cached} for prompt of {prompt_len}"
    );
    let (status, _) = post(
        port,
        "/v1/completions",
        br#"{"model":"tiny-llama","prompt":"x","logit_bias":{"99999":5}}"#,
    );
    assert_eq!(status, 400);
    let (status, _) = post(
        port,
        "/v1/completions",
        br#"{"model":"tiny-llama","prompt":[99999]}"#,
    );
    assert_eq!(status, 400);
    let (status, h) = http(
        port,
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200, "serves on after bad input: {h}");
}

const ANTHROPIC: &str = r#"
import json, os
import anthropic
try:
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = os.environ["U_MODEL"]
def client(kind):
    if kind == "unix":
        http = httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"]), timeout=60)
        return anthropic.Anthropic(base_url="http://localhost", api_key="unused", http_client=http, max_retries=0)
    return anthropic.Anthropic(base_url=os.environ["U_ROOT"], api_key="unused", timeout=60, max_retries=0)

def refused(f):
    try:
        f()
        return None
    except anthropic.APIStatusError as e:
        return [e.status_code, e.body["type"], e.body["error"]["type"], e.body["error"]["message"]]

out = {}
greedy = {"temperature": 0}
for kind in ["tcp", "unix"]:
    c = client(kind)
    r = {}
    msgs = [{"role": "user", "content": "Hello, world"}]
    whole = c.messages.create(model=MODEL, messages=msgs, max_tokens=12, extra_body=greedy)
    r["whole"] = whole.content[0].text
    r["whole_usage"] = whole.usage.model_dump()
    prefix = os.environ["U_PREFIX"]
    pre = msgs + [{"role": "assistant", "content": prefix}]
    cont = c.messages.create(model=MODEL, messages=pre, max_tokens=12 - int(os.environ["U_PREFIX_TOKENS"]), extra_body=greedy)
    r["prefill"] = cont.content[0].text
    r["count"] = c.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    r["count_pre"] = c.messages.count_tokens(model=MODEL, messages=pre).input_tokens
    r["tools"] = refused(lambda: c.messages.create(model=MODEL, messages=msgs, max_tokens=4, tools=[{"name": "f", "input_schema": {"type": "string"}}]))
    r["thinking"] = refused(lambda: c.messages.create(model=MODEL, messages=msgs, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024}))
    r["too_long"] = refused(lambda: c.messages.create(model=MODEL, messages=msgs, max_tokens=300))
    r["count_bad"] = refused(lambda: c.messages.count_tokens(model="nope", messages=msgs))
    out[kind] = r
print(json.dumps(out))
"#;

#[test]
fn anthropic_prefill_count_tokens_errors_and_tokenize_endpoints() {
    let server = start_tiny(&Options::default());
    let port = server.port;
    // The first tokens greedy answers with, as text: the assistant prefill to continue.
    let (s, chat) = post(
        port,
        "/v1/chat/completions",
        br#"{"model":"tiny-llama","messages":[{"role":"user","content":"Hello, world"}],
            "max_tokens":12,"temperature":0,"logprobs":true}"#,
    );
    assert_eq!(s, 200, "{chat}");
    let tokens: Vec<String> = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["token"].as_str().unwrap().to_string())
        .collect();
    assert!(tokens.len() > 6, "{chat}");
    let prefix: String = tokens[..4].concat();
    let rest: String = tokens[4..].concat();
    let v = run(
        ANTHROPIC,
        &server,
        &[("U_PREFIX", &prefix), ("U_PREFIX_TOKENS", "4")],
    );
    eprintln!("client saw {v}");
    for kind in ["tcp", "unix"] {
        let r = &v[kind];
        assert_eq!(r["whole"], format!("{prefix}{rest}"), "{kind}");
        assert_eq!(
            r["prefill"], rest,
            "the prefill is continued, not a new turn: {r}"
        );
        assert_eq!(
            r["count"],
            r["whole_usage"]["input_tokens"].as_u64().unwrap()
                + r["whole_usage"]["cache_read_input_tokens"]
                    .as_u64()
                    .unwrap()
                + r["whole_usage"]["cache_creation_input_tokens"]
                    .as_u64()
                    .unwrap(),
            "{r}"
        );
        assert!(r["count_pre"].as_u64() > r["count"].as_u64(), "{r}");
        assert_eq!(
            r["tools"],
            json!([
                400,
                "error",
                "invalid_request_error",
                "`tools[0].input_schema` must be a schema of `type` \"object\", got \"string\""
            ])
        );
        assert_eq!(r["thinking"][0], 400);
        assert_eq!(r["too_long"][0], 400);
        assert_eq!(r["too_long"][2], "invalid_request_error");
        assert_eq!(
            (&r["count_bad"][0], &r["count_bad"][2]),
            (&json!(404), &json!("not_found_error"))
        );
    }
    // Errors on any Anthropic path are in Anthropic's shape.
    let (s, body) = post(port, "/v1/messages/batches", b"{}");
    assert_eq!(
        (s, &body["type"], &body["error"]["type"]),
        (404, &json!("error"), &json!("not_found_error"))
    );
    let (s, body) = post(port, "/v1/messages/count_tokens", b"{");
    assert_eq!(
        (s, &body["error"]["type"]),
        (400, &json!("invalid_request_error")),
        "{body}"
    );
    // llama-server's /tokenize and /detokenize.
    let (s, t) = post(port, "/tokenize", br#"{"content":"Hello, world"}"#);
    assert_eq!(s, 200, "{t}");
    let (s, with_bos) = post(
        port,
        "/tokenize",
        br#"{"content":"Hello, world","add_special":true}"#,
    );
    assert_eq!(s, 200);
    assert!(with_bos["tokens"].as_array().unwrap().len() >= t["tokens"].as_array().unwrap().len());
    let (s, d) = post(
        port,
        "/detokenize",
        json!({"tokens": t["tokens"]}).to_string().as_bytes(),
    );
    assert_eq!((s, &d["content"]), (200, &json!("Hello, world")), "{d}");
    let (_, p) = post(
        port,
        "/tokenize",
        br#"{"content":"Hello, world","with_pieces":true}"#,
    );
    let joined: String = p["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["piece"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(joined, "Hello, world");
    for bad in [
        &br#"{"tokens":[99999]}"#[..],
        br#"{"tokens":"x"}"#,
        br#"{"tokens":[1],"model":"nope"}"#,
    ] {
        let (s, _) = post(port, "/detokenize", bad);
        assert!((400..500).contains(&s), "{s}");
    }
    let (s, _) = post(port, "/tokenize", br#"{"content":5}"#);
    assert_eq!(s, 400);
}

const KEYS: &str = r#"
import json, os
import openai, anthropic
try:
    import httpx2 as httpx
except ImportError:
    import httpx

MODEL = os.environ["U_MODEL"]
out = {}
for kind in ["tcp", "unix"]:
    def http():
        if kind == "unix":
            return httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"]), timeout=60)
        return httpx.Client(timeout=60)
    o_base = "http://localhost/v1" if kind == "unix" else os.environ["U_BASE"]
    a_base = "http://localhost" if kind == "unix" else os.environ["U_ROOT"]
    r = {}
    msgs = [{"role": "user", "content": "Hi"}]
    good = openai.OpenAI(base_url=o_base, api_key=os.environ["U_KEY_A"], http_client=http(), max_retries=0)
    r["openai_ok"] = good.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2).choices[0].finish_reason
    bad = openai.OpenAI(base_url=o_base, api_key="sk-wrong-wrong-wrong-wrong", http_client=http(), max_retries=0)
    try:
        bad.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        r["openai_bad"] = None
    except openai.AuthenticationError as e:
        r["openai_bad"] = [e.status_code, e.body.get("type")]
    a = anthropic.Anthropic(base_url=a_base, api_key=os.environ["U_KEY_B"], http_client=http(), max_retries=0)
    r["anthropic_ok"] = a.messages.create(model=MODEL, messages=msgs, max_tokens=2).stop_reason
    abad = anthropic.Anthropic(base_url=a_base, api_key="sk-wrong-wrong-wrong-wrong", http_client=http(), max_retries=0)
    try:
        abad.messages.create(model=MODEL, messages=msgs, max_tokens=2)
        r["anthropic_bad"] = None
    except anthropic.AuthenticationError as e:
        r["anthropic_bad"] = [e.status_code, e.body["type"], e.body["error"]["type"]]
    out[kind] = r
print(json.dumps(out))
"#;

#[test]
fn api_keys_and_cors_allow_list() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let (key_a, key_b) = ("sk-alice-0123456789abcdef", "sk-bob-fedcba9876543210");
    let keys = secrets.join("keys");
    std::fs::write(&keys, format!("# name key\nalice {key_a}\nbob {key_b}\n")).unwrap();
    let options = Options {
        transport_config: format!(
            "api_keys_file = \"{}\"\ncors_allow_origins = [\"https://app.example\"]",
            keys.display()
        ),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let port = server.port;
    let v = run(KEYS, &server, &[("U_KEY_A", key_a), ("U_KEY_B", key_b)]);
    eprintln!("client saw {v}");
    for kind in ["tcp", "unix"] {
        let r = &v[kind];
        assert_eq!(r["openai_ok"], "length", "{kind}");
        assert_eq!(
            r["openai_bad"],
            json!([401, "authentication_error"]),
            "{kind}"
        );
        assert_eq!(r["anthropic_ok"], "max_tokens", "{kind}");
        assert_eq!(
            r["anthropic_bad"],
            json!([401, "error", "authentication_error"]),
            "{kind}"
        );
    }
    let (s, _) = post(port, "/v1/models", b"");
    assert_eq!(s, 405);
    let (s, _) = http(
        port,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 401, "no key");
    let (s, _) = http(
        port,
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(s, 200, "health needs no key");
    // A preflight from an allowed origin, then the request itself.
    let pre = raw(
        port,
        "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\n\
         Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\
         Connection: close\r\n\r\n",
    )
    .to_ascii_lowercase();
    assert!(pre.starts_with("http/1.1 204"), "{pre}");
    assert!(
        pre.contains("access-control-allow-origin: https://app.example"),
        "{pre}"
    );
    assert!(
        pre.contains("access-control-allow-methods: post, options"),
        "{pre}"
    );
    assert!(
        pre.contains("access-control-allow-headers: authorization"),
        "{pre}"
    );
    let body =
        r#"{"model":"tiny-llama","messages":[{"role":"user","content":"Hi"}],"max_tokens":2}"#;
    let call = |origin: &str, key: &str| {
        raw(
            port,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: {origin}\r\n\
                 Authorization: Bearer {key}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        )
        .to_ascii_lowercase()
    };
    let ok = call("https://app.example", key_a);
    assert!(ok.starts_with("http/1.1 200"), "{ok}");
    assert!(
        ok.contains("access-control-allow-origin: https://app.example"),
        "{ok}"
    );
    let denied = call("https://evil.example", key_a);
    assert!(denied.starts_with("http/1.1 403"), "{denied}");
    assert!(!denied.contains("access-control-allow-origin"), "{denied}");
    let pre_denied = raw(
        port,
        "OPTIONS /v1/messages HTTP/1.1\r\nHost: x\r\nOrigin: https://evil.example\r\n\
         Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n",
    );
    assert!(pre_denied.starts_with("HTTP/1.1 403"), "{pre_denied}");
    assert!(
        pre_denied.contains("permission_error"),
        "Anthropic's shape: {pre_denied}"
    );
    let wrong = call("https://app.example", "sk-nope-nope-nope-nope");
    assert!(wrong.starts_with("http/1.1 401"), "{wrong}");
    assert!(
        call("https://app.example", key_b).starts_with("http/1.1 200"),
        "serves on"
    );
}

/// `[model] aliases`: the model answers to its other names through the official client (the
/// list names them all), over TCP and the Unix socket; an unknown name is still a 404.
#[test]
fn model_aliases_are_served_and_listed() {
    let server = start_tiny(&Options {
        model_config: r#"aliases = ["gpt-4o-mini", "local/tiny"]"#.into(),
        ..Options::default()
    });
    let got = run(
        r#"
import json, os, openai
try:
    import httpx2 as httpx
except ImportError:
    import httpx
out = {}
for kind in ["tcp", "unix"]:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=os.environ["U_SOCK"])) if kind == "unix" else None
    base = "http://localhost/v1" if kind == "unix" else os.environ["U_BASE"]
    c = openai.OpenAI(base_url=base, api_key="none", http_client=http)
    names = sorted(m.id for m in c.models.list().data)
    texts = [c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4, temperature=0).choices[0].message.content
             for m in [os.environ["U_MODEL"], "gpt-4o-mini", "local/tiny"]]
    try:
        c.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        unknown = None
    except openai.NotFoundError as e:
        unknown = e.status_code
    out[kind] = {"names": names, "texts": texts, "unknown": unknown}
print(json.dumps(out))
"#,
        &server,
        &[],
    );
    for kind in ["tcp", "unix"] {
        let r = &got[kind];
        assert_eq!(
            r["names"],
            json!(["gpt-4o-mini", "local/tiny", MODEL]),
            "{r}"
        );
        let texts = r["texts"].as_array().unwrap();
        assert!(texts.iter().all(|t| t == &texts[0]), "{r}");
        assert_eq!(r["unknown"], 404, "{r}");
    }
}

/// One HTTP/1.1 request over TCP (`port`) or a Unix socket, with an API key when given:
/// (status, body as JSON, or null).
fn call(
    to: Result<u16, &std::path::Path>,
    method: &str,
    path: &str,
    body: &str,
    key: Option<&str>,
) -> (u16, Value) {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    call_with(to, method, path, body, &auth)
}

/// [`call`] signed as Safebox asks, with the named HMAC key `(id, key)` and a fresh nonce.
fn signed_call(
    to: Result<u16, &std::path::Path>,
    method: &str,
    path: &str,
    body: &str,
    (id, key): (&str, &str),
) -> (u16, Value) {
    use hmac::{Hmac, Mac};
    use sha2::{Digest, Sha256};
    use std::sync::atomic::{AtomicU64, Ordering};
    static NONCE: AtomicU64 = AtomicU64::new(0);
    let nonce = format!("nonce-{:016}", NONCE.fetch_add(1, Ordering::Relaxed));
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let canonical = format!(
        "{method}\n{path}\n{ts}\n{nonce}\n{}",
        hex::encode(Sha256::digest(body.as_bytes()))
    );
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).unwrap();
    mac.update(canonical.as_bytes());
    let sig = hex::encode(mac.finalize().into_bytes());
    let auth = format!(
        "X-Safebox-Key-Id: {id}\r\nX-Safebox-Timestamp: {ts}\r\nX-Safebox-Nonce: {nonce}\r\nX-Safebox-Signature: v1={sig}\r\n"
    );
    call_with(to, method, path, body, &auth)
}

/// One request with the header lines `auth`: (status, body as JSON, or null).
fn call_with(
    to: Result<u16, &std::path::Path>,
    method: &str,
    path: &str,
    body: &str,
    auth: &str,
) -> (u16, Value) {
    let raw = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut out = String::new();
    match to {
        Ok(port) => {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(raw.as_bytes()).unwrap();
            let _ = s.read_to_string(&mut out);
        }
        Err(socket) => {
            let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
            s.write_all(raw.as_bytes()).unwrap();
            let _ = s.read_to_string(&mut out);
        }
    }
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// A completion resuming checkpoint `private`.
fn resume_private() -> String {
    format!(
        r#"{{"model":"{MODEL}","prompt":" to","resume_from":"private","max_tokens":2,"temperature":0}}"#
    )
}

/// Every use of checkpoint `private` besides listing: resume, fork, graft, delete, as
/// (method, path, body).
fn uses_of_private() -> [(&'static str, &'static str, String); 4] {
    [
        ("POST", "/v1/completions", resume_private()),
        (
            "POST",
            "/v1/checkpoints/fork",
            r#"{"source":"private","name":"mine"}"#.into(),
        ),
        (
            "POST",
            "/v1/checkpoints/graft",
            r#"{"target":"private","source":"private","name":"g"}"#.into(),
        ),
        ("DELETE", "/v1/checkpoints/private", String::new()),
    ]
}

fn checkpoint_names(v: &Value) -> Vec<String> {
    v["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| c["name"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// #16: a checkpoint belongs to the client that saved it — by API key name, and by Unix peer
/// uid. Another client does not see it listed, and its resume, fork, graft and delete answer
/// 404, as for a name that does not exist (existence is not revealed); unauthenticated TCP
/// clients share one namespace of their own.
#[test]
fn checkpoints_belong_to_the_client_that_saved_them() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let (alice, bob) = ("sk-alice-0123456789abcdef", "sk-bob-fedcba9876543210");
    let keys = secrets.join("keys");
    std::fs::write(&keys, format!("alice {alice}\nbob {bob}\n")).unwrap();
    let options = Options {
        transport_config: format!("api_keys_file = \"{}\"", keys.display()),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let tcp = Ok(server.port);
    let save = r#"{"name":"private","prompt":"My secret plan is"}"#;
    let (s, v) = call(tcp, "POST", "/v1/checkpoints", save, Some(alice));
    assert_eq!(s, 201, "{v}");
    let (_, v) = call(tcp, "GET", "/v1/checkpoints", "", Some(alice));
    assert_eq!(checkpoint_names(&v), ["private"], "{v}");
    let (_, v) = call(tcp, "GET", "/v1/checkpoints", "", Some(bob));
    assert!(checkpoint_names(&v).is_empty(), "bob sees {v}");
    let resume = resume_private();
    for (method, path, body) in uses_of_private() {
        let body = body.as_str();
        let (s, v) = call(tcp, method, path, body, Some(bob));
        assert_eq!(s, 404, "bob {method} {path}: {v}");
        let (s_none, _) = call(
            tcp,
            method,
            &path.replace("private", "nothing"),
            &body.replace("private", "nothing"),
            Some(bob),
        );
        assert_eq!(s_none, 404, "a name that does not exist answers alike");
    }
    // Bob's own checkpoint of the same name is his, and alice's is untouched.
    let (s, _) = call(tcp, "POST", "/v1/checkpoints", save, Some(bob));
    assert_eq!(s, 201);
    let (s, v) = call(tcp, "POST", "/v1/completions", &resume, Some(alice));
    assert_eq!(s, 200, "{v}");
    let (s, _) = call(tcp, "DELETE", "/v1/checkpoints/private", "", Some(bob));
    assert_eq!(s, 200);
    let (_, v) = call(tcp, "GET", "/v1/checkpoints", "", Some(alice));
    assert_eq!(checkpoint_names(&v), ["private"], "{v}");
    drop(server);

    // Without keys: a Unix peer owns its checkpoints by uid; TCP clients share their own.
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let server = start_with(dir, &model, "loader-safetensors", &Options::default());
    let (tcp, unix) = (Ok(server.port), Err(server.socket.as_path()));
    let (s, _) = call(unix, "POST", "/v1/checkpoints", save, None);
    assert_eq!(s, 201);
    let (_, v) = call(unix, "GET", "/v1/checkpoints", "", None);
    assert_eq!(checkpoint_names(&v), ["private"], "{v}");
    let (_, v) = call(tcp, "GET", "/v1/checkpoints", "", None);
    assert!(checkpoint_names(&v).is_empty(), "TCP sees {v}");
    let (s, _) = call(tcp, "POST", "/v1/completions", &resume, None);
    assert_eq!(s, 404);
    let shared = r#"{"name":"shared","prompt":"Hello"}"#;
    assert_eq!(call(tcp, "POST", "/v1/checkpoints", shared, None).0, 201);
    let (_, v) = call(tcp, "GET", "/v1/checkpoints", "", None);
    assert_eq!(checkpoint_names(&v), ["shared"], "{v}");
    // The owned form of a name is not for the shared namespace.
    let (s, v) = call(
        tcp,
        "POST",
        "/v1/checkpoints",
        r#"{"name":"o-0123456789abcdef.x","prompt":"Hi"}"#,
        None,
    );
    assert_eq!(s, 400, "{v}");
}

/// #16: with several named HMAC keys (`hmac_keys_file`) each key id is a client: app1's
/// checkpoint is not found by app2 (list, resume, fork, graft, delete: 404); the admin scope
/// (`admin_clients`) lists both clients' checkpoints, says whose each is, and deletes one by
/// its stored name. A Unix peer made admin by uid sees the TCP clients' shared checkpoints.
#[test]
fn hmac_key_ids_own_checkpoints_and_the_admin_scope_sees_all() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(&secrets).unwrap();
    let (app1, app2, ops) = (
        ("app1", "app1-secret-0123456789"),
        ("app2", "app2-secret-9876543210"),
        ("ops", "ops-secret-abcdefghijkl"),
    );
    let keys = secrets.join("hmac-keys");
    std::fs::write(
        &keys,
        format!(
            "# id key\n{} {}\n{} {}\n{} {}\n",
            app1.0, app1.1, app2.0, app2.1, ops.0, ops.1
        ),
    )
    .unwrap();
    let options = Options {
        transport_config: format!(
            "hmac_keys_file = \"{}\"\nadmin_clients = [\"hmac:ops\"]",
            keys.display()
        ),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let tcp = Ok(server.port);
    let save = r#"{"name":"private","prompt":"My secret plan is"}"#;
    assert_eq!(
        signed_call(tcp, "POST", "/v1/checkpoints", save, app1).0,
        201
    );
    let (_, v) = signed_call(tcp, "GET", "/v1/checkpoints", "", app1);
    assert_eq!(checkpoint_names(&v), ["private"], "{v}");
    let (_, v) = signed_call(tcp, "GET", "/v1/checkpoints", "", app2);
    assert!(checkpoint_names(&v).is_empty(), "app2 sees {v}");
    for (method, path, body) in uses_of_private() {
        let (s, v) = signed_call(tcp, method, path, &body, app2);
        assert_eq!(s, 404, "app2 {method} {path}: {v}");
    }
    // Unsigned, or signed under another key's id: refused.
    assert_eq!(call(tcp, "GET", "/v1/checkpoints", "", None).0, 401);
    assert_eq!(
        signed_call(tcp, "GET", "/v1/checkpoints", "", (app2.0, app1.1)).0,
        401
    );
    assert_eq!(
        signed_call(tcp, "POST", "/v1/checkpoints", save, app2).0,
        201
    );

    // The admin sees both clients' `private`, each under its stored name and owner.
    let (s, v) = signed_call(tcp, "GET", "/v1/checkpoints", "", ops);
    assert_eq!(s, 200, "{v}");
    let listed: Vec<(String, String)> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["owner"].as_str().unwrap_or_default().to_string(),
                c["name"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let mut owners: Vec<&str> = listed.iter().map(|(o, _)| o.as_str()).collect();
    owners.sort();
    assert_eq!(owners, ["hmac:app1", "hmac:app2"], "{v}");
    assert!(listed.iter().all(|(_, n)| n.ends_with(".private")), "{v}");
    let app1_stored = &listed.iter().find(|(o, _)| o == "hmac:app1").unwrap().1;
    let (s, v) = signed_call(
        tcp,
        "DELETE",
        &format!("/v1/checkpoints/{app1_stored}"),
        "",
        ops,
    );
    assert_eq!(s, 200, "{v}");
    let (_, v) = signed_call(tcp, "GET", "/v1/checkpoints", "", app1);
    assert!(checkpoint_names(&v).is_empty(), "deleted by the admin: {v}");
    let (_, v) = signed_call(tcp, "GET", "/v1/checkpoints", "", app2);
    assert_eq!(
        checkpoint_names(&v),
        ["private"],
        "app2's is untouched: {v}"
    );
    drop(server);

    // A Unix peer in the admin scope by uid: it sees what TCP clients saved in their shared
    // namespace, which they see under its plain name.
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let uid = std::fs::metadata(dir.path()).unwrap().uid();
    let model = model_dir(dir.path());
    let options = Options {
        transport_config: format!("admin_clients = [\"unix:uid={uid}\"]"),
        ..Options::default()
    };
    let server = start_with(dir, &model, "loader-safetensors", &options);
    let (tcp, unix) = (Ok(server.port), Err(server.socket.as_path()));
    assert_eq!(call(tcp, "POST", "/v1/checkpoints", save, None).0, 201);
    let (_, v) = call(unix, "GET", "/v1/checkpoints", "", None);
    assert_eq!(checkpoint_names(&v), ["private"], "{v}");
    assert_eq!(
        v["data"][0]["owner"],
        Value::Null,
        "the shared namespace: {v}"
    );
    assert_eq!(
        call(unix, "DELETE", "/v1/checkpoints/private", "", None).0,
        200
    );
    let (_, v) = call(tcp, "GET", "/v1/checkpoints", "", None);
    assert!(checkpoint_names(&v).is_empty(), "{v}");
}

/// #16: by default (runner-text's `share_prefixes = "client"`) a client's cached prompt
/// prefixes serve only that client: bob's first request with alice's exact prompt prefills it
/// all (`cached_tokens` 0) while alice's own repeat is served from the cache; with `"all"` bob
/// hits alice's prefix, and with `"none"` nobody does.
#[test]
fn cached_prefixes_serve_only_their_client_by_default() {
    let prompt = "The quarterly numbers for the secret project are as follows: revenue grew";
    let body =
        format!(r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":1,"temperature":0}}"#);
    let cached = |port: u16, key: &str| {
        let (s, v) = call(Ok(port), "POST", "/v1/completions", &body, Some(key));
        assert_eq!(s, 200, "{v}");
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    for (mode, alice_again, bob_after) in [
        ("client", true, false),
        ("all", true, true),
        ("none", false, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = model_dir(dir.path());
        let secrets = dir.path().join("secrets");
        std::fs::create_dir_all(&secrets).unwrap();
        let (alice, bob) = ("sk-alice-0123456789abcdef", "sk-bob-fedcba9876543210");
        let keys = secrets.join("keys");
        std::fs::write(&keys, format!("alice {alice}\nbob {bob}\n")).unwrap();
        let options = Options {
            transport_config: format!("api_keys_file = \"{}\"", keys.display()),
            runner_config: if mode == "client" {
                String::new() // the default
            } else {
                format!("share_prefixes = \"{mode}\"")
            },
            ..Options::default()
        };
        let server = start_with(dir, &model, "loader-safetensors", &options);
        assert_eq!(cached(server.port, alice), 0, "{mode}: alice first");
        assert_eq!(
            cached(server.port, alice) > 0,
            alice_again,
            "{mode}: alice again"
        );
        assert_eq!(
            cached(server.port, bob) > 0,
            bob_after,
            "{mode}: bob after alice"
        );
    }
}

/// #15: with a vocabulary that has fill-in-the-middle tokens, `suffix` on `/v1/completions`
/// becomes the FIM prompt `<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>`: the prompt grows by
/// the suffix's characters and three single tokens (the tiny tokenizer is one token a
/// character, so spelled out they would be 42), and the answer is the greedy continuation of
/// exactly that prompt as `/tokenize` splits it.
#[test]
fn suffix_becomes_a_fill_in_the_middle_prompt_with_the_models_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    // The tiny tokenizer with its last three (unused) characters turned into FIM tokens.
    let path = model.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let fim = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().unwrap() < 125);
    for (i, name) in fim.iter().enumerate() {
        vocab.insert(name.to_string(), json!(125 + i));
    }
    for (i, name) in fim.iter().enumerate() {
        t["added_tokens"].as_array_mut().unwrap().push(json!({
            "id": 125 + i, "content": name, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    }
    std::fs::write(&path, t.to_string()).unwrap();
    let server = start_with(dir, &model, "loader-safetensors", &Options::default());
    let ask = |extra: Value| {
        let mut body = json!({"model": MODEL, "prompt": "def f(", "max_tokens": 4,
            "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (s, v) = post(server.port, "/v1/completions", body.to_string().as_bytes());
        assert_eq!(s, 200, "{v}");
        v
    };
    let plain = ask(json!({}));
    let filled = ask(json!({"suffix": ") end"}));
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        tokens(&filled),
        tokens(&plain) + 5 + 3,
        "{filled} vs {plain}"
    );
    let (s, ids) = post(
        server.port,
        "/tokenize",
        json!({"model": MODEL, "content": format!("{}def f({}) end{}", fim[0], fim[1], fim[2]),
            "add_special": false, "parse_special": true})
        .to_string()
        .as_bytes(),
    );
    assert_eq!(s, 200, "{ids}");
    let ids = ids["tokens"].as_array().unwrap();
    assert_eq!(ids.len(), 14, "{ids:?}");
    assert_eq!(
        [&ids[0], &ids[7], &ids[13]].map(|i| i.as_u64().unwrap()),
        [125, 126, 127]
    );
    let literal =
        ask(json!({"prompt": [ids.iter().map(|i| i.as_u64().unwrap()).collect::<Vec<_>>()]}));
    assert_eq!(
        filled["choices"][0]["text"], literal["choices"][0]["text"],
        "{filled} vs {literal}"
    );
}
