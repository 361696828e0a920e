//! Turning token bytes into streamed text: whole UTF-8 characters only, and stop strings cut
//! out even when they span several tokens.

/// Buffers token bytes until they form whole UTF-8 characters.
#[derive(Default, Debug)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds `bytes`; returns the text they complete (possibly empty). Bytes that can never be
    /// valid UTF-8 become U+FFFD; an incomplete character at the end waits for more.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: `valid_up_to` bytes are checked UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Whatever is still buffered, lossily (an incomplete character at the very end).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Holds back text that might be the start of a stop string.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// Text that is safe to emit now (no stop string can start in it).
    Emit(String),
    /// A stop string was produced: emit the text that preceded it (first field) and stop; the
    /// second field is the stop string.
    Stop(String, String),
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> StopCheck {
        self.held.push_str(text);
        if self.stops.is_empty() {
            return StopCheck::Emit(std::mem::take(&mut self.held));
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first {
            let before = self.held[..at].to_string();
            let stop = stop.clone();
            self.held.clear();
            return StopCheck::Stop(before, stop);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep_from = self.held.len();
        for (i, _) in self.held.char_indices() {
            let tail = &self.held[i..];
            if self.stops.iter().any(|s| s.starts_with(tail)) {
                keep_from = i;
                break;
            }
        }
        let emit = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        StopCheck::Emit(emit)
    }

    /// The held-back text, once generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let mut s = Utf8Stream::default();
        let euro = "€".as_bytes(); // e2 82 ac
        assert_eq!(s.push(&euro[..1]), "");
        assert_eq!(s.push(&euro[1..2]), "");
        assert_eq!(s.push(&[euro[2], b'!']), "€!");
        assert_eq!(s.push(&[0xff, b'a']), "\u{FFFD}a");
        assert_eq!(s.push(&euro[..2]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }

    #[test]
    fn stop_strings_spanning_tokens_are_cut() {
        let mut m = StopMatcher::new(["</end>".to_string(), "STOP".to_string()]);
        assert_eq!(m.push("hello <"), StopCheck::Emit("hello ".into()));
        assert_eq!(m.push("/e"), StopCheck::Emit("".into()));
        assert_eq!(m.push("x"), StopCheck::Emit("</ex".into()));
        assert_eq!(m.push(" ST"), StopCheck::Emit(" ".into()));
        assert_eq!(
            m.push("OP and more"),
            StopCheck::Stop("".into(), "STOP".into())
        );
        let mut m = StopMatcher::new(["ab".to_string()]);
        assert_eq!(m.push("xa"), StopCheck::Emit("x".into()));
        assert_eq!(m.finish(), "a");
        let mut m = StopMatcher::new([]);
        assert_eq!(m.push("abc"), StopCheck::Emit("abc".into()));
    }
}
