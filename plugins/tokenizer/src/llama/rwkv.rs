//! RWKV's "world" tokenizer (`tokenizer.ggml.model = rwkv`): token texts are escaped byte
//! strings (`\t`, `\n`, `\r`, `\xHH`, `\` before any other character); text is tokenized by
//! the greedy longest match over its bytes.

use super::Engine;
use std::collections::HashMap;
use u_sdk::UError;

/// A byte trie node: its children and the token ending here.
#[derive(Default)]
struct Node {
    children: HashMap<u8, Node>,
    id: Option<u32>,
}

/// The trie of the unescaped token bytes.
pub struct Rwkv {
    root: Node,
}

/// The bytes an escaped RWKV token text stands for.
pub fn unescape(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut escaping = false;
    let mut hex: Option<(u8, u8)> = None;
    for &c in text.as_bytes() {
        if let Some((left, acc)) = hex {
            let value = if c >= b'a' {
                c.wrapping_sub(b'a').wrapping_add(10)
            } else {
                c.wrapping_sub(b'0')
            };
            let acc = acc.wrapping_shl(4).wrapping_add(value);
            hex = if left == 1 {
                out.push(acc);
                None
            } else {
                Some((left - 1, acc))
            };
            continue;
        }
        if escaping {
            match c {
                b't' => out.push(b'\t'),
                b'n' => out.push(b'\n'),
                b'r' => out.push(b'\r'),
                b'x' => hex = Some((2, 0)),
                other => out.push(other),
            }
            escaping = false;
            continue;
        }
        if c == b'\\' {
            escaping = true;
            continue;
        }
        out.push(c);
    }
    out
}

impl Rwkv {
    /// Builds the trie over every token (a later token with the same bytes wins).
    pub fn new(tokens: &[String]) -> Rwkv {
        let mut root = Node::default();
        for (id, t) in tokens.iter().enumerate() {
            let mut node = &mut root;
            for c in unescape(t) {
                node = node.children.entry(c).or_default();
            }
            node.id = Some(id as u32);
        }
        Rwkv { root }
    }

    /// Appends the tokens of `text` to `out`.
    pub fn tokenize(&self, e: &Engine, text: &str, out: &mut Vec<u32>) -> Result<(), UError> {
        let bytes = text.as_bytes();
        let mut pos = 0;
        while pos < bytes.len() {
            let mut node = &self.root;
            let mut best = None;
            let mut at = pos;
            while let Some(next) = bytes.get(at).and_then(|b| node.children.get(b)) {
                node = next;
                at += 1;
                if let Some(id) = node.id {
                    best = Some((id, at));
                }
            }
            match best {
                Some((id, end)) => {
                    out.push(id);
                    pos = end;
                }
                None => {
                    out.push(e.unknown(&format!("byte 0x{:02X} has no RWKV token", bytes[pos]))?);
                    pos += 1;
                }
            }
        }
        Ok(())
    }
}
