//! Training state on disk: named `F32` tensors ([`NamedValues`]) as a safetensors file (an
//! 8-byte little-endian header length, a JSON header of `dtype`, `shape` and `data_offsets`
//! per tensor, then the data), the form checkpoints and trained adapters are written in and
//! PEFT reads. [`decode`] takes any bytes: a file that is not such a file is an error saying
//! why, never a panic.

use u_sdk::{NamedValues, Result, UError};

/// The safetensors bytes of `tensors`, in order (header padded to 8 bytes).
pub fn encode(tensors: &[NamedValues]) -> Result<Vec<u8>> {
    let mut header = String::from("{");
    let mut offset = 0usize;
    for (i, t) in tensors.iter().enumerate() {
        let end = offset + 4 * t.values.len();
        let name = quote(t.name.as_str());
        let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "{name}:{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            dims.join(",")
        ));
        offset = end;
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + offset);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for t in tensors {
        out.extend(t.values.iter().flat_map(|v| v.to_le_bytes()));
    }
    Ok(out)
}

/// `s` as a JSON string.
fn quote(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The `F32` tensors of safetensors `bytes` (`__metadata__` skipped), in header order.
pub fn decode(bytes: &[u8]) -> Result<Vec<NamedValues>> {
    let bad = |why: String| UError::invalid(format!("training state: {why}"));
    let len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| bad("shorter than a safetensors header".into()))?;
    let start = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(8))
        .filter(|&s| s <= bytes.len())
        .ok_or_else(|| bad("the header runs past the end of the file".into()))?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..start])
            .map_err(|e| bad(format!("the header is not a JSON object ({e})")))?;
    let data = &bytes[start..];
    let mut out = Vec::with_capacity(header.len());
    for (name, t) in header {
        if name == "__metadata__" {
            continue;
        }
        if t["dtype"] != "F32" {
            return Err(bad(format!("{name} is not F32")));
        }
        let dims: Vec<u64> = t["shape"]
            .as_array()
            .and_then(|a| a.iter().map(serde_json::Value::as_u64).collect())
            .ok_or_else(|| bad(format!("{name} has no shape")))?;
        let offsets = t["data_offsets"]
            .as_array()
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)))
            .ok_or_else(|| bad(format!("{name} has no data offsets")))?;
        let count = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(|| bad(format!("{name}'s shape overflows")))?;
        let fits = |(a, b): (u64, u64)| {
            let (a, b) = (usize::try_from(a).ok()?, usize::try_from(b).ok()?);
            (a <= b && b <= data.len() && (b - a) as u64 == count).then_some((a, b))
        };
        let (a, b) = fits(offsets)
            .ok_or_else(|| bad(format!("{name}'s data offsets do not fit its shape")))?;
        out.push(NamedValues {
            name: name.into(),
            dims: dims.into(),
            values: data[a..b]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, dims: &[u64], values: &[f32]) -> NamedValues {
        NamedValues {
            name: name.into(),
            dims: dims.to_vec().into(),
            values: values.to_vec().into(),
        }
    }

    #[test]
    fn state_round_trips_and_damaged_files_are_refused() {
        let t = vec![
            tensor(
                "a \"quoted\" name",
                &[2, 3],
                &[0.5, -1.0, 2.0, 3.5, 0.0, 1e-7],
            ),
            tensor("step", &[1], &[7.0]),
        ];
        let bytes = encode(&t).unwrap();
        assert!((u64::from_le_bytes(bytes[..8].try_into().unwrap())).is_multiple_of(8));
        let mut back = decode(&bytes).unwrap();
        back.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(back, t);
        for cut in [0, 3, 20, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut f16 = bytes.clone();
        let at = f16.windows(5).position(|w| w == b"\"F32\"").unwrap();
        f16[at + 1..at + 4].copy_from_slice(b"F16");
        let e = decode(&f16).unwrap_err();
        assert!(e.message.contains("is not F32"), "{}", e.message);
    }
}
