//! A GGUF v2/v3 parser over a byte slice, independent of the plugin ABI and of any host.
//!
//! Layout (little-endian), per llama.cpp's `docs/gguf.md`:
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type u32, value)
//! tensor_count × (name: string, n_dims u32, dims: n_dims × u64 (innermost first), ggml_type u32, offset u64)
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset
//! ```
//!
//! A string is a `u64` byte length and the bytes; an array is an element type `u32`, a count `u64`
//! and the elements. [`Gguf::parse`] reads only the header, the metadata and the tensor infos;
//! tensor data stays where it is and [`Gguf::tensor_data`] hands out sub-slices of the caller's
//! buffer. Every count and length is checked against the bytes left before anything is allocated,
//! so the memory a parse allocates is bounded by a small multiple of the input's size.

use crate::error::{Error, Result};
use std::collections::HashMap;
use u_sdk::DType;

/// The four magic bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The metadata key naming the architecture.
pub const ARCHITECTURE_KEY: &str = "general.architecture";
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays accepted in metadata.
pub const MAX_ARRAY_NESTING: usize = 8;

/// A GGUF metadata value type id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    /// `u8`.
    U8 = 0,
    /// `i8`.
    I8 = 1,
    /// `u16`.
    U16 = 2,
    /// `i16`.
    I16 = 3,
    /// `u32`.
    U32 = 4,
    /// `i32`.
    I32 = 5,
    /// `f32`.
    F32 = 6,
    /// One byte, 0 or 1.
    Bool = 7,
    /// Length-prefixed UTF-8.
    Str = 8,
    /// Typed, length-prefixed array.
    Array = 9,
    /// `u64`.
    U64 = 10,
    /// `i64`.
    I64 = 11,
    /// `f64`.
    F64 = 12,
}

impl ValueType {
    /// Parses a type id.
    pub fn from_id(id: u32) -> Result<ValueType> {
        use ValueType::*;
        Ok(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => Str,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            other => return Err(Error::UnknownValueType(other)),
        })
    }

    /// The fewest bytes one value of this type occupies in the file.
    const fn min_encoded_len(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | Str => 8,
            Array => 12,
        }
    }
}

/// A metadata value with its exact GGUF type.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `u8`.
    U8(u8),
    /// `i8`.
    I8(i8),
    /// `u16`.
    U16(u16),
    /// `i16`.
    I16(i16),
    /// `u32`.
    U32(u32),
    /// `i32`.
    I32(i32),
    /// `f32`.
    F32(f32),
    /// `bool`.
    Bool(bool),
    /// A string (invalid UTF-8 is replaced with U+FFFD).
    Str(String),
    /// An array.
    Array(Array),
    /// `u64`.
    U64(u64),
    /// `i64`.
    I64(i64),
    /// `f64`.
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string slice, if it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// A metadata array: one element type for all elements.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    /// `u8` elements.
    U8(Vec<u8>),
    /// `i8` elements.
    I8(Vec<i8>),
    /// `u16` elements.
    U16(Vec<u16>),
    /// `i16` elements.
    I16(Vec<i16>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `f32` elements.
    F32(Vec<f32>),
    /// `bool` elements.
    Bool(Vec<bool>),
    /// String elements.
    Str(Vec<String>),
    /// Arrays of arrays; each inner array has its own element type.
    Array(Vec<Array>),
    /// `u64` elements.
    U64(Vec<u64>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `f64` elements.
    F64(Vec<f64>),
}

impl Array {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Maps a ggml type id to a [`DType`]; `Err` carries ggml's name for ids this loader does not read.
pub fn dtype_from_ggml(type_id: u32) -> std::result::Result<DType, &'static str> {
    Ok(match type_id {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        9 => DType::Q8_1,
        10 => DType::Q2_K,
        11 => DType::Q3_K,
        12 => DType::Q4_K,
        13 => DType::Q5_K,
        14 => DType::Q6_K,
        15 => DType::Q8_K,
        24 => DType::I8,
        25 => DType::I16,
        26 => DType::I32,
        27 => DType::I64,
        28 => DType::F64,
        30 => DType::BF16,
        34 => DType::TQ1_0,
        35 => DType::TQ2_0,
        other => {
            return Err(match other {
                4 | 5 => "Q4_2/Q4_3 (removed from ggml)",
                16 => "IQ2_XXS",
                17 => "IQ2_XS",
                18 => "IQ3_XXS",
                19 => "IQ1_S",
                20 => "IQ4_NL",
                21 => "IQ3_S",
                22 => "IQ2_S",
                23 => "IQ4_XS",
                29 => "IQ1_M",
                31..=33 => "Q4_0_4_4/Q4_0_4_8/Q4_0_8_8 (removed from ggml)",
                36..=38 => "IQ4_NL_4_4/IQ4_NL_4_8/IQ4_NL_8_8 (removed from ggml)",
                39 => "MXFP4",
                40 => "NVFP4",
                41 => "Q1_0",
                _ => "unknown",
            });
        }
    })
}

/// The ggml type id of a [`DType`] (the inverse of [`dtype_from_ggml`]); ggml has no `U8`.
pub const fn ggml_type_id(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q8_1 => 9,
        DType::Q2_K => 10,
        DType::Q3_K => 11,
        DType::Q4_K => 12,
        DType::Q5_K => 13,
        DType::Q6_K => 14,
        DType::Q8_K => 15,
        DType::I8 => 24,
        DType::I16 => 25,
        DType::I32 => 26,
        DType::I64 => 27,
        DType::F64 => 28,
        DType::BF16 => 30,
        DType::TQ1_0 => 34,
        DType::TQ2_0 => 35,
        DType::U8 => return None,
    })
}

