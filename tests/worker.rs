//! Issue 21: loader plugins in worker processes of their own (`isolation = "worker"`). The
//! loader parses the model file in a process confined to its own grants; the host maps the
//! tensors it shares through a sealed memfd and never maps the loader's code.

use serde_json::Value;
use std::{
    path::{Path, PathBuf},
    process::Command,
};
use u_conformance::{
    bin, root, run,
    serving::{Options, http, model_dir, post, smollm2_path, start_smollm2},
    text,
};

const WORKER: &str = "isolation = \"worker\"";

/// The development deployment with absolute plugin paths, and with its GGUF and safetensors
/// loaders in worker processes when `isolated`.
fn dev_deployment(dir: &Path, isolated: bool) -> PathBuf {
    let target = format!("\"{}/", root().join("target").display());
    let mut dev = std::fs::read_to_string(root().join("manifests/dev.toml"))
        .unwrap()
        .replace("\"../target/", &target)
        .replace("\"../tests/", &format!("\"{}/tests/", root().display()));
    if isolated {
        for loader in ["loader-gguf.so\"\n", "loader-safetensors.so\"\n"] {
            assert!(dev.contains(loader), "manifests/dev.toml loads {loader}");
            dev = dev.replace(loader, &format!("{loader}{WORKER}\n"));
        }
    }
    let path = dir.join(if isolated { "worker.toml" } else { "dev.toml" });
    std::fs::write(&path, dev).unwrap();
    path
}

fn generate(deployment: &Path, model: &Path, extra: &[&str]) -> std::process::Output {
    run(Command::new(bin("u-runner"))
        .args([
            "generate",
            "--json",
            "--temp",
            "0",
            "--prompt",
            "Once upon a time",
        ])
        .args(extra)
        .arg("--model")
        .arg(model)
        .arg("--deployment")
        .arg(deployment))
}

fn token_ids(out: &std::process::Output) -> Vec<u64> {
    assert!(out.status.success(), "{}", text(out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// Greedy tokens are the same whether the loader runs in the host's process or in a worker,
/// for GGUF (SmolLM2, Q4_1 blocks and a 49k-token vocabulary in the metadata) and for
/// safetensors (the tiny Llama fixture).
#[test]
fn a_loader_in_a_worker_gives_the_tokens_it_gives_in_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let (in_host, in_worker) = (
        dev_deployment(dir.path(), false),
        dev_deployment(dir.path(), true),
    );
    let tiny = model_dir(dir.path());
    for (model, n) in [(smollm2_path(), "24"), (tiny, "16")] {
        let expected = token_ids(&generate(&in_host, &model, &["-n", n]));
        let got = token_ids(&generate(&in_worker, &model, &["-n", n]));
        assert_eq!(expected.len(), n.parse::<usize>().unwrap());
        assert_eq!(got, expected, "{}", model.display());
    }
    let listed = run(Command::new(bin("u-runner"))
        .args(["plugins", "--json"])
        .arg(&in_worker));
    assert!(listed.status.success(), "{}", text(&listed));
    let listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    for p in listed["loaded"].as_array().unwrap() {
        let isolated = matches!(
            p["name"].as_str(),
            Some("loader-gguf" | "loader-safetensors")
        );
        let process = if isolated { "worker" } else { "host" };
        assert_eq!(p["process"], process, "{p}");
    }
}

/// A malformed model file fails in the worker with the loader's own error, not a crash of the
/// host or a lost worker.
#[test]
fn a_malformed_model_is_the_loaders_clear_error_through_the_worker() {
    let dir = tempfile::tempdir().unwrap();
    let deployment = dev_deployment(dir.path(), true);
    let bytes = std::fs::read(smollm2_path()).unwrap();
    let broken = dir.path().join("truncated.gguf");
    std::fs::write(&broken, &bytes[..100_000]).unwrap();
    let out = generate(&deployment, &broken, &["-n", "4"]);
    assert!(!out.status.success());
    let said = text(&out);
    assert!(said.contains("loader-gguf"), "{said}");
    assert!(
        !said.contains("worker process of"),
        "the worker survives: {said}"
    );
    assert!(!said.contains("panicked"), "{said}");
}

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .is_ok_and(|s| s.lines().any(|l| l == format!("PPid:\t{pid}")))
        })
        .collect()
}

fn complete(port: u16) -> (u16, Value) {
    post(
        port,
        "/v1/completions",
        br#"{"model":"SmolLM2-135M-Instruct.Q4_1","prompt":"The capital of France is","max_tokens":8,"temperature":0}"#,
    )
}

