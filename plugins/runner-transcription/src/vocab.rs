//! Whisper's special tokens and the tokens it is never allowed to write, found through the
//! model's own tokenizer (so any Whisper vocabulary works: English-only, multilingual, v3).

use u_sdk::{Result, TokenizerBox, UError};

/// Seconds one timestamp token step stands for.
pub const TIME_PRECISION: f64 = 0.02;

/// The vocabulary size from which a Whisper model is multilingual (51865; English-only models
/// have 51864).
pub const MULTILINGUAL_VOCAB: usize = 51865;

/// The special token ids of a Whisper vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Specials {
    /// `<|endoftext|>`.
    pub eot: u32,
    /// `<|startoftranscript|>`.
    pub sot: u32,
    /// `<|translate|>`.
    pub translate: u32,
    /// `<|transcribe|>`.
    pub transcribe: u32,
    /// `<|startoflm|>`.
    pub sot_lm: u32,
    /// `<|startofprev|>`.
    pub sot_prev: u32,
    /// `<|nospeech|>` (`<|nocaptions|>` in older vocabularies).
    pub no_speech: u32,
    /// `<|notimestamps|>`.
    pub no_timestamps: u32,
    /// `<|0.00|>`: the first timestamp token (the one after `<|notimestamps|>` where the
    /// tokenizer does not name it); every id from here on is a timestamp.
    pub timestamp_begin: u32,
    /// Language tokens (`<|en|>` …) with their codes, for multilingual vocabularies.
    pub languages: Vec<(u32, String)>,
}

fn single(tok: &TokenizerBox, text: &str) -> Result<Option<u32>> {
    let ids = tok.encode(text.into(), false, true).into_result()?;
    Ok(match ids.as_slice() {
        [id] => Some(*id),
        _ => None,
    })
}

impl Specials {
    /// Finds the special tokens in `tok` of a model of `vocab_size` ids; a vocabulary without
    /// them is not Whisper's. English-only models (fewer than [`MULTILINGUAL_VOCAB`] ids) keep
    /// the language tokens in their vocabulary but were never trained on them.
    pub fn find(tok: &TokenizerBox, vocab_size: usize) -> Result<Specials> {
        let need = |text: &str| -> Result<u32> {
            single(tok, text)?.ok_or_else(|| {
                UError::invalid(format!(
                    "runner-transcription: the tokenizer has no `{text}` token (not a Whisper \
                     vocabulary)"
                ))
            })
        };
        let no_speech = match single(tok, "<|nospeech|>")? {
            Some(id) => id,
            None => need("<|nocaptions|>")?,
        };
        let sot = need("<|startoftranscript|>")?;
        let translate = need("<|translate|>")?;
        let mut languages = Vec::new();
        let multilingual = vocab_size >= MULTILINGUAL_VOCAB;
        // Language tokens lie between `sot` and `translate` (100 at most in any Whisper).
        for id in (sot + 1..translate).take(128).filter(|_| multilingual) {
            let text = tok.decode([id].as_slice().into(), false).into_result()?;
            if let Some(code) = text.strip_prefix("<|").and_then(|t| t.strip_suffix("|>")) {
                languages.push((id, code.to_string()));
            }
        }
        let no_timestamps = need("<|notimestamps|>")?;
        // Older tokenizer.json files stop at `<|notimestamps|>`; the model's timestamps follow
        // it all the same.
        let timestamp_begin = single(tok, "<|0.00|>")?.unwrap_or(no_timestamps + 1);
        Ok(Specials {
            eot: need("<|endoftext|>")?,
            sot,
            translate,
            transcribe: need("<|transcribe|>")?,
            sot_lm: need("<|startoflm|>")?,
            sot_prev: need("<|startofprev|>")?,
            no_speech,
            no_timestamps,
            timestamp_begin,
            languages,
        })
    }

    /// Whether the vocabulary has language and task tokens (English-only models have none).
    pub fn multilingual(&self) -> bool {
        !self.languages.is_empty()
    }

    /// The language token of `code`.
    pub fn language(&self, code: &str) -> Option<u32> {
        self.languages
            .iter()
            .find(|(_, c)| c == code)
            .map(|(id, _)| *id)
    }
}

/// Symbols Whisper should not write (openai-whisper's `non_speech_tokens`): speaker tags,
/// brackets, music notes. Each counts alone and after a space.
const SYMBOLS: &str = "\"#()*+/:;<=>@[\\]^_`{|}~「」『』";
/// Multi-character marks suppressed the same way.
const MARKS: [&str; 20] = [
    "<<",
    ">>",
    "<<<",
    ">>>",
    "--",
    "---",
    "-(",
    "-[",
    "('",
    "(\"",
    "((",
    "))",
    "(((",
    ")))",
    "[[",
    "]]",
    "{{",
    "}}",
    "♪♪",
    "♪♪♪",
];
/// Music symbols: their first byte-level token is suppressed even when they take several
/// (their UTF-8 forms share the first two bytes with nothing a transcript needs).
const MUSIC: [&str; 7] = ["♩", "♪", "♫", "♬", "♭", "♮", "♯"];

/// The ids openai-whisper suppresses at every step (`suppress_tokens="-1"`): the non-speech
/// symbols and the task and special tokens a transcript never contains.
pub fn suppressed(tok: &TokenizerBox, s: &Specials) -> Result<Vec<u32>> {
    let encode = |t: &str| -> Result<Vec<u32>> {
        Ok(tok.encode(t.into(), false, false).into_result()?.into_vec())
    };
    let mut ids = Vec::new();
    // "-" and "'" are allowed inside words, so only their spaced forms are suppressed.
    for space in [" -", " '"] {
        ids.extend(encode(space)?.first());
    }
    let chars: Vec<String> = SYMBOLS.chars().map(String::from).collect();
    let marks = chars.iter().map(String::as_str).chain(MARKS).chain(MUSIC);
    for symbol in marks {
        let music = MUSIC.contains(&symbol);
        for text in [symbol.to_string(), format!(" {symbol}")] {
            let t = encode(&text)?;
            if t.len() == 1 || (music && !t.is_empty()) {
                ids.push(t[0]);
            }
        }
    }
    ids.extend([
        s.translate,
        s.transcribe,
        s.sot,
        s.sot_prev,
        s.sot_lm,
        s.no_speech,
    ]);
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}
