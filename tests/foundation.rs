//! Issue 2: the microkernel foundation, tested as an operator meets it — signed plugins, the
//! host's refusals, the static capability proof and the run-time sandbox.

use serde_json::Value;
use std::{
    io::ErrorKind,
    net::TcpListener,
    path::{Path, PathBuf},
    process::Command,
};
use u_attest::SecretKey;
use u_conformance::*;

fn copy_with(dir: &Path, name: &str, from: &Path, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(from).unwrap();
    edit(&mut bytes);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn plugin_block(path: &Path, grants: &str) -> String {
    format!(
        "[[plugins]]\npath = \"{}\"\n[plugins.grants]\n{grants}\n\n",
        path.display()
    )
}

/// Sets PF_W on the first executable PT_LOAD segment (a W+X segment), ELF64 little-endian.
fn make_writable_executable(bytes: &mut [u8]) {
    let phoff = u64::from_le_bytes(bytes[0x20..0x28].try_into().unwrap()) as usize;
    let phentsize = u16::from_le_bytes(bytes[0x36..0x38].try_into().unwrap()) as usize;
    let phnum = u16::from_le_bytes(bytes[0x38..0x3a].try_into().unwrap()) as usize;
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let p_type = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let flags = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap());
        if p_type == 1 && flags & 1 != 0 {
            bytes[at + 4..at + 8].copy_from_slice(&(flags | 2).to_le_bytes());
            return;
        }
    }
    panic!("no executable PT_LOAD segment");
}

/// Turns two one-byte `int3` padding instructions in `.text` into a `syscall` instruction
/// (same length, never executed), so the file contains a raw system call.
fn plant_syscall(bytes: &mut [u8]) {
    let facts = u_attest::elf::analyse(bytes).unwrap();
    let (_, range) = facts
        .code
        .iter()
        .find(|(name, _)| name == ".text")
        .cloned()
        .unwrap();
    let mut at = range.start;
    while at + 1 < range.end {
        let d = u_attest::syscalls::decode_x86_64(&bytes[at..range.end]);
        if d.len == 1 && bytes[at] == 0xCC && bytes[at + 1] == 0xCC {
            bytes[at..at + 2].copy_from_slice(&[0x0F, 0x05]);
            return;
        }
        at += d.len;
    }
    panic!("no int3 padding to plant a system call in");
}

/// Sets `sh_size` of the section starting at file offset `offset` (ELF64 little-endian).
fn set_section_size(bytes: &mut [u8], offset: usize, size: u64) {
    let shoff = u64::from_le_bytes(bytes[0x28..0x30].try_into().unwrap()) as usize;
    let shentsize = u16::from_le_bytes(bytes[0x3a..0x3c].try_into().unwrap()) as usize;
    let shnum = u16::from_le_bytes(bytes[0x3c..0x3e].try_into().unwrap()) as usize;
    for i in 0..shnum {
        let at = shoff + i * shentsize;
        let sh_offset = u64::from_le_bytes(bytes[at + 24..at + 32].try_into().unwrap()) as usize;
        if sh_offset == offset {
            bytes[at + 32..at + 40].copy_from_slice(&size.to_le_bytes());
            return;
        }
    }
    panic!("no section at offset {offset}");
}

