//! The safetensors container: an 8-byte little-endian header length, a JSON header, then the
//! data region. Plain Rust over a byte slice — no host, no I/O — so it can be tested and fuzzed.
//!
//! Every check happens here, before any tensor is handed out: the header length against
//! [`MAX_HEADER_LEN`] and the file size, each dtype against the supported set, each shape's
//! element and byte counts with overflow checks, each tensor's offsets against its byte size and
//! the data region, and that no two tensors overlap.

use crate::error::HeaderError;
use serde_json::{Map, Value};
use std::ops::Range;
use u_sdk::DType;

/// The largest JSON header accepted (100 MiB, the limit of the reference implementation).
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;

/// One tensor as the header describes it, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawTensor {
    /// The name as stored.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
    /// Byte range in the whole file (not relative to the data region).
    pub range: Range<usize>,
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Header {
    /// Tensors, in data-region order.
    pub tensors: Vec<RawTensor>,
    /// The free-form `__metadata__` string map, sorted by key.
    pub metadata: Vec<(String, String)>,
}

/// Parses a safetensors dtype string. `None` for dtypes that U cannot represent (e.g. `BOOL`,
/// `U16`, the 8-bit floats) and for unknown strings.
pub fn parse_dtype(s: &str) -> Option<DType> {
    Some(match s {
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F32" => DType::F32,
        "F64" => DType::F64,
        "I8" => DType::I8,
        "U8" => DType::U8,
        "I16" => DType::I16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        _ => return None,
    })
}

/// Parses and validates the header of a whole safetensors file held in `file`.
pub fn parse(file: &[u8]) -> Result<Header, HeaderError> {
    let file_len = file.len() as u64;
    let len_bytes: [u8; 8] = file
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or(HeaderError::TooShort { len: file_len })?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_LEN {
        return Err(HeaderError::HeaderTooLarge {
            len: header_len,
            limit: MAX_HEADER_LEN,
        });
    }
    let available = file_len - 8;
    if header_len > available {
        return Err(HeaderError::HeaderPastEnd {
            len: header_len,
            available,
        });
    }
    // Both fit in usize: they are bounded by the slice's length.
    let data_start = 8 + header_len as usize;
    let json = &file[8..data_start];
    let data_len = file_len - data_start as u64;

    let root: Map<String, Value> =
        serde_json::from_slice(json).map_err(|e| HeaderError::Json(e.to_string()))?;

    let mut header = Header::default();
    for (name, entry) in &root {
        if name == "__metadata__" {
            header.metadata = parse_metadata(entry)?;
            continue;
        }
        let t = parse_entry(name, entry, data_len)?;
        header.tensors.push(RawTensor {
            range: t.range.start + data_start..t.range.end + data_start,
            ..t
        });
    }
    header.tensors.sort_by_key(|t| (t.range.start, t.range.end));
    // Zero-sized tensors occupy nothing and cannot overlap anything.
    let mut last: Option<&RawTensor> = None;
    for t in header.tensors.iter().filter(|t| !t.range.is_empty()) {
        if let Some(prev) = last.filter(|p| t.range.start < p.range.end) {
            return Err(HeaderError::Overlap {
                first: prev.name.clone(),
                second: t.name.clone(),
            });
        }
        last = Some(t);
    }
    Ok(header)
}

fn parse_metadata(v: &Value) -> Result<Vec<(String, String)>, HeaderError> {
    let obj = v.as_object().ok_or_else(|| {
        HeaderError::Json("`__metadata__` must be an object of strings".to_string())
    })?;
    obj.iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|s| (k.clone(), s.to_string()))
                .ok_or_else(|| HeaderError::Json(format!("`__metadata__.{k}` must be a string")))
        })
        .collect()
}

