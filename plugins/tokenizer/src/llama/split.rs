//! Splitting text into words before BPE, as llama.cpp does it.
//!
//! A pre-tokenizer is a list of patterns applied in turn: each splits every current piece into
//! the matches and the text between them (nothing matches across a piece boundary). Some
//! patterns have a hand-written splitter ([`Custom`]); the others are regular expressions, run
//! one of two ways:
//! - a pattern that names Unicode categories (`\p{L}`) runs over a *collapsed* text, one
//!   character per code point: ASCII stays, non-ASCII whitespace becomes U+000B and every other
//!   code point becomes a stand-in for its category (letters, numbers, punctuation, marks,
//!   symbols, the rest), and each `\p{…}` in the pattern becomes a class of that stand-in plus
//!   the category's ASCII members. Letter subcategories (`\p{Lu}`) are all "letter" this way.
//! - any other pattern runs over the text itself, non-ASCII whitespace turned into U+000B.
//!
//! In both, `\s`, `\d`, `\w` and `\b` are the ASCII ones of ECMAScript regular expressions.

use super::unicode::{Flags, is_han, to_lower};
use fancy_regex::Regex;
use u_sdk::UError;

/// The hand-written splitters, each standing for the regular expression it is selected by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Custom {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)` (GPT-2).
    Gpt2,
    /// Llama 3's pattern: case-insensitive contractions, letter runs with one leading
    /// non-letter, numbers in threes, punctuation runs with trailing newlines, whitespace.
    Llama3,
    /// Llama 3's pattern with numbers one digit at a time (Qwen2).
    Qwen2,
    /// [`Custom::Qwen2`] with combining marks counted as letters (Qwen3.5).
    Qwen35,
    /// Kimi K2: runs of Han ideographs, letter runs (other than Han) with a trailing
    /// contraction, then as [`Custom::Llama3`].
    KimiK2,
    /// Number runs cut into threes from the right (the text before a run stays with its first
    /// group).
    DigitGroups,
    /// Runs of newlines and runs of everything else.
    Newlines,
}

impl Custom {
    /// The splitter a pattern selects, if it has one (by exact text, as llama.cpp dispatches).
    fn for_pattern(p: &str) -> Option<Custom> {
        const CONTRACTIONS: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
        let llama3_tail = r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        Some(match p {
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)" => {
                Custom::Gpt2
            }
            _ if p == format!("(?i:'s|'t|'re|'ve|'m|'ll|'d){llama3_tail}")
                || p == format!("{CONTRACTIONS}{llama3_tail}") =>
            {
                Custom::Llama3
            }
            _ if p
                == format!(
                    r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                ) =>
            {
                Custom::Qwen2
            }
            _ if p
                == format!(
                    r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+|\p{{N}}| ?[^\s\p{{L}}\p{{M}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
                ) =>
            {
                Custom::Qwen35
            }
            r"\p{Han}+" => Custom::KimiK2,
            r"\p{AFMoE_digits}" | r"\d{1,3}(?=(?:\d{3})*\b)" => Custom::DigitGroups,
            r"[^\n]+|[\n]+" => Custom::Newlines,
            _ => return None,
        })
    }
}

/// One step of a pre-tokenizer.
#[derive(Debug)]
enum Step {
    Custom(Custom),
    /// A regular expression over the collapsed text (it names categories) or the text itself.
    Regex {
        re: Regex,
        collapsed: bool,
    },
}

/// A compiled pre-tokenizer: its patterns in order.
#[derive(Debug)]
pub struct Splitter {
    steps: Vec<Step>,
}

/// The category stand-ins of the collapsed text (private-use characters).
const STAND_IN_OTHER: char = '\u{E0D0}';

