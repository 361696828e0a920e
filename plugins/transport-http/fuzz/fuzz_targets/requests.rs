//! Fuzzes every request-body parser of the transport (OpenAI chat and completions, Anthropic
//! messages, Safebox, SGLang's `/generate`, checkpoint commands, image generations), the HMAC
//! verifier (one secret and named keys), the API-key file and the plugin configuration: any
//! bytes must give `Ok` or a 4xx `ApiError` (or a configuration error), never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_sdk::CheckpointOp;
use u_transport_http::{
    Config, access, anthropic, checkpoints,
    error::Dialect,
    generations,
    openai::{self, Endpoint},
    safebox::{self, Secrets, Signed, Verifier},
    sglang,
};

fuzz_target!(|data: &[u8]| {
    let models = ["tiny".to_string()];
    let check = |e: u_transport_http::error::ApiError| {
        assert!((400..500).contains(&e.status), "{e:?}");
        for d in [Dialect::OpenAi, Dialect::Anthropic, Dialect::Safebox] {
            let _ = e.body(d);
        }
    };
    for endpoint in [Endpoint::Chat, Endpoint::Completions] {
        if let Err(e) = openai::parse(endpoint, data, &models, 16) {
            check(e);
        }
    }
    if let Err(e) = anthropic::parse(data, &models) {
        check(e);
    }
    if let Err(e) = safebox::parse(data, &models, 16) {
        check(e);
    }
    if let Err(e) = sglang::parse(data, &models) {
        check(e);
    }
    if let Err(e) = generations::parse(data, &models) {
        check(e);
    }
    for op in [CheckpointOp::Save, CheckpointOp::Fork, CheckpointOp::Graft] {
        if let Err(e) = checkpoints::parse(op, data, &models) {
            check(e);
        }
    }
    // Header values cut from the input: the verifier refuses, never panics.
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(4, '\n');
    let (ts, nonce, sig, id) = (parts.next(), parts.next(), parts.next(), parts.next());
    let one = Secrets::One(b"fuzzing-secret-0123456789".to_vec());
    let named = Secrets::Named(vec![("app".into(), b"fuzzing-secret-0123456789".to_vec())]);
    for (secrets, key_id) in [(one, None), (named, id)] {
        let v = Verifier::new(secrets, 300).expect("long secret");
        let signed = Signed {
            timestamp: ts,
            nonce,
            signature: sig,
            key_id,
        };
        if let Err(e) = v.check("POST", safebox::PATH, &signed, data, 1_000) {
            check(e);
        }
    }
    let _ = access::Keys::parse(&text);
    let _ = Config::parse(&text);
});
