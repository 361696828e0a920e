//! Byte-pair merges (`gpt2`, `gemma4`, `whitespace`): the pre-tokenizer splits the text into
//! words; each word (GPT-2 byte-encoded, or UTF-8 with `▁` for spaces) starts as its
//! characters and the adjacent pair of lowest merge rank is merged until none is left; each
//! final piece is its token, else its bytes' tokens.

use super::{
    Engine,
    pre::Group,
    split::Splitter,
    spm::chars,
    unicode::{Flags, byte_to_char, to_lower},
};
use crate::vocab::GgufVocab;
use std::collections::{BinaryHeap, HashMap};
use u_sdk::UError;

/// A byte-pair vocabulary's merge ranks and pre-tokenizer.
pub struct Bpe {
    ranks: HashMap<(String, String), usize>,
    splitter: Splitter,
    byte_encode: bool,
    ignore_merges: bool,
    /// Gemma 4: a word of newlines only that is a token is that token.
    newline_words: bool,
    /// The `whitespace` model: words are the runs between whitespace, lowercased as set.
    whitespace: bool,
}

/// A candidate merge, best first: lowest rank, then the leftmost.
#[derive(PartialEq, Eq)]
struct Bigram {
    rank: usize,
    left: usize,
    right: usize,
    text: String,
}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.rank.cmp(&self.rank).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Bpe {
    /// The merges (first rank of a repeated pair wins) and pre-tokenizer of `v`.
    pub fn new(v: &GgufVocab) -> Result<Bpe, UError> {
        let pre = v
            .pre_tokenizer
            .ok_or_else(|| UError::invalid("a byte-pair vocabulary needs a pre-tokenizer"))?;
        let (patterns, byte_encode) = pre.group.patterns();
        let mut ranks = HashMap::with_capacity(v.merges.len());
        for (i, (a, b)) in v.merges.iter().enumerate() {
            ranks.entry((a.clone(), b.clone())).or_insert(i);
        }
        Ok(Bpe {
            ranks,
            splitter: Splitter::new(patterns)?,
            byte_encode,
            ignore_merges: pre.ignore_merges,
            newline_words: pre.group == Group::Gemma4,
            whitespace: v.model == "whitespace",
        })
    }

    /// Appends the tokens of `text` to `out`.
    pub fn tokenize(&self, e: &Engine, text: &str, out: &mut Vec<u32>) {
        if self.whitespace {
            // Whitespace ends a word; the words are lowercased when the vocabulary says so.
            let mut word = String::new();
            for c in text.chars() {
                if Flags::of(c).is_whitespace() {
                    if !word.is_empty() {
                        self.segment(e, &word, out);
                        word.clear();
                    }
                } else {
                    word.push(if e.lowercase { to_lower(c) } else { c });
                }
            }
            if !word.is_empty() {
                self.segment(e, &word, out);
            }
            return;
        }
        self.segment(e, text, out);
    }

    /// Pre-tokenizes `text` and merges each word.
    fn segment(&self, e: &Engine, text: &str, out: &mut Vec<u32>) {
        for word in self.splitter.split(text) {
            let word = if self.byte_encode {
                word.bytes().map(byte_to_char).collect()
            } else {
                word
            };
            self.word(e, &word, out);
        }
    }

    fn word(&self, e: &Engine, word: &str, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if let Some(id) = e.id(word).filter(|_| {
            self.ignore_merges || (self.newline_words && word.bytes().all(|b| b == b'\n'))
        }) {
            out.push(id);
            return;
        }
        let mut symbols = chars(word);
        let piece = |s: &super::spm::Symbol| &word[s.start..s.start + s.len];
        let mut queue = BinaryHeap::new();
        let add = |symbols: &[super::spm::Symbol],
                   queue: &mut BinaryHeap<Bigram>,
                   l: Option<usize>,
                   r: Option<usize>| {
            let (Some(l), Some(r)) = (l, r) else {
                return;
            };
            let (a, b) = (piece(&symbols[l]), piece(&symbols[r]));
            if let Some(&rank) = self.ranks.get(&(a.to_string(), b.to_string())) {
                queue.push(Bigram {
                    rank,
                    left: l,
                    right: r,
                    text: format!("{a}{b}"),
                });
            }
        };
        for i in 1..symbols.len() {
            add(&symbols, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 {
                continue;
            }
            if format!("{}{}", piece(&l), piece(&r)) != b.text {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            let (prev, next) = (symbols[b.left].prev, symbols[b.left].next);
            add(&symbols, &mut queue, prev, Some(b.left));
            add(&symbols, &mut queue, Some(b.left), next);
        }
        for s in symbols.iter().filter(|s| s.len > 0) {
            let p = piece(s);
            match e.id(p) {
                Some(id) => out.push(id),
                None => {
                    // Bytes without a token are dropped, as llama.cpp drops them.
                    for &b in p.as_bytes() {
                        let id = if self.byte_encode {
                            std::str::from_utf8(&[b]).ok().and_then(|s| e.id(s))
                        } else {
                            e.id(&format!("<0x{b:02X}>"))
                        };
                        out.extend(id);
                    }
                }
            }
        }
    }
}
