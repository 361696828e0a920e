//! The byte layout of the messages between the host and a worker: little-endian integers,
//! length-prefixed strings and lists. Hand-written rather than derived, because the host's size
//! budget is tight and floats must cross bit for bit.
//!
//! A reader never trusts a length: every count is checked against the bytes left before
//! anything is allocated for it, and every failure is an error naming what was malformed.

use u_sdk::{DType, ErrorKind, MetaValue, TensorInfo, UError};

/// Appends values to a message.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

/// Reads values from a received message.
pub struct Reader<'a> {
    rest: &'a [u8],
}

/// A value that crosses between host and worker.
pub trait Wire: Sized {
    /// Appends `self`.
    fn put(&self, w: &mut Writer);
    /// Reads one value.
    fn get(r: &mut Reader<'_>) -> Result<Self, String>;
}

impl Writer {
    /// Appends a byte.
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }

    /// Appends a `u64`.
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// Appends length-prefixed bytes.
    pub fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    /// Appends a length-prefixed UTF-8 string.
    pub fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }

    /// Appends a count, then each item.
    pub fn list<T>(&mut self, items: &[T], mut put: impl FnMut(&mut Self, &T)) {
        self.u64(items.len() as u64);
        for item in items {
            put(self, item);
        }
    }
}

impl<'a> Reader<'a> {
    /// Reads from `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        if n > self.rest.len() as u64 {
            return Err(format!("{n} bytes wanted, {} left", self.rest.len()));
        }
        let (head, rest) = self.rest.split_at(n as usize);
        self.rest = rest;
        Ok(head)
    }

    /// Reads a byte.
    pub fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    /// Reads a `u64`.
    pub fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().map_err(|_| "short u64")?))
    }

    /// Reads length-prefixed bytes.
    pub fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u64()?;
        self.take(n)
    }

    /// Reads a length-prefixed UTF-8 string.
    pub fn str(&mut self) -> Result<String, String> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| "a string is not UTF-8".to_string())
    }

    /// Reads a count of items that take at least `min_bytes` each, then each item.
    pub fn list<T>(
        &mut self,
        min_bytes: u64,
        mut get: impl FnMut(&mut Self) -> Result<T, String>,
    ) -> Result<Vec<T>, String> {
        let n = self.u64()?;
        if n.saturating_mul(min_bytes) > self.rest.len() as u64 {
            return Err(format!("a list of {n} items is longer than the message"));
        }
        (0..n).map(|_| get(self)).collect()
    }

    /// Fails unless every byte was read.
    pub fn finish(self) -> Result<(), String> {
        match self.rest.len() {
            0 => Ok(()),
            n => Err(format!("{n} bytes left over")),
        }
    }
}

impl Wire for DType {
    fn put(&self, w: &mut Writer) {
        w.u8(DType::ALL.iter().position(|d| d == self).unwrap_or(0) as u8);
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        let i = r.u8()?;
        DType::ALL
            .get(i as usize)
            .copied()
            .ok_or_else(|| format!("unknown dtype {i}"))
    }
}

impl Wire for TensorInfo {
    fn put(&self, w: &mut Writer) {
        w.str(&self.name);
        self.dtype.put(w);
        w.list(&self.shape, |w, d| w.u64(*d));
        w.u64(self.byte_len);
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        Ok(TensorInfo {
            name: r.str()?.into(),
            dtype: DType::get(r)?,
            shape: r.list(8, Reader::u64)?.into(),
            byte_len: r.u64()?,
        })
    }
}

