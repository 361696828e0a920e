//! #15: the built-in chat page at `/`, in headless Chromium (Debian's `chromium`, which
//! `cargo xtask test` installs) driven by Playwright (`tests/browser/chat_page.py`): a typed
//! message's answer streams in (several partial texts seen before the turn ends), a second turn
//! shows the first turn's tokens as cached, Stop cuts a long answer short, and the page loads
//! nothing from elsewhere (its content security policy allows only its own server). The
//! screenshot goes to the test's temporary directory (`target/tmp/chat-page.png`).

use std::process::Command;
use u_conformance::{
    root,
    serving::{Options, http, start_smollm2},
    text,
};

#[test]
fn the_chat_page_streams_answers_and_shows_cached_tokens() {
    let server = start_smollm2(&Options::default());
    let (status, page) = http(
        server.port,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200);
    assert!(page.contains("<title>U chat</title>"), "{page}");
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "no outside source"
    );

    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("chat-page.png");
    let _ = std::fs::remove_file(&shot);
    let out = Command::new("python3")
        .arg(root().join("tests/browser/chat_page.py"))
        .env("U_URL", format!("http://127.0.0.1:{}/", server.port))
        .env("U_SCREENSHOT", &shot)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "the browser run failed (is `cargo xtask test`'s set-up done: chromium, playwright?):\n{}\nserver log:\n{}",
        text(&out),
        server.log()
    );
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{seen:#}\nscreenshot: {}", shot.display());
    assert_eq!(
        seen["errors"],
        serde_json::json!([]),
        "script errors on the page"
    );
    assert_eq!(seen["model"], "SmolLM2-135M-Instruct.Q4_1");
    let csp = seen["csp"].as_str().unwrap();
    assert!(
        csp.starts_with("default-src 'none'") && csp.contains("connect-src 'self'"),
        "{csp}"
    );
    for turn in ["first", "second"] {
        let partials = seen[turn].as_array().unwrap();
        assert!(
            partials.len() >= 3,
            "{turn}: the answer did not stream in: {partials:?}"
        );
        let last = partials.last().unwrap().as_str().unwrap();
        assert!(last.trim().len() > 10, "{turn}: {last:?}");
    }
    let cached: Vec<i64> = seen["cached"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    // The second turn's prompt begins with the whole first exchange: the prefix cache serves it.
    assert!(cached[1] > 20, "{:?}", seen["info"]);
    assert!(seen["info"][1].as_str().unwrap().contains("cached"));
    // Stop cuts a long answer short, and the server serves on.
    assert_eq!(seen["stopped_info"], "stopped", "{seen}");
    let stopped = seen["stopped"].as_str().unwrap();
    assert!(!stopped.is_empty(), "{seen}");
    let (status, _) = http(
        server.port,
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    assert_eq!(status, 200);
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "screenshot"
    );
}
