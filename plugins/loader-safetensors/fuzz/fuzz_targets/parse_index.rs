//! The JSON side: `model.safetensors.index.json` and `config.json` → metadata.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = u_loader_safetensors::index::parse(data);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = u_sdk::weights::config_metadata(&v);
    }
});
