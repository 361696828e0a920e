//! The GPU deployment (`manifests/gpu.toml`: kernels-wgpu preferred, kernels-cpu beside it) as
//! an operator runs it: greedy tokens equal the CPU deployment's, ops the GPU plugin lacks run
//! on the CPU plugin (logged), a deployment whose GPU does not open runs on the CPU, and the
//! device in use is reported. Without a GPU it runs on Mesa's lavapipe, which `cargo xtask
//! test` installs.

use serde_json::Value;
use std::{path::Path, process::Command};
use u_conformance::{bin, fixture_model_dir, root, run, serving::smollm2_path, text};

fn generate(deployment: &Path, model: &Path, prompt: &str, steps: &str) -> (Value, String) {
    let out = run(Command::new(bin("u-runner"))
        .args([
            "generate", "--json", "--temp", "0", "-n", steps, "--prompt", prompt,
        ])
        .arg("--model")
        .arg(model)
        .arg("--deployment")
        .arg(deployment)
        .env("RUST_LOG", "info"));
    assert!(out.status.success(), "{}", text(&out));
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", text(&out)));
    (json, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn ids(v: &Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .expect("tokens is an array")
        .iter()
        .map(|t| t.as_u64().expect("token ids are integers"))
        .collect()
}

fn gpu_toml() -> std::path::PathBuf {
    root().join("manifests/gpu.toml")
}

fn dev_toml() -> std::path::PathBuf {
    root().join("manifests/dev.toml")
}

/// Steps at which two greedy runs part, with the tokens each chose.
fn first_difference(gpu: &[u64], cpu: &[u64]) -> Option<(usize, u64, u64)> {
    gpu.iter()
        .zip(cpu)
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .map(|(i, (a, b))| (i, *a, *b))
}

/// SmolLM2 end to end on the GPU deployment: 32 greedy tokens, the device reported, and the
/// CPU's tokens until the first near-tie (step 14 for this prompt, at a top-2 gap of 0.017:
/// plugins/kernels-wgpu/tests/smollm2.rs compares the logits step by step and says why the
/// backends may part there).
#[test]
fn smollm2_generates_on_the_gpu_as_on_the_cpu_up_to_a_near_tie() {
    let model = smollm2_path();
    let prompt = "The capital of France is";
    let (gpu, log) = generate(&gpu_toml(), &model, prompt, "32");
    let (cpu, _) = generate(&dev_toml(), &model, prompt, "32");
    let device = gpu["timings"]["device"].as_str().unwrap_or_default();
    eprintln!(
        "GPU device: {device}; {:.2} tokens/s generated ({} on the CPU)",
        gpu["timings"]["generated_tokens_per_s"], cpu["timings"]["generated_tokens_per_s"]
    );
    assert!(device.ends_with("(wgpu)"), "{gpu}\n{log}");
    assert_eq!(ids(&gpu).len(), 32, "{gpu}");
    let parted = first_difference(&ids(&gpu), &ids(&cpu));
    eprintln!("first difference (step, GPU token, CPU token): {parted:?}");
    assert!(
        parted.is_none_or(|(step, _, _)| step >= 14),
        "GPU {gpu}\nCPU {cpu}"
    );
}

#[test]
fn a_fixture_llama_in_f32_generates_the_cpus_tokens() {
    let dir = fixture_model_dir("llama");
    let (gpu, log) = generate(&gpu_toml(), dir.path(), "Hello, world", "16");
    let (cpu, _) = generate(&dev_toml(), dir.path(), "Hello, world", "16");
    assert!(
        gpu["timings"]["device"]
            .as_str()
            .is_some_and(|d| d.ends_with("(wgpu)")),
        "{gpu}\n{log}"
    );
    assert_eq!(ids(&gpu), ids(&cpu), "GPU {gpu}\nCPU {cpu}");
}

/// Mixtral's routing (top-k, the scatter of expert outputs) is not on the GPU: those ops run
/// on the CPU plugin, each kind logged once, and the tokens stay the CPU's.
#[test]
fn a_mixture_of_experts_routes_on_the_cpu_and_keeps_the_tokens() {
    let dir = fixture_model_dir("mixtral");
    let (gpu, log) = generate(&gpu_toml(), dir.path(), "Hello, world", "12");
    let (cpu, _) = generate(&dev_toml(), dir.path(), "Hello, world", "12");
    assert_eq!(ids(&gpu), ids(&cpu), "GPU {gpu}\nCPU {cpu}\n{log}");
    let fallbacks: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("runs on the cpu backend"))
        .collect();
    assert!(
        fallbacks.iter().any(|l| l.contains("TopK")),
        "no fallback logged:\n{log}"
    );
    let mut kinds = fallbacks.clone();
    kinds.dedup();
    assert_eq!(
        kinds.len(),
        fallbacks.len(),
        "logged more than once:\n{log}"
    );
}

/// `manifests/gpu.toml` with `config` as the GPU plugin's `[plugins.config]`, written to a
/// temporary folder (paths made absolute).
fn gpu_toml_with(config: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let manifest = std::fs::read_to_string(gpu_toml())
        .unwrap()
        .replace("../", &format!("{}/", root().display()))
        .replace(
            "[plugins.grants]\ngpu = true",
            &format!("[plugins.grants]\ngpu = true\n[plugins.config]\n{config}"),
        );
    let deployment = dir.path().join("gpu.toml");
    std::fs::write(&deployment, manifest).unwrap();
    (dir, deployment)
}

/// A deployment whose GPU adapter does not open (here: one named that no machine has) passes
/// the GPU plugin over with a warning and runs the model on the CPU plugin.
#[test]
fn without_its_gpu_the_deployment_runs_on_the_cpu() {
    let (_dir, deployment) = gpu_toml_with("adapter = \"no-such-adapter\"");
    let model = fixture_model_dir("llama");
    let (out, log) = generate(&deployment, model.path(), "Hello, world", "8");
    let (cpu, _) = generate(&dev_toml(), model.path(), "Hello, world", "8");
    assert!(
        log.contains("kernels-wgpu passed over") && log.contains("no-such-adapter"),
        "{log}"
    );
    let device = out["timings"]["device"].as_str().unwrap_or_default();
    assert!(device.starts_with("cpu"), "{out}");
    assert_eq!(ids(&out), ids(&cpu));
}

/// Weights that do not fit the GPU's memory (here: a 16 MiB limit for SmolLM2's 100 MB) fail
/// with an out-of-memory error naming the limit, and the model is built on the CPU instead.
#[test]
fn a_model_too_big_for_the_gpu_is_built_on_the_cpu() {
    let (_dir, deployment) = gpu_toml_with("memory_limit_mb = 16");
    let model = smollm2_path();
    let (out, log) = generate(&deployment, &model, "Hi", "4");
    let (cpu, _) = generate(&dev_toml(), &model, "Hi", "4");
    assert!(
        log.contains("out of device memory")
            && log.contains("memory_limit_mb")
            && log.contains("built on kernels-cpu instead"),
        "{log}"
    );
    let device = out["timings"]["device"].as_str().unwrap_or_default();
    assert!(device.starts_with("cpu"), "{out}");
    assert_eq!(ids(&out), ids(&cpu));
}

/// `u-runner plugins` names the GPU plugin's device, its `gpu` grant, and the CPU plugin's.
#[test]
fn plugins_report_the_device_and_the_gpu_grant() {
    let out = run(Command::new(bin("u-runner"))
        .args(["plugins", "--json"])
        .arg(gpu_toml()));
    assert!(out.status.success(), "{}", text(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let plugin = |name: &str| {
        report["loaded"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} not loaded: {report}"))
            .clone()
    };
    let gpu = plugin("kernels-wgpu");
    assert!(
        gpu["device"]
            .as_str()
            .is_some_and(|d| d.ends_with("(wgpu)")),
        "{gpu}"
    );
    assert!(gpu["capabilities"].to_string().contains("gpu"), "{gpu}");
    assert!(gpu["grants"].to_string().contains("gpu"), "{gpu}");
    let cpu = plugin("kernels-cpu");
    assert!(
        cpu["device"].as_str().is_some_and(|d| d.starts_with("cpu")),
        "{cpu}"
    );
    assert!(plugin("runner-text")["device"].is_null());
}