/// Categories a pattern may name, with their stand-in and ASCII members (as a class body).
const CATEGORIES: [(&str, char, &str); 10] = [
    (r"\p{N}", '\u{E0D1}', "0-9"),
    (r"\p{L}", '\u{E0D2}', "A-Za-z"),
    (r"\p{P}", '\u{E0D3}', r"!-#%-*,-/:-;?-@\[-\]_\{\}"),
    (r"\p{M}", '\u{E0D4}', ""),
    (r"\p{S}", '\u{E0D5}', r"\$\+<->\^`\|\~"),
    (r"\p{Lu}", '\u{E0D2}', "A-Za-z"),
    (r"\p{Ll}", '\u{E0D2}', "A-Za-z"),
    (r"\p{Lt}", '\u{E0D2}', "A-Za-z"),
    (r"\p{Lm}", '\u{E0D2}', "A-Za-z"),
    (r"\p{Lo}", '\u{E0D2}', "A-Za-z"),
];

/// The stand-in of a non-ASCII code point in the collapsed text.
fn stand_in(c: char) -> char {
    let f = Flags::of(c);
    if f.is_whitespace() {
        return '\u{B}';
    }
    match f.category() {
        Flags::NUMBER => '\u{E0D1}',
        Flags::LETTER => '\u{E0D2}',
        Flags::PUNCTUATION => '\u{E0D3}',
        Flags::ACCENT_MARK => '\u{E0D4}',
        Flags::SYMBOL => '\u{E0D5}',
        _ => STAND_IN_OTHER,
    }
}

