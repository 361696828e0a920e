//! openai-whisper's transcription loop (`whisper.transcribe`) over a whole recording: the
//! log-mel spectrogram of the audio plus 30 s of silence, cut into windows of at most 3000
//! frames (zero-padded); each window decoded with the previous text as its prompt, retried at
//! higher temperatures when the result looks like a failure, skipped when it is silence; with
//! timestamps, the window is split at timestamp pairs and the next one starts at the last
//! timestamp, otherwise each window is one segment.

use crate::{
    decode::{Decoded, Decoder, Rng},
    vocab::TIME_PRECISION,
};
use std::io::Write;
use u_audio::{HOP_LENGTH, N_SAMPLES, SAMPLE_RATE};
use u_sdk::{ErrorKind, Result, Rows, TokenizerBox, TranscriptSegment, UError};

/// Frames in a 30 s window.
pub const N_FRAMES: usize = N_SAMPLES / HOP_LENGTH;
/// Spectrogram frames per encoder position (the second convolution's stride).
const INPUT_STRIDE: usize = 2;
/// A window whose text compresses better than this is repetitive: decode it again hotter.
const COMPRESSION_RATIO_THRESHOLD: f64 = 2.4;
/// A window whose mean log-probability is below this is unlikely: decode it again hotter.
const LOGPROB_THRESHOLD: f64 = -1.0;
/// Above this no-speech probability (and below the log-probability threshold) a window is
/// silence.
const NO_SPEECH_THRESHOLD: f64 = 0.6;
/// Step between fallback temperatures.
const TEMPERATURE_STEP: f32 = 0.2;

/// What the loop needs.
pub struct Job<'a> {
    /// The window decoder.
    pub decoder: Decoder<'a>,
    /// For segment texts.
    pub tokenizer: &'a TokenizerBox,
    /// Mel bins the model reads.
    pub n_mels: usize,
    /// The transcript's start sequence (`sot`, language and task, maybe `notimestamps`).
    pub start: Vec<u32>,
    /// Predict timestamps.
    pub timestamps: bool,
    /// Prompt each window with the text before it.
    pub condition_on_previous: bool,
    /// The first temperature.
    pub temperature: f32,
    /// Tokens of the initial prompt (OpenAI's `prompt`), placed before the first window.
    pub prompt: Vec<u32>,
    /// Longest decoder context (448).
    pub context: usize,
}

/// The log-mel spectrogram of a recording with Whisper's 30 s of padding: `[n_mels, frames]`,
/// and its frames of content (those before the padding). Made once per request; language
/// detection and every window read it.
pub struct Spectrogram {
    mel: Vec<f32>,
    frames: usize,
    content: usize,
}

impl Spectrogram {
    /// The spectrogram of `samples` (16 kHz mono).
    pub fn of(samples: &[f32], n_mels: usize) -> Result<Spectrogram> {
        let (mel, frames) = u_audio::log_mel_spectrogram(samples, n_mels, N_SAMPLES)
            .map_err(|e| UError::invalid(format!("runner-transcription: {e:?}")))?;
        Ok(Spectrogram {
            mel,
            frames,
            content: frames.saturating_sub(N_FRAMES),
        })
    }
}

/// Frames `seek..seek + len` of `mel` (`[n_mels, frames]`), zero-padded to [`N_FRAMES`].
fn window(mel: &[f32], n_mels: usize, frames: usize, seek: usize, len: usize) -> Vec<f32> {
    let mut out = vec![0f32; n_mels * N_FRAMES];
    for m in 0..n_mels {
        let row = &mel[m * frames + seek..m * frames + seek + len];
        out[m * N_FRAMES..m * N_FRAMES + len].copy_from_slice(row);
    }
    out
}

/// How well `text` compresses with zlib (bytes in over bytes out).
pub fn compression_ratio(text: &str) -> f64 {
    if text.is_empty() {
        return 0.0;
    }
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    if z.write_all(text.as_bytes()).is_err() {
        return 0.0;
    }
    match z.finish() {
        Ok(out) if !out.is_empty() => text.len() as f64 / out.len() as f64,
        _ => 0.0,
    }
}

