//! Fuzzes audio decoding (WAV, FLAC, MP3 through symphonia), resampling to 16 kHz and the
//! log-mel front end on what decodes: any bytes give audio or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(audio) = u_audio::decode::decode(data.to_vec())
        && audio.samples.len() < 1 << 20
        && let Ok(mono) = audio.mono_at(u_audio::SAMPLE_RATE)
    {
        let _ = u_audio::log_mel_spectrogram(&mono, 80, 0);
    }
});
