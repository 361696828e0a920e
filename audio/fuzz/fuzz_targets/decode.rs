//! Fuzzes audio decoding (WAV, FLAC, MP3 through symphonia) under the duration bound a server
//! applies, resampling to 16 kHz and the log-mel front end on what decodes: any bytes give
//! audio or an error, never a crash or a runaway allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// The duration bound: a minute (servers apply their own; the memory a bound allows grows
/// with it).
const MAX_SECONDS: f64 = 60.0;

fuzz_target!(|data: &[u8]| {
    // `decode` turns a panic inside the decoding libraries into an error (its documented
    // contract); libfuzzer's hook would abort on it before that, so this hook is silent. A
    // panic that escapes still fails the run.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| std::panic::set_hook(Box::new(|_| {})));
    if let Ok(audio) = u_audio::decode::decode_at_most(data.to_vec(), MAX_SECONDS)
        && audio.samples.len() < 1 << 20
        && let Ok(mono) = audio.mono_at(u_audio::SAMPLE_RATE)
    {
        let _ = u_audio::log_mel_spectrogram(&mono, 80, 0);
    }
});
