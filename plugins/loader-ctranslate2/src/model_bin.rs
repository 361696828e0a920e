//! The `model.bin` container, parsed and validated over a byte slice — no host, no I/O — so it
//! can be tested and fuzzed.
//!
//! Layout (little-endian throughout; a *string* is a `u16` length that counts a trailing NUL,
//! then that many bytes, the last of which is the NUL):
//!
//! ```text
//! u32     binary version (5 or 6)
//! string  spec name                       e.g. "WhisperSpec"
//! u32     spec revision
//! u32     variable count, then per variable:
//!           string  name                  e.g. "encoder/conv1/weight"
//!           u8      rank, then rank × u32 dimensions, outermost first
//!           u8      dtype id              0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16
//!           u32     byte count            = elements × dtype size
//!           bytes   the values, unpadded
//! u32     alias count, then per alias: string alias, string target variable
//! ```
//!
//! Data follows its header directly, so it has no alignment. Every check happens in [`parse`]:
//! each length against the bytes left, the version, string terminators and UTF-8, each rank
//! against [`MAX_RANK`], each dtype id, each byte count against `elements × size` (with
//! overflow checks), names unique across variables and aliases, each alias naming a variable,
//! and no bytes after the alias table.

use crate::error::FormatError;
use std::{collections::HashMap, ops::Range};
use u_sdk::{DType, MetaValue, convert};

/// The binary versions this loader reads (CTranslate2 4.x writes 6).
pub const SUPPORTED_VERSIONS: [u32; 2] = [5, 6];
/// The most dimensions a variable may have (CTranslate2's own models use at most 4).
pub const MAX_RANK: usize = 8;
/// The file a CTranslate2 model directory keeps its weights in.
pub const MODEL_FILE: &str = "model.bin";
/// Fewest bytes one variable's header can take (empty name, rank 0): a lower bound used to cap
/// allocations by the bytes actually present.
const MIN_VARIABLE_LEN: usize = 2 + 1 + 1 + 1 + 4;

/// The dtype a CTranslate2 dtype id stands for (the order of its `DataType` enum).
pub fn dtype_from_id(id: u8) -> Option<DType> {
    Some(match id {
        0 => DType::F32,
        1 => DType::I8,
        2 => DType::I16,
        3 => DType::I32,
        4 => DType::F16,
        5 => DType::BF16,
        _ => return None,
    })
}

/// One stored variable, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variable {
    /// The name as stored.
    pub name: String,
    /// Element type as stored.
    pub dtype: DType,
    /// Dimensions, outermost first; empty for a scalar.
    pub shape: Vec<u64>,
    /// Byte range of the values in the file.
    pub range: Range<usize>,
}

impl Variable {
    /// Whether this is a rank-0 variable (CTranslate2 keeps model options such as
    /// `decoder/num_heads` as scalars).
    pub fn is_scalar(&self) -> bool {
        self.shape.is_empty()
    }
}

/// A second name for a variable (e.g. tied embeddings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    /// The alias.
    pub name: String,
    /// The name of the variable it stands for.
    pub target: String,
    /// The index of that variable in [`ModelBin::variables`].
    pub variable: usize,
}

/// A parsed, validated `model.bin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelBin {
    /// The container version (one of [`SUPPORTED_VERSIONS`]).
    pub binary_version: u32,
    /// The model specification's class name, e.g. `WhisperSpec`.
    pub spec: String,
    /// The specification's revision.
    pub revision: u32,
    /// Variables, in file order.
    pub variables: Vec<Variable>,
    /// Aliases, in file order.
    pub aliases: Vec<Alias>,
}