#[test]
fn signed_plugin_loads_and_answers_a_call_across_the_abi() {
    let dir = tempfile::tempdir().unwrap();
    let dep = deployment(
        dir.path(),
        "one",
        &plugin_block(&plugin("loader-gguf"), "fs.read = [\"/tmp/**\"]"),
    );
    let out = run(Command::new(bin("u-runner"))
        .args(["plugins", "--json"])
        .arg(&dep));
    assert!(out.status.success(), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let loaded = v["loaded"].as_array().unwrap();
    assert_eq!(loaded.len(), 1, "{v:#}");
    assert_eq!(loaded[0]["name"], "loader-gguf");
    assert_eq!(loaded[0]["kind"], "loader");
    // `summary` and `details` come from the plugin's describe(), called through the ABI.
    assert!(
        loaded[0]["summary"].as_str().unwrap().contains("GGUF"),
        "{v:#}"
    );
    assert!(
        !loaded[0]["details"].as_array().unwrap().is_empty(),
        "{v:#}"
    );
    assert_eq!(v["refused"].as_array().unwrap().len(), 0);
    assert!(
        v["host"]
            .as_str()
            .unwrap()
            .contains("signed by trusted key"),
        "{v:#}"
    );
}

#[test]
fn every_bad_plugin_is_refused_with_its_reason_and_the_rest_load() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dev = dev_key();
    let stranger = SecretKey::generate().unwrap();
    let unsigned = copy_with(
        d,
        "unsigned.so",
        &unsigned_plugin("libu_loader_safetensors.so"),
        |_| {},
    );
    let tampered = copy_with(d, "tampered.so", &plugin("loader-onnx"), |b| {
        flip_code_byte(b)
    });
    let untrusted = copy_with(d, "untrusted.so", &plugin("loader-onnx"), |b| {
        u_attest::sign_bytes(b, &stranger).unwrap();
    });
    let other_abi = copy_with(d, "other-abi.so", &plugin("loader-onnx"), |b| {
        rewrite_abi_and_sign(b, &dev)
    });
    let wx = copy_with(d, "wx.so", &plugin("loader-onnx"), |b| {
        make_writable_executable(b);
        u_attest::sign_bytes(b, &dev).unwrap();
    });
    let read = "fs.read = [\"/tmp/**\"]";
    let plugins = [
        plugin_block(&plugin("loader-gguf"), read),
        plugin_block(&unsigned, read),
        plugin_block(&tampered, read),
        plugin_block(&untrusted, read),
        // Requests fs.read; the deployment grants it nothing.
        plugin_block(&plugin("loader-safetensors"), ""),
        plugin_block(&other_abi, read),
        plugin_block(&wx, read),
        plugin_block(&d.join("missing.so"), read),
    ]
    .concat();
    let dep = deployment(d, "mixed", &plugins);
    let out = run(Command::new(bin("u-runner"))
        .args(["plugins", "--json"])
        .arg(&dep));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let loaded: Vec<&str> = v["loaded"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(loaded, ["loader-gguf"], "{v:#}");
    let reason = |label: &str| -> String {
        v["refused"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["plugin"] == label)
            .unwrap_or_else(|| panic!("no refusal for {label}: {v:#}"))["reason"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(reason("unsigned.so").contains("not signed"));
    assert!(reason("tampered.so").contains("tampered"));
    assert!(reason("untrusted.so").contains("untrusted key"));
    assert!(reason("untrusted.so").contains(&stranger.public().to_string()));
    let grant = reason("loader-safetensors.so");
    assert!(
        grant.contains(
            "plugin `loader-safetensors` requests `fs.read`, which the deployment does not grant it"
        ),
        "{grant}"
    );
    let abi = reason("other-abi.so");
    assert!(
        abi.contains("built against SDK ABI") && abi.contains("this host speaks ABI"),
        "{abi}"
    );
    assert!(reason("wx.so").contains("both writable and executable"));
    assert!(reason("missing.so").contains("cannot read"));
    // The human form names plugin and reason on one line each.
    let human = run(Command::new(bin("u-runner")).arg("plugins").arg(&dep));
    let human = text(&human);
    assert!(human.contains("[LOADED]  loader-gguf"), "{human}");
    assert_eq!(human.matches("[REFUSED]").count(), 7, "{human}");
}

#[test]
fn a_panicking_plugin_is_refused_and_the_host_keeps_going() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = format!(
        "[[plugins]]\npath = \"{}\"\n[plugins.grants]\nfs.read = [\"/tmp/**\"]\n[plugins.config]\npanic_on_instantiate = true\n\n{}",
        plugin("probe").display(),
        plugin_block(&plugin("loader-gguf"), "fs.read = [\"/tmp/**\"]")
    );
    let dep = deployment(dir.path(), "panics", &blocks);
    let out = run(Command::new(bin("u-runner"))
        .args(["plugins", "--json"])
        .arg(&dep));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["loaded"][0]["name"], "loader-gguf", "{v:#}");
    let reason = v["refused"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("instantiate panicked inside the plugin: probe was configured to panic"),
        "{reason}"
    );
}

#[test]
fn inspect_fails_a_plugin_that_imports_more_than_it_declares() {
    let out = run(Command::new(bin("u-attest"))
        .arg("inspect")
        .arg(plugin("probe")));
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains(
            "imports `connect`, which needs `net.connect`, but the manifest does not declare it"
        ),
        "{t}"
    );
    assert!(
        t.contains("imports `fork`, which needs `process.fork`"),
        "{t}"
    );

    let out = run(Command::new(bin("u-attest"))
        .args(["inspect", "--json"])
        .arg(plugin("probe")));
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["declared"], serde_json::json!(["fs.read"]));
    assert_eq!(v["observed"]["net.connect"], serde_json::json!(["connect"]));
    assert_eq!(v["surface"]["raw_syscalls"], 0);
}

