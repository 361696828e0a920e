//! Audio files to the samples the front end takes: WAV, FLAC and MP3 decoded with
//! `symphonia`, channels averaged to mono, resampled to 16 kHz with `rubato`'s FFT resampler
//! (its delay removed, the length `⌈len · 16000 / rate⌉`). A file that is not audio, uses a
//! codec not built in, holds no samples, has damaged frames (a packet that does not decode, or
//! a gap in the packets' timestamps where the reader skipped some) is an error saying so; a
//! file cut off between packets decodes to what it holds.

use rubato::{FftFixedIn, Resampler};
use symphonia::core::{
    audio::SampleBuffer,
    codecs::{CODEC_TYPE_NULL, DecoderOptions},
    errors::Error as Symphonia,
    formats::FormatOptions,
    io::MediaSourceStream,
    meta::MetadataOptions,
    probe::Hint,
};

/// The sample rates read (a file claiming another is refused before any resampler is made).
pub const RATES: std::ops::RangeInclusive<u32> = 1_000..=384_000;

/// The most samples (all channels counted) a file may decode to: 2²⁸, 1 GiB of `f32`. A
/// lossless file of silence compresses tens of thousands of samples into a byte (46 kB of
/// FLAC held 46 M samples), so a bound on the duration alone lets a small upload at a high
/// rate with many channels claim tens of gigabytes. This one holds 50 minutes of 44.1 kHz
/// stereo, more than a 25 MB MP3 at 128 kbit/s.
pub const MAX_SAMPLES: usize = 1 << 28;

/// Decoded audio: interleaved samples at their own rate.
#[derive(Debug, Clone, PartialEq)]
pub struct Audio {
    /// Samples per second.
    pub sample_rate: u32,
    /// Channels interleaved in `samples`.
    pub channels: usize,
    /// Interleaved samples in `[-1, 1]`.
    pub samples: Vec<f32>,
}

/// Why audio could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

fn fail(why: impl Into<String>) -> DecodeError {
    DecodeError(why.into())
}

/// How far into a file a FLAC stream marker is looked for (the format probe may find one
/// after leading junk).
const FLAC_SEARCH: usize = 1 << 20;

/// Turns the metadata blocks of every FLAC stream marker near the start into padding, but for
/// STREAMINFO and SEEKTABLE: symphonia allocates the lengths a picture or a Vorbis comment
/// declares (up to 4 GiB) before reading them, so a tiny file could claim gigabytes. Padding is
/// skipped unread; the blocks dropped carry no audio.
fn defuse_flac(bytes: &mut [u8]) {
    let window = bytes.len().min(FLAC_SEARCH);
    let mut from = 0;
    while let Some(found) = bytes[from..window].windows(4).position(|w| w == b"fLaC") {
        let mut at = from + found + 4;
        while let Some(&flags) = bytes.get(at) {
            let Some(len) = bytes.get(at + 1..at + 4) else {
                break;
            };
            let len = u32::from_be_bytes([0, len[0], len[1], len[2]]) as usize;
            let (last, kind) = (flags & 0x80 != 0, flags & 0x7f);
            if kind != 0 && kind != 3 {
                bytes[at] = (flags & 0x80) | 1;
            }
            at += 4 + len;
            if last {
                break;
            }
        }
        from += found + 4;
    }
}

/// Refuses a WAV file whose format chunk gives a sample rate of 0 (symphonia panics building
/// its time base from it). The chunks after `RIFF….WAVE` are walked while they fit.
fn check_wav(bytes: &[u8]) -> Result<(), DecodeError> {
    if bytes.len() < 12 || &bytes[..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return Ok(());
    }
    let mut at = 12;
    while let Some(header) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
        if &header[..4] == b"fmt "
            && let Some(rate) = bytes.get(at + 12..at + 16)
            && u32::from_le_bytes(rate.try_into().expect("4 bytes")) == 0
        {
            return Err(fail("corrupt WAV file: a sample rate of 0 Hz"));
        }
        at = at.saturating_add(8).saturating_add(len + (len & 1));
    }
    Ok(())
}

/// Decodes a whole WAV, FLAC or MP3 file held in `bytes`. A panic inside the decoding
/// libraries (on input no check here foresaw) is an error too.
pub fn decode(bytes: Vec<u8>) -> Result<Audio, DecodeError> {
    decode_at_most(bytes, f64::INFINITY)
}

/// [`decode`], refusing a file longer than `max_seconds` as soon as decoding reaches that
/// point (a few compressed bytes can stand for hours of samples: the bound is on what
/// decoding produces, not on the file's size).
pub fn decode_at_most(bytes: Vec<u8>, max_seconds: f64) -> Result<Audio, DecodeError> {
    decode_within(bytes, max_seconds, MAX_SAMPLES)
}

/// [`decode_at_most`], refusing a file that decodes to more than `max_samples` samples (all
/// channels counted) as soon as decoding passes that many ([`MAX_SAMPLES`] for the others).
pub fn decode_within(
    bytes: Vec<u8>,
    max_seconds: f64,
    max_samples: usize,
) -> Result<Audio, DecodeError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decode_bytes(bytes, max_seconds, max_samples)
    }))
    .unwrap_or_else(|_| Err(fail("corrupt audio file (the decoder gave up on it)")))
}

