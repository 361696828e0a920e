//! Code-point classes as llama.cpp's tokenizers see them: one category flag per code point
//! (from the Unicode general category), a fixed whitespace set, the simple lowercase map and the
//! first code point of the canonical decomposition.

use unicode_general_category::{GeneralCategory as G, get_general_category};

/// The classes of one code point. `Flags::default()` (all clear) stands for a position outside
/// the text being split, which no class matches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flags(u16);

impl Flags {
    /// Unassigned (Cn).
    pub const UNDEFINED: u16 = 0x1;
    /// Nd, Nl, No.
    pub const NUMBER: u16 = 0x2;
    /// Lu, Ll, Lt, Lm, Lo.
    pub const LETTER: u16 = 0x4;
    /// Zs, Zl, Zp.
    pub const SEPARATOR: u16 = 0x8;
    /// Mn, Mc, Me.
    pub const ACCENT_MARK: u16 = 0x10;
    /// Pc, Pd, Ps, Pe, Pi, Pf, Po.
    pub const PUNCTUATION: u16 = 0x20;
    /// Sm, Sc, Sk, So.
    pub const SYMBOL: u16 = 0x40;
    /// Cc, Cf, Co, Cs.
    pub const CONTROL: u16 = 0x80;
    /// The whitespace set (not a category).
    pub const WHITESPACE: u16 = 0x100;

    /// The flags of `c`.
    pub fn of(c: char) -> Flags {
        let category = match get_general_category(c) {
            G::Unassigned => Self::UNDEFINED,
            G::DecimalNumber | G::LetterNumber | G::OtherNumber => Self::NUMBER,
            G::UppercaseLetter
            | G::LowercaseLetter
            | G::TitlecaseLetter
            | G::ModifierLetter
            | G::OtherLetter => Self::LETTER,
            G::SpaceSeparator | G::LineSeparator | G::ParagraphSeparator => Self::SEPARATOR,
            G::NonspacingMark | G::SpacingMark | G::EnclosingMark => Self::ACCENT_MARK,
            G::ConnectorPunctuation
            | G::DashPunctuation
            | G::OpenPunctuation
            | G::ClosePunctuation
            | G::InitialPunctuation
            | G::FinalPunctuation
            | G::OtherPunctuation => Self::PUNCTUATION,
            G::MathSymbol | G::CurrencySymbol | G::ModifierSymbol | G::OtherSymbol => Self::SYMBOL,
            G::Control | G::Format | G::PrivateUse | G::Surrogate => Self::CONTROL,
            // The enumeration is non-exhaustive: a category added later is "undefined".
            _ => Self::UNDEFINED,
        };
        Flags(
            category
                | if is_whitespace(c) {
                    Self::WHITESPACE
                } else {
                    0
                },
        )
    }

    /// Whether any class is set (false only outside the text).
    pub fn any(self) -> bool {
        self.0 != 0
    }

    /// The category flag alone.
    pub fn category(self) -> u16 {
        self.0 & 0xFF
    }

    /// A number.
    pub fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }

    /// A letter.
    pub fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }

    /// An accent (combining) mark.
    pub fn is_accent_mark(self) -> bool {
        self.0 & Self::ACCENT_MARK != 0
    }

    /// Punctuation.
    pub fn is_punctuation(self) -> bool {
        self.0 & Self::PUNCTUATION != 0
    }

    /// A symbol.
    pub fn is_symbol(self) -> bool {
        self.0 & Self::SYMBOL != 0
    }

    /// A control, format, private-use or surrogate code point.
    pub fn is_control(self) -> bool {
        self.0 & Self::CONTROL != 0
    }

    /// Whitespace.
    pub fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
}

/// The whitespace set: tab to carriage return, space, NEL, no-break space, Ogham space, the
/// U+2000 spaces, line and paragraph separators, narrow no-break space, medium mathematical
/// space and ideographic space.
pub fn is_whitespace(c: char) -> bool {
    matches!(
        c,
        '\u{9}'..='\u{D}'
            | ' '
            | '\u{85}'
            | '\u{A0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200A}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202F}'
            | '\u{205F}'
            | '\u{3000}'
    )
}

/// The simple (one code point) lowercase of `c`.
pub fn to_lower(c: char) -> char {
    let mut lower = c.to_lowercase();
    match (lower.next(), lower.next()) {
        (Some(l), None) => l,
        // A multi-code-point lowercase (U+0130): its simple mapping is its first code point.
        (Some(l), Some(_)) => l,
        _ => c,
    }
}

/// The first code point of the canonical decomposition of `c` (a base letter without its
/// marks: llama.cpp's accent stripping).
pub fn nfd_first(c: char) -> char {
    let mut first = None;
    unicode_normalization::char::decompose_canonical(c, |d| {
        first.get_or_insert(d);
    });
    first.unwrap_or(c)
}

/// CJK ideographs (the unified blocks and extensions A–F, and the compatibility blocks).
pub fn is_han(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF
            | 0x3400..=0x4DBF
            | 0x20000..=0x2A6DF
            | 0x2A700..=0x2B73F
            | 0x2B740..=0x2B81F
            | 0x2B820..=0x2CEAF
            | 0x2CEB0..=0x2EBEF
            | 0xF900..=0xFAFF
            | 0x2F800..=0x2FA1F)
}

/// GPT-2's byte-to-character alphabet: printable Latin-1 bytes stand for themselves, the other
/// 68 bytes for U+0100 onwards, in order.
pub fn byte_to_char(b: u8) -> char {
    static TABLE: std::sync::OnceLock<[char; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..=255u8 {
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
            t[b as usize] = if printable {
                char::from(b)
            } else {
                n += 1;
                char::from_u32(0xFF + n).expect("below U+0200")
            };
        }
        t
    })[b as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_sample_code_points() {
        assert!(Flags::of('a').is_letter() && !Flags::of('a').is_whitespace());
        assert!(Flags::of('٣').is_number());
        assert!(Flags::of('\u{301}').is_accent_mark());
        assert!(Flags::of('!').is_punctuation() && Flags::of('$').is_symbol());
        let ideographic = Flags::of('\u{3000}');
        assert!(ideographic.is_whitespace() && ideographic.category() == Flags::SEPARATOR);
        assert!(Flags::of('\u{7}').is_control() && !Flags::of('\u{1C}').is_whitespace());
        assert!(!Flags::default().any() && Flags::of('\u{378}').any());
    }

    #[test]
    fn case_decomposition_and_bytes() {
        assert_eq!(to_lower('İ'), 'i');
        assert_eq!(to_lower('Σ'), 'σ');
        assert_eq!(nfd_first('é'), 'e');
        assert_eq!(nfd_first('ǖ'), 'u');
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(0xAD), 'Ń');
    }
}