#[test]
fn sandbox_denies_what_was_not_granted_and_the_host_survives() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().canonicalize().unwrap();
    std::fs::create_dir_all(d.join("allowed")).unwrap();
    std::fs::write(d.join("allowed/ok.txt"), "hello").unwrap();
    std::fs::write(d.join("secret.txt"), "do not read").unwrap();
    // A real server the probe will try to reach: it must never see a connection.
    let witness = TcpListener::bind("127.0.0.1:0").unwrap();
    witness.set_nonblocking(true).unwrap();
    let port = witness.local_addr().unwrap().port();
    let block = format!(
        "[[plugins]]\npath = \"{}\"\n[plugins.grants]\nfs.read = [\"{}/allowed/**\"]\n[plugins.config]\nread_allowed = \"{}/allowed/ok.txt\"\nread_denied = \"{}/secret.txt\"\nconnect = \"127.0.0.1:{port}\"\n",
        plugin("probe").display(),
        d.display(),
        d.display(),
        d.display()
    );
    let dep = deployment(&d, "probe", &block);
    let out = run(Command::new(bin("u-runner")).arg("serve").arg(&dep));
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    let outcome = |attempt: &str| -> String {
        log.lines()
            .find(|l| l.contains(&format!("probe: {attempt}:")))
            .unwrap_or_else(|| panic!("no outcome for {attempt}:\n{log}"))
            .to_string()
    };
    assert!(log.contains("Landlock: enforced"), "{log}");
    assert!(log.contains("seccomp: enforced"), "{log}");
    assert!(outcome("host-read-allowed").contains(": ok (5 bytes)"));
    assert!(outcome("direct-read-allowed").contains(": ok (5 bytes)"));
    assert!(outcome("host-read-denied").contains("outside its `fs.read` grant"));
    assert!(outcome("direct-read-denied").contains("denied (Permission denied (os error 13))"));
    assert!(
        outcome("instantiate-thread-read-denied")
            .contains("denied (Permission denied (os error 13))")
    );
    assert!(outcome("socket").contains("denied (Operation not permitted (os error 1))"));
    assert!(outcome("io-uring").contains("denied (Operation not permitted (os error 1))"));
    assert!(outcome("connect").contains("denied (Operation not permitted (os error 1))"));
    assert!(outcome("spawn-process").contains("denied (Operation not permitted (os error 1))"));
    assert!(outcome("spawn-thread").contains("ok (thread returned 42)"));
    assert!(log.contains("transport finished"), "{log}");
    match witness.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the probe reached the witness server: {other:?}"),
    }
}