/// Rewrites ECMAScript's ASCII classes for this engine (whose `\s`, `\d`, `\w`, `\b` are
/// Unicode-aware). Inside a bracket class the class body is inserted without brackets.
fn ascii_classes(p: &str) -> String {
    let chars: Vec<char> = p.chars().collect();
    let mut out = String::with_capacity(p.len() + 16);
    let mut inside = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' && i + 1 < chars.len() {
            let body = match chars[i + 1] {
                's' => Some((r"\t\n\x0B\x0C\r ", false)),
                'S' => Some((r"\t\n\x0B\x0C\r ", true)),
                'd' => Some(("0-9", false)),
                'D' => Some(("0-9", true)),
                'w' => Some(("0-9A-Za-z_", false)),
                'W' => Some(("0-9A-Za-z_", true)),
                _ => None,
            };
            match body {
                // A negated class inside a class has no bracket-free form; the patterns have none.
                Some((b, neg)) if !(inside && neg) => {
                    if inside {
                        out.push_str(b);
                    } else {
                        out.push('[');
                        if neg {
                            out.push('^');
                        }
                        out.push_str(b);
                        out.push(']');
                    }
                }
                _ if chars[i + 1] == 'b' && !inside => out.push_str(r"(?-u:\b)"),
                _ if chars[i + 1] == 'B' && !inside => out.push_str(r"(?-u:\B)"),
                _ => {
                    out.push(c);
                    out.push(chars[i + 1]);
                }
            }
            i += 2;
            continue;
        }
        if c == '[' && !inside {
            inside = true;
        } else if c == ']' && inside {
            inside = false;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// `p` with each category replaced by its collapsed class.
fn collapse_pattern(p: &str) -> Result<String, UError> {
    if !p.is_ascii() {
        return Err(UError::invalid(format!(
            "pre-tokenizer pattern {p:?} names Unicode categories and has non-ASCII characters"
        )));
    }
    let mut out = String::with_capacity(p.len() * 2);
    let bytes = p.as_bytes();
    let mut inside = false;
    let mut i = 0;
    while i < p.len() {
        let c = bytes[i];
        if c == b'[' && (i == 0 || bytes[i - 1] != b'\\') {
            out.push('[');
            inside = true;
            i += 1;
            continue;
        }
        if inside && c == b']' && bytes[i - 1] != b'\\' {
            out.push(']');
            inside = false;
            i += 1;
            continue;
        }
        if let Some((name, stand, ascii)) = CATEGORIES.iter().find(|(n, ..)| p[i..].starts_with(n))
        {
            if !inside {
                out.push('[');
            }
            out.push(*stand);
            out.push_str(ascii);
            if !inside {
                out.push(']');
            }
            i += name.len();
            continue;
        }
        out.push(c as char);
        i += 1;
    }
    Ok(out)
}

impl Splitter {
    /// Compiles `patterns` (llama.cpp's pattern texts).
    pub fn new(patterns: &[&str]) -> Result<Splitter, UError> {
        let steps = patterns
            .iter()
            .map(|p| {
                if let Some(c) = Custom::for_pattern(p) {
                    return Ok(Step::Custom(c));
                }
                let collapsed = CATEGORIES.iter().any(|(n, ..)| p.contains(n));
                let src = if collapsed {
                    collapse_pattern(p)?
                } else {
                    p.to_string()
                };
                let re = Regex::new(&ascii_classes(&src))
                    .map_err(|e| UError::invalid(format!("pre-tokenizer pattern {p:?}: {e}")))?;
                Ok(Step::Regex { re, collapsed })
            })
            .collect::<Result<_, UError>>()?;
        Ok(Splitter { steps })
    }

    /// The words of `text`, in order (some may be empty; their concatenation is `text`).
    pub fn split(&self, text: &str) -> Vec<String> {
        let cpts: Vec<char> = text.chars().collect();
        let mut pieces = vec![cpts.len()];
        let needs_collapse = self.steps.iter().any(|s| {
            matches!(
                s,
                Step::Regex {
                    collapsed: true,
                    ..
                }
            )
        });
        let collapsed: Vec<char> = if needs_collapse {
            cpts.iter()
                .map(|&c| if c.is_ascii() { c } else { stand_in(c) })
                .collect()
        } else {
            Vec::new()
        };
        let plain: Vec<char> = cpts
            .iter()
            .map(|&c| {
                if !c.is_ascii() && Flags::of(c).is_whitespace() {
                    '\u{B}'
                } else {
                    c
                }
            })
            .collect();
        for step in &self.steps {
            let next = match step {
                Step::Custom(c) => custom(*c, &cpts, &pieces),
                Step::Regex {
                    re,
                    collapsed: true,
                } => regex_split(re, &collapsed, &pieces),
                Step::Regex { re, .. } => regex_split(re, &plain, &pieces),
            };
            // A splitter that yields nothing (empty pieces only) leaves the pieces as they are.
            if !next.is_empty() {
                pieces = next;
            }
        }
        let mut words = Vec::with_capacity(pieces.len());
        let mut start = 0;
        for n in pieces {
            words.push(cpts[start..start + n].iter().collect());
            start += n;
        }
        words
    }
}

/// Splits each piece of `chars` (lengths in `pieces`) at the matches of `re`: the text before a
/// match, the match (possibly empty), and the rest after the last match.
fn regex_split(re: &Regex, chars: &[char], pieces: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut start = 0;
    for &n in pieces {
        let seg: String = chars[start..start + n].iter().collect();
        // Byte offset → code-point index in this segment.
        let mut index = vec![0usize; seg.len() + 1];
        let mut k = 0;
        for (b, c) in seg.char_indices() {
            index[b] = k;
            k += 1;
            let _ = c;
        }
        index[seg.len()] = k;
        let mut done = 0;
        let mut at = 0;
        while at <= seg.len() {
            let Ok(Some(m)) = re.find_from_pos(&seg, at) else {
                break;
            };
            let (s, e) = (index[m.start()], index[m.end()]);
            if s > done {
                out.push(s - done);
            }
            out.push(e - s);
            done = e;
            at = if m.end() > m.start() {
                m.end()
            } else {
                // An empty match: the next search starts one code point on.
                match seg[m.end()..].chars().next() {
                    Some(c) => m.end() + c.len_utf8(),
                    None => seg.len() + 1,
                }
            };
        }
        if done < n {
            out.push(n - done);
        }
        start += n;
    }
    out
}

/// The pieces a hand-written splitter makes of each piece of `cpts`.
fn custom(kind: Custom, cpts: &[char], pieces: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(pieces.len());
    let mut start = 0;
    for &n in pieces {
        let seg = Seg {
            cpts,
            ini: start,
            end: start + n,
        };
        let mut emit = Emitter {
            out: &mut out,
            prev: start,
        };
        match kind {
            Custom::Gpt2 => gpt2(&seg, &mut emit),
            Custom::Llama3 | Custom::Qwen2 | Custom::Qwen35 => llama3(&seg, &mut emit, kind),
            Custom::KimiK2 => kimi_k2(&seg, &mut emit),
            Custom::DigitGroups => digit_groups(&seg, &mut emit),
            Custom::Newlines => newlines(&seg, &mut emit),
        }
        start += n;
    }
    out
}

/// One piece being split: positions are indices into the whole text.
struct Seg<'a> {
    cpts: &'a [char],
    ini: usize,
    end: usize,
}

