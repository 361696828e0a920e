//! The SentencePiece unigram model (`tokenizer.ggml.model = t5`): the text is normalized by
//! the model's precompiled character map (longest-prefix replacements stored as a
//! XOR-compressed double array), spaces become `▁` (optionally prefixed, optionally runs merged),
//! and the Viterbi path over token scores gives the tokens; a code point no token covers is the
//! unknown token at the lowest score minus 10.

use super::Engine;
use crate::vocab::{GgufVocab, TokenType};
use std::collections::HashMap;
use u_sdk::UError;

/// A byte trie node: its children and the token ending here.
#[derive(Default)]
struct Node {
    children: HashMap<u8, Node>,
    id: Option<u32>,
}

impl Node {
    fn insert(&mut self, bytes: &[u8], id: u32) {
        let mut node = self;
        for &b in bytes {
            node = node.children.entry(b).or_default();
        }
        node.id = Some(id);
    }
}

/// The unigram model: its tries, normalizer and scores.
pub struct Ugm {
    tokens: Node,
    user_defined: Node,
    /// The double array of the character map (empty: no map).
    xcda: Vec<u32>,
    /// NUL-terminated replacement strings.
    replacements: Vec<u8>,
    unknown_score: f64,
    user_defined_ids: Vec<bool>,
    remove_extra_whitespaces: bool,
}

/// One entry of the double array: base, check byte, leaf flag, value.
struct Xcda<'a>(&'a [u32]);

impl Xcda<'_> {
    fn node(&self, i: usize) -> Result<u32, UError> {
        self.0.get(i).copied().ok_or_else(|| {
            UError::invalid("tokenizer.ggml.precompiled_charsmap: an index points past its array")
        })
    }
    fn base(&self, i: usize) -> Result<usize, UError> {
        let p = self.node(i)?;
        Ok(((p >> 10) << ((p & (1 << 9)) >> 6)) as usize)
    }
    fn check(&self, i: usize) -> Result<u32, UError> {
        Ok(self.node(i)? & ((1 << 31) | 0xFF))
    }
    fn leaf(&self, i: usize) -> Result<bool, UError> {
        Ok((self.node(i)? >> 8) & 1 == 1)
    }
    fn value(&self, i: usize) -> Result<usize, UError> {
        Ok((self.node(i)? & ((1 << 31) - 1)) as usize)
    }
}

impl Ugm {
    /// Reads the character map and builds the tries of `v`.
    pub fn new(v: &GgufVocab) -> Result<Ugm, UError> {
        let (xcda, replacements) = if v.charsmap.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let bad =
                |why: &str| UError::invalid(format!("tokenizer.ggml.precompiled_charsmap: {why}"));
            let size = v
                .charsmap
                .get(..4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
                .ok_or_else(|| bad("shorter than its 4-byte header"))?;
            if size % 4 != 0
                || size
                    .checked_add(4)
                    .is_none_or(|end| end >= v.charsmap.len())
            {
                return Err(bad(&format!(
                    "its array of {size} bytes does not fit the {} bytes",
                    v.charsmap.len()
                )));
            }
            let xcda = v.charsmap[4..4 + size]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            (xcda, v.charsmap[4 + size..].to_vec())
        };
        let mut tokens = Node::default();
        let mut user_defined = Node::default();
        let mut min_score = f32::MAX;
        for (i, (t, ty)) in v.tokens.iter().zip(&v.types).enumerate() {
            if *ty == TokenType::Normal {
                min_score = min_score.min(v.scores[i]);
            }
            if matches!(
                ty,
                TokenType::Normal | TokenType::UserDefined | TokenType::Unused
            ) {
                tokens.insert(t.as_bytes(), i as u32);
            }
            if *ty == TokenType::UserDefined {
                user_defined.insert(t.as_bytes(), i as u32);
            }
        }
        Ok(Ugm {
            tokens,
            user_defined,
            xcda,
            replacements,
            unknown_score: f64::from(min_score - 10.0),
            user_defined_ids: v
                .types
                .iter()
                .map(|t| *t == TokenType::UserDefined)
                .collect(),
            remove_extra_whitespaces: v.remove_extra_whitespaces,
        })
    }

