//! Writes large GGUF files cheaply for the zero-copy test and the load benchmark: a real header
//! with `tensors` F32 tensors of `rows × cols`, and a data region that is a sparse hole (the file
//! system stores no bytes for it; reading it yields zeros).

use std::{fs::File, io::Write, path::Path};

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Creates the file and returns its size in bytes.
pub fn write(path: &Path, tensors: usize, rows: u64, cols: u64) -> std::io::Result<u64> {
    const ALIGN: u64 = 32;
    let mut h = Vec::new();
    h.extend_from_slice(b"GGUF");
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(tensors as u64).to_le_bytes());
    h.extend_from_slice(&2u64.to_le_bytes());
    string(&mut h, "general.architecture");
    h.extend_from_slice(&8u32.to_le_bytes());
    string(&mut h, "bench");
    string(&mut h, "general.alignment");
    h.extend_from_slice(&4u32.to_le_bytes());
    h.extend_from_slice(&(ALIGN as u32).to_le_bytes());
    let bytes_per = rows * cols * 4;
    for i in 0..tensors {
        string(&mut h, &format!("blk.{i}.ffn_up.weight"));
        h.extend_from_slice(&2u32.to_le_bytes());
        h.extend_from_slice(&cols.to_le_bytes());
        h.extend_from_slice(&rows.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&(i as u64 * bytes_per).to_le_bytes());
    }
    while !(h.len() as u64).is_multiple_of(ALIGN) {
        h.push(0);
    }
    let total = h.len() as u64 + tensors as u64 * bytes_per;
    let mut f = File::create(path)?;
    f.write_all(&h)?;
    f.set_len(total)?;
    Ok(total)
}

/// Resident memory of this process, in bytes (from `/proc/self/statm`).
pub fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no memory-safety preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}