impl Seg<'_> {
    /// The code point at `pos`, `None` outside the piece.
    fn cpt(&self, pos: usize) -> Option<char> {
        (self.ini..self.end).contains(&pos).then(|| self.cpts[pos])
    }

    /// The flags at `pos`, all clear outside the piece.
    fn flags(&self, pos: usize) -> Flags {
        self.cpt(pos).map(Flags::of).unwrap_or_default()
    }

    /// Whether `pos` is the start of a contraction (`'s`, `'t`, `'m`, `'d`, `'re`, `'ve`,
    /// `'ll`); returns its length. `fold` compares case-insensitively.
    fn contraction(&self, pos: usize, fold: bool) -> Option<usize> {
        if self.cpt(pos) != Some('\'') || pos + 1 >= self.end {
            return None;
        }
        let at = |p: usize| self.cpt(p).map(|c| if fold { to_lower(c) } else { c });
        if matches!(at(pos + 1), Some('s' | 't' | 'm' | 'd')) {
            return Some(2);
        }
        if pos + 2 < self.end {
            let pair = (at(pos + 1), at(pos + 2));
            if matches!(
                pair,
                (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
            ) {
                return Some(3);
            }
        }
        None
    }
}

/// Records the pieces as their end positions arrive.
struct Emitter<'a> {
    out: &'a mut Vec<usize>,
    prev: usize,
}

impl Emitter<'_> {
    /// Ends a piece at `end`; returns its length (nothing is recorded for length 0).
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev;
        if len > 0 {
            self.out.push(len);
        }
        self.prev = end;
        len
    }
}

/// Whitespace runs: up to the last newline in the run; else all but the last whitespace when
/// more text follows (`\s+(?!\S)`); else the whole run. Returns the new position, or `None`
/// when there is no whitespace at `pos`.
fn whitespace(seg: &Seg<'_>, emit: &mut Emitter<'_>, pos: usize, newlines: bool) -> Option<usize> {
    let mut n = 0;
    let mut last_newline_end = 0;
    while seg.flags(pos + n).is_whitespace() {
        if newlines && matches!(seg.cpt(pos + n), Some('\r' | '\n')) {
            last_newline_end = pos + n + 1;
        }
        n += 1;
    }
    if last_newline_end > 0 {
        emit.add(last_newline_end);
        return Some(last_newline_end);
    }
    if n > 1 && seg.cpt(pos + n).is_some() {
        emit.add(pos + n - 1);
        return Some(pos + n - 1);
    }
    if n > 0 {
        emit.add(pos + n);
        return Some(pos + n);
    }
    None
}

fn not_space_letter_number(f: Flags) -> bool {
    !(f.is_whitespace() || f.is_letter() || f.is_number())
}

