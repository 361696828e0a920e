//! `u-runner transcribe`: speech to text with a Whisper-style model, wired as for `generate`
//! (loader, architecture, kernels, cache, tokenizer, the transcription runner), the audio file
//! read before the process is locked down. The text goes to stdout (or, with `--json`, the
//! transcript with its segments); subtitles (SRT, WebVTT) are the HTTP API's formats.

use anyhow::{Context, Result, bail};
use serde_json::json;
use std::{io::Read, path::PathBuf, time::Instant};
use u_runner::wiring;

/// The largest audio file read (1 GiB).
const MAX_AUDIO_BYTES: u64 = 1 << 30;

/// Arguments of `u-runner transcribe`.
#[derive(clap::Args)]
pub struct TranscribeArgs {
    /// The audio file: WAV, FLAC or MP3.
    file: PathBuf,
    /// The model: a CTranslate2 Whisper folder, a Hugging Face Whisper folder.
    #[arg(long)]
    model: PathBuf,
    /// The spoken language (ISO-639-1, e.g. `de`) [default: detected; `en` for English-only
    /// models].
    #[arg(long, default_value = "")]
    language: String,
    /// Translate the speech to English.
    #[arg(long)]
    translate: bool,
    /// Text that conditions the first window (spellings, names, style).
    #[arg(long, default_value = "")]
    prompt: String,
    /// The first sampling temperature (0 is greedy; raised on windows that fail).
    #[arg(long = "temp", default_value_t = 0.0)]
    temperature: f32,
    /// Beams of beam search (1: greedy; openai-whisper's command line uses 5).
    #[arg(long, default_value_t = 1)]
    beam_size: u32,
    /// Print one JSON object (OpenAI's `verbose_json`: language, duration, text, segments with
    /// their tokens; and timings) instead of the text.
    #[arg(long)]
    json: bool,
    /// Do not predict timestamps (each 30 s window becomes one segment).
    #[arg(long)]
    no_timestamps: bool,
    /// Do not prompt each window with the text before it.
    #[arg(long)]
    no_condition_on_previous_text: bool,
    /// Compute threads [default: the deployment's, else all cores].
    #[arg(long)]
    threads: Option<u32>,
    /// The deployment [default: as for `generate`].
    #[arg(long)]
    deployment: Option<PathBuf>,
}

/// Transcribes the file and prints its text (or JSON); speed goes to stderr.
pub fn run(args: TranscribeArgs) -> Result<i32> {
    let mut audio = Vec::new();
    std::fs::File::open(&args.file)
        .with_context(|| format!("opening {}", args.file.display()))?
        .take(MAX_AUDIO_BYTES + 1)
        .read_to_end(&mut audio)
        .with_context(|| format!("reading {}", args.file.display()))?;
    if audio.len() as u64 > MAX_AUDIO_BYTES {
        bail!(
            "{} is larger than {MAX_AUDIO_BYTES} bytes",
            args.file.display()
        );
    }
    let d = crate::load_default(args.deployment)?;
    let threads = args.threads.unwrap_or_else(|| crate::threads(&d)).max(1);
    let opened = wiring::open(&d, &args.model, threads, wiring::Want::Engine)?;
    let (runner, engine) = opened.engine.context("no engine was started")?;
    let request = u_sdk::TranscribeRequest {
        model: wiring::served_name(&u_attest::deployment::absolute(&args.model)).into(),
        audio: audio.into(),
        language: args.language.into(),
        translate: args.translate,
        prompt: args.prompt.into(),
        temperature: args.temperature,
        timestamps: !args.no_timestamps,
        condition_on_previous: !args.no_condition_on_previous_text,
        beam_size: args.beam_size,
        client: "".into(),
    };
    let start = Instant::now();
    let t = engine
        .transcribe(&request)
        .into_result()
        .map_err(|e| anyhow::anyhow!("{runner}: {e}"))?;
    let seconds = start.elapsed().as_secs_f64();
    let rtf = if t.duration > 0.0 {
        seconds / t.duration
    } else {
        0.0
    };
    if !args.json {
        println!("{}", t.text);
    } else {
        let segments: Vec<_> = t
            .segments
            .iter()
            .enumerate()
            .map(|(i, s)| {
                json!({
                    "id": i, "seek": s.seek, "start": s.start, "end": s.end,
                    "text": s.text.as_str(), "tokens": s.tokens.as_slice(),
                    "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                    "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob,
                })
            })
            .collect();
        println!(
            "{}",
            json!({
                "task": if request.translate { "translate" } else { "transcribe" },
                "language": t.language.as_str(), "duration": t.duration,
                "text": t.text.as_str(), "segments": segments,
                "timings": { "seconds": seconds, "real_time_factor": rtf, "threads": threads },
            })
        );
    }
    eprintln!(
        "transcribed {:.1} s of audio in {seconds:.2} s (real-time factor {rtf:.3}; {threads} threads)",
        t.duration
    );
    Ok(0)
}