/// Parses and validates a whole `model.bin` held in `file`.
pub fn parse(file: &[u8]) -> Result<ModelBin, FormatError> {
    let mut r = Reader { file, pos: 0 };
    let binary_version = r.u32(&|| "binary version".into())?;
    if !SUPPORTED_VERSIONS.contains(&binary_version) {
        return Err(FormatError::UnsupportedVersion {
            version: binary_version,
        });
    }
    let spec = r.string(&|| "spec name".into())?;
    let revision = r.u32(&|| "spec revision".into())?;
    let count = r.u32(&|| "variable count".into())? as usize;

    let mut variables = Vec::with_capacity(count.min(r.remaining() / MIN_VARIABLE_LEN));
    // Every name (variables and aliases), and the variable index of those that are variables.
    let mut names: HashMap<String, Option<usize>> = HashMap::with_capacity(variables.capacity());
    for i in 0..count {
        let name = r.name(&|| format!("name of variable {i}"))?;
        if names.contains_key(&name) {
            return Err(FormatError::DuplicateName { name });
        }
        let rank = r.u8(&|| format!("rank of `{name}`"))?;
        if usize::from(rank) > MAX_RANK {
            return Err(FormatError::RankTooLarge {
                name,
                rank,
                limit: MAX_RANK,
            });
        }
        let mut shape = Vec::with_capacity(usize::from(rank));
        for d in 0..rank {
            shape.push(u64::from(r.u32(&|| format!("dimension {d} of `{name}`"))?));
        }
        let id = r.u8(&|| format!("dtype of `{name}`"))?;
        let dtype = dtype_from_id(id).ok_or_else(|| FormatError::UnknownDtype {
            name: name.clone(),
            id,
        })?;
        let nbytes = u64::from(r.u32(&|| format!("byte count of `{name}`"))?);
        let expected = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| dtype.bytes_for(n));
        let Some(expected) = expected else {
            return Err(FormatError::ShapeOverflow { name, shape });
        };
        if nbytes != expected {
            return Err(FormatError::SizeMismatch {
                name,
                dtype,
                shape,
                nbytes,
                expected,
            });
        }
        let range = r.take(nbytes, &|| format!("data of `{name}`"))?;
        names.insert(name.clone(), Some(variables.len()));
        variables.push(Variable {
            name,
            dtype,
            shape,
            range,
        });
    }

    let count = r.u32(&|| "alias count".into())? as usize;
    let mut aliases = Vec::with_capacity(count.min(r.remaining() / 4));
    for i in 0..count {
        let name = r.name(&|| format!("name of alias {i}"))?;
        if names.contains_key(&name) {
            return Err(FormatError::DuplicateName { name });
        }
        let target = r.string(&|| format!("target of alias `{name}`"))?;
        let Some(&Some(variable)) = names.get(&target) else {
            return Err(FormatError::AliasTarget {
                alias: name,
                target,
            });
        };
        names.insert(name.clone(), None);
        aliases.push(Alias {
            name,
            target,
            variable,
        });
    }

    if r.remaining() != 0 {
        return Err(FormatError::TrailingBytes {
            offset: r.pos as u64,
            extra: r.remaining() as u64,
        });
    }
    Ok(ModelBin {
        binary_version,
        spec,
        revision,
        variables,
        aliases,
    })
}

/// Whether `head` (the first bytes of a file) starts like a `model.bin`: a small binary version
/// (2 or later, the versions that carry a spec name) and a NUL-terminated spec name of letters,
/// digits and `_` ending in `Spec`. Versions this loader does not read are recognised too, so
/// that opening them reports the version instead of "no loader recognises the file".
pub fn sniff_head(head: &[u8]) -> bool {
    let (Some(version), Some(len)) = (head.get(..4), head.get(4..6)) else {
        return false;
    };
    let version = u32::from_le_bytes([version[0], version[1], version[2], version[3]]);
    let len = usize::from(u16::from_le_bytes([len[0], len[1]]));
    if !(2..=255).contains(&version) || len < "Spec\0".len() {
        return false;
    }
    match head.get(6..6 + len) {
        Some([name @ .., 0]) => {
            name.ends_with(b"Spec") && name.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'_')
        }
        _ => false,
    }
}

