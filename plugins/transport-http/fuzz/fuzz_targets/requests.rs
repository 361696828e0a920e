//! Fuzzes every request-body parser of the transport (OpenAI chat and completions, Anthropic
//! messages, Safebox, checkpoint commands) and the HMAC verifier: any bytes must give `Ok` or a
//! 4xx `ApiError`, never a panic; whatever parses must render its error and reply shapes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use u_sdk::CheckpointOp;
use u_transport_http::{
    anthropic, checkpoints,
    error::Dialect,
    openai::{self, Endpoint},
    safebox::{self, Signed, Verifier},
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
    for op in [CheckpointOp::Save, CheckpointOp::Fork, CheckpointOp::Graft] {
        if let Err(e) = checkpoints::parse(op, data, &models) {
            check(e);
        }
    }
    // Header values cut from the input: the verifier refuses, never panics.
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\n');
    let (ts, nonce, sig) = (parts.next(), parts.next(), parts.next());
    let v = Verifier::new(b"fuzzing-secret-0123456789".to_vec(), 300).expect("long secret");
    let signed = Signed {
        timestamp: ts,
        nonce,
        signature: sig,
    };
    if let Err(e) = v.check("POST", safebox::PATH, &signed, data, 1_000) {
        check(e);
    }
});