/// Serving with the loader in a worker (kept alive because run-time adapters load through it):
/// the host maps the shared, sealed weights but never the loader's code, which only the worker
/// maps; the worker runs under its own seccomp filter; the proof lists the worker's own,
/// narrower grants. A killed worker costs only calls to it: loading an adapter then fails with
/// the signal that ended it, and the model, whose weights the host maps, serves on.
#[test]
fn the_worker_holds_the_loader_and_the_host_only_its_weights() {
    let adapters = tempfile::tempdir().unwrap();
    let options = Options {
        loader_entry: WORKER.into(),
        model_config: format!("adapter_dirs = [\"{}\"]", adapters.path().display()),
        ..Options::default()
    };
    let server = start_smollm2(&options);
    let host = server.child.id();
    let (status, body) = complete(server.port);
    assert_eq!(status, 200, "{body}\n{}", server.log());
    let answer = body["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!answer.is_empty(), "{body}");
    let workers = children_of(host);
    assert_eq!(
        workers.len(),
        1,
        "one worker process: {workers:?}\n{}",
        server.log()
    );
    let worker = workers[0];
    assert!(
        server.log().contains(&format!(
            "runs in a worker process plugin=\"loader-gguf\" pid={worker}"
        )),
        "{}",
        server.log()
    );
    let host_maps = std::fs::read_to_string(format!("/proc/{host}/maps")).unwrap();
    let worker_maps = std::fs::read_to_string(format!("/proc/{worker}/maps")).unwrap();
    assert!(
        host_maps.contains("memfd:u-weights:loader-gguf"),
        "{host_maps}"
    );
    assert!(
        host_maps.contains("memfd:u-plugin:runner-text"),
        "{host_maps}"
    );
    assert!(
        !host_maps.contains("memfd:u-plugin:loader-gguf"),
        "{host_maps}"
    );
    assert!(
        worker_maps.contains("memfd:u-plugin:loader-gguf"),
        "{worker_maps}"
    );
    assert!(
        !worker_maps.contains("memfd:u-plugin:transport-http"),
        "{worker_maps}"
    );
    assert_eq!(status_field(worker, "Seccomp"), "2", "filter mode");
    assert_eq!(status_field(worker, "NoNewPrivs"), "1");
    let manifest = server.dir.path().join("serve-test.toml");
    let out = run(Command::new(bin("u-attest")).arg("inspect").arg(&manifest));
    let proof = text(&out);
    let block = proof
        .split("worker process of loader-gguf")
        .nth(1)
        .unwrap_or_else(|| panic!("no worker in the proof:\n{proof}"));
    let block: String = block
        .lines()
        .take_while(|l| !l.starts_with("verdict"))
        .collect();
    assert!(
        block.contains(&smollm2_path().display().to_string()),
        "{block}"
    );
    assert!(
        block.contains("no component listens on the network"),
        "{block}"
    );
    assert!(
        block.contains("no component can create or modify files"),
        "{block}"
    );
    assert!(
        block.contains("no component can start processes"),
        "{block}"
    );

    std::fs::write(adapters.path().join("x.gguf"), b"GGUF").unwrap();
    let killed = Command::new("kill")
        .args(["-KILL", &worker.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let load = format!(
        r#"{{"lora_name": "x", "lora_path": "{}/x.gguf"}}"#,
        adapters.path().display()
    );
    let raw = format!(
        "POST /v1/load_lora_adapter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{load}",
        load.len()
    );
    let (status, said) = http(server.port, raw.as_bytes()).unwrap();
    assert!(status >= 400, "{status} {said}");
    assert!(
        said.contains(&format!(
            "worker process of loader-gguf (pid {worker}) was killed by signal 9"
        )),
        "{said}"
    );
    let (status, body) = complete(server.port);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), answer);
}

/// Only loaders cross the process boundary: a deployment that puts another kind in a worker is
/// refused with the reason, by the host and by the offline proof alike.
#[test]
fn only_loaders_run_in_workers() {
    let dir = tempfile::tempdir().unwrap();
    let dev = std::fs::read_to_string(dev_deployment(dir.path(), false)).unwrap();
    let entry = "runner-text.so\"\n";
    assert!(dev.contains(entry));
    let manifest = dir.path().join("bad.toml");
    std::fs::write(&manifest, dev.replace(entry, &format!("{entry}{WORKER}\n"))).unwrap();
    let reason = "isolation = \"worker\" is built for loader plugins";
    let host = run(Command::new(bin("u-runner")).arg("plugins").arg(&manifest));
    assert!(!host.status.success());
    assert!(text(&host).contains(reason), "{}", text(&host));
    let proof = run(Command::new(bin("u-attest")).arg("inspect").arg(&manifest));
    assert!(!proof.status.success());
    assert!(text(&proof).contains(reason), "{}", text(&proof));
    let typo = dir.path().join("typo.toml");
    std::fs::write(
        &typo,
        dev.replace(entry, &format!("{entry}isolation = \"process\"\n")),
    )
    .unwrap();
    let out = run(Command::new(bin("u-runner")).arg("plugins").arg(&typo));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("unknown variant `process`"),
        "{}",
        text(&out)
    );
}
