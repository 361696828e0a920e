//! # u-audio — audio front ends for speech models
//!
//! [`log_mel_spectrogram`] is Whisper's input as openai-whisper's `log_mel_spectrogram`
//! computes it (Radford et al. 2022, *Robust Speech Recognition via Large-Scale Weak
//! Supervision*), from 16 kHz mono samples:
//!
//! 1. optional zero padding on the right (whisper pads 30 s before transcribing);
//! 2. a short-time Fourier transform: frames of [`N_FFT`] = 400 samples every [`HOP_LENGTH`] =
//!    160 (10 ms), centred (the signal reflect-padded by 200 at each end), a periodic Hann
//!    window, power `|X|²` of the 201 bins; the last frame is dropped;
//! 3. the [`mel::filters`] bank (librosa's Slaney mel scale and normalisation) of 80 or 128
//!    bins;
//! 4. `log10(max(x, 1e-10))`, floored at the maximum minus 8, then `(x + 4) / 4`.
//!
//! The result is `[n_mels, frames]`, row-major, `frames = (len + padding) / 160`.
//!
//! [`decode`] reads WAV, FLAC and MP3 files and resamples them to 16 kHz mono.

pub mod decode;
pub mod mel;

use realfft::RealFftPlanner;

/// Samples per second the front end expects.
pub const SAMPLE_RATE: u32 = 16_000;
/// Samples per STFT frame.
pub const N_FFT: usize = 400;
/// Samples between frames.
pub const HOP_LENGTH: usize = 160;
/// Samples in Whisper's 30 s window (its padding before transcription).
pub const N_SAMPLES: usize = 30 * SAMPLE_RATE as usize;

/// Why a spectrogram could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// Whisper's filterbanks have 80 or 128 bins.
    MelBins(usize),
    /// Reflect padding needs more than `N_FFT / 2` samples.
    TooShort(usize),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::MelBins(n) => write!(f, "{n} mel bins: Whisper's front end has 80 or 128"),
            Error::TooShort(n) => write!(
                f,
                "{n} samples: the spectrogram needs more than {} (a 12.5 ms clip)",
                N_FFT / 2
            ),
        }
    }
}

impl std::error::Error for Error {}

/// The log-mel spectrogram of `samples` (16 kHz mono) with `padding` zeros appended, `n_mels`
/// (80 or 128) rows of `frames` values (see the crate documentation).
pub fn log_mel_spectrogram(
    samples: &[f32],
    n_mels: usize,
    padding: usize,
) -> Result<(Vec<f32>, usize), Error> {
    if n_mels != 80 && n_mels != 128 {
        return Err(Error::MelBins(n_mels));
    }
    let len = samples.len() + padding;
    let half = N_FFT / 2;
    if len <= half {
        return Err(Error::TooShort(len));
    }
    // Centred frames over the reflect-padded signal (torch.stft's `center=True`).
    let at = |i: isize| -> f32 {
        let n = len as isize;
        let j = if i < 0 {
            -i
        } else if i >= n {
            2 * (n - 1) - i
        } else {
            i
        };
        samples.get(j as usize).copied().unwrap_or(0.0)
    };
    let frames = len / HOP_LENGTH;
    let bins = N_FFT / 2 + 1;
    let window: Vec<f64> = (0..N_FFT)
        .map(|n| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * n as f64 / N_FFT as f64).cos())
        .collect();
    let fft = RealFftPlanner::<f64>::new().plan_fft_forward(N_FFT);
    let (mut input, mut spectrum) = (fft.make_input_vec(), fft.make_output_vec());
    let mut power = vec![0f32; bins * frames];
    for t in 0..frames {
        let start = (t * HOP_LENGTH) as isize - half as isize;
        for (k, x) in input.iter_mut().enumerate() {
            *x = f64::from(at(start + k as isize)) * window[k];
        }
        fft.process(&mut input, &mut spectrum)
            .expect("buffers made by the plan");
        for (b, c) in spectrum.iter().enumerate() {
            power[b * frames + t] = c.norm_sqr() as f32;
        }
    }
    let filters = mel::filters(SAMPLE_RATE, N_FFT, n_mels);
    let mut out = vec![0f32; n_mels * frames];
    for (m, row) in out.chunks_exact_mut(frames).enumerate() {
        let weights = &filters[m * bins..(m + 1) * bins];
        for (b, &w) in weights.iter().enumerate().filter(|(_, w)| **w != 0.0) {
            let p = &power[b * frames..(b + 1) * frames];
            row.iter_mut().zip(p).for_each(|(o, &x)| *o += w * x);
        }
    }
    for v in out.iter_mut() {
        *v = v.max(1e-10).log10();
    }
    let floor = out.iter().copied().fold(f32::NEG_INFINITY, f32::max) - 8.0;
    for v in out.iter_mut() {
        *v = (v.max(floor) + 4.0) / 4.0;
    }
    Ok((out, frames))
}
