//! The log-mel front end against openai-whisper's `log_mel_spectrogram`
//! (`tests/fixtures/gen_log_mel.py`): a tone, a chirp in noise, noise, silence and a click train
//! with a DC offset, at 80 and 128 mel bins and with whisper's 30 s of padding, to 1e-4.

use anyhow::Result;
use serde_json::Value;
use std::path::Path;
use u_audio::{Error, log_mel_spectrogram};

fn floats(path: &Path) -> Result<Vec<f32>> {
    Ok(std::fs::read(path)?
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect())
}

#[test]
fn log_mel_equals_openai_whisper() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/log_mel");
    let index: Value = serde_json::from_slice(&std::fs::read(dir.join("index.json"))?)?;
    let cases = index.as_array().unwrap();
    assert_eq!(cases.len(), 11);
    for case in cases {
        let samples = floats(&dir.join(case["clip"].as_str().unwrap()))?;
        let n_mels = case["n_mels"].as_u64().unwrap() as usize;
        let padding = case["padding"].as_u64().unwrap() as usize;
        let want = floats(&dir.join(case["mel"].as_str().unwrap()))?;
        let kept = case["kept"].as_u64().unwrap() as usize;
        let (got, frames) = log_mel_spectrogram(&samples, n_mels, padding)?;
        assert_eq!(frames as u64, case["frames"].as_u64().unwrap(), "{case}");
        let mut worst = 0f32;
        for m in 0..n_mels {
            let row = &got[m * frames..(m + 1) * frames];
            let reference = &want[m * kept..(m + 1) * kept];
            for (t, &g) in row.iter().enumerate() {
                // Past the kept frames lies the padding's silence, equal to the last kept one.
                let w = reference[t.min(kept - 1)];
                worst = worst.max((g - w).abs());
            }
        }
        eprintln!("{}: worst difference {worst:e}", case["mel"]);
        assert!(worst < 1e-4, "{case}: differs by {worst}");
    }
    Ok(())
}

#[test]
fn bad_input_is_refused() {
    assert_eq!(
        log_mel_spectrogram(&[0.0; 1000], 64, 0),
        Err(Error::MelBins(64))
    );
    assert_eq!(
        log_mel_spectrogram(&[0.0; 200], 80, 0),
        Err(Error::TooShort(200))
    );
    assert!(
        log_mel_spectrogram(&[], 80, 480_000).is_ok(),
        "padding alone is audio"
    );
}