/// One tensor's description, as stored in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as GGUF stores them: innermost (fastest-varying) first.
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub ggml_type: u32,
    /// The element type.
    pub dtype: DType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub byte_len: u64,
}

impl TensorInfo {
    /// Dimensions outermost first, as [`u_sdk::TensorInfo`] wants them.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        // Checked during parsing: the product fits in an i64.
        self.dims.iter().product()
    }
}

/// A parsed GGUF file: header, metadata and tensor infos; tensor data is not copied.
#[derive(Clone, Debug)]
pub struct Gguf {
    /// Format version (2 or 3).
    pub version: u32,
    /// Alignment of the data section and of every tensor offset.
    pub alignment: u64,
    /// Metadata, in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the data section in the file.
    pub data_start: u64,
    /// Length of the parsed file.
    pub file_len: u64,
    keys: HashMap<String, usize>,
    names: HashMap<String, usize>,
}

impl Gguf {
    /// Parses the header, metadata and tensor infos of a whole GGUF file held in `bytes`, and
    /// checks that every tensor's data lies inside it.
    pub fn parse(bytes: &[u8]) -> Result<Gguf> {
        let mut r = Reader { buf: bytes, pos: 0 };
        let magic = r.array::<4>("magic")?;
        if magic != MAGIC {
            return Err(Error::BadMagic { found: magic });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            let swapped = version.swap_bytes();
            if (2..=3).contains(&swapped) {
                return Err(Error::BigEndian(swapped));
            }
            return Err(Error::UnsupportedVersion(version));
        }
        let tensor_count = r.u64("tensor count")?;
        let kv_count = r.u64("metadata count")?;
        // A key/value pair takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at
        // least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
        r.check_count("metadata count", kv_count, 13)?;
        r.check_count("tensor count", tensor_count, 24)?;

        let mut metadata = Vec::with_capacity(to_usize(kv_count));
        let mut keys = HashMap::with_capacity(to_usize(kv_count));
        for index in 0..kv_count {
            let mut key = String::new();
            let entry = (|| {
                key = r.utf8("metadata key")?.to_owned();
                let ty = ValueType::from_id(r.u32("metadata value type")?)?;
                r.value(ty, 0)
            })();
            let value = entry.map_err(|source| Error::InMetadata {
                index,
                key: key.clone(),
                source: Box::new(source),
            })?;
            if keys.insert(key.clone(), metadata.len()).is_some() {
                return Err(Error::DuplicateKey(key));
            }
            metadata.push((key, value));
        }

        let alignment = match keys.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_u64().ok_or_else(|| {
                    Error::BadAlignment(format!("must be an unsigned integer, found {v:?}"))
                })?;
                if a == 0 || !a.is_power_of_two() {
                    return Err(Error::BadAlignment(format!("{a} is not a power of two")));
                }
                a
            }
        };

        let mut tensors = Vec::with_capacity(to_usize(tensor_count));
        let mut names = HashMap::with_capacity(to_usize(tensor_count));
        for index in 0..tensor_count {
            let mut name = String::new();
            let info = (|| {
                name = r.utf8("tensor name")?.to_owned();
                r.tensor_info(&name, alignment)
            })();
            let info = info.map_err(|source| Error::InTensorInfo {
                index,
                name: name.clone(),
                source: Box::new(source),
            })?;
            if names.insert(name.clone(), tensors.len()).is_some() {
                return Err(Error::DuplicateTensor(name));
            }
            tensors.push(info);
        }

        let file_len = bytes.len() as u64;
        let data_start = align_up(r.pos as u64, alignment).ok_or(Error::DataSectionPastEnd {
            start: u64::MAX,
            len: file_len,
        })?;
        if !tensors.is_empty() && data_start > file_len {
            return Err(Error::DataSectionPastEnd {
                start: data_start,
                len: file_len,
            });
        }
        let available = file_len.saturating_sub(data_start);
        for t in &tensors {
            let fits = t
                .offset
                .checked_add(t.byte_len)
                .is_some_and(|end| end <= available);
            if !fits {
                return Err(Error::OutOfBounds {
                    name: t.name.clone(),
                    offset: t.offset,
                    byte_len: t.byte_len,
                    available,
                });
            }
        }

        Ok(Gguf {
            version,
            alignment,
            metadata,
            tensors,
            data_start,
            file_len,
            keys,
            names,
        })
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// `general.architecture`, if present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.get(ARCHITECTURE_KEY).and_then(Value::as_str)
    }

    /// The info of a tensor by name.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of tensor `name` inside `file`, which must be the buffer this was parsed from.
    pub fn tensor_data<'a>(&self, file: &'a [u8], name: &str) -> Result<&'a [u8]> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| Error::TensorNotFound(name.to_owned()))?;
        let out_of_bounds = || Error::OutOfBounds {
            name: info.name.clone(),
            offset: info.offset,
            byte_len: info.byte_len,
            available: (file.len() as u64).saturating_sub(self.data_start),
        };
        let start = self
            .data_start
            .checked_add(info.offset)
            .ok_or_else(out_of_bounds)?;
        let end = start.checked_add(info.byte_len).ok_or_else(out_of_bounds)?;
        let start = usize::try_from(start).map_err(|_| out_of_bounds())?;
        let end = usize::try_from(end).map_err(|_| out_of_bounds())?;
        file.get(start..end).ok_or_else(out_of_bounds)
    }
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? & !(alignment - 1))
}