fn gpt2(seg: &Seg<'_>, emit: &mut Emitter<'_>) {
    let mut pos = seg.ini;
    while pos < seg.end {
        let cpt = seg.cpt(pos);
        if let Some(len) = seg.contraction(pos, false) {
            pos += emit.add(pos + len);
            continue;
        }
        let space = cpt == Some(' ');
        let mut f2 = if space {
            seg.flags(pos + 1)
        } else {
            seg.flags(pos)
        };
        let run = |f: Flags| -> Option<fn(Flags) -> bool> {
            if f.is_letter() {
                Some(Flags::is_letter)
            } else if f.is_number() {
                Some(Flags::is_number)
            } else if not_space_letter_number(f) && f.any() {
                Some(|f: Flags| not_space_letter_number(f) && f.any())
            } else {
                None
            }
        };
        if let Some(class) = run(f2) {
            pos += usize::from(space);
            while class(f2) {
                pos += 1;
                f2 = seg.flags(pos);
            }
            emit.add(pos);
            continue;
        }
        if let Some(next) = whitespace(seg, emit, pos, false) {
            pos = next;
            continue;
        }
        pos += 1;
        emit.add(pos);
    }
}

/// Llama 3, Qwen2 and Qwen3.5 (which differ in number grouping and in counting marks).
fn llama3(seg: &Seg<'_>, emit: &mut Emitter<'_>, kind: Custom) {
    let marks = kind == Custom::Qwen35;
    let wordish = |f: Flags| f.is_letter() || (marks && f.is_accent_mark());
    let mut pos = seg.ini;
    while pos < seg.end {
        let cpt = seg.cpt(pos);
        let flags = seg.flags(pos);
        if let Some(len) = seg.contraction(pos, true) {
            pos += emit.add(pos + len);
            continue;
        }
        if !(matches!(cpt, Some('\r' | '\n')) || flags.is_number())
            && (wordish(flags) || wordish(seg.flags(pos + 1)))
        {
            pos += 1;
            while wordish(seg.flags(pos)) {
                pos += 1;
            }
            emit.add(pos);
            continue;
        }
        if flags.is_number() {
            if kind == Custom::Llama3 {
                let mut ini = pos;
                while seg.flags(pos).is_number() {
                    pos += 1;
                    if pos - ini >= 3 {
                        emit.add(pos);
                        ini = pos;
                    }
                }
            } else {
                pos += 1;
            }
            emit.add(pos);
            continue;
        }
        let other = |f: Flags| not_space_letter_number(f) && !(marks && f.is_accent_mark());
        let mut f2 = if cpt == Some(' ') {
            seg.flags(pos + 1)
        } else {
            flags
        };
        if other(f2) && flags.any() {
            pos += usize::from(cpt == Some(' '));
            while other(f2) && f2.any() {
                pos += 1;
                f2 = seg.flags(pos);
            }
            while matches!(seg.cpt(pos), Some('\r' | '\n')) {
                pos += 1;
            }
            emit.add(pos);
            continue;
        }
        if let Some(next) = whitespace(seg, emit, pos, true) {
            pos = next;
            continue;
        }
        pos += 1;
        emit.add(pos);
    }
}

fn kimi_k2(seg: &Seg<'_>, emit: &mut Emitter<'_>) {
    let han = |p: usize| seg.cpt(p).is_some_and(is_han);
    let letter = |p: usize| seg.flags(p).is_letter() && !han(p);
    let mut pos = seg.ini;
    while pos < seg.end {
        let cpt = seg.cpt(pos);
        let flags = seg.flags(pos);
        if han(pos) {
            while han(pos) {
                pos += 1;
            }
            emit.add(pos);
            continue;
        }
        let plain_lead =
            !(matches!(cpt, Some('\r' | '\n')) || flags.is_letter() || flags.is_number());
        if letter(pos) || (plain_lead && letter(pos + 1)) {
            let lead = plain_lead;
            if lead {
                pos += 1;
            }
            let mut letters = false;
            while letter(pos) {
                letters = true;
                pos += 1;
            }
            if letters || (!lead && letter(pos)) {
                if !letters {
                    pos += 1;
                }
                while letter(pos) {
                    pos += 1;
                }
                if let Some(len) = seg.contraction(pos, true) {
                    pos += len;
                }
                emit.add(pos);
                continue;
            } else if lead {
                pos -= 1;
            }
        }
        if flags.is_number() {
            let mut ini = pos;
            while seg.flags(pos).is_number() {
                pos += 1;
                if pos - ini >= 3 {
                    emit.add(pos);
                    ini = pos;
                }
            }
            emit.add(pos);
            continue;
        }
        let mut f2 = if cpt == Some(' ') {
            seg.flags(pos + 1)
        } else {
            flags
        };
        if not_space_letter_number(f2) && f2.any() {
            pos += usize::from(cpt == Some(' '));
            while not_space_letter_number(f2) && f2.any() {
                pos += 1;
                f2 = seg.flags(pos);
            }
            while matches!(seg.cpt(pos), Some('\r' | '\n')) {
                pos += 1;
            }
            emit.add(pos);
            continue;
        }
        if let Some(next) = whitespace(seg, emit, pos, true) {
            pos = next;
            continue;
        }
        pos += 1;
        emit.add(pos);
    }
}

