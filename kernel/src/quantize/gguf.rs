//! A GGUF v3 writer: the header, metadata and tensor infos first (offsets known from the
//! tensors' types and shapes), then each tensor's bytes padded to [`ALIGNMENT`].

use std::io::{self, Write};
use u_sdk::{DType, MetaValue};

/// The data alignment written (llama.cpp's `GGUF_DEFAULT_ALIGNMENT`).
pub const ALIGNMENT: u64 = 32;

/// ggml's type id of `dtype`.
pub fn ggml_type(dtype: DType) -> Option<u32> {
    use DType::*;
    Some(match dtype {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q5_0 => 6,
        Q5_1 => 7,
        Q8_0 => 8,
        Q8_1 => 9,
        Q2_K => 10,
        Q3_K => 11,
        Q4_K => 12,
        Q5_K => 13,
        Q6_K => 14,
        Q8_K => 15,
        I8 => 24,
        I16 => 25,
        I32 => 26,
        I64 => 27,
        F64 => 28,
        BF16 => 30,
        TQ1_0 => 34,
        TQ2_0 => 35,
        U8 => return None,
    })
}

/// A tensor's entry in the header.
pub struct TensorEntry {
    /// Its name.
    pub name: String,
    /// Dimensions, outermost first (GGUF stores them innermost first).
    pub dims: Vec<u64>,
    /// The type written.
    pub dtype: DType,
    /// Its size in bytes.
    pub bytes: u64,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends a value's GGUF type and bytes. Integers are written as llama.cpp's converter
/// writes them, `uint32`/`int32` (64-bit when a value does not fit), floats as `float32`;
/// `Err` for nested values (JSON), which have no GGUF form here.
fn value(out: &mut Vec<u8>, v: &MetaValue) -> Result<(), &'static str> {
    const U32: u32 = 4;
    const I32: u32 = 5;
    const F32: u32 = 6;
    const BOOL: u32 = 7;
    const STR: u32 = 8;
    const ARRAY: u32 = 9;
    const U64: u32 = 10;
    const I64: u32 = 11;
    let ty = |out: &mut Vec<u8>, t: u32| out.extend_from_slice(&t.to_le_bytes());
    let array = |out: &mut Vec<u8>, t: u32, n: usize| {
        ty(out, ARRAY);
        ty(out, t);
        out.extend_from_slice(&(n as u64).to_le_bytes());
    };
    let unsigned = |out: &mut Vec<u8>, xs: &[u64], wide: bool| {
        for &x in xs {
            if wide {
                out.extend_from_slice(&x.to_le_bytes());
            } else {
                out.extend_from_slice(&(x as u32).to_le_bytes());
            }
        }
    };
    let signed = |out: &mut Vec<u8>, xs: &[i64], wide: bool| {
        for &x in xs {
            if wide {
                out.extend_from_slice(&x.to_le_bytes());
            } else {
                out.extend_from_slice(&(x as i32).to_le_bytes());
            }
        }
    };
    let u_wide = |xs: &[u64]| xs.iter().any(|&x| x > u64::from(u32::MAX));
    let i_wide = |xs: &[i64]| xs.iter().any(|&x| i32::try_from(x).is_err());
    match v {
        MetaValue::Bool(b) => {
            ty(out, BOOL);
            out.push(u8::from(*b));
        }
        MetaValue::UInt(x) => {
            let wide = u_wide(&[*x]);
            ty(out, if wide { U64 } else { U32 });
            unsigned(out, &[*x], wide);
        }
        MetaValue::Int(x) => {
            let wide = i_wide(&[*x]);
            ty(out, if wide { I64 } else { I32 });
            signed(out, &[*x], wide);
        }
        MetaValue::Float(x) => {
            ty(out, F32);
            out.extend_from_slice(&(*x as f32).to_le_bytes());
        }
        MetaValue::Str(s) => {
            ty(out, STR);
            string(out, s);
        }
        MetaValue::UIntArray(xs) => {
            let wide = u_wide(xs);
            array(out, if wide { U64 } else { U32 }, xs.len());
            unsigned(out, xs, wide);
        }
        MetaValue::IntArray(xs) => {
            let wide = i_wide(xs);
            array(out, if wide { I64 } else { I32 }, xs.len());
            signed(out, xs, wide);
        }
        MetaValue::FloatArray(xs) => {
            array(out, F32, xs.len());
            for &x in xs.iter() {
                out.extend_from_slice(&(x as f32).to_le_bytes());
            }
        }
        MetaValue::BoolArray(xs) => {
            array(out, BOOL, xs.len());
            out.extend(xs.iter().map(|&b| u8::from(b)));
        }
        MetaValue::StrArray(xs) => {
            array(out, STR, xs.len());
            for s in xs.iter() {
                string(out, s);
            }
        }
        MetaValue::Json(_) => return Err("a nested array"),
    }
    Ok(())
}

