//! An ONNX `ModelProto` from arbitrary bytes: protobuf decoding, initializer validation, typed
//! field conversion and naming must never panic; every tensor must have its declared size.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_loader_onnx::OnnxModel;

fuzz_target!(|data: &[u8]| {
    if let Ok(model) = OnnxModel::from_bytes(data.to_vec(), None) {
        for t in model.tensors() {
            let want = t.dtype.bytes_for(t.shape.iter().product());
            assert_eq!(Some(t.bytes().len() as u64), want);
            let _ = model.tensor_f32(&t.name);
        }
    }
});