#[test]
fn inspect_json_of_the_real_components_matches_their_manifests() {
    let mut components: Vec<(PathBuf, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(root().join("plugins")).unwrap() {
        let manifest = entry.unwrap().path().join("plugin.toml");
        if manifest.exists() {
            let m = u_sdk::manifest::PluginManifest::parse(
                &std::fs::read_to_string(&manifest).unwrap(),
            )
            .unwrap();
            components.push((manifest, plugin(&m.name)));
        }
    }
    components.push((root().join("kernel/u-runner.toml"), bin("u-runner")));
    assert!(components.len() >= 2, "no real plugins found");
    for (source, built) in components {
        let m = u_sdk::manifest::PluginManifest::parse(&std::fs::read_to_string(&source).unwrap())
            .unwrap();
        let out = run(Command::new(bin("u-attest"))
            .args(["inspect", "--json"])
            .arg(&built));
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}: {}", built.display(), text(&out)));
        let declared: Vec<String> = m
            .capabilities
            .iter()
            .map(|c| c.name().to_string())
            .chain(m.optional.iter().map(|c| format!("{c} (optional)")))
            .collect();
        assert_eq!(v["name"], m.name.as_str());
        assert_eq!(
            v["declared"],
            serde_json::json!(declared),
            "{}",
            built.display()
        );
        assert_eq!(v["signed"], true, "{}", built.display());
        assert_eq!(
            v["ok"],
            true,
            "{} exceeds its manifest: {v:#}",
            built.display()
        );
        assert!(out.status.success());
    }
    // The development deployment as a whole passes the proof.
    let out = run(Command::new(bin("u-attest"))
        .args(["inspect", "--json"])
        .arg(root().join("manifests/dev.toml")));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], true, "{v:#}");
    assert!(v["guarantees"].as_array().unwrap().iter().any(|g| {
        g.as_str()
            .unwrap()
            .starts_with("no component can open an outbound network connection")
    }));
}

#[test]
fn bad_deployment_manifests_get_one_clear_error_each() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("malformed", "[deployment\nname = 'x'\n", "TOML parse error"),
        (
            "missing",
            "[[plugins]]\npath = 'a.so'\n",
            "missing field `deployment`",
        ),
        (
            "unknown-capability",
            "[deployment]\nname = 'x'\n[[plugins]]\npath = 'a.so'\n[plugins.grants]\nnet.raw = ['tcp:1.2.3.4:80']\n",
            "unknown capability `net.raw`",
        ),
        (
            "missing-path",
            "[deployment]\nname = 'x'\n[[plugins]]\nname = 'a'\n",
            "missing field `path`",
        ),
        (
            "bad-trust",
            "[deployment]\nname = 'x'\n[[trust]]\nname = 'k'\nkey_file = 'nope.pub'\n",
            "trusted publisher `k`",
        ),
    ];
    for (name, body, expected) in cases {
        let path = dir.path().join(format!("{name}.toml"));
        std::fs::write(&path, body).unwrap();
        for tool in ["u-runner", "u-attest"] {
            let verb = if tool == "u-runner" {
                "plugins"
            } else {
                "inspect"
            };
            let out = run(Command::new(bin(tool)).arg(verb).arg(&path));
            assert_eq!(out.status.code(), Some(2), "{tool} {name}: {}", text(&out));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(expected), "{tool} {name}: {err}");
            assert_eq!(
                err.trim().lines().count(),
                1,
                "{tool} {name}: one line expected: {err}"
            );
        }
    }
}

#[test]
fn malformed_components_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let source = plugin("loader-gguf");
    let bytes = std::fs::read(&source).unwrap();
    let meta = u_attest::elf::analyse(&bytes).unwrap().meta;
    // A file cut short in the middle of .u.meta.
    let truncated = d.join("truncated.so");
    std::fs::write(&truncated, &bytes[..meta.start + 100]).unwrap();
    let out = run(Command::new(bin("u-attest"))
        .arg("verify")
        .arg("--trust")
        .arg(dev_pub())
        .arg(&truncated));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("not a valid ELF file (truncated or corrupt)"),
        "{}",
        text(&out)
    );
    // A .u.meta section shorter than the record it must hold.
    let short = copy_with(d, "short-meta.so", &source, |b| {
        set_section_size(b, meta.start, 100)
    });
    let out = run(Command::new(bin("u-attest"))
        .arg("verify")
        .arg("--trust")
        .arg(dev_pub())
        .arg(&short));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains(".u.meta section is 100 bytes, expected 4096"),
        "{}",
        text(&out)
    );
    // Not an ELF file at all.
    let junk = d.join("junk.so");
    std::fs::write(&junk, b"#!/bin/sh\necho hi\n").unwrap();
    let out = run(Command::new(bin("u-attest"))
        .arg("verify")
        .arg("--trust")
        .arg(dev_pub())
        .arg(&junk));
    assert!(
        text(&out).contains("not a valid ELF file"),
        "{}",
        text(&out)
    );
    // A manifest edited to an unknown capability: refused at signing, and a tampered signature
    // at verification.
    let edited = copy_with(d, "edited.so", &source, |b| {
        patch_manifest(b, "fs.read", "fs.rexd")
    });
    let out = run(Command::new(bin("u-attest"))
        .arg("verify")
        .arg("--trust")
        .arg(dev_pub())
        .arg(&edited));
    assert!(text(&out).contains("tampered"), "{}", text(&out));
    let key_dir = tempfile::tempdir().unwrap();
    let stem = key_dir.path().join("k");
    assert!(
        run(Command::new(bin("u-attest"))
            .arg("keygen")
            .arg("--out")
            .arg(&stem))
        .status
        .success()
    );
    let out = run(Command::new(bin("u-attest"))
        .arg("sign")
        .arg("--key")
        .arg(stem.with_extension("key"))
        .arg(&edited));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("unknown capability `fs.rexd`"),
        "{}",
        text(&out)
    );
}

