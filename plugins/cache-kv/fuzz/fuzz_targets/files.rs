//! Fuzzes the reader of checkpoint (`.ukv`) and prefix-segment (`.ukvp`) files: any input must
//! give `Ok` or `Err`, never a panic, an out-of-bounds read or a runaway allocation.
//!
//! The first byte chooses how the rest is read: bit 0 the file kind (checkpoint or segment);
//! bit 1 makes the header honest — magic, version, length and checksum written for the bytes as
//! they are, since a hostile file can carry a valid checksum and only then does the page table
//! get parsed; bit 2 takes the cache's layout (layers, heads, head size, model id) from the
//! file's own header where it is small enough for a real model, so that the layout checks pass;
//! bit 3 makes the cache int8.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_cache_kv::{FileKind, MAGIC, PREFIX_MAGIC, VERSION, check_file};
use u_sdk::{DType, KvLayout};
use xxhash_rust::xxh3::Xxh3;

const HEADER: usize = 96;

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// Writes the magic, version, length and checksum a writer of `kind` would.
fn make_honest(file: &mut [u8], kind: FileKind) {
    let magic = match kind {
        FileKind::Checkpoint => MAGIC,
        FileKind::Prefix => PREFIX_MAGIC,
    };
    file[..8].copy_from_slice(&magic);
    file[8..12].copy_from_slice(&VERSION.to_le_bytes());
    let len = file.len() as u64;
    file[40..48].copy_from_slice(&len.to_le_bytes());
    let mut h = Xxh3::new();
    h.update(&file[..48]);
    h.update(&[0u8; 16]);
    h.update(&file[64..]);
    file[48..64].copy_from_slice(&h.digest128().to_le_bytes());
}

/// The layout the file's header states, where every dimension is one a real model could have.
fn stated_layout(file: &[u8], dtype: DType) -> Option<KvLayout> {
    let (layers, kv_heads, head_dim) = (u32_at(file, 16), u32_at(file, 20), u32_at(file, 24));
    let model_len = u32_at(file, 80) as usize;
    let sane = (1..=256).contains(&layers)
        && (1..=256).contains(&kv_heads)
        && (1..=1024).contains(&head_dim)
        && HEADER + model_len <= file.len();
    sane.then(|| KvLayout {
        layers,
        kv_heads,
        head_dim,
        dtype,
        model_id: String::from_utf8_lossy(&file[HEADER..HEADER + model_len])
            .into_owned()
            .into(),
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut file = rest.to_vec();
    let kind = if mode & 1 == 0 {
        FileKind::Checkpoint
    } else {
        FileKind::Prefix
    };
    let dtype = if mode & 8 == 0 { DType::F32 } else { DType::I8 };
    if mode & 2 != 0 && file.len() >= HEADER {
        make_honest(&mut file, kind);
    }
    let layout = (mode & 4 != 0 && file.len() >= HEADER)
        .then(|| stated_layout(&file, dtype))
        .flatten()
        .unwrap_or_else(|| KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 16,
            dtype,
            model_id: "model-a".into(),
        });
    if let Ok((tokens, label)) = check_file(&file, kind, layout) {
        assert!(kind == FileKind::Checkpoint || label.len() as u64 == 4 * tokens);
    }
});
