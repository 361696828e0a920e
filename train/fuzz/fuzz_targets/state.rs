//! Fuzzes the training-state reader (`u-runner train --resume` reads checkpoints with it): any
//! bytes give tensors or an error, never a panic; what it reads encodes and reads back the same,
//! bit for bit (NaNs included).
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_sdk::NamedValues;

fn bits(t: &[NamedValues]) -> Vec<(String, Vec<u64>, Vec<u32>)> {
    t.iter()
        .map(|t| {
            (
                t.name.to_string(),
                t.dims.to_vec(),
                t.values.iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    if let Ok(tensors) = u_train::state::decode(data) {
        let again = u_train::state::encode(&tensors).expect("encodes");
        let back = u_train::state::decode(&again).expect("reads back");
        assert_eq!(bits(&back), bits(&tensors));
    }
});
