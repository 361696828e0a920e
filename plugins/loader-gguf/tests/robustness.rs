//! Malformed input gets an error, never a panic, an out-of-bounds read or a huge allocation:
//! every truncation of the fixtures, single-byte flips of their headers, and seeded random
//! corruptions. A counting allocator checks that no single allocation made while parsing exceeds
//! a small multiple of the input's size.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    path::Path,
};
use u_loader_gguf::{Gguf, dequantize_to_vec, plugin::meta_value};

struct Counting;

thread_local! {
    /// The largest allocation made by this thread since the last reset.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only records sizes in a const thread-local.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(layout.size())));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = LARGEST.try_with(|l| l.set(l.get().max(new_size)));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gguf")
            .join(name),
    )
    .unwrap()
}

/// Parses `bytes`, checks the allocation bound, and on success touches every tensor and value.
fn exercise(bytes: &[u8]) -> Result<(), String> {
    LARGEST.with(|l| l.set(0));
    let parsed = Gguf::parse(bytes);
    let largest = LARGEST.with(Cell::get);
    let bound = 8 * bytes.len() + 4096;
    assert!(
        largest <= bound,
        "parsing {} bytes allocated {largest} bytes at once (bound {bound})",
        bytes.len()
    );
    let g = parsed.map_err(|e| {
        let msg = e.to_string();
        assert!(!msg.is_empty());
        msg
    })?;
    for (_, v) in &g.metadata {
        let _ = meta_value(v);
    }
    for t in &g.tensors {
        let data = g
            .tensor_data(bytes, &t.name)
            .expect("parse checked the bounds");
        assert_eq!(data.len() as u64, t.byte_len);
        let values = dequantize_to_vec(t.dtype, data).expect("parse checked the size");
        assert_eq!(values.len() as u64, t.elements());
    }
    Ok(())
}

/// The end of the last tensor's data: every shorter prefix must fail, every longer one parse.
fn required_len(bytes: &[u8]) -> usize {
    let g = Gguf::parse(bytes).unwrap();
    g.tensors
        .iter()
        .map(|t| (g.data_start + t.offset + t.byte_len) as usize)
        .max()
        .unwrap_or(g.data_start as usize)
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    for name in ["quants.gguf", "metadata.gguf"] {
        let bytes = fixture(name);
        let need = required_len(&bytes);
        assert!(need <= bytes.len());
        for len in 0..=bytes.len() {
            let r = exercise(&bytes[..len]);
            assert_eq!(r.is_ok(), len >= need, "{name} truncated to {len}: {r:?}");
        }
    }
}

#[test]
fn byte_flips_in_the_header_never_panic() {
    for name in ["quants.gguf", "metadata.gguf"] {
        let bytes = fixture(name);
        let header_end = Gguf::parse(&bytes).unwrap().data_start as usize;
        let mut errors = 0;
        for i in 0..header_end {
            for mask in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= mask;
                errors += usize::from(exercise(&b).is_err());
            }
        }
        assert!(
            errors > header_end,
            "{name}: only {errors} of the flips were rejected"
        );
    }
}

#[test]
fn random_corruptions_never_panic() {
    // xorshift64*, fixed seed.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let interesting: [u64; 8] = [
        0,
        1,
        0xff,
        0xffff_ffff,
        u64::MAX,
        u64::MAX / 2,
        1 << 32,
        1 << 62,
    ];
    for name in ["quants.gguf", "metadata.gguf"] {
        let bytes = fixture(name);
        let header_end = Gguf::parse(&bytes).unwrap().data_start as usize;
        for _ in 0..3000 {
            let mut b = bytes.clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() % header_end as u64) as usize;
                let v = interesting[(next() % interesting.len() as u64) as usize];
                let width = [1usize, 4, 8][(next() % 3) as usize];
                let end = (at + width).min(b.len());
                b[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            }
            if next() % 4 == 0 {
                let cut = (next() % b.len() as u64) as usize;
                b.truncate(cut);
            }
            let _ = exercise(&b);
        }
    }
}

#[test]
fn hostile_headers_are_rejected_cheaply() {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    b.extend_from_slice(&u64::MAX.to_le_bytes());
    let e = exercise(&b).unwrap_err();
    assert!(e.contains("cannot fit"), "{e}");
    for len in 0..b.len() {
        assert!(exercise(&b[..len]).is_err());
    }
    assert!(exercise(b"").unwrap_err().contains("truncated"));
    assert!(
        exercise(b"GGML\x03\0\0\0")
            .unwrap_err()
            .contains("not a GGUF file")
    );
}