fn decode_bytes(
    mut bytes: Vec<u8>,
    max_seconds: f64,
    max_samples: usize,
) -> Result<Audio, DecodeError> {
    if bytes.is_empty() {
        return Err(fail("empty audio file"));
    }
    check_wav(&bytes)?;
    defuse_flac(&mut bytes);
    let source = MediaSourceStream::new(Box::new(std::io::Cursor::new(bytes)), Default::default());
    let probed = symphonia::default::get_probe()
        .format(
            &Hint::new(),
            source,
            &FormatOptions::default(),
            &MetadataOptions::default(),
        )
        .map_err(|e| fail(format!("not a WAV, FLAC or MP3 file ({e})")))?;
    let mut format = probed.format;
    let track = format
        .tracks()
        .iter()
        .find(|t| t.codec_params.codec != CODEC_TYPE_NULL)
        .ok_or_else(|| fail("the file holds no audio track"))?;
    let track_id = track.id;
    let mut decoder = symphonia::default::get_codecs()
        .make(&track.codec_params, &DecoderOptions::default())
        .map_err(|e| fail(format!("unsupported codec ({e})")))?;
    let (mut samples, mut spec) = (Vec::new(), None);
    // Where the next packet should start: a reader that resynchronises past damage skips
    // frames, and the gap in the timestamps is how that shows.
    let mut next_ts: Option<u64> = None;
    loop {
        let packet = match format.next_packet() {
            Ok(p) => p,
            Err(Symphonia::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(Symphonia::ResetRequired) => break,
            Err(e) => return Err(fail(format!("corrupt audio file ({e})"))),
        };
        if packet.track_id() != track_id {
            continue;
        }
        if let Some(want) = next_ts
            && packet.ts() != want
        {
            return Err(fail(format!(
                "corrupt audio data: the stream skips from sample {want} to {} (damaged frames)",
                packet.ts()
            )));
        }
        next_ts = Some(packet.ts() + packet.dur());
        let decoded = decoder
            .decode(&packet)
            .map_err(|e| fail(format!("corrupt audio data ({e})")))?;
        let s = *decoded.spec();
        if spec.is_some_and(|old: symphonia::core::audio::SignalSpec| old != s) {
            return Err(fail("the audio changes its rate or channels part-way"));
        }
        spec = Some(s);
        let mut buf = SampleBuffer::<f32>::new(decoded.capacity() as u64, s);
        buf.copy_interleaved_ref(decoded);
        if samples.len() + buf.samples().len() > max_samples {
            return Err(fail(format!(
                "the audio decodes to more than {max_samples} samples (the most accepted)"
            )));
        }
        samples.extend_from_slice(buf.samples());
        let frames = samples.len() / s.channels.count().max(1);
        if frames as f64 > max_seconds * f64::from(s.rate.max(1)) {
            return Err(fail(format!(
                "the audio is longer than {max_seconds:.0} s (the longest accepted)"
            )));
        }
    }
    let spec = spec.ok_or_else(|| fail("the file holds no audio samples"))?;
    if !RATES.contains(&spec.rate) {
        return Err(fail(format!(
            "a sample rate of {} Hz (audio is read at {} to {} Hz)",
            spec.rate,
            RATES.start(),
            RATES.end()
        )));
    }
    let channels = spec.channels.count();
    if samples.is_empty() || channels == 0 || spec.rate == 0 {
        return Err(fail("the file holds no audio samples"));
    }
    if samples.iter().any(|x| !x.is_finite() || x.abs() > 1e3) {
        return Err(fail(
            "corrupt audio data: samples that are not finite numbers or lie far outside ±1",
        ));
    }
    Ok(Audio {
        sample_rate: spec.rate,
        channels,
        samples,
    })
}

impl Audio {
    /// The channels averaged into one.
    pub fn mono(&self) -> Vec<f32> {
        self.samples
            .chunks_exact(self.channels)
            .map(|f| f.iter().sum::<f32>() / self.channels as f32)
            .collect()
    }

    /// Mono at `rate` samples per second (what speech models take: 16 kHz).
    pub fn mono_at(&self, rate: u32) -> Result<Vec<f32>, DecodeError> {
        resample(&self.mono(), self.sample_rate, rate)
    }
}

/// `samples` at `from` Hz resampled to `to` Hz: `⌈len · to / from⌉` samples, aligned with the
/// input (the resampler's delay removed).
pub fn resample(samples: &[f32], from: u32, to: u32) -> Result<Vec<f32>, DecodeError> {
    if from == to || samples.is_empty() {
        return Ok(samples.to_vec());
    }
    if !RATES.contains(&from) || !RATES.contains(&to) {
        return Err(fail(format!(
            "resampling {from} Hz to {to} Hz: rates are {} to {} Hz",
            RATES.start(),
            RATES.end()
        )));
    }
    let bad = |e: &dyn std::fmt::Display| fail(format!("resampling {from} Hz to {to} Hz: {e}"));
    let mut r =
        FftFixedIn::<f32>::new(from as usize, to as usize, 1024, 2, 1).map_err(|e| bad(&e))?;
    let expected = (samples.len() as u64 * u64::from(to)).div_ceil(u64::from(from)) as usize;
    let delay = r.output_delay();
    let mut out = Vec::with_capacity(expected + delay);
    let mut at = 0;
    while at + r.input_frames_next() <= samples.len() {
        let n = r.input_frames_next();
        let o = r
            .process(&[&samples[at..at + n]], None)
            .map_err(|e| bad(&e))?;
        out.extend_from_slice(&o[0]);
        at += n;
    }
    let o = r
        .process_partial(Some(&[&samples[at..]]), None)
        .map_err(|e| bad(&e))?;
    out.extend_from_slice(&o[0]);
    while out.len() < delay + expected {
        let o = r
            .process_partial::<&[f32]>(None, None)
            .map_err(|e| bad(&e))?;
        if o[0].is_empty() {
            break;
        }
        out.extend_from_slice(&o[0]);
    }
    out.drain(..delay.min(out.len()));
    out.truncate(expected);
    Ok(out)
}