/// The header: magic, version 3, counts, the key/value pairs, the tensor infos with offsets,
/// padded to [`ALIGNMENT`]. Keys whose values have no GGUF form are left out and returned.
pub fn header(
    metadata: &[(String, MetaValue)],
    tensors: &[TensorEntry],
) -> Result<(Vec<u8>, Vec<String>), String> {
    let mut kv = Vec::new();
    let mut skipped = Vec::new();
    let mut n_kv = 0u64;
    for (key, v) in metadata {
        let mut one = Vec::new();
        string(&mut one, key);
        match value(&mut one, v) {
            Ok(()) => {
                kv.extend_from_slice(&one);
                n_kv += 1;
            }
            Err(why) => skipped.push(format!("{key} ({why})")),
        }
    }
    let mut out = Vec::with_capacity(kv.len() + 64 * tensors.len() + 64);
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&n_kv.to_le_bytes());
    out.extend_from_slice(&kv);
    let mut offset = 0u64;
    for t in tensors {
        let ty = ggml_type(t.dtype)
            .ok_or_else(|| format!("{}: GGUF has no type {}", t.name, t.dtype))?;
        string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in t.dims.iter().rev() {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset += t.bytes.next_multiple_of(ALIGNMENT);
    }
    out.resize((out.len() as u64).next_multiple_of(ALIGNMENT) as usize, 0);
    Ok((out, skipped))
}

/// Writes a tensor's bytes and the zeros that pad them to [`ALIGNMENT`].
pub fn write_padded(out: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    out.write_all(bytes)?;
    let pad = (bytes.len() as u64).next_multiple_of(ALIGNMENT) as usize - bytes.len();
    out.write_all(&[0u8; ALIGNMENT as usize][..pad])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_lays_out_gguf_v3() {
        let meta = vec![
            (
                "general.architecture".to_string(),
                MetaValue::Str("llama".into()),
            ),
            ("llama.block_count".to_string(), MetaValue::UInt(2)),
            ("x.nested".to_string(), MetaValue::Json("[[1]]".into())),
            ("x.ids".to_string(), MetaValue::IntArray(vec![-1, 5].into())),
        ];
        let tensors = vec![
            TensorEntry {
                name: "a".into(),
                dims: vec![2, 32],
                dtype: DType::Q8_0,
                bytes: 68,
            },
            TensorEntry {
                name: "b".into(),
                dims: vec![3],
                dtype: DType::F32,
                bytes: 12,
            },
        ];
        let (h, skipped) = header(&meta, &tensors).unwrap();
        assert_eq!(skipped, ["x.nested (a nested array)"]);
        assert_eq!(&h[..4], b"GGUF");
        assert_eq!(h.len() % 32, 0);
        let u64_at = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().unwrap());
        assert_eq!((u64_at(8), u64_at(16)), (2, 3));
        // Tensor b starts after a's 68 bytes padded to 96; dims are stored innermost first.
        let b = h
            .windows(9)
            .position(|w| w == b"\x01\0\0\0\0\0\0\0b")
            .unwrap()
            + 9;
        assert_eq!(u32::from_le_bytes(h[b..b + 4].try_into().unwrap()), 1);
        assert_eq!(u64_at(b + 4), 3);
        assert_eq!(u64_at(b + 16), 96);
        let a = h
            .windows(9)
            .position(|w| w == b"\x01\0\0\0\0\0\0\0a")
            .unwrap()
            + 9;
        assert_eq!((u64_at(a + 4), u64_at(a + 12)), (32, 2));
        let mut data = Vec::new();
        write_padded(&mut data, &[1; 68]).unwrap();
        assert_eq!(data.len(), 96);
    }
}