/// The architecture a spec name stands for: lower-cased, without the `Spec` suffix
/// (`WhisperSpec` → `whisper`, `TransformerSpec` → `transformer`); `None` if nothing is left.
pub fn architecture(spec: &str) -> Option<String> {
    let base = spec.strip_suffix("Spec").unwrap_or(spec);
    (!base.is_empty()).then(|| base.to_lowercase())
}

/// A rank-0 variable's value as metadata: integers as [`MetaValue::Int`], floats as
/// [`MetaValue::Float`]. `None` if `bytes` is not one value of `dtype` (or `dtype` is not one
/// CTranslate2 stores).
pub fn scalar_value(dtype: DType, bytes: &[u8]) -> Option<MetaValue> {
    let b2 = || <[u8; 2]>::try_from(bytes).ok();
    let b4 = || <[u8; 4]>::try_from(bytes).ok();
    Some(match dtype {
        DType::I8 => match bytes {
            [b] => MetaValue::Int(i64::from(*b as i8)),
            _ => return None,
        },
        DType::I16 => MetaValue::Int(i64::from(i16::from_le_bytes(b2()?))),
        DType::I32 => MetaValue::Int(i64::from(i32::from_le_bytes(b4()?))),
        DType::F32 => MetaValue::Float(f64::from(f32::from_le_bytes(b4()?))),
        DType::F16 => MetaValue::Float(f64::from(convert::f16_to_f32(u16::from_le_bytes(b2()?)))),
        DType::BF16 => MetaValue::Float(f64::from(convert::bf16_to_f32(u16::from_le_bytes(b2()?)))),
        _ => return None,
    })
}

/// A cursor over the file that refuses to read past its end.
struct Reader<'a> {
    file: &'a [u8],
    pos: usize,
}

