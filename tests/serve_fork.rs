//! Fork isolation (`isolation = "fork"` in runner-text's config, `process.fork` granted): each
//! request runs in its own forked process, so a session that aborts or exhausts its memory
//! limit fails alone, with a 5xx to its own client, while the others complete and the server
//! serves on; and a forked session generates exactly the tokens thread mode does.

use serde_json::{Value, json};
use u_conformance::serving::{MODEL, Options, Server, http, model_dir, start_tiny, start_with};

/// A deployment in fork mode, its test faults armed.
fn fork_server(pool: usize) -> Server {
    start_tiny(&Options {
        runner_grants: "process.fork = true".into(),
        runner_config: format!(
            "isolation = \"fork\"\nfork_pool = {pool}\nwarm_prompt = \"You are a helpful assistant.\"\nsession_memory_mb = 512\nsession_cpu_seconds = 60"
        ),
        env: vec![("U_FORK_TEST_TRIGGERS".into(), "1".into())],
        ..Options::default()
    })
}

/// A greedy completion of `prompt`: the status (0 when the server did not answer) and the
/// answer.
fn complete(server: &Server, prompt: &str) -> (u16, Value) {
    let body =
        json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}).to_string();
    let raw = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    match http(server.port, raw.as_bytes()) {
        Ok((status, body)) => (status, serde_json::from_str(&body).unwrap_or(Value::Null)),
        Err(e) => (0, json!(e.to_string())),
    }
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn prompts() -> Vec<String> {
    (0..8)
        .map(|i| {
            format!(
                "You are a helpful assistant. Session {i}: count {i} {}",
                i + 1
            )
        })
        .collect()
}

#[test]
fn a_crashing_or_memory_hungry_session_fails_alone() {
    let threads = start_tiny(&Options::default());
    let want: Vec<String> = prompts()
        .iter()
        .map(|p| {
            let (status, v) = complete(&threads, p);
            assert_eq!(status, 200, "thread mode: {v}");
            text_of(&v)
        })
        .collect();
    drop(threads);

    let server = fork_server(2);
    let log = server.log();
    assert!(log.contains("fork isolation: zygote"), "{log}");
    let faults = ["<<u-test:abort>>", "<<u-test:exhaust-memory>>"]
        .map(|f| format!("You are a helpful assistant. {f}"));
    let all: Vec<String> = prompts().into_iter().chain(faults).collect();
    let server = &server;
    let results: Vec<(String, u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = all
            .into_iter()
            .map(|p| {
                s.spawn(move || {
                    let (status, v) = complete(server, &p);
                    (p, status, v)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (prompt, status, v)) in results.iter().enumerate() {
        if i < 8 {
            assert_eq!(*status, 200, "{prompt}: {v}\n{}", server.log());
            assert_eq!(
                text_of(v),
                want[i],
                "{prompt}: fork mode differs from thread mode"
            );
        } else {
            assert!(
                (500..600).contains(status),
                "{prompt}: a failed session answers 5xx, got {status} {v}\n{}",
                server.log()
            );
            let message = v["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("session process ended"), "{v}");
        }
    }
    // The zygote reaps its sessions every half second and logs how they ended.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !server.log().contains("killed by SIGABRT") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let log = server.log();
    assert!(
        log.contains("killed by SIGABRT"),
        "the abort is logged:\n{log}"
    );
    // The parent serves on, and new sessions replace the dead ones.
    let (status, v) = complete(server, &prompts()[3]);
    assert_eq!(status, 200, "{v}");
    assert_eq!(text_of(&v), want[3]);
    let (status, metrics) = http(
        server.port,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("u_model_fork_failed_sessions 2"),
        "two sessions failed:\n{metrics}"
    );
}

#[test]
fn fork_mode_needs_process_fork_granted() {
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let options = Options {
        runner_config: "isolation = \"fork\"".into(),
        ..Options::default()
    };
    let started =
        std::panic::catch_unwind(|| start_with(dir, &model, "loader-safetensors", &options));
    let message = match started {
        Ok(_) => panic!("fork mode started without process.fork"),
        Err(p) => p.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    assert!(message.contains("process.fork"), "{message}");
}

/// The warm-up line of a fork-mode log: (prompt tokens, tokens from the cache).
fn warm_up(log: &str) -> (u32, u32) {
    let line = log
        .lines()
        .find(|l| l.contains("warm-up of"))
        .unwrap_or_else(|| panic!("no warm-up line:\n{log}"));
    let numbers: Vec<u32> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (numbers[0], numbers[1])
}

#[test]
fn a_warm_restart_maps_the_warm_up_back_instead_of_prefilling_it() {
    let kv = tempfile::tempdir().unwrap();
    let options = Options {
        runner_grants: "process.fork = true".into(),
        runner_config: "isolation = \"fork\"\nwarm_prompt = \"You are a helpful assistant. Answer briefly and kindly, in plain words.\"".into(),
        cache_config: format!("dir = \"{}\"", kv.path().display()),
        kv_dir: Some(kv.path().to_path_buf()),
        ..Options::default()
    };
    let mut first = start_tiny(&options);
    let (prompt, cached) = warm_up(&first.log());
    assert!(prompt > 8, "{}", first.log());
    assert_eq!(cached, 0, "a first start prefills: {}", first.log());
    let (status, v) = complete(
        &first,
        "You are a helpful assistant. Answer briefly and kindly, in plain words. Hi",
    );
    assert_eq!(status, 200, "{v}");
    assert!(first.stop().is_some_and(|s| s.success()), "{}", first.log());
    let second = start_tiny(&options);
    let (again, cached) = warm_up(&second.log());
    assert_eq!(again, prompt);
    assert!(
        cached + 1 >= prompt,
        "the restart maps the warm-up's KV back (all but the token it must run): {}",
        second.log()
    );
    let (status, v2) = complete(
        &second,
        "You are a helpful assistant. Answer briefly and kindly, in plain words. Hi",
    );
    assert_eq!(status, 200, "{v2}");
    assert_eq!(
        text_of(&v2),
        text_of(&v),
        "the restarted server answers as the first did"
    );
}

/// Sessions are bounded as thread mode's requests are: `max_running` run at once, `max_queued`
/// more wait for one to end, and a request past both is refused with 429.
#[test]
fn sessions_are_bounded_by_max_running_and_max_queued() {
    let server = start_tiny(&Options {
        runner_grants: "process.fork = true".into(),
        runner_config: "isolation = \"fork\"\nfork_pool = 1".into(),
        model_config: "max_running = 1\nmax_queued = 1".into(),
        env: vec![("U_FORK_TEST_TRIGGERS".into(), "1".into())],
        ..Options::default()
    });
    let server = &server;
    let statuses: Vec<u16> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                s.spawn(move || {
                    // Staggered, so the first holds the one running slot and the second waits.
                    std::thread::sleep(std::time::Duration::from_millis(300 * i));
                    complete(server, &format!("Request {i} <<u-test:stall>>")).0
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(statuses, [200, 200, 429], "{}", server.log());
}
