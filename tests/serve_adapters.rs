//! Issue 17, low-rank adapters as an operator and clients use them: `u-runner generate --lora`
//! from a PEFT directory or llama.cpp's GGUF LoRA (the same adapter gives the same tokens; scale 0
//! is the base model), and `u-runner serve` with `[model.adapters]`, chosen per request by the
//! official `openai` and `anthropic` clients — as the model name (`base:adapter` or the
//! adapter's own), as llama.cpp's `lora: [{id, scale}]` and as the Safebox `adapters` field —
//! with requests under different adapters answered in shared batches exactly as alone, and
//! prompt KV computed under one adapter never reused under another.

use serde_json::{Value, json};
use std::path::PathBuf;
use u_conformance::{
    bin, root, run,
    serving::{
        MODEL, Options, bias_lora_path, generate_json, model_dir, post, python_client, start_tiny,
    },
    text,
};

fn lora(name: &str) -> PathBuf {
    root()
        .join("plugins/arch-llama/tests/fixtures/lora")
        .join(name)
}

fn ids(v: &Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn generate_runs_under_an_adapter_from_peft_or_gguf_and_scale_zero_is_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let run = |extra: &[&str]| {
        ids(&generate_json(
            &model,
            &[&["-p", "Hello, world", "-n", "12"], extra].concat(),
        ))
    };
    let base = run(&[]);
    let peft = lora("a").display().to_string();
    let gguf = lora("a.gguf").display().to_string();
    let under_a = run(&["--lora", &peft]);
    assert_ne!(under_a, base, "the adapter changes the greedy tokens");
    assert_eq!(
        run(&["--lora", &gguf]),
        under_a,
        "llama.cpp's GGUF form of the same adapter"
    );
    assert_eq!(
        run(&["--lora", &format!("{peft}:0")]),
        base,
        "scale 0 is the base"
    );
    let both = run(&["--lora", &peft, "--lora", &lora("b").display().to_string()]);
    assert_ne!(both, under_a);
    eprintln!("base {base:?}\nunder a {under_a:?}\nunder a+b {both:?}");
}

const SCRIPT: &str = r#"
import json, os, concurrent.futures
from openai import OpenAI
import anthropic
client = OpenAI(base_url=os.environ["U_BASE"], api_key="unused", max_retries=0)
model = os.environ["U_MODEL"]
listed = [m.id for m in client.models.list().data]

def complete(prompt="Hello, world", **kw):
    r = client.completions.create(model=kw.pop("model", model), prompt=prompt, max_tokens=12, temperature=0, **kw)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else None

solo = {}
for name in [None, "a", "b", "c"]:
    solo[str(name)] = complete(model=model if name is None else f"{model}:{name}")[0]
forms = {
    "own name": complete(model="a")[0],
    "lora by name": complete(extra_body={"lora": [{"id": "a", "scale": 1.0}]})[0],
    "lora by index": complete(extra_body={"lora": [{"id": 0}]})[0],
    "lora scale 0": complete(extra_body={"lora": [{"id": "a", "scale": 0}]})[0],
}
# 16 at once over the four settings: batched together, each as alone.
settings = [None, "a", "b", "c"] * 4
with concurrent.futures.ThreadPoolExecutor(16) as pool:
    together = list(pool.map(lambda n: complete(model=model if n is None else f"{model}:{n}")[0], settings))
mixed_ok = all(t == solo[str(n)] for t, n in zip(together, settings))

# The prefix cache is keyed by the adapter set: a long prompt under `a`, then the base.
long = "The quick brown fox jumps over the lazy dog. " * 2
_, first_a = complete(long, model=f"{model}:a")
_, base_after_a = complete(long)
_, base_again = complete(long)
_, a_again = complete(long, model=f"{model}:a")

chat = client.chat.completions.create(model=f"{model}:b", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0).choices[0].message.content
ant = anthropic.Anthropic(base_url=os.environ["U_ROOT"], api_key="unused", max_retries=0)
msg = ant.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"lora": [{"id": "b"}], "temperature": 0})
errors = {}
for what, kw in {"unknown model adapter": {"model": f"{model}:zzz"}, "unknown lora": {"extra_body": {"lora": [{"id": "zzz"}]}}, "lora index past the end": {"extra_body": {"lora": [{"id": 9}]}}, "bad lora": {"extra_body": {"lora": "a"}}}.items():
    try:
        complete(**kw)
        errors[what] = None
    except Exception as e:
        errors[what] = [getattr(e, "status_code", None), str(e)]
print(json.dumps({"listed": listed, "solo": solo, "forms": forms, "mixed_ok": mixed_ok, "together": together,
  "cache": [first_a, base_after_a, base_again, a_again], "chat_b": chat, "anthropic_b": msg.content[0].text, "errors": errors}))
"#;

