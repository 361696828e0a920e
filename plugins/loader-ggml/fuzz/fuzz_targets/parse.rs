//! A whole whisper.cpp GGML file from arbitrary bytes: parsing, the aligned copy, views and
//! f32 conversion never panic, and every view has its declared length and is 16-byte aligned.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use u_loader_ggml::{GgmlModel, model::ALIGN};

fuzz_target!(|data: &[u8]| {
    let Ok(model) = GgmlModel::parse(Arc::new(data.to_vec())) else {
        return;
    };
    for t in model.tensors() {
        let view = model.view(&t.name).expect("listed tensors have views");
        assert_eq!(view.data.len() as u64, t.info().byte_len);
        assert!(view.data.as_ptr().addr().is_multiple_of(ALIGN), "{} unaligned", t.name);
        let _ = u_sdk::quant::dequantize_view(&view);
    }
});