fn digit_groups(seg: &Seg<'_>, emit: &mut Emitter<'_>) {
    let mut pos = seg.ini;
    while pos < seg.end {
        if seg.flags(pos).is_number() {
            let start = pos;
            while pos < seg.end && seg.flags(pos).is_number() {
                pos += 1;
            }
            let count = pos - start;
            let mut current = start;
            if !count.is_multiple_of(3) {
                current += count % 3;
                emit.add(current);
            }
            while current < start + count {
                current += 3;
                emit.add(current);
            }
            continue;
        }
        pos += 1;
    }
    if emit.prev < seg.end {
        emit.add(seg.end);
    }
}

fn newlines(seg: &Seg<'_>, emit: &mut Emitter<'_>) {
    let mut pos = seg.ini;
    while pos < seg.end {
        let newline = seg.cpts[pos] == '\n';
        while pos < seg.end && (seg.cpts[pos] == '\n') == newline {
            pos += 1;
        }
        emit.add(pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(patterns: &[&str], text: &str) -> Vec<String> {
        Splitter::new(patterns).unwrap().split(text)
    }

    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    #[test]
    fn patterns_select_their_splitters() {
        assert_eq!(Custom::for_pattern(GPT2), Some(Custom::Gpt2));
        assert_eq!(Custom::for_pattern(LLAMA3), Some(Custom::Llama3));
        assert_eq!(Custom::for_pattern(r"\p{N}"), None);
    }

    #[test]
    fn custom_splitters_split_like_their_patterns() {
        assert_eq!(
            words(&[GPT2], "Hello world's  end 123"),
            ["Hello", " world", "'s", " ", " end", " 123"]
        );
        assert_eq!(
            words(&[LLAMA3], "I'M 12345 ok!\n\nx"),
            ["I", "'M", " ", "123", "45", " ok", "!\n\n", "x"]
        );
        assert_eq!(words(&[r"\p{AFMoE_digits}"], "ab 12345"), ["ab 12", "345"]);
        assert_eq!(words(&[r"[^\n]+|[\n]+"], "a b\n\nc"), ["a b", "\n\n", "c"]);
    }

    #[test]
    fn regex_steps_resplit_and_keep_empty_matches() {
        assert_eq!(
            words(&[r"\p{N}", GPT2], "ab 123"),
            ["ab", " ", "1", "2", "3"]
        );
        assert_eq!(
            words(&[r"(?=(\d{3})+(?!\d))"], "1234567"),
            ["1", "", "234", "", "567"]
        );
        // Collapsed categories: every non-ASCII letter is "a letter", cased or not.
        assert_eq!(words(&[r"\p{L}+"], "añb 中"), ["añb", " ", "中"]);
        // Non-ASCII whitespace is whitespace to `\s`.
        assert_eq!(words(&[r"\s+"], "a\u{3000}b"), ["a", "\u{3000}", "b"]);
    }
}