#[test]
fn clients_choose_adapters_per_request_and_kv_is_never_shared_across_adapters() {
    let options = Options {
        model_config: format!(
            "[model.adapters]\na = \"{}\"\nb = \"{}\"\nc = \"{}\"\n",
            lora("a").display(),
            lora("b").display(),
            lora("c").display()
        ),
        ..Options::default()
    };
    let server = start_tiny(&options);
    let env = [
        ("U_MODEL", MODEL.to_string()),
        ("U_BASE", server.url()),
        ("U_ROOT", format!("http://127.0.0.1:{}", server.port)),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let v = python_client(SCRIPT, &env, &server);
    eprintln!("{}", serde_json::to_string_pretty(&v).unwrap());
    assert_eq!(v["listed"], json!([MODEL, "a", "b", "c"]));
    let solo = &v["solo"];
    let texts: std::collections::HashSet<&str> = ["None", "a", "b", "c"]
        .iter()
        .map(|k| solo[k].as_str().unwrap())
        .collect();
    assert_eq!(texts.len(), 4, "each adapter answers differently: {solo}");
    for form in ["own name", "lora by name", "lora by index"] {
        assert_eq!(v["forms"][form], solo["a"], "{form}");
    }
    assert_eq!(v["forms"]["lora scale 0"], solo["None"]);
    assert_eq!(v["mixed_ok"], true, "{}", v["together"]);
    // The base run after `a` finds no more of the long prompt cached than the first run under
    // `a` did (the BOS every earlier request of its own adapter set shares); a repeat under
    // the same adapters reuses the whole prompt.
    let cache: Vec<u64> = v["cache"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap_or(0))
        .collect();
    assert!(
        cache[1] <= cache[0] && cache[0] <= 1,
        "a base request reused KV computed under adapter a: {cache:?}"
    );
    assert!(cache[2] > 40 && cache[3] > 40, "{cache:?}");
    assert_eq!(
        v["chat_b"], v["anthropic_b"],
        "OpenAI and Anthropic agree under adapter b"
    );
    for (what, e) in v["errors"].as_object().unwrap() {
        let status = e[0].as_u64();
        assert!(matches!(status, Some(400 | 404)), "{what}: {e}");
    }
    // The Safebox protocol's `adapters` field, through its endpoint, equals the OpenAI chat
    // under the same adapter (same rendered conversation).
    let (status, safebox) = post(
        server.port,
        "/v1/safebox/llm",
        br#"{"userInput": "Hi", "max_tokens": 8, "temperature": 0, "adapters": [{"id": "b"}]}"#,
    );
    assert_eq!(status, 200, "{safebox}");
    assert_eq!(safebox["text"], v["chat_b"], "{safebox}");
    // generate --lora gives the server's answer under the same adapter.
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let cli = generate_json(
        &model,
        &[
            "-p",
            "Hello, world",
            "-n",
            "12",
            "--lora",
            &lora("a").display().to_string(),
        ],
    );
    assert_eq!(cli["text"], solo["a"]);
}

/// A real PEFT adapter from a registry package — rank 16 on t5-large's `q` and `v` — parses,
/// and is refused by name on the tiny Llama: its modules are no projection of this model.
#[test]
fn a_real_adapter_for_another_base_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let adapter = bias_lora_path();
    let out = run(std::process::Command::new(bin("u-runner"))
        .args(["generate", "-p", "Hi", "-n", "4", "--lora"])
        .arg(&adapter)
        .arg("--model")
        .arg(&model)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml")));
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("adapter `bias-detector-lora`")
            && said.contains(".SelfAttention.")
            && said.contains("names no projection of this llama model")
            && said.contains("trained on `t5-large`"),
        "{said}"
    );
    eprintln!("{}", said.lines().last().unwrap_or_default());
}

fn steering(name: &str) -> PathBuf {
    root()
        .join("plugins/arch-llama/tests/fixtures/steering")
        .join(name)
}

