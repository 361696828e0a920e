//! WordPiece (`tokenizer.ggml.model = bert`): BERT's normalization (lowercasing, accent
//! stripping, control characters dropped, punctuation and CJK ideographs as words of their own),
//! then per word the greedy longest match. Word starts are stored as `▁word`, continuations
//! bare; a word with no complete match is the unknown token.

use super::{
    Engine,
    unicode::{Flags, nfd_first, to_lower},
};
use u_sdk::UError;

/// Appends the tokens of `text` to `out`.
pub(super) fn tokenize(e: &Engine, text: &str, out: &mut Vec<u32>) -> Result<(), UError> {
    for word in words(text, e.lowercase, e.strip_accents) {
        let w = format!("\u{2581}{word}");
        let bytes = w.as_bytes();
        let before = out.len();
        let mut i = 0;
        while i < bytes.len() {
            let longest = (i + 1..=bytes.len().min(i + e.max_token_len + 1))
                .rev()
                .find_map(|j| Some((j, e.id(std::str::from_utf8(&bytes[i..j]).ok()?)?)));
            match longest {
                Some((j, id)) => {
                    out.push(id);
                    i = j;
                }
                None => {
                    out.truncate(before);
                    break;
                }
            }
        }
        if out.len() == before {
            out.push(e.unknown(&format!("the word {word:?} has no WordPiece match"))?);
        }
    }
    Ok(())
}

/// BERT's words of `text`.
fn words(text: &str, lowercase: bool, strip_accents: bool) -> Vec<String> {
    let mut words = vec![String::new()];
    for c in text.chars() {
        let c = if strip_accents { nfd_first(c) } else { c };
        let flags = Flags::of(c);
        if flags.is_whitespace() {
            if !words.last().is_some_and(String::is_empty) {
                words.push(String::new());
            }
            continue;
        }
        if c == '\0' || c == '\u{FFFD}' || flags.is_control() {
            continue;
        }
        if strip_accents && flags.is_accent_mark() {
            continue;
        }
        let alone = flags.is_punctuation() || ((c as u32) < 0x7F && flags.is_symbol()) || is_cjk(c);
        let c = if lowercase { to_lower(c) } else { c };
        let last = words.last_mut().expect("never empty");
        if alone {
            if !last.is_empty() {
                words.push(String::new());
            }
            words.last_mut().expect("never empty").push(c);
            words.push(String::new());
        } else {
            last.push(c);
        }
    }
    if words.last().is_some_and(String::is_empty) {
        words.pop();
    }
    words.retain(|w| !w.is_empty());
    words
}

/// The CJK ideograph blocks BERT isolates (with the same extension ranges as HF's WordPiece).
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2B73F
            | 0x2B740..=0x2B81F
            | 0x2B920..=0x2CEAF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F)
}
