//! `u-runner train` on SmolLM2 (#17), against the reference `tests/fixtures/gen_peft_roundtrip.py`
//! recorded with PEFT:
//!
//! - `train lora` (on an F16 GGUF of SmolLM2, made by `u-runner quantize` as the generator made
//!   it, so that U and transformers run the same weights) lowers the loss on its text, and the
//!   adapter it writes is the one the generator trained (tensor norms to 1e-3): PEFT loaded
//!   that adapter, and the server, loading it at run time, gives PEFT's log-probabilities for
//!   it (and for the base without it);
//! - a run interrupted by SIGINT writes a checkpoint and exits 130, and `--resume` finishes it
//!   with exactly the adapter of an uninterrupted run;
//! - `train soft-prompt` lowers the loss and writes a PEFT prompt-tuning adapter `generate
//!   --soft-prompt` takes;
//! - `train control-vector` writes llama.cpp's control-vector GGUF, which `generate
//!   --control-vector` takes: strength 0 leaves the text alone, a strong one changes it;
//! - bad input is refused with a clear message.

use serde_json::Value;
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};
use u_conformance::{
    bin, plugin, root, run,
    serving::{Options, generate_json, post, smollm2_path, start_with},
    text,
};

/// Log-probabilities of the served adapter against PEFT's (U's F16 kernels against
/// transformers' f32 arithmetic on the same F16 weights).
const LOGPROB_TOLERANCE: f64 = 2e-3;

fn fixture() -> Value {
    let path = root().join("tests/fixtures/train/smollm2-lora-peft.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn data() -> PathBuf {
    root().join("tests/fixtures/train/lighthouse.txt")
}

/// `u-runner train KIND --model SmolLM2 --data … --out OUT ARGS --json`, which must succeed;
/// its summary.
fn train(kind: &str, out: &Path, args: &[&str]) -> Value {
    train_on(&smollm2_path(), kind, out, args)
}

/// [`train`] on `model`.
fn train_on(model: &Path, kind: &str, out: &Path, args: &[&str]) -> Value {
    let o = run(train_command(model, kind, &data(), out, args).arg("--json"));
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `u-runner train KIND --model MODEL --data DATA --out OUT ARGS` on the development
/// deployment.
fn train_command(model: &Path, kind: &str, data: &Path, out: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.args(["train", kind, "--model"])
        .arg(model)
        .arg("--data")
        .arg(data)
        .arg("--out")
        .arg(out)
        .args(args)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"));
    cmd
}

/// `u-runner train control-vector` on SmolLM2 with these prompt files.
fn control_vector_command(pos: &Path, neg: &Path, out: &Path) -> Command {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.args(["train", "control-vector", "--model"])
        .arg(smollm2_path())
        .arg("--positive")
        .arg(pos)
        .arg("--negative")
        .arg(neg)
        .arg("--out")
        .arg(out)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"));
    cmd
}

/// The L2 norm of every tensor of a safetensors file of F32 tensors.
fn norms(path: &Path) -> Vec<(String, f64)> {
    let bytes = std::fs::read(path).unwrap();
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + len]).unwrap();
    let data = &bytes[8 + len..];
    let mut out: Vec<(String, f64)> = header
        .iter()
        .map(|(name, t)| {
            let o = t["data_offsets"].as_array().unwrap();
            let (a, b) = (
                o[0].as_u64().unwrap() as usize,
                o[1].as_u64().unwrap() as usize,
            );
            let sum: f64 = data[a..b]
                .chunks_exact(4)
                .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())).powi(2))
                .sum();
            (name.clone(), sum.sqrt())
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The server's five most likely next tokens after `prompt` under `model`, piece → logprob.
fn served_top5(port: u16, model: &str, prompt: &str) -> serde_json::Map<String, Value> {
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
    });
    let (status, v) = post(port, "/v1/completions", body.to_string().as_bytes());
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .unwrap_or_else(|| panic!("no top logprobs: {v}"))
        .clone()
}

/// Compares the served top five with PEFT's `[token, piece, logprob]` list: at least four
/// tokens in common, each within [`LOGPROB_TOLERANCE`]; returns the largest difference.
fn compare(what: &str, served: &serde_json::Map<String, Value>, peft: &Value) -> f64 {
    let mut common = 0;
    let mut worst = 0f64;
    for entry in peft.as_array().unwrap() {
        let (piece, want) = (entry[1].as_str().unwrap(), entry[2].as_f64().unwrap());
        if let Some(got) = served.get(piece).and_then(Value::as_f64) {
            common += 1;
            worst = worst.max((got - want).abs());
        }
    }
    assert!(
        common >= 4,
        "{what}: U's top five {served:?}, PEFT's {peft}"
    );
    assert!(
        worst < LOGPROB_TOLERANCE,
        "{what}: U's top five {served:?} differ from PEFT's {peft} by {worst}"
    );
    worst
}

