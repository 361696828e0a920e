//! Opening a large GGUF file copies nothing: resident memory grows only with what is read.

#[path = "support/sparse_gguf.rs"]
mod sparse_gguf;

use u_sdk::WeightSet;

const MB: u64 = 1 << 20;

#[test]
fn opening_two_gigabytes_maps_them_without_reading() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.gguf");
    // 32 tensors of 4096 × 4096 f32 = 2 GiB of tensor data.
    let size = sparse_gguf::write(&path, 32, 4096, 4096).unwrap();
    assert!(size > 2048 * MB);

    let before = sparse_gguf::resident_bytes();
    let weights = u_loader_gguf::open_path(&path).unwrap();
    let opened = sparse_gguf::resident_bytes();
    assert_eq!(weights.tensors().unwrap().len(), 32);
    assert!(
        opened.saturating_sub(before) < 16 * MB,
        "opening grew resident memory by {} MiB",
        (opened - before) / MB
    );

    // Reading one 64 MiB tensor makes about that much resident, not the whole file.
    let view = weights.tensor("blk.7.ffn_up.weight".into()).unwrap();
    assert_eq!(view.data.len() as u64, 64 * MB);
    let checksum: u64 = view.data.iter().step_by(4096).map(|&b| u64::from(b)).sum();
    assert_eq!(checksum, 0);
    let read = sparse_gguf::resident_bytes();
    let grown = read.saturating_sub(before);
    assert!(
        (48 * MB..128 * MB).contains(&grown),
        "reading one 64 MiB tensor grew resident memory by {} MiB",
        grown / MB
    );
}
