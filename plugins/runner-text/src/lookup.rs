//! Prompt-lookup speculative decoding (Saxena 2023, *Prompt Lookup Decoding*; llama.cpp's
//! `lookup`, vLLM's n-gram speculator): no draft model. The last few tokens of a sequence are
//! looked up earlier in it (prompt and output), and the tokens that followed there are the
//! draft. The sequence's next pass runs its last token and the draft together (one forward
//! over `1 + k` rows, which on a CPU costs about what one row does: decode reads every weight
//! once either way) and keeps the longest prefix of the draft the sampler agrees with, plus
//! the sampler's own token after it (see [`crate::Sampler::verify`]). Code edits, quotes and
//! structured text repeat their input and accept most drafts; prose accepts few, so a
//! sequence whose draft is rejected outright waits a growing number of steps before drafting
//! again.

/// The longest n-gram matched, and the shortest.
const NGRAM: std::ops::RangeInclusive<usize> = 2..=4;

/// Steps a sequence waits, at most, after rejected drafts.
const MAX_COOLDOWN: u32 = 16;

/// The draft for `tokens`: up to `max` tokens that followed the most recent earlier
/// occurrence of the longest suffix of 2 to 4 tokens found earlier; empty when none is.
pub(crate) fn propose(tokens: &[u32], max: usize) -> Vec<u32> {
    let len = tokens.len();
    if max == 0 {
        return Vec::new();
    }
    for n in NGRAM.rev().filter(|&n| n < len) {
        let suffix = &tokens[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            // A draft is tokens: it stops where an image's positions begin.
            return tokens[from..(from + max).min(len)]
                .iter()
                .take_while(|&&t| !crate::images::is_image_id(t))
                .copied()
                .collect();
        }
    }
    Vec::new()
}

/// One sequence's drafting: how long a draft may be, and its back-off.
#[derive(Clone, Debug, Default)]
pub(crate) struct Lookup {
    /// Steps left before the next draft.
    skip: u32,
    /// The wait after the next rejected draft.
    cooldown: u32,
    /// Tokens drafted and accepted so far.
    pub drafted: usize,
    /// Of those, the ones the sampler kept.
    pub accepted: usize,
}

impl Lookup {
    /// Whether this step may draft (counting down a back-off).
    pub(crate) fn ready(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// Records a verified draft of `drafted` tokens of which `accepted` were kept.
    pub(crate) fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted;
        self.accepted += accepted;
        if accepted == 0 {
            self.cooldown = (self.cooldown * 2).clamp(1, MAX_COOLDOWN);
            self.skip = self.cooldown;
        } else {
            self.cooldown = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_recent_match_drafts_what_followed_it() {
        // "a b c d | x a b c" → after "a b c" came "d | x"
        let t = [1, 2, 3, 4, 9, 5, 1, 2, 3];
        assert_eq!(propose(&t, 3), [4, 9, 5]);
        assert_eq!(propose(&t, 1), [4]);
        // The most recent occurrence wins.
        let t = [1, 2, 7, 1, 2, 8, 1, 2];
        assert_eq!(propose(&t, 2), [8, 1]);
        // Nothing repeats: no draft; a single repeated token is too weak a match.
        assert!(propose(&[1, 2, 3, 4], 4).is_empty());
        assert!(propose(&[5, 1, 6, 1], 4).is_empty());
        assert!(propose(&[1, 2, 1, 2], 0).is_empty());
    }

    #[test]
    fn rejected_drafts_back_off_and_an_accepted_one_resets() {
        let mut l = Lookup::default();
        assert!(l.ready());
        l.record(4, 0);
        assert!(!l.ready());
        assert!(l.ready());
        l.record(4, 0);
        assert_eq!((0..3).filter(|_| !l.ready()).count(), 2);
        l.record(4, 3);
        assert!(l.ready());
        assert_eq!((l.drafted, l.accepted), (12, 3));
    }
}
