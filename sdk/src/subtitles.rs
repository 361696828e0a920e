//! A [`Transcript`](crate::Transcript) written as subtitles: SubRip (`.srt`) and WebVTT
//! (`.vtt`), the response formats OpenAI's transcription API offers. Shared by the transports
//! and the host's `transcribe` command so both write the same bytes.

use crate::Transcript;
use std::fmt::Write;

/// `HH:MM:SS{sep}mmm` for `seconds` (negative clamps to zero).
pub fn timestamp(seconds: f64, sep: char) -> String {
    let ms = (seconds.max(0.0) * 1000.0).round() as u64;
    let (h, m, s, ms) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    format!("{h:02}:{m:02}:{s:02}{sep}{ms:03}")
}

/// A cue's text on one line: line breaks would end the cue, and `-->` would read as timing.
fn cue(text: &str) -> String {
    text.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("-->", "->")
}

/// SubRip: numbered cues, `,` before the milliseconds, a blank line after each.
pub fn srt(t: &Transcript) -> String {
    let mut out = String::new();
    for (i, s) in t.segments.iter().enumerate() {
        let _ = write!(
            out,
            "{}\n{} --> {}\n{}\n\n",
            i + 1,
            timestamp(s.start, ','),
            timestamp(s.end, ','),
            cue(&s.text)
        );
    }
    out
}

/// WebVTT: the `WEBVTT` header, then cues with `.` before the milliseconds.
pub fn vtt(t: &Transcript) -> String {
    let mut out = String::from("WEBVTT\n\n");
    for s in t.segments.iter() {
        let _ = write!(
            out,
            "{} --> {}\n{}\n\n",
            timestamp(s.start, '.'),
            timestamp(s.end, '.'),
            cue(&s.text)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TranscriptSegment;

    fn transcript() -> Transcript {
        let seg = |start, end, text: &str| TranscriptSegment {
            seek: 0,
            start,
            end,
            text: text.into(),
            tokens: Default::default(),
            temperature: 0.0,
            avg_logprob: 0.0,
            compression_ratio: 0.0,
            no_speech_prob: 0.0,
        };
        Transcript {
            text: "Hello there. General Kenobi.".into(),
            language: "en".into(),
            duration: 3725.5,
            segments: vec![
                seg(0.0, 1.5, " Hello\nthere."),
                seg(3661.25, 3725.5, " General --> Kenobi."),
            ]
            .into(),
        }
    }

    #[test]
    fn subrip_and_webvtt_cues() {
        let t = transcript();
        assert_eq!(
            srt(&t),
            "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n\
             2\n01:01:01,250 --> 01:02:05,500\nGeneral -> Kenobi.\n\n"
        );
        assert_eq!(
            vtt(&t),
            "WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n\
             01:01:01.250 --> 01:02:05.500\nGeneral -> Kenobi.\n\n"
        );
    }
}
