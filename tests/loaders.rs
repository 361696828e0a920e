//! Issue 3: `u-runner inspect` reads every format through the deployment's signed loader plugins.

use serde_json::Value;
use std::process::Command;
use u_conformance::*;

fn inspect(model: &str) -> (Option<i32>, Value, String) {
    let out = run(Command::new(bin("u-runner"))
        .args(["inspect", "--json", "--deployment"])
        .arg(root().join("manifests/dev.toml"))
        .arg(root().join(model)));
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code(), v, text(&out))
}

#[test]
fn inspect_reports_format_architecture_hyper_parameters_and_tensors() {
    let (code, v, log) = inspect("tests/fixtures/gguf/quants.gguf");
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(v["format"], "gguf");
    assert_eq!(v["loader"], "loader-gguf");
    let q4k = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "q4_k")
        .expect("q4_k tensor");
    assert_eq!(q4k["dtype"], "Q4_K");
    assert_eq!(q4k["shape"], serde_json::json!([2, 512]));
    assert_eq!(q4k["bytes"], 2 * 2 * 144);

    let (code, v, log) = inspect("tests/fixtures/safetensors/llama_sharded");
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(v["format"], "safetensors");
    assert_eq!(v["architecture"], "llama");
    // The format's own keys: config.json as the checkpoint states it.
    assert_eq!(v["hyper_parameters"]["config.num_hidden_layers"], 2);
    assert_eq!(v["hyper_parameters"]["config.num_key_value_heads"], 1);
    let names: Vec<&str> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"model.embed_tokens.weight"), "{names:?}");
    assert!(
        names.contains(&"model.layers.1.mlp.down_proj.weight"),
        "{names:?}"
    );

    let (code, v, log) = inspect("tests/fixtures/onnx/external/model.onnx");
    assert_eq!(code, Some(0), "{log}");
    assert_eq!(v["format"], "onnx");
    assert_eq!(v["architecture"], "llama");
}

#[test]
fn inspect_prints_a_table_and_refuses_unknown_files_clearly() {
    let out = run(Command::new(bin("u-runner"))
        .args(["inspect", "--deployment"])
        .arg(root().join("manifests/dev.toml"))
        .arg(root().join("tests/fixtures/gguf/quants.gguf")));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("format: gguf (loader loader-gguf)"), "{t}");
    assert!(
        t.lines().any(|l| l.trim_start().starts_with("q6_k")
            && l.contains("Q6_K")
            && l.contains("[2, 512]")),
        "{t}"
    );

    let (code, _, log) = inspect("README.md");
    assert_eq!(code, Some(2), "{log}");
    assert!(
        log.contains("no loader in the deployment recognises"),
        "{log}"
    );

    let (code, _, log) = inspect("tests/fixtures/does-not-exist.gguf");
    assert_eq!(code, Some(2), "{log}");
}

#[test]
fn a_deployment_whose_loaders_are_all_refused_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(plugin("loader-gguf")).unwrap();
    rewrite_abi_and_sign(&mut bytes, &dev_key());
    let other_abi = dir.path().join("other-abi.so");
    std::fs::write(&other_abi, bytes).unwrap();
    let model = root().join("tests/fixtures/gguf/quants.gguf");
    let dep = deployment(
        dir.path(),
        "refused-loader",
        &format!(
            "[[plugins]]\npath = \"{}\"\n[plugins.grants]\nfs.read = [\"{}\"]\n\n[[plugins]]\npath = \"{}\"\n",
            other_abi.display(),
            model.display(),
            plugin("kernels-cpu").display()
        ),
    );
    let out = run(Command::new(bin("u-runner"))
        .args(["quantize", "--deployment"])
        .arg(&dep)
        .arg(&model)
        .arg(dir.path().join("out.gguf"))
        .arg("Q8_0"));
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("built against SDK ABI"), "{log}");
    assert!(log.contains("no loader plugin is loaded"), "{log}");
}