impl Job<'_> {
    fn text(&self, tokens: &[u32]) -> Result<String> {
        let eot = self.decoder.specials.eot;
        let text: Vec<u32> = tokens.iter().copied().filter(|&t| t < eot).collect();
        Ok(self
            .tokenizer
            .decode(text.as_slice().into(), true)
            .into_result()?
            .into())
    }

    /// The prompt of a window: the previous text (at most half the context) after
    /// `startofprev`, then the start sequence.
    fn prompt(&self, previous: &[u32]) -> Vec<u32> {
        let mut p = Vec::new();
        if !previous.is_empty() {
            let keep = (self.context / 2 - 1).min(previous.len());
            p.push(self.decoder.specials.sot_prev);
            p.extend_from_slice(&previous[previous.len() - keep..]);
        }
        p.extend_from_slice(&self.start);
        p
    }

    /// Decodes one window, retrying hotter while the result looks like a failure.
    fn with_fallback(
        &self,
        prompt: &[u32],
        kv: u64,
        mel: &[f32],
        rng: &mut Rng,
    ) -> Result<(Decoded, f64)> {
        let mut t = self.temperature;
        let mut encoded = false;
        loop {
            let d = self.decoder.window(
                prompt,
                kv,
                if encoded { &[] } else { mel },
                self.timestamps,
                t,
                rng,
            )?;
            encoded = true;
            let ratio = compression_ratio(self.text(&d.tokens)?.trim());
            let silent =
                d.no_speech_prob > NO_SPEECH_THRESHOLD && d.avg_logprob() < LOGPROB_THRESHOLD;
            let failed = ratio > COMPRESSION_RATIO_THRESHOLD || d.avg_logprob() < LOGPROB_THRESHOLD;
            if silent || !failed || t >= 1.0 - 1e-6 {
                return Ok((d, ratio));
            }
            t = (t + TEMPERATURE_STEP).min(1.0);
        }
    }

    /// Transcribes the recording of `spectrogram`: the segments in order.
    pub fn run(&self, spectrogram: &Spectrogram) -> Result<Vec<TranscriptSegment>> {
        let Spectrogram {
            mel,
            frames,
            content,
        } = spectrogram;
        let (frames, content) = (*frames, *content);
        let s = self.decoder.specials;
        let cache = self.decoder.cache;
        let seconds_per_frame = HOP_LENGTH as f64 / f64::from(SAMPLE_RATE);
        let mut rng = Rng::new(0x5eed);
        let mut all_tokens = self.prompt.clone();
        let mut prompt_reset = 0;
        let mut segments = Vec::new();
        let mut seek = 0;
        while seek < content {
            let window_start = seek;
            let size = N_FRAMES.min(content - seek);
            let offset = seek as f64 * seconds_per_frame;
            let mel_window = window(mel, self.n_mels, frames, seek, size);
            let kv = cache.create().into_result()?;
            let prompt = self.prompt(&all_tokens[prompt_reset..]);
            let result = self.with_fallback(&prompt, kv, &mel_window, &mut rng);
            let _ = cache.release(kv);
            let (d, ratio) = result?;
            if d.no_speech_prob > NO_SPEECH_THRESHOLD && d.avg_logprob() < LOGPROB_THRESHOLD {
                seek += size;
                continue;
            }
            let segment = |tokens: &[u32], start: f64, end: f64| -> Result<TranscriptSegment> {
                Ok(TranscriptSegment {
                    seek: seek as u64,
                    start,
                    end,
                    text: self.text(tokens)?.into(),
                    tokens: tokens.to_vec().into(),
                    temperature: d.temperature,
                    avg_logprob: d.avg_logprob(),
                    compression_ratio: ratio,
                    no_speech_prob: d.no_speech_prob,
                })
            };
            let time = |t: u32| f64::from(t.saturating_sub(s.timestamp_begin)) * TIME_PRECISION;
            let tokens = &d.tokens;
            let is_ts = |i: usize| tokens[i] >= s.timestamp_begin;
            let single_ending =
                tokens.len() >= 2 && !is_ts(tokens.len() - 2) && is_ts(tokens.len() - 1);
            let consecutive: Vec<usize> = (1..tokens.len())
                .filter(|&i| is_ts(i - 1) && is_ts(i))
                .collect();
            let before = segments.len();
            if self.timestamps && !consecutive.is_empty() {
                let mut slices = consecutive;
                if single_ending {
                    slices.push(tokens.len());
                }
                let mut last = 0;
                for &end in &slices {
                    let piece = &tokens[last..end];
                    segments.push(segment(
                        piece,
                        offset + time(piece[0]),
                        offset + time(piece[piece.len() - 1]),
                    )?);
                    last = end;
                }
                if single_ending {
                    seek += size;
                } else {
                    let last_ts = tokens[last - 1].saturating_sub(s.timestamp_begin);
                    seek += last_ts as usize * INPUT_STRIDE;
                }
            } else {
                let mut duration = size as f64 * seconds_per_frame;
                if let Some(&t) = tokens.iter().rev().find(|&&t| t >= s.timestamp_begin)
                    && self.timestamps
                    && t != s.timestamp_begin
                {
                    duration = time(t);
                }
                if !tokens.is_empty() {
                    segments.push(segment(tokens, offset, offset + duration)?);
                }
                seek += size;
            }
            // Segments that hold no text (a lone timestamp pair) are dropped.
            let mut i = before;
            while i < segments.len() {
                if segments[i].text.trim().is_empty() {
                    segments.remove(i);
                } else {
                    i += 1;
                }
            }
            all_tokens.extend(
                segments[before..]
                    .iter()
                    .flat_map(|x| x.tokens.iter().copied()),
            );
            if !self.condition_on_previous || d.temperature > 0.5 {
                prompt_reset = all_tokens.len();
            }
            if seek <= window_start {
                return Err(UError::new(
                    ErrorKind::Internal,
                    "runner-transcription: a window did not advance",
                ));
            }
        }
        Ok(segments)
    }

    /// The language of the first window (multilingual models): the likeliest language token
    /// after `sot`.
    pub fn detect_language(&self, spectrogram: &Spectrogram) -> Result<String> {
        let s = self.decoder.specials;
        let (mel, frames) = (&spectrogram.mel, spectrogram.frames);
        // As openai-whisper detects it: the first 30 s of the padded spectrogram (the log-mel
        // of the padding, not zeros, after a short clip's speech).
        let mel_window = window(mel, self.n_mels, frames, 0, N_FRAMES.min(frames));
        let cache = self.decoder.cache;
        let seq = cache.create().into_result()?;
        let kv = match cache.create().into_result() {
            Ok(kv) => kv,
            Err(e) => {
                let _ = cache.release(seq);
                return Err(e);
            }
        };
        let logits = self
            .decoder
            .pass(seq, &[s.sot], kv, &mel_window, Rows::Last);
        let _ = cache.release(seq);
        let _ = cache.release(kv);
        let logits = logits?;
        s.languages
            .iter()
            .max_by(|a, b| logits[a.0 as usize].total_cmp(&logits[b.0 as usize]))
            .map(|(_, code)| code.clone())
            .ok_or_else(|| {
                UError::invalid("runner-transcription: the model has no language tokens")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitive_text_compresses_well() {
        let plain = compression_ratio("The quick brown fox jumps over the lazy dog.");
        let looped = compression_ratio(&"la la la la ".repeat(40));
        assert!(plain < 1.5, "{plain}");
        assert!(looped > COMPRESSION_RATIO_THRESHOLD, "{looped}");
    }

    #[test]
    fn windows_are_zero_padded() {
        let (n_mels, frames) = (2, 5);
        let mel: Vec<f32> = (0..10).map(|v| v as f32).collect();
        let w = window(&mel, n_mels, frames, 1, 3);
        assert_eq!(&w[..4], &[1.0, 2.0, 3.0, 0.0]);
        assert_eq!(&w[N_FRAMES..N_FRAMES + 4], &[6.0, 7.0, 8.0, 0.0]);
        assert!(w[N_FRAMES + 3..].iter().all(|&v| v == 0.0));
    }
}
