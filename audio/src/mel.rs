//! Mel filterbanks as librosa's `filters.mel` makes them with its defaults (Slaney's mel scale,
//! `htk=False`; Slaney's area normalisation, `norm="slaney"`; `fmin = 0`, `fmax = sr / 2`),
//! which is how Whisper's `mel_filters.npz` was made.

/// Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
fn hz_to_mel(f: f64) -> f64 {
    let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
    let min_log_mel = min_log_hz / f_sp;
    let logstep = 6.4f64.ln() / 27.0;
    match f >= min_log_hz {
        true => min_log_mel + (f / min_log_hz).ln() / logstep,
        false => f / f_sp,
    }
}

/// The inverse of [`hz_to_mel`].
fn mel_to_hz(m: f64) -> f64 {
    let (f_sp, min_log_hz) = (200.0 / 3.0, 1000.0);
    let min_log_mel = min_log_hz / f_sp;
    let logstep = 6.4f64.ln() / 27.0;
    match m >= min_log_mel {
        true => min_log_hz * (logstep * (m - min_log_mel)).exp(),
        false => f_sp * m,
    }
}

/// `n_mels` triangular filters over the `n_fft / 2 + 1` bins of a `sample_rate` signal,
/// row-major `[n_mels, n_fft / 2 + 1]`.
pub fn filters(sample_rate: u32, n_fft: usize, n_mels: usize) -> Vec<f32> {
    let bins = n_fft / 2 + 1;
    let nyquist = f64::from(sample_rate) / 2.0;
    let fft_freqs: Vec<f64> = (0..bins)
        .map(|i| nyquist * i as f64 / (bins - 1) as f64)
        .collect();
    let (lo, hi) = (hz_to_mel(0.0), hz_to_mel(nyquist));
    let mel_f: Vec<f64> = (0..n_mels + 2)
        .map(|i| mel_to_hz(lo + (hi - lo) * i as f64 / (n_mels + 1) as f64))
        .collect();
    let mut out = vec![0f32; n_mels * bins];
    for m in 0..n_mels {
        let (left, centre, right) = (mel_f[m], mel_f[m + 1], mel_f[m + 2]);
        let norm = 2.0 / (right - left);
        for (b, &f) in fft_freqs.iter().enumerate() {
            let lower = (f - left) / (centre - left);
            let upper = (right - f) / (right - centre);
            out[m * bins + b] = (lower.min(upper).max(0.0) * norm) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mel_scale_is_linear_then_logarithmic_and_inverts() {
        assert!((hz_to_mel(1000.0) - 15.0).abs() < 1e-12);
        assert!((hz_to_mel(200.0) - 3.0).abs() < 1e-12);
        for f in [0.0, 350.0, 1000.0, 4321.0, 8000.0] {
            assert!((mel_to_hz(hz_to_mel(f)) - f).abs() < 1e-9, "{f}");
        }
    }

    #[test]
    fn each_filter_is_a_normalised_triangle() {
        let f = filters(16_000, 400, 80);
        assert_eq!(f.len(), 80 * 201);
        for row in f.chunks_exact(201) {
            let nonzero: Vec<usize> = (0..201).filter(|&b| row[b] > 0.0).collect();
            assert!(!nonzero.is_empty());
            // One contiguous run of bins.
            assert_eq!(nonzero.last().unwrap() - nonzero[0] + 1, nonzero.len());
        }
    }
}
