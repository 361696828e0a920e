//! Decoding and resampling (`tests/fixtures/gen_decode.py`, written by libsndfile): 16-bit WAV
//! and FLAC give libsndfile's samples exactly; MP3 the same signal (after the codec's delay,
//! correlation above 0.999); 44.1 kHz resampled to 16 kHz is the same tones at 16 kHz; a 16 kHz
//! float WAV passes through; empty, truncated, corrupt and non-audio files are clear errors, and
//! a small file that decodes to more samples than the budget is refused while decoding.

use anyhow::Result;
use std::path::{Path, PathBuf};
use u_audio::decode::{decode, decode_within, resample};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/decode")
        .join(name)
}

fn read(name: &str) -> Result<Vec<u8>> {
    Ok(std::fs::read(fixture(name))?)
}

#[test]
fn lossless_files_give_their_samples_exactly() -> Result<()> {
    let want: Vec<f32> = read("clip.pcm")?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    for file in ["clip.wav", "clip.flac"] {
        let a = decode(read(file)?)?;
        assert_eq!((a.sample_rate, a.channels), (44_100, 2), "{file}");
        assert_eq!(a.samples, want, "{file}");
    }
    let tone = decode(read("tone16k.wav")?)?;
    assert_eq!(
        (tone.sample_rate, tone.channels, tone.samples.len()),
        (16_000, 1, 8000)
    );
    assert_eq!(
        tone.mono_at(16_000)?,
        tone.samples,
        "16 kHz mono passes through"
    );
    Ok(())
}

#[test]
fn mp3_decodes_to_the_same_signal() -> Result<()> {
    let wav = decode(read("clip.wav")?)?.mono();
    let mp3 = decode(read("clip.mp3")?)?;
    assert_eq!((mp3.sample_rate, mp3.channels), (44_100, 2));
    let mp3 = mp3.mono();
    // The encoder's delay: the lag that lines the two up best.
    let corr = |lag: usize| -> f64 {
        let n = wav.len().min(mp3.len().saturating_sub(lag)) - 2000;
        let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
        for i in 1000..n {
            let (a, b) = (f64::from(wav[i]), f64::from(mp3[i + lag]));
            ab += a * b;
            aa += a * a;
            bb += b * b;
        }
        ab / (aa * bb).sqrt()
    };
    let best = (0..3000).map(corr).fold(f64::MIN, f64::max);
    assert!(best > 0.999, "correlation {best}");
    Ok(())
}

#[test]
fn resampling_to_16k_keeps_the_tones() -> Result<()> {
    let a = decode(read("clip.wav")?)?;
    let mono = a.mono_at(16_000)?;
    let expected_len = (a.samples.len() / 2 * 16_000).div_ceil(44_100);
    assert_eq!(mono.len(), expected_len);
    let mut worst = 0f32;
    for (n, &v) in mono.iter().enumerate().skip(100).take(mono.len() - 200) {
        let t = n as f64 / 16_000.0;
        let want = 0.5 * (2.0 * std::f64::consts::PI * 440.0 * t).sin()
            + 0.05 * (2.0 * std::f64::consts::PI * 3000.0 * t).sin();
        worst = worst.max((v - want as f32).abs());
    }
    assert!(worst < 2e-3, "resampled tones differ by {worst}");
    assert_eq!(resample(&[], 44_100, 16_000)?, Vec::<f32>::new());
    Ok(())
}

#[test]
fn bad_files_are_clear_errors() -> Result<()> {
    let says = |bytes: Vec<u8>, what: &str| {
        let e = decode(bytes).expect_err(what);
        assert!(e.0.contains(what), "{e}");
    };
    says(Vec::new(), "empty audio file");
    says(
        b"this is not audio at all, just some text".to_vec(),
        "not a WAV, FLAC or MP3",
    );
    let wav = read("clip.wav")?;
    says(wav[..40].to_vec(), "not a WAV, FLAC or MP3");
    // Damaged frames in the middle: never silently dropped.
    for file in ["clip.flac", "clip.mp3"] {
        let mut bytes = read(file)?;
        let middle = bytes.len() / 2;
        bytes[middle..middle + 400]
            .iter_mut()
            .for_each(|b| *b ^= 0x5a);
        says(bytes, "corrupt audio");
    }
    // A small file that decodes to many samples is stopped at the sample budget, not at the
    // end of memory (a 46 kB FLAC of silence held 46 M samples).
    let silence = read("silence-8ch-96k.flac")?;
    assert!(silence.len() < 8_000, "{} bytes", silence.len());
    assert_eq!(
        decode_within(silence.clone(), f64::INFINITY, 2_000_000)?
            .samples
            .len(),
        2 * 96_000 * 8
    );
    let e = decode_within(silence, f64::INFINITY, 1_000_000).expect_err("over the budget");
    assert!(e.0.contains("more than 1000000 samples"), "{e}");
    // Truncated between packets: what it holds.
    let cut = decode(wav[..wav.len() / 2].to_vec())?;
    assert!(cut.samples.len() < 2 * 26_460 && !cut.samples.is_empty());
    Ok(())
}