#[test]
fn keygen_sign_verify_round_trip_through_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let stem = dir.path().join("publisher");
    let out = run(Command::new(bin("u-attest"))
        .arg("keygen")
        .arg("--out")
        .arg(&stem));
    assert!(out.status.success(), "{}", text(&out));
    let file = copy_with(
        dir.path(),
        "p.so",
        &unsigned_plugin("libu_loader_gguf.so"),
        |_| {},
    );
    let verify = |key: &Path| {
        run(Command::new(bin("u-attest"))
            .arg("verify")
            .arg("--trust")
            .arg(key)
            .arg(&file))
    };
    let before = verify(&stem.with_extension("pub"));
    assert_eq!(before.status.code(), Some(1));
    assert!(text(&before).contains("not signed"));
    let out = run(Command::new(bin("u-attest"))
        .arg("sign")
        .arg("--key")
        .arg(stem.with_extension("key"))
        .arg(&file));
    assert!(out.status.success(), "{}", text(&out));
    let ok = verify(&stem.with_extension("pub"));
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(text(&ok).contains("OK "));
    let other = verify(&dev_pub());
    assert_eq!(other.status.code(), Some(1));
    assert!(text(&other).contains("untrusted key"));
}

/// #16: the proof covers the served model (its path, who reads it, whether a declared grant
/// covers it) and every listener with its authentication; a listener other machines reach
/// without authentication is a warning, which `inspect --strict` and `serve --strict` refuse.
#[test]
fn the_proof_lists_the_model_and_listeners_and_strict_refuses_open_listeners() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().canonicalize().unwrap();
    let model = d.join("elsewhere/model.gguf");
    std::fs::create_dir_all(model.parent().unwrap()).unwrap();
    std::fs::copy(root().join("tests/fixtures/quantize/model.gguf"), &model).unwrap();
    let keys = d.join("keys.txt");
    std::fs::write(&keys, "ops k-123456789\n").unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // The loader and tokenizer are granted another folder: the model is outside it.
    let models = format!("fs.read = [\"{}/models/**\"]", d.display());
    let manifest = |listen: &str, config: &str| {
        let plugins = format!(
            "{}{}{}[[plugins]]\npath = \"{}\"\n[plugins.grants]\nnet.listen = [\"{listen}\"]\nfs.read = [\"{}\"]\n[plugins.config]\n{config}\n\n[model]\npath = \"{}\"\n",
            plugin_block(&plugin("loader-gguf"), &models),
            plugin_block(&plugin("tokenizer"), &models),
            plugin_block(&plugin("kernels-cpu"), ""),
            plugin("transport-http").display(),
            keys.display(),
            model.display()
        );
        deployment(&d, "proof", &plugins)
    };
    let inspect = |path: &Path, strict: bool| {
        let mut cmd = Command::new(bin("u-attest"));
        cmd.arg("inspect").arg(path);
        if strict {
            cmd.arg("--strict");
        }
        run(&mut cmd)
    };

    // Loopback, no keys: the model is listed as read outside every declared grant; no warning.
    let local = manifest(&format!("tcp:127.0.0.1:{port}"), "");
    let out = inspect(&local, true);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(
        t.contains(&format!(
            "model {}: read {} by loader-gguf, tokenizer (granted at start-up by the host; outside every declared fs.read)",
            model.display(),
            model.display()
        )),
        "{t}"
    );
    assert!(t.contains(&format!("tcp:127.0.0.1:{port} (transport-http): no authentication, reachable from this machine only")), "{t}");
    assert!(!t.contains("warning:"), "{t}");
    let v: Value = serde_json::from_slice(
        &run(Command::new(bin("u-attest"))
            .args(["inspect", "--json"])
            .arg(&local))
        .stdout,
    )
    .unwrap();
    assert!(
        v["effective"]["fs.read"]
            .as_array()
            .unwrap()
            .contains(&Value::from(model.display().to_string())),
        "{v}"
    );

    // Every address, no keys: a warning; --strict fails it, and `serve --strict` will not serve.
    let open = manifest(&format!("tcp:0.0.0.0:{port}"), "");
    let out = inspect(&open, false);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}");
    assert!(t.contains(&format!("warning: transport-http listens on tcp:0.0.0.0:{port}, reachable from other machines, without authentication")), "{t}");
    assert_eq!(inspect(&open, true).status.code(), Some(1));
    let out = run(Command::new(bin("u-runner"))
        .args(["serve", "--strict"])
        .arg(&open));
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "--strict is set: not serving: transport-http listens on tcp:0.0.0.0:{port}"
        )),
        "{}",
        text(&out)
    );

    // The same with API keys: reachable, authenticated, no warning.
    let keyed = manifest(
        &format!("tcp:0.0.0.0:{port}"),
        &format!("api_keys_file = \"{}\"", keys.display()),
    );
    let t = text(&inspect(&keyed, true));
    assert!(t.contains("API keys, reachable from other machines"), "{t}");
    assert!(!t.contains("warning:"), "{t}");
}