impl Wire for MetaValue {
    fn put(&self, w: &mut Writer) {
        match self {
            MetaValue::Bool(v) => {
                w.u8(0);
                w.u8(*v as u8);
            }
            MetaValue::Int(v) => {
                w.u8(1);
                w.u64(*v as u64);
            }
            MetaValue::UInt(v) => {
                w.u8(2);
                w.u64(*v);
            }
            MetaValue::Float(v) => {
                w.u8(3);
                w.u64(v.to_bits());
            }
            MetaValue::Str(v) => {
                w.u8(4);
                w.str(v);
            }
            MetaValue::IntArray(v) => {
                w.u8(5);
                w.list(v, |w, x| w.u64(*x as u64));
            }
            MetaValue::UIntArray(v) => {
                w.u8(6);
                w.list(v, |w, x| w.u64(*x));
            }
            MetaValue::FloatArray(v) => {
                w.u8(7);
                w.list(v, |w, x| w.u64(x.to_bits()));
            }
            MetaValue::BoolArray(v) => {
                w.u8(8);
                w.list(v, |w, x| w.u8(*x as u8));
            }
            MetaValue::StrArray(v) => {
                w.u8(9);
                w.list(v, |w, x| w.str(x));
            }
            MetaValue::Json(v) => {
                w.u8(10);
                w.str(v);
            }
        }
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        Ok(match r.u8()? {
            0 => MetaValue::Bool(r.u8()? != 0),
            1 => MetaValue::Int(r.u64()? as i64),
            2 => MetaValue::UInt(r.u64()?),
            3 => MetaValue::Float(f64::from_bits(r.u64()?)),
            4 => MetaValue::Str(r.str()?.into()),
            5 => MetaValue::IntArray(r.list(8, |r| Ok(r.u64()? as i64))?.into()),
            6 => MetaValue::UIntArray(r.list(8, Reader::u64)?.into()),
            7 => MetaValue::FloatArray(r.list(8, |r| Ok(f64::from_bits(r.u64()?)))?.into()),
            8 => MetaValue::BoolArray(r.list(1, |r| Ok(r.u8()? != 0))?.into()),
            9 => MetaValue::StrArray(r.list(8, |r| Ok(r.str()?.into()))?.into()),
            10 => MetaValue::Json(r.str()?.into()),
            tag => return Err(format!("unknown metadata type {tag}")),
        })
    }
}

impl Wire for UError {
    fn put(&self, w: &mut Writer) {
        w.u8(self.kind as u8);
        w.str(&self.message);
    }

    fn get(r: &mut Reader<'_>) -> Result<Self, String> {
        let kind = ErrorKind::ALL.get(r.u8()? as usize).copied();
        Ok(UError::new(kind.unwrap_or(ErrorKind::Internal), r.str()?))
    }
}

/// Encodes one value as a whole message.
pub fn encode(value: &impl Wire) -> Vec<u8> {
    let mut w = Writer::default();
    value.put(&mut w);
    w.0
}

/// Decodes a whole message as one value; trailing bytes are an error.
pub fn decode<T: Wire>(bytes: &[u8]) -> Result<T, String> {
    let mut r = Reader::new(bytes);
    let value = T::get(&mut r)?;
    r.finish()?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metadata_type_crosses_bit_for_bit() {
        let values = [
            MetaValue::Bool(true),
            MetaValue::Int(-7),
            MetaValue::UInt(u64::MAX),
            MetaValue::Float(f64::from_bits(0x3ee4_f8b5_88e3_68f1)),
            MetaValue::Float(f64::NAN),
            MetaValue::Str("ünïcode".into()),
            MetaValue::IntArray(vec![-1, 0, i64::MIN].into()),
            MetaValue::UIntArray(vec![1, 2].into()),
            MetaValue::FloatArray(vec![0.1, -0.0].into()),
            MetaValue::BoolArray(vec![true, false].into()),
            MetaValue::StrArray(vec!["<s>".into(), String::new().into()].into()),
            MetaValue::Json("[[1,2]]".into()),
        ];
        for v in values {
            let back: MetaValue = decode(&encode(&v)).unwrap();
            assert_eq!(encode(&back), encode(&v), "{v:?}");
        }
        let t = TensorInfo {
            name: "blk.0.attn_q.weight".into(),
            dtype: DType::Q6_K,
            shape: vec![576, 576].into(),
            byte_len: 272_160,
        };
        assert_eq!(decode::<TensorInfo>(&encode(&t)).unwrap(), t);
        for kind in ErrorKind::ALL {
            let e = UError::new(kind, "why");
            assert_eq!(decode::<UError>(&encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn malformed_messages_are_errors_not_allocations() {
        let mut w = Writer::default();
        w.u8(9);
        w.u64(u64::MAX);
        assert!(
            decode::<MetaValue>(&w.0)
                .unwrap_err()
                .contains("longer than")
        );
        assert!(decode::<MetaValue>(&[4, 200, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(decode::<MetaValue>(&[11]).unwrap_err().contains("unknown"));
        assert!(
            decode::<MetaValue>(&[0, 1, 0])
                .unwrap_err()
                .contains("left over")
        );
        assert!(decode::<DType>(&[200]).is_err());
        let mut w = Writer::default();
        w.str("");
        w.u8(0);
        w.u64(0);
        assert_eq!(w.0.len(), 17, "a tensor without its byte length");
        assert!(decode::<TensorInfo>(&w.0).is_err());
    }
}
