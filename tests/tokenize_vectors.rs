//! `u-runner tokenize --no-special` on every llama.cpp 0.3.36 test vocabulary that has test
//! vectors (`ggml-vocab-<name>.gguf` with `.inp`/`.out`, fetched from the llama-cpp-python
//! source archive): the whole `.inp` file in one call, split on llama.cpp's separator, gives
//! the `.out` file line for line. Also the bad inputs: an id out of range for `--decode`, a
//! vocabulary of an unknown tokenizer type, a truncated vocabulary.

use std::{path::Path, process::Command};
use u_conformance::{bin, root, run, serving::llama_vocab_dir, text};

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn tokenize(model: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.arg("tokenize")
        .arg("--model")
        .arg(model)
        .arg("--deployment")
        .arg(root().join("manifests/dev.toml"))
        .args(args);
    cmd
}

#[test]
fn the_cli_passes_every_test_vector() {
    let dir = llama_vocab_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let f = e.ok()?.file_name().into_string().ok()?;
            Some(
                f.strip_prefix("ggml-vocab-")?
                    .strip_suffix(".gguf.inp")?
                    .to_string(),
            )
        })
        .collect();
    names.sort();
    assert_eq!(names.len(), 15, "{names:?}");
    let mut report = Vec::new();
    for name in &names {
        let model = dir.join(format!("ggml-vocab-{name}.gguf"));
        let inp = dir.join(format!("ggml-vocab-{name}.gguf.inp"));
        let want =
            std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out"))).unwrap();
        let out = run(&mut tokenize(
            &model,
            &[
                "--no-special",
                "--separator",
                SEPARATOR,
                "--file",
                inp.to_str().unwrap(),
            ],
        ));
        assert!(out.status.success(), "{name}: {}", text(&out));
        let got = String::from_utf8(out.stdout).unwrap();
        let (got, want): (Vec<&str>, Vec<&str>) = (got.lines().collect(), want.lines().collect());
        assert_eq!(got.len(), want.len(), "{name}: one line per input");
        let same = got
            .iter()
            .zip(&want)
            .filter(|(g, w)| g.split_whitespace().eq(w.split_whitespace()))
            .count();
        report.push(format!("{name}: {same}/{}", want.len()));
        assert_eq!(same, want.len(), "{name}: {}", report.last().unwrap());
    }
    println!("{}", report.join("\n"));
}

#[test]
fn bad_vocabularies_and_ids_are_clear_errors() {
    let dir = llama_vocab_dir();
    let model = dir.join("ggml-vocab-qwen2.gguf");
    let out = run(&mut tokenize(
        &model,
        &["--decode", "--text", "9707 999999999"],
    ));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("token id 999999999 is out of range"),
        "{}",
        text(&out)
    );

    // The same vocabulary with an unknown tokenizer type, and cut short.
    let tmp = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(&model).unwrap();
    let at = bytes
        .windows(4)
        .position(|w| w == b"gpt2")
        .expect("the model name is in the file");
    let mut unknown = bytes.clone();
    unknown[at..at + 4].copy_from_slice(b"gpt9");
    let path = tmp.path().join("unknown.gguf");
    std::fs::write(&path, &unknown).unwrap();
    let out = run(&mut tokenize(&path, &["--text", "Hello"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("\"gpt9\" is not supported"),
        "{}",
        text(&out)
    );

    let path = tmp.path().join("truncated.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let out = run(&mut tokenize(&path, &["--text", "Hello"]));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
    println!("truncated: {}", text(&out).trim());
}