    /// The normalized form of the longest prefix at `at`: the bytes to append and how many
    /// input bytes they replace.
    fn prefix<'a>(&'a self, input: &'a [u8], at: usize) -> Result<(&'a [u8], usize), UError> {
        let longest = |root: &Node| {
            let mut node = root;
            let mut best = 0;
            for (k, b) in input[at..].iter().enumerate() {
                match node.children.get(b) {
                    Some(n) => node = n,
                    None => break,
                }
                if node.id.is_some() {
                    best = k + 1;
                }
            }
            best
        };
        let user = longest(&self.user_defined);
        if user > 0 {
            return Ok((&input[at..at + user], user));
        }
        if !self.xcda.is_empty() {
            let x = Xcda(&self.xcda);
            let mut node = x.base(0)?;
            let (mut len, mut value) = (0, 0);
            for (k, &c) in input[at..].iter().enumerate() {
                if c == 0 {
                    break;
                }
                node ^= c as usize;
                if x.check(node)? != u32::from(c) {
                    break;
                }
                let leaf = x.leaf(node)?;
                node ^= x.base(node)?;
                if leaf {
                    len = k + 1;
                    value = x.value(node)?;
                }
            }
            if len > 0 {
                let repl = self.replacements.get(value..).ok_or_else(|| {
                    UError::invalid(
                        "tokenizer.ggml.precompiled_charsmap: a replacement points past the map",
                    )
                })?;
                let end = repl.iter().position(|&b| b == 0).ok_or_else(|| {
                    UError::invalid(
                        "tokenizer.ggml.precompiled_charsmap: a replacement is not terminated",
                    )
                })?;
                return Ok((&repl[..end], len));
            }
        }
        let n = match input[at] {
            b if b < 0x80 => 1,
            b if b >> 5 == 0b110 => 2,
            b if b >> 4 == 0b1110 => 3,
            _ => 4,
        };
        let n = n.min(input.len() - at);
        Ok((&input[at..at + n], n))
    }

    /// The normalized text: the character map applied, spaces as `▁` (a `▁` before the first
    /// word with the space prefix; runs of spaces merged into one `▁` before the next word when
    /// extra whitespace is removed).
    fn normalize(&self, e: &Engine, text: &str) -> Result<Vec<u8>, UError> {
        let input = text.as_bytes();
        let space = "\u{2581}".as_bytes();
        let merge = self.remove_extra_whitespaces;
        let mut out = Vec::with_capacity(input.len() * 3);
        let (mut prepended, mut in_word) = (false, false);
        let mut at = 0;
        while at < input.len() {
            let (bytes, used) = self.prefix(input, at)?;
            for &c in bytes {
                if c != b' ' {
                    if !in_word {
                        in_word = true;
                        if (e.add_space_prefix && !prepended) || merge {
                            out.extend_from_slice(space);
                            prepended = true;
                        }
                    }
                    out.push(c);
                } else {
                    in_word = false;
                    if !merge {
                        out.extend_from_slice(space);
                    }
                }
            }
            at += used;
        }
        Ok(out)
    }

    /// Appends the tokens of `text` to `out`.
    pub fn tokenize(&self, e: &Engine, text: &str, out: &mut Vec<u32>) -> Result<(), UError> {
        let s = self.normalize(e, text)?;
        if s.is_empty() {
            return Ok(());
        }
        let unk = e.unknown("the unigram model needs an unknown token")?;
        // best[i]: the best (token, start, score) of a path ending at byte i.
        let mut best = vec![(unk, 0usize, f64::MIN); s.len() + 1];
        best[0] = (unk, 0, 0.0);
        let mut at = 0;
        while at < s.len() {
            let width = match s[at] {
                b if b < 0x80 => 1,
                b if b >> 5 == 0b110 => 2,
                b if b >> 4 == 0b1110 => 3,
                _ => 4,
            }
            .min(s.len() - at);
            let here = best[at].2;
            let mut single = false;
            let mut node = &self.tokens;
            for (k, b) in s[at..].iter().enumerate() {
                match node.children.get(b) {
                    Some(n) => node = n,
                    None => break,
                }
                if let Some(id) = node.id {
                    let end = at + k + 1;
                    if end - at == width {
                        single = true;
                    }
                    let score = if self.user_defined_ids[id as usize] {
                        0.0
                    } else {
                        f64::from(e.scores[id as usize])
                    };
                    if here + score > best[end].2 {
                        best[end] = (id, at, here + score);
                    }
                }
            }
            if !single {
                let end = at + width;
                if here + self.unknown_score > best[end].2 {
                    best[end] = (unk, at, here + self.unknown_score);
                }
            }
            at += width;
        }
        let mut path = Vec::new();
        let mut pos = s.len();
        let mut prev_unknown = false;
        loop {
            let (id, start, _) = best[pos];
            let unknown = id == unk;
            if !(prev_unknown && unknown) {
                path.push(id);
            }
            if start == 0 {
                break;
            }
            prev_unknown = unknown;
            pos = start;
        }
        out.extend(path.into_iter().rev());
        Ok(())
    }
}
