//! SentencePiece BPE (`tokenizer.ggml.model = llama`): start from the characters, repeatedly
//! merge the adjacent pair whose concatenation is the highest-scoring vocabulary token, then
//! emit each final piece — as its token, as the two pieces it was merged from, or as byte
//! tokens (`<0xXX>`).

use super::Engine;
use std::collections::{BinaryHeap, HashMap};
use u_sdk::UError;

/// A symbol of the chain: a byte range of the text and its neighbours.
#[derive(Clone, Copy)]
pub(super) struct Symbol {
    pub start: usize,
    pub len: usize,
    pub prev: Option<usize>,
    pub next: Option<usize>,
}

/// The symbols of `text`, one per UTF-8 character.
pub(super) fn chars(text: &str) -> Vec<Symbol> {
    let n = text.chars().count();
    text.char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
        })
        .collect()
}

/// A candidate merge, best first: higher score, then the leftmost.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// Appends the tokens of `text` (spaces already `▁`) to `out`.
pub(super) fn tokenize(e: &Engine, text: &str, out: &mut Vec<u32>) -> Result<(), UError> {
    if text.is_empty() {
        return Ok(());
    }
    let mut symbols = chars(text);
    let mut queue = BinaryHeap::new();
    let mut merged: HashMap<&str, (usize, usize)> = HashMap::new();
    for i in 1..symbols.len() {
        try_add(
            e,
            text,
            &symbols,
            &mut queue,
            &mut merged,
            Some(i - 1),
            Some(i),
        );
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(n) = r.next {
            symbols[n].prev = Some(b.left);
        }
        let prev = symbols[b.left].prev;
        let next = symbols[b.left].next;
        try_add(
            e,
            text,
            &symbols,
            &mut queue,
            &mut merged,
            prev,
            Some(b.left),
        );
        try_add(
            e,
            text,
            &symbols,
            &mut queue,
            &mut merged,
            Some(b.left),
            next,
        );
    }
    let mut i = Some(0);
    while let Some(k) = i {
        resegment(e, text, &symbols, &merged, symbols[k], out)?;
        i = symbols[k].next;
    }
    Ok(())
}

/// Queues the merge of symbols `left` and `right` when their concatenation is a token.
fn try_add<'t>(
    e: &Engine,
    text: &'t str,
    symbols: &[Symbol],
    queue: &mut BinaryHeap<Bigram>,
    merged: &mut HashMap<&'t str, (usize, usize)>,
    left: Option<usize>,
    right: Option<usize>,
) {
    let (Some(l), Some(r)) = (left, right) else {
        return;
    };
    let (s, n) = (symbols[l].start, symbols[l].len + symbols[r].len);
    let piece = &text[s..s + n];
    if let Some(id) = e.id(piece) {
        queue.push(Bigram {
            score: e.scores[id as usize],
            left: l,
            right: r,
            size: n,
        });
        merged.insert(piece, (l, r));
    }
}

/// Emits one final symbol: its token, else the two symbols it was merged from, else bytes.
fn resegment(
    e: &Engine,
    text: &str,
    symbols: &[Symbol],
    merged: &HashMap<&str, (usize, usize)>,
    s: Symbol,
    out: &mut Vec<u32>,
) -> Result<(), UError> {
    let piece = &text[s.start..s.start + s.len];
    if let Some(id) = e.id(piece) {
        out.push(id);
        return Ok(());
    }
    if let Some(&(l, r)) = merged.get(piece) {
        resegment(e, text, symbols, merged, symbols[l], out)?;
        return resegment(e, text, symbols, merged, symbols[r], out);
    }
    for &b in piece.as_bytes() {
        out.push(byte_token(e, b)?);
    }
    Ok(())
}

/// The token of one byte: `<0xXX>`, else the one-byte text itself.
pub(super) fn byte_token(e: &Engine, b: u8) -> Result<u32, UError> {
    e.id(&format!("<0x{b:02X}>"))
        .or_else(|| std::str::from_utf8(&[b]).ok().and_then(|s| e.id(s)))
        .ok_or_else(|| {
            UError::invalid(format!(
                "the vocabulary has no token for byte 0x{b:02X} (neither <0x{b:02X}> nor the byte)"
            ))
        })
}
