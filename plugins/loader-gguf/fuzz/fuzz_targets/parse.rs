//! Fuzzes the GGUF parser: any input must give `Ok` or `Err`, never a panic, an out-of-bounds
//! access or a runaway allocation; a file that parses must have every tensor readable and
//! dequantizable and every metadata value convertible to the ABI form.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_loader_gguf::{Gguf, dequantize_to_vec, plugin::meta_value};

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else {
        return;
    };
    for (_, v) in &g.metadata {
        let _ = meta_value(v);
    }
    for t in &g.tensors {
        let bytes = g.tensor_data(data, &t.name).expect("parse checked the bounds");
        let values = dequantize_to_vec(t.dtype, bytes).expect("parse checked the size");
        assert_eq!(values.len() as u64, t.elements());
    }
});