/// Names the field being read, for errors (built only when one is reported).
type What<'w> = &'w dyn Fn() -> String;

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.file.len() - self.pos
    }

    /// The range of the next `n` bytes, consumed.
    fn take(&mut self, n: u64, what: What<'_>) -> Result<Range<usize>, FormatError> {
        let available = self.remaining() as u64;
        if n > available {
            return Err(FormatError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                available,
            });
        }
        let start = self.pos;
        // `n ≤ available`, so it fits in usize and the sum stays within the slice.
        self.pos += n as usize;
        Ok(start..self.pos)
    }

    fn array<const N: usize>(&mut self, what: What<'_>) -> Result<[u8; N], FormatError> {
        let range = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(&self.file[range]);
        Ok(out)
    }

    fn u8(&mut self, what: What<'_>) -> Result<u8, FormatError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u32(&mut self, what: What<'_>) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed, NUL-terminated UTF-8 string.
    fn string(&mut self, what: What<'_>) -> Result<String, FormatError> {
        let offset = self.pos as u64;
        let len = u16::from_le_bytes(self.array(what)?);
        let range = self.take(u64::from(len), what)?;
        let Some((&0, text)) = self.file[range].split_last() else {
            return Err(FormatError::MissingNul {
                what: what(),
                offset,
            });
        };
        if text.contains(&0) {
            return Err(FormatError::EmbeddedNul {
                what: what(),
                offset,
            });
        }
        match std::str::from_utf8(text) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => Err(FormatError::NotUtf8 {
                what: what(),
                offset,
            }),
        }
    }

    /// A [`Self::string`] that must not be empty.
    fn name(&mut self, what: What<'_>) -> Result<String, FormatError> {
        let offset = self.pos as u64;
        let name = self.string(what)?;
        if name.is_empty() {
            return Err(FormatError::EmptyName {
                what: what(),
                offset,
            });
        }
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_writer::{ModelBinWriter, string};

    fn whisperish() -> ModelBinWriter {
        ModelBinWriter::new("WhisperSpec", 3)
            .var("encoder/num_heads", &[], 2, &6i16.to_le_bytes())
            .var("decoder/activation", &[], 1, &[3])
            .var("decoder/alignment_layer", &[], 2, &(-1i16).to_le_bytes())
            .var("scale", &[], 0, &0.125f32.to_le_bytes())
            .var("decoder/embeddings/weight", &[3, 2], 4, &[0x3c; 12])
            .var("counts", &[2], 3, &[1, 0, 0, 0, 2, 0, 0, 0])
            .var("empty", &[0, 4], 5, &[])
            .alias("decoder/projection/weight", "decoder/embeddings/weight")
    }

    #[test]
    fn round_trip() {
        let bytes = whisperish().bytes();
        let m = parse(&bytes).unwrap();
        assert_eq!(m.binary_version, 6);
        assert_eq!(m.spec, "WhisperSpec");
        assert_eq!(m.revision, 3);
        assert_eq!(m.variables.len(), 7);
        let emb = &m.variables[4];
        assert_eq!(emb.name, "decoder/embeddings/weight");
        assert_eq!((emb.dtype, emb.shape.as_slice()), (DType::F16, &[3, 2][..]));
        assert_eq!(&bytes[emb.range.clone()], &[0x3c; 12]);
        assert_eq!(m.variables[5].dtype, DType::I32);
        assert_eq!(m.variables[6].range.len(), 0);
        assert!(m.variables[0].is_scalar() && !emb.is_scalar());
        assert_eq!(
            m.aliases,
            [Alias {
                name: "decoder/projection/weight".into(),
                target: "decoder/embeddings/weight".into(),
                variable: 4,
            }]
        );
        let scalar = |i: usize| {
            let v = &m.variables[i];
            scalar_value(v.dtype, &bytes[v.range.clone()])
        };
        assert_eq!(scalar(0), Some(MetaValue::Int(6)));
        assert_eq!(scalar(1), Some(MetaValue::Int(3)));
        assert_eq!(scalar(2), Some(MetaValue::Int(-1)));
        assert_eq!(scalar(3), Some(MetaValue::Float(0.125)));
        assert_eq!(
            scalar_value(DType::F16, &0x3c00u16.to_le_bytes()),
            Some(MetaValue::Float(1.0))
        );
        assert_eq!(
            scalar_value(DType::BF16, &0x4000u16.to_le_bytes()),
            Some(MetaValue::Float(2.0))
        );
        assert_eq!(scalar_value(DType::I16, &[1]), None);
        assert_eq!(scalar_value(DType::U8, &[1]), None);
        assert!(parse(&whisperish().version(5).bytes()).is_ok());
    }

    #[test]
    fn every_dtype_id() {
        let ids = [
            (0, DType::F32),
            (1, DType::I8),
            (2, DType::I16),
            (3, DType::I32),
            (4, DType::F16),
            (5, DType::BF16),
        ];
        for (id, dtype) in ids {
            assert_eq!(dtype_from_id(id), Some(dtype));
            let size = dtype.block_bytes();
            let m = parse(
                &ModelBinWriter::new("XSpec", 1)
                    .var("v", &[3], id, &vec![7; 3 * size])
                    .bytes(),
            )
            .unwrap();
            assert_eq!(m.variables[0].dtype, dtype);
        }
        assert_eq!(dtype_from_id(6), None);
    }

    #[test]
    fn unsupported_versions_are_named() {
        for version in [0, 1, 4, 7, u32::MAX] {
            let err = parse(&whisperish().version(version).bytes()).unwrap_err();
            assert_eq!(err, FormatError::UnsupportedVersion { version });
            assert!(
                err.to_string().contains(&format!("version {version}")),
                "{err}"
            );
        }
    }

    #[test]
    fn every_truncation_is_refused() {
        let bytes = whisperish().bytes();
        for len in 0..bytes.len() {
            let err = parse(&bytes[..len]).expect_err("truncated");
            assert!(matches!(err, FormatError::Truncated { .. }), "{len}: {err}");
        }
    }

    #[test]
    fn lengths_past_the_end_are_refused() {
        // A byte count that matches the shape but runs past the end.
        let mut bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1_000_000], 0, &[])
            .raw_nbytes(4_000_000)
            .bytes();
        let err = parse(&bytes).unwrap_err();
        assert!(
            matches!(&err, FormatError::Truncated { what, needed: 4_000_000, .. } if what == "data of `w`"),
            "{err}"
        );
        // A string length past the end.
        bytes = 6u32.to_le_bytes().to_vec();
        bytes.extend(u16::MAX.to_le_bytes());
        bytes.extend(b"ASpec\0");
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::Truncated { needed: 65535, .. }
        ));
        // Huge counts do not allocate: they fail on the first missing entry.
        let mut bytes = ModelBinWriter::new("XSpec", 1).bytes();
        let at = bytes.len() - 8;
        bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        // (The alias count's zero bytes read as an empty-length name.)
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::MissingNul { what, .. } if what == "name of variable 0"
        ));
        let mut bytes = ModelBinWriter::new("XSpec", 1).bytes();
        let at = bytes.len() - 4;
        bytes[at..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::Truncated { .. }
        ));
    }

    #[test]
    fn byte_counts_must_match_the_shape() {
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &[2, 3], 4, &[0; 10])
            .bytes();
        assert_eq!(
            parse(&bytes).unwrap_err(),
            FormatError::SizeMismatch {
                name: "w".into(),
                dtype: DType::F16,
                shape: vec![2, 3],
                nbytes: 10,
                expected: 12,
            }
        );
        // A scalar is one value.
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("s", &[], 3, &[0; 2])
            .bytes();
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::SizeMismatch { expected: 4, .. }
        ));
    }

    #[test]
    fn overflowing_shapes_are_refused() {
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &[u32::MAX; 3], 0, &[])
            .bytes();
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::ShapeOverflow { .. }
        ));
        // Elements fit in 64 bits, bytes do not.
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &[u32::MAX, u32::MAX], 0, &[])
            .bytes();
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::ShapeOverflow { .. }
        ));
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1 << 31, 1 << 31, 4], 0, &[])
            .bytes();
        assert!(matches!(
            parse(&bytes).unwrap_err(),
            FormatError::ShapeOverflow { .. }
        ));
    }

    #[test]
    fn rank_and_dtype_limits() {
        let dims = [1u32; MAX_RANK + 1];
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &dims, 1, &[0])
            .bytes();
        assert_eq!(
            parse(&bytes).unwrap_err(),
            FormatError::RankTooLarge {
                name: "w".into(),
                rank: 9,
                limit: MAX_RANK,
            }
        );
        assert!(
            parse(
                &ModelBinWriter::new("XSpec", 1)
                    .var("w", &dims[..MAX_RANK], 1, &[0])
                    .bytes()
            )
            .is_ok()
        );
        let bytes = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1], 9, &[0])
            .bytes();
        assert_eq!(
            parse(&bytes).unwrap_err(),
            FormatError::UnknownDtype {
                name: "w".into(),
                id: 9,
            }
        );
    }

    #[test]
    fn names_are_unique() {
        let twice = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1], 1, &[0])
            .var("w", &[1], 1, &[0]);
        assert_eq!(
            parse(&twice.bytes()).unwrap_err(),
            FormatError::DuplicateName { name: "w".into() }
        );
        let alias_shadows = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1], 1, &[0])
            .var("v", &[1], 1, &[0])
            .alias("v", "w");
        assert_eq!(
            parse(&alias_shadows.bytes()).unwrap_err(),
            FormatError::DuplicateName { name: "v".into() }
        );
        let alias_twice = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1], 1, &[0])
            .alias("a", "w")
            .alias("a", "w");
        assert_eq!(
            parse(&alias_twice.bytes()).unwrap_err(),
            FormatError::DuplicateName { name: "a".into() }
        );
    }

    #[test]
    fn aliases_name_variables() {
        let missing = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1], 1, &[0])
            .alias("a", "nope");
        assert_eq!(
            parse(&missing.bytes()).unwrap_err(),
            FormatError::AliasTarget {
                alias: "a".into(),
                target: "nope".into(),
            }
        );
        let chained = ModelBinWriter::new("XSpec", 1)
            .var("w", &[1], 1, &[0])
            .alias("a", "w")
            .alias("b", "a");
        assert!(matches!(
            parse(&chained.bytes()).unwrap_err(),
            FormatError::AliasTarget { .. }
        ));
    }

    #[test]
    fn strings_are_checked() {
        let header = |name: &[u8]| {
            let mut b = 6u32.to_le_bytes().to_vec();
            b.extend((name.len() as u16).to_le_bytes());
            b.extend(name);
            b.extend([0; 12]);
            b
        };
        assert!(matches!(
            parse(&header(b"")).unwrap_err(),
            FormatError::MissingNul { offset: 4, .. }
        ));
        assert!(matches!(
            parse(&header(b"XSpec")).unwrap_err(),
            FormatError::MissingNul { .. }
        ));
        assert!(matches!(
            parse(&header(b"X\0Spec\0")).unwrap_err(),
            FormatError::EmbeddedNul { .. }
        ));
        assert!(matches!(
            parse(&header(b"X\xffSpec\0")).unwrap_err(),
            FormatError::NotUtf8 { .. }
        ));
        // An empty spec name is allowed (it names no architecture); empty variable names not.
        assert!(parse(&header(b"\0")).is_ok());
        let mut b = 6u32.to_le_bytes().to_vec();
        string(&mut b, "XSpec");
        b.extend(1u32.to_le_bytes());
        b.extend(1u32.to_le_bytes());
        string(&mut b, "");
        let err = parse(&b).unwrap_err();
        assert!(
            matches!(&err, FormatError::EmptyName { what, offset: 20 } if what == "name of variable 0"),
            "{err}"
        );
        let non_utf8_name = ModelBinWriter::new("XSpec", 1).var_raw_name(b"w\xfe", &[1], 1, &[0]);
        assert!(matches!(
            parse(&non_utf8_name.bytes()).unwrap_err(),
            FormatError::NotUtf8 { what, .. } if what == "name of variable 0"
        ));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut bytes = whisperish().bytes();
        let end = bytes.len();
        bytes.extend([0, 0, 0]);
        assert_eq!(
            parse(&bytes).unwrap_err(),
            FormatError::TrailingBytes {
                offset: end as u64,
                extra: 3,
            }
        );
    }

    #[test]
    fn sniffing_heads() {
        let bytes = whisperish().bytes();
        assert!(sniff_head(&bytes));
        assert!(sniff_head(&bytes[..6 + "WhisperSpec\0".len()]));
        assert!(!sniff_head(&bytes[..6 + "WhisperSpec".len()]));
        assert!(
            sniff_head(&whisperish().version(4).bytes()),
            "refused on open, by version"
        );
        assert!(!sniff_head(&whisperish().version(1).bytes()));
        assert!(!sniff_head(&whisperish().version(1 << 20).bytes()));
        assert!(!sniff_head(&ModelBinWriter::new("Whisper", 3).bytes()));
        assert!(!sniff_head(&ModelBinWriter::new("Bad Spec", 3).bytes()));
        assert!(!sniff_head(b"GGUF\x03\0\0\0\0\0\0\0"));
        assert!(!sniff_head(&[]));
    }

    #[test]
    fn architecture_names() {
        assert_eq!(architecture("WhisperSpec").as_deref(), Some("whisper"));
        assert_eq!(
            architecture("TransformerSpec").as_deref(),
            Some("transformer")
        );
        assert_eq!(
            architecture("TransformerDecoderModelSpec").as_deref(),
            Some("transformerdecodermodel")
        );
        assert_eq!(architecture("Odd").as_deref(), Some("odd"));
        assert_eq!(architecture("Spec"), None);
        assert_eq!(architecture(""), None);
    }
}
