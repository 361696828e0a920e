//! A whole `model.bin` from arbitrary bytes: parsing, the aligned copy, views, scalar metadata
//! and f32 conversion must never panic; the model accepts exactly what the parser accepts, and
//! every view has its declared length, is 16-byte aligned and holds the bytes the file stores.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_loader_ctranslate2::{ALIGN, CTranslate2Model, model_bin};

fuzz_target!(|data: &[u8]| {
    let _ = model_bin::sniff_head(data);
    let parsed = model_bin::parse(data);
    let Ok(model) = CTranslate2Model::from_bytes(data.to_vec(), None) else {
        assert!(parsed.is_err(), "the model refuses what the parser accepts");
        return;
    };
    let parsed = parsed.expect("the model accepts what the parser refuses");
    for t in model.tensors() {
        let view = model.view(&t.name).expect("listed tensors have views");
        assert_eq!(view.data.len() as u64, t.info().byte_len);
        assert!(
            view.data.as_ptr().addr().is_multiple_of(ALIGN),
            "{} unaligned",
            t.name
        );
        let stored = t.alias_of.as_deref().unwrap_or(&t.name);
        let v = parsed
            .variables
            .iter()
            .find(|v| v.name == stored)
            .expect("every tensor is a variable or an alias of one");
        assert_eq!(view.data.as_slice(), &data[v.range.clone()]);
        let _ = model.tensor_f32(&t.name);
    }
    let scalars = parsed.variables.iter().filter(|v| v.is_scalar()).count();
    let scalar_aliases = parsed
        .aliases
        .iter()
        .filter(|a| parsed.variables[a.variable].is_scalar())
        .count();
    assert_eq!(
        model.tensors().len(),
        parsed.variables.len() + parsed.aliases.len() - scalars - scalar_aliases
    );
});