#[test]
fn a_trained_lora_lowers_the_loss_loads_in_peft_and_is_served() {
    let r = fixture();
    let dir = tempfile::tempdir().unwrap();
    let base_file = dir.path().join("smollm2-f16.gguf");
    let o = run(Command::new(bin("u-runner"))
        .args(["quantize", "--allow-requantize"])
        .arg(smollm2_path())
        .arg(&base_file)
        .arg("F16")
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml")));
    assert!(o.status.success(), "{}", text(&o));
    let out = dir.path().join("lighthouse");
    let args: Vec<&str> = r["train"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .filter(|a| *a != "--json")
        .collect();
    let summary = train_on(&base_file, "lora", &out, &args);
    let (before, after) = (
        summary["loss_before"].as_f64().unwrap(),
        summary["loss_after"].as_f64().unwrap(),
    );
    assert!(
        after < before - 0.5,
        "the loss on the text went {before} → {after}"
    );
    let want = r["summary"]["loss_after"].as_f64().unwrap();
    assert!(
        (after - want).abs() < 0.05,
        "loss {after}, the reference run's {want}"
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        (config["peft_type"].as_str(), config["r"].as_u64()),
        (Some("LORA"), Some(4))
    );
    let norms = norms(&out.join("adapter_model.safetensors"));
    let reference = r["norms"].as_object().unwrap();
    assert_eq!(
        norms.len(),
        reference.len(),
        "one A and one B per targeted projection"
    );
    for (name, n) in &norms {
        let want = reference[name].as_f64().unwrap();
        assert!(
            (n - want).abs() <= 1e-3 * want.max(1e-3),
            "{name}: norm {n}, the reference adapter's {want}"
        );
    }

    // Served at run time, beside the base, the adapter gives PEFT's log-probabilities.
    let server = start_with(
        tempfile::tempdir().unwrap(),
        &base_file,
        "loader-gguf",
        &Options {
            model_config: format!("adapter_dirs = [\"{}\"]\n", dir.path().display()),
            plugins: format!(
                "[[plugins]]\npath = \"{}\"\n[plugins.grants]\nfs.read = [\"{}/**\"]\n",
                plugin("loader-safetensors").display(),
                dir.path().display()
            ),
            ..Options::default()
        },
    );
    let body =
        serde_json::json!({"lora_name": "lighthouse", "lora_path": out.display().to_string()});
    let (status, v) = post(
        server.port,
        "/v1/load_lora_adapter",
        body.to_string().as_bytes(),
    );
    assert_eq!(status, 200, "{v}");
    let base = "smollm2-f16";
    let mut moved = 0f64;
    for case in r["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let tuned = served_top5(server.port, &format!("{base}:lighthouse"), prompt);
        let plain = served_top5(server.port, base, prompt);
        let d1 = compare(&format!("{prompt} (adapter)"), &tuned, &case["adapter"]);
        let d2 = compare(&format!("{prompt} (base)"), &plain, &case["base"]);
        eprintln!("{prompt}: within {d1:.1e} of PEFT with the adapter, {d2:.1e} without");
        let shift = |c: &Value| c[0][2].as_f64().unwrap();
        moved = moved.max((shift(&case["adapter"]) - shift(&case["base"])).abs());
    }
    assert!(
        moved > 3.0 * LOGPROB_TOLERANCE,
        "the adapter moves PEFT's logprobs by {moved}"
    );
}

#[test]
fn an_interrupted_run_resumes_to_the_adapter_of_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let settings = [
        "--rank",
        "2",
        "--targets",
        "q_proj,k_proj",
        "--seq-len",
        "48",
        "--batch",
        "1",
        "--steps",
        "6",
        "--lr",
        "1e-3",
        "--threads",
        "2",
        "--log-every",
        "1",
        "--checkpoint-every",
        "0",
    ];
    let whole = dir.path().join("whole");
    train("lora", &whole, &settings);

    let cut = dir.path().join("cut");
    let mut child = train_command(&smollm2_path(), "lora", &data(), &cut, &settings)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let first = line.starts_with("step 1/6");
        seen.push(line);
        if first {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            break;
        }
    }
    seen.extend(lines.map_while(Result::ok));
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{}", seen.join("\n"));
    let log = seen.join("\n");
    assert!(log.contains("continue with --resume"), "{log}");
    assert!(cut.join("checkpoint/state.safetensors").exists());
    assert!(
        !cut.join("adapter_model.safetensors").exists(),
        "no adapter before the end"
    );

    let mut resumed = settings.to_vec();
    resumed.push("--resume");
    train("lora", &cut, &resumed);
    assert_eq!(
        std::fs::read(cut.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(whole.join("adapter_model.safetensors")).unwrap(),
        "the resumed run's adapter differs from the uninterrupted run's"
    );

    // A checkpoint of other settings is not resumed.
    let mut other = settings.to_vec();
    other[1] = "4";
    other.push("--resume");
    let o = run(&mut train_command(
        &smollm2_path(),
        "lora",
        &data(),
        &cut,
        &other,
    ));
    assert!(!o.status.success());
    assert!(
        text(&o).contains("taken for other data or settings"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_trained_soft_prompt_lowers_the_loss_and_generate_takes_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("prompt");
    let summary = train(
        "soft-prompt",
        &out,
        &[
            "--virtual-tokens",
            "8",
            "--init-text",
            "a story about the sea",
            "--seq-len",
            "64",
            "--batch",
            "2",
            "--steps",
            "8",
            "--lr",
            "3e-2",
            "--threads",
            "2",
        ],
    );
    let (before, after) = (
        summary["loss_before"].as_f64().unwrap(),
        summary["loss_after"].as_f64().unwrap(),
    );
    assert!(
        after < before - 0.2,
        "the loss on the text went {before} → {after}"
    );
    let config: Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(config["peft_type"], "PROMPT_TUNING");
    assert_eq!(config["num_virtual_tokens"], 8);
    let prompt = ["-p", "The keeper of the", "-n", "8"];
    let plain = generate_json(&smollm2_path(), &prompt);
    let mut with = prompt.to_vec();
    let path = out.display().to_string();
    with.extend(["--soft-prompt", &path]);
    let tuned = generate_json(&smollm2_path(), &with);
    assert_ne!(
        tuned["text"], plain["text"],
        "the soft prompt changed nothing"
    );
}

#[test]
fn a_control_vector_from_contrasting_prompts_steers_generation() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, lines: &[&str]| {
        let p = dir.path().join(name);
        std::fs::write(&p, lines.join("\n")).unwrap();
        p
    };
    let pos = write(
        "pos.txt",
        &[
            "I am overjoyed, this is the happiest day of my life",
            "Everything is wonderful and I love it",
            "What a delightful, cheerful morning",
            "We laughed and celebrated all night",
        ],
    );
    let neg = write(
        "neg.txt",
        &[
            "I am miserable, this is the worst day of my life",
            "Everything is awful and I hate it",
            "What a gloomy, dreary morning",
            "We cried and mourned all night",
        ],
    );
    let vector = dir.path().join("happy.gguf");
    let o = run(control_vector_command(&pos, &neg, &vector).arg("--json"));
    assert!(o.status.success(), "{}", text(&o));
    let summary: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (summary["pairs"].as_u64(), summary["layers"].as_u64()),
        (Some(4), Some(29))
    );
    let bytes = std::fs::read(&vector).unwrap();
    assert_eq!(&bytes[..4], b"GGUF");
    assert!(bytes.windows(13).any(|w| w == b"controlvector"));

    let prompt = ["-p", "Today I feel", "-n", "10"];
    let plain = generate_json(&smollm2_path(), &prompt);
    let steered = |strength: &str| {
        let arg = format!("{}:{strength}", vector.display());
        let mut a = prompt.to_vec();
        a.extend(["--control-vector", &arg]);
        generate_json(&smollm2_path(), &a)
    };
    assert_eq!(
        steered("0")["text"],
        plain["text"],
        "strength 0 must change nothing"
    );
    assert_ne!(
        steered("8")["text"],
        plain["text"],
        "a strong vector changed nothing"
    );

    // Unpaired prompts are refused.
    let short = write("short.txt", &["only one line"]);
    let o = run(&mut control_vector_command(&pos, &short, &vector));
    assert!(!o.status.success());
    assert!(text(&o).contains("paired line by line"), "{}", text(&o));
}

#[test]
fn bad_training_input_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let refuse = |args: &[&str], data: &Path, says: &str| {
        let out = dir.path().join("out");
        let o = run(&mut train_command(
            &smollm2_path(),
            "lora",
            data,
            &out,
            args,
        ));
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(text(&o).contains(says), "{args:?}: {}", text(&o));
    };
    refuse(
        &["--targets", "x_proj"],
        &data(),
        "unknown target module `x_proj`",
    );
    refuse(&["--rank", "0"], &data(), "rank of 0");
    refuse(&["--seq-len", "1"], &data(), "--seq-len must be at least 2");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    refuse(&[], &empty, "fewer than two tokens");
    refuse(&[], &dir.path().join("missing.txt"), "reading");
    refuse(&["--resume"], &data(), "--resume: reading");
}