/// #16: `u-attest inspect --runner-form MODEL SOCKET` proves the deployment the Safebox runner
/// form serves: the socket it adds (with its authentication) and the model, which the plain
/// inspection of the same manifest does not list.
#[test]
fn inspect_proves_the_runner_form_with_its_socket_and_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().canonicalize().unwrap();
    let model = d.join("model.gguf");
    std::fs::copy(root().join("tests/fixtures/quantize/model.gguf"), &model).unwrap();
    let socket = d.join("u-llm.sock");
    let secret = d.join("secret.key");
    std::fs::write(&secret, "0123456789abcdef-secret\n").unwrap();
    let dev = root().join("manifests/dev.toml");
    let inspect = |extra: &[&std::ffi::OsStr]| {
        let out = run(Command::new(bin("u-attest"))
            .arg("inspect")
            .arg(&dev)
            .args(extra));
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        text(&out)
    };
    let plain = inspect(&[]);
    assert!(!plain.contains(&socket.display().to_string()), "{plain}");
    let form = [
        "--runner-form".as_ref(),
        model.as_os_str(),
        socket.as_os_str(),
    ];
    let t = inspect(&form);
    assert!(
        t.contains(&format!(
            "unix:{} (transport-http): no authentication, reachable from this machine only",
            socket.display()
        )),
        "{t}"
    );
    assert!(t.contains(&format!("model {}:", model.display())), "{t}");
    let mut signed = form.to_vec();
    signed.extend(["--secret-file".as_ref(), secret.as_os_str()]);
    let t = inspect(&signed);
    assert!(
        t.contains(&format!(
            "unix:{} (transport-http): HMAC-signed requests",
            socket.display()
        )),
        "{t}"
    );
    let out = run(Command::new(bin("u-attest"))
        .arg("inspect")
        .arg(plugin("transport-http"))
        .args(form));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--runner-form proves a deployment"),
        "{}",
        text(&out)
    );
}