/// Control vectors and soft prompts as operators load them (`[model.control_vectors]`,
/// `[model.soft_prompts]`, `generate --control-vector/--soft-prompt`) and clients ask for them
/// (`control_vectors`, `soft_prompt`): strength 0 is the base; a soft prompt's virtual tokens
/// count in the usage and never appear in the text; `generate` and the server agree.
#[test]
fn control_vectors_and_soft_prompts_per_request() {
    let options = Options {
        model_config: format!(
            "[model.control_vectors]\ncvec = \"{}\"\n[model.soft_prompts]\nsoft = \"{}\"\n",
            steering("cvec.safetensors").display(),
            steering("soft").display()
        ),
        ..Options::default()
    };
    let server = start_tiny(&options);
    let ask = |extra: &str| {
        let body = format!(
            r#"{{"model": "{MODEL}", "prompt": "Hello, world", "max_tokens": 12, "temperature": 0, "logprobs": 1{extra}}}"#
        );
        let (status, v) = post(server.port, "/v1/completions", body.as_bytes());
        assert_eq!(status, 200, "{v}");
        // The tiny model's greedy text is one letter over and over; the first token's
        // log-probability (deterministic) shows a change too small to turn it.
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["choices"][0]["logprobs"]["token_logprobs"][0]
                .as_f64()
                .unwrap(),
        )
    };
    let base = ask("");
    let steered = ask(r#", "control_vectors": [{"name": "cvec", "strength": 4}]"#);
    let zero = ask(r#", "control_vectors": [{"name": "cvec", "strength": 0}]"#);
    let outside =
        ask(r#", "control_vectors": [{"name": "cvec", "strength": 4, "layers": [0, 0]}]"#);
    let soft = ask(r#", "soft_prompt": "soft""#);
    eprintln!("base {base:?}\nsteered {steered:?}\nsoft {soft:?}");
    assert_ne!(steered.2, base.2, "the vector moves the logits");
    assert_eq!(zero, base, "strength 0");
    assert_eq!(outside, base, "block 1's vector outside the range [0, 0]");
    assert_ne!(soft.2, base.2, "the soft prompt moves the logits");
    assert_eq!(
        soft.1,
        base.1 + 4,
        "four virtual tokens counted in the prompt"
    );
    for (extra, says) in [
        (r#", "control_vectors": [{"name": "nope"}]"#, "not loaded"),
        (r#", "soft_prompt": "nope""#, "not loaded"),
        (
            r#", "control_vectors": [{"name": "cvec", "layers": [2, 1]}]"#,
            "layers",
        ),
    ] {
        let body = format!(r#"{{"model": "{MODEL}", "prompt": "Hi", "max_tokens": 2{extra}}}"#);
        let (status, v) = post(server.port, "/v1/completions", body.as_bytes());
        assert!(
            matches!(status, 400 | 404) && v.to_string().contains(says),
            "{status} {v}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let run = |extra: &[&str]| {
        generate_json(
            &model,
            &[&["-p", "Hello, world", "-n", "12"], extra].concat(),
        )["text"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let cvec = format!("{}:40", steering("cvec.gguf").display());
    let strong = ask(r#", "control_vectors": [{"name": "cvec", "strength": 40}]"#);
    assert_ne!(strong.0, base.0);
    assert_eq!(
        run(&["--control-vector", &cvec]),
        strong.0,
        "GGUF via generate = safetensors via serve"
    );
    assert_eq!(
        run(&["--soft-prompt", &steering("soft").display().to_string()]),
        soft.0
    );
}

/// Raw POST returning the status and body text (the adapter endpoints answer in plain text, as
/// vLLM's do).
fn post_text(port: u16, path: &str, body: &str) -> (u16, String) {
    let raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    u_conformance::serving::http(port, raw.as_bytes()).unwrap()
}

/// vLLM's runtime endpoints: `POST /v1/load_lora_adapter` loads an adapter from a directory the
/// deployment allows (`[model] adapter_dirs`), the model then serves it by name with no reload;
/// past `adapter_budget_mb` the least recently used idle run-time adapter is unloaded; the
/// deployment's own adapters are pinned; paths outside the allowed directories are refused.
#[test]
fn adapters_load_and_unload_at_run_time_within_a_budget() {
    let options = Options {
        model_config: format!(
            "adapter_dirs = [\"{}\"]\nadapter_budget_mb = 0.02\n[model.adapters]\nb = \"{}\"\n",
            lora("").display(),
            lora("b").display()
        ),
        ..Options::default()
    };
    let server = start_tiny(&options);
    let models = || {
        let (_, v) = u_conformance::serving::http(
            server.port,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        let v: Value = serde_json::from_str(&v).unwrap();
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let complete = |model: &str| {
        let body = format!(
            r#"{{"model": "{model}", "prompt": "Hello, world", "max_tokens": 12, "temperature": 0}}"#
        );
        let (status, v) = post(server.port, "/v1/completions", body.as_bytes());
        (
            status,
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        )
    };
    assert_eq!(models(), [MODEL, "b"]);
    let load = |name: &str, dir: &str| {
        let path = lora(dir).display().to_string();
        post_text(
            server.port,
            "/v1/load_lora_adapter",
            &format!(r#"{{"lora_name": "{name}", "lora_path": "{path}"}}"#),
        )
    };
    let (status, said) = load("a", "a");
    assert_eq!(
        (status, said.as_str()),
        (200, "Success: LoRA adapter 'a' added successfully.")
    );
    assert_eq!(models(), [MODEL, "a", "b"]);
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let cli = generate_json(
        &model,
        &[
            "-p",
            "Hello, world",
            "-n",
            "12",
            "--lora",
            &lora("a").display().to_string(),
        ],
    );
    assert_eq!(
        complete(&format!("{MODEL}:a")),
        (200, cli["text"].as_str().unwrap().to_string())
    );
    let (status, said) = load("a", "a");
    assert_eq!(status, 400, "{said}");
    assert!(said.contains("already been loaded"), "{said}");
    // `c` does not fit beside `a` in 0.02 MB: `a`, idle, makes room; `b` is pinned.
    let (status, said) = load("c", "c");
    assert_eq!(status, 200, "{said}");
    assert_eq!(models(), [MODEL, "b", "c"]);
    assert_eq!(complete(&format!("{MODEL}:a")).0, 404);
    // Outside the allowed directory, another base's adapter, a pinned one.
    let outside = root().join("plugins/arch-llama/tests/fixtures/steering/soft");
    let (status, said) = post_text(
        server.port,
        "/v1/load_lora_adapter",
        &format!(
            r#"{{"lora_name": "x", "lora_path": "{}"}}"#,
            outside.display()
        ),
    );
    assert_eq!(status, 403, "{said}");
    assert!(
        said.contains("not in a directory the deployment allows"),
        "{said}"
    );
    // A file of the allowed directory that is no adapter: refused, the others serve on.
    let (status, said) = load("bad", "logits.bin");
    assert_eq!(status, 400, "{said}");
    assert_eq!(complete(&format!("{MODEL}:c")).0, 200);
    let (status, said) = post_text(
        server.port,
        "/v1/unload_lora_adapter",
        r#"{"lora_name": "b"}"#,
    );
    assert_eq!(status, 400, "{said}");
    let (status, said) = post_text(
        server.port,
        "/v1/unload_lora_adapter",
        r#"{"lora_name": "c"}"#,
    );
    assert_eq!(
        (status, said.as_str()),
        (200, "Success: LoRA adapter 'c' removed successfully.")
    );
    let (status, _) = post_text(
        server.port,
        "/v1/unload_lora_adapter",
        r#"{"lora_name": "c"}"#,
    );
    assert_eq!(status, 404);
    assert_eq!(models(), [MODEL, "b"]);
    assert_eq!(
        complete(&format!("{MODEL}:b")).0,
        200,
        "the pinned adapter still serves"
    );
}

/// The metrics the Gateway API Inference Extension's endpoint picker reads, under vLLM's names
/// (issue 21): while one request runs and others wait, `vllm:num_requests_running` and
/// `vllm:num_requests_waiting` count them and `vllm:lora_requests_info` names their adapters;
/// once they are done both are 0 and no adapter is in use; `max_lora` is the resident count.
#[test]
fn the_endpoint_pickers_metrics_follow_the_load() {
    let options = Options {
        model_config: format!(
            "max_running = 1\nmax_queued = 8\n[model.adapters]\na = \"{}\"\nb = \"{}\"\n",
            lora("a").display(),
            lora("b").display()
        ),
        ..Options::default()
    };
    let server = start_tiny(&options);
    let port = server.port;
    let scrape = || {
        let (_, text) = u_conformance::serving::http(
            port,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .unwrap();
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {text}"))
        };
        let info = text
            .lines()
            .find(|l| l.starts_with("vllm:lora_requests_info{"))
            .unwrap_or_else(|| panic!("no vllm:lora_requests_info in {text}"))
            .to_string();
        (
            value("vllm:num_requests_running"),
            value("vllm:num_requests_waiting"),
            value("vllm:kv_cache_usage_perc"),
            info,
        )
    };
    let idle = scrape();
    assert_eq!((idle.0, idle.1), (0.0, 0.0));
    assert!(
        idle.3
            .contains(r#"max_lora="2",running_lora_adapters="",waiting_lora_adapters="""#),
        "{}",
        idle.3
    );
    let busy = std::thread::scope(|s| {
        for i in 0..6 {
            s.spawn(move || {
                let adapter = if i % 2 == 0 { "a" } else { "b" };
                let body = format!(
                    r#"{{"model":"{MODEL}:{adapter}","prompt":"Hello number {i}","max_tokens":200,"temperature":0}}"#
                );
                let (status, v) = post(port, "/v1/completions", body.as_bytes());
                assert_eq!(status, 200, "{v}");
            });
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let m = scrape();
            let named = !m.3.contains(r#"running_lora_adapters="""#)
                && !m.3.contains(r#"waiting_lora_adapters="""#);
            if m.0 == 1.0 && m.1 >= 1.0 && named {
                return Some(m);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
        }
    });
    let busy = busy.expect("never saw one request running and others waiting");
    assert!((0.0..=1.0).contains(&busy.2), "KV usage {}", busy.2);
    let after = scrape();
    assert_eq!((after.0, after.1), (0.0, 0.0), "{:?}", after);
    assert!(
        after
            .3
            .contains(r#"running_lora_adapters="",waiting_lora_adapters="""#)
    );
}
