//! Fuzzes vocabulary metadata: any GGUF file the loader's parser accepts must give a
//! tokenizer or a clear error (never a panic), and a tokenizer built from it must encode and
//! decode a short text without a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;
use u_loader_gguf::{Gguf, plugin::meta_value};
use u_tokenizer::Tok;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else {
        return;
    };
    let meta: HashMap<String, u_sdk::MetaValue> = g
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), meta_value(v)))
        .collect();
    let Ok(tok) = Tok::from_meta(&meta) else {
        return;
    };
    for text in ["Hello world 123 <|im_start|>", "", "  \n\t é 中文 😀"] {
        if let Ok(ids) = tok.encode_with(text, true, true) {
            let _ = tok.decode(&ids, false);
        }
    }
});