/// #16: `u-attest verify --deployment` judges each plugin with the host's own admission code,
/// so it and `u-runner plugins` agree — same verdict, same reason — on every case: granted,
/// ungranted (two kinds), over-granted, a wrong pinned name, a duplicate, an untrusted signer, a
/// tampered file, a W+X segment, another ABI, the host itself, and an import surface or a raw
/// system call beyond the manifest (loaded with a warning, refused when the deployment is
/// strict).
#[test]
fn verify_and_the_host_agree_on_every_admission_case() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let dev = dev_key();
    let stranger = SecretKey::generate().unwrap();
    let read = "fs.read = [\"/tmp/**\"]";
    let again = copy_with(d, "again.so", &plugin("loader-gguf"), |_| {});
    let untrusted = copy_with(d, "untrusted.so", &plugin("loader-onnx"), |b| {
        u_attest::sign_bytes(b, &stranger).unwrap();
    });
    let tampered = copy_with(d, "tampered.so", &plugin("loader-onnx"), |b| {
        flip_code_byte(b)
    });
    let wx = copy_with(d, "wx.so", &plugin("loader-onnx"), |b| {
        make_writable_executable(b);
        u_attest::sign_bytes(b, &dev).unwrap();
    });
    let other_abi = copy_with(d, "other-abi.so", &plugin("loader-onnx"), |b| {
        rewrite_abi_and_sign(b, &dev)
    });
    let syscall = copy_with(d, "syscall.so", &plugin("loader-onnx"), |b| {
        plant_syscall(b);
        u_attest::sign_bytes(b, &dev).unwrap();
    });
    let pinned = format!(
        "[[plugins]]\nname = \"loader-onnx\"\npath = \"{}\"\n[plugins.grants]\n{read}\n\n",
        plugin("loader-gguf").display()
    );
    // (case, plugin blocks, strict, the verdict of each entry: None loaded, Some(words) refused)
    let cases: Vec<(&str, String, bool, Vec<Option<&str>>)> = vec![
        (
            "granted",
            plugin_block(&plugin("loader-gguf"), read),
            false,
            vec![None],
        ),
        (
            "fs.read not granted",
            plugin_block(&plugin("loader-safetensors"), ""),
            false,
            vec![Some(
                "requests `fs.read`, which the deployment does not grant it",
            )],
        ),
        (
            "net.listen not granted",
            plugin_block(&plugin("transport-http"), read),
            false,
            vec![Some("requests `net.listen`")],
        ),
        (
            "over-granted",
            plugin_block(&plugin("kernels-cpu"), read),
            false,
            vec![None],
        ),
        (
            "pinned name",
            pinned,
            false,
            vec![Some("expects plugin `loader-onnx`")],
        ),
        (
            "duplicate",
            plugin_block(&plugin("loader-gguf"), read) + &plugin_block(&again, read),
            false,
            vec![None, Some("already loaded")],
        ),
        (
            "untrusted",
            plugin_block(&untrusted, read),
            false,
            vec![Some("untrusted key")],
        ),
        (
            "tampered",
            plugin_block(&tampered, read),
            false,
            vec![Some("tampered")],
        ),
        (
            "W+X",
            plugin_block(&wx, read),
            false,
            vec![Some("both writable and executable")],
        ),
        (
            "other ABI",
            plugin_block(&other_abi, read),
            false,
            vec![Some("built against SDK ABI")],
        ),
        (
            "the host",
            plugin_block(&bin("u-runner"), read),
            false,
            vec![Some("host component")],
        ),
        (
            "imports beyond, default",
            plugin_block(&plugin("probe"), read),
            false,
            vec![None],
        ),
        (
            "imports beyond, strict",
            plugin_block(&plugin("probe"), read),
            true,
            vec![Some("observed surface exceeds its manifest")],
        ),
        (
            "raw system call, default",
            plugin_block(&syscall, read),
            false,
            vec![None],
        ),
        (
            "raw system call, strict",
            plugin_block(&syscall, read),
            true,
            vec![Some("contains 1 raw system-call instruction(s)")],
        ),
    ];
    assert!(cases.len() >= 10);
    // The planted call is what `u-attest inspect` finds too (the same scan).
    let v: Value = serde_json::from_slice(
        &run(Command::new(bin("u-attest"))
            .args(["inspect", "--json"])
            .arg(&syscall))
        .stdout,
    )
    .unwrap();
    assert_eq!(v["surface"]["raw_syscalls"], 1, "{v}");
    assert_eq!(v["ok"], false, "{v}");
    for (i, (case, blocks, strict, want)) in cases.iter().enumerate() {
        let dep = deployment(d, &format!("case{i}"), blocks);
        if *strict {
            let text = std::fs::read_to_string(&dep).unwrap();
            std::fs::write(
                &dep,
                text.replacen("threads = 1\n", "threads = 1\nstrict = true\n", 1),
            )
            .unwrap();
        }
        let host = run(Command::new(bin("u-runner"))
            .args(["plugins", "--json"])
            .arg(&dep));
        let v: Value = serde_json::from_slice(&host.stdout)
            .unwrap_or_else(|_| panic!("{case}: {}", text(&host)));
        let verify = run(Command::new(bin("u-attest"))
            .args(["verify", "--deployment"])
            .arg(&dep));
        let lines = String::from_utf8_lossy(&verify.stdout).into_owned();
        let entries: Vec<&str> = lines.lines().filter(|l| !l.starts_with("  ")).collect();
        assert_eq!(entries.len(), want.len(), "{case}: {lines}");
        let refused = v["refused"].as_array().unwrap();
        let mut host_refusals = refused.iter();
        for (line, want) in entries.iter().zip(want) {
            match want {
                None => assert!(line.starts_with("OK "), "{case}: verify says {line}"),
                Some(words) => {
                    let reason = line
                        .strip_prefix("REFUSED ")
                        .and_then(|l| l.split_once(": "))
                        .map(|(_, r)| r)
                        .unwrap_or_else(|| panic!("{case}: verify says {line}"));
                    assert!(reason.contains(words), "{case}: verify's reason {reason}");
                    let host_reason = host_refusals
                        .next()
                        .unwrap_or_else(|| panic!("{case}: the host loaded it: {v:#}"))["reason"]
                        .as_str()
                        .unwrap();
                    assert_eq!(host_reason, reason, "{case}: the host and verify disagree");
                }
            }
        }
        assert!(
            host_refusals.next().is_none(),
            "{case}: the host refused more: {v:#}"
        );
        let loaded = v["loaded"].as_array().unwrap().len();
        assert_eq!(
            loaded,
            want.iter().filter(|w| w.is_none()).count(),
            "{case}: {v:#}"
        );
        let all_ok = want.iter().all(Option::is_none);
        assert_eq!(verify.status.success(), all_ok, "{case}: {lines}");
        if *case == "raw system call, default" {
            assert!(
                lines.contains("warning: contains 1 raw system-call"),
                "{lines}"
            );
            assert!(
                text(&host).contains("contains 1 raw system-call"),
                "{}",
                text(&host)
            );
        }
        if *case == "imports beyond, default" {
            assert!(lines.contains("warning: imports `connect`"), "{lines}");
            assert!(
                text(&host).contains("imports `connect`"),
                "the host says it loudly: {}",
                text(&host)
            );
        }
    }
}

/// #16: `u-runner serve --strict` refuses the probe plugin (it imports `connect`, `fork` and
/// `socket` beyond its manifest), naming the undeclared imports, and serves nothing.
#[test]
fn serve_strict_refuses_a_plugin_importing_beyond_its_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let blocks = plugin_block(&plugin("probe"), "fs.read = [\"/tmp/**\"]")
        + &plugin_block(
            &plugin("transport-http"),
            &format!("net.listen = [\"tcp:127.0.0.1:{port}\"]"),
        );
    let dep = deployment(dir.path(), "strict", &blocks);
    let out = run(Command::new(bin("u-runner"))
        .args(["serve", "--strict"])
        .arg(&dep));
    let t = text(&out);
    assert_ne!(out.status.code(), Some(0), "{t}");
    assert!(t.contains("--strict is set: not serving"), "{t}");
    for import in ["connect", "fork", "socket"] {
        assert!(t.contains(&format!("imports `{import}`")), "{import}: {t}");
    }
}