/// Parses one entry; the returned range is relative to the data region.
fn parse_entry(name: &str, v: &Value, data_len: u64) -> Result<RawTensor, HeaderError> {
    let bad = |reason: &str| HeaderError::BadEntry {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    let obj = v.as_object().ok_or_else(|| bad("entry is not an object"))?;
    let dtype_str = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("`dtype` is missing or not a string"))?;
    let dtype = parse_dtype(dtype_str).ok_or_else(|| HeaderError::UnsupportedDtype {
        name: name.to_string(),
        dtype: dtype_str.to_string(),
    })?;
    let shape = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("`shape` is missing or not an array"))?
        .iter()
        .map(Value::as_u64)
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| bad("`shape` holds something other than non-negative integers"))?;
    let offsets = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("`data_offsets` is missing or not an array"))?;
    let (begin, end) = match offsets.as_slice() {
        [b, e] => (
            b.as_u64()
                .ok_or_else(|| bad("`data_offsets` must be integers"))?,
            e.as_u64()
                .ok_or_else(|| bad("`data_offsets` must be integers"))?,
        ),
        _ => return Err(bad("`data_offsets` must hold exactly two integers")),
    };

    let overflow = || HeaderError::ShapeOverflow {
        name: name.to_string(),
        shape: shape.clone(),
    };
    let elements = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let bytes = dtype.bytes_for(elements).ok_or_else(overflow)?;

    let offsets_err = |reason: String| HeaderError::BadOffsets {
        name: name.to_string(),
        begin,
        end,
        data_len,
        reason,
    };
    if begin > end {
        return Err(offsets_err("begin after end".to_string()));
    }
    if end > data_len {
        return Err(offsets_err(
            "run past the end of the data region".to_string(),
        ));
    }
    if end - begin != bytes {
        return Err(offsets_err(format!(
            "span {} bytes but {dtype} {shape:?} needs {bytes}",
            end - begin
        )));
    }
    Ok(RawTensor {
        name: name.to_string(),
        dtype,
        shape,
        // Both are ≤ data_len, which is ≤ the slice length, so they fit in usize.
        range: begin as usize..end as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn parses_a_valid_file() {
        let f = file(
            r#"{"__metadata__":{"format":"pt"},"b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},"a":{"dtype":"I8","shape":[2,2],"data_offsets":[0,4]}}  "#,
            &[1, 2, 3, 4, 0, 60, 0, 188],
        );
        let h = parse(&f).unwrap();
        assert_eq!(h.metadata, vec![("format".to_string(), "pt".to_string())]);
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].name, "a");
        assert_eq!(h.tensors[0].shape, vec![2, 2]);
        let start = f.len() - 8;
        assert_eq!(h.tensors[0].range, start..start + 4);
        assert_eq!(h.tensors[1].dtype, DType::F16);
    }

    #[test]
    fn refuses_malformed_headers() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![1, 2, 3], "too short"),
            (u64::MAX.to_le_bytes().to_vec(), "exceeds the limit"),
            (100u64.to_le_bytes().to_vec(), "past the end"),
            (file("{", &[]), "not valid JSON"),
            (file("[]", &[]), "not valid JSON"),
            (file(r#"{"a":1}"#, &[]), "not an object"),
            (
                file(
                    r#"{"a":{"dtype":"Q9","shape":[],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "not supported",
            ),
            (
                file(
                    r#"{"a":{"dtype":"BOOL","shape":[],"data_offsets":[0,1]}}"#,
                    &[0; 1],
                ),
                "not supported",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "non-negative",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "overflows",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,4]}}"#,
                    &[0; 4],
                ),
                "overflows",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[],"data_offsets":[0,8]}}"#,
                    &[0; 4],
                ),
                "past the end",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[],"data_offsets":[4,0]}}"#,
                    &[0; 4],
                ),
                "begin after end",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                    &[0; 8],
                ),
                "needs 8",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#,
                    &[0; 4],
                ),
                "exactly two",
            ),
            (
                file(
                    r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                    &[0; 8],
                ),
                "overlap",
            ),
            (file(r#"{"__metadata__":{"k":1}}"#, &[]), "must be a string"),
        ];
        for (bytes, want) in cases {
            let err = parse(&bytes).expect_err(want).to_string();
            assert!(err.contains(want), "expected `{want}`, got `{err}`");
        }
    }

    #[test]
    fn zero_sized_tensors_are_fine() {
        let f = file(
            r#"{"e":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#,
            &[7],
        );
        let h = parse(&f).unwrap();
        assert_eq!(h.tensors.len(), 2);
    }
}
