//! A plugin author cannot crash the host, and architectures do not silently shadow each other.
//!
//! `arch-panicky` (tests/plugins/panicky) is a toy decoder that claims the `llama` family and
//! panics in whichever interface method its config names. With arch-llama beside it and no
//! choice, the host refuses to guess and names both; with `[model] architecture` it uses the
//! one named. A panic in `Architecture::build`, `Model::config`, `Model::cache` or
//! `Model::forward` ends `u-runner generate` with a clear error (exit status 2, not an abort),
//! and under `serve` a panicking forward pass or graft fails its own request with a 500 JSON
//! error while the server goes on answering the next ones.

use serde_json::Value;
use std::process::Command;
use u_conformance::{
    bin, deployment, plugin, run,
    serving::{Options, model_dir, post, start_with},
    text,
};

/// A deployment for the tiny Llama fixture with arch-panicky (configured by `panicky`), and
/// arch-llama too when `with_llama`; `model` lines go into a `[model]` table.
fn plugins(with_llama: bool, panicky: &str, model: &str) -> String {
    let mut blocks = String::new();
    for (name, extra) in [
        (
            "loader-safetensors",
            "[plugins.grants]\nfs.read = [\"/tmp/**\"]\n",
        ),
        ("tokenizer", "[plugins.grants]\nfs.read = [\"/tmp/**\"]\n"),
        ("kernels-cpu", ""),
        (
            "cache-kv",
            "[plugins.grants]\nfs.read = [\"/tmp/u-kv/**\"]\nfs.write = [\"/tmp/u-kv/**\"]\n",
        ),
        ("runner-text", ""),
    ] {
        blocks.push_str(&format!(
            "[[plugins]]\npath = \"{}\"\n{extra}\n",
            plugin(name).display()
        ));
    }
    if with_llama {
        blocks.push_str(&format!(
            "[[plugins]]\npath = \"{}\"\n\n",
            plugin("arch-llama").display()
        ));
    }
    blocks.push_str(&format!(
        "[[plugins]]\npath = \"{}\"\n[plugins.config]\n{panicky}\n\n",
        plugin("arch-panicky").display()
    ));
    if !model.is_empty() {
        blocks.push_str(&format!("[model]\n{model}\n"));
    }
    blocks
}

fn generate(dir: &std::path::Path, name: &str, plugins: &str) -> std::process::Output {
    let d = deployment(dir, name, plugins);
    let model = model_dir(dir);
    run(Command::new(bin("u-runner"))
        .args([
            "generate", "--json", "--temp", "0", "-n", "3", "--prompt", "hello",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--deployment")
        .arg(&d))
}

#[test]
fn two_architectures_claiming_llama_without_a_choice_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let out = generate(dir.path(), "both", &plugins(true, "", ""));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = text(&out);
    assert!(
        err.contains("`arch-llama` and `arch-panicky`") && err.contains("architecture ="),
        "{err}"
    );
    // Named, it is used: the toy's greedy tokens count up from the prompt's last token.
    let out = generate(
        dir.path(),
        "chosen",
        &plugins(true, "", "architecture = \"arch-panicky\""),
    );
    assert!(out.status.success(), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let t: Vec<u64> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(t.len(), 3, "{v}");
    assert!(t[1] == t[0] + 1 && t[2] == t[1] + 1, "{v}");
    // A choice that does not declare the family is refused too.
    let out = generate(
        dir.path(),
        "wrong",
        &plugins(false, "", "architecture = \"arch-llama\""),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("no architecture plugin of that name"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_panic_in_any_model_method_is_a_clear_cli_error() {
    let dir = tempfile::tempdir().unwrap();
    for (method, says) in [
        ("build", "architecture.build panicked"),
        ("config", "model.config panicked"),
        ("cache", "model.cache panicked"),
        ("forward", "model.forward panicked"),
    ] {
        let out = generate(
            dir.path(),
            method,
            &plugins(false, &format!("panic_in = [\"{method}\"]"), ""),
        );
        let err = text(&out);
        assert_eq!(out.status.code(), Some(2), "{method}: {err}");
        assert!(err.contains(says), "{method}: {err}");
        assert!(
            err.contains(&format!("arch-panicky was told to panic in {method}")),
            "{method}: the panic's message comes along: {err}"
        );
    }
}

#[test]
fn a_panicking_request_gets_a_500_and_the_server_serves_on() {
    // The trigger: the token the tiny tokenizer gives "boom".
    let dir = tempfile::tempdir().unwrap();
    let model = model_dir(dir.path());
    let tok = run(Command::new(bin("u-runner"))
        .args([
            "tokenize",
            "--no-special",
            "--json",
            "--text",
            "boom",
            "--model",
        ])
        .arg(&model));
    let ids: Value = serde_json::from_slice(&tok.stdout).unwrap();
    let trigger = ids["tokens"][0].as_u64().expect("a token");
    let server = start_with(
        dir,
        &model,
        "loader-safetensors",
        &Options {
            plugins: format!(
                "[[plugins]]\npath = \"{}\"\n[plugins.config]\npanic_in = [\"forward\", \"graft\"]\ntrigger = {trigger}\n",
                plugin("arch-panicky").display()
            ),
            model_config: "architecture = \"arch-panicky\"".into(),
            ..Options::default()
        },
    );
    let complete = |prompt: &str| {
        post(
            server.port,
            "/v1/completions",
            format!(
                r#"{{"model":"tiny-llama","prompt":"{prompt}","max_tokens":3,"temperature":0}}"#
            )
            .as_bytes(),
        )
    };
    let (s, v) = complete("hello");
    assert_eq!(s, 200, "{v}");
    let (s, v) = complete("boom");
    assert_eq!(s, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("model.forward panicked"),
        "{v}"
    );
    for _ in 0..3 {
        let (s, v) = complete("hello again");
        assert_eq!(s, 200, "the server goes on: {v}\n{}", server.log());
    }
    // A checkpoint graft panics inside the plugin: its own 500, nothing else.
    for (name, prompt) in [("a", "hello"), ("b", "world")] {
        let body = format!(r#"{{"model":"tiny-llama","name":"{name}","prompt":"{prompt}"}}"#);
        let (s, v) = post(server.port, "/v1/checkpoints", body.as_bytes());
        assert_eq!(s, 201, "{v}");
    }
    let (s, v) = post(
        server.port,
        "/v1/checkpoints/graft",
        br#"{"model":"tiny-llama","name":"ab","source":"b","target":"a"}"#,
    );
    assert_eq!(s, 500, "{v}");
    assert!(v.to_string().contains("model.graft panicked"), "{v}");
    let (s, _) = complete("still here");
    assert_eq!(s, 200);
}

#[test]
fn the_offline_proof_shows_the_families_and_tasks_each_plugin_declares() {
    let out = run(Command::new(bin("u-attest"))
        .arg("inspect")
        .arg(u_conformance::root().join("manifests/dev.toml")));
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    for line in [
        "builds families: llama, mistral",
        "builds families: bert, nomic-bert",
        "serves tasks: text-generation",
        "serves tasks: embeddings",
    ] {
        assert!(shown.contains(line), "`{line}` missing from:\n{shown}");
    }
    let out = run(Command::new(bin("u-attest"))
        .args(["inspect", "--json"])
        .arg(u_conformance::root().join("manifests/dev.toml")));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let bert = v["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "arch-bert")
        .expect("arch-bert in the proof");
    assert_eq!(bert["kind"], "architecture");
    assert_eq!(bert["families"], serde_json::json!(["bert", "nomic-bert"]));
}
