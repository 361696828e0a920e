//! A whole safetensors file from arbitrary bytes: header validation, names, views
//! and f32 conversion must never panic, and every view must have its declared length.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_loader_safetensors::SafetensorsModel;

fuzz_target!(|data: &[u8]| {
    if let Ok(model) = SafetensorsModel::from_bytes(data.to_vec(), None) {
        for t in model.tensors() {
            let view = model.view(&t.name).expect("listed tensors have views");
            assert_eq!(view.data.len() as u64, t.info().byte_len);
            let _ = model.tensor_f32(&t.name);
        }
    }
});