/// A count already checked against the input length always fits in `usize`.
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Truncated {
                what,
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let start = self.pos;
        // `n <= remaining`, so it fits in usize and the range is in bounds.
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_len` bytes each fit in what is left.
    fn check_count(&self, what: &'static str, count: u64, min_len: u64) -> Result<()> {
        let remaining = self.remaining();
        if count.checked_mul(min_len).is_none_or(|n| n > remaining) {
            return Err(Error::CountTooLarge {
                what,
                count,
                remaining,
                offset: self.pos as u64,
            });
        }
        Ok(())
    }

    fn bytes_string(&mut self, what: &'static str) -> Result<&'a [u8]> {
        let len = self.u64(what)?;
        self.check_count(what, len, 1)?;
        self.take(len, what)
    }

    fn utf8(&mut self, what: &'static str) -> Result<&'a str> {
        std::str::from_utf8(self.bytes_string(what)?).map_err(|_| Error::InvalidUtf8(what))
    }

    fn lossy_string(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes_string("string value")?).into_owned())
    }

    fn value(&mut self, ty: ValueType, depth: usize) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>("u8 value")?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array("i8 value")?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("u16 value")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("i16 value")?)),
            ValueType::U32 => Value::U32(self.u32("u32 value")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("i32 value")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("f32 value")?)),
            ValueType::Bool => Value::Bool(bool_from(self.array::<1>("bool value")?[0])?),
            ValueType::Str => Value::Str(self.lossy_string()?),
            ValueType::Array => Value::Array(self.array_value(depth)?),
            ValueType::U64 => Value::U64(self.u64("u64 value")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("i64 value")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("f64 value")?)),
        })
    }

    fn array_value(&mut self, depth: usize) -> Result<Array> {
        if depth >= MAX_ARRAY_NESTING {
            return Err(Error::NestingTooDeep(MAX_ARRAY_NESTING));
        }
        let ty = ValueType::from_id(self.u32("array element type")?)?;
        let count = self.u64("array length")?;
        self.check_count("array length", count, ty.min_encoded_len())?;
        let n = to_usize(count);
        Ok(match ty {
            ValueType::U8 => Array::U8(self.take(count, "u8 array")?.to_vec()),
            ValueType::I8 => Array::I8(self.fixed(n, "i8 array", i8::from_le_bytes)?),
            ValueType::U16 => Array::U16(self.fixed(n, "u16 array", u16::from_le_bytes)?),
            ValueType::I16 => Array::I16(self.fixed(n, "i16 array", i16::from_le_bytes)?),
            ValueType::U32 => Array::U32(self.fixed(n, "u32 array", u32::from_le_bytes)?),
            ValueType::I32 => Array::I32(self.fixed(n, "i32 array", i32::from_le_bytes)?),
            ValueType::F32 => Array::F32(self.fixed(n, "f32 array", f32::from_le_bytes)?),
            ValueType::U64 => Array::U64(self.fixed(n, "u64 array", u64::from_le_bytes)?),
            ValueType::I64 => Array::I64(self.fixed(n, "i64 array", i64::from_le_bytes)?),
            ValueType::F64 => Array::F64(self.fixed(n, "f64 array", f64::from_le_bytes)?),
            ValueType::Bool => Array::Bool(
                self.take(count, "bool array")?
                    .iter()
                    .map(|&b| bool_from(b))
                    .collect::<Result<_>>()?,
            ),
            ValueType::Str => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.lossy_string()?);
                }
                Array::Str(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }

    /// Reads `n` fixed-size little-endian numbers (the count was checked against the input).
    fn fixed<T, const N: usize>(
        &mut self,
        n: usize,
        what: &'static str,
        decode: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let len = (n as u64)
            .checked_mul(N as u64)
            .ok_or(Error::CountTooLarge {
                what,
                count: n as u64,
                remaining: self.remaining(),
                offset: self.pos as u64,
            })?;
        let bytes = self.take(len, what)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                decode(a)
            })
            .collect())
    }

    fn tensor_info(&mut self, name: &str, alignment: u64) -> Result<TensorInfo> {
        let n_dims = self.u32("tensor dimension count")?;
        if n_dims as usize > MAX_DIMS {
            return Err(Error::TooManyDims {
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("tensor dimension")?);
        }
        let ggml_type = self.u32("tensor type")?;
        let offset = self.u64("tensor offset")?;
        let dtype = dtype_from_ggml(ggml_type).map_err(|type_name| Error::UnsupportedType {
            name: name.to_owned(),
            type_id: ggml_type,
            type_name,
        })?;
        let bad_shape = |reason: String| Error::BadShape {
            name: name.to_owned(),
            dims: dims.clone(),
            reason,
        };
        let mut elements: u64 = 1;
        for &d in &dims {
            elements = elements
                .checked_mul(d)
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| bad_shape("has more elements than fit in an i64".into()))?;
        }
        let row = dims.first().copied().unwrap_or(1);
        if row % dtype.block_size() as u64 != 0 {
            return Err(bad_shape(format!(
                "has rows of {row} values, not a multiple of the {dtype} block size {}",
                dtype.block_size()
            )));
        }
        let byte_len = dtype
            .bytes_for(elements)
            .ok_or_else(|| bad_shape(format!("overflows the byte size of {dtype}")))?;
        if offset % alignment != 0 {
            return Err(Error::Misaligned {
                name: name.to_owned(),
                offset,
                alignment,
            });
        }
        Ok(TensorInfo {
            name: name.to_owned(),
            dims,
            ggml_type,
            dtype,
            offset,
            byte_len,
        })
    }
}

fn bool_from(b: u8) -> Result<bool> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(Error::BadBool(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF writer for unit tests.
    pub(crate) struct W(pub Vec<u8>);

    impl W {
        fn header(version: u32, tensors: u64, kvs: u64) -> W {
            let mut w = W(b"GGUF".to_vec());
            w.u32(version).u64(tensors).u64(kvs);
            w
        }
        fn u32(&mut self, v: u32) -> &mut W {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut W {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        fn s(&mut self, v: &str) -> &mut W {
            self.u64(v.len() as u64);
            self.0.extend_from_slice(v.as_bytes());
            self
        }
    }

    #[test]
    fn minimal_file_parses() {
        let mut w = W::header(3, 1, 1);
        w.s("general.architecture").u32(8).s("llama");
        w.s("t").u32(2).u64(4).u64(2).u32(0).u64(0);
        while !w.0.len().is_multiple_of(32) {
            w.0.push(0);
        }
        w.0.extend((0..8u32).flat_map(|i| (i as f32).to_le_bytes()));
        let g = Gguf::parse(&w.0).unwrap();
        assert_eq!(g.architecture(), Some("llama"));
        let t = g.tensor_info("t").unwrap();
        assert_eq!(t.shape(), vec![2, 4]);
        assert_eq!(t.byte_len, 32);
        let data = g.tensor_data(&w.0, "t").unwrap();
        assert_eq!(&data[4..8], &1f32.to_le_bytes());
    }

    #[test]
    fn defects_are_reported() {
        assert!(matches!(
            Gguf::parse(b"GGUX\x03\0\0\0"),
            Err(Error::BadMagic { .. })
        ));
        let w = W::header(1, 0, 0);
        assert_eq!(Gguf::parse(&w.0).unwrap_err(), Error::UnsupportedVersion(1));
        let mut w = W(b"GGUF".to_vec());
        w.0.extend_from_slice(&3u32.to_be_bytes());
        w.u64(0).u64(0);
        assert_eq!(Gguf::parse(&w.0).unwrap_err(), Error::BigEndian(3));
        let w = W::header(3, u64::MAX, 0);
        assert!(matches!(
            Gguf::parse(&w.0).unwrap_err(),
            Error::CountTooLarge { .. }
        ));
        // A string length past the end.
        let mut w = W::header(3, 0, 1);
        w.u64(1 << 40);
        assert!(matches!(
            Gguf::parse(&w.0).unwrap_err().root(),
            Error::CountTooLarge { .. }
        ));
        // An array of u64::MAX u64s.
        let mut w = W::header(3, 0, 1);
        w.s("k").u32(9).u32(10).u64(u64::MAX);
        assert!(matches!(
            Gguf::parse(&w.0).unwrap_err().root(),
            Error::CountTooLarge { .. }
        ));
        // Deeply nested arrays.
        let mut w = W::header(3, 0, 1);
        w.s("k").u32(9);
        for _ in 0..100 {
            w.u32(9).u64(1);
        }
        w.u32(0).u64(0);
        assert_eq!(
            Gguf::parse(&w.0).unwrap_err().root(),
            &Error::NestingTooDeep(MAX_ARRAY_NESTING)
        );
        // Unknown value type.
        let mut w = W::header(3, 0, 1);
        w.s("k").u32(13).u64(0);
        assert_eq!(
            Gguf::parse(&w.0).unwrap_err().root(),
            &Error::UnknownValueType(13)
        );
        // Duplicate key.
        let mut w = W::header(3, 0, 2);
        w.s("k").u32(4).u32(1).s("k").u32(4).u32(1);
        assert_eq!(
            Gguf::parse(&w.0).unwrap_err(),
            Error::DuplicateKey("k".into())
        );
        // Alignment not a power of two.
        let mut w = W::header(3, 0, 1);
        w.s(ALIGNMENT_KEY).u32(4).u32(24);
        assert!(matches!(
            Gguf::parse(&w.0).unwrap_err(),
            Error::BadAlignment(_)
        ));
    }

    #[test]
    fn edge_cases_of_metadata() {
        // Empty arrays keep their element type; strings with invalid UTF-8 are kept lossily.
        let mut w = W::header(2, 0, 3);
        w.s("empty").u32(9).u32(8).u64(0);
        w.s("lossy").u32(8).u64(2);
        w.0.extend_from_slice(b"a\xff");
        w.s("flag").u32(9).u32(7).u64(2);
        w.0.extend_from_slice(&[1, 0]);
        let g = Gguf::parse(&w.0).unwrap();
        assert_eq!(g.version, 2);
        assert_eq!(g.get("empty"), Some(&Value::Array(Array::Str(vec![]))));
        assert_eq!(g.get("lossy"), Some(&Value::Str("a\u{fffd}".into())));
        assert_eq!(
            g.get("flag"),
            Some(&Value::Array(Array::Bool(vec![true, false])))
        );
        assert_eq!(g.architecture(), None);

        let mut w = W::header(3, 0, 1);
        w.s("b").u32(7);
        w.0.push(2);
        assert_eq!(Gguf::parse(&w.0).unwrap_err().root(), &Error::BadBool(2));
        let mut w = W::header(3, 0, 1);
        w.u64(1);
        w.0.push(0xff);
        w.u32(0);
        w.0.push(0);
        let e = Gguf::parse(&w.0).unwrap_err();
        assert_eq!(e.root(), &Error::InvalidUtf8("metadata key"));
        assert!(e.to_string().starts_with("metadata entry #0"), "{e}");
    }

    #[test]
    fn edge_cases_of_tensors() {
        // A scalar (no dims), a tensor with a zero dimension, and a duplicate name.
        let mut w = W::header(3, 2, 0);
        w.s("scalar").u32(0).u32(0).u64(0);
        w.s("empty").u32(2).u64(0).u64(5).u32(0).u64(32);
        while !w.0.len().is_multiple_of(32) {
            w.0.push(0);
        }
        w.0.resize(w.0.len() + 32, 0);
        let g = Gguf::parse(&w.0).unwrap();
        assert_eq!(g.tensor_info("scalar").unwrap().shape(), Vec::<u64>::new());
        assert_eq!(g.tensor_info("scalar").unwrap().byte_len, 4);
        assert_eq!(g.tensor_info("empty").unwrap().byte_len, 0);
        assert_eq!(g.tensor_data(&w.0, "empty").unwrap(), &[] as &[u8]);
        assert_eq!(
            g.tensor_data(&w.0, "nope").unwrap_err(),
            Error::TensorNotFound("nope".into())
        );

        let mut w = W::header(3, 2, 0);
        w.s("t").u32(1).u64(1).u32(0).u64(0);
        w.s("t").u32(1).u64(1).u32(0).u64(32);
        w.0.resize(160, 0);
        assert_eq!(
            Gguf::parse(&w.0).unwrap_err(),
            Error::DuplicateTensor("t".into())
        );
        // No tensors: the data section may be absent.
        let w = W::header(3, 0, 0);
        assert!(Gguf::parse(&w.0).is_ok());
    }

    #[test]
    fn tensor_defects_are_reported() {
        let tensor = |dims: &[u64], ty: u32, offset: u64, data: usize| {
            let mut w = W::header(3, 1, 0);
            w.s("w").u32(dims.len() as u32);
            for &d in dims {
                w.u64(d);
            }
            w.u32(ty).u64(offset);
            while !w.0.len().is_multiple_of(32) {
                w.0.push(0);
            }
            w.0.resize(w.0.len() + data, 0);
            Gguf::parse(&w.0)
        };
        assert!(tensor(&[32, 2], 2, 0, 36).is_ok());
        let e = tensor(&[32, 2], 20, 0, 36).unwrap_err();
        assert_eq!(e.kind(), u_sdk::ErrorKind::Unsupported);
        assert!(e.to_string().contains("\"w\""), "{e}");
        assert!(e.to_string().contains("ggml type 20 (IQ4_NL)"), "{e}");
        let e = tensor(&[32, 2], 99, 0, 36).unwrap_err();
        assert!(e.to_string().contains("ggml type 99 (unknown)"), "{e}");
        assert!(matches!(
            tensor(&[31, 2], 2, 0, 36).unwrap_err().root(),
            Error::BadShape { .. }
        ));
        assert!(matches!(
            tensor(&[1 << 32, 1 << 32], 0, 0, 0).unwrap_err().root(),
            Error::BadShape { .. }
        ));
        assert!(matches!(
            tensor(&[1 << 62], 0, 0, 0).unwrap_err().root(),
            Error::BadShape { .. }
        ));
        assert!(matches!(
            tensor(&[32, 2], 2, 0, 35).unwrap_err(),
            Error::OutOfBounds { .. }
        ));
        assert!(matches!(
            tensor(&[32, 2], 2, u64::MAX - 31, 36).unwrap_err(),
            Error::OutOfBounds { .. }
        ));
        assert!(matches!(
            tensor(&[32, 2], 2, 4, 40).unwrap_err().root(),
            Error::Misaligned { .. }
        ));
        assert!(matches!(
            tensor(&[1, 1, 1, 1, 1], 0, 0, 4).unwrap_err().root(),
            Error::TooManyDims { .. }
        ));
    }
}
